"""HTTP serving benchmark: TTFT and decode tok/s through ``/v1/chat/completions`` against the library API.

Starts the server in-process (uvicorn on a random loopback port, the engine on its own thread, as
``ninfer serve`` does), then drives it with an asyncio load generator (httpx, streaming): for each
concurrency level C, N requests with a fixed prompt length and ``max_tokens``, at most C in flight.
The load generator runs in its own process (a real client's position) unless ``--client-in-process``
(both sides in ``perf/http_load.py``).
Per request, TTFT is the time from sending to the first streamed token delta, decode tok/s is
``(completion_tokens - 1) / (last delta - first delta)``. The same workload (same prompt ids, greedy,
same output length) also runs through the library API (``llm.engine`` stepped directly, as
``LLM._run`` does) with each request created at the time the HTTP client sent it, and the HTTP
overhead is reported on TTFT and on decode throughput (p50s) against that replay. (A closed library
loop submits each wave before one step, so the wave's prompts prefill together, while over HTTP they
reach the engine one by one and all but the first wait for a step: that is the arrival pattern, not
HTTP processing. The closed loop's percentiles stay in the records as ``library_burst_*``.)

Random weights never stop early (``llm.stop_ids = frozenset()``), so every request decodes exactly
``max_tokens`` tokens; checkpoints get the same treatment unless ``--respect-eos``. Levels above the
engine's lanes (``--lanes``, at most 8) queue in the server and in the library loop alike.

    python perf/bench_server.py --random 27b                         # GPU: levels 1 2 4 8 16
    python perf/bench_server.py ./my-model --prompt-tokens 1024 --max-tokens 256
    python perf/bench_server.py --smoke                              # CPU: tiny default model, C = 1, 2
    python perf/bench_server.py --simulate-device --device cpu --levels 1 --max-tokens 64   # CPU, GPU-like timing

Records (``perf/common.py``): ``server_ttft`` and ``server_decode`` per level, with
``baseline = "library API"``.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

if not torch.cuda.is_available():  # CPU smoke runs: Triton kernels run in the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common
from common import record
from http_load import Client, InProcessServer, Sample

LIBRARY = "library API"


# ------------------------------------------------------------------------------------------ workload
def make_prompts(llm: Any, n: int, prompt_tokens: int) -> list[tuple[str, list[int]]]:
    """``n`` distinct user messages whose rendered chat prompts (thinking off) all have ``prompt_tokens`` ids.

    Distinct from their first word, so no request shares more than the template's few prefix tokens.
    """
    tok = llm.tokenizer
    words = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet",
             "kilo", "lima", "mike", "november", "oscar", "papa", "quebec", "romeo", "sierra", "tango"]

    def ids_of(text: str) -> list[int]:
        return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}], enable_thinking=False))

    out = []
    for i in range(n):
        head = f"{i} {words[i % len(words)]} {words[(i * 7 + 3) % len(words)]}:"
        body = [words[(k * 11 + i) % len(words)] for k in range(4 * prompt_tokens)]
        lo, hi = 0, len(body)  # the most words that stay within prompt_tokens (binary search)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if len(ids_of(head + " " + " ".join(body[:mid]))) <= prompt_tokens:
                lo = mid
            else:
                hi = mid - 1
        text = head + " " + " ".join(body[:lo + 1])  # one word too many, then trim by characters
        while len(ids_of(text)) > prompt_tokens and len(text) > len(head):
            text = text[:-1]
        ids = ids_of(text)
        out.append((text, ids))
    return out


@torch.no_grad()
def text_tokens_only(llm: Any) -> int:
    """Zero the LM-head rows of every token that is not plain printable ASCII text; returns the tokens kept.

    Random weights sample from the whole vocabulary: special tokens, partial UTF-8 bytes and tag
    fragments would render as no text (or be held back), so streamed chunks would not match
    tokens. With those rows zeroed their logit is exactly 0 and greedy decoding (almost surely)
    picks a text token, so every token is one streamed delta on both paths.
    """
    from ninfer.quant.linear import QuantWeight

    head = llm.model.lm_head
    weight = getattr(head, "weight", None)
    if isinstance(head, QuantWeight):
        rows = head.shape[-2]
    elif isinstance(weight, torch.Tensor) and weight.dim() == 2:
        rows = weight.shape[0]
    else:
        return 0
    tok = llm.tokenizer
    keep = torch.zeros(rows, dtype=torch.bool)
    for i in range(min(llm.valid_vocab, rows)):
        text = tok.decode([i])
        keep[i] = bool(text) and text.isascii() and text.isprintable() and not any(c in text for c in "<>&")
    if isinstance(head, QuantWeight):
        _zero_quantized_rows(head, (~keep).nonzero()[:, 0])
    else:
        weight[~keep.to(weight.device)] = 0
    return int(keep.sum())


def _zero_quantized_rows(head: Any, rows: torch.Tensor) -> None:
    """Zero output rows of a quantized LM head (recipes quantize it: int8-g64 under ``int4``): every stored
    float tensor with one entry per row (scales, nvfp4's global scales, fp8 codes) gets zeros there, so
    the dequantized rows are exactly 0 in every format (integer codes times a zero scale)."""
    for name, spec in head.format.specs(head.shape).items():
        tensor = getattr(head, name).data
        if spec.row_block != 1 or not tensor.is_floating_point():
            continue
        dim = spec.row_dim % tensor.dim()
        target = tensor.view(torch.uint8) if tensor.element_size() == 1 else tensor  # fp8: no index_fill_
        target.index_fill_(dim, rows.to(tensor.device), 0)


def percentiles(values: list[float]) -> dict[str, float]:
    t = torch.tensor(values, dtype=torch.float64)
    q = torch.quantile(t, torch.tensor([0.5, 0.9, 0.99], dtype=torch.float64)).tolist()
    return {"p50": q[0], "p90": q[1], "p99": q[2]}


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


# ------------------------------------------------------------------------------------------ library API
def run_library(llm: Any, prompts: list[list[int]], concurrency: int, max_tokens: int) -> list[Sample]:
    """A closed loop through ``llm.engine``: at most ``concurrency`` requests submitted at once. A wave of
    requests is submitted before the next step, so their prompts prefill together — an arrival pattern
    HTTP clients cannot produce (see :func:`run_library_replay`)."""
    from ninfer.runtime.request import Status
    from ninfer.runtime.sampling import SamplingParams
    from ninfer.runtime.scheduler import QueueFull

    engine, params = llm.engine, SamplingParams(greedy=True)
    todo, live, done = list(prompts), [], []
    while todo or live:
        while todo and len(live) < concurrency:
            req = llm._request(todo[0], max_tokens, params, thinking=False)
            try:
                engine.add_request(req)
            except QueueFull:
                break
            todo.pop(0)
            live.append(req)
        engine.step()
        for req in [r for r in live if r.status == Status.FINISHED]:
            live.remove(req)
            done.append(req)
    _sync()
    samples = []
    for req in done:
        ttft = req.first_token_time - req.arrival
        decode = req.finish_time - req.first_token_time
        n = len(req.output_ids)
        samples.append(Sample(ttft, (n - 1) / decode if decode > 0 and n > 1 else 0.0, n,
                              req.finish_time - req.arrival))
    return samples


def run_library_replay(llm: Any, prompts: list[list[int]], sent_s: list[float], max_tokens: int) -> list[Sample]:
    """The library API fed the HTTP run's arrival times: request ``i`` is created ``sent_s[i]`` seconds after
    the start, between engine steps (as the server's engine thread takes new requests), and its TTFT is
    counted from that scheduled time. Against this baseline the overhead is what the HTTP layer adds
    (parsing, templating, tokenizing, streaming), not the difference between a burst submitted before
    one step and requests that reach the engine one by one over a few milliseconds."""
    from ninfer.runtime.request import Status
    from ninfer.runtime.sampling import SamplingParams
    from ninfer.runtime.scheduler import QueueFull

    engine, params = llm.engine, SamplingParams(greedy=True)
    order = sorted(range(len(prompts)), key=sent_s.__getitem__)
    live: list[tuple[Any, float]] = []
    done: list[tuple[Any, float]] = []
    start = time.perf_counter()
    while order or live:
        now = time.perf_counter() - start
        while order and sent_s[order[0]] <= now:
            req = llm._request(prompts[order[0]], max_tokens, params, thinking=False)
            try:
                engine.add_request(req)
            except QueueFull:  # the server would hold it as pending: retry after the next step
                break
            live.append((req, start + sent_s[order.pop(0)]))
        if live:
            engine.step()
        elif order:
            time.sleep(max(0.0, sent_s[order[0]] - now))
        for item in [x for x in live if x[0].status == Status.FINISHED]:
            live.remove(item)
            done.append(item)
    _sync()
    samples = []
    for req, due in done:
        decode = req.finish_time - req.first_token_time
        n = len(req.output_ids)
        samples.append(Sample(req.first_token_time - due, (n - 1) / decode if decode > 0 and n > 1 else 0.0, n,
                              req.finish_time - due))
    return samples


# ------------------------------------------------------------------------------------------ report
def report(label: str, level: int, args: argparse.Namespace, http: list[Sample], lib: list[Sample],
           burst: list[Sample]) -> dict:
    """Records of one level: HTTP against the library API replaying HTTP's arrival times (``lib``); the
    closed-loop library run (``burst``: each wave submitted before one step) is kept in the record."""
    shape = f"{label} C={level} P={args.prompt_tokens} T={args.max_tokens}"
    h_ttft, l_ttft = percentiles([s.ttft_s * 1e3 for s in http]), percentiles([s.ttft_s * 1e3 for s in lib])
    h_dec, l_dec = percentiles([s.decode_tok_s for s in http]), percentiles([s.decode_tok_s for s in lib])
    h_e2e, l_e2e = percentiles([s.total_s * 1e3 for s in http]), percentiles([s.total_s * 1e3 for s in lib])
    ttft_overhead = 100 * (h_ttft["p50"] - l_ttft["p50"]) / l_ttft["p50"] if l_ttft["p50"] > 0 else float("nan")
    dec_overhead = 100 * (l_dec["p50"] - h_dec["p50"]) / l_dec["p50"] if l_dec["p50"] > 0 else float("nan")
    r3 = lambda d: {k: round(v, 3) for k, v in d.items()}
    common_extra = {"concurrency": level, "requests": len(http), "prompt_tokens": args.prompt_tokens,
                    "max_tokens": args.max_tokens, "lanes": args.lanes,
                    "tokens_http": sorted({s.tokens for s in http}), "tokens_library": sorted({s.tokens for s in lib}),
                    "e2e_http_ms": r3(h_e2e), "e2e_library_ms": r3(l_e2e),
                    "library_burst_ttft_ms": r3(percentiles([s.ttft_s * 1e3 for s in burst])),
                    "library_burst_tok_s": r3(percentiles([s.decode_tok_s for s in burst]))}
    record("server_ttft", shape, h_ttft["p50"], achieved=h_ttft["p50"], limit=float("nan"), unit="ms",
           baseline=LIBRARY, baseline_ms=l_ttft["p50"], http_ms=r3(h_ttft), library_ms=r3(l_ttft),
           overhead_pct=round(ttft_overhead, 2), **common_extra)
    per_tok = lambda tok_s: 1e3 / tok_s if tok_s > 0 else float("nan")
    record("server_decode", shape, per_tok(h_dec["p50"]), achieved=h_dec["p50"], limit=float("nan"),
           unit="tok/s", baseline=LIBRARY, baseline_ms=per_tok(l_dec["p50"]), http_tok_s=r3(h_dec),
           library_tok_s=r3(l_dec), overhead_pct=round(dec_overhead, 2), **common_extra)
    return {"level": level, "ttft_overhead_pct": ttft_overhead, "decode_overhead_pct": dec_overhead}


# ------------------------------------------------------------------------------------------ main
def load(args: argparse.Namespace) -> tuple[Any, str]:
    from ninfer.runtime.engine import EngineConfig

    max_context = args.prompt_tokens + args.max_tokens + 64
    graphs = torch.cuda.is_available() and not args.no_cuda_graphs
    if args.random:
        from random_model import random_llm

        cfg = EngineConfig(max_concurrency=args.lanes, max_context=max_context, prefill_chunk=args.prefill_chunk,
                           cuda_graphs=graphs, prefix_cache=False)
        llm, label = random_llm(args.random, cfg, recipe=args.recipe), f"random-{args.random} {args.recipe or 'bf16'}"
    else:
        import ninfer

        llm = ninfer.load(args.model, device=args.device, prefix_cache=False, max_concurrency=args.lanes, max_context=max_context,
                          prefill_chunk=args.prefill_chunk, cuda_graphs=graphs, progress=False)
        label = Path(args.model).name if args.model else "tiny-default"
    if args.random or not args.respect_eos:
        llm.stop_ids = frozenset()  # never stop early: every request decodes max_tokens tokens
    if args.simulate_device:  # CPU: a stand-in for an asynchronous GPU (perf/device_sim.py), text tokens only
        from device_sim import DeviceTimes, simulate_device

        simulate_device(llm, DeviceTimes(), overlap=not args.no_overlap)
        label += " simulated-device" + (" no-overlap" if args.no_overlap else "")
    elif args.random or args.text_tokens:
        print(f"sampling restricted to {text_tokens_only(llm)} plain-text tokens", flush=True)
    if args.no_overlap:  # the A/B of the server's launch-timed hand-overs (ninfer/runtime/async_engine.py)
        llm.engine.launches_async = False
        label += "" if args.simulate_device else " no-overlap"
    # how long the HTTP thread may hold the engine thread off the interpreter: `ninfer serve`'s default
    # (--switch-interval-ms 0.5) unless asked otherwise (records of runs before that default used Python's 5 ms)
    sys.setswitchinterval(args.switch_interval / 1e3)
    if args.switch_interval != SERVE_SWITCH_MS:
        label += f" switch={args.switch_interval:g}ms"
    return llm, label


SERVE_SWITCH_MS = 0.5  # ninfer serve --switch-interval-ms default


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", help="checkpoint directory or Hub id (default: the bundled tiny model)")
    p.add_argument("--random", metavar="SHAPE", help="random weights at a real shape (27b, 35b-a3b) instead")
    p.add_argument("--recipe", help="with --random: quantize the random model with this recipe (e.g. int4)")
    p.add_argument("--levels", type=int, nargs="+", default=[1, 2, 4, 8, 16], help="concurrency levels")
    p.add_argument("--requests", type=int, default=0, help="requests per level (default: max(8, 2 x level))")
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--lanes", type=int, default=8, help="engine lanes (max_concurrency, at most 8)")
    p.add_argument("--prefill-chunk", type=int, default=1024)
    p.add_argument("--device", help="device of a checkpoint (default: cuda if available)")
    p.add_argument("--no-cuda-graphs", action="store_true")
    p.add_argument("--respect-eos", action="store_true", help="let a checkpoint stop at its end-of-sequence ids")
    p.add_argument("--text-tokens", action="store_true",
                   help="zero a checkpoint's LM-head rows of non-text tokens (always done for --random)")
    p.add_argument("--client-in-process", action="store_true",
                   help="run the load generator on this process's event loop (default: its own process)")
    p.add_argument("--simulate-device", action="store_true",
                   help="CPU: replace the model by perf/device_sim.py's stand-in for a GPU (launch, then wait)")
    p.add_argument("--no-overlap", action="store_true",
                   help="the server hands outputs over as soon as a step ends (the behaviour before launch timing)")
    p.add_argument("--switch-interval", type=float, default=SERVE_SWITCH_MS, metavar="MS",
                   help="Python's thread switch interval in this process (server, engine thread, library runs); "
                        f"default {SERVE_SWITCH_MS}, as `ninfer serve`; Python's own is 5")
    p.add_argument("--smoke", action="store_true", help="CPU check: tiny default model, levels 1 2, few tokens")
    args = p.parse_args(argv)
    if args.smoke:
        args.levels, args.prompt_tokens, args.max_tokens, args.lanes = [1, 2], 48, 6, 2
        args.requests, args.text_tokens = args.requests or 2, True
        if args.model is None and args.random is None and not torch.cuda.is_available():
            args.device = "cpu"
    args.lanes = min(args.lanes, 8)
    if not torch.cuda.is_available():  # perf/common.py reads the GPU name; CPU runs record where they are
        common.environment = lambda: {"gpu": "cpu", "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}
        if "OUT" not in os.environ:
            os.environ["OUT"] = tempfile.mkdtemp(prefix="ninfer-bench-server-")
    print(f"records -> {common.results_path()}", flush=True)

    llm, label = load(args)
    per_level = {c: args.requests or max(8, 2 * c) for c in args.levels}
    warm_n = min(max(args.levels), args.lanes)
    prompts = make_prompts(llm, max(per_level.values()) + warm_n, args.prompt_tokens)
    warm, prompts = prompts[-warm_n:], prompts[:-warm_n]
    lengths = sorted({len(ids) for _, ids in prompts})
    print(f"{label}: prompt {lengths} tokens, max_tokens {args.max_tokens}, lanes {args.lanes}, "
          f"levels {args.levels}", flush=True)

    # Per level: the library API's closed loop, then the server (its engine thread owns llm.engine while it
    # runs), each after an unmeasured warm-up at the level's batch size (kernels, CUDA graphs, allocator);
    # then the library API again, fed the HTTP run's send times: the baseline of the overhead columns.
    library, burst, http = {}, {}, {}
    rows = []
    client = Client(in_process=args.client_in_process)
    for c in args.levels:
        batch = min(c, warm_n)
        run_library(llm, [ids for _, ids in warm[:batch]], c, args.max_tokens)
        burst[c] = run_library(llm, [ids for _, ids in prompts[:per_level[c]]], c, args.max_tokens)
        with InProcessServer(llm, max_pending=max(args.levels) + 8, max_tokens=args.max_tokens) as server:
            client.run(server.url, [t for t, _ in warm[:batch]], c, args.max_tokens)
            http[c] = client.run(server.url, [t for t, _ in prompts[:per_level[c]]], c, args.max_tokens)
        library[c] = run_library_replay(llm, [ids for _, ids in prompts[:per_level[c]]],
                                        [x.sent_s for x in http[c]], args.max_tokens)
        print(f"level {c}: library and HTTP done", flush=True)
        rows.append(report(label, c, args, http[c], library[c], burst[c]))  # recorded now: a cut run keeps it
    client.close()

    print("\nlevel  TTFT overhead  decode overhead   (HTTP vs library API at the same arrival times, p50)")
    for row in rows:
        print(f"{row['level']:5d}  {row['ttft_overhead_pct']:+12.1f}%  {row['decode_overhead_pct']:+14.1f}%")
    bad = [c for c in args.levels for s in http[c] + library[c] + burst[c] if s.tokens != args.max_tokens]
    if bad and not args.respect_eos:
        raise SystemExit(f"some requests did not decode exactly {args.max_tokens} tokens (levels {sorted(set(bad))})")
    return rows


if __name__ == "__main__":
    main()
