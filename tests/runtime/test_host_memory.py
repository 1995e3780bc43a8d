"""Host copies of the model cache (HostCache) in reused host-pool blocks: exact round trips, reuse, release, the cap."""
from __future__ import annotations

import pytest
import torch

from ninfer.config import parse_config
from ninfer.models.cache import ModelCache
from ninfer.runtime.host_cache import HostCache
from ninfer.runtime.host_memory import ALIGN, HostPool, Layout, aligned, pow2_at_least
from tiny_checkpoints import text_config_kwargs

LAYERS = ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"]
CONFIG = parse_config({"model_type": "qwen3_5_text", **text_config_kwargs(head_dim=128, layer_types=LAYERS)})


def _cache(dtype: torch.dtype = torch.bfloat16, kv_dtype: str = "auto", **kw) -> HostCache:
    kw.setdefault("limit", 1 << 30)
    device_cache = ModelCache(CONFIG, num_pages=12, page_size=4, num_slots=3, device="cpu", dtype=dtype,
                              kv_dtype=kv_dtype, with_mtp=True)
    cache = HostCache(device_cache, **kw)
    _scramble(cache, seed=0)
    return cache


def _scramble(cache: HostCache, seed: int) -> None:
    """Random bits in every state and KV tensor (any bit pattern: the copies must move bytes, not values)."""
    g = torch.Generator().manual_seed(seed)
    for t in (*cache.cache.state_tensors(), *cache.cache.page_tensors()):
        bits = t.view(torch.uint8)
        bits.copy_(torch.randint(0, 256, bits.shape, generator=g, dtype=torch.uint8))


def _bits(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.view(torch.uint8).clone() for t in tensors]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _slot(cache: HostCache, slot: int) -> list[torch.Tensor]:
    return _bits([s[slot] for s in cache.cache.state_tensors()])


def _pages(cache: HostCache, pages: list[int]) -> list[torch.Tensor]:
    return _bits([t[pages] for t in cache.cache.page_tensors()])


KINDS = [(torch.bfloat16, "auto"), (torch.float32, "auto"), (torch.bfloat16, "bf16"), (torch.bfloat16, "fp8"),
         (torch.bfloat16, "int8"), (torch.float32, "int8")]


def _one_page_block(dtype: torch.dtype, kv_dtype: str) -> int:
    """The smallest block that holds a page: a state copy then spans several blocks, a page copy one per page."""
    probe = _cache(dtype, kv_dtype)
    return pow2_at_least(sum(aligned(t[0].numel() * t.element_size()) for t in probe.cache.page_tensors()))


@pytest.mark.parametrize("small", [False, True], ids=["default-blocks", "small-blocks"])
@pytest.mark.parametrize("dtype,kv_dtype", KINDS, ids=[f"{d}-{k}".replace("torch.", "") for d, k in KINDS])
def test_save_restore_is_bit_exact(dtype: torch.dtype, kv_dtype: str, small: bool) -> None:
    cache = _cache(dtype, kv_dtype, block_bytes=_one_page_block(dtype, kv_dtype) if small else None)
    if small:
        assert cache.state_layout.num_blocks > 1 and cache.pages_per_block == 1
    else:
        assert cache.state_layout.num_blocks == 1 and cache.pages_per_block > 1
    want_slot, pages = _slot(cache, 1), [7, 2, 9, 0, 5]
    want_pages = _pages(cache, pages)
    state, kv = cache.save_slot(1), cache.save_pages(pages)
    assert kv.rows == len(pages)
    assert state.nbytes == cache.host_nbytes(slot=True) and kv.nbytes == cache.host_nbytes(pages=len(pages))
    _scramble(cache, seed=1)  # the device storage is reused right after the save
    cache.restore_slot(2, state)
    cache.restore_pages([1, 3, 4, 6, 8], kv)
    assert _same(_slot(cache, 2), want_slot) and _same(_pages(cache, [1, 3, 4, 6, 8]), want_pages)
    cache.restore_pages([11, 10], kv)  # a prefix of the saved pages (a hit shorter than the copy)
    assert _same(_pages(cache, [11, 10]), _pages(cache, [1, 3]))
    assert cache.pool.used_bytes == state.nbytes + kv.nbytes
    cache.release(state, kv, None)
    assert cache.pool.used_bytes == 0 and cache.pool.free_bytes == cache.pool.held_bytes > 0


