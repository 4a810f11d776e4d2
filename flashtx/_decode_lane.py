"""A decoding step, planned once per call signature: from flash_attn_with_kvcache to the kernel launches in one dict
lookup (as flashtx._attention_lane is for attention).

A generation loop calls flash_attn_with_kvcache with the same signature every step: only the values of the
tensors change (the new tokens, the lengths). Plain: every tensor argument a plain tensor (not a subclass) or None,
cache_seqlens a tensor (an int or None builds one per call: the general path), the scalars of their documented
types (a float or None scale, a float softcap, an int pair window, bools, an int num_splits), no tensor that
requires grad under grad mode, and the automatic backend or `triton`. The key is what decides the plan: every
tensor's dtype, device, shape and strides and every scalar.

A lane is made from the general path's own work: its argument checks and normalisation (`decode._prepare`, which
raises what the general path raises), its backend (`decode._backend`, which must be `triton`), and the launch cache's
entries for the append and the attention (`triton_kernels.decode.kv_append_entry` / `decode_entry`, the ones
kv_append and decode_attention would replay), made for the normalised tensors, which must be the caller's own or
views with their data pointers (a contiguous() that copies, a reshaped ALiBi table of other strides: the general
path). Every call still checks what depends on values or addresses, as the general path does: the index ranges
(`decode._check_ranges`: on the host for CPU tensors, by the check kernel and a device-side assert on a GPU, the
kernel's launch replayed from the lane's entry, `decode._check_entry`; not where the caller proved them,
`ranges_known`: flashtx.nn's sealed caches) and, when appending, whether the caches share
memory with each other or with q, k, v (`decode.append_overlap`). It then fires the append (bumping the caches'
version counters, as the in-place op's call does) and the attention, with the outputs and split partials allocated as
the ops allocate them. Every other call returns None, and the caller takes the general path: empty inputs, tensors on
a CUDA device that is not the current one, and plans that are not Triton's (and lanes.remember's and lanes.eager's
rules).

`LANE = False` turns it off (tests and bench/overhead.py compare both).
"""
from __future__ import annotations

import math

import torch

from . import _env, _lanes, _library
from .triton_kernels import precision
from .triton_kernels.precision import TORCH_ACC_DTYPE

LANE = _env.HAS_TRITON  # the lanes launch Triton kernels: without triton every call takes the general path
LN2 = math.log(2.0)

_TENSOR, _F32, _STRIDED = torch.Tensor, torch.float32, torch.strided
_INC_VERSION = torch.autograd.graph.increment_version


class _Lane:
    """One call signature's plan: the append's and the attention's launch entries, the split partials' shapes,
    what the range check reads (Snew, capacity, q_moves), and the output shapes."""

    __slots__ = ("check", "append", "rotary", "attend", "parts", "snew", "capacity", "q_moves", "left", "out_shape",
                 "lse_shape", "acc")

    def __init__(self, check, append, rotary, attend, parts, snew, capacity, q_moves, left, out_shape, lse_shape,
                 acc):
        self.check, self.append, self.rotary, self.attend, self.parts = check, append, rotary, attend, parts
        self.snew, self.capacity, self.q_moves, self.left = snew, capacity, q_moves, left
        self.out_shape, self.lse_shape, self.acc = out_shape, lse_shape, acc


_check_ranges = None  # flashtx.decode._check_ranges, bound by the first _make (decode imports this module)
append_overlap = None  # flashtx.decode.append_overlap, bound so too


def _sig(t):
    """A tensor argument's part of the key: None, its (dtype, device, shape, strides), or False for anything else
    (a subclass, a number): the general path's."""
    if t is None:
        return None
    if type(t) is not _TENSOR or t.layout is not _STRIDED or t.is_nested or t.is_neg():  # (refused there)
        return False
    return t.dtype, t.device, t.shape, t.stride()


