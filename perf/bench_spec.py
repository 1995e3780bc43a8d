"""MTP speculative decoding at the real 27B / 35B-A3B shapes with random weights.

Random weights accept nothing, so forced acceptance (``speculative.force_acceptance``) accepts exactly ``n`` of
the ``K`` drafts each round while running every real code path (catch-up, K draft steps, the
K+1-token verification with per-token DeltaNet states, sampling of every row, rollback). For
each ``n`` and concurrency ``C`` this measures the round time and the committed tokens per
second (``C * (n + 1) / round``), next to plain decoding (one token per step) in the same run,
and projects the rate at the tokens-per-round that real checkpoints reach (feature-bar §11:
MTP K=3 accepts 37-91%, i.e. 2.1-3.7 tokens per round; the issue's target is 2.7).

    python perf/bench_spec.py --shape 27b [--recipe int4-27b] [--draft-tokens 3] [--lanes 1 8]
"""
from __future__ import annotations

import argparse

import torch
from bench_engine import prefill, steady_decode, weight_bytes_per_step
from common import copy_bandwidth_for, record
from random_model import SHAPES, random_llm, random_model

from ninfer.checkpoint import materialize
from ninfer.kernels.rope import rope_inv_freq
from ninfer.llm import LLM
from ninfer.models.mtp import MTPHead
from ninfer.quant.linear import quantize_model_, recipe_plans
from ninfer.quant.recipe import load_recipe
from ninfer.runtime.engine import EngineConfig
from ninfer.runtime.memory import kv_bytes_per_token, state_bytes_per_slot
from ninfer.runtime.speculative import force_acceptance

TOKENS_PER_ROUND = (2.1, 2.7, 3.7)
TARGETS = {("27b", 1): 470.0, ("35b-a3b", 1): 1100.0}  # tok/s at C=1, K=3, 2.7 tokens per round (4-bit)


@torch.no_grad()
def random_head(model, recipe: str | None = None) -> MTPHead:
    """A random MTP head for ``model``; with ``recipe``, quantized by its ``mtp.`` rules as ``ninfer.load(...,
    quantize=recipe)`` quantizes a checkpoint's head."""
    with torch.device("meta"):
        head = MTPHead(model.config, model)
    plan = recipe_plans(load_recipe(recipe), _float_twin(model), head)[1] if recipe else {}
    materialize(head, model.device, model.dtype)
    gen = torch.Generator(device=model.device).manual_seed(1)
    for _, p in head.named_parameters():
        if p.dim() == 1:
            p.normal_(0.0, 0.1, generator=gen)
        else:
            p.normal_(0.0, p.shape[-1] ** -0.5, generator=gen)
    if plan:
        quantize_model_(head, plan, dtype=model.dtype)
    head.inv_freq = rope_inv_freq(model.config.rotary_dim, model.config.rope_theta).to(model.device)
    return head.eval()


def _float_twin(model):
    """``model``'s architecture on the meta device, unquantized: what recipes resolve against."""
    with torch.device("meta"):
        return type(model)(model.config)


def make_llm(model, head, shape: str, cfg: EngineConfig, full_vocab: bool = False) -> LLM:
    llm = random_llm(shape, cfg, model=model, mtp_head=head, full_vocab=full_vocab)
    llm.stop_ids = frozenset()  # random weights: never stop early
    return llm


