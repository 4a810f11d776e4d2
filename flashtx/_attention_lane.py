"""Attention calls planned once per call signature: from the public shell to the kernel launch in one dict
lookup.

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

Calls with option tensors take two more lanes, built the same way:
- `forward_op`: what functional._run would hand the op (the padded shells' key/query masks, lengths, attn_mask,
  ALiBi slopes, dropout's seed; varlen with ALiBi or dropout), without lse or probabilities. A learned bias (an
  attn_mask that requires grad) is an input of its node too (AttnFwdBias), whose backward fires the entry
  attention_backward would replay, its bias-gradient buffer and reduce included.
  The option tensors are keyed by their layouts (dtype, shape, strides), never their values: each call's own
  tensors are bound in their launch roles (MaskSpec.launch_key's order, `masks_of`) and saved as the op saves
  them, so autograd's in-place check covers them too.
- `varlen`: flash_attn_varlen_func's common call (cu_seqlens, a window, a softcap). Its node takes the packed
  (total, H, D) tensors themselves, with no unsqueeze or select nodes around it (as many nodes again as the call's
  own), and its launches, planned on the (1, total, H, D) views the op takes, bind the packed tensors (the kernels
  read pointers; the strides were planned). Where its backward lane declines, the op's backward runs on those
  views.

`LANE = False` turns them off (bench/overhead.py times both; tests compare them).
"""
from __future__ import annotations

import torch

from . import _env, _lanes, _library, _small_q
from ._attention_op import (BIAS_GRAD, GRAD, NO_GRAD, _all_none, _backward, _plan, attn_bwd, empty_like_layout,
                            out_layout, savable, spec_of)
from ._library import _C_APPLY, _unwrap_if_dead, call
from ._packing import MIN_NUMEL, grads_like, part_stride
from .triton_kernels import precision
from .triton_kernels.limits import INT32_MAX, MAX_SEQ, LimitExceeded

LANE = _env.HAS_TRITON  # the lanes launch Triton kernels: without triton every call takes the general path

_NO_AUX = [None] * 8  # _attention_op.Aux, every entry None
_NO_WINDOW = (-1, -1)
_TENSOR, _F32 = torch.Tensor, torch.float32


class _Lane:
    """One call signature's plan: its key, the forward's launch entry (a list of launch.LaunchCache replays), the
    row statistics' shape and dtype, and the op's (aux, ints, floats, backend) for its backward."""

    __slots__ = ("key", "entry", "aligned", "lse_shape", "acc", "dv", "args", "saved", "like", "out_geometry")

    def __init__(self, key, entry, aligned, lse_shape, acc, dv, args, saved, packed=False):
        self.key, self.entry, self.aligned, self.lse_shape = key, entry, aligned, lse_shape
        self.acc, self.dv, self.args = acc, dv, args
        self.saved = saved  # _lanes.layouts of q, k, v, out and the mask tensors, as the forward saves them
        # how gradients are allocated: like the op's (B, H, S, D) views or (B, S, H, D) tensors, or (packed: varlen's
        # (total, H, D) tensors) as (total, H, D) tensors whose unsqueeze(0) the launches were planned on
        self.like = packed_like if packed else empty_like_layout
        # the output's (size, stride), as _attention_op.out_layout allocates it (the key holds the shapes); None where
        # out_layout lays it out as q (self.like's order)
        self.out_geometry = _out_geometry(lse_shape, dv, bool(args[0][7]), packed)  # args[0][7]: Ints.bshd

    def run(self, q, k, v, masks: tuple = ()):
        """(out, m2, l2) of the forward, allocated as the op allocates them. masks: () for a plain lane, else the
        option tensors in MASK_ROLES' order (masks_of)."""
        geometry = self.out_geometry  # as the op allocates it (out_layout)
        out = (self.like(q, self.dv) if geometry is None else
               torch.empty_strided(geometry[0], geometry[1], dtype=q.dtype, device=q.device))
        dev = q.device
        m2 = torch.empty(self.lse_shape, dtype=self.acc, device=dev)  # (B, Hq, Sq)
        l2 = torch.empty(self.lse_shape, dtype=self.acc, device=dev)
        tensors = (q, k, v, out, *masks, m2, l2)  # attention_fwd's roles, in order
        _lanes.fire(self.entry, tensors)
        return out, m2, l2


