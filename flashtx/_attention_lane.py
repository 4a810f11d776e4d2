"""The plain attention call, planned once per call signature: from the public shell to the kernel launch in
one dict lookup.

A model calls attention with the same few signatures over and over, and most of them take no tensor option:
no mask, bias, lengths, ALiBi, dropout or lse, the automatic backend or `triton`, at most a sliding window and
a softcap (Mistral's, Gemma 2's: scalars). For those, `flashtx.attention`, `flash_attn_func` and the patched
SDPA hand their validated q, k, v (and window, softcap) to `forward` here. It keys the call on what decides its
plan: dtype, device, shapes and strides, scale, causal alignment, window, softcap, layout, whether autograd
records it, torch's TF32 switch (fp32) and the small-query route's bound. The entry
("lane") holds the attention forward's memoised launches (the LaunchCache entry that attention_forward
itself would replay) and the op's arguments for the backward. A call then allocates out and the row
statistics and fires the launches: no argument lists, no op dispatch, no planning.

Nothing here decides anything the general path (functional._run -> the flashtx::attn_fwd op) does not: a
lane is made from that path's own plan (`_attention_op._plan`, which must choose `triton`) and launch
entry; its autograd node (named as the op's, AttnFwd) saves what the op's saves, with out as its one output (a
hook on the node sees one gradient, not the op's three: m2 and l2 are saved, not returned), and its backward
fires the launch entry the op's backward (flashtx::attn_bwd) would replay, kept per forward lane and dout
strides (`_lane_backward`; the op's `_attention_op._backward` wherever that one refuses); and the lanes are
dropped whenever plans or launch entries are (`_dispatch.clear_plans`, `LaunchCache.clear`, a tuner starting),
a lane made across a drop (another thread) included. Every other call returns None, and the caller takes the general
path: while anything traces (torch.compile sees the op, not this), under functorch transforms, tensor
subclasses (Parameters too), on a CUDA device that is not the current one, with the launch cache off (a
tuner), strided last dims, empty tensors, sequences past MAX_SEQ, the small-query decode route's calls
(flashtx._small_q), and wherever the plan is not Triton's. Refusals that the inputs alone show are not
stored (a decode loop's growing key count would fill the table).

`LANE = False` turns it off (bench/overhead.py times both; tests compare them).
"""
from __future__ import annotations

import torch

from . import _lanes, _library, _small_q
from ._attention_op import GRAD, NO_GRAD, _backward, _plan, empty_like_layout, spec_of
from ._library import _C_APPLY, _unwrap_if_dead
from .triton_kernels import precision
from .triton_kernels.limits import MAX_SEQ, LimitExceeded

LANE = True

_NO_AUX = [None] * 8  # _attention_op.Aux, every entry None
_NO_WINDOW = (-1, -1)
_TENSOR, _F32 = torch.Tensor, torch.float32


class _Lane:
    """One call signature's plan: its key, the forward's launch entry (a list of launch.LaunchCache replays), the
    row statistics' shape and dtype, and the op's (aux, ints, floats, backend) for its backward."""

    __slots__ = ("key", "entry", "aligned", "lse_shape", "acc", "dv", "args", "saved")

    def __init__(self, key, entry, aligned, lse_shape, acc, dv, args, saved):
        self.key, self.entry, self.aligned, self.lse_shape = key, entry, aligned, lse_shape
        self.acc, self.dv, self.args = acc, dv, args
        self.saved = saved  # _lanes.layouts of q, k, v, out, as the forward saves them

    def run(self, q, k, v):
        """(out, m2, l2) of the forward, allocated as the op allocates them."""
        out = empty_like_layout(q, self.dv)  # like q: (B, Hq, Sq, Dv), or (B, Sq, Hq, Dv) with bshd
        dev = q.device
        m2 = torch.empty(self.lse_shape, dtype=self.acc, device=dev)  # (B, Hq, Sq)
        l2 = torch.empty(self.lse_shape, dtype=self.acc, device=dev)
        tensors = (q, k, v, out, m2, l2)  # attention_fwd's roles, in order
        _lanes.fire(self.entry, tensors)
        return out, m2, l2


