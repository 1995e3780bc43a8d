"""The paged K/V storage every attention kernel reads and writes: :class:`PagedKV` and its formats.

``kv_dtype``: ``"auto"`` (the model dtype), ``"bf16"``, ``"fp8"`` (e4m3 with one fp32 scale per row, a
row being one token's one head) and ``"int8"`` (symmetric, one fp32 scale per ``INT8_GROUP`` values).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


KV_DTYPES = ("auto", "bf16", "fp8", "int8")
QUANT_MAX = {"fp8": 448.0, "int8": 127.0}  # largest code magnitude of each quantised format
INT8_GROUP = 64  # values sharing one int8 scale


# Rows whose largest magnitude is below this quantise to zero: their reciprocal scale would overflow.
TINY_AMAX = 1e-30


@dataclass
class PagedKV:
    """One attention layer's paged K/V storage: ``[num_pages, page_size, kv_heads, head_dim]`` each.

    ``k_scale``/``v_scale`` ``[num_pages, page_size, kv_heads, n_groups]`` (fp32) exist only for the
    quantised formats; ``value = code * scale`` over consecutive groups of ``head_dim / n_groups``.
    """

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None

    @classmethod
    def allocate(cls, num_pages: int, page_size: int, num_heads: int, head_dim: int, *,
                 dtype: torch.dtype, device: torch.device | str, kv_dtype: str = "auto") -> "PagedKV":
        """``dtype`` is the model dtype ("auto" stores in it); ``kv_dtype`` one of :data:`KV_DTYPES`."""
        if kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype must be one of {KV_DTYPES}, got {kv_dtype!r}")
        shape = (num_pages, page_size, num_heads, head_dim)
        storage = {"auto": dtype, "bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn, "int8": torch.int8}[kv_dtype]
        k, v = torch.zeros(shape, dtype=storage, device=device), torch.zeros(shape, dtype=storage, device=device)
        if kv_dtype not in QUANT_MAX:
            return cls(k, v)
        group = head_dim if kv_dtype == "fp8" else min(INT8_GROUP, head_dim)
        if head_dim % group:
            raise ValueError(f"int8 KV needs head_dim divisible by {group}, got {head_dim}")
        scale_shape = (num_pages, page_size, num_heads, head_dim // group)
        return cls(k, v, torch.zeros(scale_shape, dtype=torch.float32, device=device),
                   torch.zeros(scale_shape, dtype=torch.float32, device=device))

    @property
    def page_size(self) -> int:
        return self.k.shape[1]

    @property
    def quant(self) -> str | None:
        """``"fp8"``, ``"int8"``, or ``None`` when values are stored as they are."""
        return {torch.float8_e4m3fn: "fp8", torch.int8: "int8"}.get(self.k.dtype)
