"""The chunked DeltaNet state kernel, as the launcher configures it, compiled for sm_90 (H200) on any host.

Why: with a dv block of 16 or 32, the B operands of the state kernel's wgmma dots are 16 / 32-column
tiles (32 / 64-byte swizzle), and Triton's wgmma then reads past the end of a shared-memory operand
(memcheck on an H200: an illegal address with 16-bit inputs), which a run under the interpreter cannot
show. The tiny test models (dv = 16) reached them through the launcher's dv block and faulted in engine
warm-up; this test holds every 16-bit configuration to 64-column (128-byte swizzled) B tiles, as at 27B.

The launcher runs for real on CPU tensors with its three kernels replaced by recorders; the recorded state
kernel launch (its grid, argument dtypes and constexprs) is then compiled ahead of time for sm_90 in a
child process without the interpreter (compiling needs no GPU), once per autotune config.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

# (hk, hv, dk, dv): the tiny checkpoints' linear attention, other small dims, and Qwen3.5-27B's.
SHAPES = [(2, 4, 16, 16), (2, 4, 16, 32), (2, 4, 32, 16), (16, 48, 128, 128)]


def _record_state_launch(hk: int, hv: int, dk: int, dv: int, n: int) -> dict:
    """Run the launcher on bf16 CPU tensors with recording kernels; the state kernel's launch (kernels
    restored after)."""
    from ninfer.kernels.deltanet import chunk

    launches = {}

    class Recorder:
        def __init__(self, name: str, fn: object) -> None:
            self.name, self.arg_names = name, fn.fn.arg_names  # the autotuner wraps the JITFunction

        def __getitem__(self, grid: tuple):
            def launch(*args: object, **kwargs: object) -> None:
                launches[self.name] = dict(grid=list(grid), args=dict(zip(self.arg_names, args)), kwargs=kwargs)
            return launch

    kernels = {name: getattr(chunk, name) for name in ("_qk_gate_kernel", "_inverse_kernel", "_state_kernel")}
    for name, kernel in kernels.items():
        setattr(chunk, name, Recorder(name, kernel))
    try:
        _run_launcher(chunk, hk, hv, dk, dv, n)
    finally:
        for name, kernel in kernels.items():
            setattr(chunk, name, kernel)
    return launches["_state_kernel"]


def _run_launcher(chunk: object, hk: int, hv: int, dk: int, dv: int, n: int) -> None:
    import torch

    mixed = torch.zeros(n, 2 * hk * dk + hv * dv, dtype=torch.bfloat16)
    q, k, v = mixed.split([hk * dk, hk * dk, hv * dv], dim=-1)
    ab = torch.zeros(n, 2 * hv, dtype=torch.bfloat16)
    chunk.gated_delta_rule_chunked_triton(
        q.reshape(n, hk, dk), k.reshape(n, hk, dk), v.reshape(n, hv, dv), ab[:, :hv], ab[:, hv:],
        torch.zeros(hv), torch.zeros(hv), torch.zeros(3, hv, dk, dv), torch.tensor([0, n], dtype=torch.int32),
        torch.tensor([2], dtype=torch.int32))


def _compile_sm90(launch: dict, num_warps: int, num_stages: int) -> str:
    """TTGIR of the recorded state kernel launch for sm_90 (pointers 16-byte aligned, as torch allocates)."""
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from ninfer.kernels.deltanet import chunk

    fn = chunk._state_kernel.fn
    type_names = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int32: "i32",
                  torch.int64: "i64"}
    values = {**launch["args"], **launch["kwargs"]}
    signature, constexprs, attrs = {}, {}, {}
    for i, name in enumerate(fn.arg_names):
        value = values[name]
        if isinstance(value, torch.Tensor):
            signature[name] = "*" + type_names[value.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in launch["kwargs"] or value is None:
            signature[name] = "constexpr"
            constexprs[(i,)] = value
        else:
            signature[name] = "i32"
    kernel = triton.compile(ASTSource(fn, signature, constexprs=constexprs, attrs=attrs),
                            target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps, num_stages=num_stages))
    return kernel.asm["ttgir"]


def wgmma_b_operands(ttgir: str) -> list[str]:
    """``KxN/swizzle`` of the shared-memory B operand of each wgmma (``ttng.warp_group_dot``)."""
    swizzle = dict(re.findall(r"^#(\w+) = #ttg\.nvmma_shared<\{swizzlingByteWidth = (\d+)", ttgir, re.M))
    found = re.findall(r"ttng\.warp_group_dot .*? \* !ttg\.memdesc<(\d+)x(\d+)x\w+, #(\w+)", ttgir)
    return [f"{k}x{n}/{swizzle.get(layout, layout)}" for k, n, layout in found]


def _child(shape: list[int]) -> None:
    """In the child process: record, compile each autotune config, print the grid and B operands as JSON."""
    from ninfer.kernels.deltanet import chunk

    launch = _record_state_launch(*shape, n=200)
    operands = {f"w{cfg.num_warps}s{cfg.num_stages}": wgmma_b_operands(_compile_sm90(launch, cfg.num_warps,
                                                                                      cfg.num_stages))
                for cfg in chunk._state_kernel.configs}
    print(json.dumps(dict(grid=launch["grid"], bv=launch["kwargs"]["BV"], operands=operands)))


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "hk{}-hv{}-dk{}-dv{}".format(*s))
def test_state_kernel_wgmma_operands_on_sm90(shape: tuple[int, int, int, int]) -> None:
    pytest.importorskip("triton.backends.nvidia")
    env = {**os.environ, "TRITON_INTERPRET": "0"}  # compiled for real
    env.pop("NINFER_AUTOTUNE", None)  # every autotune config
    root = Path(__file__).resolve().parents[2]
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, __file__, json.dumps(shape)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    hk, hv, dk, dv = shape
    assert got["grid"] == [1, hv, -(-dv // got["bv"])]
    for config, operands in got["operands"].items():
        # 16-bit inputs: the four (dk < 64) or five dots all on the tensor cores, each B operand with
        # 64-column (128-byte swizzled) rows, never the 16 / 32-column ones that fault.
        assert len(operands) == (4 if dk < 64 else 5), (config, operands)
        assert all(int(op.split("x")[1].split("/")[0]) >= 64 and op.endswith("/128") for op in operands), \
            (config, operands)  # 16-bit inputs: tensor-core dots, and only the n64 shape


if __name__ == "__main__":
    _child(json.loads(sys.argv[1]))
