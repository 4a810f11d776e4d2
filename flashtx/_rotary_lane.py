"""The plain RoPE call, planned once per call signature: from apply_rotary / apply_rotary_qk to the kernel launch
in one dict lookup (as flashtx._attention_lane is for attention).

Plain: plain tensors, positions from an int seqlen_offsets (no offsets tensor, position_ids or cu_seqlens), the
automatic backend or `triton`, cos/sin that need no gradient. The key is what decides the plan: dtype, device,
shape and strides of q, k, cos and sin, layout, interleaved, inplace, the direction (a backward's conjugate) and
whether autograd records the call. An int offset does not key it: the tables are narrowed to the rows
[offset, offset + S) first (views, the same values), as the launcher itself does, so a decode loop's new offset
each step replays one lane.

A lane is made from the general path's own work: the call's validation (`rotary._prepare` on the caller's
arguments, which raises what the general path raises), its backend (which must be `triton`), and the launch
cache's entry for the narrowed call (`triton_kernels.rotary.rotary_entry`). A call then allocates its outputs as
the op does (empty_like) and fires the entry. With autograd, its node (named as the op's: Rotary / RotaryQk) saves
what the op's saves (the caller's tables and offset, not the narrowed views), and its backward is the op's: the
conjugate rotation of the gradients, out of place, through a lane of its own (`conjugate` keys it), or through the
ops where rotate() does not take it (create_graph among the rest). In place, where autograd records nothing, the
entry fires on q and k themselves and their version counters are bumped, as the in-place op's call does; q and k
sharing memory is checked every call (it depends on addresses). Every other call returns None, and the caller takes
the general path: in-place calls that autograd records, a table too short for the offset, empty tensors, sparse
tensors, tensors on a CUDA device that is not the current one, and where the plan is not Triton's
(lanes.remember's and lanes.eager's rules too).

`LANE = False` turns it off (tests compare both).
"""
from __future__ import annotations

import torch

from . import _env, _lanes, _library
from ._library import _C_APPLY, _unwrap_if_dead
from ._rotary_op import _save, rotated_grads
from ._validate import has_internal_overlap, views_overlap

LANE = _env.HAS_TRITON  # the lanes launch Triton kernels: without triton every call takes the general path

_TENSOR, _STRIDED = torch.Tensor, torch.strided
_NO_INDEX = (None, None, None)  # offsets, position_ids, cu_seqlens
_INC_VERSION = torch.autograd.graph.increment_version


class _Lane:
    """One call signature's plan: the forward's launch entry (launch.LaunchCache replays) and the op's
    (spec, backend) for its backward (spec's offset is the call's: see saved())."""

    __slots__ = ("entry", "spec", "backend")

    def __init__(self, entry, spec, backend):
        self.entry, self.spec, self.backend = entry, spec, backend

    def saved(self, ctx, cos, sin, offset: int) -> None:
        """What the op's node saves: the caller's full tables and its offset (not the narrowed views the launch
        reads), so that a checkpoint's recompute through the other path finds the same saved tensors."""
        spec = self.spec.copy()
        spec[0] = offset
        _save(ctx, cos, sin, _NO_INDEX, spec, self.backend)

    def fire(self, q, qo, k, ko, cos, sin) -> None:
        tensors = (q, qo, k, ko, cos, sin, None, None, None)  # rotary_launch's roles, in order
        _lanes.fire(self.entry, tensors)


class RotaryQk(torch.autograd.Function):
    """The autograd node of a lane's out-of-place q+k rotation: flashtx::rotary_qk's (saved tensors, backward)."""

    @staticmethod
    def forward(ctx, q, k, cos, sin, lane, tables, offset):
        qo, ko = torch.empty_like(q), torch.empty_like(k)
        lane.fire(q, qo, k, ko, cos, sin)
        lane.saved(ctx, *tables, offset)
        return qo, ko

    @staticmethod
    def backward(ctx, dq, dk):
        return (*_backward(ctx, dq, dk), None, None, None, None, None)


