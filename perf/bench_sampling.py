"""Token sampling at V = 248320 (ids >= 248077 padding), B = 1, 2, 4, 8, against torch sort-based sampling.

Configs: the Qwen non-thinking preset (T 0.7, top_k 20, top_p 0.8, presence 1.5: penalty state is
read), plain temperature (the chunk draw), greedy, and a wide nucleus (top_p 0.95, no top_k, flat
logits: thresholds below the merged candidates, so the last program streams the row again).
Minimal bytes: the logits read once, plus int32 counts and int8 seen when penalties are on.
Structured output: the same launches with a packed token bitmask on every row, against the free
launch, at B = 1 and 8 (``constrained ...`` records). Both sides run from CUDA graphs (the baseline falls back to plain timing if it cannot be captured).
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ninfer.kernels.sampling import SamplingTensors, sample_triton  # noqa: E402
from perf.common import bench_graph_ms, bench_ms, copy_bandwidth_tbps, record  # noqa: E402

V, VL = 248320, 248077
CONFIGS = {
    "preset_nonthinking": dict(temperature=0.7, top_k=20, top_p=0.8, presence_penalty=1.5),
    "temperature_only": dict(temperature=1.0),
    "greedy": dict(temperature=0.0),
    "wide_nucleus_flat": dict(temperature=1.0, top_p=0.95),
}


def make_logits(batch: int, dtype: torch.dtype, flat: bool) -> torch.Tensor:
    x = torch.randn(batch, V, device="cuda") * (0.3 if flat else 2.0)
    if not flat:
        head = torch.randint(0, VL, (batch, 300), device="cuda")
        x.scatter_(1, head, 8.0 + 3.0 * torch.rand(batch, 300, device="cuda"))
    return x.to(dtype)


def torch_sample(logits: torch.Tensor, st: SamplingTensors, counts: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
    """vLLM-style torch sampler: penalties, temperature, sort + cumsum top_k/top_p, multinomial."""
    z = logits[:, :VL].float()
    rep = st.repetition_penalty[:, None]
    z = torch.where(seen[:, :VL] != 0, torch.where(z > 0, z / rep, z * rep), z)
    c = counts[:, :VL]
    z = z - st.frequency_penalty[:, None] * c - st.presence_penalty[:, None] * (c > 0)
    z = z / st.temperature.clamp(min=1e-6)[:, None]
    z_sorted, order = z.sort(dim=-1)
    k = torch.where(st.top_k > 0, st.top_k, VL).clamp(max=VL).long()
    kth = z_sorted.gather(1, (VL - k)[:, None])
    z_sorted = z_sorted.masked_fill(z_sorted < kth, float("-inf"))
    cum = z_sorted.softmax(-1).cumsum(-1)
    drop = cum <= 1 - st.top_p[:, None]
    drop[:, -1] = False
    z_sorted = z_sorted.masked_fill(drop, float("-inf"))
    probs = torch.empty_like(z).scatter_(1, order, z_sorted.softmax(-1))
    return torch.multinomial(probs, 1).squeeze(1)


def time_baseline(fn) -> float:
    try:
        return bench_graph_ms(fn)
    except RuntimeError as err:  # not capturable on this torch: time it eagerly
        print(f"baseline not graph-capturable ({err.__class__.__name__}); timing eagerly", flush=True)
        torch.cuda.synchronize()
        return bench_ms(fn)


def bench_point(name: str, batch: int, dtype: torch.dtype, bandwidth: float) -> None:
    cfg = CONFIGS[name]
    logits = make_logits(batch, dtype, flat=name == "wide_nucleus_flat")
    st = SamplingTensors.full(batch, "cuda", seed=1, **cfg)
    counts = (torch.rand(batch, V, device="cuda") < 0.002).to(torch.int32)
    seen = (counts > 0).to(torch.int8)
    ms = bench_graph_ms(lambda: sample_triton(logits, st, counts, seen, vocab_limit=VL))
    base_st = SamplingTensors.full(batch, "cuda", seed=1, **cfg)
    base_ms = time_baseline(lambda: torch_sample(logits, base_st, counts, seen))
    penalised = cfg.get("presence_penalty", 0.0) != 0.0
    nbytes = batch * VL * (logits.element_size() + (5 if penalised else 0))
    record("sampling", f"{name} B={batch} V={V} {str(dtype)[6:]}", ms, achieved=nbytes / ms / 1e9,
           limit=bandwidth, unit="TB/s", baseline="torch sort+cumsum+multinomial", baseline_ms=base_ms,
           bytes=nbytes)


def bench_mask_point(name: str, batch: int, dtype: torch.dtype, bandwidth: float) -> None:
    """Structured output's cost: the same launch with every row constrained by a packed bitmask (5% of
    ids allowed) against the free launch (the HAS_MASK=False variant)."""
    cfg = CONFIGS[name]
    logits = make_logits(batch, dtype, flat=False)
    counts = torch.zeros(batch, V, dtype=torch.int32, device="cuda")
    seen = torch.zeros(batch, V, dtype=torch.int8, device="cuda")
    words = -(-V // 32)
    bits = (torch.rand(batch, words, 32, device="cuda") < 0.05).long() << torch.arange(32, device="cuda")
    bits = bits.sum(-1)
    bitmask = torch.where(bits >= 2 ** 31, bits - 2 ** 32, bits).to(torch.int32)
    mask_rows = torch.arange(batch, dtype=torch.int32, device="cuda")
    st = SamplingTensors.full(batch, "cuda", seed=1, **cfg)
    free_ms = bench_graph_ms(lambda: sample_triton(logits, st, counts, seen, vocab_limit=VL))
    ms = bench_graph_ms(lambda: sample_triton(logits, st, counts, seen, vocab_limit=VL, bitmask=bitmask,
                                              mask_rows=mask_rows))
    nbytes = batch * (VL * logits.element_size() + words * 4)
    record("sampling", f"constrained {name} B={batch} V={V} {str(dtype)[6:]}", ms, achieved=nbytes / ms / 1e9,
           limit=bandwidth, unit="TB/s", baseline="same launch, no mask", baseline_ms=free_ms, bytes=nbytes)


def main() -> None:
    bandwidth = copy_bandwidth_tbps()
    print(f"copy bandwidth {bandwidth:.3f} TB/s", flush=True)
    points = [(name, torch.bfloat16) for name in CONFIGS] + [("preset_nonthinking", torch.float32)]
    for name, dtype in points:
        for batch in (1, 2, 4, 8):
            bench_point(name, batch, dtype, bandwidth)
    for name in ("greedy", "preset_nonthinking"):
        for batch in (1, 8):
            bench_mask_point(name, batch, torch.bfloat16, bandwidth)


if __name__ == "__main__":
    main()
