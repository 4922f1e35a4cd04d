"""Stream migration (issue 21), with real worker processes SIGKILLed mid-stream.

A router (in this process, to read its metrics) and two mixed workers (processes,
forked from one that imported pdserve once: tests/forked_pdserve.py):
  - greedy: the worker serving a stream is killed after some tokens reached the
    client; the stream continues on the other worker, and the client's tokens are
    the uninterrupted run's, token for token, none twice, none missing;
  - seeded sampling: the same, the continuation drawing what the dead worker would have;
  - n = 3 seeded samples: each continues as a request of its own, each token-exact;
  - presence and frequency penalties: the continuation counts the sent tokens as output;
  - logprobs: each token's logprob and top-k are the uninterrupted run's (fp32,
    within 1e-4), and so is the final cumulative logprob;
  - a stop string whose text begins in the tokens sent before the kill and ends
    after it: the stream ends where the uninterrupted run does ("stop"), its text
    cut there too;
  - the new worker already caches the continuation's prefix (warmed mid-stream):
    its prefix cache is hit, and the continuation is still token-exact;
  - --max-migrations 0: the stream fails UNAVAILABLE, as before migration, saying so;
  - a second failure: the worker the stream moved to is killed too; with three
    workers the stream ends on the third, token-exact, after two migrations.
Each kill is replaced by a fresh worker before the next test, and every worker left
frees every block once its stream ended.
"""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import grpc
import pytest

from cluster_helpers import all_blocks_free, stats, wait_for
from engine_helpers import one_thread  # noqa: F401 (an autouse fixture: one torch thread)
from forked_pdserve import ForkedProcess, spawn_pdserve
from pdserve.engine import LLM, SamplingParams
from pdserve.engine.text import SequenceText
from pdserve.proto.pdserve.v1 import pdserve_pb2 as pb
from pdserve.services.router.client import Client
from pdserve.services.router.config import RouterConfig
from pdserve.services.router.main import Router

pytestmark = pytest.mark.cluster(seconds=40)

PROMPT = "class Stack:\n    def __init__(self):"
MAX_TOKENS = 400
SHORT = 200  # the newer tests' max_tokens: room for a kill or two, less time
MIGRATIONS = "pdserve:request_migrations_total"
BLOCK = 16  # the workers' KV block size (the default)


@pytest.fixture(scope="module")
def llm():
    return LLM(num_blocks=256)


class Cluster:
    def __init__(self, router: Router, tmp: Path) -> None:
        self.router = router
        self.tmp = tmp
        self.procs: dict[str, ForkedProcess] = {}
        self.spawned = 0

    def alive(self) -> list[str]:
        return [w for w, proc in self.procs.items() if proc.poll() is None]

    def keep(self, n: int = 2) -> None:
        """Start workers (or stop the newest) until `n` serve, and only they are registered."""
        while len(self.alive()) > n:
            proc = self.procs[self.alive()[-1]]
            proc.terminate()  # it drains (it has nothing) and deregisters
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        while len(self.alive()) < n:
            self.spawned += 1
            name = f"mig-{self.spawned}"
            self.procs[name] = spawn_pdserve(
                ["mixed", "--router", self.router.internal_address, "--worker-id", name, "--num-blocks", "256"],
                self.tmp / f"{name}.log")
        wait_for(lambda: sorted(h.worker_id for h in self.router.registry.live()) == sorted(self.alive()), 120,
                 f"{n} workers to serve (and no other to be registered)")

    def addresses(self) -> dict[str, str]:
        return {h.worker_id: h.info.address for h in self.router.registry.live() if h.worker_id in self.alive()}

    def kill_the_one_serving(self) -> str:
        """SIGKILL the worker running a request; its id."""
        def running(address: str) -> int:
            try:
                return stats(address).num_running
            except grpc.RpcError:  # a worker killed before, not dropped yet
                return 0

        def serving():
            busy = [w for w, address in self.addresses().items() if running(address)]
            return busy[0] if len(busy) == 1 else None

        victim = wait_for(serving, 10, "one worker to be running the request")
        self.procs[victim].send_signal(signal.SIGKILL)
        self.procs[victim].wait(10)
        return victim

    def migrations(self) -> float:
        registry = self.router.metrics.registry
        return sum(registry.get_sample_value(MIGRATIONS, dict(
            model_name=self.router.config.model_name, role="router", worker="router", reason=reason)) or 0.0
            for reason in ("stream_broken", "dropped"))

    def wait_all_blocks_free(self) -> None:
        """Every live worker has finished everything (its blocks free, nothing reserved)."""
        wait_for(lambda: all(all_blocks_free(a) for a in self.addresses().values()), 15,
                 "every live worker to free every block")

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        self.router.stop()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    router = Router(RouterConfig(port=0, worker_timeout=3.0))
    router.start()
    cluster = Cluster(router, tmp_path_factory.mktemp("migration"))
    try:
        yield cluster
    finally:
        cluster.stop()


