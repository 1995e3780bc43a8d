"""Where a decode step's (or a prefill's) GPU time goes: kernel time per step, by kernel and by op family.

Builds the random-weight model (optionally quantized with a recipe, optionally with an MTP head for
speculative rounds), times the steady step with CUDA graphs on, then runs the same steps with graphs
off under ``torch.profiler`` and sums each kernel's device time per step. The difference between the
graph step and the summed kernel time is what the step spends between kernels (launch gaps and
bubbles inside the graph). Writes one ``profile_step`` record per run to the JSON results.

    python perf/profile_step.py --shape 27b --recipe int4 [--lanes 1] [--draft-tokens 3] [--top 25]
    python perf/profile_step.py --shape 35b-a3b --recipe qwen3_5_35b_a3b_int4 --prefill 8192 [--chunk 1024]

``--mixed CONTEXT`` profiles the steps that pack a long prompt's chunks (``--chunk`` tokens each, the budget
beside decodes; up to 256 tokens they replay the prompt-chunk graph unless ``NINFER_CHUNK_GRAPHS=0``) with 4
decodes, once the prompt has reached CONTEXT tokens: wall time per step, kernel time
by family, and (``--host``) the host's time per op (torch.profiler) and a cProfile of the same steps.
    python perf/profile_step.py --shape 27b --recipe int4 --mixed 16384 --chunk 128 --host

``--timeline`` also profiles the graph-replayed steps themselves (``perf/graph_timeline.py``): how much of a step
the GPU is busy, runs two kernels at once (the second stream's branches) or idles between kernels.

``--prefill N`` profiles one N-token prompt instead (one request, eager, chunks of ``--chunk``): the
kernel time by family against the prefill's wall time, after two unprofiled prefills of the same
length (compilation and tuning).
    python perf/profile_step.py --shape tiny --device cpu --steps 2   # smoke test (no kernel times on a CPU)
"""
from __future__ import annotations

import argparse
import re
from collections import defaultdict

import torch
from bench_engine import GREEDY, prefill, steady_decode, time_steps
from bench_spec import make_llm, random_head
from common import record
from graph_timeline import LONG_GAP_US, profile_timeline
from random_model import SHAPES, random_model, random_prompt

from ninfer.llm import LLM
from ninfer.runtime.engine import EngineConfig
from ninfer.runtime.speculative import force_acceptance

# Op families by lower-cased kernel name (first match wins): Triton kernel names, cuBLAS and torch kernels.
FAMILIES = [
    ("quant GEMM (register decode)", r"fragment"),
    ("quant GEMV", r"gemv"),
    ("quant GEMM (tl.dot)", r"quant_gemm|split_finish"),
    ("MoE experts", r"moe|expert|route|router|topk"),
    ("bf16 GEMM (cuBLAS)", r"gemm|sm90_xmma|cutlass|nvjet|splitk"),
    ("attention", r"attn|attention|paged|merge|^_decode_kernel|^_prefill_kernel|write_kv"),
    ("Gated DeltaNet", r"delta|gdn|recurrent|chunk"),
    ("causal conv", r"conv"),
    ("norms / RoPE / SwiGLU", r"norm|rope|rotary|swiglu|silu"),
    ("sampling", r"sampl|argmax|softmax|penalt|logprob"),
    ("copies / other torch", r"copy|fill|elementwise|reduce|index|gather|scatter|cat"),
]


def family(name: str) -> str:
    low = name.lower()
    for fam, pattern in FAMILIES:
        if re.search(pattern, low):
            return fam
    return "other"


def kernel_times(llm, lanes: int, context: int, steps: int) -> dict[str, tuple[float, int]]:
    """{kernel name: (device ms, launches)} over the prefill, 3 warm steps and ``steps`` eager steps."""
    return _profiled(lambda: steady_decode(llm, lanes, context, steps))