def test_blocks_are_reused_after_release() -> None:
    cache = _cache()
    first = cache.save_slot(0)
    ptrs = sorted(b.data.data_ptr() for b in first.blocks)
    cache.release(first)
    again = cache.save_slot(1)
    assert sorted(b.data.data_ptr() for b in again.blocks) == ptrs and cache.pool.allocated == len(ptrs)
    assert _same(_bits(again.tensors), _slot(cache, 1))
    pages = cache.save_pages(list(range(12)))  # needs new blocks: the state copy holds the old ones
    cache.release(again, pages)
    allocated = cache.pool.allocated
    cache.release(cache.save_pages(list(range(12))), cache.save_slot(2))  # any freed block serves any copy
    assert cache.pool.allocated == allocated


def test_release_is_idempotent_and_empties_the_copy() -> None:
    cache = _cache()
    saved = cache.save_slot(0)
    cache.release(saved)
    free = cache.pool.free_bytes
    cache.release(saved)
    assert cache.pool.free_bytes == free and saved.nbytes == 0 and saved.tensors == []
    with pytest.raises(ValueError):  # a released copy cannot be restored by mistake
        cache.restore_slot(0, saved)


def test_pool_keeps_at_most_its_limit() -> None:
    pool = HostPool(block_bytes=1024, pin=False, limit=3 * 1024)
    layout = Layout.pack([((256,), torch.float32)], 1024)  # one block per copy
    copies = [pool.take(layout) for _ in range(5)]  # callers may exceed the cap (a must-snapshot)...
    assert pool.used_bytes == 5 * 1024 and pool.allocated == 5
    for c in copies:
        pool.release(c)
    assert pool.held_bytes == pool.free_bytes == 3 * 1024  # ...but freed blocks beyond it are let go
    pool.reserve(10 * 1024)
    assert pool.held_bytes == 3 * 1024 and pool.allocated == 5


def test_reserve_pins_ahead_so_saves_allocate_nothing() -> None:
    cache = _cache(prepin=1 << 20)
    assert cache.pool.free_bytes > (1 << 20) - cache.pool.block_bytes and cache.pool.used_bytes == 0
    allocated = cache.pool.allocated
    copies = [cache.save_slot(0), cache.save_pages([0, 1, 2])]
    assert cache.pool.allocated == allocated
    cache.release(*copies)
    assert cache.pool.used_bytes == 0


def test_no_limit_keeps_nothing() -> None:
    cache = _cache(limit=0)
    cache.release(cache.save_slot(0))
    assert cache.pool.held_bytes == 0


def test_layout_aligns_and_spills_to_the_next_block() -> None:
    layout = Layout.pack([((3,), torch.bfloat16), ((10,), torch.float32), ((50,), torch.float32),
                          ((4,), torch.float8_e4m3fn)], 512)
    assert layout.places == ((0, 0), (0, ALIGN), (1, 0), (1, ALIGN))  # 6 + 40 bytes, then 200 + 4
    assert layout.num_blocks == 2
    with pytest.raises(ValueError):
        Layout.pack([((200,), torch.float32)], 512)
    pool = HostPool(512, pin=False, limit=0)
    views = pool.take(layout, repeat=2).tensors
    assert [v.dtype for v in views[:4]] == [torch.bfloat16, torch.float32, torch.float32, torch.float8_e4m3fn]
    assert [tuple(v.shape) for v in views[4:]] == [(3,), (10,), (50,), (4,)]
    assert [v.storage_offset() * v.element_size() for v in views] == [0, ALIGN, 0, ALIGN] * 2
