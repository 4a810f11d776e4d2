"""Attention of a few queries over many keys (decoding through `flashtx.attention` / `flash_attn_func` /
the patched SDPA, e.g. Hugging Face generation with attn_implementation="ftx"), run by the split-KV decode
kernels of flashtx.flash_attn_with_kvcache instead of the training forward.

The training forward gives each (q head, batch) one program with a BLOCK_M-row query tile: for Sq = 1 it
fills one row of 64-128, reads K/V once per q head (a GQA group reads them GROUP times), and launches B x Hq
programs, too few to fill the GPU at small batch over a long context. The decode kernel packs a KV group's
query heads into one tile (K/V read once per group) and splits the keys across programs (an LSE combine
merges them). flash-attn 2 does the same inside its own forward for Sq = 1 (mha_fwd's seqlenq_ngroups_swapped
and its split-KV heuristic), which SDPA's FLASH backend inherits; bench/test_decode.py's `flashtx-train`
provider (the training forward, SMALL_Q_DECODE off) times the two against each other.

Taken where the decode kernels pay, more keys than queries (a cache plus new tokens: with Sk <= Sq the
training forward's one tile per head already holds every key, and there is nothing to split), and only where
the two compute the same thing: no autograd (the decode op has no backward), at most SMALL_Q_MAX queries, no
query mask, lengths, float bias or dropout (a key mask, softcap, ALiBi and windows are the decode kernel's too:
transformers' padded batches pass a key mask and a top-left window (-1, Sk - Sq), the bottom-right causal mask;
a bool attn_mask that broadcasts over heads, (B | 1, 1, Sq | 1, Sk | 1), is a key mask, a row per query when it
differs by query: transformers' static-cache steps pass one, (B, 1, Sq, max_len)), causal bottom-right aligned,
windows either way where the bounds translate (top-left bounds are bottom-right ones shifted by Sk - Sq), unit
last strides (q in any layout: the decode kernels write (B, Sq, Hq, Dv), the memory order of attention's output
whatever q's, see _attention_op.out_layout), and the attention dispatch choosing
Triton's kernels within their limits (triton_kernels.limits.within_limits's, as the attention op checks). Under
torch.compile a growing K/V (dynamic Sk) compiles once without a window or with transformers' (-1, Sk - Sq): the
guard Sk > Sq stays true as it grows. A top-left window with a fixed bound shifts by Sk - Sq, which would
pin Sk (the decode launcher takes int bounds: a graph per step), so with a symbolic Sk those run the training
forward, whose bounds do not shift. Everything else returns None: the caller runs the training forward.
"""
from __future__ import annotations

import math
import operator

import torch
from torch import Tensor
from torch.fx.experimental.symbolic_shapes import has_static_value

from . import _decode_op, _dispatch, _env, _small_q_lane
from ._library import call
from .backends import BACKENDS, AttentionInputs
from .triton_kernels.limits import INT32_MAX, MAX_GRID_YZ, MAX_SEQ, mask_span

LN2 = math.log(2.0)
SMALL_Q_DECODE = True  # False: every call runs the training forward (bench/test_decode.py's flashtx-train)
SMALL_Q_MAX = 16  # the most queries per sequence the decode kernels take here (as flashtx.nn's DECODE_MAX_S)

# (device type, index, dtype, D, Dv) -> whether attention's Triton backend runs those kinds (cleared with the plans)
_TAKES = _dispatch.plan_table("small_q")


@torch.compiler.assume_constant_result  # torch.compile runs it while tracing and keeps the answer
def _triton_takes(device_type: str, index, dtype, d_qk: int, d_v: int) -> bool:
    """Whether attention's Triton backend runs inputs of these kinds without grad (then the decode kernels,
    whose reasons are a subset: device, dtype, head dims, can too), from tiny stand-ins once per key. Not the
    decode dispatch's own choice: its fallback would warn, about a call that attention then runs itself."""
    key = (device_type, index, dtype, d_qk, d_v)
    ok = _TAKES.get(key)
    if ok is None:
        dev = torch.device(device_type, index) if index is not None else torch.device(device_type)
        q = torch.empty(1, 1, 1, d_qk, dtype=dtype, device=dev)
        v = torch.empty(1, 1, 1, d_v, dtype=dtype, device=dev)
        if device_type == "cpu" and not _env.INTERPRET:
            ok = False  # CPU tensors run the reference there (flashtx._dispatch)
        else:
            ok = not BACKENDS["triton"].not_supported_reasons(AttentionInputs(q, q, v, needs_grad=0))
        _TAKES[key] = ok
    return ok


