"""flashtx's Triton kernels, installed as ``flashtx.triton_kernels`` (never top-level).

Each module holds ``@triton.jit`` kernels and a tensor-in/tensor-out launcher, with no autograd.
"""