def _profiled(fn, host_top: int = 0) -> dict[str, tuple[float, int]]:
    """{kernel name: (device ms, launches)} of the CUDA kernels ``fn()`` runs; with ``host_top``, also print
    the host's own time per op (torch.profiler's self CPU time: native, without cProfile's per-call cost)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        fn()
    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in prof.events():
        if e.device_type.name == "CUDA":
            totals[e.name][0] += e.device_time / 1e3
            totals[e.name][1] += 1
    if host_top:
        print(f"\nhost time by op (torch.profiler, self CPU time, top {host_top}):")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=host_top))
    return {name: (ms, n) for name, (ms, n) in totals.items()}


def _report(label: str, wall_ms: float, what: str, per: dict[str, tuple[float, float]], top: int) -> None:
    kernel_ms = sum(ms for ms, _ in per.values())
    fams: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for name, (ms, n) in per.items():
        fams[family(name)][0] += ms
        fams[family(name)][1] += n
    print(f"\n{label}: {what} {wall_ms:.3f} ms; kernels {kernel_ms:.3f} ms "
          f"({sum(n for _, n in per.values()):.0f} launches); between kernels {wall_ms - kernel_ms:.3f} ms")
    print(f"{'family':28s} {'ms':>9s} {'share':>7s} {'launches':>9s}")
    for fam, (ms, n) in sorted(fams.items(), key=lambda kv: -kv[1][0]):
        print(f"{fam:28s} {ms:9.3f} {100 * ms / max(wall_ms, 1e-9):6.1f}% {n:9.0f}")
    print(f"\ntop {top} kernels (ms, launches):")
    for name, (ms, n) in sorted(per.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"  {ms:8.3f} ms {n:6.0f}x  {name[:110]}")
    record("profile_step", label, wall_ms, achieved=kernel_ms, limit=wall_ms, unit="kernel ms",
           families={k: round(v[0], 4) for k, v in fams.items()},
           launches=round(sum(n for _, n in per.values())), family_launches={k: round(v[1]) for k, v in fams.items()},
           top={k[:120]: round(v[0], 4) for k, v in sorted(per.items(), key=lambda kv: -kv[1][0])[:top]})


def run_prefill(args: argparse.Namespace) -> None:
    """One ``--prefill``-token prompt, eager (prefill never runs in a graph), profiled once warm."""
    model = random_model(args.shape, device=args.device, recipe=args.recipe)
    cfg = EngineConfig(max_concurrency=1, max_context=args.prefill + 64, kv_capacity=args.prefill + 64,
                       prefill_chunk=args.chunk, cuda_graphs=False, prefix_cache=False)
    llm = make_llm(model, None, args.shape, cfg)
    prefill(llm, args.prefill)  # compile and tune
    wall, _ = prefill(llm, args.prefill)
    per = _profiled(lambda: prefill(llm, args.prefill), args.top if args.host else 0)
    label = f"{args.shape} {args.recipe or 'bf16'} prefill T={args.prefill} chunk={args.chunk}"
    _report(label, wall * 1e3, f"prefill {args.prefill / wall:.0f} tok/s,", per, args.top)
    if args.host:
        _host_profile(lambda: prefill(llm, args.prefill), args.top)


def run_mixed(args: argparse.Namespace) -> None:
    """4 decodes (prompts of ``--context`` tokens) beside a long prompt's ``--chunk``-token chunks, profiled
    from ``--mixed`` tokens on."""
    model = random_model(args.shape, device=args.device, recipe=args.recipe)
    steps = args.steps
    long_tokens = args.mixed + 4 * steps * args.chunk + 1024
    cfg = EngineConfig(max_concurrency=8, max_context=long_tokens + 256, kv_capacity=2 * long_tokens + 8192,
                       prefill_tokens_while_decoding=args.chunk)
    llm = make_llm(model, None, args.shape, cfg)
    engine = llm.engine
    decoders = [llm._request(random_prompt(args.context, seed=i), 10 ** 6, GREEDY) for i in range(4)]
    for r in decoders:
        engine.add_request(r)
    while not all(r.output_ids for r in decoders):
        engine.step()
    long = llm._request(random_prompt(long_tokens, seed=99), 1, GREEDY)
    engine.add_request(long)
    while long.num_computed < args.mixed:
        engine.step()
    wall = time_steps(llm, steps)
    long_ctx = long.num_computed
    profiled = _profiled(lambda: [engine.step() for _ in range(steps)], args.top if args.host else 0)
    per = {k: (ms / steps, n / steps) for k, (ms, n) in profiled.items()}
    graph = " chunk-graph" if engine.runner.chunk_graphs is not None else ""  # NINFER_CHUNK_GRAPHS=0: eager
    label = f"{args.shape} {args.recipe or 'bf16'} mixed 4 decodes + chunk={args.chunk}{graph} at ctx={long_ctx}"
    _report(label, wall * 1e3, "step", per, args.top)
    if args.host:
        _host_profile(lambda: [engine.step() for _ in range(steps)], args.top)
    for r in [*decoders, long]:
        engine.cancel(r.request_id)


def _host_profile(fn, top: int) -> None:
    """Where the host's time goes in ``fn()`` (cProfile: own time, then cumulative)."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.runcall(fn)
    stats = pstats.Stats(prof)
    for key in ("tottime", "cumulative"):
        print(f"\nhost time by {key} (cProfile, top {top}):")
        stats.sort_stats(key).print_stats(top)


