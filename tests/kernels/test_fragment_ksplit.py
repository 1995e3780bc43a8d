"""The register decode with K split over a program's warps (``kind="frag-ksplit"``: one 16-row tile a program, each
warp over an equal share of its split's chunks, the shares summed through shared memory, warp 0 storing), in the
interpreter against the reference GEMM: int4 (g64 / g128), int8-g64 and nvfp4, plain / residual / SwiGLU, one and
two splits, several token blocks, each trip's codes requested during the one before and copied ahead by
``cp.async``; the configs ``NINFER_FRAG_KSPLIT=1`` offers, and a K that does not fall into equal shares refused.
The norm epilogues with these configs: ``test_quant_norm_epilogue.py``, ``test_quant_deferred_norm.py``."""
from __future__ import annotations

import pytest
import torch
from kernel_testing import check_fragment_decode as _check
from kernel_testing import frag_config, fragment_laid

from ninfer.kernels.quant_gemm import quant_matmul_triton
from ninfer.kernels.quant_gemm.configs import KSPLIT_KIND
from ninfer.kernels.quant_gemm.fragment_configs import (
    fragment_candidates,
    fragment_ksplit_candidates,
)
from ninfer.quant.formats import quantize


def _ksplit(tokens: int, warps: int, split: int, stages: int = 2):
    return frag_config(tokens, warps, 2, split, stages, kind=KSPLIT_KIND)


@pytest.mark.parametrize("fmt", ["int4-g64", "int4-g128", "int8-g64", "nvfp4"])
@pytest.mark.parametrize("stages", [1, 2, 3])
def test_warps_splitting_k_match_the_reference(fmt: str, stages: int) -> None:
    _check(fmt, 3, 48, 512, _ksplit(8, 2, 1, stages), residual=True, seed=stages)  # 3 programs, 4 chunks a warp
    _check(fmt, 5, 64, 512, _ksplit(8, 2, 2, stages), swiglu=True, seed=stages + 1)  # two splits, fused sum
    _check(fmt, 11, 32, 1024, _ksplit(8, 4, 2, stages), residual=True, seed=stages + 2)  # two token blocks
    _check(fmt, 16, 32, 256, _ksplit(16, 2, 1, stages), seed=stages + 3)  # 16 tokens a program


def test_the_switch_offers_them(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NINFER_FRAG_KSPLIT", raising=False)
    plain = fragment_candidates("int4-g64", 1, 5120, 6144, 132)
    assert all(c.kind != KSPLIT_KIND for c in plain)
    monkeypatch.setenv("NINFER_FRAG_KSPLIT", "1")
    both = fragment_candidates("int4-g64", 1, 5120, 6144, 132)
    ksplit = fragment_ksplit_candidates("int4-g64", 1, 5120, 6144)
    assert both == plain + ksplit and ksplit and all(c.block_n == 16 for c in ksplit)
    for cfg in ksplit:  # whole, equal shares of K for every warp of every split
        per = (6144 // 64) // cfg.split_k
        assert per * cfg.split_k == 6144 // 64 and per % (2 * cfg.num_warps) == 0


def test_a_k_without_equal_shares_is_refused() -> None:
    w = fragment_laid(quantize(torch.randn(32, 384), "int4-g64"))  # 6 chunks: no 4 warps x 2-chunk trips
    with pytest.raises(ValueError, match="equal shares"):
        quant_matmul_triton(torch.randn(1, 384).half(), w, config=_ksplit(8, 4, 1))
