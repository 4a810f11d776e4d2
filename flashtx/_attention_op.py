"""The attention op: torch.library custom ops with fake impls and registered autograd.

`flashtx::attention_fwd` returns (out, m2, l2) (row max of the scores and log2 of the row sum,
log2 units; lse2 = m2 + l2) and saves (q, k, v, out, m2, l2) for backward; `flashtx::attention_bwd`
recomputes P = exp2(s2 - m2) * exp2(-l2) through the same backend. Both take (B, H, S, D)
views with any strides. Being custom ops, they trace under torch.compile(fullgraph=True).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ._validate import refuse_double_backward
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
           max_seqlen_q, max_seqlen_k, max_seqlen_q_t, max_seqlen_k_t, attn_mask, softcap, alibi_slopes,
           dropout_p, rng) -> AttentionMasks:
    """The op's flat mask arguments as AttentionMasks; 0-dim max_seqlen tensors are read here, at
    run time (outside any traced graph)."""
    if max_seqlen_q_t is not None:
        max_seqlen_q = int(max_seqlen_q_t.item())
    if max_seqlen_k_t is not None:
        max_seqlen_k = int(max_seqlen_k_t.item())
    return AttentionMasks((window_left, window_right), key_mask, query_mask, q_lens, kv_lens, cu_seqlens_q,
                          cu_seqlens_k, max_seqlen_q, max_seqlen_k, attn_mask, softcap, alibi_slopes, dropout_p, rng)


# The mask arguments every attention op takes after (scale, causal, bottom_right, backend), in order:
# window_left, window_right (int, -1 = unbounded), key_mask, query_mask, q_lens, kv_lens,
# cu_seqlens_q, cu_seqlens_k (Optional[Tensor]), max_seqlen_q, max_seqlen_k (int),
# max_seqlen_q_t, max_seqlen_k_t (Optional 0-dim tensors that override the ints),
# attn_mask (Optional 4-D Tensor), softcap (float), alibi_slopes (Optional (1|B, H) Tensor),
# dropout_p (float), rng (Optional (1,) int64 seed Tensor).
N_MASK_ARGS = 17


def _mask_arg(mask_args: tuple, i: int, default=None):
    """The i-th mask argument as a fake impl sees it (trailing defaults may be left out)."""
    return mask_args[i] if len(mask_args) > i else default

ATTN_MASK_INDEX = 7 + 12  # position of attn_mask among attention_fwd's inputs


@torch.library.custom_op("flashtx::attention_fwd", mutates_args=())
def attention_fwd(q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool, bottom_right: bool,
                  backend: str, window_left: int = -1, window_right: int = -1, key_mask: Optional[Tensor] = None,
                  query_mask: Optional[Tensor] = None, q_lens: Optional[Tensor] = None,
                  kv_lens: Optional[Tensor] = None, cu_seqlens_q: Optional[Tensor] = None,
                  cu_seqlens_k: Optional[Tensor] = None, max_seqlen_q: int = 0, max_seqlen_k: int = 0,
                  max_seqlen_q_t: Optional[Tensor] = None,
                  max_seqlen_k_t: Optional[Tensor] = None, attn_mask: Optional[Tensor] = None,
                  softcap: float = 0.0, alibi_slopes: Optional[Tensor] = None, dropout_p: float = 0.0,
                  rng: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    masks = _masks(window_left, window_right, key_mask, query_mask, q_lens, kv_lens, cu_seqlens_q, cu_seqlens_k,
                   max_seqlen_q, max_seqlen_k, max_seqlen_q_t, max_seqlen_k_t, attn_mask, softcap, alibi_slopes,
                   dropout_p, rng)
    out = empty_like_layout(q, v.shape[-1])  # (B, Hq, Sq, Dv)
    m2, l2 = BACKENDS[backend].forward(q, k, v, out, scale=scale, causal=causal, bottom_right=bottom_right,
                                       masks=masks)
    return out, m2, l2


@attention_fwd.register_fake
def _(q, k, v, scale, causal, bottom_right, backend, *mask_args):
    B, H, Sq = q.shape[:3]
    return (empty_like_layout(q, v.shape[-1]), q.new_empty((B, H, Sq), dtype=_ACC[q.dtype]),
            q.new_empty((B, H, Sq), dtype=_ACC[q.dtype]))


@torch.library.custom_op("flashtx::attention_bwd", mutates_args=())
def attention_bwd(do: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, m2: Tensor, l2: Tensor,
                  dlse2: Optional[Tensor], scale: float, causal: bool, bottom_right: bool,
                  backend: str, bias_grad: bool, window_left: int = -1, window_right: int = -1,
                  key_mask: Optional[Tensor] = None,
                  query_mask: Optional[Tensor] = None, q_lens: Optional[Tensor] = None,
                  kv_lens: Optional[Tensor] = None, cu_seqlens_q: Optional[Tensor] = None,
                  cu_seqlens_k: Optional[Tensor] = None, max_seqlen_q: int = 0, max_seqlen_k: int = 0,
                  max_seqlen_q_t: Optional[Tensor] = None,
                  max_seqlen_k_t: Optional[Tensor] = None, attn_mask: Optional[Tensor] = None,
                  softcap: float = 0.0, alibi_slopes: Optional[Tensor] = None, dropout_p: float = 0.0,
                  rng: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dq, dk, dv, dbias); dbias is attn_mask's gradient (its shape) when bias_grad, else empty."""
    masks = _masks(window_left, window_right, key_mask, query_mask, q_lens, kv_lens, cu_seqlens_q, cu_seqlens_k,
                   max_seqlen_q, max_seqlen_k, max_seqlen_q_t, max_seqlen_k_t, attn_mask, softcap, alibi_slopes,
                   dropout_p, rng)
    dq, dk, dv = (empty_like_layout(t, t.shape[-1]) for t in (q, k, v))
    dbias = torch.empty_like(attn_mask, memory_format=torch.contiguous_format) if bias_grad else q.new_empty(0)
    BACKENDS[backend].backward(do, q, k, v, out, m2, l2, dlse2, dq, dk, dv, scale=scale, causal=causal,
                               bottom_right=bottom_right, masks=masks, dbias=dbias if bias_grad else None)
    return dq, dk, dv, dbias


