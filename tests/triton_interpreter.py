"""Triton's CPU interpreter (TRITON_INTERPRET=1) without its per-call re-patching.

The interpreter maps `triton.language` onto numpy by patching the language's builtins
when a kernel is launched (`GridExecutor.__call__` -> `_patch_lang`, undone after the
grid), and again on *every* call of a `@triton.jit` helper from inside that kernel
(`InterpretedFunction.__call__` -> `_patch_lang`, whose scope it drops). The second
patching walks every module of `triton.language` with `inspect.getmembers` and sets the
same attributes to equivalent wrappers: a third of the CPU time of the kernel tests, for
helpers (`tl.sum`, `tl.max`, `tl.zeros`: `@triton.jit` functions of triton.language) called
in every KV tile of every program.

`skip_repatching()` skips that second patching inside a launch, for a helper whose
module sees no `triton.language` module that the launch did not patch already (the
patching is of those module objects, shared by every kernel); every launch, and any
other call, patches as before. The kernels compute exactly what they computed: only the
redundant work is gone. Where this Triton has no such internals (a later version may
change them), nothing is changed.
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
    import triton.language as tl

    def languages(fn) -> frozenset[int]:
        """The `triton.language` modules `_patch_lang` patches for `fn` (by identity)."""
        return frozenset(id(v) for v in fn.__globals__.values() if v is tl or v is tl.core)

    launch: dict[str, Any] = {"running": False, "patched": None}  # modules patched in this launch
    launch_grid = executor.__call__

    def call(self, *args, **kwargs):
        launch["running"], launch["patched"] = True, None
        try:
            return launch_grid(self, *args, **kwargs)
        finally:
            launch["running"], launch["patched"] = False, None

    def patch_once(fn):
        langs = languages(fn)
        if launch["patched"] is not None and langs <= launch["patched"]:
            return None  # a helper's call: those modules are patched for this launch
        scope = patch_lang(fn)
        if launch["running"]:  # the launch's own patching, or a helper's first of `core`
            launch["patched"] = (launch["patched"] or frozenset()) | langs
        return scope

    patch_once.skips_repatching = True  # type: ignore[attr-defined]
    executor.__call__ = call
    interpreter._patch_lang = patch_once
