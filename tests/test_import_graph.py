"""Imports point downward: no circle between modules, no import up the layer table.

Every module of the package (every .py under the repository root but tests/) is
parsed with `ast`, and every import of `pdserve.*` counts: at module level, inside
functions, under `if TYPE_CHECKING:` (a type-only import still ties the two modules
together, so it counts for circles and for direction) and relative ones, resolved.
Imports by name at run time (`importlib.import_module`, `--kv-connector
module:factory`) are not seen.

The layer table, bottom up (a layer may import the layers under it that it names,
and what those may import; a row's own modules may import each other, circles
aside):

    outside      deploy/, scripts/         anything of ours; nothing imports them
    cli          cli.py, __main__.py       the command line: every subcommand
    bench        bench/                    measures everything below; only cli runs it
    planner      planner/                  profiles a worker's engine; plans and scales pools
    launch       launch/                   starts services (processes, Ray actors)
    services     services/ (the rest)      the worker process: composes the roles
    prefill      services/prefill/         prefill and decode are siblings:
    decode       services/decode/          neither imports the other
    worker       services/worker/          what every worker role shares
    router       services/router/          beside the worker side, above common; never
                                           reaches a KV transport, even through others
    common       services/common/          metrics, health, credentials, flags
    kvtransfer   kvtransfer/               moving KV pages (engine types only)
    package      __init__.py (`pdserve`)   the public API, re-exported from engine
    engine       engine/                   nothing of ours outside engine/
    proto        proto/                    the contract between processes; no imports

proto is the contract every layer above engine may import; engine knows nothing about
networks, so not even proto. Within engine/ (and every other layer) there is no order,
but there are no circles either.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import pdserve

ROOT = Path(pdserve.__file__).resolve().parent
PACKAGE = "pdserve"
SKIP_DIRS = {"tests", "build", "dist", "__pycache__", "node_modules"}


# -- the table --------------------------------------------------------------------------


@dataclass(frozen=True)
class Layer:
    """A row of the table. `modules`: names, or `prefix.*` for a package and all under
    it (the longest match wins). `imports`: the layers directly under this one that its
    modules may import (and, through them, what those may)."""

    name: str
    modules: tuple[str, ...]
    imports: tuple[str, ...] = ()


LAYERS = (
    Layer("proto", ("pdserve.proto.*",)),
    Layer("engine", ("pdserve.engine.*",)),
    Layer("package", ("pdserve",), ("engine",)),
    Layer("kvtransfer", ("pdserve.kvtransfer.*",), ("proto", "engine")),
    Layer("common", ("pdserve.services.common.*",), ("kvtransfer",)),
    Layer("router", ("pdserve.services.router.*",), ("common",)),
    Layer("worker", ("pdserve.services.worker.*",), ("common",)),
    Layer("prefill", ("pdserve.services.prefill.*",), ("worker",)),
    Layer("decode", ("pdserve.services.decode.*",), ("worker",)),
    Layer("services", ("pdserve.services.*",), ("prefill", "decode")),
    Layer("launch", ("pdserve.launch.*",), ("services", "router")),
    Layer("planner", ("pdserve.planner.*",), ("launch",)),
    Layer("bench", ("pdserve.bench.*",), ("planner", "package")),
    Layer("cli", ("pdserve.cli", "pdserve.__main__"), ("bench",)),
    Layer("outside", ("pdserve.deploy.*", "pdserve.scripts.*"), ("cli",)),
)
# Modules a layer must not reach through any chain of imports (a layer's own rule on
# top of the table): the router never moves KV bytes, so no transport loads in it.
UNREACHABLE = {"router": ("pdserve.kvtransfer.transports.zmq", "pdserve.kvtransfer.transports.nccl")}


# -- reading the package ----------------------------------------------------------------


@dataclass(frozen=True)
class Import:
    source: str  # the importing module
    target: str  # the module imported (for `from m import name`: m.name if a module, else m)
    where: str  # file:line, for the report


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([PACKAGE, *parts])


def package_files(root: Path = ROOT) -> dict[str, Path]:
    """Every module of the package: name -> file (tests and build output left out)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).parts[:-1]
        if any(p in SKIP_DIRS or p.startswith(".") or p.endswith(".egg-info") for p in rel):
            continue
        out[module_name(path, root)] = path
    return out


