"""Whether a start's kernels are already compiled: a marker per start configuration in Triton's cache.

A start's dry passes (:func:`ninfer.runtime.startup.parallel_compile`) pay for themselves only when there is
something to compile. On warm caches they run every warm-up forward once more with nothing to compile: the 27B
``int4`` start spent 10.6 s in them to save 1.7 s of its real passes (ready in 21.1 s with them, 11.9 s without;
run 2026-12-03.16). So a start whose warm-up finished leaves a marker, named by a hash of everything that decides
which kernels the start meets: the model's configuration and its weights' formats, shapes and layouts, the MTP
head, the engine's options (``warmup`` aside: ``ninfer warmup`` builds the engine without it, then warms it up),
the GPU, the torch and Triton versions, ninfer's sources and shipped tuning tables, and the ``NINFER_`` /
``TRITON_`` environment. A later start that finds its marker skips the dry passes.

The marker lives in Triton's cache directory, so clearing that cache clears the markers with it. A marker can
only cost time, never correctness: a kernel missing from the cache anyway compiles at its first launch, as with
``NINFER_PARALLEL_COMPILE=0``. ``NINFER_PARALLEL_COMPILE=always`` runs the dry passes even where a marker is.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import os
from pathlib import Path

import torch
import triton
from torch import nn

from ninfer.kernels.precompile import ENV as PARALLEL_COMPILE_ENV
from ninfer.quant.linear import QuantWeight
from ninfer.runtime.engine_config import EngineConfig

MARKERS = "ninfer-warm-starts"
log = logging.getLogger("ninfer.startup")


def triton_cache_dir() -> Path:
    """Where Triton keeps compiled kernels: its ``knobs`` (Triton 3.4 on), else ``TRITON_CACHE_DIR`` or its
    default."""
    knobs = getattr(triton, "knobs", None)
    cache = getattr(getattr(knobs, "cache", None), "dir", None)
    return Path(cache or os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")


@functools.lru_cache(maxsize=1)
def _sources_digest() -> str:
    """ninfer's code and the tuning tables it ships (a table's choices are kernels to compile)."""
    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.suffix in (".py", ".json")):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def _weights(module: nn.Module | None) -> list[str]:
    if module is None:
        return []
    return [f"{name}:{m.format.name}:{m.layout}:{list(m.shape)}" for name, m in module.named_modules()
            if isinstance(m, QuantWeight)]


def start_key(model: nn.Module, mtp_head: nn.Module | None, config: EngineConfig) -> str:
    """The hash that names this start's marker (module doc)."""
    device = next(model.parameters()).device
    gpu = (torch.cuda.get_device_name(device), torch.cuda.get_device_capability(device)) \
        if device.type == "cuda" else device.type
    options = {k: v for k, v in dataclasses.asdict(config).items() if k != "warmup"}
    env = sorted((k, v) for k, v in os.environ.items() if k.startswith(("NINFER_", "TRITON_")))
    parts = [repr(getattr(model, "config", None)), str(getattr(model, "dtype", None)), *_weights(model),
             repr(mtp_head), *_weights(mtp_head), repr(sorted(options.items())), repr(gpu), torch.__version__,
             triton.__version__, _sources_digest(), repr(env)]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]


def marker_for(model: nn.Module, mtp_head: nn.Module | None, config: EngineConfig) -> WarmMarker | None:
    """This start's marker, on CUDA (elsewhere nothing compiles)."""
    if next(model.parameters()).device.type != "cuda":
        return None
    return WarmMarker.for_start(model, mtp_head, config)


@dataclasses.dataclass(frozen=True)
class WarmMarker:
    """The marker of one start configuration (:func:`for_start`)."""
    path: Path

    @classmethod
    def for_start(cls, model: nn.Module, mtp_head: nn.Module | None, config: EngineConfig) -> WarmMarker:
        return cls(triton_cache_dir() / MARKERS / start_key(model, mtp_head, config))

    def skip_reason(self) -> str | None:
        """Why this start can skip its dry passes (None: it cannot, or ``NINFER_PARALLEL_COMPILE=always``)."""
        if os.environ.get(PARALLEL_COMPILE_ENV, "").strip().lower() == "always" or not self.path.exists():
            return None
        return f"an earlier start of this configuration compiled its kernels: {self.path}"

    def write(self) -> None:
        """Note that this configuration's warm-up finished; a cache directory we cannot write costs nothing
        but the next start's dry passes."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.touch()
        except OSError as err:
            log.debug("no warm-start marker written (%s): the next start runs its dry passes", err)
