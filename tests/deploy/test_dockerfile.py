"""The Dockerfile, read statically (no Docker engine here): what it copies exists and
gets through .dockerignore, the image runs the installed `pdserve` as a non-root
user, and the CPU and CUDA variants differ only in their base stage.
"""

from __future__ import annotations

import json
import re
import subprocess
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "Dockerfile"
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
CHART_VALUES = yaml.safe_load((REPO / "deploy" / "helm" / "pdserve" / "values.yaml").read_text())
LOCK = REPO / "deploy" / "docker" / "requirements.lock"


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[tuple[str, str]] = field(default_factory=list)


def parse_dockerfile(text: str) -> tuple[dict[str, str], list[Stage]]:
    """Global ARG defaults and the stages, each instruction as (KEYWORD, rest) with
    continuation lines joined and comments dropped."""
    lines, pending = [], ""
    for raw in text.splitlines():
        if not pending and (not raw.strip() or raw.lstrip().startswith("#")):
            continue
        if raw.lstrip().startswith("#"):  # a comment inside a continued instruction
            continue
        if raw.rstrip().endswith("\\"):
            pending += raw.rstrip()[:-1] + " "
            continue
        lines.append(pending + raw)
        pending = ""
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for line in lines:
        keyword, _, rest = line.strip().partition(" ")
        keyword, rest = keyword.upper(), " ".join(rest.split())
        if keyword == "FROM":
            parts = rest.split()
            stages.append(Stage(parts[0], parts[2] if len(parts) == 3 and parts[1].upper() == "AS" else None))
        elif not stages:
            assert keyword == "ARG", f"only ARG may come before the first FROM, not {keyword}"
            arg, _, default = rest.partition("=")
            global_args[arg] = default
        else:
            stages[-1].instructions.append((keyword, rest))
    return global_args, stages


GLOBAL_ARGS, STAGES = parse_dockerfile(DOCKERFILE.read_text())
BY_NAME = {s.name: s for s in STAGES if s.name}


def chain(variant: str) -> list[Stage]:
    """The final stage and every stage it builds on (FROM), for VARIANT=variant."""
    args = {**GLOBAL_ARGS, "VARIANT": variant}
    stages, stage = [], STAGES[-1]
    while True:
        stages.append(stage)
        base = re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args[m.group(1) or m.group(2)], stage.base)
        if base not in BY_NAME:
            return stages[::-1]
        stage = BY_NAME[base]


def copies(stage: Stage) -> list[tuple[list[str], str]]:
    """(sources, destination) of the stage's COPY instructions from the build context."""
    out = []
    for keyword, rest in stage.instructions:
        if keyword == "COPY" and "--from=" not in rest:
            *sources, dest = [p for p in rest.split() if not p.startswith("--")]
            out.append((sources, dest))
    return out


def all_copies() -> list[tuple[list[str], str]]:
    return [c for stage in STAGES for c in copies(stage)]


# -- .dockerignore -------------------------------------------------------------------------