def imports_in(source: str, text: str, is_package: bool, modules: Iterable[str], filename: str = "") -> list[Import]:
    """The `pdserve.*` imports of one module's source, wherever they sit in it."""
    known = set(modules)
    here = source if is_package else source.rpartition(".")[0]
    found = []
    nodes = [n for n in ast.walk(ast.parse(text, filename or source)) if isinstance(n, (ast.Import, ast.ImportFrom))]
    for node in sorted(nodes, key=lambda n: (n.lineno, n.col_offset)):
        where = f"{filename or source}:{node.lineno}"
        if isinstance(node, ast.Import):
            found += [Import(source, a.name, where) for a in node.names if _ours(a.name)]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = here.split(".")[: len(here.split(".")) - (node.level - 1)]
                base = ".".join([*parent, *([base] if base else [])])
            if not _ours(base):
                continue
            for alias in node.names:
                child = f"{base}.{alias.name}"
                found.append(Import(source, child if child in known else base, where))
    return found


def _ours(name: str) -> bool:
    return name == PACKAGE or name.startswith(PACKAGE + ".")


def scan(root: Path = ROOT) -> list[Import]:
    files = package_files(root)
    found = []
    for name, path in files.items():
        rel = str(path.relative_to(root))
        found += imports_in(name, path.read_text(), path.name == "__init__.py", files, rel)
    return found


# -- the checks -------------------------------------------------------------------------


def graph_of(imports: Iterable[Import]) -> dict[str, dict[str, str]]:
    """source -> {target: where (the first such import)}; self-imports left out."""
    graph: dict[str, dict[str, str]] = {}
    for i in imports:
        if i.target != i.source:
            graph.setdefault(i.source, {}).setdefault(i.target, i.where)
    return graph


