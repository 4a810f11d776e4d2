"""The attention kernels' shape rules, in ints (no triton import: dispatch's reasons use them too): the
(B, H, S, D) views they plan on, and their limits.

The kernels put heads and batch (or sequences) on CUDA grid dims y and z, and index within one
(batch, head) slice with int32 offsets. The launchers check these once per call signature, when a
launch is planned (a replayed launch has the shapes and strides it was planned for), and raise
LimitExceeded; the attention op then resolves its backend again, uncached, so the reasons say which
limit (a requested `triton` raises them; automatic dispatch warns and runs `reference`).
"""
from __future__ import annotations

INT32_MAX = 2**31 - 1  # kernels index within a (batch, head) slice with int32 offsets
MAX_GRID_YZ = 65535  # CUDA's limit on grid dims y and z, where the kernels put heads and batch
# The longest sequence the kernels take (queries or keys, a decode cache's capacity). Window bounds are
# int32 in the kernels, added to positions and tile offsets: a bound at or past MAX_SEQ sees every key of
# such a sequence, so the host takes it as -1 (unbounded, flashtx._validate.check_window), and a sum of three
# such terms (e.g. the backward's key tile + BLOCK_N + Sq - Sk + left) stays below 2**31.
MAX_SEQ = 2**29


def surely(cond) -> bool:
    """cond as a bool: itself, or a traced condition's value where the trace can decide it (guarding on it, as
    `if cond` does); False where it depends on a size read on the device (an unbacked SymInt of unpad_input's
    total under torch.compile), which `if cond` cannot trace. For early outs (an empty output) whose other
    branch also serves the case (a launch over an empty grid does nothing)."""
    if not _traced(cond):
        return cond
    from torch.fx.experimental.symbolic_shapes import guard_or_false  # (sympy: only when tracing)
    return guard_or_false(cond)


def undecided(cond) -> bool:
    """Whether a traced condition cannot be decided on the host (it depends on a value read on the device, an
    unbacked SymInt), without guarding on it."""
    if not _traced(cond):
        return False
    from torch.fx.experimental.symbolic_shapes import guard_or_false, guard_or_true  # (sympy: only when tracing)

    return guard_or_false(cond) != guard_or_true(cond)


def unbacked(n) -> bool:
    """Whether n is a traced size that depends on a value read on the device (an unbacked SymInt), in an op's traced
    implementation (not under Dynamo, which shows SymInts as ints)."""
    import torch
    if not isinstance(n, torch.SymInt):
        return False
    from torch.fx.experimental.symbolic_shapes import has_free_unbacked_symbols  # (sympy: only when tracing)
    return has_free_unbacked_symbols(n)


def exporting() -> bool:
    """torch.compiler.is_exporting(), right under torch.compile too: torch 2.11's Dynamo folds that call to True in
    every trace, torch.compile's included (pytorch/pytorch#176347, fixed by #176499). This reads the flag strict and
    non-strict export set (torch._export.utils._compiling_state_context), which the fixed call returns."""
    import torch
    if hasattr(torch.compiler, "_is_exporting_flag"):
        return torch.compiler._is_exporting_flag
    return torch.compiler.is_exporting()


def least(a, b):
    """min(a, b); in a traced op implementation torch.sym_min, which does not guard on which is smaller (min()
    does, and cannot when one was read on the device: a max_seqlen bound against unpad_input's total). Dynamo
    traces min() itself so (and torch 2.11's cannot trace sym_min)."""
    import torch
    if torch.compiler.is_dynamo_compiling() or not (isinstance(a, torch.SymInt) or isinstance(b, torch.SymInt)):
        return min(a, b)
    return torch.sym_min(a, b)


def _traced(cond) -> bool:
    """Whether cond may be symbolic: Dynamo is tracing (it shows a SymBool as a bool, and guards on isinstance), or
    cond is a SymBool (a traced op implementation's)."""
    import torch
    return torch.compiler.is_compiling() or isinstance(cond, torch.SymBool)


class LimitExceeded(RuntimeError):
    """The inputs exceed a shape limit of the Triton attention kernels (see within_limits)."""


def bhsd(bshd: bool, *ts) -> tuple:
    """ts as the (B, H, S, D) views the kernels plan on: their transposes when they are (B, S, H, D)
    tensors (flash-attn's layout, the attention ops' Ints.bshd), else themselves."""
    return tuple(t.transpose(1, 2) for t in ts) if bshd else ts


def seq_span(t) -> int:
    """Elements the sequence dim of a (B, H, S, D) view spans as the kernels read it: S x its stride, or
    S x D when the last stride is not 1 (the backend copies such a tensor contiguous first)."""
    st = t.stride()
    return t.shape[2] * (st[2] if st[3] == 1 or t.shape[3] == 1 else t.shape[3])


def span_too_wide(t) -> bool:
    """Whether seq_span(t) passes INT32_MAX, compared as S > INT32_MAX // step (the same for positive ints): a traced
    S is then bounded by an integer, not by a fraction (torch.export cannot phrase a fix for an unbounded Dim
    against s <= 2147483647/64, and fails on an internal assertion)."""
    st = t.stride()
    step = st[2] if st[3] == 1 or t.shape[3] == 1 else t.shape[3]
    return step > 0 and t.shape[2] > INT32_MAX // step


def check_spans(**views) -> None:
    """Raise LimitExceeded when a (B, H, S, D) view's seq_span passes int32: for the tensors a launcher plans with
    beyond q, k, v (checked by within_limits, before dispatch): the outputs and gradients it allocates dense (whose
    rows can be wider than those of expanded or overlapping inputs) and the incoming gradient."""
    for name, t in views.items():
        if t is not None and span_too_wide(t):
            raise LimitExceeded(f"{name} {tuple(t.shape)} (B, H, S, D) with strides {t.stride()}: its sequence span "
                                f"({seq_span(t)} elements) overflows the kernels' int32 offsets")


def mask_span(m) -> int:
    """Elements one (batch, head) slice of a 4-D attn_mask view spans (strides are never negative)."""
    return sum((n - 1) * abs(st) for n, st in zip(m.shape[2:], m.stride()[2:]))


def within_limits(q, k, v, bias, cu_seqlens_q) -> bool:
    """Whether (B, H, S, D) views q, k, v (and a 4-D attn_mask view `bias`, varlen's cu_seqlens_q) fit
    the grid and int32-offset limits."""
    qs = q.shape
    if qs[0] > MAX_GRID_YZ or qs[1] > MAX_GRID_YZ or (
            cu_seqlens_q is not None and cu_seqlens_q.shape[0] - 1 > MAX_GRID_YZ):
        return False
    if span_too_wide(q) or span_too_wide(k) or span_too_wide(v):
        return False  # strides are never negative; a stride of 0 spans nothing
    if qs[2] > MAX_SEQ or k.shape[2] > MAX_SEQ:
        return False  # (a stride-0 view can be that long: window bounds would reach 2**31)
    return bias is None or mask_span(bias) <= INT32_MAX


def check_limits(q, k, v, bias, cu_seqlens_q) -> None:
    """Raise LimitExceeded unless within_limits."""
    if not within_limits(q, k, v, bias, cu_seqlens_q):
        raise LimitExceeded(f"attention inputs {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)} exceed the "
                            "Triton kernels' grid or int32-offset limits")
