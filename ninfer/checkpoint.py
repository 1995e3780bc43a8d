"""Find a checkpoint and stream its safetensors into a model (reference §12).

Checkpoint quirks live here and only here: the ``model.language_model.`` / ``model.`` key
prefixes, MoE experts stored per expert (stacked on the fly into ``[E, ...]``, float weights or
the packed tensors of pre-quantized checkpoints), projections the model fuses (the checkpoint's
``mlp.gate_proj`` and ``mlp.up_proj`` fill rows ``[0, I)`` and ``[I, 2I)`` of ``mlp.gate_up_proj``;
a stored fused tensor loads as well: :func:`fused_parts`), optional ``mtp.*`` and ``model.visual.*``
components. Tensors go straight from the file to their final device and dtype one at a time, so the
weights never exist twice in full.
"""
from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from tqdm.auto import tqdm


class CheckpointError(ValueError):
    """A checkpoint that cannot be found or does not match its config; the message says which tensor or file."""


# Tensors kept in fp32 whatever the model dtype (decay parameters of the DeltaNet gates).
FP32_PARAMS = re.compile(r"\.(A_log|dt_bias)$")
# A float ``weight``, or a packed field of a quantized one (names as ninfer.quant.imports translates them).
_PER_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.(weight|qweight|scales|global_scale)$")
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "tokenizer*"]


def resolve_model_path(model: str | os.PathLike[str]) -> Path:
    """A local checkpoint directory, or a Hub id resolved through huggingface_hub (cache and offline mode honoured)."""
    path = Path(model).expanduser()
    if path.exists():
        if not path.is_dir():
            raise CheckpointError(f"{path} is a file; pass the checkpoint directory that holds config.json")
        return path
    name = str(model)
    if name.count("/") != 1 or name.startswith(("/", ".", "~")):
        raise CheckpointError(f"{name!r} is neither a local directory nor a Hugging Face Hub id (org/name)")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id=name, allow_patterns=_HUB_PATTERNS))
    except Exception as err:  # huggingface_hub raises a family of offline/not-found/HTTP errors
        raise CheckpointError(
            f"model {name!r} is not a local directory, is not in the Hugging Face cache, and could not be "
            f"downloaded ({type(err).__name__}: {err})"
        ) from None


def checkpoint_files(model_dir: Path) -> dict[str, Path]:
    """Map every tensor name to the safetensors file holding it."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = {name: model_dir / shard for name, shard in weight_map.items()}
        missing = sorted({str(p.name) for p in files.values() if not p.is_file()})
        if missing:
            raise CheckpointError(f"{index.name} lists shards that are missing from {model_dir}: {missing}")
        return files
    shards = sorted(model_dir.glob("*.safetensors"))
    if not shards:
        raise CheckpointError(f"no *.safetensors files in {model_dir}")
    files = {}
    for shard in shards:
        with safe_open(shard, framework="pt") as f:
            files.update({name: shard for name in f.keys()})
    return files


@dataclass
class LoadReport:
    """What a load found besides the text model's own tensors."""

    # ``mtp.*`` without the prefix, as stored; ``ninfer.load`` empties it once ``spec="mtp"`` built the head, and
    # otherwise keeps it in host memory
    mtp: dict[str, torch.Tensor] = field(default_factory=dict)
    vision_keys: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class RowSlice:
    """Where one checkpoint projection lives inside a fused one: rows ``[start, stop)`` of ``module``."""

    module: str
    start: int
    stop: int


def fused_parts(model: nn.Module, prefix: str = "") -> dict[str, RowSlice]:
    """Checkpoint projection name (``layers.0.mlp.gate_proj``) -> its rows in the fused module holding it,
    for every module of ``model`` that declares ``fused_rows`` (see ``ninfer.models.layers``)."""
    out = {}
    for owner_name, owner in model.named_modules(prefix=prefix.rstrip(".")):
        head = f"{owner_name}." if owner_name else ""
        for fused, parts in getattr(owner, "fused_rows", {}).items():
            start = 0
            for part, rows in parts:
                out[head + part] = RowSlice(head + fused, start, start + rows)
                start += rows
    return out


def canonical_name(key: str) -> tuple[str, str]:
    """``(component, name)``: component is ``text``, ``mtp`` or ``vision``; name drops the layout prefix."""
    if key.startswith("mtp."):
        return "mtp", key[len("mtp."):]
    if key.startswith(("model.visual.", "visual.")):
        return "vision", key.split("visual.", 1)[1]
    for prefix in ("model.language_model.", "language_model.model.", "language_model.", "model."):
        if key.startswith(prefix):
            return "text", key[len(prefix):]
    return "text", key