def _out_geometry(lse_shape: tuple, dv: int, bshd: bool, packed: bool) -> tuple | None:
    """(size, stride) of _attention_op.out_layout's output for q of these (B, Hq, Sq) and dv (packed: of the
    (total, Hq, Dv) tensor its (1, total, Hq, Dv) output views), or None where out_layout lays it out as q."""
    B, H, S = lse_shape
    if S * H * dv > INT32_MAX:
        return None
    if packed:
        return (S, H, dv), (H * dv, dv, 1)
    if bshd:
        return (B, S, H, dv), (S * H * dv, H * dv, dv, 1)
    return (B, H, S, dv), (S * H * dv, dv, H * dv, 1)


def packed_like(t, last_dim: int):
    """Uninitialised (total, H, last_dim) tensor whose two first dims are ordered in memory as packed t's (varlen's
    (total, H, D) q, k, v), as empty_like_layout orders t.unsqueeze(0)'s, its batch dim aside. A replay planned on
    its unsqueeze(0) binds it itself: the kernels read pointers, and the strides were planned."""
    if last_dim == t.shape[2] and t.stride(2) == 1:
        return torch.empty_like(t)
    T, H = t.shape[:2]
    if t.stride(0) >= t.stride(1):
        return torch.empty(T, H, last_dim, dtype=t.dtype, device=t.device)
    return torch.empty(H, T, last_dim, dtype=t.dtype, device=t.device).transpose(0, 1)


def masks_of(bias, aux) -> tuple:
    """The option tensors of an attn_fwd call (its bias and Aux list) in the launchers' MASK_ROLES order (key mask,
    query mask, q/kv lengths, cu_seqlens q/k, attn_mask, ALiBi slopes, dropout seed): MaskSpec.launch_key's."""
    return (*aux[:6], bias, aux[6], aux[7])


def _saved_masks(bias, aux) -> tuple:
    """masks_of the tensors the op's node saves after q, k, v, out, m2, l2 (bias, then Aux's, or bias None alone for
    a call without options)."""
    return () if not aux else masks_of(bias, aux)


class AttnFwd(torch.autograd.Function):
    """The autograd node of a lane's forward: the flashtx::attn_fwd op's (its name, saved tensors and arguments,
    its backward's launches), with out alone as output (m2, l2 are saved, not returned: the lane's callers
    return no lse, so their cotangent is always None)."""

    @staticmethod
    def forward(ctx, q, k, v, lane, masks):
        out, m2, l2 = lane.run(q, k, v, masks)
        ctx.set_materialize_grads(False)
        if masks:  # as the op saves them: bias, then the Aux tensors (its args say none is None: n_none 0)
            ctx.save_for_backward(q, k, v, out, m2, l2, *map(savable, (masks[6], *masks[:6], masks[7], masks[8])))
        else:
            ctx.save_for_backward(q, k, v, out, m2, l2, None)
        ctx.args = lane.args
        ctx.lane = lane if _lanes.no_saved_tensor_hooks() else None  # (hooks may unpack other tensors: the op's path)
        ctx.packed = lane.like is packed_like
        return out

    @staticmethod
    def backward(ctx, dout):
        if ctx.lane is not None and dout is not None:
            grads = _lane_backward(ctx, dout)
            if grads is not None:
                return (*grads, None, None)
        if ctx.packed and dout is not None:  # the op's backward on the (1, total, H, D) views it plans for
            q, k, v, out, m2, l2, bias, *aux = ctx.saved_tensors
            ints, floats, backend, _ = ctx.args
            grads = call(attn_bwd, dout.unsqueeze(0), q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0),
                         out.unsqueeze(0), m2, l2, None, bias, aux, ints, floats, backend, False)
            return grads[0][0], grads[1][0], grads[2][0], None, None
        dq, dk, dv = _backward(ctx, dout, None, None)[:3]
        return dq, dk, dv, None, None


