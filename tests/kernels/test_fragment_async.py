"""The register decode with its codes copied into shared memory by the loop's software pipeline (``num_stages >= 3``,
``NINFER_FRAG_ASYNC=1`` adds such configs to the tuner's candidates): in the interpreter, whose body gathers its
own codes, the loop and its splits against the reference; the plain loads that the pipeline turns into
``cp.async`` (:func:`~ninfer.kernels.quant_gemm.fragment_steps.load_trip_async`) give a lane the words its PTX
decode takes, in order. The GPU tests (``tests/gpu/test_quant_fragments_gpu.py`` with the switch on) check the
PTX path of every candidate."""
from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from kernel_testing import check_fragment_decode as _check
from kernel_testing import frag_config

from ninfer.kernels.quant_gemm.fragment_configs import (
    ASYNC_STAGES,
    fragment_async_candidates,
    fragment_candidates,
)
from ninfer.kernels.quant_gemm.fragment_steps import load_trip_async
from ninfer.kernels.quant_gemm.fragments import to_fragments, words
from ninfer.quant.formats import quantize


@pytest.mark.parametrize("stages", ASYNC_STAGES)
@pytest.mark.parametrize("fmt", ["int4-g64", "int4-g128", "int8-g64"])
def test_pipelined_decode_matches_the_reference(fmt: str, stages: int) -> None:
    """Splits of several trips, of one and of unequal length (fewer trips than the pipeline's depth), SwiGLU,
    a residual, two token blocks."""
    _check(fmt, 3, 48, 512, frag_config(8, 2, 2, 1, stages), residual=True, seed=stages)
    _check(fmt, 5, 64, 768, frag_config(8, 1, 2, 2, stages), swiglu=True, seed=stages + 1)
    _check(fmt, 11, 32, 384, frag_config(8, 1, 2, 3, stages), residual=True, seed=stages + 2)


@triton.jit
def _trip_words_kernel(q_ptr, out_ptr, KC, c, UNROLL: tl.constexpr, BITS: tl.constexpr, WORDS: tl.constexpr):
    """Each lane of one warp per tile: the words ``load_trip_async`` gives it for the trip at chunk ``c``."""
    e = tl.arange(0, 32)
    tile = tl.program_id(0)
    code_words = q_ptr + tile.to(tl.int64) * KC * (32 * BITS) + e * 4
    codes = load_trip_async(code_words, q_ptr, c, UNROLL, BITS, False)
    for u in tl.static_range(UNROLL):
        for j in tl.static_range(WORDS):
            tl.store(out_ptr + ((tile * 32 + e) * UNROLL + u) * WORDS + j, codes[u][j])


@pytest.mark.parametrize("fmt", ["int4-g64", "int8-g64"])
def test_a_lane_gets_its_chunks_words_in_order(fmt: str) -> None:
    """Lane ``l`` of tile ``t``, chunk ``c``: int4 words ``(t * KC + c) * 128 + 4 l + j``; int8 the same four then
    four more 512 bytes on (the PTX path's two 16-byte loads)."""
    n, k, c, unroll = 32, 512, 2, 2
    w = quantize(torch.randn(n, k, generator=torch.Generator().manual_seed(3)), fmt)
    q, _ = to_fragments(w.tensors["qweight"], w.tensors["scales"])
    bits = 8 if fmt.startswith("int8") else 4
    kc, n_words = k // 64, bits  # words a lane holds of a chunk: 4 for int4, 8 for int8
    flat = words(q)
    out = torch.zeros(n // 16, 32, unroll, n_words, dtype=torch.int32)
    _trip_words_kernel[(n // 16,)](flat, out, kc, c, UNROLL=unroll, BITS=bits, WORDS=n_words)
    for tile in range(n // 16):
        for lane in range(32):
            for u in range(unroll):
                base = (tile * kc + c + u) * 32 * bits + 4 * lane
                want = [flat[base + j].item() for j in range(4)]
                if bits == 8:
                    want += [flat[base + 128 + j].item() for j in range(4)]
                assert out[tile, lane, u].tolist() == want, (tile, lane, u)


def test_the_switch_adds_the_pipelined_configs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Off, no candidate copies its codes ahead; on, the pipelined ones follow the register decode's (its favourite
    stays first), every one of them 2 or 4 chunks a trip."""
    monkeypatch.delenv("NINFER_FRAG_ASYNC", raising=False)
    plain = fragment_candidates("int4-g64", 1, 17408, 5120, 132, swiglu=True)
    assert all(c.num_stages < 3 for c in plain)
    monkeypatch.setenv("NINFER_FRAG_ASYNC", "1")
    both = fragment_candidates("int4-g64", 1, 17408, 5120, 132, swiglu=True)
    pipelined = fragment_async_candidates("int4-g64", 1, 17408, 5120, 132)
    assert both == plain + pipelined and both[0] == plain[0]
    assert pipelined and {c.num_stages for c in pipelined} == set(ASYNC_STAGES)
    assert all(c.block_k in (128, 256) and c.kind == "frag" for c in pipelined)