def circles(graph: Mapping[str, Mapping[str, str]]) -> list[list[str]]:
    """One circle (a, b, ..., a) for each group of modules that import each other
    (Tarjan's strongly connected components), shortest first found by BFS."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(start: str) -> None:  # iterative: import chains can be deep
        work = [(start, iter(sorted(graph.get(start, {}))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, {})))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    group = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        group.append(member)
                        if member == node:
                            break
                    if len(group) > 1:
                        groups.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [_circle_through(group[0], set(group), graph) for group in sorted(groups)]


def _circle_through(start: str, group: set[str], graph: Mapping[str, Mapping[str, str]]) -> list[str]:
    path = _path(start, lambda n: n == start, graph, within=group)
    assert path is not None, start  # a strongly connected group always has one
    return path


def _path(start: str, goal, graph: Mapping[str, Mapping[str, str]], within: set[str] | None = None) -> list[str] | None:
    """The shortest import chain from `start` to a module `goal` accepts (BFS), or None."""
    parent: dict[str, str] = {}
    frontier = [start]
    seen = {start}
    while frontier:
        following = []
        for node in frontier:
            for nxt in sorted(graph.get(node, {})):
                if within is not None and nxt not in within:
                    continue
                if goal(nxt):
                    chain = [nxt, node]
                    while chain[-1] != start:
                        chain.append(parent[chain[-1]])
                    return chain[::-1]
                if nxt not in seen:
                    seen.add(nxt)
                    parent[nxt] = node
                    following.append(nxt)
        frontier = following
    return None


def layer_of(module: str, layers: Iterable[Layer] = LAYERS) -> Layer | None:
    best, length = None, -1
    for layer in layers:
        for pattern in layer.modules:
            prefix = pattern[:-2] if pattern.endswith(".*") else None
            hit = module == pattern or (prefix is not None and (module == prefix or module.startswith(prefix + ".")))
            if hit and len(pattern) > length:
                best, length = layer, len(pattern)
    return best


def allowed(layers: Iterable[Layer] = LAYERS) -> dict[str, set[str]]:
    """Layer -> every layer its modules may import (its own, and the closure of `imports`)."""
    direct = {layer.name: set(layer.imports) for layer in layers}
    out = {}
    for name in direct:
        reach, todo = {name}, list(direct[name])
        while todo:
            below = todo.pop()
            if below not in reach:
                reach.add(below)
                todo += direct[below]
        out[name] = reach
    return out


def upward(imports: Iterable[Import], layers: tuple[Layer, ...] = LAYERS) -> list[str]:
    """Imports the table does not allow, and modules it does not place, one line each."""
    may = allowed(layers)
    problems = []
    for i in imports:
        src, dst = layer_of(i.source, layers), layer_of(i.target, layers)
        if src is None:
            problems.append(f"{i.source}: in no layer (add it to LAYERS in tests/test_import_graph.py)")
        elif dst is None:
            problems.append(f"{i.where}: {i.source} imports {i.target}, which is in no layer")
        elif dst.name not in may[src.name]:
            others = ", ".join(sorted(may[src.name] - {src.name})) or "nothing of ours"
            problems.append(f"{i.where}: {i.source} ({src.name}) imports {i.target} ({dst.name}); "
                            f"{src.name} may import only {others}")
    return sorted(set(problems))


def reaches(imports: Iterable[Import], layers: tuple[Layer, ...] = LAYERS,
            unreachable: Mapping[str, tuple[str, ...]] = UNREACHABLE) -> list[str]:
    """For each module a layer must never load and does: the shortest chain to it."""
    imports = list(imports)
    graph = graph_of(imports)
    problems = []
    for name, banned in unreachable.items():
        members = {m for i in imports for m in (i.source, i.target) if (layer_of(m, layers) or NOWHERE).name == name}
        graph_from_layer = {**graph, LAYER_START: dict.fromkeys(members, "")}
        for module in banned:
            chain = _path(LAYER_START, lambda m, module=module: m == module, graph_from_layer)
            if chain is not None:
                problems.append(f"{name} reaches {module}: " + _chain(chain[1:], graph))
    return problems


LAYER_START = "<layer>"  # a made-up module importing every module of a layer: one BFS for all
NOWHERE = Layer("", ())


def _chain(chain: list[str], graph: Mapping[str, Mapping[str, str]]) -> str:
    steps = [f"{a} -> {b} ({graph[a][b]})" for a, b in zip(chain, chain[1:])]
    return "; ".join(steps)


def report(imports: list[Import], layers: tuple[Layer, ...] = LAYERS,
           unreachable: Mapping[str, tuple[str, ...]] = UNREACHABLE) -> list[str]:
    graph = graph_of(imports)
    return ([f"circle: {_chain(c, graph)}" for c in circles(graph)]
            + upward(imports, layers) + reaches(imports, layers, unreachable))


# -- the tests --------------------------------------------------------------------------


def test_the_package_imports_point_downward_without_circles():
    problems = report(scan())
    assert not problems, "imports that break the layering:\n  " + "\n  ".join(problems)


def test_every_module_sits_in_a_layer_and_every_layer_exists():
    files = package_files()
    assert "pdserve.engine.engine" in files and "pdserve.cli" in files  # the scan sees the package
    unplaced = sorted(m for m in files if layer_of(m) is None)
    assert not unplaced, f"modules in no layer: {unplaced}"
    names = {layer.name for layer in LAYERS}
    assert all(set(layer.imports) <= names for layer in LAYERS)
    assert set(UNREACHABLE) <= names


def test_the_table_says_what_the_design_says():
    may = allowed()
    assert may["engine"] == {"engine"} and may["proto"] == {"proto"}
    assert "kvtransfer" not in may["engine"] and "engine" in may["kvtransfer"]
    assert "decode" not in may["prefill"] and "prefill" not in may["decode"]
    assert {"prefill", "decode"} <= may["services"] and not {"prefill", "decode", "services"} & may["worker"]
    assert not {"worker", "prefill", "decode", "services"} & may["router"]
    assert not {"router", "launch", "cli", "bench"} & may["services"]
    assert "cli" not in may["launch"] and "launch" in may["cli"]
    assert all("bench" not in may[layer] for layer in may if layer not in ("bench", "cli", "outside"))
    assert all("outside" not in may[layer] for layer in may if layer != "outside")
    assert "proto" in may["router"] and "proto" in may["kvtransfer"]


# -- the checker, on graphs made up for it ----------------------------------------------

TOY = (
    Layer("low", ("pdserve.low.*",)),
    Layer("left", ("pdserve.left.*",), ("low",)),
    Layer("right", ("pdserve.right.*",), ("low",)),
    Layer("top", ("pdserve.top",), ("left", "right")),
)


def _imports(*edges: str) -> list[Import]:
    return [Import(a, b, f"{a}:1") for a, b in (e.split(" -> ") for e in edges)]


def test_the_checker_accepts_a_clean_graph():
    clean = _imports("pdserve.top -> pdserve.left.a", "pdserve.left.a -> pdserve.low.x",
                     "pdserve.right.b -> pdserve.low.x", "pdserve.top -> pdserve.low.y",
                     "pdserve.low.x -> pdserve.low.y")
    assert report(clean, TOY, {}) == []


def test_the_checker_finds_a_circle_and_names_its_steps():
    graph = graph_of(_imports("pdserve.low.a -> pdserve.low.b", "pdserve.low.b -> pdserve.low.c",
                              "pdserve.low.c -> pdserve.low.a", "pdserve.low.c -> pdserve.low.d"))
    assert circles(graph) == [["pdserve.low.a", "pdserve.low.b", "pdserve.low.c", "pdserve.low.a"]]
    (line,) = report(_imports("pdserve.low.a -> pdserve.low.b", "pdserve.low.b -> pdserve.low.a"), TOY, {})
    assert line == "circle: pdserve.low.a -> pdserve.low.b (pdserve.low.a:1); pdserve.low.b -> pdserve.low.a (pdserve.low.b:1)"


def test_the_checker_finds_an_upward_import_a_sibling_import_and_an_unplaced_module():
    problems = report(_imports("pdserve.low.x -> pdserve.left.a", "pdserve.left.a -> pdserve.right.b",
                               "pdserve.elsewhere -> pdserve.low.x", "pdserve.top -> pdserve.nowhere"), TOY, {})
    assert problems == [
        "pdserve.elsewhere: in no layer (add it to LAYERS in tests/test_import_graph.py)",
        "pdserve.left.a:1: pdserve.left.a (left) imports pdserve.right.b (right); left may import only low",
        "pdserve.low.x:1: pdserve.low.x (low) imports pdserve.left.a (left); low may import only nothing of ours",
        "pdserve.top:1: pdserve.top imports pdserve.nowhere, which is in no layer",
    ]


def test_the_checker_follows_chains_to_a_module_a_layer_must_not_load():
    chain = _imports("pdserve.top -> pdserve.left.a", "pdserve.left.a -> pdserve.low.socket")
    assert report(chain, TOY, {"top": ("pdserve.low.socket",)}) == [
        "top reaches pdserve.low.socket: pdserve.top -> pdserve.left.a (pdserve.top:1); "
        "pdserve.left.a -> pdserve.low.socket (pdserve.left.a:1)"]
    assert report(chain, TOY, {"right": ("pdserve.low.socket",)}) == []


def test_imports_are_found_under_type_checking_in_functions_and_relative():
    text = (
        "from __future__ import annotations\n"
        "from typing import TYPE_CHECKING\n"
        "import os\n"
        "import pdserve.engine.config as config\n"
        "from pdserve.engine import LLM, request\n"
        "if TYPE_CHECKING:\n"
        "    from pdserve.kvtransfer.wire import Inbox\n"
        "def later():\n"
        "    from ..common import flags\n"
        "    from . import sibling\n"
        "    from .sibling import name\n"
    )
    modules = {"pdserve.engine.request", "pdserve.services.worker.sibling", "pdserve.services.common.flags"}
    found = imports_in("pdserve.services.worker.loop", text, False, modules)
    assert [i.target for i in found] == [
        "pdserve.engine.config", "pdserve.engine", "pdserve.engine.request", "pdserve.kvtransfer.wire",
        "pdserve.services.common.flags", "pdserve.services.worker.sibling", "pdserve.services.worker.sibling",
    ]
    in_package = imports_in("pdserve.proto.v1", "from . import stubs\n", True, {"pdserve.proto.v1.stubs"})
    assert [i.target for i in in_package] == ["pdserve.proto.v1.stubs"]
