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
back on a hit), else dropped. Slots are scarce (a few per engine) and pages plentiful, and the
checkpoints of one conversation share most of their pages, so eviction takes two steps: freeing a
slot moves only the state to the host (~150 MB at 27B) and leaves the KV pages shared on the device;
the KV follows only when admission runs short of pages (64 KiB per token at 27B: copying it with every
slot eviction cost 2 GiB per 32k-token checkpoint, seconds per turn of a long chat). Host copies live in
blocks of the runtime's host pool (:mod:`ninfer.runtime.host_memory`: pinning fresh memory per offload ran
at 1 GB/s) and go back to it when a checkpoint is dropped (from the host budget, by eviction, or clear).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from ninfer.models.cache import ModelCache
from ninfer.runtime.host_cache import HostCache
from ninfer.runtime.host_memory import HostTensors
from ninfer.runtime.pools import PagePool, SlotPool
from ninfer.runtime.request import Request


@dataclass
class HostCopy:
    """What a checkpoint (or a paused request) keeps in host memory: its state slot and, unless its KV
    pages are still on the device, their contents; in blocks of the host cache's pool, which the owner
    gives back (:meth:`release`) when it drops the copy."""

    state: HostTensors  # HostCache.save_slot: conv then recurrent state, one tensor per DeltaNet layer
    kv: HostTensors | None  # HostCache.save_pages: k, v (and scales) of the pages; None: on the device

    @property
    def nbytes(self) -> int:
        """Host memory held (whole pool blocks)."""
        return self.state.nbytes + (self.kv.nbytes if self.kv is not None else 0)

    def release(self, host: HostCache) -> None:
        """Give the blocks back to ``host``'s pool (the owner drops the copy; a second call is a no-op)."""
        host.release(self.state, self.kv)


def cache_key(tokens: list[int] | tuple[int, ...], media_keys: tuple[tuple[int, str], ...] = ()) -> tuple:
    """Token ids plus the content hashes of the media that start inside them (pad ids alone are ambiguous)."""
    n = len(tokens)
    return tuple(tokens), tuple(key for start, key in media_keys if start < n)


@dataclass
class Checkpoint:
    key: tuple
    length: int
    slot: int | None  # None once the state lives in host memory
    pages: list[int]  # device pages covering tokens [0, length), the last maybe partly filled; [] once on the host
    last_used: int = 0
    hits: int = 0
    host: HostCopy | None = None  # the state (and maybe the KV) in host memory

    @property
    def kv_on_host(self) -> bool:
        return self.host is not None and self.host.kv is not None


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
    offloaded: int = 0  # state moved to host memory (a slot freed)
    kv_offloaded: int = 0  # KV pages moved to host memory too (pages freed)
    restored: int = 0  # resumed from host memory (the state, and the KV when it was there)


