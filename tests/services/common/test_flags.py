"""services/common/flags.py: the field types the flags read (tri-state booleans, tuples
of a fixed length and comma-separated ones, choices), their environment variables, and
`to_argv` reproducing every one of them."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import pytest

from pdserve.services.common.flags import add_flags, flag, from_namespace, parse_argv, to_argv


@dataclass(frozen=True)
class Demo:
    payoff: bool | None = flag(None, "tri-state: None leaves it to the engine")
    quick: bool = flag(False, "a switch")
    lengths: tuple[int, int] = flag((8, 128), "two values")
    sizes: tuple[int, ...] = flag((1, 4), "comma-separated")
    span: tuple[int, int] | None = flag(None, "two values or none")
    kind: str = flag("random", "one of a few", choices=("random", "prefix"))
    api_key: str | None = flag(None, "no variable", env=False)


def test_defaults_and_every_form_of_each_type() -> None:
    assert parse_argv(Demo, []) == Demo()
    got = parse_argv(Demo, ["--payoff", "false", "--quick", "--lengths", "3", "4", "--sizes", "1,16,64",
                            "--span", "5", "6", "--kind", "prefix"])
    assert got == Demo(False, True, (3, 4), (1, 16, 64), (5, 6), "prefix")
    assert parse_argv(Demo, ["--payoff"]).payoff is True
    assert parse_argv(Demo, ["--no-payoff"]).payoff is False
    assert parse_argv(Demo, ["--payoff", "true"]).payoff is True


@pytest.mark.parametrize("argv, named", [
    (["--payoff", "maybe"], "true|false"), (["--sizes", "1,x"], "--sizes"), (["--kind", "trace"], "--kind"),
    (["--lengths", "3"], "--lengths"), (["--no-payoff", "true"], "--no-payoff"),
])
def test_bad_values_exit_2_naming_the_flag(argv: list[str], named: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_argv(Demo, argv)
    assert exit_info.value.code == 2
    assert named in capsys.readouterr().err


def test_to_argv_reproduces_every_type() -> None:
    for config in (Demo(), Demo(True, True, (1, 2), (7,), (3, 3), "prefix", "k"), Demo(payoff=False)):
        assert parse_argv(Demo, to_argv(config)) == config
    assert to_argv(Demo(sizes=(1, 4, 16))) [:6] == ["--no-quick", "--lengths", "8", "128", "--sizes", "1,4,16"]


def test_environment_sets_defaults_but_not_where_opted_out(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_SIZES", "2,3")
    monkeypatch.setenv("PDSERVE_LENGTHS", "5,6")
    monkeypatch.setenv("PDSERVE_PAYOFF", "no")
    monkeypatch.setenv("PDSERVE_API_KEY", "secret")
    assert parse_argv(Demo, []) == Demo(payoff=False, lengths=(5, 6), sizes=(2, 3))
    assert parse_argv(Demo, ["--sizes", "9"]).sizes == (9,)  # the command line wins
    monkeypatch.setenv("PDSERVE_LENGTHS", "5")
    with pytest.raises(ValueError, match="PDSERVE_LENGTHS: expected 2"):
        parse_argv(Demo, [])


def test_help_names_each_variable_once() -> None:
    parser = argparse.ArgumentParser()
    assert add_flags(parser, Demo) == {"payoff", "quick", "lengths", "sizes", "span", "kind", "api_key"}
    text = parser.format_help()
    assert "PDSERVE_SIZES" in text and "PDSERVE_API_KEY" not in text
    assert from_namespace(Demo, parser.parse_args([])) == Demo()
