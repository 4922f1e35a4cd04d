"""Load: 200 streaming clients for 60 s against `pdserve up` as it comes (1 prefill +
1 decode worker, real processes, the launch's credentials, the embedded model).

The mix (tests/load_clients.py): short prompts (prefilled on the decode worker) and
long ones (prefilled on the prefill worker, their KV crossing over ZeroMQ), n > 1,
beam search, calls cancelled after a token or two, and deadlines of a few tens of
milliseconds. Outputs are short so that a 2-core machine keeps up.

First a warm-up of the same mix (WARMUP_S), after which every process's peak resident
set so far (VmHWM) is read; then the measured run. Then:
  - every request ended with its result or an expected status (OK; CANCELLED for a
    client's cancel; DEADLINE_EXCEEDED for a tiny deadline; RESOURCE_EXHAUSTED, the
    router's admission limit) - never INTERNAL, UNKNOWN or UNAVAILABLE;
  - no call outlived its deadline by more than the slack;
  - every process is alive, and its RSS is within RSS_GROWTH of its size after the
    warm-up (all figures printed);
  - every worker ends with all blocks free and nothing running, waiting, held or
    reserved (aborts of cancelled and expired calls settle within a deadline).
"""

from __future__ import annotations

from dataclasses import replace
import re
import urllib.request
from pathlib import Path

import pytest

from cluster_helpers import UpProcess, all_blocks_free, pid_alive, wait_for
from load_clients import LoadConfig, Summary, run_clients
from pdserve.proto.pdserve.v1 import pdserve_pb2 as pb
from pdserve.proto.pdserve.v1 import pdserve_pb2_grpc as pb_grpc
from pdserve.services.router.client import Client

pytestmark = pytest.mark.timed

CLIENTS = 200
DURATION_S = 60.0
WARMUP_S = 15.0
RSS_GROWTH = 0.10
# A cache the load fills (4096 tokens per worker): preemptions, and reservations that
# find no room, happen during the run.
NUM_BLOCKS = 256
LOAD = LoadConfig(clients=CLIENTS, duration=DURATION_S, deadline=60.0, slack=2.0, seed=1)


def rss_bytes(pid: int, field: str = "VmRSS") -> int:
    """The resident set (VmRSS), or with field="VmHWM" its peak so far."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"/proc/{pid}/status: no {field}")


def process_names(up: UpProcess) -> dict[str, int]:
    """`pdserve up` itself and each child, named by its role (router, prefill-0, ...)."""
    names = {"launcher": up.proc.pid}
    for pid in up.children():
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        args = [a.decode() for a in argv if a]
        if "--worker-id" in args:
            names[args[args.index("--worker-id") + 1]] = pid
        elif "router" in args:
            names["router"] = pid
        else:
            names[f"child-{pid}"] = pid
    return names


def rss_report(names: dict[str, int], before: dict[str, int], after: dict[str, int]) -> str:
    lines = [f"{'process':<12}{'pid':>8}{'RSS warm-up peak MiB':>22}{'RSS end MiB':>14}{'growth':>9}"]
    for name, pid in names.items():
        b, a = before[name], after.get(name, 0)
        lines.append(f"{name:<12}{pid:>8}{b / 2**20:>22.1f}{a / 2**20:>14.1f}{(a - b) / b:>+9.1%}")
    return "\n".join(lines)


def router_metrics(up: UpProcess) -> dict[str, float]:
    """The router's /metrics samples, `name{labels}` -> value (its port from the Registry)."""
    with up.auth.channel(up.internal) as channel:
        port = pb_grpc.RegistryStub(channel).ListWorkers(pb.ListWorkersRequest(), timeout=5).router_metrics_port
    host = up.internal.rsplit(":", 1)[0]
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    samples = {}
    for line in text.splitlines():
        match = re.fullmatch(r"(pdserve:[^\s{]+(?:\{[^}]*\})?) (\S+)", line)
        if match:
            samples[match[1]] = float(match[2])
    return samples


def sample(samples: dict[str, float], name: str, **labels: str) -> float:
    """The sum of `name`'s samples whose labels include `labels`."""
    def matches(key: str) -> bool:
        return key.split("{")[0] == name and all(f'{k}="{v}"' in key for k, v in labels.items())
    return sum(v for k, v in samples.items() if matches(k))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    up = UpProcess(["--num-blocks", str(NUM_BLOCKS), "--max-n", "4", "--log-level", "WARNING"],
                   tmp_path_factory.mktemp("load") / "up.log")
    yield up
    up.stop()


