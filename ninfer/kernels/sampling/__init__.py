"""Token sampling with penalties, top-k/top-p/min-p and logprobs (see :mod:`.dispatch`).

Modules, bottom up: ``passes`` (the kernel's passes over a row), ``kernel`` (the fused sampling kernel)
and ``dispatch`` (the tensors, the plain-PyTorch references and the public op).
"""
from ninfer.kernels.sampling.dispatch import (
    MAX_LOGPROBS,
    SampleOutput,
    SamplingTensors,
    apply_bitmask,
    apply_penalties_reference,
    sample,
    sample_reference,
    sample_triton,
    sampling_probs_reference,
    suppress_tokens,
)

__all__ = ["MAX_LOGPROBS", "SampleOutput", "SamplingTensors", "apply_bitmask", "apply_penalties_reference", "sample",
           "sample_reference", "sample_triton", "sampling_probs_reference",
           "suppress_tokens"]
