"""The attention ops: `flashtx::attn_fwd`, `flashtx::attn_bwd` (triton_ops) and `flashtx::attn_probs`.

Each op takes (B, H, S, D) views with any strides and small grouped arguments:

    bias    Optional[Tensor]: attn_mask as a 4-D view (the only differentiable optional input)
    aux     Tensor?[]: the other optional tensors, in `Aux`'s field order
    ints    int[]: `Ints`' fields; floats float[]: `Floats`' fields
    backend str: "" (automatic) or a backend name

The op body resolves its backend through flashtx._dispatch's plan cache (one dict lookup) and
calls it. The forward returns (out, m2, l2): the row max of the scores and the log2 of the row sum
of exp2(s2 - m2), both (B, H, Sq) in the accumulator dtype (log2 units; rows that see no key have
m2 = -inf, l2 = 0). The backward recomputes P = exp2(s2 - m2) * exp2(-l2): kept apart, so rows
whose scores all sit at a huge finite value (a -1e9 mask) keep log2(l) exactly. The natural lse is
(m2 + l2) * ln 2, and an unused lse gives dl2 = None (no dlse work in the backward).
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import Tensor

from . import _dispatch
from ._library import call, register_autograd, triton_op
from ._validate import refuse_double_backward
from .backends import AttentionInputs, inputs_summary, within_limits
from .triton_kernels.mask_spec import NO_MASKS, MaskSpec

_ACC = {torch.float16: torch.float32, torch.bfloat16: torch.float32, torch.float32: torch.float32,
        torch.float64: torch.float64}


class Aux(NamedTuple):
    """The optional tensors of an attention op (its `aux` list), in order."""
    key_mask: Optional[Tensor] = None  # (B, Sk) bool, True = real key
    query_mask: Optional[Tensor] = None  # (B, Sq) bool
    q_lens: Optional[Tensor] = None  # (B,) int
    kv_lens: Optional[Tensor] = None  # (B,) int
    cu_seqlens_q: Optional[Tensor] = None  # (nseq + 1,) int32 (varlen)
    cu_seqlens_k: Optional[Tensor] = None
    alibi_slopes: Optional[Tensor] = None  # (1 | B, Hq) float32
    rng: Optional[Tensor] = None  # (1,) int64 dropout seed


class Ints(NamedTuple):
    """The int arguments of an attention op (its `ints` list), in order."""
    causal: int
    bottom_right: int
    window_left: int = -1
    window_right: int = -1
    max_seqlen_q: int = 0  # varlen: grid bound (at most total_q)
    max_seqlen_k: int = 0
    needs_grad: int = 0  # NO_GRAD, GRAD (the plan must fit the backward too) or BIAS_GRAD (and the bias's)


NO_GRAD, GRAD, BIAS_GRAD = 0, 1, 2


class Floats(NamedTuple):
    """The float arguments of an attention op (its `floats` list), in order."""
    scale: float
    softcap: float = 0.0
    dropout_p: float = 0.0


def spec_of(bias, aux: list, ints: Ints, floats: Floats, no_aux: bool | None = None) -> MaskSpec:
    """The MaskSpec of an op's arguments. no_aux: whether every aux entry is None, if already known."""
    if no_aux is None:
        no_aux = all(t is None for t in aux)
    if (no_aux and bias is None and ints.window_left < 0 and ints.window_right < 0 and floats.softcap == 0.0
            and floats.dropout_p == 0.0):
        return NO_MASKS  # the common case: no MaskSpec built
    a = Aux(*aux)
    return MaskSpec((ints.window_left, ints.window_right), a.key_mask, a.query_mask, a.q_lens, a.kv_lens,
                    a.cu_seqlens_q, a.cu_seqlens_k, ints.max_seqlen_q, ints.max_seqlen_k, bias, floats.softcap,
                    a.alibi_slopes, floats.dropout_p, a.rng)


