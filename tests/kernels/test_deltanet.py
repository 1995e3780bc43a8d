"""Gated DeltaNet Triton kernels (interpreter on CPU) against the PyTorch reference."""
from __future__ import annotations

import torch

from ninfer.kernels.deltanet import gated_delta_rule_reference
from ninfer.kernels.deltanet.chunk import gated_delta_rule_chunked_triton
from ninfer.kernels.deltanet.recurrent import gated_delta_rule_recurrent_triton

HK, HV = 2, 4


def _inputs(lens: list[int], dk: int, dv: int, slots: int, dtype: torch.dtype, seed: int) -> dict:
    """Ragged inputs; q, k, v are strided views of one packed projection, and so are a and b (the fused
    ``in_proj_a`` / ``in_proj_b``), as the model passes them."""
    gen = torch.Generator().manual_seed(seed)
    n = sum(lens)
    mixed = torch.randn(n, 2 * HK * dk + HV * dv, generator=gen).to(dtype)
    q, k, v = mixed.split([HK * dk, HK * dk, HV * dv], dim=-1)
    ab = torch.randn(n, 2 * HV, generator=gen) * torch.tensor([2.0] * HV + [1.0] * HV)
    a, b = ab.to(dtype).split([HV, HV], dim=-1)
    return dict(
        q=q.reshape(n, HK, dk), k=k.reshape(n, HK, dk), v=v.reshape(n, HV, dv), a=a, b=b,
        A_log=torch.empty(HV).uniform_(0.0, 2.5, generator=gen), dt_bias=torch.randn(HV, generator=gen),
        state=torch.randn(slots, HV, dk, dv, generator=gen),
        cu_seqlens=torch.tensor([0] + lens).cumsum(0).to(torch.int32),
    )


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def _check_against_reference(launcher, lens: list[int], dk: int, dv: int, dtype: torch.dtype, tol: float,
                             seed: int) -> None:
    slots = len(lens) + 2
    inp = _inputs(lens, dk, dv, slots, dtype, seed)
    slot_ids = torch.randperm(slots, generator=torch.Generator().manual_seed(seed))[: len(lens)]
    expect_state = inp["state"].clone()
    args = lambda st: (inp["q"], inp["k"], inp["v"], inp["a"], inp["b"], inp["A_log"], inp["dt_bias"], st,  # noqa: E731
                       inp["cu_seqlens"], slot_ids)
    out = launcher(*args(inp["state"]))
    ref = gated_delta_rule_reference(*args(expect_state))
    assert out.dtype == dtype and torch.isfinite(out).all()
    assert _rel(out, ref) < tol
    used = slot_ids[torch.tensor(lens) > 0]
    assert _rel(inp["state"][used], expect_state[used]) < tol
    untouched = torch.ones(slots, dtype=torch.bool)
    untouched[used] = False
    assert torch.equal(inp["state"][untouched], expect_state[untouched])  # unused and empty-sequence slots


def test_recurrent_matches_reference_ragged() -> None:
    _check_against_reference(gated_delta_rule_recurrent_triton, [1, 3, 0, 2, 1], 16, 32, torch.float32, 1e-5, 0)


def test_chunked_matches_reference_ragged() -> None:
    _check_against_reference(gated_delta_rule_chunked_triton, [1, 5, 64, 0, 70, 130], 32, 16, torch.float32, 1e-5, 1)


def test_chunked_fp16_inputs() -> None:
    # fp16 inputs make the matmul operands fp16 (as bf16 does on the GPU); state stays fp32.
    _check_against_reference(gated_delta_rule_chunked_triton, [3, 100], 32, 32, torch.float16, 2e-2, 2)


