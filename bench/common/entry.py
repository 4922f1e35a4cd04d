"""What the `main` of every benchmark shares: its flags, and its exit.

    parse(Flags, argv, prog, doc, build)   the command line -> the benchmark's Flags (a
        frozen dataclass, one field a flag: services/common/flags.py, as every service's
        config) -> build(flags), its config; a value either refuses exits 2 naming it
    overridden(preset, flags)              the preset (quick, gpu, ...) with every flag
                                           that was given (not None) on top
    compare_main(name, run)                run() -> (last line, problems), printed after
                                           the wall time; exit 0 only when nothing was
                                           inconsistent (130 interrupted, 1 failed)
    compare_entry(name, Flags, argv, ...)  the two above for a comparison whose Flags hold
                                           a `report: ReportFlags` block (--json, --plot)

A SIGTERM unwinds like ^C, so the clusters a benchmark started are stopped on the way out.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
import signal
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

from pdserve.services.common.flags import add_flags, flag, from_namespace

C = TypeVar("C")
F = TypeVar("F")


def parse(flags: type[F], argv: Sequence[str] | None, prog: str, doc: str | None,
          build: Callable[[F], C] = lambda f: f) -> C:
    """The benchmark's config from its command line (`python -m PROG --help` lists the
    flags, each with its PDSERVE_* variable); bad input exits 2 with a message naming
    the flag, as argparse does for a malformed one."""
    parser = argparse.ArgumentParser(prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_flags(parser, flags)
    try:
        return build(from_namespace(flags, parser.parse_args(argv)))
    except ValueError as e:
        parser.error(str(e))


def overridden(preset: C, flags: Any, *, renamed: Mapping[str, str] | None = None, skip: Iterable[str] = ()) -> C:
    """`preset` (a frozen config) with every field of `flags` that was given (not None)
    and that `preset` has, but those in `skip` (flags the caller turns into a field
    itself); `renamed` maps a flag's name to the field it sets when the two differ
    (`{"duration": "duration_s"}`)."""
    fields = {f.name for f in dataclasses.fields(preset)}
    renamed = renamed or {}
    given = {}
    for f in dataclasses.fields(flags):
        name = renamed.get(f.name, f.name)
        value = getattr(flags, f.name)
        if name in fields and f.name not in skip and value is not None:
            given[name] = value
    return dataclasses.replace(preset, **given)


@dataclass(frozen=True)
class ReportFlags:
    """Where a comparison writes its report: a block of its flags (--json, --plot)."""

    json: str | None = flag(None, "write the full report (every run's records) to this file")
    plot: str | None = flag(None, "write the report's figure to this PNG")


def compare_entry(name: str, flags: type[F], argv: Sequence[str] | None, doc: str | None,
                  config_from: Callable[[F], C], run: Callable[..., tuple[str, list[str]]]) -> int:
    """`python -m pdserve.NAME [flags]`: its config from the flags (`flags` has a
    `report: ReportFlags` field), then compare_main running `run(config, json_path=,
    plot_path=)`."""
    cfg, given = parse(flags, argv, f"python -m pdserve.{name}", doc, lambda f: (config_from(f), f))
    report = given.report
    return compare_main(name, lambda: run(cfg, json_path=report.json, plot_path=report.plot))


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
