"""The MoE block after its router in one launch (:mod:`ninfer.kernels.moe.fused_decode`) in the Triton interpreter:
routed stacks in every grouped format with an int8 or int4 shared expert, fp32 and fp16 activations, 1-8 tokens,
every candidate config, with and without the residual, against the references (top-k routing, the dequantized
experts, the shared expert's SwiGLU MLP, the gated combine, the RMSNorm after the block). The interpreter runs the
programs one after another, so each B item finds its token's A items done: the tests check the items' indexing,
the routing in every program, the epilogue and that every counter is left at zero (the GPU tests check the waits)."""
from __future__ import annotations

import pytest
import torch
from kernel_testing import expert_routing, expert_stacks, poisoned_outputs  # noqa: F401  (a fixture)

from ninfer.kernels.counters import arrival_counters
from ninfer.kernels.dispatch import INTERPRET
from ninfer.kernels.moe import fused_decode as fd
from ninfer.kernels.norms import NextNorm
from ninfer.quant.formats import quantize

pytestmark = [pytest.mark.skipif(not INTERPRET, reason="Triton launchers on CPU need TRITON_INTERPRET=1"),
              pytest.mark.usefixtures("poisoned_outputs")]

E, K = 8, 3
SHAPES = {  # routed format: (H, I, shared I); H a multiple of the shared expert's group (its gate/up K)
    "int4-g64": (192, 64, 128), "int4-g128": (256, 128, 64), "int8-g64": (128, 64, 64), "nvfp4": (192, 48, 64),
    "fp8-b128": (256, 96, 64),
}
TOL = {torch.float32: 2e-5, torch.float16: 4e-3}


def _block(fmt: str, shared_fmt: str, n: int, dtype: torch.dtype, seed: int) -> dict:
    h, i, si = SHAPES[fmt]
    gate_up, down = expert_stacks(fmt, E, h, i, seed)
    g = torch.Generator().manual_seed(seed + 3)
    shared_gate_up = quantize(torch.randn(2 * si, h, generator=g) * h ** -0.5, shared_fmt)
    shared_down = quantize(torch.randn(h, si, generator=g) * si ** -0.5, shared_fmt)
    logits = torch.randn(n, E + 1, generator=g).to(dtype)  # the router's rows, the shared expert's gate last
    return dict(x=torch.randn(n, h, generator=g).to(dtype), router_logits=logits[:, :E], shared_logit=logits[:, E:],
                gate_up=gate_up, down=down, shared_gate_up=shared_gate_up, shared_down=shared_down,
                residual=(torch.randn(n, h, generator=g) * 3).to(dtype),
                w=(torch.randn(h, generator=g) * 0.3).to(dtype))


def _reference(b: dict, with_residual: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return fd.moe_block_reference(b["x"], b["router_logits"], b["shared_logit"], b["gate_up"], b["down"],
                                  b["shared_gate_up"], b["shared_down"], K, b["w"], 1e-6,
                                  b["residual"] if with_residual else None)


def _close(got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, label: object) -> None:
    assert got.dtype == dtype and torch.isfinite(got).all(), label
    err = ((got.double() - ref.double()).norm() / ref.double().norm()).item()
    assert err < TOL[dtype], (label, err)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("fmt", list(SHAPES))
def test_every_candidate_matches_the_reference_block(fmt: str, dtype: torch.dtype) -> None:
    for n, shared_fmt in ((1, "int8-g64"), (3, "int4-g64"), (8, "int8-g64")):
        b = _block(fmt, shared_fmt, n, dtype, seed=n)
        _, i, si = SHAPES[fmt]
        cands = fd.fused_candidates(fmt, shared_fmt, i, si)
        assert cands
        for cfg in cands if n == 3 and dtype == torch.float32 else cands[:1]:  # every config once, in fp32
            for with_residual in (True, False) if cfg == cands[0] else (True,):
                norm = NextNorm(b["w"], 1e-6, b["residual"] if with_residual else None, torch.empty_like(b["x"]))
                out = torch.empty_like(b["x"])
                assert fd.launch_fused(b["x"], b["router_logits"], b["shared_logit"], b["gate_up"], b["down"],
                                       b["shared_gate_up"], b["shared_down"], K, norm, out, cfg)
                ref, ref_res = _reference(b, with_residual)
                _close(norm.new_residual, ref_res, dtype, (fmt, n, cfg, "residual"))
                _close(out, ref, dtype, (fmt, n, cfg, "normed"))
    assert not arrival_counters(torch.device("cpu")).any()


def test_the_block_api_takes_it_where_switched_on(monkeypatch: pytest.MonkeyPatch) -> None:
    b = _block("int4-g64", "int8-g64", 2, torch.float16, seed=5)
    args = [b[k] for k in ("gate_up", "down", "shared_gate_up", "shared_down")]
    monkeypatch.delenv("NINFER_MOE_FUSED_DECODE", raising=False)
    assert not fd.fused_decode_applies(b["x"], *args[:2])
    monkeypatch.setenv("NINFER_MOE_FUSED_DECODE", "1")
    assert not fd.fused_decode_applies(b["x"], *args[:2])  # CPU tensors: the model takes the reference path
    monkeypatch.setattr(fd, "use_triton", lambda x: True)  # as on a GPU
    assert fd.fused_decode_applies(b["x"], *args[:2]) and fd.shared_expert_fits(*args[2:])
    assert not fd.fused_decode_applies(b["x"].repeat(5, 1), *args[:2])  # 10 tokens
    fp8 = expert_stacks("fp8", E, 192, 64)
    assert not fd.fused_decode_applies(b["x"], *fp8)  # per-row scales
    assert not fd.shared_expert_fits(*(w.select(0) for w in fp8))
    got = fd.moe_block_fused_then_norm(b["x"], b["router_logits"], b["shared_logit"], *args, K, b["w"], 1e-6,
                                       b["residual"])
    assert got is not None
    ref, ref_res = _reference(b, True)
    _close(got[1], ref_res, torch.float16, "residual")
    _close(got[0], ref, torch.float16, "normed")


def test_candidates() -> None:
    for fmt in SHAPES:
        cands = fd.fused_candidates(fmt, "int8-g64", 512, 512)
        assert cands and len(set(cands)) == len(cands) and all(c.num_warps <= 8 for c in cands)
        assert any(c.words for c in cands) == fmt.startswith("int4")
    assert fd.fused_candidates("int4-g64", "int8-g64", 512, 512)[0] == fd.FusedConfig(16, 8, 16, 1024, 512, 4)
    assert fd.fused_candidates("int4-g64", "int8-g64", 36, 512) == []  # no 8- or 16-column gate/up tiles fit
