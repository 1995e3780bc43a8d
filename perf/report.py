"""The benchmark records in perf/results/: file them by what they measure, render the current tables and the history.

    python perf/report.py --add $OUT/perf.jsonl           # file one device call's records into perf/results/<topic>.jsonl
    python perf/report.py --current                        # the newest record of every measured point, as tables
    python perf/report.py --history > docs/performance-history.md

A record is one measured point (``bench`` + ``shape`` + variant fields). ``--add`` stamps each record with a
``run`` label, ``DATE.N`` (the N-th batch of records filed that day: one device call, or one pair of stages), and appends it to the file of its topic
(``topic``), so a file holds every run of one kind of measurement in the order they ran; a later run of
the same point supersedes the earlier one in ``--current`` and sits below it in ``--history``. Records of
code that was measured and then not kept carry ``not_shipped`` (``--add ... --not-shipped "why"``): they go
to ``not-shipped.jsonl`` and into the history only.
"""
from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
NOT_SHIPPED = "not-shipped"
SCRATCH = "latest.jsonl"  # where perf/common.py writes when OUT is unset: unfiled, never read here

_ELEMENTWISE = ("rms_norm", "gated_rms_norm", "apply_rope", "qk_norm_rope", "swiglu", "causal_conv1d")
# The benches whose ``config`` names a variant measured side by side (a sweep's tile config, DeltaNet's inverse
# precision); elsewhere ``config`` is just the candidate a path picked and is no part of the point.
_CONFIG_IS_VARIANT = {"attention_decode_sweep", "attention_prefill_sweep", "deltanet_prefill"}
# Fields worth a column besides the time, the achieved rate and the baseline, in this order.
_EXTRAS = ("tok_per_s", "ttft_ms", "tokens_per_round", "round_vs_plain_step", "overhead_pct", "hit_rate",
           "cached_tokens", "path", "config")


def _model_and_weights(shape: str) -> tuple[str, str]:
    """``"27b int4 C=8 ctx=512"`` -> ("27b", "int4"); the HTTP bench names its model ``random-27b``."""
    model, weights = (shape.split() + ["", ""])[:2]
    return model.removeprefix("random-"), weights


def topic(record: dict) -> str:
    """The results file a record belongs to, named by what it measures (``engine-27b-int4``, ``quant-gemm-decode``)."""
    if record.get("not_shipped"):
        return NOT_SHIPPED
    bench = record["bench"]
    if bench.startswith(_ELEMENTWISE):
        return "elementwise"
    if bench.startswith("deltanet"):
        return "deltanet"
    if bench.endswith("_sweep"):
        return "attention-sweeps"
    if bench.startswith("attention"):
        return "attention"
    if bench == "quant_gemm":
        return "quant-gemm-decode" if record["m"] <= 32 else "quant-gemm-prefill"
    if bench == "tune_l2":  # perf/bench_tune_l2.py: decode GEMMs under the tuner's warm and L2-cold picks
        return "quant-gemm-decode"
    if bench.startswith("moe"):
        return "moe-kernels"
    if bench == "float_gemv":
        return "float-gemv"
    if bench == "deferred_norm":
        return "deferred-norm"
    if bench == "sampling":
        return "sampling"
    if bench == "launch_floor":  # perf/bench_launch_floor.py: what a dependent kernel costs whatever it computes
        return "launch-floor"
    if bench.startswith("host_"):
        return "host-copies"
    if bench.startswith("transformers"):
        return "transformers-floor"
    if bench.startswith("vision"):
        return "vision"
    model, weights = _model_and_weights(record["shape"])
    if bench.startswith("prefix"):  # perf/bench_prefix_cache.py runs bf16 weights only
        return f"prefix-cache-{model}"
    for prefix, name in (("engine", "engine"), ("spec", "mtp"), ("server", "server"), ("profile", "profile"),
                         ("startup", "startup"), ("structured", "structured")):
        if bench.startswith(prefix):
            return f"{name}-{model}-{weights}"
    raise ValueError(f"perf/report.py: no topic for bench {bench!r}; add one to topic()")


def point_key(record: dict) -> tuple:
    """What identifies a measured point across runs (two records with one key measured the same thing)."""
    config = record.get("config") if record["bench"] in _CONFIG_IS_VARIANT else None
    return (record["bench"], record["shape"], record.get("kv_dtype"), record.get("format"), config,
            record.get("num_splits"), record.get("not_shipped"))