def empty_like_layout(t: Tensor, last_dim: int) -> Tensor:
    """Uninitialised (B, H, S, last_dim) tensor whose first three dims are ordered in memory as t's.

    So an output for (B, S, H, D) inputs viewed as (B, H, S, D) is itself (B, S, H, D) in memory.
    """
    if last_dim == t.shape[3] and t.stride(3) == 1:
        return torch.empty_like(t)  # keeps the memory order of t's dims (dense or not), in one call
    B, H, S = t.shape[:3]
    s0, s1, s2 = t.stride()[:3]
    if s0 >= s1 >= s2:  # (B, H, S) order: the common cases first
        return torch.empty(B, H, S, last_dim, dtype=t.dtype, device=t.device)
    if s0 >= s2 > s1:  # (B, S, H) order
        return torch.empty(B, S, H, last_dim, dtype=t.dtype, device=t.device).transpose(1, 2)
    shape = [B, H, S]
    order = sorted(range(3), key=lambda i: (-t.stride(i), i))  # outermost first
    buf = torch.empty([shape[i] for i in order] + [last_dim], dtype=t.dtype, device=t.device)
    inverse = [order.index(i) for i in range(3)] + [3]
    return buf.permute(inverse)


def _plan(q, k, v, bias, aux, ints: Ints, floats: Floats, backend: str, no_aux: bool = False) -> str:
    """The backend for these inputs: cached per key; shape limits are checked on every call. The
    backward plans with the forward's arguments, so both take the same backend. no_aux: every aux is None."""
    # head dims as ints: under dynamic shapes they are SymInts (unhashable); the kernels specialise on them anyway
    key = (q.device, q.dtype, int(q.shape[-1]), int(v.shape[-1]), ints.causal, ints.window_left >= 0,
           None if no_aux else tuple(t is not None for t in aux), None if bias is None else bias.dtype,
           floats.softcap > 0, floats.dropout_p > 0, ints.needs_grad)

    def inputs():
        return AttentionInputs(q, k, v, bool(ints.causal), bool(ints.bottom_right), spec_of(bias, aux, ints, floats),
                               needs_grad=ints.needs_grad)

    def summary():
        return inputs_summary(inputs())

    if not within_limits(q, k, v, bias, aux[4]):  # aux[4]: Aux.cu_seqlens_q  # rare: let the reasons say which limit
        return _dispatch.resolve("attention", backend or None, inputs(), summary)
    return _dispatch.plan("attention", key, backend or None, inputs, summary)


@triton_op("flashtx::attn_fwd", mutates_args=())
def attn_fwd(q: Tensor, k: Tensor, v: Tensor, bias: Optional[Tensor], aux: list[Optional[Tensor]], ints: list[int],
             floats: list[float], backend: str) -> tuple[Tensor, Tensor, Tensor]:
    """(out (B, Hq, Sq, Dv), m2 (B, Hq, Sq), l2 (B, Hq, Sq)) of q (B, Hq, Sq, D), k (B, Hkv, Sk, D),
    v (B, Hkv, Sk, Dv); see the module docstring."""
    it, fl = Ints(*ints), Floats(*floats)
    no_aux = all(t is None for t in aux)
    name = _plan(q, k, v, bias, aux, it, fl, backend, no_aux)
    out = empty_like_layout(q, v.shape[-1])  # (B, Hq, Sq, Dv)
    m2, l2 = _dispatch.IMPLS["attention"][name].forward(
        q, k, v, out, scale=fl.scale, causal=bool(it.causal), bottom_right=bool(it.bottom_right),
        masks=spec_of(bias, aux, it, fl, no_aux))
    return out, m2, l2


