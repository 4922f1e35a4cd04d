"""Frozen config dataclasses <-> command-line flags <-> environment.

Each field of a config dataclass is one flag: `max_num_seqs` is `--max-num-seqs`,
and `PDSERVE_MAX_NUM_SEQS` in the environment overrides the field's default (a flag
given on the command line overrides both). `to_argv` turns a config back into
flags, so a launcher passes every setting to its children explicitly.

    @dataclass(frozen=True)
    class C:
        port: int = flag(50051, "port to listen on")

A field whose type is itself such a dataclass is a block of flags (its fields are
flags of their own, at the same level): one block, e.g. the cluster credentials
(services/common/credentials.py), is a field of every service's config, and every
launcher renders it as those flags.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import typing
from collections.abc import Iterable, Sequence
from typing import Any, TypeVar

ENV_PREFIX = "PDSERVE_"
T = TypeVar("T")


def flag(default: Any, help: str, *, cli: bool = True) -> Any:
    """A config field that is also a flag (`cli=False`: set in code only)."""
    return dataclasses.field(default=default, metadata={"help": help, "cli": cli})


def _cli_fields(cls: type) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if f.metadata.get("cli", True)]


def _base_type(annotation: Any) -> type:
    """int for `int`, `int | None` and `Optional[int]`."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    return args[0] if args else annotation


def _block(cls: type, f: dataclasses.Field) -> type | None:
    """The dataclass of a field that is a block of flags, else None."""
    kind = _base_type(typing.get_type_hints(cls)[f.name])
    return kind if dataclasses.is_dataclass(kind) else None


def option_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def _parse(kind: type, text: str, name: str) -> Any:
    if kind is bool:
        lowered = text.strip().lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{name}: expected a boolean, got {text!r}")
    try:
        return kind(text)
    except ValueError as e:
        raise ValueError(f"{name}: expected {kind.__name__}, got {text!r}") from e


def add_flags(parser: argparse.ArgumentParser, cls: type, skip: Iterable[str] = ()) -> set[str]:
    """Add one flag per field of `cls` not in `skip`; returns the names added."""
    hints = typing.get_type_hints(cls)
    added = set()
    for f in _cli_fields(cls):
        block = _block(cls, f)
        if block is not None:
            added |= add_flags(parser, block, skip)
            continue
        if f.name in skip:
            continue
        kind = _base_type(hints[f.name])
        default = f.default
        env = os.environ.get(ENV_PREFIX + f.name.upper())
        if env is not None:
            default = _parse(kind, env, ENV_PREFIX + f.name.upper())
        help_text = f"{f.metadata.get('help', '')} (env {ENV_PREFIX}{f.name.upper()}; default: %(default)s)"
        if kind is bool:
            parser.add_argument(option_name(f.name), dest=f.name, action=argparse.BooleanOptionalAction,
                                default=default, help=help_text)
        else:
            parser.add_argument(option_name(f.name), dest=f.name, type=kind, default=default, help=help_text)
        added.add(f.name)
    return added


def from_namespace(cls: type[T], namespace: argparse.Namespace, **overrides: Any) -> T:
    """Build `cls` from the parsed flags it has (others keep their defaults)."""
    values = {}
    for f in _cli_fields(cls):
        block = _block(cls, f)
        if block is not None:
            values[f.name] = from_namespace(block, namespace)
        elif hasattr(namespace, f.name):
            values[f.name] = getattr(namespace, f.name)
    values.update(overrides)
    return cls(**values)


def parse_argv(cls: type[T], argv: Sequence[str], prog: str | None = None, **overrides: Any) -> T:
    """The `cls` a command line of its flags gives, parsed as a service's own command
    parses it (`pdserve decode ARGV...` is `parse_argv(WorkerConfig, ARGV, role="decode")`).
    Bad flags exit as argparse does (status 2, the message names the flag)."""
    parser = argparse.ArgumentParser(prog=prog)
    add_flags(parser, cls)
    return from_namespace(cls, parser.parse_args(list(argv)), **overrides)


def to_argv(config: Any, skip: Iterable[str] = ()) -> list[str]:
    """Flags that reproduce `config` (every flag field not in `skip`, None omitted)."""
    argv: list[str] = []
    for f in _cli_fields(type(config)):
        value = getattr(config, f.name)
        if _block(type(config), f) is not None:
            argv += to_argv(value, skip)
            continue
        if f.name in skip or value is None:
            continue
        if isinstance(value, bool):
            argv.append(option_name(f.name) if value else "--no-" + f.name.replace("_", "-"))
        else:
            argv += [option_name(f.name), str(value)]
    return argv


def check(ok: bool, name: str, rule: str, value: object) -> None:
    """Raise ValueError naming the field, as engine.SamplingParams does."""
    if not ok:
        raise ValueError(f"{name}: {rule}, got {value!r}")