def materialize(model: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """Give every parameter of a meta-device model uninitialised storage on ``device`` (fp32 where pinned)."""
    for module_name, module in model.named_modules():
        keep = getattr(module, "keep_dtype", ())  # quantized weights declare their packed dtypes
        for name, param in list(module.named_parameters(recurse=False)):
            full = f"{module_name}.{name}" if module_name else name
            target = param.dtype if name in keep else torch.float32 if FP32_PARAMS.search(full) else dtype
            setattr(module, name, nn.Parameter(torch.empty(param.shape, dtype=target, device=device),
                                               requires_grad=False))


def tensor_bytes(files: dict[str, Path]) -> int:
    """Stored bytes of the named tensors, from the safetensors headers: what the load progress bar counts
    (the shards' sizes would also count their headers and the tensors that are skipped)."""
    by_file: dict[Path, list[str]] = {}
    for name, path in files.items():
        by_file.setdefault(path, []).append(name)
    total = 0
    for path, names in by_file.items():
        with open(path, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        for name in names:
            begin, end = header.get(name, {}).get("data_offsets", (0, 0))
            total += end - begin
    return total


def _iter_tensors(files: dict[str, Path], device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    by_file: dict[Path, list[str]] = {}
    for name, path in files.items():
        by_file.setdefault(path, []).append(name)
    load_device = str(device) if device.type in ("cpu", "cuda") else "cpu"
    for path, names in by_file.items():
        with safe_open(path, framework="pt", device=load_device) as f:
            available = set(f.keys())
            for name in names:
                if name not in available:
                    raise CheckpointError(f"tensor {name} is listed in the index but absent from {path.name}")
                yield name, f.get_tensor(name)


def _expert_slice(params: dict[str, nn.Parameter], stacks: dict[str, nn.Module], stacked: str, expert: int,
                  proj: str, part: str) -> torch.Tensor:
    """The view of a stacked expert parameter that one per-expert tensor fills (gate rows first, then up).

    Float stacks are 3-D parameters; a quantized stack is a module whose ``rows_view`` knows where
    each packed field keeps a row range (and refuses ranges that split a shared scale block).
    """
    owner = f"{stacked}.{'down' if proj == 'down' else 'gate_up'}_proj"
    if part == "weight":
        rows = params[owner][expert]
        half = rows.shape[0] // 2
        return rows if proj == "down" else rows[:half] if proj == "gate" else rows[half:]
    module = stacks[owner]
    n = module.shape[-2]
    start, stop = (0, n) if proj == "down" else (0, n // 2) if proj == "gate" else (n // 2, n)
    try:
        return module.rows_view(part, start, stop, index=expert)
    except ValueError as err:
        raise CheckpointError(f"per-expert {proj}_proj tensors of {stacked} cannot be stacked: {err}") from None


def load_weights(
    model: nn.Module, model_dir: Path, device: torch.device, *, tied_lm_head: bool,
    progress: bool = True, translate: Callable[[str, torch.Tensor], list[tuple[str, torch.Tensor]]] | None = None,
) -> LoadReport:
    """Copy every checkpoint tensor into ``model`` (already materialised); raise on missing or misshapen ones.

    ``translate`` maps a checkpoint tensor to the ``(key, tensor)`` pairs it stands for (pre-quantized
    checkpoints in public layouts rename and rescale their packed tensors this way).
    """
    files = checkpoint_files(model_dir)
    report = LoadReport()
    # Vision weights are not read at all here: the vision tower loads them when vision is enabled.
    report.vision_keys = sorted(k for k in files if canonical_name(k)[0] == "vision")
    files = {k: p for k, p in files.items() if canonical_name(k)[0] != "vision"}
    total = tensor_bytes(files)
    bar = tqdm(total=total, unit="B", unit_scale=True, desc="loading weights", disable=not progress or None)

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for raw_key, raw in _iter_tensors(files, device):
            bar.update(raw.numel() * raw.element_size())
            yield from (translate(raw_key, raw) if translate else [(raw_key, raw)])

    fill_module(model, tensors(), report=report, tied_lm_head=tied_lm_head, source=f"checkpoint {model_dir}")
    bar.close()
    return report


def fill_module(model: nn.Module, tensors: Iterable[tuple[str, torch.Tensor]], *, report: LoadReport | None = None,
                tied_lm_head: bool = False, source: str = "the checkpoint") -> None:
    """Copy ``(key, tensor)`` pairs into ``model`` (materialised; quantized weights already installed): a
    parameter, rows of a fused projection, or a slice of stacked experts. ``mtp.*`` keys go to
    ``report.mtp`` as stored. Raises :class:`CheckpointError` on an unexpected, misshapen or missing tensor."""
    params = dict(model.named_parameters())
    stacks = {name: m for name, m in model.named_modules() if hasattr(m, "rows_view")}  # quantized weights
    parts = fused_parts(model)
    report = report if report is not None else LoadReport()
    filled: set[str] = set()
    expert_parts: dict[tuple[str, str], int] = {}  # (stacked experts, field) -> per-expert tensors placed
    for key, tensor in tensors:
        _place(key, tensor, params, stacks, parts, filled, expert_parts, report, tied_lm_head)
    for (stacked, part), count in expert_parts.items():
        suffix = "" if part == "weight" else f".{part}"
        expected = 3 * params[f"{stacked}.down_proj{suffix}"].shape[0]
        if count != expected:
            raise CheckpointError(f"{stacked}: found {count} per-expert {part} tensors, expected {expected}")
        filled.update({f"{stacked}.gate_up_proj{suffix}", f"{stacked}.down_proj{suffix}"})
    missing = _missing(params, parts, filled)
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise CheckpointError(f"{source} is missing {len(missing)} tensors: {shown}")


def _missing(params: dict[str, nn.Parameter], parts: dict[str, RowSlice], filled: set[str]) -> list[str]:
    """The checkpoint tensors that no loaded tensor filled: a fused parameter is filled by itself or by
    all its parts (the same field of each)."""
    by_module: dict[str, list[str]] = {}
    for part, where in parts.items():
        by_module.setdefault(where.module, []).append(part)
    missing = []
    for name in params:
        module, _, field_name = name.rpartition(".")
        if name in filled:
            continue
        if module not in by_module:
            missing.append(name)
        else:
            missing += [n for part in by_module[module] if (n := f"{part}.{field_name}") not in filled]
    return sorted(missing)


def _fused_slice(key: str, base: str, field_name: str, where: RowSlice, params: dict[str, nn.Parameter],
                 stacks: dict[str, nn.Module]) -> torch.Tensor:
    """The rows of a fused parameter that checkpoint tensor ``key`` (field ``field_name`` of projection ``base``)
    fills: a row slice of a float weight, or the part of each packed tensor holding those rows."""
    target = f"{where.module}.{field_name}"
    if target not in params:
        raise CheckpointError(f"unexpected tensor {key}: {base} is part of {where.module}, which holds "
                              f"{sorted(n.rpartition('.')[2] for n in params if n.startswith(where.module + '.'))}")
    if where.module not in stacks:
        return params[target].data[where.start:where.stop]
    try:
        return stacks[where.module].rows_view(field_name, where.start, where.stop)
    except ValueError as err:
        raise CheckpointError(f"tensor {key} cannot fill rows [{where.start}, {where.stop}) of the fused "
                              f"{where.module}: {err}") from None


def _place(key: str, tensor: torch.Tensor, params: dict[str, nn.Parameter], stacks: dict[str, nn.Module],
           parts: dict[str, RowSlice], filled: set[str], expert_parts: dict[tuple[str, str], int],
           report: LoadReport, tied_lm_head: bool) -> None:
    """Put one checkpoint tensor where it belongs: a parameter, rows of a fused projection, a slice of
    stacked experts, or the report."""
    component, name = canonical_name(key)
    if component == "mtp":
        report.mtp[name] = tensor  # as stored: packed fields of a quantized head keep their dtypes
        return
    if name == "lm_head.weight" and tied_lm_head:
        return  # tied models use the embedding; a stored copy of the head is redundant
    if match := _PER_EXPERT.match(name):
        stacked, expert, proj, part = match.group(1), int(match.group(2)), match.group(3), match.group(4)
        down = f"{stacked}.down_proj" + ("" if part == "weight" else f".{part}")
        if down not in params:
            what = "no experts" if f"{stacked}.down_proj" not in stacks | params else "experts in another format"
            raise CheckpointError(f"unexpected tensor {key}: the config describes {what} there")
        if expert >= params[down].shape[0]:
            raise CheckpointError(f"tensor {key}: expert {expert} is beyond num_experts in config.json")
        _copy(key, _expert_slice(params, stacks, stacked, expert, proj, part), tensor)
        expert_parts[(stacked, part)] = expert_parts.get((stacked, part), 0) + 1
        return
    base, _, field_name = name.rpartition(".")
    if base in parts:
        if name in filled:
            raise CheckpointError(f"tensor {key} appears twice in the checkpoint")
        _copy(key, _fused_slice(key, base, field_name, parts[base], params, stacks), tensor)
        filled.add(name)
        return
    if name not in params:
        raise CheckpointError(f"unexpected tensor {key} (no parameter {name!r} in a model built from config.json)")
    _copy(key, params[name].data, tensor)
    filled.add(name)


def _copy(key: str, target: torch.Tensor, tensor: torch.Tensor) -> None:
    if tuple(tensor.shape) != tuple(target.shape):
        raise CheckpointError(
            f"tensor {key} has shape {list(tensor.shape)} but config.json implies {list(target.shape)}"
        )
    target.copy_(tensor)
