"""Quantized models end to end: convert -> load -> generate, and quantize= while loading."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import ninfer
from ninfer.checkpoint import fused_parts
from ninfer.cli import main
from ninfer.kernels.moe import dispatch as moe_ops
from ninfer.kernels.moe import gemm as moe_gemm
from ninfer.kernels.dispatch import INTERPRET
from ninfer.quant.formats import QuantizedTensor, get_format, quantize
from ninfer.quant.linear import QuantLinear, QuantWeight, weight_shapes
from ninfer.quant.recipe import load_recipe, resolve_plan
from tiny_checkpoints import TinyCheckpoint, make_dense

PROMPT = list(range(3, 140))


def _mean_abs_logprob_gap(a: ninfer.LLM, b: ninfer.LLM) -> float:
    return (a.score(PROMPT) - b.score(PROMPT)).abs().mean().item()


@pytest.fixture(scope="module")
def reference(dense_ckpt: TinyCheckpoint) -> ninfer.LLM:
    return ninfer.load(dense_ckpt.path, device="cpu", progress=False)


def _simulated(ckpt: TinyCheckpoint, recipe: str) -> ninfer.LLM:
    """The float model with every planned weight replaced by dequantize(quantize(w)): the format's own error."""
    llm = ninfer.load(ckpt.path, device="cpu", progress=False)
    params = dict(llm.model.named_parameters())
    parts = fused_parts(llm.model)
    with torch.no_grad():
        for name, fmt in resolve_plan(load_recipe(recipe), weight_shapes(llm.model)).items():
            if fmt != "bf16":
                if name in parts:  # a part of a fused projection: its rows, quantized on their own
                    where = parts[name]
                    weight = params[f"{where.module}.weight"][where.start:where.stop]
                else:
                    weight = params.get(f"{name}.weight", params.get(name))  # stacked experts have no .weight
                weight.copy_(get_format(fmt).dequantize(quantize(weight.data, fmt).tensors, torch.float32))
    return llm


# The tiny random models are far more sensitive than real ones (peaked random heads, fast-forgetting
# DeltaNet gates), so the float comparison is a loose sanity bound; exactness is checked against the
# simulated quantization, which isolates the kernels and the loader from the format's own error.
@pytest.mark.parametrize("recipe, bound", [("int8", 0.3), ("fp8", 1.0)])
def test_quantize_on_load_equals_simulated_quantization(dense_ckpt: TinyCheckpoint, reference, recipe: str,
                                                        bound: float) -> None:
    llm = ninfer.load(dense_ckpt.path, device="cpu", quantize=recipe, progress=False)
    assert any(isinstance(m, QuantLinear) for m in llm.model.modules())
    assert (llm.score(PROMPT) - _simulated(dense_ckpt, recipe).score(PROMPT)).abs().max().item() < 1e-4
    assert _mean_abs_logprob_gap(llm, reference) < bound
    assert len(llm.generate("hello", max_new_tokens=5, greedy=True).token_ids) == 5


@pytest.mark.skipif(not INTERPRET, reason="CPU tensors through Triton need TRITON_INTERPRET=1")
@pytest.mark.parametrize("recipe", ["int8", "nvfp4", "fp8"])
def test_quantized_moe_experts(moe_ckpt: TinyCheckpoint, monkeypatch: pytest.MonkeyPatch, recipe: str) -> None:
    """The grouped quantized expert GEMMs (Triton interpreter) inside the model: 3, 40 and 137 tokens
    take the alignment-free, 16-row and 64-row paths (8 experts, top 2)."""
    simulated = _simulated(moe_ckpt, recipe)
    expected = {n: simulated.score(PROMPT[:n]) for n in (3, 40, len(PROMPT))}
    llm = ninfer.load(moe_ckpt.path, device="cpu", quantize=recipe, progress=False)
    experts = llm.model.layers[0].mlp.experts
    assert isinstance(experts.gate_up_proj, QuantWeight) and isinstance(experts.down_proj, QuantWeight)
    calls = []

    def spy(x, gate_up, down, weights, ids, shared=None, norm=None):  # norm: the next norm in the combine (default)
        calls.append((gate_up, down))
        return moe_gemm.moe_experts_triton(x, gate_up, down, weights, ids, shared=shared, norm=norm)

    monkeypatch.setattr(moe_ops, "use_triton", lambda x: True)  # CPU tensors through the interpreter
    monkeypatch.setattr(moe_ops, "moe_experts_triton", spy)
    for n, ref in expected.items():
        assert (llm.score(PROMPT[:n]) - ref).abs().max().item() < 1e-4, n
    assert calls and all(isinstance(w, QuantizedTensor) for pair in calls for w in pair)


def test_convert_then_load_without_repacking(tmp_path: Path) -> None:
    # A bf16 source, like real checkpoints: the converter stores unquantized tensors as bf16.
    source = make_dense(tmp_path / "bf16", dtype=torch.bfloat16, seed=4)
    out = tmp_path / "int8"
    main(["convert", str(source.path), "--recipe", "int8", "--out", str(out)])
    assert (out / "ninfer.json").is_file()
    converted = ninfer.load(out, device="cpu", progress=False)
    on_the_fly = ninfer.load(source.path, device="cpu", quantize="int8", progress=False)
    # Loading the converted files gives exactly the on-the-fly quantized model.
    assert torch.equal(converted.score(PROMPT), on_the_fly.score(PROMPT))
    greedy = converted.generate("abc", max_new_tokens=6, greedy=True)
    assert greedy.token_ids == on_the_fly.generate("abc", max_new_tokens=6, greedy=True).token_ids


def test_convert_cli_lists_recipes_and_rejects_bad_ones(dense_ckpt: TinyCheckpoint, tmp_path: Path, capsys) -> None:
    main(["convert", "--list-recipes"])
    listed = capsys.readouterr().out
    assert "qwen3_5_27b_int4" in listed and "nvfp4" in listed
    with pytest.raises(SystemExit) as exc:
        main(["convert", str(dense_ckpt.path), "--recipe", "no-such-recipe", "--out", str(tmp_path / "x")])
    assert exc.value.code == 2 and "no-such-recipe" in capsys.readouterr().err


def test_quantize_on_load_of_a_quantized_checkpoint_is_an_error(dense_ckpt: TinyCheckpoint, tmp_path: Path) -> None:
    out = tmp_path / "q"
    main(["convert", str(dense_ckpt.path), "--recipe", "int8", "--out", str(out)])
    with pytest.raises(ValueError, match="already quantized"):
        ninfer.load(out, device="cpu", quantize="int8", progress=False)
