"""flash-attn 2's packed-input API: q, k, v (or k, v) stacked in one tensor, as a fused QKV (or KV)
projection produces them. Each function takes views of its slices (no copies) and runs
flash_attn_func / flash_attn_varlen_func, so features, checks and kernels are theirs. Where the packed
tensor is dense, the attention backward writes dq, dk, dv (dk, dv) as slices of one buffer, which is the
packed gradient (no stack copy; flashtx._packing); elsewhere (a strided packed tensor, a traced call, a
backward the lanes do not serve) autograd stacks the slices' gradients, as unbind's backward does.
"""
from __future__ import annotations

from torch import Tensor

from . import functional
from ._packing import unbind
from ._validate import check_flag, check_tensor
from .functional import _VARLEN_NAMES, _varlen, flash_attn_func


def _unpack(name: str, t, dim: int, parts: int, layout: str):
    """t's `parts` slices along `dim` (views), after checking rank and that dim's size."""
    check_tensor(name, t)
    rank = len(layout.split(","))
    if t.dim() != rank or t.shape[dim] != parts:
        raise ValueError(f"{name} must be {rank}-D {layout} with {parts} at dim {dim % rank}; got shape "
                         f"{tuple(t.shape)}")
    return unbind(t, dim)


_FLASH_KEYWORDS = ("backend", "key_mask", "query_mask", "kv_lens", "q_lens", "attn_bias")  # flash_attn_func's


def _check_keywords(fn: str, kwargs: dict) -> None:
    """Refuse, naming `fn` (the packed form called), a keyword flash_attn_func does not take (its q, k, v too)."""
    for name in kwargs:
        if name not in _FLASH_KEYWORDS:
            raise TypeError(f"{fn}() got an unexpected keyword argument '{name}'")


def _check_kv(q, kv, bshd: bool, kwargs: dict) -> None:
    """kv against q, naming kv (the unpacked k, v would be named otherwise): dtype, batch (bshd), head dim,
    heads; and no block_table (flash-attn's packed forms take none). Ints only: q's own checks follow."""
    if "block_table" in kwargs:
        raise TypeError("block_table is not an argument of the packed forms (as in flash-attn): pass k and v "
                        "caches to flash_attn_varlen_func(..., block_table=...)")
    if not isinstance(q, Tensor) or q.dim() != (4 if bshd else 3) or kv.dim() != q.dim() + 1:
        return
    if kv.dtype != q.dtype and not (functional._AUTOCAST_ANY() and q.dtype in functional._CASTABLE
                                    and kv.dtype in functional._CASTABLE):  # (autocast casts both, as for k, v)
        raise TypeError(f"kv must have q's dtype {q.dtype}; got {kv.dtype}")
    if bshd and kv.shape[0] != q.shape[0]:
        raise ValueError(f"kv must have q's batch size {q.shape[0]}; got kv of shape {tuple(kv.shape)}")
    if kv.shape[-1] != q.shape[-1]:
        raise ValueError(f"kv must have q's head dim {q.shape[-1]}; got kv of shape {tuple(kv.shape)}")
    if kv.shape[-2] == 0 or q.shape[-2] % kv.shape[-2]:
        raise ValueError(f"q's heads ({q.shape[-2]}) must be a multiple of kv's heads ({kv.shape[-2]}); got q "
                         f"{tuple(q.shape)} and kv {tuple(kv.shape)}")


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                              softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, **kwargs):
    """Drop-in for flash-attn 2's ``flash_attn_qkvpacked_func``.

    Args:
        qkv: (B, S, 3, H, D) float16, bfloat16 or float32, any strides (e.g. a fused projection's
            output viewed as (B, S, 3, H, D)); q, k and v are its [:, :, 0], [:, :, 1], [:, :, 2].
        dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
            return_attn_probs, and keyword-only backend / key_mask / query_mask / kv_lens / q_lens /
            attn_bias: as flash_attn_func.

    Returns:
        out (B, S, H, D) in qkv's dtype (with return_attn_probs: (out, softmax_lse, probs)); the
        gradient of qkv is (B, S, 3, H, D).

    Example:
        >>> qkv = fused_proj(x).view(B, S, 3, H, D)
        >>> out = flashtx.flash_attn_qkvpacked_func(qkv, causal=True)  # (B, S, H, D)
    """
    _check_keywords("flash_attn_qkvpacked_func", kwargs)
    q, k, v = _unpack("qkv", qkv, 2, 3, "(B, S, 3, H, D)")
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs, **kwargs)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                             softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, **kwargs):
    """Drop-in for flash-attn 2's ``flash_attn_kvpacked_func`` (cross-attention, or GQA with a fused KV).

    Args:
        q: (B, Sq, Hq, D); kv: (B, Sk, 2, Hkv, D) with k = kv[:, :, 0] and v = kv[:, :, 1], Hq a
            multiple of Hkv (GQA/MQA). float16, bfloat16 or float32, any strides.
        The other arguments: as flash_attn_func.

    Returns:
        out (B, Sq, Hq, D) in q's dtype (with return_attn_probs: (out, softmax_lse, probs)); the
        gradient of kv is (B, Sk, 2, Hkv, D).

    Example:
        >>> out = flashtx.flash_attn_kvpacked_func(q, kv, causal=True)  # kv: (B, Sk, 2, Hkv, D)
    """
    k, v = _unpack("kv", kv, 2, 2, "(B, S, 2, H, D)")
    _check_kv(q, kv, True, kwargs)
    _check_keywords("flash_attn_kvpacked_func", kwargs)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs, **kwargs)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
                                     window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False, **kwargs):
    """Drop-in for flash-attn 2's ``flash_attn_varlen_qkvpacked_func``: packed sequences, packed QKV.

    Args:
        qkv: (total, 3, H, D): the sequences concatenated, q = qkv[:, 0], k = qkv[:, 1], v = qkv[:, 2].
        cu_seqlens: (nseq + 1,) int32 cumulative lengths (starting at 0, ending at total), for
            queries and keys alike; max_seqlen: the longest sequence (int or 0-dim tensor).
        The other arguments: as flash_attn_varlen_func.

    Returns:
        out (total, H, D) in qkv's dtype (with return_attn_probs: (out, softmax_lse, probs)).

    Example:
        >>> out = flashtx.flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, causal=True)
    """
    q, k, v = _unpack("qkv", qkv, 1, 3, "(total, 3, H, D)")
    _check_kv(None, qkv, False, kwargs)  # (block_table only)
    backend = kwargs.pop("backend", None)
    if kwargs:
        raise TypeError(f"flash_attn_varlen_qkvpacked_func() got an unexpected keyword argument '{next(iter(kwargs))}'")
    if deterministic is not False and deterministic is not True:
        check_flag("deterministic", deterministic)
    return _varlen(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p, softmax_scale, causal,
                   window_size, softcap, alibi_slopes, return_attn_probs, None, backend, _PACKED_NAMES)


