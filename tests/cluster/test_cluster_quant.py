"""Quantized workers end to end: real processes started by `pdserve up` (and prefill
workers started by hand), KV pages from prefill to decode workers over ZeroMQ
tcp (CURVE), every prompt crossing (local prefill threshold 0), tokens checked against
the engine run in this process with the same flags.

Three clusters, started together once:
  `fp8`       1 prefill + 1 decode worker with --kv-cache-dtype fp8: greedy output is
              the FP8 engine's (pages move as stored, never converted), and what
              crosses is a quarter of float32's bytes;
  `int8`      1 prefill + 1 decode worker with --quantization int8: the int8 engine's;
  `mismatch`  a decode worker with the model's KV dtype and full-precision weights,
              joined in turn by a prefill worker with --kv-cache-dtype fp8 and one with
              --quantization int8: neither pairs with it, the request fails at once
              with FAILED_PRECONDITION naming both layouts, and no block stays taken.
The decode worker's pages against the prefill worker's, byte for byte, are compared in
tests/kvtransfer/test_kv_fp8.py (an engine pair through the real ZeroMQ connector).
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest
import torch

from cluster_helpers import REPO, UpProcess, all_blocks_free, child_env, wait_for
from pdserve.engine import LLM, SamplingParams
from pdserve.proto.pdserve.v1 import pdserve_pb2 as pb
from pdserve.services.router.client import Client, collect

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


@contextmanager
def joined(up: UpProcess, log_dir: Path, worker_id: str, *flags: str) -> Iterator[pb.WorkerInfo]:
    """A prefill worker started by hand with `flags`, registered with `up` (with the
    launch's credentials) for the block, then stopped and gone from the router."""
    kv = up.secrets / "kv"
    log = open(log_dir / f"{worker_id}.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdserve", "prefill", "--port", "0", "--router", up.internal, "--worker-id", worker_id,
         "--num-blocks", "64", "--kv-connector", "zmq", *flags,
         "--cluster-token-file", str(up.secrets / "cluster-token"), "--kv-curve-cert", str(kv / "prefill.key_secret"),
         "--kv-curve-authorized", str(kv / "senders")],
        cwd=REPO, env=child_env(), stdin=subprocess.DEVNULL, stdout=log, stderr=log)
    try:
        yield wait_for(lambda: next((w for w in up.list_workers() if w.worker_id == worker_id and w.kv_endpoint),
                                    None), 60, f"{worker_id} to register")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        log.close()
        wait_for(lambda: worker_id not in {w.worker_id for w in up.list_workers()}, 10, f"{worker_id} to leave")


@pytest.fixture(scope="module")
def fp32_greedy():
    """The full-precision engine's output: the quantized runs differ from it (so each
    comparison below tells one configuration from another)."""
    return engine_greedy(PROMPTS)[0]


def engine_greedy(prompts: list[str], **flags) -> tuple[list[list[int]], LLM]:
    """What the engine alone generates with these flags (every prompt prefilled where it decodes)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        llm = LLM(num_blocks=128, **flags)
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params)], llm
    finally:
        torch.set_num_threads(before)


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


def refused(up: UpProcess, prefill: pb.WorkerInfo) -> str:
    """A request through a decode worker and `prefill`, which must refuse to pair:
    it fails at once, and no block stays taken on either side. The refusal's message."""
    decode = next(w for w in up.list_workers() if w.role == pb.ROLE_DECODE)
    started = time.monotonic()
    with Client(up.address, timeout=30) as client:
        with pytest.raises(grpc.RpcError) as err:
            collect(client.generate(PROMPTS[1], max_tokens=4, temperature=0.0))
    assert time.monotonic() - started < 10
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION, err.value.details()
    for w in (prefill, decode):
        wait_for(lambda: all_blocks_free(w.address, up.auth), 10, f"{w.worker_id}'s blocks to be free")
    assert up.stats(decode.address).kv_transfers == up.stats(prefill.address).kv_transfers == 0
    return err.value.details()


def test_fp8_and_model_dtype_workers_refuse_to_pair(clusters, tmp_path):
    """The prefill worker refuses the decode worker's plan before a page leaves,
    naming both sides' pages; the decode worker's reservation is freed."""
    with joined(clusters["mismatch"], tmp_path, "prefill-fp8", "--kv-cache-dtype", "fp8") as prefill:
        message = refused(clusters["mismatch"], prefill)
    assert re.search(r"transfer_plan\.layout: dtype( and kv_format)? differ: the decode worker holds float32 pages "
                     r".* the prefill worker float8_e4m3fn pages", message), message


def test_workers_with_other_weights_refuse_to_pair(clusters, tmp_path):
    """The same KV dtype, other weights (so other K and V): refused all the same."""
    with joined(clusters["mismatch"], tmp_path, "prefill-int8", "--quantization", "int8") as prefill:
        message = refused(clusters["mismatch"], prefill)
    assert re.search(r"transfer_plan\.layout: kv_format differ: the decode worker holds float32 pages .*"
                     r"\(weights=float32\), the prefill worker float32 pages .*\(weights=int8/online\)", message), message
