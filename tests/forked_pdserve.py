"""pdserve services (workers, routers) forked from one interpreter that has already
imported them: a multiprocessing forkserver, started on a test process's first use
(and kept for its later test files), preloading torch, the worker and the router. For
tests that start workers or routers by hand.

Each is a real process of its own running `pdserve ROLE ARGS...` (the same
`pdserve.cli.main` as `python -m pdserve`), its stderr in a log, signalled and reaped
like a `subprocess.Popen`; only the ~2.5 CPU-s of importing torch and pdserve again
in every process is spared (the forkserver pays it once). Each child takes this
process's environment as it is at the spawn, less the `PDSERVE_*` variables but the
suite's settings (as `child_env()`), so flags come from the command line alone; what is read at import
(torch's OMP_NUM_THREADS, set by tests/conftest.py) is the forkserver's.

    proc = spawn_pdserve(["mixed", "--router", registry, ...], log_path)
    proc.pid;  proc.returncode;  proc.poll();  proc.wait(timeout)
    proc.send_signal(sig);  proc.terminate();  proc.kill()
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
from pathlib import Path

from cluster_helpers import SUITE_SETTINGS

PRELOAD = ["torch", "pdserve.cli", "pdserve.services.node", "pdserve.services.router.main"]


def _context() -> multiprocessing.context.ForkServerContext:
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # read when the forkserver starts (once per test process)
    return ctx


def _run(argv: list[str], log: str, stdout_to_log: bool, env: dict[str, str]) -> None:
    """The child: `env`, stdin /dev/null, stderr appended to the log (stdout too, or
    /dev/null), then `pdserve ARGV`."""
    os.environ.clear()
    os.environ.update(env)
    null = os.open(os.devnull, os.O_RDWR)
    err = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    for fd, target in ((null, 0), (err if stdout_to_log else null, 1), (err, 2)):
        os.dup2(fd, target)
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # as a fresh `pdserve` process has it
    from pdserve.cli import main

    sys.exit(main(argv))


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_") or k in SUITE_SETTINGS}


class ForkedProcess:
    """The `subprocess.Popen` calls the tests make, over a forked `multiprocessing.Process`."""

    def __init__(self, argv: list[str], log: Path, stdout_to_log: bool = False) -> None:
        self.args = argv
        log.touch()  # there from the start, as a Popen's log opened by the caller is
        self._process = _context().Process(target=_run, args=(argv, str(log), stdout_to_log, _env()), daemon=True)
        # daemon: one left running when the test process exits is terminated, not awaited
        self._process.start()
        self.pid = self._process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self._process.exitcode

    def send_signal(self, sig: int) -> None:
        if self._process.exitcode is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def spawn_pdserve(argv: list[str], log: Path, stdout_to_log: bool = False) -> ForkedProcess:
    """`pdserve ARGV` (a service and its flags) in a forked process, its stderr (and with
    `stdout_to_log` its stdout) appended to `log`."""
    return ForkedProcess(argv, log, stdout_to_log)
