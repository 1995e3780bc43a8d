"""Token sampling for a batch of rows of logits: penalties, temperature, min_p / top_k / top_p, draw.

Semantics (vLLM's order), per row:

1. Penalties on the raw logits (fp32): repetition (HF/vLLM: a logit of a token seen in the prompt or
   output is divided by the penalty when positive, multiplied when not), then frequency and
   presence (OpenAI: ``logit -= frequency * count + presence * (count > 0)`` over generated tokens).
2. Temperature: ``u = z / T``. ``T <= 0`` is greedy: the argmax of the penalised logits (lowest id
   on ties); temperature and filters are ignored, penalties are not.
3. Filters, each keeping an upper set of ``u``: min_p keeps ``exp(u - max u) >= min_p``; top_k
   keeps ``u >= the k-th largest u``; top_p keeps the smallest set of highest scores whose mass
   reaches ``top_p`` of what min_p and top_k kept (the first token always). Ties at a threshold
   are all kept, so the kept set is a function of the values, not of a sort order.
4. Draw by inverse CDF from the kept, renormalised ``softmax(u)``, with one uniform per row that
   depends only on the row's ``(seed, counter)``: a row's token does not depend on the other rows.

Structured output: an optional packed token bitmask ``int32 [R, ceil(V / 32)]`` (xgrammar's layout: bit
``t % 32`` of word ``t // 32`` set = token ``t`` allowed) with ``mask_rows [B]`` int32 naming each row's
bitmask row (-1: unconstrained, its mask is never read). A disallowed token's raw logit is ``-inf``
before anything else, so penalties, filters, the draw *and the logprobs* see the masked logits: the
logprobs are those of the constrained distribution, as when the caller masked the logits in place.

Ids ``>= vocab_limit`` (vocabulary padding) are never chosen and are not part of any softmax.
``logprob`` is the OpenAI convention: the log-probability of the token under the model's raw
distribution, ``log_softmax`` of the raw logits over ids ``< vocab_limit``, before penalties,
temperature and filters; ``top_ids/top_logprobs`` are the ``num_logprobs`` best of that same
distribution (descending, lowest id first on ties).

The caller owns the penalty state: ``seen`` starts with the prompt's ids set, ``output_counts`` at
zero. Each call advances a row's state in place: ``counter += 1``, ``output_counts[tok] += 1`` and
``seen[tok] = 1``. The Triton path (``kernel.py``) does all of it in one CUDA-graph-safe
launch (its divisions are products with rounded reciprocals, within an ulp of the reference);
the reference does it in torch and draws its uniform from a ``torch.Generator`` seeded from
``(seed, counter)``, so it is batch independent too but not bit-equal to the Triton draws.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from ninfer.kernels.dispatch import use_triton
from ninfer.kernels.sampling.kernel import sample_kernel

MAX_LOGPROBS = 20
# The kernel unrolls its top-logprobs loop (a constexpr count): a launch computes the smallest class that
# holds the count asked for and the caller gets its first entries (the same: descending, lowest id first on
# ties), so serving meets 7 compiled variants, all warmed at start-up (``Sampler.warm_up``), not 21.
LOGPROB_CLASSES = (0, 1, 2, 4, 8, 16, MAX_LOGPROBS)


def logprob_class(num_logprobs: int) -> int:
    """The count of top logprobs a launch computes for ``num_logprobs`` (see ``LOGPROB_CLASSES``)."""
    return next(c for c in LOGPROB_CLASSES if c >= num_logprobs)


@dataclass
class SamplingTensors:
    """Per-row sampling parameters as device tensors (one entry per row), so a graph can replay them."""

    temperature: torch.Tensor  # fp32, <= 0: greedy
    top_k: torch.Tensor  # int32, 0: off
    top_p: torch.Tensor  # fp32, 1: off
    min_p: torch.Tensor  # fp32, 0: off
    presence_penalty: torch.Tensor  # fp32
    frequency_penalty: torch.Tensor  # fp32
    repetition_penalty: torch.Tensor  # fp32, 1: off
    seed: torch.Tensor  # int64
    counter: torch.Tensor  # int64, advanced by one per call

    @classmethod
    def full(cls, batch: int, device: torch.device | str = "cpu", *, temperature: float = 1.0, top_k: int = 0,
             top_p: float = 1.0, min_p: float = 0.0, presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
             repetition_penalty: float = 1.0, seed: int = 0, counter: int = 0) -> SamplingTensors:
        """Every row with the same parameters (rows are then edited in place)."""
        def f(v: float) -> torch.Tensor:
            return torch.full((batch,), v, dtype=torch.float32, device=device)

        def i(v: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.full((batch,), v, dtype=dtype, device=device)

        return cls(f(temperature), i(top_k, torch.int32), f(top_p), f(min_p), f(presence_penalty),
                   f(frequency_penalty), f(repetition_penalty), i(seed, torch.int64), i(counter, torch.int64))


@dataclass
class SampleOutput:
    token_ids: torch.Tensor  # [B] int64
    logprob: torch.Tensor  # [B] fp32, raw distribution
    top_ids: torch.Tensor | None = None  # [B, n] int64
    top_logprobs: torch.Tensor | None = None  # [B, n] fp32


def apply_penalties_reference(logits: torch.Tensor, st: SamplingTensors, output_counts: torch.Tensor,
                              seen: torch.Tensor) -> torch.Tensor:
    """fp32 penalised logits: repetition (over ``seen``), then frequency and presence (over counts)."""
    z = logits.float()
    rep = st.repetition_penalty.float()[:, None]
    z = torch.where(seen != 0, torch.where(z > 0, z / rep, z * rep), z)
    z = z - st.frequency_penalty.float()[:, None] * output_counts.float()
    return z - torch.where(output_counts > 0, st.presence_penalty.float()[:, None], 0.0)


def sampling_probs_reference(logits: torch.Tensor, st: SamplingTensors, output_counts: torch.Tensor,
                             seen: torch.Tensor, *, vocab_limit: int) -> torch.Tensor:
    """The distribution each row is drawn from, ``[B, vocab_limit]`` fp64 (one-hot for greedy rows)."""
    z = apply_penalties_reference(logits[:, :vocab_limit], st, output_counts[:, :vocab_limit],
                                  seen[:, :vocab_limit])
    probs = torch.zeros(z.shape, dtype=torch.float64, device=z.device)
    for b in range(z.shape[0]):
        temp = float(st.temperature[b])
        if temp <= 0:
            probs[b, int(z[b].argmax())] = 1.0
            continue
        u = z[b] / temp
        ok = ~u.isnan()
        w = torch.exp(u - u[ok].max())
        keep = ok.clone()
        min_p, top_k, top_p = float(st.min_p[b]), int(st.top_k[b]), float(st.top_p[b])
        if min_p > 0:
            keep &= w >= min_p
        if 0 < top_k < vocab_limit:
            keep &= u >= u[ok].topk(min(top_k, int(ok.sum()))).values[-1]
        if top_p < 1:
            mass = torch.where(keep, w, 0.0).double()
            order = torch.argsort(torch.where(keep, u, float("-inf")), descending=True, stable=True)
            cum = mass[order].cumsum(0)
            cut = int((cum < top_p * cum[-1]).sum().clamp(max=len(cum) - 1))
            keep &= u >= u[order[cut]]
        mass = torch.where(keep, w, 0.0).double()
        probs[b] = mass / mass.sum()
    return probs


def _row_generator(seed: int, counter: int) -> torch.Generator:
    mixed = (seed * 0x9E3779B97F4A7C15 + counter * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) % 2 ** 64
    return torch.Generator().manual_seed(mixed)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, mask_rows: torch.Tensor) -> torch.Tensor:
    """``logits`` with each disallowed token of a constrained row (``mask_rows[b] >= 0``) at ``-inf``
    (a new tensor; the torch form of the kernel's mask, shape-static so a graph may capture it)."""
    vocab = logits.shape[1]
    words = bitmask[mask_rows.long().clamp(min=0)]
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).view(words.shape[0], -1)[:, :vocab].bool()
    allowed |= (mask_rows < 0)[:, None]
    return logits.masked_fill(~allowed, float("-inf"))


