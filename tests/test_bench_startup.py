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
                        "--budgets", "32", "--stalls", "3x"])
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
    assert [r["prefill_tokens_while_decoding"] for r in itl] == [1024, 32, 1024]
    assert [r["max_decode_stall"] for r in itl] == [None, None, "3x"]
    assert itl[2]["shape"].endswith("max_decode_stall=3x") and itl[1]["shape"].endswith("budget=32")
    assert itl[1]["chunk_tokens_max"] <= 32 < itl[0]["chunk_tokens_max"]
    assert all(r["itl_p50_ms"] <= r["itl_p99_ms"] <= r["itl_max_ms"] and r["tpot_ms"] > 0 for r in itl)
    after = by_bench["startup_after_ready"][0]
    assert after["median_ms"] == 0 and after["first_events"] == []


def test_compile_both_starts_each_mode_once_per_setting_with_caches_of_its_own(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from ninfer.kernels import precompile

    started: list[tuple[str, str, str | None, str]] = []

    class Done:
        returncode = 0

    def run(cmd: list[str], env: dict, **kw: object) -> Done:
        started.append((cmd[cmd.index("--child") + 1], cmd[len(cmd) - 1 - cmd[::-1].index("--compile") + 1],
                        env.get(precompile.ENV), env["TRITON_CACHE_DIR"]))
        return Done()

    monkeypatch.setenv(precompile.ENV, "0")  # the parent's own setting does not leak into the parallel children
    monkeypatch.setattr(bench_startup.subprocess, "run", run)
    bench_startup.main(["--shape", "tiny", "--modes", "cold", "warm", "--compile", "both"])
    assert [(m, s, e) for m, s, e, _ in started] == [("cold", "parallel", None), ("warm", "parallel", None),
                                                      ("cold", "serial", "0"), ("warm", "serial", "0")]
    caches = [c for *_, c in started]
    assert caches[0] == caches[1] != caches[2] == caches[3]
