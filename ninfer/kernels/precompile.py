"""Compile the Triton kernels a piece of work will launch, many at once, before it runs.

Triton compiles a kernel specialisation the first time it is launched, on the launching thread, and the
launch waits for it: a warm-up that meets a few hundred specialisations compiles them one after another.
:func:`precompile` instead runs the work once as a *dry pass* in which no kernel runs:

* every ``JITFunction.run`` of the calling thread becomes ``run(..., warmup=True)``: the arguments are bound
  and specialised as for the real launch, a kernel already compiled is found and not launched, a new one is
  handed to the compile pool and the pass goes on (Triton's ``AsyncCompileMode``, the mechanism torch's
  inductor uses; Triton 3.6 and 3.8 have it). The pending kernel goes into the function's in-memory cache at
  once, so the pass's later launches of it find it there: Triton would put it there only when the pass ends,
  and until then hand every launch to its compile path again, which hashes the compile options, libdevice's
  470 KB file included (~0.6 ms a launch: 20 s of a warm 27B start's dry passes, ~35k launches, run
  2026-12-03.10). A pending kernel whose compile failed is taken out again, so its launch compiles anew;
* ``triton.autotune`` kernels (``Autotuner.run``) request every pruned config instead of benchmarking;
* the runtime tuners (:mod:`ninfer.kernels.tuning`) see a :class:`DryTuner`: a key already chosen, stored
  in the tune cache or shipped with the package (:mod:`ninfer.kernels.shipped`) requests its config; a key to
  be timed requests every candidate (their timings of launches that did not run are thrown away, nothing is
  stored; ``triton.testing.do_bench`` calls its function once instead of timing hundreds of repeats). An
  autotuned kernel with a shipped config for the key requests only that one (its prune step,
  :mod:`ninfer.kernels.autotune`); the choice itself is made, and counted, by the real pass.

The pool's threads run ``triton.compile``; leaving the async mode waits for all of them and puts each kernel
into its function's in-memory cache. The real pass that follows finds every specialisation the dry pass
reached and compiles only what it did not (a specialisation that depends on values the dry pass did not
compute): correctness never depends on the dry pass, only the time does.

Threads, not processes: the bulk of a compile (MLIR / LLVM passes in C++, ``ptxas`` as a subprocess)
overlaps across threads (two threads compile sm_90 kernels 1.9x as fast as one on two cores, Triton 3.6
and 3.8); the Python front end (AST to TTIR) holds the GIL.

The dry pass computes nothing: tensors that kernels would have written hold whatever memory held. It
must not read device values to steer the host (the warm-up's forwards do not: the CUDA forward is
sync-free, and data-dependent indexing happens inside kernels, which do not run). Only the calling
thread's launches are dry; other threads launch as usual.

``NINFER_PARALLEL_COMPILE=0`` turns the dry pass off (each kernel compiles at its first launch, one after
another); ``NINFER_COMPILE_WORKERS`` sets the pool's size (default ``min(CPU count, 16)``). Without
``AsyncCompileMode`` (a Triton before 3.5) or in the interpreter nothing is precompiled.
"""
from __future__ import annotations

import functools
import os
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import triton

from ninfer.kernels import compile_watch
from ninfer.kernels.dispatch import INTERPRET, env_switch
from ninfer.kernels.tuning import (
    Config,
    TunerState,
    default_tuner,
    shipped_config,
    stored_config,
    untuned_config,
    use_tuner,
)

ENV = "NINFER_PARALLEL_COMPILE"
WORKERS_ENV = "NINFER_COMPILE_WORKERS"
MAX_WORKERS = 16


def _async_compile_mode() -> Any:
    """Triton's ``AsyncCompileMode`` where ``JITFunction`` consults it, else None."""
    try:
        from triton.runtime import _async_compile, jit
    except ImportError:
        return None
    mode = getattr(_async_compile, "AsyncCompileMode", None)
    uses_it = getattr(jit, "_async_compile", None) is _async_compile and hasattr(_async_compile, "active_mode")
    return mode if uses_it else None


ASYNC_COMPILE_MODE = _async_compile_mode()
SUPPORTED = ASYNC_COMPILE_MODE is not None


