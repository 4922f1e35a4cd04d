"""What the `main` of a cluster-comparison benchmark (bench.cluster.disagg, bench.cluster.prefix) shares.

    parse flags -> overridden(base config, flags given) -> compare_main(name, run)
        run() -> (last line, problems)     printed after the wall time; exit 0 only
                                           when nothing was inconsistent

A SIGTERM unwinds like ^C, so the clusters are stopped on the way out.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import TypeVar

C = TypeVar("C")


def overridden(base: C, given: Mapping[str, object], parser: argparse.ArgumentParser) -> C:
    """`base` (a frozen config) with every flag that was given (not None); a value the
    config refuses is the parser's error, naming it."""
    try:
        return replace(base, **{k: v for k, v in given.items() if v is not None})
    except ValueError as e:
        parser.error(str(e))


def compare_main(name: str, run: Callable[[], tuple[str, list[str]]]) -> int:
    """Run a benchmark; its exit status (130 interrupted, 1 failed or inconsistent)."""
    signal.signal(signal.SIGTERM, interrupt_on_sigterm)
    start = time.perf_counter()
    try:
        last, problems = run()
    except KeyboardInterrupt:
        print(f"{name}: interrupted", file=sys.stderr)
        return 130
    except (ConnectionError, RuntimeError, OSError, ValueError) as e:  # a cluster that did not start, ...
        print(f"{name}: {e}", file=sys.stderr)
        return 1
    for problem in problems:
        print(f"INCONSISTENT: {problem}")
    print(f"benchmark wall time: {time.perf_counter() - start:.0f} s")
    print(last, flush=True)
    return 1 if problems else 0


def interrupt_on_sigterm(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")
