"""Quantized modules and the model surgery that installs them (CPU: dequantize + matmul path)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ninfer.kernels.quant_gemm import quant_matmul
from ninfer.quant.formats import FormatError, quantize
from ninfer.quant.linear import (
    QuantEmbedding,
    QuantLinear,
    QuantWeight,
    prepare_model_,
    quantize_model_,
    weight_shapes,
)


class _Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 64)
        self.proj = nn.Linear(64, 96, bias=False)
        self.experts = nn.Module()
        self.experts.gate_up = nn.Parameter(torch.randn(3, 64, 64))
        self.norm = nn.Parameter(torch.ones(64))


PLAN = {"embed": "int8-g32", "proj": "int4-g64", "experts.gate_up": "nvfp4", "norm": "bf16"}


def test_quant_linear_matches_dequantized_weight() -> None:
    torch.manual_seed(0)
    w = torch.randn(96, 64)
    layer = QuantLinear.from_float(w, "int4-g64")
    x = torch.randn(2, 5, 64)
    expect = F.linear(x, layer.dequantize(torch.float32))
    assert torch.allclose(layer(x), expect, atol=1e-5)
    res = torch.randn(2, 5, 96)
    assert torch.allclose(layer(x, residual=res), expect + res, atol=1e-5)
    assert all(not p.requires_grad for p in layer.parameters())
    assert {n for n, _ in layer.named_parameters()} == {"qweight", "scales"} <= QuantLinear.keep_dtype


def test_stacked_gate_up_with_swiglu_epilogue() -> None:
    torch.manual_seed(1)
    gate = QuantLinear.from_float(torch.randn(32, 64), "nvfp4")
    up = QuantLinear.from_float(torch.randn(32, 64) * 3, "nvfp4")  # another global scale: stacking keeps both
    fused = QuantLinear.stacked([gate, up])
    x = torch.randn(4, 64)
    assert torch.allclose(fused(x, swiglu=True), F.silu(gate(x)) * up(x), atol=1e-5)


def test_embedding_lookup_and_tied_head() -> None:
    torch.manual_seed(2)
    table = torch.randn(50, 64)
    emb = QuantEmbedding.from_float(table, "fp8-b128")
    ids = torch.tensor([[3, 49], [0, 3]])
    full = emb.dequantize(torch.float32)
    assert torch.equal(emb(ids), full[ids])
    head = emb.as_linear()
    assert head.qweight is emb.qweight
    x = torch.randn(3, 64)
    assert torch.allclose(head(x), x @ full.t(), atol=1e-5)


def test_rows_view_and_partial_loads_match_whole_quantization() -> None:
    torch.manual_seed(3)
    w = torch.randn(2, 256, 128)
    for fmt in ("int8-g64", "nvfp4", "fp8-b128", "fp8"):
        whole = QuantWeight.from_float(w, fmt)
        parts = QuantWeight((2, 256, 128), fmt)
        for e in range(2):
            if fmt == "nvfp4":  # separately quantized halves get their own global scale: compare values
                parts.load_float_(w[e, :128], index=e, rows=(0, 128))
                parts.load_float_(w[e, 128:], index=e, rows=(128, 256))
            else:
                parts.load_float_(w[e], index=e)
        if fmt == "nvfp4":
            halves = torch.cat([quantize(w[:, :128], fmt).dequantize(), quantize(w[:, 128:], fmt).dequantize()], 1)
            assert torch.equal(parts.dequantize(torch.float32), halves)
        else:
            assert torch.equal(parts.dequantize(torch.float32), whole.dequantize(torch.float32))
    experts = QuantWeight.from_float(w, "int4-g64")
    x = torch.randn(3, 128)
    assert torch.allclose(quant_matmul(x, experts.select(1)), x @ experts.dequantize(torch.float32)[1].t(), atol=1e-5)
    with pytest.raises(FormatError, match="do not align"):
        QuantWeight((256, 128), "fp8-b128").rows_view("scales", 64, 128)


def test_weight_shapes_and_model_surgery() -> None:
    torch.manual_seed(4)
    model = _Toy()
    assert weight_shapes(model) == {"embed": (50, 64), "proj": (96, 64), "experts.gate_up": (3, 64, 64), "norm": (64,)}
    reference = {name: p.detach().clone() for name, p in model.named_parameters()}
    quantize_model_(model, PLAN)
    assert isinstance(model.proj, QuantLinear) and isinstance(model.embed, QuantEmbedding)
    assert isinstance(model.experts.gate_up, QuantWeight) and isinstance(model.norm, nn.Parameter)
    assert model.embed.dtype == torch.float32
    expect = quantize(reference["proj.weight"], "int4-g64").dequantize()
    assert torch.equal(model.proj.dequantize(torch.float32), expect)

    # A meta model prepared from the same plan has exactly the parameters a loader fills by name.
    with torch.device("meta"):
        empty = _Toy()
    prepare_model_(empty, PLAN, dtype=torch.bfloat16)
    got = {n: (tuple(p.shape), p.dtype) for n, p in empty.named_parameters()}
    want = {n: (tuple(p.shape), p.dtype) for n, p in model.named_parameters()}
    assert got == want
    assert all(p.is_meta for p in empty.parameters()) and empty.embed.dtype == torch.bfloat16


def test_surgery_errors() -> None:
    model = _Toy()
    with pytest.raises(FormatError, match="cannot hold format int8-g32"):
        quantize_model_(model, {"norm": "int8-g32"})
    with pytest.raises(FormatError, match="not a module or parameter"):
        quantize_model_(model, {"missing": "fp8"})
    with pytest.raises(FormatError, match="bias"):
        quantize_model_(nn.Sequential(nn.Linear(64, 64)), {"0": "fp8"})
