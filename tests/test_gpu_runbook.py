"""perf/gpu_runbook.sh: named stages, unknown names refused before anything runs, and a stage's parts logged
in order under the call's deadline (run here with stand-ins for python3 and nvidia-smi: no GPU needed)."""
from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNBOOK = ROOT / "perf" / "gpu_runbook.sh"


def _run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(RUNBOOK), *args], capture_output=True, text=True, timeout=60,
                          env={**os.environ, **(env or {})})


def test_list_names_every_stage_with_what_it_measures() -> None:
    listed = _run("--list")
    assert listed.returncode == 0
    lines = [line.split(None, 1) for line in listed.stdout.splitlines()[1:] if line.strip()]
    names = [name for name, _ in lines]
    assert {"verify-fused", "bench-27b-step", "engine-27b-int4", "quant-gemm-decode", "profile-27b",
            "ncu-gemm-mma", "gpu-tests-model", "startup-27b-int4"} <= set(names)
    assert all(len(what) > 20 for _, what in lines) and len(names) == len(set(names))
    assert not any(name.isdigit() for name in names)


def test_unknown_or_missing_stage_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "out"
    bad = _run("engine-27b-int4", "engine.27b", env={"OUT": str(out)})
    assert bad.returncode == 2 and "unknown stage 'engine.27b'" in bad.stderr
    assert not out.exists()  # refused before anything ran
    assert _run().returncode != 0


def test_stage_parts_run_in_order_under_the_deadline(tmp_path: Path) -> None:
    fake = tmp_path / "bin"
    fake.mkdir()
    for tool in ("python3", "nvidia-smi"):
        (fake / tool).write_text('#!/bin/sh\necho "stand-in $0 $*"\n')
        (fake / tool).chmod(0o755)
    out = tmp_path / "out"
    env = {"OUT": str(out), "PATH": f"{fake}:{os.environ['PATH']}", "RUNBOOK_SHARED": "1"}
    done = _run("bench-27b-step", env=env)
    assert done.returncode == 0, done.stderr
    log = (out / "runbook.log").read_text().splitlines()
    started = [line for line in log if line.startswith("=== ") and "[" in line]
    assert len(started) == 2
    assert "[150s]" in started[0] and "bench_engine.py --shape 27b --recipe int4" in started[0]
    assert "[120s]" in started[1] and "profile_step.py --shape 27b --recipe int4 --lanes 8" in started[1]
    assert sum(line.startswith("--- rc=0") for line in log) == 2
    # a part gets at most what is left of the call's deadline (less 20 s for the cache), none below 10 s
    # (a loaded machine may take a second or two before a part starts: 100 s leaves 78-80 s then)
    for budget, expect in (("100", r"\[(7[89]|80)s\]"), ("30", r"--- skipped \(deadline\)")):
        folder = tmp_path / f"budget{budget}"
        assert _run("bench-27b-step", env={**env, "OUT": str(folder), "BUDGET": budget}).returncode == 0
        assert len(re.findall(expect, (folder / "runbook.log").read_text())) == 2
