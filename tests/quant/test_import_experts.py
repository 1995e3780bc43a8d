"""Pre-quantized MoE checkpoints that store experts per expert, in each public layout of
``ninfer.quant.imports``, load into packed ``[E, ...]`` stacks without requantizing.

Each checkpoint is the tiny MoE with every ``mlp.experts.{e}.{gate,up,down}_proj.weight`` replaced
by that layout's tensors. The oracle is the float checkpoint with each expert weight set to its
dequantized value computed straight from the layout's description (not through ninfer's formats).
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import ninfer
from ninfer.checkpoint import CheckpointError
from ninfer.kernels.moe import dispatch as moe_ops
from ninfer.kernels.dispatch import INTERPRET
from ninfer.quant.formats import quantize
from ninfer.quant.linear import QuantWeight
from tiny_checkpoints import TinyCheckpoint, make_moe

PROMPT = list(range(3, 60))
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
EXPERT_WEIGHT = ".mlp.experts."


def _nvfp4_values(packed: torch.Tensor, block_scale: torch.Tensor, multiplier: float) -> torch.Tensor:
    """Low nibble first, sign in bit 3, 16 values per e4m3 block scale, times the tensor's global multiplier."""
    codes = torch.stack([packed & 0xF, packed >> 4], -1).flatten(-2)
    values = E2M1[(codes & 7).long()] * torch.where(codes >= 8, -1.0, 1.0)
    return values * block_scale.float().repeat_interleave(16, -1) * multiplier


