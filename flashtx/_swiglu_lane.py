"""The plain SwiGLU call, planned once per call signature: from swiglu / swiglu_packed to the kernel launch in one
dict lookup (as flashtx._attention_lane is for attention and flashtx._rotary_lane for RoPE).

Plain: plain tensors (not subclasses, not Parameters) whose (..., H) rows are a view ((M, H) without a copy), a
bool inplace_backward, the automatic backend or `triton`. The key is what decides the plan: dtype, device, shapes
and strides, whether autograd records the call, inplace_backward and the backend.

A lane is made from the general path's own work: the call's validation (`swiglu._check` / `_check_packed`, which
raise what the general path raises), its backend (which must be `triton`) and the launch cache's entry for the
rows views (`triton_kernels.swiglu.swiglu_entry`, the one swiglu_forward would replay). A call allocates its output
as the op does and fires the entry on the caller's tensors: the launch reads only data pointers, and a rows view
has its tensor's (packed: `up` is x's column H onward, a narrow() of x). With autograd, its node (named as the
op's: Swiglu / SwigluPacked) saves what the op's saves, and its backward fires the entry the op's backward would
replay (in place over the saved inputs, with their version counters bumped, when inplace_backward holds, as
flashtx::swiglu_bwd_ does), kept per forward lane, dout's dtype and strides, and in place or not; the op's
backward (`_swiglu_op._backward`) runs instead for create_graph, saved-tensor hooks, a saved tensor whose `.data`
was swapped, a dout whose rows are not a view, and anything tracing. gate and up overlapping, and a leaf that
requires grad (whose values an in-place backward would overwrite), are checked every call when inplace_backward
is set (they depend on addresses and on the tensors, not their layouts). Every other call returns None, and the
caller takes the general path: empty tensors, tensors on a CUDA device that is not the current one, and plans that
are not Triton's (and lanes.remember's and lanes.eager's rules).

`LANE = False` turns it off (tests and bench/overhead.py compare both).
"""
from __future__ import annotations

import math

import torch

from . import _env, _lanes, _library
from ._library import _C_APPLY, _unwrap_if_dead
from ._swiglu_op import _backward, _backward_packed, refuse_spent
from ._validate import grad_leaf, views_overlap

LANE = _env.HAS_TRITON  # the lanes launch Triton kernels: without triton every call takes the general path

_TENSOR, _STRIDED, _CONTIGUOUS = torch.Tensor, torch.strided, torch.contiguous_format
_INC_VERSION = torch.autograd.graph.increment_version


class _Lane:
    """One call signature's plan: its key, the forward's launch entry (launch.LaunchCache replays), packed: the
    column where up starts and the output's shape, the saved inputs' _lanes.layouts and the backend."""

    __slots__ = ("key", "entry", "h", "out_shape", "saved", "backend")

    def __init__(self, key, entry, h, out_shape, saved, backend):
        self.key, self.entry, self.h, self.out_shape = key, entry, h, out_shape
        self.saved, self.backend = saved, backend


def _rows(*ts):
    """(M, H) views of (..., H) tensors (their data pointers), or None where one is not viewable so."""
    try:
        return [t if t.dim() == 2 else t.view(math.prod(t.shape[:-1]), t.shape[-1]) for t in ts]
    except RuntimeError:
        return None


class Swiglu(torch.autograd.Function):
    """The autograd node of a lane's swiglu: flashtx::swiglu's (saved tensors, arguments, backward)."""

    @staticmethod
    def forward(ctx, gate, up, lane, inplace):
        out = torch.empty_like(gate, memory_format=_CONTIGUOUS)
        _lanes.fire(lane.entry, (gate, up, out, None, None))
        _save(ctx, lane, inplace, gate, up)
        return out

    @staticmethod
    def backward(ctx, dout):
        return _node_backward(ctx, dout, _backward, 2)


class SwigluPacked(torch.autograd.Function):
    """The autograd node of a lane's swiglu_packed: flashtx::swiglu_packed's."""

    @staticmethod
    def forward(ctx, x, lane, inplace):
        out = torch.empty(lane.out_shape, dtype=x.dtype, device=x.device)
        _lanes.fire(lane.entry, (x, x.narrow(-1, lane.h, lane.h), out, None, None))
        _save(ctx, lane, inplace, x)
        return out

    @staticmethod
    def backward(ctx, dout):
        return _node_backward(ctx, dout, _backward_packed, 1)


