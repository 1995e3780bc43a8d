"""The runtime tuners' state: what each tuner chose per key, and whether calls may benchmark.

Three tuners pick launch configurations by timing their candidates on a key's first call: the quantized
GEMM (:mod:`ninfer.kernels.quant_gemm.tune`, table ``"quant_gemm"``), the MoE expert path at decode
(:mod:`ninfer.kernels.moe.quant_gemv`, table ``"moe_gemv"``) and the small float projections at decode
(:mod:`ninfer.kernels.float_gemv`, table ``"float_gemv"``). All keep their choices in one
:class:`TunerState` per process (:func:`default_tuner`): the kernels find it without a parameter, as they
are called deep inside a model's forward. The model runner reports the instance its forwards use
(``ModelRunner.tuner``); tests and benchmarks swap in a fresh one with :func:`use_tuner` (a new process, as
far as tuning goes). A choice also goes to disk (:mod:`ninfer.kernels.tune_cache`) and a later process takes
it while it is still a candidate. A key that neither this process nor the disk cache knows takes the package's
shipped choice for this GPU model (:mod:`ninfer.kernels.shipped`) while that is a candidate, before anything is
timed: a first start on a known GPU benchmarks nothing.

A call may benchmark (:meth:`TunerState.tunable`) only on CUDA outside the interpreter, outside CUDA-graph
capture and with tuning on (``enabled``; None: ``NINFER_QUANT_TUNE``, ``0`` turns it off, read at the call).
Other calls take what was chosen for the key, else its shipped choice (a measured one beats the heuristic: it
matters for graph capture and ``NINFER_QUANT_TUNE=0``), else its first candidate (the heuristic favourite),
kept per key so that later untunable calls skip building the candidate list.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict
from typing import Any, TypeVar

import torch

from ninfer.kernels import compile_watch, shipped, tune_cache
from ninfer.kernels.dispatch import INTERPRET, env_switch

Config = TypeVar("Config")  # a tuner's launch configuration: a frozen (hashable) dataclass
TUNE_ENV = "NINFER_QUANT_TUNE"
TIMED, STORED, SHIPPED = "timed", "stored", "shipped"  # where a chosen config came from (TunerState.sources)


def on_gpu(device: torch.device) -> bool:
    """Whether kernels on ``device`` really run on a GPU (not the Triton interpreter), so can be timed."""
    return device.type == "cuda" and not INTERPRET


class TunerState:
    """Chosen configs per table and key, the untuned keys' favourites, the timings behind each choice and
    the on/off switch (``enabled``; None: the ``NINFER_QUANT_TUNE`` environment variable when asked)."""

    def __init__(self, enabled: bool | None = None) -> None:
        self.enabled = enabled
        self._chosen: dict[str, dict[tuple, Any]] = {}
        self._favourites: dict[str, dict[tuple, Any]] = {}
        self._timings: dict[str, dict[tuple, dict[Any, float]]] = {}
        self._sources: dict[str, dict[tuple, str]] = {}  # per chosen key: TIMED, STORED or SHIPPED

    def tuning_on(self) -> bool:
        if self.enabled is not None:
            return self.enabled
        return env_switch(TUNE_ENV, True)

    def tunable(self, device: torch.device) -> bool:
        """Whether a call on ``device`` may benchmark now: tuning on, a real GPU, no graph being captured."""
        return self.tuning_on() and on_gpu(device) and not torch.cuda.is_current_stream_capturing()

    def choose(self, table: str, key: tuple, candidates: Callable[[], list[Config]],
               time_fn: Callable[[list[Config]], dict[Config, float]], device: torch.device) -> Config:
        """The config of ``key`` in ``table``: the one chosen earlier; else, in a tunable call, the one stored
        on disk if still among ``candidates()``, else the shipped one if still among them, else the fastest by
        ``time_fn`` (ms per candidate that ran; then stored); untunable calls take the shipped one if still a
        candidate, else the first candidate, as do keys with a single candidate."""
        chosen = self._chosen.get(table, {}).get(key)
        if chosen is not None:
            return chosen
        tunable = self.tunable(device)
        favourites = self._favourites.setdefault(table, {})
        if not tunable and key in favourites:
            return favourites[key]
        cands = candidates()
        if not tunable or len(cands) == 1:
            favourites[key] = untuned_config(table, key, cands, device)
            return favourites[key]
        chosen, source = stored_config(table, key, cands, device), STORED
        if chosen is None:
            chosen, source = shipped_config(table, key, cands, device), SHIPPED
        if chosen is None:
            timings = time_fn(cands)
            if not timings:
                raise RuntimeError(f"no {table} config fits this GPU for {key}")
            self._timings.setdefault(table, {})[key] = dict(timings)
            chosen, source = min(timings, key=timings.__getitem__), TIMED
            tune_cache.record(table, key, asdict(chosen), device)
        self._chosen.setdefault(table, {})[key] = chosen
        self._sources.setdefault(table, {})[key] = source
        return chosen

    def chosen(self, table: str) -> dict[tuple, Any]:
        """The configs chosen so far in ``table`` by tunable calls: by benchmark, from the disk cache or from
        the shipped table (:meth:`sources` says which; for reports and ``shipped_export``)."""
        return dict(self._chosen.get(table, {}))

    def favourite(self, table: str, key: tuple) -> Any | None:
        """What untunable calls took for ``key`` of ``table`` (shipped or first candidate), None if none yet."""
        return self._favourites.get(table, {}).get(key)

    def sources(self, table: str) -> dict[tuple, str]:
        """Where each of :meth:`chosen`'s configs came from: ``TIMED``, ``STORED`` (disk cache) or ``SHIPPED``."""
        return dict(self._sources.get(table, {}))

    def timings(self, table: str) -> dict[tuple, dict[Any, float]]:
        """Milliseconds per launch of every candidate timed for each key of ``table`` (keys taken from the
        disk cache or the shipped table were not timed by this state and have none)."""
        return {key: dict(t) for key, t in self._timings.get(table, {}).items()}

    def clear(self) -> None:
        """Forget every choice, favourite and timing (the disk cache stays)."""
        self._chosen.clear()
        self._favourites.clear()
        self._timings.clear()
        self._sources.clear()


