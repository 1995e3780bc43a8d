"""Shrink a Triton cache to what a later launch needs: drop the intermediate IRs (TTIR, TTGIR, LLVM IR,
PTX, source) and remove them from each kernel's group file, which Triton checks entry by entry
before it counts a cache hit. Used by perf/device_cache.sh to carry compiled kernels between device
calls (a returned file may have 16 MiB, the carried tree 64 MiB).

    python perf/prune_triton_cache.py $TRITON_CACHE_DIR
"""
from __future__ import annotations

import json
import sys
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


if __name__ == "__main__":
    print(f"pruned {prune(Path(sys.argv[1]))} intermediate files")
