"""Offline throughput benchmark: pdserve's `engine.LLM` against two transformers baselines.

Run it with `python -m pdserve.bench.engine.offline` (about 6-8 minutes on 2 CPU cores),
`python -m pdserve.bench.engine.offline --quick` (a tiny model and 8 requests, well under a minute)
or `python -m pdserve.bench.engine.offline --gpu` (on cuda: bench/gpu_benchmarks.md).

Everything happens in one process and one run:

1. A random-initialised ~100M-parameter Llama (fp32, seeded) is saved in Hugging Face
   format to a temporary directory, which is removed at the end.
2. A seeded workload is drawn: prompts of random token ids (never the special ids 0-2)
   and a per-request number of new tokens. EOS is ignored by every system, so each one
   produces exactly the requested number of tokens for every request.
3. Three systems run the same workload on the same weights, each after a short warm-up
   and timed with `time.perf_counter` around the generation only (model loading and KV
   cache allocation are outside the timed region for all three). Both paged caches are
   sized to hold the whole workload at once, so neither system preempts. This is
   repeated `--repeats` times (3), interleaved: each repetition draws a new workload
   (seed + repetition, so no prefix cache can reuse an earlier one) and runs ours,
   HF generate, HF continuous batching on it, one after the other; every ratio is
   taken within a repetition and reported as the median with its min-max
   (bench/common/repeat.py), so a stray process on the machine moves one repetition, not
   the figure:

   * `engine.LLM` (ours), one `SamplingParams(max_tokens=n_i, temperature=0, ignore_eos=True)`
     per request.
   * transformers `model.generate` in static batches (left padding, pad id 0), each batch
     running to the longest `max_new_tokens` of its members; only each request's own
     `n_i` tokens count as useful output.
   * transformers continuous batching. `generate_batch` takes a single `max_new_tokens`
     for all requests, so we use the manager it wraps
     (`continuous_batching_context_manager` + `add_request(..., max_new_tokens=n_i)`),
     which lets every request stop at its own length: the work is the same as ours.
     CUDA graphs, compilation, async batching and the flash decode fast path are off
     (CPU), the attention is SDPA (its paged path on CPU), and the cache is sized
     explicitly (otherwise it takes 60% of the machine's RAM). Block sharing (HF's
     prefix cache) stays at its default, on, like our prefix cache: the prompts are
     random, so neither system can reuse anything, and requests are added one by one
     in workload order (`add_requests` would re-sort them when sharing is on).

4. The machine's fp32 matmul roofline is measured at the model's own GEMM shapes.
5. The workload's FLOPs are computed analytically (see `workload_flops`), and each
   system's achieved GFLOP/s is those useful FLOPs divided by its wall time.

The last line printed is machine-readable:
`ratio_vs_hf_generate=X ratio_vs_hf_generate_batch=Y roofline_fraction=Z`
(medians over repetitions; a skipped system prints `nan`).
"""

from __future__ import annotations

import gc
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from pdserve.bench.common.entry import parse
from pdserve.bench.common.random_model import PAD_ID, ModelSpec, save_random_model, temporary_dir
from pdserve.bench.common.machine import machine_load
from pdserve.bench.common.repeat import interleaved
from pdserve.bench.common.stats import Ratio, fmt
from pdserve.bench.engine.workload import (QUICK_MODEL, QUICK_WORKLOAD, Request, WorkloadSpec, make_warmup,
                                           make_workload, output_tokens, prompt_tokens)
from pdserve.services.common.flags import flag

if TYPE_CHECKING:
    from transformers import ContinuousBatchingConfig, PreTrainedModel
    from transformers.generation.continuous_batching import ContinuousBatchingManager



# -- configuration -------------------------------------------------------------------