def _lane_backward(ctx, dout, learned: bool = False):
    """(dq, dk, dv) of a lane's forward from the backward's launch entry, kept per forward lane and dout strides
    (and the TF32 switch, which the backward reads again), as the op's backward (flashtx::attn_bwd) computes them:
    the same entry, which launch.LaunchCache would replay there. learned: the node's bias requires grad (its
    gradient is returned fourth; the entry then holds the bias gradient's buffer and reduce: a _HostEntry). A dout
    with a strided last dim (out.sum()'s expanded ones) is copied first, as the backend copies it. None where the
    op's backward must run: the lanes off, a dout with rows too far apart for int32 (the backend copies it
    first), create_graph (the op refuses a double backward), anything tracing or
    intercepting, q not on the current CUDA device, saved tensors whose .data was swapped for another shape or
    layout, a backward the launch cache cannot replay (a GQA dK/dV split, a plan that does not fit these inputs'
    alignment)."""
    if not LANE or type(dout) is not _TENSOR or torch.is_grad_enabled() or not _lanes.eager():
        return None
    lane = ctx.lane
    q, k, v, out, m2, l2, bias, *aux = ctx.saved_tensors
    if _library._other_device(q) is not None or (learned and not ctx.needs_input_grad[3]):
        return None
    masks = _saved_masks(bias, aux)
    if _lanes.layouts(q, k, v, out, *masks) != lane.saved:
        return None  # a saved tensor's .data was swapped since the forward: not what the plan reads
    packs = packing(q, k, v)
    if dout.stride(-1) != 1 and dout.shape[-1] != 1:  # (backends._unit_last's copy: the kernels' unit last stride)
        dout = dout.contiguous()
    key = ("attn_bwd", lane.key, dout.stride(), q.dtype is _F32 and precision.allow_tf32(), packs)
    entry = _lanes.TABLE.get(key)
    if entry is None:
        entry = _lanes.remember(key, lambda: _build_backward(dout, q, k, v, out, m2, l2, bias, aux, lane, packs,
                                                             learned))
    if not entry:
        return None
    dq, dk, dv, delta = _grads_like(q, k, v, lane, packs)
    dbias = torch.empty_like(bias, memory_format=torch.contiguous_format) if learned else None  # as the op's
    tensors = [dout, q, k, v, out, m2, l2, dq, dk, dv, None, dbias, *masks, delta, None, None]  # attention_bwd's roles
    holds = getattr(entry, "holds", None)  # (an _AlignedEntry's: launches through TMA descriptors)
    if holds is not None and not holds(tensors):
        return None  # planned for 16-byte aligned inputs that these are not
    _lanes.fire(entry, tensors)
    return (dq, dk, dv, dbias) if learned else (dq, dk, dv)


def packing(q, k, v) -> tuple:
    """(3, part stride) where q, k, v are equal slices of one dense packed tensor (a fused QKV projection's), (2,
    part stride) where k and v are (a fused KV), else (0, 0) (flashtx._packing.part_stride): which gradients
    _grads_like writes as slices of one buffer. Packed tensors below _packing.MIN_NUMEL are not looked at (the
    packed forms stack their gradients there)."""
    three = 3 * q.numel() >= MIN_NUMEL  # (q, k, v of equal shapes: the packed tensor's size)
    if not (three or 2 * k.numel() >= MIN_NUMEL) or k.untyped_storage().data_ptr() != v.untyped_storage().data_ptr():
        return 0, 0  # (the common cases, in a few calls)
    sp = part_stride((q, k, v)) if three else 0
    if sp:
        return 3, sp
    sp = part_stride((k, v)) if 2 * k.numel() >= MIN_NUMEL else 0
    return (2, sp) if sp else (0, 0)


