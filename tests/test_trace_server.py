"""perf/trace_server.py end to end on the CPU with perf/device_sim.py's stand-in device: every stage of the request
and token paths is found, and the simulated device's decode time is waited for (the decode left in flight lands
after it), as a GPU's would be. In a child process: the tool wraps server and engine classes for good."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "perf"))
import trace_server  # noqa: E402
from device_sim import DeviceTimes  # noqa: E402


def test_a_simulated_device_trace_covers_every_stage(tmp_path: Path) -> None:
    out = tmp_path / "trace.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, str(ROOT / "perf" / "trace_server.py"), "--simulate-device", "--requests", "2",
                    "--warmup", "1", "--prompt-tokens", "32", "--max-tokens", "3", "--json", str(out)],
                   check=True, env=env, capture_output=True, timeout=300)
    result = json.loads(out.read_text())
    assert result["requests"] == 2
    assert set(result["request_path"]) == {name for name, _, _ in trace_server.REQUEST_PATH + [trace_server.TOTAL_REQUEST]}
    assert set(result["first_token"]) == set(trace_server.TOKEN_STAGES) | {"total"}
    assert result["decode_token"]  # tokens after the first one reach the client too
    # a decode step lasts at least the device's time for it: the host reads its tokens only once they exist
    assert result["decode_step_ms"] >= DeviceTimes().decode_device_ms / 2
