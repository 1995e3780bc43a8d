"""Reusable (pinned) host memory for host copies of decoding state: prefix-cache offloads, pause snapshots.

Why a pool: pinning host memory costs far more than copying into it. Saving one Qwen3.5-27B state slot
(147 MiB in 96 tensors) into freshly pinned tensors took 151 ms on an H200 (1 GB/s: page pinning
dominates) and restoring it 3.6 ms (42 GB/s); an agent loop spent 7.8 s of its 20.1 s in 52 such saves.
So host copies live in blocks of pinned memory that go back to a free list when a copy is dropped and
serve the next save, and that can be pinned ahead at start-up (:meth:`HostPool.reserve`).

Every block has the same size, a power of two: one free list then serves any copy (a state slot, any
number of KV pages), and torch's pinned allocator, which rounds each request up to a power of two (a
147 MiB tensor would pin 256 MiB), wastes nothing. A copy packs its tensors in order into as many
blocks as they need, each at a ``ALIGN``-byte offset, and reads them back through typed views
(``bytes[offset:offset + n].view(dtype).view(shape)``).

The cap: the pool holds (in use + free) at most ``limit`` bytes, the host budgets of its callers
together (the prefix cache's and the pauser's). Callers keep their copies within their budgets, so
blocks are only ever let go when copies beyond every budget (a paused request with media must be
snapshotted) come back: a released block stays in the free list while the pool holds no more than
``limit``, else it goes back to torch (whose pinned allocator caches it in turn).

Synchronization on CUDA: copies into and out of blocks are ``non_blocking`` on the current stream and
an event recorded after them stays with the blocks (:meth:`HostPool.record`). A block handed out again
makes the current stream wait for that event, so a save never overwrites a block that an earlier
asynchronous restore may still be reading; a block let go waits for it on the host. The device storage
a save reads (a state slot, KV pages) may be overwritten right after the save returns: that work is
queued later on the same stream, so it runs after the copy (no host synchronization needed). Nothing
reads a block on the host while a device copy may be in flight. On CPU the blocks are plain memory,
copies synchronous, and the pooling is the same (what the tests exercise).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

ALIGN = 256  # byte alignment of every tensor in a block (any dtype's, and whole DMA-friendly lines)


def pow2_at_least(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass(frozen=True)
class Layout:
    """Where the tensors of one copy lie: (block, byte offset) of each ``(shape, dtype)``, in order."""

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]
    places: tuple[tuple[int, int], ...]
    num_blocks: int

    @classmethod
    def pack(cls, specs: list[tuple[tuple[int, ...], torch.dtype]], block_bytes: int) -> Layout:
        """Pack in order: a tensor that does not fit what is left of a block starts the next one."""
        places, block, offset = [], 0, 0
        for shape, dtype in specs:
            n = _nbytes(shape, dtype)
            if n > block_bytes:
                raise ValueError(f"a {n}-byte tensor does not fit a {block_bytes}-byte host block")
            if offset + n > block_bytes:
                block, offset = block + 1, 0
            places.append((block, offset))
            offset = aligned(offset + n)
        shapes, dtypes = zip(*specs) if specs else ((), ())
        return cls(tuple(map(tuple, shapes)), tuple(dtypes), tuple(places), block + 1 if specs else 0)


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    n = dtype.itemsize
    for d in shape:
        n *= d
    return n


class HostBlock:
    """``block_bytes`` of host memory, and the event after the last device copy into or out of it."""

    __slots__ = ("data", "event")

    def __init__(self, data: torch.Tensor) -> None:
        self.data = data
        self.event: torch.cuda.Event | None = None


@dataclass
class HostTensors:
    """One copy in pool blocks: typed views of a :class:`Layout` (repeated ``len(blocks) / num_blocks``
    times) and the blocks they live in, until :meth:`HostPool.release` gives them back (then both empty)."""

    tensors: list[torch.Tensor]
    blocks: list[HostBlock]
    block_bytes: int
    rows: int = 0  # what the leading dimension counts, where the caller needs it (the pages of a page save)

    @property
    def nbytes(self) -> int:
        """Host memory held: whole blocks (what the callers' budgets count)."""
        return len(self.blocks) * self.block_bytes


@dataclass
class HostPool:
    """A free list of equal host blocks (pinned when ``pin``), capped at ``limit`` bytes held; see the module doc."""

    block_bytes: int
    pin: bool
    limit: int = 0
    allocated: int = 0  # blocks ever allocated (pinned): the allocations the pool could not spare
    _free: list[HostBlock] = field(default_factory=list, init=False, repr=False)
    _in_use: int = field(default=0, init=False)

    @property
    def used_bytes(self) -> int:
        return self._in_use * self.block_bytes

    @property
    def free_bytes(self) -> int:
        return len(self._free) * self.block_bytes

    @property
    def held_bytes(self) -> int:
        return self.used_bytes + self.free_bytes

    def reserve(self, nbytes: int) -> None:
        """Allocate (pin) free blocks ahead until the pool holds ``nbytes`` (at most ``limit``), so that
        the first copies do not pay for pinning (about 1 GB/s)."""
        while self.held_bytes + self.block_bytes <= min(nbytes, self.limit):
            self._free.append(self._allocate())

    def take(self, layout: Layout, repeat: int = 1, rows: int = 0) -> HostTensors:
        """Blocks for ``repeat`` copies of ``layout`` (the most recently freed first) and their views."""
        blocks = [self._free.pop() if self._free else self._allocate() for _ in range(layout.num_blocks * repeat)]
        self._in_use += len(blocks)
        for block in blocks:
            if block.event is not None:  # an earlier copy out of this block may still be running
                torch.cuda.current_stream().wait_event(block.event)
                block.event = None
        tensors = [blocks[r * layout.num_blocks + b].data[offset: offset + _nbytes(shape, dtype)]
                   .view(dtype).view(shape)
                   for r in range(repeat)
                   for shape, dtype, (b, offset) in zip(layout.shapes, layout.dtypes, layout.places)]
        return HostTensors(tensors, blocks, self.block_bytes, rows)

    def record(self, saved: HostTensors) -> None:
        """After queueing copies into or out of ``saved``: mark its blocks busy until they complete."""
        if self.pin and saved.blocks:
            event = torch.cuda.Event()
            event.record()
            for block in saved.blocks:
                block.event = event

    def release(self, saved: HostTensors | None) -> None:
        """Give a copy's blocks back (a no-op for ``None`` or a copy already released): kept for reuse
        while the pool holds at most ``limit`` bytes, else let go."""
        if saved is None:
            return
        blocks, saved.blocks, saved.tensors = saved.blocks, [], []
        for block in blocks:
            if self.held_bytes <= self.limit:
                self._free.append(block)
            elif block.event is not None:
                block.event.synchronize()  # torch may hand the memory out again once we drop it
            self._in_use -= 1

    def _allocate(self) -> HostBlock:
        self.allocated += 1
        return HostBlock(torch.empty(self.block_bytes, dtype=torch.uint8, pin_memory=self.pin))