@dataclass(frozen=True)
class BenchConfig:
    model: ModelSpec = ModelSpec()
    workload: WorkloadSpec = WorkloadSpec()
    seed: int = 0
    block_size: int = 16  # ours
    max_num_batched_tokens: int = 2048  # ours; also HF continuous batching's max_batch_tokens
    hf_batch_size: int = 16  # static batches of transformers `generate`
    hf_page_size: int = 256  # transformers continuous batching page size (its default)
    num_check_requests: int = 4  # requests re-run unpadded through HF `generate` for the token check
    roofline_min_seconds: float = 0.5  # per GEMM shape, split over 3 best-of repeats
    workload_kind: str = "mixed"  # or "parallel": bench/engine/parallel.py
    quick: bool = False
    repeats: int = 3
    device: str = "cpu"
    run_hf_generate: bool = True
    run_hf_batch: bool = True
    enforce_eager: bool = False  # ours without the fast path (engine/prepacked.py)
    decode_capture_sizes: str = ""  # ours with the decode step captured for these batch sizes (engine/captured.py)
    profile: bool = False  # decode workload: the step split by torch.profiler
    decode_steps: int = 64  # decode workload: timed steps per batch size
    decode_batches: tuple[int, ...] = (1, 8, 16, 64)


# -- workload ------------------------------------------------------------------------


# -- FLOPs ---------------------------------------------------------------------------


def request_flops(model: ModelSpec, prompt_len: int, new_tokens: int) -> int:
    """Useful FLOPs of one request of `prompt_len` prompt tokens and `new_tokens` generated ones.

    A multiply-add is 2 FLOPs. The forward pass runs over T = prompt_len + new_tokens - 1
    tokens: every prompt token and every generated token except the last, which is
    returned but never fed back. For each of those tokens:

    * linear layers: 2 * P, where P = `non_embedding_linear_params` = num_layers *
      (hidden * (q_size + 2 * kv_size) + q_size * hidden + 3 * hidden * intermediate);
    * attention: 4 * q_size * c per layer, where c = position + 1 is the number of keys
      the token attends to (itself included): 2 * q_size * c for QK^T and as much for PV.
      Summed over positions 0..T-1: 4 * q_size * num_layers * T * (T + 1) / 2.

    The LM head, 2 * hidden * vocab, is counted only for the tokens whose logits are
    needed: the last prompt token and every generated token but the last, i.e. exactly
    `new_tokens` times. Norms, RoPE, softmax, activations and sampling are elementwise
    and left out; so is the embedding lookup (no FLOPs). Work a system does beyond
    this (padding, logits for prompt tokens, tokens past a request's length) is not
    useful and is not counted.
    """
    forwarded = prompt_len + new_tokens - 1
    linear = 2 * model.non_embedding_linear_params * forwarded
    attention = 4 * model.q_size * model.num_layers * forwarded * (forwarded + 1) // 2
    lm_head = 2 * model.hidden_size * model.vocab_size * new_tokens
    return linear + attention + lm_head


def workload_flops(model: ModelSpec, requests: Sequence[Request]) -> int:
    """Sum of `request_flops` over the workload."""
    return sum(request_flops(model, len(r.prompt), r.max_new_tokens) for r in requests)


# -- roofline ------------------------------------------------------------------------


@dataclass(frozen=True)
class MatmulResult:
    m: int
    k: int
    n: int
    gflops: float


def matmul_gflops(m: int, k: int, n: int, min_seconds: float, repeats: int = 3, device: str = "cpu") -> float:
    """Best-of-`repeats` fp32 GFLOP/s of `torch.matmul([m, k], [k, n])` after a warm-up."""
    gen = torch.Generator().manual_seed(m * 1_000_003 + k * 1009 + n)
    a = torch.randn(m, k, generator=gen).to(device)
    b = torch.randn(k, n, generator=gen).to(device)
    out = torch.empty(m, n, device=device)
    for _ in range(3):
        torch.matmul(a, b, out=out)
    best = 0.0
    for _ in range(repeats):
        iters, start = 0, time.perf_counter()
        while True:
            torch.matmul(a, b, out=out)
            iters += 1
            _sync(device)
            elapsed = time.perf_counter() - start
            if elapsed >= min_seconds / repeats:
                break
        best = max(best, 2 * m * k * n * iters / elapsed / 1e9)
    return best


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def roofline_shapes(model: ModelSpec, batched_tokens: int, decode_rows: int) -> list[tuple[int, int, int]]:
    """The GEMMs of a forward pass (fused qkv, o, fused gate_up, down) for a full prefill
    batch and for a decode batch of every request, plus the decode LM head."""
    h = model.hidden_size
    per_layer = [
        (h, model.q_size + 2 * model.kv_size),
        (model.q_size, h),
        (h, 2 * model.intermediate_size),
        (model.intermediate_size, h),
    ]
    shapes = [(m, k, n) for m in (batched_tokens, decode_rows) for k, n in per_layer]
    shapes.append((decode_rows, h, model.vocab_size))
    return shapes