def attention(q: Tensor, k: Tensor, v: Tensor, bias, aux: list, ints: list, floats: list, backend: str,
              return_lse: bool, lane=None):
    """out [, lse] of attention over validated q (B, Hq, Sq, D), k (B, Hkv, Sk, D), v (B, Hkv, Sk, Dv) views
    (bshd: (B, S, H, D) tensors), as functional._run returns them (out (B, Hq, Sq, Dv) over (B, Sq, Hq, Dv)
    memory, or that tensor with bshd, as _attention_op.out_layout; lse (B, Hq, Sq) natural log), through the
    decode kernels; None where they must not take the call (module docstring). bias, aux, ints, floats,
    backend: the attention op's arguments; the caller has checked that nothing needs grad, that there are more
    keys than queries and that no query mask, lengths or dropout is given (a key mask, a bias and ALiBi may be).
    lane: a shell's request for its call's lane (flashtx._small_q_lane), made here if this takes the call."""
    causal, bottom_right, left, right, bshd = ints[0], ints[1], ints[2], ints[3], ints[7]
    shape, st = q.shape, q.stride()
    if bshd:
        B, Sq, Hq = shape[0], shape[1], shape[2]
        Sk = k.shape[1]
    else:
        B, Hq, Sq = shape[0], shape[1], shape[2]
        Sk = k.shape[2]
    # the cheapest refusals first: every no-grad call of at most SMALL_Q_MAX queries pays for them
    if not 0 < Sq <= SMALL_Q_MAX or B > MAX_GRID_YZ or Hq * Sq > MAX_GRID_YZ:
        return None
    if st[3] != 1 or k.stride(3) != 1 or v.stride(3) != 1:
        return None
    key_mask = aux[0]  # (B, Sk) bool, True = a real key
    if bias is not None and (bias.dtype != torch.bool or bias.shape[1] != 1 or key_mask is not None):
        return None  # additive, or differing per head (or beside a key mask)
    if not bottom_right and (causal or left >= 0 or right >= 0):
        # top-left bounds i - left <= j <= i + right, as the decode kernels' bottom-right ones (query i at Sk - Sq + i)
        shift = Sk - Sq
        if causal or (right >= 0 and right < shift):
            return None  # not expressible bottom-right (top-left causal with Sq < Sk sees fewer keys than any window)
        right = right - shift if right >= 0 else -1
        left = left + shift if left >= 0 else -1
        if not (has_static_value(left) and has_static_value(right)):  # (type() is int for SymInts under Dynamo)
            return None  # with a symbolic Sk a fixed top-left bound moves with it: the launcher's int() would pin Sk
        # (transformers' (-1, Sk - Sq), computed from the shapes, shifts to the constant (-1, 0))
    if backend not in ("", "triton") or not _triton_takes(q.device.type, q.device.index, q.dtype,
                                                          operator.index(shape[3]), operator.index(v.shape[3])):
        return None
    sd = 1 if bshd else 2  # the sequence dim; unit last strides (above): limits.within_limits's spans, in ints
    if (Sq * st[sd] > INT32_MAX or Sk * k.stride(sd) > INT32_MAX or Sk * v.stride(sd) > INT32_MAX or Sk > MAX_SEQ
            or (bias is not None and mask_span(bias) > INT32_MAX)):
        return None  # past the training forward's int32-offset limits: the attention op's call (its fallback)
    if bshd:
        qd, kc, vc = q, k, v
    else:
        qd, kc, vc = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, S, H, D) views
    if bias is not None:  # a 4-D (B | 1, 1, Sq | 1, Sk | 1) bool view: True = attend (SDPA's polarity, the key mask's)
        key_mask = bias[:, 0].expand(B, bias.shape[2], Sk)  # (B, Sq | 1, Sk) view
    elif key_mask is not None:
        key_mask = key_mask[:, None]  # (B, 1, Sk): every query's
    alibi = aux[6].detach() if aux[6] is not None else None  # slopes get no gradient (as the training forward)
    from .triton_kernels.attention_common import as_u8  # (triton: only on this kernels' path)

    key_mask = as_u8(key_mask) if key_mask is not None else None  # (B, Sq | 1, Sk), nonzero = visible
    if lane is not None and alibi is None:
        _small_q_lane.make(lane, qd, kc, vc, key_mask, floats[0], bool(causal), left, right, floats[1], Sk, bool(bshd),
                           return_lse)
    # no cache_seqlens: every sequence's keys are k's first snew = Sk rows
    out, lse2 = call(_decode_op.kvcache_attention, qd, kc, vc, None, None, None, None, alibi, key_mask, floats[0],
                     bool(causal), left, right, floats[1], 0, Sk, "triton", not bshd)
    # out (B, Sq, Hq, Dv), or without bshd (B, Hq, Sq, Dv) laid out (B, Sq, Hq, Dv) as the attention op's
    return (out, lse2 * LN2) if return_lse else out
