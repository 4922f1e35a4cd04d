#!/usr/bin/env python
"""GPU check of the whole engine: one prepared script to run when an accelerator is lent.

    python tests/gpu/check_engine.py                     # every check and figure on CUDA
    python tests/gpu/check_engine.py --quick             # smaller shapes (well under 5 minutes)
    python tests/gpu/check_engine.py --device cpu --quick   # smoke test without a GPU (tests do this)

Checks (each prints PASS or FAIL with its detail):
  greedy     the engine (Triton attention on CUDA: attention_backend auto) == transformers
             `generate`, token for token, fp32; a divergence only counts when transformers'
             own top-2 logits at that position are more than --tie-tol apart
  parallel   n=4 seeded samples: reproducible, not all equal, prompt blocks shared
  beam       beam_width=4, n=2 == transformers `generate(num_beams=4)` (same tie rule)
  prefix     a second run of the same prompts hits the prefix cache, same tokens
  half       fp16 and bf16 engines: first token == transformers (same dtype) where its
             top-2 gap is clear
  blocks     every engine ends with all its KV blocks free
  quant      --quantization int8/int4/fp8/fp4 and --kv-cache-dtype fp8 (bf16 model): the
             device engine (Triton quantized GEMMs, FP8 pages) against the same scheme on
             the CPU (torch's kernels), by vLLM's check_logprobs_close rule: greedy tokens
             may differ only where each side's token is in the other's top-5
Figures:
  decode     decode tokens/s of a batch, engine steps timed after the prefill step
  kernel     Triton paged decode attention: bytes of K/V read per second, as a fraction
             of the device's peak HBM bandwidth (by device name, or --peak-gbps) and of a
             device-to-device copy measured here

Exit status: 0 when every check passes, 1 when one fails, 2 without CUDA (unless --device cpu).
On a CPU the figures are meaningless (the kernel runs in Triton's interpreter, which needs
TRITON_INTERPRET=1 set before triton is imported; without it the kernel figure is skipped).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

# Peak HBM bandwidth (bytes/s) by device name, from the vendors' data sheets; the first
# substring that matches wins, so the longer names come first.
PEAK_HBM = (
    ("H200", 4.8e12),
    ("H100 PCIe", 2.0e12),
    ("H100", 3.35e12),
    ("GH200", 4.0e12),
    ("B200", 8.0e12),
    ("A100-SXM4-80GB", 2.039e12),
    ("A100 80GB PCIe", 1.935e12),
    ("A100", 1.555e12),
    ("L40S", 0.864e12),
    ("L40", 0.864e12),
    ("L4", 0.3e12),
    ("A10G", 0.6e12),
    ("A10", 0.6e12),
    ("V100", 0.9e12),
    ("T4", 0.32e12),
)


@dataclass(frozen=True)
class Shapes:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    prompts: int  # greedy / prefix prompts
    new_tokens: int
    decode_seqs: int
    decode_prompt: int
    decode_tokens: int
    kernel_seqs: int
    kernel_context: int
    kernel_heads: int
    kernel_kv_heads: int
    kernel_head_dim: int


FULL = Shapes(hidden=768, layers=12, heads=12, kv_heads=4, intermediate=2048, vocab=32000, prompts=8,
              new_tokens=32, decode_seqs=64, decode_prompt=256, decode_tokens=128, kernel_seqs=64,
              kernel_context=4096, kernel_heads=32, kernel_kv_heads=8, kernel_head_dim=128)
QUICK = Shapes(hidden=256, layers=4, heads=8, kv_heads=4, intermediate=640, vocab=4096, prompts=4,
               new_tokens=16, decode_seqs=16, decode_prompt=64, decode_tokens=32, kernel_seqs=16,
               kernel_context=1024, kernel_heads=32, kernel_kv_heads=8, kernel_head_dim=128)
CPU = Shapes(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, vocab=256, prompts=3,
             new_tokens=8, decode_seqs=4, decode_prompt=16, decode_tokens=4, kernel_seqs=2,
             kernel_context=40, kernel_heads=4, kernel_kv_heads=2, kernel_head_dim=16)


@dataclass
class Report:
    results: list[tuple[str, bool, str]] = field(default_factory=list)

    def check(self, name: str, ok: bool, detail: str) -> None:
        self.results.append((name, ok, detail))
        print(f"{'PASS' if ok else 'FAIL'} {name:9} {detail}", flush=True)

    def figure(self, name: str, detail: str) -> None:
        print(f"     {name:9} {detail}", flush=True)

    @property
    def ok(self) -> bool:
        return all(ok for _, ok, _ in self.results)


def peak_hbm(device_name: str) -> float | None:
    """The data-sheet peak memory bandwidth of a device, bytes/s (None: unknown)."""
    return next((peak for key, peak in PEAK_HBM if key in device_name), None)


def first_divergence(got: list[int], want: list[int]) -> int | None:
    """Index of the first differing token (a length difference counts), None if equal."""
    for i, (a, b) in enumerate(zip(got, want)):
        if a != b:
            return i
    return None if len(got) == len(want) else min(len(got), len(want))


def is_tie(logits: torch.Tensor, tol: float) -> bool:
    """Whether the two largest logits are within `tol` (either token is a fair argmax)."""
    top = logits.float().topk(2).values
    return bool(top[0] - top[1] <= tol)


# -- model and engines ---------------------------------------------------------------------


def save_model(path: Path, s: Shapes, seed: int, vocab: int | None = None) -> None:
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=vocab or s.vocab, hidden_size=s.hidden, intermediate_size=s.intermediate,
        num_hidden_layers=s.layers, num_attention_heads=s.heads, num_key_value_heads=s.kv_heads,
        max_position_embeddings=2048, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval().save_pretrained(path)


def hf_model(path: Path, device: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()


def prompts(s: Shapes, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = [1, 17, 100, 333, 64, 250, 48, 7][: s.prompts]
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


def blocks_free(engine) -> bool:
    engine.check_integrity()
    stats = engine.stats()
    return stats.num_free_blocks == stats.num_blocks and not engine.has_unfinished()


# -- checks -------------------------------------------------------------------------------


def check_greedy_and_prefix(report: Report, path: Path, s: Shapes, args: argparse.Namespace) -> None:
    from pdserve.engine import LLM, SamplingParams

    hf = hf_model(path, args.device, torch.float32)
    llm = LLM(model=str(path), device=args.device, dtype="float32", num_blocks=1024)
    batch = prompts(s, s.vocab, args.seed)
    params = SamplingParams(max_tokens=s.new_tokens, temperature=0.0, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(batch, params)]
    exact, ties, bad = 0, 0, []
    for i, (prompt, tokens) in enumerate(zip(batch, got)):
        ids = torch.tensor([prompt], device=args.device)
        with torch.no_grad():
            want = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=s.new_tokens,
                               do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        at = first_divergence(tokens, want)
        if at is None:
            exact += 1
            continue
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + want[:at]], device=args.device)).logits[0, -1]
        if is_tie(logits, args.tie_tol):
            ties += 1
        else:
            bad.append(f"prompt {i} (len {len(prompt)}) at token {at}")
    report.check("greedy", not bad, f"{exact}/{len(batch)} token-exact, {ties} diverged at a tie"
                 + (f"; diverged: {', '.join(bad)}" if bad else ""))
    hits_before = llm.stats().prefix_cache_hits
    again = [o.outputs[0].token_ids for o in llm.generate(batch, params)]
    hits = llm.stats().prefix_cache_hits - hits_before
    want_hits = sum((len(p) - 1) // 16 * 16 for p in batch)
    report.check("prefix", again == got and hits >= want_hits,
                 f"second run: {hits} prompt tokens from the cache (>= {want_hits}), same tokens: {again == got}")
    report.check("blocks", blocks_free(llm.engine), "greedy/prefix engine: all blocks free")
    del hf


def check_parallel(report: Report, path: Path, s: Shapes, args: argparse.Namespace) -> None:
    from pdserve.engine import SamplingParams
    from pdserve.engine.config import CacheConfig
    from pdserve.engine.engine import EngineConfig, LLMEngine

    prompt = prompts(s, s.vocab, args.seed + 1)[2]
    params = SamplingParams(max_tokens=s.new_tokens, temperature=1.0, n=4, seed=7, ignore_eos=True)
    runs, peak = [], 0
    for _ in range(2):
        engine = LLMEngine(EngineConfig(model=str(path), device=args.device, cache=CacheConfig(num_blocks=512)))
        engine.add_request("p", prompt, params)
        out = None
        while engine.has_unfinished():
            for o in engine.step():
                out = o
            stats = engine.stats()
            peak = max(peak, stats.num_blocks - stats.num_free_blocks)
        runs.append([c.token_ids for c in out.outputs])
        report.check("blocks", blocks_free(engine), "parallel engine: all blocks free")
    prompt_blocks = len(prompt) // 16
    unshared = 4 * -(-(len(prompt) + s.new_tokens) // 16)
    ok = runs[0] == runs[1] and len({tuple(t) for t in runs[0]}) > 1 and peak < unshared
    report.check("parallel", ok, f"n=4 reproducible: {runs[0] == runs[1]}, distinct samples: "
                 f"{len({tuple(t) for t in runs[0]})}, peak blocks {peak} (prompt {prompt_blocks}, unshared {unshared})")


def check_beam(report: Report, tmp: Path, s: Shapes, args: argparse.Namespace) -> None:
    from pdserve.engine import LLM, SamplingParams

    path = tmp / "beam"
    save_model(path, s, args.seed + 2, vocab=128)
    hf = hf_model(path, args.device, torch.float32)
    llm = LLM(model=str(path), device=args.device, dtype="float32", num_blocks=512)
    batch = prompts(s, 128, args.seed + 3)[:3]
    params = SamplingParams(max_tokens=12, beam_width=4, n=2, temperature=0.0, ignore_eos=True)
    outs = llm.generate(batch, params)
    exact, ties, bad = 0, 0, []
    for i, (prompt, out) in enumerate(zip(batch, outs)):
        ids = torch.tensor([prompt], device=args.device)
        with torch.no_grad():
            want = hf.generate(ids, attention_mask=torch.ones_like(ids), num_beams=4, num_return_sequences=2,
                               do_sample=False, max_new_tokens=12, eos_token_id=None, pad_token_id=0)
        got = [c.token_ids for c in out.outputs]
        if got == want[:, len(prompt):].tolist():
            exact += 1
        elif _beam_near_tie(hf, prompt, got, want[:, len(prompt):].tolist(), args):
            ties += 1
        else:
            bad.append(f"prompt {i} (len {len(prompt)})")
    report.check("beam", not bad, f"{exact}/{len(batch)} equal to transformers num_beams=4, {ties} at a tie"
                 + (f"; differ: {', '.join(bad)}" if bad else ""))
    report.check("blocks", blocks_free(llm.engine), "beam engine: all blocks free")


def _beam_near_tie(hf, prompt: list[int], got: list[list[int]], want: list[list[int]], args) -> bool:
    """Beams that differ only where two hypotheses' scores are within the tie tolerance."""
    device = args.device

    def score(tokens: list[int]) -> float:
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + tokens], device=device)).logits[0, len(prompt) - 1 : -1].float()
        return float(torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens, device=device)[:, None]).sum())

    return all(abs(score(a) - score(b)) <= args.tie_tol for a, b in zip(got, want))


