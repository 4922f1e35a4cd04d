"""Write deploy/docker/requirements.lock: every package the image installs, pinned.

    python scripts/lock_image_requirements.py            # resolve against PyPI, write the lock
    python scripts/lock_image_requirements.py --print    # print it instead

The Dockerfile installs torch first from the PyTorch index of its variant (the CPU
build, or a CUDA build with its own exactly pinned CUDA libraries), then everything
else from this lock, then pdserve itself with --no-deps. So the lock is pdserve's
dependencies without torch, plus torch's own requirements without its CUDA
libraries (torch pins those exactly), resolved together for CPython 3.11 on
manylinux x86_64: one lock for both variants, and torch's pins (triton) hold in both.

Resolution uses `pip install --dry-run --report` with --isolated, so this machine's
pip configuration (local wheel folders, constraints) plays no part.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import tomllib
import zipfile
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parent.parent
LOCK = REPO / "deploy" / "docker" / "requirements.lock"
PYTHON_VERSION = "3.11"
# Both variants' bases have glibc >= 2.31 (bookworm 2.36, Ubuntu 24.04 2.39): llguidance ships manylinux_2_31 only.
PLATFORMS = ("manylinux_2_31_x86_64", "manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
# Installed by torch from its own index, pinned exactly by torch.
TORCH_CUDA_PREFIXES = ("nvidia-", "cuda-")
ENVIRONMENT = {**default_environment(), "python_version": PYTHON_VERSION, "python_full_version": f"{PYTHON_VERSION}.0",
               "platform_system": "Linux", "sys_platform": "linux", "platform_machine": "x86_64",
               "implementation_name": "cpython", "platform_python_implementation": "CPython"}


def project_requirements() -> tuple[list[Requirement], Requirement]:
    """pdserve's requirements without torch, and the torch requirement."""
    deps = [Requirement(d) for d in tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]]
    (torch,) = [d for d in deps if canonicalize_name(d.name) == "torch"]
    return [d for d in deps if d is not torch], torch


def _pip_report(requirements: list[str], no_deps: bool = False, find_links: Path | None = None) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        command = [sys.executable, "-m", "pip", "--isolated", "install", "--dry-run", "--ignore-installed", "--quiet",
                   "--report", str(report), "--only-binary=:all:", "--python-version", PYTHON_VERSION,
                   "--implementation", "cp", "--target", str(Path(tmp) / "target")]
        for platform in PLATFORMS:
            command += ["--platform", platform]
        if no_deps:
            command.append("--no-deps")
        if find_links is not None:
            command += ["--find-links", str(find_links)]
        cert = Path("/etc/ssl/certs/ca-certificates.crt")
        if cert.is_file():  # --isolated drops PIP_CERT; a proxy may need the system CAs
            command += ["--cert", str(cert)]
        subprocess.run(command + requirements, check=True)
        return json.loads(report.read_text())["install"]


def torch_requirements(torch: Requirement) -> list[str]:
    """torch's own Linux requirements, less the CUDA libraries it pins itself."""
    (item,) = _pip_report([str(torch)], no_deps=True)
    kept = []
    for text in item["metadata"].get("requires_dist", []):
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate({**ENVIRONMENT, "extra": ""}):
            continue
        if canonicalize_name(req.name).startswith(TORCH_CUDA_PREFIXES):
            continue
        req.marker = None
        kept.append(str(req))
    return kept


def _torch_stand_in(folder: Path, version: str) -> None:
    """A wheel named torch at the pinned version with no requirements: packages that
    require torch themselves (xgrammar) resolve against the pin, not an old torch whose
    CUDA libraries pip can find, while torch's own requirements come in explicitly. Its
    local label (+lock) sorts it above PyPI's wheel of the same version, which the pin
    matches as well."""
    version = f"{version}+lock"
    name = f"torch-{version}.dist-info"
    files = {f"{name}/METADATA": f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n",
             f"{name}/WHEEL": "Wheel-Version: 1.0\nGenerator: pdserve\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    files[f"{name}/RECORD"] = "".join(f"{path},,\n" for path in files) + f"{name}/RECORD,,\n"
    with zipfile.ZipFile(folder / f"torch-{version}-py3-none-any.whl", "w") as wheel:
        for path, text in files.items():
            wheel.writestr(path, text)


def lock_text() -> str:
    deps, torch = project_requirements()
    (version,) = [spec.version for spec in torch.specifier]
    with tempfile.TemporaryDirectory() as tmp:
        _torch_stand_in(Path(tmp), version)
        resolved = _pip_report([str(d) for d in deps] + torch_requirements(torch) + [str(torch)], find_links=Path(tmp))
    pins = sorted((canonicalize_name(i["metadata"]["name"]), i["metadata"]["version"]) for i in resolved
                  if canonicalize_name(i["metadata"]["name"]) != "torch")
    header = [
        "# The pdserve image's Python packages besides torch and pdserve, pinned (both variants).",
        f"# Written by scripts/lock_image_requirements.py from pyproject.toml and {torch}'s requirements,",
        f"# resolved for CPython {PYTHON_VERSION} on manylinux x86_64. Do not edit by hand.",
    ]
    return "\n".join(header + [f"{name}=={version}" for name, version in pins]) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--print", action="store_true", help="print the lock instead of writing it")
    args = parser.parse_args(argv)
    text = lock_text()
    if args.print:
        print(text, end="")
    else:
        LOCK.parent.mkdir(parents=True, exist_ok=True)
        LOCK.write_text(text)
        print(f"wrote {LOCK.relative_to(REPO)} ({text.count(chr(10)) - 3} packages)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
