"""Causal GQA attention over a paged KV cache (see :mod:`.dispatch`).

Modules, bottom up: ``paged`` (the K/V storage type), ``common`` (tile reads through the page table,
the online-softmax step, the gated epilogue), ``split_kv`` (split ranges and their merge), the kernels
``write``, ``prologue`` (q/k norm, RoPE and the K/V write in one launch), ``decode``, ``prefill``, the
plain-PyTorch ``reference`` and ``dispatch`` (the public ops).
"""
from ninfer.kernels.attention.dispatch import paged_attention, paged_attention_triton, write_kv
from ninfer.kernels.attention.paged import KV_DTYPES, PagedKV
from ninfer.kernels.attention.prologue import qk_norm_rope_write_kv
from ninfer.kernels.attention.reference import (
    dequantize_kv_reference,
    paged_attention_reference,
    quantize_kv_reference,
    write_kv_reference,
)

__all__ = [
    "KV_DTYPES",
    "PagedKV",
    "dequantize_kv_reference",
    "paged_attention",
    "paged_attention_reference",
    "paged_attention_triton",
    "qk_norm_rope_write_kv",
    "quantize_kv_reference",
    "write_kv",
    "write_kv_reference",
]
