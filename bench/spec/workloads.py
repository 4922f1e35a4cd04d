"""The speculative-decoding benchmark's prompts (bench/spec/methods.py): functions from the
standard-library files the embedded model never trained on.

    held_out_sources: scripts/train_default_model.py's val split (every 40th stdlib file)
                      and idlelib (never in its corpus)
        --functions (ast)--> Function(source, name, parameter)  seeded draw, size-filtered
            grounded:    <source>\\n\\n# The same function, with p renamed to new_p:\\n<renamed def line>
                         the answer repeats the prompt (what prompt lookup is for)
            completion:  the function's first lines; the model continues freely

Every request is greedy and ignores EOS, so each method does the same work and spec-off's
tokens are the reference for every other method's.
"""

from __future__ import annotations

import ast
import importlib.util
import random
import re
import sys
import sysconfig
import textwrap
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

WORKLOADS = ("grounded", "completion")
TRAINING_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "train_default_model.py"
COMPLETION_LINES = 4  # a completion prompt: the def line and the lines after it


@dataclass(frozen=True)
class Function:
    source: str  # dedented, from the def line (decorators left out)
    name: str
    parameter: str  # the first parameter other than self / cls, used in the body


@dataclass(frozen=True)
class SpecRequest:
    prompt: tuple[int, ...]
    max_tokens: int


def held_out_sources() -> list[str]:
    """Standard-library source the embedded model never trained on: the val split of its
    training script's corpus (every 40th file), then idlelib, which that corpus skips
    (application code; its tests left out)."""
    train = _training_script()
    val = train.collect_corpus(train.TrainConfig()).val
    idlelib = Path(sysconfig.get_paths()["stdlib"]) / "idlelib"
    return [*val, *(p.read_text(encoding="utf-8") for p in sorted(idlelib.rglob("*.py")) if "idle_test" not in p.parts)]


def _training_script() -> ModuleType:
    """scripts/train_default_model.py as a module: its corpus split is the one truth of
    what was held out."""
    spec = importlib.util.spec_from_file_location("train_default_model", TRAINING_SCRIPT)
    if spec is None or spec.loader is None:
        raise ValueError(f"cannot load {TRAINING_SCRIPT}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def functions(text: str) -> Iterator[Function]:
    """Every function and method of a module's source that has a parameter its body uses."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return
    lines = text.splitlines()
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.end_lineno is None:
            continue
        source = textwrap.dedent("\n".join(lines[node.lineno - 1 : node.end_lineno]))
        params = [a.arg for a in (*node.args.posonlyargs, *node.args.args) if a.arg not in ("self", "cls")]
        body = source.split("\n", 1)[-1]
        used = [p for p in params if len(p) > 1 and re.search(rf"\b{p}\b", body)]
        if used and source.startswith(("def ", "async def ")):
            yield Function(source, node.name, used[0])


def grounded_prompt(fn: Function) -> str:
    """The function, then a request to write it again with its parameter renamed,
    started with the renamed def line."""
    new = f"new_{fn.parameter}"
    renamed = re.sub(rf"\b{fn.parameter}\b", new, fn.source)
    return f"{fn.source}\n\n# The same function, with {fn.parameter} renamed to {new}:\n{renamed.split(chr(10))[0]}\n"


def completion_prompt(fn: Function) -> str:
    return "\n".join(fn.source.split("\n")[:COMPLETION_LINES]) + "\n"


PROMPTS: dict[str, Callable[[Function], str]] = {"grounded": grounded_prompt, "completion": completion_prompt}


def draw_functions(
    encode: Callable[[str], list[int]], count: int, token_range: tuple[int, int], seed: int,
) -> list[Function]:
    """`count` held-out functions of `token_range` tokens (inclusive), drawn with the seed;
    fewer when the held-out files have fewer."""
    pool = [fn for text in held_out_sources() for fn in functions(text)
            if fn.source.count("\n") >= 2 * COMPLETION_LINES]
    rng = random.Random(f"spec-functions-{seed}")
    rng.shuffle(pool)
    chosen: list[Function] = []
    for fn in pool:
        if len(chosen) == count:
            break
        if token_range[0] <= len(encode(fn.source)) <= token_range[1]:
            chosen.append(fn)
    return chosen


def make_requests(
    workload: str, fns: Sequence[Function], encode: Callable[[str], list[int]], max_tokens: int,
) -> list[SpecRequest]:
    prompt = PROMPTS[workload]
    return [SpecRequest(tuple(encode(prompt(fn))), max_tokens) for fn in fns]
