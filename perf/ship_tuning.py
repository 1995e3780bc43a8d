"""Merge exported tuning choices into the package's shipped per-GPU tables (``ninfer/kernels/tuned/``).

A GPU run with ``NINFER_EXPORT_TUNING=<path>`` (``perf/bench_engine.py``, ``perf/bench_startup.py``) writes the
choices it made (``ninfer.kernels.shipped_export``). This script validates such files and merges each into
``<dest>/<gpu>-sm<cc>.json`` (the GPU model from the file's ``meta``; a later entry replaces an earlier one of
the same key), then prints the entries per runtime-tuner table and per autotuned kernel: in each input, and
in the resulting table with how many were new or changed. Commit the changed tables afterwards.

    python perf/ship_tuning.py /tmp/h200.json [/tmp/h200-35b.json ...] [--dest DIR] [--dry-run]

Nothing is written if any input is malformed. Autotuned kernel names that no kernel of this checkout declares
(a renamed kernel, a file from another branch) are reported: their entries would never be read.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import ninfer  # noqa: F401 (imports every kernel module: the autotuner registry is complete)
from ninfer.kernels import shipped, shipped_export, tune_cache
from ninfer.kernels.autotune import registered

DEST = Path(__file__).resolve().parents[1] / "ninfer" / "kernels" / "tuned"


def _changed(before: dict[str, Any], after: dict[str, Any]) -> dict[str, int]:
    """Per table / kernel: entries of ``after`` that ``before`` lacked or held with other fields."""
    out = {}
    for section, prefix in (("tables", ""), ("autotune", "autotune:")):
        for group, entries in after.get(section, {}).items():
            old = before.get(section, {}).get(group, {})
            n = sum(old.get(k) != v for k, v in entries.items())
            if n:
                out[prefix + group] = n
    return out


def _lines(counts: dict[str, int], changed: dict[str, int] | None = None) -> list[str]:
    lines = []
    for name, n in counts.items():
        extra = f" ({changed[name]} new or changed)" if changed and name in changed else ""
        lines.append(f"    {name}: {n}{extra}")
    return lines or ["    (no entries)"]


def ship(paths: list[Path], dest: Path = DEST, dry_run: bool = False) -> dict[Path, dict[str, Any]]:
    """Merge the exported files ``paths`` into the tables under ``dest``; returns the tables by path (written
    unless ``dry_run``). Raises ValueError, writing nothing, if an input is malformed."""
    inputs = [(path, shipped_export.read(path)) for path in paths]  # all validated before anything is written
    known = set(registered())
    results: dict[Path, dict[str, Any]] = {}
    for path, doc in inputs:
        print(f"{path}: {doc['meta']['gpu']} (sm {doc['meta']['capability']})")
        print("\n".join(_lines(shipped.counts(doc))))
        unknown = sorted(set(doc.get("autotune", {})) - known)
        if unknown:
            print(f"    not declared by any kernel of this checkout (never read): {', '.join(unknown)}")
        target = dest / f"{tune_cache.gpu_stem(doc['meta']['gpu'], doc['meta']['capability'])}.json"
        base = results.get(target)
        if base is None:
            base = shipped_export.read(target) if target.exists() else {}
        results[target] = shipped.merge(base, doc)
    for target, doc in results.items():
        before = shipped_export.read(target) if target.exists() else {}
        verb = "would write" if dry_run else "wrote"
        print(f"{verb} {target}:")
        print("\n".join(_lines(shipped.counts(doc), _changed(before, doc))))
        if not dry_run:
            shipped_export.write(target, doc)
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("paths", nargs="+", type=Path, help="files written with NINFER_EXPORT_TUNING")
    p.add_argument("--dest", type=Path, default=DEST, help=f"the tables' folder (default {DEST})")
    p.add_argument("--dry-run", action="store_true", help="validate and report, write nothing")
    args = p.parse_args(argv)
    try:
        ship(args.paths, args.dest, args.dry_run)
    except (OSError, ValueError) as e:
        print(f"ship_tuning: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
