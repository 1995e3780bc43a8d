"""The router kernels compiled for sm_90 (H200) and sm_120 (RTX 5090) on any host, as their launchers configure
them at the 35B-A3B shapes: the Triton compiler rejects what the interpreter runs (a branch that reshapes a
variable of the enclosing block once reached the GPU that way), and the fused router must fit 99 KB of shared
memory."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SMEM_LIMIT = 99 * 1024
TARGETS = [90, 120]


def _compile(arch: int) -> list[dict]:
    """Shared memory of the fused router and of the top-k kernel (bf16), compiled for ``arch``."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from ninfer.kernels.moe import routing

    experts, rows, top_k = 256, 257, 8
    kernels = {
        "_router_kernel": (dict(IEEE=False, BLOCK_T=16, BLOCK_R=routing.ROUTER_BLOCK_R, BLOCK_H=routing.ROUTER_BLOCK_H,
                                TOP_K=top_k, K_BLOCK=top_k, T_BLOCK=routing.ROUTER_MAX_TOKENS, E_BLOCK=experts,
                                X_BLOCK=triton.next_power_of_2(rows - experts)),
                           {"x_ptr": "*bf16", "w_ptr": "*bf16", "part_ptr": "*fp32", "logits_ptr": "*bf16",
                            "rw_ptr": "*bf16", "ids_ptr": "*i64", "cnt_ptr": "*i32"}, 4),
        "_route_kernel": (dict(TOP_K=top_k, K_BLOCK=top_k, E_BLOCK=experts),
                          {"logits_ptr": "*bf16", "w_ptr": "*bf16", "ids_ptr": "*i64"}, 1),
    }
    found = []
    for name, (constexprs_by_name, pointers, warps) in kernels.items():
        fn = getattr(routing, name)
        signature, constexprs, attrs = {}, {}, {}
        for i, arg in enumerate(fn.arg_names):
            if arg in pointers:
                signature[arg] = pointers[arg]
                attrs[(i,)] = [["tt.divisibility", 16]]
            elif arg in constexprs_by_name:
                signature[arg], constexprs[(i,)] = "constexpr", constexprs_by_name[arg]
            else:
                signature[arg] = "i32"
        kernel = triton.compile(ASTSource(fn, signature, constexprs=constexprs, attrs=attrs),
                                target=GPUTarget("cuda", arch, 32), options=dict(num_warps=warps))
        found.append(dict(kernel=name, shared=kernel.metadata.shared))
    return found


@pytest.mark.parametrize("arch", TARGETS)
def test_router_kernels_compile(arch: int) -> None:
    pytest.importorskip("triton.backends.nvidia")
    env = {**os.environ, "TRITON_INTERPRET": "0"}  # compiled for real
    root = Path(__file__).resolve().parents[2]
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, __file__, str(arch)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    kernels = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [k["kernel"] for k in kernels] == ["_router_kernel", "_route_kernel"]
    assert all(k["shared"] <= SMEM_LIMIT for k in kernels), kernels


if __name__ == "__main__":
    print(json.dumps(_compile(int(sys.argv[1]))))
