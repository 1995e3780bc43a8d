"""``y = x @ W^T`` with W in a quantized format (see :mod:`.dispatch` for the paths and their choice).

Modules, bottom up: ``weights`` (:class:`QuantizedTensor` as the kernels see it), ``common`` (format codes,
decoders, the dequantized tile, epilogue and split-K finish), ``tune`` (configs and their per-GPU
selection), the kernels ``gemm`` (``tl.dot``), ``gemv_steps`` + ``gemv`` (decode GEMV), ``gemv_mma``
(int4 decode on tensor cores), ``dequant`` (whole-weight dequantization + cuBLAS), ``norm_epilogue`` (the norm
after a decode GEMM in its launch), and ``dispatch``.
"""
from ninfer.kernels.quant_gemm.dispatch import (
    quant_matmul,
    quant_matmul_reference,
    quant_matmul_then_norm,
    quant_matmul_triton,
)
from ninfer.kernels.quant_gemm.weights import QuantizedTensor

__all__ = ["QuantizedTensor", "quant_matmul", "quant_matmul_reference", "quant_matmul_then_norm", "quant_matmul_triton"]
