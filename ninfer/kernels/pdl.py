"""Programmatic dependent launch (PDL): a decode GEMM starts streaming its weights while the kernel
before it finishes.

A decode step is a chain of short kernels, each waiting for the previous one to drain and for its own
launch (~1.3 us per boundary inside a CUDA graph), and each GEMM then waits a DRAM latency before its
first bytes arrive. The weights do not depend on the previous kernel, only the activations do. So a
GEMM launched with PDL (``launch_pdl=True``) may start while its predecessor runs; it asks L2 for its
first weight lines, then ``griddepcontrol.wait``\\s until the predecessor has finished and its writes
are visible, and only then reads activations or writes anything (scratch, counters, outputs). The
kernels that usually come before a GEMM (norms, GEMMs) call ``griddepcontrol.launch_dependents`` when
they start, which lets the dependent grid in as soon as every one of their programs is resident.

A kernel launched with PDL must wait before touching anything the previous kernel writes or reads:
every kernel here that takes ``PDL=True`` calls :func:`wait_for_predecessor` before its first such
access. Triggering is harmless for a successor launched without PDL (it then simply waits as usual).

Hopper (sm_90) and later; elsewhere, under the interpreter and with ``NINFER_PDL=0`` (read at import)
the flags are off and the kernels compile to what they were.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ninfer.kernels.dispatch import INTERPRET

_ENABLED = os.environ.get("NINFER_PDL", "1") != "0" and not INTERPRET
_CAPABLE: dict[int, bool] = {}


def pdl_enabled(device: torch.device) -> bool:
    """Whether kernels on ``device`` are launched with PDL (sm_90+, not disabled, not interpreted)."""
    if not _ENABLED or device.type != "cuda":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    capable = _CAPABLE.get(index)
    if capable is None:
        capable = _CAPABLE[index] = torch.cuda.get_device_capability(index)[0] >= 9
    return capable


@triton.jit
def allow_dependents(PDL: tl.constexpr):
    """Let a PDL-launched successor start once every program of this kernel is resident."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def wait_for_predecessor(PDL: tl.constexpr):
    """Block until the previous kernel in the stream has finished and its writes are visible."""
    if PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def prefetch_l2(ptrs, PDL: tl.constexpr):
    """Ask L2 for the cache line of each pointer (no registers, no result): issued before
    :func:`wait_for_predecessor`, the weight stream starts while the previous kernel finishes."""
    if PDL:
        tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // $0", "=r,l", [ptrs], dtype=tl.int32,
                                  is_pure=False, pack=1)


@triton.jit
def prefetch_rows_l2(base_ptr, rows, stride_row, first_byte, last_byte, LINES: tl.constexpr,
                     PDL: tl.constexpr):
    """:func:`prefetch_l2` of the first ``LINES`` 128-byte lines of bytes ``[first_byte, last_byte)``
    of each row ``rows`` (``base_ptr`` a byte pointer, ``stride_row`` in bytes)."""
    if PDL:
        offs = first_byte + tl.arange(0, LINES) * 128
        offs = tl.minimum(offs, last_byte - 1)  # short ranges repeat their last line: harmless
        prefetch_l2(base_ptr + rows[:, None].to(tl.int64) * stride_row + offs[None, :], PDL)


def prefetch_lines(bytes_per_row: int, limit: int = 8) -> int:
    """How many 128-byte lines per row a launch prefetches: the program's range, at most ``limit``
    (a power of two: it is a block shape)."""
    lines = max(1, min(limit, -(-bytes_per_row // 128)))
    return 1 << (lines - 1).bit_length()
