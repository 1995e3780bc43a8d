"""Tuning choices shipped inside the package, per GPU model: a first start on a known GPU times nothing.

Issue 22: a cold start of the 27B engine spent minutes compiling and benchmarking tuning candidates. The
user's tune cache (:mod:`ninfer.kernels.tune_cache`) helps only from the second start, and only while the
software stack and the kernels' sources stay the same. As vLLM ships its per-GPU fused-MoE configs, ninfer
ships the choices measured on the GPUs it is developed on: one JSON file per GPU model in
``ninfer/kernels/tuned/``, named ``<gpu>-sm<cc>.json`` as :func:`tune_cache.gpu_stem` names it
(``nvidia-h200-sm90.json``) and keyed by nothing else. A choice measured with another Triton or an older
kernel source is still a good first guess, and it is only taken while it is one of the configs the code
offers now (a stale entry is skipped, never launched)::

    {"meta": {"gpu": "NVIDIA H200", "capability": "9.0", "sources": [{date, versions, command, ...}, ...]},
     "tables": {"quant_gemm": {key text: config fields}, "moe_gemv": {...}, "float_gemv": {...}},
     "autotune": {"<module>.<kernel>": {key text: {"kwargs": {...}, "num_warps": 4, "num_stages": 2,
                                                   "num_ctas": 1, "maxnreg": null}}}}

Readers: the runtime tuners (:meth:`ninfer.kernels.tuning.TunerState.choose`: after the process's own choice
and the user's tune cache, before timing; untunable calls take it too) and the ``triton.autotune`` kernels
(:mod:`ninfer.kernels.autotune`: a key's shipped config, when it is among the pruned configs, is taken
without benchmarking). Writers: :mod:`ninfer.kernels.shipped_export` (a process's choices, on a GPU) and
``perf/ship_tuning.py`` (merges exports into the package folder).

``NINFER_SHIPPED_TUNING=0`` turns the tables off (read per call). A missing file is no table; an unreadable or
malformed one is no table either, with one warning: a shipped table must never stop a run.
"""
from __future__ import annotations

import json
import warnings
from functools import cache
from importlib import resources
from importlib.resources.abc import Traversable
from typing import Any

import torch

from ninfer.kernels import tune_cache
from ninfer.kernels.dispatch import env_switch

ENV = "NINFER_SHIPPED_TUNING"
# the runtime tuners' tables (kernels/tuning.py)
TABLES = ("quant_gemm", "moe_gemv", "float_gemv")
# A triton.Config as JSON: what decides which kernel compiles (a pre_hook cannot be stored; no config of
# ninfer's has one). The defaults are Config's, for entries written without the optional fields.
CONFIG_DEFAULTS: dict[str, Any] = {"num_ctas": 1, "maxnreg": None}

_loaded: dict[str, dict[str, Any]] = {}  # file stem -> its document ({} when absent or broken), read once
_warned: set[str] = set()


def enabled() -> bool:
    """Whether the shipped tables are consulted (``NINFER_SHIPPED_TUNING``, read per call; ``0`` / ``off``: no)."""
    return env_switch(ENV, True)


def folder() -> Traversable:
    """The package folder of the tables (found through importlib.resources: works from a wheel too)."""
    return resources.files("ninfer.kernels").joinpath("tuned")


def gpu_identity(device: torch.device) -> tuple[str, str] | None:
    """``(GPU name, "major.minor")`` of a CUDA device, else None (CPU, interpreter, no driver)."""
    if device.type != "cuda":
        return None
    return _cuda_identity(device.index if device.index is not None else -1)


@cache
def _cuda_identity(index: int) -> tuple[str, str] | None:
    try:
        if not torch.cuda.is_available():
            return None
        device = torch.cuda.current_device() if index < 0 else index
        major, minor = torch.cuda.get_device_capability(device)
        return torch.cuda.get_device_name(device), f"{major}.{minor}"
    except (RuntimeError, AssertionError):  # no usable driver: nothing shipped applies
        return None


def table_stem(device: torch.device) -> str | None:
    """The file stem of ``device``'s GPU model (``nvidia-h200-sm90``), or None for a non-CUDA device."""
    identity = gpu_identity(device)
    return None if identity is None else tune_cache.gpu_stem(*identity)


def table(device: torch.device) -> dict[str, Any]:
    """The shipped document for ``device``'s GPU model: empty when switched off, absent or broken."""
    if not enabled():
        return {}
    stem = table_stem(device)
    if stem is None:
        return {}
    if stem not in _loaded:
        _loaded[stem] = _read(stem)
    return _loaded[stem]


def _read(stem: str) -> dict[str, Any]:
    path = folder().joinpath(f"{stem}.json")
    if not path.is_file():
        return {}
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        doc, problems = {}, [str(e)]
    else:
        problems = validate(doc)
    if problems:
        if stem not in _warned:
            _warned.add(stem)
            warnings.warn(f"ninfer: ignoring the shipped tuning table {stem}.json ({problems[0]})",
                          RuntimeWarning, stacklevel=4)
        return {}
    return doc


