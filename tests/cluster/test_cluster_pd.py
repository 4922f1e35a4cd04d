"""The disaggregated path end to end: real processes started by `pdserve up`, KV pages
from prefill workers to decode workers over ZeroMQ tcp, tokens checked against the
engine run in this process (embedded default model).

Two clusters, each started once:
  `pd1`  `pdserve up` as it comes (1 prefill + 1 decode worker, ZeroMQ tcp, local
         prefill threshold 64) but for `--speculative-config` (ngram, K=3), which only
         the decode worker takes: prompts below the threshold prefill on the decode
         worker, the others on the prefill worker (worker Stats tell which), every
         result the spec-off engine's; logprobs, stop strings, a cancelled stream; the
         draft counts in responses, Stats and a live /metrics scrape;
  `pd2`  2 prefill + 2 decode workers, threshold 0 (every prompt crosses), the decode
         workers speculating with the embedded draft model (its KV computed there):
         batches, n=3 and beam search, prefix-aware routing, then faults (a prefill
         worker killed, a decode worker killed mid-stream), then no block left in use.
The ipc and torch.distributed (gloo) connectors run with in-process workers.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from cluster_helpers import Stream, UpProcess, all_blocks_free, metric, stats, wait_for
from engine_helpers import one_thread  # noqa: F401 (an autouse fixture: one torch thread)
from pdserve.engine import LLM, SamplingParams
from pdserve.engine.config import DEFAULT_DRAFT_MODEL
from pdserve.proto.pdserve.v1 import pdserve_pb2 as pb
from pdserve.services.common.credentials import ClusterAuth
from pdserve.services.router.client import Client, collect
from pdserve.services.router.config import RouterConfig
from pdserve.services.router.main import Router
from pdserve.services.worker.config import WorkerConfig
from pdserve.services.node import Worker

pytestmark = pytest.mark.cluster(seconds=50)

MAX_N = 4
THRESHOLD = 64  # the router's default --local-prefill-threshold
K = 3
# measure_payoff off: every eligible step drafts, so the counts these tests pin do not
# depend on the worker's timing of whether drafting pays (tests/engine/spec has those).
NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1, "measure_payoff": False})
DRAFT = json.dumps({"method": "draft_model", "num_speculative_tokens": K, "model": DEFAULT_DRAFT_MODEL})
SPEC_COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_unspeculated_requests")


def code(name: str, lines: int) -> str:
    """A distinct code-like prompt (its first block differs from every other's)."""
    body = "".join(f"    {name}_{k} = compute({k}, '{name}')  # step {k}\n" for k in range(lines))
    return f"def {name}(data):\n{body}"


SHORT = ["for i in range(", "def fib(n):\n", "    def __repr__(self):\n        return "]
LONG = [code("alpha", 12), code("beta", 30), code("gamma", 4)]
PREFIX = code("shared_prefix", 25)  # ~ 400 tokens, shared by several prompts
SHARED = [PREFIX + tail for tail in ("    return alpha\n", "    return beta_1 + beta_2\n", "    yield from data\n")]


@pytest.fixture(scope="module")
def llm():
    return LLM(num_blocks=512)


def greedy(llm: LLM, prompts: list[str], max_tokens: int) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0))]


def run_all(client: Client, prompts: list[str], **sampling) -> list[dict]:
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda p: collect(client.generate(p, **sampling)), prompts))


def workers(up: UpProcess, role: str) -> list[pb.WorkerInfo]:
    return sorted((w for w in up.list_workers() if w.role == role), key=lambda w: w.worker_id)


def counters(infos: list[pb.WorkerInfo], auth: ClusterAuth | None) -> dict[str, pb.StatsResponse]:
    return {w.worker_id: stats(w.address, auth) for w in infos}


def total(snapshot: dict[str, pb.StatsResponse], field: str) -> int:
    return sum(getattr(s, field) for s in snapshot.values())


def every_block_free(infos: list[pb.WorkerInfo], auth: ClusterAuth | None) -> None:
    """Running, waiting, reserved and held (prefill: awaiting an ack) all zero."""
    for w in infos:
        wait_for(lambda: all_blocks_free(w.address, auth), 20, f"{w.worker_id}'s blocks to be free")


# -- pd1: `pdserve up` as it comes -------------------------------------------------------


@pytest.fixture(scope="module")
def pd1(tmp_path_factory):
    up = UpProcess(["--num-blocks", "512", "--max-n", str(MAX_N), "--held-lease", "10", "--speculative-config", NGRAM],
                   tmp_path_factory.mktemp("pd1") / "up.log")
    yield up
    up.stop()