class AttnFwd(torch.autograd.Function):
    """The autograd node of a lane's forward: the flashtx::attn_fwd op's (its name, saved tensors and arguments,
    its backward's launches), with out alone as output (m2, l2 are saved, not returned: the lane's callers
    return no lse, so their cotangent is always None)."""

    @staticmethod
    def forward(ctx, q, k, v, lane):
        out, m2, l2 = lane.run(q, k, v)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(q, k, v, out, m2, l2, None)
        ctx.args = lane.args
        ctx.lane = lane if _lanes.no_saved_tensor_hooks() else None  # (hooks may unpack other tensors: the op's path)
        return out

    @staticmethod
    def backward(ctx, dout):
        if ctx.lane is not None and dout is not None:
            grads = _lane_backward(ctx, dout)
            if grads is not None:
                return (*grads, None)
        dq, dk, dv = _backward(ctx, dout, None, None)[:3]
        return dq, dk, dv, None


def _lane_backward(ctx, dout):
    """(dq, dk, dv) of a lane's forward from the backward's launch entry, kept per forward lane and dout strides
    (and the TF32 switch, which the backward reads again), as the op's backward (flashtx::attn_bwd) computes them:
    the same entry, which launch.LaunchCache would replay there. None where the op's backward must run: the
    lanes off, a dout with a strided last dim (the backend copies it first), create_graph (the op refuses a
    double backward), anything tracing or intercepting, q not on the current CUDA device, saved tensors whose
    .data was swapped for another shape or layout, a backward the launch cache cannot replay (a GQA dK/dV split,
    a plan that does not fit these inputs' alignment)."""
    if not LANE or type(dout) is not _TENSOR or dout.stride(3) != 1 or torch.is_grad_enabled() or not _lanes.eager():
        return None
    lane = ctx.lane
    q, k, v, out, m2, l2, _ = ctx.saved_tensors
    if _library._other_device(q) is not None:
        return None
    if _lanes.layouts(q, k, v, out) != lane.saved:
        return None  # a saved tensor's .data was swapped since the forward: not what the plan reads
    key = ("attn_bwd", lane.key, dout.stride(), q.dtype is _F32 and precision.allow_tf32())
    entry = _lanes.TABLE.get(key)
    if entry is None:
        entry = _lanes.remember(key, lambda: _build_backward(dout, q, k, v, out, m2, l2, lane))
    if not entry:
        return None
    dq, dk, dv, delta = _grads_like(q, k, v, lane)
    tensors = (dout, q, k, v, out, m2, l2, dq, dk, dv, None, None, delta, None, None)  # attention_bwd's roles
    if type(entry) is not list and not entry.holds(tensors):
        return None  # planned for 16-byte aligned inputs (TMA descriptors) that these are not
    _lanes.fire(entry, tensors)
    return dq, dk, dv


def _grads_like(q, k, v, lane) -> tuple:
    """(dq, dk, dv, delta) allocated as the op's backward allocates them: each gradient laid out like its input,
    delta (B, Hq, Sq) in the accumulator dtype, as attention_backward's."""
    return (empty_like_layout(q, q.shape[3]), empty_like_layout(k, k.shape[3]), empty_like_layout(v, lane.dv),
            torch.empty(lane.lse_shape, dtype=lane.acc, device=q.device))


def _build_backward(dout, q, k, v, out, m2, l2, lane):
    """The backward's launch entry for a lane (stored), or False where the op's backward must take it (stored)."""
    from .triton_kernels.attention_bwd import backward_entry

    ints, floats, backend, _ = lane.args
    if _plan(q, k, v, None, _NO_AUX, ints, floats, backend, True) != "triton":  # as the op's backward plans (again)
        return False
    dq, dk, dv, delta = _grads_like(q, k, v, lane)
    try:
        entry = backward_entry(dout, q, k, v, out, m2, l2, dq, dk, dv, delta, scale=floats[0],
                               causal=bool(ints[0]), bottom_right=bool(ints[1]), bshd=bool(ints[7]),
                               spec=spec_of(None, _NO_AUX, ints, floats, True))
    except LimitExceeded:
        return False  # the op's backward re-plans it (and says why)
    return entry if entry is not None else False


_apply = _C_APPLY.__get__(None, AttnFwd) if _C_APPLY is not None and _unwrap_if_dead else AttnFwd.apply


