"""perf/bench_startup.py on CPU (the tiny shape): every measurement runs and files its records, and the
after-ready record counts what the watch saw (nothing here: the interpreter compiles nothing)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "perf"))
import bench_startup  # noqa: E402


def test_a_warm_child_measures_everything_and_records_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OUT", str(tmp_path))
    bench_startup.main(["--shape", "tiny", "--device", "cpu", "--recipe", "none", "--child", "warm",
                        "--ttft-lanes", "2", "--prefill", "200", "--long", "300", "--decode-context", "16",
                        "--budgets", "32"])
    rows = [json.loads(line) for line in (tmp_path / "perf.jsonl").read_text().splitlines()]
    by_bench: dict[str, list[dict]] = {}
    for row in rows:
        by_bench.setdefault(row["bench"], []).append(row)
    ready = by_bench["startup_ready"][0]
    assert ready["shape"] == "tiny bf16 warm" and ready["target_ready_s"] == 15.0
    assert "engine set-up" in ready["phases_s"] and ready["compiled"] == 0
    assert [r["shape"] for r in by_bench["startup_ttft_batch"]] == ["tiny bf16 warm C=2 first",
                                                                    "tiny bf16 warm C=2 second"]
    assert by_bench["startup_prefill"][0]["prefill_chunk"] == 8192
    itl = by_bench["startup_itl_beside_prefill"]
    assert [r["prefill_tokens_while_decoding"] for r in itl] == [1024, 32]
    assert all(r["itl_p50_ms"] <= r["itl_p99_ms"] <= r["itl_max_ms"] and r["tpot_ms"] > 0 for r in itl)
    after = by_bench["startup_after_ready"][0]
    assert after["median_ms"] == 0 and after["first_events"] == []
