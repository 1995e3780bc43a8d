"""Independent work of a layer on a second CUDA stream, so that a captured graph runs it beside the first.

A decode step is a chain of short launches, each bound by its latency and using a fraction of the GPU. Where a
layer has two independent pieces (the MoE block's shared expert beside its routing and routed experts; the
Gated DeltaNet's a/b gate GEMM beside its q/k/v/z projection), launching one of them from a second stream
makes them branches of the captured graph, which the GPU runs side by side.

``overlapped(fn, like)`` runs ``fn`` on the device's side stream, forked from the current stream, when its
launches are being captured into a graph (:func:`~ninfer.kernels.dispatch.capturing`: the capture and the
eager run before it) and the batch has at most ``MAX_ROWS`` rows; otherwise it runs ``fn`` in place. The
consumer calls :meth:`Overlapped.wait` (or :func:`wait_for`) just before it reads the value: the current
stream then waits for the side stream's work. Side-stream launches take their own bank of arrival counters
(:func:`~ninfer.kernels.counters.counter_bank`), since they may run while a current-stream launch counts.

Memory stays safe without ``record_stream``: the side stream allocates only after a fork, which orders it
after everything the current stream had launched, so after the last read of anything it frees; and the
current stream reads the side stream's outputs only after waiting for them. ``NINFER_OVERLAP=0`` (read per
call) runs everything in place.
"""
from __future__ import annotations

from collections.abc import Callable
from contextvars import ContextVar
from typing import Generic, TypeVar

import torch

from ninfer.kernels.counters import counter_bank
from ninfer.kernels.dispatch import capturing, env_switch
from ninfer.kernels.quant_gemm.tune import SKINNY_MAX_M
from ninfer.kernels.scoped import scoped

T = TypeVar("T")

# Decode-sized batches only: a prefill chunk fills the GPU by itself, and above SKINNY_MAX_M (16) rows a quantized
# GEMM may take the dequantizing path, whose one workspace two streams must not use at once.
MAX_ROWS = SKINNY_MAX_M

_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}
_on_side: ContextVar[bool] = ContextVar("ninfer_on_side_stream", default=False)  # no nested forks


class Overlapped(Generic[T]):
    """A value computed on the side stream of ``device`` (until ``done``), or in place (``done`` None)."""

    def __init__(self, value: T, done: torch.cuda.Event | None = None, device: torch.device | None = None) -> None:
        self.value, self._done, self._device = value, done, device

    @property
    def forked(self) -> bool:
        """Whether the current stream has yet to wait for the side stream's work on the value."""
        return self._done is not None

    def wait(self) -> T:
        """The value, once the current stream has waited for the side stream's work (a no-op in place)."""
        if self._done is not None:
            torch.cuda.current_stream(self._device).wait_event(self._done)
            self._done = None
        return self.value


def wait_for(value: T | Overlapped[T]) -> T:
    """``value`` itself, or an :class:`Overlapped` value once the current stream waited for it."""
    return value.wait() if isinstance(value, Overlapped) else value


def overlap_enabled(like: torch.Tensor) -> bool:
    """Whether :func:`overlapped` forks for a batch like ``like`` (rows along dim 0): captured launches on CUDA,
    at most ``MAX_ROWS`` rows, ``NINFER_OVERLAP`` not ``0``, not already inside a side branch."""
    return (env_switch("NINFER_OVERLAP", True) and capturing(like) and like.shape[0] <= MAX_ROWS
            and not _on_side.get())


def overlapped(fn: Callable[[], T], like: torch.Tensor) -> Overlapped[T]:
    """``fn()`` on the side stream of ``like``'s device where :func:`overlap_enabled`, else in place."""
    if not overlap_enabled(like):
        return Overlapped(fn())
    device = like.device
    side = _SIDE_STREAMS.get(device)
    if side is None:
        side = _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with scoped(_on_side, True), torch.cuda.stream(side), counter_bank(1):
        value = fn()
    done = torch.cuda.Event()
    done.record(side)
    return Overlapped(value, done, device)
