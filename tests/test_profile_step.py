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


def test_graph_timeline_busy_concurrent_and_idle_time() -> None:
    """Two streams: kernels [0, 10) and [20, 30) on stream 7, [5, 25) on stream 9 (µs): busy 30 of a 30 µs span,
    two at once during [5, 10) and [20, 25), nothing idle; over 2 steps, halved."""
    import graph_timeline

    trace = {"traceEvents": [
        {"cat": "kernel", "name": "a", "ts": 0, "dur": 10, "args": {"stream": 7}},
        {"cat": "kernel", "name": "b", "ts": 5, "dur": 20, "args": {"stream": 9}},
        {"cat": "kernel", "name": "c", "ts": 20, "dur": 10, "args": {"stream": 7}},
        {"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 50},
    ]}
    found = graph_timeline.summarize(graph_timeline.kernel_intervals(trace), steps=2)
    assert found["kernels"] == 1.5 and found["streams"]["7"] == {"kernels": 1.0, "ms": 0.01}
    assert (found["kernel_ms"], found["busy_ms"], found["concurrent_ms"], found["span_ms"], found["idle_ms"]) == \
        pytest.approx((0.02, 0.015, 0.005, 0.015, 0.0))
    gap = graph_timeline.summarize([(0.0, 1.0, 1), (3.0, 4.0, 1)])  # one stream, 2 µs between its kernels
    assert gap["idle_ms"] == pytest.approx(0.002) and gap["concurrent_ms"] == 0.0 and gap["long_gap_ms"] == 0.0
    host = graph_timeline.summarize([(0.0, 1.0, 1), (3.0, 4.0, 1), (54.0, 55.0, 1)])  # 50 µs: the host's gap
    assert host["idle_ms"] == pytest.approx(0.052) and host["long_gap_ms"] == pytest.approx(0.05)
    assert graph_timeline.summarize([])["kernels"] == 0


def test_timeline_flag_runs_on_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a CPU the engine runs without graphs: the flag adds nothing, the eager profile files its record."""
    monkeypatch.setenv("OUT", str(tmp_path))
    profile_step.main(["--shape", "tiny", "--device", "cpu", "--steps", "2", "--top", "3", "--timeline"])
    rows = [json.loads(line) for line in (tmp_path / "perf.jsonl").read_text().splitlines()]
    assert [r["bench"] for r in rows] == ["profile_step"]
