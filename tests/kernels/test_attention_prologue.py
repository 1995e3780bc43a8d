"""The one-launch attention prologue (q/k norm, RoPE, K/V into the paged cache; CPU interpreter) against the
unfused references: ``qk_norm_rope_reference`` then ``write_kv_reference``."""
from __future__ import annotations

import pytest
import torch

from kernel_testing import assert_close, poisoned_outputs  # noqa: F401  (fixture)
from ninfer.kernels.attention import PagedKV, write_kv_reference
from ninfer.kernels.attention.prologue import fits, qk_norm_rope_write_kv, qk_norm_rope_write_kv_triton
from ninfer.kernels.dispatch import INTERPRET
from ninfer.kernels.attention.write import write_kv_triton
from ninfer.kernels.rope import qk_norm_rope_reference, qk_norm_rope_triton

pytestmark = [pytest.mark.skipif(not INTERPRET, reason="Triton launchers on CPU need TRITON_INTERPRET=1"),
              pytest.mark.usefixtures("poisoned_outputs")]

PAGES, PAGE = 6, 4
TOL = {torch.float32: 1e-6, torch.float16: 2e-3}


def _inputs(n: int, hq: int, hk: int, d: int, rot: int, dtype: torch.dtype, seed: int):
    """q, k, v as column views of one projection output (as the model splits it), weights, tables, slots."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(n, (2 * hq + 2 * hk) * d, generator=g).to(dtype)
    q, k, v = qkv.split([2 * hq * d, hk * d, hk * d], dim=-1)
    q = q.view(n, hq, 2 * d)[..., :d]  # the query half of each [query | gate] block
    k, v = k.view(n, hk, d), v.view(n, hk, d)
    qw, kw = 0.3 * torch.randn(d, generator=g).to(dtype), 0.3 * torch.randn(d, generator=g).to(dtype)
    cos, sin = torch.randn(n, rot, generator=g).to(dtype), torch.randn(n, rot, generator=g).to(dtype)
    slots = torch.randperm(PAGES * PAGE, generator=g)[:n]
    return q, k, v, qw, kw, cos, sin, slots


def _cache(hk: int, d: int, dtype: torch.dtype) -> PagedKV:
    kv = PagedKV.allocate(PAGES, PAGE, hk, d, dtype=dtype, device="cpu")
    kv.k.fill_(float("nan"))  # slots nobody writes keep NaN; the two caches must agree everywhere
    kv.v.fill_(float("nan"))
    return kv


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("n", "hq", "hk", "d", "rot"), [(1, 4, 2, 32, 8), (5, 6, 2, 64, 16), (9, 3, 1, 16, 16)])
def test_prologue_matches_norm_rope_then_write(dtype: torch.dtype, n: int, hq: int, hk: int, d: int, rot: int) -> None:
    q, k, v, qw, kw, cos, sin, slots = _inputs(n, hq, hk, d, rot, dtype, seed=n + d)
    got_kv, want_kv, unfused_kv = (_cache(hk, d, dtype) for _ in range(3))
    assert fits(q, cos, got_kv)
    got_q = qk_norm_rope_write_kv_triton(q, k, v, qw, kw, cos, sin, 1e-6, got_kv, slots)
    want_q, want_k = qk_norm_rope_reference(q, k, qw, kw, cos, sin, 1e-6)
    write_kv_reference(want_k, v, want_kv, slots)
    written = torch.zeros(PAGES, PAGE, dtype=torch.bool)
    written.view(-1)[slots] = True
    assert_close(got_q, want_q, TOL[dtype])
    assert_close(got_kv.k[written], want_kv.k[written], TOL[dtype])
    assert torch.equal(got_kv.v[written], want_kv.v[written])  # v is only copied
    assert got_kv.k[~written].isnan().all() and got_kv.v[~written].isnan().all()  # no other slot touched
    # The unfused Triton kernels (the same arithmetic, two launches) give the same bits.
    unfused_q, unfused_k = qk_norm_rope_triton(q, k, qw, kw, cos, sin, 1e-6)
    write_kv_triton(unfused_k, v, unfused_kv, slots)
    assert torch.equal(got_q, unfused_q)
    assert torch.equal(got_kv.k[written], unfused_kv.k[written])


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8", "bf16"])
def test_quantised_or_other_dtype_caches_take_the_two_launches(kv_dtype: str) -> None:
    q, k, v, qw, kw, cos, sin, slots = _inputs(3, 4, 2, 32, 8, torch.float32, seed=1)
    got_kv = PagedKV.allocate(PAGES, PAGE, 2, 32, dtype=torch.float32, device="cpu", kv_dtype=kv_dtype)
    want_kv = PagedKV.allocate(PAGES, PAGE, 2, 32, dtype=torch.float32, device="cpu", kv_dtype=kv_dtype)
    assert not fits(q, cos, got_kv)
    with pytest.raises(ValueError, match="unquantised"):
        qk_norm_rope_write_kv_triton(q, k, v, qw, kw, cos, sin, 1e-6, got_kv, slots)
    got_q = qk_norm_rope_write_kv(q, k, v, qw, kw, cos, sin, 1e-6, got_kv, slots)  # the two-launch path
    want_q, want_k = qk_norm_rope_reference(q, k, qw, kw, cos, sin, 1e-6)
    write_kv_reference(want_k, v, want_kv, slots)
    torch.testing.assert_close(got_q, want_q, rtol=1e-6, atol=1e-6)
    for got, want in ((got_kv.k, want_kv.k), (got_kv.v, want_kv.v)):
        assert torch.equal(got.view(torch.uint8) if got.element_size() == 1 else got,
                           want.view(torch.uint8) if want.element_size() == 1 else want)
