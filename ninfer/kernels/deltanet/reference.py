"""Plain-PyTorch references of the gated delta rule (recurrent and chunked forms) over a ragged batch;
they define correctness and are the CPU path."""
from __future__ import annotations

import torch


CHUNK = 64


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def recurrent_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token rule. ``q, k [H, T, dk]`` normalised, ``v [H, T, dv]``, ``g, beta [H, T]``, state ``[H, dk, dv]``."""
    out = torch.empty_like(v)
    for t in range(v.shape[1]):
        state = state * g[:, t].exp()[:, None, None]
        delta = (v[:, t] - (state * k[:, t, :, None]).sum(-2)) * beta[:, t, None]
        state = state + k[:, t, :, None] * delta[:, None, :]
        out[:, t] = (state * q[:, t, :, None]).sum(-2)
    return out, state


def chunked_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as :func:`recurrent_rule`, computed chunk by chunk in the UT form."""
    heads, length, _ = q.shape
    pad = (CHUNK - length % CHUNK) % CHUNK
    q, k, v = (torch.nn.functional.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
    g, beta = (torch.nn.functional.pad(t, (0, pad)) for t in (g, beta))
    n = (length + pad) // CHUNK
    q, k, v = (t.reshape(heads, n, CHUNK, -1) for t in (q, k, v))
    g, beta = g.reshape(heads, n, CHUNK), beta.reshape(heads, n, CHUNK)

    gamma = g.cumsum(-1)  # inclusive in-chunk cumulative log decay
    upper = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).triu(1)
    decay = (gamma[..., :, None] - gamma[..., None, :]).masked_fill(upper, float("-inf")).exp()
    k_beta = k * beta[..., None]
    system = (k_beta @ k.transpose(-1, -2)) * decay  # unit lower-triangular after adding I
    system = system.masked_fill(~torch.ones_like(upper).tril(-1), 0.0) + torch.eye(CHUNK, device=q.device)
    new_values = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    decayed_keys = torch.linalg.solve_triangular(
        system, k_beta * gamma.exp()[..., None], upper=False, unitriangular=True
    )
    intra = (q @ k.transpose(-1, -2)) * decay
    q_decayed = q * gamma.exp()[..., None]
    k_to_end = k * (gamma[..., -1:] - gamma).exp()[..., None]
    chunk_decay = gamma[..., -1].exp()[..., None, None]

    out = torch.empty_like(v)
    for c in range(n):
        v_new = new_values[:, c] - decayed_keys[:, c] @ state
        out[:, c] = q_decayed[:, c] @ state + intra[:, c] @ v_new
        state = state * chunk_decay[:, c] + k_to_end[:, c].transpose(-1, -2) @ v_new
    return out.reshape(heads, n * CHUNK, -1)[:, :length], state


def decay_and_beta(
    a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log decay ``g = -exp(A_log) * softplus(a + dt_bias)`` (fp32, so ``g <= 0``) and ``beta = sigmoid(b)``."""
    g = -A_log.float().exp() * torch.nn.functional.softplus(a.float() + dt_bias.float())
    return g, torch.sigmoid(b)


def gated_delta_rule_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor,
    cu_seqlens: torch.Tensor,
    slot_ids: torch.Tensor,
    max_seqlen: int | None = None,
    state_out_slots: torch.Tensor | None = None,
    ckpt_offsets: torch.Tensor | None = None,
    ckpt_slots: torch.Tensor | None = None,
) -> torch.Tensor:
    """Gated delta rule for a packed batch.

    ``q, k [N, Hk, dk]`` (not yet normalised), ``v [N, Hv, dv]``; ``a, b [N, Hv]`` are the raw
    decay and beta projections, turned into gates with ``A_log, dt_bias [Hv]`` (see
    :func:`decay_and_beta`). ``state [S, Hv, dk, dv]`` fp32 is read at ``slot_ids [B]`` and updated
    in place. ``max_seqlen`` (a host int, optional) lets kernels pick the decode path without a sync.
    With ``state_out_slots [B, max_T]`` the state after token ``t`` of sequence ``b`` goes to slot
    ``state_out_slots[b, t]`` and the input slot is only read (speculative verification keeps one
    state per drafted token, so a rejected draft rolls back without recomputation).
    With ``ckpt_offsets [B]`` (0: none) the state after the first ``ckpt_offsets[b]`` tokens of sequence
    ``b`` also goes to slot ``ckpt_slots[b]`` (a prefix-cache checkpoint inside the prefill, which would
    otherwise end the chunk there and cost the rest of the prompt another forward).
    Returns ``o [N, Hv, dv]`` in v's dtype.
    """
    g, beta = decay_and_beta(a, b, A_log, dt_bias)
    group = v.shape[1] // k.shape[1]
    scale = k.shape[-1] ** -0.5
    out = torch.empty_like(v)
    bounds = cu_seqlens.tolist()
    ckpts = [0] * len(bounds) if ckpt_offsets is None else ckpt_offsets.tolist()
    for i, slot in enumerate(slot_ids.tolist()):
        start, end = bounds[i], bounds[i + 1]
        if end == start:
            continue

        def heads_first(t: torch.Tensor) -> torch.Tensor:
            return t[start:end].float().transpose(0, 1)

        qs = _l2norm(heads_first(q).repeat_interleave(group, 0)) * scale
        ks = _l2norm(heads_first(k).repeat_interleave(group, 0))
        vs, gs, bs = heads_first(v), heads_first(g), heads_first(beta)
        if state_out_slots is not None:
            s_t = state[slot].float()
            for t in range(end - start):  # one token at a time, keeping every intermediate state
                o, s_t = recurrent_rule(qs[:, t:t + 1], ks[:, t:t + 1], vs[:, t:t + 1], gs[:, t:t + 1],
                                        bs[:, t:t + 1], s_t)
                out[start + t] = o[:, 0].to(v.dtype)
                state[int(state_out_slots[i, t])] = s_t.to(state.dtype)
            continue
        new_state, r = state[slot].float(), ckpts[i]
        for lo, hi in ((0, r), (r, end - start)) if 0 < r else ((0, end - start),):
            if hi == lo:
                continue
            rule = recurrent_rule if hi - lo == 1 else chunked_rule
            o, new_state = rule(qs[:, lo:hi], ks[:, lo:hi], vs[:, lo:hi], gs[:, lo:hi], bs[:, lo:hi], new_state)
            out[start + lo:start + hi] = o.transpose(0, 1).to(v.dtype)
            if hi == r:
                state[int(ckpt_slots[i])] = new_state.to(state.dtype)
        state[slot] = new_state.to(state.dtype)
    return out
