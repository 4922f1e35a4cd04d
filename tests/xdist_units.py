"""The units of work `make test` hands its two pytest-xdist workers, and their order
(tests/conftest.py applies them; the markers are registered in pyproject.toml)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

TIMED_UNIT = "timed"


def rank(item: pytest.Item) -> tuple[int, float]:
    """Where `item`'s file goes in the order the units are handed out: timed first,
    then the in-process files, then the `cluster` files, longest first."""
    if item.get_closest_marker("timed") is not None:
        return (0, 0.0)
    cluster = item.get_closest_marker("cluster")
    if cluster is None:
        return (1, 0.0)
    return (2, -float(cluster.kwargs.get("seconds", 0)))


def marked_timed(path: Path) -> bool:
    """Whether the test file at `path` marks all its tests `timed` (its module-level
    `pytestmark`). The controller reads it from the file: it never collects, and sees
    node ids only."""
    tree = ast.parse(path.read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "pytestmark" for t in node.targets):
            return any(isinstance(n, ast.Attribute) and n.attr == TIMED_UNIT for n in ast.walk(node.value))
    return False


def unit_of(path: str, root: Path, timed: dict[str, bool]) -> str:
    """The unit of work of the test file at `path` (from `root`): TIMED_UNIT for every
    file marked timed, else the file itself. `timed` caches each file's answer."""
    if path not in timed:
        timed[path] = path.endswith(".py") and marked_timed(root / path)
    return TIMED_UNIT if timed[path] else path
