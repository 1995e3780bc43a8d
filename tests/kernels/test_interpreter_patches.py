"""The CPU tests' shortcut in Triton's interpreter (``tests/interpreter_patches.py``): helpers called from a running
kernel keep its patch of ``triton.language`` instead of patching it again; the results and the restored
language are those of the interpreter's own code."""
from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from triton.runtime import interpreter

from ninfer.kernels.dispatch import INTERPRET

pytestmark = pytest.mark.skipif(not INTERPRET, reason="the interpreter's patches (TRITON_INTERPRET=1)")


@triton.jit
def _square(x):
    return x * x


@triton.jit
def _square_plus_one(x):
    return _square(x) + tl.full(x.shape, 1.0, x.dtype)  # a builtin inside a nested helper


@triton.jit
def _kernel(x_ptr, out_ptr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, _square_plus_one(tl.load(x_ptr + offs)))


def test_the_shortcut_is_installed_and_nested_helpers_compute_as_before() -> None:
    assert getattr(interpreter._patch_lang, "_ninfer_nested_skip", False)
    x = torch.randn(64)
    out = torch.full_like(x, float("nan"))
    _kernel[(4,)](x, out, BLOCK=16)
    torch.testing.assert_close(out, x * x + 1, rtol=0, atol=0)
    # the kernel's patch is undone when it returns, as without the shortcut
    assert tl.core.is_builtin(tl.load) and tl.core.is_builtin(tl.full)
    _kernel[(4,)](x + 1, out, BLOCK=16)  # and a second kernel patches again
    torch.testing.assert_close(out, (x + 1) ** 2 + 1, rtol=0, atol=0)
