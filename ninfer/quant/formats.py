"""Weight formats: quantizers, reference dequantizers and the packed layouts the GEMM kernels read.

A weight ``w [*, N, K]`` (N output rows, K input features, optional leading dims such as experts)
is stored as a few tensors with fixed names. Every layout keeps the rows outermost and K
contiguous inside a row, so rows can be sliced, stacked along N (gate with up, expert slices) or
gathered (embedding lookups) without unpacking, and a GEMM tile reads whole K runs of one row.

* ``bf16``: ``weight [*, N, K]`` bf16, as stored.
* ``fp8``: ``qweight [*, N, K]`` e4m3fn, ``scales [*, N]`` fp32; ``w = q * scales[n]``.
* ``fp8-b128``: ``qweight [*, N, K]`` e4m3fn, ``scales [*, ceil(N/128), ceil(K/128)]`` fp32;
  ``w = q * scales[n // 128, k // 128]``.
* ``int8-g32``, ``int8-g64``: ``qweight [*, N, K]`` int8, ``scales [*, N, K/G]`` fp16;
  ``w = q * scales[n, k // G]``.
* ``int4-g64``, ``int4-g128``: ``qweight [*, N, K/2]`` uint8, ``scales [*, N, K/G]`` fp16;
  ``w = (nibble - 8) * scales[n, k // G]``.
* ``nvfp4``: ``qweight [*, N, K/2]`` uint8, ``scales [*, N, K/16]`` e4m3fn, ``global_scale [*, N]``
  fp32; ``w = e2m1(nibble) * scales[n, k // 16] * global_scale[n]``.

4-bit packing: byte ``j`` of a row holds element ``2j`` in its low nibble and ``2j + 1`` in its high
nibble, the order of ModelOpt and compressed-tensors NVFP4 checkpoints, which therefore load
byte for byte. int4 nibbles are offset binary (``q + 8``, ``q`` in [-8, 7]); e2m1 nibbles are
sign | exponent (2 bits) | mantissa (1 bit), values ±{0, 0.5, 1, 1.5, 2, 3, 4, 6}.

Scales are symmetric abs-max: ``amax / 127`` (int8), ``amax / 7`` (int4), ``amax / 448`` (fp8),
and for nvfp4 ``amax_block / 6 / global`` rounded to e4m3 with ``global = amax_tensor / (6 * 448)``.
The nvfp4 global scale is one value per tensor slice as quantized, stored once per row so that
separately quantized tensors (gate and up, per-expert checkpoints) stack along N unchanged.
int scales are fp16 (10 mantissa bits: the scale adds far less error than the codes do).
Quantizers compute in fp32 on the input's device and round codes to nearest (ties to even).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ninfer.kernels.quant_gemm.weights import FormatError, QuantizedTensor

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
E2M1_MAX = 6.0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitude of codes 0..7; bit 3 is the sign
# Rounding thresholds between consecutive e2m1 magnitudes (midpoints).
_E2M1_BOUNDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
FP16_TINY = 2.0 ** -24  # smallest positive fp16: floor of int scales so all-zero groups stay finite
_CHUNK_ELEMS = 1 << 25


@dataclass(frozen=True)
class TensorSpec:
    """One stored tensor: shape, dtype, and which dim indexes output rows (``row_block`` rows per entry)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    row_dim: int  # negative: counted from the end
    row_block: int = 1

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


