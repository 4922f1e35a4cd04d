"""The `pdserve` command line."""

from __future__ import annotations

import argparse
import sys


def _offline(args: argparse.Namespace) -> int:
    from engine import LLM, SamplingParams

    llm = LLM(model=args.model, dtype=args.dtype, device=args.device)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    for out in llm.generate(args.prompts, params):
        print(out.prompt + out.outputs[0].text)
        print("-" * 40)
    return 0


def build_parser() -> argparse.ArgumentParser:
    from engine.llm import DEFAULT_MODEL

    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    off = sub.add_parser("offline", help="generate in this process with the engine alone")
    off.add_argument("prompts", nargs="+")
    off.add_argument("--model", default=DEFAULT_MODEL)
    off.add_argument("--max-tokens", type=int, default=64)
    off.add_argument("--temperature", type=float, default=0.0)
    off.add_argument("--seed", type=int, default=None)
    off.add_argument("--dtype", default="float32")
    off.add_argument("--device", default="cpu")
    off.set_defaults(func=_offline)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:
        print(f"pdserve: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
