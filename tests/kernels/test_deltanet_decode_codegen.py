"""The one-launch DeltaNet decode kernel compiled for sm_90 (H200) on any host, every autotune config: within
the 99 KB of shared memory an RTX 5090 block has, without converting the fp32 state block between register
layouts through shared memory (a conv window in per-tap vectors once caused it), and with the last program's
tail loads issued before its stores, which the interpreter cannot show (``perf/deltanet_sass.py`` prints it)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

PERF = Path(__file__).resolve().parents[2] / "perf"
sys.path.insert(0, str(PERF))
from deltanet_sass import CASES  # noqa: E402  (27B decode and verification rows, 35B-A3B decode)

SMEM_LIMIT = 99 * 1024


def _compile(*case: int) -> list[dict]:
    """Per config: shared memory, and the tail's global loads / barriers / stores (``sass_tools.memory_order``)."""
    from deltanet_sass import compile_decode, configs
    from sass_tools import memory_order

    found = []
    for cfg in configs():
        kernel = compile_decode(case, cfg)
        found.append(dict(num_warps=cfg.num_warps, block=cfg.kwargs["BV"], shared=kernel.metadata.shared,
                          tail=memory_order(kernel)))
    return found


@pytest.mark.parametrize("case", CASES, ids=lambda c: "hk{}-hv{}-dk{}-dv{}-t{}-slots{}-gates{}".format(*c))
def test_decode_kernel_shared_memory_on_sm90(case: tuple[int, ...]) -> None:
    pytest.importorskip("triton.backends.nvidia")
    env = {**os.environ, "TRITON_INTERPRET": "0"}  # compiled for real
    env.pop("NINFER_AUTOTUNE", None)  # every autotune config
    root = Path(__file__).resolve().parents[2]
    env["PYTHONPATH"] = os.pathsep.join([str(root), str(PERF), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, __file__, json.dumps(case)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    configs = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(configs) >= 1
    for config in configs:
        block_bytes = case[2] * min(config["block"], case[3]) * 4  # the program's state block, fp32
        assert config["shared"] <= SMEM_LIMIT, config
        assert config["shared"] < block_bytes // 2, config  # reductions and vector conversions only
        # The last program of a key head issues its tail's loads together: no store between two runs of loads
        # (before, each window set and each value head's norm was a round trip of its own: 5 at decode, 12 at a
        # 4-token verification).
        runs = config["tail"].split()
        stores = [i for i, run in enumerate(runs) if run.startswith("STG")]
        loads = [i for i, run in enumerate(runs) if run.startswith("LDG")]
        assert loads and stores and max(loads) < min(stores), config


if __name__ == "__main__":
    print(json.dumps(_compile(*json.loads(sys.argv[1]))))
