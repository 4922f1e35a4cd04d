"""`pdserve up --launcher ray` on a simulated three-node Ray cluster on this machine
(ray.cluster_utils.Cluster): a head node offering no pdserve resource, a node offering
`pdserve_prefill`, a node offering `pdserve_decode`.

One Ray cluster for the whole module (Ray's start-up costs tens of seconds and
~600 MB; its wall time and the module's are printed at the end), shut down with
Cluster.shutdown (never `ray stop`: other Ray sessions on the machine are not ours).
Ray runs in its single-machine mode (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0: every Ray
address on loopback) and with token authentication, as clusters started by
`ray start` have it; the launcher finds the token the way a user's would
(RAY_AUTH_TOKEN_PATH) and joins with `--address auto`.

In order, on one launcher with two routers (`--routers 2`, issue 21): 1P+1D placed
by resource (state API) and greedy-equal to transformers through the router; the
second router: its own `ready` line and ports, every worker registered with it too,
it serves the same tokens; `pdserve scale` to 2P+1D, same checks (the new worker
registers with both routers); a decode actor's process SIGKILLed (its stream
migrates onto the actor Ray restarts, which registers with both routers again);
decode scaled 2 -> 1 under load (the drained worker finishes its streams); SIGTERM
stops exactly what the launcher started (both routers included).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch

from cluster_helpers import REPO, Stream, UpProcess, child_env, list_workers, pid_alive, wait_for
from hf_models import hf_greedy
from pdserve.engine.llm import DEFAULT_MODEL
from pdserve.engine.tokenizer import Tokenizer
from pdserve.launch.ray_config import RayConfig
from pdserve.proto.pdserve.v1 import pdserve_pb2 as pb
from pdserve.proto.pdserve.v1 import pdserve_pb2_grpc as pb_grpc
from pdserve.services.router.client import Client, collect

pytestmark = pytest.mark.timed

RAY_ENV = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # single-machine mode: Ray's addresses on loopback
    "RAY_AUTH_MODE": "token",
    "RAY_USAGE_STATS_ENABLED": "0",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def code(name: str, lines: int) -> str:
    body = "".join(f"    {name}_{k} = compute({k}, '{name}')  # step {k}\n" for k in range(lines))
    return f"def {name}(data):\n{body}"


# Below the router's local prefill threshold (64 tokens): prefilled on the decode
# worker; the others cross from a prefill worker.
TEXTS = ["def fib(n):\n", "class Stack:\n    def __init__(self):\n        ", code("alpha", 8), code("beta", 14),
         code("gamma", 20)]


# -- one Ray cluster for the module ---------------------------------------------------------


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory, request):
    """The simulated cluster, and this process connected to it (for the state API)."""
    began = time.monotonic()
    token = tmp_path_factory.mktemp("ray") / "auth_token"
    token.write_text(os.urandom(32).hex())
    token.chmod(0o600)
    with pytest.MonkeyPatch.context() as env:
        for name, value in {**RAY_ENV, "RAY_AUTH_TOKEN_PATH": str(token)}.items():
            env.setenv(name, value)
        import ray
        from ray._private import ray_constants
        from ray.cluster_utils import Cluster

        if ray_constants.ENABLE_RAY_CLUSTER:
            pytest.fail("ray was imported before this module set its environment (single-machine mode)")
        cluster = Cluster(initialize_head=True, head_node_args=dict(
            num_cpus=1, dashboard_port=free_port(), dashboard_agent_listen_port=free_port()))
        nodes = {
            "head": cluster.head_node.node_id,
            "prefill": cluster.add_node(num_cpus=2, resources={"pdserve_prefill": 2}).node_id,
            "decode": cluster.add_node(num_cpus=2, resources={"pdserve_decode": 2}).node_id,
        }
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, logging_level="WARNING")
        started = time.monotonic() - began
        try:
            yield cluster, nodes
        finally:
            ray.shutdown()
            cluster.shutdown()
            reporter = request.config.pluginmanager.get_plugin("terminalreporter")
            capture = request.config.pluginmanager.get_plugin("capturemanager")
            if reporter is not None and capture is not None:
                with capture.global_and_fixture_disabled():  # to the terminal, not into the captured output
                    reporter.write_line(f"\n[ray] tests/launch/test_ray_launcher.py: Ray cluster up in {started:.0f}s, "
                                        f"module wall time {time.monotonic() - began:.0f}s")


@pytest.fixture(scope="module")
def up(ray_cluster, tmp_path_factory):
    env = child_env()
    env.pop("RAY_AUTH_MODE")  # as a user's shell: only the token is there (Ray turns the mode on for `auto`)
    launcher = UpProcess(
        # --admission-timeout: a stream whose only decode actor was killed waits for Ray's
        # restart of it (a worker's start, seconds on a loaded machine; 5 s by default).
        ["--launcher", "ray", "--address", "auto", "--routers", "2", "--prefill", "1", "--decode", "1",
         "--num-blocks", "256", "--drain-grace", "60", "--admission-timeout", "60"],
        tmp_path_factory.mktemp("ray-up") / "up.log", env=env,
    )
    try:
        _, launcher.second_address, _, launcher.second_internal = launcher._expect("ready", 60).split()
    except BaseException:
        launcher.stop()
        raise
    yield launcher
    launcher.stop()


@pytest.fixture(scope="module")
def reference():
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL, dtype=torch.float32).eval()
    return model, Tokenizer(DEFAULT_MODEL)


def actors(alive_only: bool = True) -> list:
    from ray.util.state import list_actors

    filters = [("class_name", "=", "WorkerActor")] + ([("state", "=", "ALIVE")] if alive_only else [])
    return list_actors(filters=filters, detail=True, limit=1000)


def assert_placed(up: UpProcess, nodes: dict[str, str], prefill: int, decode: int) -> None:
    """Every worker the router lists is an actor on its pool's node, in a STRICT_PACK
    placement group there; none on the head."""
    from ray.util import placement_group_table

    workers = up.list_workers()
    assert sorted(w.role for w in workers) == sorted([pb.ROLE_PREFILL] * prefill + [pb.ROLE_DECODE] * decode)

    def listed() -> dict:  # Ray's state API lists an actor a moment after its worker registers
        by_pid = {a.pid: a for a in actors()}
        return by_pid if all(w.pid in by_pid for w in workers) else {}

    by_pid = wait_for(listed, 30, "Ray's state API to list every registered worker's actor", step=0.5)
    for w in workers:
        actor = by_pid[w.pid]  # the worker's process is its actor's
        assert actor.node_id == nodes["prefill" if w.role == pb.ROLE_PREFILL else "decode"], w.worker_id
        assert actor.repr_name == f"WorkerActor({w.worker_id})"
    assert not [a for a in by_pid.values() if a.node_id == nodes["head"]]
    groups = placement_group_table()  # the state API's placement groups lack the strategy
    for actor in by_pid.values():
        group = groups[actor.placement_group_id]
        assert group["strategy"] == "STRICT_PACK" and group["state"] == "CREATED"
        assert group["name"].startswith("pdserve-") and set(group["bundles_to_node_id"].values()) == {actor.node_id}


def assert_greedy_matches_transformers(router: str, reference, max_tokens: int = 12) -> None:
    model, tokenizer = reference
    prompts = [tokenizer.encode(t) for t in TEXTS]
    assert min(map(len, prompts)) < 64 < max(map(len, prompts))  # both paths: local and remote prefill
    with Client(router, timeout=120) as client, ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(lambda p: collect(client.generate(p, max_tokens=max_tokens, temperature=0.0,
                                                                ignore_eos=True)), prompts))
    for prompt, result in zip(prompts, got):
        assert list(result[0].token_ids) == hf_greedy(model, prompt, max_tokens, eos=False)


def registered_with_both(up: UpProcess) -> list[tuple[str, int]]:
    """The workers (id, pid) the first router lists, once the second lists the same."""
    first = sorted((w.worker_id, w.pid) for w in up.list_workers())
    second = sorted((w.worker_id, w.pid) for w in list_workers(up.second_internal, up.auth))
    return first if first == second else []


def kv_transfers(up: UpProcess, role: int) -> int:
    return sum(up.stats(w.address).kv_transfers for w in up.list_workers() if w.role == role)


def run_scale(up: UpProcess, *args: str) -> subprocess.CompletedProcess:
    """`pdserve scale` as an operator runs it: at the Registry, with the cluster token."""
    command = [sys.executable, "-m", "pdserve", "scale", "--address", up.internal,
               "--cluster-token-file", str(up.secrets / "cluster-token"), *args]
    return subprocess.run(command, cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=120)


def pool_sizes(up: UpProcess) -> pb.ScaleResponse:
    with up.auth.channel(up.internal) as channel:
        return pb_grpc.RegistryStub(channel).Scale(pb.ScaleRequest(), timeout=5)


# -- without a cluster: the placement shapes ------------------------------------------------------------


def test_bundles_carry_the_pool_resource_and_pack_gpus_on_one_node():
    cpu = RayConfig()
    assert cpu.bundles("prefill", "cpu") == [{"CPU": 1.0, "pdserve_prefill": 1}]
    assert cpu.bundles("mixed", "cpu") == [{"CPU": 1.0, "pdserve_decode": 1}]
    assert cpu.bundles("decode", "cuda") == [{"CPU": 1.0, "pdserve_decode": 1, "GPU": 1}]
    assert cpu.bundles("decode", "cpu", host_tier_bytes=1 << 30) == [  # a host KV tier's memory, reserved
        {"CPU": 1.0, "pdserve_decode": 1, "memory": 1 << 30}]
    tp = RayConfig(ray_gpus_per_worker=4, ray_decode_resource="", ray_decode_accelerator_type="H200")
    assert tp.bundles("decode", "cuda") == [{"CPU": 1.0, "accelerator_type:H200": 0.001, "GPU": 1}] + [{"GPU": 1}] * 3


@pytest.mark.parametrize("kwargs, field", [
    (dict(ray_cpus_per_worker=0), "ray_cpus_per_worker"),
    (dict(ray_gpus_per_worker=-1), "ray_gpus_per_worker"),
    (dict(ray_max_restarts=-2), "ray_max_restarts"),
])
def test_ray_settings_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        RayConfig(**kwargs)


ROUTER_ARGV = """
import json, sys, tempfile
from pathlib import Path
from pdserve import cli
from pdserve.launch.cluster import Cluster, ClusterSpec, LaunchConfig, render_router
from pdserve.launch.ray import RayCluster
from pdserve.launch.ray_config import RayConfig
from pdserve.services.common.flags import from_namespace, to_argv
from pdserve.services.router.config import RouterConfig
from pdserve.services.worker.config import WorkerConfig

