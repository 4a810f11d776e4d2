"""RMSNorm as LLaMA and Hugging Face's LlamaRMSNorm compute it."""
from __future__ import annotations

import numbers

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class RMSNorm(nn.Module):
    """Root-mean-square layer norm: ``weight * (x / sqrt(mean(x**2, -1) + eps))``.

    Normalises in float32 (float64 stays float64), casts back to x's dtype, then scales by
    ``weight``, as transformers' ``LlamaRMSNorm``. The normalisation is torch's ``F.rms_norm``: on CUDA, per
    torch's implementation, recent versions fuse it into one kernel forward and backward where the formula
    written out launches five (not measured here); its reduction order may differ from the written-out mean
    in the last bit.

    Args:
        dim: the size of the last dim of x.
        eps: added to the mean square.
        elementwise_affine: learn ``weight`` (dim,), initialised to ones; otherwise no weight.
        device, dtype: for the weight.

    Shapes: x (..., dim) -> (..., dim), in x's dtype promoted with the weight's (x's dtype when they match;
    an fp16 x with an fp32 weight gives fp32, as LlamaRMSNorm).
    """

    def __init__(self, dim: int, eps: float = 1e-6, elementwise_affine: bool = True, *, device=None, dtype=None):
        super().__init__()
        if isinstance(dim, bool) or not isinstance(dim, numbers.Integral) or dim < 1:
            raise ValueError(f"dim must be an int >= 1; got {dim!r}")
        if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not eps >= 0:
            raise ValueError(f"eps must be a number >= 0; got {eps!r}")
        self.dim, self.eps = int(dim), float(eps)
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype)) if elementwise_affine else None

    def reset_parameters(self) -> None:
        """weight to ones, as at construction (how a module built on the meta device is initialised after
        ``to_empty()``, e.g. by FSDP)."""
        if self.weight is not None:
            nn.init.ones_(self.weight)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}, elementwise_affine={self.weight is not None}"

    def forward(self, x: Tensor) -> Tensor:
        """x: (..., dim) -> (..., dim)."""
        if x.is_nested:
            raise TypeError("RMSNorm needs a dense x; got a nested tensor (pad the sequences to one length)")
        if x.shape[-1] != self.dim:
            raise ValueError(f"RMSNorm({self.dim}) got x of shape {tuple(x.shape)}: the last dim must be {self.dim}")
        if not x.is_floating_point():  # (its result cast back to an integer dtype would be truncated)
            raise TypeError(f"RMSNorm needs a floating-point x; got dtype {x.dtype}")
        h = x if x.dtype == torch.float64 else x.float()
        h = F.rms_norm(h, (self.dim,), None, self.eps).to(x.dtype)  # h * rsqrt(mean(h**2) + eps), one kernel
        return h if self.weight is None else self.weight * h
