"""Owners of the fixed device storage: KV pages and DeltaNet state slots.

Pages are reference counted so that a later prefix cache can share them between sequences;
a page returns to the free list when its last owner lets go. Admission reserves what a request
needs now plus a margin; a growing sequence reserves more, and when none is left the runtime pauses
another request (``ninfer.runtime.pause``) rather than fail.
"""
from __future__ import annotations

from collections import deque


class PagePool:
    """Free list and reference counts of ``num_pages`` KV pages, plus reservations for admitted requests."""

    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self._free: deque[int] = deque(range(num_pages))
        self._refs = [0] * num_pages
        self.reserved = 0  # pages promised to admitted requests but not yet taken

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_available(self) -> int:
        """Pages neither in use nor promised: what admission may reserve."""
        return len(self._free) - self.reserved

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def reserve(self, n: int) -> bool:
        if n > self.num_available:
            return False
        self.reserved += n
        return True

    def unreserve(self, n: int) -> None:
        assert 0 <= n <= self.reserved
        self.reserved -= n

    def take_reserved(self) -> int:
        """Turn one reserved page into an owned page."""
        assert self.reserved > 0 and self._free, "page taken without a reservation"
        self.reserved -= 1
        page = self._free.popleft()
        self._refs[page] = 1
        return page

    def incref(self, page: int) -> None:
        assert self._refs[page] > 0
        self._refs[page] += 1

    def release(self, pages: list[int]) -> None:
        for page in pages:
            assert self._refs[page] > 0, f"page {page} released twice"
            self._refs[page] -= 1
            if self._refs[page] == 0:
                self._free.append(page)


class SlotPool:
    """Free list of DeltaNet state slots (one per resident sequence)."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free: deque[int] = deque(range(num_slots))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def acquire(self) -> int | None:
        return self._free.popleft() if self._free else None

    def release(self, slot: int) -> None:
        assert slot not in self._free, f"slot {slot} released twice"
        self._free.append(slot)
