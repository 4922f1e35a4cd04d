"""A worker and several routers (issue 21, router replicas), the worker side.

  - --router: a list, or a DNS name standing for every address it resolves to,
    looked up again (services/worker/registration.py), without a process;
  - a worker process given two router processes registers with both, and each
    serves a request through it; one router SIGKILLed, the other serves on; the
    killed one restarted on its Registry port is joined again within a heartbeat
    interval (plus the restarted router's first reconnect);
  - a router that refuses the worker at startup (another block size) makes it exit
    naming why; one nobody listens on does not stop it from serving the other.
"""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import pytest

from cluster_helpers import list_workers, wait_for
from forked_pdserve import spawn_pdserve
from pdserve.engine.llm import DEFAULT_MODEL
from pdserve.services.router.client import Client, collect
from pdserve.services.worker.config import WorkerConfig
from pdserve.services.worker.registration import Routers, parse_routers, resolve

pytestmark = pytest.mark.cluster(seconds=30)

HEARTBEAT = 0.2
ROUTER_FLAGS = ["--port", "0", "--heartbeat-interval", str(HEARTBEAT), "--worker-timeout", "1.0"]


# -- --router, without a process --------------------------------------------------------


def test_router_flag_takes_a_list_and_refuses_what_is_not_one():
    assert parse_routers("10.0.0.1:5, router.svc:50052 ,[::1]:7") == [("10.0.0.1", 5), ("router.svc", 50052),
                                                                      ("::1", 7)]
    for bad in ("", "host", "host:", "a:1,b", "a:99999"):
        with pytest.raises(ValueError, match=r"^router: "):
            parse_routers(bad)
    with pytest.raises(ValueError, match=r"^router: "):
        WorkerConfig(router="nowhere")


def test_a_name_stands_for_every_address_it_resolves_to():
    answers = {"routers.svc": ["10.0.0.2", "10.0.0.1"], "v6.svc": ["fd00::1"]}

    def lookup(host: str, port: int) -> list[str]:
        if host not in answers:
            raise OSError("no such name")
        return sorted(answers[host])

    found, unresolved = resolve(parse_routers("routers.svc:50052,10.0.0.9:1,v6.svc:2,gone.svc:3"), lookup)
    assert found == {"10.0.0.1:50052": "routers.svc", "10.0.0.2:50052": "routers.svc", "10.0.0.9:1": "",
                     "[fd00::1]:2": "v6.svc"}
    assert unresolved == {"gone.svc"}


def test_routers_found_again_are_joined_and_those_gone_let_be_but_not_on_a_failed_lookup():
    """The set of Registrars follows the name's addresses; a lookup that fails keeps
    them (a DNS hiccup is not every router gone)."""
    answers: dict[str, list[str]] = {"routers.svc": ["127.0.0.1"]}

    def lookup(host: str, port: int) -> list[str]:
        if not answers[host]:
            raise OSError("SERVFAIL")
        return answers[host]

    routers = Routers("routers.svc:1", pb_info(), lambda: None, resolve_interval=0.0, lookup=lookup)
    try:
        routers._update()
        assert [r.router for r in routers.registrars()] == ["127.0.0.1:1"]
        answers["routers.svc"] = ["127.0.0.2", "127.0.0.3"]
        routers._update()
        assert sorted(r.router for r in routers.registrars()) == ["127.0.0.2:1", "127.0.0.3:1"]
        answers["routers.svc"] = []
        routers._update()
        assert sorted(r.router for r in routers.registrars()) == ["127.0.0.2:1", "127.0.0.3:1"]
    finally:
        routers.stop()


def pb_info():
    from pdserve.proto.pdserve.v1 import pdserve_pb2 as pb

    return pb.WorkerInfo(worker_id="w", address="127.0.0.1:1")


# -- processes --------------------------------------------------------------------------


class Proc:
    """`pdserve ARGS` as a process of its own (forked: tests/forked_pdserve.py), its stderr in a log file."""

    def __init__(self, args: list[str], log: Path) -> None:
        self.log = log
        self.proc = spawn_pdserve(args, log)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.kill()


