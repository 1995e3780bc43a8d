"""The quantized weight as the kernels see it: a format (by name) and its stored tensors.

The formats themselves (quantizers, dequantizers, layouts) live in :mod:`ninfer.quant.formats`, which
re-exports these names; the kernels need only the type and the tensors, so they do not import ``quant``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


class FormatError(ValueError):
    """An unknown format, or a weight shape the format cannot store; the message says which."""


class WeightFormatLike(Protocol):
    """What a :class:`QuantizedTensor` needs of its format (``ninfer.quant.formats.WeightFormat``)."""

    name: str

    def dequantize(self, tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor: ...

    def dequantize_rows(self, tensors: dict[str, torch.Tensor], rows: torch.Tensor,
                        dtype: torch.dtype) -> torch.Tensor: ...


ROWS = "rows"  # the formats' own layout (ninfer.quant.formats); the other: fragments.FRAGMENTS


@dataclass
class QuantizedTensor:
    """A weight ``[*, N, K]`` in one format: the format and its stored tensors, in the format's own layout
    (``"rows"``) or re-laid for a kernel (``layout``; :mod:`ninfer.kernels.quant_gemm.fragments`)."""

    format: WeightFormatLike
    shape: tuple[int, ...]
    tensors: dict[str, torch.Tensor]
    layout: str = ROWS

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.format.dequantize(self.row_major().tensors, dtype)

    def row_major(self) -> QuantizedTensor:
        """This weight in the format's own layout (itself if it is in it)."""
        if self.layout == ROWS:
            return self
        from ninfer.kernels.quant_gemm.fragments import from_fragments

        q, s = from_fragments(self.tensors["qweight"], self.tensors["scales"])
        return QuantizedTensor(self.format, self.shape, {**self.tensors, "qweight": q, "scales": s})

    def select(self, index: int) -> QuantizedTensor:
        """Slice ``index`` of the leading dim (one expert of a stack) as views: every stored tensor
        carries the leading dims of the weight, so no format needs to know about experts."""
        if len(self.shape) < 3:
            raise FormatError(f"select takes a slice of a stacked weight [E, N, K]; this one is {list(self.shape)}")
        return QuantizedTensor(self.format, self.shape[1:], {name: t[index] for name, t in self.tensors.items()},
                               self.layout)

    def dequantize_rows(self, rows: torch.Tensor, dtype: torch.dtype = torch.float32,
                        block: int = 4096) -> torch.Tensor:
        """Rows ``rows`` of a 2-D weight, dequantized: ``[len(rows), K]`` (a tied LM head's subset, the drafts').
        A re-laid weight is read back ``block`` rows at a time (a multiple of the fragments' 16-row tiles, whose
        tensors hold their rows contiguously), so no more than a block is ever dequantized at once."""
        if self.layout == ROWS:
            return self.format.dequantize_rows(self.tensors, rows, dtype)
        n, k = self.shape
        out = torch.empty(rows.shape[0], k, dtype=dtype, device=rows.device)
        for first in range(0, n, block):
            inside = ((rows >= first) & (rows < first + block)).nonzero().squeeze(1)
            if inside.numel():
                stop = min(n, first + block)
                part = QuantizedTensor(self.format, (stop - first, k),
                                       {name: t[first:stop] for name, t in self.tensors.items()}, self.layout)
                out[inside] = part.dequantize(dtype).index_select(0, rows[inside] - first)
        return out