def lookup(name: str, key_text: str, device: torch.device) -> dict | None:
    """The fields shipped for ``key_text`` in runtime-tuner table ``name`` for ``device``'s GPU model, or None."""
    value = table(device).get("tables", {}).get(name, {}).get(key_text)
    return dict(value) if isinstance(value, dict) else None


def autotune_lookup(kernel: str, key_text: str, device: torch.device) -> dict | None:
    """The config fields shipped for ``triton.autotune`` kernel ``kernel`` (``<module>.<name>``) and key."""
    value = table(device).get("autotune", {}).get(kernel, {}).get(key_text)
    return dict(value) if isinstance(value, dict) else None


def autotune_key_text(key: tuple) -> str:
    """A ``triton.autotune`` key (the key arguments' values, then the tensor arguments' dtypes as strings,
    as ``Autotuner.run`` builds it) as deterministic JSON text."""
    return json.dumps(list(key), default=str)


def config_fields(config: Any) -> dict[str, Any]:
    """A ``triton.Config`` as the JSON fields the table stores."""
    return {"kwargs": dict(config.kwargs), "num_warps": config.num_warps, "num_stages": config.num_stages,
            "num_ctas": getattr(config, "num_ctas", 1), "maxnreg": getattr(config, "maxnreg", None)}


def matching_config(fields: dict[str, Any], configs: list) -> Any | None:
    """The config of ``configs`` that ``fields`` describe (same kwargs, warps, stages, CTAs, register cap), or
    None: a shipped choice is only ever one of the configs the kernel offers now."""
    wanted = {**CONFIG_DEFAULTS, **fields}
    wanted = {k: wanted.get(k) for k in ("kwargs", "num_warps", "num_stages", *CONFIG_DEFAULTS)}
    return next((c for c in configs if config_fields(c) == wanted), None)


def validate(doc: Any) -> list[str]:
    """What is wrong with a table document (empty: nothing). Keys must be JSON lists (the key texts of
    :func:`tune_cache.key_text` and :func:`autotune_key_text`), values objects; autotune values need
    ``kwargs`` (an object), ``num_warps`` and ``num_stages`` (integers)."""
    if not isinstance(doc, dict):
        return ["not a JSON object"]
    problems = []
    meta = doc.get("meta")
    if not isinstance(meta, dict) or not all(isinstance(meta.get(f), str) for f in ("gpu", "capability")):
        problems.append("meta needs the gpu name and capability (strings)")
    for section in ("tables", "autotune"):
        groups = doc.get(section, {})
        if not isinstance(groups, dict):
            problems.append(f"{section} is not an object")
            continue
        for group, entries in groups.items():
            if not isinstance(entries, dict):
                problems.append(f"{section}.{group} is not an object")
                continue
            for key, value in entries.items():
                where = f"{section}.{group}[{key}]"
                if not _is_key_text(key):
                    problems.append(f"{where}: the key is not a JSON list")
                elif not isinstance(value, dict):
                    problems.append(f"{where}: not an object")
                elif section == "autotune" and not (
                        isinstance(value.get("kwargs"), dict) and isinstance(value.get("num_warps"), int)
                        and isinstance(value.get("num_stages"), int)):
                    problems.append(f"{where}: needs kwargs (object), num_warps and num_stages (integers)")
    unknown = set(doc) - {"meta", "tables", "autotune"}
    if unknown:
        problems.append(f"unknown sections {sorted(unknown)}")
    return problems


def _is_key_text(text: str) -> bool:
    try:
        return isinstance(json.loads(text), list)
    except ValueError:
        return False


def merge(base: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """``new`` merged over ``base`` (two documents of one GPU model): entries of ``new`` replace those of the
    same key (the later measurement wins), the producers listed in ``meta.sources`` accumulate."""
    if base and (base["meta"]["gpu"], base["meta"]["capability"]) != (new["meta"]["gpu"], new["meta"]["capability"]):
        raise ValueError(f"cannot merge tables of {new['meta']['gpu']} (sm {new['meta']['capability']}) into "
                         f"{base['meta']['gpu']} (sm {base['meta']['capability']})")
    merged: dict[str, Any] = {"meta": dict(new["meta"]), "tables": {}, "autotune": {}}
    sources = [*base.get("meta", {}).get("sources", []), *new["meta"].get("sources", [])]
    merged["meta"]["sources"] = [s for i, s in enumerate(sources) if s not in sources[:i]]
    for section in ("tables", "autotune"):
        for doc in (base, new):
            for group, entries in doc.get(section, {}).items():
                merged[section].setdefault(group, {}).update(entries)
    return merged


def counts(doc: dict[str, Any]) -> dict[str, int]:
    """Entries per runtime-tuner table and per autotuned kernel (``autotune:<kernel>``), for reports."""
    out = {name: len(entries) for name, entries in sorted(doc.get("tables", {}).items())}
    out |= {f"autotune:{name}": len(entries) for name, entries in sorted(doc.get("autotune", {}).items())}
    return out


def forget() -> None:
    """Drop the tables read and the warnings given (tests: a fresh process)."""
    _loaded.clear()
    _warned.clear()
    _cuda_identity.cache_clear()
