"""The start-up report (:mod:`ninfer.runtime.startup`): exclusive phase times, counts, what load prints."""
from __future__ import annotations

import time

import pytest

import ninfer
from ninfer.kernels import compile_watch
from ninfer.runtime import startup
from tiny_checkpoints import TinyCheckpoint


def test_nested_phases_are_exclusive_and_count_their_own_events() -> None:
    report = startup.begin()
    with startup.phase("outer"):
        time.sleep(0.05)
        compile_watch.record(compile_watch.COMPILED, "k_outer", "[A=1]")
        with startup.phase("inner"):
            time.sleep(0.1)
            compile_watch.record(compile_watch.TUNED, "quant_gemm", "(key)")
            compile_watch.record(compile_watch.LOADED, "k_inner", "[A=2]")
    with startup.phase("inner"):  # a phase met twice adds up
        time.sleep(0.05)
    assert startup.finish() is report and startup.finish() is None
    outer, inner = report.phases["outer"], report.phases["inner"]
    assert 0.05 <= outer.seconds < 0.1 and 0.15 <= inner.seconds < 0.25
    assert (outer.events, inner.events) == (1, 2) and (outer.compiles, inner.compiles) == (1, 1)
    assert report.ready_s >= outer.seconds + inner.seconds and report.other_s >= 0
    d = report.as_dict()
    assert (d["compiled"], d["loaded_from_triton_cache"], d["tuned"], d["loaded_from_tune_cache"]) == (1, 1, 1, 0)
    assert set(d["phases_s"]) == {"outer", "inner"}
    text = report.describe()
    assert text.startswith(f"ready in {report.ready_s:.1f} s: outer ") and "(2 new kernels/tunings)" in text
    assert "1 kernels compiled, 1 loaded from Triton's cache; 1 tuner keys timed" in text


def test_phases_outside_a_report_time_nothing() -> None:
    assert startup.finish() is None

    @startup.timed("warm-up")
    def work(x: int) -> int:
        return x + 1

    assert work(1) == 2  # no report open: the decorator only calls through
    report = startup.begin()
    assert work(2) == 3 and "warm-up" in startup.finish().phases
    assert report.phases["warm-up"].seconds >= 0


def test_load_prints_the_report_when_ready(dense_ckpt: TinyCheckpoint, capsys: pytest.CaptureFixture) -> None:
    llm = ninfer.load(dense_ckpt.path, device="cpu", max_concurrency=1, progress=True)
    err = capsys.readouterr().err
    report = llm.startup
    assert report is not None and report.ready_s > 0
    assert {"model build/quantize", "weights read", "engine set-up"} <= set(report.phases)
    # On CPU there are no CUDA graphs and no warm-up, and the interpreter compiles nothing.
    assert "graph capture" not in report.phases and "warm-up" not in report.phases
    lines = [line for line in err.splitlines() if line.startswith("ninfer: ")]
    assert lines[0].startswith("ninfer: ready in ") and "weights read" in lines[0]
    assert lines[1].startswith("ninfer: start-up 0 kernels compiled, 0 loaded from Triton's cache")
    quiet = ninfer.load(dense_ckpt.path, device="cpu", max_concurrency=1, progress=False)
    assert "ready in" not in capsys.readouterr().err and quiet.startup.ready_s > 0


def test_the_parallel_compile_is_a_phase_with_its_count(monkeypatch: pytest.MonkeyPatch) -> None:
    from ninfer.kernels import precompile

    def compile_in_parallel(dry_pass):  # as precompile.precompile: the pool's compiles are events of the phase
        dry_pass()
        compile_watch.record(compile_watch.COMPILED, "k", "[A=1]")
        compile_watch.record(compile_watch.COMPILED, "k", "[A=2]")
        return precompile.Precompiled(ran=True, jobs=2, failed=1, workers=16, seconds=0.0)

    monkeypatch.setattr(precompile, "disabled_reason", lambda: None)
    monkeypatch.setattr(precompile, "precompile", compile_in_parallel)
    report = startup.begin()
    passes: list[str] = []
    with startup.phase("warm-up"):
        startup.parallel_compile(lambda: passes.append("dry"))
        passes.append("real")
    startup.finish()
    assert passes == ["dry", "real"]
    assert list(report.phases) == ["warm-up", startup.PARALLEL_COMPILE]
    assert report.phases[startup.PARALLEL_COMPILE].events == 2 and report.phases["warm-up"].events == 0
    assert report.as_dict()["phases_compiles"] == {"warm-up": 0, startup.PARALLEL_COMPILE: 2}
    assert report.describe().endswith(
        "; parallel compile: 2 kernels on 16 threads (1 failed, compiled again at launch)")
    assert report.as_dict()["parallel_compile"] == {"on": True, "kernels": 2, "failed": 1, "workers": 16, "reason": ""}


def test_switched_off_the_parallel_compile_is_no_phase_and_the_report_says_why(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from ninfer.kernels import precompile

    monkeypatch.setenv(precompile.ENV, "0")
    report = startup.begin()
    result = startup.parallel_compile(lambda: pytest.fail("no dry pass when off"))
    startup.finish()
    assert not result.ran and startup.PARALLEL_COMPILE not in report.phases
    assert report.describe().endswith(f"; parallel compile off ({precompile.ENV}=0)")
    assert report.as_dict()["parallel_compile"]["on"] is False
