"""When to run a Triton kernel, and how to configure autotuning for where it runs.

Launchers (``*_triton``) run on CUDA tensors, or on CPU tensors under the Triton interpreter
(``TRITON_INTERPRET=1``, used by the CPU tests). Public ops pick Triton for CUDA tensors unless
``NINFER_KERNELS=reference`` asks for the PyTorch references everywhere.
"""
from __future__ import annotations

import os

import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def use_triton(x: torch.Tensor) -> bool:
    return x.is_cuda and os.environ.get("NINFER_KERNELS", "triton") != "reference"


def autotune_configs(configs: list) -> list:
    """All configs on a GPU; only the first under the interpreter, which cannot benchmark."""
    return configs[:1] if INTERPRET else configs