def check_half(report: Report, path: Path, s: Shapes, args: argparse.Namespace, dtype_name: str) -> None:
    from pdserve.engine import LLM, SamplingParams

    dtype = getattr(torch, dtype_name)
    hf = hf_model(path, args.device, dtype)
    llm = LLM(model=str(path), device=args.device, dtype=dtype_name, num_blocks=512)
    batch = prompts(s, s.vocab, args.seed + 4)
    outs = llm.generate(batch, SamplingParams(max_tokens=1, temperature=0.0))
    checked, wrong = 0, 0
    for prompt, out in zip(batch, outs):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt], device=args.device)).logits[0, -1].float()
        top2 = logits.topk(2).values
        if top2[0] - top2[1] > 0.05 * top2[0].abs().clamp(min=1.0):
            checked += 1
            wrong += out.outputs[0].token_ids[0] != int(logits.argmax())
    report.check(dtype_name, wrong == 0 and checked > 0, f"first token == transformers for {checked - wrong}/{checked} "
                 f"prompts with a clear top-2 gap ({len(batch) - checked} near ties skipped)")
    report.check("blocks", blocks_free(llm.engine), f"{dtype_name} engine: all blocks free")


def logprobs_close(a, b) -> tuple[bool, str]:
    """vLLM's check_logprobs_close on one sequence: equal up to the first divergence,
    where each side's token must be among the other's top logprobs; then stop."""
    for i, (ta, tb) in enumerate(zip(a.token_ids, b.token_ids)):
        if ta != tb:
            ok = ta in b.logprobs[i] and tb in a.logprobs[i]
            return ok, f"diverged at {i} ({'within' if ok else 'outside'} top-5)"
    return True, "equal"