@dataclass
class Run:
    """What the client got from a stream whose workers were killed."""

    messages: list[pb.GenerateResponse] = field(default_factory=list)
    victims: list[str] = field(default_factory=list)  # the workers killed, in order
    error: grpc.RpcError | None = None  # None: the stream ended well

    @property
    def tokens(self) -> list[int]:
        return [t for m in self.messages for t in m.token_ids]

    @property
    def text(self) -> str:
        return "".join(m.text for m in self.messages)

    @property
    def logprobs(self) -> list[pb.TokenLogprob]:
        return [lp for m in self.messages for lp in m.logprobs]

    @property
    def finish_reason(self) -> str:
        return self.messages[-1].finish_reason

    @property
    def last(self) -> pb.GenerateResponse:
        return self.messages[-1]


def stream_and_kill(
    cluster: Cluster, after: int | Sequence[int], workers: int = 2, max_tokens: int = MAX_TOKENS,
    before_kill: Callable[[], None] | None = None, **sampling,
) -> Run:
    """Stream PROMPT on `workers` workers; each time the client has `after[i]` tokens,
    SIGKILL the worker serving it (`before_kill` runs first, the stream going on)."""
    cluster.keep(workers)
    kills = [after] if isinstance(after, int) else list(after)
    run = Run()
    tokens = 0
    with Client(cluster.router.address, timeout=120) as client:
        call = client.generate(PROMPT, max_tokens=max_tokens, ignore_eos=True, **sampling)
        try:
            for message in call:
                run.messages.append(message)
                tokens += len(message.token_ids)
                if len(run.victims) < len(kills) and tokens >= kills[len(run.victims)]:
                    if before_kill is not None and not run.victims:
                        before_kill()
                    run.victims.append(cluster.kill_the_one_serving())
        except grpc.RpcError as e:
            run.error = e
            return run
    assert len(run.victims) == len(kills), f"the stream ended after {len(run.victims)} of {len(kills)} kills"
    return run


def reference_output(llm: LLM, max_tokens: int = MAX_TOKENS, **sampling):
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, **sampling)
    return llm.generate([PROMPT], params)[0].outputs[0]


def reference(llm: LLM, max_tokens: int = MAX_TOKENS, **sampling) -> list[int]:
    return list(reference_output(llm, max_tokens, **sampling).token_ids)


def test_a_greedy_stream_continues_on_another_worker_token_for_token(cluster, llm):
    before = cluster.migrations()
    run = stream_and_kill(cluster, after=8, temperature=0.0)
    assert run.error is None, run.error
    want = reference_output(llm, temperature=0.0)
    assert run.tokens == list(want.token_ids)
    # logprobs not asked: the workers' token_logprobs still let the router count the sent tokens'
    assert run.last.cumulative_logprob == pytest.approx(want.cumulative_logprob, abs=1e-2)
    assert cluster.migrations() == before + 1
    assert run.victims[0] not in {h.worker_id for h in cluster.router.registry.live()}
    cluster.wait_all_blocks_free()


def test_a_seeded_stream_continues_with_what_the_dead_worker_would_have_sampled(cluster, llm):
    sampling = dict(temperature=0.9, top_p=0.95, seed=1234)
    run = stream_and_kill(cluster, after=16, **sampling)
    assert run.error is None, run.error
    assert run.tokens == reference(llm, **sampling)
    cluster.wait_all_blocks_free()