def measure_roofline(shapes: Sequence[tuple[int, int, int]], min_seconds: float, device: str = "cpu") -> list[MatmulResult]:
    return [MatmulResult(m, k, n, matmul_gflops(m, k, n, min_seconds, device=device)) for m, k, n in shapes]


# -- model ---------------------------------------------------------------------------


def load_hf_model(path: Path, device: str = "cpu") -> PreTrainedModel:
    """The checkpoint as a transformers model, with EOS disabled in its generation config:
    `generate` fills unset options from it, and a None EOS means no EOS stopping criterion."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").to(device).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = PAD_ID
    return model


# -- systems -------------------------------------------------------------------------


@dataclass(frozen=True)
class RunResult:
    name: str
    wall_s: float
    tokens: tuple[tuple[int, ...], ...]  # generated ids per request, truncated to its n_i
    extra: dict[str, object] = field(default_factory=dict)


def timed(fn: Callable[[], list[list[int]]]) -> tuple[float, list[list[int]]]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def kv_blocks_needed(requests: Sequence[Request], block_size: int) -> int:
    """Blocks to hold every request at full length at once (no preemption for either cache)."""
    return sum(-(-(len(r.prompt) + r.max_new_tokens) // block_size) for r in requests)


def load_ours(model_dir: Path, num_blocks: int, cfg: BenchConfig):
    from pdserve.engine import LLM

    return LLM(
        model=str(model_dir),
        block_size=cfg.block_size,
        num_blocks=num_blocks,
        enable_prefix_caching=True,
        max_num_seqs=256,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        dtype="float32",
        device=cfg.device,
        enforce_eager=cfg.enforce_eager,
        decode_capture_sizes=cfg.decode_capture_sizes,
    )


def run_ours(llm, requests: Sequence[Request], warmup: Sequence[Request]) -> RunResult:
    """One timed pass over `requests` on a loaded engine (its pool holds them all at once)."""
    from pdserve.engine import SamplingParams

    def generate(reqs: Sequence[Request]) -> list[list[int]]:
        params = [SamplingParams(max_tokens=r.max_new_tokens, temperature=0.0, ignore_eos=True) for r in reqs]
        outs = llm.generate([list(r.prompt) for r in reqs], params)
        return [list(o.outputs[0].token_ids) for o in outs]

    generate(warmup)
    wall, tokens = timed(lambda: generate(requests))
    return RunResult("pdserve engine.LLM", wall, _truncate(tokens, requests), {"stats": llm.stats()})


def _truncate(tokens: Sequence[Sequence[int]], requests: Sequence[Request]) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(t[: r.max_new_tokens]) for t, r in zip(tokens, requests))


def hf_generate_batch(model: PreTrainedModel, batch: Sequence[Request]) -> list[list[int]]:
    """One static batch: left-padded with PAD_ID, run to the batch's longest `max_new_tokens`."""
    from transformers import GenerationConfig

    width = max(len(r.prompt) for r in batch)
    ids = torch.full((len(batch), width), PAD_ID, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, r in enumerate(batch):
        ids[row, width - len(r.prompt) :] = torch.tensor(r.prompt)
        mask[row, width - len(r.prompt) :] = 1
    ids, mask = ids.to(model.device), mask.to(model.device)
    gen_config = GenerationConfig(
        max_new_tokens=max(r.max_new_tokens for r in batch),
        do_sample=False,
        eos_token_id=None,
        pad_token_id=PAD_ID,
    )
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=gen_config)
    return [out[row, width : width + r.max_new_tokens].tolist() for row, r in enumerate(batch)]


