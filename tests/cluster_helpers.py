"""Helpers for tests that start real pdserve processes (tests/cluster/, tests/services/, ...)."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import grpc
from prometheus_client.parser import text_string_to_metric_families

from pdserve.proto.pdserve.v1 import pdserve_pb2 as pb
from pdserve.proto.pdserve.v1 import pdserve_pb2_grpc as pb_grpc
from pdserve.services.common.credentials import ClusterAuth, ClusterCredentials
from pdserve.services.router.client import Client

REPO = Path(__file__).resolve().parent.parent
T = TypeVar("T")


SUITE_SETTINGS = ("PDSERVE_TORCH_THREADS", "PDSERVE_DTYPE")  # set by tests/conftest.py


def child_env() -> dict[str, str]:
    """This environment without the user's PDSERVE_* settings (every flag reads one), but
    with the suite's one torch thread per worker and float32 (tests/conftest.py)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_") or k in SUITE_SETTINGS}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    return env


class UpProcess:
    """`pdserve up ...` as a child process; `address` (public) and `internal` (the
    Registry) once it printed `ready <address> internal <registry>`; with --http-port,
    `openai_url` (`http://HOST:PORT/v1`) once it printed `openai <url>`. It keeps the
    launch's credentials in `secrets` (beside the log): `auth` presents them, as an
    operator's tool would, to the cluster's internal services. `env` adds to the
    child's environment (None: removes that variable)."""

    def __init__(self, args: list[str], log_path: Path, timeout: float = 240.0,
                 env: dict[str, str | None] | None = None) -> None:
        self.log_path = log_path
        self.log = open(log_path, "wb")
        self.secrets = log_path.parent / "secrets"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pdserve", "up", "--port", "0", "--secrets-dir", str(self.secrets), *args],
            cwd=REPO, env={k: v for k, v in {**child_env(), **(env or {})}.items() if v is not None}, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=self.log,
            text=True,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.stdout_lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        _, self.address, _, self.internal = self._expect("ready", timeout).split()
        self.routers: list[tuple[str, str]] = [(self.address, self.internal)]  # (public, Registry); see read_routers
        self.openai_url: str | None = self._expect("openai", timeout).split()[1] if "--http-port" in args else None
        self.auth = ClusterAuth(ClusterCredentials(cluster_token_file=str(self.secrets / "cluster-token")))

    def _expect(self, word: str, timeout: float) -> str:
        """The next line printed, which must start with `word` (else the launch is stopped)."""
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            self.stop()
            raise TimeoutError(f"pdserve up: no {word!r} line within {timeout}s; see {self.log_path}") from None
        assert line.startswith(f"{word} "), f"pdserve up printed {line!r}; see {self.log_path}"
        self.stdout_lines.append(line)
        return line

    def read_routers(self, count: int, timeout: float = 60.0) -> list[tuple[str, str]]:
        """With `--routers count`: every router's (public, Registry) address, the first
        router's first, after reading the `ready` lines of the others (the next
        `count - 1` lines printed: call this before any other line is expected)."""
        while len(self.routers) < count:
            _, public, _, internal = self._expect("ready", timeout).split()
            self.routers.append((public, internal))
        return list(self.routers)

    def wait_line(self, line: str, timeout: float) -> None:
        """Until the launcher has printed `line` (e.g. `restarted router 1`), keeping
        every line printed meanwhile in `stdout_lines`."""
        give_up = time.monotonic() + timeout
        while line not in self.stdout_lines:
            try:
                self.stdout_lines.append(self.lines.get(timeout=max(0.01, give_up - time.monotonic())))
            except queue.Empty:
                raise AssertionError(f"pdserve up did not print {line!r} within {timeout}s (printed: "
                                     f"{self.stdout_lines}); see {self.log_path}") from None

    def router_pid(self, index: int) -> int:
        """The pid of router `index`: the launcher's child that writes the address file
        of its name (launch/cluster.py: router, router-1, ...)."""
        name = f"/{'router' if index == 0 else f'router-{index}'}.address"
        for pid in self.children():
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
            except FileNotFoundError:  # it has just exited
                continue
            if any(arg.endswith(name) for arg in argv):
                return pid
        raise AssertionError(f"no router {index} among the children of pdserve up")

    def list_workers(self, registry: str | None = None) -> list[pb.WorkerInfo]:
        """The workers registered with the first router (or with the Registry at `registry`)."""
        return list_workers(registry or self.internal, self.auth)

    def stats(self, worker: str) -> pb.StatsResponse:
        return stats(worker, self.auth)

    def all_blocks_free(self, worker: str) -> bool:
        return all_blocks_free(worker, self.auth)

    def wait_every_block_free(self, timeout: float = 30) -> None:
        """Every registered worker has freed every block (its streams all ended)."""
        for worker in self.list_workers():
            wait_for(lambda: self.all_blocks_free(worker.address), timeout, f"every block free on {worker.worker_id}",
                     step=0.5)

    def stop_and_restarts(self) -> tuple[int, list[str]]:
        """Stop the launcher: its exit code and the `restarted ...` lines it printed, sorted."""
        code = self.stop()
        restarted = sorted(line for line in self.stdout_lines if line.startswith("restarted "))
        print(f"launcher: {restarted}; exit {code}")
        return code, restarted

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))

    def children(self) -> list[int]:
        pids: list[int] = []
        for task in Path(f"/proc/{self.proc.pid}/task").glob("*"):
            try:
                text = (task / "children").read_text().split()
            except FileNotFoundError:  # the thread ended between the listing and the read
                continue
            pids += [int(p) for p in text]
        return pids

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        while True:
            try:
                self.stdout_lines.append(self.lines.get_nowait())
            except queue.Empty:
                break
        self.log.close()
        return self.proc.returncode