def run(args: argparse.Namespace) -> None:
    model = random_model(args.shape, device=args.device, recipe=args.recipe)  # quantized part by part
    label = args.recipe or "bf16"
    head = random_head(model, args.recipe)
    k, ctx = args.draft_tokens, args.context
    full = args.full_vocab or args.draft_vocab is not None  # a subset of the tiny tokenizer's 481 ids is no subset
    label += " full-vocab" if full else ""
    label += f" {args.label}" if args.label else ""
    vocab = f" draft-vocab={args.draft_vocab}" if args.draft_vocab else ""
    bw = copy_bandwidth_for(args.device)
    kv_tok, state = kv_bytes_per_token(model.config, "auto", model.dtype), state_bytes_per_slot(model.config, model.dtype)
    for lanes in args.lanes:
        max_context = max(ctx, args.prefill) + 4096
        common = dict(max_concurrency=lanes, max_context=max_context, kv_capacity=lanes * max_context,
                      cuda_graphs=args.device == "cuda", prefix_cache=False)
        plain = make_llm(model, None, args.shape, EngineConfig(**common), full)
        base = steady_decode(plain, lanes, ctx, args.steps)
        # The plain engine's own numbers (issue 5): decode against the roofline of the bytes a step reads.
        floor = weight_bytes_per_step(model, lanes) + lanes * (ctx * kv_tok + 2 * state)
        record("engine_decode_b1" if lanes == 1 else "engine_decode_throughput",
               f"{args.shape} {label} C={lanes} ctx={ctx}", base * 1e3, achieved=floor / base / 1e12, limit=bw,
               unit="TB/s", tok_per_s=round(lanes / base, 1), roofline_ms=round(floor / bw / 1e9, 4))
        if args.prefill and lanes == max(args.lanes):
            prefill(plain, 1024)  # warm the prefill kernels' autotuning
            seconds, ttft = prefill(plain, args.prefill)
            record("engine_prefill", f"{args.shape} {label} T={args.prefill} chunk=1024", seconds * 1e3,
                   achieved=args.prefill / seconds, limit=float("nan"), unit="tok/s", ttft_ms=round(ttft * 1e3, 1))
        del plain
        record("spec_plain_decode", f"{args.shape} {label} C={lanes} ctx={ctx}", base * 1e3,
               achieved=lanes / base, limit=float("nan"), unit="tok/s")
        spec = EngineConfig(**common, draft_tokens=k, draft_vocab=args.draft_vocab)
        llm = make_llm(model, head, args.shape, spec, full)
        if args.draft_vocab is not None and llm.engine.spec.draft_ids is None:
            raise SystemExit(f"--draft-vocab {args.draft_vocab} covers the whole vocabulary ({llm.valid_vocab} ids)")
        rounds = {}
        for n in range(k + 1):
            force_acceptance(llm.engine.spec, n)
            rounds[n] = steady_decode(llm, lanes, ctx, args.steps)
            record("spec_forced_accept", f"{args.shape} {label} C={lanes} K={k}{vocab} n={n} ctx={ctx}",
                   rounds[n] * 1e3,
                   achieved=lanes * (n + 1) / rounds[n], limit=float("nan"), unit="tok/s",
                   baseline="plain decode step", baseline_ms=base * 1e3, tokens_per_round=n + 1,
                   round_vs_plain_step=round(rounds[n] / base, 3))
        for tpr in TOKENS_PER_ROUND:
            if tpr - 1 > k:
                continue
            lo = min(int(tpr - 1), k - 1) if k > 1 else 0
            frac = (tpr - 1) - lo
            t = rounds[lo] + frac * (rounds[min(lo + 1, k)] - rounds[lo])
            target = TARGETS.get((args.shape, lanes)) if tpr == 2.7 and k == 3 else None
            # One round commits tpr tokens per lane; plain decoding needs tpr steps for them.
            record("spec_projected", f"{args.shape} {label} C={lanes} K={k}{vocab} {tpr} tok/round ctx={ctx}", t * 1e3,
                   achieved=lanes * tpr / t, limit=target or float("nan"), unit="tok/s",
                   baseline="plain decode, same tokens", baseline_ms=tpr * base * 1e3)
        del llm
        if args.device == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="27b")
    parser.add_argument("--recipe", default=None, help="quantize the random model with this recipe first")
    parser.add_argument("--draft-tokens", type=int, default=3)
    parser.add_argument("--draft-vocab", type=int, default=None,
                        help="draft among the N lowest token ids only (the engine's draft_vocab)")
    parser.add_argument("--full-vocab", action="store_true",
                        help="sample and draft over the model's whole vocabulary, not the bundled tokenizer's 481 ids "
                             "(implied by --draft-vocab: compare with a run that passes this)")
    parser.add_argument("--label", default="", help="words added to every record's label (a setting being compared)")
    parser.add_argument("--lanes", type=int, nargs="*", default=[1, 8])
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--device", default="cuda", help="cpu: a smoke test with --shape tiny / tiny-moe")
    parser.add_argument("--prefill", type=int, default=0, help="also time a prompt of this many tokens (plain engine)")
    run(parser.parse_args())
