"""Quantized workers end to end: real processes started by `pdserve up` (and prefill
workers started by hand), KV pages from prefill to decode workers over ZeroMQ
tcp (CURVE), every prompt crossing (local prefill threshold 0), tokens checked against
the engine run in this process with the same flags.

Three clusters, started together once:
  `fp8`       1 prefill + 1 decode worker with --kv-cache-dtype fp8: greedy output is
              the FP8 engine's (pages move as stored, never converted), and what
              crosses is a quarter of float32's bytes;
  `int8`      1 prefill + 1 decode worker with --quantization int8: the int8 engine's;
  `mismatch`  a decode worker with the model's KV dtype and full-precision weights; a
              prefill worker started by hand with --kv-cache-dtype fp8, and one with
              --quantization int8, are each refused at registration (the router
              compares their kv_layout with the registered workers'), exit naming
              both layouts, and the cluster serves on.
The decode worker's pages against the prefill worker's, byte for byte, and the
reservation-time refusal of a pair whose layouts differ (the second line of defence,
for workers that met without this router's check) are in tests/services/worker/test_worker_kv_fp8.py
(an engine pair through the real ZeroMQ connector).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from cluster_helpers import UpProcess, all_blocks_free, wait_for
from engine_helpers import one_thread  # noqa: F401 (an autouse fixture: one torch thread)
from forked_pdserve import ForkedProcess, spawn_pdserve
from pdserve.engine import LLM, SamplingParams
from pdserve.proto.pdserve.v1 import pdserve_pb2 as pb
from pdserve.services.router.client import Client, collect

pytestmark = pytest.mark.cluster(seconds=45)

COMMON = ["--num-blocks", "128", "--local-prefill-threshold", "0"]  # every prompt crosses
CLUSTERS = {
    "fp8": ["--kv-cache-dtype", "fp8", *COMMON],
    "int8": ["--quantization", "int8", *COMMON],
    "mismatch": ["--prefill", "0", *COMMON],  # its prefill worker joins by hand, with FP8 pages
}
MAX_TOKENS = 12


def code(name: str, lines: int) -> str:
    """A distinct code-like prompt (its first block differs from every other's)."""
    body = "".join(f"    {name}_{k} = compute({k}, '{name}')  # step {k}\n" for k in range(lines))
    return f"def {name}(data):\n{body}"


PROMPTS = [code("alpha", 3), code("beta", 9), "def fib(n):\n    return fib(n - 1) + fib(n - 2)\n"]


@pytest.fixture(scope="module")
def clusters(tmp_path_factory):
    """The three launches, started side by side (each takes seconds to come up)."""
    with ThreadPoolExecutor(len(CLUSTERS)) as pool:
        futures = {name: pool.submit(UpProcess, args, tmp_path_factory.mktemp(name) / "up.log")
                   for name, args in CLUSTERS.items()}
    ups = {name: f.result() for name, f in futures.items() if f.exception() is None}
    try:
        for f in futures.values():
            f.result()  # raises the first launch's failure (the others are stopped below)
        yield ups
    finally:
        for up in ups.values():
            up.stop()


def start_prefill(up: UpProcess, log_dir: Path, worker_id: str, *flags: str) -> tuple[ForkedProcess, Path]:
    """A prefill worker started by hand with `flags` (a process forked: tests/forked_pdserve.py),
    registering with `up` (with the launch's credentials); its log's path."""
    kv = up.secrets / "kv"
    log = log_dir / f"{worker_id}.log"
    proc = spawn_pdserve(
        ["prefill", "--port", "0", "--router", up.internal, "--worker-id", worker_id, "--num-blocks", "64",
         "--kv-connector", "zmq", *flags, "--cluster-token-file", str(up.secrets / "cluster-token"),
         "--kv-curve-cert", str(kv / "prefill.key_secret"), "--kv-curve-authorized", str(kv / "senders")],
        log, stdout_to_log=True)
    return proc, log


@pytest.fixture(scope="module")
def fp32_greedy():
    """The full-precision engine's output: the quantized runs differ from it (so each
    comparison below tells one configuration from another)."""
    return engine_greedy(PROMPTS)[0]


def engine_greedy(prompts: list[str], **flags) -> tuple[list[list[int]], LLM]:
    """What the engine alone generates with these flags (every prompt prefilled where it decodes)."""
    llm = LLM(num_blocks=128, **flags)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)], llm


