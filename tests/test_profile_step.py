"""perf/profile_step.py on CPU (the tiny shape): the chunked-prefill and mixed-step modes run end to end, with
the host profiles, and file one record each (no kernel times on a CPU)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "perf"))
import profile_step  # noqa: E402


@pytest.mark.parametrize("mode", [["--prefill", "64", "--chunk", "16"],
                                  ["--mixed", "48", "--chunk", "16", "--context", "24", "--steps", "2"]])
def test_a_mode_profiles_and_files_its_record(mode: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setenv("OUT", str(tmp_path))
    profile_step.main(["--shape", "tiny", "--device", "cpu", "--host", "--top", "5", *mode])
    text = capsys.readouterr().out
    assert "host time by op (torch.profiler" in text and "host time by tottime (cProfile" in text
    (row,) = [json.loads(line) for line in (tmp_path / "perf.jsonl").read_text().splitlines()]
    assert row["bench"] == "profile_step" and row["median_ms"] > 0
    if mode[0] == "--mixed":  # the long prompt had reached the asked context before the profiled steps
        ctx = int(row["shape"].rsplit("ctx=", 1)[1])
        assert row["shape"].startswith("tiny bf16 mixed 4 decodes + chunk=16 at ctx=") and ctx >= 48 + 2 * 16
    else:
        assert row["shape"] == "tiny bf16 prefill T=64 chunk=16"
