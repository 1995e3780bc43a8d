"""Exact-prefix reuse for hybrid models: KV pages shared by reference plus DeltaNet state checkpoints.

Reusing a prefix of length ``P`` needs the attention KV of tokens ``[0, P)`` *and* the complete
DeltaNet state (conv + recurrent) at exactly ``P``, which the KV cannot rebuild. So the unit of
reuse is a checkpoint: a state slot holding the state after ``P`` tokens, plus references to the
KV pages covering them. A new request resumes from the longest checkpointed prefix of its prompt
that leaves at least one token to compute (its logits start the generation).

Checkpoints are taken one token before the end of each prompt (so an identical prompt hits),
every ``interval`` tokens of a long prompt, and at the end of each generation (so the next turn
of a chat hits). They live in spare state slots and pinned pages and are evicted least recently
used when admission needs the memory: moved to a host memory budget when one is set (and copied
back on a hit), else dropped.
"""
from __future__ import annotations

import itertools

import torch
from dataclasses import dataclass, field

from ninfer.models.cache import ModelCache
from ninfer.runtime.pools import PagePool, SlotPool


@dataclass
class HostCopy:
    """A checkpoint moved to host memory: its state slot and KV pages, copied off the device."""

    state: list[torch.Tensor]  # conv then recurrent state, one tensor per DeltaNet layer
    kv: list[torch.Tensor]  # per attention layer: k, v (and scales) of the checkpoint's pages

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.state, *self.kv))


def cache_key(tokens: list[int] | tuple[int, ...], media_keys: tuple[tuple[int, str], ...] = ()) -> tuple:
    """Token ids plus the content hashes of the media that start inside them (pad ids alone are ambiguous)."""
    n = len(tokens)
    return tuple(tokens), tuple(key for start, key in media_keys if start < n)


@dataclass
class Checkpoint:
    key: tuple
    length: int
    slot: int | None  # None once the checkpoint lives in host memory
    pages: list[int]  # pages covering tokens [0, len(tokens)); the last may be partly filled
    last_used: int = 0
    hits: int = 0
    host: HostCopy | None = None


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
    evicted: int = 0  # dropped for good
    offloaded: int = 0  # moved to host memory
    restored: int = 0  # resumed from host memory


@dataclass
class PrefixCache:
    cache: ModelCache
    pages: PagePool
    slots: SlotPool
    page_size: int
    interval: int = 4096
    host_bytes_limit: int = 0  # pinned host memory for evicted checkpoints (0: evict means drop)
    stats: PrefixCacheStats = field(default_factory=PrefixCacheStats)

    def __post_init__(self) -> None:
        self._by_length: dict[int, dict[tuple[int, ...], Checkpoint]] = {}
        self._clock = itertools.count(1)

    def __len__(self) -> int:
        return sum(len(v) for v in self._by_length.values())

    # -- lookup -------------------------------------------------------------------------------
    def lookup(self, prompt: list[int], media_keys: tuple[tuple[int, str], ...] = ()) -> PrefixHit | None:
        """The longest checkpoint whose tokens (and media) prefix ``prompt`` and leave a token to compute."""
        self.stats.lookups += 1
        for length in sorted(self._by_length, reverse=True):
            if length >= len(prompt):
                continue
            ckpt = self._by_length[length].get(cache_key(prompt[:length], media_keys))
            if ckpt is not None:
                ckpt.last_used = next(self._clock)  # the newest entry: the last one eviction would pick
                return PrefixHit(length, ckpt)
        return None

    def record_hit(self, hit: PrefixHit) -> None:
        hit.checkpoint.hits += 1
        self.stats.hits += 1
        self.stats.hit_tokens += hit.length

    def shared_pages(self, hit: PrefixHit) -> list[int]:
        """The checkpoint's fully used pages, which a resuming sequence shares by reference
        (none for a checkpoint in host memory: the sequence gets its own copies)."""
        if hit.checkpoint.host is not None:
            return []
        full = hit.length // self.page_size
        shared = hit.checkpoint.pages[:full]
        for page in shared:
            self.pages.incref(page)
        return shared

    # -- insert / evict -----------------------------------------------------------------------
    def insert(self, tokens: list[int], slot: int, pages: list[int],
               media_keys: tuple[tuple[int, str], ...] = ()) -> bool:
        """Checkpoint the state in ``slot`` after ``tokens`` (whose KV is in ``pages``); False if no slot is free."""
        key, length = cache_key(tokens, media_keys), len(tokens)
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
        self._by_length.setdefault(length, {})[key] = Checkpoint(key, length, target, list(needed), next(self._clock))
        self.stats.inserted += 1
        return True

    def evict_one(self) -> bool:
        """Free the device memory of the least recently used device-resident checkpoint: move it to
        host memory when the host budget allows, else drop it. False when no checkpoint is on the device."""
        on_device = [c for c in self._entries() if c.host is None]
        if not on_device:
            return False
        victim = min(on_device, key=lambda c: c.last_used)
        if not self._offload(victim):
            self._drop(victim)
        return True

    def restore(self, ckpt: Checkpoint, slot: int, pages: list[int]) -> None:
        """Copy a host checkpoint into a sequence's state slot and its own KV pages (covering the prefix)."""
        assert ckpt.host is not None
        self.cache.restore_slot(slot, ckpt.host.state)
        self.cache.restore_pages(pages[: len(ckpt.host.kv[0]) if ckpt.host.kv else 0], ckpt.host.kv)
        self.stats.restored += 1

    def clear(self) -> None:
        for ckpt in list(self._entries()):
            self._drop(ckpt)

    def held(self) -> tuple[int, int]:
        """(distinct KV pages, state slots) the device-resident checkpoints hold."""
        on_device = [c for c in self._entries() if c.host is None]
        return len({p for c in on_device for p in c.pages}), len(on_device)

    @property
    def host_bytes(self) -> int:
        return sum(c.host.nbytes for c in self._entries() if c.host is not None)

    def _entries(self) -> list[Checkpoint]:
        return [c for group in self._by_length.values() for c in group.values()]

    def _offload(self, ckpt: Checkpoint) -> bool:
        if self.host_bytes_limit <= 0:
            return False
        host = HostCopy(self.cache.save_slot(ckpt.slot), self.cache.save_pages(ckpt.pages))
        while self.host_bytes + host.nbytes > self.host_bytes_limit:
            on_host = [c for c in self._entries() if c.host is not None]
            if not on_host:
                return False  # larger than the whole budget
            self._drop(min(on_host, key=lambda c: c.last_used))
        self.pages.release(ckpt.pages)
        self.slots.release(ckpt.slot)
        ckpt.slot, ckpt.pages, ckpt.host = None, [], host
        self.stats.offloaded += 1
        return True

    def _drop(self, ckpt: Checkpoint) -> None:
        group = self._by_length[ckpt.length]
        del group[ckpt.key]
        if not group:
            del self._by_length[ckpt.length]
        if ckpt.host is None:
            self.pages.release(ckpt.pages)
            self.slots.release(ckpt.slot)
        self.stats.evicted += 1



def chat_checkpoint_marks(prompt_ids: list[int], turn_start_id: int | None) -> tuple[int, ...]:
    """Prompt positions worth a checkpoint in a rendered chat: just before the first turn after the
    system prompt (a shared system prompt and tools hit) and just before the last turn, the
    assistant's (the next turn of the conversation starts the same way, also when the template
    drops the reasoning of earlier turns)."""
    if turn_start_id is None:
        return ()
    starts = [i for i, t in enumerate(prompt_ids) if t == turn_start_id and i > 0]
    return tuple(sorted(set(starts[:1] + starts[-1:])))
