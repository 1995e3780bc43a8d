"""Which norms a model may defer (``NINFER_DEFERRED_NORM``): a norm is left to its readers only where every
projection that reads its rows normalizes them itself (``reads_deferred_norm``), which the layers declare."""
from __future__ import annotations

import pytest

import ninfer


@pytest.mark.parametrize("quantized", [False, True])
def test_the_layers_declare_their_readers(composite_ckpt, composite_moe_ckpt, quantized: bool) -> None:
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
            # quantized experts (their GEMV / register decode)
            assert layer.mlp.reads_deferred_norm == quantized, (moe, quantized)
