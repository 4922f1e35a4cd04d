"""Loading a GPU check script (tests/gpu/check_NAME.py) as a module, for its tests."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

HERE = Path(__file__).resolve().parent


@contextmanager
def loaded_check(name: str) -> Iterator[ModuleType]:
    """tests/gpu/check_NAME.py as the module `check_NAME` while the block runs (scripts,
    not a package: loaded by path; registered, since its dataclasses look it up)."""
    spec = importlib.util.spec_from_file_location(f"check_{name}", HERE / f"check_{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)