def wait_for(predicate: Callable[[], T], timeout: float, what: str, step: float = 0.1) -> T:
    give_up = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > give_up:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(step)


def list_workers(registry: str, auth: ClusterAuth | None = None) -> list[pb.WorkerInfo]:
    """The live workers, from the router's internal (Registry) address."""
    with (auth or ClusterAuth()).channel(registry) as channel:
        return list(pb_grpc.RegistryStub(channel).ListWorkers(pb.ListWorkersRequest(), timeout=5).workers)


def router_metrics_url(registry: str, auth: ClusterAuth | None = None) -> str:
    """The /metrics URL of the router whose Registry is at `registry` (it says its port)."""
    with (auth or ClusterAuth()).channel(registry) as channel:
        port = pb_grpc.RegistryStub(channel).ListWorkers(pb.ListWorkersRequest(), timeout=5).router_metrics_port
    return f"http://{registry.rpartition(':')[0]}:{port}/metrics"


def stats(address: str, auth: ClusterAuth | None = None) -> pb.StatsResponse:
    with (auth or ClusterAuth()).channel(address) as channel:
        return pb_grpc.WorkerStub(channel).Stats(pb.StatsRequest(), timeout=5)


def all_blocks_free(address: str, auth: ClusterAuth | None = None) -> bool:
    s = stats(address, auth)
    busy = s.num_running + s.num_waiting + s.num_held + s.num_reserved
    return s.num_free_blocks == s.num_blocks and busy == 0


def is_prefork_helper(pid: int) -> bool:
    """Whether `pid` is the helper `pdserve up` forks its workers from (launch/prefork.py)."""
    try:
        return b"pdserve.launch.prefork" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except FileNotFoundError:
        return False


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is dead for our purposes
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


class Stream:
    """A generate call consumed on its own thread, recording when things happened."""

    def __init__(self, client: Client, prompt: str, **sampling) -> None:
        self.tokens: list[int] = []
        self.error: grpc.RpcError | None = None
        self.ended_at = 0.0
        self._call = client.generate(prompt, **sampling)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for message in self._call:
                self.tokens.extend(message.token_ids)
        except grpc.RpcError as e:
            self.error = e
        self.ended_at = time.monotonic()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "a stream hung"


def metric(url: str, name: str, **labels: str) -> dict[tuple[tuple[str, str], ...], float]:
    """The samples of `name` at a /metrics `url` whose labels include `labels`, keyed
    by their other labels (model_name, role and worker left out)."""
    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    fixed = {"model_name", "role", "worker"}
    out: dict[tuple[tuple[str, str], ...], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                key = tuple(sorted((k, v) for k, v in sample.labels.items() if k not in fixed and k not in labels))
                out[key] = out.get(key, 0.0) + sample.value
    return out
