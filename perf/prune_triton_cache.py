"""Shrink a Triton cache to what a later launch needs: drop the intermediate IRs (TTIR, TTGIR, LLVM IR,
PTX, source) and remove them from each kernel's group file, which Triton checks entry by entry
before it counts a cache hit; then, past a byte budget, drop the kernels used least recently. Used by
perf/device_cache.sh to carry compiled kernels between device calls (a returned file may have 16 MiB, the
carried tree 64 MiB, and the tuning candidates of every session would fill it).

"Used": :class:`UsageMarkingCacheManager` (``TRITON_CACHE_MANAGER=prune_triton_cache:UsageMarkingCacheManager``,
set by the runbook) touches a kernel's group file on every cache hit, and a compile writes it, so the group's
modification time is when the kernel was last needed; the carried tar keeps it across calls.

    python perf/prune_triton_cache.py $TRITON_CACHE_DIR [--budget BYTES]
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

DROP = {".llir", ".ttir", ".ttgir", ".ptx", ".source", ".amdgcn"}


def prune(cache_dir: Path) -> int:
    """Delete the droppable files of every group in ``cache_dir``; returns how many were deleted."""
    dropped = 0
    for group in cache_dir.rglob("__grp__*.json"):
        try:
            data = json.loads(group.read_text())
        except (OSError, ValueError):
            continue  # Triton treats a corrupt group as a miss and recompiles: nothing to keep
        kept = {}
        for name, path in data.get("child_paths", {}).items():
            if Path(path).suffix in DROP:
                Path(path).unlink(missing_ok=True)
                dropped += 1
            else:
                kept[name] = path
        data["child_paths"] = kept
        group.write_text(json.dumps(data))
    return dropped


def evict(cache_dir: Path, budget: int) -> int:
    """Delete whole kernel entries (a group file's directory), least recently used first, until the entries
    with a group file hold at most ``budget`` bytes; returns how many were deleted. Other files (Triton's
    autotuning results, ninfer's warm-start markers) are left alone."""
    entries = []
    for group in cache_dir.rglob("__grp__*.json"):
        files = [f for f in group.parent.iterdir() if f.is_file()]
        entries.append((group.stat().st_mtime, sum(f.stat().st_size for f in files), group.parent, files))
    total = sum(size for _, size, _, _ in entries)
    evicted = 0
    for _, size, _, files in sorted(entries, key=lambda e: e[0]):
        if total <= budget:
            break
        for f in files:
            f.unlink(missing_ok=True)
        total -= size
        evicted += 1
    return evicted


def _usage_marking_manager():
    from triton.runtime.cache import FileCacheManager

    class UsageMarkingCacheManager(FileCacheManager):
        """Triton's file cache that marks a kernel as used (its group file's mtime) on every hit."""

        def get_group(self, filename: str):
            found = super().get_group(filename)
            if found:
                try:
                    os.utime(self._make_path(f"__grp__{filename}"))
                except OSError:
                    pass  # a read-only or vanished cache is still a hit
            return found
    return UsageMarkingCacheManager


def __getattr__(name: str):  # Triton imports the class by name; building it lazily keeps this file triton-free
    if name == "UsageMarkingCacheManager":
        return _usage_marking_manager()
    raise AttributeError(name)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("cache_dir", type=Path)
    parser.add_argument("--budget", type=int, default=None, help="bytes of kernel entries to keep at most")
    args = parser.parse_args()
    print(f"pruned {prune(args.cache_dir)} intermediate files")
    if args.budget is not None:
        print(f"evicted {evict(args.cache_dir, args.budget)} least recently used kernels")