def dockerignore_rules() -> list[tuple[bool, re.Pattern]]:
    """(exclude?, pattern) in order, as Docker reads them (the last match wins; a
    pattern matching a folder matches everything in it)."""
    rules = []
    for line in (REPO / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pattern = line.lstrip("!").strip("/")
        regex = ""
        for token in re.split(r"(\*\*/?|\*|\?)", pattern):
            regex += {"**/": "(.*/)?", "**": ".*", "*": "[^/]*", "?": "[^/]"}.get(token, re.escape(token))
        rules.append((not negate, re.compile(regex + "$")))
    return rules


def in_context(path: str) -> bool:
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    included = True
    for exclude, regex in dockerignore_rules():
        if any(regex.match(p) for p in prefixes):
            included = not exclude
    return included


def tracked(path: str) -> list[str]:
    out = subprocess.run(["git", "ls-files", "--", path], cwd=REPO, capture_output=True, text=True, check=True).stdout
    return out.split()


def test_copied_files_exist_and_get_through_the_dockerignore() -> None:
    for sources, _ in all_copies():
        for source in sources:
            assert (REPO / source).exists(), f"COPY {source}: not in the repository"
            files = tracked(source) or [source]
            blocked = [f for f in files if not in_context(f)]
            assert not blocked, f"COPY {source}: .dockerignore keeps out {blocked[:5]}"


def test_dockerignore_keeps_the_context_small() -> None:
    for path in (".venv/bin/python", ".git/HEAD", "tests/deploy/test_dockerfile.py", "engine/__pycache__/engine.cpython-311.pyc",
                 "scripts/train_default_model.py", "models/other/model.safetensors", "bench/x.pyc"):
        assert not in_context(path), path
    for path in ("engine/engine.py", "services/router/main.py", "models/pdserve-tiny-code/config.json"):
        assert in_context(path), path


def test_the_package_is_copied_whole() -> None:
    """Every folder and module the wheel is built from reaches the builder's /src."""
    (builder,) = [s for s in STAGES if s.name == "builder"]
    copied = {source for sources, dest in copies(builder) if dest.startswith("/src") for source in sources}
    folders = {package.split(".")[1] for package in PYPROJECT["tool"]["setuptools"]["packages"] if "." in package}
    root_modules = {p for p in tracked(".") if "/" not in p and p.endswith(".py")}
    needed = folders | root_modules | {"pyproject.toml", PYPROJECT["project"]["readme"]}
    assert needed <= copied, f"not copied into /src: {sorted(needed - copied)}"
    assert not {"tests", "scripts", ".venv"} & copied


# -- the image runs the installed pdserve, not as root ---------------------------------------


def test_entrypoint_is_the_installed_pdserve() -> None:
    final = STAGES[-1]
    entrypoint = [rest for keyword, rest in final.instructions if keyword == "ENTRYPOINT"][-1]
    command = json.loads(entrypoint)  # exec form: signals reach pdserve itself
    venv = re.search(r"VIRTUAL_ENV=(\S+)", " ".join(r for k, r in chain("cpu")[-2].instructions if k == "ENV"))
    assert venv, "the common base stage sets VIRTUAL_ENV"
    assert command == [f"{venv.group(1)}/bin/pdserve"]
    assert "pdserve" in PYPROJECT["project"]["scripts"]  # the console script pip writes there
    (builder,) = [s for s in STAGES if s.name == "builder"]
    runs = [rest for keyword, rest in builder.instructions if keyword == "RUN"]
    assert any(f"-m venv {venv.group(1)}" in r for r in runs)
    assert any(re.search(r"pip install .*--no-deps.* /src\b", r) for r in runs), "pdserve is pip-installed (not editable)"
    assert any("pip check" in r for r in runs)
    assert ("COPY", f"--from=builder {venv.group(1)} {venv.group(1)}") in final.instructions


def test_runs_as_a_non_root_user_the_chart_agrees_with() -> None:
    users = [rest for keyword, rest in STAGES[-1].instructions if keyword == "USER"]
    uid, _, gid = users[-1].partition(":")
    assert uid.isdigit() and int(uid) != 0 and (not gid or int(gid) != 0)
    assert CHART_VALUES["podSecurityContext"]["runAsUser"] == int(uid)
    assert CHART_VALUES["podSecurityContext"]["runAsGroup"] == int(gid or uid)


def test_embedded_model_is_where_the_chart_looks() -> None:
    final = STAGES[-1]
    (model,) = [(s, d) for s, d in copies(final) if "models" in d]
    assert (REPO / model[0][0] / "config.json").is_file()
    assert model[1] == CHART_VALUES["model"]["embeddedPath"]
    env = " ".join(rest for keyword, rest in final.instructions if keyword == "ENV")
    assert f"PDSERVE_MODEL={model[1]}" in env  # the default of every --model in the image


# -- variants and locked dependencies -------------------------------------------------------


def test_cpu_and_cuda_variants_differ_only_in_their_base_stage() -> None:
    assert GLOBAL_ARGS["VARIANT"] == "cpu"
    cpu, cuda = chain("cpu"), chain("cuda")
    assert [s.name for s in cpu] == ["base-cpu", "base", "runtime"]
    assert [s.name for s in cuda] == ["base-cuda", "base", "runtime"]
    assert cpu[1:] == cuda[1:]  # the common stages are the very same
    # ... and the builder builds on the same common base
    assert BY_NAME["builder"].base == "base"
    cpu_base, cuda_base = cpu[0], cuda[0]
    assert cpu_base.base.startswith("python:3.11-")
    assert re.fullmatch(r"nvidia/cuda:[\d.]+-(cudnn-)?runtime-ubuntu[\d.]+", cuda_base.base)

    def env(stage: Stage) -> dict[str, str]:
        pairs = " ".join(rest for keyword, rest in stage.instructions if keyword == "ENV")
        return dict(re.findall(r"(\w+)=(\S+)", pairs))

    assert set(env(cpu_base)) == set(env(cuda_base)) == {"TORCH_INDEX_URL", "PYTHON"}
    assert env(cpu_base)["TORCH_INDEX_URL"].endswith("/whl/cpu")
    assert re.search(r"/whl/cu\d+$", env(cuda_base)["TORCH_INDEX_URL"])
    # the CUDA base brings its Python; nothing else is installed in either base
    assert [k for k, _ in cpu_base.instructions] == ["ENV"]
    assert [k for k, _ in cuda_base.instructions] == ["RUN", "ENV"]
    assert "python3-venv" in cuda_base.instructions[0][1]


def test_torch_version_is_the_project_pin() -> None:
    (torch,) = [Requirement(d) for d in PYPROJECT["project"]["dependencies"] if d.startswith("torch")]
    assert str(torch.specifier) == f"=={GLOBAL_ARGS['TORCH_VERSION']}"


def test_lock_pins_every_dependency() -> None:
    pins: dict[str, str] = {}
    for line in LOCK.read_text().splitlines():
        if not line or line.startswith("#"):
            continue
        match = re.fullmatch(r"([A-Za-z0-9_.-]+)==([A-Za-z0-9_.+!-]+)", line)
        assert match, f"requirements.lock: not an exact pin: {line!r}"
        pins[canonicalize_name(match.group(1))] = match.group(2)
    assert "torch" not in pins  # torch comes from the variant's index
    for dep in map(Requirement, PYPROJECT["project"]["dependencies"]):
        if canonicalize_name(dep.name) == "torch":
            continue
        name = canonicalize_name(dep.name)
        assert name in pins, f"{dep.name} is not in the lock"
        assert dep.specifier.contains(pins[name], prereleases=True), f"lock has {name}=={pins[name]}, pyproject wants {dep}"
    assert "setuptools" in pins  # the build backend, used with --no-build-isolation
    assert ("COPY", "deploy/docker/requirements.lock /tmp/requirements.lock") in BY_NAME["builder"].instructions


def test_exposed_ports_are_the_charts() -> None:
    exposed = {int(p) for k, rest in STAGES[-1].instructions if k == "EXPOSE" for p in rest.split()}
    assert exposed == {CHART_VALUES["router"]["ports"]["grpc"], CHART_VALUES["decode"]["ports"]["grpc"]}


@pytest.mark.parametrize("text,expected", [
    ("ARG A=1\nFROM x AS y\nRUN a \\\n  # note\n  && b\n", [("RUN", "a && b")]),
    ("FROM x\nCOPY a b /c/\n", [("COPY", "a b /c/")]),
])
def test_parser(text: str, expected: list) -> None:
    _, stages = parse_dockerfile(text)
    assert stages[-1].instructions == expected
