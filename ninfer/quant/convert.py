"""``ninfer convert``: a bf16 Hugging Face checkpoint -> a quantized ninfer checkpoint directory.

The output holds the source's config, tokenizer and generation files, safetensors shards and
``ninfer.json``. Checkpoint keys keep their original prefixes, so the loader's prefix handling
applies unchanged: a quantized weight ``<key>.weight`` becomes ``<key>.qweight``, ``<key>.scales``
(and ``<key>.global_scale`` for nvfp4); per-expert MoE keys of a quantized MoE layer are stacked
into the fused layout first (``...mlp.experts.gate_up_proj.qweight``, gate rows then up rows).
Projections that the model fuses (``mlp.gate_proj`` and ``mlp.up_proj`` into ``mlp.gate_up_proj``, ...)
are written separately under their checkpoint names, each quantized on its own (the loader fills the
fused module's rows from them); the recipe must give the parts of one fused projection one format.
Tensors no rule selects are copied verbatim; ``bf16`` rules cast to bf16 (A_log and dt_bias stay
fp32). Conversion streams one tensor at a time (one MoE layer's experts at most) and quantizes on
the GPU when there is one, so memory stays far below the model's size.

``ninfer.json`` records, per quantized weight (recipe naming, ``mtp.`` prefix for MTP): format,
layout, group size, logical shape, source dtype and stored keys; every other stored key as
``copy`` or ``bf16``; the recipe and the source.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm

from ninfer.checkpoint import (
    FP32_PARAMS,
    RowSlice,
    canonical_name,
    checkpoint_files,
    fused_parts,
    resolve_model_path,
)
from ninfer.config import load_config
from ninfer.quant.formats import FormatError, get_format
from ninfer.quant.imports import scan_checkpoint
from ninfer.quant.linear import module_plan
from ninfer.quant.recipe import (
    Recipe,
    RecipeError,
    list_recipes,
    load_recipe,
    resolve_plan,
)

MANIFEST = "ninfer.json"
MANIFEST_FORMAT = "ninfer-quantized-checkpoint"
_PER_EXPERT = re.compile(r"^(?P<head>.*\.mlp\.experts)\.(?P<e>\d+)\.(?P<proj>gate|up|down)_proj\.weight$")
_RESOURCES = ("*.json", "*.jinja", "*.txt", "*.model", "tokenizer*", "*.py")
_FLOAT_DTYPES = {"F32", "F16", "BF16"}

__all__ = ["MANIFEST", "convert_checkpoint", "list_recipes", "manifest_plan", "read_manifest"]


class ConvertError(ValueError):
    """A source or destination the converter cannot use; the message says why."""


def _selection_name(key: str) -> str | None:
    """The recipe name of a checkpoint key (None for vision tensors, which are always copied)."""
    component, name = canonical_name(key)
    if component == "vision":
        return None
    if match := _PER_EXPERT.match(name):
        name = f"{match['head']}.{'down' if match['proj'] == 'down' else 'gate_up'}_proj"
    base = name.removesuffix(".weight")
    return f"mtp.{base}" if component == "mtp" else base


def _headers(files: dict[str, Path]) -> dict[str, tuple[tuple[int, ...], str]]:
    """Shape and safetensors dtype name of every tensor, read without loading data."""
    out = {}
    for path in sorted(set(files.values())):
        with safe_open(path, framework="pt") as f:
            for key in f.keys():
                if files.get(key) == path:
                    sl = f.get_slice(key)
                    out[key] = (tuple(sl.get_shape()), sl.get_dtype())
    return out


def _shapes(headers: dict[str, tuple[tuple[int, ...], str]]) -> dict[str, tuple[int, ...]]:
    """Recipe names -> logical shapes; per-expert tensors counted into their stacked ``[E, ...]`` shape."""
    shapes: dict[str, tuple[int, ...]] = {}
    experts: dict[str, dict[str, Any]] = {}
    for key, (shape, _) in headers.items():
        name = _selection_name(key)
        if name is None:
            continue
        match = _PER_EXPERT.match(canonical_name(key)[1])
        if not match:
            shapes[name] = shape
            continue
        info = experts.setdefault(name, {"experts": set(), "shape": shape, "rows": 0})
        info["experts"].add(int(match["e"]))
        info["rows"] = shape[0] * (2 if match["proj"] != "down" else 1)
    for name, info in experts.items():
        shapes[name] = (len(info["experts"]), info["rows"], info["shape"][1])
    return shapes


class _ShardWriter:
    """Buffers output tensors and writes ``model-XXXXX-of-YYYYY.safetensors`` shards plus the index."""

    def __init__(self, out: Path, max_bytes: int) -> None:
        self.out, self.max_bytes = out, max_bytes
        self.buffer: dict[str, torch.Tensor] = {}
        self.size = 0
        self.shards: list[list[str]] = []
        self.written: set[str] = set()
        self.total = 0

    def add(self, key: str, tensor: torch.Tensor) -> None:
        if key in self.written:
            raise ConvertError(f"output key {key} would be written twice")
        self.written.add(key)
        self.buffer[key] = tensor.detach().to("cpu").contiguous()
        nbytes = tensor.numel() * tensor.element_size()
        self.size += nbytes
        self.total += nbytes
        if self.size >= self.max_bytes:
            self.flush()

    def flush(self) -> None:
        if self.buffer:
            save_file(self.buffer, str(self.out / f"shard-{len(self.shards):05d}.tmp"), metadata={"format": "pt"})
            self.shards.append(list(self.buffer))
            self.buffer, self.size = {}, 0

    def close(self) -> dict[str, str]:
        self.flush()
        weight_map = {}
        for i, keys in enumerate(self.shards):
            name = f"model-{i + 1:05d}-of-{len(self.shards):05d}.safetensors"
            os.replace(self.out / f"shard-{i:05d}.tmp", self.out / name)
            weight_map.update({key: name for key in keys})
        index = {"metadata": {"total_size": self.total}, "weight_map": dict(sorted(weight_map.items()))}
        (self.out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        return weight_map


def convert_checkpoint(src: str | os.PathLike[str], recipe: str | os.PathLike[str] | Recipe,
                       out: str | os.PathLike[str], *, device: str | torch.device | None = None, progress: bool = True,
                       max_shard_bytes: int = 4 << 30) -> Path:
    """Quantize checkpoint ``src`` (directory or Hub id) with ``recipe`` (name, path or Recipe) into ``out``."""
    src_dir = resolve_model_path(src)
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConvertError(f"{out} already exists and is not an empty directory; convert never overwrites")
    rec = recipe if isinstance(recipe, Recipe) else load_recipe(recipe)
    files = checkpoint_files(src_dir)
    if (src_dir / MANIFEST).is_file() or scan_checkpoint(files):
        raise ConvertError(f"{src_dir} is already quantized: load it directly instead of converting it")
    headers = _headers(files)
    shapes = _shapes(headers)
    plan = resolve_plan(rec, shapes)
    try:  # the parts of a fused projection load into one module: one format, no scale block across parts
        module_plan(plan, _model_fused_parts(src_dir))
    except FormatError as err:
        raise RecipeError(f"recipe {rec.name!r}: {err}") from None
    for key, (_, dtype) in headers.items():
        name = _selection_name(key)
        if name in plan and plan[name] != "bf16" and dtype not in _FLOAT_DTYPES:
            raise ConvertError(f"{key} is stored as {dtype}, not as floats: the source is already quantized "
                               f"(load it directly instead of converting it)")
    dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    out.mkdir(parents=True, exist_ok=True)
    writer = _ShardWriter(out, max_shard_bytes)
    weights: dict[str, dict[str, Any]] = {}
    passthrough: dict[str, str] = {}
    pending: dict[str, dict[tuple[int, str], torch.Tensor]] = {}
    total = sum(os.path.getsize(p) for p in set(files.values()))
    bar = tqdm(total=total, unit="B", unit_scale=True, desc="converting", disable=not progress or None)
    try:
        for key, tensor in _stream(files):
            bar.update(tensor.numel() * tensor.element_size())
            name = _selection_name(key)
            fmt = plan.get(name) if name is not None else None
            match = _PER_EXPERT.match(canonical_name(key)[1])
            if match and fmt not in (None, "bf16"):
                parts = pending.setdefault(name, {})
                parts[(int(match["e"]), match["proj"])] = tensor
                if len(parts) == shapes[name][0] * (1 if match["proj"] == "down" else 2):
                    stacked = _stack_experts(pending.pop(name), shapes[name][0])
                    head = key[: key.index(".mlp.experts.")] + ".mlp.experts." + name.rsplit(".", 1)[1]
                    weights[name] = _write_quantized(writer, head, stacked, fmt, dev)
                continue
            if fmt is None or fmt == "bf16":
                cast = fmt == "bf16" and tensor.is_floating_point() and not FP32_PARAMS.search(key)
                writer.add(key, tensor.to(torch.bfloat16) if cast else tensor)
                passthrough[key] = "bf16" if cast else "copy"
            else:
                weights[name] = _write_quantized(writer, key.removesuffix(".weight"), tensor, fmt, dev)
        if pending:
            raise ConvertError(f"incomplete per-expert tensors for {sorted(pending)}")
        writer.close()
    except BaseException:
        bar.close()
        shutil.rmtree(out, ignore_errors=True)
        raise
    bar.close()
    _copy_resources(src_dir, out)
    manifest = {"format": MANIFEST_FORMAT, "version": 1, "source": str(src), "source_dir": str(src_dir),
                "recipe": rec.to_json(), "weights": weights, "passthrough": passthrough,
                "bytes": {"source": total, "output": writer.total}}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return out


def _model_fused_parts(src_dir: Path) -> dict[str, RowSlice]:
    """The fused projections of the text model and the MTP head that ``src_dir``'s config describes, named
    as recipes name their parts (``mtp.`` prefix for the head)."""
    from ninfer.models.mtp import MTPHead
    from ninfer.models.qwen3_5 import Qwen3_5TextModel

    with torch.device("meta"):
        model = Qwen3_5TextModel(load_config(src_dir))
        head = MTPHead(model.config, model)
    return fused_parts(model) | fused_parts(head, prefix="mtp.")


def _stream(files: dict[str, Path]):
    by_file: dict[Path, list[str]] = {}
    for key, path in files.items():
        by_file.setdefault(path, []).append(key)
    for path in sorted(by_file):
        with safe_open(path, framework="pt") as f:
            for key in sorted(by_file[path]):
                yield key, f.get_tensor(key)


def _stack_experts(parts: dict[tuple[int, str], torch.Tensor], num_experts: int) -> torch.Tensor:
    if any(proj == "down" for _, proj in parts):
        return torch.stack([parts[(e, "down")] for e in range(num_experts)])
    return torch.stack([torch.cat([parts[(e, "gate")], parts[(e, "up")]]) for e in range(num_experts)])


def _write_quantized(writer: _ShardWriter, head: str, weight: torch.Tensor, fmt_name: str,
                     device: torch.device) -> dict[str, Any]:
    fmt = get_format(fmt_name)
    packed = fmt.quantize(weight.to(device))
    keys = {field: f"{head}.{field}" for field in packed}
    for field, tensor in packed.items():
        writer.add(keys[field], tensor)
    return {"format": fmt.name, "layout": fmt.layout, "group_size": fmt.group_size, "shape": list(weight.shape),
            "source_dtype": str(weight.dtype).removeprefix("torch."), "tensors": keys}


def _copy_resources(src: Path, out: Path) -> None:
    for pattern in _RESOURCES:
        for path in src.glob(pattern):
            if path.is_file() and path.name != "model.safetensors.index.json" and not (out / path.name).exists():
                shutil.copy2(path, out / path.name)


def read_manifest(model_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The parsed ``ninfer.json`` of a converted checkpoint, or None for any other checkpoint."""
    path = Path(model_dir) / MANIFEST
    if not path.is_file():
        return None
    manifest = json.loads(path.read_text())
    if manifest.get("format") != MANIFEST_FORMAT:
        raise RecipeError(f"{path} is not a ninfer quantized-checkpoint manifest")
    return manifest


def manifest_plan(manifest: dict[str, Any], component: str = "text") -> dict[str, str]:
    """Weight name -> format of the quantized weights of one component (``text`` or ``mtp``), ready for
    :func:`ninfer.quant.linear.prepare_model_` (MTP names lose their ``mtp.`` prefix)."""
    plan = {}
    for name, entry in manifest["weights"].items():
        is_mtp = name.startswith("mtp.")
        if component == "mtp" and is_mtp:
            plan[name.removeprefix("mtp.")] = entry["format"]
        elif component == "text" and not is_mtp:
            plan[name] = entry["format"]
    return plan