def test_presence_and_frequency_penalties_count_the_sent_tokens_as_output_after_the_cut(cluster, llm):
    sampling = dict(temperature=0.8, seed=77, presence_penalty=1.0, frequency_penalty=0.5)
    run = stream_and_kill(cluster, after=16, max_tokens=SHORT, **sampling)
    assert run.error is None, run.error
    assert run.tokens == reference(llm, SHORT, **sampling)
    cluster.wait_all_blocks_free()


def test_logprobs_continue_as_the_uninterrupted_run_s(cluster, llm):
    """Each token's logprob and its top 2 (fp32: within 1e-4; the new worker computes
    the sent tokens' KV in one prefill, the dead one did it token by token), and the
    final cumulative logprob: the sent tokens' (the router's) plus the new worker's."""
    sampling = dict(temperature=0.0, logprobs=2)
    before = cluster.migrations()
    run = stream_and_kill(cluster, after=16, max_tokens=SHORT, **sampling)
    assert run.error is None, run.error
    want = reference_output(llm, SHORT, **sampling)
    assert cluster.migrations() == before + 1
    assert run.tokens == list(want.token_ids)
    assert len(run.logprobs) == len(want.logprobs) == SHORT
    for i, (got, expected) in enumerate(zip(run.logprobs, want.logprobs)):
        assert got.token_id == want.token_ids[i]
        assert got.logprob == pytest.approx(expected[got.token_id], abs=1e-4), i
        assert len(got.top) == 2, i
        assert {t.token_id for t in got.top} | {got.token_id} == set(expected), i
        for top in got.top:
            assert top.logprob == pytest.approx(expected[top.token_id], abs=1e-4), (i, top.token_id)
    assert run.last.HasField("cumulative_logprob")
    assert run.last.cumulative_logprob == pytest.approx(want.cumulative_logprob, abs=1e-3)
    assert run.last.cumulative_logprob == pytest.approx(sum(lp.logprob for lp in run.logprobs), abs=1e-6)
    cluster.wait_all_blocks_free()


def text_offsets(llm: LLM, tokens: list[int]) -> tuple[str, list[int]]:
    """The output text of `tokens` after PROMPT, and its length after each token (offsets[k]: after k tokens)."""
    text = SequenceText(llm.tokenizer, llm.tokenizer.encode(PROMPT))
    offsets = [0]
    for token in tokens:
        text.append(token)
        offsets.append(len(text.text))
    return text.finish(), offsets


def test_a_stop_string_spanning_the_cut_ends_the_stream_where_the_uninterrupted_run_ends(cluster, llm):
    """The stop string is the uninterrupted run's text of tokens 13..60: it begins in
    what the client has when the worker is killed (>= 16 tokens), and completes on
    the new worker, which cannot see its beginning: the router's StopWatch ends the
    stream there, the new worker's call is cancelled (its blocks freed)."""
    start, end, kill_at = 12, 60, 16
    full, offsets = text_offsets(llm, reference(llm, SHORT, temperature=0.0))
    stop = full[offsets[start]:offsets[end]]
    assert len(stop) > 40 and full.find(stop) == offsets[start], stop  # its first match is there
    want = reference_output(llm, SHORT, temperature=0.0, stop=[stop])
    assert want.finish_reason == "stop" and len(want.token_ids) == end, (want.finish_reason, len(want.token_ids))
    before = cluster.migrations()
    run = stream_and_kill(cluster, after=kill_at, max_tokens=SHORT, temperature=0.0, stop=[stop])
    assert run.error is None, run.error
    # Migrated, so the dead worker had not completed the stop string: the cut lies
    # in it (the client had >= kill_at > start tokens at the kill).
    assert cluster.migrations() == before + 1
    assert run.tokens == list(want.token_ids)
    assert run.finish_reason == "stop"
    assert run.text == want.text == full[:offsets[start]]
    assert run.last.usage.completion_tokens == end
    cluster.wait_all_blocks_free()


