"""`make demo`: complete a few Python snippets with the embedded default model."""

from __future__ import annotations

import argparse
import time

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.llm import DEFAULT_MODEL

PROMPTS = [
    "import os\n\n\ndef ",
    "class Stack:\n    def __init__(self):\n        ",
    "    def __repr__(self):\n        return ",
    "for i in range(",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args()
    llm = LLM(model=args.model)
    start = time.perf_counter()
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=args.max_tokens, temperature=0.0))
    elapsed = time.perf_counter() - start
    for out in outs:
        print("=" * 60)
        print(out.prompt + out.outputs[0].text)
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    print("=" * 60)
    print(f"{len(outs)} completions, {tokens} tokens in {elapsed:.2f}s ({tokens / elapsed:.0f} tok/s); stats {llm.stats()}")


if __name__ == "__main__":
    main()
