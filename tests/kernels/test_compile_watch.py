"""The compile / tune watch (:mod:`ninfer.kernels.compile_watch`), on CPU.

Compilations are real: Triton compiles a small kernel for an sm_90 target without a GPU (ptxas ships
with it) into a temporary cache directory, so the listener sees a compile and then a disk-cache load.
``triton.autotune`` benchmarking goes through a real ``Autotuner`` over a stand-in kernel object whose
launches are recorded (nothing can launch here); the ninfer tuners run with faked timings as in
``test_tune_cache``.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.runtime.autotuner import Autotuner
from triton.runtime.jit import JITFunction

from ninfer.kernels import compile_watch, tune_cache
from ninfer.kernels.quant_gemm import tune as quant_gemm_tune
from ninfer.kernels.quant_gemm.tune import GemmConfig, select_config
from ninfer.kernels.tuning import TunerState, use_tuner


def _add_one(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + i, tl.load(x_ptr + i, mask=i < n) + 1, mask=i < n)


# A JITFunction even where the CPU tests run the interpreter (triton.jit would give an InterpretedFunction).
_ADD_ONE = JITFunction(_add_one)


def _compile(block: int) -> None:
    src = triton.compiler.ASTSource(_ADD_ONE, signature={"x_ptr": "*fp32", "y_ptr": "*fp32", "n": "i32",
                                                         "BLOCK": "constexpr"}, constexprs={"BLOCK": block})
    triton.compile(src, target=GPUTarget("cuda", 90, 32))


def test_this_triton_is_fully_watched() -> None:
    assert compile_watch.install() == {"compilations": True, "autotune": True}, triton.__version__


def _in_a_fresh_process(test: str) -> bool:
    """Run ``test`` in a child pytest without the interpreter and say whether this is that child. Compiling
    for a real target after other tests ran kernels in the Triton interpreter (which patches
    ``triton.language`` while it runs) fails in-process, so these tests compile in a process of their own."""
    if os.environ.get("NINFER_COMPILE_WATCH_CHILD") == "1":
        return True
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["NINFER_COMPILE_WATCH_CHILD"] = "1"
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"{__file__}::{test}"],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    return False


def test_compilations_compiled_then_loaded_from_the_disk_cache(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    if not _in_a_fresh_process("test_compilations_compiled_then_loaded_from_the_disk_cache"):
        return
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    with compile_watch.watch() as w:
        _compile(128)
        _compile(128)  # a new process would find it in the cache directory
        _compile(64)
    _compile(32)  # after the block: not the watch's
    kinds = [(e.kind, e.name, e.key) for e in w.events]
    assert kinds == [("compiled", "_add_one", "[BLOCK=128] num_warps=4, num_stages=3"),
                     ("loaded", "_add_one", "[BLOCK=128] num_warps=4, num_stages=3"),
                     ("compiled", "_add_one", "[BLOCK=64] num_warps=4, num_stages=3")]
    assert w.count("compiled") == 2 and w.count("loaded") == 1 and len(w.stalls()) == 3
    assert w.summary().startswith("2 kernels compiled, 1 loaded from Triton's cache; 0 tuner keys timed")
    assert "compiled _add_one [BLOCK=64]" in w.describe()


def test_a_listener_set_before_keeps_being_called(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if not _in_a_fresh_process("test_a_listener_set_before_keeps_being_called"):
        return
    compile_watch.install()
    seen: list[bool] = []
    ours = triton.knobs.compilation.listener
    monkeypatch.setattr(triton.knobs.compilation, "listener",
                        lambda **kw: (seen.append(kw["cache_hit"]), ours(**kw)))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    with compile_watch.watch() as w:
        _compile(16)
    assert seen == [False] and w.count("compiled") == 1


class _StandIn:
    """What an ``Autotuner`` wraps: a ``fn`` (the Python function) and ``run`` (the launch)."""

    def __init__(self) -> None:
        self.fn, self.arg_names, self.launches = self._kernel, ["x", "N"], []

    @staticmethod
    def _kernel(x, N, BLOCK):  # noqa: N803 (Triton argument names)
        pass

    def run(self, *args, **kwargs) -> None:
        self.launches.append(kwargs["BLOCK"])


def test_autotune_benchmarks_count_once_per_key() -> None:
    compile_watch.install()
    kernel = _StandIn()
    configs = [triton.Config({"BLOCK": 16}), triton.Config({"BLOCK": 32})]
    tuner = Autotuner(kernel, ["x", "N"], configs, ["N"], None, None,
                      do_bench=lambda fn, quantiles: (fn(), [1.0, 1.0, 1.0])[1])
    with compile_watch.watch() as w:
        tuner.run(0, 64, grid=(1,))  # benchmarks both configs, then launches the chosen one
        tuner.run(0, 64, grid=(1,))  # the key is known: no benchmark
        tuner.run(0, 128, grid=(1,))
    assert [(e.kind, e.key) for e in w.events] == [("autotuned", "(64)"), ("autotuned", "(128)")]
    assert w.events[0].name == "_kernel" and len(kernel.launches) == 2 + 1 + 1 + 2 + 1


def test_tuner_timings_and_tune_cache_reads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NINFER_TUNE_CACHE", str(tmp_path))
    monkeypatch.setattr(tune_cache, "file_parts", lambda device: {"gpu": "NVIDIA H200", "capability": "9.0"})
    tuner = TunerState()
    monkeypatch.setattr(tuner, "tunable", lambda device: True)
    monkeypatch.setattr(quant_gemm_tune, "autotune_configs", lambda cfgs: cfgs)

    def time_candidates(cands: list[GemmConfig], launch, graphs: bool) -> dict[GemmConfig, float]:
        return {c: float(i) for i, c in enumerate(cands)}

    monkeypatch.setattr(quant_gemm_tune, "time_candidates", time_candidates)
    x = torch.zeros(1, 64)

    def new_process_select() -> None:
        tune_cache.forget()
        tuner.clear()
        select_config("int4-g64", x, 32, 64, False, False, lambda cfg: None)

    try:
        with use_tuner(tuner), compile_watch.watch() as first:
            new_process_select()
            select_config("int4-g64", x, 32, 64, False, False, lambda cfg: None)  # in memory now: nothing
        with use_tuner(tuner), compile_watch.watch() as second:
            new_process_select()
    finally:
        tune_cache.forget()
    assert [(e.kind, e.name) for e in first.events] == [("tuned", "quant_gemm")]
    assert first.events[0].key.startswith("(int4-g64, torch.float32, 1, 32, 64, False, False")
    assert [(e.kind, e.name) for e in second.events] == [("tune-loaded", "quant_gemm")]
    assert "0 kernels compiled" in second.summary() and "1 from the tune cache" in second.summary()


def test_a_triton_without_hooks_warns_and_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compile_watch, "SUPPORT", {"compilations": False, "autotune": True})
    monkeypatch.setattr(compile_watch, "_installed", [])
    monkeypatch.setattr(triton.knobs.compilation, "listener", triton.knobs.compilation.listener)
    with pytest.warns(RuntimeWarning, match="no hook for compilations"):
        w = compile_watch.Watch()
    assert not w.complete and "not all counted" in w.summary()
