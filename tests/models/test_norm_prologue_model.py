"""The decoder's norms folded into the quantized GEMMs, through the whole model: a tiny int4 model scored once
with the CPU references and once with the quantized GEMMs in the Triton interpreter (as on CUDA), where a
decode-sized forward (M <= 8) hands each deferred norm with a single reader (attention's qkv_proj, the MLP's
gate_up_proj) to its GEMM's prologue, and DeltaNet layers run the norm first (two readers)."""
from __future__ import annotations

import pytest
import torch

import ninfer
from ninfer.kernels.quant_gemm import dispatch
from tiny_checkpoints import TinyCheckpoint


def test_quantized_model_folds_single_reader_norms_into_the_gemm(dense_ckpt: TinyCheckpoint,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    llm = ninfer.load(dense_ckpt.path, device="cpu", quantize="int4", progress=False)
    tokens = list(range(3, 9))  # one forward of 6 tokens: decode-sized GEMMs
    ref = llm.score(tokens)
    launches: list[bool] = []
    real = dispatch._launch

    def spy(*args: object) -> None:
        launches.append(len(args) > 6 and args[6] is not None)
        real(*args)

    monkeypatch.setattr(dispatch, "use_triton", lambda x: True)  # the CUDA path, in the interpreter
    monkeypatch.setattr(dispatch, "_launch", spy)
    got = llm.score(tokens)
    config = llm.model.config
    attention = sum(t == "full_attention" for t in config.layer_types)
    assert sum(launches) == attention + config.num_hidden_layers  # qkv_proj and gate_up_proj of each layer
    assert len(launches) > sum(launches)  # the others (in_proj_qkvz, o_proj, out_proj, down_proj, head) unfused
    torch.testing.assert_close(got, ref, rtol=1e-3, atol=1e-3)
