"""Workers forked from one preloaded interpreter (`pdserve up --worker-start fork`,
the default on Linux).

A fresh `python -m pdserve decode ...` spends ~2.5 CPU-s importing torch, gRPC and
the engine before it reads a flag. `pdserve up` instead starts one helper process
(`python -m pdserve.launch.prefork`) that imports them once; each local worker, and
each restart of one, is forked from it and runs its `python -m pdserve ARGS` module
as the interpreter would (runpy), in well under a second of CPU.

    launcher (`pdserve up`)            helper (imported torch once, never ran an op)
      spawn(argv, env, cpus, out) --->  fork -> fork -> worker: env, cores, stdout/err,
                                          |              /proc/PID/cmdline = the argv
                                          exits          `python -m pdserve ARGV` would
      <--- {"pid": worker}  (the worker is now the launcher's child)

What a worker sees is what an exec'd one sees: the launcher is its parent (the
launcher is a child subreaper while it spawns: the helper's intermediate child exits
and the worker is re-parented to it, so it is waited for, signalled and watched
($PDSERVE_LAUNCHER_PID) like any child), its environment is the one given, its cores
are set before it runs a line of pdserve, and its /proc/PID/cmdline reads
`python -m pdserve ROLE FLAGS...` (written over the helper's argv, which it started
with ROOM bytes of blank room). What differs is what was fixed before the fork: what
its libraries read from the environment at import, and /proc/PID/environ (both the
helper's, which starts with the environment the workers get).

The helper is single-threaded when it forks (it imports, it never computes), answers
one request at a time over a socketpair (JSON and the output descriptor; no pickle),
and exits at the socket's end of file: when the launcher closes it, or dies. If it cannot start, or a
worker's command line does not fit its room, the worker is exec'd instead (logged).
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Sequence

log = logging.getLogger(__name__)

PRELOAD = ("torch", "pdserve.cli", "pdserve.services.node")  # what a worker imports before it serves
ROOM = 32768  # bytes of /proc/PID/cmdline a forked worker can fill
REPLY_TIMEOUT = 120.0  # the first reply waits for the helper's imports (seconds on a busy machine)
REPARENT_TIMEOUT = 10.0
PR_SET_CHILD_SUBREAPER = 36
MAX_MESSAGE = 1 << 20


def _prctl(option: int, value: int) -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(option, ctypes.c_ulong(value), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def supported() -> bool:
    return sys.platform.startswith("linux") and hasattr(socket, "send_fds")


class PreforkedProcess:
    """The `subprocess.Popen` calls the launcher makes, for a forked child of this
    process (waited for with waitpid, as Popen does)."""

    def __init__(self, pid: int, args: list[str]) -> None:
        self.pid = pid
        self.args = args
        self.returncode: int | None = None
        self._lock = threading.Lock()

    def poll(self) -> int | None:
        with self._lock:
            if self.returncode is None:
                try:
                    pid, status = os.waitpid(self.pid, os.WNOHANG)
                except ChildProcessError:  # not ours (cannot happen once re-parented): gone
                    pid, status = self.pid, 255 << 8
                if pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
            return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        give_up = None if timeout is None else time.monotonic() + timeout
        delay = 0.0005
        while self.poll() is None:
            if give_up is not None and time.monotonic() >= give_up:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            time.sleep(delay)
            delay = min(delay * 2, 0.05)
        return self.returncode  # type: ignore[return-value]

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Prefork:
    """The launcher's end: starts the helper, forks workers from it."""

    # Being a subreaper is a property of the whole process, which may run several
    # clusters (a benchmark starts two at once): one spawn at a time sets and clears it.
    _subreaper = threading.Lock()

    def __init__(self, python: str, env: dict[str, str]) -> None:
        self._lock = threading.Lock()  # this helper's socket: one request at a time
        self._ready = False  # the helper said it has imported everything
        self._sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self._helper = subprocess.Popen(
                [python, "-m", "pdserve.launch.prefork", str(theirs.fileno()), " " * ROOM],
                env=env, stdin=subprocess.DEVNULL, pass_fds=(theirs.fileno(),))
        finally:
            theirs.close()
        self.broken = ""  # why this helper forks no more workers

    def spawn(self, command: Sequence[str], env: dict[str, str], cpus: Sequence[int], out: int) -> PreforkedProcess:
        """Fork `command` (`python -m pdserve ARGS`) with `env`, on `cpus` (all when
        empty), stdout and stderr to descriptor `out`. Raises OSError when the helper
        cannot (the caller execs instead)."""
        if self.broken:
            raise OSError(self.broken)
        title = _title(command)
        if len(title) > ROOM:
            raise OSError(f"a command line of {len(title)} bytes does not fit the helper's {ROOM}")
        request = json.dumps({"argv": list(command), "env": env, "cpus": list(cpus)}).encode()
        with self._lock:
            try:
                self._sock.settimeout(REPLY_TIMEOUT)
                if not self._ready:  # its imports, outside the process-wide lock
                    self._ready = json.loads(self._sock.recv(MAX_MESSAGE) or b"{}").get("ready", False)
                    if not self._ready:
                        raise OSError("it ended before it was ready")
                with Prefork._subreaper:
                    if not _prctl(PR_SET_CHILD_SUBREAPER, 1):
                        self.broken = "this system refuses PR_SET_CHILD_SUBREAPER"
                        raise OSError(self.broken)
                    try:
                        socket.send_fds(self._sock, [request], [out])
                        reply = json.loads(self._sock.recv(MAX_MESSAGE) or b"{}")
                    finally:
                        _prctl(PR_SET_CHILD_SUBREAPER, 0)  # later orphans (a worker's own children) go to init
            except (OSError, ValueError) as e:
                self.broken = self.broken or f"the helper did not answer: {e}"
                self.close()
                raise OSError(self.broken) from e
        if "pid" not in reply:
            self.broken = f"the helper failed: {reply.get('error', 'no reply')}"
            self.close()
            raise OSError(self.broken)
        return PreforkedProcess(int(reply["pid"]), list(command))

    def close(self, timeout: float = 5.0) -> None:
        self._sock.close()  # the helper exits at end of file
        try:
            self._helper.wait(timeout)
        except subprocess.TimeoutExpired:
            self._helper.kill()
            self._helper.wait(timeout)


