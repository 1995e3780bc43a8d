"""The start-up report: how long each phase of building an engine took, and what it compiled or tuned.

``ninfer.load`` opens a report (:func:`begin`), the phases time themselves into it (:func:`phase`, or the
:func:`timed` decorator on the function that does the phase: graph capture, warm-up), and
:func:`finish` closes it, prints it when asked (``progress=True``, and so ``ninfer serve``) and returns
it; ``LLM.startup`` keeps it. Phase times are exclusive: a phase nested in another (graph capture
inside building the engine) is not counted twice, and ``other`` is the rest of the wall time. Kernel
and tuner counts come from :mod:`ninfer.kernels.compile_watch` over the whole start-up and per phase, including
how many tuning choices came from the package's shipped table for this GPU (:mod:`ninfer.kernels.shipped`).

:func:`parallel_compile` is the phase of that name: a dry pass of the warm-up's work whose kernels compile on
a thread pool (:mod:`ninfer.kernels.precompile`); the report counts what it compiled and says when it was
off or skipped (a start whose kernels an earlier start of the same configuration compiled,
:mod:`ninfer.runtime.warm_start`). Phases run outside any report (an engine built directly, in a test) time
nothing and skip no dry pass.
"""
from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TextIO, TypeVar

from ninfer.kernels import compile_watch, precompile

F = TypeVar("F", bound=Callable[..., Any])
PARALLEL_COMPILE = "parallel compile"


@dataclass
class Phase:
    seconds: float = 0.0
    events: int = 0  # compilations and tuner events while the phase (not a nested one) ran
    compiles: int = 0  # of them: kernels compiled or loaded from Triton's disk cache


def _compiles(position: int) -> int:
    return sum(e.kind in (compile_watch.COMPILED, compile_watch.LOADED) for e in compile_watch.since(position))


@dataclass
class StartupReport:
    watch: compile_watch.Watch = field(default_factory=compile_watch.Watch)
    start: float = field(default_factory=time.perf_counter)
    phases: dict[str, Phase] = field(default_factory=dict)
    ready_s: float | None = None
    precompiled: list[precompile.Precompiled] = field(default_factory=list)  # each parallel_compile's result
    dry_passes_off: str | None = None  # why this start's dry passes are skipped (skip_dry_passes)
    # per open phase: [nested seconds, nested events, nested compiles]
    _stack: list[list[float]] = field(default_factory=list)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        entry = self.phases.setdefault(name, Phase())  # listed in the order the phases began
        t0, e0 = time.perf_counter(), compile_watch.mark()
        self._stack.append([0.0, 0.0, 0.0])
        try:
            yield
        finally:
            nested_s, nested_events, nested_compiles = self._stack.pop()
            seconds, events, compiles = time.perf_counter() - t0, compile_watch.mark() - e0, _compiles(e0)
            entry.seconds += seconds - nested_s
            entry.events += events - int(nested_events)
            entry.compiles += compiles - int(nested_compiles)
            if self._stack:
                self._stack[-1][0] += seconds
                self._stack[-1][1] += events
                self._stack[-1][2] += compiles

    def close(self) -> None:
        if self.ready_s is None:
            self.ready_s = time.perf_counter() - self.start
            self.watch.end = compile_watch.mark()

    @property
    def other_s(self) -> float:
        total = self.ready_s if self.ready_s is not None else time.perf_counter() - self.start
        return max(0.0, total - sum(p.seconds for p in self.phases.values()))

    def describe(self) -> str:
        """Two lines: the time to ready by phase, then what was compiled and tuned."""
        total = self.ready_s if self.ready_s is not None else time.perf_counter() - self.start
        parts = [f"{name} {p.seconds:.1f} s" + (f" ({p.events} new kernels/tunings)" if p.events else "")
                 for name, p in self.phases.items()]
        parts.append(f"other {self.other_s:.1f} s")
        text = f"ready in {total:.1f} s: {', '.join(parts)}\nstart-up {self.watch.summary()}"
        return text + (f"; {self.precompile_summary()}" if self.precompiled else "")

    def precompile_summary(self) -> str:
        """``parallel compile: N kernels on W threads`` (with failures), or why it was off."""
        ran = [p for p in self.precompiled if p.ran]
        if not ran:
            return f"parallel compile off ({self.precompiled[0].reason})"
        jobs, failed = sum(p.jobs for p in ran), sum(p.failed for p in ran)
        notes = [r.reason for r in ran if r.reason] + ([f"{failed} failed, compiled again at launch"] if failed else [])
        return (f"parallel compile: {jobs} kernels on {max(p.workers for p in ran)} threads"
                + (f" ({'; '.join(notes)})" if notes else ""))

    def as_dict(self) -> dict[str, Any]:
        """For benchmarks' JSON records: seconds by phase and the compile / tune counts."""
        w = self.watch
        return {"ready_s": self.ready_s, "phases_s": {k: round(p.seconds, 3) for k, p in self.phases.items()},
                "phases_compiles": {k: p.compiles for k, p in self.phases.items()},
                "other_s": round(self.other_s, 3), "compiled": w.count(compile_watch.COMPILED),
                "loaded_from_triton_cache": w.count(compile_watch.LOADED), "tuned": w.count(compile_watch.TUNED),
                "loaded_from_tune_cache": w.count(compile_watch.TUNE_LOADED),
                "autotuned": w.count(compile_watch.AUTOTUNED),
                "tuned_from_shipped_table": w.count(compile_watch.TUNE_SHIPPED),
                "autotuned_from_shipped_table": w.count(compile_watch.AUTOTUNE_SHIPPED),
                "parallel_compile": {"on": any(p.ran for p in self.precompiled),
                                     "kernels": sum(p.jobs for p in self.precompiled),
                                     "failed": sum(p.failed for p in self.precompiled),
                                     "workers": max((p.workers for p in self.precompiled), default=0),
                                     "reason": next((p.reason for p in self.precompiled if p.reason), "")}}


