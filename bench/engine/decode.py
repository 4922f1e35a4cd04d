"""The decode workload of `bench.engine.offline`: step time at batch 1, 8, 16 and 64, the fast
path against `--enforce-eager` (the path before it), beside the bandwidth floor.

    python -m pdserve.bench.engine.offline --workload decode [--profile] [--repeats 3]

One process, one model (`bench.engine.offline`'s 100M-parameter fp32 Llama, seeded), three
engines on the same weights: `LLM(enforce_eager=True)`, `LLM()` (the fast path:
oneDNN-prepacked linear layers, engine/prepacked.py) and `LLM(decode_capture_sizes=
<the batch sizes>)` (the decode step compiled per batch size, engine/captured.py; with
`--quick` for the largest alone, the smaller batches running in it padded).
Each repetition runs, for each batch size, the three engines (rotated: bench/common/repeat.py): B
requests of 128 random prompt tokens are prefilled, then `--steps` (64) pure decode
steps are timed one by one (`time.perf_counter`); a repetition's figure is its
median step. Ratios are taken within a repetition, reported as median (min, max).

The floor of a decode step is the bytes of weights it must read (every linear layer
and the LM head; the embedding table is only looked up) divided by the read
bandwidth measured in each repetition (bench/engine/gemm.py: the best of 7 sums over 512 MB).

`--profile` runs each batch size once more per engine under `torch.profiler` and
splits its median step into GEMMs, attention (with the paged-KV gather), the small
operations (norms, rotary, activation, residuals, embedding), KV writes, sampling,
and the rest (Python, scheduling, per-op dispatch: the step's wall time less the
operators' own time). The profiler adds its own overhead to "the rest"; a captured
step's fused element-wise kernels are not operators the profiler names, so they count there too.

Last line: `decode_bw_fraction_b1=X decode_speedup_b16=Y` (floor / captured step at
batch 1; eager step / captured step at batch 16; medians over repetitions).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from pdserve.bench.common.machine import read_bandwidth
from pdserve.bench.common.random_model import FIRST_REGULAR_TOKEN, ModelSpec
from pdserve.bench.common.repeat import rotated
from pdserve.bench.common.stats import Ratio, median

PROMPT_LEN = 128
MODES = ("eager", "fast", "captured")

# Operator name -> part of the step (anything unlisted is a small operation).
_GEMM = ("mm", "addmm", "bmm", "_linear_pointwise", "_weight_int8pack_mm", "_weight_int4pack_mm", "_int_mm",
         "_scaled_mm", "_mkl_linear")
# index_select: the paged-KV gather (a whole page per index)
_ATTENTION = ("scaled_dot_product", "_scaled_dot_product", "index_select", "paged_decode_attention")
_KV_WRITE = ("index_copy", "index_put")
_SAMPLING = ("argmax", "topk", "sort", "softmax", "log_softmax", "multinomial", "exponential", "gumbel", "cumsum")
PARTS = ("gemm", "attention", "small ops", "kv write", "sampling", "python/other")


@dataclass(frozen=True)
class DecodeConfig:
    batches: tuple[int, ...] = (1, 8, 16, 64)
    steps: int = 64
    repeats: int = 3
    profile: bool = False
    threads: int = 2
    model: ModelSpec = ModelSpec()
    # buckets of the captured engine; None: one per batch size. --quick compiles only the
    # largest (a smaller batch runs in it padded, the captured path all the same): each
    # bucket is an Inductor compile of seconds from a cold cache
    capture_sizes: tuple[int, ...] | None = None

    @property
    def buckets(self) -> tuple[int, ...]:
        return self.batches if self.capture_sizes is None else self.capture_sizes


def weight_bytes_read(spec: ModelSpec) -> int:
    """fp32 bytes a decode step reads of the weights: every linear layer, the LM head
    (a tied one reads the embedding table once) and the norms."""
    head = spec.vocab_size * spec.hidden_size
    norms = (2 * spec.num_layers + 1) * spec.hidden_size
    return 4 * (spec.non_embedding_linear_params + head + norms)


def part_of(op: str) -> str:
    """The part of a step a profiled operator (`aten::mm`, `mkldnn::_linear_pointwise`) is."""
    name = op.split("::")[-1]
    if name.startswith(_KV_WRITE):
        return "kv write"
    if name.startswith(_GEMM):
        return "gemm"
    if name.startswith(_ATTENTION):
        return "attention"
    if name.lstrip("_").startswith(_SAMPLING):
        return "sampling"
    return "small ops"


def _prompts(batch: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(f"decode-{batch}-{seed}")
    return [[rng.randrange(FIRST_REGULAR_TOKEN, vocab) for _ in range(PROMPT_LEN)] for _ in range(batch)]


def decode_steps(llm, prompts: Sequence[Sequence[int]], steps: int, around: Callable[[Callable[[], None]], object]
                 | None = None) -> list[float]:
    """Prefill `prompts`, then time `steps` steps in which every request decodes one
    token; `around(run)` (a profiler) wraps the timed steps when given."""
    from pdserve.engine import SamplingParams

    eng = llm.engine
    # the first prompts decode while the last ones prefill (2048 tokens a step): room
    # for those tokens too, so that no request finishes inside the timed steps
    params = SamplingParams(max_tokens=steps + 8 + len(prompts) * PROMPT_LEN // 256, temperature=0.0,
                            ignore_eos=True)
    ids = [f"decode-{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts):
        eng.add_request(rid, list(prompt), params)
    times: list[float] = []
    try:
        eng.step()  # prefill (and any mixed steps after it: last_batch is the last step's)
        while eng.last_batch != (len(prompts), len(prompts)):
            eng.step()

        def run() -> None:
            for _ in range(steps):
                start = time.perf_counter()
                eng.step()
                times.append(time.perf_counter() - start)
                if eng.last_batch != (len(prompts), len(prompts)):
                    raise RuntimeError(f"decode bench: a step ran {eng.last_batch}, not one token per request")

        if around is None:
            run()
        else:
            around(run)
    finally:
        for rid in ids:
            eng.abort(rid)
    return times


def profile_step(llm, prompts: Sequence[Sequence[int]], steps: int) -> dict[str, float]:
    """Seconds per step in each of PARTS, under torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    holder: dict[str, object] = {}

    def around(run: Callable[[], None]) -> None:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            run()
        holder["prof"] = prof

    times = decode_steps(llm, prompts, steps, around)
    parts = dict.fromkeys(PARTS, 0.0)
    for event in holder["prof"].key_averages():  # type: ignore[attr-defined]
        if event.key.startswith(("aten::", "mkldnn::", "mkl::", "quantized::", "pdserve::")):
            parts[part_of(event.key)] += event.self_cpu_time_total / 1e6 / steps
    ops = sum(parts.values())
    parts["python/other"] = max(0.0, sum(times) / steps - ops)
    return parts


