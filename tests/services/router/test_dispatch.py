"""The dispatcher (services/router/dispatch.py) over fake workers (fake_workers.py):
what reaches the client, and what each worker is asked, without a process. The real
processes: tests/services/test_services_pd.py, tests/cluster/test_cluster_migration.py."""

from __future__ import annotations

import grpc
import pytest

from fake_workers import BUSY, FAIL, PREFILL, FakeRegistry, FakeRpcError, FakeWorker, final, message, refusal, tokens
from pdserve.engine.errors import FailureKind
from pdserve.engine.hashing import hash_blocks
from pdserve.proto.pdserve.v1 import pdserve_pb2 as pb
from pdserve.services.common.deadline import Deadline
from pdserve.services.common.metrics import Disabled
from pdserve.services.common.status import ServeError, Status
from pdserve.services.router.cancel import Cancellation
from pdserve.services.router.config import RouterConfig
from pdserve.services.router.dispatch import Dispatcher
from pdserve.services.router.events import Tokens, update_of
from pdserve.engine.sampling_params import SamplingParams
from pdserve.services.router.records import Request
from pdserve.services.router.validate import Limits, Validator

BLOCK = 16
PROMPT = tuple(range(100, 120))
VALIDATOR = Validator(Limits("tiny", vocab_size=4096, max_model_len=256, max_n=4, block_size=BLOCK), None)
CONFIG = RouterConfig(port=0, local_prefill_threshold=4, admission_timeout=0.0)


def job(**sampling):
    return VALIDATOR.validate(Request(token_ids=PROMPT, sampling=SamplingParams(**sampling)))


def run(registry: FakeRegistry, the_job, config: RouterConfig = CONFIG) -> list:
    cached: list[int] = []
    dispatcher = Dispatcher(registry, config, Disabled())
    updates = list(dispatcher.run(the_job, Deadline.after(30), Cancellation(), cached.append))
    assert registry.booked == 0  # every worker booked was released
    return updates


def sent(updates, index: int = 0) -> list[int]:
    return [t for u in updates for seq in u.tokens if seq.index == index for t in seq.token_ids]


def test_a_local_prefill_forwards_the_workers_messages_as_they_are():
    script = [message(tokens(0, [5, 6], [-0.1, -0.2])), final((0, "length", -0.5), deltas=[tokens(0, [7], [-0.2])])]
    decode = FakeWorker("d1", decode=script)
    updates = run(FakeRegistry([decode]), job(max_tokens=3))
    assert updates == [update_of(m) for m in script]
    (request,) = decode.decodes()
    assert request.local_prefill and tuple(request.token_ids) == PROMPT and not request.HasField("first_token")


def test_the_first_token_travels_once_from_the_prefill_worker():
    """P's first token reaches the client at once; D streams only what it samples
    after it, forwarded unedited; the final cumulative logprob counts both."""
    d_script = [message(tokens(0, [8], [-0.25])), final((0, "length", -0.75), deltas=[tokens(0, [9], [-0.5])])]
    decode = FakeWorker("d1", decode=d_script, kv=True)
    prefill = FakeWorker("p1", role_code=PREFILL, kv=True, first=(7, -0.5))
    updates = run(FakeRegistry([decode], [prefill]), job(max_tokens=3, logprobs=0))
    assert sent(updates) == [7, 8, 9]
    assert updates[0].tokens == (Tokens(0, (7,), updates[0].tokens[0].logprobs, (-0.5,)),)
    assert [e.token_id for e in updates[0].tokens[0].logprobs] == [7]  # asked: the top logprobs, from P
    assert updates[1] == update_of(d_script[0])  # D's own, as it came
    assert updates[2].tokens == update_of(d_script[1]).tokens
    assert updates[2].end.results[0].cumulative_logprob == -0.75 + -0.5  # D's, then P's first token
    reserve, attach = decode.requests
    assert isinstance(reserve, pb.ReserveRequest) and not attach.local_prefill and not attach.HasField("first_token")


def test_a_failed_prefill_worker_is_skipped_with_a_fresh_reservation():
    decode = FakeWorker("d1", decode=[final((0, "length", -1.0), deltas=[tokens(0, [8], [-1.0])])], kv=True)
    dead = FakeWorker("p1", role_code=PREFILL, kv=True)
    alive = FakeWorker("p2", role_code=PREFILL, kv=True, first=(7, -0.5))
    updates = run(FakeRegistry([decode], [dead, alive]), job(max_tokens=2))
    assert sent(updates) == [7, 8]
    reservations = [r.request_id for r in decode.requests if isinstance(r, pb.ReserveRequest)]
    assert len(reservations) == 2 and reservations[0] != reservations[1] and decode.aborted == [reservations[0]]


def test_a_worker_that_fails_before_a_token_is_retried_on_the_next():
    broken = FakeWorker("d1", decode=[FAIL])
    good = FakeWorker("d2", decode=[final((0, "length", -1.0), deltas=[tokens(0, [5], [-1.0])])])
    updates = run(FakeRegistry([broken, good]), job(max_tokens=1))
    assert sent(updates) == [5]
    assert broken.decodes()[0].request_id != good.decodes()[0].request_id  # each attempt has its own id


