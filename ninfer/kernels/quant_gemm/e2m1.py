"""e2m1 (nvfp4) codes as floats, for the row-major kernels (:mod:`.common`, :mod:`.gemv_steps`) and the fragment
layout (:mod:`.fragments_fp4`) alike; a module of its own so that neither imports the other."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def e2m1_values(nib):
    """e2m1 nibbles -> fp32 ``value * 2^-126``: sign, exponent and mantissa bits moved to fp32 positions
    form exactly that number (the e2m1 subnormal 0.5 becomes an fp32 subnormal); one multiply-shift
    places all three fields at once, one AND clears the bits in between."""
    bits = (nib.to(tl.uint32) * 0x10400000) & 0x81C00000  # nibble << 28 (sign) plus nibble << 22 (e, m)
    return bits.to(tl.float32, bitcast=True)
