"""End-to-end engine benchmark at the real 27B / 35B-A3B shapes with random weights.

Measures, in one run: copy bandwidth (the roofline's ceiling); batch-1 decode step time at two
contexts against the roofline (weights + KV + DeltaNet state bytes per step / copy bandwidth);
steady decode throughput with C lanes all decoding; prefill tok/s and TTFT; and transformers on
the same GPU as the floor.

    python perf/bench_engine.py --shape 27b [--contexts 1024 32768] [--prefill 8192] [--hf]
"""
from __future__ import annotations

import argparse
import gc
import time

import torch

from common import copy_bandwidth_tbps, record
from random_model import SHAPES, random_llm
from ninfer.runtime.engine import EngineConfig
from ninfer.runtime.memory import kv_bytes_per_token, state_bytes_per_slot
from ninfer.runtime.sampling import SamplingParams

GREEDY = SamplingParams(greedy=True)


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 448, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def weight_bytes_per_step(model) -> int:
    """Bytes a decode step streams: every parameter once, except the embedding (one row per token)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    emb = model.embed_tokens.weight
    return total - emb.numel() * emb.element_size()


def steady_decode(llm, lanes: int, context: int, steps: int) -> float:
    """Seconds per step once ``lanes`` sequences of ~``context`` tokens are all decoding."""
    engine = llm.engine
    reqs = [llm._request(_prompt(context, seed=i), 10 ** 6, GREEDY) for i in range(lanes)]
    for r in reqs:
        engine.add_request(r)
    while any(not r.prefill_done or not r.output_ids for r in reqs):
        engine.step()
    for _ in range(3):
        engine.step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    elapsed = (time.perf_counter() - start) / steps
    for r in reqs:
        engine.cancel(r.request_id)
    return elapsed


def prefill(llm, tokens: int) -> tuple[float, float]:
    """(prefill seconds, TTFT seconds) of one request of ``tokens`` prompt tokens."""
    engine = llm.engine
    req = llm._request(_prompt(tokens, seed=99), 1, GREEDY)
    torch.cuda.synchronize()
    start = time.perf_counter()
    engine.add_request(req)
    engine.run_until_done()
    torch.cuda.synchronize()
    ttft = req.first_token_time - start
    return ttft, ttft


def run(args: argparse.Namespace) -> None:
    bw = copy_bandwidth_tbps()
    shape = args.shape
    max_ctx = max(args.contexts + [args.prefill]) + 64
    cfg = EngineConfig(max_concurrency=max(args.lanes), max_context=max_ctx,
                       kv_capacity=max_ctx * max(args.lanes) if max(args.lanes) * max_ctx < 600_000 else "auto",
                       prefill_chunk=args.chunk, cuda_graphs=True, prefix_cache=False)  # raw engine speed
    llm = random_llm(shape, cfg)
    llm.stop_ids = frozenset()  # random weights: never stop early
    model_cfg = llm.config
    wbytes = weight_bytes_per_step(llm.model)
    kv_tok = kv_bytes_per_token(model_cfg, "auto", torch.bfloat16)
    state = state_bytes_per_slot(model_cfg, torch.bfloat16)
    for ctx in args.contexts:
        step = steady_decode(llm, 1, ctx, args.steps)
        floor_bytes = wbytes + ctx * kv_tok + 2 * state
        record("engine_decode_b1", f"{shape} bf16 ctx={ctx}", step * 1e3, achieved=floor_bytes / step / 1e12,
               limit=bw, unit="TB/s", tok_per_s=round(1 / step, 1), roofline_ms=round(floor_bytes / bw / 1e9, 4))
    for lanes in args.lanes:
        step = steady_decode(llm, lanes, 512, args.steps)
        floor_bytes = wbytes + lanes * (512 * kv_tok + 2 * state)
        record("engine_decode_throughput", f"{shape} bf16 C={lanes} ctx=512", step * 1e3,
               achieved=floor_bytes / step / 1e12, limit=bw, unit="TB/s", tok_per_s=round(lanes / step, 1))
    if args.prefill:
        prefill(llm, 1024)  # warm the prefill kernels' autotuning
        seconds, ttft = prefill(llm, args.prefill)
        record("engine_prefill", f"{shape} bf16 T={args.prefill} chunk={args.chunk}", seconds * 1e3,
               achieved=args.prefill / seconds, limit=float("nan"), unit="tok/s", ttft_ms=round(ttft * 1e3, 1))
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    if args.hf:
        transformers_floor(shape, args.prefill or 8192)


@torch.no_grad()
def transformers_floor(shape: str, prefill_tokens: int) -> None:
    """transformers' own implementation on the same GPU: decode tok/s and prefill tok/s (the floor)."""
    import transformers

    raw = dict(SHAPES[shape])
    cls = transformers.Qwen3_5MoeForCausalLM if raw.pop("model_type") == "qwen3_5_moe_text" else \
        transformers.Qwen3_5ForCausalLM
    conf_cls = transformers.Qwen3_5MoeTextConfig if cls is transformers.Qwen3_5MoeForCausalLM else \
        transformers.Qwen3_5TextConfig
    config = conf_cls(**raw)
    with torch.device("cuda"):
        model = cls._from_config(config, torch_dtype=torch.bfloat16).eval()
    ids = torch.tensor([_prompt(128, 1)], device="cuda")
    model.generate(ids, max_new_tokens=4, do_sample=False)
    torch.cuda.synchronize()
    start = time.perf_counter()
    model.generate(ids, max_new_tokens=33, min_new_tokens=33, do_sample=False)
    torch.cuda.synchronize()
    per_tok = (time.perf_counter() - start) / 33
    record("transformers_decode_b1", f"{shape} bf16 ctx=128", per_tok * 1e3, achieved=1 / per_tok,
           limit=float("nan"), unit="tok/s")
    long = torch.tensor([_prompt(prefill_tokens, 2)], device="cuda")
    model(long[:, :512])
    torch.cuda.synchronize()
    start = time.perf_counter()
    model(long, logits_to_keep=1)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    record("transformers_prefill", f"{shape} bf16 T={prefill_tokens}", seconds * 1e3,
           achieved=prefill_tokens / seconds, limit=float("nan"), unit="tok/s")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="27b")
    parser.add_argument("--contexts", type=int, nargs="*", default=[1024, 32768])
    parser.add_argument("--lanes", type=int, nargs="*", default=[1, 2, 4, 8])
    parser.add_argument("--prefill", type=int, default=8192)
    parser.add_argument("--chunk", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--hf", action="store_true", help="also measure transformers as the floor")
    run(parser.parse_args())