def _grads_like(q, k, v, lane, packs: tuple = (0, 0)) -> tuple:
    """(dq, dk, dv, delta) allocated as the op's backward allocates them: each gradient laid out like its input,
    delta (B, Hq, Sq) in the accumulator dtype, as attention_backward's. With packs (packing's answer) the packed
    gradients are the same slices of one new buffer, so the packed forms' gradient is that buffer
    (flashtx._packing.Unpack)."""
    like = lane.like
    delta = torch.empty(lane.lse_shape, dtype=lane.acc, device=q.device)
    kind, sp = packs
    if kind == 3:
        return (*grads_like((q, k, v), sp), delta)
    dq = like(q, q.shape[-1])
    if kind == 2:
        return (dq, *grads_like((k, v), sp), delta)
    return dq, like(k, k.shape[-1]), like(v, lane.dv), delta


def _build_backward(dout, q, k, v, out, m2, l2, bias, aux, lane, packs: tuple = (0, 0), learned: bool = False):
    """The backward's launch entry for a lane (stored), or False where the op's backward must take it (stored):
    planned for gradients laid out as _grads_like(..., packs) allocates them, and with learned for the bias's
    gradient allocated as the op's backward allocates it."""
    from .triton_kernels.attention_bwd import backward_entry

    ints, floats, backend, _ = lane.args
    aux = aux or _NO_AUX  # (a plain lane's node saves no Aux tensors)
    no_aux = _all_none(aux)
    dq, dk, dv, delta = _grads_like(q, k, v, lane, packs)
    if lane.like is packed_like:  # planned on the (1, total, H, D) views the op's backward takes
        dout, q, k, v, out, dq, dk, dv = (t.unsqueeze(0) for t in (dout, q, k, v, out, dq, dk, dv))
    s = 1 if ints[7] else 2
    if dout.shape[s] * dout.stride(s) > INT32_MAX:
        return False  # rows too far apart for int32: the backend copies dout first
    if _plan(q, k, v, bias, aux, ints, floats, backend, no_aux) != "triton":  # as the op's backward plans (again)
        return False
    dbias = torch.empty_like(bias, memory_format=torch.contiguous_format) if learned else None
    try:
        entry = backward_entry(dout, q, k, v, out, m2, l2, dq, dk, dv, delta, scale=floats[0],
                               causal=bool(ints[0]), bottom_right=bool(ints[1]), bshd=bool(ints[7]),
                               spec=spec_of(bias, aux, ints, floats, no_aux), dbias=dbias)
    except LimitExceeded:
        return False  # the op's backward re-plans it (and says why)
    return entry if entry is not None else False


_apply = _C_APPLY.__get__(None, AttnFwd) if _C_APPLY is not None and _unwrap_if_dead else AttnFwd.apply


def _bias_forward(ctx, q, k, v, bias, lane, masks):
    return AttnFwd.forward(ctx, q, k, v, lane, masks)


def _bias_backward(ctx, dout):
    if ctx.lane is not None and dout is not None:
        grads = _lane_backward(ctx, dout, learned=True)
        if grads is not None:
            return (*grads, None, None)
    dq, dk, dv, dbias = _backward(ctx, dout, None, None)[:4]  # (needs_input_grad[3]: the bias's, as the op's)
    return dq, dk, dv, dbias, None, None


# A lane's node for a learned bias (an attn_mask that requires grad): AttnFwd's forward with the bias an input of
# the node too, and a backward that also returns its gradient. Named AttnFwd, as the op's node and the plain lane's.
AttnFwdBias = type("AttnFwd", (AttnFwd,), dict(
    forward=staticmethod(_bias_forward), backward=staticmethod(_bias_backward), __qualname__="AttnFwdBias",
    __doc__="AttnFwd with the bias an input: the op's node for a call whose attn_mask requires grad."))