args = cli.build_parser().parse_args(["up", *sys.argv[1:]])
spec = ClusterSpec(from_namespace(RouterConfig, args), from_namespace(WorkerConfig, args, role="decode"),
                   from_namespace(LaunchConfig, args))
cluster = RayCluster(spec, from_namespace(RayConfig, args))  # not connected: no Ray started
argv = to_argv(render_router(cluster.spec, Path(tempfile.mkdtemp()) / "router.address", cluster.credentials))
router = from_namespace(RouterConfig, cli.build_parser().parse_args(["router", *argv]))
print(json.dumps({"launcher": spec.launch.launcher, "argv": argv, "http_port": router.http_port,
                  "http_host": router.public_http_host, "child_process": RayCluster._start_routers is Cluster._start_routers}))
"""


def test_the_router_of_a_ray_launch_gets_the_http_api_flags():
    """`pdserve up --launcher ray --http-port 0`: the router is the launcher's child
    process as with --launcher local (RayCluster keeps Cluster's _start_routers, which
    reads the HTTP address the router writes, so `up` prints the `openai` line), and
    its command line carries the HTTP flags, which `pdserve router` parses back. In a
    child process: importing ray here would fix its cluster mode before the Ray
    fixture sets it."""
    import json

    template = str(REPO / "models" / "pdserve-tiny-code" / "chat_template.jinja")
    for http, port, host in ((["--http-port", "0"], 0, "127.0.0.1"),
                             (["--http-port", "8000", "--http-host", "0.0.0.0"], 8000, "0.0.0.0")):
        flags = ["--launcher", "ray", *http, "--chat-template", template]
        proc = subprocess.run([sys.executable, "-c", ROUTER_ARGV, *flags], cwd=REPO, env=child_env(),
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-3000:]
        got = json.loads(proc.stdout.strip().splitlines()[-1])
        assert got["launcher"] == "ray" and got["child_process"]
        assert (got["http_port"], got["http_host"]) == (port, host)
        argv = got["argv"]
        assert argv[argv.index("--http-port") + 1] == str(port)
        assert argv[argv.index("--chat-template") + 1].endswith("chat_template.jinja")


WORKER_ARGV = """
import json, sys
from pdserve import cli
from pdserve.launch.cluster import render_worker
from pdserve.launch.ray import RayCluster, actor_argv, worker_config
from pdserve.launch.ray_config import RayConfig
from pdserve.services.common.flags import from_namespace

