"""Which Triton kernels were compiled, and which tuner keys benchmarked, since a mark.

Serving must not compile or tune after start-up: the first request that meets a new kernel key waits
seconds for ptxas or for a tuner timing every candidate. This module counts both so that start-up can
report them and a test can prove that nothing happens after "ready":

* **Compilations**: Triton's compilation listener (``triton.knobs.compilation.listener``, Triton >= 3.4:
  called on every ``triton.compile``, with ``cache_hit`` telling a kernel loaded from Triton's on-disk
  cache from one built by the compiler). A kernel already in the in-process cache calls nothing.
* **Tuner timings**: ``kernels.tune_cache`` reports each choice it stores (the quantized GEMM tuner and
  the MoE GEMV tuner store every choice they measure) and each one it reads back; ``triton.autotune``
  benchmarking is seen through ``Autotuner._bench`` (one call per config timed, the same signature in
  Triton 3.6 and 3.8), wrapped once.
* **Shipped choices** (:mod:`ninfer.kernels.shipped`): a runtime-tuner key or a ``triton.autotune`` key
  answered from the package's table for this GPU model (``tune-shipped``, ``autotune-shipped``): nothing
  was timed, but the key was new to the process, so it still counts as a stall after start-up.

:func:`install` puts the hooks in place (idempotent; it chains a listener that is already set);
:func:`watch` is a context manager over the events from its start::

    with compile_watch.watch() as w:
        serve_some_requests()
    assert not w.stalls(), w.describe()

A Triton without the listener or ``Autotuner._bench`` leaves ``SUPPORT`` saying what cannot be counted,
and :func:`install` warns once; :attr:`Watch.complete` is False then.

:func:`muted` drops the events of the calling thread inside a block: the dry pass of
:mod:`ninfer.kernels.precompile` reads tune-cache entries that the real pass reads again, while the
compilations it requests run (and count) on the compile pool's threads.
"""
from __future__ import annotations

import contextlib
import functools
import threading
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import triton

COMPILED, LOADED = "compiled", "loaded"  # by the compiler, from Triton's disk cache
TUNED, TUNE_LOADED = "tuned", "tune-loaded"  # benchmarked now, read from ninfer's tune cache
AUTOTUNED = "autotuned"  # a triton.autotune key benchmarked
TUNE_SHIPPED, AUTOTUNE_SHIPPED = "tune-shipped", "autotune-shipped"  # taken from the shipped table, untimed


@dataclass(frozen=True)
class Event:
    kind: str  # COMPILED, LOADED, TUNED, TUNE_LOADED, AUTOTUNED, TUNE_SHIPPED or AUTOTUNE_SHIPPED
    name: str  # kernel function, or tuner table
    key: str  # what distinguishes this instance: constexprs and launch options, the tuner key

    def __str__(self) -> str:
        return f"{self.kind} {self.name} {self.key}"


_events: list[Event] = []
_lock = threading.Lock()
_installed: list[bool] = []
_autotuned: set[tuple[int, str]] = set()  # (autotuner id, key): one event per key, not per timed config
_thread = threading.local()  # ``muted``: this thread's events are dropped


def _knob(path: str) -> Any:
    """``triton.knobs.<path>`` or None on a Triton without it."""
    obj: Any = getattr(triton, "knobs", None)
    for part in path.split("."):
        if obj is None:
            return None
        obj = getattr(obj, part, None)
    return obj


def _support() -> dict[str, bool]:
    compilation = _knob("compilation")
    autotuner = getattr(getattr(getattr(triton, "runtime", None), "autotuner", None), "Autotuner", None)
    return {"compilations": compilation is not None and hasattr(compilation, "listener"),
            "autotune": autotuner is not None and hasattr(autotuner, "_bench")}


SUPPORT = _support()


def record(kind: str, name: str, key: str) -> None:
    """Add one event (the hooks call this; so may a tuner of ninfer's own), unless this thread is muted."""
    if getattr(_thread, "muted", False):
        return
    with _lock:
        _events.append(Event(kind, name, key))


def record_tune(table: str, key: tuple, measured: bool, shipped: bool = False) -> None:
    """A tuner choice for ``key`` of ``table``: timed now (``measured``), read from the tune cache, or taken
    from the shipped table (``shipped``)."""
    record(TUNED if measured else TUNE_SHIPPED if shipped else TUNE_LOADED, table, _key_text(key))


def record_autotune_shipped(kernel: str, key: tuple) -> None:
    """A ``triton.autotune`` key of ``kernel`` answered from the shipped table (no benchmark)."""
    record(AUTOTUNE_SHIPPED, kernel, _key_text(key))


def _key_text(key: object) -> str:
    if isinstance(key, tuple):
        return "(" + ", ".join(str(v) for v in key) + ")"
    return str(key)


def _constants_text(src: Any) -> str:
    """A compiled source's constexprs by argument name (``BLOCK_M=64``), as Triton's ``ASTSource`` keeps
    them (keys are argument-index tuples); a source of another shape gives its repr."""
    constants = getattr(src, "constants", None)
    names = getattr(getattr(src, "fn", None), "arg_names", None)
    if not isinstance(constants, dict) or names is None:
        return repr(src)
    parts = []
    for k, v in sorted(constants.items(), key=lambda kv: str(kv[0])):
        index = k[0] if isinstance(k, tuple) and len(k) == 1 and isinstance(k[0], int) else None
        label = names[index] if index is not None and index < len(names) else str(k)
        parts.append(f"{label}={v}")
    return ", ".join(parts)


