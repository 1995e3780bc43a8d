"""The runtime tuners' choices on disk, so that a second start on the same GPU skips the benchmarking.

``quant_gemm.tune.select_config`` and ``moe.quant_gemv.choose_config`` time every candidate on a
key's first call (minutes at the 27B/35B shapes, every start). Their choices go to one JSON file per
GPU model and software stack, as vLLM and SGLang ship per-GPU configs, under ``$NINFER_TUNE_CACHE``
(a directory; ``off`` or ``0``: no reads, no writes), else ``$XDG_CACHE_HOME/ninfer/tune``
(``~/.cache/ninfer/tune``). The file name hashes GPU name, compute capability, Triton and torch
versions and the source of the tuned kernels' modules (``TUNED_SOURCES``): a timing is only valid for
the code and compiler that produced it. I/O errors and corrupt files warn once: a cache must never stop a run.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import tempfile
import warnings
from functools import cache
from pathlib import Path

import torch
import triton

from ninfer.kernels import compile_watch

_loaded: dict[Path, dict[str, dict[str, dict]]] = {}  # file -> table -> key text -> value, read once per process
_warned: list[str] = []  # the one warning given (warn once: a broken directory would warn for every key)


def cache_dir() -> Path | None:
    """The directory of the files, or None when disabled (read per call: switchable without a reload)."""
    env = os.environ.get("NINFER_TUNE_CACHE", "").strip()
    if env.lower() in ("off", "0"):
        return None
    if env:
        return Path(env).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ninfer" / "tune"


# The modules the tuned kernels, their candidates and their launchers live in (the quantized GEMMs and
# GEMVs, the MoE expert paths, the autotune switches, the choice among timings): an edit there invalidates
# earlier timings, an edit to attention or DeltaNet kernels does not (it would throw away minutes of tuning
# at the 27B shapes).
TUNED_SOURCES = ("quant_gemm/*.py", "moe/*.py", "float_gemv.py", "dispatch.py", "tuning.py")


def source_hash(folder: Path | None = None) -> str:
    """Hash of the tuned kernels' sources (``TUNED_SOURCES`` under ``folder``, by path relative to it;
    default this package, read once)."""
    return _package_source_hash() if folder is None else _hash_sources(folder)


@cache
def _package_source_hash() -> str:
    return _hash_sources(Path(__file__).resolve().parent)


def _hash_sources(folder: Path) -> str:
    h = hashlib.sha256()
    for path in sorted({p for pattern in TUNED_SOURCES for p in folder.glob(pattern)}):
        h.update(path.relative_to(folder).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def file_parts(device: torch.device) -> dict[str, str]:
    """All a stored choice depends on besides its key (the file is per GPU model, not per device index)."""
    major, minor = torch.cuda.get_device_capability(device)
    return {"gpu": torch.cuda.get_device_name(device), "capability": f"{major}.{minor}",
            "triton": triton.__version__, "torch": torch.__version__, "kernels": source_hash()}


def key_text(key: tuple) -> str:
    """A tuner key as deterministic JSON text: dtypes by name, ``torch.device`` entries dropped."""
    return json.dumps([str(v) if isinstance(v, torch.dtype) else v for v in key if not isinstance(v, torch.device)])


def gpu_stem(gpu: str, capability: str) -> str:
    """A GPU model as a file-name stem: ``"NVIDIA H200"``, ``"9.0"`` -> ``nvidia-h200-sm90`` (this cache's
    files start with it; the shipped tables of :mod:`ninfer.kernels.shipped` are named by it)."""
    slug = re.sub(r"[^a-z0-9]+", "-", gpu.lower()).strip("-") or "gpu"
    return f"{slug}-sm{capability.replace('.', '')}"


def forget() -> None:
    """Drop what this process read or wrote and the warning given (tests: a fresh process)."""
    _loaded.clear()
    _warned.clear()


def _warn(message: str) -> None:
    if not _warned:
        _warned.append(message)
        warnings.warn(f"ninfer tune cache: {message}; tuning in memory only", RuntimeWarning, stacklevel=3)


def _location(device: torch.device) -> tuple[Path, dict[str, str]] | None:
    """The file for this GPU model and software stack (None: disabled) and what its name hashes."""
    root = cache_dir()
    if root is None:
        return None
    parts = file_parts(device)
    digest = hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]
    # the GPU part is for people; the digest decides
    return root / f"{gpu_stem(parts['gpu'], parts['capability'])}-{digest}.json", parts


def _read(path: Path) -> dict[str, dict[str, dict]]:
    """The tables of ``path``: empty if it does not exist, or (warning) if it is unreadable or corrupt."""
    try:
        tables = json.loads(path.read_text()).get("tables")
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, AttributeError) as e:  # AttributeError: JSON that is not an object
        tables = e
    if not isinstance(tables, dict) or not all(isinstance(t, dict) for t in tables.values()):
        _warn(f"ignoring {path} ({tables if isinstance(tables, Exception) else 'not a tune-cache file'})")
        return {}
    return tables


def lookup(table: str, key: tuple, device: torch.device) -> dict | None:
    """The value stored for ``key`` in ``table`` for this GPU model and software stack, or None."""
    try:
        where = _location(device)
    except OSError as e:  # kernel sources unreadable
        _warn(str(e))
        return None
    if where is None:
        return None
    if where[0] not in _loaded:  # once per process: later misses are new keys, tuned here
        _loaded[where[0]] = _read(where[0])
    value = _loaded[where[0]].get(table, {}).get(key_text(key))
    if not isinstance(value, dict):
        return None
    compile_watch.record_tune(table, key, measured=False)
    return dict(value)


def record(table: str, key: tuple, value: dict, device: torch.device) -> None:
    """Store ``value`` for ``key``, merged with the file as it is now (another process may have added
    keys since this one read it), through a temporary file renamed over the old one: readers see the
    old or the new file, never half of one. Racing writers may drop each other's new entries (no file
    lock): those keys are tuned again on a later start, nothing worse."""
    compile_watch.record_tune(table, key, measured=True)  # the tuners store every choice they time
    try:
        where = _location(device)
        if where is None:
            return
        path, parts = where
        mine = _loaded.setdefault(path, {})
        mine.setdefault(table, {})[key_text(key)] = dict(value)
        path.parent.mkdir(parents=True, exist_ok=True)
        merged = _read(path)
        for name, entries in mine.items():
            merged.setdefault(name, {}).update(entries)
        _loaded[path] = merged
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump({"meta": parts, "tables": merged}, f, indent=1, sort_keys=True)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    except OSError as e:
        _warn(f"cannot write ({e})")
