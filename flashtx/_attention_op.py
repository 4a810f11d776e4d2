"""The attention op: torch.library custom ops with fake impls and registered autograd.

`flashtx::attention_fwd` returns (out, lse2) and saves (q, k, v, out, lse2) for backward;
`flashtx::attention_bwd` recomputes P from lse2 through the same backend. Both take (B, H, S, D)
views with any strides. Being custom ops, they trace under torch.compile(fullgraph=True).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .backends import BACKENDS, AttentionMasks

_ACC = {torch.float16: torch.float32, torch.bfloat16: torch.float32, torch.float32: torch.float32,
        torch.float64: torch.float64}


def empty_like_layout(t: Tensor, last_dim: int) -> Tensor:
    """Uninitialised (B, H, S, last_dim) tensor whose first three dims are ordered in memory as t's.

    So an output for (B, S, H, D) inputs viewed as (B, H, S, D) is itself (B, S, H, D) in memory.
    """
    shape = list(t.shape[:3])
    order = sorted(range(3), key=lambda i: (-t.stride(i), i))  # outermost first
    buf = torch.empty([shape[i] for i in order] + [last_dim], dtype=t.dtype, device=t.device)
    inverse = [order.index(i) for i in range(3)] + [3]
    return buf.permute(inverse)


def _masks(window_left, window_right, key_mask, query_mask, q_lens, kv_lens, cu_seqlens_q, cu_seqlens_k,
           max_seqlen_q, max_seqlen_k, max_seqlen_q_t, max_seqlen_k_t) -> AttentionMasks:
    """The op's flat mask arguments as AttentionMasks; 0-dim max_seqlen tensors are read here, at
    run time (outside any traced graph)."""
    if max_seqlen_q_t is not None:
        max_seqlen_q = int(max_seqlen_q_t.item())
    if max_seqlen_k_t is not None:
        max_seqlen_k = int(max_seqlen_k_t.item())
    return AttentionMasks((window_left, window_right), key_mask, query_mask, q_lens, kv_lens, cu_seqlens_q,
                          cu_seqlens_k, max_seqlen_q, max_seqlen_k)


# The mask arguments every attention op takes after (scale, causal, bottom_right, backend), in order:
# window_left, window_right (int, -1 = unbounded), key_mask, query_mask, q_lens, kv_lens,
# cu_seqlens_q, cu_seqlens_k (Optional[Tensor]), max_seqlen_q, max_seqlen_k (int),
# max_seqlen_q_t, max_seqlen_k_t (Optional 0-dim tensors that override the ints).
N_MASK_ARGS = 12


@torch.library.custom_op("flashtx::attention_fwd", mutates_args=())
def attention_fwd(q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool, bottom_right: bool,
                  backend: str, window_left: int = -1, window_right: int = -1, key_mask: Optional[Tensor] = None,
                  query_mask: Optional[Tensor] = None, q_lens: Optional[Tensor] = None,
                  kv_lens: Optional[Tensor] = None, cu_seqlens_q: Optional[Tensor] = None,
                  cu_seqlens_k: Optional[Tensor] = None, max_seqlen_q: int = 0, max_seqlen_k: int = 0,
                  max_seqlen_q_t: Optional[Tensor] = None,
                  max_seqlen_k_t: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    masks = _masks(window_left, window_right, key_mask, query_mask, q_lens, kv_lens, cu_seqlens_q, cu_seqlens_k,
                   max_seqlen_q, max_seqlen_k, max_seqlen_q_t, max_seqlen_k_t)
    out = empty_like_layout(q, v.shape[-1])  # (B, Hq, Sq, Dv)
    lse2 = BACKENDS[backend].forward(q, k, v, out, scale=scale, causal=causal, bottom_right=bottom_right,
                                     masks=masks)
    return out, lse2


@attention_fwd.register_fake
def _(q, k, v, scale, causal, bottom_right, backend, *mask_args):
    B, H, Sq = q.shape[:3]
    return empty_like_layout(q, v.shape[-1]), q.new_empty((B, H, Sq), dtype=_ACC[q.dtype])


@torch.library.custom_op("flashtx::attention_bwd", mutates_args=())
def attention_bwd(do: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse2: Tensor,
                  dlse2: Optional[Tensor], scale: float, causal: bool, bottom_right: bool,
                  backend: str, window_left: int = -1, window_right: int = -1, key_mask: Optional[Tensor] = None,
                  query_mask: Optional[Tensor] = None, q_lens: Optional[Tensor] = None,
                  kv_lens: Optional[Tensor] = None, cu_seqlens_q: Optional[Tensor] = None,
                  cu_seqlens_k: Optional[Tensor] = None, max_seqlen_q: int = 0, max_seqlen_k: int = 0,
                  max_seqlen_q_t: Optional[Tensor] = None,
                  max_seqlen_k_t: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    masks = _masks(window_left, window_right, key_mask, query_mask, q_lens, kv_lens, cu_seqlens_q, cu_seqlens_k,
                   max_seqlen_q, max_seqlen_k, max_seqlen_q_t, max_seqlen_k_t)
    dq, dk, dv = (empty_like_layout(t, t.shape[-1]) for t in (q, k, v))
    BACKENDS[backend].backward(do, q, k, v, out, lse2, dlse2, dq, dk, dv, scale=scale, causal=causal,
                               bottom_right=bottom_right, masks=masks)
    return dq, dk, dv


@attention_bwd.register_fake
def _(do, q, k, v, out, lse2, dlse2, scale, causal, bottom_right, backend, *mask_args):
    return empty_like_layout(q, q.shape[-1]), empty_like_layout(k, k.shape[-1]), empty_like_layout(v, v.shape[-1])


def _setup_context(ctx, inputs, output):
    q, k, v, scale, causal, bottom_right, backend = inputs[:7]
    wl, wr, km, qm, ql, kl, cuq, cuk, msq, msk, msq_t, msk_t = inputs[7:]
    out, lse2 = output
    ctx.save_for_backward(q, k, v, out, lse2, km, qm, ql, kl, cuq, cuk, msq_t, msk_t)
    ctx.args = (scale, causal, bottom_right, backend, wl, wr, msq, msk)


def _backward(ctx, dout, dlse2):
    q, k, v, out, lse2, km, qm, ql, kl, cuq, cuk, msq_t, msk_t = ctx.saved_tensors
    scale, causal, bottom_right, backend, wl, wr, msq, msk = ctx.args
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv = attention_bwd(dout, q, k, v, out, lse2, dlse2, scale, causal, bottom_right, backend,
                               wl, wr, km, qm, ql, kl, cuq, cuk, msq, msk, msq_t, msk_t)
    return (dq, dk, dv) + (None,) * (4 + N_MASK_ARGS)


attention_fwd.register_autograd(_backward, setup_context=_setup_context)
