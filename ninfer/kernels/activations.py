"""SwiGLU: ``silu(gate) * up``."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def swiglu_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """``gate_up [..., 2I]`` holds gate in its first half and up in its second."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    return swiglu_reference(gate_up)
