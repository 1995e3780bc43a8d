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