def _modelopt_nvfp4(w: torch.Tensor, salt: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    q = quantize(w, "nvfp4").tensors
    multiplier = float(q["global_scale"][0]) * (1 + salt % 3) / 2  # gate, up and down of one expert differ
    tensors = {"weight": q["qweight"], "weight_scale": q["scales"], "weight_scale_2": torch.tensor(multiplier),
               "input_scale": torch.tensor(0.5)}
    return tensors, _nvfp4_values(q["qweight"], q["scales"], multiplier)


def _ct_nvfp4(w: torch.Tensor, salt: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    q = quantize(w, "nvfp4").tensors
    divisor = 1.0 / float(q["global_scale"][0])
    tensors = {"weight_packed": q["qweight"], "weight_scale": q["scales"],
               "weight_global_scale": torch.tensor([divisor]), "input_global_scale": torch.tensor([3.0])}
    return tensors, _nvfp4_values(q["qweight"], q["scales"], 1.0 / divisor)


def _fp8_block(w: torch.Tensor, salt: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    n, k = w.shape
    scale = torch.rand(-(-n // 128), -(-k // 128), generator=torch.Generator().manual_seed(salt)) * 1e-3 + 1e-3
    expanded = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:n, :k]
    q = (w / expanded).to(torch.float8_e4m3fn)
    return {"weight": q, "weight_scale_inv": scale}, q.float() * expanded


def _fp8_channel(w: torch.Tensor, salt: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    scale = w.abs().amax(-1, keepdim=True) / 448.0
    q = (w / scale).to(torch.float8_e4m3fn)
    return {"weight": q, "weight_scale": scale, "input_scale": torch.tensor(1.0)}, q.float() * scale


LAYOUTS = {"modelopt-nvfp4": _modelopt_nvfp4, "ct-nvfp4": _ct_nvfp4, "fp8-block": _fp8_block,
           "fp8-channel": _fp8_channel}


@pytest.fixture(scope="module")
def wide_moe_ckpt(tmp_path_factory: pytest.TempPathFactory) -> TinyCheckpoint:
    """Expert width 128: gate and up each fill whole 128-row scale blocks (fp8-block stacks them)."""
    return make_moe(tmp_path_factory.mktemp("moe_wide"), overrides={"moe_intermediate_size": 128}, seed=1)


def _write_prequantized(ckpt: TinyCheckpoint, layout: str, out: Path) -> dict[str, torch.Tensor]:
    """Copy ``ckpt`` with its experts in ``layout``; returns the dequantized value of each expert weight."""
    shutil.copytree(ckpt.path, out)
    file = next(out.glob("*.safetensors"))
    tensors, dequantized = {}, {}
    for i, (key, w) in enumerate(sorted(load_file(file).items())):
        if EXPERT_WEIGHT in key and key.endswith("_proj.weight"):
            base = key.removesuffix(".weight")
            packed, dequantized[key] = LAYOUTS[layout](w, i)
            tensors.update({f"{base}.{suffix}": t for suffix, t in packed.items()})
        else:
            tensors[key] = w
    save_file(tensors, str(file))
    return dequantized


def _float_oracle(ckpt: TinyCheckpoint, dequantized: dict[str, torch.Tensor]) -> ninfer.LLM:
    llm = ninfer.load(ckpt.path, device="cpu", progress=False)
    with torch.no_grad():
        for key, w in dequantized.items():  # model.layers.{l}.mlp.experts.{e}.{proj}_proj.weight
            parts = key.split(".")
            layer, expert, proj = int(parts[2]), int(parts[5]), parts[6]
            experts = llm.model.layers[layer].mlp.experts
            if proj == "down_proj":
                experts.down_proj[expert].copy_(w)
            else:
                half = experts.gate_up_proj.shape[1] // 2
                rows = slice(0, half) if proj == "gate_proj" else slice(half, 2 * half)
                experts.gate_up_proj[expert, rows].copy_(w)
    return llm


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_per_expert_prequantized_experts_load_as_packed_stacks(moe_ckpt: TinyCheckpoint, wide_moe_ckpt,
                                                               tmp_path: Path, layout: str) -> None:
    ckpt = wide_moe_ckpt if layout == "fp8-block" else moe_ckpt
    dequantized = _write_prequantized(ckpt, layout, tmp_path / layout)
    llm = ninfer.load(tmp_path / layout, device="cpu", progress=False)
    experts = llm.model.layers[1].mlp.experts
    assert isinstance(experts.gate_up_proj, QuantWeight) and isinstance(experts.down_proj, QuantWeight)
    e, gate_key = 3, "model.layers.1.mlp.experts.3.gate_proj.weight"
    half = experts.gate_up_proj.shape[1] // 2
    got = experts.gate_up_proj.dequantize(torch.float32)[e, :half]
    assert torch.allclose(got, dequantized[gate_key], rtol=1e-6, atol=0)  # scales multiplied in another order
    oracle = _float_oracle(ckpt, dequantized).score(PROMPT)
    assert (llm.score(PROMPT) - oracle).abs().max().item() < 1e-4


@pytest.mark.skipif(not INTERPRET, reason="CPU tensors through Triton need TRITON_INTERPRET=1")
def test_imported_nvfp4_stacks_through_the_grouped_kernels(moe_ckpt: TinyCheckpoint, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Gate and up of one expert carry different global scales: per-row in the stack, read by the kernel."""
    dequantized = _write_prequantized(moe_ckpt, "modelopt-nvfp4", tmp_path / "q")
    oracle = _float_oracle(moe_ckpt, dequantized)
    expected = {n: oracle.score(PROMPT[:n]) for n in (4, len(PROMPT))}
    llm = ninfer.load(tmp_path / "q", device="cpu", progress=False)
    monkeypatch.setattr(moe_ops, "use_triton", lambda x: True)
    for n, ref in expected.items():
        assert (llm.score(PROMPT[:n]) - ref).abs().max().item() < 1e-4, n


def test_block_scales_that_straddle_gate_and_up_are_refused(moe_ckpt: TinyCheckpoint, tmp_path: Path) -> None:
    """Expert width 32: one 128-row fp8 scale block would have to hold both gate and up."""
    _write_prequantized(moe_ckpt, "fp8-block", tmp_path / "q")
    with pytest.raises(CheckpointError, match="cannot be stacked"):
        ninfer.load(tmp_path / "q", device="cpu", progress=False)


def test_missing_expert_is_reported(moe_ckpt: TinyCheckpoint, tmp_path: Path) -> None:
    _write_prequantized(moe_ckpt, "modelopt-nvfp4", tmp_path / "q")
    file = next((tmp_path / "q").glob("*.safetensors"))
    tensors = {k: t for k, t in load_file(file).items() if ".layers.2.mlp.experts.5.up_proj." not in k}
    save_file(tensors, str(file))
    with pytest.raises(CheckpointError, match="layers.2.mlp.experts: found 23 per-expert qweight tensors, expected 24"):
        ninfer.load(tmp_path / "q", device="cpu", progress=False)
