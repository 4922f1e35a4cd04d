"""Triton's CPU interpreter (TRITON_INTERPRET=1) without its per-call re-patching.

The interpreter maps `triton.language` onto numpy by patching the language's builtins
when a kernel is launched (`GridExecutor.__call__` -> `_patch_lang`, undone after the
grid), and again on *every* call of a `@triton.jit` helper from inside that kernel
(`InterpretedFunction.__call__` -> `_patch_lang`, whose scope it drops). The second
patching walks every module of `triton.language` with `inspect.getmembers` and sets the
same attributes to equivalent wrappers: a fifth of the CPU time of the kernel tests, for
helpers (`_dot`, `_load_rows`, `_fold_tile`, ...) called in every KV tile of every program.

`skip_repatching()` skips that second patching for helpers that live in the launched
kernel's module (the same `triton.language` globals, already patched for this launch);
a helper from any other module, and every launch, patch as before. The kernels compute
exactly what they computed: only the redundant work is gone. Where this Triton has no
such internals (a later version may change them), nothing is changed.
"""

from __future__ import annotations

import os
from typing import Any


def skip_repatching() -> None:
    """Install the skip once per process (idempotent) where the interpreter runs the
    kernels (TRITON_INTERPRET=1); see the module docstring."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    from triton.runtime import interpreter

    executor = getattr(interpreter, "GridExecutor", None)
    patch_lang = getattr(interpreter, "_patch_lang", None)
    if executor is None or patch_lang is None or getattr(patch_lang, "skips_repatching", False):
        return
    launch: dict[str, Any] = {"module": None, "patched": None}  # this launch's kernel globals
    launch_grid = executor.__call__

    def call(self, *args, **kwargs):
        launch["module"], launch["patched"] = self.fn.__globals__, None
        try:
            return launch_grid(self, *args, **kwargs)
        finally:
            launch["module"] = launch["patched"] = None

    def patch_once(fn):
        if launch["patched"] is not None and fn.__globals__ is launch["patched"]:
            return None  # a helper's call: its module's language is patched for this launch
        scope = patch_lang(fn)
        if fn.__globals__ is launch["module"]:
            launch["patched"] = fn.__globals__  # the launch's own patching, restored after it
        return scope

    patch_once.skips_repatching = True  # type: ignore[attr-defined]
    executor.__call__ = call
    interpreter._patch_lang = patch_once
