"""Rows of a quantized embedding table in one launch (CPU interpreter) against the formats' reference dequantizer:
bit for bit, since both compute the same fp32 product and round it once."""
from __future__ import annotations

import pytest
import torch

from kernel_testing import poisoned_outputs  # noqa: F401  (fixture)
from ninfer.kernels.dispatch import INTERPRET
from ninfer.kernels.embedding import code_kind, embedding_rows_triton
from ninfer.quant.formats import get_format, quantize

pytestmark = [pytest.mark.skipif(not INTERPRET, reason="Triton launchers on CPU need TRITON_INTERPRET=1"),
              pytest.mark.usefixtures("poisoned_outputs")]


@pytest.mark.parametrize("fmt", ["int8-g64", "int8-g32", "int4-g64", "int4-g128", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("dim", [256, 1280 + 128])  # one column block; two, the second partly masked
def test_rows_equal_the_reference(fmt: str, dtype: torch.dtype, dim: int) -> None:
    g = torch.Generator().manual_seed(dim)
    table = quantize(torch.randn(50, dim, generator=g) * 0.3, fmt)
    ids = torch.tensor([7, 0, 49, 7, 23])
    out = embedding_rows_triton(table.tensors["qweight"], table.tensors["scales"], ids, dim, dtype)
    ref = get_format(fmt).dequantize_rows(table.tensors, ids, dtype)
    assert out.dtype == dtype and torch.equal(out, ref)


def test_tables_it_does_not_read() -> None:
    for fmt in ("nvfp4", "fp8-b128"):
        table = quantize(torch.randn(128, 256), fmt)
        assert code_kind(table.tensors["qweight"], table.tensors["scales"], 256) is None, fmt
    table = quantize(torch.randn(16, 256), "int8-g64")
    assert code_kind(table.tensors["qweight"], table.tensors["scales"], 256) is not None
    assert code_kind(table.tensors["qweight"], table.tensors["scales"], 512) is None  # codes of another width
