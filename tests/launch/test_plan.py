"""`pdserve plan` (launch/plan.py): its numbers are what a worker started with the same
flags reports at start (`memory: ...`), for full-precision and quantized storage (both
as real processes); the table shows the alternatives; bad flags exit 2 naming the field
(those in this process, through cli.main)."""

from __future__ import annotations

import json
import re
import signal
from pathlib import Path

import pytest

from cluster_helpers import wait_for
from forked_pdserve import ForkedProcess, spawn_pdserve
from hf_models import build_model
from pdserve import cli
from pdserve.engine.memory import plan_memory

pytestmark = pytest.mark.cluster(seconds=25)

KV_BYTES = 3_000_000  # the KV budget of the worker and of the plan (a CPU: no device memory)
MAX_MODEL_LEN = 256
MEMORY_LINE = re.compile(
    r"memory: weights (?P<weight_bytes>\d+) bytes \((?P<weight_scheme>[^)]+)\), activation peak "
    r"(?P<activation_peak_bytes>\d+) bytes, kv (?P<kv_cache_dtype>\S+) (?P<kv_bytes_per_token>\d+) bytes/token, "
    r"(?P<num_blocks>\d+) blocks of (?P<block_size>\d+) \((?P<kv_cache_bytes>\d+) bytes\), max concurrency "
    r"(?P<max_concurrency>\d+) at max_model_len (?P<max_model_len>\d+)")
STORAGE = {"full precision": [], "int8 + fp8 KV": ["--quantization", "int8", "--kv-cache-dtype", "fp8"]}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("plan") / "model"
    build_model(path)
    return path


def plan_here(capsys, model_dir: Path, *flags: str) -> tuple[int, str, str]:
    """`pdserve plan` in this process: (exit status, stdout, stderr)."""
    capsys.readouterr()
    code = cli.main(["plan", "--model", str(model_dir), *flags])
    out, err = capsys.readouterr()
    return code, out, err


def plan_rows(capsys, model_dir: Path, *flags: str) -> list[dict]:
    """`pdserve plan --json` through the command line's own entry point (cli.main), in
    this process: the workers it is compared with are the processes of their own."""
    code, out, err = plan_here(capsys, model_dir, "--json", *flags)
    assert code == 0, err[-3000:]
    return json.loads(out)


def start_worker(model_dir: Path, flags: list[str], log: Path) -> ForkedProcess:
    """`pdserve mixed` standalone: no router, so it only loads, logs and serves (a process
    of its own, forked: tests/forked_pdserve.py)."""
    return spawn_pdserve(
        ["mixed", "--model", str(model_dir), "--port", "0", "--no-metrics", "--kv-cache-memory", str(KV_BYTES),
         "--max-model-len", str(MAX_MODEL_LEN), *flags], log)


def reported(proc: ForkedProcess, log: Path) -> dict[str, int | str]:
    def line():
        assert proc.poll() is None, f"the worker exited: {log.read_text()[-3000:]}"
        return MEMORY_LINE.search(log.read_text())

    found = wait_for(line, 120, "the worker's memory line").groupdict()
    return {k: v if k in ("weight_scheme", "kv_cache_dtype") else int(v) for k, v in found.items()}