class Rotary(torch.autograd.Function):
    """The autograd node of a lane's out-of-place rotation of one tensor: flashtx::rotary's."""

    @staticmethod
    def forward(ctx, x, cos, sin, lane, tables, offset):
        out = torch.empty_like(x)
        lane.fire(x, out, None, None, cos, sin)
        lane.saved(ctx, *tables, offset)
        return out

    @staticmethod
    def backward(ctx, dout):
        return _backward(ctx, dout, None)[0], None, None, None, None, None


def _backward(ctx, dq, dk) -> tuple:
    """A lane node's gradients (dq, dk) (dx, None for one tensor), as the op's backward computes them (the
    conjugate rotation, out of place): through a conjugate lane of its own, keyed like a forward's, where rotate()
    takes the call, else the ops (create_graph among the rest: the op's backward records its own node)."""
    saved = ctx.saved_tensors  # once (checkpointing allows one unpacking): the caller's full tables (saved())
    if not torch.is_grad_enabled() and (dq is not None or dk is not None):
        cos, sin = saved[:2]
        spec = ctx.spec  # conjugated: [offset, max_seqlen, interleaved, conjugate = 1, heads first]
        x, y = (dq, dk) if dq is not None else (dk, None)  # one gradient: a one-tensor rotation, as the op's
        done = rotate(x, y, cos, sin, spec[0], spec[2] == 1, "bhsd" if spec[4] else "bshd", False, ctx.backend,
                      conjugate=True)
        if done is not None:
            return done if dq is not None else (None, done[0])
    return rotated_grads(ctx, saved, dq, dk)


def _bound(fn):
    return _C_APPLY.__get__(None, fn) if _C_APPLY is not None and _unwrap_if_dead else fn.apply


_APPLY_QK, _APPLY_X = _bound(RotaryQk), _bound(Rotary)


def inference_outside(q: torch.Tensor, k: torch.Tensor | None) -> bool:
    """Whether q or k is an inference tensor while inference mode is off: torch refuses in-place updates there
    (flashtx.rotary refuses inplace=True and rotates inplace=None out of place)."""
    return not torch.is_inference_mode_enabled() and (q.is_inference() or (k is not None and k.is_inference()))


