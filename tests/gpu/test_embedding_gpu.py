"""Rows of a quantized embedding table in one launch, on the GPU at the real vocabulary: bit-equal to the formats'
reference dequantizer in bf16 and fp32, eagerly and replayed from a CUDA graph; the module takes the kernel."""
from __future__ import annotations

import pytest
import torch

from ninfer.kernels.embedding import embedding_rows_triton
from ninfer.quant.formats import get_format, quantize
from ninfer.quant.linear import QuantEmbedding

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
VOCAB, DEV = 248_320, "cuda"


@pytest.mark.parametrize("fmt", ["int8-g64", "int8-g32", "fp8"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("dim", [5120, 2048])
def test_rows_at_the_real_vocabulary(fmt: str, dtype: torch.dtype, dim: int) -> None:
    table = quantize(torch.randn(VOCAB, dim, device=DEV, dtype=torch.bfloat16) * 0.02, fmt)
    q, s = table.tensors["qweight"], table.tensors["scales"]
    ids = torch.tensor([0, VOCAB - 1, 12345, 0, 248_000, 7], device=DEV)
    ref = get_format(fmt).dequantize_rows(table.tensors, ids, dtype)
    assert torch.equal(embedding_rows_triton(q, s, ids, dim, dtype), ref)
    static = ids.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = embedding_rows_triton(q, s, static, dim, dtype)
    static.copy_(torch.randint(0, VOCAB, (6,), device=DEV))
    graph.replay()
    assert torch.equal(out, get_format(fmt).dequantize_rows(table.tensors, static, dtype))


def test_the_module_takes_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    emb = QuantEmbedding.from_float(torch.randn(4096, 256, device=DEV, dtype=torch.bfloat16), "int8-g64")
    ids = torch.randint(0, 4096, (3, 5), device=DEV)
    calls = []
    import ninfer.quant.linear as linear

    monkeypatch.setattr(linear, "embedding_rows_triton",
                        lambda *a: calls.append(1) or embedding_rows_triton(*a))
    out = emb(ids)
    assert calls and out.shape == (3, 5, 256)
    assert torch.equal(out, emb.format.dequantize_rows(dict(emb.named_parameters()), ids.reshape(-1),
                                                       torch.bfloat16).view(3, 5, 256))