def run_order(label: str) -> tuple[str, int]:
    """``"2026-11-30.12"`` sorts after ``"2026-11-30.9"``."""
    date, _, seq = label.partition(".")
    return date, int(seq or 0)


def load(folder: Path = RESULTS) -> list[dict]:
    """Every record under ``folder``, oldest run first (records of one run keep their file order)."""
    records = []
    for path in sorted(folder.glob("*.jsonl")):
        if path.name == SCRATCH:
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if line.strip():
                record = json.loads(line)
                if "run" not in record:
                    raise ValueError(f"{path}:{n}: record without a run label; file records with --add")
                records.append(record)
    return sorted(records, key=lambda r: run_order(r["run"]))


def current(records: list[dict]) -> list[dict]:
    """The newest record of each shipped point, in the order the points were first measured."""
    newest: dict[tuple, dict] = {}
    for record in records:
        if not record.get("not_shipped"):
            newest[point_key(record)] = record
    return list(newest.values())


def next_run(records: list[dict], date: str) -> str:
    """The label of the next device call filed on ``date``."""
    seqs = [run_order(r["run"])[1] for r in records if r["run"].split(".")[0] == date]
    return f"{date}.{max(seqs, default=0) + 1}"


def add(source: Path, folder: Path = RESULTS, run: str | None = None, not_shipped: str | None = None) -> dict[str, int]:
    """Append the records of ``source`` (one device call's perf.jsonl) to their topic files; returns counts per topic."""
    new = [json.loads(line) for line in source.read_text().splitlines() if line.strip()]
    if not new:
        raise ValueError(f"{source}: no records")
    if run is None:
        dates = {r["date"] for r in new}
        if len(dates) != 1:
            raise ValueError(f"{source}: records of several dates {sorted(dates)}; pass --run")
        run = next_run(load(folder), dates.pop())
    elif not re.fullmatch(r"\d{4}-\d{2}-\d{2}\.\d+", run):
        raise ValueError(f"--run {run!r}: expected DATE.N, e.g. 2026-11-30.7")
    counts: dict[str, int] = {}
    lines: dict[str, list[str]] = {}
    for record in new:
        record["run"] = run
        if not_shipped:
            record["not_shipped"] = not_shipped
        name = topic(record)
        lines.setdefault(name, []).append(json.dumps(record, allow_nan=True))
        counts[name] = counts.get(name, 0) + 1
    for name, rows in lines.items():
        with open(folder / f"{name}.jsonl", "a") as f:
            f.write("\n".join(rows) + "\n")
    return counts


def _number(value: float | None, digits: int = 4) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    return f"{value:.{digits}f}".rstrip("0").rstrip(".") if isinstance(value, float) else str(value)


def _variant(record: dict) -> str:
    parts = [record.get("kv_dtype") or record.get("format") or ""]
    if record["bench"] in _CONFIG_IS_VARIANT and record.get("config"):
        parts.append(record["config"])
    if record.get("num_splits") is not None:
        parts.append(f"splits={record['num_splits']}")
    return " ".join(p for p in parts if p)


def _extras(record: dict) -> str:
    out = [f"{k}={_number(record[k]) if isinstance(record[k], float) else record[k]}"
           for k in _EXTRAS if record.get(k) is not None and not (k == "config" and record["bench"] in _CONFIG_IS_VARIANT)]
    if isinstance(record.get("families"), dict):  # profile_step: kernel ms per op family, largest first
        fams = sorted(record["families"].items(), key=lambda kv: -kv[1])
        out.append("; ".join(f"{name} {_number(ms, 2)}" for name, ms in fams))
    return ", ".join(out)


def _row(record: dict, with_run: bool) -> str:
    frac = record.get("fraction_of_limit")
    frac_s = "" if frac is None or math.isnan(frac) else f"{100 * frac:.1f}%"
    speedup = record.get("speedup_vs_baseline")
    vs = f"{speedup}x {record['baseline']}" if speedup is not None and record.get("baseline") else ""
    cells = [record["bench"], record["shape"], _variant(record)]
    if with_run:
        cells += [record["run"], record.get("commit", "")]
    cells += [_number(record["median_ms"]), f"{_number(record['achieved'], 3)} {record['unit']}", frac_s, vs,
              _extras(record)]
    return "| " + " | ".join(str(c).replace("|", "/") for c in cells) + " |"


