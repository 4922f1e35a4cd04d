"""bench/'s layout: one entry point per benchmark (a module with a `__main__` guard,
`python -m pdserve.bench.<subject>.<name>`), and no module imports an entry point, so
what two benchmarks share lives in a library module. Read with `ast`, nothing imported."""

from __future__ import annotations

import ast
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"
SUBJECTS = {"engine", "transfer", "serving", "cluster", "spec", "quant", "offload", "structured", "planner", "common"}


def _module(path: Path) -> str:
    return "pdserve." + ".".join(path.relative_to(BENCH.parent).with_suffix("").parts)


def _is_entry(tree: ast.Module) -> bool:
    return any(isinstance(node, ast.If) and "__main__" in ast.unparse(node.test) for node in tree.body)


def _imports(tree: ast.Module) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names |= {f"{node.module}.{alias.name}" for alias in node.names}  # `from pkg import module`
        elif isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
    return names


def test_every_module_sits_in_a_subject_and_no_module_imports_an_entry_point() -> None:
    trees = {_module(p): ast.parse(p.read_text()) for p in BENCH.rglob("*.py")}
    assert {m.split(".")[2] for m in trees if m.count(".") >= 3} == SUBJECTS
    assert all(m.count(".") == 3 for m in trees if not m.endswith("__init__")), sorted(trees)  # one level
    entries = {m for m, tree in trees.items() if _is_entry(tree)}
    assert {"pdserve.bench.serving.command", "pdserve.bench.engine.offline", "pdserve.bench.spec.methods",
            "pdserve.bench.spec.gpu", "pdserve.bench.cluster.disagg", "pdserve.bench.quant.schemes",
            "pdserve.bench.offload.__main__", "pdserve.bench.structured.__main__", "pdserve.bench.planner.__main__"} <= entries
    assert not any(m.startswith("pdserve.bench.common.") for m in entries)
    importers = {(m, e) for m, tree in trees.items() for e in entries & _imports(tree)}
    assert importers == set(), sorted(importers)


def test_no_entry_point_parses_its_own_flags() -> None:
    """Flags are a frozen dataclass read through services/common/flags.py (common.entry)."""
    hand_written = [p.name for p in BENCH.rglob("*.py")
                    if "add_argument(" in p.read_text() or "ArgumentParser(" in p.read_text()]
    assert hand_written == ["entry.py"], hand_written
