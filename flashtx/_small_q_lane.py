"""Decoding calls of the attention shells (flashtx._small_q's route), planned once per call signature: from
flashtx.attention / flash_attn_func to the decode kernels' launches in one dict lookup, as flashtx._attention_lane
is for the training forward.

A generation loop calls attention once per layer per token: every layer of one step passes the same signature
(the cache has grown by the same token in each), so all but the first reuse the plan. Transformers'
attn_implementation="ftx" steps are the model case: no mask (DynamicCache), a (B, Sk) key mask with its window
(-1, Sk - Sq) (left padding), or a bool (B, 1, Sq, max_len) attn_mask (StaticCache).

Plain: q, k, v plain 4-D tensors that the shell's own common-case test passes (dtypes, heads, a bool causal, a
float or None scale), no autograd (the decode op has none), more keys than queries and at most SMALL_Q_MAX
queries, no tensor option but one plain bool mask (an attn_mask, or a key_mask; no query mask, lengths, ALiBi or
dropout), a bool return_lse. The key is what decides the plan: every tensor's dtype, device, shape and strides,
the mask's role, every scalar, the backend and the TF32 switch (fp32).

A lane is made on a key's second call (the first layer of a step marks the key, the second makes the lane, the rest
reuse it), as the launch cache memoises the route's growing signatures (LaunchCache.run's `twice`): a loop whose
keys grow every call, one layer deep, would pay for a plan it never reuses. It is made from the general path's own
work, never beside it: a call whose key has no lane goes down the general path (all validation, the dispatch,
flashtx._small_q's refusals) with a request, and _small_q.attention makes the lane (`make`) from the arguments it
hands the decode op, if it takes the call, its launch entry (`triton_kernels.decode.decode_entry`, the one
decode_attention replays) included. The lane binds the caller's own tensors in the kernels' roles: the kernels read
pointers, the strides were planned (q, k, v for their (B, S, H, D) views, the mask as the uint8 view the launcher
reads), so a lane is kept only where those views start where the caller's tensors do. Every other call returns
None: the caller takes the general path (and _lanes.remember's and _lanes.eager's rules apply). Lanes are dropped
with the plans and launch entries (flashtx._lanes).

`LANE = False` turns it off (tests compare both).
"""
from __future__ import annotations

import math

import torch

from . import _decode_op, _env, _lanes, _library, _small_q
from .triton_kernels import precision

LANE = _env.HAS_TRITON  # the lanes launch Triton kernels: without triton every call takes the general path
LN2 = math.log(2.0)

_TENSOR, _F32, _BOOL, _U8, _STRIDED = torch.Tensor, torch.float32, torch.bool, torch.uint8, torch.strided


class _Lane:
    """One call signature's plan: the decode launch entry, the split partials' shapes (None for one split), the
    output shapes and the accumulator dtype, the layout (bshd) and whether lse is returned."""

    __slots__ = ("entry", "parts", "out_shape", "lse_shape", "acc", "bshd", "return_lse")

    def __init__(self, entry, parts, out_shape, lse_shape, acc, bshd, return_lse):
        self.entry, self.parts, self.out_shape, self.lse_shape = entry, parts, out_shape, lse_shape
        self.acc, self.bshd, self.return_lse = acc, bshd, return_lse

    def run(self, q, k, v, mask):
        """What _small_q.attention returns for this call: out [, lse], allocated as the decode op allocates them."""
        dev = q.device
        res, out = _decode_op.empty_out(*self.out_shape, not self.bshd, q.dtype, dev)  # out: (B, Sq, Hq, Dv)
        lse2 = torch.empty(self.lse_shape, dtype=self.acc, device=dev)  # (B, Hq, Sq), log2
        o_part = l_part = None
        if self.parts is not None:
            o_part = torch.empty(self.parts[0], dtype=self.acc, device=dev)
            l_part = torch.empty(self.parts[1], dtype=self.acc, device=dev)
        km = None if mask is None else mask.view(_U8)  # (nonzero = visible, as the launcher's view)
        _lanes.fire(self.entry, (q, k, v, out, lse2, None, None, None, None, None, km, o_part, l_part))
        return (res, lse2 * LN2) if self.return_lse else res


def decoding(Sq, Sk) -> bool:
    """Whether a shell's call of Sq queries over Sk keys may be a decoding step with a lane: eager (checked first:
    under a trace, comparing a size would guard it), 0 < Sq <= SMALL_Q_MAX, Sk > Sq. The cheap test every call of
    the shells' common case pays before lookup."""
    return _lanes.eager() and 0 < Sq <= _small_q.SMALL_Q_MAX and Sk > Sq


