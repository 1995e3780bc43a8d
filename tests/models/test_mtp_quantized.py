"""A quantized MTP head: a recipe's ``mtp.*`` rules at load time, the packed head of a converted checkpoint and
that of an imported (ModelOpt NVFP4) one. Oracles: the head quantized at load equals the converted one tensor for
tensor, each packed weight equals the format's quantizer (or the file's codes) on the checkpoint's weight, and
speculative greedy decoding over the quantized head equals plain greedy decoding."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import ninfer
from ninfer.checkpoint import CheckpointError
from ninfer.quant.convert import convert_checkpoint, read_manifest
from ninfer.quant.formats import quantize
from ninfer.quant.linear import QuantLinear, QuantWeight
from ninfer.runtime.sampling import SamplingParams
from tiny_checkpoints import planned_weight

GREEDY = SamplingParams(greedy=True)
PROMPTS = [[5, 17, 33, 99, 12, 7, 201, 45], list(range(20, 47))]
RECIPES = {"dense": "int4", "moe": "nvfp4"}  # the tiny MoE's 32-wide experts take 16-column groups


def _load(path: Path, **kw) -> ninfer.LLM:
    return ninfer.load(path, **(dict(device="cpu", progress=False, max_concurrency=2, max_context=256) | kw))


def _greedy(llm: ninfer.LLM) -> list[list[int]]:
    return [c.token_ids for c in llm._run([llm._request(list(p), 12, GREEDY) for p in PROMPTS])]


def _head(llm: ninfer.LLM):
    return llm.engine.spec.head


def _file_weight(ckpt_dir: Path, name: str) -> torch.Tensor:
    """MTP weight ``name`` (recipe naming, ``mtp.`` prefix) as the checkpoint stores it; stacked for experts."""
    raw = load_file(str(ckpt_dir / "model.safetensors"))
    if name in ("mtp.layers.0.mlp.experts.gate_up_proj", "mtp.layers.0.mlp.experts.down_proj"):
        num = sum(1 for k in raw if k.startswith("mtp.layers.0.mlp.experts.") and k.endswith(".down_proj.weight"))
        per = "mtp.layers.0.mlp.experts.{}.{}_proj.weight"
        if name.endswith("down_proj"):
            return torch.stack([raw[per.format(e, "down")] for e in range(num)])
        return torch.stack([torch.cat([raw[per.format(e, "gate")], raw[per.format(e, "up")]]) for e in range(num)])
    return raw[f"{name}.weight"]


@pytest.fixture(scope="module", params=["dense", "moe"])
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    ckpt = request.getfixturevalue("composite_ckpt" if request.param == "dense" else "composite_moe_ckpt")
    recipe = RECIPES[request.param]
    converted = convert_checkpoint(ckpt.path, recipe, tmp_path_factory.mktemp("mtpq") / "q", progress=False)
    return ckpt, recipe, converted


def test_a_recipe_quantizes_the_head_like_the_converter(case) -> None:
    ckpt, recipe, converted = case
    llm = _load(ckpt.path, quantize=recipe, spec="mtp")
    at_load = _head(llm)
    assert not llm.load_report.mtp  # the float tensors the recipe quantized are not kept beside the head
    planned = {n.removeprefix("mtp."): e["format"] for n, e in read_manifest(converted)["weights"].items()
               if n.startswith("mtp.")}
    assert any(".self_attn." in n for n in planned) and any(".mlp." in n for n in planned)
    assert "fc" not in planned and not isinstance(at_load.fc, QuantWeight)  # fc, norms and router stay float
    for name, fmt in planned.items():
        module, rows = planned_weight(at_load, name)
        assert module.format.name == fmt, name
        want = quantize(_file_weight(ckpt.path, f"mtp.{name}").float(), fmt).dequantize()
        got = module.dequantize(torch.float32)[..., rows, :]
        assert torch.equal(got, want), name
    from_file = _head(_load(converted, spec="mtp")).state_dict()
    mine = at_load.state_dict()
    assert from_file.keys() == mine.keys()
    for key, tensor in mine.items():
        assert torch.equal(from_file[key], tensor), key


def test_greedy_over_a_quantized_head_equals_plain(case) -> None:
    ckpt, recipe, converted = case
    want = _greedy(_load(converted))
    assert _greedy(_load(converted, spec="mtp", draft_tokens=3)) == want
    assert _greedy(_load(ckpt.path, quantize=recipe, spec="mtp", draft_tokens=2)) == _greedy(
        _load(ckpt.path, quantize=recipe))


def _modelopt_mlp(tmp_path: Path, ckpt_dir: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """The checkpoint with its MTP MLP stored as ModelOpt NVFP4 (random codes and scales)."""
    out = tmp_path / "modelopt"
    shutil.copytree(ckpt_dir, out)
    raw = load_file(str(out / "model.safetensors"))
    g = torch.Generator().manual_seed(3)
    codes = {}
    for proj in ("gate", "up", "down"):
        base = f"mtp.layers.0.mlp.{proj}_proj"
        n, k = raw.pop(f"{base}.weight").shape
        codes[proj] = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8)
        raw[f"{base}.weight"] = codes[proj]
        raw[f"{base}.weight_scale"] = (torch.rand(n, k // 16, generator=g) * 0.5 + 0.1).to(torch.float8_e4m3fn)
        raw[f"{base}.weight_scale_2"] = torch.tensor(0.02)
        raw[f"{base}.input_scale"] = torch.tensor(1.0)
    save_file(raw, str(out / "model.safetensors"))
    return out, codes


def test_an_imported_packed_head_loads_byte_for_byte(composite_ckpt, tmp_path: Path) -> None:
    path, codes = _modelopt_mlp(tmp_path, composite_ckpt.path)
    llm = _load(path, spec="mtp", draft_tokens=2)
    mlp = _head(llm).layers[0].mlp
    assert isinstance(mlp.gate_up_proj, QuantLinear) and mlp.gate_up_proj.format.name == "nvfp4"
    half = codes["gate"].shape[0]
    assert torch.equal(mlp.gate_up_proj.qweight[:half], codes["gate"])
    assert torch.equal(mlp.gate_up_proj.qweight[half:], codes["up"])
    assert torch.equal(mlp.down_proj.qweight, codes["down"])
    assert _greedy(llm) == _greedy(_load(path))


def test_a_packed_head_with_a_missing_field_names_it(composite_ckpt, tmp_path: Path) -> None:
    path, _ = _modelopt_mlp(tmp_path, composite_ckpt.path)
    raw = load_file(str(path / "model.safetensors"))
    del raw["mtp.layers.0.mlp.down_proj.weight_scale"]
    save_file(raw, str(path / "model.safetensors"))
    with pytest.raises((CheckpointError, ValueError), match="down_proj"):
        _load(path, spec="mtp")
