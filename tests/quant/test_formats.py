"""Weight formats: exact packing, declared tensor specs, per-format error bounds (with hypothesis)."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ninfer.quant.formats import (
    E2M1_VALUES,
    FORMATS,
    FormatError,
    IntGroupFormat,
    e2m1_decode,
    e2m1_encode,
    get_format,
    pack_nibbles,
    quantize,
    stack_rows,
    unpack_nibbles,
)

QUANTIZED = [name for name in FORMATS if name != "bf16"]
SETTINGS = settings(max_examples=25, deadline=None)


def _weight(seed: int, shape: tuple[int, ...], spread: int = 4) -> torch.Tensor:
    """Random weights whose rows/groups span 2^spread in magnitude (a realistic, scale-stressing mix)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(*shape, generator=g)
    return w * torch.exp2(-torch.randint(0, spread + 1, shape, generator=g).float()) * 0.05


def test_nibbles_roundtrip_and_order() -> None:
    codes = torch.randint(0, 16, (3, 5, 64), dtype=torch.uint8)
    packed = pack_nibbles(codes)
    assert packed.shape == (3, 5, 32) and packed.dtype == torch.uint8
    assert torch.equal(unpack_nibbles(packed), codes)
    assert pack_nibbles(torch.tensor([1, 2], dtype=torch.uint8)).item() == 0x21  # element 0 in the low nibble


def test_e2m1_codes_exact_and_rounding() -> None:
    codes = torch.arange(16, dtype=torch.uint8)
    values = e2m1_decode(codes)
    assert values[:8].tolist() == list(E2M1_VALUES) and values[8:].tolist() == [-v for v in E2M1_VALUES]
    nonzero = values != 0
    assert torch.equal(e2m1_encode(values[nonzero]), codes[nonzero])  # every nonzero value encodes to its code
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, -5.0])
    assert e2m1_decode(e2m1_encode(ties)).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, -4.0]


@pytest.mark.parametrize("name", list(FORMATS))
def test_specs_match_quantized_tensors_with_expert_dim(name: str) -> None:
    fmt = get_format(name)
    shape = (3, 256, 384)
    packed = fmt.quantize(_weight(0, shape))
    specs = fmt.specs(shape)
    assert set(packed) == set(specs)
    for key, tensor in packed.items():
        assert tuple(tensor.shape) == specs[key].shape and tensor.dtype == specs[key].dtype, key
    assert fmt.nbytes(shape) == sum(t.numel() * t.element_size() for t in packed.values())
    # Each expert slice is quantized on its own.
    w = _weight(0, shape)
    for e in range(3):
        single = fmt.quantize(w[e])
        for key in packed:
            assert torch.equal(packed[key][e].view(torch.uint8) if packed[key].dtype.itemsize == 1 else packed[key][e],
                               single[key].view(torch.uint8) if single[key].dtype.itemsize == 1 else single[key])


@pytest.mark.parametrize("name", list(FORMATS))
def test_select_one_expert_of_a_stack(name: str) -> None:
    stack = quantize(_weight(1, (3, 256, 128)), name)
    whole = stack.dequantize()
    for e in range(3):
        one = stack.select(e)
        assert one.shape == (256, 128)
        assert all(t.data_ptr() == stack.tensors[k][e].data_ptr() for k, t in one.tensors.items())  # views
        assert torch.equal(one.dequantize(), whole[e])
    with pytest.raises(FormatError, match="stacked"):
        stack.select(0).select(0)


def _int_bound(fmt: IntGroupFormat, scales: torch.Tensor) -> torch.Tensor:
    # Half a step, plus the clamp when the fp16 scale rounded below amax / qmax.
    return scales.float().repeat_interleave(fmt.group_size, -1) * (0.5 + fmt.qmax * 2.0 ** -11) + 1e-12


@SETTINGS
@given(seed=st.integers(0, 2 ** 16), rows=st.integers(1, 9), groups=st.integers(1, 4),
       name=st.sampled_from(["int8-g32", "int8-g64", "int4-g64", "int4-g128"]))
def test_int_formats_error_bound_and_idempotence(seed: int, rows: int, groups: int, name: str) -> None:
    fmt = get_format(name)
    w = _weight(seed, (rows, groups * fmt.group_size))
    t = fmt.quantize(w)
    deq = fmt.dequantize(t)
    assert ((deq - w).abs() <= _int_bound(fmt, t["scales"])).all()
    again = fmt.quantize(deq)  # dequantized values are representable: requantizing changes nothing
    assert torch.equal(again["qweight"], t["qweight"]) and torch.equal(again["scales"], t["scales"])


