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

How a field's type reads on the command line:

    bool                 --fast / --no-fast
    bool | None          tri-state (None: decided later): --fast, --no-fast, --fast true|false
    tuple[int, int]      two values: --prompt-tokens 8 128 (a fixed length n: n values)
    tuple[int, ...]      one comma-separated value: --concurrency 1,4,16
    anything else        one value of that type (int, float, str; `T | None` as T)

`flag(..., choices=(...))` limits the values; `flag(..., env=False)` reads no
`PDSERVE_*` variable (a setting whose variable already means something else).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import types
import typing
from collections.abc import Iterable, Sequence
from typing import Any, TypeVar

ENV_PREFIX = "PDSERVE_"
T = TypeVar("T")


def flag(default: Any, help: str, *, cli: bool = True, choices: Sequence[Any] | None = None,
         env: bool = True) -> Any:
    """A config field that is also a flag (`cli=False`: set in code only; `choices`: its
    allowed values; `env=False`: no PDSERVE_* variable sets its default)."""
    return dataclasses.field(default=default, metadata={"help": help, "cli": cli, "choices": choices, "env": env})


def _cli_fields(cls: type) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if f.metadata.get("cli", True)]


def _base_type(annotation: Any) -> type:
    """int for `int`, `int | None` and `Optional[int]`."""
    if not _optional(annotation):  # tuple[int, int] is a type of its own, not a union to unwrap
        return annotation
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    return args[0] if args else annotation


def _optional(annotation: Any) -> bool:
    """`X | None` or `Optional[X]`."""
    union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    return union and type(None) in typing.get_args(annotation)


def _tuple_shape(kind: Any) -> tuple[type, int | None] | None:
    """(element type, length) of `tuple[int, int]`, (element type, None) of
    `tuple[int, ...]`; None for a type that is not a tuple."""
    if typing.get_origin(kind) is not tuple:
        return None
    args = typing.get_args(kind)
    if len(args) == 2 and args[1] is Ellipsis:
        return args[0], None
    if len(set(args)) != 1:
        raise TypeError(f"tuple flags hold one element type, got {kind}")
    return args[0], len(args)


class _TriState(argparse.Action):
    """`--x` (True), `--no-x` (False), `--x true|false`; absent: the default (None)."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        negatives = ["--no-" + o[2:] for o in option_strings if o.startswith("--")]
        super().__init__([*option_strings, *negatives], dest, nargs="?", **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        if option_string is not None and option_string.startswith("--no-"):
            if values is not None:
                parser.error(f"{option_string}: takes no value")
            setattr(namespace, self.dest, False)
        else:
            setattr(namespace, self.dest, True if values is None else values)


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    """`cls`'s resolved field types: resolving a module's string annotations evaluates
    each (tens of ms a class), and every flag of every block asks for them."""
    return typing.get_type_hints(cls)


def _block(cls: type, f: dataclasses.Field) -> type | None:
    """The dataclass of a field that is a block of flags, else None."""
    kind = _base_type(_hints(cls)[f.name])
    return kind if dataclasses.is_dataclass(kind) else None


def option_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def _parse(kind: type, text: str, name: str) -> Any:
    shape = _tuple_shape(kind)
    if shape is not None:  # a variable's value: comma-separated, whatever the length
        element, length = shape
        values = tuple(_parse(element, part.strip(), name) for part in text.split(",") if part.strip())
        if length is not None and len(values) != length:
            raise ValueError(f"{name}: expected {length} comma-separated values, got {text!r}")
        return values
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
    hints = _hints(cls)
    added = set()
    for f in _cli_fields(cls):
        block = _block(cls, f)
        if block is not None:
            added |= add_flags(parser, block, skip)
            continue
        if f.name in skip:
            continue
        _add_flag(parser, f, hints[f.name])
        added.add(f.name)
    return added


def _add_flag(parser: argparse.ArgumentParser, f: dataclasses.Field, annotation: Any) -> None:
    kind = _base_type(annotation)
    variable = ENV_PREFIX + f.name.upper()
    default = f.default
    uses_env = f.metadata.get("env", True)
    if uses_env and os.environ.get(variable) is not None:
        default = _parse(kind, os.environ[variable], variable)
    where = f"env {variable}; " if uses_env else ""
    help_text = f"{f.metadata.get('help', '').replace('%', '%%')} ({where}default: %(default)s)"
    options: dict[str, Any] = {"dest": f.name, "default": default, "help": help_text}
    if f.metadata.get("choices") is not None:
        options["choices"] = f.metadata["choices"]
    shape = _tuple_shape(kind)
    if kind is bool and _optional(annotation):
        parser.add_argument(option_name(f.name), action=_TriState, type=_converter(bool, "true|false"),
                            metavar="true|false", **options)
    elif kind is bool:
        parser.add_argument(option_name(f.name), action=argparse.BooleanOptionalAction, **options)
    elif shape is not None and shape[1] is not None:  # tuple[int, int]: that many values
        parser.add_argument(option_name(f.name), type=shape[0], nargs=shape[1], action=_AsTuple, **options)
    elif shape is not None:  # tuple[int, ...]: one comma-separated value
        parser.add_argument(option_name(f.name), type=_converter(kind, f"comma-separated {shape[0].__name__}"),
                            **options)
    else:
        parser.add_argument(option_name(f.name), type=kind, **options)


def _converter(kind: Any, what: str) -> Any:
    """`_parse` for argparse, named for its message ("invalid true|false value: 'x'")."""
    def convert(text: str) -> Any:
        return _parse(kind, text, what)

    convert.__name__ = what
    return convert


class _AsTuple(argparse.Action):
    """nargs values stored as a tuple (frozen configs compare equal to their defaults)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        setattr(namespace, self.dest, tuple(values))


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
        elif isinstance(value, tuple):
            shape = _tuple_shape(_base_type(_hints(type(config))[f.name]))
            if shape is not None and shape[1] is None:
                argv += [option_name(f.name), ",".join(map(str, value))]
            else:
                argv += [option_name(f.name), *map(str, value)]
        else:
            argv += [option_name(f.name), str(value)]
    return argv


def check(ok: bool, name: str, rule: str, value: object) -> None:
    """Raise ValueError naming the field, as engine.SamplingParams does."""
    if not ok:
        raise ValueError(f"{name}: {rule}, got {value!r}")
