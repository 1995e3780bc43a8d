"""``NINFER_PDL_WAITS=1`` (:mod:`ninfer.kernels.pdl`): the norms, the MoE routing, the expert GEMV and the combine
launched with programmatic dependent launch, waiting at their start. It changes when kernels start, never what they
compute: the int4 MoE model decodes the same tokens and logprobs from its captured graphs with it and without, and
each of those kernels is launched so (the launch option and the wait go together)."""
from __future__ import annotations

import pytest
import torch

from tiny_checkpoints import REAL_HEADS, TinyCheckpoint, make_moe

import ninfer
import ninfer.kernels.pdl as pdl

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(autouse=True)
def first_candidates(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NINFER_AUTOTUNE", "off")


@pytest.fixture(scope="module")
def moe(tmp_path_factory) -> TinyCheckpoint:
    """The MoE model of the whole-model GPU tests: real head sizes, 128-wide experts (int4 groups fit)."""
    return make_moe(tmp_path_factory.mktemp("pdl_moe"), expert_layout="fused", seed=2,
                    overrides={**REAL_HEADS, "moe_intermediate_size": 128, "shared_expert_intermediate_size": 128})


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 448, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_the_moe_model_decodes_bit_equal_with_the_small_kernels_waiting(moe: TinyCheckpoint, monkeypatch) -> None:
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("programmatic dependent launch needs compute capability 9.0")
    monkeypatch.setenv("NINFER_PDL", "1")
    waited = []
    real = pdl.small_kernel_pdl
    outs = []
    for waits in ("0", "1"):
        monkeypatch.setenv("NINFER_PDL_WAITS", waits)
        for module in ("ninfer.kernels.norms", "ninfer.kernels.moe.routing", "ninfer.kernels.moe.gemm",
                       "ninfer.kernels.moe.quant_gemv"):
            monkeypatch.setattr(f"{module}.small_kernel_pdl", lambda device: waited.append(real(device)) or waited[-1])
        llm = ninfer.load(moe.path, device="cuda", dtype=torch.bfloat16, quantize="int4", progress=False,
                          max_concurrency=2)
        outs.append([llm.generate(_prompt(40, seed), max_new_tokens=24, greedy=True, logprobs=1, ignore_eos=True)
                     for seed in (8, 9)])
        del llm
        assert waited and all(p.wait == (waits == "1") and p.trigger for p in waited)
        assert all(p.options() == ({"launch_pdl": True} if p.wait else {}) for p in waited)
        waited.clear()
    for a, b in zip(*outs):
        assert a.token_ids == b.token_ids
        assert [{t: lp.logprob for t, lp in d.items()} for d in a.logprobs] == \
            [{t: lp.logprob for t, lp in d.items()} for d in b.logprobs]