@SETTINGS
@given(seed=st.integers(0, 2 ** 16), rows=st.integers(1, 200), cols=st.integers(1, 300),
       name=st.sampled_from(["fp8", "fp8-b128"]))
def test_fp8_error_bound(seed: int, rows: int, cols: int, name: str) -> None:
    fmt = get_format(name)
    w = _weight(seed, (rows, cols), spread=12)
    t = fmt.quantize(w)
    deq = fmt.dequantize(t)
    if name == "fp8":
        scale = t["scales"][:, None]
    else:
        scale = t["scales"].repeat_interleave(128, 0).repeat_interleave(128, 1)[:rows, :cols]
    # e4m3: half a step is 2^-4 of the value (normals) or 2^-10 of the scale (subnormals).
    bound = torch.maximum(w.abs() * 2.0 ** -4, scale * 2.0 ** -10) * (1 + 1e-5) + 1e-12
    assert ((deq - w).abs() <= bound).all()


@SETTINGS
@given(seed=st.integers(0, 2 ** 16), rows=st.integers(1, 8), blocks=st.integers(1, 8))
def test_nvfp4_error_bound(seed: int, rows: int, blocks: int) -> None:
    fmt = get_format("nvfp4")
    w = _weight(seed, (rows, 16 * blocks), spread=4)
    t = fmt.quantize(w)
    deq = fmt.dequantize(t)
    step = t["scales"].float().repeat_interleave(16, -1) * t["global_scale"][:, None]
    # e2m1 spacing is 0.5 up to 2, 1 up to 4, 2 up to 6 (in units of the block's step); the fp8 block
    # scale may round down and clip the block maximum by at most 2^-4 of it.
    bound = torch.maximum(0.25 * step, w.abs() / 4) * (1 + 1e-5) + 1e-12
    assert ((deq - w).abs() <= bound).all()
    assert torch.isfinite(deq).all()


def test_zero_and_tiny_weights_stay_finite() -> None:
    for name in QUANTIZED:
        w = torch.zeros(4, 128)
        w[1, :16] = 1e-30
        deq = quantize(w, name).dequantize()
        assert torch.isfinite(deq).all() and deq[0].abs().max() == 0, name
        assert (deq - w).abs().max() <= 1e-29, name


@pytest.mark.parametrize("name", QUANTIZED)
def test_stack_rows_and_row_selection(name: str) -> None:
    a, b = quantize(_weight(1, (128, 256)), name), quantize(_weight(2, (256, 256)) * 3, name)
    both = stack_rows([a, b])
    assert both.shape == (384, 256)
    assert torch.equal(both.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))
    rows = torch.tensor([0, 383, 130, 7, 200])
    fmt = get_format(name)
    assert torch.equal(fmt.dequantize_rows(both.tensors, rows), both.dequantize()[rows])


def test_shape_errors_are_clear() -> None:
    with pytest.raises(FormatError, match="group size 128"):
        quantize(torch.zeros(8, 192), "int4-g128")
    with pytest.raises(FormatError, match="2-D|-D shape"):
        quantize(torch.zeros(64), "int8-g64")
    with pytest.raises(FormatError, match="unknown weight format 'int3'.*int4-g64"):
        get_format("int3")
    with pytest.raises(FormatError, match="N divisible by 128"):
        stack_rows([quantize(torch.zeros(64, 128), "fp8-b128"), quantize(torch.zeros(64, 128), "fp8-b128")])


@pytest.mark.parametrize("name", QUANTIZED)
def test_row_chunked_quantization_equals_whole(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from ninfer.quant import formats

    w = _weight(7, (2, 1000, 128))
    whole = get_format(name).quantize(w)
    monkeypatch.setattr(formats, "_CHUNK_ELEMS", 1 << 12)  # 128-row chunks
    chunked = get_format(name).quantize(w)
    for key, tensor in whole.items():
        assert torch.equal(tensor.view(torch.uint8) if tensor.dtype.itemsize == 1 else tensor,
                           chunked[key].view(torch.uint8) if tensor.dtype.itemsize == 1 else chunked[key]), key


def test_bytes_per_param() -> None:
    shape = (5120, 17408)
    per_param = {name: get_format(name).nbytes(shape) / (shape[0] * shape[1]) for name in FORMATS}
    assert per_param["bf16"] == 2 and per_param["int4-g64"] == 0.5 + 2 / 64 and per_param["int8-g32"] == 1 + 2 / 32
    assert abs(per_param["nvfp4"] - (0.5 + 1 / 16 + 4 / 17408)) < 1e-12
    assert abs(per_param["fp8"] - (1 + 4 / 17408)) < 1e-12
