"""RoPE in place on a fused QKV projection under autograd (flash-attn's ``ApplyRotaryEmbQKV_``).

Rotating q and k out of place, as autograd otherwise needs, leaves attention saving the rotated copies while the
projection itself stays alive through v (a view of it): (Hq + 2 Hkv) + (Hq + Hkv) heads of activations per layer
where the projection's (Hq + 2 Hkv) suffice. Here the q and k heads of the projection's output are rotated in place
by an autograd node that marks it dirty, and its backward rotates the incoming gradient's q and k heads back (by
-theta) in place: attention then saves views of the one rotated projection.

The node takes the projection's own (B * S, N) output, never a view of it: marking a view dirty makes autograd
copy the whole base's gradient (CopySlices). A Linear with a bias returns a view of its (B * S, N) addmm result,
so that result is what the node rotates. Eager only (torch.compile decides for itself what it keeps).
"""
from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable
from torch.nn.modules import module as _module

from .. import _lanes, _rotary_lane
from .._library import _C_APPLY, _unwrap_if_dead
from ..rotary import apply_rotary_qk


def projection_base(proj: Tensor) -> Tensor | None:
    """The tensor the in-place node rotates for proj (B, S, N): proj's base when proj is a contiguous view of all of
    it (a Linear with bias: its (B * S, N) addmm result), proj itself when it is no view (a Linear without bias);
    None where the node cannot take it (a non-contiguous output, a view of part of a tensor, a subclass)."""
    if type(proj) is not Tensor or not proj.is_contiguous():
        return None
    base = proj._base if proj._is_view() else proj
    if base is None or type(base) is not Tensor or base._is_view() or not base.is_contiguous() \
            or base.numel() != proj.numel() or base.data_ptr() != proj.data_ptr():
        return None
    return base


# Projections below this many elements rotate out of place: the node's Python (~50 us more per forward + backward,
# measured on CPU with the launches stubbed) costs more than the memory it saves is worth where a step waits on the
# host; the packed forms' threshold (flashtx._packing.MIN_NUMEL), for the same reason.
MIN_NUMEL = 1 << 20


def backward_hooked(module: torch.nn.Module) -> bool:
    """Whether a module backward hook (the module's own, full or not, or a global one) watches module's output: it
    sits on the output's own autograd node (register_full_backward_hook's BackwardHookFunction view), which the node
    here would leave off the gradient's path by rotating the projection's base (the hook never fired)."""
    return bool(module._backward_hooks or module._backward_pre_hooks or _module._global_backward_hooks
                or getattr(_module, "_global_backward_pre_hooks", None))


def eligible(proj: Tensor) -> bool:
    """Whether a training call rotates the projection in place: autograd records it, nothing traces or intercepts
    it (Dynamo sees the out-of-place form), the projection has MIN_NUMEL elements or more, and it is its own
    (B * S, N) tensor or a view of one."""
    return torch.is_grad_enabled() and proj.requires_grad and _lanes.eager() and proj.numel() >= MIN_NUMEL \
        and projection_base(proj) is not None  # (eager() before numel(): a traced size is not compared, not guarded)


class RotateQK(torch.autograd.Function):
    """base (projection_base's) -> base with its q and k heads (of its (B, S, Hq + 2 Hkv, D) view) rotated in
    place."""

    @staticmethod
    def forward(ctx, base, shape, heads, cos, sin, interleaved, backend):
        ctx.mark_dirty(base)
        ctx.args = (shape, heads, cos, sin, interleaved, backend)
        with torch.no_grad():
            _rotate(base, shape, heads, cos, sin, interleaved, backend)
        return base

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        shape, heads, cos, sin, interleaved, backend = ctx.args
        if grad is None:
            return (None,) * 7
        # in place, as flash-attn's: the gradient autograd hands this node is the projection's alone (its one
        # consumer, the split's backward, made it); a strided one (an expand from a hook) is copied first
        grad = grad.contiguous()
        _rotate(grad, shape, heads, cos, -sin, interleaved, backend)  # by -theta: the rotation's transpose
        return grad, None, None, None, None, None, None


def _rotate(t: Tensor, shape: tuple, heads: tuple, cos: Tensor, sin: Tensor, interleaved: bool, backend) -> None:
    """Rotate the q and k heads of t's (B, S, Hq + 2 Hkv, D) view in place, positions 0 .. S - 1."""
    hq, hkv = heads
    qkv = t.view(shape)
    q, k = qkv[:, :, :hq], qkv[:, :, hq:hq + hkv]  # disjoint head ranges: the lane skips its overlap search
    if _rotary_lane.rotate(q, k, cos, sin, 0, interleaved, "bshd", True, backend, disjoint=True) is None:
        apply_rotary_qk(q, k, cos, sin, interleaved=interleaved, inplace=True, backend=backend)


def rotate_qk_(proj: Tensor, shape: tuple, heads: tuple, cos: Tensor, sin: Tensor, interleaved: bool,
               backend) -> Tensor:
    """proj (B, S, N) with the q and k heads of its (B, S, Hq + 2 Hkv, D) view `shape` rotated in place, recorded by
    autograd (RotateQK); for an `eligible` proj. Returns the rotated projection as a (B, S, N) view."""
    base = projection_base(proj)
    return _apply(base, shape, heads, cos, sin, interleaved, backend).view(proj.shape)


_apply = _C_APPLY.__get__(None, RotateQK) if _C_APPLY is not None and _unwrap_if_dead else RotateQK.apply
