"""``scoped(var, value)``: a context variable set for one ``with`` block of one thread, restored after: how the
kernels' test hooks and launch modes (graph-bound launches, forced prefill splits, the reduce-kernel hook, the
arrival counters' bank, the second stream) hold."""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TypeVar

T = TypeVar("T")


@contextmanager
def scoped(var: ContextVar[T], value: T) -> Iterator[None]:
    token = var.set(value)
    try:
        yield
    finally:
        var.reset(token)