def test_default_topology_is_one_prefill_and_one_decode_worker_moving_kv(pd1):
    (prefill,), (decode,) = workers(pd1, pb.ROLE_PREFILL), workers(pd1, pb.ROLE_DECODE)
    assert len(pd1.list_workers()) == 2
    assert prefill.kv_endpoint and decode.kv_endpoint.startswith("tcp://127.0.0.1:")


def test_conditional_disaggregation_matches_the_engine(pd1, llm):
    """Short prompts prefill on the decode worker, long ones on the prefill worker,
    whose KV crosses to the decode worker; every result is the engine's."""
    prompts = SHORT + LONG
    lengths = {p: len(llm.engine.tokenizer.encode(p)) for p in prompts}
    remote = [p for p in prompts if lengths[p] >= THRESHOLD]
    assert 0 < len(remote) < len(prompts), lengths
    (prefill,), (decode,) = workers(pd1, pb.ROLE_PREFILL), workers(pd1, pb.ROLE_DECODE)
    before = counters([prefill, decode], pd1.auth)
    want = [o.outputs[0] for o in llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0))]
    with Client(pd1.address, timeout=120) as client:
        got = run_all(client, prompts, max_tokens=16, temperature=0.0)
    for prompt, w, g in zip(prompts, want, got):
        (seq,) = g.values()
        assert list(seq.token_ids) == w.token_ids and seq.text == w.text, prompt
        assert seq.cumulative_logprob == pytest.approx(w.cumulative_logprob, abs=1e-4)
        assert seq.usage.prompt_tokens == lengths[prompt] and seq.timing.ttft_seconds > 0

    def settled():  # the prefill worker counts a transfer once the decode worker acked it
        return pd1.stats(prefill.address).kv_transfers - before[prefill.worker_id].kv_transfers == len(remote)

    wait_for(settled, 10, "the prefill worker to see every transfer acknowledged")
    after = counters([prefill, decode], pd1.auth)
    p, d = after[prefill.worker_id], after[decode.worker_id]
    p0, d0 = before[prefill.worker_id], before[decode.worker_id]
    assert p.prefix_cache_queries - p0.prefix_cache_queries == sum(lengths[x] for x in remote)  # it computed those
    assert d.kv_transfers - d0.kv_transfers == len(remote) and d.kv_transfer_failures == p.kv_transfer_failures == 0
    sent, received = p.kv_transfer_bytes - p0.kv_transfer_bytes, d.kv_transfer_bytes - d0.kv_transfer_bytes
    assert sent == received > 0


def test_logprobs_and_stop_strings_through_the_prefill_worker(pd1, llm):
    prompt = LONG[1]
    want = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, logprobs=2))[0].outputs[0]
    stop = want.text[3:5]
    stopped = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, stop=[stop]))[0].outputs[0]
    with Client(pd1.address, timeout=60) as client:
        (got,) = collect(client.generate(prompt, max_tokens=8, temperature=0.0, logprobs=2)).values()
        (cut,) = collect(client.generate(prompt, max_tokens=8, temperature=0.0, stop=[stop])).values()
    assert [lp.token_id for lp in got.logprobs] == want.token_ids
    for lp, entry in zip(got.logprobs, want.logprobs):  # the first from the prefill worker
        assert lp.logprob == pytest.approx(entry[lp.token_id], abs=1e-4)
    assert got.cumulative_logprob == pytest.approx(want.cumulative_logprob, abs=1e-4)
    assert cut.text == stopped.text and cut.finish_reason == "stop" and list(cut.token_ids) == stopped.token_ids


def test_cancel_mid_stream_frees_both_workers(pd1):
    (prefill,), (decode,) = workers(pd1, pb.ROLE_PREFILL), workers(pd1, pb.ROLE_DECODE)
    transfers = pd1.stats(decode.address).kv_transfers
    with Client(pd1.address, timeout=60) as client:
        # A fresh prompt: one the decode worker has cached would prefill there.
        call = client.generate(code("cancelled", 6), max_tokens=600, temperature=0.0, ignore_eos=True)
        for _, _ in zip(range(3), call):
            pass
        assert pd1.stats(decode.address).num_running == 1
        call.cancel()
    assert pd1.stats(decode.address).kv_transfers == transfers + 1  # it did cross
    every_block_free([prefill, decode], pd1.auth)


