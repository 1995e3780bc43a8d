"""``convert_checkpoint`` on tiny checkpoints, loading its output with the streaming loader, and public-layout
imports."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ninfer.checkpoint import canonical_name, checkpoint_files, load_weights, materialize
from ninfer.config import load_config
from ninfer.models.qwen3_5 import Qwen3_5TextModel
from ninfer.quant.convert import (
    ConvertError,
    convert_checkpoint,
    manifest_plan,
    read_manifest,
)
from ninfer.quant.formats import QuantizedTensor, get_format, quantize
from ninfer.quant.imports import scan_checkpoint
from ninfer.quant.linear import QuantLinear, QuantWeight, prepare_model_
from ninfer.quant.recipe import RecipeError
from tiny_checkpoints import planned_weight


def _tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for path in sorted(set(checkpoint_files(model_dir).values())):
        out.update(load_file(path))
    return out


def _load_converted(model_dir: Path) -> Qwen3_5TextModel:
    """What ``ninfer.load`` does with a converted checkpoint: prepare, materialise (keep_dtype), stream in
    (fused projections filled from their parts); raises on a missing or unexpected tensor."""
    config = load_config(model_dir)
    with torch.device("meta"):
        model = Qwen3_5TextModel(config)
    prepare_model_(model, manifest_plan(read_manifest(model_dir)), dtype=torch.float32)
    materialize(model, torch.device("cpu"), torch.float32)
    load_weights(model, model_dir, torch.device("cpu"), tied_lm_head=config.tie_word_embeddings,
                 progress=False)
    return model


def test_convert_dense_and_load_without_repacking(dense_ckpt, tmp_path: Path) -> None:
    out = convert_checkpoint(dense_ckpt.path, "qwen3_5_27b_int4", tmp_path / "q", progress=False)
    assert (out / "config.json").read_text() == (dense_ckpt.path / "config.json").read_text()
    assert (out / "tokenizer.json").is_file() and (out / "generation_config.json").is_file()
    manifest = read_manifest(out)
    assert manifest["recipe"]["name"] == "qwen3_5_27b_int4"
    entry = manifest["weights"]["layers.0.mlp.down_proj"]
    assert entry["format"] == "int4-g64" and entry["group_size"] == 64 and entry["shape"] == [64, 128]
    assert entry["tensors"] == {"qweight": "model.layers.0.mlp.down_proj.qweight",
                                "scales": "model.layers.0.mlp.down_proj.scales"}
    stored = _tensors(out)
    assert stored["model.norm.weight"].dtype == torch.bfloat16
    assert stored["model.layers.0.linear_attn.A_log"].dtype == torch.float32
    assert manifest["passthrough"]["model.layers.0.input_layernorm.weight"] == "bf16"

    source = {canonical_name(k)[1]: t for k, t in _tensors(dense_ckpt.path).items()}
    model = _load_converted(out)
    assert "model.layers.0.mlp.gate_proj.qweight" in stored  # fused projections are written as their parts
    for name, fmt in manifest_plan(manifest).items():
        module, rows = planned_weight(model, name)
        assert isinstance(module, QuantWeight) and module.format.name == fmt
        expect = quantize(source[f"{name}.weight"], fmt).dequantize()
        got = module.dequantize(torch.float32)
        assert torch.equal(got[rows], expect), name
    assert isinstance(model.layers[0].mlp.gate_up_proj, QuantLinear)
    assert isinstance(model.layers[3].self_attn.qkv_proj, QuantLinear)
    assert model.layers[0].linear_attn.in_proj_ab.weight.dtype == torch.float32  # bf16 rule, model dtype


def test_convert_refuses_fused_parts_in_different_formats(dense_ckpt, tmp_path: Path) -> None:
    recipe = tmp_path / "split.json"
    recipe.write_text(json.dumps({"rules": [{"select": "layers.*.mlp.gate_proj", "format": "int8-g32"},
                                            {"select": "layers.*.mlp.up_proj", "format": "int4-g64"}]}))
    with pytest.raises(RecipeError, match=r"gate_proj: int8-g32, .*up_proj: int4-g64.*one fused projection "
                                          r"\(layers\.0\.mlp\.gate_up_proj\)"):
        convert_checkpoint(dense_ckpt.path, recipe, tmp_path / "never", progress=False)
    assert not (tmp_path / "never").exists()


def test_convert_stacks_per_expert_tensors(moe_ckpt, tmp_path: Path) -> None:
    out = convert_checkpoint(moe_ckpt.path, "qwen3_5_35b_a3b_nvfp4", tmp_path / "q", progress=False)
    stored = _tensors(out)
    source = _tensors(moe_ckpt.path)
    num_experts = moe_ckpt.config["num_experts"]
    assert not any(".experts.0." in key for key in stored)
    gate_up = torch.stack([torch.cat([source[f"model.layers.1.mlp.experts.{e}.gate_proj.weight"],
                                      source[f"model.layers.1.mlp.experts.{e}.up_proj.weight"]])
                           for e in range(num_experts)])
    fmt = get_format("nvfp4")
    got = fmt.dequantize({f: stored[f"model.layers.1.mlp.experts.gate_up_proj.{f}"] for f in fmt.specs(gate_up.shape)})
    assert torch.equal(got, quantize(gate_up, fmt).dequantize())
    assert read_manifest(out)["weights"]["layers.1.mlp.experts.down_proj"]["shape"] == [num_experts, 64, 32]
    model = _load_converted(out)
    assert isinstance(model.layers[1].mlp.experts.gate_up_proj, QuantWeight)


def test_convert_composite_keeps_prefixes_vision_and_packs_mtp(composite_moe_ckpt, tmp_path: Path) -> None:
    out = convert_checkpoint(composite_moe_ckpt.path, "nvfp4", tmp_path / "q", progress=False, max_shard_bytes=50_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # several shards
    stored = _tensors(out)
    source = _tensors(composite_moe_ckpt.path)
    assert "model.language_model.layers.0.mlp.experts.gate_up_proj.qweight" in stored
    # The recipe's mtp.* rules pack the MTP layer's projections and experts; its fc, norms and router stay.
    assert "mtp.layers.0.mlp.experts.gate_up_proj.qweight" in stored
    assert "mtp.layers.0.self_attn.q_proj.qweight" in stored
    for key in ("mtp.fc.weight", "mtp.norm.weight", "mtp.layers.0.mlp.gate.weight"):
        assert torch.equal(stored[key], source[key]), key
    for key in source:
        if key.startswith("model.visual."):
            assert torch.equal(stored[key], source[key]), key
    _load_converted(out)


def test_convert_refuses_bad_inputs(dense_ckpt, tmp_path: Path) -> None:
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    with pytest.raises(ConvertError, match="never overwrites"):
        convert_checkpoint(dense_ckpt.path, "int8", tmp_path / "full", progress=False)
    with pytest.raises(RecipeError, match="matches no weight"):
        convert_checkpoint(dense_ckpt.path, "qwen3_5_35b_a3b_int4", tmp_path / "never", progress=False)
    assert not (tmp_path / "never").exists()
    done = convert_checkpoint(dense_ckpt.path, "int8", tmp_path / "once", progress=False)
    with pytest.raises(ConvertError, match="already quantized"):
        convert_checkpoint(done, "int8", tmp_path / "twice", progress=False)


# ---- pre-quantized public layouts -------------------------------------------------------------

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _documented_nvfp4(packed: torch.Tensor, block_scale: torch.Tensor, multiplier: float) -> torch.Tensor:
    """Straight from the layout notes: low nibble first, sign bit 3, 16 values per e4m3 scale."""
    codes = torch.stack([packed & 0xF, packed >> 4], -1).flatten(-2)
    values = E2M1[(codes & 7).long()] * torch.where(codes >= 8, -1.0, 1.0)
    return values * block_scale.float().repeat_interleave(16, -1) * multiplier


def _import(tmp_path: Path, tensors: dict[str, torch.Tensor]) -> dict[str, QuantizedTensor]:
    save_file(tensors, str(tmp_path / "model.safetensors"))
    files = checkpoint_files(tmp_path)
    imported = scan_checkpoint(files)
    out: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        for new_key, new in imported.translate(key, tensor):
            base, _, field = new_key.rpartition(".")
            out.setdefault(base, {})[field] = new
    result = {}
    for base, w in imported.weights.items():
        fmt = get_format(w.format)
        specs = {f: tuple(s.shape) for f, s in fmt.specs(w.shape).items()}
        assert specs == {f: tuple(t.shape) for f, t in out[base].items()}
        result[base] = QuantizedTensor(fmt, w.shape, out[base])
    assert imported.plan() == {canonical_name(b)[1]: w.format for b, w in imported.weights.items()}
    return result


def _random_nvfp4(g: torch.Generator, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    packed = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8)
    scale = (torch.rand(n, k // 16, generator=g) * 400).to(torch.float8_e4m3fn)
    return packed, scale


def test_modelopt_nvfp4_loads_byte_for_byte(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    packed, scale = _random_nvfp4(g, 48, 64)
    base = "model.language_model.layers.0.mlp.gate_proj"
    got = _import(tmp_path, {f"{base}.weight": packed, f"{base}.weight_scale": scale,
                             f"{base}.weight_scale_2": torch.tensor(0.003), f"{base}.input_scale": torch.tensor(1.5),
                             "model.language_model.norm.weight": torch.ones(64)})
    assert torch.equal(got[base].tensors["qweight"], packed)
    assert torch.allclose(got[base].dequantize(), _documented_nvfp4(packed, scale, 0.003), rtol=1e-6, atol=0)


def test_compressed_tensors_nvfp4_inverts_the_global_divisor(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(1)
    packed, scale = _random_nvfp4(g, 32, 128)
    base = "model.layers.3.self_attn.o_proj"
    got = _import(tmp_path, {f"{base}.weight_packed": packed, f"{base}.weight_scale": scale,
                             f"{base}.weight_global_scale": torch.tensor([250.0]),
                             f"{base}.input_global_scale": torch.tensor([10.0])})
    expect = _documented_nvfp4(packed, scale, 1.0) / 250.0
    assert torch.allclose(got[base].dequantize(), expect, rtol=1e-6, atol=0)


def test_block_and_row_fp8_checkpoints(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(2)
    block_q = torch.randn(200, 300, generator=g).to(torch.float8_e4m3fn)
    block_s = torch.rand(2, 3, generator=g) + 0.1
    row_q = torch.randn(64, 96, generator=g).to(torch.float8_e4m3fn)
    chan_s = torch.rand(64, 1, generator=g)
    got = _import(tmp_path, {"model.layers.0.mlp.up_proj.weight": block_q,
                             "model.layers.0.mlp.up_proj.weight_scale_inv": block_s,
                             "model.layers.1.self_attn.q_proj.weight": row_q,
                             "model.layers.1.self_attn.q_proj.weight_scale": torch.tensor(0.02),
                             "model.layers.1.self_attn.k_proj.weight": row_q.clone(),
                             "model.layers.1.self_attn.k_proj.weight_scale": chan_s,
                             "model.layers.1.self_attn.k_proj.input_scale": torch.tensor(1.0)})
    expand = block_s.repeat_interleave(128, 0).repeat_interleave(128, 1)[:200, :300]
    assert got["model.layers.0.mlp.up_proj"].format.name == "fp8-b128"
    assert torch.equal(got["model.layers.0.mlp.up_proj"].dequantize(), block_q.float() * expand)
    assert got["model.layers.1.self_attn.q_proj"].format.name == "fp8"
    assert torch.equal(got["model.layers.1.self_attn.q_proj"].dequantize(), row_q.float() * torch.tensor(0.02))
    assert torch.equal(got["model.layers.1.self_attn.k_proj"].dequantize(), row_q.float() * chan_s)


def test_per_expert_imports_report_the_stacked_name(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(3)
    tensors = {}
    for e in range(2):
        for proj in ("gate", "up", "down"):
            packed, scale = _random_nvfp4(g, 32, 64)
            base = f"model.layers.0.mlp.experts.{e}.{proj}_proj"
            tensors |= {f"{base}.weight": packed, f"{base}.weight_scale": scale,
                        f"{base}.weight_scale_2": torch.tensor(0.01 * (e + 1))}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    plan = scan_checkpoint(checkpoint_files(tmp_path)).plan()
    assert plan == {"layers.0.mlp.experts.gate_up_proj": "nvfp4", "layers.0.mlp.experts.down_proj": "nvfp4"}