def check_quant(report: Report, path: Path, s: Shapes, args: argparse.Namespace) -> None:
    from pdserve.engine import LLM, SamplingParams

    batch = prompts(s, s.vocab, args.seed + 8)
    params = SamplingParams(max_tokens=s.new_tokens, temperature=0.0, ignore_eos=True, logprobs=5)
    for quantization, kv in (("int8", "auto"), ("int4", "auto"), ("fp8", "auto"), ("fp4", "auto"), (None, "fp8")):
        kwargs = dict(model=str(path), dtype="bfloat16", num_blocks=512, quantization=quantization, kv_cache_dtype=kv)
        dev = LLM(device=args.device, **kwargs)
        ref = LLM(device="cpu", **kwargs)
        results = [logprobs_close(a.outputs[0], b.outputs[0])
                   for a, b in zip(dev.generate(batch, params), ref.generate(batch, params))]
        name = f"quant {quantization}" if quantization else f"quant kv {kv}"
        report.check(name, all(ok for ok, _ in results) and blocks_free(dev.engine),
                     f"{dev.engine.memory.weight_scheme}: " + ", ".join(d for _, d in results))
        del dev, ref


# -- figures ------------------------------------------------------------------------------


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def decode_throughput(report: Report, path: Path, s: Shapes, args: argparse.Namespace, dtype_name: str) -> None:
    from pdserve.engine import SamplingParams
    from pdserve.engine.config import CacheConfig, SchedulerConfig
    from pdserve.engine.engine import EngineConfig, LLMEngine

    per_seq = -(-(s.decode_prompt + s.decode_tokens) // 16)
    engine = LLMEngine(EngineConfig(
        model=str(path), device=args.device, dtype=dtype_name,
        cache=CacheConfig(num_blocks=s.decode_seqs * per_seq + 16),
        scheduler=SchedulerConfig(max_num_seqs=s.decode_seqs, max_num_batched_tokens=s.decode_seqs * s.decode_prompt),
    ))
    batch = [p[: s.decode_prompt] + [3] * max(0, s.decode_prompt - len(p)) for p in prompts(s, s.vocab, args.seed)]
    seconds, tokens = 0.0, 0
    for run in range(2):  # the first run warms up (Triton compiles its kernels)
        for i in range(s.decode_seqs):
            engine.add_request(f"d{run}-{i}", batch[i % len(batch)],
                               SamplingParams(max_tokens=s.decode_tokens, temperature=0.0, ignore_eos=True))
        engine.step()  # the prefill
        synchronize(args.device)
        start = time.perf_counter()
        steps = 0
        while engine.has_unfinished():
            engine.step()
            steps += 1
        synchronize(args.device)
        seconds, tokens = time.perf_counter() - start, steps * s.decode_seqs
    report.figure("decode", f"{dtype_name}: {tokens / seconds:10.1f} tok/s ({s.decode_seqs} seqs, "
                  f"{seconds / max(1, tokens // s.decode_seqs) * 1e3:.2f} ms per step)")
    report.check("blocks", blocks_free(engine), f"decode {dtype_name} engine: all blocks free")


def time_ms(fn: Callable[[], object], device: str, iters: int) -> float:
    fn()
    synchronize(device)
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    synchronize(device)
    return (time.perf_counter() - start) * 1e3 / iters


def kernel_bandwidth(report: Report, s: Shapes, args: argparse.Namespace) -> None:
    """Triton paged decode attention at a serving shape: K/V bytes read per second."""
    if args.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        report.figure("kernel", "skipped: on a CPU the Triton kernel needs TRITON_INTERPRET=1")
        return
    from pdserve.engine.attention.triton_kernels import paged_decode_attention

    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    bs, kvh, d, h = 16, s.kernel_kv_heads, s.kernel_head_dim, s.kernel_heads
    blocks_per_seq = -(-s.kernel_context // bs)
    num_blocks = s.kernel_seqs * blocks_per_seq
    gen = torch.Generator(device=args.device).manual_seed(args.seed)
    kv = torch.randn((num_blocks, 2, bs, kvh, d), device=args.device, dtype=dtype, generator=gen)
    tables = torch.randperm(num_blocks, device=args.device, generator=gen).view(s.kernel_seqs, blocks_per_seq)
    tables = tables.to(torch.int32)
    seq_lens = torch.full((s.kernel_seqs,), s.kernel_context, dtype=torch.int32, device=args.device)
    q = torch.randn((s.kernel_seqs, h, d), device=args.device, dtype=dtype, generator=gen)

    def run() -> torch.Tensor:
        return paged_decode_attention(q, kv[:, 0], kv[:, 1], tables, seq_lens, d ** -0.5)

    iters = 20 if args.device.startswith("cuda") else 1
    ms = time_ms(run, args.device, iters)
    elem = kv.element_size()
    moved = s.kernel_seqs * s.kernel_context * kvh * d * 2 * elem + 2 * q.numel() * elem
    achieved = moved / (ms / 1e3)
    copy_src = torch.empty(moved // elem, device=args.device, dtype=dtype)
    copy_ms = time_ms(lambda: copy_src.clone(), args.device, iters)
    copy_bw = 2 * moved / (copy_ms / 1e3)  # a copy reads and writes every byte
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    peak = args.peak_gbps * 1e9 if args.peak_gbps else peak_hbm(name)
    of_peak = f"{achieved / peak:.3f} of the {peak / 1e9:.0f} GB/s peak" if peak else "peak unknown (--peak-gbps)"
    report.figure("kernel", f"{name} {str(dtype).removeprefix('torch.')} {s.kernel_seqs} seqs x {s.kernel_context} "
                  f"tokens, H={h} KVH={kvh} D={d}: {ms:.3f} ms, {achieved / 1e9:.1f} GB/s = {of_peak}; "
                  f"{achieved / copy_bw:.3f} of a measured device copy ({copy_bw / 1e9:.1f} GB/s)")


# -- main ---------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", help="cuda (default), cuda:N, or cpu for a smoke test")
    p.add_argument("--quick", action="store_true", help="smaller model and shapes")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tie-tol", type=float, default=1e-3, help="logit gap below which a divergence is a tie")
    p.add_argument("--peak-gbps", type=float, default=None, help="device peak HBM bandwidth, GB/s (default: by name)")
    p.add_argument("--skip", nargs="*", default=[], choices=["greedy", "parallel", "beam", "half", "quant", "decode", "kernel"])
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("gpu_check_engine: no CUDA device; run with --device cpu for a smoke test", file=sys.stderr)
        return 2
    shapes = CPU if args.device == "cpu" else QUICK if args.quick else FULL
    torch.backends.cuda.matmul.allow_tf32 = False
    name = torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else "cpu"
    print(f"device: {name}  torch {torch.__version__}  model: hidden={shapes.hidden} layers={shapes.layers} "
          f"vocab={shapes.vocab}", flush=True)
    report = Report()
    with tempfile.TemporaryDirectory(prefix="pdserve-gpu-check-") as tmp:
        path = Path(tmp) / "model"
        save_model(path, shapes, args.seed)
        if "greedy" not in args.skip:
            check_greedy_and_prefix(report, path, shapes, args)
        if "parallel" not in args.skip:
            check_parallel(report, path, shapes, args)
        if "beam" not in args.skip:
            check_beam(report, Path(tmp), shapes, args)
        if "half" not in args.skip:
            for dtype_name in ("float16", "bfloat16"):
                check_half(report, path, shapes, args, dtype_name)
        if "quant" not in args.skip:
            check_quant(report, path, shapes, args)
        if "decode" not in args.skip:
            for dtype_name in ("float32", "bfloat16"):
                decode_throughput(report, path, shapes, args, dtype_name)
    if "kernel" not in args.skip:
        kernel_bandwidth(report, shapes, args)
    print("all checks passed" if report.ok else "SOME CHECKS FAILED", flush=True)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
