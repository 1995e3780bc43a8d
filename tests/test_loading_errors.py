"""Bad checkpoints and bad arguments fail with messages that name the problem."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import ninfer
from ninfer.checkpoint import CheckpointError
from ninfer.config import ConfigError, parse_config
from tiny_checkpoints import TinyCheckpoint


def _copy(ckpt: TinyCheckpoint, tmp_path: Path) -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(ckpt.path, dst)
    return dst


def _edit_tensors(path: Path, edit) -> None:
    file = next(path.glob("*.safetensors"))
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file)


def test_missing_directory_or_config(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="neither a local directory nor a Hugging Face Hub id"):
        ninfer.load(tmp_path / "nope" / "deeper", device="cpu")
    with pytest.raises(ConfigError, match="config.json"):
        ninfer.load(tmp_path, device="cpu")


def test_hub_id_absent_offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(CheckpointError, match="not in the Hugging Face cache"):
        ninfer.load("nobody/no-such-model", device="cpu")


def test_unknown_model_type_names_it_and_the_supported_ones() -> None:
    with pytest.raises(ConfigError, match=r"'llama'.*qwen3_5"):
        parse_config({"model_type": "llama"})


def test_inconsistent_layer_types() -> None:
    with pytest.raises(ConfigError, match="layer_types has 2 entries"):
        parse_config({"model_type": "qwen3_5_text", "num_hidden_layers": 3, "intermediate_size": 8,
                      "layer_types": ["linear_attention", "full_attention"]})


def test_wrong_tensor_shape(dense_ckpt: TinyCheckpoint, tmp_path: Path) -> None:
    path = _copy(dense_ckpt, tmp_path)
    _edit_tensors(path, lambda t: t.update({"model.norm.weight": torch.zeros(65)}))
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight has shape \[65\].*\[64\]"):
        ninfer.load(path, device="cpu", progress=False)


def test_missing_tensor(dense_ckpt: TinyCheckpoint, tmp_path: Path) -> None:
    path = _copy(dense_ckpt, tmp_path)
    _edit_tensors(path, lambda t: t.pop("model.layers.1.linear_attn.A_log"))
    with pytest.raises(CheckpointError, match=r"missing 1 tensors: layers\.1\.linear_attn\.A_log"):
        ninfer.load(path, device="cpu", progress=False)


def test_unexpected_tensor(dense_ckpt: TinyCheckpoint, tmp_path: Path) -> None:
    path = _copy(dense_ckpt, tmp_path)
    _edit_tensors(path, lambda t: t.update({"model.layers.0.bogus.weight": torch.zeros(2)}))
    with pytest.raises(CheckpointError, match="unexpected tensor model.layers.0.bogus.weight"):
        ninfer.load(path, device="cpu", progress=False)


def test_missing_shard_and_missing_weights(dense_ckpt: TinyCheckpoint, tmp_path: Path) -> None:
    path = _copy(dense_ckpt, tmp_path)
    file = next(path.glob("*.safetensors"))
    index = {"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors"):
        ninfer.load(path, device="cpu", progress=False)
    (path / "model.safetensors.index.json").unlink()
    file.unlink()
    with pytest.raises(CheckpointError, match="no \\*.safetensors files"):
        ninfer.load(path, device="cpu", progress=False)


def test_mtp_weights_are_kept_and_vision_weights_skipped(composite_ckpt: TinyCheckpoint) -> None:
    llm = ninfer.load(composite_ckpt.path, device="cpu", progress=False)
    assert "fc.weight" in llm.load_report.mtp
    assert llm.load_report.vision_keys and all("visual" in k for k in llm.load_report.vision_keys)


def test_bad_generation_arguments(dense_ckpt: TinyCheckpoint) -> None:
    llm = ninfer.load(dense_ckpt.path, device="cpu", progress=False)
    with pytest.raises(ValueError, match="top_p"):
        llm.generate("hi", top_p=0.0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        llm.generate("hi", max_new_tokens=0)
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.generate("")
