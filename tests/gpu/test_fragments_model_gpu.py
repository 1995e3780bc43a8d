"""A whole int4 (and nvfp4) model with its projections in the fragment layout (what ``ninfer.load(...,
quantize="int4")`` serves on a GPU) against the same model kept row-major (``NINFER_FRAGMENTS=0``) and against the PyTorch
reference path: prefill scores (the dequantization path and the decode kernel over token blocks) and greedy
decoding from CUDA graphs (the register decode at 1..3 tokens).

The quantized GEMMs run their first candidate (``NINFER_AUTOTUNE=off``): every candidate is checked in
``test_quant_fragments_gpu.py``, and tuning them all for fp32 activations (Triton gathers, no PTX) kept this file
past 270 s of compiling on the H200."""
from __future__ import annotations

import pytest
import torch
from bf16_oracle import assert_same_up_to_rounding

import ninfer
from ninfer.kernels.quant_gemm.fragments import FRAGMENTS
from ninfer.quant.linear import QuantLinear
from tiny_checkpoints import REAL_HEADS, TinyCheckpoint, make_dense

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(autouse=True)
def first_candidates(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NINFER_AUTOTUNE", "off")


@pytest.fixture(scope="module")
def dense(tmp_path_factory) -> TinyCheckpoint:
    return make_dense(tmp_path_factory.mktemp("fdense"), seed=3, overrides=REAL_HEADS)


def _prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(0, 448, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _layouts(llm) -> set[str]:
    return {m.layout for m in llm.model.modules() if isinstance(m, QuantLinear)}


@pytest.mark.parametrize("fmt", ["int4", "nvfp4"])
def test_fp32_fragments_equal_the_reference(dense: TinyCheckpoint, monkeypatch: pytest.MonkeyPatch, fmt: str) -> None:
    llm = ninfer.load(dense.path, device="cuda", dtype=torch.float32, quantize=fmt, progress=False,
                      cuda_graphs=False)
    assert FRAGMENTS in _layouts(llm)
    ids = _prompt(200)
    got = llm.score(ids)
    monkeypatch.setenv("NINFER_KERNELS", "reference")
    ref = llm.score(ids)
    assert (got - ref).abs().max().item() < 1e-3


@pytest.mark.parametrize("fmt", ["int4", "nvfp4"])
def test_bf16_fragments_decode_like_rows(dense: TinyCheckpoint, monkeypatch: pytest.MonkeyPatch, fmt: str) -> None:
    kw = dict(device="cuda", dtype=torch.bfloat16, quantize=fmt, progress=False, max_concurrency=2)
    monkeypatch.setenv("NINFER_FRAGMENTS", "0")
    rows = ninfer.load(dense.path, **kw)
    monkeypatch.delenv("NINFER_FRAGMENTS")
    frag = ninfer.load(dense.path, **kw)
    assert _layouts(rows) == {"rows"} and FRAGMENTS in _layouts(frag)
    ids = _prompt(300, seed=1)
    # The fp32 model over the same codes is the oracle: the fragment path must be as close to it as the row-major
    # one (nvfp4's tiny random model rounds further from both in bf16 than int4's: max 0.19 / mean 0.05 apart).
    ref = ninfer.load(dense.path, device="cuda", dtype=torch.float32, quantize=fmt, progress=False,
                      cuda_graphs=False).score(ids)
    err_frag, err_rows = (frag.score(ids) - ref).abs(), (rows.score(ids) - ref).abs()
    assert err_frag.mean() <= 1.25 * err_rows.mean() + 2e-3, (err_frag.mean(), err_rows.mean())
    assert err_frag.max() <= 1.5 * err_rows.max() + 2e-2, (err_frag.max(), err_rows.max())
    for seed in (2, 3):
        prompt = _prompt(40, seed)
        a = frag.generate(prompt, max_new_tokens=24, greedy=True, logprobs=1, ignore_eos=True)
        b = rows.generate(prompt, max_new_tokens=24, greedy=True, logprobs=1, ignore_eos=True)
        assert_same_up_to_rounding(a, b, greedy=True)


def test_programmatic_dependent_launch_decodes_bit_equal(dense: TinyCheckpoint,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """``NINFER_PDL=1`` (the norms let the next GEMM launch early, the GEMMs request their codes before they wait)
    changes when kernels start, never what they compute: the same tokens and logprobs from the captured graphs."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("programmatic dependent launch needs compute capability 9.0")
    for a, b in zip(*_decoded_off_and_on(dense, monkeypatch, "NINFER_PDL", seeds=(4, 5))):
        assert a.token_ids == b.token_ids
        assert [{t: lp.logprob for t, lp in d.items()} for d in a.logprobs] == \
            [{t: lp.logprob for t, lp in d.items()} for d in b.logprobs]


def test_the_deferred_norm_decodes_like_the_norm_kernels(dense: TinyCheckpoint,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """``NINFER_DEFERRED_NORM=1`` (the output projections leave the norms after them to the projections that read
    the rows, all of them in the fragment layout here): the same greedy tokens, logprobs within bf16 rounding, from
    the captured graphs; and the deferral did happen."""
    import ninfer.kernels.quant_gemm.dispatch as quant_dispatch

    deferred = []
    launch = quant_dispatch.launch_fragment_mma
    monkeypatch.setattr(quant_dispatch, "launch_fragment_mma", lambda *a, **k: deferred.append(
        (k.get("deferred") is not None, k.get("row_norm") is not None)) or launch(*a, **k))
    outs = _decoded_off_and_on(dense, monkeypatch, "NINFER_DEFERRED_NORM", seeds=(6, 7))
    assert any(d for d, _ in deferred) and any(r for _, r in deferred)
    for a, b in zip(*outs):
        assert_same_up_to_rounding(a, b, greedy=True)


def _decoded_off_and_on(dense: TinyCheckpoint, monkeypatch: pytest.MonkeyPatch, env: str, seeds: tuple[int, ...]):
    """Greedy 24-token continuations (logprobs too) of 40-token prompts from the int4 model's captured graphs, with
    ``env`` set to 0, then to 1."""
    kw = dict(device="cuda", dtype=torch.bfloat16, quantize="int4", progress=False, max_concurrency=2)
    outs = []
    for value in ("0", "1"):
        monkeypatch.setenv(env, value)
        llm = ninfer.load(dense.path, **kw)
        outs.append([llm.generate(_prompt(40, seed), max_new_tokens=24, greedy=True, logprobs=1, ignore_eos=True)
                     for seed in seeds])
        del llm
    return outs
