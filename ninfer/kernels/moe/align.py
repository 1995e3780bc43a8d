"""Token-to-expert alignment for the grouped expert GEMMs, on the device and CUDA-graph safe.

The ``N * k`` routed (token, slot) pairs, numbered ``pair = token * k + slot``, are grouped by
expert; each expert's group is padded to a multiple of ``block_m`` so every GEMM row block belongs
to one expert. Outputs (fixed sizes for a given N, k, E and block_m; nothing read back to the host):

* ``sorted_pairs [max_padded]`` int32: pair indices grouped by expert, ascending pair order within
  an expert (a stable counting sort: deterministic); each group's padding holds the sentinel ``N * k``.
  Entries past ``num_post_padded`` are unspecified (their blocks are skipped).
* ``block_experts [max_blocks]`` int32: the expert of each row block, ``-1`` past the end.
* ``num_post_padded [1]`` int32: the padded total.

``max_padded = N*k + min(E, N*k) * (block_m - 1)`` bounds the padded total (at most ``min(E, N*k)``
experts have tokens, each padding fewer than ``block_m`` rows), so decode grids stay small.

Counting uses one-hot ``[C, E]`` tiles in registers: a sub-chunk's per-expert counts are column
sums, and a pair's rank among earlier same-expert pairs is an exclusive column cumsum. Up to
``CHUNK`` pairs (decode, small prefills) one program does everything in one launch; beyond that
three launches: per-chunk counts, a one-program plan (prefix over chunks and experts), and
per-chunk placement.

At decode the alignment is skipped: :func:`pair_group` lets the GEMM program of an expert's first
pair collect that expert's pairs straight from ``ids``. :class:`ExpertRows` records which of the
two a call uses; the jit helpers below are how every grouped GEMM (float or quantized weights)
maps its programs to one expert's rows.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

CHUNK = 1024  # pairs per program of the multi-program path
_TILE = 16384  # one-hot tile elements: [pairs, experts] int32, [64, 256] at E = 256, kept in registers
_BLOCKS = 64  # row blocks per step when labelling blocks with their expert


def max_padded_rows(pairs: int, num_experts: int, block_m: int) -> int:
    return pairs + min(num_experts, pairs) * (block_m - 1)


@triton.jit
def _chunk_counts(ids_ptr, lo, hi, SUB: tl.constexpr, E_BLOCK: tl.constexpr):
    """Pairs per expert among pairs [lo, hi), as an [E_BLOCK] int32 vector."""
    experts = tl.arange(0, E_BLOCK)
    counts = tl.zeros((E_BLOCK,), dtype=tl.int32)
    for start in range(lo, hi, SUB):
        offs = start + tl.arange(0, SUB)
        e = tl.load(ids_ptr + offs, mask=offs < hi, other=-1).to(tl.int32)
        counts += tl.sum((e[:, None] == experts[None, :]).to(tl.int32), axis=0)
    return counts


@triton.jit
def _place_chunk(ids_ptr, sorted_ptr, base, lo, hi, SUB: tl.constexpr, E_BLOCK: tl.constexpr):
    """Write pairs [lo, hi) to ``sorted[base[e] + rank]``, rank counting earlier pairs of expert e
    in this range (so the order within an expert is the pair order)."""
    experts = tl.arange(0, E_BLOCK)
    for start in range(lo, hi, SUB):
        offs = start + tl.arange(0, SUB)
        ok = offs < hi
        e = tl.load(ids_ptr + offs, mask=ok, other=-1).to(tl.int32)
        hot = (e[:, None] == experts[None, :]).to(tl.int32)
        earlier = tl.cumsum(hot, axis=0) - hot
        dest = tl.sum(hot * (earlier + base[None, :]), axis=1)
        tl.store(sorted_ptr + dest, offs, mask=ok)
        base += tl.sum(hot, axis=0)


@triton.jit
def _plan(totals, starts_ptr, sorted_ptr, block_experts_ptr, post_ptr, NK, E, max_blocks,
          BLOCK_M: tl.constexpr, E_BLOCK: tl.constexpr, BLOCKS: tl.constexpr):
    """From per-expert totals: padded group starts (returned and stored), sentinels in the padding,
    the expert of every row block and the padded total."""
    experts = tl.arange(0, E_BLOCK)
    padded = (totals + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    total = tl.sum(padded, axis=0)
    tl.store(starts_ptr + experts, starts, mask=experts < E)
    tl.store(post_ptr, total)
    pad = starts[:, None] + totals[:, None] + tl.arange(0, BLOCK_M)[None, :]
    tl.store(sorted_ptr + pad, tl.zeros_like(pad) + NK, mask=pad < ends[:, None])
    # Block b starts at row b * BLOCK_M and belongs to the expert whose padded range holds that row:
    # the number of experts (empty ones included) whose range ends at or before it.
    for b0 in range(0, max_blocks, BLOCKS):
        b = b0 + tl.arange(0, BLOCKS)
        row = b * BLOCK_M
        expert = tl.sum((ends[None, :] <= row[:, None]).to(tl.int32), axis=1)
        tl.store(block_experts_ptr + b, tl.where(row < total, expert, -1), mask=b < max_blocks)
    return starts


@triton.jit
def _align_one_kernel(ids_ptr, sorted_ptr, block_experts_ptr, post_ptr, starts_ptr, NK, E, max_blocks,
                      BLOCK_M: tl.constexpr, E_BLOCK: tl.constexpr, SUB: tl.constexpr, BLOCKS: tl.constexpr):
    totals = _chunk_counts(ids_ptr, 0, NK, SUB, E_BLOCK)
    starts = _plan(totals, starts_ptr, sorted_ptr, block_experts_ptr, post_ptr, NK, E, max_blocks,
                   BLOCK_M, E_BLOCK, BLOCKS)
    _place_chunk(ids_ptr, sorted_ptr, starts, 0, NK, SUB, E_BLOCK)


@triton.jit
def _count_kernel(ids_ptr, counts_ptr, NK, CHUNK: tl.constexpr, SUB: tl.constexpr, E_BLOCK: tl.constexpr):
    p = tl.program_id(0)
    counts = _chunk_counts(ids_ptr, p * CHUNK, tl.minimum(p * CHUNK + CHUNK, NK), SUB, E_BLOCK)
    tl.store(counts_ptr + p * E_BLOCK + tl.arange(0, E_BLOCK), counts)


@triton.jit
def _plan_kernel(counts_ptr, prefix_ptr, sorted_ptr, block_experts_ptr, post_ptr, starts_ptr, num_chunks, NK, E,
                 max_blocks, BLOCK_M: tl.constexpr, E_BLOCK: tl.constexpr, BLOCKS: tl.constexpr):
    """Turns chunk counts into exclusive prefixes over earlier chunks and plans the groups. The prefixes go
    to their own buffer: with fewer experts than threads, several warps hold copies of one count, and a
    warp that reads it after another warp wrote over it in place would read a prefix."""
    experts = tl.arange(0, E_BLOCK)
    totals = tl.zeros((E_BLOCK,), dtype=tl.int32)
    for p in range(num_chunks):
        c = tl.load(counts_ptr + p * E_BLOCK + experts)
        tl.store(prefix_ptr + p * E_BLOCK + experts, totals)
        totals += c
    _plan(totals, starts_ptr, sorted_ptr, block_experts_ptr, post_ptr, NK, E, max_blocks, BLOCK_M, E_BLOCK, BLOCKS)


@triton.jit
def _place_kernel(ids_ptr, prefix_ptr, starts_ptr, sorted_ptr, NK, E,
                  CHUNK: tl.constexpr, SUB: tl.constexpr, E_BLOCK: tl.constexpr):
    p = tl.program_id(0)
    experts = tl.arange(0, E_BLOCK)
    base = tl.load(prefix_ptr + p * E_BLOCK + experts) + tl.load(starts_ptr + experts, mask=experts < E, other=0)
    _place_chunk(ids_ptr, sorted_ptr, base, p * CHUNK, tl.minimum(p * CHUNK + CHUNK, NK), SUB, E_BLOCK)


def align_pairs(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``ids [N, k]`` (int32/int64 expert per pair, all in [0, E)) -> ``(sorted_pairs, block_experts,
    num_post_padded)`` as described in the module docstring."""
    flat = ids.reshape(-1)
    if flat.stride(0) != 1:
        flat = flat.contiguous()
    nk = flat.numel()
    dev = ids.device
    max_padded = max_padded_rows(nk, num_experts, block_m)
    max_blocks = triton.cdiv(max_padded, block_m)
    e_block = triton.next_power_of_2(num_experts)
    sub = max(16, _TILE // e_block)
    sorted_pairs = torch.empty(max_padded, dtype=torch.int32, device=dev)
    block_experts = torch.empty(max_blocks, dtype=torch.int32, device=dev)
    post = torch.empty(1, dtype=torch.int32, device=dev)
    starts = torch.empty(num_experts, dtype=torch.int32, device=dev)
    if nk <= CHUNK:
        _align_one_kernel[(1,)](
            ids_ptr=flat, sorted_ptr=sorted_pairs, block_experts_ptr=block_experts, post_ptr=post,
            starts_ptr=starts, NK=nk, E=num_experts, max_blocks=max_blocks, BLOCK_M=block_m, E_BLOCK=e_block,
            SUB=sub, BLOCKS=_BLOCKS, num_warps=4,
        )
        return sorted_pairs, block_experts, post
    chunks = triton.cdiv(nk, CHUNK)
    counts = torch.empty(chunks, e_block, dtype=torch.int32, device=dev)
    prefixes = torch.empty_like(counts)
    _count_kernel[(chunks,)](flat, counts, nk, CHUNK=CHUNK, SUB=sub, E_BLOCK=e_block, num_warps=4)
    _plan_kernel[(1,)](
        counts_ptr=counts, prefix_ptr=prefixes, sorted_ptr=sorted_pairs, block_experts_ptr=block_experts, post_ptr=post,
        starts_ptr=starts, num_chunks=chunks, NK=nk, E=num_experts, max_blocks=max_blocks, BLOCK_M=block_m,
        E_BLOCK=e_block, BLOCKS=_BLOCKS, num_warps=8,
    )
    _place_kernel[(chunks,)](
        ids_ptr=flat, prefix_ptr=prefixes, starts_ptr=starts, sorted_ptr=sorted_pairs, NK=nk, E=num_experts,
        CHUNK=CHUNK, SUB=sub, E_BLOCK=e_block, num_warps=4,
    )
    return sorted_pairs, block_experts, post


@dataclass
class ExpertRows:
    """How the grouped GEMM programs of one call find each expert's (token, slot) pairs: from
    ``ids`` directly (``direct``: one program per pair and column tile, decode) or from the
    alignment (one program per row block of ``block_m`` pairs and column tile)."""

    pairs: int  # N * k
    block_m: int
    direct: bool
    flat_ids: torch.Tensor | None = None  # direct: ids [N*k]
    pairs_block: int = 0  # direct: pairs held in registers (a power of two >= pairs)
    sorted_pairs: torch.Tensor | None = None  # aligned: see align_pairs
    block_experts: torch.Tensor | None = None

    @property
    def blocks(self) -> int:
        return 0 if self.block_experts is None else self.block_experts.numel()

    @property
    def tune_m(self) -> int:
        """Autotuning bucket of the pair count (one tuning per power of two)."""
        return min(triton.next_power_of_2(self.pairs), 65536)

    def grid(self, n_out: int) -> Callable[[dict], tuple[int, ...]]:
        if self.direct:
            return lambda meta: (self.pairs, triton.cdiv(n_out, meta["BLOCK_N"]))
        return lambda meta: (self.blocks * triton.cdiv(n_out, meta["BLOCK_N"]),)


def expert_rows(ids: torch.Tensor, num_experts: int, direct_max_pairs: int, block_m: int) -> ExpertRows:
    """Plan one call: alignment-free up to ``direct_max_pairs`` pairs (16-row tiles), else aligned
    to ``block_m``. Fixed-size outputs only, nothing read back: CUDA-graph safe."""
    nk = ids.numel()
    if nk <= direct_max_pairs:
        return ExpertRows(nk, 16, True, flat_ids=ids.reshape(-1).contiguous(), pairs_block=direct_max_pairs)
    sorted_pairs, block_experts, _ = align_pairs(ids, num_experts, block_m)
    return ExpertRows(nk, block_m, False, sorted_pairs=sorted_pairs, block_experts=block_experts)


@triton.jit
def aligned_tile(pid, num_blocks, N_OUT, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """``(row block, column tile)`` of aligned GEMM program ``pid``, in grouped order: GROUP_M
    consecutive row blocks (one or two experts at prefill) sweep the weight tiles together, so a
    weight tile is read once for all of an expert's blocks and their activation rows stay in L2."""
    num_n = tl.cdiv(N_OUT, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    size_m = tl.minimum(num_blocks - first_m, GROUP_M)
    return first_m + (pid % per_group) % size_m, (pid % per_group) // size_m


@triton.jit
def pair_group(ids_ptr, p, NK, PAIRS_BLOCK: tl.constexpr):
    """Alignment-free grouping for the program of pair ``p`` (all NK <= PAIRS_BLOCK ids in registers):
    ``(expert, match, rank, count, earlier)``: its expert, which pairs share it, their ranks among
    them, how many, and how many come before ``p`` (the program with none computes the expert; the
    others exit, so each selected expert is computed once and no other expert is read)."""
    offs = tl.arange(0, PAIRS_BLOCK)
    ids = tl.load(ids_ptr + offs, mask=offs < NK, other=-1)
    expert = tl.load(ids_ptr + p)
    match = ids == expert
    earlier = tl.sum((match & (offs < p)).to(tl.int32), axis=0)
    rank = tl.cumsum(match.to(tl.int32), axis=0) - 1
    return expert, match, rank, tl.sum(match.to(tl.int32), axis=0), earlier


@triton.jit
def pair_rows(match, rank, count, t0, NK, BLOCK_M: tl.constexpr, PAIRS_BLOCK: tl.constexpr):
    """The pairs of ranks ``[t0, t0 + BLOCK_M)`` among ``match`` as a row tile, ``NK`` past ``count``."""
    offs = tl.arange(0, PAIRS_BLOCK)
    r = t0 + tl.arange(0, BLOCK_M)
    hit = match[None, :] & (rank[None, :] == r[:, None])  # [BLOCK_M, PAIRS_BLOCK]: row r <- its pair
    return tl.where(r < count, tl.sum(tl.where(hit, offs[None, :], 0), axis=1), NK)
