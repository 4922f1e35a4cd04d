"""Stream migration (issue 21), with real worker processes SIGKILLed mid-stream.

A router (in this process, to read its metrics) and two mixed workers (processes):
  - greedy: the worker serving a stream is killed after some tokens reached the
    client; the stream continues on the other worker, and the client's tokens are
    the uninterrupted run's, token for token, none twice, none missing;
  - seeded sampling: the same, the continuation drawing what the dead worker would have;
  - --max-migrations 0: the stream fails UNAVAILABLE, as before migration, saying so.
Each kill is replaced by a fresh worker before the next test.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import grpc
import pytest
import torch

from cluster_helpers import REPO, child_env, stats, wait_for
from pdserve.engine import LLM, SamplingParams
from pdserve.services.router.client import Client
from pdserve.services.router.config import RouterConfig
from pdserve.services.router.main import Router

PROMPT = "class Stack:\n    def __init__(self):"
MAX_TOKENS = 400
MIGRATIONS = "pdserve:request_migrations_total"


@pytest.fixture(scope="module")
def llm():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield LLM(num_blocks=256)
    torch.set_num_threads(before)


class Cluster:
    def __init__(self, router: Router, tmp: Path) -> None:
        self.router = router
        self.tmp = tmp
        self.procs: dict[str, subprocess.Popen] = {}
        self.spawned = 0

    def keep_two(self) -> None:
        """Start workers until two serve."""
        alive = {h.worker_id for h in self.router.registry.live()}
        while len([w for w in self.procs if w in alive or self.procs[w].poll() is None]) < 2:
            self.spawned += 1
            name = f"mig-{self.spawned}"
            self.procs[name] = subprocess.Popen(
                [sys.executable, "-m", "pdserve", "mixed", "--router", self.router.internal_address, "--worker-id",
                 name, "--num-blocks", "256"],
                cwd=REPO, env=child_env(), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=open(self.tmp / f"{name}.log", "wb"))
        wait_for(lambda: len(self.router.registry.live()) == 2, 120, "two workers to serve")

    def kill_the_one_serving(self) -> str:
        """SIGKILL the worker running a request; its id."""
        def serving():
            busy = [h for h in self.router.registry.live() if stats(h.info.address).num_running]
            return busy[0] if len(busy) == 1 else None

        victim = wait_for(serving, 10, "one worker to be running the request")
        self.procs[victim.worker_id].send_signal(signal.SIGKILL)
        self.procs[victim.worker_id].wait(10)
        return victim.worker_id

    def migrations(self) -> float:
        labels = dict(model_name=self.router.config.model_name, role="router", worker="router", reason="stream_broken")
        return self.router.metrics.registry.get_sample_value(MIGRATIONS, labels) or 0.0

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


def stream_and_kill(cluster: Cluster, after: int, **sampling) -> tuple[list[int], str, grpc.RpcError | None]:
    """Stream PROMPT, kill its worker once `after` tokens arrived; the tokens the client
    got, the id of the worker killed, and the stream's error (None: it ended well)."""
    cluster.keep_two()
    tokens: list[int] = []
    victim = ""
    with Client(cluster.router.address, timeout=120) as client:
        call = client.generate(PROMPT, max_tokens=MAX_TOKENS, ignore_eos=True, **sampling)
        try:
            for message in call:
                tokens.extend(message.token_ids)
                if not victim and len(tokens) >= after:
                    victim = cluster.kill_the_one_serving()
        except grpc.RpcError as e:
            return tokens, victim, e
    assert victim, "the stream ended before its worker was killed"
    return tokens, victim, None


def reference(llm: LLM, **sampling) -> list[int]:
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, **sampling)
    return list(llm.generate([PROMPT], params)[0].outputs[0].token_ids)


def test_a_greedy_stream_continues_on_another_worker_token_for_token(cluster, llm):
    before = cluster.migrations()
    tokens, victim, error = stream_and_kill(cluster, after=8, temperature=0.0)
    assert error is None, error
    assert tokens == reference(llm, temperature=0.0)
    assert cluster.migrations() == before + 1
    assert victim not in {h.worker_id for h in cluster.router.registry.live()}


def test_a_seeded_stream_continues_with_what_the_dead_worker_would_have_sampled(cluster, llm):
    sampling = dict(temperature=0.9, top_p=0.95, seed=1234)
    tokens, _, error = stream_and_kill(cluster, after=16, **sampling)
    assert error is None, error
    assert tokens == reference(llm, **sampling)


def test_with_max_migrations_0_the_stream_fails_unavailable_saying_so(cluster):
    dispatcher = cluster.router.front_end.dispatcher
    dispatcher.config = replace(dispatcher.config, max_migrations=0)
    before = cluster.migrations()
    try:
        tokens, _, error = stream_and_kill(cluster, after=8, temperature=0.0)
    finally:
        dispatcher.config = cluster.router.config
    assert error is not None and error.code() == grpc.StatusCode.UNAVAILABLE, error
    assert "--max-migrations 0 reached" in error.details(), error.details()
    assert 0 < len(tokens) < MAX_TOKENS
    assert cluster.migrations() == before
