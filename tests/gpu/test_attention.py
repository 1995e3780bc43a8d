"""Paged-attention kernels on the GPU at the 27B shapes (24 q heads : 4 KV heads, head dim 256,
page 64) against the fp32 reference: every KV format, ragged prefill with earlier context, split-KV
prefill of a short chunk over a 64k context, split decode, speculative decode, the fused gate, and
replay inside a CUDA graph."""
from __future__ import annotations

import pytest
import torch

from ninfer.kernels.attention import (
    KV_DTYPES,
    PagedKV,
    dequantize_kv_reference,
    paged_attention,
    paged_attention_reference,
    write_kv,
    write_kv_reference,
)
from ninfer.kernels.attention.decode import paged_attention_decode_triton
from ninfer.kernels.attention.prefill import paged_attention_prefill_triton
from ninfer.kernels.attention.write import write_kv_triton

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

HEADS, KV_HEADS, HEAD_DIM, PAGE = 24, 4, 256, 64
SCALE = HEAD_DIM ** -0.5


def _batch(ctx_lens: list[int], new_lens: list[int], kv_dtype: str,
           dtype: torch.dtype = torch.bfloat16) -> tuple[PagedKV, torch.Tensor, torch.Tensor, torch.Tensor]:
    pages_per_seq = [-(-c // PAGE) for c in ctx_lens]
    num_pages = sum(pages_per_seq) + 5
    kv = PagedKV.allocate(num_pages, PAGE, KV_HEADS, HEAD_DIM, dtype=dtype, device="cuda", kv_dtype=kv_dtype)
    perm = torch.randperm(num_pages, device="cuda")
    table = torch.zeros((len(ctx_lens), max(pages_per_seq)), dtype=torch.int32, device="cuda")
    used = 0
    for b, (ctx, n) in enumerate(zip(ctx_lens, pages_per_seq)):
        table[b, :n] = perm[used:used + n].int()
        used += n
        pos = torch.arange(ctx, device="cuda")
        slots = table[b, pos // PAGE].long() * PAGE + pos % PAGE
        k = torch.randn(ctx, KV_HEADS, HEAD_DIM, device="cuda", dtype=dtype)
        write_kv(k, torch.randn_like(k), kv, slots)
    cu = torch.tensor([0] + new_lens, device="cuda").cumsum(0).int()
    return kv, table, cu, torch.tensor(ctx_lens, dtype=torch.int32, device="cuda")


def _check(out: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    assert torch.isfinite(out).all()
    diff = out.float() - ref.float()
    assert (diff.norm() / ref.float().norm()).item() < tol
    assert (diff.abs().max() / ref.float().abs().max()).item() < 4 * tol


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_write_kv(kv_dtype: str) -> None:
    torch.manual_seed(0)
    n = 1000
    k = torch.randn(n, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16) * 4
    v = torch.randn_like(k)
    slots = torch.randperm(40 * PAGE, device="cuda")[:n]
    ours = PagedKV.allocate(40, PAGE, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda", kv_dtype=kv_dtype)
    ref = PagedKV.allocate(40, PAGE, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda", kv_dtype=kv_dtype)
    write_kv_triton(k, v, ours, slots)
    write_kv_reference(k, v, ref, slots)
    if ours.quant is None:
        assert torch.equal(ours.k, ref.k) and torch.equal(ours.v, ref.v)
        return
    for codes, scales, ref_codes, ref_scales in ((ours.k, ours.k_scale, ref.k, ref.k_scale),
                                                 (ours.v, ours.v_scale, ref.v, ref.v_scale)):
        assert torch.allclose(scales, ref_scales, rtol=1e-6, atol=0)
        # Codes are computed op for op like the reference; allow a rare last-bit tie difference.
        same = (codes.view(torch.uint8) == ref_codes.view(torch.uint8)).float().mean().item()
        assert same > 0.9999, same
        deq, ref_deq = dequantize_kv_reference(codes, scales), dequantize_kv_reference(ref_codes, ref_scales)
        step = scales.repeat_interleave(HEAD_DIM // scales.shape[-1], -1) * (32 if ours.quant == "fp8" else 1)
        assert ((deq - ref_deq).abs() <= step * 1.001).all()


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_prefill_ragged_with_context(kv_dtype: str) -> None:
    torch.manual_seed(1)
    # A 1-token prompt, a short prompt, a chunk over 1000 earlier tokens, a long prompt, a decode row.
    ctx_lens, new_lens = [1, 100, 1537, 3000, 700], [1, 100, 537, 3000, 1]
    kv, table, cu, ctx = _batch(ctx_lens, new_lens, kv_dtype)
    q = torch.randn(sum(new_lens), HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    out = paged_attention(q, kv, table, cu, ctx, SCALE, max(new_lens))
    _check(out, paged_attention_reference(q.float(), kv, table, cu, ctx, SCALE), 1e-2)


@pytest.mark.parametrize("ragged", [False, True])
@pytest.mark.parametrize("num_splits", [None, 1, 5, 64])
def test_prefill_chunk_over_long_context(ragged: bool, num_splits: int | None) -> None:
    """A 100-token turn over 65,536 cached tokens (split-KV's case: 24-48 programs unsplit), alone and
    in a ragged batch (64-token chunk over 64k, a 1-token prompt, a chunk over 3k, a chunk longer than
    its past); default splits (> 1 on any GPU of more than 96 SMs), unsplit, forced; gated and plain."""
    torch.manual_seed(7)
    if ragged:
        ctx_lens, new_lens = [65536 + 64, 1, 3001, 100], [64, 1, 50, 64]
    else:
        ctx_lens, new_lens = [65536 + 100], [100]
    kv, table, cu, ctx = _batch(ctx_lens, new_lens, "bf16")
    n = sum(new_lens)
    qg = torch.randn(n, HEADS, 2 * HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    q, gate = qg[..., :HEAD_DIM].contiguous(), qg[..., HEAD_DIM:]
    plain, gated = (paged_attention_prefill_triton(q, kv, table, cu, ctx, SCALE, max(new_lens), gate=g,
                                                   num_splits=num_splits) for g in (None, gate))
    ref = paged_attention_reference(q.float(), kv, table, cu, ctx, SCALE)
    _check(plain, ref, 1e-2)
    _check(gated, ref * torch.sigmoid(gate.float()), 1e-2)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("num_splits", [None, 1, 64])
def test_decode_batch(kv_dtype: str, num_splits: int | None) -> None:
    torch.manual_seed(2)
    ctx_lens = [1, 63, 64, 65, 1000, 4097, 9000, 20000]
    kv, table, cu, ctx = _batch(ctx_lens, [1] * 8, kv_dtype)
    q = torch.randn(8, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    out = paged_attention_decode_triton(q, kv, table, cu, ctx, SCALE, 1, num_splits=num_splits)
    _check(out, paged_attention_reference(q.float(), kv, table, cu, ctx, SCALE), 1e-2)


@pytest.mark.parametrize("ctx_len", [100, 20000])
def test_decode_batch_one(ctx_len: int) -> None:
    """Batch 1 takes the other measured tile config on the H200 (64-key tiles; see ``measured_config``)."""
    torch.manual_seed(4)
    kv, table, cu, ctx = _batch([ctx_len], [1], "bf16")
    q = torch.randn(1, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    out = paged_attention_decode_triton(q, kv, table, cu, ctx, SCALE, 1)
    _check(out, paged_attention_reference(q.float(), kv, table, cu, ctx, SCALE), 1e-2)


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8"])
def test_speculative_decode(kv_dtype: str) -> None:
    torch.manual_seed(3)
    ctx_lens, new_lens = [8, 300, 5000, 4], [8, 1, 5, 4]
    kv, table, cu, ctx = _batch(ctx_lens, new_lens, kv_dtype)
    q = torch.randn(sum(new_lens), HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    out = paged_attention(q, kv, table, cu, ctx, SCALE, 8)
    _check(out, paged_attention_reference(q.float(), kv, table, cu, ctx, SCALE), 1e-2)


@pytest.mark.parametrize("max_seqlen", [1, 300])
def test_fp32(max_seqlen: int) -> None:
    torch.manual_seed(4)
    ctx_lens, new_lens = [max_seqlen + 400, 50], [max_seqlen, 1]
    kv, table, cu, ctx = _batch(ctx_lens, new_lens, "auto", torch.float32)
    q = torch.randn(sum(new_lens), HEADS, HEAD_DIM, device="cuda")
    out = paged_attention(q, kv, table, cu, ctx, SCALE, max_seqlen)
    _check(out, paged_attention_reference(q, kv, table, cu, ctx, SCALE), 1e-5)


@pytest.mark.parametrize("max_seqlen, num_splits", [(1, 1), (1, 16), (200, None)])
def test_fused_gate_matches_unfused(max_seqlen: int, num_splits: int | None) -> None:
    """``gate=`` equals the model's ``o * torch.sigmoid(gate)`` in bf16 up to rare last-bit exp differences."""
    torch.manual_seed(5)
    new_lens = [max_seqlen, 1, 1]
    kv, table, cu, ctx = _batch([max_seqlen + 2000, 70, 3000], new_lens, "bf16")
    n = sum(new_lens)
    qg = torch.randn(n, HEADS, 2 * HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    q, gate = qg[..., :HEAD_DIM].contiguous(), qg[..., HEAD_DIM:]
    if num_splits is None:
        plain, gated = (paged_attention(q, kv, table, cu, ctx, SCALE, max_seqlen, gate=g) for g in (None, gate))
    else:
        plain, gated = (paged_attention_decode_triton(q, kv, table, cu, ctx, SCALE, 1, gate=g, num_splits=num_splits)
                        for g in (None, gate))
    expect = plain * torch.sigmoid(gate)
    assert (gated != expect).float().mean().item() < 1e-3
    assert ((gated.float() - expect.float()).abs() <= expect.float().abs() * 2 ** -7).all()


def test_decode_replays_in_cuda_graph() -> None:
    """No host syncs: a captured decode step follows context lengths changed in place."""
    torch.manual_seed(6)
    kv, table, cu, ctx = _batch([5000, 30, 900], [1, 1, 1], "int8")
    q = torch.randn(3, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    k_new = torch.randn(3, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    slots = torch.zeros(3, dtype=torch.long, device="cuda")

    def step() -> torch.Tensor:
        write_kv(k_new, k_new, kv, slots)
        return paged_attention(q, kv, table, cu, ctx, SCALE, 1)

    ctx -= 1  # the step appends the last token of each context
    pos = ctx.long()
    slots.copy_(table[torch.arange(3, device="cuda"), pos // PAGE].long() * PAGE + pos % PAGE)
    ctx += 1
    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for _ in range(2):
        pos = ctx.long()  # grow every sequence by one token and replay
        slots.copy_(table[torch.arange(3, device="cuda"), pos // PAGE].long() * PAGE + pos % PAGE)
        ctx += 1
        graph.replay()
        torch.cuda.synchronize()
        _check(out, paged_attention_reference(q.float(), kv, table, cu, ctx, SCALE), 1e-2)
