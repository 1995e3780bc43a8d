"""One Qwen3.5-35B-A3B MoE block at decode as the model runs it: router, top-k, the routed experts (int4-g64), the
shared expert (int8-g64, re-laid for the register decode) on the captured step's second stream, the combine and the
norm after the block (``SparseMoeBlock.forward_then_norm``), the default path: the only one since the down projection
with the combine and the whole block after the router, each in one launch, were measured slower (run 2026-12-06.1)
and removed (commit 076d72c still has them).

Each point replays a CUDA graph of 2 x 8 blocks over 8 inputs (so consecutive blocks route to other experts) and
reports milliseconds per block against the bytes it must read (router, the distinct selected experts, the shared
expert, activations) over the copy bandwidth. The records keep the label ``... T=<n> base`` of the runs that
compared paths.

    python perf/bench_moe_block.py [--tokens 1 2 8] [--label WORDS]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import bench_graph_ms, copy_bandwidth_for, record  # noqa: E402

from ninfer.kernels.moe import route_topk_reference  # noqa: E402
from ninfer.models.layers import RMSNorm  # noqa: E402
from ninfer.models.moe import SparseMoeBlock  # noqa: E402
from ninfer.quant.linear import QuantLinear, quantize_model_  # noqa: E402

E, TOP_K, H, I, SHARED_I = 256, 8, 2048, 512, 512
ROUTINGS = 8


def build_block(device: torch.device) -> tuple[SparseMoeBlock, RMSNorm]:
    """The 35B-A3B block with random weights, quantized as the ``qwen3_5_35b_a3b_int4`` recipe does, the shared
    expert in the register decode's fragment layout as an engine lays it."""
    config = SimpleNamespace(hidden_size=H, num_experts=E, num_experts_per_tok=TOP_K, moe_intermediate_size=I,
                             shared_expert_intermediate_size=SHARED_I)
    torch.manual_seed(0)
    block = SparseMoeBlock(config).to(device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, H ** -0.5)
    quantize_model_(block, {"experts.gate_up_proj": "int4-g64", "experts.down_proj": "int4-g64",
                            "shared_expert.gate_up_proj": "int8-g64", "shared_expert.down_proj": "int8-g64"})
    for module in block.modules():
        if isinstance(module, QuantLinear) and module.qweight.is_cuda:
            module.use_fragment_layout_()
    norm = RMSNorm(H, 1e-6).to(device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        norm.weight.normal_(0.0, 0.3)
    return block, norm


def block_bytes(block: SparseMoeBlock, xs: list[torch.Tensor]) -> float:
    """Bytes one block must read, averaged over the inputs' routings: the router, the distinct selected experts,
    the shared expert, the activations and residual in and the two rows out."""
    gate_up, down = block.experts.gate_up_proj.packed(), block.experts.down_proj.packed()
    per_expert = sum(t[0].numel() * t.element_size() for w in (gate_up, down) for t in w.tensors.values())
    shared = sum(t.numel() * t.element_size() for m in (block.shared_expert.gate_up_proj, block.shared_expert.down_proj)
                 for t in m.packed().tensors.values())
    router = block.router.weight.numel() * 2
    with torch.no_grad():
        unique = sum(route_topk_reference(block._router_logits(x)[0], TOP_K)[1].unique().numel() for x in xs) / len(xs)
    return unique * per_expert + shared + router + 4 * xs[0].numel() * 2


def run(args: argparse.Namespace) -> None:
    device = torch.device("cuda")
    bw = copy_bandwidth_for(device)
    block, norm = build_block(device)
    for n in args.tokens:
        xs = [torch.randn(n, H, device=device, dtype=torch.bfloat16) for _ in range(ROUTINGS)]
        residuals = [torch.randn(n, H, device=device, dtype=torch.bfloat16) for _ in range(ROUTINGS)]
        nbytes = block_bytes(block, xs)
        calls = [0]

        def step() -> tuple[torch.Tensor, torch.Tensor]:
            r = calls[0] % ROUTINGS
            calls[0] += 1
            return block.forward_then_norm(xs[r], norm, residuals[r])

        with torch.no_grad():
            ms = bench_graph_ms(step, inner=2 * ROUTINGS)  # its first, eager call tunes the keys
        label = f"35b-a3b int4-g64 + int8-g64 shared T={n} base" + (f" {args.label}" if args.label else "")
        record("moe_block", label, ms, achieved=nbytes / ms / 1e9, limit=bw, unit="TB/s", path="base",
               bytes_moved=int(nbytes))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 8])
    parser.add_argument("--label", default="", help="words added to the records' labels (a switch set in the "
                        "environment, e.g. NINFER_MOE_DOWN_EARLY=1)")
    run(parser.parse_args(argv))


if __name__ == "__main__":
    main()
