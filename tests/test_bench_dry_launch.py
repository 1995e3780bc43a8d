"""perf/bench_dry_launch.py runs on a CPU (a stand-in sm_90 driver) and reports the cost of a dry launch."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_it_reports_the_cost_of_a_dry_launch(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"TRITON_CACHE_DIR": str(tmp_path)}
    for extra in ([], ["--without-early-cache"]):
        out = subprocess.run([sys.executable, str(ROOT / "perf" / "bench_dry_launch.py"), "--launches", "50", *extra],
                             env=env, capture_output=True, text=True, timeout=300, check=True).stdout
        assert "us per dry launch of a kernel in the disk cache (50 launches, 1 load)" in out, out
        assert ("without" in out) == bool(extra)