_apply_bias = (_C_APPLY.__get__(None, AttnFwdBias) if _C_APPLY is not None and _unwrap_if_dead
               else AttnFwdBias.apply)


def forward(q, k, v, scale: float, causal: bool, bottom_right: bool, bshd: bool, backend: str | None = None,
            window: tuple = _NO_WINDOW, softcap: float = 0.0):
    """out of attention over validated 4-D q, k, v (plain tensors: (B, H, S, D), or (B, S, H, D) with bshd) with
    no mask, bias, lengths, ALiBi, dropout or lse, as the general path (functional._run) returns it, or None where
    the lane does not take the call (module docstring): the caller runs the general path. backend: the caller's,
    None or a name (the lane serves the calls planned for `triton`); window: validated (left, right) ints (-1:
    unbounded), aligned as causal is; softcap: a validated float, 0.0 for none."""
    if not LANE or not _lanes.eager():
        return None
    if type(q) is not _TENSOR or type(k) is not _TENSOR or type(v) is not _TENSOR or q.is_neg() or k.is_neg() or \
            v.is_neg():
        return None  # a subclass (a Parameter too) goes through the registered op; a negated view is refused there
    if _library._other_device(q) is not None:
        return None  # the general path makes q's device current first (flashtx._library.call)
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    if not grad and (k.shape[1] > q.shape[1] if bshd else k.shape[2] > q.shape[2]) and \
            (q.shape[1] if bshd else q.shape[2]) <= _small_q.SMALL_Q_MAX:
        return None  # the small-query decode route's, before a key is built (_make would not store one)
    dtype = q.dtype
    key = (dtype, q.device, q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), scale, causal,
           bottom_right, bshd, grad, dtype is _F32 and precision.allow_tf32(), backend, _small_q.SMALL_Q_MAX, window,
           softcap)
    lane = _lanes.TABLE.get(key)
    if lane is None:
        lane = _make(key, q, k, v, scale, causal, bottom_right, bshd, grad, backend or "", window, softcap)
    return _fire(lane, q, k, v, (), grad)


def _fire(lane, q, k, v, masks: tuple, grad: bool, learned=None):
    """out of a lane's forward on these inputs (through its autograd node when grad; learned: the attn_mask that
    requires grad, an input of that node), or None where there is no lane or it does not fit them: the caller's
    general path."""
    if not lane:
        return None
    if lane.aligned and not lane.entry.holds((q, k, v)):
        return None  # planned for 16-byte aligned K, V (TMA descriptors) that these are not
    if not grad:
        return lane.run(q, k, v, masks)[0]
    if learned is not None:
        return _apply_bias(_unwrap_if_dead(q), _unwrap_if_dead(k), _unwrap_if_dead(v), _unwrap_if_dead(learned), lane,
                           masks)
    return _apply(_unwrap_if_dead(q), _unwrap_if_dead(k), _unwrap_if_dead(v), lane, masks)


def _dims(q, k, v, bshd, packed: bool = False):
    """(B, Hq, Sq, Sk) of inputs a lane may be planned for: (B, H, S, D) views, (B, S, H, D) tensors with bshd, or
    varlen's (total, H, D) tensors when packed; None where the inputs alone send the call to the general path
    (past MAX_SEQ, or the launcher's early returns on empty tensors; a strided last dim, which the backend copies
    first)."""
    if packed:
        B, Sq, Hq, Sk = 1, q.shape[0], q.shape[1], k.shape[0]
    elif bshd:
        B, Sq, Hq, Sk = q.shape[0], q.shape[1], q.shape[2], k.shape[1]
    else:
        B, Hq, Sq, Sk = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    if not (0 < Sq <= MAX_SEQ and 0 < Sk <= MAX_SEQ and B > 0 and Hq > 0 and v.shape[-1] > 0):
        return None
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        return None
    return B, Hq, Sq, Sk


