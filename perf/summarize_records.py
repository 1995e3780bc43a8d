"""Print the records of a device call's ``perf.jsonl`` as one short line each (label, time, fraction of the
limit, baseline fractions, config): what a call's reply shows of its benchmarks.

    python perf/summarize_records.py $OUT/perf.jsonl [--grep TEXT]
"""
from __future__ import annotations

import argparse
import json


def line(rec: dict) -> str:
    parts = [f"{rec.get('shape', '?'):58s}", f"{rec.get('median_ms', 0) * 1e3:8.1f} us",
             f"{100 * (rec.get('fraction_of_limit') or 0):5.1f}%"]
    for key, name in (("cublas_fraction", "cublas"), ("int4pack_fraction", "int4pack")):
        if rec.get(key) is not None:
            parts.append(f"{name} {100 * rec[key]:.1f}%")
    if rec.get("config"):
        parts.append(str(rec["config"]))
    return " | ".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path")
    parser.add_argument("--grep", default="", help="only records whose label contains this text")
    args = parser.parse_args()
    with open(args.path) as f:
        for raw in f:
            rec = json.loads(raw)
            if args.grep in rec.get("shape", ""):
                print(line(rec))


if __name__ == "__main__":
    main()