def shares_tables(q: torch.Tensor, k: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether q or k shares memory with cos or sin: the in-place kernel would read table rows it already rotated,
    so such a call rotates out of place and copies back. Eager calls only (it reads pointers): under torch.compile
    every in-place call does so (flashtx.rotary._rotate_inplace)."""
    c, s = cos.untyped_storage().data_ptr(), sin.untyped_storage().data_ptr()  # (the common case: other storages)
    for t in (q, k):
        if t is not None:
            p = t.untyped_storage().data_ptr()
            if (p == c and views_overlap(t, cos)) or (p == s and views_overlap(t, sin)):
                return True
    return False


def rotate(q, k, cos, sin, offset, interleaved, layout, inplace, backend, conjugate: bool = False,
           disjoint: bool = False):
    """apply_rotary_qk's result (q_rot, k_rot) (k None: apply_rotary's, as (x_rot, None)), or None where the lane
    does not take the call (module docstring): the caller runs the general path. Arguments as the public
    functions take them; conjugate: rotate the other way (a lane node's backward, out of place, without grad);
    disjoint: the caller knows q and k share no element (flashtx.nn's head ranges of one projection), so an
    in-place call skips the overlap test (a search over the strides, ~10 us for slices of one tensor)."""
    if not LANE or not _lanes.eager():
        return None
    if type(q) is not _TENSOR or (k is not None and type(k) is not _TENSOR) or type(cos) is not _TENSOR or \
            type(sin) is not _TENSOR or type(offset) is not int or type(interleaved) is not bool or \
            type(layout) is not str or (backend is not None and type(backend) is not str) or \
            (inplace is not False and inplace is not True and inplace is not None) or \
            cos.requires_grad or sin.requires_grad or q.layout is not _STRIDED or cos.layout is not _STRIDED or \
            sin.layout is not _STRIDED or (k is not None and (k.layout is not _STRIDED or k.is_neg())) or \
            q.is_neg() or cos.is_neg() or sin.is_neg() or q.is_nested or cos.is_nested or sin.is_nested or \
            (k is not None and k.is_nested):
        return None  # the general path's (subclasses, Parameters too, go through the registered ops; tables with
        # grad, sparse and nested tensors, negated views and arguments of other types are refused there)
    if q.dim() != 4 or cos.dim() < 2 or sin.dim() < 2 or _library._other_device(q) is not None:
        return None  # (the general path makes q's device current first: flashtx._library.call)
    grad = torch.is_grad_enabled() and (q.requires_grad or (k is not None and k.requires_grad))
    if inplace is None and grad:
        inplace = False  # what the general path does (flashtx.rotary._inplace_allowed)
    S = q.shape[1] if layout == "bshd" else q.shape[2]
    seqlen_ro = cos.shape[-2]
    tables = cos, sin  # the caller's: validated on a miss
    if offset:  # the launcher's narrowing (triton_kernels.rotary.rotary_launch): one lane for every offset
        if offset < 0 or offset + S > seqlen_ro or sin.shape[-2] != seqlen_ro:
            return None
        cos, sin = cos.narrow(-2, offset, S), sin.narrow(-2, offset, S)
    key = ("rotary", q.dtype, q.device, q.shape, q.stride(), None if k is None else (k.dtype, k.device, k.shape,
           k.stride()), cos.dtype, cos.device, cos.shape, cos.stride(), sin.dtype, sin.device, sin.shape,
           sin.stride(), seqlen_ro, interleaved, layout, inplace, grad, backend, conjugate)
    lane = _lanes.TABLE.get(key)
    if lane is None:
        lane = _make(key, q, k, cos, sin, tables, offset, interleaved, layout, inplace, grad, backend, conjugate)
    if not lane:
        return None
    if inplace is False:
        if grad:
            if k is None:
                return _APPLY_X(_unwrap_if_dead(q), cos, sin, lane, tables, offset), None
            return _APPLY_QK(_unwrap_if_dead(q), _unwrap_if_dead(k), cos, sin, lane, tables, offset)
        if k is None:
            out = torch.empty_like(q)
            lane.fire(q, out, None, None, cos, sin)
            return out, None
        qo, ko = torch.empty_like(q), torch.empty_like(k)
        lane.fire(q, qo, k, ko, cos, sin)
        return qo, ko
    if (k is not None and not disjoint and views_overlap(q, k)) or shares_tables(q, k, *tables) or \
            inference_outside(q, k):
        return None  # refused (inplace=True) or rotated out of place (None, or over the tables, or an inference
        # tensor outside inference mode) by the general path
    lane.fire(q, q, k, k, cos, sin)
    _INC_VERSION(q)  # as flashtx._library.call does for the in-place op
    if k is not None:
        _INC_VERSION(k)
    return q, k


def _make(key, q, k, cos, sin, tables, offset, interleaved, layout, inplace, grad, backend, conjugate):
    """The lane for `key` (stored), False where the general path must take these calls (stored too), or None where
    it must take this one for what the inputs alone show (not stored)."""
    if q.numel() == 0 or (k is not None and k.numel() == 0):
        return None  # nothing to launch: the general path's early returns
    if inplace is True and grad:
        return None  # recorded in place: rotated out of place and copied back by the general path
    from . import rotary as api

    # The general path's validation of the caller's arguments (its tables, its offset) raises what it raises. All
    # it checks is fixed by the key but the offset's one check (offset + S <= seqlen_ro), which rotate() repeats.
    _, spec, chosen = api._prepare("x" if k is None else "q", q, k, *tables, offset, None, None, None, layout,
                                   interleaved, backend)
    if chosen != "triton" or (inplace is not False and (has_internal_overlap(q) or
                                                        (k is not None and has_internal_overlap(k)))):
        return _lanes.remember(key, lambda: False)  # another backend; or in place refused or made out of place
    from .triton_kernels.rotary import rotary_entry

    def build():
        qo = q if inplace is not False else torch.empty_like(q)
        ko = None if k is None else k if inplace is not False else torch.empty_like(k)
        entry = rotary_entry(q, qo, k, ko, cos, sin, interleaved, layout == "bhsd", conjugate)
        if type(entry) is not list:
            return False  # not replayable (None), or planned for aligned inputs: the general path plans each call
        spec[3] = int(conjugate)  # (a conjugate lane takes no grad: rotate's caller runs without it)
        return _Lane(entry, spec, chosen)
    return _lanes.remember(key, build)
