"""``ninfer warmup`` on CUDA: the warm-up phase runs (and is timed apart from loading), the tuning cache it
fills is the one a later start reads, and a generation after it is the same as without warm-up."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import ninfer
from cli_testing import run_cli
from tiny_checkpoints import TinyCheckpoint

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_warmup_reports_the_phases_and_the_caches(capsys, monkeypatch, tmp_path: Path,
                                                  dense_ckpt: TinyCheckpoint) -> None:
    monkeypatch.setenv("NINFER_TUNE_CACHE", str(tmp_path / "tune"))
    code, out, err = run_cli(capsys, "warmup", str(dense_ckpt.path), "--device", "cuda", "--max-concurrency", "2",
                             "--max-context", "1024", "--prefill-chunk", "256")
    assert code == 0, err
    for phase in ("load", r"warm-up \(prefill kernels\)", r"decode \(1-2 lanes\)"):
        assert re.search(rf"^{phase}\s+\d+\.\d+ s$", out, re.M), phase
    assert f"tuning cache: {tmp_path / 'tune'}" in out and "Triton compile cache:" in out


def test_generation_after_warmup_matches_one_without(dense_ckpt: TinyCheckpoint) -> None:
    prompt = "The quick brown fox"
    warm = ninfer.load(dense_ckpt.path, device="cuda", progress=False, max_context=512, prefill_chunk=64)
    cold = ninfer.load(dense_ckpt.path, device="cuda", progress=False, max_context=512, prefill_chunk=64, warmup=False)
    a = warm.generate(prompt, max_new_tokens=16, greedy=True)
    b = cold.generate(prompt, max_new_tokens=16, greedy=True)
    assert a.token_ids == b.token_ids
