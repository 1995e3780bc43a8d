"""The PyTorch reference ops agree with independent, naive formulations of the same math."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ninfer.kernels.attention import PagedKV, paged_attention_reference, write_kv_reference
from ninfer.kernels.conv import causal_conv1d_reference
from ninfer.kernels.deltanet import chunked_rule, gated_delta_rule_reference, recurrent_rule
from ninfer.kernels.rope import apply_rope_reference, mrope_cos_sin, rope_inv_freq


def _rule_inputs(heads: int, length: int, dk: int, dv: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(heads, length, dk, generator=g, dtype=torch.float64), dim=-1) * dk ** -0.5
    k = F.normalize(torch.randn(heads, length, dk, generator=g, dtype=torch.float64), dim=-1)
    v = torch.randn(heads, length, dv, generator=g, dtype=torch.float64)
    decay = -torch.rand(heads, length, generator=g, dtype=torch.float64) * 0.5
    beta = torch.rand(heads, length, generator=g, dtype=torch.float64)
    state = torch.randn(heads, dk, dv, generator=g, dtype=torch.float64)
    return q, k, v, decay, beta, state


def test_chunked_rule_equals_recurrence_across_partial_chunks() -> None:
    for length in (1, 63, 64, 65, 150):
        inputs = _rule_inputs(3, length, 16, 8, seed=length)
        o_rec, s_rec = recurrent_rule(*inputs)
        o_chk, s_chk = chunked_rule(*inputs)
        assert (o_rec - o_chk).abs().max() < 1e-10
        assert (s_rec - s_chk).abs().max() < 1e-10


def test_ragged_delta_rule_equals_per_sequence_calls_and_updates_slots() -> None:
    torch.manual_seed(0)
    lens, hk, hv, d = [5, 1, 70], 2, 4, 8
    n = sum(lens)
    q, k = torch.randn(n, hk, d), torch.randn(n, hk, d)
    v, a, bb = torch.randn(n, hv, d), torch.randn(n, hv), torch.randn(n, hv)
    A_log, dt_bias = torch.rand(hv).log(), torch.randn(hv)
    state = torch.randn(4, hv, d, d)
    slots = torch.tensor([3, 0, 2])
    cu = torch.tensor([0, 5, 6, 76])
    expect_state = state.clone()
    out = gated_delta_rule_reference(q, k, v, a, bb, A_log, dt_bias, state, cu, slots)
    for b, (start, end) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        one = expect_state[slots[b]].clone()[None]
        o = gated_delta_rule_reference(q[start:end], k[start:end], v[start:end], a[start:end], bb[start:end], A_log, dt_bias,
                                       one, torch.tensor([0, end - start]), torch.tensor([0]))
        assert torch.allclose(out[start:end], o, atol=1e-5)
        assert torch.allclose(state[slots[b]], one[0], atol=1e-5)
    assert torch.equal(state[1], expect_state[1])  # an unused slot is untouched


def test_causal_conv_matches_direct_sum_and_continues_from_state() -> None:
    torch.manual_seed(1)
    channels, taps, length = 6, 4, 9
    x, w = torch.randn(length, channels), torch.randn(channels, taps)
    state = torch.zeros(1, channels, taps - 1)
    full = causal_conv1d_reference(x, w, state, torch.tensor([0, length]), torch.tensor([0]))
    padded = torch.cat([torch.zeros(taps - 1, channels), x])
    direct = torch.stack([F.silu((padded[t:t + taps].t() * w).sum(-1)) for t in range(length)])
    assert torch.allclose(full, direct, atol=1e-6)
    # Same result when fed in pieces through the state slot.
    state.zero_()
    pieces = [causal_conv1d_reference(x[a:b], w, state, torch.tensor([0, b - a]), torch.tensor([0]))
              for a, b in ((0, 2), (2, 3), (3, 9))]
    assert torch.allclose(torch.cat(pieces), direct, atol=1e-6)


def test_paged_attention_matches_dense_causal_attention() -> None:
    torch.manual_seed(2)
    heads, kv_heads, dim, page = 4, 2, 8, 4
    ctx, new = 11, 3
    kv = PagedKV.allocate(8, page, kv_heads, dim, dtype=torch.float32, device="cpu")
    table = torch.tensor([[5, 1, 7]])
    q, k, v = torch.randn(ctx, heads, dim), torch.randn(ctx, kv_heads, dim), torch.randn(ctx, kv_heads, dim)
    slots = table[0, torch.arange(ctx) // page] * page + torch.arange(ctx) % page
    write_kv_reference(k, v, kv, slots)
    out = paged_attention_reference(q[-new:], kv, table, torch.tensor([0, new]), torch.tensor([ctx]), dim ** -0.5)
    dense = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.repeat_interleave(2, 1).transpose(0, 1)[None],
        v.repeat_interleave(2, 1).transpose(0, 1)[None], is_causal=True)[0].transpose(0, 1)
    assert torch.allclose(out, dense[-new:], atol=1e-5)


def test_text_mrope_is_plain_partial_rope() -> None:
    torch.manual_seed(3)
    pos = torch.arange(7)
    inv = rope_inv_freq(8, 1e7)
    cos, sin = mrope_cos_sin(pos.expand(3, 7), inv, [2, 1, 1], torch.float32)
    x = torch.randn(7, 2, 16)
    y = apply_rope_reference(x, cos, sin)
    angle = pos[:, None].float() * inv
    x1, x2 = x[..., :4], x[..., 4:8]
    c, s = angle.cos()[:, None], angle.sin()[:, None]
    assert torch.allclose(y[..., :4], x1 * c - x2 * s, atol=1e-6)
    assert torch.allclose(y[..., 4:8], x2 * c + x1 * s, atol=1e-6)
    assert torch.equal(y[..., 8:], x[..., 8:])


def test_per_token_states_for_speculative_rollback() -> None:
    """With state_out_slots, the state (and conv window) after token t equals running tokens [0, t] alone."""
    torch.manual_seed(5)
    lens, hk, hv, d, taps = [4, 2], 2, 4, 8, 4
    n, channels = sum(lens), 6
    q, k, v = torch.randn(n, hk, d), torch.randn(n, hk, d), torch.randn(n, hv, d)
    a, bb, A_log, dt_bias = torch.randn(n, hv), torch.randn(n, hv), torch.rand(hv).log(), torch.randn(hv)
    x, w = torch.randn(n, channels), torch.randn(channels, taps)
    cu, slots = torch.tensor([0, 4, 6]), torch.tensor([0, 1])
    out_slots = torch.tensor([[2, 3, 4, 5], [6, 7, -1, -1]])
    state, conv = torch.randn(8, hv, d, d), torch.randn(8, channels, taps - 1)
    initial, initial_conv = state.clone(), conv.clone()
    o = gated_delta_rule_reference(q, k, v, a, bb, A_log, dt_bias, state, cu, slots, state_out_slots=out_slots)
    y = causal_conv1d_reference(x, w, conv, cu, slots, state_out_slots=out_slots)
    assert torch.equal(state[:2], initial[:2]) and torch.equal(conv[:2], initial_conv[:2])  # inputs only read
    for b, (start, length) in enumerate(((0, 4), (4, 2))):
        for t in range(length):
            ref_state, ref_conv = initial[b:b + 1].clone(), initial_conv[b:b + 1].clone()
            end = start + t + 1
            ref_o = gated_delta_rule_reference(q[start:end], k[start:end], v[start:end], a[start:end], bb[start:end],
                                               A_log, dt_bias, ref_state, torch.tensor([0, t + 1]), torch.tensor([0]))
            ref_y = causal_conv1d_reference(x[start:end], w, ref_conv, torch.tensor([0, t + 1]), torch.tensor([0]))
            slot = int(out_slots[b, t])
            assert torch.allclose(state[slot], ref_state[0], atol=1e-5)
            assert torch.allclose(conv[slot], ref_conv[0], atol=1e-6)
            assert torch.allclose(o[end - 1], ref_o[-1], atol=1e-5) and torch.allclose(y[end - 1], ref_y[-1], atol=1e-6)