def table(records: list[dict], with_run: bool = False) -> str:
    """One markdown table of records (with their run and commit when ``with_run``)."""
    head = ["bench", "shape", "variant"] + (["run", "commit"] if with_run else []) + \
        ["median ms", "achieved", "% of limit", "vs baseline", "also"]
    align = ["---"] * 3 + (["---"] * 2 if with_run else []) + ["---:", "---:", "---:", "---", "---"]
    return "\n".join(["| " + " | ".join(head) + " |", "|" + "|".join(align) + "|"] + [_row(r, with_run) for r in records])


def _by_topic(records: list[dict]) -> dict[str, list[dict]]:
    groups: dict[str, list[dict]] = {}
    for record in records:
        groups.setdefault(topic(record), []).append(record)
    return dict(sorted(groups.items()))


def render_current(records: list[dict]) -> str:
    """The newest value of every point, one table per topic, each row with its run and commit."""
    return "\n".join(f"### {name}\n\n{table(rows, with_run=True)}\n" for name, rows in _by_topic(current(records)).items())


def render_history(records: list[dict]) -> str:
    """Every record, per topic and point, oldest run first; the runs and the not-shipped records apart."""
    runs: dict[str, dict] = {}
    for r in records:
        entry = runs.setdefault(r["run"], {"commits": set(), "count": 0, "topics": set()})
        entry["commits"].add(r.get("commit", "unknown"))
        entry["count"] += 1
        entry["topics"].add(topic(r))
    out = ["# Performance history (generated)", "",
           "Generated by `python perf/report.py --history > docs/performance-history.md` from `perf/results/*.jsonl`;",
           "do not edit by hand. `docs/performance.md` holds the current numbers; this appendix holds every record,",
           "oldest run first within each measured point. A run is one filed batch of records (`DATE.N`: the N-th that day,",
           "one device call or one pair of runbook stages); `commit` is the checkout it ran (`unknown`: not recorded).",
           "Records of code that was measured and not kept are in the last section only.",
           "", "## Runs", "", "| run | commits | records | topics |", "|---|---|---:|---|"]
    for label in sorted(runs, key=run_order):
        e = runs[label]
        out.append(f"| {label} | {', '.join(sorted(e['commits']))} | {e['count']} | {', '.join(sorted(e['topics']))} |")
    shipped = [r for r in records if not r.get("not_shipped")]
    for name, rows in _by_topic(shipped).items():
        order = {k: i for i, k in enumerate(dict.fromkeys(point_key(r) for r in rows))}
        rows = sorted(rows, key=lambda r: (order[point_key(r)], run_order(r["run"])))
        out += ["", f"## {name} (`perf/results/{name}.jsonl`)", "", table(rows, with_run=True)]
    unshipped = [r for r in records if r.get("not_shipped")]
    if unshipped:
        out += ["", f"## Measured, not shipped (`perf/results/{NOT_SHIPPED}.jsonl`)", "",
                "These records come from code that was measured and then reverted or replaced; they never stand for",
                "the code as committed. The reverted code itself is in git history.", ""]
        for label, rows in _group(unshipped, "not_shipped").items():
            out += [f"### {label}", "", table(rows, with_run=True), ""]
    return "\n".join(out).rstrip() + "\n"


def _group(records: list[dict], field: str) -> dict[str, list[dict]]:
    groups: dict[str, list[dict]] = {}
    for record in records:
        groups.setdefault(record[field], []).append(record)
    return groups


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--add", type=Path, metavar="PERF_JSONL", help="file a device call's records by topic")
    mode.add_argument("--current", action="store_true", help="print the newest record of every point")
    mode.add_argument("--history", action="store_true", help="print every record (docs/performance-history.md)")
    parser.add_argument("--run", help="with --add: the run label DATE.N (default: the next one of the records' date)")
    parser.add_argument("--not-shipped", metavar="WHY", help="with --add: the records measure code that was not kept")
    parser.add_argument("--results", type=Path, default=RESULTS, help="the records folder (default perf/results)")
    args = parser.parse_args(argv)
    if (args.run or args.not_shipped) and not args.add:
        parser.error("--run and --not-shipped go with --add")
    try:
        if args.add:
            for name, n in add(args.add, args.results, args.run, args.not_shipped).items():
                print(f"{n:5d} -> {args.results / name}.jsonl")
        else:
            records = load(args.results)
            sys.stdout.write(render_current(records) if args.current else render_history(records))
    except (ValueError, OSError, KeyError, json.JSONDecodeError) as exc:
        print(f"perf/report.py: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
