"""Ops of the Qwen3.5 hot path: each module has a plain-PyTorch reference that defines correctness.

Every public op dispatches to its Triton kernel on CUDA tensors and to the reference elsewhere.
"""