def lookup(q, k, v, mask, role: str, scale: float, causal: bool, bottom_right: bool, bshd: bool, window: tuple,
           softcap: float, backend, return_lse: bool) -> tuple:
    """(result, request) of a shell's decoding call (decoding() passed; q, k, v: the shell's 4-D tensors, its common
    case; mask: its one bool mask tensor or None, `role` naming the argument; the scalars validated). result: the
    lane's (out [, lse], as the general path returns it), or None; request: (key, q, k, v, mask) for the general
    path (functional._run's `lane`) where the call's key has no lane yet, else None."""
    lane_key = key(q, k, v, mask, role, scale, causal, bottom_right, bshd, window, softcap, backend, return_lse)
    if lane_key is None:
        return _NOTHING
    res = forward(lane_key, q, k, v, mask)
    if res is None:
        return None, (lane_key, q, k, v, mask)
    return (None if res is False else res), None


_NOTHING = (None, None)


def key(q, k, v, mask, role: str, scale: float, causal: bool, bottom_right: bool, bshd: bool, window: tuple,
        softcap: float, backend, return_lse: bool):
    """The lane key of a call lookup() takes, or None where no lane may take it (the general path's, with no
    request)."""
    if not LANE or not _small_q.SMALL_Q_DECODE:
        return None
    if type(q) is not _TENSOR or type(k) is not _TENSOR or type(v) is not _TENSOR:
        return None
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return None  # the training forward's (no decode backward)
    if mask is not None and (type(mask) is not _TENSOR or mask.dtype is not _BOOL or mask.layout is not _STRIDED
                             or mask.is_nested):
        return None  # (the general path says what is wrong with a mask of another kind)
    if q.is_neg() or k.is_neg() or v.is_neg() or _library._other_device(q) is not None:
        return None  # refused, or run on q's device made current, by the general path
    dtype = q.dtype
    return ("small_q", dtype, q.device, q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), role,
            None if mask is None else (mask.device, mask.shape, mask.stride()), scale, causal, bottom_right, bshd,
            window, softcap, backend, return_lse, dtype is _F32 and precision.allow_tf32(), _small_q.SMALL_Q_MAX)


def forward(lane_key, q, k, v, mask):
    """The lane's result for a call with this key (out [, lse]); None where there is no lane yet, False where the
    general path takes these calls (a refusal remembered: no request)."""
    lane = _lanes.TABLE.get(lane_key)
    if not lane:
        return lane  # (None or False)
    return lane.run(q, k, v, mask)


def refuse(request) -> None:
    """Remember that the general path takes the calls of this request's key (flashtx._small_q refused the call:
    for what the key alone decides, the shapes, strides, mask layout, scalars and backend)."""
    _lanes.remember(request[0], _refused)


def _refused():
    return False


def make(request, qd, kc, vc, km, scale: float, causal: bool, left: int, right: int, softcap: float, snew: int,
         bshd: bool, return_lse: bool) -> None:
    """Keep the lane of the request's key: _small_q.attention's call of the decode op on (B, S, H, D) views qd, kc,
    vc and the uint8 key mask view km (None, or (B, Sq | 1, Sk)), with these scalars and no ALiBi. Not kept where a
    view does not start where the caller's tensor does (the lane binds the caller's), or the launches cannot be
    replayed (False kept: the general path plans each call)."""
    lane_key, q, k, v, mask = request
    if qd.shape[0] == 0 or qd.shape[2] == 0 or (
            qd.data_ptr() != q.data_ptr() or kc.data_ptr() != k.data_ptr() or vc.data_ptr() != v.data_ptr()
            or (mask is None) != (km is None) or (km is not None and km.data_ptr() != mask.data_ptr())):
        # nothing to launch (decode_attention returns early), or views that do not start where the caller's
        # tensors do (the layouts decide both)
        refuse(request)
        return
    from .triton_kernels.decode import decode_entry
    from .triton_kernels.launch import LAUNCHES, TORCH_ACC_DTYPE

    if lane_key not in LAUNCHES.seen:  # a key's first call: as the launch cache's `twice` (module docstring)
        LAUNCHES.keep(LAUNCHES.seen, lane_key, True, LAUNCHES.generation)
        return

    def build():
        B, Sq, Hq, _ = qd.shape
        dv = vc.shape[3]
        acc = TORCH_ACC_DTYPE[qd.dtype]
        out_shape, lse_shape = (B, Sq, Hq, dv), (B, Hq, Sq)
        entry, splits = decode_entry(qd, kc, vc, torch.empty(out_shape, dtype=qd.dtype, device=qd.device),
                                     torch.empty(lse_shape, dtype=acc, device=qd.device), None, None, None, None,
                                     None, scale=scale, causal=causal, window=(left, right), softcap=softcap,
                                     snew=snew, key_mask=km)
        if type(entry) is not list:
            return False  # not replayable (or planned for aligned inputs): the general path plans each call
        parts = ((splits, B, Sq, Hq, dv), (splits, B, Hq, Sq)) if splits > 1 else None
        return _Lane(entry, parts, out_shape, lse_shape, acc, bshd, return_lse)

    _lanes.remember(lane_key, build)
