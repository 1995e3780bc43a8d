"""The memory plan reserves the quantized prefill path's dequantization buffer."""
from __future__ import annotations

import torch
from tiny_checkpoints import text_config_kwargs
from torch import nn

from ninfer.config import parse_config
from ninfer.quant.linear import QuantLinear
from ninfer.runtime.engine import EngineConfig
from ninfer.runtime.memory import dequant_workspace_bytes, plan_memory


def test_dequant_workspace_is_the_largest_eligible_quantized_linear() -> None:
    model = nn.ModuleDict({
        "gate_up": QuantLinear(5120, 34816, "int4-g64", device="meta"),
        "down": QuantLinear(17408, 5120, "nvfp4", device="meta"),
        "lm_head": QuantLinear(5120, 248320, "fp8", device="meta"),  # too large for the path: not counted
        "plain": nn.Linear(8, 8, bias=False, device="meta"),
    })
    assert dequant_workspace_bytes([model, None], torch.bfloat16) == 34816 * 5120 * 2
    assert dequant_workspace_bytes([nn.Linear(8, 8)], torch.bfloat16) == 0


def test_plan_adds_the_dequant_bytes_to_the_workspace() -> None:
    cfg = parse_config({**text_config_kwargs(), "model_type": "qwen3_5_text"})
    engine = EngineConfig(kv_capacity=256)
    base = plan_memory(cfg, engine, torch.device("cpu"), torch.float32)
    plan = plan_memory(cfg, engine, torch.device("cpu"), torch.float32, dequant_bytes=12345)
    assert plan.workspace_bytes == base.workspace_bytes + 12345
    assert plan.num_pages == base.num_pages


def test_the_prompt_chunk_graph_adds_its_activations_to_the_workspace(monkeypatch) -> None:
    """With a prompt-chunk graph (``NINFER_CHUNK_GRAPHS=1``) the workspace also holds a chunk of the while-decoding budget (the graph's
    pool keeps it): as much as a ``prefill_chunk`` that much longer would."""
    cfg = parse_config({**text_config_kwargs(), "model_type": "qwen3_5_text"})
    engine = EngineConfig(kv_capacity=256, prefill_chunk=1024, prefill_tokens_while_decoding=256)
    longer = EngineConfig(kv_capacity=256, prefill_chunk=1280, prefill_tokens_while_decoding=256)
    monkeypatch.setenv("NINFER_CHUNK_GRAPHS", "0")
    base = plan_memory(cfg, engine, torch.device("cpu"), torch.float32).workspace_bytes
    monkeypatch.setenv("NINFER_CHUNK_GRAPHS", "1")
    assert plan_memory(cfg, engine, torch.device("cpu"), torch.float32).workspace_bytes > base
    monkeypatch.setenv("NINFER_CHUNK_GRAPHS", "0")
    with_graph = plan_memory(cfg, longer, torch.device("cpu"), torch.float32).workspace_bytes
    monkeypatch.setenv("NINFER_CHUNK_GRAPHS", "1")
    assert plan_memory(cfg, engine, torch.device("cpu"), torch.float32).workspace_bytes == with_graph