def spec_metrics(worker: pb.WorkerInfo) -> dict[str, float | list[float]]:
    """The worker's spec_decode counters on a live /metrics scrape; per_pos by position."""
    url = f"http://{worker.address.rsplit(':', 1)[0]}:{worker.metrics_port}/metrics"
    got: dict[str, float | list[float]] = {
        name: metric(url, f"pdserve:spec_decode_{name}_total").get((), -1.0) for name in SPEC_COUNTERS}
    per_pos = metric(url, "pdserve:spec_decode_num_accepted_tokens_per_pos_total")
    got["per_pos"] = [per_pos[(("position", str(i)),)] for i in range(len(per_pos))]
    return got


def test_the_decode_worker_speculates_and_counts_drafts_end_to_end(pd1, llm):
    """Speculation through prefill + decode: greedy tokens are the spec-off engine's,
    each response's usage counts the request's drafts (accepted <= drafted), and the
    decode worker's live /metrics shows the counters with their invariants: accepted
    <= draft tokens, per-position counts non-increasing and summing to the accepted;
    a beam search is decoded without speculation, and counted. The prefill worker does
    not speculate."""
    (prefill,), (decode,) = workers(pd1, pb.ROLE_PREFILL), workers(pd1, pb.ROLE_DECODE)
    prompts = [code(f"spec_{i}", 8 + 4 * i) for i in range(3)] + SHORT  # long ones cross from the prefill worker
    assert any(len(llm.engine.tokenizer.encode(p)) >= THRESHOLD for p in prompts)
    before = spec_metrics(decode)
    want = greedy(llm, prompts, 24)
    with Client(pd1.address, timeout=120) as client:
        got = run_all(client, prompts, max_tokens=24, temperature=0.0)
        (beam, _) = collect(client.generate(SHORT[0], max_tokens=4, beam_width=2, n=2)).values()
    drafted = accepted = 0
    for prompt, w, g in zip(prompts, want, got):
        (seq,) = g.values()
        assert list(seq.token_ids) == w, prompt
        assert 0 <= seq.usage.num_accepted_tokens <= seq.usage.num_draft_tokens, prompt
        drafted, accepted = drafted + seq.usage.num_draft_tokens, accepted + seq.usage.num_accepted_tokens
    assert drafted > 0, "no request speculated"
    assert (beam.usage.num_draft_tokens, beam.usage.num_accepted_tokens) == (0, 0)
    wanted = {"num_draft_tokens": before["num_draft_tokens"] + drafted,
              "num_accepted_tokens": before["num_accepted_tokens"] + accepted,
              "num_unspeculated_requests": before["num_unspeculated_requests"] + 1}

    def settled() -> dict | None:  # /metrics reads the stats as of the engine loop's last iteration
        now = spec_metrics(decode)
        return now if all(now[k] == v for k, v in wanted.items()) else None

    after = wait_for(settled, 10, "the decode worker's /metrics to count the requests' drafts")
    assert 0 < after["num_drafts"] <= after["num_draft_tokens"]
    assert after["num_accepted_tokens"] <= after["num_draft_tokens"]
    assert len(after["per_pos"]) == K and after["per_pos"] == sorted(after["per_pos"], reverse=True)
    assert sum(after["per_pos"]) == after["num_accepted_tokens"]
    assert stats(decode.address, pd1.auth).spec_decode_num_draft_tokens == after["num_draft_tokens"]
    assert spec_metrics(prefill) == {**dict.fromkeys(SPEC_COUNTERS, 0.0), "per_pos": []}


def test_pd1_leaves_every_block_free(pd1):
    every_block_free(pd1.list_workers(), pd1.auth)


# -- pd2: 2 prefill + 2 decode workers, every prompt crosses ------------------------------


@pytest.fixture(scope="module")
def pd2(tmp_path_factory):
    up = UpProcess(
        ["--prefill", "2", "--decode", "2", "--local-prefill-threshold", "0", "--num-blocks", "512",
         "--max-n", str(MAX_N), "--held-lease", "10", "--stats-interval", "0.5", "--worker-timeout", "10",
         "--speculative-config", DRAFT,
         "--no-supervise"],  # killed workers stay dead here (tests/cluster/test_chaos.py has the restarts)
        tmp_path_factory.mktemp("pd2") / "up.log",
    )
    yield up
    up.stop()


@pytest.fixture(scope="module")
def client2(pd2):
    with Client(pd2.address, timeout=120) as c:
        yield c


