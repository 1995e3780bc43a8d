"""The decoder's norms folded into the quantized GEMMs, through the whole model: a tiny int4 model scored once
with the CPU references and once with the quantized GEMMs in the Triton interpreter (as on CUDA), where a
decode-sized forward (M <= 8) hands each deferred norm to its first reader's GEMM prologue (attention's
qkv_proj, DeltaNet's in_proj_qkvz, the MLP's gate_up_proj); DeltaNet's second reader (in_proj_ab, bf16) takes
the normed x that GEMM wrote."""
from __future__ import annotations

import pytest
import torch

import ninfer
from ninfer.kernels import norms
from ninfer.kernels.quant_gemm import dispatch
from ninfer.models.batch import make_batch
from tiny_checkpoints import TinyCheckpoint


def test_quantized_model_folds_its_norms_into_the_gemms(dense_ckpt: TinyCheckpoint,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    llm = ninfer.load(dense_ckpt.path, device="cpu", quantize="int4", progress=False)
    tokens = list(range(3, 9))  # one forward of 6 tokens: decode-sized GEMMs
    ref = llm.score(tokens)
    launches: list[bool] = []
    real = dispatch._launch

    def spy(*args: object) -> None:
        launches.append(len(args) > 6 and args[6] is not None)
        real(*args)

    deferred_norms: list[int] = []
    real_norm = norms.rms_norm

    def norm_spy(*args: object, **kwargs: object) -> tuple:
        deferred_norms.append(1)
        return real_norm(*args, **kwargs)

    monkeypatch.setattr(dispatch, "use_triton", lambda x: True)  # the CUDA path, in the interpreter
    monkeypatch.setattr(dispatch, "_launch", spy)
    monkeypatch.setattr(norms, "rms_norm", norm_spy)  # what materialises a deferred norm
    got = llm.score(tokens)
    layers = llm.model.config.num_hidden_layers
    # each layer's first mixer projection (qkv_proj, in_proj_qkvz) and gate_up_proj; in_proj_ab (bf16) reads
    # the normed x that in_proj_qkvz's GEMM wrote, so no deferred norm runs as a kernel of its own
    assert sum(launches) == 2 * layers and not deferred_norms
    assert len(launches) > sum(launches)  # the others (o_proj, out_proj, down_proj, LM head) have no prologue
    torch.testing.assert_close(got, ref, rtol=1e-3, atol=1e-3)



def test_decode_graph_forward_folds_the_final_norm_into_the_quantized_head(dense_ckpt: TinyCheckpoint,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """``forward(defer_norm=True)`` (what the decode graphs run): the final norm goes to the int8 LM head's GEMM
    prologue, and the logits equal those of the normed hidden states."""
    llm = ninfer.load(dense_ckpt.path, device="cpu", quantize="int4", progress=False)
    runner = llm.runner
    runner.start(8)
    batch = make_batch(input_ids=[5, 6, 7], positions=torch.arange(3).expand(3, 3), seq_lens=[3], context_lens=[3],
                       block_tables=torch.arange(runner.cache.num_pages, dtype=torch.int32)[None],
                       slot_mapping=torch.arange(3), state_slots=[0])
    real = dispatch._launch
    prologue_columns: list[int] = []

    def spy(*args: object) -> None:
        if len(args) > 6 and args[6] is not None:
            prologue_columns.append(args[3].shape[1])
        real(*args)

    monkeypatch.setattr(dispatch, "use_triton", lambda x: True)  # the CUDA path, in the interpreter
    monkeypatch.setattr(dispatch, "_launch", spy)
    logits = []
    for defer in (False, True):
        runner.cache.reset_slot(0)
        prologue_columns.clear()
        logits.append(llm.model.logits(llm.model(batch, runner.cache, defer_norm=defer)))
        assert (logits[-1].shape[-1] in prologue_columns) == defer
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-4, atol=1e-4)
