"""Public attention functions: an SDPA-compatible shell and a flash-attn-compatible shell.

Both are thin layers over one op (flashtx::attention_fwd / attention_bwd) and differ only in
layout and causal alignment:

=====================  ======================  =====================================
function               layout                  causal alignment when Sq != Sk
=====================  ======================  =====================================
attention              (..., H, S, D) (SDPA)   top-left: query i sees keys j <= i
flash_attn_func        (B, S, H, D)            bottom-right: i sees j <= i + Sk - Sq
=====================  ======================  =====================================
"""
from __future__ import annotations

import math

import torch

from . import _attention_op  # noqa: F401  (registers the custom ops)
from ._attention_op import attention_fwd
from ._validate import check_qkv, check_tensor, not_implemented, resolve_scale
from .backends import AttentionInputs, select_backend

LN2 = math.log(2.0)


def _run(q, k, v, *, scale, causal, bottom_right, backend, return_lse):
    """q, k, v: validated (B, H, S, D) views. Returns out (B, Hq, Sq, Dv) [, lse (B, Hq, Sq)]."""
    name = select_backend(AttentionInputs(q, k, v, causal, bottom_right), backend)
    out, lse2 = attention_fwd(q, k, v, scale, causal, bottom_right, name)
    if return_lse:
        return out, lse2 * LN2  # natural log
    return out


def attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False,
              *, backend=None, return_lse=False):
    """Drop-in for ``torch.nn.functional.scaled_dot_product_attention``, with O(N) memory.

    Args:
        query: (..., Hq, Sq, D); key: (..., Hkv, Sk, D); value: (..., Hkv, Sk, Dv). The leading
            dims (usually one batch dim) must match. float16, bfloat16 or float32 (float64 for
            tests); any strides. Dv may differ from D.
        attn_mask, dropout_p: not supported yet; anything but None / 0.0 raises NotImplementedError.
        is_causal: causal mask aligned top-left, as in SDPA: query i sees keys j <= i. With
            Sq > Sk every row still sees key 0; with Sq < Sk the last keys are never seen.
        scale: softmax scale; default 1/sqrt(D).
        enable_gqa: allow Hq to be a multiple of Hkv (GQA/MQA). Q head h uses K/V head
            h // (Hq // Hkv); K/V are never expanded. Without it Hq must equal Hkv, as in SDPA.
        backend: None (automatic), "triton", "reference" or "cuda" (see flashtx.backends).
        return_lse: also return the log-sum-exp of each row's scaled scores.

    Returns:
        out (..., Hq, Sq, Dv) in query's dtype; with return_lse, (out, lse) with lse (..., Hq, Sq)
        in float32 (float64 for float64 inputs), natural log. Differentiable in query, key, value
        (and through lse).

    Example:
        >>> out = flashtx.attention(q, k, v, is_causal=True)  # q, k, v: (B, H, S, D)
    """
    for n, t in (("query", query), ("key", key), ("value", value)):
        check_tensor(n, t)
    if attn_mask is not None:
        raise not_implemented("attn_mask", "<tensor>", "arbitrary masks and bias are the masks issue")
    if dropout_p != 0.0:
        raise not_implemented("dropout_p", dropout_p, "dropout is the score-modifiers issue")
    if backend is not None and not isinstance(backend, str):
        raise TypeError(f"backend must be None or a string; got {type(backend).__name__}")
    if not (query.dim() == key.dim() == value.dim()) or query.dim() < 2:
        raise ValueError(f"query, key, value must have the same rank, at least 2 ((..., H, S, D) or (S, D)); "
                         f"got shapes {tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}")
    lead = query.shape[:-3]
    if key.shape[:-3] != lead or value.shape[:-3] != lead:
        raise ValueError(f"query, key, value must have the same leading (batch) dims; got shapes "
                         f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}")
    q, k, v = (_as4d(t) for t in (query, key, value))
    check_qkv(("query", "key", "value"), q, k, v, "(..., H, S, D)", allow_gqa=bool(enable_gqa),
              gqa_hint="Pass enable_gqa=True for grouped-query attention, as with SDPA.")
    scale = resolve_scale("scale", scale, q.shape[-1])
    res = _run(q, k, v, scale=scale, causal=bool(is_causal), bottom_right=False, backend=backend,
               return_lse=return_lse)
    lead_shape = query.shape[:-2]  # (..., Hq)
    if return_lse:
        out, lse = res
        return out.reshape(*lead_shape, *out.shape[2:]), lse.reshape(*lead_shape, lse.shape[2])
    return res.reshape(*lead_shape, *res.shape[2:])


def _as4d(t: torch.Tensor) -> torch.Tensor:
    """(..., H, S, D) -> (B, H, S, D), a view whenever the leading dims allow one."""
    if t.dim() == 4:
        return t
    if t.dim() == 2:
        return t[None, None]
    if t.dim() == 3:
        return t[None]
    return t.reshape(-1, *t.shape[-3:])


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False, *, backend=None):
    """Drop-in for flash-attn 2's ``flash_attn_func``.

    Args:
        q: (B, Sq, Hq, D); k: (B, Sk, Hkv, D); v: (B, Sk, Hkv, Dv), Hq a multiple of Hkv
            (GQA/MQA without expanding K/V). float16, bfloat16 or float32; any strides.
        softmax_scale: default 1/sqrt(D).
        causal: causal mask aligned bottom-right, as flash-attn >= 2.1: query i sees keys
            j <= i + Sk - Sq. When Sq > Sk, the first Sq - Sk rows see no key: their output is 0
            (and their lse -inf), as in flash-attn.
        deterministic: accepted; flashtx's backward is always deterministic (no atomics).
        dropout_p, window_size, softcap, alibi_slopes, return_attn_probs: not supported yet;
            anything but their defaults raises NotImplementedError.
        backend: as in flashtx.attention.

    Returns:
        out (B, Sq, Hq, Dv) in q's dtype, laid out in memory like q (contiguous for contiguous q).

    Example:
        >>> out = flashtx.flash_attn_func(q, k, v, causal=True)  # q, k, v: (B, S, H, D)
    """
    for n, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(n, t)
        if t.dim() != 4:
            raise ValueError(f"{n} must be 4-D (B, S, H, D); got shape {tuple(t.shape)}")
    if dropout_p != 0.0:
        raise not_implemented("dropout_p", dropout_p, "dropout is the score-modifiers issue")
    if tuple(window_size) != (-1, -1):
        raise not_implemented("window_size", tuple(window_size), "sliding windows are the masks issue")
    if softcap != 0.0:
        raise not_implemented("softcap", softcap, "softcap is the score-modifiers issue")
    if alibi_slopes is not None:
        raise not_implemented("alibi_slopes", "<tensor>", "ALiBi is the score-modifiers issue")
    if return_attn_probs:
        raise not_implemented("return_attn_probs", True, "it comes with dropout")
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, S, D) views, no copies
    check_qkv(("q", "k", "v"), qh, kh, vh, "(B, S, H, D)", allow_gqa=True)
    scale = resolve_scale("softmax_scale", softmax_scale, q.shape[-1])
    out = _run(qh, kh, vh, scale=scale, causal=bool(causal), bottom_right=True, backend=backend, return_lse=False)
    return out.transpose(1, 2)  # (B, Sq, Hq, Dv)
