"""Host copies of decoding state at the 27B shape (no weights): fresh pinning against pooled blocks.

The prefix cache's state offloads and the pauser's snapshots copy a state slot (147 MiB at 27B, 96
tensors) and KV pages to host memory. Into freshly pinned tensors a save took 151 ms (1 GB/s); into the
blocks of a ``HostCache`` (ninfer/runtime/host_cache.py, host_memory.py) the pinning happens once. Rows:

  - host_save_state   fresh-pinned per tensor (the old path) / into new pool blocks / into reused blocks
  - host_restore_state from pool blocks
  - host_save_kv, host_restore_kv   ``--pages`` pages (default 512: a 32k-token checkpoint)
  - host_prepin       pinning pool blocks ahead (HostPool.reserve), GB/s

Each save is timed to its completion (synchronized); ``--saves`` copies stay alive at once, as the
checkpoints of an agent loop do (no block is freed in between).

    python perf/bench_host_copies.py [--saves 52] [--pages 512]
    python perf/bench_host_copies.py --shape tiny --device cpu --saves 4 --pages 8  # smoke test
"""
from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from common import record, sync
from random_model import shape_config
from ninfer.config import parse_config
from ninfer.models.cache import ModelCache
from ninfer.runtime.host_cache import HostCache


def _timed(fn) -> tuple[float, object]:
    sync()
    start = time.perf_counter()
    out = fn()
    sync()
    return time.perf_counter() - start, out


def _saves(n: int, save: Callable[[], object]) -> tuple[list[float], list]:
    """``n`` saves kept alive (so none reuses another's memory): their times and the copies."""
    times, kept = [], []
    for _ in range(n):
        s, saved = _timed(save)
        times.append(s)
        kept.append(saved)
    return times, kept


def _legacy_save(cache: ModelCache, slot: int) -> list[torch.Tensor]:
    """The old path: a new pinned tensor per state tensor per save."""
    out = []
    for state in cache.state_tensors():
        host = torch.empty(state[slot].shape, dtype=state.dtype, pin_memory=state.is_cuda)
        host.copy_(state[slot])
        out.append(host)
    return out


def _row(bench: str, what: str, seconds: list[float], nbytes: int, **extra) -> None:
    ms = 1e3 * sorted(seconds)[len(seconds) // 2]
    record(bench, what, ms, achieved=nbytes / ms / 1e6, limit=float("nan"), unit="GB/s",
           mean_ms=round(1e3 * sum(seconds) / len(seconds), 3), max_ms=round(1e3 * max(seconds), 3), **extra)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--saves", type=int, default=52)
    parser.add_argument("--pages", type=int, default=512)
    parser.add_argument("--kv-dtype", default="auto")
    parser.add_argument("--shape", default="27b")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    config, shape = parse_config(shape_config(args.shape)), args.shape
    device_cache = ModelCache(config, num_pages=args.pages + 8, page_size=64, num_slots=2, device=args.device,
                              dtype=torch.bfloat16, kv_dtype=args.kv_dtype)
    for t in (*device_cache.state_tensors(), *device_cache.page_tensors()):
        t.view(torch.uint8).random_()
    cache = HostCache(device_cache, limit=64 << 30)
    pool, slot_mib = cache.pool, device_cache.slot_nbytes / 2 ** 20
    slot_bytes, state_host = device_cache.slot_nbytes, cache.host_nbytes(slot=True)
    what = f"{shape} state slot {slot_mib:.0f} MiB in {len(device_cache.state_tensors())} tensors"
    print(f"block {pool.block_bytes >> 10} KiB: a state copy takes {state_host >> 10} KiB of blocks, "
          f"{cache.pages_per_block} KV pages per block")

    times, kept = _saves(args.saves, lambda: cache.save_slot(0))
    _row("host_save_state", f"{what} new pool blocks", times, slot_bytes, saves=args.saves,
         allocated_blocks=pool.allocated)
    cache.release(*kept)

    times, legacy = _saves(args.saves, lambda: _legacy_save(device_cache, 0))
    _row("host_save_state", f"{what} fresh pinned tensors (old path)", times, slot_bytes, saves=args.saves)
    del legacy

    allocated = pool.allocated
    times, kept = _saves(args.saves, lambda: cache.save_slot(0))
    _row("host_save_state", f"{what} reused pool blocks", times, slot_bytes, saves=args.saves,
         new_blocks=pool.allocated - allocated)
    times = [_timed(lambda: cache.restore_slot(1, saved))[0] for saved in kept[:20]]
    _row("host_restore_state", f"{what} from pool blocks", times, slot_bytes)
    cache.release(*kept)

    pages, kv_bytes = list(range(args.pages)), args.pages * device_cache.page_nbytes
    kv_what = f"{shape} {args.pages} KV pages {kv_bytes / 2 ** 30:.2f} GiB {args.kv_dtype}"
    first, saved = _timed(lambda: cache.save_pages(pages))
    cache.release(saved)
    times = []
    for _ in range(5):
        s, saved = _timed(lambda: cache.save_pages(pages))
        times.append(s)
        cache.release(saved)
    _row("host_save_kv", f"{kv_what} reused pool blocks", times, kv_bytes, first_save_ms=round(1e3 * first, 2))
    saved = cache.save_pages(pages)
    times = [_timed(lambda: cache.restore_pages(pages, saved))[0] for _ in range(5)]
    _row("host_restore_kv", f"{kv_what} from pool blocks", times, kv_bytes)
    cache.release(saved)

    fresh = HostCache(ModelCache(config, num_pages=8, page_size=64, num_slots=1, device=args.device,
                                 dtype=torch.bfloat16), limit=8 << 30).pool
    s, _ = _timed(lambda: fresh.reserve(4 << 30 if args.device == "cuda" else 64 << 20))
    _row("host_prepin", f"{shape} pool reserve {fresh.held_bytes / 2 ** 30:.1f} GiB", [s], fresh.held_bytes)
    stats = getattr(torch.cuda, "host_memory_stats", None)
    if stats is not None and args.device == "cuda":
        print({k: v for k, v in stats().items() if "bytes" in k and "current" in k.lower()})


if __name__ == "__main__":
    main()
