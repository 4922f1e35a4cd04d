"""The distribution installs under one import namespace, `pdserve`.

Builds the wheel from this checkout, installs it into a fresh virtual environment
and checks that `pdserve` (plus its dist-info) is all it adds to site-packages, and
that the installed `pdserve` command and `from pdserve import LLM, SamplingParams`
work there. The fresh environment borrows this one's third-party packages through a
path entry (not a site dir, so this checkout's editable finder is not loaded there):
installing torch again would cost minutes and prove nothing about pdserve.
"""

from __future__ import annotations

import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.cluster(seconds=5)

REPO = Path(__file__).resolve().parent.parent
TOP_LEVEL_FOLDERS = ("engine", "services", "kvtransfer", "proto", "launch", "bench")


def _run(*args: str | Path, cwd: Path | None = None, timeout: float = 300) -> str:
    done = subprocess.run([str(a) for a in args], cwd=cwd, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, args))} exited {done.returncode}:\n{done.stdout}\n{done.stderr}")
    return done.stdout


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    _run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", out, REPO)
    (path,) = out.glob("pdserve-*.whl")
    return path


def test_wheel_has_one_top_level_package(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/", 1)[0] for n in names}
    dist_info = {t for t in tops if t.endswith(".dist-info")}
    assert tops - dist_info == {"pdserve"}, sorted(tops)
    # The subpackages and the committed stubs and model-free data made it in.
    for folder in TOP_LEVEL_FOLDERS:
        assert f"pdserve/{folder}/__init__.py" in names, folder
    assert "pdserve/proto/pdserve/v1/pdserve.proto" in names
    assert "pdserve/cli.py" in names
    assert not any(n.startswith(("pdserve/tests/", "pdserve/scripts/")) for n in names)
    entry_points = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert re.search(r"^pdserve\s*=\s*pdserve\.cli:main$", entry_points, re.M), entry_points


def test_installed_wheel_runs_in_a_fresh_venv(wheel: Path, tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    _run(sys.executable, "-m", "venv", "--without-pip", venv)
    py = venv / "bin" / "python"
    site = Path(_run(py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").strip())
    # Third-party dependencies from this environment, as a plain path entry.
    deps = [p for p in sys.path if p.rstrip("/").endswith("site-packages")]
    (site / "_pdserve_test_deps.pth").write_text("".join(p + "\n" for p in deps))
    before = {p.name for p in site.iterdir()}
    _run(sys.executable, "-m", "pip", "--python", py, "install", "--no-deps", "--no-index", "-q", wheel)
    added = {p.name for p in site.iterdir()} - before
    assert {a for a in added if not a.endswith(".dist-info")} == {"pdserve"}, sorted(added)

    work = tmp_path / "elsewhere"  # not the checkout: nothing resolves through the cwd
    work.mkdir()
    help_text = _run(venv / "bin" / "pdserve", "--help", cwd=work, timeout=120)
    assert "up" in help_text and "generate" in help_text
    where = _run(py, "-c", "import pdserve, pdserve.services; print(pdserve.__file__)", cwd=work)
    assert Path(where.strip()).is_relative_to(site), where
    api = _run(py, "-c", "from pdserve import LLM, SamplingParams; print(LLM.__module__, SamplingParams.__name__)", cwd=work)
    assert api.split() == ["pdserve.engine.llm", "SamplingParams"]
    for folder in TOP_LEVEL_FOLDERS:  # none of the folders is importable on its own
        # (another distribution may own the name: proto-plus, which ray[default] brings, installs `proto`)
        bare = subprocess.run([py, "-c", f"import {folder}; print({folder}.__file__)"], cwd=work,
                              capture_output=True, text=True, timeout=60)
        assert bare.returncode != 0 or not Path(bare.stdout.strip()).is_relative_to(site / "pdserve"), \
            f"`import {folder}` resolved to pdserve's folder outside the pdserve namespace"


def test_sources_import_only_through_the_namespace() -> None:
    """A bare `from engine ...` would work from the checkout's root and load a second
    copy of the module beside `pdserve.engine` (two registries, two sets of classes)."""
    bare = re.compile(rf"^\s*(from|import) ({'|'.join(TOP_LEVEL_FOLDERS)})([. ]|$)", re.M)
    offenders = []
    for path in REPO.rglob("*.py"):
        if ".venv" in path.parts or "build" in path.parts:
            continue
        for match in bare.finditer(path.read_text()):
            offenders.append(f"{path.relative_to(REPO)}: {match.group(0).strip()}")
    assert not offenders, offenders


def test_launchers_and_router_import_without_torch() -> None:
    """The engine (and torch, ~1 s of CPU per process) loads on first use of `LLM` or
    of a module that computes: a launcher (`pdserve up`, the benchmarks' cluster
    starter and load generators) and the router's modules import without it."""
    code = (
        "import sys\n"
        "import pdserve.services.router.main, pdserve.launch.local, pdserve.bench.cluster.prefix, pdserve.bench.cluster.disagg\n"
        "from pdserve.cli import build_parser\n"
        "from pdserve.engine import SamplingParams\n"
        "build_parser()\n"
        "print('torch' in sys.modules)\n"
        "from pdserve.engine import LLM\n"
        "print('torch' in sys.modules, LLM.__module__)\n"
    )
    assert _run(sys.executable, "-c", code, timeout=120).split() == ["False", "True", "pdserve.engine.llm"]
