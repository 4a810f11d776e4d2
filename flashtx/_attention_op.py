"""The attention op: torch.library custom ops with fake impls and registered autograd.

`flashtx::attention_fwd` returns (out, lse2) and saves (q, k, v, out, lse2) for backward;
`flashtx::attention_bwd` recomputes P from lse2 through the same backend. Both take (B, H, S, D)
views with any strides. Being custom ops, they trace under torch.compile(fullgraph=True).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .backends import BACKENDS

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


@torch.library.custom_op("flashtx::attention_fwd", mutates_args=())
def attention_fwd(q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool, bottom_right: bool,
                  backend: str) -> tuple[Tensor, Tensor]:
    out = empty_like_layout(q, v.shape[-1])  # (B, Hq, Sq, Dv)
    lse2 = BACKENDS[backend].forward(q, k, v, out, scale=scale, causal=causal, bottom_right=bottom_right)
    return out, lse2


@attention_fwd.register_fake
def _(q, k, v, scale, causal, bottom_right, backend):
    B, H, Sq = q.shape[:3]
    return empty_like_layout(q, v.shape[-1]), q.new_empty((B, H, Sq), dtype=_ACC[q.dtype])


@torch.library.custom_op("flashtx::attention_bwd", mutates_args=())
def attention_bwd(do: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse2: Tensor,
                  dlse2: Optional[Tensor], scale: float, causal: bool, bottom_right: bool,
                  backend: str) -> tuple[Tensor, Tensor, Tensor]:
    dq, dk, dv = (empty_like_layout(t, t.shape[-1]) for t in (q, k, v))
    BACKENDS[backend].backward(do, q, k, v, out, lse2, dlse2, dq, dk, dv, scale=scale, causal=causal,
                               bottom_right=bottom_right)
    return dq, dk, dv


@attention_bwd.register_fake
def _(do, q, k, v, out, lse2, dlse2, scale, causal, bottom_right, backend):
    return empty_like_layout(q, q.shape[-1]), empty_like_layout(k, k.shape[-1]), empty_like_layout(v, v.shape[-1])


def _setup_context(ctx, inputs, output):
    q, k, v, scale, causal, bottom_right, backend = inputs
    out, lse2 = output
    ctx.save_for_backward(q, k, v, out, lse2)
    ctx.args = (scale, causal, bottom_right, backend)


def _backward(ctx, dout, dlse2):
    q, k, v, out, lse2 = ctx.saved_tensors
    scale, causal, bottom_right, backend = ctx.args
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv = attention_bwd(dout, q, k, v, out, lse2, dlse2, scale, causal, bottom_right, backend)
    return dq, dk, dv, None, None, None, None


attention_fwd.register_autograd(_backward, setup_context=_setup_context)