def test_prefill_then_decode_continues_the_state() -> None:
    """A chunked prefill followed by recurrent decode steps equals one reference pass over all tokens."""
    lens, steps, dk = [70, 9], 2, 16
    total = [n + steps for n in lens]
    inp = _inputs(total, dk, dk, 2, torch.float32, 3)
    ref_state = inp["state"].clone()
    slot_ids = torch.tensor([1, 0])
    keys = ("q", "k", "v", "a", "b")
    ref = gated_delta_rule_reference(*(inp[x] for x in keys), inp["A_log"], inp["dt_bias"], ref_state,
                                     inp["cu_seqlens"], slot_ids)
    starts = inp["cu_seqlens"][:-1].tolist()
    prefill_rows = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lens)])
    o_pre = gated_delta_rule_chunked_triton(*(inp[x][prefill_rows] for x in keys), inp["A_log"], inp["dt_bias"],
                                            inp["state"], torch.tensor([0, lens[0], sum(lens)]), slot_ids)
    assert _rel(o_pre, ref[prefill_rows]) < 1e-5
    for t in range(steps):
        step_rows = torch.tensor([s + lens[i] + t for i, s in enumerate(starts)])
        o = gated_delta_rule_recurrent_triton(*(inp[x][step_rows] for x in keys), inp["A_log"], inp["dt_bias"],
                                              inp["state"], torch.tensor([0, 1, 2]), slot_ids)
        assert _rel(o, ref[step_rows]) < 1e-5
    assert _rel(inp["state"], ref_state) < 1e-5


def test_recurrent_state_out_slots_match_token_by_token() -> None:
    """With state_out_slots, the state after each token lands in its own slot and the input slot is kept."""
    lens, dk, dv = [3, 1, 2], 16, 16
    inp = _inputs(lens, dk, dv, 12, torch.float32, 4)
    slot_ids = torch.tensor([0, 1, 2])
    out_slots = torch.tensor([[3, 4, 5], [6, 11, 11], [7, 8, 11]], dtype=torch.int32)  # 11: never written
    before = inp["state"].clone()
    inp["state"][3:] = float("nan")
    poisoned = inp["state"].clone()
    keys = ("q", "k", "v", "a", "b")
    o = gated_delta_rule_recurrent_triton(*(inp[x] for x in keys), inp["A_log"], inp["dt_bias"], inp["state"],
                                          inp["cu_seqlens"], slot_ids, state_out_slots=out_slots)
    assert torch.equal(inp["state"][:3], before[:3])
    assert torch.isnan(inp["state"][11]).all() and torch.isnan(inp["state"][9:11]).all()
    assert torch.isnan(poisoned[3:9]).all()
    starts = inp["cu_seqlens"].tolist()
    for b, length in enumerate(lens):
        running = before[slot_ids[b]].clone()[None]
        for t in range(length):
            row = slice(starts[b] + t, starts[b] + t + 1)
            ref = gated_delta_rule_reference(*(inp[x][row] for x in keys), inp["A_log"], inp["dt_bias"], running,
                                             torch.tensor([0, 1]), torch.tensor([0]))
            assert _rel(o[row], ref) < 1e-5
            assert _rel(inp["state"][out_slots[b, t]], running[0]) < 1e-5