class WeightFormat:
    """Base class: subclasses define the stored tensors and the (de)quantization math."""

    name: str
    layout: str  # versioned name of the packed layout, recorded in checkpoints
    group_size: int = 0  # elements along K sharing a scale (0: one scale per row or none)

    def check_shape(self, shape: tuple[int, ...]) -> None:
        if len(shape) < 2:
            raise FormatError(f"format {self.name} stores weights [*, N, K]; got a {len(shape)}-D shape {list(shape)}")
        k = shape[-1]
        if self.group_size and k % self.group_size:
            raise FormatError(f"format {self.name} needs K divisible by its group size {self.group_size}; "
                              f"shape {list(shape)} has K = {k}")

    def specs(self, shape: tuple[int, ...]) -> dict[str, TensorSpec]:
        raise NotImplementedError

    def nbytes(self, shape: tuple[int, ...]) -> int:
        return sum(spec.nbytes for spec in self.specs(tuple(shape)).values())

    def quantize(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        """The stored tensors of float weight ``w [*, N, K]`` (computed in fp32 on w's device, in row
        chunks of about 2^25 elements so that a vocabulary-sized tensor needs little extra memory)."""
        stats = self._stats(w)
        rows, per_row = w.shape[-2], max(w.numel() // max(w.shape[-2], 1), 1)
        step = max(128, (_CHUNK_ELEMS // per_row) // 128 * 128)  # whole 128-row blocks (fp8-b128)
        if rows <= step:
            return self._quantize(w, stats)
        parts = [self._quantize(w[..., i:i + step, :], stats) for i in range(0, rows, step)]
        specs = self.specs(tuple(w.shape))
        return {name: torch.cat([p[name] for p in parts], dim=specs[name].row_dim) for name in parts[0]}

    def _stats(self, w: torch.Tensor) -> torch.Tensor | None:
        """Statistics over a whole weight slice that row chunks must share (nvfp4's global scale)."""
        return None

    def _quantize(self, w: torch.Tensor, stats: torch.Tensor | None) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def dequantize(self, t: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        raise NotImplementedError

    def pack(self, w: torch.Tensor) -> QuantizedTensor:
        self.check_shape(tuple(w.shape))
        return QuantizedTensor(self, tuple(w.shape), self.quantize(w))

    def select_rows(self, t: dict[str, torch.Tensor], rows: torch.Tensor) -> dict[str, torch.Tensor]:
        """The stored tensors of rows ``rows`` of a 2-D weight (formats whose scales are per row)."""
        specs = self.specs((128, 128))  # row dims do not depend on the sizes
        return {name: x.index_select(specs[name].row_dim % x.dim(), rows) for name, x in t.items()}

    def dequantize_rows(self, t: dict[str, torch.Tensor], rows: torch.Tensor,
                        dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Dequantize rows ``rows`` of a 2-D weight only (embedding lookups)."""
        return self.dequantize(self.select_rows(t, rows), dtype)

    def __repr__(self) -> str:
        return f"WeightFormat({self.name})"


class Bf16Format(WeightFormat):
    name, layout = "bf16", "dense-v1"

    def specs(self, shape: tuple[int, ...]) -> dict[str, TensorSpec]:
        return {"weight": TensorSpec(tuple(shape), torch.bfloat16, -2)}

    def _quantize(self, w: torch.Tensor, stats: torch.Tensor | None) -> dict[str, torch.Tensor]:
        return {"weight": w.to(torch.bfloat16)}

    def dequantize(self, t: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return t["weight"].to(dtype)


class Fp8RowFormat(WeightFormat):
    name, layout = "fp8", "fp8-e4m3-row-scale-v1"

    def specs(self, shape: tuple[int, ...]) -> dict[str, TensorSpec]:
        *lead, n, k = shape
        return {"qweight": TensorSpec((*lead, n, k), FP8, -2), "scales": TensorSpec((*lead, n), torch.float32, -1)}

    def _quantize(self, w: torch.Tensor, stats: torch.Tensor | None) -> dict[str, torch.Tensor]:
        w = w.float()
        scale = w.abs().amax(-1) / FP8_MAX
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = (w / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        return {"qweight": q, "scales": scale}

    def dequantize(self, t: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (t["qweight"].float() * t["scales"].float()[..., None]).to(dtype)


class Fp8BlockFormat(WeightFormat):
    """FP8 with one scale per 128x128 block, as Qwen's and DeepSeek's FP8 checkpoints store them."""

    name, layout, block = "fp8-b128", "fp8-e4m3-block128-v1", 128

    def specs(self, shape: tuple[int, ...]) -> dict[str, TensorSpec]:
        *lead, n, k = shape
        b = self.block
        return {"qweight": TensorSpec((*lead, n, k), FP8, -2),
                "scales": TensorSpec((*lead, -(-n // b), -(-k // b)), torch.float32, -2, b)}

    def _expand(self, scales: torch.Tensor, n: int, k: int) -> torch.Tensor:
        b = self.block
        return scales.float().repeat_interleave(b, -2).repeat_interleave(b, -1)[..., :n, :k]

    def _quantize(self, w: torch.Tensor, stats: torch.Tensor | None) -> dict[str, torch.Tensor]:
        *lead, n, k = w.shape
        b = self.block
        nb, kb = -(-n // b), -(-k // b)
        padded = torch.zeros(*lead, nb * b, kb * b, dtype=torch.float32, device=w.device)
        padded[..., :n, :k] = w.float()
        amax = padded.view(*lead, nb, b, kb, b).abs().amax(dim=(-3, -1))
        scale = amax / FP8_MAX
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = (w.float() / self._expand(scale, n, k)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        return {"qweight": q, "scales": scale}

    def dequantize(self, t: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        q = t["qweight"]
        return (q.float() * self._expand(t["scales"], q.shape[-2], q.shape[-1])).to(dtype)

    def dequantize_rows(self, t: dict[str, torch.Tensor], rows: torch.Tensor,
                        dtype: torch.dtype = torch.float32) -> torch.Tensor:
        q = t["qweight"].index_select(0, rows)
        scales = t["scales"].index_select(0, rows // self.block).float().repeat_interleave(self.block, -1)
        return (q.float() * scales[:, : q.shape[-1]]).to(dtype)


class IntGroupFormat(WeightFormat):
    """Signed integers with one fp16 abs-max scale per ``group_size`` elements along K."""

    def __init__(self, bits: int, group_size: int) -> None:
        self.bits, self.group_size = bits, group_size
        self.name = f"int{bits}-g{group_size}"
        self.layout = "int8-row-v1" if bits == 8 else "int4-offset8-lowfirst-v1"
        self.qmax, self.qmin = 2 ** (bits - 1) - 1, -(2 ** (bits - 1))

    def specs(self, shape: tuple[int, ...]) -> dict[str, TensorSpec]:
        *lead, n, k = shape
        if self.bits == 8:
            q = TensorSpec((*lead, n, k), torch.int8, -2)
        else:
            q = TensorSpec((*lead, n, k // 2), torch.uint8, -2)
        return {"qweight": q, "scales": TensorSpec((*lead, n, k // self.group_size), torch.float16, -2)}

    def _quantize(self, w: torch.Tensor, stats: torch.Tensor | None) -> dict[str, torch.Tensor]:
        *lead, n, k = w.shape
        groups = w.float().reshape(*lead, n, k // self.group_size, self.group_size)
        scale = (groups.abs().amax(-1) / self.qmax).clamp(FP16_TINY, torch.finfo(torch.float16).max).half()
        q = torch.round(groups / scale.float()[..., None]).clamp(self.qmin, self.qmax).reshape(*lead, n, k)
        if self.bits == 8:
            return {"qweight": q.to(torch.int8), "scales": scale}
        return {"qweight": pack_nibbles((q + 8).to(torch.uint8)), "scales": scale}

    def codes(self, qweight: torch.Tensor) -> torch.Tensor:
        """Signed integer codes ``[*, N, K]`` as int16."""
        if self.bits == 8:
            return qweight.to(torch.int16)
        return unpack_nibbles(qweight).to(torch.int16) - 8

    def dequantize(self, t: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        q = self.codes(t["qweight"]).float()
        scales = t["scales"].float().repeat_interleave(self.group_size, -1)
        return (q * scales).to(dtype)


class Nvfp4Format(WeightFormat):
    name, layout, group_size = "nvfp4", "nvfp4-lowfirst-scale16-v1", 16

    def specs(self, shape: tuple[int, ...]) -> dict[str, TensorSpec]:
        *lead, n, k = shape
        return {"qweight": TensorSpec((*lead, n, k // 2), torch.uint8, -2),
                "scales": TensorSpec((*lead, n, k // 16), FP8, -2),
                "global_scale": TensorSpec((*lead, n), torch.float32, -1)}

    def _stats(self, w: torch.Tensor) -> torch.Tensor:
        amax = torch.maximum(w.amax(dim=(-2, -1)), -w.amin(dim=(-2, -1))).float()  # no |w| copy
        glob = amax / (E2M1_MAX * FP8_MAX)
        return torch.where(glob > 0, glob, torch.ones_like(glob))[..., None, None]

    def _quantize(self, w: torch.Tensor, stats: torch.Tensor | None) -> dict[str, torch.Tensor]:
        *lead, n, k = w.shape
        w = w.float()
        glob = stats
        blocks = w.reshape(*lead, n, k // 16, 16)
        scale = (blocks.abs().amax(-1) / E2M1_MAX / glob).clamp(max=FP8_MAX).to(FP8)
        step = scale.float() * glob
        ratio = torch.where(step[..., None] > 0, blocks / step[..., None], torch.zeros_like(blocks))
        codes = e2m1_encode(ratio.reshape(*lead, n, k))
        return {"qweight": pack_nibbles(codes), "scales": scale,
                "global_scale": glob[..., 0].expand(*lead, n).contiguous()}

    def dequantize(self, t: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        values = e2m1_decode(unpack_nibbles(t["qweight"]))
        scales = t["scales"].float().repeat_interleave(16, -1) * t["global_scale"].float()[..., None]
        return (values * scales).to(dtype)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """``[*, K]`` uint8 values < 16 -> ``[*, K/2]`` bytes: element 2j low nibble, 2j + 1 high nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_nibbles`: ``[*, K/2]`` bytes -> ``[*, K]`` uint8 nibbles."""
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """Round fp32 values to the nearest e2m1 code (ties to the even code, saturating at ±6) as uint8."""
    mag = x.abs().clamp(max=E2M1_MAX)
    bounds = torch.tensor(_E2M1_BOUNDS, dtype=mag.dtype, device=mag.device)
    low, high = torch.bucketize(mag, bounds, right=False), torch.bucketize(mag, bounds, right=True)
    idx = torch.where((low != high) & (low % 2 == 1), high, low)  # on a midpoint: the even code
    return (idx | ((x < 0).long() << 3)).to(torch.uint8)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """uint8 e2m1 codes -> fp32 values."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    mag = table[(codes & 7).long()]
    return torch.where((codes & 8) != 0, -mag, mag)


FORMATS: dict[str, WeightFormat] = {f.name: f for f in (
    Bf16Format(), Fp8RowFormat(), Fp8BlockFormat(), IntGroupFormat(8, 32), IntGroupFormat(8, 64),
    IntGroupFormat(4, 64), IntGroupFormat(4, 128), Nvfp4Format(),
)}


def get_format(name: str | WeightFormat) -> WeightFormat:
    if isinstance(name, WeightFormat):
        return name
    try:
        return FORMATS[name]
    except KeyError:
        raise FormatError(f"unknown weight format {name!r}; known formats: {', '.join(FORMATS)}") from None


def quantize(w: torch.Tensor, fmt: str | WeightFormat) -> QuantizedTensor:
    """Quantize a float weight ``[*, N, K]`` (checked against the format's constraints)."""
    return get_format(fmt).pack(w)


def stack_rows(parts: list[QuantizedTensor]) -> QuantizedTensor:
    """Concatenate weights of one format along N (e.g. gate then up), without requantizing."""
    fmt = parts[0].format
    if any(p.format is not fmt for p in parts):
        raise FormatError(f"cannot stack weights of different formats: {[p.format.name for p in parts]}")
    specs = fmt.specs(parts[0].shape)
    for p in parts[:-1]:
        if any(spec.row_block > 1 for spec in specs.values()) and p.shape[-2] % 128:
            raise FormatError(f"format {fmt.name}: stacked parts need N divisible by 128, got {p.shape[-2]}")
    tensors = {name: torch.cat([p.tensors[name] for p in parts], dim=spec.row_dim) for name, spec in specs.items()}
    shape = (*parts[0].shape[:-2], sum(p.shape[-2] for p in parts), parts[0].shape[-1])
    return QuantizedTensor(fmt, shape, tensors)
