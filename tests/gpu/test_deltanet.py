"""Gated DeltaNet Triton kernels on the GPU at 27B shapes against the fp32 PyTorch reference."""
from __future__ import annotations

import pytest
import torch

from ninfer.kernels.deltanet import gated_delta_rule, gated_delta_rule_reference
from ninfer.kernels.deltanet.chunk import gated_delta_rule_chunked_triton
from ninfer.kernels.deltanet.recurrent import gated_delta_rule_recurrent_triton

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

HK, HV, DK, DV = 16, 48, 128, 128  # Qwen3.5-27B linear-attention heads
# tests/tiny_checkpoints.py's linear attention: dv < 64, the state kernel's padded dv block
TINY = (2, 4, 16, 16)
KEYS = ("q", "k", "v", "a", "b")


def _inputs(lens: list[int], slots: int, dtype: torch.dtype, seed: int,
            dims: tuple[int, int, int, int] = (HK, HV, DK, DV)) -> dict:
    """Random inputs shaped like the model's: q, k, v are strided views of one conv output."""
    HK, HV, DK, DV = dims  # noqa: N806
    gen = torch.Generator(device="cuda").manual_seed(seed)
    n = sum(lens)
    mixed = torch.randn(n, 2 * HK * DK + HV * DV, generator=gen, device="cuda").to(dtype)
    q, k, v = mixed.split([HK * DK, HK * DK, HV * DV], dim=-1)
    return dict(
        q=q.reshape(n, HK, DK), k=k.reshape(n, HK, DK), v=v.reshape(n, HV, DV),
        a=torch.randn(n, HV, generator=gen, device="cuda").to(dtype),
        b=torch.randn(n, HV, generator=gen, device="cuda").to(dtype),
        A_log=torch.empty(HV, device="cuda").uniform_(0, 16, generator=gen).clamp_min(0.5).log(),
        dt_bias=torch.randn(HV, generator=gen, device="cuda"),
        state=0.1 * torch.randn(slots, HV, DK, DV, generator=gen, device="cuda"),
        cu_seqlens=torch.tensor([0] + lens, device="cuda").cumsum(0).to(torch.int32),
    )