def run_hf_generate(
    model: PreTrainedModel, requests: Sequence[Request], warmup: Sequence[Request], batch_size: int
) -> RunResult:
    def generate(reqs: Sequence[Request]) -> list[list[int]]:
        tokens: list[list[int]] = []
        for start in range(0, len(reqs), batch_size):
            tokens.extend(hf_generate_batch(model, reqs[start : start + batch_size]))
        return tokens

    generate(warmup)
    wall, tokens = timed(lambda: generate(requests))
    padded = sum(
        len(batch) * max(r.max_new_tokens for r in batch)
        for batch in (requests[s : s + batch_size] for s in range(0, len(requests), batch_size))
    )
    return RunResult(
        f"HF generate (static batches of {batch_size})", wall, _truncate(tokens, requests),
        {"generated_incl_padding": padded},
    )


def hf_cb_config(requests: Sequence[Request], cfg: BenchConfig) -> ContinuousBatchingConfig:
    """Everything explicit: on a CPU, an unset `num_blocks` / `max_batch_tokens` sizes the
    cache from the machine's RAM."""
    from transformers import ContinuousBatchingConfig

    return ContinuousBatchingConfig(
        page_size=cfg.hf_page_size,
        num_blocks=kv_blocks_needed(requests, cfg.hf_page_size) + 2,
        max_batch_tokens=cfg.max_num_batched_tokens,
        max_blocks_per_request=0,  # the flash_attn_with_kvcache decode path: CUDA/XPU only
        use_cuda_graph=False,
        use_async_batching=False,
        default_compile_level=0,
        auto_switch_to_flash=False,
        allow_block_sharing=True,
        seed=cfg.seed,
    )


def hf_cb_generate(
    manager: ContinuousBatchingManager, reqs: Sequence[Request], tag: str, poll_s: float = 1.0
) -> list[list[int]]:
    """Submit every request with its own `max_new_tokens` and wait for all of them."""
    ids = [
        manager.add_request(list(r.prompt), request_id=f"{tag}-{i}", max_new_tokens=r.max_new_tokens, eos_token_id=-1)
        for i, r in enumerate(reqs)
    ]
    if any(i is None for i in ids):
        raise RuntimeError("HF continuous batching: a request was refused")
    results: dict[str, list[int]] = {}
    while len(results) < len(ids):
        out = manager.get_result(timeout=poll_s)
        if out is None:
            if not manager.is_running():
                raise RuntimeError("HF continuous batching: the generation thread stopped early")
            continue
        if out.is_finished():
            if out.error is not None:
                raise RuntimeError(f"HF continuous batching: {out.request_id} failed: {out.error}")
            results[out.request_id] = list(out.generated_tokens)
    return [results[i] for i in ids]


def run_hf_batch(
    model: PreTrainedModel, requests: Sequence[Request], warmup: Sequence[Request], cfg: BenchConfig
) -> RunResult:
    from transformers import GenerationConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    gen_config = GenerationConfig(
        max_new_tokens=max(r.max_new_tokens for r in requests), do_sample=False, eos_token_id=-1, pad_token_id=PAD_ID
    )
    hints = WorkloadHints(
        max_prompt_length=max(len(r.prompt) for r in requests),
        max_generated_length=max(r.max_new_tokens for r in requests),
        num_requests=len(requests),
    )
    cm = model.continuous_batching_context_manager(
        generation_config=gen_config,
        continuous_batching_config=hf_cb_config([*requests, *warmup], cfg),
        block=True,
        timeout=60,
        warmup=True,
        workload_hints=hints,
    )
    with torch.inference_mode(), cm as manager:
        hf_cb_generate(manager, warmup, "warmup")
        wall, tokens = timed(lambda: hf_cb_generate(manager, requests, "req"))
        resolved = manager.continuous_batching_config
        extra = {
            "attn": model.config._attn_implementation,
            "num_blocks": resolved.num_blocks,
            "max_batch_tokens": resolved.max_batch_tokens,
        }
    return RunResult("HF generate_batch (continuous batching)", wall, _truncate(tokens, requests), extra)


# -- report --------------------------------------------------------------------------


@dataclass(frozen=True)
class Throughput:
    wall_s: float
    output_tok_s: float
    total_tok_s: float
    gflops: float
    roofline_fraction: float