@dataclass
class PrefixCache:
    cache: ModelCache
    host: HostCache  # the offloads' copies
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
        (none when its KV is in host memory: the sequence gets its own copies)."""
        if hit.checkpoint.kv_on_host:
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
        if not tokens or self.holds(tokens, media_keys):
            return False
        target = self.reserve_slot()
        if target is None:
            return False
        self.cache.copy_slot(slot, target)
        return self.adopt(tokens, target, pages, media_keys)

    def holds(self, tokens: list[int], media_keys: tuple[tuple[int, str], ...] = ()) -> bool:
        """Whether ``tokens`` are checkpointed already."""
        return cache_key(tokens, media_keys) in self._by_length.get(len(tokens), {})

    def reserve_slot(self) -> int | None:
        """A state slot for a new checkpoint (freeing the least recently used one's if none is free), or
        None. The forward that fills it hands it back through :meth:`adopt`."""
        target = self.slots.acquire()
        if target is None and self.free_slot():
            target = self.slots.acquire()
        return target

    def adopt(self, tokens: list[int], slot: int, pages: list[int],
              media_keys: tuple[tuple[int, str], ...] = ()) -> bool:
        """Checkpoint ``tokens`` with the state already in ``slot`` (from :meth:`reserve_slot`; released
        if that prefix is already checkpointed); False then."""
        if not tokens or self.holds(tokens, media_keys):
            self.slots.release(slot)
            return False
        key, length = cache_key(tokens, media_keys), len(tokens)
        needed = pages[: -(-length // self.page_size)]
        for page in needed:
            self.pages.incref(page)
        self._by_length.setdefault(length, {})[key] = Checkpoint(key, length, slot, list(needed), next(self._clock))
        self.stats.inserted += 1
        return True

    def forward_checkpoints(self, prefills: list[tuple[Request, int]], marks: dict[str, int],
                            first_row: int) -> list[tuple[int, Request, int, int, int]]:
        """The checkpoints a packed forward writes itself: ``(i, req, row, r, slot)`` per prompt chunk
        ``(req, end)`` with a mark (``marks``: request id -> prompt position) inside it whose prefix is not
        cached yet, while state slots can be reserved for them: its index in the batch (chunks start at
        ``first_row``, after the decode rows), the chunk's first packed row, the tokens before the mark, and
        the checkpoint's slot (:meth:`adopt` takes it after the forward)."""
        out = []
        row = first_row
        for i, (req, end) in enumerate(prefills, start=first_row):
            start, mark = req.num_computed, marks.get(req.request_id)
            if mark is not None and not self.holds(req.tokens(0, mark), req.media_keys):
                slot = self.reserve_slot()
                if slot is not None:
                    out.append((i, req, row, mark - start, slot))
            row += end - start
        return out

    def free_slot(self) -> bool:
        """Free one state slot: the least recently used checkpoint holding one moves its state to host
        memory and keeps its KV pages on the device (when the host budget allows), or is dropped.
        False when no checkpoint holds a slot."""
        return self._evict_lru([c for c in self._entries() if c.slot is not None], kv=False)

    def evict_one(self) -> bool:
        """Free all the device memory (state slot and KV pages) of the least recently used checkpoint
        holding any: move it to host memory when the host budget allows, else drop it. False when no
        checkpoint holds device memory."""
        return self._evict_lru([c for c in self._entries() if c.slot is not None or c.pages], kv=True)

    def _evict_lru(self, holders: list[Checkpoint], kv: bool) -> bool:
        if not holders:
            return False
        victim = min(holders, key=lambda c: c.last_used)
        if not self._offload(victim, kv=kv):
            self._drop(victim)
        return True

    def restore(self, ckpt: Checkpoint, slot: int, pages: list[int] | None = None) -> None:
        """Copy a checkpoint's state into a sequence's ``slot`` (from its slot or host memory) and, when its
        KV is in host memory, into the sequence's own ``pages`` (covering the prefix)."""
        if ckpt.slot is not None:
            self.cache.copy_slot(ckpt.slot, slot)
            return
        assert ckpt.host is not None
        self.host.restore_slot(slot, ckpt.host.state)
        if ckpt.host.kv is not None:
            assert pages is not None, "a checkpoint with its KV on the host needs the sequence's pages"
            self.host.restore_pages(pages[: ckpt.host.kv.rows], ckpt.host.kv)
        self.stats.restored += 1

    def clear(self) -> None:
        for ckpt in list(self._entries()):
            self._drop(ckpt)

    def held(self) -> tuple[int, int]:
        """(distinct KV pages, state slots) the checkpoints hold on the device."""
        entries = self._entries()
        return len({p for c in entries for p in c.pages}), sum(c.slot is not None for c in entries)

    @property
    def host_bytes(self) -> int:
        return sum(c.host.nbytes for c in self._entries() if c.host is not None)

    def _entries(self) -> list[Checkpoint]:
        return [c for group in self._by_length.values() for c in group.values()]

    def _offload(self, ckpt: Checkpoint, kv: bool) -> bool:
        """Move the checkpoint's state (if on the device) and, with ``kv``, its KV pages to host memory,
        dropping older host copies to fit; False (nothing moved) when the budget cannot hold them."""
        kv_pages = ckpt.pages if kv else []
        if not self._host_room(self.host.host_nbytes(slot=ckpt.slot is not None, pages=len(kv_pages)), keep=ckpt):
            return False
        if ckpt.slot is not None:
            state = self.host.save_slot(ckpt.slot)
            self.slots.release(ckpt.slot)
            ckpt.slot = None
            self.stats.offloaded += 1
        else:
            assert ckpt.host is not None
            state = ckpt.host.state
        kv_copy = ckpt.host.kv if ckpt.host is not None else None
        if kv_pages:
            kv_copy = self.host.save_pages(kv_pages)
            self.pages.release(kv_pages)
            ckpt.pages = []
            self.stats.kv_offloaded += 1
        ckpt.host = HostCopy(state, kv_copy)
        return True

    def _host_room(self, nbytes: int, keep: Checkpoint) -> bool:
        """Make ``nbytes`` of the host budget free by dropping the least recently used host copies other
        than ``keep``'s; False when the budget is off or cannot hold them."""
        if self.host_bytes_limit <= 0 or nbytes > self.host_bytes_limit:
            return False
        while self.host_bytes + nbytes > self.host_bytes_limit:
            on_host = [c for c in self._entries() if c.host is not None and c is not keep]
            if not on_host:
                return False
            self._drop(min(on_host, key=lambda c: c.last_used))
        return True

    def _drop(self, ckpt: Checkpoint) -> None:
        group = self._by_length[ckpt.length]
        del group[ckpt.key]
        if not group:
            del self._by_length[ckpt.length]
        self.pages.release(ckpt.pages)
        if ckpt.slot is not None:
            self.slots.release(ckpt.slot)
        if ckpt.host is not None:  # the pinned blocks serve the next offload
            ckpt.host.release(self.host)
            ckpt.host = None
        self.stats.evicted += 1



# How close before the prompt's end a request's own mark may lie and still stand in for the end mark.
END_MARK_REACH = 16


def prompt_end_mark(prompt_len: int, marks: tuple[int, ...]) -> int | None:
    """The checkpoint one token before the prompt's end, so that a repeated prompt hits; ``None`` when one
    of the request's marks lies at most ``END_MARK_REACH`` tokens before it (a rendered chat's last turn
    start, ``<|im_start|>assistant``), which serves a repeat as well. A chunk's forward writes only its
    last mark's state itself; a mark before it ends the chunk, and each extra chunk is another forward
    that reads every weight once more (~11 ms on the 27B int4 model)."""
    end = prompt_len - 1
    if end <= 0 or any(end - END_MARK_REACH <= m < end for m in marks):
        return None
    return end


def chat_checkpoint_marks(prompt_ids: list[int], turn_start_id: int | None) -> tuple[int, ...]:
    """Prompt positions worth a checkpoint in a rendered chat: just before the first turn after the
    system prompt (a shared system prompt and tools hit) and just before the last turn, the
    assistant's (the next turn of the conversation starts the same way, also when the template
    drops the reasoning of earlier turns)."""
    if turn_start_id is None:
        return ()
    starts = [i for i, t in enumerate(prompt_ids) if t == turn_start_id and i > 0]
    return tuple(sorted(set(starts[:1] + starts[-1:])))