def report(title: str, summary: Summary) -> None:
    print(f"\n-- {title}: {len(summary.records)} requests", summary.table(), *summary.problems(), sep="\n", flush=True)


def test_200_streaming_clients_for_60s(cluster):
    with Client(cluster.address, timeout=30) as client:
        (model,) = client.list_models()
    names = process_names(cluster)
    assert {"router", "prefill-0", "decode-0"} <= set(names), names

    warm = run_clients(cluster.address, replace(LOAD, duration=WARMUP_S, seed=0), model.vocab_size)
    report("warm-up", warm)
    workers = cluster.list_workers()
    for w in workers:
        wait_for(lambda: all_blocks_free(w.address, cluster.auth), 30, f"{w.worker_id}'s blocks free after warm-up")
    # A process's size after the warm-up is the peak it reached in it: a router of ~80 MiB
    # (no torch) moves by several MiB between two readings with its threads' allocator
    # arenas alone (malloc_trim gives 1-4 MiB back), which a 10 % bound on a one-off
    # reading would take for growth; a leak still takes it past its warm-up peak.
    rss_warm = {name: rss_bytes(pid, "VmHWM") for name, pid in names.items()}

    summary = run_clients(cluster.address, LOAD, model.vocab_size)
    report("load", summary)
    dead = [name for name, pid in names.items() if not pid_alive(pid)]
    for w in workers:
        wait_for(lambda: all_blocks_free(w.address, cluster.auth), 30, f"{w.worker_id}'s blocks free after the load")
    rss_end = {name: rss_bytes(pid) for name, pid in names.items() if name not in dead}
    print(rss_report(names, rss_warm, rss_end), flush=True)
    for w in workers:
        st = cluster.stats(w.address)
        print(f"{w.worker_id}: {st.num_blocks} blocks, {st.num_preemptions} preemptions, {st.kv_transfers} KV transfers "
              f"({st.kv_transfer_failures} failed), prefix cache hits {st.prefix_cache_hits}/{st.prefix_cache_queries} "
              "tokens", flush=True)
    wait_for(lambda: sample(router_metrics(cluster), "pdserve:num_requests_inflight") == 0, 30,
             "the router to have no call in flight")
    metrics = router_metrics(cluster)
    failures = {k: v for k, v in metrics.items() if k.startswith("pdserve:request_failure_total")}
    paths = {k: v for k, v in metrics.items() if k.startswith("pdserve:router_prefill_path_total")}
    print("router:", *(f"{k} {v:g}" for k, v in sorted({**failures, **paths}.items())), sep="\n  ", flush=True)

    assert not dead, f"processes died under load: {dead}"
    server_side = {code: sample(metrics, "pdserve:request_failure_total", code=code)
                   for code in ("INTERNAL", "UNKNOWN", "UNAVAILABLE")}
    assert not any(server_side.values()), f"the router ended calls with {server_side}"
    errors = [line for line in cluster.log_path.read_text(errors="replace").splitlines()
              if " ERROR " in line or " CRITICAL " in line or line.startswith("Traceback")]
    assert not errors, "errors logged under load:\n" + "\n".join(errors[:20])
    assert not warm.problems(), f"warm-up: {warm.problems()}"
    assert summary.records and not summary.problems(), summary.problems()
    kinds = {r.kind for r in summary.records if r.code == "OK"}
    assert kinds >= {"short", "long", "n", "beam"}, kinds  # the mix ran, and each kind succeeded
    assert any(r.code == "CANCELLED" for r in summary.records if r.kind == "cancel")
    assert any(r.code == "DEADLINE_EXCEEDED" for r in summary.records if r.kind == "tiny")
    grown = {n: (rss_end[n] - rss_warm[n]) / rss_warm[n] for n in names if rss_end[n] > rss_warm[n] * (1 + RSS_GROWTH)}
    assert not grown, f"RSS grew more than {RSS_GROWTH:.0%} after the warm-up: {grown}"
    assert len(cluster.list_workers()) == len(workers)  # none dropped out of the router's view
