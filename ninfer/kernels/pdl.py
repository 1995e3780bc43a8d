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