_current: list[StartupReport] = []  # the open report, if any


def begin() -> StartupReport:
    """Open a report (replacing an unfinished one) and start counting compilations."""
    _current[:] = [StartupReport()]
    return _current[0]


def phase(name: str) -> contextlib.AbstractContextManager[None]:
    """Time the block as phase ``name`` of the open report (nothing without one)."""
    return _current[0].phase(name) if _current else contextlib.nullcontext()


def timed(name: str) -> Callable[[F], F]:
    """Decorator: each call of the function is (part of) phase ``name``."""
    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            with phase(name):
                return fn(*args, **kwargs)
        return run  # type: ignore[return-value]
    return wrap


def skip_dry_passes(reason: str) -> None:
    """The open report's start skips its dry passes (:mod:`ninfer.runtime.warm_start`: its kernels are cached)."""
    if _current:
        _current[0].dry_passes_off = reason


def parallel_compile(dry_pass: Callable[[], Any]) -> precompile.Precompiled:
    """Phase ``parallel compile``: :func:`ninfer.kernels.precompile.precompile` of ``dry_pass``, its result
    kept in the open report (switched off, or skipped for this start: no phase, and the report says why)."""
    reason = precompile.disabled_reason() or (_current[0].dry_passes_off if _current else None)
    if reason is not None:
        result = precompile.Precompiled(ran=False, reason=reason)
    else:
        with phase(PARALLEL_COMPILE):
            result = precompile.precompile(dry_pass)
    if _current:
        _current[0].precompiled.append(result)
    return result


def finish(out: TextIO | None = None) -> StartupReport | None:
    """Close the open report and print it to ``out`` (None: print nothing); returns it (None without one)."""
    if not _current:
        return None
    report = _current.pop()
    report.close()
    if out is not None:
        print(f"ninfer: {report.describe().replace(chr(10), chr(10) + 'ninfer: ')}", file=out, flush=True)
    return report