def load(model_dir: str, mode: str, batches: Sequence[int], buckets: Sequence[int] | None = None):
    """The engine of `mode`: eager (--enforce-eager), fast (the default: prepacked
    linears) or captured (the decode step compiled for each of `buckets`, by default
    `batches`)."""
    from pdserve.engine import LLM

    blocks = max(batches) * (-(-(PROMPT_LEN + 400) // 16))
    return LLM(model=model_dir, num_blocks=blocks, block_size=16, enable_prefix_caching=False,
               max_num_seqs=max(256, max(batches)), max_num_batched_tokens=2048, dtype="float32",
               enforce_eager=mode == "eager", decode_capture_sizes=tuple(buckets or batches) if mode == "captured" else ())


def run(model_dir: str, cfg: DecodeConfig, log: Callable[[str], None]) -> str:
    torch.set_num_threads(cfg.threads)
    spec = cfg.model
    engines = {}
    for mode in MODES:
        start = time.perf_counter()
        engines[mode] = load(model_dir, mode, cfg.batches, cfg.buckets)
        log(f"{mode}: engine ready in {time.perf_counter() - start:.1f} s")
    for llm in engines.values():  # warm-up: first-call allocations, oneDNN primitives
        decode_steps(llm, _prompts(2, spec.vocab_size, -1), 4)
    floor_bytes = weight_bytes_read(spec)
    step: dict[tuple[str, int], list[float]] = {(m, b): [] for m in MODES for b in cfg.batches}
    floors: list[float] = []
    for rep in range(cfg.repeats):
        bw = read_bandwidth()
        floors.append(floor_bytes / (bw * 1e9))
        log(f"[repeat {rep + 1}/{cfg.repeats}] read bandwidth {bw:.1f} GB/s, floor {floors[-1] * 1e3:.2f} ms")
        for batch in cfg.batches:
            prompts = _prompts(batch, spec.vocab_size, rep)
            for mode in rotated(list(MODES), rep):
                step[(mode, batch)].append(median(decode_steps(engines[mode], prompts, cfg.steps)))
    floor = median(floors)
    print(f"threads={torch.get_num_threads()} weights read per step {floor_bytes / 1e6:.0f} MB, "
          f"bandwidth floor {floor * 1e3:.2f} ms (median of {cfg.repeats})")
    print(f"{'batch':>5} {'eager ms':>9} {'fast ms':>8} {'capt ms':>8} {'eager tok/s':>11} {'capt tok/s':>10} "
          f"{'fast/eager speed-up':>28} {'captured/eager speed-up':>28} {'floor/fast':>28} {'floor/captured':>28}")
    speedups: dict[int, Ratio] = {}
    fractions: dict[int, Ratio] = {}
    for batch in cfg.batches:
        eager, fast, capt = step[("eager", batch)], step[("fast", batch)], step[("captured", batch)]
        speedups[batch] = Ratio.paired(eager, capt)
        fractions[batch] = Ratio.paired(floors, capt)
        e, f, c = (median(x) for x in (eager, fast, capt))
        print(f"{batch:>5} {e * 1e3:>9.2f} {f * 1e3:>8.2f} {c * 1e3:>8.2f} {batch / e:>11.1f} {batch / c:>10.1f} "
              f"{Ratio.paired(eager, fast)!s:>28} {speedups[batch]!s:>28} {Ratio.paired(floors, fast)!s:>28} "
              f"{fractions[batch]!s:>28}")
    if cfg.profile:
        print_profile(engines, cfg, floor)
    b1 = fractions.get(1, Ratio.of([]))
    b16 = speedups.get(16, Ratio.of([]))
    return f"decode_bw_fraction_b1={b1.median:.3f} decode_speedup_b16={b16.median:.3f}"


def print_profile(engines: dict, cfg: DecodeConfig, floor: float) -> None:
    print(f"\nprofile (ms per decode step, torch.profiler; floor {floor * 1e3:.2f} ms)")
    print(f"{'batch':>5} {'path':>8} " + " ".join(f"{p:>12}" for p in PARTS) + f" {'total':>8}")
    for batch in cfg.batches:
        prompts = _prompts(batch, cfg.model.vocab_size, 10_000)
        for mode in MODES:
            parts = profile_step(engines[mode], prompts, min(cfg.steps, 32))
            cells = " ".join(f"{parts[p] * 1e3:>12.2f}" for p in PARTS)
            print(f"{batch:>5} {mode:>8} {cells} {sum(parts.values()) * 1e3:>8.2f}")
