"""SDPA's argument forms that flashtx.attention (the drop-in) takes off its common path: leading dims other than
(B, H), a 0-dim tensor or p = 1 for dropout_p, and torch.nn.attention.bias's CausalBias as attn_mask."""
from __future__ import annotations

import math
import numbers

import torch
from torch.nn.attention.bias import CausalBias, CausalVariant

from ._validate import check_flag, check_qkv, check_tensor


def dropout_p(p) -> tuple:
    """SDPA's dropout_p forms the kernels do not take, and every out-of-range value (one message for all):
    a 0-dim real tensor (read on the host: a sync, and a graph break under torch.compile) and p = 1 (every
    probability dropped: run without dropout, then zero the output). -> (p for the kernels, drop everything)."""
    if isinstance(p, torch.Tensor) and p.dim() == 0 and not p.is_complex() and p.dtype != torch.bool:
        p = p.item()
    if isinstance(p, bool) or not isinstance(p, numbers.Real) or not 0.0 <= float(p) <= 1.0:
        raise ValueError(f"dropout_p must be a float in [0, 1] (or a 0-dim tensor of one); got {p!r}")
    return (0.0, True) if float(p) == 1.0 else (float(p), False)


def causal_bias(mask, is_causal, query, key) -> tuple:
    """attn_mask that is not a plain tensor -> (attn_mask, is_causal, bottom_right) for the kernels.

    CausalBias (torch.nn.attention.bias.causal_upper_left / causal_lower_right) computes SDPA in its own
    __torch_function__ and holds no mask values: it becomes is_causal, aligned top-left (upper_left) or
    bottom-right (lower_right; rows that see no key give 0, as torch). Other masks pass unchanged."""
    if isinstance(mask, CausalBias):
        if is_causal is not False:
            raise ValueError(f"attn_mask is a CausalBias, which is causal itself: is_causal must be False; got "
                             f"{is_causal!r} (torch raises so too)")
        sizes = (mask.seq_len_q, mask.seq_len_kv)
        if isinstance(query, torch.Tensor) and isinstance(key, torch.Tensor) and query.dim() >= 2 and (
                key.dim() >= 2) and sizes != (query.shape[-2], key.shape[-2]):
            raise ValueError(f"attn_mask is a CausalBias for {sizes[0]} queries and {sizes[1]} keys; the inputs "
                             f"have {query.shape[-2]} and {key.shape[-2]}")
        return None, True, mask.variant == CausalVariant.LOWER_RIGHT
    return mask, is_causal, False


def checked_4d(query, key, value, backend, enable_gqa) -> tuple:
    """attention's checks of query, key, value and backend, raising with a message that names the argument;
    returns (B, H, S, D) views of query, key, value."""
    for n, t in (("query", query), ("key", key), ("value", value)):
        check_tensor(n, t)
    if not (query.dim() == key.dim() == value.dim()) or query.dim() < 2:
        raise ValueError(f"query, key, value must have the same rank, at least 2 ((..., H, S, D) or (S, D)); "
                         f"got shapes {tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}")
    lead = query.shape[:-3]
    if key.shape[:-3] != lead or value.shape[:-3] != lead:
        raise ValueError(f"query, key, value must have the same leading (batch) dims; got shapes "
                         f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}")
    q, k, v = as4d(query), as4d(key), as4d(value)
    if backend is not None and not isinstance(backend, str):
        raise TypeError(f"backend must be None or a string; got {type(backend).__name__}")
    check_qkv(("query", "key", "value"), q, k, v, "(..., H, S, D)", allow_gqa=check_flag("enable_gqa", enable_gqa),
              gqa_hint="Pass enable_gqa=True for grouped-query attention, as with SDPA.")
    return q, k, v


def as4d(t: torch.Tensor) -> torch.Tensor:
    """(..., H, S, D) -> (B, H, S, D), a view whenever the leading dims allow one."""
    if t.dim() == 4:
        return t
    if t.dim() == 2:
        return t[None, None]
    if t.dim() == 3:
        return t[None]
    return t.reshape(math.prod(t.shape[:-3]), *t.shape[-3:])  # not -1: a size-0 dim makes -1 ambiguous