def test_batch_across_two_pairs_matches_the_engine(pd2, client2, llm):
    prompts = SHORT + LONG + SHARED
    prefills = workers(pd2, pb.ROLE_PREFILL)
    before = counters(prefills, pd2.auth)
    want = greedy(llm, prompts, 16)
    got = run_all(client2, prompts, max_tokens=16, temperature=0.0)
    drafted = 0
    for prompt, w, g in zip(prompts, want, got):
        (seq,) = g.values()
        assert list(seq.token_ids) == w, prompt
        assert 0 <= seq.usage.num_accepted_tokens <= seq.usage.num_draft_tokens
        drafted += seq.usage.num_draft_tokens
    assert drafted > 0  # the draft model proposed on the decode side of every pair
    wait_for(lambda: total(counters(prefills, pd2.auth), "kv_transfers") - total(before, "kv_transfers") == len(prompts), 10,
             "every prompt's KV to have crossed")
    decodes = counters(workers(pd2, pb.ROLE_DECODE), pd2.auth)
    assert total(decodes, "kv_transfers") >= len(prompts) and total(decodes, "kv_transfer_failures") == 0


def test_parallel_sampling_and_beam_search_prefill_once(pd2, client2, llm):
    """n > 1 and beams: the prefill worker ships the KV once, the decode worker
    recomputes the last prompt token and forks the sequences."""
    prefills = workers(pd2, pb.ROLE_PREFILL)
    before = total(counters(prefills, pd2.auth), "kv_transfers")
    sampled = dict(max_tokens=10, temperature=0.8, top_p=0.9, seed=11, n=3)
    beams = dict(max_tokens=8, temperature=0.0, beam_width=3, n=2)
    want_n = llm.generate([LONG[0]], SamplingParams(**sampled))[0]
    want_b = llm.generate([LONG[2]], SamplingParams(**beams))[0]
    got_n = collect(client2.generate(LONG[0], **sampled))
    got_b = collect(client2.generate(LONG[2], **beams))
    assert sorted(got_n) == [0, 1, 2] and sorted(got_b) == [0, 1]
    for want, got in ((want_n, got_n), (want_b, got_b)):
        for c in want.outputs:
            assert list(got[c.index].token_ids) == c.token_ids
            assert got[c.index].cumulative_logprob == pytest.approx(c.cumulative_logprob, abs=1e-4)
    wait_for(lambda: total(counters(prefills, pd2.auth), "kv_transfers") - before == 2, 10, "one transfer per request")


def warm_up(client: Client, up: UpProcess, prompt: str, want: list[int]) -> tuple[pb.WorkerInfo, pb.WorkerInfo]:
    """Send `prompt`; (the prefill worker that computed it, the other one), once the
    router knows what the first one caches."""
    prefills = workers(up, pb.ROLE_PREFILL)
    before = counters(prefills, up.auth)
    (seq,) = collect(client.generate(prompt, max_tokens=len(want), temperature=0.0)).values()
    assert list(seq.token_ids) == want
    now = counters(prefills, up.auth)
    (holder,) = [w for w in prefills if now[w.worker_id].prefix_cache_queries > before[w.worker_id].prefix_cache_queries]
    (other,) = [w for w in prefills if w.worker_id != holder.worker_id]
    time.sleep(1.5)  # the router's view follows the holder's KV events (and its load, Stats every 0.5 s)
    return holder, other


