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
