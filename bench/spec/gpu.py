#!/usr/bin/env python
"""GPU mode of the speculative-decoding benchmark (bench/spec/methods.py), for one GPU in under 5 minutes.

    python -m pdserve.bench.spec.gpu [--json PATH] [--plot PATH]    # cuda, bf16, ~0.8B target
    python -m pdserve.bench.spec.gpu --device cpu --tiny           # smoke test without a GPU
    python -m pdserve.bench.spec.gpu -- --repeats 1 --concurrency 1,64  # after --: bench.spec.methods's flags

Two models are saved to a temporary directory (removed at the end):

    target  a seeded random Llama, bench.cluster.clusters.GPU_MODEL's shape (hidden 2048, 16 layers,
            GQA 16/8) with the embedded model's 4096-token vocabulary, so that bench.spec.methods's
            stdlib prompts, encoded by the embedded tokenizer, are valid ids for it
    draft   the target's first 2 layers with its embeddings and final norm (a layer-skip
            self-draft): an independent random draft would agree with a random target on
            nothing, a truncated one agrees where the later layers move the logits little

then `python -m pdserve.bench.spec.methods` runs off / ngram / draft_model on them (2 interleaved
repetitions, concurrency 1, 4, 16, 64, max_tokens 64). Random weights make the acceptance
figures say nothing about real models (a random model's greedy output loops, which prompt
lookup predicts well); what the run measures is the mechanism's cost on a GPU: a verification
pass over K+1 tokens against a decode step, and the draft's K passes. In bf16, batched
verification and one-token decoding round differently, so a near-tie in the logits may give
a different greedy token: bench.spec.methods reports every such difference (INCONSISTENT, exit 1).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from pdserve.bench.common.entry import parse
from pdserve.bench.spec import run as spec
from pdserve.bench.cluster.clusters import GPU_MODEL
from pdserve.bench.common.random_model import ModelSpec, save_random_model, temporary_dir
from pdserve.engine.config import DEFAULT_MODEL
from pdserve.services.common.flags import flag

TARGET = ModelSpec(**asdict(GPU_MODEL) | {"vocab_size": 4096, "max_position_embeddings": 2048})
TINY = ModelSpec(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
                 vocab_size=4096, max_position_embeddings=1024)
DRAFT_LAYERS = 2  # of TARGET's; TINY's draft has 1


def save_truncated_draft(target: Path, draft: Path, num_layers: int) -> None:
    """`target`'s first `num_layers` layers, its embeddings, final norm and head, as a model."""
    from safetensors.torch import load_file, save_file

    config = json.loads((target / "config.json").read_text())
    config["num_hidden_layers"] = num_layers
    if "layer_types" in config:
        config["layer_types"] = config["layer_types"][:num_layers]
    draft.mkdir(parents=True, exist_ok=True)
    (draft / "config.json").write_text(json.dumps(config, indent=2))
    tensors = {}
    for path in sorted(target.glob("*.safetensors")):
        tensors |= load_file(path)
    kept = {k: v for k, v in tensors.items() if not k.startswith("model.layers.") or int(k.split(".")[2]) < num_layers}
    save_file(kept, draft / "model.safetensors", metadata={"format": "pt"})


@dataclass(frozen=True)
class GpuSpecFlags:
    """This command's own flags; bench.spec.methods's come after `--`."""

    device: str = flag("cuda", "torch device of the models")
    dtype: str | None = flag(None, "model dtype (bfloat16 on cuda, float32 on cpu)")
    tiny: bool = flag(False, "tiny models and bench.spec.methods --quick (CPU smoke test)")
    seed: int = flag(0, "seed of the random target")
    json: str | None = flag(None, "write bench.spec.methods's full report here")
    plot: str | None = flag(None, "write a PNG of acceptance by position here")


def bench_args(args: GpuSpecFlags, target: Path, draft: Path, rest: Sequence[str]) -> list[str]:
    """bench.spec.methods's flags for the two saved models, then `rest` (given after `--`)."""
    dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    common = ["--model", str(target), "--draft-model", str(draft), "--tokenizer", DEFAULT_MODEL,
              "--device", args.device, "--dtype", dtype]
    if args.json:
        common += ["--json", args.json]
    if args.plot:
        common += ["--plot", args.plot]
    preset = ["--quick"] if args.tiny else ["--repeats", "2", "--max-tokens", "64"]
    return [*preset, *common, *rest]


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    own, rest = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    args = parse(GpuSpecFlags, own, "python -m pdserve.bench.spec.gpu", __doc__)
    shape, layers = (TINY, 1) if args.tiny else (TARGET, DRAFT_LAYERS)
    print(f"target: random Llama, {shape.total_params / 1e6:.1f}M parameters; "
          f"draft: the target's first {layers} of {shape.num_layers} layers", flush=True)
    with temporary_dir("pdserve-spec-gpu-") as tmp:
        save_random_model(shape, tmp / "target", args.seed)
        save_truncated_draft(tmp / "target", tmp / "draft", layers)
        return spec.main(bench_args(args, tmp / "target", tmp / "draft", rest), "python -m pdserve.bench.spec.gpu --",
                         spec.__doc__)


if __name__ == "__main__":
    sys.exit(main())
