"""What every benchmark's `main` shares (bench/common/entry.py): its flags parsed into a
config, presets overridden by the flags given, and a refused value's exit."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from pdserve.bench.common.entry import overridden, parse
from pdserve.services.common.flags import flag


@dataclass(frozen=True)
class Config:
    repeats: int = 3
    duration_s: float = 40.0
    slo: str = "derived"

    def __post_init__(self) -> None:
        if self.repeats < 1:
            raise ValueError(f"--repeats: must be >= 1, got {self.repeats}")


@dataclass(frozen=True)
class Flags:
    quick: bool = flag(False, "the quick preset")
    repeats: int | None = flag(None, "repetitions")
    duration: float | None = flag(None, "seconds")
    slo: str | None = flag(None, "parsed by the caller")
    json: str | None = flag(None, "not a config field")


QUICK = Config(repeats=2, duration_s=3.0)


def build(flags: Flags) -> Config:
    return overridden(QUICK if flags.quick else Config(), flags, renamed={"duration": "duration_s"}, skip={"slo"})


def test_flags_given_override_the_preset_and_the_rest_keep_it() -> None:
    assert parse(Flags, [], "bench", None, build) == Config()
    assert parse(Flags, ["--quick"], "bench", None, build) == QUICK
    got = parse(Flags, ["--quick", "--repeats", "5", "--duration", "1.5", "--slo", "x", "--json", "r.json"],
                "bench", None, build)
    assert got == Config(repeats=5, duration_s=1.5, slo="derived")  # slo skipped, json not a field


def test_a_value_the_config_refuses_exits_2_naming_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse(Flags, ["--repeats", "0"], "bench", None, build)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "bench: error: --repeats: must be >= 1, got 0" in err


def test_parse_without_a_build_returns_the_flags() -> None:
    assert parse(Flags, ["--json", "out.json"], "bench", None) == Flags(json="out.json")
