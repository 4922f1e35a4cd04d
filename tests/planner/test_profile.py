"""`pdserve profile` (planner/profile.py): a real profile of the embedded model taken
by the CLI (with the serving path measured through real clusters), read back; its
interpolation, and the refusals of a bad file or flag."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.engine.llm import DEFAULT_MODEL
from pdserve.planner.profile import FORMAT, Profile, ProfileConfig, _interpolate
from cluster_helpers import REPO, child_env

pytestmark = pytest.mark.cluster(seconds=15)  # the CLI, and the clusters its serving measurement starts


@pytest.fixture(scope="module")
def taken(tmp_path_factory):
    out = tmp_path_factory.mktemp("profile") / "profile.json"
    done = subprocess.run(
        [sys.executable, "-m", "pdserve", "profile", "--quick", "--output", str(out), "--num-blocks", "512",
         "--torch-threads", "1", "--transfer-blocks", "32", "--serving"],
        cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return out, done.stdout


def test_the_cli_writes_a_profile_of_what_it_measured(taken):
    path, stdout = taken
    profile = Profile.read(path)
    assert stdout.splitlines()[-1] == (f"profile {path} prefill_points={len(profile.prefill)} "
                                       f"decode_points={len(profile.decode)}")
    source = profile.source
    assert source["model"] == "pdserve-tiny-code" and source["device"] == "cpu"
    assert source["config_sha256"] == hashlib.sha256((Path(DEFAULT_MODEL) / "config.json").read_bytes()).hexdigest()
    assert source["flags"]["num_blocks"] == 512 and source["flags"]["torch_threads"] == 1
    assert source["machine"]["torch_threads"] == 1 and source["machine"]["isa"]
    assert source["kv_bytes_per_block"] > 0 and source["block_size"] == 16
    # every prefill point ran what it says: the cached prefix was not run again
    assert {(p["tokens"], p["cached"]) for p in profile.prefill} == {
        (n, c) for n in (16, 128, 512) for c in (0, 256)}
    for point in [*profile.prefill, *profile.decode]:
        assert 0 < point["low"] <= point["seconds"] <= point["high"] and point["runs"] == 1
    # decode points the 512-block pool holds (16 x 512-token sequences do not fit)
    assert {(p["batch"], p["context"]) for p in profile.decode} == {
        (1, 64), (4, 64), (16, 64), (1, 512), (4, 512)}
    transfer = profile.transfer
    assert transfer["bytes_per_block"] == source["kv_bytes_per_block"] and transfer["seconds_per_block"] > 0
    assert profile.transfer_seconds(10) == pytest.approx(
        transfer["latency_seconds"] + 9 * transfer["seconds_per_block"])
    # the serving path, through real clusters: what it adds, never negative
    serving = profile.serving
    assert set(serving["measured_itl_seconds"]) == {"1", "8", "32"} and serving["measured_ttft_seconds"] > 0
    for key in ("request_seconds", "remote_seconds", "step_seconds", "step_seconds_per_sequence"):
        assert serving[key] >= 0, key
    assert profile.step_overhead(8) == pytest.approx(serving["step_seconds"] + 8 * serving["step_seconds_per_sequence"])


def test_interpolation_meets_the_points_and_is_linear_between_and_beyond():
    xs, ys = [10, 20, 40], [1.0, 2.0, 6.0]
    assert [_interpolate(xs, ys, x) for x in xs] == ys
    assert _interpolate(xs, ys, 30) == pytest.approx(4.0)
    assert _interpolate(xs, ys, 60) == pytest.approx(10.0)  # the last segment's slope
    assert _interpolate(xs, ys, 0) == 0.0  # extrapolated below zero: clipped
    assert _interpolate([5], [3.0], 100) == 3.0
    profile = Profile({}, prefill=[
        {"tokens": t, "cached": c, "seconds": t / 1000 + c / 10000} for t in (16, 64) for c in (0, 256)],
        decode=[{"batch": b, "context": x, "seconds": 0.001 * b + x / 1e5} for b in (1, 8) for x in (64, 512)])
    assert profile.prefill_seconds(40, 128) == pytest.approx(0.040 + 0.0128)
    assert profile.decode_seconds(4, 288) == pytest.approx(0.004 + 0.00288)
    assert profile.transfer_seconds(8) == 0.0  # none measured


def test_a_file_that_is_not_a_profile_is_refused_naming_what(tmp_path):
    cases = {"bad.json": "{not json", "other.json": json.dumps({"format": "something/2"}),
             "empty.json": json.dumps({"format": FORMAT, "source": {}, "prefill": [], "decode": [{"x": 1}]})}
    for name, text in cases.items():
        (tmp_path / name).write_text(text)
    with pytest.raises(ValueError, match="cannot read"):
        Profile.read(tmp_path / "bad.json")
    with pytest.raises(ValueError, match=f"not a {FORMAT} file"):
        Profile.read(tmp_path / "other.json")
    with pytest.raises(ValueError, match="no prefill points"):
        Profile.read(tmp_path / "empty.json")
    with pytest.raises(ValueError, match="cannot read"):
        Profile.read(tmp_path / "missing.json")


def test_a_bad_flag_is_refused_by_name():
    done = subprocess.run([sys.executable, "-m", "pdserve", "profile", "--repeats", "0"], cwd=REPO, env=child_env(),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "repeats" in done.stderr
    with pytest.raises(ValueError, match="decode_steps"):
        ProfileConfig(decode_steps=0)
