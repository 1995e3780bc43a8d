"""When to run a Triton kernel, and how to configure autotuning for where it runs.

Launchers (``*_triton``) run on CUDA tensors, or on CPU tensors under the Triton interpreter
(``TRITON_INTERPRET=1``, used by the CPU tests). Public ops pick Triton for CUDA tensors unless
``NINFER_KERNELS=reference`` asks for the PyTorch references everywhere.
"""
from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from functools import cache

import torch

from ninfer.kernels.scoped import scoped

# Read once, at import, on purpose: Triton picks the interpreter when ``@triton.jit`` decorates a kernel (at
# the kernel modules' import), so a later change of the variable cannot change how the kernels run.
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def use_triton(x: torch.Tensor) -> bool:
    return x.is_cuda and os.environ.get("NINFER_KERNELS", "triton") != "reference"


_graph_bound: ContextVar[bool] = ContextVar("ninfer_graph_bound", default=False)


@contextmanager
def graph_bound() -> Iterator[None]:
    """Inside, launches take the paths a CUDA-graph capture takes (:func:`capturing`): the eager run before a
    capture then compiles and tunes what the capture will launch, and the capture compiles nothing."""
    with scoped(_graph_bound, True):
        yield


def capturing(x: torch.Tensor) -> bool:
    """Whether a launch on ``x``'s device is (or, inside :func:`graph_bound`, will be) captured into a graph."""
    return x.is_cuda and (_graph_bound.get() or torch.cuda.is_current_stream_capturing())


def pdl_enabled(device: torch.device) -> bool:
    """Whether launches on ``device`` use programmatic dependent launch (the register decode starts while the
    kernel before it finishes, requests its weights, and waits for that kernel's results with
    ``griddepcontrol.wait``; the norms, the GEMMs, the DeltaNet and attention decode, the attention merge and the MoE
    combine let the next kernel launch early): on compute capability 9.0 and up unless ``NINFER_PDL=0`` (read per
    call). With the deferred norm, where a GEMM follows a GEMM or a decode kernel at every layer, the 27B int4 step
    took 7.42 / 7.37 against 7.57 / 7.57 ms at batch 1 and 8.79 against 8.93 ms at C = 8, the 35B-A3B the same with
    and without (H100, run 2026-12-05.21); before it, with norm kernels between the GEMMs, it was inside the noise
    (H200, runs 2026-12-04.13 / .14)."""
    return env_switch("NINFER_PDL", True) and _capability(device) >= (9, 0)


SPLIT_SUMS = ("each", "across", "tile")
DEFAULT_SPLIT_SUM = "across"


def split_sum_mode() -> str:
    """``NINFER_SPLIT_SUM`` (read per launch): how the register decodes' fused split-K reductions read the partials,
    ``across`` (the default, :func:`split_sum_across`), ``each`` (accumulator after accumulator) or ``tile``
    (``fragment_mma`` only: the last split loads up to 16 splits' partials of its whole tile at once, one round trip
    to L2 where the others take one per four splits, so that more splits of fewer loop trips could pay; its keys
    offer more candidates and are tuned apart from the others'; its GPU tests pass, its speed is not measured)."""
    mode = os.environ.get("NINFER_SPLIT_SUM", DEFAULT_SPLIT_SUM)
    if mode not in SPLIT_SUMS:
        raise ValueError(f"NINFER_SPLIT_SUM={mode!r}: expected one of {', '.join(SPLIT_SUMS)}")
    return mode


def split_sum_across() -> bool:
    """Whether the register decodes' fused split-K reductions (``fragment_mma``, ``moe.quant_mma``) sum split after
    split for all of a program's accumulators at once (``across``, the default) instead of accumulator after
    accumulator (``NINFER_SPLIT_SUM=each``; read per launch). The last split of ``each`` waits for a round of L2
    loads per four splits and accumulator, ``across`` for one per four splits (``gemv_steps.sum_splits_of``): the
    27B int4 step 0.9% faster at batch 1 and 2.6% at C = 8 on an H100 (run 2026-12-05.15), the same bits."""
    return split_sum_mode() == "across"


def fused_prologue() -> bool:
    """Whether attention layers take the one-launch prologue (q/k norm, RoPE and the K/V write,
    ``attention.prologue``): on unless ``NINFER_FUSED_PROLOGUE=0`` (read per call). Its GPU test and the whole-model
    GPU tests passed with it (run 2026-12-05.5); the 27B step was the same with it and without (6.54-6.67 against
    6.53-6.55 ms at batch 1, 8.08 against 8.12 ms at C = 8), with one launch fewer per attention layer."""
    return env_switch("NINFER_FUSED_PROLOGUE", True)


