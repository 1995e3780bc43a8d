"""The diagnostic kernel variants of perf/probe_gemv_layout.py in the interpreter (fp16, small shapes): each
computes what the shipped kernel or its own fp64 reference computes, so the GPU numbers they give are of
correct kernels."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "perf"))
import probe_gemv_kernels as probe  # noqa: E402
import probe_gemv_registers as registers  # noqa: E402

from ninfer.kernels.quant_gemm.gemv_mma import launch_gemv_mma  # noqa: E402
from ninfer.kernels.quant_gemm.tune import GemmConfig  # noqa: E402

N, K = 128, 512


@pytest.fixture()
def packed() -> torch.Tensor:
    torch.manual_seed(0)
    return torch.randint(0, 256, (N, K // 2), dtype=torch.uint8)


@pytest.mark.parametrize("tiled", [False, True])
def test_stream_reads_every_word(packed: torch.Tensor, tiled: bool) -> None:
    bn, bkw = 32, 16
    q = probe.to_tiles(packed, bn, bkw * 8).view(torch.int32) if tiled else packed.view(torch.int32)
    out = torch.full((2, N), -1, dtype=torch.int32)
    probe._stream_kernel[(N // bn, 2)](q, out, N, K // 8, K // 16, TILED=tiled, BLOCK_N=bn, BLOCK_KW=bkw, UNROLL=2)
    words = packed.view(torch.int32).view(N, 2, K // 16)
    want = words[:, :, 0]
    for j in range(1, K // 16):
        want = want ^ words[:, :, j]
    assert torch.equal(out, want.t().contiguous())


@pytest.mark.parametrize("swiglu", [False, True])
@pytest.mark.parametrize("variant", ["tiles", "3d-rows", "3d-tiles", "ablate-6"])
def test_variants_match_the_shipped_kernel(packed: torch.Tensor, swiglu: bool, variant: str) -> None:
    n_out = N // 2 if swiglu else N
    scales = torch.rand(N, K // 128, dtype=torch.float16) * 0.01
    x = torch.randn(3, K, dtype=torch.float16)
    cfg = GemmConfig(8, 32, 128, 2, 2, 2, "gemv-mma")
    want = torch.empty(3, n_out, dtype=torch.float16)
    launch_gemv_mma(x, packed, scales, None, want, swiglu, 128, cfg)
    got = torch.full_like(want, float("nan"))
    if variant == "tiles":
        probe.launch_tiles(x, probe.to_tiles(packed, 32, 128), scales, got, swiglu, cfg)
    elif variant.startswith("3d"):
        tiled = variant == "3d-tiles"
        probe.launch_3d(x, probe.to_tiles(packed, 32, 128) if tiled else packed, scales, got, swiglu, cfg, tiled)
    else:
        probe.launch_ablate(x, packed, scales.t().contiguous(), got, swiglu, cfg, 6)
    assert torch.equal(got, want)


@pytest.mark.parametrize("m", [1, 2])
def test_w4a8_matches_its_reference(packed: torch.Tensor, m: int) -> None:
    scales = torch.rand(N, K // 128, dtype=torch.float32) * 0.01
    x = torch.randn(m, K)
    out = torch.full((m, N), float("nan"))
    registers.launch_w4a8(registers.quantize_x(x), packed, scales, out, GemmConfig(m, 32, 256, 2, 4, 1, "w4a8"))
    want = registers.w4a8_reference(packed, scales, x)
    assert ((out.double() - want).abs().max() / want.abs().max()).item() < 1e-6


def test_fragment_layouts_put_each_lanes_operands_in_its_registers() -> None:
    """frag_weights / frag_x against the m16n8k16 fragment map (the kernel itself is PTX: GPU only)."""
    torch.manual_seed(1)
    n, k = 32, 128
    q = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8)
    codes = torch.stack([q & 0xF, q >> 4], -1).view(n, k).int()
    words = registers.frag_weights(q).view(n // 16, k // 64, 32, 4).numpy().astype("int64") & 0xFFFFFFFF
    x = torch.randn(3, k).to(torch.bfloat16)
    xf = registers.frag_x(x)
    for tile in range(n // 16):
        for c in range(k // 64):
            for lane in range(32):
                g, t = divmod(lane, 4)
                for j in range(4):
                    b = [(int(words[tile, c, lane, j]) >> (8 * i)) & 0xFF for i in range(4)]
                    col, r = 64 * c + 16 * j + 2 * t, 16 * tile + g
                    regs = [(b[0] & 15, b[1] & 15), (b[2] & 15, b[3] & 15), (b[0] >> 4, b[1] >> 4), (b[2] >> 4, b[3] >> 4)]
                    want = [(r, col), (r + 8, col), (r, col + 8), (r + 8, col + 8)]
                    assert regs == [(int(codes[rr, cc]), int(codes[rr, cc + 1])) for rr, cc in want]
                    for reg in range(2):
                        pair = xf[c, lane, j, reg:reg + 1].view(torch.bfloat16)
                        ref = x[g, col + 8 * reg:col + 8 * reg + 2] if g < 3 else torch.zeros(2, dtype=torch.bfloat16)
                        assert torch.equal(pair, ref)