def _rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative Frobenius error (bf16 rounding alone gives about 2e-3)."""
    return ((x.float() - ref.float()).norm() / ref.float().norm()).item()


def _tolerances(launcher, dtype: torch.dtype) -> tuple[float, float]:
    """(output, state) bounds, about 2.5x the errors measured on an H200.

    Chunked: bf16 inputs make the matmul operands bf16 (the state is rounded where it feeds a
    matmul): ~4e-3 / 3e-3; fp32 inputs use tf32 matmuls: ~2.2e-3 / 1.5e-3. Recurrent: all fp32,
    so only the output's rounding to bf16 shows (~1.7e-3); its state matches to ~1e-7.
    """
    if launcher is gated_delta_rule_chunked_triton:
        return (1e-2, 1e-2) if dtype == torch.bfloat16 else (5e-3, 5e-3)
    return (5e-3 if dtype == torch.bfloat16 else 1e-4), 1e-4


def _compare(launcher, lens: list[int], dtype: torch.dtype, seed: int,
             dims: tuple[int, int, int, int] = (HK, HV, DK, DV), slot_ids: torch.Tensor | None = None,
             **kwargs) -> None:
    slots = len(lens) + 3
    inp = _inputs(lens, slots, dtype, seed, dims)
    if slot_ids is None:
        slot_ids = torch.randperm(slots, device="cuda")[: len(lens)]
    expect = inp["state"].clone()
    out = launcher(*(inp[x] for x in KEYS), inp["A_log"], inp["dt_bias"], inp["state"], inp["cu_seqlens"], slot_ids,
                   **kwargs)
    ref = gated_delta_rule_reference(*(inp[x].float() for x in KEYS), inp["A_log"], inp["dt_bias"], expect,
                                     inp["cu_seqlens"], slot_ids)
    torch.cuda.synchronize()
    assert out.dtype == dtype and torch.isfinite(out).all()
    out_tol, state_tol = _tolerances(launcher, dtype)
    assert _rel_err(out, ref) < out_tol
    used = slot_ids[torch.tensor(lens, device="cuda") > 0]
    assert _rel_err(inp["state"][used], expect[used]) < state_tol
    untouched = torch.ones(slots, dtype=torch.bool, device="cuda")
    untouched[used] = False
    assert torch.equal(inp["state"][untouched], expect[untouched])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_chunked_ragged_batch(dtype: torch.dtype) -> None:
    _compare(gated_delta_rule_chunked_triton, [1, 63, 64, 0, 65, 300, 1000], dtype, 0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_recurrent_decode_batch(dtype: torch.dtype) -> None:
    _compare(gated_delta_rule_recurrent_triton, [1] * 8, dtype, 1)


def test_recurrent_ragged_multi_token() -> None:
    _compare(gated_delta_rule_recurrent_triton, [1, 4, 0, 8, 2], torch.bfloat16, 2)


def test_recurrent_state_out_slots() -> None:
    """Speculative verification: the state after each token goes to its own slot; inputs are kept."""
    lens = [3, 1, 4]
    inp = _inputs(lens, 16, torch.bfloat16, 3)
    slot_ids = torch.tensor([0, 1, 2], device="cuda")
    out_slots = torch.tensor([[3, 4, 5, 15], [6, 15, 15, 15], [7, 8, 9, 10]], device="cuda", dtype=torch.int32)
    before = inp["state"].clone()
    inp["state"][3:] = float("nan")
    o = gated_delta_rule_recurrent_triton(*(inp[x] for x in KEYS), inp["A_log"], inp["dt_bias"], inp["state"],
                                          inp["cu_seqlens"], slot_ids, state_out_slots=out_slots)
    torch.cuda.synchronize()
    assert torch.equal(inp["state"][:3], before[:3]) and torch.isnan(inp["state"][11:]).all()
    starts = inp["cu_seqlens"].tolist()
    for b, length in enumerate(lens):
        running = before[b].clone()[None]
        for t in range(length):
            row = slice(starts[b] + t, starts[b] + t + 1)
            ref = gated_delta_rule_reference(*(inp[x][row].float() for x in KEYS), inp["A_log"], inp["dt_bias"],
                                             running, torch.tensor([0, 1], device="cuda"),
                                             torch.tensor([0], device="cuda"))
            assert _rel_err(o[row], ref) < 5e-3
            assert _rel_err(inp["state"][out_slots[b, t]], running[0]) < 1e-4


def test_dispatch_prefill_then_decode_under_cuda_graph() -> None:
    """Public op: chunked prefill, then decode steps replayed from a CUDA graph, equal one reference pass."""
    lens, steps = [200, 37], 3
    inp = _inputs([n + steps for n in lens], 2, torch.bfloat16, 4)
    slot_ids = torch.tensor([1, 0], device="cuda")
    expect = inp["state"].clone()
    ref = gated_delta_rule_reference(*(inp[x].float() for x in KEYS), inp["A_log"], inp["dt_bias"], expect,
                                     inp["cu_seqlens"], slot_ids)
    starts = inp["cu_seqlens"][:-1].tolist()
    pre = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lens)]).cuda()
    o = gated_delta_rule(*(inp[x][pre] for x in KEYS), inp["A_log"], inp["dt_bias"], inp["state"],
                         torch.tensor([0, lens[0], sum(lens)], device="cuda", dtype=torch.int32), slot_ids, max(lens))
    assert _rel_err(o, ref[pre]) < 1e-2

    step_in = {x: inp[x][:2].clone() for x in KEYS}
    cu = torch.tensor([0, 1, 2], device="cuda", dtype=torch.int32)

    def step() -> torch.Tensor:
        return gated_delta_rule(*(step_in[x] for x in KEYS), inp["A_log"], inp["dt_bias"], inp["state"], cu,
                                slot_ids, 1)

    saved = inp["state"].clone()
    step()  # compile and autotune outside the graph (this advances the state: undo it)
    inp["state"].copy_(saved)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o_step = step()
    for t in range(steps):
        rows = torch.tensor([s + n + t for s, n in zip(starts, lens)], device="cuda")
        for x in KEYS:
            step_in[x].copy_(inp[x][rows])
        graph.replay()
        assert _rel_err(o_step, ref[rows]) < 1e-2
    assert _rel_err(inp["state"][slot_ids], expect[slot_ids]) < 1e-2


@pytest.mark.parametrize("length", [1024, 2048, 4096, 4097, 8191, 8192])
def test_chunked_tiny_dims_long_prefill(length: int) -> None:
    """What engine warm-up prefills with the tiny checkpoints in bf16 (which faulted with an illegal
    address when the state kernel's dv block was 16): one long sequence in a scratch slot above 0."""
    _compare(gated_delta_rule_chunked_triton, [length], torch.bfloat16, 6, dims=TINY,
             slot_ids=torch.tensor([3], device="cuda", dtype=torch.int32))


@pytest.mark.parametrize("dims", [(2, 4, 16, 32), (2, 4, 32, 16), (4, 8, 64, 32)], ids=str)
def test_chunked_small_head_dims(dims: tuple[int, int, int, int]) -> None:
    """Other dv < 64 (padded dv block) and small dk, ragged, bf16 and fp32."""
    for dtype in (torch.bfloat16, torch.float32):
        _compare(gated_delta_rule_chunked_triton, [1, 63, 64, 0, 65, 300, 8191], dtype, 7, dims=dims)


@pytest.mark.parametrize("dims", [(HK, HV, DK, DV), TINY], ids=["27b", "tiny"])
def test_chunked_checkpoints_inside_the_launch(dims: tuple[int, int, int, int]) -> None:
    """Prefix-cache checkpoints written by the chunked launch: o and final states match the reference as
    without them; each checkpoint slot holds the fp32 reference's state after the first r tokens; other
    slots are untouched. (The runs with and without checkpoints are tuned apart and may pick different
    configs, so they are each held to the reference rather than to each other bit for bit.)"""
    lens = [1, 63, 64, 65, 300, 1000, 200]
    offsets = [1, 0, 64, 37, 300, 515, 128]  # 1, none, chunk boundaries, mid-chunk, the last token
    batch = len(lens)
    inp = _inputs(lens, 2 * batch + 2, torch.bfloat16, 5, dims)
    perm = torch.randperm(2 * batch + 2, device="cuda")
    slot_ids, ckpt_slots = perm[:batch], perm[batch:2 * batch].to(torch.int32)
    ckpt_offsets = torch.tensor(offsets, device="cuda", dtype=torch.int32)
    has = [b for b in range(batch) if offsets[b] > 0]
    named = torch.zeros(2 * batch + 2, dtype=torch.bool, device="cuda")
    named[slot_ids] = True
    named[ckpt_slots[has].long()] = True
    initial = inp["state"].clone()
    initial[~named] = float("nan")
    plain, with_ckpt = initial.clone(), initial.clone()
    run = lambda st, **kw: gated_delta_rule_chunked_triton(  # noqa: E731
        *(inp[x] for x in KEYS), inp["A_log"], inp["dt_bias"], st, inp["cu_seqlens"], slot_ids, **kw)
    o_plain = run(plain)
    o_ckpt = run(with_ckpt, ckpt_offsets=ckpt_offsets, ckpt_slots=ckpt_slots)
    starts = inp["cu_seqlens"][:-1].tolist()
    rows = torch.cat([torch.arange(starts[b], starts[b] + offsets[b]) for b in has]).cuda()
    cu = torch.tensor([0] + [offsets[b] for b in has], device="cuda").cumsum(0).to(torch.int32)
    ref, ref_full = initial.clone(), initial.clone()
    gated_delta_rule_reference(*(inp[x][rows].float() for x in KEYS), inp["A_log"], inp["dt_bias"], ref, cu,
                               slot_ids[has])
    o_ref = gated_delta_rule_reference(*(inp[x].float() for x in KEYS), inp["A_log"], inp["dt_bias"], ref_full,
                                       inp["cu_seqlens"], slot_ids)
    torch.cuda.synchronize()
    out_tol, state_tol = _tolerances(gated_delta_rule_chunked_triton, torch.bfloat16)
    for o, st in ((o_plain, plain), (o_ckpt, with_ckpt)):
        assert _rel_err(o, o_ref) < out_tol and _rel_err(st[slot_ids], ref_full[slot_ids]) < state_tol
    assert torch.isnan(with_ckpt[~named]).all()
    for b in has:
        assert _rel_err(with_ckpt[ckpt_slots[b]], ref[slot_ids[b]]) < state_tol, (b, offsets[b])
        if offsets[b] == lens[b]:  # the same launch computes both from the same operands
            assert _rel_err(with_ckpt[ckpt_slots[b]], with_ckpt[slot_ids[b]]) < 1e-6
