"""One-launch kernels inside the engine, run by the Triton interpreter on CPU, against the reference paths' greedy
output: the round rows (``kernels.spec_rows``), the RoPE tables and the quantized embedding lookup in every forward
of a speculative engine; the MoE combine applying the next norm (``NINFER_MOE_NORM=1``) in a MoE model's layers;
the one-launch attention prologue (``NINFER_FUSED_PROLOGUE=1``) in every attention layer; the output projections'
GEMMs applying the norm after them (``NINFER_NORM_IN_GEMM=1``)."""
from __future__ import annotations

import pytest

import ninfer
import ninfer.kernels.embedding as embedding
import ninfer.kernels.rope as rope
import ninfer.kernels.spec_rows as spec_rows
from ninfer.kernels.dispatch import INTERPRET
from ninfer.runtime.sampling import SamplingParams

pytestmark = pytest.mark.skipif(not INTERPRET, reason="Triton launchers on CPU need TRITON_INTERPRET=1")
OUTPUT_PROJECTIONS = (".o_proj", ".out_proj", ".down_proj")
PROMPTS = [[5, 17, 33, 99, 12, 7, 201, 45], list(range(20, 57)), [300, 301, 302]]


def _run(llm: ninfer.LLM, tokens: int = 20) -> list[list[int]]:
    params = SamplingParams(greedy=True)
    return [c.token_ids for c in llm._run([llm._request(list(p), tokens, params) for p in PROMPTS])]


