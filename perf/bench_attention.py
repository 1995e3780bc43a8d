"""Paged attention at the 27B shapes (24 q heads, 4 KV heads, head dim 256, page 64).

* prefill: one causal sequence of 8k / 32k tokens; FLOP rate (QK and PV of the causal half) vs
  the bf16 matmul peak; baseline torch SDPA (flash backend) on contiguous q/k/v with the same GQA.
* decode: batch 1 and 8 at contexts 8k / 32k / 128k, KV bf16 / fp8 / int8; bandwidth on the KV
  bytes read (codes and scales) vs the copy bandwidth; CUDA-graph replay, rotating caches so L2
  cannot hold them; baseline torch SDPA (default backend) over contiguous bf16 K/V, one query.
* prefill chunk over long context: B=1, 100 new tokens after 8k / 32k / 128k cached tokens (a short
  turn continuing a conversation restored from the prefix cache), KV bf16; the default launcher
  (split-KV) against the unsplit kernel (``num_splits=1``) in the same run; bandwidth on the KV bytes
  read vs the copy bandwidth, as for decode (the record also carries the FLOP rate: at 100 query rows
  per KV head the ideal kernel is compute-bound, ~600 FLOP per KV byte); CUDA-graph replay, rotating
  caches.
* write_kv: 8k tokens appended, bytes read + written vs the copy bandwidth; baseline the PyTorch
  reference (index_put).

Run: ``python perf/bench_attention.py`` (records to ``$OUT/perf.jsonl``).
"""
from __future__ import annotations

import itertools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from perf.common import bench_graph_ms, bench_ms, copy_bandwidth_tbps, matmul_peak_tflops, record  # noqa: E402
from ninfer.kernels.attention import PagedKV, paged_attention, write_kv, write_kv_reference  # noqa: E402
from ninfer.kernels.attention.prefill import default_prefill_splits, paged_attention_prefill_triton  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, PAGE = 24, 4, 256, 64
SCALE = HEAD_DIM ** -0.5
L2_BYTES = 60e6


def random_cache(tokens: int, kv_dtype: str) -> PagedKV:
    """A cache of ``tokens`` slots with random (finite) contents in any format."""
    kv = PagedKV.allocate(tokens // PAGE, PAGE, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda",
                          kv_dtype=kv_dtype)
    for codes in (kv.k, kv.v):
        if kv.quant == "fp8":
            codes.view(torch.uint8).random_(0, 0x7F)  # below 0x7F: never the NaN code
        elif kv.quant == "int8":
            codes.random_(-127, 128)
        else:
            codes.normal_()
    for scales in (kv.k_scale, kv.v_scale):
        if scales is not None:
            scales.uniform_(1e-3, 1e-2)
    return kv


def kv_bytes(kv: PagedKV, tokens: int) -> int:
    per_token = kv.k[0, 0].numel() * kv.k.element_size()
    if kv.k_scale is not None:
        per_token += kv.k_scale[0, 0].numel() * 4
    return 2 * tokens * per_token


