"""Paged-attention kernels in the Triton interpreter against the PyTorch reference.

Every KV format, ragged batches with lengths off the page size, length-1 sequences, prefill chunks
that attend to earlier pages, scattered page tables, split-KV decode, speculative (T > 1)
decode and split-KV prefill (short chunks over long contexts). Unwritten cache slots, unused page-table entries and outputs are poisoned, so a kernel
that reads past a sequence or skips a row fails.
"""
from __future__ import annotations

import threading
from typing import Callable

import pytest
import torch

from ninfer.kernels.attention import (
    KV_DTYPES,
    PagedKV,
    dequantize_kv_reference,
    paged_attention,
    paged_attention_reference,
    paged_attention_triton,
    quantize_kv_reference,
    write_kv_reference,
)
from ninfer.kernels.attention import prefill as attention_prefill
from ninfer.kernels.attention.decode import paged_attention_decode_triton
from ninfer.kernels.attention.split_kv import SPLIT_ALIGN
from ninfer.kernels.attention.prefill import default_prefill_splits, forced_prefill_splits, paged_attention_prefill_triton
from ninfer.kernels.attention.write import write_kv_triton

BAD_PAGE = 10 ** 6  # unused page-table entries: reading one would fault


def _poisoned_cache(num_pages: int, page_size: int, kv_heads: int, head_dim: int, kv_dtype: str,
                    dtype: torch.dtype) -> PagedKV:
    kv = PagedKV.allocate(num_pages, page_size, kv_heads, head_dim, dtype=dtype, device="cpu", kv_dtype=kv_dtype)
    for t in (kv.k, kv.v):
        if t.dtype == torch.int8:
            t.random_(-127, 128)
        else:
            t.view(torch.uint8 if t.element_size() == 1 else torch.int16 if t.element_size() == 2 else torch.int32) \
                .fill_(-1)  # all-ones bits: NaN in every float format
    for s in (kv.k_scale, kv.v_scale):
        if s is not None:
            s.fill_(float("nan"))
    return kv


