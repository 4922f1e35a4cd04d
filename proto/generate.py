"""Regenerate the committed Python stubs from the .proto files.

    python proto/generate.py            # writes proto/pdserve/v1/pdserve_pb2{,_grpc}.py{,i}

protoc writes `from pdserve.v1 import pdserve_pb2` into the gRPC stub, which only
resolves with proto/ itself on sys.path; the stub is rewritten to a relative import
so `from proto.pdserve.v1 import pdserve_pb2_grpc` works from the repository root
and from an installed distribution alike. tests/test_proto.py regenerates into a
temporary directory and fails when the committed stubs differ.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent
PROTO_FILES = ("pdserve/v1/pdserve.proto",)


def generate(out_root: Path = PROTO_ROOT) -> list[Path]:
    """Run protoc for every .proto file into `out_root`; returns the files written."""
    import grpc_tools
    from grpc_tools import protoc

    include = Path(grpc_tools.__file__).resolve().parent / "_proto"
    out_root.mkdir(parents=True, exist_ok=True)
    args = [
        "grpc_tools.protoc", f"-I{PROTO_ROOT}", f"-I{include}",
        f"--python_out={out_root}", f"--pyi_out={out_root}", f"--grpc_python_out={out_root}",
        *PROTO_FILES,
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    written = []
    for proto in PROTO_FILES:
        stem = out_root / proto.removesuffix(".proto")
        grpc_stub = stem.with_name(stem.name + "_pb2_grpc.py")
        _relative_imports(grpc_stub)
        written += [stem.with_name(stem.name + s) for s in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")]
    return written


def _relative_imports(path: Path) -> None:
    """`from pdserve.v1 import pdserve_pb2 as x` -> `from . import pdserve_pb2 as x`."""
    text = path.read_text()
    fixed = re.sub(r"^from [\w.]+ import (\w+_pb2) as", r"from . import \1 as", text, flags=re.M)
    path.write_text(fixed)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=PROTO_ROOT, help="output root (default: proto/)")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
