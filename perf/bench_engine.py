"""End-to-end engine benchmark at the real 27B / 35B-A3B shapes with random weights.

Measures, in one run: copy bandwidth (the roofline's ceiling); batch-1 decode step time at each
context against the roofline (weight bytes a step must read + KV + DeltaNet state bytes, over copy
bandwidth); steady decode throughput with C lanes all decoding; prefill tok/s and TTFT; and, with
``--hf``, transformers' own model on the same GPU as the floor (in a child process, time-bounded).

``--recipe NAME`` (a shipped recipe such as ``int4``, ``nvfp4``, ``qwen3_5_27b_int4``,
``qwen3_5_35b_a3b_nvfp4``, or a recipe file) quantizes the random model in place with the code
``ninfer.load(..., quantize=NAME)`` runs (``quantize_model_`` on ``resolve_plan(load_recipe(NAME))``),
one decoder layer at a time, so the bf16 model never exists in full. Weight bytes per step then
count the packed codes and scales as stored; in MoE models only the routed experts a step is
expected to touch (uniform routing: ``1 - (1 - k/E)^tokens`` of each expert stack) are counted.
With a recipe the issue targets (#5 27B, #6 35B-A3B) are printed next to the measured numbers.

    python perf/bench_engine.py --shape 27b [--recipe qwen3_5_27b_int4] [--contexts 1024 32768]
        [--lanes 1 4 8] [--prefill 8192] [--hf]
    python perf/bench_engine.py --shape tiny --device cpu --contexts 64 --lanes 1 2 --prefill 128  # smoke test
    python perf/bench_engine.py --shape 27b --recipe int4 --prefill --toggle NINFER_FUSED_PROLOGUE=1,0,1,0

``--toggle NAME=V1,V2,...`` measures one engine per value of an environment switch that is read when an engine is
built (its graphs capture the path), all over the one random model: an A/B comparison in one process, alternating,
without building and quantizing the model again for each side. ``--settings base A=1 B=1+C=0 base ...`` does the same
for several switches at once (one engine per setting; ``base``: the environment as given).
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import TypeVar

import torch
from common import check_target, copy_bandwidth_for, export_tuning, export_tuning_on_timeout, record, sync
from random_model import SHAPES, model_bytes, random_llm, random_model, random_prompt, shape_config

from ninfer.runtime.engine import EngineConfig
from ninfer.runtime.memory import kv_bytes_per_token, state_bytes_per_slot
from ninfer.runtime.sampling import SamplingParams

T = TypeVar("T")

GREEDY = SamplingParams(greedy=True)
HF_MIN_STEPS = 6  # transformers decode steps taken whatever the budget (the first two are not timed)
# Issue targets for a 4-bit recipe (decode at batch 1 and C = 8 lanes: #19; prefill of 8k tokens with the default
# chunking: #22).
TARGETS = {
    "27b": {"decode_b1_tok_s": 250.0, "decode_b1_roofline": 0.85, "c8_tok_s": 1600.0, "prefill_8k_tok_s": 12000.0},
    "35b-a3b": {"decode_b1_tok_s": 800.0, "prefill_8k_tok_s": 40000.0},
}


def expert_fraction(config, tokens: int) -> float:
    """Expected share of a layer's routed experts that ``tokens`` tokens pick (uniform routing)."""
    if not config.is_moe:
        return 1.0
    return 1.0 - (1.0 - config.num_experts_per_tok / config.num_experts) ** tokens


def weight_bytes_per_step(model, tokens: int = 1) -> int:
    """Weight bytes a decode step of ``tokens`` tokens must read: every parameter once, as stored (quantized
    weights are parameters holding their packed codes, scales and global scales), except the embedding
    (one row per token) and, in MoE layers, the routed experts no token picks."""
    config = model.config
    share = expert_fraction(config, tokens)
    total = 0.0
    for name, p in model.named_parameters():
        nbytes = p.numel() * p.element_size()
        if name.startswith("embed_tokens.") and not config.tie_word_embeddings:
            nbytes *= min(tokens, p.shape[0]) / p.shape[0]  # every stored tensor of an embedding is row-major
        elif ".mlp.experts." in name:
            nbytes *= share
        total += nbytes
    return int(total)


