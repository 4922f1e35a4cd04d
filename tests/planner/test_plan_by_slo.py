"""`pdserve plan --profile`: the cheapest split meeting the targets, searched in the
simulator on a profile of known costs; the closest split when none can; refusals of
nonsensical flags and of another model's profile."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pdserve.cli import main
from pdserve.engine.llm import DEFAULT_MODEL
from pdserve.planner.plan import SloPlanConfig, shapes
from pdserve.planner.profile import Profile

# prefill 1 ms + 0.1 ms a token; decode 2 ms + 0.5 ms a sequence; as test_simulator.py's
COSTS = Profile(
    {"flags": {}, "num_blocks": 4096, "block_size": 16, "model": "pdserve-tiny-code", "config_sha256": None,
     "machine": {"cpu": "elsewhere", "isa": "none"}},
    prefill=[{"tokens": t, "cached": c, "seconds": 0.001 + 0.0001 * t} for t in (16, 4096) for c in (0, 4096)],
    decode=[{"batch": b, "context": x, "seconds": 0.002 + 0.0005 * b} for b in (1, 256) for x in (64, 4096)],
    transfer={"latency_seconds": 0.001, "seconds_per_block": 0.0002, "bytes_per_block": 1},
)
ARGS = ["--input-len", "200", "--output-len", "50", "--slo-ttft-ms", "200", "--slo-tpot-ms", "10", "--requests", "300",
        "--max-workers", "4"]


@pytest.fixture
def profile(tmp_path) -> str:
    path = tmp_path / "profile.json"
    COSTS.write(path)
    return str(path)


def plan(capsys, *args: str) -> tuple[int, list[str]]:
    code = main(["plan", *args])
    captured = capsys.readouterr()
    return code, (captured.out + captured.err).splitlines()


def test_a_light_load_gets_one_worker_and_a_heavier_one_more(profile, capsys):
    code, lines = plan(capsys, "--profile", profile, "--rate", "2", *ARGS)
    assert code == 0 and lines[-1] == "plan prefill=0 decode=0 mixed=1 local_prefill_threshold=0 workers=1"
    assert any(line.startswith("warning: the profile was taken on another machine") for line in lines)
    code, lines = plan(capsys, "--profile", profile, "--rate", "40", *ARGS)
    assert code == 0 and lines[-1].startswith("plan ") and "workers=1" not in lines[-1]
    assert any("<- plan" in line for line in lines)


def test_targets_no_split_can_meet_name_the_closest(profile, capsys):
    code, lines = plan(capsys, "--profile", profile, "--rate", "2", *ARGS[:6], "--slo-tpot-ms", "1", *ARGS[8:])
    assert code == 1 and lines[-1].startswith("plan none closest=") and "met=" in lines[-1]


def test_json_lists_every_split_tried(profile, capsys):
    code, lines = plan(capsys, "--profile", profile, "--rate", "2", *ARGS, "--json")
    record = json.loads(next(line for line in lines if line.startswith("{")))
    assert record["chosen"]["mixed"] == 1 and record["chosen"]["met"] >= 0.9
    assert len(record["tried"]) == len(shapes(1, SloPlanConfig().local_prefill_thresholds))


@pytest.mark.parametrize("change, field", [
    (["--rate", "0"], "rate"), (["--rate", "nan"], "rate"), (["--slo-ttft-ms", "-1"], "slo_ttft_ms"),
    (["--attainment", "1.5"], "attainment"), (["--max-workers", "0"], "max_workers"),
    (["--length-spread", "1"], "length_spread"),
])
def test_nonsense_is_refused_by_name(profile, capsys, change, field):
    args = ["--profile", profile, "--rate", "2", *ARGS]
    i = args.index(change[0]) if change[0] in args else None
    if i is not None:
        args[i + 1] = change[1]
    else:
        args += change
    code, lines = plan(capsys, *args)
    assert code == 2 and lines[-1].startswith(f"pdserve: {field}:")


def test_a_profile_of_another_model_is_refused(profile, capsys, tmp_path):
    model = tmp_path / "other-model"
    shutil.copytree(DEFAULT_MODEL, model)
    config = json.loads((model / "config.json").read_text())
    config["num_hidden_layers"] += 1
    (model / "config.json").write_text(json.dumps(config))
    taken = json.loads(Path(profile).read_text())
    taken["source"]["config_sha256"] = "0" * 64
    Path(profile).write_text(json.dumps(taken))
    code, lines = plan(capsys, "--profile", profile, "--rate", "2", *ARGS, "--model", str(model))
    assert code == 2 and lines[-1].startswith("pdserve: profile: taken on model")
    (tmp_path / "bad.json").write_text("[]")
    code, lines = plan(capsys, "--profile", str(tmp_path / "bad.json"), "--rate", "2", *ARGS)
    assert code == 2 and "profile:" in lines[-1]