def sample_reference(logits: torch.Tensor, st: SamplingTensors, output_counts: torch.Tensor, seen: torch.Tensor,
                     *, vocab_limit: int, num_logprobs: int = 0, bitmask: torch.Tensor | None = None,
                     mask_rows: torch.Tensor | None = None) -> SampleOutput:
    """Torch sampler with the module's semantics (the CPU path); updates the row state in place."""
    _check(logits, vocab_limit, num_logprobs)
    _check_mask(logits, bitmask, mask_rows)
    if bitmask is not None:
        logits = apply_bitmask(logits, bitmask, mask_rows)
    probs = sampling_probs_reference(logits, st, output_counts, seen, vocab_limit=vocab_limit)
    raw = torch.log_softmax(logits[:, :vocab_limit].float(), dim=-1)
    tokens = []
    for b in range(logits.shape[0]):
        if float(st.temperature[b]) <= 0:
            tokens.append(int(probs[b].argmax()))
            continue
        r = float(torch.rand((), dtype=torch.float64, generator=_row_generator(int(st.seed[b]), int(st.counter[b]))))
        cum = probs[b].cumsum(0)
        tok = int((cum <= r * float(cum[-1])).sum())
        tokens.append(min(tok, int(probs[b].nonzero().max())))  # r rounded up to the total
    token_ids = torch.tensor(tokens, dtype=torch.int64, device=logits.device)
    rows = torch.arange(logits.shape[0], device=logits.device)
    out = SampleOutput(token_ids, raw[rows, token_ids])
    if num_logprobs:
        # Stable descending sort: on ties the lowest id comes first, as in the kernel.
        order = torch.argsort(raw, dim=-1, descending=True, stable=True)[:, :num_logprobs]
        out.top_ids, out.top_logprobs = order, raw.gather(1, order)
    output_counts[rows, token_ids] += 1
    seen[rows, token_ids] = 1
    st.counter += 1
    return out


