"""What `pdserve up` hands each worker (launch/cluster.py render_worker) and the local
launcher's command lines (launch/local.py), without starting a process."""

from __future__ import annotations

import json

import pytest

from pdserve import cli
from pdserve.launch.cluster import render_worker
from pdserve.launch.credentials import generate
from pdserve.launch.local import worker_argv
from pdserve.services.common.flags import from_namespace
from pdserve.services.worker.config import WorkerConfig

SPEC = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1})


def up_spec(*argv: str):
    return cli.cluster_spec(cli.build_parser().parse_args(["up", *argv]))


def test_up_gives_the_speculative_config_to_decode_and_mixed_workers_only(tmp_path):
    """`pdserve up --speculative-config JSON`: each decode and mixed worker's command line
    carries it, and parses back to it; prefill workers, which never decode, get none."""
    spec = up_spec("--speculative-config", SPEC, "--mixed", "1")
    credentials = generate(tmp_path / "secrets", spec.router.credentials)
    for index, role in enumerate(("prefill", "mixed", "decode")):
        argv = worker_argv(render_worker(spec, role, f"{role}-0", "127.0.0.1:1", credentials, index))
        child = cli.build_parser().parse_args(argv)  # what `python -m pdserve ROLE ...` parses
        config = from_namespace(WorkerConfig, child, role=child.command)
        assert config.speculative_config == (None if role == "prefill" else SPEC), role
        assert ("--speculative-config" in argv) == (role != "prefill"), role


def test_up_without_the_flag_speculates_nowhere(tmp_path):
    spec = up_spec()
    credentials = generate(tmp_path / "secrets", spec.router.credentials)
    argv = worker_argv(render_worker(spec, "decode", "decode-0", "127.0.0.1:1", credentials, 0))
    assert "--speculative-config" not in argv


def test_up_refuses_a_bad_speculative_config_naming_the_key():
    with pytest.raises(ValueError, match=r"^speculative_config\.num_speculative_tokens: "):
        up_spec("--speculative-config", '{"method": "ngram", "num_speculative_tokens": -1}')


@pytest.mark.parametrize("flags,want", [
    ([], (None, "auto", 0.9)),
    (["--quantization", "int4", "--kv-cache-dtype", "fp8_e5m2", "--gpu-memory-utilization", "0.8"],
     ("int4", "fp8_e5m2", 0.8)),
], ids=["defaults", "given"])
def test_up_gives_every_role_the_same_storage_flags(tmp_path, flags, want):
    """`pdserve up --quantization Q --kv-cache-dtype D --gpu-memory-utilization F`: every
    worker, prefill, mixed and decode alike, runs with them (a pair's KV pages are read
    as stored), and its engine config takes them."""
    spec = up_spec(*flags, "--mixed", "1")
    credentials = generate(tmp_path / "secrets", spec.router.credentials)
    for index, role in enumerate(("prefill", "mixed", "decode")):
        argv = worker_argv(render_worker(spec, role, f"{role}-0", "127.0.0.1:1", credentials, index))
        child = cli.build_parser().parse_args(argv)
        engine = from_namespace(WorkerConfig, child, role=child.command).engine_config()
        assert (engine.quantization, engine.kv_cache_dtype, engine.gpu_memory_utilization) == want, role


@pytest.mark.parametrize("flag,value,field", [
    ("--quantization", "int3", "quantization"),
    ("--kv-cache-dtype", "fp16", "kv_cache_dtype"),
    ("--gpu-memory-utilization", "0", "gpu_memory_utilization"),
])
def test_up_refuses_bad_storage_flags_naming_the_field(flag, value, field):
    with pytest.raises(ValueError, match=rf"^{field}: "):
        up_spec(flag, value)


def test_up_gives_every_worker_the_kv_tiers_and_a_disk_directory_of_its_own(tmp_path):
    """`pdserve up --kv-offload-host-bytes B --kv-offload-dir D ...`: every worker's
    command line carries the tiers; each keeps its disk tier in D/<its worker id>."""
    tiers = str(tmp_path / "tiers")
    spec = up_spec("--mixed", "1", "--kv-offload-host-bytes", str(1 << 26), "--kv-offload-dir", tiers,
                   "--kv-offload-disk-bytes", str(1 << 30), "--kv-offload-policy", "arc", "--kv-offload-persist")
    credentials = generate(tmp_path / "secrets", spec.router.credentials)
    dirs = set()
    for index, role in enumerate(("prefill", "mixed", "decode")):
        argv = worker_argv(render_worker(spec, role, f"{role}-0", "127.0.0.1:1", credentials, index))
        child = cli.build_parser().parse_args(argv)
        engine = from_namespace(WorkerConfig, child, role=child.command).engine_config()
        assert (engine.kv_offload_host_bytes, engine.kv_offload_disk_bytes, engine.kv_offload_policy,
                engine.kv_offload_persist) == (1 << 26, 1 << 30, "arc", True), role
        assert engine.kv_offload_dir == f"{tiers}/{role}-0", role
        dirs.add(engine.kv_offload_dir)
    assert len(dirs) == 3
    plain = up_spec()
    config = render_worker(plain, "decode", "decode-0", "127.0.0.1:1", credentials, 0)
    assert config.kv_offload_dir is None and not config.engine_config().kv_offload  # tiers off


def test_up_refuses_host_tiers_that_together_exceed_this_machine():
    """Each worker checks its own tier against the machine; `pdserve up --launcher local`
    starts them all on it, so their sum must fit too."""
    from pdserve.engine.offload.config import physical_memory

    memory = physical_memory()
    share = str(memory // 3)
    up_spec("--kv-offload-host-bytes", share)  # two workers: two thirds of it
    with pytest.raises(ValueError, match=r"^kv_offload_host_bytes: 4 workers on this machine x "):
        up_spec("--prefill", "2", "--decode", "2", "--kv-offload-host-bytes", share)


def test_each_router_gets_ports_of_its_own(tmp_path):
    """`pdserve up --routers N` with fixed ports: router i on --port + 2i (its Registry
    beside it), --http-port and --metrics-port + i; 0 stays any free port."""
    from pdserve.launch.cluster import render_router

    spec = up_spec("--routers", "2", "--port", "7000", "--http-port", "8000", "--metrics-port", "9000")
    credentials = generate(tmp_path / "secrets", spec.router.credentials)
    ports = [(c.port, c.registry_port, c.http_port, c.metrics_port)
             for c in (render_router(spec, tmp_path / f"r{i}", credentials, i) for i in range(2))]
    assert ports == [(7000, 7001, 8000, 9000), (7002, 7003, 8001, 9001)]
    spec = up_spec("--routers", "2", "--port", "0")
    assert {render_router(spec, tmp_path / "r", credentials, i).registry_port for i in range(2)} == {0}
