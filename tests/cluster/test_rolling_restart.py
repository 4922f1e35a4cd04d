"""A rolling restart under load loses nothing (issue 21): `pdserve up --routers 2` with
1 prefill + 2 decode workers serves 40 closed-loop streaming clients (the retrying
Client over both routers) while, one after the other, router 0, router 1 and a
decode worker get SIGTERM, as a rolling update of their pods would:

  - a router drains: it admits nothing new (its refusals are retried on the other
    router), lets its streams run for --router-drain-timeout (1 s, shorter than the
    long greedy streams started on it just before), fails those still running, and
    exits 0; their clients resume them on the other router from the tokens they
    have (issue 40), so they bring all their tokens; the launcher starts the router
    again on its ports; the next step waits until every worker has registered with
    it and the clients are served by it again;
  - the decode worker leaves the routers' pools, finishes what it can within its
    short --drain-timeout (2 s), then stops: the streams still running there fail
    over to the other decode worker (migrated, as a few long greedy streams started
    just before make sure of) and it is started again under the same id.

Asserted: every request ends OK (or CANCELLED, for the client's own cancels), none
outlives its deadline, the long streams bring all their tokens (those cut by a
router's drain resumed), the routers counted migrations
(`pdserve:request_migrations_total`, printed), every KV block is free on
every worker at the end, and the launcher restarted each process once.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

import grpc

from cluster_helpers import Stream, UpProcess, metric, pid_alive, router_metrics_url, wait_for
from load_clients import LoadConfig, Summary, run_clients
from pdserve.engine.config import ModelConfig
from pdserve.engine.llm import DEFAULT_MODEL
from pdserve.services.common.keepalive import CHANNEL_OPTIONS
from pdserve.services.router.client import Client

pytestmark = pytest.mark.cluster(seconds=120)

WORKER_DRAIN = 2.0  # seconds: short, so that streams are still running when it ends
ROUTER_DRAIN = 1.0  # seconds: less than the long streams take; those still running are resumed elsewhere
FLAGS = ["--routers", "2", "--prefill", "1", "--decode", "2", "--num-blocks", "512", "--held-lease", "10",
         "--heartbeat-interval", "0.5", "--worker-timeout", "2", "--stats-interval", "0.5", "--restart-backoff", "0.5",
         "--drain-timeout", str(WORKER_DRAIN), "--router-drain-timeout", str(ROUTER_DRAIN), "--max-num-seqs", "64"]
# no tiny deadlines: every request can succeed, and must
LOAD = LoadConfig(clients=40, duration=300.0, deadline=60.0, mix=(("short", 4), ("long", 3), ("n", 1), ("beam", 1),
                                                                   ("cancel", 1)),
                  max_tokens=(4, 32), cancel_max_tokens=48, retry_backoff=0.2)
SERVED = {kind: frozenset({"OK", "CANCELLED"} if kind == "cancel" else {"OK"}) for kind, _ in LOAD.mix}
WORKERS = ["decode-0", "decode-1", "prefill-0"]
LONG_STREAMS, LONG_TOKENS = 6, 256  # greedy, started just before the decode worker's SIGTERM
STEP_TIMEOUT = 60.0  # seconds for each process to be back and serving
# A client's channel to a router that was down dials it again within grpc's reconnect
# backoff (at most 2 s, +-20 % jitter: services/common/keepalive.py): the next router
# drains only once every client can reach this one again, as a rolling update waits
# for the new pod to be ready (and minReadySeconds) before it stops the next.
RECONNECT = dict(CHANNEL_OPTIONS)["grpc.max_reconnect_backoff_ms"] / 1000 * 1.2 + 0.5


def registered(up: UpProcess, registry: str) -> dict[str, int]:
    """Worker id -> pid of the workers registered at `registry` ({} while it is down)."""
    try:
        return {w.worker_id: w.pid for w in up.list_workers(registry)}
    except grpc.RpcError:
        return {}


def served_by(up: UpProcess, registry: str) -> float:
    """Sequences the router at `registry` returned since it started (0 while it is down)."""
    try:
        return sum(metric(router_metrics_url(registry, up.auth), "pdserve:request_success_total").values())
    except (grpc.RpcError, OSError):
        return 0.0


def restart_router(up: UpProcess, index: int, vocab: int, start: float) -> list[Stream]:
    """SIGTERM router `index` while long greedy streams run on it; back once it exited
    (drained), the launcher started it again, every worker registered with it, and it
    serves the load again. Returns the long streams (resumed on the other router)."""
    name = "router" if index == 0 else f"router-{index}"
    publics = [public for public, _ in up.routers]
    # a client each, its first attempt on this router (the list's first)
    clients = [Client([publics[index], *(p for p in publics if p != publics[index])], timeout=120)
               for _ in range(LONG_STREAMS // 2)]
    streams = [Stream(c, [(11 * i + j + index) % vocab for j in range(24)], max_tokens=LONG_TOKENS, temperature=0.0,
                      ignore_eos=True) for i, c in enumerate(clients, 1)]
    wait_for(lambda: min(len(s.tokens) for s in streams) > 0, STEP_TIMEOUT, f"every long stream on {name} to start")
    pid = up.router_pid(index)
    sent = time.monotonic()
    os.kill(pid, signal.SIGTERM)
    wait_for(lambda: not pid_alive(pid), ROUTER_DRAIN + 15, f"{name} to drain and exit")
    exited = time.monotonic()
    for s in streams:
        s.join(STEP_TIMEOUT)
    for c in clients:
        c.close()
    up.wait_line(f"restarted {name} 1", STEP_TIMEOUT)
    _, registry = up.routers[index]
    for _, each in up.routers:
        wait_for(lambda: sorted(registered(up, each)) == WORKERS, STEP_TIMEOUT, f"every worker at {each}", step=0.2)
    wait_for(lambda: served_by(up, registry) > 0, STEP_TIMEOUT, f"the restarted {name} to serve the load", step=0.2)
    print(f"t={sent - start:5.1f}s SIGTERM {name}: drained and exited in {exited - sent:.1f}s, serving again "
          f"{time.monotonic() - exited:.1f}s later; its long streams resumed {[s._call.resumptions for s in streams]} "
          "times", flush=True)
    time.sleep(RECONNECT)
    return streams


def restart_decode_worker(up: UpProcess, client: Client, vocab: int, start: float) -> list[Stream]:
    """SIGTERM decode-0 while long greedy streams run; back once the launcher started
    it again and it registered with both routers. Returns the long streams."""
    old = registered(up, up.internal)["decode-0"]
    streams = [Stream(client, [(7 * i + j) % vocab for j in range(24)], max_tokens=LONG_TOKENS, temperature=0.0,
                      ignore_eos=True) for i in range(1, LONG_STREAMS + 1)]
    wait_for(lambda: min(len(s.tokens) for s in streams) > 0, STEP_TIMEOUT, "every long stream to start")
    sent = time.monotonic()
    os.kill(old, signal.SIGTERM)
    wait_for(lambda: not pid_alive(old), WORKER_DRAIN + 15, "decode-0 to drain and exit")
    exited = time.monotonic()
    up.wait_line("restarted decode-0 1", STEP_TIMEOUT)
    for _, registry in up.routers:
        wait_for(lambda: registered(up, registry).get("decode-0", old) != old, STEP_TIMEOUT,
                 f"the restarted decode-0 at {registry}", step=0.2)
    print(f"t={sent - start:5.1f}s SIGTERM decode-0: exited after {exited - sent:.1f}s "
          f"(--drain-timeout {WORKER_DRAIN:g}), registered again {time.monotonic() - exited:.1f}s later", flush=True)
    return streams


def test_rolling_restart_of_both_routers_and_a_decode_worker_loses_no_request(tmp_path):
    began = time.monotonic()
    up = UpProcess(FLAGS, tmp_path / "up.log")
    try:
        publics = [public for public, _ in up.read_routers(2)]
        print(f"cluster up in {time.monotonic() - began:.1f}s", flush=True)
        vocab = ModelConfig.from_dir(DEFAULT_MODEL).vocab_size
        finish = threading.Event()
        outcome: dict[str, Summary | BaseException] = {}

        def load() -> None:
            try:
                outcome["summary"] = run_clients(publics, LOAD, vocab, finish=finish)
            except BaseException as e:  # reported below
                outcome["summary"] = e

        loader = threading.Thread(target=load, daemon=True)
        start = time.monotonic()
        loader.start()
        with Client(publics, timeout=120) as client:
            wait_for(lambda: all(served_by(up, registry) > 0 for _, registry in up.routers), STEP_TIMEOUT,
                     "both routers to serve the load", step=0.2)
            cut = restart_router(up, 0, vocab, start) + restart_router(up, 1, vocab, start)
            streams = restart_decode_worker(up, client, vocab, start)
            for s in streams:
                s.join(STEP_TIMEOUT)
        time.sleep(2.0)  # the load goes on over the restarted decode worker
        finish.set()
        loader.join(LOAD.deadline + LOAD.slack + 10)
        assert not loader.is_alive(), "the load clients did not end"
        print(f"load over after {time.monotonic() - start:.1f}s", flush=True)
        summary = outcome["summary"]
        if isinstance(summary, BaseException):
            raise summary
        summary = Summary(summary.records, LOAD.slack, SERVED)
        print("\n" + summary.table(), flush=True)
        moved = {registry: served for _, registry in up.routers
                 if (served := sum(metric(router_metrics_url(registry, up.auth),
                                          "pdserve:request_migrations_total").values()))}
        print(f"pdserve:request_migrations_total (decode-0's drain): {sum(moved.values()):.0f} "
              f"({', '.join(f'{r}: {n:.0f}' for r, n in moved.items()) or 'none'})", flush=True)
        long_outcomes = [(s.error.code().name if s.error else "OK", len(s.tokens)) for s in streams]
        print(f"long streams across decode-0's drain: {long_outcomes}", flush=True)

        assert not summary.unexpected(), summary.problems()
        assert not summary.overruns(), summary.problems()
        assert long_outcomes == [("OK", LONG_TOKENS)] * LONG_STREAMS
        cut_outcomes = [(s.error.code().name if s.error else "OK", len(s.tokens)) for s in cut]
        print(f"long streams across the routers' drains: {cut_outcomes}", flush=True)
        assert cut_outcomes == [("OK", LONG_TOKENS)] * len(cut)
        assert any(s._call.resumptions for s in cut), "no stream was still running on a router when its drain ended"
        assert sum(moved.values()) > 0, "no stream was still running on decode-0 when its drain ended"
        up.wait_every_block_free()
    finally:
        code, restarted = up.stop_and_restarts()
    assert restarted == ["restarted decode-0 1", "restarted router 1", "restarted router-1 1"]
    assert code == 0
    log = up.log_path.read_text()
    for name in ("router", "router-1", "decode-0"):
        assert f"{name} exited with 0" in log, f"{name} did not exit 0 after its drain"
