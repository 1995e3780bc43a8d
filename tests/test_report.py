"""perf/report.py: records filed by topic with a run label; the newest run of a point is current; the history keeps
every run in order and the not-shipped records apart; every committed record sits in its topic's file."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("report", ROOT / "perf" / "report.py")
report = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(report)


def _record(bench: str, shape: str, ms: float, **extra) -> dict:
    return {"bench": bench, "shape": shape, "median_ms": ms, "achieved": 1000 / ms, "unit": "tok/s",
            "limit": float("nan"), "fraction_of_limit": float("nan"), "baseline": None, "baseline_ms": None,
            "speedup_vs_baseline": None, "gpu": "NVIDIA H200", "commit": "abc1234", "date": "2026-12-01", **extra}


def _write(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.mark.parametrize("record, name", [
    (_record("engine_decode_b1", "27b int4 ctx=1024", 10.0), "engine-27b-int4"),
    (_record("engine_prefill", "35b-a3b qwen3_5_35b_a3b_int4 T=8192 chunk=8192", 174.0), "engine-35b-a3b-qwen3_5_35b_a3b_int4"),
    (_record("spec_projected", "27b int4 C=1 K=3 2.7 tok/round ctx=1024", 14.0), "mtp-27b-int4"),
    (_record("server_ttft", "random-27b int4 C=1 P=512 T=64", 90.0), "server-27b-int4"),
    (_record("quant_gemm", "gate_up N=34816 K=5120 M=8 int4-g64 [mma]", 0.05, m=8), "quant-gemm-decode"),
    (_record("quant_gemm", "gate_up N=34816 K=5120 M=4096 int4-g64 [tuned]", 1.9, m=4096), "quant-gemm-prefill"),
    (_record("rms_norm+residual", "8192x5120", 0.1), "elementwise"),
    (_record("attention_decode_sweep", "B=1 ctx=8192", 0.1), "attention-sweeps"),
    (_record("prefix_ttft", "27b ctx=65536+100 cache=device", 70.0), "prefix-cache-27b"),
    (_record("startup_ready", "27b int4 cold", 90000.0), "startup-27b-int4"),
    (_record("engine_decode_b1", "27b int4 ctx=1024", 10.0, not_shipped="reverted"), "not-shipped"),
])
def test_topic_names_what_a_record_measures(record: dict, name: str) -> None:
    assert report.topic(record) == name


def test_unknown_bench_is_an_error_naming_it() -> None:
    with pytest.raises(ValueError, match="no_such_bench"):
        report.topic(_record("no_such_bench", "x", 1.0))


def test_add_labels_runs_and_the_newest_run_is_current(tmp_path: Path) -> None:
    results = tmp_path / "results"
    results.mkdir()
    first = _write(tmp_path / "a.jsonl", [_record("engine_decode_b1", "27b int4 ctx=1024", 11.0),
                                          _record("sampling", "greedy B=1", 0.02)])
    second = _write(tmp_path / "b.jsonl", [_record("engine_decode_b1", "27b int4 ctx=1024", 10.0)])
    assert report.add(first, results) == {"engine-27b-int4": 1, "sampling": 1}
    assert report.add(second, results) == {"engine-27b-int4": 1}
    engine = [json.loads(line) for line in (results / "engine-27b-int4.jsonl").read_text().splitlines()]
    assert [(r["run"], r["median_ms"]) for r in engine] == [("2026-12-01.1", 11.0), ("2026-12-01.2", 10.0)]
    now = {r["bench"]: r for r in report.current(report.load(results))}
    assert now["engine_decode_b1"]["median_ms"] == 10.0 and now["engine_decode_b1"]["run"] == "2026-12-01.2"
    assert now["sampling"]["run"] == "2026-12-01.1"
    rendered = report.render_current(report.load(results))
    assert "| 10 |" in rendered and "| 11 |" not in rendered


def test_runs_sort_by_number_not_text(tmp_path: Path) -> None:
    results = tmp_path / "results"
    results.mkdir()
    for run, ms in (("2026-12-01.10", 9.0), ("2026-12-01.9", 12.0)):
        report.add(_write(tmp_path / f"{run}.jsonl", [_record("engine_decode_b1", "27b int4 ctx=1024", ms)]),
                   results, run=run)
    assert report.current(report.load(results))[0]["median_ms"] == 9.0
    assert report.next_run(report.load(results), "2026-12-01") == "2026-12-01.11"


def test_not_shipped_records_stay_out_of_current_but_in_history(tmp_path: Path) -> None:
    results = tmp_path / "results"
    results.mkdir()
    report.add(_write(tmp_path / "a.jsonl", [_record("engine_decode_b1", "27b int4 ctx=1024", 11.0)]), results)
    report.add(_write(tmp_path / "b.jsonl", [_record("engine_decode_b1", "27b int4 ctx=1024", 8.0)]), results,
               not_shipped="a reverted kernel")
    records = report.load(results)
    assert [r["median_ms"] for r in report.current(records)] == [11.0]
    history = report.render_history(records)
    shipped, _, unshipped = history.partition("## Measured, not shipped")
    assert "| 11 |" in shipped and "| 8 |" not in shipped
    assert "### a reverted kernel" in unshipped and "| 8 |" in unshipped


def test_bad_input_is_a_clear_error(tmp_path: Path) -> None:
    results = tmp_path / "results"
    results.mkdir()
    empty = _write(tmp_path / "empty.jsonl", [])
    assert report.main(["--add", str(empty), "--results", str(results)]) == 2
    one = _write(tmp_path / "one.jsonl", [_record("sampling", "greedy B=1", 0.02)])
    with pytest.raises(ValueError, match="--run"):
        report.add(one, results, run="seventh")
    _write(results / "sampling.jsonl", [_record("sampling", "greedy B=1", 0.02)])  # filed by hand: no run label
    with pytest.raises(ValueError, match="without a run label"):
        report.load(results)
    with pytest.raises(SystemExit):
        report.main(["--current", "--run", "2026-12-01.1"])


def test_committed_records_sit_in_their_topic_files() -> None:
    records = report.load()
    assert records, "perf/results/ holds no records"
    for path in sorted(report.RESULTS.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            assert report.topic(record) == path.stem, (path.name, record["bench"], record["shape"])
            assert {"run", "date", "commit", "gpu"} <= set(record), (path.name, record["bench"])
    assert report.render_history(records).startswith("# Performance history (generated)")


def test_history_appendix_is_regenerated() -> None:
    committed = (ROOT / "docs" / "performance-history.md").read_text()
    assert committed == report.render_history(report.load()), \
        "run: python perf/report.py --history > docs/performance-history.md"


def test_performance_doc_cites_only_runs_that_exist() -> None:
    import re

    runs = {r["run"] for r in report.load()}
    cited = set(re.findall(r"\b\d{4}-\d{2}-\d{2}\.\d+\b", (ROOT / "docs" / "performance.md").read_text()))
    assert cited and cited <= runs, sorted(cited - runs)