args = cli.build_parser().parse_args(["up", *sys.argv[1:]])
cluster = RayCluster(cli.cluster_spec(args), from_namespace(RayConfig, args))  # not connected: no Ray started
got = {}
for index, role in enumerate(("prefill", "mixed", "decode")):
    config = render_worker(cluster.spec, role, f"{role}-0", "127.0.0.1:1", cluster.credentials, index)
    argv = actor_argv(config)
    parsed = worker_config(argv)
    got[role] = {"argv": argv, "parsed": parsed.speculative_config,
                 "storage": [parsed.quantization, parsed.kv_cache_dtype, parsed.gpu_memory_utilization]}
print(json.dumps(got))
"""


def test_ray_actors_of_decoding_roles_get_the_speculative_config():
    """`pdserve up --launcher ray --speculative-config JSON`: the command line each decode
    and mixed actor is handed carries it, and the actor's own parser reads it back;
    prefill actors get none. In a child process, as the router's test above."""

    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1})
    proc = subprocess.run([sys.executable, "-c", WORKER_ARGV, "--launcher", "ray", "--mixed", "1",
                           "--speculative-config", spec], cwd=REPO, env=child_env(), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    for role in ("mixed", "decode"):
        argv = got[role]["argv"]
        assert argv[0] == role and argv[argv.index("--speculative-config") + 1] == spec
        assert got[role]["parsed"] == spec
    assert "--speculative-config" not in got["prefill"]["argv"] and got["prefill"]["parsed"] is None


def test_ray_actors_of_every_role_get_the_same_storage_flags():
    """`pdserve up --launcher ray --quantization Q --kv-cache-dtype D --gpu-memory-utilization F`:
    every actor, prefill included, is handed them and parses them back (a pair's KV pages
    are read as stored)."""
    proc = subprocess.run([sys.executable, "-c", WORKER_ARGV, "--launcher", "ray", "--mixed", "1",
                           "--quantization", "fp8", "--kv-cache-dtype", "fp8_e4m3", "--gpu-memory-utilization", "0.8"],
                          cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    for role in ("prefill", "mixed", "decode"):
        assert got[role]["storage"] == ["fp8", "fp8_e4m3", 0.8], role


# -- on the cluster -----------------------------------------------------------------------------------------


def test_one_prefill_and_one_decode_worker_on_their_nodes(up, ray_cluster, reference):
    _, nodes = ray_cluster
    assert_placed(up, nodes, prefill=1, decode=1)
    before = kv_transfers(up, pb.ROLE_PREFILL)
    assert_greedy_matches_transformers(up.address, reference)
    assert kv_transfers(up, pb.ROLE_PREFILL) > before  # the long prompts crossed from P to D


def test_a_second_router_has_its_own_ports_and_every_worker_and_serves(up, reference):
    """`--routers 2`: two `ready` lines, each router on its own public and Registry
    ports; each actor was handed both Registries (--router A,B) and registered with
    each; both routers serve (the greedy tokens transformers gives)."""
    assert up.stdout_lines == [f"ready {up.address} internal {up.internal}",
                               f"ready {up.second_address} internal {up.second_internal}"]
    assert len({up.address, up.second_address, up.internal, up.second_internal}) == 4
    workers = wait_for(lambda: registered_with_both(up), 30, "both routers to list the same workers")
    assert sorted(w for w, _ in workers) == ["decode-0", "prefill-0"]
    model, tokenizer = reference
    prompt = tokenizer.encode(TEXTS[0])
    want = hf_greedy(model, prompt, 8, eos=False)
    for address in (up.address, up.second_address):
        with Client(address, timeout=120) as client:
            result = collect(client.generate(prompt, max_tokens=8, temperature=0.0, ignore_eos=True))
        assert list(result[0].token_ids) == want, address


def test_scale_to_two_prefill_workers(up, ray_cluster, reference):
    _, nodes = ray_cluster
    began = time.monotonic()
    done = run_scale(up, "--prefill", "2")
    assert done.returncode == 0, done.stderr
    assert "prefill: target 2 live 1 draining 0" in done.stdout  # the target is the router's at once
    took_target = time.monotonic()
    # A new worker is a new process (Ray worker, torch, the model): it joins when it is up.
    wait_for(lambda: pool_sizes(up).live.prefill == 2, 60, "the router to see two prefill workers")
    print(f"scale-up: `pdserve scale` answered in {took_target - began:.1f}s, the new prefill worker joined "
          f"{time.monotonic() - took_target:.1f}s later")
    assert_placed(up, nodes, prefill=2, decode=1)
    assert len(wait_for(lambda: registered_with_both(up), 30, "the second router to list the new worker")) == 3
    assert_greedy_matches_transformers(up.address, reference)


def test_a_killed_decode_actor_is_restarted_and_serves_again(up, reference):
    """SIGKILL the only decode actor mid-stream: Ray restarts it, it registers again,
    and the stream migrates onto it (issue 21): the client's tokens are the
    uninterrupted greedy run's."""
    (victim,) = [w for w in up.list_workers() if w.role == pb.ROLE_DECODE]
    (actor,) = [a for a in actors() if a.pid == victim.pid]
    model, tokenizer = reference
    prompt = tokenizer.encode(TEXTS[0])
    want = hf_greedy(model, prompt, 300, eos=False)
    with Client(up.address, timeout=120) as client:
        stream = Stream(client, prompt, max_tokens=300, temperature=0.0, ignore_eos=True)
        wait_for(lambda: stream.tokens, 60, "the stream to start")
        killed_at = time.monotonic()
        os.kill(victim.pid, signal.SIGKILL)

        def back() -> pb.WorkerInfo | None:
            return next((w for w in up.list_workers() if w.worker_id == victim.worker_id and w.pid != victim.pid),
                        None)

        reborn = wait_for(back, 30, "Ray to restart the decode actor and it to register again")
        back_after = time.monotonic() - killed_at
        wait_for(lambda: (victim.worker_id, reborn.pid) in registered_with_both(up), 30,
                 "the restarted decode actor to register with the second router too")
        stream.join(120)
        assert stream.error is None, stream.error
        assert stream.tokens == want
        result = collect(client.generate(TEXTS[0], max_tokens=8, temperature=0.0))
        assert len(result[0].token_ids) >= 1
    print(f"decode actor back {back_after:.1f}s after SIGKILL; its stream migrated onto it")
    assert back_after < 30
    (restarted,) = [a for a in actors() if a.actor_id == actor.actor_id]
    assert restarted.pid == reborn.pid and restarted.num_restarts >= 1 and restarted.node_id == actor.node_id
    assert not pid_alive(victim.pid)


def test_scaling_down_drains_without_losing_a_request(up, reference):
    assert run_scale(up, "--decode", "2", "--wait", "60").returncode == 0
    model, tokenizer = reference
    prompt = tokenizer.encode(TEXTS[1])
    want = hf_greedy(model, prompt, 200, eos=False)
    decode = {w.worker_id: w for w in up.list_workers() if w.role == pb.ROLE_DECODE}
    assert sorted(decode) == ["decode-0", "decode-1"]
    with Client(up.address, timeout=180) as client:
        streams = [Stream(client, prompt, max_tokens=200, temperature=0.0, ignore_eos=True) for _ in range(6)]
        wait_for(lambda: all(up.stats(w.address).num_running > 0 for w in decode.values()), 60,
                 "both decode workers to run streams")
        done = run_scale(up, "--decode", "1")
        assert done.returncode == 0, done.stderr
        began = time.monotonic()  # the router has the new target
        wait_for(lambda: pool_sizes(up).live.decode == 1, 10, "the router to see one decode worker")
        print(f"scale-down seen by the router {time.monotonic() - began:.1f}s after it took the target")
        assert pool_sizes(up).draining.decode == 1  # decode-1, the newest, finishes what it has
        for s in streams:
            s.join(180)
    assert [s.error for s in streams] == [None] * 6
    assert all(s.tokens == want for s in streams)
    wait_for(lambda: [w.worker_id for w in up.list_workers() if w.role == pb.ROLE_DECODE] == ["decode-0"], 30,
             "the drained worker to be gone")
    # The launcher stops the actor after its drain (Worker.stop, then ray.kill); the
    # state API reports that a moment later, longer on a loaded machine.
    wait_for(lambda: [a.state for a in actors(alive_only=False) if a.pid == decode["decode-1"].pid] == ["DEAD"], 30,
             "the drained decode actor to be DEAD")


def test_sigterm_stops_what_the_launcher_started_and_nothing_else(up, ray_cluster):
    import ray
    from ray.util.state import list_placement_groups

    ours = [a.actor_id for a in actors()]
    assert len(ours) == 3  # 2 prefill + 1 decode
    router_pids = up.children()  # the actors are Ray's processes, not the launcher's children
    assert len(router_pids) == 2  # the two routers
    assert up.stop() == 0
    assert up.stdout_lines == [f"ready {up.address} internal {up.internal}",
                               f"ready {up.second_address} internal {up.second_internal}"]
    wait_for(lambda: not actors(), 15, "the launcher's actors to be gone")
    assert not any(pid_alive(pid) for pid in router_pids)
    assert not [g for g in list_placement_groups(detail=True, limit=1000) if g.state != "REMOVED"]
    assert sum(node["Alive"] for node in ray.nodes()) == 3  # the cluster itself is untouched


def test_startup_fails_clearly_when_no_node_offers_a_pool_resource(ray_cluster, tmp_path):
    """An explicit HOST:PORT, with only the token in the environment: the launcher
    turns token mode on itself. No node offers the prefill resource asked for: the
    launcher waits out its --startup-timeout (10 s: the router is up well within it,
    and the prefill worker's placement group stays PENDING however long it waits)."""
    cluster, _ = ray_cluster
    env = child_env()
    env.pop("RAY_AUTH_MODE")
    done = subprocess.run(
        [sys.executable, "-m", "pdserve", "up", "--launcher", "ray", "--address", cluster.address, "--port", "0",
         "--ray-prefill-resource", "pdserve_h100", "--startup-timeout", "10", "--num-blocks", "64"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=180,
    )
    assert done.returncode == 1 and done.stdout == ""
    assert "prefill-0 (no node offers [{'CPU': 1.0, 'pdserve_h100': 1}])" in done.stderr, done.stderr[-3000:]
    wait_for(lambda: not actors(), 15, "the started decode actor to be stopped")
