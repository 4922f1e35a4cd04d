"""Stream migration's arithmetic (services/router/migration.py): the continuation of
a request after k tokens reached the client, what it reports, and what cannot migrate.
The cluster test (tests/cluster/test_cluster_migration.py) kills real workers."""

from __future__ import annotations

import pytest

from pdserve.engine.hashing import hash_blocks
from pdserve.engine.sampler import position_key
from pdserve.services.common.convert import params_from_options
from pdserve.proto.pdserve.v1 import pdserve_pb2 as pb
from pdserve.services.router.events import update_of
from pdserve.services.router.migration import Progress, Sample, continuation, one_sample, rebase, unmigratable
from pdserve.engine.sampling_params import SamplingParams
from pdserve.services.router.records import Request
from pdserve.services.router.validate import Limits, Validator

BLOCK = 16
PROMPT = tuple(range(100, 120))  # 20 tokens: one full block and a partial one
VALIDATOR = Validator(Limits("tiny", vocab_size=4096, max_model_len=256, max_n=4, block_size=BLOCK), None)


def job(**sampling):
    return VALIDATOR.validate(Request(token_ids=PROMPT, sampling=SamplingParams(**sampling), cache_salt="s"))


def delta(tokens, logprobs=(), finish=""):
    """A worker's message with sequence 0's `tokens`, as the router's update."""
    lps = [pb.TokenLogprob(token_id=t, logprob=lp) for t, lp in zip(tokens, logprobs)]
    return update_of(pb.DecodeResponse(deltas=[pb.SequenceDelta(index=0, token_ids=tokens, logprobs=lps,
                                                                finish_reason=finish)]))


def test_the_continuation_prompts_with_what_was_sent_and_asks_for_the_rest():
    original = job(max_tokens=50, min_tokens=10, temperature=0.7, seed=7)
    sent = [1, 2, 3, 4]
    cont = continuation(original, sent, BLOCK)
    assert cont.prompt == PROMPT + (1, 2, 3, 4)
    assert (cont.params.max_tokens, cont.params.min_tokens, cont.params.resumed_tokens) == (46, 6, 4)
    assert (cont.options.max_tokens, cont.options.min_tokens, cont.options.resumed_tokens) == (46, 6, 4)
    # What the worker parses from the options is what the router holds.
    assert params_from_options(cont.options, "s") == cont.params
    # Everything else as asked: the seed, the temperature, the salt, the request id.
    assert (cont.options.seed, cont.options.temperature, cont.params.cache_salt) == (7, 0.7, "s")
    assert (cont.request_id, cont.worker_request_id) == (original.request_id, original.worker_request_id)
    assert cont.block_hashes == tuple(hash_blocks(cont.prompt, BLOCK, cache_salt="s"))
    assert cont.block_hashes[0] == original.block_hashes[0]  # the shared prefix routes to the same cache
    # The original is untouched.
    assert original.prompt == PROMPT and original.options.max_tokens == 50


def test_the_continuation_hashes_only_the_blocks_the_sent_tokens_fill(monkeypatch):
    from pdserve.engine import hashing

    original = job(max_tokens=50)
    calls = []
    real = hashing.hash_block
    monkeypatch.setattr(hashing, "hash_block", lambda *a: calls.append(a) or real(*a))
    cont = continuation(original, list(range(12)), BLOCK)  # 32 tokens: the original's block and one more
    assert len(calls) == 1 and cont.block_hashes[:1] == original.block_hashes
    monkeypatch.undo()
    assert cont.block_hashes == tuple(hash_blocks(cont.prompt, BLOCK, cache_salt="s"))


def test_min_tokens_never_goes_below_zero_and_max_tokens_counts_from_the_default():
    original = job(min_tokens=2)  # max_tokens unset: the engine's default (16)
    cont = continuation(original, list(range(5)), BLOCK)
    assert (cont.params.max_tokens, cont.params.min_tokens) == (original.params.max_tokens - 5, 0)
    with pytest.raises(ValueError, match="nothing to continue"):
        continuation(original, list(range(original.params.max_tokens)), BLOCK)


def test_a_seeded_continuation_draws_the_uniforms_of_the_uninterrupted_run():
    """The sampler keys a seeded draw by the tokens the sequence holds: the continuation's
    first draw (prompt P + k sent tokens) is the uninterrupted run's (k + 1)-th."""
    original = job(max_tokens=50, seed=3, temperature=1.0)
    sent = [5, 6, 7]
    cont = continuation(original, sent, BLOCK)
    uninterrupted = [position_key(3, 0, len(PROMPT) + i) for i in range(10)]
    continued = [position_key(cont.params.seed, 0, len(cont.prompt) + i) for i in range(7)]
    assert continued == uninterrupted[3:]