def throughput(result: RunResult, requests: Sequence[Request], flops: int, roofline: float) -> Throughput:
    out, total = output_tokens(requests), prompt_tokens(requests) + output_tokens(requests)
    gflops = flops / result.wall_s / 1e9
    return Throughput(result.wall_s, out / result.wall_s, total / result.wall_s, gflops, gflops / roofline)


def count_matches(a: Sequence[Sequence[int]], b: Sequence[Sequence[int]]) -> int:
    return sum(tuple(x) == tuple(y) for x, y in zip(a, b))


def short_lengths(result: RunResult, requests: Sequence[Request]) -> int:
    return sum(len(t) != r.max_new_tokens for t, r in zip(result.tokens, requests))


# -- main ----------------------------------------------------------------------------


WORKLOADS = ("mixed", "parallel", "sampled", "decode")


@dataclass(frozen=True)
class OfflineFlags:
    quick: bool = flag(False, "tiny model and 8 requests (smoke test)")
    workload: str = flag("mixed", "mixed: the throughput comparison with transformers; parallel: n=8 block sharing "
                                  "(bench/engine/parallel.py); sampled: a step with mixed sampling settings "
                                  "(bench/engine/sampled.py); decode: step time at batch 1-64, fast path against "
                                  "--enforce-eager (bench/engine/decode.py)", choices=WORKLOADS)
    enforce_eager: bool = flag(False, "mixed: run ours without the decode fast path")
    decode_capture_sizes: str = flag("", "mixed: run ours with its decode step compiled for these batch sizes, "
                                         "e.g. 1,8,16 (engine/captured.py)")
    profile: bool = flag(False, "decode: split each step with torch.profiler")
    steps: int = flag(64, "decode: timed decode steps per batch size")
    batches: tuple[int, ...] | None = flag(None, "decode: the batch sizes, comma-separated (1,8,16,64; 1,16 with "
                                                 "--quick)")
    num_requests: int | None = flag(None, "requests of the workload (24; 8 with --quick; 64 with --gpu)")
    seed: int = flag(0, "seed of the model and the workload")
    hf_batch_size: int | None = flag(None, "static batch size of HF generate (16; 4 with --quick)")
    max_num_batched_tokens: int = flag(2048, "ours: token budget per step; HF continuous batching's max_batch_tokens")
    check_requests: int = flag(4, "requests re-run through unpadded HF generate")
    repeats: int | None = flag(None, "interleaved repetitions (3; 2 with --quick)")
    device: str = flag("cpu", "torch device of every system (cuda: the GPU mode)")
    gpu: bool = flag(False, "GPU mode: --device cuda and 64 requests")
    skip_hf_generate: bool = flag(False, "leave HF generate out")
    skip_hf_batch: bool = flag(False, "leave HF continuous batching out")


def config_from(args: OfflineFlags) -> BenchConfig:
    batches = args.batches or ((1, 16) if args.quick else (1, 8, 16, 64))
    if args.hf_batch_size is not None and args.hf_batch_size < 1:
        raise ValueError("--hf-batch-size must be >= 1")
    model, workload = (QUICK_MODEL, QUICK_WORKLOAD) if args.quick else (ModelSpec(), WorkloadSpec())
    workload = replace(workload, seed=args.seed)
    if args.gpu:
        workload = replace(workload, num_requests=64)
    if args.num_requests is not None:
        if args.num_requests < 1:
            raise ValueError("--num-requests must be >= 1")
        workload = replace(workload, num_requests=args.num_requests)
    return BenchConfig(
        model=model,
        workload=workload,
        seed=args.seed,
        max_num_batched_tokens=args.max_num_batched_tokens,
        hf_batch_size=args.hf_batch_size or (4 if args.quick else 16),
        num_check_requests=max(0, args.check_requests),
        roofline_min_seconds=0.05 if args.quick else 0.5,
        run_hf_generate=not args.skip_hf_generate,
        run_hf_batch=not args.skip_hf_batch,
        workload_kind=args.workload,
        quick=args.quick,
        repeats=max(1, args.repeats or (2 if args.quick else 3)),
        device="cuda" if args.gpu else args.device,
        enforce_eager=args.enforce_eager,
        decode_capture_sizes=args.decode_capture_sizes,
        profile=args.profile,
        decode_steps=max(1, args.steps),
        decode_batches=batches,
    )


