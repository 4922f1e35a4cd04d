"""Smoke test of the speculative-decoding benchmark: `python -m pdserve.bench.spec.methods --quick`
end to end (about 10 s). Its figures are in docs/benchmarks.md; here only the form of
its report, and that speculation was lossless (every method's tokens equal spec-off's),
are checked, never its speed."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from bench_helpers import run_bench

pytestmark = pytest.mark.cluster(seconds=10)

LAST_LINE = re.compile(r"tpot_ratio_c1=(?P<x>\S+) throughput_ratio_c64=(?P<y>\S+) acceptance_length=(?P<z>\S+)")


def test_quick_spec_benchmark_is_lossless_and_reports_ratios(tmp_path: Path) -> None:
    report, plot = tmp_path / "spec.json", tmp_path / "spec.png"
    # measure_payoff off: every eligible step drafts, whatever this machine's timings say
    proc = run_bench(["-m", "pdserve.bench.spec.methods", "--quick", "--measure-payoff", "false", "--json", str(report),
                      "--plot", str(plot)], timeout=300)
    lines = proc.stdout.strip().splitlines()
    match = LAST_LINE.fullmatch(lines[-1])
    assert match, lines[-1]
    x, y, z = (float(match[k]) for k in "xyz")
    assert all(math.isfinite(v) and v > 0 for v in (x, y)), lines[-1]
    assert z >= 1, lines[-1]
    assert "INCONSISTENT" not in proc.stdout

    # every repetition runs every method once, in an order rotated by the repetition
    order = re.findall(r"^\[repeat (\d)/2\] grounded c=1 (\w+):", proc.stdout, re.MULTILINE)
    assert order == [("1", "off"), ("1", "ngram"), ("1", "draft_model"),
                     ("2", "ngram"), ("2", "draft_model"), ("2", "off")], order

    data = json.loads(report.read_text())
    assert data["problems"] == [] and data["last_line"] == lines[-1]
    for cell in data["cells"]:
        if cell["method"] == "off":
            continue
        assert cell["tpot_ratio"]["k"] == 2 and cell["tpot_ratio"]["lo"] <= cell["tpot_ratio"]["median"]
        assert cell["drafts"] > 0 and 0 <= cell["acceptance_rate"] <= 1 and cell["acceptance_length"] >= 1
        assert 1 <= cell["tokens_per_step"] <= cell["acceptance_length"]
        assert cell["cpu_throughput_ratio"]["median"] > 0
        by_pos = cell["acceptance_by_pos"]
        assert all(a >= b for a, b in zip(by_pos, by_pos[1:])), by_pos  # never increases with position
    assert plot.read_bytes()[:4] == b"\x89PNG"


def test_gpu_mode_runs_on_cpu_with_tiny_models() -> None:
    """bench.spec.gpu's smoke option: a tiny random target and its truncated draft."""
    proc = run_bench(["-m", "pdserve.bench.spec.gpu", "--device", "cpu", "--tiny", "--", "--repeats", "1",
                      "--workloads", "grounded", "--measure-payoff", "false"], timeout=300)
    assert "draft: the target's first 1 of 2 layers" in proc.stdout
    assert LAST_LINE.fullmatch(proc.stdout.strip().splitlines()[-1]), proc.stdout[-500:]
    assert "INCONSISTENT" not in proc.stdout


def test_a_token_that_differs_from_spec_off_is_reported() -> None:
    from pdserve.bench.spec.report import Run, mismatches
    from pdserve.engine.spec.speculator import SpecStats

    def run(method: str, tokens: tuple[tuple[int, ...], ...]) -> Run:
        return Run(method, "grounded", 4, 0, 1.0, 1.0, 6, 0.1, SpecStats(), tokens)

    off = run("off", ((1, 2, 3), (4, 5, 6)))
    assert mismatches(run("ngram", ((1, 2, 3), (4, 5, 6))), off) == []
    assert mismatches(run("ngram", ((1, 2, 3), (4, 9, 6))), off) == [
        "ngram grounded c=4 repetition 1: request 1 differs from off at output token 1 (3 vs 3 tokens)"
    ]


def test_head_line_gives_each_proposers_acceptance_and_tpot_in_the_issues_names() -> None:
    from pdserve.bench.spec.report import Run, analyse, head_lines
    from pdserve.engine.spec.speculator import SpecStats

    def run(method: str, workload: str, accepted: int, tpot_s: float) -> Run:
        stats = SpecStats() if method == "off" else SpecStats(10, 40, accepted, (accepted, 0, 0, 0))
        return Run(method, workload, 1, 0, 1.0, 1.0, 30, tpot_s, stats, ((1, 2, 3),))

    runs = [run("off", "completion", 0, 0.004), run("ngram", "completion", 6, 0.003),
            run("draft_model", "completion", 4, 0.005), run("eagle3", "completion", 9, 0.002)]
    cells, problems = analyse(runs)
    assert problems == []
    # acceptance length = 1 + accepted / drafts
    assert head_lines(cells, runs) == [
        "completion: eagle_acceptance_length=1.900 draft_acceptance_length=1.400 ngram_acceptance_length=1.600 "
        "eagle_tpot_c1_ms=2.00 draft_tpot_c1_ms=5.00 ngram_tpot_c1_ms=3.00 off_tpot_c1_ms=4.00"]
    without_eagle = [r for r in runs if r.method != "eagle3"]
    assert head_lines(analyse(without_eagle)[0], without_eagle) == []  # only where all three ran