def norm_in_moe_combine() -> bool:
    """Whether the MoE combine applies the norm that follows the block in its own launch
    (``moe.moe_experts_then_norm``): on unless ``NINFER_MOE_NORM=0`` (read per call), one launch fewer per MoE layer
    (40 of the 35B-A3B step's). Run 2026-12-05.6: its GPU tests passed, and the 35B-A3B step took 2.705-2.708 against
    2.734-2.738 ms at batch 1 and 5.08 against 5.11 ms at C = 8, on and off alternating."""
    return env_switch("NINFER_MOE_NORM", True)


def norm_in_gemm() -> bool:
    """Whether a decode GEMM followed by an RMSNorm whose rows are not deferred (the 35B-A3B output projections,
    read by MoE blocks) applies it in its own launch (``quant_gemm.quant_matmul_then_norm``), unless
    ``NINFER_NORM_IN_GEMM=0`` (read per call): a launch fewer per such projection. Run 2026-12-06.8 (H100, 35B-A3B
    int4, on and off alternating): 2.52 against 2.56 ms at batch 1, C = 8 equal (past ``MAX_ROWS`` tokens the norm
    keeps its launch); the 27B, whose norms are deferred, is unchanged (7.30 ms, run 2026-12-06.9). Before deferred
    rows it applied to every 27B projection and cost more than it saved (run 2026-12-05.7)."""
    return env_switch("NINFER_NORM_IN_GEMM", True)


def moe_down_early() -> bool:
    """Whether the MoE down projection at decode is launched with programmatic dependent launch and requests its
    expert ids and weights before it waits for the gate/up GEMM (:func:`ninfer.kernels.pdl.early_pdl`), unless
    ``NINFER_MOE_DOWN_EARLY=0`` (read per call). Run 2026-12-06.12 (H100, 35B-A3B int4, on and off twice in turn):
    2.45 against 2.53 ms at batch 1, 4.98 against 5.10 ms at C = 8; one MoE block at one token 24.4 against 26.6 µs."""
    return env_switch("NINFER_MOE_DOWN_EARLY", True)


def deltanet_early() -> bool:
    """Whether the Gated DeltaNet decode kernel is launched with programmatic dependent launch and loads its
    recurrent state (written by the previous step) before it waits for the q/k/v/z projection
    (:func:`ninfer.kernels.pdl.early_pdl`), unless ``NINFER_DELTANET_EARLY=0`` (read per call). Run 2026-12-06.11
    (H100, 27B int4, where it is the only one of the three early starts that runs, against none, twice each): 7.12
    against 7.19 ms at batch 1, 8.66 against 8.77 ms at C = 8; inside the noise on the 35B-A3B."""
    return env_switch("NINFER_DELTANET_EARLY", True)


FLOAT_GEMV_EARLY_MIN_ROWS = 8


def float_gemv_early(rows: int) -> bool:
    """Whether the small float projections at decode (the MoE routers; the DeltaNet a/b gates where the decode
    kernel does not project them) over ``rows`` tokens take the one-launch float GEMV launched with programmatic
    dependent launch, its weights asked of the L2 before it waits for the kernel before
    (:func:`ninfer.kernels.pdl.early_pdl`), instead of the tuned choice between cuBLAS and that kernel.
    ``NINFER_FLOAT_GEMV_EARLY=1`` at every token count, ``0`` never (read per call); unset, from
    ``FLOAT_GEMV_EARLY_MIN_ROWS`` tokens on. Run 2026-12-06.12 (H100, 35B-A3B int4, on and off twice in turn): at
    C = 8 4.96 against 5.12 ms, at batch 1 2.67 against 2.54 ms (cuBLAS's 3.2 µs router stays the faster there)."""
    value = os.environ.get("NINFER_FLOAT_GEMV_EARLY", "").strip()
    if not value:
        return rows >= FLOAT_GEMV_EARLY_MIN_ROWS
    return env_switch("NINFER_FLOAT_GEMV_EARLY", False)


def route_prefetch() -> bool:
    """Whether the MoE routing at decode sizes asks the L2 for the chosen experts' gate/up bytes as it picks them
    (:mod:`ninfer.kernels.moe.routing`), with ``NINFER_ROUTE_PREFETCH=1`` (read per call). Off until measured on a
    GPU: the 35B-A3B's expert gate/up took 9.7 µs a launch at batch 1 for 8.4 MB (run 2026-12-06.8), its first
    code loads waiting for ids the routing wrote just before it."""
    return env_switch("NINFER_ROUTE_PREFETCH", False)