def test_prefix_aware_routing_and_balance_when_the_holder_is_busy(pd2, client2, llm):
    prefix = code("routing_prefix", 25)
    prompts = [prefix + f"    return {k}\n" for k in range(7)]
    want = greedy(llm, prompts, 6)
    holder, other = warm_up(client2, pd2, prompts[0], want[0])
    # Requests sharing the prefix go where it is cached, and hit there.
    held, free = counters([holder, other], pd2.auth).values()
    for k in (1, 2):
        (seq,) = collect(client2.generate(prompts[k], max_tokens=6, temperature=0.0)).values()
        assert list(seq.token_ids) == want[k]
    hits = pd2.stats(holder.address).prefix_cache_hits - held.prefix_cache_hits
    assert hits >= 2 * (len(llm.engine.tokenizer.encode(prefix)) // 16 - 1) * 16
    assert pd2.stats(other.address).prefix_cache_queries == free.prefix_cache_queries  # never asked
    # The holder busy (stopped): the requests queued on it weigh against its prefix,
    # and the rest go to the other prefill worker.
    os.kill(holder.pid, signal.SIGSTOP)
    try:
        streams = [Stream(client2, p, max_tokens=6, temperature=0.0) for p in prompts[3:]]
        wait_for(lambda: pd2.stats(other.address).kv_transfers > free.kv_transfers, 30,
                 "the other prefill worker to take some of the load")
    finally:
        os.kill(holder.pid, signal.SIGCONT)
    for s, w in zip(streams, want[3:]):
        s.join(60)
        assert s.error is None and s.tokens == w
    assert pd2.stats(holder.address).prefix_cache_hits > held.prefix_cache_hits + hits  # it served its queue too


def test_a_killed_prefill_worker_is_replaced_by_the_other(pd2, client2, llm):
    """Requests stuck on a prefill worker that dies are prefilled again by the other,
    each with a fresh reservation on its decode worker; none hangs."""
    prefix = code("orphans", 25)
    prompts = [prefix + f"    return orphan_{k}\n" for k in range(5)]
    want = greedy(llm, prompts, 8)
    victim, _ = warm_up(client2, pd2, prompts[0], want[0])  # it holds the prefix: it gets some
    os.kill(victim.pid, signal.SIGSTOP)  # its requests queue up, unanswered
    streams = [Stream(client2, p, max_tokens=8, temperature=0.0) for p in prompts[1:]]
    want = want[1:]
    time.sleep(1.5)  # all routed
    killed_at = time.monotonic()
    os.kill(victim.pid, signal.SIGKILL)
    for s, w in zip(streams, want):
        s.join(60)
        assert s.error is None, s.error
        assert s.tokens == w
    assert max(s.ended_at for s in streams) - killed_at < 30
    wait_for(lambda: victim.worker_id not in {w.worker_id for w in pd2.list_workers()}, 15,
             "the router to drop the killed prefill worker")
    assert f"prefill on {victim.worker_id} failed" in Path(pd2.log.name).read_text()


def test_a_killed_decode_worker_s_stream_migrates_through_prefill_and_decode(pd2, client2, llm):
    """The decode worker dies mid-stream: the router continues the request on the other
    decode worker (its prompt plus the tokens sent, prefilled remotely, speculating),
    and the client's stream is the uninterrupted greedy run, token for token."""
    stream = Stream(client2, LONG[2], max_tokens=600, temperature=0.0, ignore_eos=True)
    wait_for(lambda: len(stream.tokens) > 3 or stream.error, 60, "the stream to start")
    assert stream.error is None, stream.error
    (victim,) = [w for w in workers(pd2, pb.ROLE_DECODE) if pd2.stats(w.address).num_running == 1]
    os.kill(victim.pid, signal.SIGKILL)
    stream.join(120)
    assert stream.error is None, stream.error
    want = [o.outputs[0].token_ids for o in llm.generate(
        [LONG[2]], SamplingParams(max_tokens=600, temperature=0.0, ignore_eos=True))][0]
    assert stream.tokens == want
    wait_for(lambda: victim.worker_id not in {w.worker_id for w in pd2.list_workers()}, 15,
             "the router to drop the killed decode worker")


def test_pd2_survivors_serve_and_leave_every_block_free(pd2, client2, llm):
    survivors = pd2.list_workers()
    assert sorted(w.role for w in survivors) == sorted([pb.ROLE_PREFILL, pb.ROLE_DECODE])
    (seq,) = collect(client2.generate(LONG[0], max_tokens=8, temperature=0.0)).values()
    assert list(seq.token_ids) == greedy(llm, [LONG[0]], 8)[0]
    every_block_free(survivors, pd2.auth)


# -- the other transports, with in-process workers ------------------------------------------


@pytest.mark.parametrize("factory", ["zmq_ipc", "gloo"])
def test_ipc_and_gloo_connectors(factory, llm):
    router = Router(RouterConfig(port=0, local_prefill_threshold=0))
    address = router.start()
    spec = factory  # --kv-connector zmq_ipc | gloo
    started = []
    try:
        for role in ("decode", "prefill"):
            worker = Worker(WorkerConfig(role=role, router=router.internal_address, worker_id=f"{role}-{factory}", num_blocks=128,
                                         kv_connector=spec))
            worker.start()
            started.append(worker)
        decode, prefill = started
        prompts = [LONG[0], SHORT[1]]
        with Client(address, timeout=60) as client:
            got = run_all(client, prompts, max_tokens=8, temperature=0.0)
        assert [list(g[0].token_ids) for g in got] == greedy(llm, prompts, 8)
        wait_for(lambda: stats(prefill.address).kv_transfers == 2, 10, "both transfers to be acknowledged")
        assert stats(decode.address).kv_transfers == 2
        every_block_free([pb.WorkerInfo(worker_id=w.config.id, address=w.address) for w in started], None)
    finally:
        for worker in reversed(started):
            worker.stop()
        router.stop()