def forward(q, k, v, scale: float, causal: bool, bottom_right: bool, bshd: bool, backend: str | None = None,
            window: tuple = _NO_WINDOW, softcap: float = 0.0):
    """out of attention over validated 4-D q, k, v (plain tensors: (B, H, S, D), or (B, S, H, D) with bshd) with
    no mask, bias, lengths, ALiBi, dropout or lse, as the general path (functional._run) returns it, or None where
    the lane does not take the call (module docstring): the caller runs the general path. backend: the caller's,
    None or a name (the lane serves the calls planned for `triton`); window: validated (left, right) ints (-1:
    unbounded), aligned as causal is; softcap: a validated float, 0.0 for none."""
    if not LANE or not _lanes.eager():
        return None
    if type(q) is not _TENSOR or type(k) is not _TENSOR or type(v) is not _TENSOR:
        return None  # a subclass (a Parameter too) goes through the registered op
    if _library._other_device(q) is not None:
        return None  # the general path makes q's device current first (flashtx._library.call)
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    dtype = q.dtype
    key = (dtype, q.device, q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), scale, causal,
           bottom_right, bshd, grad, dtype is _F32 and precision.allow_tf32(), backend, _small_q.SMALL_Q_MAX, window,
           softcap)
    lane = _lanes.TABLE.get(key)
    if lane is None:
        lane = _make(key, q, k, v, scale, causal, bottom_right, bshd, grad, backend or "", window, softcap)
    if not lane:
        return None
    if lane.aligned and not lane.entry.holds((q, k, v)):
        return None  # planned for 16-byte aligned K, V (TMA descriptors) that these are not
    if not grad:
        return lane.run(q, k, v)[0]
    return _apply(_unwrap_if_dead(q), _unwrap_if_dead(k), _unwrap_if_dead(v), lane)


def _make(key, q, k, v, scale, causal, bottom_right, bshd, grad, backend: str, window: tuple, softcap: float):
    """The lane for `key` (stored), False where the general path must take these calls after planning them
    (stored too), or None where it must take them for what the inputs alone show, or this call cannot tell
    (not stored: a decode loop's growing keys would fill the table)."""
    B, Sq, Hq = (q.shape[0], q.shape[1], q.shape[2]) if bshd else (q.shape[0], q.shape[2], q.shape[1])
    Sk = k.shape[1] if bshd else k.shape[2]
    if not (0 < Sq <= MAX_SEQ and 0 < Sk <= MAX_SEQ and B > 0 and Hq > 0 and v.shape[3] > 0):
        return None  # refused past MAX_SEQ, or the launcher's early returns: the general path's
    if not grad and Sk > Sq and Sq <= _small_q.SMALL_Q_MAX:
        return None  # the small-query decode route's (whether or not it takes them)
    if q.stride(3) != 1 or k.stride(3) != 1 or v.stride(3) != 1:
        return None  # the backend copies them first
    from .triton_kernels.attention_fwd import forward_entry
    from .triton_kernels.launch import TORCH_ACC_DTYPE, _AlignedEntry

    return _lanes.remember(key, lambda: _build(key, q, k, v, B, Hq, Sq, scale, causal, bottom_right, bshd, grad,
                                               backend, window, softcap, forward_entry, _AlignedEntry,
                                               TORCH_ACC_DTYPE[q.dtype]))


def _build(key, q, k, v, B, Hq, Sq, scale, causal, bottom_right, bshd, grad, backend, window, softcap, forward_entry,
           aligned_type, acc):
    dv = v.shape[3]
    ints = [int(causal), int(bottom_right), window[0], window[1], 0, 0, GRAD if grad else NO_GRAD,
            int(bshd)]  # _attention_op.Ints
    floats = [scale, softcap, 0.0]  # _attention_op.Floats
    if _plan(q, k, v, None, _NO_AUX, ints, floats, backend, True) != "triton":  # raises as the op would
        return False
    out = empty_like_layout(q, dv)
    m2 = torch.empty(B, Hq, Sq, dtype=acc, device=q.device)
    try:
        entry = forward_entry(q, k, v, out, m2, torch.empty_like(m2), scale=scale, causal=causal,
                              bottom_right=bottom_right, bshd=bshd, spec=spec_of(None, _NO_AUX, ints, floats, True))
    except LimitExceeded:
        return False  # the general path re-plans it (and says why)
    if entry is None:
        return False  # not replayable: the general path plans each call
    aligned = type(entry) is aligned_type
    if aligned and not all(i < 3 for i in entry.need):
        return False  # (only K and V are read through descriptors today)
    if aligned and not entry.holds((q, k, v)):
        return None  # planned for aligned inputs that these are not
    return _Lane(key, entry, aligned, (B, Hq, Sq), acc, dv, (ints, floats, backend, len(_NO_AUX)),
                 _lanes.layouts(q, k, v, out))
