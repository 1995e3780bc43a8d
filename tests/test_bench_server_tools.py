"""perf/bench_server.py helpers: quantized LM-head rows zeroed in every format; the library replay of HTTP
send times completes every request and counts TTFT from the scheduled send."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import ninfer
from ninfer.quant.linear import QuantLinear
from tiny_checkpoints import TinyCheckpoint

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "perf"))
import bench_server  # noqa: E402


@pytest.mark.parametrize("fmt", ["int8-g64", "int4-g64", "nvfp4", "fp8", "fp8-b128"])
def test_zero_quantized_rows_in_every_format(fmt: str) -> None:
    w = torch.randn(256, 256)
    head, untouched = QuantLinear.from_float(w, fmt), QuantLinear.from_float(w, fmt)
    rows = torch.tensor([3, 7, 200])
    bench_server._zero_quantized_rows(head, rows)
    got, ref = head.dequantize(torch.float32), untouched.dequantize(torch.float32)
    others = torch.ones(256, dtype=torch.bool)
    others[rows] = False
    assert torch.equal(got[rows], torch.zeros(3, 256))
    assert torch.equal(got[others], ref[others])


def test_library_replay_follows_the_send_times(dense_ckpt: TinyCheckpoint) -> None:
    llm = ninfer.load(dense_ckpt.path, device="cpu", max_concurrency=2, prefix_cache=False, progress=False)
    llm.stop_ids = frozenset()
    prompts = [torch.randint(0, 400, (12,), generator=torch.Generator().manual_seed(s)).tolist() for s in range(3)]
    samples = bench_server.run_library_replay(llm, prompts, [0.0, 0.0, 0.05], max_tokens=3)
    assert len(samples) == 3 and all(s.tokens == 3 for s in samples)
    assert all(s.ttft_s > 0 and s.total_s >= s.ttft_s for s in samples)
    assert llm.engine.is_idle()