def _on_compile(previous: Any, *, src: Any, metadata: dict, cache_hit: bool, **kwargs: Any) -> None:
    try:  # counting must never fail a compilation
        options = ", ".join(f"{o}={metadata[o]}" for o in ("num_warps", "num_stages") if o in metadata)
        name = getattr(src, "name", None) or metadata.get("name", "?")
        key = f"[{_constants_text(src)}] {options}".strip()
    except Exception as err:  # noqa: BLE001
        name, key = "?", f"(not described: {err!r})"
    record(LOADED if cache_hit else COMPILED, name, key)
    if previous is not None:
        previous(src=src, metadata=metadata, cache_hit=cache_hit, **kwargs)


def _wrap_bench(bench: Any) -> Any:
    @functools.wraps(bench)
    def timed(self: Any, *args: Any, config: Any, **meta: Any) -> Any:
        try:  # the tuning key as Autotuner.run builds it (its named arguments, not their dtypes)
            values = {**(getattr(self, "nargs", None) or {}), **meta}
            key = _key_text(tuple(values.get(k) for k in getattr(self, "keys", ())))
        except Exception as err:  # noqa: BLE001 (counting must never fail a benchmark)
            key = f"(not described: {err!r})"
        name = getattr(getattr(self, "base_fn", None), "__name__", "?")
        with _lock:
            new = (id(self), key) not in _autotuned
            _autotuned.add((id(self), key))
        if new:
            record(AUTOTUNED, name, key)
        return bench(self, *args, config=config, **meta)

    timed.__ninfer_watch__ = True  # type: ignore[attr-defined]
    return timed


def install() -> dict[str, bool]:
    """Put the hooks in place once per process; returns what can be counted (``SUPPORT``)."""
    with _lock:
        if _installed:
            return SUPPORT
        _installed.append(True)
    if SUPPORT["compilations"]:
        compilation = _knob("compilation")
        compilation.listener = functools.partial(_on_compile, compilation.listener)
    if SUPPORT["autotune"]:
        autotuner = triton.runtime.autotuner.Autotuner
        if not getattr(autotuner._bench, "__ninfer_watch__", False):
            autotuner._bench = _wrap_bench(autotuner._bench)
    missing = [what for what, ok in SUPPORT.items() if not ok]
    if missing:
        warnings.warn(f"Triton {triton.__version__} offers no hook for {' and '.join(missing)}: "
                      f"those are not counted (Triton >= 3.4 has them)", RuntimeWarning, stacklevel=2)
    return SUPPORT


@contextlib.contextmanager
def muted() -> Iterator[None]:
    """Drop the events recorded by this thread inside the block (other threads' still count)."""
    before = getattr(_thread, "muted", False)
    _thread.muted = True
    try:
        yield
    finally:
        _thread.muted = before


def mark() -> int:
    """A position in the event log: :func:`since` gives the events after it."""
    with _lock:
        return len(_events)


def since(position: int) -> list[Event]:
    with _lock:
        return list(_events[position:])


class Watch:
    """The events from the watch's start to now (or to its end, once closed)."""

    def __init__(self) -> None:
        install()
        self.start = mark()
        self.end: int | None = None
        self.complete = all(SUPPORT.values())

    @property
    def events(self) -> list[Event]:
        events = since(self.start)
        return events if self.end is None else events[:self.end - self.start]

    def count(self, *kinds: str) -> int:
        return sum(e.kind in kinds for e in self.events)

    def stalls(self) -> list[Event]:
        """Everything a request would have waited for: compilations (disk-cache loads included: they are
        new kernels in this process), tuner timings, tune-cache reads, triton.autotune benchmarks and keys taken
        from the shipped table (new keys: the kernels they pick may still compile)."""
        return list(self.events)

    def summary(self) -> str:
        """``N compiled, M loaded from Triton's cache; T tuned, L from the tune cache, A autotuned; S from the
        shipped table`` (S: tuner and autotune keys together, each counted apart when there are any)."""
        c = {k: self.count(k) for k in (COMPILED, LOADED, TUNED, TUNE_LOADED, AUTOTUNED, TUNE_SHIPPED,
                                        AUTOTUNE_SHIPPED)}
        shipped = c[TUNE_SHIPPED] + c[AUTOTUNE_SHIPPED]
        text = (f"{c[COMPILED]} kernels compiled, {c[LOADED]} loaded from Triton's cache; {c[TUNED]} tuner keys "
                f"timed, {c[TUNE_LOADED]} from the tune cache, {c[AUTOTUNED]} triton.autotune keys benchmarked; "
                f"{shipped} from the shipped table")
        if shipped:
            text += f" ({c[TUNE_SHIPPED]} tuner keys, {c[AUTOTUNE_SHIPPED]} triton.autotune keys)"
        return text if self.complete else text + " (not all counted on this Triton: compile_watch.SUPPORT)"

    def describe(self, limit: int = 200) -> str:
        """The summary and then one line per event (at most ``limit``)."""
        events = self.events
        lines = [self.summary(), *(f"  {e}" for e in events[:limit])]
        if len(events) > limit:
            lines.append(f"  ... and {len(events) - limit} more")
        return "\n".join(lines)


@contextlib.contextmanager
def watch() -> Iterator[Watch]:
    """A :class:`Watch` over the block (its events stop at the block's end)."""
    w = Watch()
    try:
        yield w
    finally:
        w.end = mark()