# varlen's error names (functional._VARLEN_NAMES) for one cu_seqlens and max_seqlen, as this form takes them
_PACKED_NAMES = ("cu_seqlens", "cu_seqlens", "max_seqlen", "max_seqlen", "total (qkv.shape[0])",
                 "total (qkv.shape[0])")


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False, return_attn_probs=False, **kwargs):
    """Drop-in for flash-attn 2's ``flash_attn_varlen_kvpacked_func``.

    Args:
        q: (total_q, Hq, D); kv: (total_k, 2, Hkv, D) with k = kv[:, 0], v = kv[:, 1].
        cu_seqlens_q / cu_seqlens_k, max_seqlen_q / max_seqlen_k and the rest: as flash_attn_varlen_func.

    Returns:
        out (total_q, Hq, D) in q's dtype (with return_attn_probs: (out, softmax_lse, probs)).

    Example:
        >>> out = flashtx.flash_attn_varlen_kvpacked_func(q, kv, cu_q, cu_k, max_q, max_k)
    """
    k, v = _unpack("kv", kv, 1, 2, "(total, 2, H, D)")
    _check_kv(q, kv, False, kwargs)
    backend = kwargs.pop("backend", None)
    if kwargs:
        raise TypeError(f"flash_attn_varlen_kvpacked_func() got an unexpected keyword argument '{next(iter(kwargs))}'")
    if deterministic is not False and deterministic is not True:
        check_flag("deterministic", deterministic)
    return _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
                   window_size, softcap, alibi_slopes, return_attn_probs, None, backend, _KVPACKED_NAMES)


_KVPACKED_NAMES = (*_VARLEN_NAMES[:5], "total_k (kv.shape[0])")  # (varlen's, kv named)


__all__ = ["flash_attn_qkvpacked_func", "flash_attn_kvpacked_func", "flash_attn_varlen_qkvpacked_func",
           "flash_attn_varlen_kvpacked_func"]
