"""Exact-prefix reuse for hybrid models: KV pages shared by reference plus DeltaNet state checkpoints.

Reusing a prefix of length ``P`` needs the attention KV of tokens ``[0, P)`` *and* the complete
DeltaNet state (conv + recurrent) at exactly ``P``, which the KV cannot rebuild. So the unit of
reuse is a checkpoint: a state slot holding the state after ``P`` tokens, plus references to the
KV pages covering them. A new request resumes from the longest checkpointed prefix of its prompt
that leaves at least one token to compute (its logits start the generation).

Checkpoints are taken one token before the end of each prompt (so an identical prompt hits),
every ``interval`` tokens of a long prompt, and at the end of each generation (so the next turn
of a chat hits). They live in spare state slots and pinned pages and are evicted least recently
used when admission needs the memory.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from ninfer.models.cache import ModelCache
from ninfer.runtime.pools import PagePool, SlotPool


@dataclass
class Checkpoint:
    tokens: tuple[int, ...]
    slot: int
    pages: list[int]  # pages covering tokens [0, len(tokens)); the last may be partly filled
    last_used: int = 0
    hits: int = 0


@dataclass
class PrefixHit:
    length: int
    checkpoint: Checkpoint


@dataclass
class PrefixCacheStats:
    hits: int = 0
    hit_tokens: int = 0
    lookups: int = 0
    inserted: int = 0
    evicted: int = 0


@dataclass
class PrefixCache:
    cache: ModelCache
    pages: PagePool
    slots: SlotPool
    page_size: int
    interval: int = 4096
    stats: PrefixCacheStats = field(default_factory=PrefixCacheStats)

    def __post_init__(self) -> None:
        self._by_length: dict[int, dict[tuple[int, ...], Checkpoint]] = {}
        self._clock = itertools.count(1)

    def __len__(self) -> int:
        return sum(len(v) for v in self._by_length.values())

    # -- lookup -------------------------------------------------------------------------------
    def lookup(self, prompt: list[int]) -> PrefixHit | None:
        """The longest checkpoint whose tokens prefix ``prompt`` and leave at least one token to compute."""
        self.stats.lookups += 1
        for length in sorted(self._by_length, reverse=True):
            if length >= len(prompt):
                continue
            ckpt = self._by_length[length].get(tuple(prompt[:length]))
            if ckpt is not None:
                ckpt.last_used = next(self._clock)  # the newest entry: the last one eviction would pick
                return PrefixHit(length, ckpt)
        return None

    def record_hit(self, hit: PrefixHit) -> None:
        hit.checkpoint.hits += 1
        self.stats.hits += 1
        self.stats.hit_tokens += hit.length

    def shared_pages(self, hit: PrefixHit) -> list[int]:
        """The checkpoint's fully used pages, which a resuming sequence shares by reference."""
        full = hit.length // self.page_size
        shared = hit.checkpoint.pages[:full]
        for page in shared:
            self.pages.incref(page)
        return shared

    # -- insert / evict -----------------------------------------------------------------------
    def insert(self, tokens: list[int], slot: int, pages: list[int]) -> bool:
        """Checkpoint the state in ``slot`` after ``tokens`` (whose KV is in ``pages``); False if no slot is free."""
        key, length = tuple(tokens), len(tokens)
        if length == 0 or key in self._by_length.get(length, {}):
            return False
        target = self.slots.acquire()
        if target is None and self.evict_one():
            target = self.slots.acquire()
        if target is None:
            return False
        self.cache.copy_slot(slot, target)
        needed = pages[: -(-length // self.page_size)]
        for page in needed:
            self.pages.incref(page)
        self._by_length.setdefault(length, {})[key] = Checkpoint(key, target, list(needed), next(self._clock))
        self.stats.inserted += 1
        return True

    def evict_one(self) -> bool:
        """Drop the least recently used checkpoint; False when there is none."""
        entries = [c for group in self._by_length.values() for c in group.values()]
        if not entries:
            return False
        victim = min(entries, key=lambda c: c.last_used)
        group = self._by_length[len(victim.tokens)]
        del group[victim.tokens]
        if not group:
            del self._by_length[len(victim.tokens)]
        self.pages.release(victim.pages)
        self.slots.release(victim.slot)
        self.stats.evicted += 1
        return True

    def clear(self) -> None:
        while self.evict_one():
            pass

    @property
    def pinned_pages(self) -> int:
        return len({p for group in self._by_length.values() for c in group.values() for p in c.pages})