def steady_decode(llm, lanes: int, context: int, steps: int,
                  timer: Callable[[object, int], T] | None = None) -> T | float:
    """Seconds per step once ``lanes`` sequences of ~``context`` tokens are all decoding (``timer(llm, steps)``
    times the steps: :func:`time_steps` by default)."""
    engine = llm.engine
    reqs = [llm._request(random_prompt(context, seed=i), 10 ** 6, GREEDY) for i in range(lanes)]
    for r in reqs:
        engine.add_request(r)
    while any(not r.prefill_done or not r.output_ids for r in reqs):
        engine.step()
    for _ in range(3):
        engine.step()
    elapsed = (timer or time_steps)(llm, steps)
    for r in reqs:
        engine.cancel(r.request_id)
    return elapsed


def time_steps(llm, steps: int) -> float:
    """Seconds per engine step over the next ``steps`` steps, the device synchronised at both ends."""
    sync(llm.device)
    start = time.perf_counter()
    for _ in range(steps):
        llm.engine.step()
    sync(llm.device)
    return (time.perf_counter() - start) / max(steps, 1)


def replay_only(llm, steps: int) -> float:
    """Seconds per replay of the decode graph of the running batch, replayed ``steps`` times back to back with no
    engine work between them: the step's GPU time, which :func:`time_steps` less this leaves to the host."""
    graphs = llm.engine.runner.graphs
    graph = graphs.graphs[len(llm.engine.scheduler.running)]
    sync(llm.device)
    start = time.perf_counter()
    for _ in range(steps):
        graph.replay()
    sync(llm.device)
    return (time.perf_counter() - start) / max(steps, 1)


def host_split(llm, steps: int) -> tuple[float, float]:
    """(seconds per engine step, seconds per bare graph replay) over the same running batch."""
    return time_steps(llm, steps), replay_only(llm, steps)


def prefill(llm, tokens: int) -> tuple[float, float]:
    """(prefill seconds, TTFT seconds) of one request of ``tokens`` prompt tokens."""
    engine = llm.engine
    req = llm._request(random_prompt(tokens, seed=99), 1, GREEDY)
    sync(llm.device)
    start = time.perf_counter()
    engine.add_request(req)
    engine.run_until_done()
    sync(llm.device)
    ttft = req.first_token_time - start
    return ttft, ttft


def toggles(spec: str | None, settings: list[str] | None = None) -> list[dict[str, str] | None]:
    """``NAME=V1,V2,...`` -> ``[{NAME: V1}, {NAME: V2}, ...]``; ``settings`` (each ``base`` or
    ``NAME=V[+NAME=V...]``) -> one dict each (``base``: empty, the environment as it stands); neither -> ``[None]``."""
    if spec and settings:
        raise SystemExit("--toggle and --settings are two ways to list the engines: give one")
    if settings:
        out = []
        for text in settings:
            pairs = [] if text == "base" else [p.partition("=") for p in text.split("+")]
            if any(not name or not sep or not value for name, sep, value in pairs):
                raise SystemExit(f"--settings takes base or NAME=V[+NAME=V...] per engine, got {text!r}")
            out.append({name: value for name, _, value in pairs})
        return out
    if not spec:
        return [None]
    name, _, values = spec.partition("=")
    if not name or not values:
        raise SystemExit(f"--toggle takes NAME=V1,V2,... (an environment variable and its values), got {spec!r}")
    return [{name: value} for value in values.split(",")]


def _setting_label(setting: dict[str, str]) -> str:
    return "+".join(f"{name}={value}" for name, value in setting.items()) or "base"