def _make(key, q, k, v, scale, causal, bottom_right, bshd, grad, backend: str, window: tuple, softcap: float):
    """The lane for `key` (stored), False where the general path must take these calls after planning them
    (stored too), or None where it must take them for what the inputs alone show, or this call cannot tell
    (not stored: a decode loop's growing keys would fill the table)."""
    dims = _dims(q, k, v, bshd)
    if dims is None:
        return None
    B, Hq, Sq, _ = dims  # (the small-query decode route's calls left in forward, before their key was built)
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
    out = out_layout(q, dv, bshd)
    m2 = torch.empty(B, Hq, Sq, dtype=acc, device=q.device)
    try:
        entry = forward_entry(q, k, v, out, m2, torch.empty_like(m2), scale=scale, causal=causal,
                              bottom_right=bottom_right, bshd=bshd, spec=spec_of(None, _NO_AUX, ints, floats, True))
    except LimitExceeded:
        return False  # the general path re-plans it (and says why)
    return _lane_of(key, entry, aligned_type, q, k, v, (B, Hq, Sq), acc, dv, (ints, floats, backend, len(_NO_AUX)),
                    _lanes.layouts(q, k, v, out))


def _lane_of(key, entry, aligned_type, q, k, v, lse_shape, acc, dv, args, saved, packed=False):
    """The _Lane of a forward's launch entry, False where the general path must plan these calls (stored), None
    where it must take this one (not stored)."""
    if entry is None:
        return False  # not replayable: the general path plans each call
    aligned = type(entry) is aligned_type
    if aligned and not all(i < 3 for i in entry.need):
        return False  # (only K and V are read through descriptors today)
    if aligned and not entry.holds((q, k, v)):
        return None  # planned for aligned inputs that these are not
    return _Lane(key, entry, aligned, lse_shape, acc, dv, args, saved, packed)


def forward_op(q, k, v, bias, aux: list, ints: list, floats: list, backend: str):
    """out of the flashtx::attn_fwd op's call on these arguments (as functional._run builds them: validated, with
    option tensors, no lse or probabilities returned; a learned bias's gradient too), or None where the lane does
    not take the call (the module docstring's refusals): the caller calls the op. The padded shells' masks,
    lengths, attn_mask, ALiBi and dropout, and varlen's cu_seqlens, are tensors the lane's launches read in their
    roles (masks_of), keyed by their layouts (dtype, shape, strides: what the launch entry was planned for), never
    by their values."""
    if not LANE or not _lanes.eager():
        return None
    if type(q) is not _TENSOR or type(k) is not _TENSOR or type(v) is not _TENSOR:
        return None
    if _library._other_device(q) is not None:
        return None
    masks = masks_of(bias, aux)
    for t in masks:
        if t is not None and type(t) is not _TENSOR:
            return None  # a subclass: the registered op
    grad = ints[6] != NO_GRAD  # (BIAS_GRAD: the bias is an input of the node too)
    key = ("attn_fwd_masks", q.dtype, q.device, q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(),
           tuple(ints), tuple(floats), backend, q.dtype is _F32 and precision.allow_tf32(), _lanes.layouts(*masks))
    lane = _lanes.TABLE.get(key)
    if lane is None:
        lane = _make_op(key, q, k, v, bias, aux, ints, floats, backend, masks)
    return _fire(lane, q, k, v, masks, grad, bias if ints[6] == BIAS_GRAD else None)