def serve(up: UpProcess, prompts: list[str]) -> list[list[int]]:
    with Client(up.address, timeout=60) as client, ThreadPoolExecutor(len(prompts)) as pool:
        results = pool.map(lambda p: collect(client.generate(p, max_tokens=MAX_TOKENS, temperature=0.0)), prompts)
        return [list(seq.token_ids) for (seq,) in (r.values() for r in results)]


def pair(up: UpProcess) -> tuple[pb.WorkerInfo, pb.WorkerInfo]:
    by_role = {w.role: w for w in up.list_workers()}
    return by_role[pb.ROLE_PREFILL], by_role[pb.ROLE_DECODE]


def settled(up: UpProcess, prefill: pb.WorkerInfo, decode: pb.WorkerInfo, transfers: int) -> None:
    """Every transfer acknowledged, and both workers' blocks free again."""
    wait_for(lambda: up.stats(prefill.address).kv_transfers == transfers, 10, "every transfer to be acknowledged")
    for w in (prefill, decode):
        wait_for(lambda: all_blocks_free(w.address, up.auth), 10, f"{w.worker_id}'s blocks to be free")


def test_fp8_kv_crosses_as_stored_and_decodes_as_the_engine_does(clusters, fp32_greedy):
    """Greedy output through prefill + decode with FP8 pages is the FP8 engine's, and
    each prompt block crosses as one FP8 page per layer: a quarter of float32's."""
    up = clusters["fp8"]
    want, llm = engine_greedy(PROMPTS, kv_cache_dtype="fp8")
    assert serve(up, PROMPTS) == want != fp32_greedy
    prefill, decode = pair(up)
    settled(up, prefill, decode, len(PROMPTS))
    cfg, bs = llm.engine.model_config, llm.engine.runner.block_size
    page = 2 * bs * cfg.num_kv_heads * cfg.head_dim  # one byte an element
    blocks = sum(-(-len(llm.engine.tokenizer.encode(p)) // bs) for p in PROMPTS)
    sent, received = up.stats(prefill.address), up.stats(decode.address)
    assert received.kv_transfers == len(PROMPTS) and received.kv_transfer_failures == sent.kv_transfer_failures == 0
    assert sent.kv_transfer_bytes == received.kv_transfer_bytes == blocks * cfg.num_layers * page
    assert llm.engine.runner.kv_cache.element_size() == 1 and received.num_blocks == 128


def test_int8_weights_on_both_sides_decode_as_the_engine_does(clusters, fp32_greedy):
    up = clusters["int8"]
    want, _ = engine_greedy(PROMPTS, quantization="int8")
    assert serve(up, PROMPTS) == want != fp32_greedy
    settled(up, *pair(up), len(PROMPTS))


@pytest.mark.parametrize(("worker_id", "flags", "layout"), [
    ("prefill-fp8", ("--kv-cache-dtype", "fp8"), "float8_e4m3fn;weights=float32;kv_scales="),
    ("prefill-int8", ("--quantization", "int8"), "float32;weights=int8/online"),
])
def test_a_worker_whose_kv_pages_differ_is_refused_at_registration(clusters, tmp_path, worker_id, flags, layout):
    """Other KV pages (FP8, or the same dtype computed by other weights) would be
    misread by the decode worker: the router refuses the worker, which exits saying why,
    and the cluster goes on serving."""
    up = clusters["mismatch"]
    proc, log = start_prefill(up, tmp_path, worker_id, *flags)
    try:
        assert proc.wait(90) != 0
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text(errors="replace")
    assert "refused registration: worker.kv_layout" in text and layout in text, text[-2000:]
    assert "the registered workers hold 'float32;weights=float32'" in text, text[-2000:]
    assert worker_id not in {w.worker_id for w in up.list_workers()}
    with Client(up.address, timeout=60) as client:  # the decode worker prefills it itself
        (seq,) = collect(client.generate(PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0.0)).values()
    assert list(seq.token_ids) == engine_greedy(PROMPTS[:1])[0][0]