@attention_bwd.register_fake
def _(do, q, k, v, out, m2, l2, dlse2, scale, causal, bottom_right, backend, bias_grad, *mask_args):
    attn_mask = _mask_arg(mask_args, 12)
    dbias = torch.empty_like(attn_mask, memory_format=torch.contiguous_format) if bias_grad else q.new_empty(0)
    return (empty_like_layout(q, q.shape[-1]), empty_like_layout(k, k.shape[-1]), empty_like_layout(v, v.shape[-1]),
            dbias)


@torch.library.custom_op("flashtx::attention_probs", mutates_args=())
def attention_probs(q: Tensor, k: Tensor, v: Tensor, m2: Tensor, l2: Tensor, scale: float, causal: bool,
                    bottom_right: bool, backend: str, window_left: int = -1, window_right: int = -1,
                    key_mask: Optional[Tensor] = None, query_mask: Optional[Tensor] = None,
                    q_lens: Optional[Tensor] = None, kv_lens: Optional[Tensor] = None,
                    cu_seqlens_q: Optional[Tensor] = None, cu_seqlens_k: Optional[Tensor] = None,
                    max_seqlen_q: int = 0, max_seqlen_k: int = 0, max_seqlen_q_t: Optional[Tensor] = None,
                    max_seqlen_k_t: Optional[Tensor] = None, attn_mask: Optional[Tensor] = None,
                    softcap: float = 0.0, alibi_slopes: Optional[Tensor] = None, dropout_p: float = 0.0,
                    rng: Optional[Tensor] = None) -> Tensor:
    """The probabilities of the forward that returned (m2, l2): (B, H, Sq, Sk) (varlen (nseq, H, max_q,
    max_k)) in m2's dtype, entries dropped by dropout negated. Not differentiable."""
    masks = _masks(window_left, window_right, key_mask, query_mask, q_lens, kv_lens, cu_seqlens_q, cu_seqlens_k,
                   max_seqlen_q, max_seqlen_k, max_seqlen_q_t, max_seqlen_k_t, attn_mask, softcap, alibi_slopes,
                   dropout_p, rng)
    return BACKENDS[backend].probs(q, k, v, m2, l2, scale=scale, causal=causal, bottom_right=bottom_right, masks=masks)


def _setup_context(ctx, inputs, output):
    q, k, v, scale, causal, bottom_right, backend = inputs[:7]
    (wl, wr, km, qm, ql, kl, cuq, cuk, msq, msk, msq_t, msk_t, am, softcap, alibi, dropout_p, rng) = inputs[7:]
    out, m2, l2 = output
    ctx.set_materialize_grads(False)  # an unused lse gives dl2 = None: the backward skips its term
    ctx.save_for_backward(q, k, v, out, m2, l2, km, qm, ql, kl, cuq, cuk, msq_t, msk_t, am, alibi, rng)
    ctx.args = (scale, causal, bottom_right, backend, wl, wr, msq, msk, softcap, dropout_p)


def _backward(ctx, dout, dm2, dl2):
    # lse2 = m2 + l2 is the only use of (m2, l2) (flashtx.functional), so dl2 is its cotangent
    dlse2 = dl2
    q, k, v, out, m2, l2, km, qm, ql, kl, cuq, cuk, msq_t, msk_t, am, alibi, rng = ctx.saved_tensors
    scale, causal, bottom_right, backend, wl, wr, msq, msk, softcap, dropout_p = ctx.args
    if dout is None:
        dout = torch.zeros_like(out)
    nig = ctx.needs_input_grad  # trailing arguments left at their defaults are not in it
    bias_grad = len(nig) > ATTN_MASK_INDEX and bool(nig[ATTN_MASK_INDEX])
    dq, dk, dv, dbias = attention_bwd(dout, q, k, v, out, m2, l2, dlse2, scale, causal, bottom_right, backend,
                                      bias_grad, wl, wr, km, qm, ql, kl, cuq, cuk, msq, msk, msq_t, msk_t, am,
                                      softcap, alibi, dropout_p, rng)
    grads = [dq, dk, dv] + [None] * (len(nig) - 3)
    if bias_grad:
        grads[ATTN_MASK_INDEX] = dbias
    return tuple(grads)


attention_fwd.register_autograd(_backward, setup_context=_setup_context)
refuse_double_backward(attention_bwd, "attention",
                       "torch.nn.functional.scaled_dot_product_attention or flashtx.reference.attention")


@attention_probs.register_fake
def _(q, k, v, m2, l2, scale, causal, bottom_right, backend, *mask_args):
    B, Sq, Sk = q.shape[0], q.shape[2], k.shape[2]
    cu_q = _mask_arg(mask_args, 6)
    if cu_q is not None:  # varlen: (nseq, H, max_seqlen_q, max_seqlen_k)
        msq, msk = _mask_arg(mask_args, 8, 0), _mask_arg(mask_args, 9, 0)
        msq = msq if _mask_arg(mask_args, 10) is None else torch.library.get_ctx().new_dynamic_size()
        msk = msk if _mask_arg(mask_args, 11) is None else torch.library.get_ctx().new_dynamic_size()
        B, Sq, Sk = cu_q.shape[0] - 1, msq, msk
    return q.new_empty((B, q.shape[1], Sq, Sk), dtype=m2.dtype)