@pytest.mark.parametrize("failure, status", [(FAIL, Status.UNAVAILABLE), (BUSY, Status.RESOURCE_EXHAUSTED)])
def test_when_every_worker_fails_before_a_token_the_request_fails_naming_them(failure, status):
    workers = [FakeWorker(f"d{i}", decode=[failure]) for i in range(3)]
    with pytest.raises(ServeError) as info:
        run(FakeRegistry(workers), job(max_tokens=1))
    assert info.value.status is status and all(w.worker_id in str(info.value) for w in workers)


def test_a_worker_that_fails_mid_stream_is_migrated_from_what_was_sent():
    first = FakeWorker("d1", decode=[message(tokens(0, [5, 6], [-0.5, -0.25])), FAIL])
    second = FakeWorker("d2", decode=[final((0, "length", -1.0), deltas=[tokens(0, [7, 8], [-0.5, -0.5])],
                                            cached=len(PROMPT) + 2)])
    updates = run(FakeRegistry([first, second]), job(max_tokens=4, temperature=0.0))
    assert sent(updates) == [5, 6, 7, 8]
    (continued,) = second.decodes()
    assert tuple(continued.token_ids) == PROMPT + (5, 6) and continued.sampling.max_tokens == 2
    end = updates[-1].end
    assert end.results[0].cumulative_logprob == -1.0 + -0.75  # the new worker's plus what was sent before
    assert end.num_cached_tokens == len(PROMPT)  # the original prompt's


def test_with_max_migrations_0_a_mid_stream_failure_fails_saying_so():
    first = FakeWorker("d1", decode=[message(tokens(0, [5], [-0.5])), FAIL])
    with pytest.raises(ServeError, match="--max-migrations 0") as info:
        run(FakeRegistry([first, FakeWorker("d2")]), job(max_tokens=4),
            RouterConfig(port=0, max_migrations=0, admission_timeout=0.0))
    assert info.value.status is Status.UNAVAILABLE


def test_a_failure_after_the_last_token_sends_the_final_update_itself():
    """Every sequence ended (max_tokens) before the worker died: no migration, the
    router's own final update from what the client has."""
    first = FakeWorker("d1", decode=[message(tokens(0, [5, 6], [-0.5, -0.25], "length")), FAIL])
    updates = run(FakeRegistry([first, FakeWorker("d2", decode=[FAIL])]), job(max_tokens=2))
    assert sent(updates) == [5, 6]
    assert [(r.index, r.finish_reason, r.cumulative_logprob) for r in updates[-1].end.results] == [(0, "length", -0.75)]


def test_parallel_samples_continue_one_by_one_after_a_mid_stream_failure():
    first = FakeWorker("d1", decode=[message(tokens(0, [5], [-0.5], "stop"), tokens(1, [6], [-0.25])), FAIL])
    second = FakeWorker("d2", decode=[final((0, "length", -1.0), deltas=[tokens(0, [7], [-1.0], "length")])])
    updates = run(FakeRegistry([first, second]), job(n=2, max_tokens=2, temperature=1.0, seed=3))
    assert (sent(updates, 0), sent(updates, 1)) == ([5], [6, 7])
    (continued,) = second.decodes()  # only sample 1 had not ended
    assert tuple(continued.token_ids) == PROMPT + (6,) and continued.sampling.sample_index == 1
    results = updates[-1].end.results
    assert [(r.index, r.finish_reason) for r in results] == [(0, "stop"), (1, "length")]
    assert results[1].cumulative_logprob == -1.0 + -0.25


# -- block hashes: sent with every prompt, a mismatch fails the request ---------------------

def mismatch() -> FakeRpcError:
    """What a worker answers when the router's hashes are not its own (rpc_errors)."""
    return refusal(grpc.StatusCode.FAILED_PRECONDITION,
                   "block_hashes[0]: differs from this worker's hash of the same prompt block: the sender and this "
                   "worker differ in tokenizer, block size (16 here) or cache salt", FailureKind.BLOCK_HASH_MISMATCH)


def assert_clear_mismatch(info: pytest.ExceptionInfo, worker: str) -> None:
    error = info.value
    assert error.status is Status.INTERNAL, error
    assert f"worker {worker} and the router hash the prompt's blocks differently" in error.message
    assert "tokenizer, block size or cache salt" in error.message and "FAILURE_KIND_BLOCK_HASH_MISMATCH" in error.message


