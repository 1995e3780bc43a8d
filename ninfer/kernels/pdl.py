"""Programmatic dependent launch (compute capability 9.0+) for the kernels between the register decodes.

Two roles. A kernel that *triggers* (``griddepcontrol.launch_dependents``) lets the kernel after it start before it
finishes, if that one is launched with PDL. A kernel *launched with PDL* must wait (``griddepcontrol.wait``: the
kernel before it has finished and its writes are visible) before it reads what that kernel writes, or writes
anything. The register decode is launched with PDL by default (:func:`~ninfer.kernels.dispatch.pdl_enabled`): it
requests its weights, then waits. Every kernel between them triggers at its start (:func:`pdl_enter`): the norms,
the MoE routing, the expert GEMV, the MoE combine, the DeltaNet and attention decode and the attention merge. With
``NINFER_PDL_WAITS=1`` (off by default, not measured yet; read per call) the small ones among them (the norms, the
routing, the expert GEMV, the combine: :func:`small_kernel_pdl`) are launched with PDL too, wait at their start and
trigger after it, so only their launch overlaps the kernel before them.

A kernel whose inputs other than its activations were written before the kernel before it started (the MoE down
projection: its expert ids come from the routing, two launches back) can request its weights while that kernel
runs: :func:`early_pdl` launches it with PDL, and it reads the ids and asks the L2 for its weight lines
(:func:`l2_prefetch_rows`) before it waits (on unless ``NINFER_MOE_DOWN_EARLY=0``). So can the Gated DeltaNet
decode: its recurrent state was written by the previous step (on unless ``NINFER_DELTANET_EARLY=0``). Reading early is
safe for anything written before the kernel before it started: that kernel, launched normally or waiting before it
triggers, or triggering at its start after a kernel launched normally, cannot have let this one start before those
writes were done.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ninfer.kernels.dispatch import env_switch, pdl_enabled


@dataclass(frozen=True)
class Pdl:
    """How one launch of a small kernel takes part: ``wait`` (launched with PDL, waits at its start) and
    ``trigger`` (lets the next kernel launch early)."""

    wait: bool = False
    trigger: bool = False

    def constexprs(self) -> dict[str, bool]:
        """The kernel's ``PDL_WAIT`` / ``PDL_TRIGGER`` arguments."""
        return {"PDL_WAIT": self.wait, "PDL_TRIGGER": self.trigger}

    def options(self) -> dict[str, bool]:
        """The launch options: PDL exactly where the kernel waits (a kernel launched so must wait)."""
        return {"launch_pdl": True} if self.wait else {}


def small_kernel_pdl(device: torch.device) -> Pdl:
    """The part of a small kernel on ``device`` (nothing off CUDA, on older GPUs or with ``NINFER_PDL=0``)."""
    trigger = pdl_enabled(device)
    return Pdl(wait=trigger and env_switch("NINFER_PDL_WAITS", False), trigger=trigger)


@triton.jit
def pdl_enter(WAIT: tl.constexpr, TRIGGER: tl.constexpr):
    """A kernel's first step: wait for the kernel before it (``WAIT``: launched with PDL), then let the next one
    launch (``TRIGGER``)."""
    if WAIT:
        tl.extra.cuda.gdc_wait()
    if TRIGGER:
        tl.extra.cuda.gdc_launch_dependents()


def early_pdl(device: torch.device) -> Pdl:
    """The part of a kernel that requests what it can before it waits (module doc): launched with PDL, waiting
    after those requests, and letting the next kernel launch once it has; nothing where PDL is off."""
    on = pdl_enabled(device)
    return Pdl(wait=on, trigger=on)


@triton.jit
def l2_prefetch_rows(row_addr, first, last, LINES: tl.constexpr):
    """Ask the L2 for bytes ``[first, last)`` of each row that starts at address ``row_addr`` (int64 ``[R]``): a
    ``prefetch.global.L2::evict_last`` per 128-byte line (no registers, no data into the SM), up to ``LINES`` lines
    a row (the caller sizes it; lines past ``last`` are clamped to its last byte). A hint that nothing reads, so
    the caller skips it in the interpreter (no inline PTX there)."""
    off = tl.minimum(first + tl.arange(0, LINES) * 128, last - 1)
    l2_prefetch(row_addr[:, None] + off[None, :])


@triton.jit
def l2_prefetch(addr):
    """Ask the L2 for the 128-byte line at each address of ``addr`` (int64, any shape): ``prefetch.global.L2`` kept
    with ``evict_last``, no registers, no data into the SM. Inline PTX: not in the interpreter."""
    # not pure: a side effect, so the unused result does not remove it
    tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1];\n\tmov.u32 $0, 0;", "=r,l", [addr],
                              dtype=tl.int32, is_pure=False, pack=1)
