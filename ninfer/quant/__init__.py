"""Quantized weights: formats (``formats``), modules and model surgery (``linear``), recipes
(``recipe``), the checkpoint converter (``convert``), imports of public pre-quantized layouts
(``imports``) and size accounting (``sizes``). The GEMMs live in ``ninfer.kernels.quant_gemm``.

Submodules are imported explicitly (``from ninfer.quant.linear import QuantLinear``): the kernels
import ``ninfer.quant.formats``, so this package must not import ``linear`` eagerly.
"""