def parse_args(argv: Sequence[str] | None) -> BenchConfig:
    return parse(OfflineFlags, argv, "python -m pdserve.bench.engine.offline", __doc__, config_from)


def log(msg: str) -> None:
    print(msg, flush=True)


def print_header(cfg: BenchConfig, requests: Sequence[Request], flops: int) -> None:
    m, w = cfg.model, cfg.workload
    log(
        f"model: llama hidden={m.hidden_size} layers={m.num_layers} heads={m.num_heads} kv_heads={m.num_kv_heads} "
        f"intermediate={m.intermediate_size} vocab={m.vocab_size} tied={m.tie_word_embeddings} fp32 "
        f"params={m.total_params / 1e6:.1f}M (non-embedding linear {m.non_embedding_linear_params / 1e6:.1f}M)"
    )
    log(
        f"workload: {len(requests)} requests seed={w.seed} prompt_len {w.prompt_len[0]}..{w.prompt_len[1]} "
        f"new_tokens {w.new_tokens[0]}..{w.new_tokens[1]}: {prompt_tokens(requests)} prompt + "
        f"{output_tokens(requests)} output tokens, {flops / 1e9:.1f} GFLOP useful work"
    )
    log(f"torch {torch.__version__} device={cfg.device} threads={torch.get_num_threads()} repeats={cfg.repeats} {machine_load()}")


def print_system(res: RunResult, tp: Throughput, requests: Sequence[Request]) -> None:
    log(
        f"{res.name:<42} wall {tp.wall_s:8.2f} s  out {tp.output_tok_s:8.1f} tok/s  total {tp.total_tok_s:8.1f} tok/s  "
        f"{tp.gflops:7.2f} GFLOP/s  {100 * tp.roofline_fraction:5.1f}% of roofline"
    )
    short = short_lengths(res, requests)
    if short:
        log(f"  WARNING: {short} requests did not produce their requested number of tokens")
    if res.extra:
        log("  " + " ".join(f"{k}={v}" for k, v in res.extra.items()))


@contextmanager
def phase(name: str) -> Iterator[None]:
    """Log how long a stage of the benchmark took (set-up and warm-up included)."""
    start = time.perf_counter()
    yield
    log(f"[phase] {name}: {time.perf_counter() - start:.1f} s")


SYSTEMS = ("ours", "hf_generate", "hf_batch")


def run_systems(
    cfg: BenchConfig, workloads: Sequence[Sequence[Request]]
) -> tuple[dict[str, list[RunResult]], list[list[int]]]:
    """Every enabled system on one fresh checkpoint, once per workload, interleaved
    (ours, HF generate, HF batch, ours, ...); also the unpadded HF reference tokens of
    the first `num_check_requests` requests of the last workload."""
    warmup = make_warmup(cfg.model.vocab_size, cfg.seed)
    with temporary_dir("pdserve-bench-") as model_dir:
        with phase("save random checkpoint"):
            save_random_model(cfg.model, model_dir, cfg.seed)
        with phase("load ours and the HF model"):
            blocks = max(kv_blocks_needed([*w, *warmup], cfg.block_size) for w in workloads) + 16
            llm = load_ours(model_dir, blocks, cfg)
            hf_model = load_hf_model(model_dir, cfg.device)
        systems: dict[str, Callable[[int], RunResult]] = {"ours": lambda rep: run_ours(llm, workloads[rep], warmup)}
        if cfg.run_hf_generate:
            systems["hf_generate"] = lambda rep: run_hf_generate(hf_model, workloads[rep], warmup, cfg.hf_batch_size)
        if cfg.run_hf_batch:
            systems["hf_batch"] = lambda rep: run_hf_batch(hf_model, workloads[rep], warmup, cfg)
        with phase(f"{cfg.repeats} interleaved repetitions of {', '.join(systems)}"):
            results = interleaved(systems, cfg.repeats, log)
        last = workloads[-1]
        with phase(f"HF reference for {min(cfg.num_check_requests, len(last))} requests"):
            reference = [hf_generate_batch(hf_model, [r])[0] for r in last[: cfg.num_check_requests]]
        del llm, hf_model
        gc.collect()
    return results, reference


