"""Fused projections (:mod:`ninfer.models.fused`): MLP gate/up and DeltaNet a/b in one storage, the
projections as views of it, the same outputs."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from ninfer.models.fused import fuse_projections
from ninfer.models.layers import MLP
from ninfer.quant.linear import QuantLinear


def _mlp(fmt: str | None, seed: int = 0, dtype: torch.dtype = torch.float32) -> MLP:
    torch.manual_seed(seed)
    mlp = MLP(64, 128).to(dtype)
    for layer in (mlp.gate_proj, mlp.up_proj, mlp.down_proj):
        nn.init.normal_(layer.weight, std=0.1)
    if fmt is not None:
        for name in ("gate_proj", "up_proj", "down_proj"):
            setattr(mlp, name, QuantLinear.from_float(getattr(mlp, name).weight.detach(), fmt))
    return mlp


@pytest.mark.parametrize("fmt", [None, "int4-g64", "int8-g32", "fp8-b128", "nvfp4"])
def test_fused_mlp_matches_unfused_and_keeps_names_and_memory(fmt: str | None) -> None:
    mlp = _mlp(fmt)
    x = torch.randn(5, 64)
    before = mlp(x)
    state = {k: v.clone() for k, v in mlp.state_dict().items()}
    nbytes = sum(p.numel() * p.element_size() for p in mlp.parameters())
    assert mlp.gate_up is None and mlp.fuse_() and mlp.fuse_()  # idempotent
    fused = mlp.gate_up
    assert fused is not None
    after = mlp(x)
    assert torch.allclose(after, before, rtol=1e-5, atol=1e-6), (after - before).abs().max()
    # names and values unchanged, no extra parameter memory, the projections are views of the fused storage
    assert list(mlp.state_dict()) == list(state)
    assert all(torch.equal(mlp.state_dict()[k], v) for k, v in state.items())
    assert sum(p.numel() * p.element_size() for p in mlp.parameters()) == nbytes
    first = fused.weight if isinstance(fused.weight, torch.Tensor) else next(fused.weight.parameters())
    gate_first = next(mlp.gate_proj.parameters())
    assert gate_first.data_ptr() == first.data_ptr()
    assert not any(m is fused.weight for m in mlp.modules())  # not a registered submodule


def test_loading_writes_through_the_views() -> None:
    mlp = _mlp("int4-g64", seed=1)
    other = _mlp("int4-g64", seed=2)
    mlp.fuse_()
    mlp.load_state_dict(other.state_dict())  # copy_ into the views: the fused storage follows
    x = torch.randn(3, 64)
    assert mlp.gate_up is not None
    assert torch.allclose(mlp(x), other(x), rtol=1e-5, atol=1e-6)


def test_replaced_parameters_unfuse() -> None:
    mlp = _mlp(None, seed=3)
    mlp.fuse_()
    mlp.up_proj.weight = nn.Parameter(torch.randn(128, 64) * 0.1)  # a new tensor, not a view of the fused storage
    assert mlp.gate_up is None
    x = torch.randn(2, 64)
    ref = mlp.down_proj(nn.functional.silu(mlp.gate_proj(x)) * mlp.up_proj(x))
    assert torch.allclose(mlp(x), ref, rtol=1e-5, atol=1e-6)


def test_mixed_formats_stay_unfused() -> None:
    mlp = _mlp("int4-g64", seed=4)
    mlp.up_proj = QuantLinear.from_float(torch.randn(128, 64) * 0.1, "int8-g32")
    assert not mlp.fuse_() and mlp.gate_up is None
    assert fuse_projections(nn.Sequential(_mlp(None), _mlp("nvfp4"), mlp)) == 2
    assert fuse_projections(None) == 0


def test_engine_fuses_every_mlp_and_deltanet_and_scores_as_unfused(dense_ckpt, moe_ckpt) -> None:
    """``ninfer.load`` fuses (dense MLPs, the MoE shared expert and its router with the shared gate, attention
    q/k/v, DeltaNet a/b); undoing it (fresh tensors in place of the views) gives the same log-probabilities.
    Parity with transformers: tests/test_parity.py."""
    import ninfer
    from ninfer.models.layers import GatedAttention, GatedDeltaNet
    from ninfer.models.moe import SparseMoeBlock

    ids = torch.randint(0, 448, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    for ckpt in (dense_ckpt, moe_ckpt):
        llm = ninfer.load(ckpt.path, device="cpu", progress=False)
        mlps = [m for m in llm.model.modules() if isinstance(m, MLP)]
        nets = [m for m in llm.model.modules() if isinstance(m, GatedDeltaNet)]
        assert mlps and nets and all(m.gate_up is not None for m in mlps)
        attns = [m for m in llm.model.modules() if isinstance(m, GatedAttention)]
        moes = [m for m in llm.model.modules() if isinstance(m, SparseMoeBlock)]
        assert all(m.router_and_shared_gate is not None for m in moes) and bool(moes) == (ckpt is moe_ckpt)
        assert all(m.in_proj_ab is not None for m in nets) and attns and all(m.qkv_proj is not None for m in attns)
        fused = llm.score(ids)
        for m in mlps + nets + attns:  # a replaced parameter breaks the shared storage: separate projections again
            for layer in {MLP: ("gate_proj", "up_proj"), GatedDeltaNet: ("in_proj_a", "in_proj_b"),
                          GatedAttention: ("q_proj", "k_proj", "v_proj")}[type(m)]:
                layer = getattr(m, layer)
                layer.weight = nn.Parameter(layer.weight.detach().clone(), requires_grad=False)
        assert all(m.gate_up is None for m in mlps) and all(m.in_proj_ab is None for m in nets)
        assert all(m.qkv_proj is None for m in attns)
        assert torch.allclose(llm.score(ids), fused, atol=1e-5)


def test_memory_plan_counts_fused_quantized_weights() -> None:
    """The dequantization workspace covers the largest fused weight too (it is no registered module)."""
    from ninfer.runtime.memory import dequant_workspace_bytes

    model = nn.Sequential(_mlp("int4-g64"))
    before = dequant_workspace_bytes([model], torch.bfloat16)
    model[0].fuse_()
    assert dequant_workspace_bytes([model], torch.bfloat16) == 2 * before  # [2I, H] instead of [I, H]