def test_a_stream_migrates_onto_a_worker_that_caches_its_prefix(cluster, llm):
    """While the stream runs on one worker, the other one (idle: the router sends it
    the next request) serves PROMPT + the run's first 64 tokens; the first is killed
    after 40 tokens. The continuation (PROMPT + >= 40 tokens sent) finds its leading
    blocks in the new worker's prefix cache, computed by a prefill, not by decoding,
    and still goes on token for token."""
    want = reference(llm, SHORT, temperature=0.0)
    prompt = llm.tokenizer.encode(PROMPT)
    warm = prompt + want[:64]
    kill_at = 40
    snapshot: dict[str, pb.StatsResponse] = {}

    warmed: dict[str, int] = {}

    def warm_the_other_worker() -> None:
        queries = {w: stats(a).prefix_cache_queries for w, a in cluster.addresses().items()}
        with Client(cluster.router.address, timeout=60) as client:
            assert [m.finish_reason for m in client.generate(warm, max_tokens=1, temperature=0.0)][-1] == "length"
        snapshot.update({w: stats(a) for w, a in cluster.addresses().items()})
        warmed.update({w: snapshot[w].prefix_cache_queries - queries[w] for w in queries})

    before = cluster.migrations()
    run = stream_and_kill(cluster, after=kill_at, max_tokens=SHORT, temperature=0.0, before_kill=warm_the_other_worker)
    assert run.error is None, run.error
    assert cluster.migrations() == before + 1
    assert run.tokens == want
    (survivor,) = [w for w in snapshot if w not in run.victims]
    assert warmed[survivor] >= len(warm), warmed  # the idle worker served the warm-up (the router's least loaded)
    after = stats(cluster.addresses()[survivor])
    hits = after.prefix_cache_hits - snapshot[survivor].prefix_cache_hits
    # at least the whole blocks of PROMPT + the first kill_at tokens (the client had them at the kill)
    assert hits >= (len(prompt) + kill_at) // BLOCK * BLOCK, (hits, after, snapshot[survivor])
    cluster.wait_all_blocks_free()


def test_n_seeded_samples_each_continue_with_what_the_dead_worker_would_have_sampled(cluster, llm):
    """n = 3: the worker forking the samples is killed once the client has 24 tokens
    over all of them; each sample goes on as a request of its own (sample_index i),
    and every sample ends as in the uninterrupted run, token for token."""
    sampling = dict(temperature=1.0, top_p=0.95, seed=4321, n=3)
    want = llm.generate([PROMPT], SamplingParams(max_tokens=SHORT, ignore_eos=True, **sampling))[0].outputs
    before = cluster.migrations()
    run = stream_and_kill(cluster, after=24, max_tokens=SHORT, **sampling)
    assert run.error is None, run.error
    assert cluster.migrations() == before + 1
    got: dict[int, list[int]] = {}
    finished: dict[int, str] = {}
    for message in run.messages:
        got.setdefault(message.index, []).extend(message.token_ids)
        if message.finish_reason:
            finished[message.index] = message.finish_reason
    assert sorted(got) == [0, 1, 2] and finished == {0: "length", 1: "length", 2: "length"}
    for output in want:
        assert got[output.index] == list(output.token_ids), output.index
    cluster.wait_all_blocks_free()


def test_with_max_migrations_0_the_stream_fails_unavailable_saying_so(cluster):
    dispatcher = cluster.router.front_end.dispatcher
    dispatcher.config = replace(dispatcher.config, max_migrations=0)
    before = cluster.migrations()
    try:
        run = stream_and_kill(cluster, after=8, temperature=0.0)
    finally:
        dispatcher.config = cluster.router.config
    assert run.error is not None and run.error.code() == grpc.StatusCode.UNAVAILABLE, run.error
    assert "--max-migrations 0 reached" in run.error.details(), run.error.details()
    assert 0 < len(run.tokens) < MAX_TOKENS
    assert cluster.migrations() == before
    cluster.wait_all_blocks_free()


def test_a_second_failure_after_the_migration_migrates_again(cluster, llm):
    """Three workers: the first serving the stream is killed after 16 tokens, the one
    it moved to after 64; it ends on the third, token for token, after two migrations
    (--max-migrations: 3 by default)."""
    assert cluster.router.config.max_migrations >= 2
    sampling = dict(temperature=0.9, top_p=0.95, seed=99)
    before = cluster.migrations()
    run = stream_and_kill(cluster, after=(16, 64), workers=3, max_tokens=SHORT, **sampling)
    assert run.error is None, run.error
    assert len(set(run.victims)) == 2
    assert run.tokens == reference(llm, SHORT, **sampling)
    assert cluster.migrations() == before + 2
    cluster.wait_all_blocks_free()