@pytest.mark.parametrize("sampling, why", [
    (dict(beam_width=2, max_tokens=8), "beam search"),
])
def test_what_cannot_migrate_says_why(sampling, why):
    assert why in unmigratable(job(**sampling))


def test_what_can_migrate():
    assert unmigratable(job(temperature=0.0)) is None
    assert unmigratable(job(seed=1, repetition_penalty=1.3, stop_token_ids=(7,), logprobs=2, prompt_logprobs=1)) is None
    assert unmigratable(job(n=3, temperature=1.0, seed=5)) is None
    assert unmigratable(job(presence_penalty=0.5, frequency_penalty=-0.3)) is None


def test_a_sample_of_n_continues_as_a_request_of_its_own_drawing_as_that_sample():
    """n > 1 migrates sample by sample: sample i of the request becomes an n == 1
    request whose seeded draws are keyed as sample i's (SamplingParams.sample_index)."""
    original = job(n=3, max_tokens=20, temperature=1.0, seed=11)
    one = one_sample(original, 2)
    assert (one.params.n, one.params.sample_index, one.options.n, one.options.sample_index) == (1, 2, 1, 2)
    assert params_from_options(one.options, "s") == one.params  # the worker reads what the router holds
    assert one.worker_request_id == f"{original.worker_request_id}-s2" and one.request_id == original.request_id
    cont = continuation(one, [4, 5], BLOCK)
    assert cont.options.sample_index == 2 and cont.params.max_tokens == 18 and cont.prompt == PROMPT + (4, 5)


def test_progress_counts_what_the_client_has_and_sees_an_ended_sequence():
    progress = Progress(n=2)
    progress.record(delta([1, 2], [-0.5, -0.25]), max_tokens=5)
    progress.record(update_of(pb.DecodeResponse(deltas=[pb.SequenceDelta(index=1, token_ids=[9])])), max_tokens=5)
    assert progress.token_ids == [1, 2] and progress.sample(0).logprob_sum == -0.75
    assert progress.sample(1).token_ids == [9] and progress.sent == 3 and progress.unfinished() == [0, 1]
    progress.record(delta([3], finish="stop"), max_tokens=5)
    assert progress.sample(0).finish_reason == "stop" and progress.unfinished() == [1] and not progress.done
    progress.record(update_of(pb.DecodeResponse(deltas=[pb.SequenceDelta(index=1, token_ids=[8, 7, 6, 5])])),
                    max_tokens=5)
    assert progress.done  # sequence 1 reached max_tokens: only the final message is missing
    final = progress.final_message()
    assert final.finished and [(r.index, r.finish_reason) for r in final.end.results] == [(0, "stop"), (1, "length")]
    assert final.end.results[0].cumulative_logprob == -0.75
    full = Progress()
    full.record(delta([1, 2, 3]), max_tokens=3)
    assert full.sample(0).finish_reason == "length"


def test_progress_knows_when_the_final_message_went_out():
    """Beams stream nothing until the final message: once it is forwarded the request
    is served, and the router does not fail it if the worker then dies (the chaos test)."""
    beams = Progress(n=2)
    beams.record(update_of(pb.DecodeResponse()), max_tokens=5)
    assert not beams.finished and beams.sent == 0
    beams.record(update_of(pb.DecodeResponse(finished=True, results=[pb.SequenceResult(index=0, token_ids=[4, 5]),
                                                                     pb.SequenceResult(index=1, token_ids=[6])])),
                 max_tokens=5)
    assert beams.finished
    beams.record(update_of(pb.DecodeResponse()), max_tokens=5)
    assert beams.finished


def test_rebase_makes_the_final_message_the_uninterrupted_runs():
    original = job(max_tokens=50, prompt_logprobs=1, logprobs=1)
    progress = Progress(samples={0: Sample(token_ids=[1, 2, 3], logprob_sum=-1.5)})
    progress.migrated()
    running = delta([4], [-0.1])
    assert rebase(running, original, progress) == delta([4], [-0.1])  # only the final message changes
    progress.record(running, max_tokens=50)  # the continuation's tokens reach the client too
    assert progress.sample(0).logprob_sum == pytest.approx(-1.6) and progress.sample(0).logprob_base == -1.5
    final = rebase(update_of(pb.DecodeResponse(
        finished=True, results=[pb.SequenceResult(index=0, finish_reason="length", cumulative_logprob=-2.0)],
        num_cached_tokens=len(PROMPT) + 3,
        prompt_logprobs=[pb.PromptTokenLogprob() for _ in range(len(PROMPT) + 3)],
    )), original, progress)
    assert final.end.results[0].cumulative_logprob == -3.5  # the new worker's -2.0 plus the -1.5 sent before it
    assert final.end.num_cached_tokens == len(PROMPT)
    assert len(final.end.prompt_logprobs) == len(PROMPT)
