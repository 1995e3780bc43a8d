"""What structured output costs: constrained against free decode through the engine, and grammar compile times.

Issue 24's table (target: constrained decode within 5% of free at C = 1 and C = 8). For each lane count C, C
concurrent requests of ``--tokens`` tokens each run twice through ``LLM._run`` (what ``llm.generate`` runs),
free and constrained, after a warm-up round of each (CUDA graphs, sampler paths, the grammar compiled). The
decode rate of a request is its tokens after the first over its decode time (``Completion.decode_s``); a row
records the median request's rate, times C for the throughput.

The constraint of the decode rows is a regex of lowercase letters and spaces far longer than ``--tokens`` allow,
so every constrained request runs to its length limit as the free ones do (random weights stop nowhere else:
the bench empties the stop tokens). A JSON Schema would close after a few random tokens; the per-token
work (the matcher's bitmask for the next step, prepared on the host while the GPU runs the current one, and
the mask applied in the fused sampler) does not depend on which grammar it is.

Compile times: a typical JSON Schema (an object with strings, an enum, an integer range and an array) through
``llm.structured.compile``, first (xgrammar's tokenizer info and the grammar) and again (the cache by text).
The random models use the bundled tiny tokenizer, so its vocabulary (recorded) is smaller than a real
checkpoint's: the compile times measure our path's overheads and scale with the vocabulary on real models.

    python perf/bench_structured.py --shape 27b --recipe int4 --lanes 1 8 --tokens 128
    python perf/bench_structured.py --shape tiny --device cpu --lanes 1 2 --tokens 16   # smoke test
    python perf/bench_structured.py --shape 27b --recipe int4 --lanes 1 --tokens 64 --profile  # host's time
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from common import record, sync
from random_model import SHAPES, random_llm, random_prompt

from ninfer.runtime.engine import EngineConfig
from ninfer.runtime.sampling import SamplingParams
from ninfer.runtime.structured import Constraint

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40},
    "kind": {"enum": ["person", "place", "thing"]},
    "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
    "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
}, "required": ["name", "kind", "year"], "additionalProperties": False}


def _round(llm, lanes: int, tokens: int, constraint: Constraint | None, seed: int) -> list:
    params = SamplingParams(greedy=True, structured=constraint)
    reqs = [llm._request(random_prompt(32, seed + i), tokens, params) for i in range(lanes)]
    outs = llm._run(reqs)
    sync(llm.device)
    return outs


def decode_rate(llm, lanes: int, tokens: int, constraint: Constraint | None) -> tuple[float, int]:
    """Median per-request decode tok/s over ``lanes`` concurrent requests (after a warm-up round), and the
    fewest tokens a request produced."""
    _round(llm, lanes, tokens, constraint, seed=1)
    outs = _round(llm, lanes, tokens, constraint, seed=100)
    rates = [c.decode_tokens_per_s for c in outs]
    return statistics.median(rates), min(len(c.token_ids) for c in outs)


def compile_times(llm) -> tuple[float, float]:
    """Seconds to compile :data:`SCHEMA` the first time and from the cache."""
    times = []
    for _ in range(2):
        start = time.perf_counter()
        llm.structured.compile(Constraint.json_schema(SCHEMA))
        times.append(time.perf_counter() - start)
    return times[0], times[1]


def profile_host(llm, lanes: int, tokens: int, constraint: Constraint) -> None:
    """Where the host's time goes in a free and a constrained round of ``lanes`` requests (cProfile, top
    functions by own time; both paths are warm from :func:`decode_rate`): xgrammar's fill and accept,
    detokenizing, and the wait for the GPU (``tolist``) show whether the constrained side's extra host work
    overlaps the forward or adds to the step."""
    import cProfile
    import io
    import pstats

    for name, c in (("free", None), ("constrained", constraint)):
        prof = cProfile.Profile()
        prof.enable()
        _round(llm, lanes, tokens, c, seed=400)
        prof.disable()
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(18)
        body = out.getvalue()
        print(f"--- host profile, {name}, C={lanes}, {tokens} tokens per request\n"
              f"{body[body.find('ncalls'):].rstrip()}", flush=True)


def run(args: argparse.Namespace) -> None:
    shape, label = args.shape, args.recipe or "bf16"
    cfg = EngineConfig(max_concurrency=max(args.lanes), max_context=32 + args.tokens + 64,
                       prefix_cache=False, cuda_graphs=torch.device(args.device).type == "cuda")
    start = time.perf_counter()
    llm = random_llm(shape, cfg, device=args.device, num_layers=args.layers, recipe=args.recipe, verbose=True)
    llm.stop_ids = frozenset()  # random weights: never stop early
    print(f"engine ready in {time.perf_counter() - start:.1f} s", flush=True)
    vocab = llm.tokenizer.vocab_size
    first, cached = compile_times(llm)
    print(f"JSON Schema compile: first {first * 1e3:.1f} ms, cached {cached * 1e3:.3f} ms "
          f"(tokenizer of {vocab} tokens)", flush=True)
    record("structured_compile", f"{shape} {label} json_schema first", first * 1e3, achieved=1 / first,
           limit=float("nan"), unit="compiles/s", cached_ms=round(cached * 1e3, 4), tokenizer_vocab=vocab)
    regex = Constraint.regex(f"[a-z ]{{{16 * args.tokens}}}")
    for lanes in args.lanes:
        free, free_n = decode_rate(llm, lanes, args.tokens, None)
        constrained, con_n = decode_rate(llm, lanes, args.tokens, regex)
        ratio = constrained / free if free else float("nan")
        print(f"C={lanes}: free {free:.1f} tok/s per request, constrained {constrained:.1f} "
              f"({ratio:.3f}x; fewest tokens {free_n} / {con_n})", flush=True)
        record("structured_decode", f"{shape} {label} C={lanes} regex", 1e3 / constrained, achieved=constrained * lanes,
               limit=free * lanes, unit="tok/s", baseline="free decode", baseline_ms=round(1e3 / free, 4),
               speedup_vs_baseline=round(ratio, 4), tokens=args.tokens, fewest_tokens=min(free_n, con_n))
        if args.profile:
            profile_host(llm, lanes, args.tokens, regex)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="27b")
    parser.add_argument("--recipe", default=None, help="a shipped recipe (int4, qwen3_5_27b_int4, ...) or a file")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--layers", type=int, default=None, help="fewer decoder layers (smoke runs)")
    parser.add_argument("--lanes", type=int, nargs="+", default=[1, 8], help="concurrent requests per row")
    parser.add_argument("--tokens", type=int, default=128, help="tokens each request generates")
    parser.add_argument("--profile", action="store_true",
                        help="after each lane count: a host profile (cProfile) of a free and a constrained round")
    args = parser.parse_args(argv)
    if min(args.lanes) < 1 or args.tokens < 4:
        parser.error("--lanes must be positive and --tokens at least 4")
    run(args)


if __name__ == "__main__":
    main()