def run(args: argparse.Namespace) -> None:
    device = torch.device(args.device)
    bw = copy_bandwidth_for(device)
    print(f"copy bandwidth {bw:.3f} TB/s", flush=True)
    if args.hf:
        hf_subprocess(args)
    label = (args.recipe or "bf16") + (" eager" if args.eager else "") + (f" {args.label}" if args.label else "")
    if args.layers is not None:
        label += f" L={args.layers}"  # a cut-down model: keep its rows apart from full-depth ones
    max_ctx = max(args.contexts + args.prefill + [args.lane_context]) + args.steps + 64
    cfg = EngineConfig(max_concurrency=max(args.lanes), max_context=max_ctx,
                       kv_capacity=max_ctx * max(args.lanes) if max(args.lanes) * max_ctx < 600_000 else "auto",
                       kv_dtype=args.kv_dtype, prefill_chunk=args.chunk, cuda_graphs=not args.eager,
                       prefix_cache=False, decode_ahead=not args.no_decode_ahead)  # raw engine speed
    start = time.perf_counter()
    model = random_model(args.shape, device=args.device, num_layers=args.layers, recipe=args.recipe, verbose=True)
    print(f"model ready in {time.perf_counter() - start:.1f} s", flush=True)
    # An A/B switch read when an engine is built (its graphs capture the path): one engine per value, over the one
    # model, in the order given, so the switch costs no second random model.
    engines = toggles(args.toggle, args.settings)
    touched = {name for setting in engines if setting for name in setting}
    before = {name: os.environ.get(name) for name in touched}
    for setting in engines:
        for name, value in before.items():  # each engine: the environment as given, then its own setting
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        os.environ.update(setting or {})
        start = time.perf_counter()
        llm = random_llm(args.shape, cfg, model=model)
        llm.stop_ids = frozenset()  # random weights: never stop early
        words = "" if setting is None else f" with {_setting_label(setting)}"
        print(f"engine ready in {time.perf_counter() - start:.1f} s{words}; {llm.engine.plan.describe(cfg.page_size)}",
              flush=True)
        measure(llm, args, cfg, bw, label if setting is None else f"{label} {_setting_label(setting)}")
        del llm
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def measure(llm, args: argparse.Namespace, cfg: EngineConfig, bw: float, label: str) -> None:
    """Decode at batch 1 per context, with each lane count, then the prefills: one record each."""
    shape, model_cfg = args.shape, llm.config
    targets = TARGETS.get(shape, {}) if args.recipe else {}
    resident = model_bytes(llm.model)
    kv_tok = kv_bytes_per_token(model_cfg, args.kv_dtype, llm.model.dtype)
    state = state_bytes_per_slot(model_cfg, llm.model.dtype)
    common = dict(recipe=args.recipe or "bf16", kv_dtype_engine=args.kv_dtype, resident_weight_bytes=resident,
                  layers=model_cfg.num_hidden_layers, cuda_graphs=not args.eager)
    wb1 = weight_bytes_per_step(llm.model, 1)
    print(f"weights resident {resident / 2**30:.2f} GiB; read per batch-1 step {wb1 / 2**30:.2f} GiB "
          f"(roofline {wb1 / bw / 1e9:.3f} ms + KV/state)", flush=True)
    for ctx in args.contexts:
        step = steady_decode(llm, 1, ctx, args.steps)
        floor_bytes = wb1 + ctx * kv_tok + 2 * state
        tok_s, frac = 1 / step, floor_bytes / step / 1e12 / bw
        extra = {}
        if targets:
            extra |= check_target("decode_b1_tok_s", tok_s, targets["decode_b1_tok_s"], "tok/s")
            if "decode_b1_roofline" in targets:
                extra |= check_target("decode_b1_roofline", frac, targets["decode_b1_roofline"], "of roofline")
        record("engine_decode_b1", f"{shape} {label} ctx={ctx}", step * 1e3, achieved=floor_bytes / step / 1e12,
               limit=bw, unit="TB/s", tok_per_s=round(tok_s, 1), roofline_ms=round(floor_bytes / bw / 1e9, 4),
               weight_bytes=wb1, step_bytes=int(floor_bytes), **common, **extra)
    for lanes in args.lanes:
        if llm.engine.runner.graphs is None:
            step = steady_decode(llm, lanes, args.lane_context, args.steps)
        else:
            step, replay = steady_decode(llm, lanes, args.lane_context, args.steps, timer=host_split)
            record("engine_decode_host", f"{shape} {label} C={lanes} ctx={args.lane_context}", (step - replay) * 1e3,
                   achieved=replay * 1e3, limit=step * 1e3, unit="ms", step_ms=round(step * 1e3, 4),
                   replay_ms=round(replay * 1e3, 4), **common)
        floor_bytes = weight_bytes_per_step(llm.model, lanes) + lanes * (args.lane_context * kv_tok + 2 * state)
        extra = check_target("c8_tok_s", lanes / step, targets["c8_tok_s"], "tok/s") \
            if lanes == 8 and "c8_tok_s" in targets else {}
        record("engine_decode_throughput", f"{shape} {label} C={lanes} ctx={args.lane_context}", step * 1e3,
               achieved=floor_bytes / step / 1e12, limit=bw, unit="TB/s", tok_per_s=round(lanes / step, 1),
               roofline_ms=round(floor_bytes / bw / 1e9, 4), step_bytes=int(floor_bytes), **common, **extra)
    if args.prefill:
        prefill(llm, min(1024, min(args.prefill)))  # warm the prefill kernels' autotuning
    for n in args.prefill:
        seconds, ttft = prefill(llm, n)
        extra = check_target("prefill_8k_tok_s", n / seconds, targets["prefill_8k_tok_s"], "tok/s") \
            if n == 8192 and "prefill_8k_tok_s" in targets else {}
        record("engine_prefill", f"{shape} {label} T={n} chunk={args.chunk}", seconds * 1e3,
               achieved=n / seconds, limit=float("nan"), unit="tok/s", ttft_ms=round(ttft * 1e3, 1),
               **common, **extra)