@triton_op("flashtx::attn_bwd", mutates_args=())
def attn_bwd(do: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, m2: Tensor, l2: Tensor, dl2: Optional[Tensor],
             bias: Optional[Tensor], aux: list[Optional[Tensor]], ints: list[int], floats: list[float], backend: str,
             bias_grad: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dq, dk, dv, dbias); dbias is the bias's gradient (its shape) when bias_grad, else empty.
    dl2 is the cotangent of the lse (log2 units), or None. Arguments as the forward's."""
    it, fl = Ints(*ints), Floats(*floats)
    no_aux = all(t is None for t in aux)
    name = _plan(q, k, v, bias, aux, it, fl, backend, no_aux)
    dq, dk, dv = empty_like_layout(q, q.shape[3]), empty_like_layout(k, k.shape[3]), empty_like_layout(v, v.shape[3])
    dbias = torch.empty_like(bias, memory_format=torch.contiguous_format) if bias_grad else q.new_empty(0)
    _dispatch.IMPLS["attention"][name].backward(
        do, q, k, v, out, m2, l2, dl2, dq, dk, dv, scale=fl.scale, causal=bool(it.causal),
        bottom_right=bool(it.bottom_right), masks=spec_of(bias, aux, it, fl, no_aux),
        dbias=dbias if bias_grad else None)
    return dq, dk, dv, dbias


# A custom_op, not a triton_op: its output shape for varlen is (nseq, H, max_seqlen_q, max_seqlen_k),
# and it is a testing aid (O(Sq * Sk) memory) that no model step traces.
@torch.library.custom_op("flashtx::attn_probs", mutates_args=())
def attn_probs(q: Tensor, k: Tensor, v: Tensor, m2: Tensor, l2: Tensor, bias: Optional[Tensor],
               aux: list[Optional[Tensor]], ints: list[int], floats: list[float], backend: str) -> Tensor:
    """The probabilities of the forward that returned (m2, l2): (B, H, Sq, Sk) (varlen (nseq, H,
    max_seqlen_q, max_seqlen_k)) in m2's dtype, entries dropped by dropout negated."""
    it, fl = Ints(*ints), Floats(*floats)
    return _dispatch.IMPLS["attention"][_plan(q, k, v, bias, aux, it, fl, backend)].probs(
        q, k, v, m2, l2, scale=fl.scale, causal=bool(it.causal), bottom_right=bool(it.bottom_right),
        masks=spec_of(bias, aux, it, fl))


@attn_probs.register_fake
def _(q, k, v, m2, l2, bias, aux, ints, floats, backend):
    it, a = Ints(*ints), Aux(*aux)
    B, Sq, Sk = q.shape[0], q.shape[2], k.shape[2]
    if a.cu_seqlens_q is not None:
        B, Sq, Sk = a.cu_seqlens_q.shape[0] - 1, it.max_seqlen_q, it.max_seqlen_k
    return q.new_empty((B, q.shape[1], Sq, Sk), dtype=m2.dtype)


def _setup_context(ctx, inputs, output):
    q, k, v, bias, aux, ints, floats, backend = inputs
    out, m2, l2 = output
    ctx.mark_non_differentiable(m2)  # lse = m2 + l2: its cotangent reaches l2 alone
    ctx.set_materialize_grads(False)
    no_aux = all(t is None for t in aux)
    if no_aux:
        ctx.save_for_backward(q, k, v, out, m2, l2, bias)  # fewer saved slots to unpack in the common case
    else:
        ctx.save_for_backward(q, k, v, out, m2, l2, bias, *aux)
    ctx.args = (ints, floats, backend, len(aux) if no_aux else 0)


def _backward(ctx, dout, dm2, dl2):
    q, k, v, out, m2, l2, bias, *aux = ctx.saved_tensors
    ints, floats, backend, n_none = ctx.args
    if n_none:
        aux = [None] * n_none
    if dout is None and dl2 is None:
        return None, None, None, None, None, None, None, None
    if dout is None:  # only the lse was used
        dout = torch.zeros_like(out)
    bias_grad = bias is not None and ctx.needs_input_grad[3]
    dq, dk, dv, dbias = call(attn_bwd, dout, q, k, v, out, m2, l2, dl2, bias, aux, ints, floats, backend, bias_grad)
    return dq, dk, dv, dbias if bias_grad else None, None, None, None, None


register_autograd(attn_fwd, _backward, _setup_context)
refuse_double_backward(attn_bwd, "attention",
                       "torch.nn.functional.scaled_dot_product_attention or flashtx.reference.attention")
