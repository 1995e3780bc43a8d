"""Render the benchmark records in perf/results/*.jsonl as markdown tables (for docs/performance.md).

    python perf/report.py > /tmp/tables.md

Files are read in name order and a later record of the same point supersedes an earlier one, so a
later run of the same day is named ``DATE.2-...jsonl`` (``.`` sorts after ``-``).
"""
from __future__ import annotations

import json
from pathlib import Path


MAX_ROWS = 150  # a family with more records is listed by count and file


def load_records(folder: Path) -> list[dict]:
    rows: dict[tuple, dict] = {}
    for path in sorted(folder.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                key = (row["bench"], row["shape"], row.get("kv_dtype"), row.get("format"), row.get("config"),
                       row.get("num_splits"))
                row["file"] = f"`perf/results/{path.name}`"
                rows[key] = row  # a later file supersedes an earlier measurement of the same point
    return list(rows.values())


def table(rows: list[dict]) -> str:
    out = ["| bench | shape | variant | median ms | achieved | % of limit | baseline | baseline ms | speed-up |",
           "|---|---|---|---:|---:|---:|---|---:|---:|"]
    for r in rows:
        variant = r.get("kv_dtype") or r.get("format") or r.get("config") or ""
        if r.get("num_splits") is not None:
            variant = f"{r.get('config', '')} splits={r['num_splits']}"
        frac = r.get("fraction_of_limit")
        frac_s = "" if frac is None or frac != frac else f"{100 * frac:.1f}%"
        extra = f" ({r['tok_per_s']} tok/s)" if "tok_per_s" in r else ""
        base_ms = "" if r.get("baseline_ms") is None else f"{r['baseline_ms']:.4f}"
        speedup = "" if r.get("speedup_vs_baseline") is None else f"{r['speedup_vs_baseline']}x"
        out.append(f"| {r['bench']} | {r['shape']} | {variant} | {r['median_ms']:.4f} | "
                   f"{r['achieved']:.3f} {r['unit']}{extra} | {frac_s} | {r.get('baseline') or ''} | "
                   f"{base_ms} | {speedup} |")
    return "\n".join(out)


if __name__ == "__main__":
    records = load_records(Path(__file__).parent / "results")
    families: dict[str, list[dict]] = {}
    for r in records:
        # sweeps (every config of a kernel) form their own family, so they never crowd out its summary rows
        family = r["bench"].split("_")[0] + (" sweeps" if r["bench"].endswith("_sweep") else "")
        families.setdefault(family, []).append(r)
    for family, rows in families.items():
        if len(rows) > MAX_ROWS:  # the quantized GEMM sweeps: summarised in the prose tables instead
            files = sorted({r.get("file", "") for r in rows})
            print(f"### {family}\n\n{len(rows)} points: see the summary tables above and {', '.join(files)}.\n")
            continue
        print(f"### {family}\n\n{table(rows)}\n")