def stored_config(table: str, key: tuple, cands: list[Config], device: torch.device) -> Config | None:
    """The config an earlier process chose for ``key`` (:mod:`tune_cache`), if it is still one of ``cands``:
    changed heuristics, SM counts or autotune settings make a stored config stale, not wrong to launch."""
    return _candidate(tune_cache.lookup(table, key, device), cands)


def shipped_config(table: str, key: tuple, cands: list[Config], device: torch.device) -> Config | None:
    """The config the package ships for ``key`` on this GPU model (:mod:`shipped`), if it is one of ``cands``
    (validated as :func:`stored_config` validates); a hit counts as a ``tune-shipped`` event."""
    cfg = _candidate(shipped.lookup(table, tune_cache.key_text(key), device), cands)
    if cfg is not None:
        compile_watch.record_tune(table, key, measured=False, shipped=True)
    return cfg


def untuned_config(table: str, key: tuple, cands: list[Config], device: torch.device) -> Config:
    """What a call that may not time takes: the shipped choice while it is a candidate (measured on this GPU
    model), else the first candidate (the heuristic favourite)."""
    if len(cands) > 1:
        cfg = shipped_config(table, key, cands, device)
        if cfg is not None:
            return cfg
    return cands[0]


def _candidate(fields: dict | None, cands: list[Config]) -> Config | None:
    try:
        cfg = type(cands[0])(**fields) if fields is not None else None
    except TypeError:  # fields of another version of the config class
        return None
    return cfg if cfg in cands else None


_default = TunerState()


def default_tuner() -> TunerState:
    """The process's tuner state, which the kernels' tuners use."""
    return _default


@contextmanager
def use_tuner(state: TunerState) -> Iterator[TunerState]:
    """Make ``state`` the process's tuner state inside the block (tests, benchmarks: a fresh or a
    pre-set state), then put the previous one back."""
    global _default
    before, _default = _default, state
    try:
        yield state
    finally:
        _default = before
