"""A long speculative run for compute-sanitizer (tiny model with the real head geometry, CUDA graphs on).

    NINFER_AUTOTUNE=off compute-sanitizer --tool memcheck python3 perf/sanitize_spec.py --tokens 400

Forced acceptance takes each count 0..K in turn, so every rollback slot and many page
boundaries are exercised; the run ends by checking that every page and slot came back.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from tiny_checkpoints import make_composite  # noqa: E402

import ninfer  # noqa: E402
from ninfer.runtime.speculative import force_acceptance  # noqa: E402

REAL_HEADS = dict(hidden_size=256, intermediate_size=512, head_dim=256, num_attention_heads=6,
                  num_key_value_heads=1, linear_num_key_heads=2, linear_num_value_heads=6,
                  linear_key_head_dim=128, linear_value_head_dim=128)


def main(args: argparse.Namespace) -> None:
    ckpt = make_composite(Path(tempfile.mkdtemp()), seed=5, overrides=REAL_HEADS)
    llm = ninfer.load(ckpt.path, device=args.device, dtype=torch.bfloat16 if args.device == "cuda" else None, max_concurrency=4, max_context=2048,
                      spec="mtp", draft_tokens=args.k, kv_dtype=args.kv_dtype, prefill_chunk=128, progress=False)
    llm.stop_ids = frozenset()
    spec = llm.engine.spec
    prompts = [torch.randint(0, 448, (n,)).tolist() for n in (5, 70, 130, 300)]
    params = llm.sampling_params(greedy=True)
    for n in range(args.k + 1):
        force_acceptance(spec, n)  # every acceptance count (so every rollback slot), graphs replayed
        reqs = [llm._request(p, args.tokens, params) for p in prompts]
        llm._run(reqs)
        print(f"forced n={n}: {[len(r.output_ids) for r in reqs]} tokens", flush=True)
    if args.device == "cuda":
        torch.cuda.synchronize()
    assert llm.engine.is_idle(), "pages or slots leaked"
    print("ok: engine idle, all pages and slots returned")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=400)
    parser.add_argument("-k", type=int, default=3)
    parser.add_argument("--kv-dtype", default="int8")
    parser.add_argument("--device", default="cuda")
    main(parser.parse_args())