def _check_checkpoints(lens: list[int], offsets: list[int], dtype: torch.dtype, tol: float, seed: int) -> None:
    """Checkpoints inside the chunked launch: outputs and final states as without them, and each
    checkpoint slot holds the reference's final state of its sequence cut to its first r tokens."""
    dk, dv, batch = 32, 16, len(lens)
    slots = 3 * batch + 2  # final slots, checkpoint slots, two never named
    inp = _inputs(lens, dk, dv, slots, dtype, seed)
    perm = torch.randperm(slots, generator=torch.Generator().manual_seed(seed))
    slot_ids, ckpt_slots = perm[:batch], perm[batch:2 * batch].to(torch.int32)
    ckpt_offsets = torch.tensor(offsets, dtype=torch.int32)
    named = torch.zeros(slots, dtype=torch.bool)
    named[slot_ids] = True
    named[ckpt_slots[ckpt_offsets > 0].long()] = True
    initial = inp["state"].clone()
    initial[~named] = float("nan")  # untouched slots must stay NaN
    keys = ("q", "k", "v", "a", "b")
    plain_state, ckpt_state = initial.clone(), initial.clone()
    run = lambda st, **kw: gated_delta_rule_chunked_triton(  # noqa: E731
        *(inp[x] for x in keys), inp["A_log"], inp["dt_bias"], st, inp["cu_seqlens"], slot_ids, **kw)
    o_plain = run(plain_state)
    o_ckpt = run(ckpt_state, ckpt_offsets=ckpt_offsets, ckpt_slots=ckpt_slots)
    # (a) Checkpoints change nothing else (the same code computes o and the final state).
    assert torch.equal(o_ckpt, o_plain)
    assert torch.equal(ckpt_state[slot_ids], plain_state[slot_ids])
    # (c) Slots named by no slot id or checkpoint are left alone.
    assert torch.isnan(ckpt_state[~named]).all()
    # (b) Each checkpoint equals the reference over the sequences truncated to their first r tokens.
    starts = inp["cu_seqlens"][:-1].tolist()
    has = [b for b in range(batch) if offsets[b] > 0]
    rows = torch.cat([torch.arange(starts[b], starts[b] + offsets[b]) for b in has])
    cu = torch.tensor([0] + [offsets[b] for b in has]).cumsum(0).to(torch.int32)
    ref_state = initial.clone()
    gated_delta_rule_reference(*(inp[x][rows] for x in keys), inp["A_log"], inp["dt_bias"], ref_state, cu,
                               slot_ids[has])
    got = ckpt_state[ckpt_slots[has].long()]
    assert torch.isfinite(got).all()
    assert _rel(got, ref_state[slot_ids[has]]) < tol
    for b in has:  # per sequence too: a small state must not hide behind a large one's scale
        assert _rel(ckpt_state[ckpt_slots[b]], ref_state[slot_ids[b]]) < tol
        if offsets[b] == lens[b]:  # the last token: exactly the final state
            assert torch.equal(ckpt_state[ckpt_slots[b]], ckpt_state[slot_ids[b]])


CKPT_LENS = [1, 63, 64, 65, 150, 200, 300, 130]
# 1, the last token (63, 64, 65, 300), chunk boundaries (64, 128), mid-chunk (37, 100), none (0).
CKPT_OFFSETS = [1, 63, 64, 0, 100, 128, 300, 37]


def test_chunked_checkpoints_fp32() -> None:
    _check_checkpoints(CKPT_LENS, CKPT_OFFSETS, torch.float32, 1e-5, 5)


def test_chunked_checkpoints_fp16_inputs() -> None:
    _check_checkpoints(CKPT_LENS, [1, 0, 37, 65, 150, 64, 129, 128], torch.float16, 2e-2, 6)


def test_chunked_tiny_model_dims_one_long_sequence() -> None:
    """The tiny checkpoints' linear attention (dk = dv = 16: a dv block padded to 64 columns) as engine
    warm-up prefills it: one sequence of many chunks, its state in the last of a few slots (the others,
    NaN, must stay untouched), 16-bit operands."""
    lens, dk, dv, slots = [1100], 16, 16, 4
    inp = _inputs(lens, dk, dv, slots, torch.float16, 7)
    slot_ids = torch.tensor([slots - 1], dtype=torch.int32)
    inp["state"][: slots - 1] = float("nan")
    expect = inp["state"].clone()
    keys = ("q", "k", "v", "a", "b")
    fixed = [inp[x] for x in keys] + [inp["A_log"], inp["dt_bias"]]
    out = gated_delta_rule_chunked_triton(*fixed, inp["state"], inp["cu_seqlens"], slot_ids)
    ref = gated_delta_rule_reference(*fixed, expect, inp["cu_seqlens"], slot_ids)
    assert out.shape == (sum(lens), HV, dv) and torch.isfinite(out).all()
    assert _rel(out, ref) < 2e-2
    assert _rel(inp["state"][-1], expect[-1]) < 2e-2
    assert torch.isnan(inp["state"][: slots - 1]).all()
