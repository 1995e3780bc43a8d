"""Fused projections declared as modules: the loader fills their rows from the checkpoint's separate
tensors (float, quantized on load, pre-quantized), recipes resolve their parts to one format."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

import ninfer
from ninfer.checkpoint import CheckpointError, canonical_name, fused_parts
from ninfer.models.layers import MLP
from ninfer.quant.formats import FORMATS, FormatError, quantize, stack_rows
from ninfer.quant.linear import QuantLinear, module_plan, quantize_model_, weight_shapes
from tiny_checkpoints import TinyCheckpoint

FUSED = {"mlp.gate_up_proj": ["mlp.gate_proj", "mlp.up_proj"],
         "self_attn.qkv_proj": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
         "linear_attn.in_proj_ab": ["linear_attn.in_proj_a", "linear_attn.in_proj_b"],
         "mlp.router": ["mlp.gate", "mlp.shared_expert_gate"],
         "mlp.shared_expert.gate_up_proj": ["mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj"]}


def _source(ckpt: TinyCheckpoint) -> dict[str, torch.Tensor]:
    return {canonical_name(k)[1]: t for k, t in load_file(str(ckpt.path / "model.safetensors")).items()
            if canonical_name(k)[0] == "text"}


@pytest.mark.parametrize("fixture", ["dense_ckpt", "moe_ckpt"])
def test_loader_fills_the_rows_of_every_fused_projection(request: pytest.FixtureRequest, fixture: str) -> None:
    ckpt: TinyCheckpoint = request.getfixturevalue(fixture)
    llm = ninfer.load(ckpt.path, device="cpu", progress=False)
    source, params = _source(ckpt), dict(llm.model.named_parameters())
    seen = set()
    for i in range(len(llm.model.layers)):
        for fused, parts in FUSED.items():
            name = f"layers.{i}.{fused}.weight"
            if name in params:
                seen.add(fused)
                expect = torch.cat([source[f"layers.{i}.{part}.weight"] for part in parts]).float()
                assert torch.equal(params[name], expect), name
    assert seen == ({"mlp.router", "mlp.shared_expert.gate_up_proj"} if fixture == "moe_ckpt"
                    else {"mlp.gate_up_proj"}) | {"self_attn.qkv_proj", "linear_attn.in_proj_ab"}
    assert not any(name.endswith(("q_proj.weight", "in_proj_a.weight", "mlp.gate.weight")) for name in params)


def test_a_stored_fused_tensor_loads_and_a_missing_part_is_named(dense_ckpt: TinyCheckpoint, tmp_path: Path) -> None:
    tensors = load_file(str(dense_ckpt.path / "model.safetensors"))
    gate, up = (f"model.layers.0.mlp.{p}_proj.weight" for p in ("gate", "up"))
    fused = {k: v for k, v in tensors.items() if k not in (gate, up)}
    fused["model.layers.0.mlp.gate_up_proj.weight"] = torch.cat([tensors[gate], tensors[up]])
    for name, content in (("fused", fused), ("missing", {k: v for k, v in tensors.items() if k != up})):
        shutil.copytree(dense_ckpt.path, tmp_path / name, ignore=shutil.ignore_patterns("*.safetensors"))
        save_file(content, str(tmp_path / name / "model.safetensors"))
    ref = ninfer.load(dense_ckpt.path, device="cpu", progress=False).score(list(range(3, 40)))
    got = ninfer.load(tmp_path / "fused", device="cpu", progress=False).score(list(range(3, 40)))
    assert torch.equal(got, ref)
    with pytest.raises(CheckpointError, match=r"missing 1 tensors: layers\.0\.mlp\.up_proj\.weight"):
        ninfer.load(tmp_path / "missing", device="cpu", progress=False)


@pytest.mark.parametrize("fmt", [f for f in FORMATS if f != "bf16"])
def test_quantized_fused_projection_holds_the_separately_quantized_parts(fmt: str) -> None:
    """Each part is quantized on its own rows: the fused module's tensors are those of the separate
    projections stacked (nvfp4: each part keeps its global scale, stored per row), and the GEMM with
    the SwiGLU epilogue equals SwiGLU over the two separate products."""
    torch.manual_seed(0)
    mlp = MLP(128, 256)
    for p in mlp.parameters():
        nn.init.normal_(p, std=0.1)
    with torch.no_grad():
        mlp.gate_up_proj.weight[256:] *= 5.0  # up with another range than gate: different global / block scales
    gate, up = (w.detach().clone() for w in mlp.gate_up_proj.weight.split(256))
    assert weight_shapes(mlp) == {"gate_proj": (256, 128), "up_proj": (256, 128), "down_proj": (128, 256)}
    quantize_model_(mlp, {"gate_proj": fmt, "up_proj": fmt})
    fused = mlp.gate_up_proj
    assert isinstance(fused, QuantLinear) and isinstance(mlp.down_proj, nn.Linear)
    expect = stack_rows([quantize(gate, fmt), quantize(up, fmt)])
    for name, tensor in expect.tensors.items():
        assert torch.equal(getattr(fused, name), tensor), name
    x = torch.randn(3, 128)
    parts = [QuantLinear.from_float(w, fmt) for w in (gate, up)]
    ref = mlp.down_proj(nn.functional.silu(parts[0](x)) * parts[1](x))
    torch.testing.assert_close(mlp(x), ref, rtol=1e-5, atol=1e-5)


def test_module_plan_resolves_parts_to_one_format() -> None:
    with torch.device("meta"):
        mlp = MLP(128, 200)
    parts = fused_parts(mlp)
    assert module_plan({"gate_proj": "int8-g32", "up_proj": "int8-g32", "down_proj": "fp8"}, parts) == {
        "gate_up_proj": "int8-g32", "down_proj": "fp8"}
    assert module_plan({"gate_proj": "bf16", "down_proj": "fp8"}, parts) == {"gate_up_proj": "bf16",
                                                                             "down_proj": "fp8"}
    with pytest.raises(FormatError, match=r"gate_proj: int8-g32, up_proj: bf16: these are one fused projection"):
        module_plan({"gate_proj": "int8-g32"}, parts)
    with pytest.raises(FormatError, match=r"gate_proj \(200 rows\) ends inside a 128-row scale block of format "
                                          r"fp8-b128"):
        module_plan({"gate_proj": "fp8-b128", "up_proj": "fp8-b128"}, parts)


@pytest.mark.parametrize("layout", ["fp8-per-tensor", "modelopt-nvfp4"])
def test_prequantized_parts_with_their_own_per_tensor_scales_load_exactly(dense_ckpt: TinyCheckpoint,
                                                                         tmp_path: Path, layout: str) -> None:
    """q/k/v quantized with different per-tensor scales (fp8's scale, nvfp4's global scale): each part's
    scale becomes its rows' scales, so the fused module dequantizes to the parts exactly."""
    tensors = load_file(str(dense_ckpt.path / "model.safetensors"))
    out, expect = dict(tensors), []
    for i, proj in enumerate(("q", "k", "v")):
        key = f"model.layers.3.self_attn.{proj}_proj.weight"
        w = tensors[key].float() * (i + 1)  # another range per part
        if layout == "fp8-per-tensor":
            scale = w.abs().max() / 448
            q = (w / scale).to(torch.float8_e4m3fn)
            out[key], out[key.replace(".weight", ".weight_scale")] = q, scale
            expect.append(q.float() * scale)
        else:
            packed = quantize(w, "nvfp4")
            out[key] = packed.tensors["qweight"]
            out[key.replace(".weight", ".weight_scale")] = packed.tensors["scales"]
            out[key.replace(".weight", ".weight_scale_2")] = packed.tensors["global_scale"][0].clone()
            expect.append(packed.dequantize())
    shutil.copytree(dense_ckpt.path, tmp_path / "q", ignore=shutil.ignore_patterns("*.safetensors"))
    save_file(out, str(tmp_path / "q" / "model.safetensors"))
    llm = ninfer.load(tmp_path / "q", device="cpu", progress=False)
    qkv = llm.model.layers[3].self_attn.qkv_proj
    assert isinstance(qkv, QuantLinear) and qkv.format.name == ("fp8" if layout == "fp8-per-tensor" else "nvfp4")
    assert torch.equal(qkv.dequantize(torch.float32), torch.cat(expect))