@dataclass(frozen=True)
class Precompiled:
    """What one :func:`precompile` did: ``jobs`` specialisations compiled on ``workers`` threads in
    ``seconds`` (``failed`` of them raised: the real launch meets the same error, as it would have), or
    nothing (``ran`` False) for ``reason``; a dry pass that raised stopped early (``reason`` says why)."""
    ran: bool
    jobs: int = 0
    failed: int = 0
    workers: int = 0
    seconds: float = 0.0
    reason: str = ""


def disabled_reason() -> str | None:
    """Why :func:`precompile` would do nothing now (None: it runs). The switch is read per call."""
    if not env_switch(ENV, True):
        return f"{ENV}={os.environ[ENV]}"
    if INTERPRET:
        return "the Triton interpreter compiles nothing"
    if not SUPPORTED:
        return f"Triton {triton.__version__} has no AsyncCompileMode"
    return None


def default_workers() -> int:
    """``NINFER_COMPILE_WORKERS``, else ``min(CPU count, 16)``."""
    env = os.environ.get(WORKERS_ENV, "").strip()
    if env:
        return max(1, int(env))
    return max(1, min(os.cpu_count() or 1, MAX_WORKERS))


def precompile(dry_pass: Callable[[], Any], *, workers: int | None = None) -> Precompiled:
    """Run ``dry_pass`` once with no kernel running (module doc), compiling what it launches on a pool of
    ``workers`` threads; returns once every compile has finished. Does nothing where disabled."""
    reason = disabled_reason()
    if reason is not None:
        return Precompiled(ran=False, reason=reason)
    n = workers or default_workers()
    t0 = time.perf_counter()
    error: Exception | None = None
    pending: list[tuple[dict, Any, Any]] = []  # (a function's kernel cache, key, pending kernel) put there early
    with ThreadPoolExecutor(n, thread_name_prefix="ninfer-compile") as pool:
        mode = ASYNC_COMPILE_MODE(pool, ignore_errors=True)
        try:
            with mode:  # on exit: waits for every compile, finalizes the ones that succeeded
                try:
                    with dry_launches(pending), compile_watch.muted(), use_tuner(DryTuner(default_tuner())):
                        dry_pass()
                except Exception as err:  # noqa: BLE001 (the real pass compiles what is missing; it raises real errors)
                    error = err
        finally:
            for cache, key, kernel in pending:  # finalized kernels replaced theirs; a failed one is still there
                if cache.get(key) is kernel:
                    del cache[key]
        futures = list(mode.raw_futures)
    failed = sum(f.exception() is not None for f in futures)
    seconds = time.perf_counter() - t0
    if error is not None:
        warnings.warn(f"parallel compile: the dry pass failed ({error!r}); the kernels it did not reach "
                      f"compile at their first launch", RuntimeWarning, stacklevel=2)
    return Precompiled(ran=True, jobs=len(futures), failed=failed, workers=n, seconds=seconds,
                       reason="" if error is None else f"dry pass failed: {error!r}")


class DryTuner(TunerState):
    """The dry pass's tuner: requests (launches, dry) what the real tuner ``real`` will launch for a key and
    stores nothing, in ``real`` neither: the real pass makes (and counts, :mod:`compile_watch`) each choice.
    Its choices are throwaway: a timed key is answered with its first candidate."""

    def __init__(self, real: TunerState) -> None:
        super().__init__(enabled=real.enabled)
        self.real = real

    def choose(self, table: str, key: tuple, candidates: Callable[[], list[Config]],
               time_fn: Callable[[list[Config]], dict[Config, float]], device: torch.device) -> Config:
        chosen = self.real.chosen(table).get(key)
        if chosen is not None:
            return chosen
        if not self.real.tunable(device):  # no timing: what the real state will answer (a favourite or shipped)
            favourite = self.real.favourite(table, key)
            return favourite if favourite is not None else untuned_config(table, key, candidates(), device)
        cands = candidates()
        if len(cands) == 1:
            return cands[0]
        known = stored_config(table, key, cands, device)
        if known is None:
            known = shipped_config(table, key, cands, device)
        time_fn([known] if known is not None else cands)  # the launches of the real timing, dry
        return known if known is not None else cands[0]