def test_every_prompt_a_worker_is_sent_carries_the_jobs_block_hashes():
    the_job = job(max_tokens=2)
    assert the_job.block_hashes == tuple(hash_blocks(PROMPT, BLOCK))  # one full block
    decode = FakeWorker("d1", decode=[final((0, "length", -1.0), deltas=[tokens(0, [8], [-1.0])])], kv=True)
    prefill = FakeWorker("p1", role_code=PREFILL, kv=True, first=(7, -0.5))
    run(FakeRegistry([decode], [prefill]), the_job)
    reserve, attach = decode.requests
    (prefilled,) = prefill.requests
    assert tuple(reserve.block_hashes) == tuple(prefilled.block_hashes) == the_job.block_hashes
    assert not attach.block_hashes  # a reservation's Decode carries no prompt
    local = FakeWorker("d2", decode=[final((0, "length", -1.0), deltas=[tokens(0, [8], [-1.0])])])
    run(FakeRegistry([local]), the_job)
    assert tuple(local.decodes()[0].block_hashes) == the_job.block_hashes


def test_a_continuation_and_a_kv_fallback_carry_their_prompts_hashes():
    sent_first = list(range(5, 17))  # with the prompt's 20 tokens: two full blocks
    first = FakeWorker("d1", decode=[message(tokens(0, sent_first, [-0.5] * 12)), FAIL])
    second = FakeWorker("d2", decode=[final((0, "length", -1.0), deltas=[tokens(0, [9], [-1.0])])])
    run(FakeRegistry([first, second]), job(max_tokens=16, temperature=0.0))
    (continued,) = second.decodes()
    assert len(continued.block_hashes) == 2
    assert tuple(continued.block_hashes) == tuple(hash_blocks(PROMPT + tuple(sent_first), BLOCK))
    # D's KV never comes after P's first token: D prefills the prompt itself.
    long_prompt = tuple(range(100, 132))  # two full blocks
    the_job = VALIDATOR.validate(Request(token_ids=long_prompt, sampling=SamplingParams(max_tokens=4)))
    lost = refusal(grpc.StatusCode.UNAVAILABLE, "KV transfer failed", FailureKind.TRANSFER)
    kv_less = FakeWorker("d3", kv=True)
    scripts = [[lost], [final((0, "length", -1.0), deltas=[tokens(0, [9], [-1.0])])]]  # attach, then fallback
    decode_call = kv_less.stub.Decode

    def next_script(request, timeout=None):
        kv_less.decode = scripts.pop(0)
        return decode_call(request, timeout)

    kv_less.stub.Decode = next_script
    prefill = FakeWorker("p1", role_code=PREFILL, kv=True, first=(7, -0.5))
    assert sent(run(FakeRegistry([kv_less], [prefill]), the_job)) == [7, 9]
    attach, fallback = kv_less.decodes()
    assert fallback.local_prefill and fallback.first_token == 7
    assert not attach.block_hashes and len(fallback.block_hashes) == 2
    assert tuple(fallback.block_hashes) == the_job.block_hashes == tuple(hash_blocks(long_prompt, BLOCK))


def test_a_reserve_that_answers_a_hash_mismatch_fails_the_request_instead_of_prefilling_there():
    decode = FakeWorker("d1", decode=[final((0, "length", -1.0), deltas=[tokens(0, [8], [-1.0])])], kv=True,
                        reserve=mismatch())
    other = FakeWorker("d2", decode=[final((0, "length", -1.0), deltas=[tokens(0, [8], [-1.0])])], kv=True)
    prefill = FakeWorker("p1", role_code=PREFILL, kv=True, first=(7, -0.5))
    with pytest.raises(ServeError) as info:
        run(FakeRegistry([decode, other], [prefill]), job(max_tokens=2))
    assert_clear_mismatch(info, "d1")
    assert not decode.decodes() and not prefill.requests and not other.requests  # no fallback, no retry


def test_any_other_failed_precondition_from_reserve_still_prefills_on_the_decode_worker():
    no_receiver = refusal(grpc.StatusCode.FAILED_PRECONDITION, "Reserve: this worker has no KV receiver")
    decode = FakeWorker("d1", decode=[final((0, "length", -1.0), deltas=[tokens(0, [8], [-1.0])])], kv=True,
                        reserve=no_receiver)
    prefill = FakeWorker("p1", role_code=PREFILL, kv=True, first=(7, -0.5))
    updates = run(FakeRegistry([decode], [prefill]), job(max_tokens=1))
    assert sent(updates) == [8] and decode.decodes()[0].local_prefill and not prefill.requests


def test_a_prefill_or_local_decode_that_answers_a_hash_mismatch_fails_the_request():
    decode = FakeWorker("d1", kv=True)
    prefill = FakeWorker("p1", role_code=PREFILL, kv=True, first=mismatch())
    with pytest.raises(ServeError) as info:
        run(FakeRegistry([decode], [prefill]), job(max_tokens=2))
    assert_clear_mismatch(info, "p1")
    (reserve, attach) = decode.requests
    assert decode.aborted == [reserve.request_id]  # the reservation is freed
    local = FakeWorker("d1", decode=[mismatch()])
    other = FakeWorker("d2", decode=[final((0, "length", -1.0), deltas=[tokens(0, [8], [-1.0])])])
    with pytest.raises(ServeError) as info:
        run(FakeRegistry([local, other]), job(max_tokens=2))
    assert_clear_mismatch(info, "d1")
    assert not other.requests