def test_plan_agrees_with_the_workers_own_report(model_dir, tmp_path, capsys):
    """Each storage choice: the plan's row for those flags has the weight bytes, scheme,
    activation peak, KV dtype and bytes per token, blocks and max concurrency that a
    worker started with the same flags logs."""
    workers = {name: start_worker(model_dir, flags, tmp_path / f"{i}.log") for i, (name, flags) in
               enumerate(STORAGE.items())}
    try:
        for i, (name, flags) in enumerate(STORAGE.items()):
            worker = reported(workers[name], tmp_path / f"{i}.log")
            rows = plan_rows(capsys, model_dir, "--kv-cache-memory", str(KV_BYTES), "--max-model-len", str(MAX_MODEL_LEN),
                             "--concurrency", "100", *flags)
            given = rows[0]
            assert given["given"] and not any(r["given"] for r in rows[1:])
            assert {k: given[k] for k in worker} == worker, name
            assert given["sequences_per_worker"] == worker["max_concurrency"]
            assert given["workers"] == -(-100 // worker["max_concurrency"])
    finally:
        for proc in workers.values():
            proc.send_signal(signal.SIGTERM)
        for proc in workers.values():
            proc.wait(30)


def test_rows_compare_the_alternatives(model_dir, capsys):
    """The given choice first, then every KV dtype with and without the weight
    quantization: fp8 pages are a quarter of fp32's, so four times the blocks fit (up to
    the cap of --max-num-seqs full-length sequences), and a prompt ships a quarter."""
    code, out, _ = plan_here(capsys, model_dir, "--json", "--quantization", "int8", "--kv-cache-dtype", "fp8_e5m2",
                             "--kv-cache-memory", "1000000", "--max-model-len", "256", "--concurrency", "40",
                             "--prompt-len", "100", "--output-len", "28")
    assert code == 0
    rows = json.loads(out)
    assert [(r["flags"]["quantization"], r["flags"]["kv_cache_dtype"]) for r in rows] == [
        ("int8", "fp8_e5m2"), ("int8", "auto"), ("int8", "fp8_e4m3"),
        (None, "fp8_e5m2"), (None, "auto"), (None, "fp8_e4m3")]
    by = {(r["flags"]["quantization"], r["flags"]["kv_cache_dtype"]): r for r in rows}
    full, fp8 = by[(None, "auto")], by[(None, "fp8_e4m3")]
    assert (full["kv_cache_dtype"], fp8["kv_cache_dtype"], full["weight_scheme"]) == ("float32", "float8_e4m3fn",
                                                                                      "float32")
    assert full["kv_bytes_per_token"] == 4 * fp8["kv_bytes_per_token"]
    assert fp8["num_blocks"] == 1000000 // fp8["kv_bytes_per_block"]
    assert full["kv_bytes_shipped"] == 4 * fp8["kv_bytes_shipped"] == 7 * full["kv_bytes_per_block"]  # 100 tokens
    assert by[("int8", "auto")]["weight_bytes"] < full["weight_bytes"] / 2  # norms stay fp32 in so small a model
    for r in rows:
        assert r["sequence_tokens"] == 128
        assert r["sequences_per_worker"] == min(r["num_blocks"] // 8, 256)
        assert r["workers"] == -(-40 // r["sequences_per_worker"])


def test_gpu_memory_budget_is_utilization_minus_weights_and_activations(model_dir, capsys):
    code, out, _ = plan_here(capsys, model_dir, "--json", "--gpu-memory", "0.05", "--gpu-memory-utilization", "0.5",
                             "--max-model-len", "1024", "--concurrency", "8", "--max-num-seqs", "10000")
    assert code == 0
    rows = json.loads(out)
    for r in rows:
        budget = int(0.05 * (1 << 30) * 0.5) - r["weight_bytes"] - r["activation_peak_bytes"]
        assert r["num_blocks"] == budget // r["kv_bytes_per_block"], r


def test_table_marks_the_given_choice(model_dir, capsys):
    code, out, _ = plan_here(capsys, model_dir, "--kv-cache-dtype", "fp8", "--kv-cache-memory", "1000000",
                             "--max-model-len", "256", "--concurrency", "8", "--prompt-len", "64", "--output-len", "64")
    assert code == 0
    lines = out.splitlines()
    assert "KV budget per worker: --kv-cache-memory" in out
    header = next(i for i, line in enumerate(lines) if "weight bytes" in line)
    rows = lines[header + 1: header + 4]
    assert rows[0].startswith("*") and "fp8 (float8_e4m3fn)" in rows[0]
    assert [("auto (float32)" in r, "fp8_e5m2" in r) for r in rows[1:]] == [(True, False), (False, True)]


def test_choices_that_do_not_fit_say_why(model_dir, capsys):
    """A device too small for the full-precision weights: their rows say so and why;
    the int8 rows, a quarter the weights, still fit."""
    code, out, _ = plan_here(capsys, model_dir, "--json", "--quantization", "int8", "--max-model-len", "256",
                             "--concurrency", "4", "--gpu-memory", "0.00709")
    assert code == 0
    rows = json.loads(out)
    full = plan_memory(str(model_dir), max_model_len=256, kv_cache_memory=1 << 20)
    assert full.weight_bytes + full.activation_peak_bytes > int(0.00709 * (1 << 30) * 0.9)  # the case's premise
    fits = {r["flags"]["quantization"]: r["error"] is None for r in rows}
    assert fits == {"int8": True, None: False}
    assert all(r["error"].startswith("gpu_memory_utilization: ") for r in rows if r["flags"]["quantization"] is None)
    code, out, _ = plan_here(capsys, model_dir, "--quantization", "int8", "--max-model-len", "256",
                             "--concurrency", "4", "--gpu-memory", "0.00709")
    assert "does not fit" in out and "float32 + auto: gpu_memory_utilization: " in out


def test_the_kv_tiers_show_beside_each_row(model_dir, capsys):
    """--kv-offload-host-bytes / --kv-offload-disk-bytes: each row holds the tiers' bytes
    as a worker with those flags allocates them (the host tier in whole blocks of the
    row's size, so fp8 rows keep more of them), and the table says so."""
    flags = ("--kv-cache-memory", "1000000", "--max-model-len", "256", "--concurrency", "8",
             "--kv-offload-host-bytes", "5000000", "--kv-offload-disk-bytes", str(1 << 30))
    code, out, _ = plan_here(capsys, model_dir, "--json", *flags)
    assert code == 0
    rows = {r["flags"]["kv_cache_dtype"]: r for r in json.loads(out)}
    for r in rows.values():
        assert r["host_tier_bytes"] == 5000000 // r["kv_bytes_per_block"] * r["kv_bytes_per_block"]
        assert r["disk_tier_bytes"] == 1 << 30
        expected = plan_memory(str(model_dir), max_model_len=256, kv_cache_memory=1000000,
                               kv_cache_dtype=r["flags"]["kv_cache_dtype"], kv_offload_host_bytes=5000000,
                               kv_offload_disk_bytes=1 << 30)
        assert (r["host_tier_bytes"], r["disk_tier_bytes"]) == (expected.host_tier_bytes, expected.disk_tier_bytes)
    assert rows["fp8_e4m3"]["host_tier_bytes"] // rows["fp8_e4m3"]["kv_bytes_per_block"] >= \
        4 * (rows["auto"]["host_tier_bytes"] // rows["auto"]["kv_bytes_per_block"])
    code, out, _ = plan_here(capsys, model_dir, *flags)
    assert "KV tiers per worker, beside the device's: host memory 4.77 MiB" in out and "disk 1.00 GiB" in out
    given = next(line for line in out.splitlines() if line.startswith("*"))
    blocks = rows["auto"]["host_tier_bytes"] // rows["auto"]["kv_bytes_per_block"]
    assert given.endswith(f"{blocks} blocks")
    code, out, _ = plan_here(capsys, model_dir, *flags[:6])
    assert "KV tiers" not in out and "host tier" not in out  # without tiers: the table as before


@pytest.mark.parametrize("flags, message", [
    ([], "concurrency: must be given"),
    (["--concurrency", "4", "--kv-offload-host-bytes", "-1"], "kv_offload_host_bytes: must be >= 0"),
    (["--concurrency", "4", "--prompt-len", "10"], "prompt_len: --prompt-len and --output-len go together"),
    (["--concurrency", "4", "--quantization", "int3"], "quantization: must be one of"),
    (["--concurrency", "4", "--kv-cache-dtype", "fp16"], "kv_cache_dtype: unknown 'fp16'"),
    (["--concurrency", "4", "--max-model-len", "64", "--prompt-len", "60", "--output-len", "10"],
     "prompt_len: + --output-len exceeds max_model_len 64"),
    (["--concurrency", "4", "--gpu-memory", "0.001"], "gpu_memory_utilization: 0.9 of"),
])
def test_bad_flags_exit_2_naming_the_field(model_dir, flags, message, capsys):
    code, out, err = plan_here(capsys, model_dir, *flags)
    assert code == 2, (out, err)
    assert f"pdserve: {message}" in err
