"""Workers forked from the preloaded helper (launch/prefork.py): each is this process's
own child, with the command line, environment, cores and output an exec'd `python -m
pdserve ...` would have, its exit status reported like a Popen's; what the helper
cannot do (a command line beyond its room, a helper gone) raises OSError for the
launcher to exec instead."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest

from cluster_helpers import child_env, pid_alive, wait_for
from pdserve.launch.prefork import ROOM, Prefork, supported

pytestmark = pytest.mark.skipif(not supported(), reason="forking workers needs Linux")


@pytest.fixture(scope="module")
def helper():
    prefork = Prefork(sys.executable, child_env())
    yield prefork
    prefork.close()
    assert prefork._helper.returncode == 0  # it left at end of file


def router(tmp_path: Path) -> list[str]:
    return [sys.executable, "-m", "pdserve", "router", "--port", "0", "--internal-port", "0"]


def spawn(helper: Prefork, command: list[str], log: Path, env: dict[str, str] | None = None, cpus=()):
    with open(log, "ab") as out:
        return helper.spawn(command, env or child_env(), cpus, out.fileno())


def test_a_forked_service_looks_like_an_execd_one_and_stops_like_one(helper, tmp_path):
    log = tmp_path / "router.log"
    address_file = tmp_path / "address"
    env = {**child_env(), "PDSERVE_ADDRESS_FILE": str(address_file)}  # flags read from its environment
    cpu = min(os.sched_getaffinity(0))
    proc = spawn(helper, router(tmp_path), log, env, cpus=[cpu])
    wait_for(lambda: address_file.is_file(), 60, "the forked router to write its address")
    assert "serving router" in log.read_text()
    stat = Path(f"/proc/{proc.pid}/stat").read_text().rpartition(")")[2].split()
    assert int(stat[1]) == os.getpid()  # re-parented: this process waits for it
    argv = [a.decode() for a in Path(f"/proc/{proc.pid}/cmdline").read_bytes().split(b"\0") if a]
    assert argv == router(tmp_path)
    assert os.sched_getaffinity(proc.pid) == {cpu}
    assert proc.poll() is None
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0 and proc.returncode == 0  # it drained and exited as a router does
    assert not pid_alive(proc.pid)


def test_exit_codes_and_signals_come_back_as_from_popen(helper, tmp_path):
    bad = spawn(helper, [sys.executable, "-m", "pdserve", "router", "--port", "-5"], tmp_path / "bad.log")
    assert bad.wait(60) == 2
    assert "port" in (tmp_path / "bad.log").read_text()  # the message names the field
    killed = spawn(helper, router(tmp_path), tmp_path / "killed.log")
    killed.kill()
    assert killed.wait(30) == -signal.SIGKILL
    killed.kill()  # a second signal to a reaped child is nothing


def test_what_the_helper_cannot_do_raises_for_the_launcher_to_exec(helper, tmp_path):
    with pytest.raises(OSError, match="does not fit"):
        spawn(helper, [sys.executable, "-m", "pdserve", "router", "--api-key-header", "x" * ROOM], tmp_path / "l.log")
    gone = Prefork(sys.executable, child_env())
    gone._helper.kill()
    gone._helper.wait(10)
    with pytest.raises(OSError, match="did not answer"):
        spawn(gone, router(tmp_path), tmp_path / "gone.log")
    with pytest.raises(OSError):  # broken for good: every later worker is exec'd
        spawn(gone, router(tmp_path), tmp_path / "gone.log")
    gone.close()


def test_worker_start_is_fork_by_default_and_a_bad_value_names_the_flag():
    from pdserve.launch.cluster import LaunchConfig

    assert LaunchConfig().worker_start == "fork"
    with pytest.raises(ValueError, match="worker_start"):
        LaunchConfig(worker_start="spawn")