def _title(command: Sequence[str]) -> bytes:
    return b"".join(arg.encode() + b"\0" for arg in command)


def set_cmdline(command: Sequence[str]) -> bool:
    """Write `command` over this process's argv area (NUL-separated, the rest NUL), so
    /proc/PID/cmdline and ps show it; False when it does not fit."""
    fields = open("/proc/self/stat", "rb").read().rpartition(b")")[2].split()
    start, end = int(fields[45]), int(fields[46])  # arg_start, arg_end (stat fields 48, 49)
    title = _title(command)
    if len(title) > end - start:
        return False
    ctypes.memmove(start, title.ljust(end - start, b"\0"), end - start)
    return True


# -- the helper ----------------------------------------------------------------------


def _become(request: dict, out: int, launcher: int, helper_fd: int) -> None:
    """In the worker: its descriptors, environment, cores and title; wait to be the
    launcher's child; then `pdserve ARGV`. Never returns."""
    code = 1
    try:
        os.close(helper_fd)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.close(null)
        os.close(out)
        signal.signal(signal.SIGINT, signal.default_int_handler)  # as a fresh interpreter has them
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        os.environ.clear()
        os.environ.update(request["env"])
        if request["cpus"]:
            os.sched_setaffinity(0, request["cpus"])
        argv = request["argv"]
        if argv[1:2] != ["-m"] or len(argv) < 3:
            raise ValueError(f"not a `python -m MODULE ...` command: {argv[:3]}")
        set_cmdline(argv)
        give_up = time.monotonic() + REPARENT_TIMEOUT
        while os.getppid() != launcher:  # the intermediate is exiting: then we are the launcher's
            if time.monotonic() > give_up:
                raise OSError(f"not re-parented to the launcher (pid {launcher}) in {REPARENT_TIMEOUT:.0f}s")
            time.sleep(0.001)
        import runpy

        sys.argv = [argv[2], *argv[3:]]  # run_module puts the module's path first, as -m does
        runpy.run_module(argv[2], run_name="__main__", alter_sys=True)  # what `python -m` runs
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _fork(request: dict, out: int, launcher: int, helper_fd: int) -> int:
    """Fork the worker through an intermediate that exits at once; its pid."""
    read, write = os.pipe()
    middle = os.fork()
    if middle == 0:
        try:
            os.close(read)
            worker = os.fork()
            if worker == 0:
                os.close(write)
                _become(request, out, launcher, helper_fd)
            os.write(write, str(worker).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        text = pipe.read()
    os.waitpid(middle, 0)  # gone: the worker is re-parented to the launcher (a subreaper)
    if not text:
        raise OSError("the intermediate process failed to fork")
    return int(text)


def serve(fd: int) -> None:
    """The helper: preload, then fork one worker per request until end of file."""
    launcher = os.getppid()  # it exits at end of file: when the launcher closes its end, or dies
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's ^C is the launcher's to act on
    sock = socket.socket(fileno=fd)
    import importlib

    for module in PRELOAD:
        importlib.import_module(module)
    sock.send(json.dumps({"ready": True}).encode())
    while True:
        try:
            message, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE, 1)
        except OSError:
            return
        if not message:
            return
        try:
            if len(fds) != 1:
                raise ValueError(f"expected one descriptor, got {len(fds)}")
            reply = {"pid": _fork(json.loads(message), fds[0], launcher, fd)}
        except (OSError, ValueError, KeyError, TypeError) as e:
            reply = {"error": f"{type(e).__name__}: {e}"}
        finally:
            for f in fds:
                os.close(f)
        sock.send(json.dumps(reply).encode())


if __name__ == "__main__":
    serve(int(sys.argv[1]))
