"""The parallel compile (:mod:`ninfer.kernels.precompile`), on CPU.

Real compiles: Triton compiles small kernels for an sm_90 target without a GPU, so a stand-in driver (device
0, an sm_90 target, no launcher) lets ``JITFunction.run`` bind, specialise and compile as on the GPU; a dry
pass never reaches a launch, and a launch that did would fail on the stand-in. These run in a child process
without the interpreter (as in ``test_compile_watch``: compiling for a real target fails in a process that
ran interpreted kernels). The orchestration (switches, the pool's concurrency, a failing dry pass, the dry
tuner, other threads) runs in-process with stand-in compile jobs.
"""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl
from triton.runtime.autotuner import Autotuner
from triton.runtime.jit import JITFunction

from ninfer.kernels import compile_watch, precompile
from ninfer.kernels.tuning import TunerState, default_tuner

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "perf"))
from bench_dry_launch import StandInDriver  # noqa: E402, I001  (the stand-in sm_90 driver, shared with the bench)

CHILD_ENV = "NINFER_PRECOMPILE_CHILD"


def _twice(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + i, tl.load(x_ptr + i, mask=i < n) * 2, mask=i < n)


def _in_a_fresh_process(test: str) -> bool:
    """Run ``test`` in a child pytest without the interpreter; True in that child."""
    if os.environ.get(CHILD_ENV) == "1":
        return True
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env[CHILD_ENV] = "1"
    env.pop(precompile.ENV, None)
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"{__file__}::{test}"],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    return False


