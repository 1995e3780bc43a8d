"""A process's tuning choices written as a shipped table (the format of :mod:`ninfer.kernels.shipped`).

A GPU run that meets the keys serving meets (the perf benchmarks at the real shapes, with
``NINFER_EXPORT_TUNING=<path>``) ends with :func:`export`: every ``triton.autotune`` kernel's choices (its
``Autotuner.cache``, through the registry of :mod:`ninfer.kernels.autotune`) and the runtime tuners' choices
(``TunerState.chosen`` of the tables in ``shipped.TABLES``), merged into the file at ``path`` if there
is one, so that several runs on one GPU model (27B, then 35B-A3B) accumulate. ``perf/ship_tuning.py`` then
merges such files into the package folder, which is how new shipped tables are made.

Separate from :mod:`ninfer.kernels.shipped` (the read side, which the tuners import): writing needs the
tuners' state and the autotuner registry, which themselves import the read side.
"""
from __future__ import annotations

import contextlib
import datetime
import json
import os
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import triton

from ninfer.kernels import shipped, tune_cache
from ninfer.kernels.autotune import registered
from ninfer.kernels.tuning import TunerState, default_tuner


def collect(device: torch.device, tuner: TunerState | None = None, meta: dict[str, Any] | None = None
            ) -> dict[str, Any]:
    """This process's choices for ``device``'s GPU model as a table document: ``tuner``'s (default: the
    process's) runtime-tuner choices and every registered autotuner's cache; ``meta`` adds to the record of
    what produced them (date, versions and command line are always there)."""
    identity = shipped.gpu_identity(device)
    if identity is None:
        raise ValueError(f"{device} is not a CUDA device: its choices are no GPU model's")
    tuner = tuner or default_tuner()
    source = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
              "triton": triton.__version__, "torch": torch.__version__, "kernels": tune_cache.source_hash(),
              "command": " ".join(sys.argv), **(meta or {})}
    tables = {name: {tune_cache.key_text(key): asdict(cfg) for key, cfg in tuner.chosen(name).items()
                     if _on(device, key)} for name in shipped.TABLES}
    autotuned = {name: {shipped.autotune_key_text(key): shipped.config_fields(cfg) for key, cfg in at.cache.items()}
                 for name, at in registered().items()}
    return {"meta": {"gpu": identity[0], "capability": identity[1], "sources": [source]},
            "tables": {k: v for k, v in tables.items() if v}, "autotune": {k: v for k, v in autotuned.items() if v}}


def _on(device: torch.device, key: tuple) -> bool:
    """Whether a tuner key belongs to ``device``'s kind (keys name their tensors' device)."""
    return all(v.type == device.type for v in key if isinstance(v, torch.device))


def read(path: Path) -> dict[str, Any]:
    """A table document from ``path``; ValueError naming the first problem if it is not one."""
    doc = json.loads(Path(path).read_text())
    problems = shipped.validate(doc)
    if problems:
        raise ValueError(f"{path}: {problems[0]}" + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""))
    return doc


def write(path: Path, doc: dict[str, Any]) -> None:
    """Write ``doc`` to ``path`` through a temporary file renamed over it (readers never see half a file),
    with sorted keys so that a committed table diffs by entry."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f, indent=1, sort_keys=True)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def export(path: Path | str, device: torch.device | None = None, *, tuner: TunerState | None = None,
           meta: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write this process's choices on ``device`` (default: the current CUDA device) to ``path``, merged over
    the table already there (same GPU model, else ValueError); returns the document written."""
    device = device or torch.device("cuda", torch.cuda.current_device())
    doc = collect(device, tuner, meta)
    path = Path(path)
    if path.exists():
        doc = shipped.merge(read(path), doc)
    write(path, doc)
    return doc
