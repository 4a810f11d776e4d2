"""The tolerance rule flashtx holds its kernels to, shared by the tests and `python -m flashtx`.

A kernel's error against a float64 reference may be at most `factor` times the error of the same
computation done eagerly in the kernel's dtype (2 for outputs, 3 for gradients), plus a floor of
a few ulps for results both compute almost exactly.
"""
from __future__ import annotations

import math

import torch

OUTPUT_FACTOR = 2.0
GRAD_FACTOR = 3.0
# The floor, in ulps of the tested dtype at the result's magnitude: about the rounding of the
# output itself for fp16/bf16/fp32. For fp64 the same-dtype eager computation *is* the reference
# (error 0), so the floor is the whole bound there: 32 ulps, ~7e-15 relative.
FLOOR_ULPS = {torch.float16: 2, torch.bfloat16: 2, torch.float32: 4, torch.float64: 32}
# The most a same-dtype eager baseline may be off, as a share of the result's largest value: more is not rounding
# (a generous cap: it refuses what is plainly another function, e.g. transformers' eager attention's gradients
# with left padding, 17-110% off the fp64 reference's while the logits agree to 1e-7).
BASELINE_CAP = 0.5


def max_err(actual: torch.Tensor, ref: torch.Tensor) -> float:
    """Max abs difference; matching infinities count as 0, NaN as +inf."""
    a, r = actual.detach().to(torch.float64).cpu(), ref.detach().to(torch.float64).cpu()
    both_inf = torch.isinf(a) & torch.isinf(r) & (torch.sign(a) == torch.sign(r))
    d = torch.where(both_inf, torch.zeros_like(a), (a - r).abs())
    if d.numel() == 0:
        return 0.0
    return float(torch.nan_to_num(d, nan=float("inf")).max())


def tolerance_check(actual: torch.Tensor, ref64: torch.Tensor, eager: torch.Tensor, *, grad: bool = False,
                    scale: float = 0.0) -> tuple[float, float]:
    """(kernel error, allowed bound) under the rule; the check passes when error <= bound.

    scale: a magnitude for the ulp floor when the exact result is ~0 through cancellation (e.g.
    dq with a single key); the floor uses max(|ref64|, scale). A non-finite kernel result where the
    reference is finite has error +inf and always fails; a non-finite eager baseline raises.
    """
    ref64 = ref64.detach()
    dt = actual.dtype
    err_k = max_err(actual, ref64)
    err_e = max_err(eager, ref64)
    if not math.isfinite(err_e):
        # a NaN or a wrong infinity in the baseline would make the bound infinite and let anything
        # (NaN included) pass: the rule needs a sound baseline
        raise ValueError("the same-dtype eager baseline is not finite where the float64 reference is; "
                         "the tolerance rule cannot be applied")
    finite = ref64[torch.isfinite(ref64)]
    largest = float(finite.abs().max()) if finite.numel() else 0.0
    magnitude = max(largest, scale, 1e-3)
    if largest == magnitude and err_e > BASELINE_CAP * magnitude:
        # rounding in the tested dtype, even accumulated through a model, is a fraction of the result; a baseline
        # this far off is broken (a wrong eager formula, or the kernel's own bug), and the bound it makes would let a
        # wrong kernel pass. (Results that cancel to ~0 are judged at `scale` or the 1e-3 floor: not capped.)
        raise ValueError(f"the same-dtype eager baseline is off the float64 reference by {err_e:.3e}, "
                         f"{err_e / magnitude:.0%} of the result's magnitude {magnitude:.3e} (rounding stays under "
                         f"{BASELINE_CAP:.0%}): the tolerance rule needs a sound baseline")
    floor = FLOOR_ULPS.get(dt, 4) * torch.finfo(dt).eps * magnitude
    bound = (GRAD_FACTOR if grad else OUTPUT_FACTOR) * err_e + floor
    return err_k, bound
