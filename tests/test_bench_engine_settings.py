"""perf/bench_engine.py's engine list: ``--toggle NAME=V1,V2`` and ``--settings base A=1+B=0 ...`` (several switches in
one process), parsed, and run end to end on a CPU (the tiny shape): one engine per setting, each built under its own
environment and no other's, its records labelled by it."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "perf"))
import bench_engine  # noqa: E402


def test_the_engine_lists() -> None:
    assert bench_engine.toggles(None) == [None]
    assert bench_engine.toggles("A=1,0,1") == [{"A": "1"}, {"A": "0"}, {"A": "1"}]
    assert bench_engine.toggles(None, ["base", "A=1", "B=0+C=x"]) == [{}, {"A": "1"}, {"B": "0", "C": "x"}]
    for bad in (["A"], ["A=1+B"], ["=1"]):
        with pytest.raises(SystemExit, match="--settings"):
            bench_engine.toggles(None, bad)
    with pytest.raises(SystemExit, match="give one"):
        bench_engine.toggles("A=1", ["base"])


def test_each_engine_sees_its_own_setting_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OUT", str(tmp_path))
    monkeypatch.setenv("NINFER_TEST_B", "given")
    monkeypatch.delenv("NINFER_TEST_A", raising=False)
    seen = []
    real = bench_engine.random_llm

    def spy(*args, **kwargs):
        import os

        seen.append((os.environ.get("NINFER_TEST_A"), os.environ.get("NINFER_TEST_B")))
        return real(*args, **kwargs)

    monkeypatch.setattr(bench_engine, "random_llm", spy)
    monkeypatch.setattr(sys, "argv", ["bench_engine.py", "--shape", "tiny", "--device", "cpu", "--contexts", "32",
                                      "--lanes", "1", "--steps", "2", "--settings", "base", "NINFER_TEST_A=1",
                                      "NINFER_TEST_B=0+NINFER_TEST_A=2", "base"])
    bench_engine.main()
    assert seen == [(None, "given"), ("1", "given"), ("2", "0"), (None, "given")]
    labels = {json.loads(line)["shape"] for line in (tmp_path / "perf.jsonl").read_text().splitlines()}
    assert any(label.endswith(" base ctx=32") for label in labels), labels
    assert any("NINFER_TEST_B=0+NINFER_TEST_A=2" in label for label in labels), labels