def run(cfg: BenchConfig) -> str:
    """Run the whole benchmark; returns the machine-readable summary line."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    bench_start = time.perf_counter()
    workloads = [make_workload(cfg.workload, cfg.model.vocab_size, rep) for rep in range(cfg.repeats)]
    flops = [workload_flops(cfg.model, w) for w in workloads]
    print_header(cfg, workloads[0], flops[0])

    with phase("roofline"):
        shapes = roofline_shapes(cfg.model, cfg.max_num_batched_tokens, len(workloads[0]))
        matmuls = measure_roofline(shapes, cfg.roofline_min_seconds, cfg.device)
    for mm in matmuls:
        log(f"matmul fp32 [{mm.m} x {mm.k}] @ [{mm.k} x {mm.n}]: {mm.gflops:8.2f} GFLOP/s")
    roofline = max(mm.gflops for mm in matmuls)
    log(f"roofline (best matmul): {roofline:.2f} GFLOP/s")

    results, reference = run_systems(cfg, workloads)

    tps = {key: [throughput(res, workloads[rep], flops[rep], roofline) for rep, res in enumerate(runs)]
           for key, runs in results.items()}
    for rep in range(cfg.repeats):
        log(f"\nrepetition {rep + 1}/{cfg.repeats}: {output_tokens(workloads[rep])} output tokens, "
            f"{flops[rep] / 1e9:.1f} GFLOP")
        for key, runs in results.items():
            print_system(runs[rep], tps[key][rep], workloads[rep])

    log("")
    ours, last = results["ours"][-1], workloads[-1]
    log(
        f"correctness (last repetition): ours == HF generate (unpadded, greedy) for "
        f"{count_matches(ours.tokens, reference)}/{len(reference)} checked requests"
    )
    for key, runs in results.items():
        if key != "ours":
            matches = count_matches(ours.tokens, runs[-1].tokens)
            log(f"correctness (last repetition): ours == {runs[-1].name} for {matches}/{len(last)} requests")

    def ratio(key: str) -> Ratio:
        if key not in tps:
            return Ratio.of([])
        return Ratio.paired([t.output_tok_s for t in tps["ours"]], [t.output_tok_s for t in tps[key]])

    x, y = ratio("hf_generate"), ratio("hf_batch")
    z = Ratio.of([t.roofline_fraction for t in tps["ours"]])
    log(f"throughput ratio ours / HF generate: {x}")
    log(f"throughput ratio ours / HF generate_batch: {y}")
    log(f"roofline fraction of ours: {z}")
    log(f"benchmark wall time: {time.perf_counter() - bench_start:.1f} s")
    return (
        f"ratio_vs_hf_generate={fmt(x.median)} ratio_vs_hf_generate_batch={fmt(y.median)} "
        f"roofline_fraction={fmt(z.median)}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    cfg = parse_args(argv)
    if cfg.workload_kind == "sampled":
        from pdserve.bench.engine import sampled

        print(sampled.run(sampled.QUICK if cfg.quick else sampled.SampledSpec()), flush=True)
        return 0
    if cfg.workload_kind == "parallel":
        from pdserve.bench.engine import parallel

        print(parallel.run(parallel.QUICK if cfg.quick else parallel.ParallelSpec()), flush=True)
        return 0
    if cfg.workload_kind == "decode":
        from pdserve.bench.engine import decode

        spec = decode.DecodeConfig(batches=cfg.decode_batches, steps=cfg.decode_steps, repeats=cfg.repeats,
                                   profile=cfg.profile, model=cfg.model)
        if cfg.quick:
            spec = replace(spec, steps=min(cfg.decode_steps, 8), capture_sizes=(max(cfg.decode_batches),))
        with temporary_dir("pdserve-bench-") as model_dir:
            save_random_model(cfg.model, model_dir, cfg.seed)
            print(decode.run(str(model_dir), spec, log), flush=True)
        return 0
    last_line = run(cfg)
    print(last_line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