def _make_op(key, q, k, v, bias, aux, ints, floats, backend, masks, packed: bool = False):
    """The lane of an op call for `key`, as _make's (stored, False stored, or None not stored). packed: q, k, v are
    varlen's (total, H, D) tensors, planned on the op's (1, total, H, D) views."""
    dims = _dims(q, k, v, ints[7], packed)
    if dims is None:
        return None
    B, Hq, Sq, _ = dims
    from .triton_kernels.attention_fwd import forward_entry
    from .triton_kernels.launch import TORCH_ACC_DTYPE, _AlignedEntry

    def build():
        no_aux = _all_none(aux)
        q4, k4, v4 = (q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)) if packed else (q, k, v)  # the op's inputs
        if _plan(q4, k4, v4, bias, aux, ints, floats, backend, no_aux) != "triton":  # raises as the op would
            return False
        acc, dv = TORCH_ACC_DTYPE[q.dtype], v.shape[-1]
        out4 = out_layout(q4, dv, bool(ints[7]))  # as the op (and _Lane.run) allocates it; packed: (1, total, Hq, Dv)
        out = out4.squeeze(0) if packed else out4  # the node's output (packed: (total, Hq, Dv))
        m2 = torch.empty(B, Hq, Sq, dtype=acc, device=q.device)
        try:
            entry = forward_entry(q4, k4, v4, out4, m2, torch.empty_like(m2),
                                  scale=floats[0], causal=bool(ints[0]), bottom_right=bool(ints[1]),
                                  bshd=bool(ints[7]), spec=spec_of(bias, aux, ints, floats, no_aux))
        except LimitExceeded:
            return False
        return _lane_of(key, entry, _AlignedEntry, q, k, v, (B, Hq, Sq), acc, dv,
                        (list(ints), list(floats), backend, 0), _lanes.layouts(q, k, v, out, *masks), packed)

    return _lanes.remember(key, build)


_NO_WINDOW_MASKS = (None,) * 4  # masks_of's key/query masks and lengths: none in a varlen call
_TAIL = (None, None, None)  # masks_of's attn_mask, ALiBi slopes, dropout seed


def varlen(q, k, v, cu_q, cu_k, max_q: int, max_k: int, scale: float, causal: bool, window: tuple, softcap: float,
           backend: str | None):
    """out (total_q, Hq, Dv) of flash_attn_varlen_func's validated call (packed (total, H, D) q, k, v; cu_seqlens
    checked; int max_seqlens clamped to the totals; no ALiBi, dropout or probabilities), as the general path
    (functional._run on the (1, total, H, D) views) computes it, or None where the lane does not take the call.
    The autograd node takes q, k, v themselves: no view nodes around it (three unsqueezes and a select cost a
    plain call's whole node again), and the launches, planned on those views, bind the packed tensors (the
    kernels read pointers; the strides were planned). Two differences from the general path, by design: the node
    saves q, k, v themselves, as any op on its inputs does, so a `.data` swap of the same layout before the
    backward is read by it (the general path's saved views keep the old storage); and one tensor passed as q, k
    and v gets dq + dk + dv summed in another order (the last bit may differ)."""
    if not LANE or not _lanes.eager():
        return None
    if not (type(q) is _TENSOR and type(k) is _TENSOR and type(v) is _TENSOR and type(cu_q) is _TENSOR
            and type(cu_k) is _TENSOR) or q.is_neg() or k.is_neg() or v.is_neg():
        return None
    if _library._other_device(q) is not None:
        return None
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    key = ("attn_varlen", q.dtype, q.device, q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(),
           _lanes.layouts(cu_q, cu_k), max_q, max_k, scale, causal, window, softcap, grad,
           q.dtype is _F32 and precision.allow_tf32(), backend)
    lane = _lanes.TABLE.get(key)
    masks = (*_NO_WINDOW_MASKS, cu_q, cu_k, *_TAIL)
    if lane is None:
        aux = [None, None, None, None, cu_q, cu_k, None, None]  # _attention_op.Aux
        ints = [int(causal), 1, window[0], window[1], max_q, max_k, GRAD if grad else NO_GRAD, 1]  # Ints: bshd
        lane = _make_op(key, q, k, v, None, aux, ints, [scale, softcap, 0.0], backend or "", masks, packed=True)
    return _fire(lane, q, k, v, masks, grad)
