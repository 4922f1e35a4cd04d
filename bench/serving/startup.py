"""What does forking workers buy? `pdserve up` with `--worker-start fork` (the default
on Linux: workers forked from one helper that imported torch and pdserve once) against
`--worker-start exec` (each worker a fresh interpreter), interleaved and repeated.

    python -m pdserve.bench.serving.startup                 # ~2 minutes on 2 cores
    python -m pdserve.bench.serving.startup --mixed 4 --repeats 5
    python -m pdserve.bench.serving.startup --quick         # the smoke test

Each repetition starts `pdserve up --prefill 0 --decode 0 --mixed N` (the embedded
model) and measures
  - ready_s: seconds from the launch to its `ready` line (every worker registered);
  - ready_cpu_s: CPU seconds the launcher and all its descendants spent until then;
  - restart_s: seconds from SIGKILL of worker mixed-0 to the line its replacement logs
    when it serves again (`mixed worker mixed-0 serving on`);
then stops it, then the same for the other side (fork exec fork exec ...). Printed per
run, then per metric the median ratio fork / exec with its min-max, and one line

    startup_ready_ratio=X startup_cpu_ratio=Y startup_restart_ratio=Z

beside the machine's ISA and core count.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from pdserve.bench.common.entry import parse
from pdserve.bench.common.stats import ratio_line
from pdserve.services.common.flags import flag

SIDES = ("fork", "exec")
TICK = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class StartupFlags:
    quick: bool = flag(False, "one repetition of one worker (the smoke test)")
    mixed: int = flag(2, "mixed workers a launch starts")
    repeats: int = flag(3, "repetitions (each runs both sides)")
    timeout: float = flag(180.0, "seconds a launch or a restart may take")


@dataclass(frozen=True)
class Run:
    ready_s: float
    ready_cpu_s: float
    restart_s: float


def tree_cpu(root: int) -> float:
    """CPU seconds of `root` and every live descendant (each with its reaped children)."""
    children: dict[int, list[int]] = {}
    cpu: dict[int, float] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue
        pid = int(entry)
        children.setdefault(int(fields[1]), []).append(pid)
        cpu[pid] = sum(int(x) for x in fields[11:15]) / TICK
    total, stack = 0.0, [root]
    while stack:
        pid = stack.pop()
        total += cpu.get(pid, 0.0)
        stack.extend(children.get(pid, []))
    return total


def worker_pid(up: int, worker_id: str) -> int:
    """The descendant of `up` whose command line names `--worker-id worker_id`."""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"--worker-id" in argv and argv[argv.index(b"--worker-id") + 1] == worker_id.encode():
                return int(entry)
    raise RuntimeError(f"no process serves as {worker_id}")


def lines_of(stream) -> "queue.Queue[str]":
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in stream], daemon=True).start()
    return lines


def wait_line(lines: "queue.Queue[str]", needle: str, give_up: float) -> None:
    while True:
        try:
            if needle in lines.get(timeout=max(0.01, give_up - time.monotonic())):
                return
        except queue.Empty:
            raise RuntimeError(f"no line with {needle!r} in time") from None


def one(side: str, f: StartupFlags) -> Run:
    start = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdserve", "up", "--port", "0", "--prefill", "0", "--decode", "0", "--mixed",
         str(f.mixed), "--num-blocks", "256", "--worker-start", side, "--restart-backoff", "0.1"],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = lines_of(proc.stdout), lines_of(proc.stderr)
        wait_line(out, "ready ", start + f.timeout)
        ready_s = time.monotonic() - start
        ready_cpu_s = tree_cpu(proc.pid)
        victim = worker_pid(proc.pid, "mixed-0")
        while not err.empty():  # what was logged before the kill
            err.get_nowait()
        killed = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        wait_line(err, "mixed worker mixed-0 serving on", killed + f.timeout)
        return Run(ready_s, ready_cpu_s, time.monotonic() - killed)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)


def main(argv: list[str] | None = None) -> int:
    import torch

    f = parse(StartupFlags, argv, "python -m pdserve.bench.serving.startup", __doc__)
    if f.quick:
        f = StartupFlags(quick=True, mixed=1, repeats=1, timeout=f.timeout)
    print(f"machine: {torch.backends.cpu.get_cpu_capability()}, {len(os.sched_getaffinity(0))} CPUs; "
          f"pdserve up --mixed {f.mixed}, --worker-start fork vs exec, {f.repeats} repetitions, interleaved")
    runs: dict[str, list[Run]] = {side: [] for side in SIDES}
    for repeat in range(f.repeats):
        for side in SIDES:
            run = one(side, f)
            runs[side].append(run)
            print(f"[{repeat + 1}/{f.repeats}] {side:<5} ready {run.ready_s:6.2f} s  CPU to ready "
                  f"{run.ready_cpu_s:6.2f} s  worker restart {run.restart_s:6.2f} s", flush=True)
    pairs = list(zip(runs["fork"], runs["exec"]))
    ready, r = ratio_line("ready s fork/exec", [(a.ready_s, b.ready_s) for a, b in pairs])
    cpu, c = ratio_line("CPU s to ready fork/exec", [(a.ready_cpu_s, b.ready_cpu_s) for a, b in pairs])
    restart, s = ratio_line("worker restart s fork/exec", [(a.restart_s, b.restart_s) for a, b in pairs])
    print("\n".join((ready, cpu, restart)))
    print(f"startup_ready_ratio={r:.3f} startup_cpu_ratio={c:.3f} startup_restart_ratio={s:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