_dry = threading.local()  # .on: this thread's launches are dry
_patch_lock = threading.Lock()
_patched: list[int] = [0]  # open dry_launches blocks (any thread): the patches stay while one is open
_originals: list[Any] = []  # JITFunction.run, ._do_compile, Autotuner.run and do_bench while patched


def dry_pass_active() -> bool:
    """Whether this thread is inside a dry pass (its launches compile and run nothing)."""
    return getattr(_dry, "on", False)


def _dry_jit_run(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def run(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
        return original(self, *args, grid=grid, warmup=warmup or dry_pass_active(), **kwargs)
    return run


def _dry_do_compile(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def do_compile(self: Any, key: Any, signature: Any, device: Any, *args: Any, **kwargs: Any) -> Any:
        kernel = original(self, key, signature, device, *args, **kwargs)
        pending = getattr(_dry, "pending", None) if dry_pass_active() else None
        if pending is not None and kernel is not None and hasattr(kernel, "result"):  # handed to the pool
            cache = self.device_caches[device][0]
            if cache.get(key) is None:
                cache[key] = kernel  # the pass's next launch with this key finds it (module doc)
                pending.append((cache, key, kernel))
        return kernel
    return do_compile


def _dry_do_bench(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def do_bench(fn: Callable[[], Any], *args: Any, **kwargs: Any) -> Any:
        if not dry_pass_active():
            return original(fn, *args, **kwargs)
        fn()  # the one launch that requests the kernel; hundreds of timed repeats of nothing would cost seconds
        quantiles = kwargs.get("quantiles")
        return [0.0] * len(quantiles) if quantiles else 0.0
    return do_bench


def _dry_autotune_run(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not dry_pass_active():
            return original(self, *args, **kwargs)
        # What Autotuner.run would benchmark, requested instead (as Autotuner.warmup does, but with the
        # launch's grid and arguments): every pruned config of a multi-config kernel.
        self.nargs = dict(zip(self.arg_names, args))
        try:
            configs = self.prune_configs(kwargs) if len(self.configs) > 1 else self.configs
            for config in configs:
                self.fn.run(*args, **kwargs, **config.all_kwargs())
        finally:
            self.nargs = None
        return None
    return run


@contextmanager
def dry_launches(pending: list[tuple[dict, Any, Any]] | None = None) -> Iterator[None]:
    """Inside the block, this thread's Triton launches compile (or find) their kernel and run nothing;
    multi-config ``triton.autotune`` launches request every pruned config and benchmark nothing;
    ``triton.testing.do_bench`` calls its function once and measures nothing. With ``pending`` (inside an
    ``AsyncCompileMode``), each kernel handed to the pool goes into its function's cache at once and is noted
    there as ``(cache, key, kernel)``, for the caller to take out the ones whose compile failed."""
    import triton.testing
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import JITFunction

    with _patch_lock:
        if _patched[0] == 0:
            _originals[:] = [JITFunction.run, JITFunction._do_compile, Autotuner.run, triton.testing.do_bench]
            JITFunction.run = _dry_jit_run(JITFunction.run)
            JITFunction._do_compile = _dry_do_compile(JITFunction._do_compile)
            Autotuner.run = _dry_autotune_run(Autotuner.run)
            triton.testing.do_bench = _dry_do_bench(triton.testing.do_bench)
        _patched[0] += 1
    before, pending_before = dry_pass_active(), getattr(_dry, "pending", None)
    _dry.on, _dry.pending = True, pending
    try:
        with warnings.catch_warnings():  # tuners capture graphs of dry launches: graphs without kernels
            warnings.filterwarnings("ignore", message=".*CUDA Graph is empty.*")
            yield
    finally:
        _dry.on, _dry.pending = before, pending_before
        with _patch_lock:
            _patched[0] -= 1
            if _patched[0] == 0:
                JITFunction.run, JITFunction._do_compile, Autotuner.run, triton.testing.do_bench = _originals
                _originals.clear()
