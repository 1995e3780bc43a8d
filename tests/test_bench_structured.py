"""perf/bench_structured.py on CPU (the tiny shape): free and constrained requests run to their length limit and
write their records, which perf/report.py knows where to file, and the compile record has its cached time (no
timing is asserted: a loaded CI machine once made the cached compile the slower one)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "perf"))
import bench_structured  # noqa: E402
import report  # noqa: E402

pytest.importorskip("xgrammar")


def test_free_and_constrained_rows_and_compile_times(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OUT", str(tmp_path))
    bench_structured.main(["--shape", "tiny", "--device", "cpu", "--lanes", "1", "2", "--tokens", "8"])
    rows = [json.loads(line) for line in (tmp_path / "perf.jsonl").read_text().splitlines()]
    compile_row = next(r for r in rows if r["bench"] == "structured_compile")
    # both times recorded (which is faster is a measurement, not a property: on a loaded CPU the order can flip)
    assert compile_row["cached_ms"] > 0 and compile_row["median_ms"] > 0 and compile_row["tokenizer_vocab"] > 256
    decode = [r for r in rows if r["bench"] == "structured_decode"]
    assert [r["shape"] for r in decode] == ["tiny bf16 C=1 regex", "tiny bf16 C=2 regex"]
    assert all(r["fewest_tokens"] == 8 and r["speedup_vs_baseline"] > 0 for r in decode)
    assert {report.topic(r) for r in rows} == {"structured-tiny-bf16"}  # perf/report.py --add files them


def test_the_host_profile_prints_a_free_and_a_constrained_round(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OUT", str(tmp_path))
    bench_structured.main(["--shape", "tiny", "--device", "cpu", "--lanes", "1", "--tokens", "6", "--profile"])
    out = capsys.readouterr().out
    free = out[out.index("host profile, free"):out.index("host profile, constrained")]
    constrained = out[out.index("host profile, constrained"):]
    assert "ncalls" in free and "ncalls" in constrained