def start_router(tmp_path: Path, name: str, internal_port: int = 0) -> tuple[Proc, str, str]:
    """A router process; (process, public address, Registry address) once it serves."""
    address_file = tmp_path / f"{name}.address"
    address_file.unlink(missing_ok=True)
    proc = Proc(["router", *ROUTER_FLAGS, "--internal-port", str(internal_port), "--address-file", str(address_file)],
                tmp_path / f"{name}.log")
    wait_for(lambda: address_file.is_file() or proc.proc.poll() is not None, 60, f"{name} to serve")
    assert proc.proc.poll() is None, proc.log.read_text()[-2000:]
    public, internal = address_file.read_text().split()[:2]
    return proc, public, internal


def registered(registry: str, worker_id: str) -> bool:
    try:
        return any(w.worker_id == worker_id for w in list_workers(registry))
    except Exception:  # a router not serving yet
        return False


def serves(address: str) -> list[int]:
    with Client(address, timeout=60) as client:
        reply = collect(client.generate("def f(x):", max_tokens=4, temperature=0.0))
    return list(reply[0].token_ids)


@pytest.fixture
def processes():
    started: list[Proc] = []
    yield started
    for proc in started:
        proc.kill()


def test_a_worker_serves_every_router_and_outlives_one_and_rejoins_it_restarted(tmp_path, processes):
    a, a_public, a_internal = start_router(tmp_path, "a")
    b, b_public, b_internal = start_router(tmp_path, "b")
    processes += [a, b]
    worker = Proc(["mixed", "--router", f"{a_internal},{b_internal}", "--worker-id", "w-0", "--num-blocks", "64",
                   "--register-timeout", "60"], tmp_path / "worker.log")
    processes.append(worker)
    wait_for(lambda: registered(a_internal, "w-0") and registered(b_internal, "w-0"), 90, "w-0 at both routers")
    tokens = serves(a_public)
    assert serves(b_public) == tokens and len(tokens) == 4

    b.kill()  # SIGKILL: no goodbye
    assert serves(a_public) == tokens
    time.sleep(3 * HEARTBEAT)  # heartbeats to b fail meanwhile; the worker serves on
    assert worker.proc.poll() is None and serves(a_public) == tokens

    port = int(b_internal.rpartition(":")[2])
    b, b_public, b_internal = start_router(tmp_path, "b", internal_port=port)
    processes.append(b)
    up = time.monotonic()
    wait_for(lambda: registered(b_internal, "w-0"), 10, "w-0 to rejoin the restarted router", step=0.02)
    rejoined = time.monotonic() - up
    # a heartbeat interval, plus the worker's channel reconnecting (its backoff is capped at 1 s)
    assert rejoined < HEARTBEAT + 1.5, rejoined
    assert serves(b_public) == tokens
    worker.stop()
    assert worker.proc.returncode == 0, worker.log.read_text()[-2000:]


def test_a_router_that_refuses_the_worker_stops_it_and_a_silent_one_does_not(tmp_path, processes):
    """Another model's router refuses the worker at startup: it exits naming the field.
    A Registry address nobody listens on is retried while the worker serves the other."""
    a, a_public, a_internal = start_router(tmp_path, "a")
    processes.append(a)
    silent = "127.0.0.1:9"  # discard: nothing listens on it here
    worker = Proc(["mixed", "--router", f"{silent},{a_internal}", "--worker-id", "w-1", "--num-blocks", "64"],
                  tmp_path / "worker.log")
    processes.append(worker)
    wait_for(lambda: registered(a_internal, "w-1"), 90, "w-1 at the live router")
    assert len(serves(a_public)) == 4 and worker.proc.poll() is None
    worker.stop()

    refusing = Proc(["router", *ROUTER_FLAGS, "--model", DEFAULT_MODEL, "--block-size", "32", "--address-file",
                     str(tmp_path / "r.address")], tmp_path / "r.log")
    processes.append(refusing)
    wait_for(lambda: (tmp_path / "r.address").is_file(), 60, "the refusing router to serve")
    r_internal = (tmp_path / "r.address").read_text().split()[1]
    worker = Proc(["mixed", "--router", f"{a_internal},{r_internal}", "--worker-id", "w-2", "--num-blocks", "64"],
                  tmp_path / "refused.log")
    processes.append(worker)
    assert worker.proc.wait(90) != 0
    text = (tmp_path / "refused.log").read_text()
    assert "refused registration: worker.block_size" in text, text[-2000:]