def frag_ksplit() -> bool:
    """Whether the register decode's tuner also times its configs that split K over a program's warps (one tile a
    program, the warps' sums added through shared memory: ``kind="frag-ksplit"``,
    :mod:`ninfer.kernels.quant_gemm.fragment_mma`) with ``NINFER_FRAG_KSPLIT=1`` (read when a call shape's candidate
    list is first built). Off until measured on a GPU: a decode GEMM costs about 5 µs beyond its bytes
    (``docs/performance.md``), part of it the split-K partials' round trip through global memory and an arrival
    counter, which these configs do without."""
    return env_switch("NINFER_FRAG_KSPLIT", False)


def frag_async() -> bool:
    """Whether the register decode's tuner also times its configs whose codes reach the registers through
    ``cp.async`` copies into shared memory, several loop trips ahead (``num_stages >= 3``:
    :mod:`ninfer.kernels.quant_gemm.fragment_mma`), with ``NINFER_FRAG_ASYNC=1`` (read when a call shape's
    candidate list is first built). Off until measured on a GPU: Nsight Compute found the register decode waiting on
    its loads with registers capping the warps per SM (``docs/performance.md``), the limit these configs lift."""
    return env_switch("NINFER_FRAG_ASYNC", False)


@cache
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device) if device.type == "cuda" else (0, 0)


def autotune_configs(configs: list) -> list:
    """All configs on a GPU; only the first (the portable one, inside 99 KB of shared memory) under
    the interpreter, which cannot benchmark, or with ``NINFER_AUTOTUNE=off``, which trades speed for
    start-up time: engine-level GPU tests compile each kernel once, not per config. Read per call: the
    ``triton.autotune`` kernels call it when their module is imported, the quantized GEMM's tuner per key."""
    return configs[:1] if INTERPRET or os.environ.get("NINFER_AUTOTUNE") == "off" else configs


def fp32_first_config(tensor_arg: str) -> dict:
    """``prune_configs_by`` of an autotuned kernel: with fp32 ``tensor_arg`` (the tests' exact dtype, not
    a serving one) only the first config is compiled. ptxas spends tens of seconds on each fp32 tile of
    the larger configs, which often exceed shared memory anyway (attention prefill at head dim 256,
    sm_90: 19 s and 128 KB for a 64 x 32 tile, 35 s and 295 KB for the largest; 1.4 s for the 16 x 16 tile
    that now comes first)."""
    def prune(configs: list, named_args: dict, **kwargs: object) -> list:
        tensor = named_args.get(tensor_arg)
        return configs[:1] if getattr(tensor, "dtype", None) == torch.float32 else configs

    return {"early_config_prune": prune}


def deferred_norm() -> bool:
    """Whether an output projection's register decode leaves the norm after it to the GEMMs that read its rows
    (``quant_gemm.deferred_norm``; ``NINFER_DEFERRED_NORM=0`` turns it off, read per call): the producer writes
    ``h * (1 + w)`` and its share of each row's sum of squares, the readers scale their sums by the row's ``rsqrt``;
    two launches fewer per dense decoder layer, nothing serial. On an H100 the 27B int4 step took 7.49 against
    7.69 ms at batch 1 (run 2026-12-05.17), 7.73-7.75 against 7.71-7.74 ms at batch 1 and 9.09-9.10 against
    9.19-9.22 ms at C = 8 (run .18)."""
    return env_switch("NINFER_DEFERRED_NORM", True)


def deferred_norm_in_moe() -> bool:
    """Whether a MoE block takes its input with the norm deferred (``NINFER_DEFERRED_NORM_MOE=1``, read per call;
    off by default): its router then runs on the float GEMV instead of cuBLAS (5.8 against 3.3 µs) and its shared
    expert's gate/up, a small GEMM, pays the factors in every program: the 35B-A3B int4 step took 3.02 against
    2.85 ms at batch 1 on an H100 (run 2026-12-05.19)."""
    return deferred_norm() and env_switch("NINFER_DEFERRED_NORM_MOE", False)


ON_VALUES = ("1", "on", "true", "yes")
OFF_VALUES = ("0", "off", "false", "no")


def env_switch(name: str, default: bool) -> bool:
    """An on/off environment switch (read now): ``1`` / ``on`` / ``true`` / ``yes`` or ``0`` / ``off`` / ``false`` /
    ``no`` (any case), ``default`` when unset or empty; anything else is an error naming the variable, so that a typo
    never silently picks a path."""
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return default
    if value in ON_VALUES or value in OFF_VALUES:
        return value in ON_VALUES
    raise ValueError(f"{name}={os.environ[name]!r}: expected 1 / on / true / yes or 0 / off / false / no")
