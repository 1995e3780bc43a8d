"""The one-launch attention prologue on the GPU at the 27B / 35B-A3B attention shapes: q and the cached k / v
bit-equal to the two-launch Triton path (q/k norm + RoPE, then the K/V write), other slots untouched."""
from __future__ import annotations

import pytest
import torch

from ninfer.kernels.attention import PagedKV
from ninfer.kernels.attention.prologue import qk_norm_rope_write_kv_triton
from ninfer.kernels.attention.write import write_kv_triton
from ninfer.kernels.rope import qk_norm_rope_triton

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SHAPES = {"27B": (24, 4, 256, 64), "35B-A3B": (16, 2, 256, 64)}  # q heads, kv heads, head_dim, rotary dims
PAGES, PAGE = 40, 64


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("n", [1, 4, 8, 32, 1000])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_prologue_equals_the_two_launches(shape: str, n: int, dtype: torch.dtype) -> None:
    hq, hk, d, rot = SHAPES[shape]
    g = torch.Generator(device="cuda").manual_seed(n)
    qkv = torch.randn(n, (2 * hq + 2 * hk) * d, device="cuda", generator=g).to(dtype)
    q, k, v = qkv.split([2 * hq * d, hk * d, hk * d], dim=-1)
    q, k, v = q.view(n, hq, 2 * d)[..., :d], k.view(n, hk, d), v.view(n, hk, d)
    qw, kw = (0.3 * torch.randn(d, device="cuda", generator=g)).to(dtype), torch.randn(d, device="cuda").to(dtype)
    angle = torch.rand(n, rot, device="cuda", generator=g) * 6.28
    cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
    slots = torch.randperm(PAGES * PAGE, device="cuda", generator=g)[:n]
    caches = []
    for _ in range(2):
        kv = PagedKV.allocate(PAGES, PAGE, hk, d, dtype=dtype, device="cuda")
        kv.k.fill_(float("nan"))
        kv.v.fill_(float("nan"))
        caches.append(kv)
    got_q = qk_norm_rope_write_kv_triton(q, k, v, qw, kw, cos, sin, 1e-6, caches[0], slots)
    want_q, want_k = qk_norm_rope_triton(q, k, qw, kw, cos, sin, 1e-6)
    write_kv_triton(want_k, v, caches[1], slots)
    assert torch.equal(got_q, want_q)
    assert torch.equal(caches[0].k.nan_to_num(7.0), caches[1].k.nan_to_num(7.0))
    assert torch.equal(caches[0].v.nan_to_num(7.0), caches[1].v.nan_to_num(7.0))