@pytest.fixture
def compile_for_sm90(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A fresh Triton cache, the stand-in driver, compile events recorded with the compiling thread."""
    monkeypatch.setattr(precompile, "INTERPRET", False)  # the child's conftest set TRITON_INTERPRET, unread here
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    compile_watch.install()
    threads: list[str] = []
    ours = triton.knobs.compilation.listener
    monkeypatch.setattr(triton.knobs.compilation, "listener",
                        lambda **kw: (threads.append(threading.current_thread().name), ours(**kw)))
    # set_active, and the attribute it sets put back after (reset_active would look for a GPU driver)
    monkeypatch.setattr(triton.runtime.driver, "_active", triton.runtime.driver._active)
    triton.runtime.driver.set_active(StandInDriver())
    return threads


def _cached(kernel: JITFunction) -> dict:
    return kernel.device_caches[0][0]


def test_a_dry_pass_compiles_every_launch_on_the_pool_and_runs_none(compile_for_sm90: list[str]) -> None:
    if not _in_a_fresh_process("test_a_dry_pass_compiles_every_launch_on_the_pool_and_runs_none"):
        return
    kernel = JITFunction(_twice)
    x, y = torch.zeros(1024), torch.zeros(1024)
    run_before = JITFunction.run

    def dry_pass() -> None:
        for block in (32, 64, 128, 256, 64, 32):  # repeats: one compile each
            kernel[(1,)](x, y, 1024, BLOCK=block)

    with compile_watch.watch() as w:
        result = precompile.precompile(dry_pass, workers=2)
    assert result.ran and result.jobs == 4 and result.failed == 0 and result.workers == 2, result
    assert w.count(compile_watch.COMPILED) == 4
    assert len(compile_for_sm90) == 4 and all(t.startswith("ninfer-compile") for t in compile_for_sm90)
    assert JITFunction.run is run_before  # the dry launch is gone with the pass
    assert len(_cached(kernel)) == 4
    with compile_watch.watch() as again:  # what the real pass finds: compiled, in memory
        for block in (32, 64, 128, 256):
            compiled = kernel.warmup(x, y, 1024, BLOCK=block, grid=(1,))
            compiled = compiled.result() if hasattr(compiled, "result") else compiled
            assert ".target sm_90" in compiled.asm["ptx"]
    assert again.events == []


def test_repeated_launches_reach_tritons_compile_path_once_per_key(compile_for_sm90: list[str],
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A dry pass meets each kernel at every launch of its forwards; the pending kernel sits in the function's
    cache from its first launch, so the later ones skip Triton's compile path (which hashes libdevice's file
    each time); after the pass the cache holds the compiled kernels, nothing pending."""
    if not _in_a_fresh_process("test_repeated_launches_reach_tritons_compile_path_once_per_key"):
        return
    kernel = JITFunction(_twice)
    x, y = torch.zeros(1024), torch.zeros(1024)
    reached: list[object] = []
    original = JITFunction._do_compile
    monkeypatch.setattr(JITFunction, "_do_compile",
                        lambda self, key, *a, **kw: reached.append(key) or original(self, key, *a, **kw))

    def dry_pass() -> None:
        for _ in range(200):
            for block in (32, 64):
                kernel[(1,)](x, y, 1024, BLOCK=block)

    t0 = time.perf_counter()
    result = precompile.precompile(dry_pass, workers=2)
    print(f"400 dry launches, 2 compiles: {time.perf_counter() - t0:.2f} s")
    assert result.jobs == 2 and result.failed == 0 and len(reached) == 2
    assert len(_cached(kernel)) == 2 and not any(hasattr(k, "result") for k in _cached(kernel).values())


def test_an_autotuned_kernel_requests_every_config_and_keeps_no_choice(compile_for_sm90: list[str]) -> None:
    if not _in_a_fresh_process("test_an_autotuned_kernel_requests_every_config_and_keeps_no_choice"):
        return
    configs = [triton.Config({"BLOCK": b}, num_warps=w) for b, w in ((32, 1), (64, 2), (128, 4))]
    tuned = Autotuner(JITFunction(_twice), ["x_ptr", "y_ptr", "n"], configs, ["n"], None, None,
                      do_bench=lambda fn, quantiles: pytest.fail("a dry pass benchmarks nothing"))
    x, y = torch.zeros(512), torch.zeros(512)
    result = precompile.precompile(lambda: tuned[(1,)](x, y, 512), workers=2)
    assert result.jobs == 3 and result.failed == 0
    assert tuned.cache == {} and len(_cached(tuned.fn)) == 3


# -- orchestration, in-process ---------------------------------------------------------------------

@pytest.fixture
def compiling(monkeypatch: pytest.MonkeyPatch) -> None:
    """As on a GPU: not the interpreter, the switch at its default."""
    monkeypatch.setattr(precompile, "INTERPRET", False)
    monkeypatch.delenv(precompile.ENV, raising=False)


def _submit(key: str, seconds: float, done: list[str]) -> None:
    """A stand-in compile job through the active async mode, as ``JITFunction._do_compile`` submits one."""
    mode = triton.runtime._async_compile.active_mode.get()
    mode.submit(key, lambda: (time.sleep(seconds), key)[1], done.append)


def test_jobs_compile_concurrently_and_finish_before_it_returns(compiling: None) -> None:
    done: list[str] = []
    t0 = time.perf_counter()
    result = precompile.precompile(lambda: [_submit(f"k{i}", 0.3, done) for i in range(4)], workers=4)
    elapsed = time.perf_counter() - t0
    assert sorted(done) == ["k0", "k1", "k2", "k3"] and result.jobs == 4 and result.failed == 0
    assert elapsed < 0.9, elapsed  # one after another: 1.2 s


def test_a_failed_job_is_counted_and_not_raised(compiling: None) -> None:
    def dry_pass() -> None:
        mode = triton.runtime._async_compile.active_mode.get()
        mode.submit("bad", lambda: 1 / 0, lambda kernel: pytest.fail("a failed compile is not finalized"))

    result = precompile.precompile(dry_pass, workers=2)
    assert result.ran and result.jobs == 1 and result.failed == 1


def test_a_pending_kernel_whose_compile_failed_is_taken_out_of_the_cache(compiling: None) -> None:
    """So that its launch compiles it again (and meets the error itself) instead of finding a failed future."""
    caches: list[dict] = []

    class _Fn:  # what _do_compile reads of a JITFunction: its per-device caches
        def __init__(self) -> None:
            self.device_caches = {0: ({}, None, None, None, None)}
            caches.append(self.device_caches[0][0])

    def submit(self: _Fn, key: str, signature: object, device: int, *rest: object) -> object:
        mode = triton.runtime._async_compile.active_mode.get()
        finalize = lambda compiled: self.device_caches[0][0].__setitem__(key, compiled)  # noqa: E731 (as Triton's)
        return mode.submit(key, (lambda: 1 / 0) if key == "bad" else (lambda: f"{key} compiled"), finalize)

    do_compile = precompile._dry_do_compile(submit)
    good, bad = _Fn(), _Fn()

    def dry_pass() -> None:
        do_compile(good, "good", None, 0)
        do_compile(bad, "bad", None, 0)
        assert "good" in caches[0] and "bad" in caches[1]  # pending, found by the pass's next launches

    result = precompile.precompile(dry_pass, workers=2)
    assert result.failed == 1 and "bad" not in caches[1] and caches[0] == {"good": "good compiled"}


def test_switched_off_it_runs_nothing(compiling: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(precompile.ENV, "0")
    result = precompile.precompile(lambda: pytest.fail("no dry pass when off"))
    assert not result.ran and result.reason == f"{precompile.ENV}=0"


def test_without_async_compile_or_in_the_interpreter_it_runs_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(precompile.ENV, raising=False)
    monkeypatch.setattr(precompile, "INTERPRET", True)
    assert "interpreter" in precompile.precompile(lambda: pytest.fail("no dry pass")).reason
    monkeypatch.setattr(precompile, "INTERPRET", False)
    monkeypatch.setattr(precompile, "SUPPORTED", False)
    result = precompile.precompile(lambda: pytest.fail("no dry pass"))
    assert not result.ran and "AsyncCompileMode" in result.reason


def test_this_triton_supports_it() -> None:
    assert precompile.SUPPORTED, triton.__version__


def test_a_failing_dry_pass_warns_and_leaves_nothing_patched(compiling: None) -> None:
    run_before, tune_before, tuner_before = JITFunction.run, Autotuner.run, default_tuner()

    def dry_pass() -> None:
        assert isinstance(default_tuner(), precompile.DryTuner)
        raise ValueError("boom")

    with pytest.warns(RuntimeWarning, match="dry pass failed"):
        result = precompile.precompile(dry_pass, workers=1)
    assert result.ran and "boom" in result.reason
    assert (JITFunction.run, Autotuner.run, default_tuner()) == (run_before, tune_before, tuner_before)
    assert triton.runtime._async_compile.active_mode.get() is None


def test_only_the_dry_threads_launches_are_dry() -> None:
    calls: list[tuple[str, bool]] = []

    def original(self: object, *args: object, grid: object, warmup: bool, **kwargs: object) -> None:
        calls.append((threading.current_thread().name, warmup))

    run = precompile._dry_jit_run(original)
    with precompile.dry_launches():
        run(None, grid=(1,), warmup=False)
        other = threading.Thread(target=lambda: run(None, grid=(1,), warmup=False), name="other")
        other.start()
        other.join()
    run(None, grid=(1,), warmup=False)
    assert calls == [("MainThread", True), ("other", False), ("MainThread", False)]


def test_muted_drops_only_this_threads_events() -> None:
    with compile_watch.watch() as w:
        with compile_watch.muted():
            compile_watch.record(compile_watch.TUNE_LOADED, "table", "(1)")
            other = threading.Thread(target=lambda: compile_watch.record(compile_watch.COMPILED, "k", "[]"))
            other.start()
            other.join()
        compile_watch.record(compile_watch.TUNED, "table", "(2)")
    assert [e.kind for e in w.events] == [compile_watch.COMPILED, compile_watch.TUNED]


# -- the dry tuner ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Cfg:
    name: str


A, B, C = _Cfg("a"), _Cfg("b"), _Cfg("c")


class _Tunable(TunerState):
    """A tuner state that may time (as on a GPU)."""

    def tunable(self, device: torch.device) -> bool:
        return True


def _choose(tuner: TunerState, timed: list[list[_Cfg]]) -> _Cfg:
    def time_fn(cands: list[_Cfg]) -> dict[_Cfg, float]:
        timed.append(list(cands))
        return {c: 1.0 for c in cands}
    return tuner.choose("table", ("k",), lambda: [A, B, C], time_fn, torch.device("cpu"))


def test_the_dry_tuner_launches_every_candidate_of_a_new_key_and_stores_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NINFER_TUNE_CACHE", str(tmp_path))
    monkeypatch.setattr(precompile, "stored_config", lambda table, key, cands, device: None)
    real, timed = _Tunable(), []
    assert _choose(precompile.DryTuner(real), timed) == A
    assert timed == [[A, B, C]] and real.chosen("table") == {} and not any(tmp_path.iterdir())


def test_the_dry_tuner_launches_only_the_config_the_real_tuner_will_take(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NINFER_TUNE_CACHE", "off")  # the real state's choice stays in memory
    monkeypatch.setattr(precompile, "stored_config", lambda table, key, cands, device: B)
    timed: list[list[_Cfg]] = []
    assert _choose(precompile.DryTuner(_Tunable()), timed) == B and timed == [[B]]  # stored on disk

    real = _Tunable()
    _choose(real, [])  # the real state chose A (equal timings: the first)
    timed = []
    assert _choose(precompile.DryTuner(real), timed) == A and timed == []  # chosen: already compiled

    untunable, timed = TunerState(), []  # on CPU: the favourite, never timed
    assert _choose(precompile.DryTuner(untunable), timed) == A and timed == []


def test_do_bench_in_a_dry_pass_calls_its_function_once_and_times_nothing() -> None:
    calls: list[int] = []
    with precompile.dry_launches():
        assert triton.testing.do_bench(lambda: calls.append(1), warmup=5, rep=20) == 0.0
        assert triton.testing.do_bench(lambda: calls.append(1), quantiles=(0.5, 0.2)) == [0.0, 0.0]
    assert calls == [1, 1] and not getattr(triton.testing.do_bench, "__wrapped__", None)


def test_graph_timing_in_a_dry_pass_calls_its_function_once_and_captures_nothing() -> None:
    from ninfer.kernels.quant_gemm import timing

    calls: list[int] = []
    with precompile.dry_launches():  # no CUDA here: a capture would raise
        assert timing.graph_ms(lambda: calls.append(1)) == 0.0
    assert calls == [1]
