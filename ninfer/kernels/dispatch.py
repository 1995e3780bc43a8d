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
    """All configs on a GPU; only the first (the portable one, inside 99 KB of shared memory) under
    the interpreter, which cannot benchmark, or with ``NINFER_AUTOTUNE=off`` (read at import), which
    trades speed for start-up time: engine-level GPU tests compile each kernel once, not per config."""
    return configs[:1] if INTERPRET or os.environ.get("NINFER_AUTOTUNE") == "off" else configs
