"""perf/prune_triton_cache.py: a pruned Triton cache still counts as a hit (what the device runbook carries)."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("prune_triton_cache", ROOT / "perf" / "prune_triton_cache.py")
prune_triton_cache = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(prune_triton_cache)

# Compiles one kernel for sm_90 offline (no GPU needed) and prints which artifacts the result holds:
# a cache hit after pruning holds only the cubin.
_COMPILE = """
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
@triton.jit
def double(x, y, n, B: tl.constexpr):
    o = tl.arange(0, B)
    tl.store(y + o, tl.load(x + o, mask=o < n) * 2, mask=o < n)
c = triton.compile(ASTSource(double, {"x": "*fp32", "y": "*fp32", "n": "i32", "B": "constexpr"}, {"B": 64}),
                   target=GPUTarget("cuda", 90, 32))
print(",".join(sorted(c.asm.keys())))
"""


def test_prune_keeps_binaries_and_rewrites_groups(tmp_path: Path) -> None:
    entry = tmp_path / "abc"
    entry.mkdir()
    files = {ext: entry / f"k.{ext}" for ext in ("json", "cubin", "ptx", "ttir", "ttgir", "llir", "source")}
    for path in files.values():
        path.write_text("x")
    group = entry / "__grp__k.json"
    group.write_text(json.dumps({"child_paths": {p.name: str(p) for p in files.values()}}))
    assert prune_triton_cache.prune(tmp_path) == 5
    assert sorted(p.name for p in entry.iterdir()) == ["__grp__k.json", "k.cubin", "k.json"]
    assert sorted(json.loads(group.read_text())["child_paths"]) == ["k.cubin", "k.json"]


def test_pruned_entry_is_still_a_cache_hit(tmp_path: Path) -> None:
    script = tmp_path / "compile_double.py"  # @triton.jit needs its source in a file
    script.write_text(_COMPILE)
    cache = tmp_path / "cache"
    env = {**os.environ, "TRITON_CACHE_DIR": str(cache), "TRITON_INTERPRET": "0"}
    run = lambda: subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,  # noqa: E731
                                 check=True).stdout.strip()
    assert "ptx" in run().split(",")  # a fresh compile produces every IR
    prune_triton_cache.prune(cache)
    assert run() == "cubin"  # loaded from the pruned cache, not recompiled


def test_evict_drops_the_kernels_used_least_recently(tmp_path: Path) -> None:
    """Three 100-byte kernels, used at t = 1, 3, 2: a 200-byte budget keeps the two used last; other files stay."""
    for name, used in (("a", 1), ("b", 3), ("c", 2)):
        entry = tmp_path / name
        entry.mkdir()
        group = entry / "__grp__k.json"
        group.write_text(json.dumps({"child_paths": {}}))
        (entry / "k.cubin").write_bytes(b"x" * (100 - group.stat().st_size))
        os.utime(group, (used, used))
    (tmp_path / "autotune.json").write_text("{}")
    assert prune_triton_cache.evict(tmp_path, 200) == 1
    assert not list((tmp_path / "a").iterdir()) and len(list((tmp_path / "b").iterdir())) == 2
    assert (tmp_path / "autotune.json").exists()
    assert prune_triton_cache.evict(tmp_path, 10_000) == 0


def test_a_cache_hit_marks_its_kernel_used(tmp_path: Path) -> None:
    """Under the usage-marking manager a hit sets the group file's mtime: what evict orders by."""
    script = tmp_path / "compile_double.py"
    script.write_text(_COMPILE)
    cache = tmp_path / "cache"
    env = {**os.environ, "TRITON_CACHE_DIR": str(cache), "TRITON_INTERPRET": "0",
           "TRITON_CACHE_MANAGER": "prune_triton_cache:UsageMarkingCacheManager",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "perf"), os.environ.get("PYTHONPATH", "")])}
    run = lambda: subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,  # noqa: E731
                                 check=True).stdout.strip()
    run()
    groups = list(cache.rglob("__grp__double.json"))
    assert len(groups) == 1
    os.utime(groups[0], (1, 1))
    run()  # a hit
    assert groups[0].stat().st_mtime > 1