def test_speculative_rounds_through_the_interpreted_kernels(composite_ckpt, monkeypatch) -> None:
    kw = dict(device="cpu", progress=False, max_concurrency=3, max_context=512, quantize="int4")
    want = _run(ninfer.load(composite_ckpt.path, **kw))  # reference paths throughout
    calls = {"rows": 0, "rope": 0, "embedding": 0}

    def counted(name, fn):  # noqa: ANN001, ANN202
        def run(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            calls[name] += 1
            return fn(*args, **kwargs)
        return run

    monkeypatch.setattr(spec_rows, "use_triton", lambda x: True)
    monkeypatch.setattr(spec_rows, "round_rows_triton", counted("rows", spec_rows.round_rows_triton))
    monkeypatch.setattr(rope, "use_triton", lambda x: True)
    monkeypatch.setattr(rope, "mrope_cos_sin_triton", counted("rope", rope.mrope_cos_sin_triton))
    monkeypatch.setattr(rope, "apply_rope_triton", rope.apply_rope_reference)  # the other RoPE ops stay as they were
    monkeypatch.setattr(rope, "qk_norm_rope_triton", rope.qk_norm_rope_reference)
    monkeypatch.setattr(embedding, "use_triton", lambda x: True)
    import ninfer.quant.linear as linear

    monkeypatch.setattr(linear, "embedding_rows_triton", counted("embedding", embedding.embedding_rows_triton))
    llm = ninfer.load(composite_ckpt.path, spec="mtp", draft_tokens=3, **kw)
    assert _run(llm) == want
    assert llm.engine.spec_totals.rounds > 0 and all(n > 0 for n in calls.values()), calls


def test_moe_layers_with_the_norm_in_the_combine(composite_moe_ckpt, monkeypatch) -> None:
    import ninfer.kernels.moe.dispatch as moe_dispatch

    kw = dict(device="cpu", progress=False, max_concurrency=2, max_context=256)
    want = _run(ninfer.load(composite_moe_ckpt.path, **kw))
    monkeypatch.setenv("NINFER_MOE_NORM", "1")
    monkeypatch.setattr(moe_dispatch, "use_triton", lambda x: True)  # the whole expert path, interpreted
    normed_in_combine = []
    triton_experts = moe_dispatch.moe_experts_triton
    monkeypatch.setattr(moe_dispatch, "moe_experts_triton",
                        lambda *a, **k: normed_in_combine.append(k.get("norm") is not None) or triton_experts(*a, **k))
    assert _run(ninfer.load(composite_moe_ckpt.path, **kw)) == want
    assert normed_in_combine and all(normed_in_combine)


@pytest.mark.parametrize("ckpt_name", ["composite_ckpt", "composite_moe_ckpt"])
def test_attention_layers_with_the_one_launch_prologue(request, ckpt_name: str, monkeypatch) -> None:
    """``NINFER_FUSED_PROLOGUE=1``: every attention layer's q/k norm, RoPE and K/V write in the interpreted
    prologue kernel, prompts and decode steps, plain and speculative; greedy output equals the reference path's."""
    import ninfer.kernels.attention.prologue as prologue

    ckpt = request.getfixturevalue(ckpt_name)
    kw = dict(device="cpu", progress=False, max_concurrency=3, max_context=512)
    want = _run(ninfer.load(ckpt.path, **kw))
    monkeypatch.setenv("NINFER_FUSED_PROLOGUE", "1")
    monkeypatch.setattr(prologue, "use_triton", lambda x: True)
    launches = []
    fused = prologue.qk_norm_rope_write_kv_triton
    monkeypatch.setattr(prologue, "qk_norm_rope_write_kv_triton", lambda *a: launches.append(1) or fused(*a))
    assert _run(ninfer.load(ckpt.path, **kw)) == want
    assert _run(ninfer.load(ckpt.path, spec="mtp", draft_tokens=3, **kw)) == want
    assert launches


def test_output_projections_that_apply_the_norm_after_them(composite_ckpt, monkeypatch) -> None:
    """``NINFER_NORM_IN_GEMM=1``: every layer's o_proj / out_proj and down_proj in the fragment layout apply the norm
    after them in their GEMM's launch (all GEMMs interpreted, prompts through the unfused path above MAX_ROWS
    tokens); greedy output equals the same GEMMs followed by the norm kernel's reference."""
    import ninfer.kernels.quant_gemm.dispatch as quant_dispatch
    from ninfer.quant.linear import QuantLinear

    kw = dict(device="cpu", progress=False, max_concurrency=3, max_context=512, quantize="int4")
    monkeypatch.setattr(quant_dispatch, "use_triton", lambda x: True)

    laid_outputs = []

    def fragment_laid_engine() -> ninfer.LLM:
        llm = ninfer.load(composite_ckpt.path, **kw)
        laid_outputs.clear()
        for name, sub in llm.engine.runner.model.named_modules():  # what the engine does to such weights on CUDA
            if isinstance(sub, QuantLinear) and sub.use_fragment_layout_() and name.endswith(OUTPUT_PROJECTIONS):
                laid_outputs.append(name)
        return llm

    want = _run(fragment_laid_engine())
    monkeypatch.setenv("NINFER_NORM_IN_GEMM", "1")
    monkeypatch.setattr(quant_dispatch, "MAX_ROWS", 3)  # every decode step, all three lanes in one batch
    fused = []
    launch = quant_dispatch.launch_fragment_mma
    monkeypatch.setattr(quant_dispatch, "launch_fragment_mma",
                        lambda *a, **k: fused.append(k.get("norm") is not None) or launch(*a, **k))
    assert _run(fragment_laid_engine()) == want
    # the tiny model's K = 64 out_proj is too narrow for the fragment layout; its down_proj and o_proj take it
    assert laid_outputs and sum(fused) == 19 * len(laid_outputs)  # every decode step (one batch of all lanes)


def test_output_projections_that_leave_the_norm_to_their_readers(composite_ckpt, monkeypatch) -> None:
    """``NINFER_DEFERRED_NORM=1``: every o_proj / down_proj in the fragment layout leaves the norm after it to the
    projections that read its rows, plain and speculative decode steps (all GEMMs interpreted); greedy output equals
    the reference path's. The tiny model's readers (K = 64) are too narrow for the fragment layout and read the
    materialized rows (the kernel tests cover the register decode and the float GEMV normalizing them). The last
    layer's down_proj is followed by the final norm, which is never deferred."""
    import ninfer.kernels.quant_gemm.dispatch as quant_dispatch
    from ninfer.quant.linear import QuantLinear

    kw = dict(device="cpu", progress=False, max_concurrency=3, max_context=512, quantize="int4")
    tokens = 8  # a few plain steps and speculative rounds: every GEMM of them runs in the interpreter
    want = _run(ninfer.load(composite_ckpt.path, **kw), tokens)
    monkeypatch.setenv("NINFER_DEFERRED_NORM", "1")
    monkeypatch.setattr(quant_dispatch, "use_triton", lambda x: True)
    produced = []
    launch = quant_dispatch.launch_fragment_mma
    monkeypatch.setattr(quant_dispatch, "launch_fragment_mma",
                        lambda *a, **k: produced.append(k.get("deferred") is not None) or launch(*a, **k))
    for spec in ({}, {"spec": "mtp", "draft_tokens": 3}):
        llm = ninfer.load(composite_ckpt.path, **kw, **spec)
        for sub in llm.engine.runner.model.modules():  # what the engine does to such weights on CUDA
            if isinstance(sub, QuantLinear):
                sub.use_fragment_layout_()
        assert _run(llm, tokens) == want
        assert spec == {} or llm.engine.spec_totals.rounds > 0
    assert any(produced) and not all(produced)