def run(args: argparse.Namespace) -> None:
    if args.mixed:
        run_mixed(args)
        return
    if args.prefill:
        run_prefill(args)
        return
    model = random_model(args.shape, device=args.device, recipe=args.recipe)
    label = f"{args.shape} {args.recipe or 'bf16'} C={args.lanes} ctx={args.context}"
    head = random_head(model, args.recipe) if args.draft_tokens else None  # quantized as bench_spec's head
    common = dict(max_concurrency=args.lanes, max_context=args.context + 4096,
                  kv_capacity=args.lanes * (args.context + 4096), prefix_cache=False)
    spec = dict(draft_tokens=args.draft_tokens, draft_vocab=args.draft_vocab) if args.draft_tokens else {}
    if args.draft_tokens:
        label += f" K={args.draft_tokens}" + (" full-vocab" if args.full_vocab or args.draft_vocab else "") \
            + (f" draft-vocab={args.draft_vocab}" if args.draft_vocab else "") + " (round)"
    if args.label:
        label += f" {args.label}"
    graphs = args.device == "cuda"

    def llm_with(cuda_graphs: bool) -> LLM:
        llm = make_llm(model, head, args.shape, EngineConfig(**common, **spec, cuda_graphs=cuda_graphs),
                       full_vocab=args.full_vocab or args.draft_vocab is not None)
        if args.draft_tokens:  # random weights accept nothing: profile the full round, every draft accepted
            force_acceptance(llm.engine.spec, args.draft_tokens)
        return llm
    graph_llm = llm_with(graphs)
    step_s = steady_decode(graph_llm, args.lanes, args.context, args.steps)
    if args.timeline and graphs:
        _timeline(label, graph_llm, args)
    if args.host and graphs:  # the graph-replayed steps' host work: what the GPU waits on between steps
        steady_decode(graph_llm, args.lanes, args.context, args.steps,
                      timer=lambda llm_, steps: _host_profile(lambda: time_steps(llm_, steps), args.top))
    del graph_llm
    eager_llm = llm_with(False)
    steady_decode(eager_llm, args.lanes, args.context, 2)  # compile and tune outside the profile
    # Profile prefill + 3 warm + N steps, then the same with 0 timed steps: the difference is N steps.
    long = kernel_times(eager_llm, args.lanes, args.context, args.steps)
    short = kernel_times(eager_llm, args.lanes, args.context, 0)
    per_step = {}
    for name, (ms, n) in long.items():
        ms0, n0 = short.get(name, (0.0, 0))
        if ms - ms0 > 0:
            per_step[name] = ((ms - ms0) / args.steps, (n - n0) / args.steps)
    _report(label, step_s * 1e3, "step with CUDA graphs", per_step, args.top)


def _timeline(label: str, llm: LLM, args: argparse.Namespace) -> None:
    """The graph-replayed steps' kernel timeline (:mod:`graph_timeline`): busy, concurrent and idle time."""
    found: dict = {}

    def timed(llm_: LLM, steps: int) -> float:  # steady_decode's timer: the profiled span per step, in seconds
        found.update(profile_timeline(lambda: time_steps(llm_, steps), steps))
        return found["span_ms"] / 1e3

    steady_decode(llm, args.lanes, args.context, args.steps, timer=timed)
    streams = ", ".join(f"stream {k}: {v['kernels']:.0f} kernels, {v['ms']:.3f} ms"
                        for k, v in found["streams"].items())
    print(f"\n{label}: graph-replayed step, {found['kernels']:.0f} kernels; busy {found['busy_ms']:.3f} of "
          f"{found['span_ms']:.3f} ms (idle between kernels {found['idle_ms']:.3f} ms, "
          f"{found['long_gap_ms']:.3f} of it in gaps over {LONG_GAP_US:.0f} µs); kernels summed "
          f"{found['kernel_ms']:.3f} ms, two or more at once {found['concurrent_ms']:.3f} ms; {streams}")
    record("profile_graph_timeline", label, found["span_ms"], achieved=found["busy_ms"], limit=found["span_ms"],
           unit="busy ms", **{k: v for k, v in found.items() if k != "span_ms"})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="27b")
    parser.add_argument("--recipe", default=None, help="quantize the random model with this recipe first")
    parser.add_argument("--lanes", type=int, default=1)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--draft-tokens", type=int, default=0, help="profile speculative rounds (all drafts accepted)")
    parser.add_argument("--draft-vocab", type=int, default=None,
                        help="with --draft-tokens: draft among the N lowest token ids only (the engine's draft_vocab)")
    parser.add_argument("--full-vocab", action="store_true",
                        help="with --draft-tokens: sample and draft over the model's whole vocabulary (implied by "
                             "--draft-vocab), not the bundled tokenizer's 481 ids")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--prefill", type=int, default=0, help="profile one prompt of this many tokens instead")
    parser.add_argument("--chunk", type=int, default=1024,
                        help="--prefill: prefill chunk; --mixed: the budget beside decodes")
    parser.add_argument("--mixed", type=int, default=0,
                        help="profile 4 decodes beside a long prompt's chunks from this context on (module doc)")
    parser.add_argument("--host", action="store_true",
                        help="also a cProfile of the host (decode: the graph-replayed steps; --prefill / --mixed: "
                             "with the host's time per op from torch.profiler)")
    parser.add_argument("--timeline", action="store_true",
                        help="also the graph-replayed steps' kernel timeline: busy, concurrent (two streams), idle")
    parser.add_argument("--label", default="", help="decode: words added to the record's label (an A/B switch set in "
                                                    "the environment, say)")
    parser.add_argument("--device", default="cuda", help="cpu: a smoke test with --shape tiny / tiny-moe")
    run(parser.parse_args(argv))


if __name__ == "__main__":
    main()
