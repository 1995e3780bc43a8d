"""Where a whole-model logprob difference comes from: the tiny model with the real head geometry scored
with every kernel family on its PyTorch reference, then with one family at a time on Triton, then all.

    python perf/parity_by_kernel.py [--dtype fp32|bf16] [--tokens 300]      # on CUDA
    TRITON_INTERPRET=1 python perf/parity_by_kernel.py --device cpu          # Triton interpreter (fp32)

Prints the max |logprob difference| of each run against the reference path and against transformers
(fp32, on the CPU), so a failing ``tests/gpu/test_model_gpu.py`` parity points at one kernel family.
"""
from __future__ import annotations

import argparse
import importlib
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from tiny_checkpoints import make_dense  # noqa: E402

import ninfer  # noqa: E402
from ninfer.kernels.dispatch import INTERPRET  # noqa: E402

FAMILIES = ["norms", "rope", "conv", "activations", "deltanet", "attention"]
DISPATCH = {"deltanet": "deltanet.dispatch", "attention": "attention.dispatch"}  # the module that reads use_triton
REAL_HEADS = dict(hidden_size=256, intermediate_size=512, head_dim=256, num_attention_heads=6,
                  num_key_value_heads=1, linear_num_key_heads=2, linear_num_value_heads=6,
                  linear_key_head_dim=128, linear_value_head_dim=128)


def _route(on: set[str]) -> None:
    """Triton for the families in ``on`` (CUDA tensors, or any under the interpreter), references elsewhere."""
    for fam in FAMILIES:
        mod = importlib.import_module(f"ninfer.kernels.{DISPATCH.get(fam, fam)}")
        mod.use_triton = (lambda x: x.is_cuda or INTERPRET) if fam in on else (lambda x: False)


def main(args: argparse.Namespace) -> None:
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    ckpt = make_dense(Path(tempfile.mkdtemp()), seed=1, overrides=REAL_HEADS)
    ids = torch.randint(0, 448, (args.tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    llm = ninfer.load(ckpt.path, device=args.device, dtype=dtype, progress=False, cuda_graphs=False)
    with torch.no_grad():
        logits = ckpt.hf_model(torch.tensor([ids])).logits[0].float()
    hf = logits.log_softmax(-1)[:-1].gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    _route(set())
    ref = llm.score(ids).float().cpu()
    print(f"{args.dtype}, {args.tokens} tokens on {args.device}: reference path vs transformers "
          f"{(ref - hf).abs().max().item():.2e}", flush=True)
    for name, on in [*((f, {f}) for f in FAMILIES), ("all", set(FAMILIES))]:
        _route(on)
        got = llm.score(ids).float().cpu()
        print(f"  triton {name:<12} vs reference {(got - ref).abs().max().item():.2e}   "
              f"vs transformers {(got - hf).abs().max().item():.2e}", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--tokens", type=int, default=300)
    parser.add_argument("--device", default="cuda")
    main(parser.parse_args())
