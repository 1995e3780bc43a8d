"""The L2 prefetch of :mod:`ninfer.kernels.prefetch`: a hint that does nothing off CUDA, forked only where the second
stream is and when asked, and its kernel compiled for sm_90 (H200) and sm_120 (RTX 5090) on any host with the
prefetch instruction kept (nothing reads its result, so a compiler could drop it)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ninfer.kernels import prefetch


def test_nothing_off_cuda() -> None:
    assert prefetch.prefetch_l2([torch.zeros(4096), torch.zeros(0)]) == 0


def test_only_asked_and_where_the_second_stream_forks(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    monkeypatch.setattr(prefetch, "prefetch_l2", lambda tensors: calls.append(1) or 0)
    x, w = torch.zeros(1, 8), [torch.zeros(64)]
    monkeypatch.delenv("NINFER_PREFETCH", raising=False)
    assert not prefetch.prefetched(w, x).forked  # off by default
    monkeypatch.setenv("NINFER_PREFETCH", "1")
    assert not prefetch.prefetched(w, x).forked  # eager (not captured): a prefetch right before the read is no use
    assert calls == []


def _compile(arch: int) -> str:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    src = ASTSource(prefetch._prefetch_kernel, {"ptr": "*u8", "n_lines": "i32", "LINES": "constexpr"},
                    constexprs={(2,): prefetch.LINES_PER_PROGRAM}, attrs={(0,): [["tt.divisibility", 16]]})
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=dict(num_warps=4)).asm["ptx"]


@pytest.mark.parametrize("arch", [90, 120])
def test_prefetch_kernel_keeps_its_instruction(arch: int) -> None:
    pytest.importorskip("triton.backends.nvidia")
    env = {**os.environ, "TRITON_INTERPRET": "0"}  # compiled for real
    root = Path(__file__).resolve().parents[2]
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, __file__, str(arch)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "prefetch.global.L2::evict_last: 1"  # one line per thread


if __name__ == "__main__":
    ptx = _compile(int(sys.argv[1]))
    print(f"prefetch.global.L2::evict_last: {ptx.count('prefetch.global.L2::evict_last')}")