def _node_backward(ctx, dout, op_backward, n: int) -> tuple:
    """A lane node's gradients for its n tensor inputs (then None for lane and inplace): the lane's backward, or the
    op's (op_backward) where that one does not serve."""
    if ctx.lane is not None and dout is not None:
        refuse_spent(ctx)
        grads = _lane_backward(ctx, dout)
        if grads is not None:
            return (*grads, None, None)
    return (*op_backward(ctx, dout)[:n], None, None)


def _save(ctx, lane, inplace: bool, *inputs) -> None:
    """What the op's setup saves (flashtx._swiglu_op._setup): the inputs, and (in place?, backend)."""
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(*inputs)
    hooks_free = _lanes.no_saved_tensor_hooks()
    # (in place only where every input takes a gradient, as the op's setup: one that needs none keeps its values)
    ctx.args = (inplace and hooks_free and all(t.requires_grad for t in inputs), lane.backend)
    ctx.lane = lane if hooks_free else None  # (hooks may unpack other tensors: the op's path)


def _lane_backward(ctx, dout):
    """The input gradients of a lane's node from the launch entry the op's backward would replay, or None where
    the op's backward must run (module docstring)."""
    if not LANE or type(dout) is not _TENSOR or torch.is_grad_enabled() or not _lanes.eager():
        return None
    lane = ctx.lane
    saved = ctx.saved_tensors
    x = saved[0]
    if _library._other_device(x) is not None:
        return None
    if _lanes.layouts(*saved) != lane.saved:
        return None  # a saved tensor's .data was swapped since the forward: not what the plan reads
    inplace = ctx.args[0]
    key = ("swiglu_bwd", lane, dout.dtype, dout.stride(), inplace)  # (the lane itself: hashed by identity)
    entry = _lanes.TABLE.get(key)
    if entry is None:
        entry = _lanes.remember(key, lambda: _build_backward(dout, saved, inplace, lane))
    if not entry:
        return None
    if len(saved) == 1:  # packed: dx = [dgate | dup], (x, x, dx, dout, dx) in swiglu_backward_packed's roles
        dx = x if inplace else torch.empty_like(x, memory_format=_CONTIGUOUS)
        _lanes.fire(entry, (x, x, dx, dout, dx))
        if inplace:
            _INC_VERSION(x)  # as the in-place op's call does
            ctx.spent = True
            return (x.detach(),)  # (the saved x itself carries the forward's graph: a gradient must not)
        return (dx,)
    gate, up = saved
    if inplace:
        _lanes.fire(entry, (gate, up, gate, dout, up))
        _INC_VERSION(gate)
        _INC_VERSION(up)
        ctx.spent = True
        return gate.detach(), up.detach()  # (the saved tensors carry the forward's graph: a gradient must not)
    dg, du = torch.empty_like(gate, memory_format=_CONTIGUOUS), torch.empty_like(up, memory_format=_CONTIGUOUS)
    _lanes.fire(entry, (gate, up, dg, dout, du))
    return dg, du


def _build_backward(dout, saved, inplace: bool, lane):
    """The backward's launch entry (stored), or False where the op's backward must take these calls (stored)."""
    from .triton_kernels.swiglu import swiglu_entry, swiglu_packed_entry

    rows = _rows(dout, *saved)
    if rows is None:
        return False  # the op's backward works on copies
    if len(saved) == 1:
        do, x = rows
        entry = swiglu_packed_entry(do, x, x if inplace else torch.empty(x.shape, dtype=x.dtype, device=x.device))
    else:
        do, g, u = rows
        if inplace:
            entry = swiglu_entry(g, u, g, do, u)
        else:
            entry = swiglu_entry(g, u, torch.empty(g.shape, dtype=g.dtype, device=g.device), do,
                                 torch.empty(u.shape, dtype=u.dtype, device=u.device))
    return entry if type(entry) is list else False


def _bound(fn):
    return _C_APPLY.__get__(None, fn) if _C_APPLY is not None and _unwrap_if_dead else fn.apply


