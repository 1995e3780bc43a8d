"""Triton partial RoPE and fused per-head norm + RoPE (CPU interpreter) against the references."""
from __future__ import annotations

import pytest
import torch

from kernel_testing import assert_close, poisoned_outputs  # noqa: F401  (fixture)
from ninfer.kernels.dispatch import INTERPRET
from ninfer.kernels.rope import (
    apply_rope_reference,
    apply_rope_triton,
    mrope_cos_sin,
    mrope_cos_sin_reference,
    mrope_cos_sin_triton,
    qk_norm_rope_reference,
    qk_norm_rope_triton,
    rope_inv_freq,
)

pytestmark = [pytest.mark.skipif(not INTERPRET, reason="Triton launchers on CPU need TRITON_INTERPRET=1"),
              pytest.mark.usefixtures("poisoned_outputs")]

TOL = {torch.float32: 1e-6, torch.float16: 2e-3}


def tables(n: int, rotary_dim: int, dtype: torch.dtype, real: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """M-RoPE tables with distinct T/H/W positions, or random ones (their two halves differ, which
    catches a swapped lo/hi half that real tables, equal in both halves, would hide)."""
    if not real:
        return torch.randn(n, rotary_dim, dtype=dtype), torch.randn(n, rotary_dim, dtype=dtype)
    positions = torch.stack([torch.arange(n) + 5, torch.arange(n) * 2, torch.arange(n) % 3])
    return mrope_cos_sin(positions, rope_inv_freq(rotary_dim, 1e7), [3, 3, 2], dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("real_tables", [True, False])
def test_apply_rope_partial_on_strided_query_view(dtype: torch.dtype, real_tables: bool) -> None:
    n, heads, head_dim, rot = 11, 3, 64, 16
    q = torch.randn(n, heads, 2 * head_dim, dtype=dtype)[..., :head_dim]  # interleaved q_proj query half
    cos, sin = tables(n, rot, dtype, real_tables)
    assert_close(apply_rope_triton(q, cos, sin), apply_rope_reference(q, cos, sin), TOL[dtype])


@pytest.mark.parametrize("rot", [32, 24])  # full rotary; a half that is not a power of two
def test_apply_rope_rotary_widths(rot: int) -> None:
    x = torch.randn(6, 2, 32)
    cos, sin = tables(6, rot, torch.float32, real=False)
    assert_close(apply_rope_triton(x, cos, sin), apply_rope_reference(x, cos, sin), TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_qk_norm_rope_matches_norm_then_rope(dtype: torch.dtype) -> None:
    n, hq, hk, head_dim, rot = 9, 6, 2, 64, 16
    q = torch.randn(n, hq, 2 * head_dim, dtype=dtype)[..., :head_dim]
    k = torch.randn(n, hk, head_dim, dtype=dtype) * 4
    q_w, k_w = torch.randn(head_dim).to(dtype), torch.randn(head_dim).to(dtype)
    cos, sin = tables(n, rot, dtype, real=False)
    q_out, k_out = qk_norm_rope_triton(q, k, q_w, k_w, cos, sin, 1e-6)
    q_ref, k_ref = qk_norm_rope_reference(q, k, q_w, k_w, cos, sin, 1e-6)
    assert_close(q_out, q_ref, TOL[dtype])
    assert_close(k_out, k_ref, TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("layout", ["distinct axes", "text (expanded row)", "column slice"])
@pytest.mark.parametrize("n", [1, 45])
def test_mrope_tables_in_one_launch(dtype: torch.dtype, layout: str, n: int) -> None:
    rot, section = 22, [5, 3, 3]  # 11 frequencies: T, H and W indices interleaved, the last ones T only
    g = torch.Generator().manual_seed(n)
    if layout == "distinct axes":
        positions = torch.randint(0, 300_000, (3, n), generator=g)
    elif layout == "text (expanded row)":
        positions = torch.randint(0, 300_000, (n,), generator=g).expand(3, n)
    else:
        positions = torch.randint(0, 300_000, (3, 2 * n + 3), generator=g)[:, 3::2]
    inv_freq = rope_inv_freq(rot, 1e7)
    cos, sin = mrope_cos_sin_triton(positions, inv_freq, section, dtype)
    cos_ref, sin_ref = mrope_cos_sin_reference(positions, inv_freq, section, dtype)
    assert_close(cos, cos_ref, TOL[dtype])
    assert_close(sin, sin_ref, TOL[dtype])
    assert torch.equal(cos[:, :rot // 2], cos[:, rot // 2:]) and torch.equal(sin[:, :rot // 2], sin[:, rot // 2:])


def test_mrope_tables_of_no_tokens() -> None:
    cos, sin = mrope_cos_sin_triton(torch.zeros(3, 0, dtype=torch.long), rope_inv_freq(8, 1e7), [2, 1, 1],
                                    torch.float32)
    assert cos.shape == sin.shape == (0, 8)
