"""A faster Triton interpreter for the CPU tests: device-function calls stop re-patching ``triton.language``.

The interpreter patches the language module (every builtin of ``tl``, ``tl.tensor`` and ``tl.math``, found through
``inspect.getmembers``) when a kernel starts, and again at every call of a ``@triton.jit`` helper from inside it,
although the kernel's patch is still in place then. Our kernels call small helpers in unrolled loops, so those
repeated patches took about half the time of the interpreted kernel tests (e.g. 32 of 65 s of an expert GEMV
test under cProfile). Here a call whose language modules are all patched already by a running kernel keeps that
patch; everything else goes through the interpreter's own code. What runs is unchanged: the helper sees the
same patched builtins either way.
"""
from __future__ import annotations

import inspect
from collections import Counter
from typing import Any


def skip_nested_language_patches() -> bool:
    """Install the shortcut; False (nothing changed) where this Triton's interpreter lacks what it wraps."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    original = getattr(interpreter, "_patch_lang", None)
    scope_type = getattr(interpreter, "_LangPatchScope", None)
    if original is None or scope_type is None or getattr(original, "_ninfer_nested_skip", False):
        return False
    patched: Counter[int] = Counter()  # id of a language module -> running kernels that patched it
    langs_of: dict[Any, frozenset[int]] = {}

    def languages(fn: Any) -> frozenset[int]:
        if fn not in langs_of:  # the same test the interpreter applies to fn's globals
            langs_of[fn] = frozenset(id(v) for v in fn.__globals__.values()
                                     if inspect.ismodule(v) and v in (tl, tl.core))
        return langs_of[fn]

    def patch_lang(fn: Any) -> Any:
        langs = languages(fn)
        if langs and all(patched[lang] for lang in langs):
            return scope_type()  # a helper inside a running kernel: its patch is in place; nothing to restore
        scope = original(fn)
        patched.update(langs)
        restore = scope.restore

        def restore_and_forget() -> None:
            restore()
            patched.subtract(langs)

        scope.restore = restore_and_forget
        return scope

    patch_lang._ninfer_nested_skip = True
    interpreter._patch_lang = patch_lang
    return True