def sdpa_flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[str, object]:
    """Causal SDPA on the flash backend with GQA, or with repeated K/V heads if the backend refuses GQA."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def gqa() -> torch.Tensor:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=SCALE, enable_gqa=True)

    try:
        gqa()
        return "torch SDPA flash (enable_gqa)", gqa
    except RuntimeError as err:
        print(f"flash SDPA with enable_gqa failed ({err}); repeating K/V heads", flush=True)
    group = HEADS // KV_HEADS
    k_rep, v_rep = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)

    def repeated() -> torch.Tensor:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k_rep, v_rep, is_causal=True, scale=SCALE)

    repeated()
    return "torch SDPA flash (repeated K/V)", repeated


def prefill_inputs(seqlen: int) -> tuple[PagedKV, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One causal sequence of ``seqlen`` new tokens: its cache (bf16, shuffled pages), page table, queries,
    cu_seqlens and context lengths."""
    kv = random_cache(seqlen, "bf16")
    table = torch.randperm(seqlen // PAGE, device="cuda", dtype=torch.int32)[None]
    q = torch.randn(seqlen, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    cu = torch.tensor([0, seqlen], device="cuda", dtype=torch.int32)
    ctx = torch.tensor([seqlen], device="cuda", dtype=torch.int32)
    return kv, table, q, cu, ctx


def bench_prefill(peak: float) -> None:
    for seqlen in (8192, 32768):
        kv, table, q, cu, ctx = prefill_inputs(seqlen)
        ms = bench_ms(lambda: paged_attention(q, kv, table, cu, ctx, SCALE, seqlen), warmup=10, rep=200)
        # The baseline sees the same keys, contiguous: [1, heads, S, D].
        pos = torch.arange(seqlen, device="cuda")
        k_flat = kv.k[table[0, pos // PAGE].long(), pos % PAGE]
        v_flat = kv.v[table[0, pos // PAGE].long(), pos % PAGE]
        qb, kb, vb = (x.transpose(0, 1).unsqueeze(0).contiguous() for x in (q, k_flat, v_flat))
        name, fn = sdpa_flash(qb, kb, vb)
        base_ms = bench_ms(fn, warmup=10, rep=200)
        flops = 4 * HEADS * HEAD_DIM * seqlen * (seqlen + 1) / 2
        record("attention_prefill", f"S={seqlen} h=24/4 d=256 causal", ms, achieved=flops / ms / 1e9, limit=peak,
               unit="TFLOP/s", baseline=name, baseline_ms=base_ms, kv_dtype="bf16")
        del kv, q, k_flat, v_flat, qb, kb, vb, fn
        torch.cuda.empty_cache()


def bench_prefill_chunk(bandwidth: float, peak: float, new: int = 100) -> None:
    for past in (8192, 32768, 131072):
        ctx_len = past + new
        tokens = triton.cdiv(ctx_len, PAGE) * PAGE
        q = torch.randn(new, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        cu = torch.tensor([0, new], device="cuda", dtype=torch.int32)
        ctx = torch.tensor([ctx_len], device="cuda", dtype=torch.int32)
        nbytes = kv_bytes(random_cache(PAGE, "bf16"), ctx_len)
        copies = max(1, min(8, int(4 * L2_BYTES // nbytes) + 1))
        caches = [random_cache(tokens, "bf16") for _ in range(copies)]
        tables = [torch.randperm(tokens // PAGE, device="cuda", dtype=torch.int32)[None] for _ in range(copies)]

        def timed(num_splits: int | None) -> float:
            turn = itertools.cycle(range(copies))

            def step() -> torch.Tensor:
                i = next(turn)
                return paged_attention_prefill_triton(q, caches[i], tables[i], cu, ctx, SCALE, new,
                                                      num_splits=num_splits)

            return bench_graph_ms(step, inner=max(copies, 4 // copies * copies))

        base_ms, ms = timed(1), timed(None)
        flops = 4 * HEADS * HEAD_DIM * new * (past + (new + 1) / 2)  # QK and PV of the visible keys
        record("attention_prefill_chunk", f"B=1 T={new} ctx={past} h=24/4 d=256", ms, achieved=nbytes / ms / 1e9,
               limit=bandwidth, unit="TB/s", baseline="same kernel unsplit (num_splits=1)", baseline_ms=base_ms,
               kv_dtype="bf16", kv_bytes=nbytes, num_splits=default_prefill_splits(q.device, HEADS, new),
               tflops=round(flops / ms / 1e9, 2), matmul_peak_tflops=round(peak, 1))
        del caches, tables
        torch.cuda.empty_cache()


def bench_decode(bandwidth: float) -> None:
    for ctx_len, batch in itertools.product((8192, 32768, 131072), (1, 8)):
        tokens = ctx_len * batch
        q = torch.randn(batch, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        cu = torch.arange(batch + 1, device="cuda", dtype=torch.int32)
        ctx = torch.full((batch,), ctx_len, device="cuda", dtype=torch.int32)
        base_ms = None
        for kv_dtype in ("bf16", "fp8", "int8"):
            probe = random_cache(PAGE, kv_dtype)
            nbytes = kv_bytes(probe, tokens)
            copies = max(1, min(8, int(4 * L2_BYTES // nbytes) + 1))
            caches = [random_cache(tokens, kv_dtype) for _ in range(copies)]
            tables = [torch.randperm(tokens // PAGE, device="cuda", dtype=torch.int32).view(batch, -1)
                      for _ in range(copies)]
            turn = itertools.cycle(range(copies))

            def step() -> torch.Tensor:
                i = next(turn)
                return paged_attention(q, caches[i], tables[i], cu, ctx, SCALE, 1)

            ms = bench_graph_ms(step, inner=max(copies, 20 // copies * copies))
            if kv_dtype == "bf16":
                try:
                    base_ms = _sdpa_decode_ms(q, ctx_len, copies)
                except RuntimeError as err:  # a backend that cannot be captured or run at this size
                    print(f"SDPA decode baseline failed: {err}", flush=True)
            record("attention_decode", f"B={batch} ctx={ctx_len} h=24/4 d=256", ms, achieved=nbytes / ms / 1e9,
                   limit=bandwidth, unit="TB/s", baseline="torch SDPA default backend, contiguous bf16 KV",
                   baseline_ms=base_ms, kv_dtype=kv_dtype, kv_bytes=nbytes)
            del caches, tables
            torch.cuda.empty_cache()


def _sdpa_decode_ms(q: torch.Tensor, ctx_len: int, copies: int) -> float:
    batch = q.shape[0]
    kvs = [(torch.randn(batch, KV_HEADS, ctx_len, HEAD_DIM, device="cuda", dtype=torch.bfloat16),
            torch.randn(batch, KV_HEADS, ctx_len, HEAD_DIM, device="cuda", dtype=torch.bfloat16))
           for _ in range(copies)]
    qb = q.unsqueeze(2)
    turn = itertools.cycle(range(copies))

    def step() -> torch.Tensor:
        k, v = kvs[next(turn)]
        return F.scaled_dot_product_attention(qb, k, v, scale=SCALE, enable_gqa=True)

    ms = bench_graph_ms(step, inner=max(copies, 20 // copies * copies))
    del kvs
    torch.cuda.empty_cache()
    return ms


def bench_write(bandwidth: float) -> None:
    n = 8192
    k = torch.randn(n, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    for kv_dtype in ("bf16", "fp8", "int8"):
        kv = random_cache(4 * n, kv_dtype)
        slots = torch.randperm(4 * n, device="cuda")[:n]
        nbytes = 2 * k.numel() * k.element_size() + kv_bytes(kv, n)
        ms = bench_ms(lambda: write_kv(k, v, kv, slots))
        base_ms = bench_ms(lambda: write_kv_reference(k, v, kv, slots))
        record("attention_write_kv", f"N={n} kv_heads=4 d=256", ms, achieved=nbytes / ms / 1e9, limit=bandwidth,
               unit="TB/s", baseline="write_kv_reference (torch)", baseline_ms=base_ms, kv_dtype=kv_dtype)


def main() -> None:
    torch.manual_seed(0)
    bandwidth, peak = copy_bandwidth_tbps(), matmul_peak_tflops()
    print(f"copy bandwidth {bandwidth:.2f} TB/s, bf16 matmul peak {peak:.0f} TFLOP/s", flush=True)
    bench_write(bandwidth)
    bench_decode(bandwidth)
    bench_prefill(peak)
    bench_prefill_chunk(bandwidth, peak)


if __name__ == "__main__":
    main()
