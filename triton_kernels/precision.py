"""The tl.dot input precision of fp32 inputs (torch's TF32 switch, as torch.matmul follows it) and the accumulator
dtypes. Torch-only (no triton import): the lanes key on them before any kernel module loads, and flashtx imports
them without triton (its reference backend)."""
from __future__ import annotations

import torch

# Accumulator (and lse) dtype per input dtype: fp32 for the half types and fp32, fp64 for fp64 (tests).
TORCH_ACC_DTYPE = {torch.float16: torch.float32, torch.bfloat16: torch.float32,
                   torch.float32: torch.float32, torch.float64: torch.float64}

# torch.backends.cuda.matmul.allow_tf32 reads this getter through a module __getattr__ (~0.5 us a call
# against 0.06 us): read it directly when this torch has it.
_get_allow_tf32 = getattr(torch._C, "_get_cublas_allow_tf32", None) or (lambda: torch.backends.cuda.matmul.allow_tf32)


def allow_tf32() -> bool:
    """torch's TF32 switch for fp32 matmuls, set through either of its APIs: allow_tf32 (the getter above), or
    fp32_precision (torch >= 2.9: torch.backends.fp32_precision / torch.backends.cuda.matmul.fp32_precision =
    "tf32"), after which the old getter raises rather than answer."""
    try:
        return _get_allow_tf32()
    except RuntimeError:
        return torch.backends.cuda.matmul.fp32_precision == "tf32"  # the matmul setting, or what it inherits


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot input precision: fp32 inputs follow torch's TF32 switch, like torch.matmul does."""
    if dtype == torch.float32 and allow_tf32():
        return "tf32"
    return "ieee"