# ------------------------------------------------------------------------------------------ transformers floor

def hf_subprocess(args: argparse.Namespace) -> None:
    """The transformers floor in a child process (its own memory; killed after ``--hf-timeout`` seconds)."""
    cmd = [sys.executable, __file__, "--hf-only", "--shape", args.shape, "--device", args.device,
           "--prefill", *map(str, args.prefill[:1]), "--hf-prompt", str(args.hf_prompt), "--hf-new", str(args.hf_new),
           "--hf-budget", str(args.hf_budget)]
    if args.layers is not None:
        cmd += ["--layers", str(args.layers)]
    print(f"=== transformers floor (child process, timeout {args.hf_timeout} s) ===", flush=True)
    try:
        rc = subprocess.run(cmd, timeout=args.hf_timeout, check=False).returncode
        if rc:
            print(f"transformers floor: child exited with status {rc}", flush=True)
    except subprocess.TimeoutExpired:
        print(f"transformers floor: killed after {args.hf_timeout} s (no record beyond those printed above)",
              flush=True)


def hf_model(shape: str, device: str, num_layers: int | None = None):
    """transformers' own ``Qwen3_5ForCausalLM`` / ``Qwen3_5MoeForCausalLM`` at ``shape``, random bf16 weights,
    built directly on ``device`` (transformers' init under a default device: nothing materialises on the host)."""
    import transformers

    raw = shape_config(shape, num_layers)
    moe = raw.pop("model_type") == "qwen3_5_moe_text"
    cls = getattr(transformers, "Qwen3_5MoeForCausalLM" if moe else "Qwen3_5ForCausalLM")
    config = getattr(transformers, "Qwen3_5MoeTextConfig" if moe else "Qwen3_5TextConfig")(**raw)
    with torch.device(device):
        model = cls._from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    return model.eval()


def fla_version() -> str | None:
    try:
        import fla

        return str(getattr(fla, "__version__", "unknown"))
    except Exception:  # noqa: BLE001 - any import failure means transformers uses its torch fallback
        return None


