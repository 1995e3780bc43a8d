"""Random-weight models at the real 27B / 35B-A3B shapes, for benchmarks (no checkpoint needed)."""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch

import ninfer
from ninfer.checkpoint import LoadReport, materialize
from ninfer.config import parse_config
from ninfer.kernels.rope import rope_inv_freq
from ninfer.llm import LLM
from ninfer.models.qwen3_5 import Qwen3_5TextModel
from ninfer.runtime.engine import EngineConfig
from ninfer.tokenizer import Tokenizer

COMMON = dict(vocab_size=248320, head_dim=256, linear_num_key_heads=16, linear_key_head_dim=128,
              linear_value_head_dim=128, linear_conv_kernel_dim=4, rms_norm_eps=1e-6, eos_token_id=248044,
              max_position_embeddings=262144, tie_word_embeddings=False,
              rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                               "mrope_section": [11, 11, 10], "mrope_interleaved": True})
SHAPES = {
    "27b": dict(model_type="qwen3_5_text", hidden_size=5120, intermediate_size=17408, num_hidden_layers=64,
                num_attention_heads=24, num_key_value_heads=4, linear_num_value_heads=48, **COMMON),
    "35b-a3b": dict(model_type="qwen3_5_moe_text", hidden_size=2048, num_hidden_layers=40, num_attention_heads=16,
                    num_key_value_heads=2, linear_num_value_heads=32, num_experts=256, num_experts_per_tok=8,
                    moe_intermediate_size=512, shared_expert_intermediate_size=512, **COMMON),
}


@torch.no_grad()
def random_model(shape: str, device: str = "cuda", dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                 num_layers: int | None = None) -> Qwen3_5TextModel:
    raw = dict(SHAPES[shape])
    if num_layers is not None:
        raw["num_hidden_layers"] = num_layers
    config = parse_config(raw)
    with torch.device("meta"):
        model = Qwen3_5TextModel(config)
    materialize(model, torch.device(device), dtype)
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("A_log"):
            p.uniform_(0.0, 2.7, generator=gen)
        elif name.endswith("dt_bias"):
            p.normal_(-3.0, 0.5, generator=gen)
        elif p.dim() == 1:
            p.normal_(0.0, 0.1, generator=gen)
        else:
            p.normal_(0.0, p.shape[-1] ** -0.5, generator=gen)
    model.register_buffer("inv_freq", rope_inv_freq(config.rotary_dim, config.rope_theta).to(device),
                          persistent=False)
    return model.eval()


def random_llm(shape: str, engine: EngineConfig, **kw) -> LLM:
    """An LLM over a random model, with the bundled tiny tokenizer (only its ids are sampled)."""
    from ninfer.default_model import build_tokenizer, write_generation_config

    model = random_model(shape, **kw)
    tmp = Path(tempfile.mkdtemp(prefix=f"ninfer-{shape}-"))
    build_tokenizer(tmp)
    write_generation_config(tmp)
    (tmp / "config.json").write_text(json.dumps(SHAPES[shape]))
    return LLM(model, Tokenizer(tmp), tmp, LoadReport(), engine)


__all__ = ["SHAPES", "random_model", "random_llm", "ninfer"]