def _batch(ctx_lens: list[int], new_lens: list[int], page_size: int, kv_heads: int, head_dim: int,
           kv_dtype: str, dtype: torch.dtype = torch.float32,
           writer: Callable[..., None] = write_kv_reference
           ) -> tuple[PagedKV, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A cache holding each sequence's context on scattered pages, and the batch tensors."""
    pages_per_seq = [-(-c // page_size) for c in ctx_lens]
    num_pages = sum(pages_per_seq) + 3
    kv = _poisoned_cache(num_pages, page_size, kv_heads, head_dim, kv_dtype, dtype)
    perm = torch.randperm(num_pages)
    table = torch.full((len(ctx_lens), max(pages_per_seq) + 1), BAD_PAGE, dtype=torch.int32)
    used = 0
    for b, (ctx, n) in enumerate(zip(ctx_lens, pages_per_seq)):
        table[b, :n] = perm[used:used + n].int()
        used += n
        pos = torch.arange(ctx)
        slots = table[b, pos // page_size].long() * page_size + pos % page_size
        k, v = torch.randn(2, ctx, kv_heads, head_dim).to(dtype)
        writer(k, v, kv, slots)
    cu = torch.tensor([0] + new_lens).cumsum(0).int()
    return kv, table, cu, torch.tensor(ctx_lens, dtype=torch.int32)


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def _poisoned_out(q: torch.Tensor) -> torch.Tensor:
    return torch.full_like(q, float("nan"))


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("page_size", [16, 32])
def test_write_kv_matches_reference(kv_dtype: str, page_size: int) -> None:
    torch.manual_seed(0)
    kv_heads, head_dim, n = 2, 128, 40
    k, v = torch.randn(n, kv_heads, head_dim) * 3, torch.randn(n, kv_heads, head_dim)
    k[3] = 0.0  # an all-zero row quantises to zero codes and a zero scale
    slots = torch.randperm(4 * page_size)[:n]
    ours = _poisoned_cache(4, page_size, kv_heads, head_dim, kv_dtype, torch.float32)
    ref = _poisoned_cache(4, page_size, kv_heads, head_dim, kv_dtype, torch.float32)
    ref.k.copy_(ours.k), ref.v.copy_(ours.v)
    write_kv_triton(k, v, ours, slots)
    write_kv_reference(k, v, ref, slots)
    for a, b in ((ours.k, ref.k), (ours.v, ref.v)):
        if kv_dtype == "bf16":  # the interpreter truncates fp32 -> bf16 instead of rounding (§14.1)
            assert torch.allclose(a.float(), b.float(), rtol=2 ** -7, atol=0, equal_nan=True)
        else:
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    if ours.k_scale is not None:
        for a, b in ((ours.k_scale, ref.k_scale), (ours.v_scale, ref.v_scale)):
            assert torch.equal(a.view(torch.int32), b.view(torch.int32))  # bitwise, NaN poison included


@pytest.mark.parametrize("quant, n_groups, rel", [("fp8", 1, 2 ** -4), ("int8", 2, 1 / 254)])
def test_quantization_reference_round_trips(quant: str, n_groups: int, rel: float) -> None:
    torch.manual_seed(1)
    x = torch.randn(50, 3, 128) * torch.logspace(-3, 3, 50)[:, None, None]
    codes, scales = quantize_kv_reference(x, quant, n_groups)
    assert scales.shape == (50, 3, n_groups)
    back = dequantize_kv_reference(codes, scales)
    amax = x.unflatten(-1, (n_groups, -1)).abs().amax(-1, keepdim=True)
    err = (back - x).unflatten(-1, (n_groups, -1)).abs()
    if quant == "fp8":  # relative to each value, above e4m3's subnormal range
        assert (err <= rel * x.unflatten(-1, (n_groups, -1)).abs() + amax * 2 ** -16).all()
    else:
        assert (err <= rel * amax * 1.0001).all()


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("page_size, heads, kv_heads, head_dim", [(16, 4, 2, 64), (32, 6, 1, 32)])
def test_prefill_matches_reference(kv_dtype: str, page_size: int, heads: int, kv_heads: int, head_dim: int) -> None:
    torch.manual_seed(2)
    # Whole prompt, a length-1 prompt, a later chunk over earlier pages, a 1-token chunk (decode-like).
    ctx_lens, new_lens = [37, 1, 100, 50], [37, 1, 70, 1]
    kv, table, cu, ctx = _batch(ctx_lens, new_lens, page_size, kv_heads, head_dim, kv_dtype)
    q = torch.randn(sum(new_lens), heads, head_dim)
    out = paged_attention_prefill_triton(q, kv, table, cu, ctx, head_dim ** -0.5, max(new_lens), out=_poisoned_out(q))
    ref = paged_attention_reference(q, kv, table, cu, ctx, head_dim ** -0.5)
    assert _rel_err(out, ref) < 1e-5


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("num_splits", [1, 2, 3, 5])
@pytest.mark.parametrize("gated", [False, True])
def test_split_prefill_matches_reference(kv_dtype: str, num_splits: int, gated: bool) -> None:
    """Split-KV prefill: rows whose query precedes a whole split (and blocks wholly before one) get
    weight 0 there; contexts split into 1 to 5 ranges; the merge applies the gate. One split runs the
    unsplit kernel (its own loop bounds and early exit) on the same short chunks over long pasts."""
    torch.manual_seed(8)
    heads, kv_heads, head_dim, page_size = 2, 1, 32, 16  # few programs: the interpreter is slow
    # A length-1 prompt, a chunk longer than its past, short chunks over longer pasts (300 keys: five
    # 64-key splits of five), a 1-token chunk; no context a multiple of the page size or SPLIT_ALIGN.
    ctx_lens, new_lens = [1, 70, 300, 91, 200], [1, 40, 20, 1, 24]
    assert all(c % page_size and c % SPLIT_ALIGN.value for c in ctx_lens[1:])
    kv, table, cu, ctx = _batch(ctx_lens, new_lens, page_size, kv_heads, head_dim, kv_dtype)
    n = sum(new_lens)
    q = torch.randn(n, heads, head_dim)
    gate = torch.randn(n, heads, 2 * head_dim)[..., head_dim:] if gated else None
    out = paged_attention_prefill_triton(q, kv, table, cu, ctx, head_dim ** -0.5, max(new_lens), gate=gate,
                                         num_splits=num_splits, out=_poisoned_out(q))
    ref = paged_attention_reference(q, kv, table, cu, ctx, head_dim ** -0.5)
    assert _rel_err(out, ref if gate is None else ref * torch.sigmoid(gate)) < 1e-5


def test_default_prefill_splits(monkeypatch: pytest.MonkeyPatch) -> None:
    """27B heads on a 132-SM GPU: a 100-token chunk (48 programs) splits, also beside decode rows (the
    launch's batch does not count), a 4096-token one does not; the default choice runs split in the
    interpreter when the SM count says so."""
    monkeypatch.setattr(attention_prefill, "sm_count", lambda device: 132)
    cpu = torch.device("cpu")
    assert default_prefill_splits(cpu, 24, 100) == 6 and default_prefill_splits(cpu, 24, 128) == 6
    assert default_prefill_splits(cpu, 24, 4096) == 1 and default_prefill_splits(cpu, 24, 1024) == 1
    torch.manual_seed(9)
    heads, kv_heads, head_dim = 4, 2, 32
    ctx_lens, new_lens = [1000, 7], [20, 7]
    assert default_prefill_splits(cpu, heads, 20) > 1
    kv, table, cu, ctx = _batch(ctx_lens, new_lens, 32, kv_heads, head_dim, "auto")
    q = torch.randn(sum(new_lens), heads, head_dim)
    out = paged_attention_prefill_triton(q, kv, table, cu, ctx, 0.3, 20, out=_poisoned_out(q))
    assert _rel_err(out, paged_attention_reference(q, kv, table, cu, ctx, 0.3)) < 1e-5


def test_forced_prefill_splits_override_the_default_and_restore_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's warm-up runs short chunks unsplit too (forced_prefill_splits(1)): inside the context the
    launcher takes the forced count (an assert on the count seen by the launch), after it the default again."""
    monkeypatch.setattr(attention_prefill, "sm_count", lambda device: 132)
    seen = []
    real = attention_prefill._prefill_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                seen.append(kwargs["SPLIT"])
                return real[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(attention_prefill, "_prefill_kernel", Spy())
    torch.manual_seed(4)
    kv, table, cu, ctx = _batch([300], [20], 32, 2, 32, "auto")
    q = torch.randn(20, 4, 32)
    ref = paged_attention_reference(q, kv, table, cu, ctx, 0.3)
    with forced_prefill_splits(1):
        inside = paged_attention_prefill_triton(q, kv, table, cu, ctx, 0.3, 20, out=_poisoned_out(q))
        # another thread meanwhile: the override holds only where it was set
        other = threading.Thread(target=paged_attention_prefill_triton, args=(q, kv, table, cu, ctx, 0.3, 20))
        other.start()
        other.join()
    after = paged_attention_prefill_triton(q, kv, table, cu, ctx, 0.3, 20, out=_poisoned_out(q))
    assert seen == [False, True, True]
    assert _rel_err(inside, ref) < 1e-5 and _rel_err(after, ref) < 1e-5
    with pytest.raises(ValueError, match="splits >= 1"), forced_prefill_splits(0):
        pass


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_matches_reference(kv_dtype: str, num_splits: int) -> None:
    torch.manual_seed(3)
    heads, kv_heads, head_dim, page_size = 6, 1, 64, 16
    ctx_lens = [1, 33, 300, 77, 130]
    kv, table, cu, ctx = _batch(ctx_lens, [1] * 5, page_size, kv_heads, head_dim, kv_dtype)
    q = torch.randn(5, heads, head_dim)
    out = paged_attention_decode_triton(q, kv, table, cu, ctx, head_dim ** -0.5, 1, num_splits=num_splits,
                                        out=_poisoned_out(q))
    ref = paged_attention_reference(q, kv, table, cu, ctx, head_dim ** -0.5)
    assert _rel_err(out, ref) < 1e-5


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_speculative_decode_matches_reference(kv_dtype: str, num_splits: int) -> None:
    """Up to 8 new tokens per sequence (verification of drafts): causal among themselves."""
    torch.manual_seed(4)
    heads, kv_heads, head_dim, page_size = 4, 2, 32, 32
    ctx_lens, new_lens = [8, 45, 200, 3], [8, 1, 5, 3]
    kv, table, cu, ctx = _batch(ctx_lens, new_lens, page_size, kv_heads, head_dim, kv_dtype)
    q = torch.randn(sum(new_lens), heads, head_dim)
    out = paged_attention_decode_triton(q, kv, table, cu, ctx, head_dim ** -0.5, 8, num_splits=num_splits,
                                        out=_poisoned_out(q))
    ref = paged_attention_reference(q, kv, table, cu, ctx, head_dim ** -0.5)
    assert _rel_err(out, ref) < 1e-5


@pytest.mark.parametrize("max_seqlen, num_splits", [(1, 1), (1, 4), (40, None)])
def test_fused_gate_matches_reference(max_seqlen: int, num_splits: int | None) -> None:
    torch.manual_seed(5)
    heads, kv_heads, head_dim = 4, 2, 64
    new_lens = [max_seqlen, 1]
    kv, table, cu, ctx = _batch([max_seqlen + 150, 90], new_lens, 16, kv_heads, head_dim, "fp8")
    n = sum(new_lens)
    q = torch.randn(n, heads, head_dim)
    gate = torch.randn(n, heads, 2 * head_dim)[..., head_dim:]  # strided, as split from q_proj's output
    if num_splits is None:
        out = paged_attention_prefill_triton(q, kv, table, cu, ctx, 0.125, max_seqlen, gate=gate, out=_poisoned_out(q))
    else:
        out = paged_attention_decode_triton(q, kv, table, cu, ctx, 0.125, max_seqlen, gate=gate,
                                            num_splits=num_splits, out=_poisoned_out(q))
    ref = paged_attention_reference(q, kv, table, cu, ctx, 0.125) * torch.sigmoid(gate)
    assert _rel_err(out, ref) < 1e-5
    assert torch.equal(paged_attention(q, kv, table, cu, ctx, 0.125, max_seqlen, gate=gate), ref)


def test_fp16_prefill_and_decode() -> None:
    torch.manual_seed(6)
    heads, kv_heads, head_dim = 4, 2, 64
    new_lens = [30, 1, 9]
    kv, table, cu, ctx = _batch([30, 70, 90], new_lens, 16, kv_heads, head_dim, "auto", torch.float16)
    q = torch.randn(sum(new_lens), heads, head_dim, dtype=torch.float16)
    ref = paged_attention_reference(q.float(), kv, table, cu, ctx, head_dim ** -0.5)
    out = paged_attention_prefill_triton(q, kv, table, cu, ctx, head_dim ** -0.5, 30, out=_poisoned_out(q))
    assert out.dtype == torch.float16 and _rel_err(out, ref) < 2e-3
    q1, cu1 = q[:3], torch.arange(4, dtype=torch.int32)
    out = paged_attention_decode_triton(q1, kv, table, cu1, ctx, head_dim ** -0.5, 1, num_splits=2,
                                        out=_poisoned_out(q1))
    assert _rel_err(out, paged_attention_reference(q1.float(), kv, table, cu1, ctx, head_dim ** -0.5)) < 2e-3


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_kernel_written_cache_and_dispatch(kv_dtype: str) -> None:
    """Cache filled by the write kernel; the dispatcher's decode and prefill paths agree with the reference."""
    torch.manual_seed(7)
    heads, kv_heads, head_dim = 4, 2, 64
    new_lens = [3, 1]
    kv, table, cu, ctx = _batch([20, 81], new_lens, 16, kv_heads, head_dim, kv_dtype, writer=write_kv_triton)
    q = torch.randn(4, heads, head_dim)
    ref = paged_attention_reference(q, kv, table, cu, ctx, 0.2)
    decode = paged_attention_triton(q, kv, table, cu, ctx, 0.2, 3)
    prefill = paged_attention_triton(q, kv, table, cu, ctx, 0.2, None)
    assert _rel_err(decode, ref) < 1e-5 and _rel_err(prefill, ref) < 1e-5
    assert torch.equal(paged_attention(q, kv, table, cu, ctx, 0.2, 3), ref)  # CPU tensors take the reference