@torch.no_grad()
def transformers_floor(args: argparse.Namespace) -> None:
    """Batch-1 greedy decode (and, if the budget allows, prefill) through transformers, bounded by ``--hf-budget``."""
    import transformers

    t0 = time.perf_counter()
    deadline = t0 + args.hf_budget
    device, shape = args.device, args.shape
    fla = fla_version()
    print(f"transformers {transformers.__version__}, fla {fla or 'not importable (torch fallback kernels)'}",
          flush=True)
    model = hf_model(shape, device, args.layers)
    sync(device)
    mem = f", {torch.cuda.memory_allocated() / 2**30:.1f} GiB" if torch.device(device).type == "cuda" else ""
    print(f"built {type(model).__name__} ({sum(p.numel() for p in model.parameters()) / 1e9:.2f}B params{mem}) "
          f"in {time.perf_counter() - t0:.1f} s", flush=True)
    extra = dict(transformers=transformers.__version__, fla=fla, attn="sdpa")
    ids = torch.tensor([random_prompt(args.hf_prompt, 1)], device=device)
    start = time.perf_counter()
    out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
    token = out.logits[:, -1:].argmax(-1)
    sync(device)
    print(f"prefill of {args.hf_prompt} tokens (first call) {time.perf_counter() - start:.2f} s", flush=True)
    cache, steps = out.past_key_values, []
    for i in range(args.hf_new):
        start = time.perf_counter()
        out = model(input_ids=token, past_key_values=cache, use_cache=True)
        token = out.logits[:, -1:].argmax(-1)
        sync(device)
        steps.append(time.perf_counter() - start)
        if i + 1 >= HF_MIN_STEPS and time.perf_counter() > deadline:
            print(f"decode stopped by the budget after {len(steps)} tokens", flush=True)
            break
    print(f"decode steps (ms): {' '.join(f'{1e3 * s:.1f}' for s in steps)}", flush=True)
    timed = steps[2:] if len(steps) > 4 else steps  # the first steps warm kernels and caches
    per_tok = statistics.median(timed)
    record("transformers_decode_b1", f"{shape} bf16 ctx={args.hf_prompt}", per_tok * 1e3, achieved=1 / per_tok,
           limit=float("nan"), unit="tok/s", tok_per_s=round(1 / per_tok, 2), tokens=len(steps),
           mean_ms=round(1e3 * sum(timed) / len(timed), 3), **extra)
    del out, cache
    if not args.prefill:
        return
    n_prefill = args.prefill[0]  # one prompt: transformers at 64k+ would not fit the budget anyway
    warm = min(512, n_prefill)
    # The estimate comes from a second short prefill: the first one compiles and autotunes fla's kernels
    # for prefill shapes (it once made an 8k prefill look like ~160 s).
    for attempt in range(2):
        if time.perf_counter() + 5 > deadline:
            print("transformers prefill skipped: no budget left", flush=True)
            return
        start = time.perf_counter()
        model(input_ids=torch.tensor([random_prompt(warm, 3 + attempt)], device=device), use_cache=False,
              logits_to_keep=1)
        sync(device)
        estimate = (time.perf_counter() - start) * n_prefill / warm
    long = torch.tensor([random_prompt(n_prefill, 2)], device=device)
    runs = []
    for attempt in range(2):  # the first run at the full length may compile again: the second is kept if it fits
        if time.perf_counter() + estimate > deadline:
            print(f"transformers prefill of {n_prefill} (run {attempt + 1}) skipped: ~{estimate:.0f} s estimated, "
                  f"budget left {deadline - time.perf_counter():.0f} s", flush=True)
            break
        start = time.perf_counter()
        model(input_ids=long, use_cache=False, logits_to_keep=1)
        sync(device)
        runs.append(time.perf_counter() - start)
        estimate = runs[-1]
        print(f"transformers prefill of {n_prefill} tokens, run {attempt + 1}: {runs[-1]:.2f} s", flush=True)
    if runs:
        seconds = runs[-1]
        record("transformers_prefill", f"{shape} bf16 T={n_prefill}", seconds * 1e3, achieved=n_prefill / seconds,
               limit=float("nan"), unit="tok/s", runs=len(runs), **extra)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="27b")
    parser.add_argument("--recipe", default=None, help="quantize with this recipe (name or file); default bf16")
    parser.add_argument("--kv-dtype", default="auto", choices=["auto", "bf16", "fp8", "int8"])
    parser.add_argument("--contexts", type=int, nargs="*", default=[1024, 32768])
    parser.add_argument("--lanes", type=int, nargs="*", default=[1, 2, 4, 8])
    parser.add_argument("--lane-context", type=int, default=512, help="prompt tokens per lane in the C-lane runs")
    parser.add_argument("--prefill", type=int, nargs="*", default=[8192],
                        help="time a single prompt of each of these lengths (none: skip)")
    parser.add_argument("--chunk", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--layers", type=int, default=None, help="fewer decoder layers (smoke tests)")
    parser.add_argument("--eager", action="store_true", help="decode without CUDA graphs")
    parser.add_argument("--no-decode-ahead", action="store_true",
                        help="wait for each decode step's tokens before launching the next (EngineConfig.decode_ahead)")
    parser.add_argument("--toggle", metavar="NAME=V1,V2,...", default=None,
                        help="one engine per value of this environment variable, over one random model, in this "
                             "order (an A/B switch read when the engine is built: NINFER_FUSED_PROLOGUE=1,0,1,0)")
    parser.add_argument("--settings", nargs="+", metavar="SETTING", default=None,
                        help="one engine per setting, in this order: base (the environment as it stands) or "
                             "NAME=V[+NAME=V...] (e.g. base NINFER_PDL_WAITS=1 NINFER_NORM_IN_GEMM=0 base ...)")
    parser.add_argument("--label", default="", help="words added to the records' labels (e.g. an A/B switch set in "
                                                    "the environment)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--hf", action="store_true", help="also measure transformers as the floor (child process)")
    parser.add_argument("--hf-only", action="store_true", help="only the transformers floor, in this process")
    parser.add_argument("--hf-prompt", type=int, default=128, help="transformers: prompt tokens before decoding")
    parser.add_argument("--hf-new", type=int, default=32, help="transformers: decode steps")
    parser.add_argument("--hf-budget", type=float, default=60.0,
                        help="transformers: seconds (from its start) after which decoding stops and prefill is skipped")
    parser.add_argument("--hf-timeout", type=int, default=240, help="--hf: kill the child after this many seconds")
    parsed = parser.parse_args(argv)
    if parsed.hf_only:
        transformers_floor(parsed)
    else:
        if not parsed.lanes or min(parsed.lanes) < 1:
            parser.error("--lanes needs at least one positive lane count")
        export_tuning_on_timeout(parsed.device)
        run(parsed)
        export_tuning(parsed.device)  # NINFER_EXPORT_TUNING: the choices this run made, for the shipped tables


if __name__ == "__main__":
    main()
