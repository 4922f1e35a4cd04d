"""`python -m pdserve.bench.offload --quick` (the embedded model, a 1P+1D cluster among
its runs): the report's form and its internal consistency, never its speed. Every
run accounted for, interleaved A B A B; each ratio the median of the per-repetition
ratios the JSON's summaries give; hit rates in [0, 1], tier hits only where tiers are
on; the last line the one-engine comparison's figures."""

from __future__ import annotations

import json
import math
import re
import statistics
from pathlib import Path

import pytest

from bench_helpers import run_bench

pytestmark = pytest.mark.cluster(seconds=60)

LAST = re.compile(r"^offload_ttft_p50_ratio=(\S+) offload_throughput_ratio=(\S+) host_hit_rate=(\S+)$")
RATIO = r"(\S+) \(min (\S+), max (\S+), k=(\d+)\)"


def test_quick_offload_benchmark_report_holds_together(tmp_path: Path) -> None:
    report = tmp_path / "offload.json"
    proc = run_bench(["-m", "pdserve.bench.offload", "--quick", "--json", str(report)])
    out = proc.stdout
    lines = out.strip().splitlines()
    match = LAST.match(lines[-1])
    assert match, lines[-1]
    assert "INCONSISTENT" not in out
    assert re.match(r"^isa=\S+ load_avg_1m=\S+ cpus=\d+", lines[0]), lines[0]
    assert "device pool" in out and "(25%" in out

    # interleaved: every repetition runs off then on, in each comparison
    order = re.findall(r"^\[repeat (\d)/(\d)\] (\S+)$", out, re.MULTILINE)
    assert [(r, name) for r, _, name in order[:4]] == [("1", "engine-off"), ("1", "engine-host"),
                                                       ("2", "engine-off"), ("2", "engine-host")]
    assert [name for _, _, name in order[4:8]] == ["cluster-off", "cluster-host"] * 2
    assert [name for _, _, name in order[8:11]] == ["off-16", "disk-warm-16", "disk-cold-16"]
    assert [name for _, _, name in order[11:]] == ["lru", "arc"] * 2
    for title in ("engine", "cluster"):
        for what in ("TTFT p50 off/on", "TTFT p99 off/on", "output throughput on/off"):
            assert re.search(rf"^{title} {what}: {RATIO}$", out, re.MULTILINE), (title, what)
    for kind in ("warm", "cold"):
        assert re.search(rf"block_size=16 {kind}: disk hit \S+ ms/block .* vs recompute \S+ ms/block", out), kind
    assert re.search(r"^  lru\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+[\d.]+$", out, re.MULTILINE)
    assert re.search(r"^  arc\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+[\d.]+$", out, re.MULTILINE)

    figures = json.loads(report.read_text())["figures"]
    engine = figures["engine"]
    for name, runs in {**engine, **figures["cluster"], **figures["policies"]}.items():
        assert len(runs) == 2, name
        for run in runs:
            s = run["summary"]
            assert s["failed"] == 0 and s["completed"] == s["num_requests"] > 0, name
            assert 0 < s["ttft"]["p50"] <= s["ttft"]["p99"], name
    conversations = 12 * 5  # --quick: 12 conversations of 5-6 turns
    assert all(r["summary"]["num_requests"] >= conversations for r in engine["engine-off"])
    # the tiers off find nothing below the pool; on, hit rates are rates
    assert all(r["onloaded_blocks"] == 0 and r["host_hit_rate"] is None for r in engine["engine-off"])
    rates = [r["host_hit_rate"] for r in engine["engine-host"]]
    assert all(0 <= h <= 1 for h in rates)
    # the last line is the engine comparison: medians of per-repetition ratios
    p50 = statistics.median(off["summary"]["ttft"]["p50"] / on["summary"]["ttft"]["p50"]
                            for off, on in zip(engine["engine-off"], engine["engine-host"]))
    tput = statistics.median(on["summary"]["output_throughput"] / off["summary"]["output_throughput"]
                             for off, on in zip(engine["engine-off"], engine["engine-host"]))
    assert float(match[1]) == pytest.approx(p50, abs=1e-3) == pytest.approx(figures["ttft_p50"]["median"], abs=1e-3)
    assert float(match[2]) == pytest.approx(tput, abs=1e-3)
    assert float(match[3]) == pytest.approx(statistics.median(rates), abs=1e-3)
    assert figures["ttft_p50"]["k"] == 2 and figures["ttft_p50"]["lo"] <= figures["ttft_p50"]["median"] <= figures["ttft_p50"]["hi"]
    disk = figures["disk_16"]
    assert disk["recompute_ms_per_block"] > 0
    for kind in ("warm", "cold"):
        assert disk[f"{kind}_disk_ms_per_block"] > 0 and 0 <= disk[f"{kind}_disk_hit_rate"] <= 1
    assert all(math.isfinite(float(x)) for x in match.groups())


@pytest.mark.parametrize(("argv", "named"), [(["--repeats", "0"], "--repeats"), (["--device-fraction", "0"], "--device-fraction"),
                                              (["--disk-block-sizes", "16,24"], "block sizes"),
                                              (["--turns", "0", "3"], "--turns")])
def test_offload_benchmark_refuses_bad_flags_naming_them(argv: list[str], named: str,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    from pdserve.bench.offload.__main__ import main

    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2 and named in capsys.readouterr().err