def step(q, k_cache, v_cache, k, v, cos, sin, seqlens, batch_idx, leftpad, block_table, scale, causal, window,
         softcap, interleaved, alibi, num_splits, return_lse, backend, ranges_known=False):
    """flash_attn_with_kvcache's result for these arguments (its own, in its order), or None where the lane does not
    take the call (module docstring): the caller runs the general path. ranges_known: the caller proved the index
    values in range (decode.kvcache_step): no index check."""
    if not LANE or type(q) is not _TENSOR or type(k_cache) is not _TENSOR or type(v_cache) is not _TENSOR or \
            type(seqlens) is not _TENSOR or not _lanes.eager() or q.is_neg() or q.layout is not _STRIDED or \
            q.is_nested:  # (Dynamo cannot trace is_neg)
        return None
    if not (type(window) is tuple and len(window) == 2 and type(window[0]) is int and type(window[1]) is int) or \
            type(softcap) is not float or (scale is not None and type(scale) is not float) or \
            (causal is not True and causal is not False) or (interleaved is not True and interleaved is not False) or \
            (return_lse is not True and return_lse is not False) or type(num_splits) is not int or \
            (backend is not None and type(backend) is not str):
        return None  # (equal values of other types hash alike: the general path checks each)
    if _library._other_device(q) is not None:
        return None
    sigs = (_sig(k_cache), _sig(v_cache), _sig(k), _sig(v), _sig(cos), _sig(sin), _sig(seqlens), _sig(batch_idx),
            _sig(leftpad), _sig(block_table), _sig(alibi))
    if False in sigs:
        return None  # a subclass or another type: the general path's
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                       for t in (q, k_cache, v_cache, k, v, cos, sin, alibi)):
        return None  # refused by the general path
    dtype = q.dtype
    key = ("decode", dtype, q.device, q.shape, q.stride(), sigs, scale, causal, window, softcap, interleaved,
           num_splits, backend, dtype is _F32 and precision.allow_tf32())  # (fp32: the dots follow the TF32 switch)
    lane = _lanes.TABLE.get(key)
    if lane is None:  # (_make checks this call's values as the general path does, in its order)
        lane = _make(key, q, k_cache, v_cache, k, v, cos, sin, seqlens, batch_idx, leftpad, block_table, scale, causal,
                     window, softcap, interleaved, alibi, num_splits, backend, ranges_known)
        if not lane:
            return None
    elif not lane:
        return None
    else:
        if lane.snew and append_overlap(q, k, v, k_cache, v_cache) is not None:
            return None  # refused by the general path (it depends on addresses)
        if not ranges_known:
            _check_ranges(q, k_cache, seqlens, batch_idx, leftpad, block_table, cos, lane.snew, lane.capacity,
                          lane.q_moves, lane.left, lane.check)
    if lane.append is not None:
        q_out = torch.empty_like(q) if lane.rotary else None
        _lanes.fire(lane.append, (q, q_out, k, v, k_cache, v_cache, cos, sin, seqlens, batch_idx, block_table))
        _INC_VERSION(k_cache)
        _INC_VERSION(v_cache)
        if q_out is not None:
            q = q_out
    dev = q.device
    out = torch.empty(lane.out_shape, dtype=q.dtype, device=dev)  # (B, Sq, Hq, Dv)
    lse2 = torch.empty(lane.lse_shape, dtype=lane.acc, device=dev)  # (B, Hq, Sq)
    parts = lane.parts
    o_part = l_part = None
    if parts is not None:
        o_part, l_part = torch.empty(parts[0], dtype=lane.acc, device=dev), torch.empty(parts[1], dtype=lane.acc,
                                                                                         device=dev)
    _lanes.fire(lane.attend, (q, k_cache, v_cache, out, lse2, seqlens, leftpad, batch_idx, block_table, alibi, None,
                              o_part, l_part))
    if return_lse:
        return out, lse2 * LN2
    return out


def _make(key, q, k_cache, v_cache, k, v, cos, sin, seqlens, batch_idx, leftpad, block_table, scale, causal, window,
          softcap, interleaved, alibi, num_splits, backend, ranges_known=False):
    """The lane for `key` (stored), False where the general path must take these calls (stored too), or None where
    it must take this one for what the inputs alone show (not stored). Raises what the general path raises for this
    call, in its order: the argument checks, the index values (which a returned lane's call has then passed), the
    backend's refusal."""
    global _check_ranges, append_overlap
    from .decode import _backend, _check_entry, _check_ranges, _prepare, append_overlap

    prepared = _prepare(q, k_cache, v_cache, k, v, cos, sin, seqlens, batch_idx, leftpad, block_table, scale, causal,
                        window, softcap, alibi, num_splits)  # raises what the general path raises
    (_, _, _, _, _, cos2, sin2, seqlens2, batch_idx2, leftpad2, block_table2, snew, capacity, causal, window2,
     softcap, alibi2, scale, q_moves) = prepared
    B, Sq, Hq, _ = q.shape
    if B == 0 or Sq == 0 or Hq == 0:
        return None  # nothing to launch: the general path's
    if not ranges_known:
        _check_ranges(q, k_cache, seqlens, batch_idx, leftpad, block_table, cos, snew, capacity, q_moves,
                      window2[0])  # as it does
    same = all(a is b or (a is not None and b is not None and a.data_ptr() == b.data_ptr()
                          and (a.shape == b.shape or a is alibi))
               for a, b in ((cos, cos2), (sin, sin2), (seqlens, seqlens2), (batch_idx, batch_idx2),
                            (leftpad, leftpad2), (block_table, block_table2), (alibi, alibi2)))
    if not same:
        return _lanes.remember(key, lambda: False)  # normalised to copies: the general path's (per call)
    name = _backend(q, k_cache, v_cache, k, cos2, leftpad2, alibi2, window2, softcap, capacity, backend)
    if name != "triton":
        return _lanes.remember(key, lambda: False)
    from .triton_kernels.decode import decode_entry, kv_append_entry

    def build():
        append = None
        if snew or cos is not None:
            q_out = torch.empty_like(q) if cos is not None else None
            append = kv_append_entry(q, q_out, k, v, k_cache, v_cache, cos2, sin2, seqlens2, batch_idx2, block_table2,
                                     interleaved=interleaved, q_same_pos=not q_moves)
            if type(append) is not list:
                return False
        qa = torch.empty_like(q) if cos is not None else q  # the attention reads the rotated q (like q)
        acc = TORCH_ACC_DTYPE[q.dtype]
        out_shape, lse_shape = (B, Sq, Hq, v_cache.shape[3]), (B, Hq, Sq)
        attend, splits = decode_entry(qa, k_cache, v_cache, torch.empty(out_shape, dtype=q.dtype, device=q.device),
                                      torch.empty(lse_shape, dtype=acc, device=q.device), seqlens2, leftpad2,
                                      batch_idx2, block_table2, alibi2, scale=scale, causal=causal, window=window2,
                                      softcap=softcap, num_splits=num_splits, snew=snew)
        if type(attend) is not list:
            return False
        parts = ((splits, B, Sq, Hq, v_cache.shape[3]), (splits, B, Hq, Sq)) if splits > 1 else None
        check = _check_entry(q, k_cache, seqlens, batch_idx, leftpad, block_table, cos, snew, capacity, q_moves,
                             window2[0])  # (the device's branch of the index check, replayed)
        return _Lane(check, append, cos is not None, attend, parts, snew, capacity, q_moves, window2[0], out_shape,
                     lse_shape, acc)
    return _lanes.remember(key, build)