_APPLY, _APPLY_PACKED = _bound(Swiglu), _bound(SwigluPacked)


def _plain(t, inplace_backward, backend) -> bool:
    return (type(t) is _TENSOR and t.layout is _STRIDED and not t.is_nested  # (those refused there)
            and (inplace_backward is False or inplace_backward is True)
            and (backend is None or type(backend) is str))


def forward(gate, up, inplace_backward, backend):
    """swiglu(gate, up, inplace_backward=..., backend=...)'s result, or None where the lane does not take the call
    (module docstring): the caller runs the general path."""
    if not LANE or not _plain(gate, inplace_backward, backend) or type(up) is not _TENSOR or \
            up.layout is not _STRIDED or up.is_nested or not _lanes.eager() or \
            _library._other_device(gate) is not None or gate.is_neg() or up.is_neg():  # (a negated view: refused
        # there; Dynamo cannot trace is_neg)
        return None
    grad = torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad)
    key = ("swiglu", gate.dtype, gate.device, gate.shape, gate.stride(), up.dtype, up.device, up.shape, up.stride(),
           grad, inplace_backward, backend)
    lane = _lanes.TABLE.get(key)
    if lane is None:
        lane = _make(key, (gate, up), inplace_backward, backend)
    if not lane or (inplace_backward and (views_overlap(gate, up) or (grad and (grad_leaf(gate) or grad_leaf(up))))):
        return None  # (overlapping gate and up, or a leaf's values to overwrite: the general path refuses them)
    if grad:
        return _APPLY(_unwrap_if_dead(gate), _unwrap_if_dead(up), lane, inplace_backward)
    out = torch.empty_like(gate, memory_format=_CONTIGUOUS)
    _lanes.fire(lane.entry, (gate, up, out, None, None))
    return out


def forward_packed(x, inplace_backward, backend):
    """swiglu_packed(x, ...)'s result, or None where the lane does not take the call."""
    if not LANE or not _plain(x, inplace_backward, backend) or not _lanes.eager() or \
            _library._other_device(x) is not None or x.is_neg():
        return None
    grad = torch.is_grad_enabled() and x.requires_grad
    key = ("swiglu_packed", x.dtype, x.device, x.shape, x.stride(), grad, inplace_backward, backend)
    lane = _lanes.TABLE.get(key)
    if lane is None:
        lane = _make(key, (x,), inplace_backward, backend)
    if not lane or (inplace_backward and grad and grad_leaf(x)):
        return None  # (a leaf's values to overwrite: the general path refuses it)
    if grad:
        return _APPLY_PACKED(_unwrap_if_dead(x), lane, inplace_backward)
    out = torch.empty(lane.out_shape, dtype=x.dtype, device=x.device)
    _lanes.fire(lane.entry, (x, x.narrow(-1, lane.h, lane.h), out, None, None))
    return out


def _make(key, inputs, inplace_backward, backend):
    """The lane for `key` (stored), False where the general path must take these calls (stored too), or None
    where it must take this one for what the inputs alone show (not stored)."""
    from .swiglu import _check, _check_packed, _select  # (the package's `swiglu` is the function)

    x = inputs[0]
    if len(inputs) == 2:
        _check(*inputs, inplace_backward)  # raises what the general path raises
    else:
        _check_packed(x, inplace_backward)
    if x.numel() == 0:
        return None  # nothing to launch: the general path's
    if _select(x, backend) != "triton":
        return _lanes.remember(key, lambda: False)
    from .triton_kernels.swiglu import swiglu_entry

    def build():
        rows = _rows(*inputs)
        if rows is None:
            return False  # the op reads a copy
        if len(inputs) == 2:
            h, out_shape = None, None
            g, u = rows
        else:
            h = x.shape[-1] // 2
            out_shape = (*x.shape[:-1], h)
            g, u = rows[0][:, :h], rows[0][:, h:]
        entry = swiglu_entry(g, u, torch.empty(g.shape, dtype=x.dtype, device=x.device))
        if type(entry) is not list:
            return False  # not replayable: the general path plans each call
        return _Lane(key, entry, h, out_shape, _lanes.layouts(*inputs), "triton")
    return _lanes.remember(key, build)
