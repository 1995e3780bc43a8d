"""The one-launch DeltaNet decode kernel compiled for sm_90 (H200) on any host, every autotune config: within
the 99 KB of shared memory an RTX 5090 block has, and without converting the fp32 state block
between register layouts through shared memory (a conv window in per-tap vectors once caused it), which the
interpreter cannot show."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# (hk, hv, dk, dv, tokens, per-token slots, hidden size of gates projected in the kernel, 0: a and b given):
# 27B decode and verification rows, 35B-A3B decode.
CASES = [(16, 48, 128, 128, 1, 0, 0), (16, 48, 128, 128, 1, 0, 5120), (16, 48, 128, 128, 4, 1, 5120),
         (16, 32, 128, 128, 1, 0, 2048)]
SMEM_LIMIT = 99 * 1024


def _compile(hk: int, hv: int, dk: int, dv: int, tokens: int, per_token: int, hidden: int) -> list[dict]:
    """Shared memory of each config (bf16 activations and weights, fp32 state; pointers 16-byte aligned)."""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from ninfer.kernels.deltanet import decode

    fn = decode._decode_kernel.fn
    fp32 = {"A_log", "dt_bias", "state", "sumsq"}
    ints = {"cu_seqlens": "i32", "slot_ids": "i64", "out_slots": "i64", "counters": "i32"}
    const = dict(HV=hv, GROUP=hv // hk, DK=dk, DV=dv, K=4, T_MAX=triton.next_power_of_2(tokens),
                 HAS_OUT_SLOTS=bool(per_token), WDT=tl.bfloat16, PROD_DTYPE=tl.bfloat16, GATES_FROM_X=hidden > 0,
                 H=max(hidden, 1), BH=min(decode.GATE_BLOCK, triton.next_power_of_2(max(hidden, 1))))
    pointers = set(fn.arg_names[:fn.arg_names.index("gate_w") + 1])
    found = []
    for cfg in decode._decode_kernel.configs:
        signature, constexprs, attrs = {}, {}, {}
        values = {**const, **cfg.kwargs}
        for i, name in enumerate(fn.arg_names):
            if name in pointers:
                signature[name] = "*" + ("fp32" if name in fp32 else ints.get(name, "bf16"))
                attrs[(i,)] = [["tt.divisibility", 16]]
            elif name in values:
                signature[name], constexprs[(i,)] = "constexpr", values[name]
            else:
                signature[name] = "fp32" if name in ("scale", "eps") else "i32"
        kernel = triton.compile(ASTSource(fn, signature, constexprs=constexprs, attrs=attrs),
                                target=GPUTarget("cuda", 90, 32), options=dict(num_warps=cfg.num_warps))
        found.append(dict(num_warps=cfg.num_warps, block=cfg.kwargs["BV"], shared=kernel.metadata.shared))
    return found


@pytest.mark.parametrize("case", CASES, ids=lambda c: "hk{}-hv{}-dk{}-dv{}-t{}-slots{}-gates{}".format(*c))
def test_decode_kernel_shared_memory_on_sm90(case: tuple[int, ...]) -> None:
    pytest.importorskip("triton.backends.nvidia")
    env = {**os.environ, "TRITON_INTERPRET": "0"}  # compiled for real
    env.pop("NINFER_AUTOTUNE", None)  # every autotune config
    root = Path(__file__).resolve().parents[2]
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, __file__, json.dumps(case)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    configs = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(configs) >= 1
    for config in configs:
        block_bytes = case[2] * min(config["block"], case[3]) * 4  # the program's state block, fp32
        assert config["shared"] <= SMEM_LIMIT, config
        assert config["shared"] < block_bytes // 2, config  # reductions and vector conversions only


if __name__ == "__main__":
    print(json.dumps(_compile(*json.loads(sys.argv[1]))))