def _check(logits: torch.Tensor, vocab_limit: int, num_logprobs: int) -> None:
    if logits.dim() != 2:
        raise ValueError(f"logits must be [B, V], got {tuple(logits.shape)}")
    if not 0 < vocab_limit <= logits.shape[1]:
        raise ValueError(f"vocab_limit must be in [1, {logits.shape[1]}], got {vocab_limit}")
    if not 0 <= num_logprobs <= MAX_LOGPROBS:
        raise ValueError(f"num_logprobs must be in [0, {MAX_LOGPROBS}], got {num_logprobs}")


def _check_mask(logits: torch.Tensor, bitmask: torch.Tensor | None, mask_rows: torch.Tensor | None) -> None:
    if (bitmask is None) != (mask_rows is None):
        raise ValueError("bitmask and mask_rows come together")
    if bitmask is None:
        return
    words = -(-logits.shape[1] // 32)
    if bitmask.dtype != torch.int32 or bitmask.dim() != 2 or bitmask.shape[1] < words:
        raise ValueError(f"bitmask must be int32 [R, >= {words}], got {bitmask.dtype} {tuple(bitmask.shape)}")
    if mask_rows.shape != (logits.shape[0],) or mask_rows.dtype != torch.int32:
        raise ValueError(f"mask_rows must be int32 [{logits.shape[0]}], got {mask_rows.dtype} {tuple(mask_rows.shape)}")


_WORKSPACES: dict[tuple, tuple[torch.Tensor, ...]] = {}


def _workspace(device: torch.device, batch: int, s_pad: int, kc: int, lp_cap: int) -> tuple[torch.Tensor, ...]:
    """Scratch kept across calls: the arrival counters must start at zero and are left at zero.

    Allocated on the first call for a shape (do that one outside graph capture); one sampler per
    stream, as concurrent calls of the same shape would share it.
    """
    key = (device, batch, s_pad, kc, lp_cap)
    if key not in _WORKSPACES:
        _WORKSPACES[key] = (
            torch.empty(batch, s_pad * kc, dtype=torch.float32, device=device),  # candidate scores
            torch.empty(batch, s_pad * kc, dtype=torch.int32, device=device),  # candidate ids
            torch.empty(batch, s_pad, 4, dtype=torch.float32, device=device),  # raw max/sum, scaled max/sum
            torch.empty(batch, s_pad, 4, dtype=torch.int32, device=device),  # threshold key, n cand, n top
            torch.empty(batch, s_pad, max(lp_cap, 1), dtype=torch.float32, device=device),  # raw top values
            torch.empty(batch, s_pad, max(lp_cap, 1), dtype=torch.int32, device=device),  # raw top ids
            torch.zeros(batch, dtype=torch.int32, device=device),  # chunks arrived per row
        )
    return _WORKSPACES[key]


# 16 warps: 8 values per thread of a 4096-id block or of the 4096 merged candidates; the kernel then
# fits 128 registers (one 16-warp program per SM; 8 warps would need 255 registers and hold fewer
# warps per SM).
_NUM_WARPS = 16


def sample_triton(logits: torch.Tensor, st: SamplingTensors, output_counts: torch.Tensor, seen: torch.Tensor,
                  *, vocab_limit: int, num_logprobs: int = 0, chunk: int = 4096, candidates: int = 64,
                  bitmask: torch.Tensor | None = None, mask_rows: torch.Tensor | None = None) -> SampleOutput:
    """One launch of :mod:`ninfer.kernels.sampling.kernel`, grid ``(ceil(vocab_limit / chunk), B)``.

    ``chunk`` ids per program (power of two), ``candidates`` (power of two) kept per chunk; the
    merged ``next_pow2(n_chunks) * candidates`` slots bound what the last program resolves in
    registers. The defaults give 61 chunks and 4096 slots at V = 248320. Without ``bitmask`` the
    launch is the HAS_MASK=False variant: no mask argument is read at all.
    """
    _check(logits, vocab_limit, num_logprobs)
    _check_mask(logits, bitmask, mask_rows)
    batch, asked, num_logprobs = logits.shape[0], num_logprobs, logprob_class(num_logprobs)
    token_ids = torch.empty(batch, dtype=torch.int64, device=logits.device)
    logprob = torch.empty(batch, dtype=torch.float32, device=logits.device)
    # At least one column, so the kernel never gets a null pointer.
    top_ids = torch.empty(batch, max(num_logprobs, 1), dtype=torch.int64, device=logits.device)
    top_lp = torch.empty(batch, max(num_logprobs, 1), dtype=torch.float32, device=logits.device)
    out = SampleOutput(token_ids, logprob, top_ids[:, :asked] if asked else None, top_lp[:, :asked] if asked else None)
    if batch == 0:
        return out
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    if seen.dtype == torch.bool:
        seen = seen.view(torch.uint8)
    lp_cap = triton.next_power_of_2(num_logprobs) if num_logprobs else 0
    if chunk < max(candidates, lp_cap):  # each chunk is split in that many groups (see _select_top)
        raise ValueError(f"chunk {chunk} is smaller than candidates {candidates} or next_pow2(num_logprobs)")
    n_chunks = triton.cdiv(vocab_limit, chunk)
    s_pad = triton.next_power_of_2(n_chunks)
    cand_u, cand_id, stat_f, stat_i, lp_v, lp_id, arrive = _workspace(logits.device, batch, s_pad, candidates,
                                                                      lp_cap)
    has_mask = bitmask is not None
    if has_mask and bitmask.stride(-1) != 1:
        bitmask = bitmask.contiguous()
    sample_kernel[(n_chunks, batch)](
        logits_ptr=logits, stride_l=logits.stride(0), counts_ptr=output_counts, stride_c=output_counts.stride(0),
        seen_ptr=seen, stride_s=seen.stride(0), mask_ptr=bitmask if has_mask else arrive,
        stride_m=bitmask.stride(0) if has_mask else 0, mask_idx_ptr=mask_rows if has_mask else arrive,
        temp_ptr=st.temperature, top_k_ptr=st.top_k, top_p_ptr=st.top_p,
        min_p_ptr=st.min_p, pres_ptr=st.presence_penalty, freq_ptr=st.frequency_penalty,
        rep_ptr=st.repetition_penalty, seed_ptr=st.seed, counter_ptr=st.counter, cand_u_ptr=cand_u,
        cand_id_ptr=cand_id, stat_f_ptr=stat_f, stat_i_ptr=stat_i, lp_v_ptr=lp_v, lp_id_ptr=lp_id,
        arrive_ptr=arrive, tok_ptr=token_ids, logprob_ptr=logprob, top_id_ptr=top_ids, top_lp_ptr=top_lp,
        vocab_limit=vocab_limit, n_chunks=n_chunks, CHUNK=chunk, KC=candidates, S_PAD=s_pad, NUM_LP=num_logprobs,
        LP_CAP=max(lp_cap, 1), HAS_MASK=has_mask, num_warps=_NUM_WARPS,
    )
    return out


def suppress_tokens(logits: torch.Tensor, rows: torch.Tensor, pair_rows: torch.Tensor, pair_ids: torch.Tensor,
                    *, vocab_limit: int) -> None:
    """Set ``logits[rows[pair_rows[i]], pair_ids[i]]`` to ``-inf`` in place (``min_tokens``: stop ids before
    the minimum), before :func:`sample`, so the fused kernel stays as it is and other rows are not touched.

    ``rows [r]`` are distinct row indices; pair ``i`` names its row by position in ``rows``. A row whose
    every other id ``< vocab_limit`` is already ``-inf`` (a grammar that only allows ending) keeps its
    logits: a row with nothing left to draw has no defined sample, and ending is what the constraint wants.
    No host synchronisation (the index tensors are the caller's), so it may run inside a CUDA graph.
    """
    picked = logits[rows]
    picked[pair_rows, pair_ids] = float("-inf")
    alive = picked[:, :vocab_limit].isfinite().any(dim=1, keepdim=True)
    logits[rows] = torch.where(alive, picked, logits[rows])


def sample(logits: torch.Tensor, st: SamplingTensors, output_counts: torch.Tensor, seen: torch.Tensor,
           *, vocab_limit: int, num_logprobs: int = 0, bitmask: torch.Tensor | None = None,
           mask_rows: torch.Tensor | None = None) -> SampleOutput:
    """Sample one token per row of ``logits [B, V]``; ``output_counts [B, V]`` int32 and ``seen [B, V]``
    (int8/bool) are the caller's penalty buffers, updated in place with the sampled tokens. ``bitmask`` /
    ``mask_rows``: the structured-output token mask (see the module docstring); ``logits`` is not modified."""
    kw = dict(vocab_limit=vocab_limit, num_logprobs=num_logprobs, bitmask=bitmask, mask_rows=mask_rows)
    if use_triton(logits):
        return sample_triton(logits, st, output_counts, seen, **kw)
    return sample_reference(logits, st, output_counts, seen, **kw)
