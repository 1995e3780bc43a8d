"""The MoE block through the fused decode launch (``NINFER_MOE_FUSED_DECODE=1``, :mod:`ninfer.kernels.moe.fused_decode`)
in the Triton interpreter, as the model calls it: int4 routed experts, an int8 shared expert re-laid in the register
decode's fragment layout (the block reads a row-major copy it keeps), against the same block with the switch off (the
reference path), the norm after it with and without a residual."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from ninfer.kernels.dispatch import INTERPRET
from ninfer.kernels.moe import fused_decode as fd
from ninfer.models.layers import RMSNorm
from ninfer.models.moe import SparseMoeBlock
from ninfer.quant.linear import QuantLinear, quantize_model_

pytestmark = pytest.mark.skipif(not INTERPRET, reason="Triton launchers on CPU need TRITON_INTERPRET=1")

H, E, I, SI = 128, 8, 64, 128  # the fragment layout takes K in multiples of 128


def _block() -> SparseMoeBlock:
    torch.manual_seed(0)
    config = SimpleNamespace(hidden_size=H, num_experts=E, num_experts_per_tok=2, moe_intermediate_size=I,
                             shared_expert_intermediate_size=SI)
    block = SparseMoeBlock(config)
    for p in block.parameters():
        p.data.normal_(0.0, H ** -0.5)
    quantize_model_(block, {"experts.gate_up_proj": "int4-g64", "experts.down_proj": "int4-g64",
                            "shared_expert.gate_up_proj": "int8-g64", "shared_expert.down_proj": "int8-g64"})
    for module in (block.shared_expert.gate_up_proj, block.shared_expert.down_proj):
        assert isinstance(module, QuantLinear) and module.use_fragment_layout_()
    return block


@pytest.mark.parametrize("with_residual", [True, False])
def test_the_block_decodes_through_one_launch(with_residual: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    block = _block()
    norm = RMSNorm(H, 1e-6)
    norm.weight.data.normal_(0.0, 0.3)
    x, residual = torch.randn(3, H), (torch.randn(3, H) * 2 if with_residual else None)
    monkeypatch.setenv("NINFER_MOE_FUSED_DECODE", "0")
    want, want_res = block.forward_then_norm(x, norm, residual)
    monkeypatch.setenv("NINFER_MOE_FUSED_DECODE", "1")
    monkeypatch.setattr(fd, "use_triton", lambda t: True)  # as on a GPU; the kernel runs interpreted
    launched = []
    real = fd.launch_fused
    monkeypatch.setattr(fd, "launch_fused", lambda *a, **k: launched.append(1) or real(*a, **k))
    got, got_res = block.forward_then_norm(x, norm, residual)
    assert launched
    torch.testing.assert_close(got_res, want_res, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    kept = block.__dict__["_shared_rows"]
    assert all(w.layout == "rows" for w in kept)  # the fragment-laid weights stay as the register decode reads them
    assert block.shared_expert.gate_up_proj.layout != "rows"
