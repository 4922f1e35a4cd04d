"""Where `pdserve up` puts its processes by default (launch/placement.py): each local
worker on its own share of the cores with one torch thread per core, the routers on
what is left; nothing decided where the operator decided; the same tokens as a
one-thread engine."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from cluster_helpers import UpProcess, is_prefork_helper
from pdserve.engine import LLM, SamplingParams
from pdserve.engine.llm import DEFAULT_MODEL
from pdserve.launch.cluster import ClusterSpec, LaunchConfig
from pdserve.launch.placement import Placement, place, place_local
from pdserve.services.common.cpus import Cpus, this_process
from pdserve.services.router.client import Client, collect
from pdserve.services.router.config import RouterConfig
from pdserve.services.worker.config import WorkerConfig, parse_cpus

pytestmark = pytest.mark.cluster(seconds=15)


@pytest.mark.parametrize("cores, workers, expected", [
    (2, 1, Placement(((0, 1),), ())),
    (2, 2, Placement(((0,), (1,)), ())),
    (3, 2, Placement(((0,), (1,)), (2,))),
    (16, 2, Placement(((0, 1, 2, 3, 4, 5, 6), (7, 8, 9, 10, 11, 12, 13)), (14, 15))),
    (8, 3, Placement(((0, 1), (2, 3), (4, 5)), (6, 7))),
    (2, 3, None),
])
def test_shares_are_disjoint_and_the_rest_goes_to_the_routers(cores, workers, expected):
    assert place(list(range(cores)), workers) == expected


def test_workers_wait_passively_only_where_they_share_cores_with_the_routers():
    assert place(list(range(2)), 1).worker_env == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert place(list(range(3)), 2).worker_env == {}


def spec(**launch) -> ClusterSpec:
    return ClusterSpec(RouterConfig(), WorkerConfig(torch_threads=None), LaunchConfig(**launch))


def test_the_default_sets_worker_cpus_in_start_order():
    placed, placement, line = place_local(spec(prefill=1, decode=2), Cpus((4, 5, 6, 7, 8, 9, 10, 11), 8, None))
    assert placed.launch.worker_cpus == "4-5;6-7;8-9" and placement.routers == (10, 11)
    assert "prefill-0 4-5, decode-0 6-7, decode-1 8-9" in line and "routers 10-11" in line
    assert placed.worker.torch_threads is None  # each worker: one thread per core of its share


def test_a_cgroup_limit_shares_only_the_usable_cores():
    placed, _, _ = place_local(spec(prefill=1, decode=1), Cpus(tuple(range(64)), 4, 4.0))
    assert placed.launch.worker_cpus == "0-1;2-3"


def test_too_few_cores_leaves_workers_unpinned_with_one_thread_each():
    placed, placement, line = place_local(spec(prefill=1, decode=2), Cpus((0, 1), 2, None))
    assert placement is None and placed.launch.worker_cpus == "" and placed.worker.torch_threads == 1
    assert "too few to share" in line


@pytest.mark.parametrize("asked", [dict(launch=dict(worker_cpus="0;1")), dict(worker=dict(cpu_affinity="0")),
                                   dict(worker=dict(torch_threads=2)), dict(worker=dict(torch_threads=0)),
                                   dict(worker=dict(device="cuda"))])
def test_nothing_is_decided_where_the_operator_decided(asked):
    given = ClusterSpec(RouterConfig(), replace(WorkerConfig(torch_threads=None), **asked.get("worker", {})),
                        LaunchConfig(**asked.get("launch", {})))
    placed, placement, _ = place_local(given, Cpus(tuple(range(8)), 8, None))
    assert placed == given and placement is None


def allowed(pid: int) -> set[int]:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Cpus_allowed_list:"):
            return parse_cpus(line.split()[1])
    raise AssertionError(f"/proc/{pid}/status has no Cpus_allowed_list")


def test_up_with_default_flags_pins_each_worker_and_matches_a_one_thread_engine(tmp_path):
    cpus = this_process()
    expected = place(cpus.ids[:cpus.usable], 2)
    up = UpProcess(["--num-blocks", "64"], tmp_path / "up.log", env={"PDSERVE_TORCH_THREADS": None})
    try:
        workers = {w.worker_id: w.pid for w in up.list_workers()}
        assert sorted(workers) == ["decode-0", "prefill-0"]
        log = up.log_path.read_text()
        assert "placement: " in log, log[-3000:]
        if expected is None:  # a one-core machine: nothing to share
            assert "too few to share" in log
        else:
            for worker_id, share in zip(("prefill-0", "decode-0"), expected.workers):
                assert allowed(workers[worker_id]) == set(share), worker_id
                assert f"torch threads: {len(share)} (one per usable CPU" in log
                environ = dict(item.split(b"=", 1) for item in Path(f"/proc/{workers[worker_id]}/environ").read_bytes()
                               .split(b"\0") if b"=" in item)
                assert environ.get(b"OMP_WAIT_POLICY") == (None if expected.routers else b"PASSIVE"), worker_id
            routers = [pid for pid in up.children() if pid not in workers.values() and not is_prefork_helper(pid)]
            assert routers and all(allowed(pid) == set(expected.routers or cpus.ids) for pid in routers)
        prompt = "def fibonacci(n):"
        with Client(up.address, timeout=60) as client:
            served = list(collect(client.generate(prompt, max_tokens=16, temperature=0.0, ignore_eos=True))[0].token_ids)
    finally:
        assert up.stop() == 0
    import torch  # the reference in this process: one thread (tests/conftest.py)

    assert torch.get_num_threads() == 1
    engine = LLM(model=DEFAULT_MODEL, num_blocks=64)
    reference = engine.generate([prompt], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))[0]
    assert served == list(reference.outputs[0].token_ids)


def test_the_engine_gives_the_same_tokens_on_one_thread_and_on_every_core():
    """What the threads default changes on a CPU: greedy tokens stay the same."""
    import torch

    prompts = ["def fibonacci(n):", "import os\n", "class Stack:\n    def", "# sort a list\n", "for i in range(10):"]
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    tokens = {}
    before = torch.get_num_threads()
    try:
        for threads in (1, max(2, this_process().usable)):
            torch.set_num_threads(threads)
            engine = LLM(model=DEFAULT_MODEL, num_blocks=64)
            tokens[threads] = [list(r.outputs[0].token_ids) for r in engine.generate(prompts, params)]
    finally:
        torch.set_num_threads(before)
    first, *others = tokens.values()
    assert all(other == first for other in others)
