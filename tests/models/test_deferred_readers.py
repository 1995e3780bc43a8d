"""Which norms a model may defer (``NINFER_DEFERRED_NORM``): a norm is left to its readers only where every
projection that reads its rows normalizes them itself (``reads_deferred_norm``), which the layers declare; a MoE block
only where ``NINFER_DEFERRED_NORM_MOE=1`` asks, and nothing with ``NINFER_DEFERRED_NORM=0``."""
from __future__ import annotations

import pytest

import ninfer
from ninfer.kernels.dispatch import deferred_norm


@pytest.mark.parametrize("moe_defers", [False, True])
@pytest.mark.parametrize("quantized", [False, True])
def test_the_layers_declare_their_readers(composite_ckpt, composite_moe_ckpt, quantized: bool, moe_defers: bool,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NINFER_DEFERRED_NORM_MOE", "1" if moe_defers else "0")
    # the tiny MoE's 32-wide experts take nvfp4's 16-column groups
    for ckpt, moe, recipe in ((composite_ckpt, False, "int4"), (composite_moe_ckpt, True, "nvfp4")):
        model = ninfer.load(ckpt.path, device="cpu", progress=False,
                            quantize=recipe if quantized else None).engine.runner.model
        for layer in model.layers:
            mixer = layer.self_attn if layer.is_attention else layer.linear_attn
            # quantized q/k/v(/z) GEMMs and the float a/b gates' GEMV read deferred rows; float q/k/v (our Linear,
            # the float GEMV at decode sizes) too
            assert mixer.reads_deferred_norm and layer.reads_deferred_norm
            # the dense MLP's gate/up: a quantized GEMM does, a float GateUpLinear does not; a MoE block: only with
            # quantized experts (their GEMV / register decode), and only when asked
            assert layer.mlp.reads_deferred_norm == (quantized and (moe_defers or not moe)), (moe, quantized)


def test_the_switches_turn_it_off_and_name_themselves(composite_moe_ckpt, monkeypatch: pytest.MonkeyPatch) -> None:
    model = ninfer.load(composite_moe_ckpt.path, device="cpu", progress=False, quantize="nvfp4").engine.runner.model
    monkeypatch.setenv("NINFER_DEFERRED_NORM_MOE", "1")
    assert all(layer.mlp.reads_deferred_norm for layer in model.layers)
    monkeypatch.setenv("NINFER_DEFERRED_NORM", "0")  # off everywhere, the MoE blocks too
    assert not any(layer.mlp.reads_deferred_norm for layer in model.layers)
    assert not deferred_norm()
    monkeypatch.setenv("NINFER_DEFERRED_NORM", "maybe")
    with pytest.raises(ValueError, match="NINFER_DEFERRED_NORM='maybe'"):
        deferred_norm()
