"""The attention ops: `flashtx::attn_fwd`, `flashtx::attn_bwd` (triton_ops) and `flashtx::attn_probs`.

Each op takes (B, H, S, D) views with any strides, or, with `Ints.bshd`, (B, S, H, D) tensors (flash-attn's
layout: the kernels read them through their strides, so no transposed views are made per call, nor
transposes recorded by autograd), and small grouped arguments:

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

import operator
from typing import NamedTuple, Optional

import torch
from torch import Tensor

from . import _dispatch, _env
from ._library import call, register_autograd, triton_op
from ._validate import refuse_double_backward
from .backends import BACKENDS as _BACKENDS
from .backends import AttentionInputs, inputs_summary
from .triton_kernels.limits import INT32_MAX, LimitExceeded, bhsd, surely, within_limits
from .triton_kernels.mask_spec import NO_MASKS, MaskSpec


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
    bshd: int = 0  # 1: q, k, v (and out, do, the gradients) are (B, S, H, D) tensors, not (B, H, S, D) views


NO_GRAD, GRAD, BIAS_GRAD = 0, 1, 2


class Floats(NamedTuple):
    """The float arguments of an attention op (its `floats` list), in order."""
    scale: float
    softcap: float = 0.0
    dropout_p: float = 0.0


_NONES = (None,) * len(Aux._fields)


def _all_none(aux: list) -> bool:
    """Whether every aux entry is None, by identity only (list.count would call a tensor's __eq__)."""
    return all(map(operator.is_, aux, _NONES))


def spec_of(bias, aux: list, ints: list, floats: list, no_aux: bool | None = None) -> MaskSpec:
    """The MaskSpec of an op's arguments (its `ints` and `floats` lists, or Ints and Floats). no_aux: whether
    every aux entry is None, if already known."""
    if no_aux is None:
        no_aux = _all_none(aux)
    # by position (no NamedTuple built in the common case): window_left/right; softcap, dropout_p
    if no_aux and bias is None and ints[2] < 0 and ints[3] < 0 and floats[1] == 0.0 and floats[2] == 0.0:
        return NO_MASKS  # the common case: no MaskSpec built
    a, it, fl = Aux(*aux), Ints(*ints), Floats(*floats)
    return MaskSpec((it.window_left, it.window_right), a.key_mask, a.query_mask, a.q_lens, a.kv_lens,
                    a.cu_seqlens_q, a.cu_seqlens_k, it.max_seqlen_q, it.max_seqlen_k, bias, fl.softcap,
                    a.alibi_slopes, fl.dropout_p, a.rng)


def empty_like_layout(t: Tensor, last_dim: int) -> Tensor:
    """Uninitialised (B, H, S, last_dim) tensor whose first three dims are ordered in memory as t's: the
    gradients (each like its input), and outputs too wide for out_layout's order.

    So a gradient for (B, S, H, D) inputs viewed as (B, H, S, D) is itself (B, S, H, D) in memory.
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


def out_layout(q: Tensor, last_dim: int, bshd: bool) -> Tensor:
    """The uninitialised attention output of q: a (B, Hq, Sq, last_dim) view of a contiguous (B, Sq, Hq, last_dim)
    tensor, or with bshd that tensor itself. Whatever q's layout, as SDPA's flash and memory-efficient
    kernels lay out theirs, so merging the heads (``out.transpose(1, 2).reshape(B, Sq, -1)``, transformers'
    attention functions) copies nothing. Except where that layout's sequence span, Sq * Hq * last_dim, passes
    the kernels' int32 offsets (limits.check_spans) while q's own may not: then laid out as q (empty_like_layout)."""
    a, b, c = q.shape[:3]
    if surely(b * c * last_dim > INT32_MAX):  # (an undecided traced size: unpad_input's total, whose q spans as much)
        return empty_like_layout(q, last_dim)
    if bshd:
        return torch.empty(a, b, c, last_dim, dtype=q.dtype, device=q.device)
    # one allocation, not a transposed view of one (no view bookkeeping)
    return torch.empty_strided((a, b, c, last_dim), (b * c * last_dim, last_dim, b * last_dim, 1), dtype=q.dtype,
                               device=q.device)


_PLANS = _dispatch.plan_table("attention")  # _plan's key -> backend name (flashtx._dispatch.plan's answer)


def _plan(q, k, v, bias, aux, ints: list, floats: list, backend: str, no_aux: bool = False) -> str:
    """The backend for these inputs, cached per key (one dict lookup). The backward plans with the forward's
    arguments, so both take the same backend. no_aux: every aux is None. Shape limits are not part of the
    key: a call past one is not cached, and the Triton launchers check them once per call signature (raising
    LimitExceeded, see _replan), so a cached plan never launches a grid the GPU refuses."""
    # Ints/Floats fields by position (no NamedTuple built per call): causal, window_left, window_right,
    # needs_grad; softcap, dropout_p (whether each window side is on decides the masks' tile table, see
    # configs' masks_visibility). Head dims as ints: under dynamic shapes they are SymInts (unhashable); the
    # kernels specialise on them anyway.
    key = (q.device, q.dtype, int(q.shape[3]), int(v.shape[3]), ints[0], ints[2] >= 0, ints[3] >= 0,
           None if no_aux else tuple(t is not None for t in aux), None if bias is None else bias.dtype,
           floats[1] > 0, floats[2] > 0, ints[6], backend)
    name = _PLANS.get(key)
    if name is None:
        inputs, summary = _describe(q, k, v, bias, aux, ints, floats)
        if not within_limits(*bhsd(ints[7], q, k, v), bias, aux[4]):  # aux[4]: Aux.cu_seqlens_q
            # past a shape limit: this call's answer, not the key's (a cached `reference` would serve every
            # later call of this kind, however small)
            return _dispatch.resolve("attention", backend or None, inputs(), summary)
        name = _PLANS[key] = _dispatch.resolve("attention", backend or None, inputs(), summary)
    return name


def _describe(q, k, v, bias, aux, ints, floats) -> tuple:
    """(inputs(), summary()): the AttentionInputs of an op's arguments and its description, built on demand."""
    it, fl = Ints(*ints), Floats(*floats)
    q, k, v = bhsd(ints[7], q, k, v)

    def inputs():
        return AttentionInputs(q, k, v, bool(it.causal), bool(it.bottom_right), spec_of(bias, aux, it, fl),
                               needs_grad=it.needs_grad)

    def summary():
        return inputs_summary(inputs())

    return inputs, summary


def _replan(q, k, v, bias, aux, ints, floats, backend: str, exc: LimitExceeded) -> str:
    """The backend after the planned one raised LimitExceeded: resolved again, uncached, with every
    backend's reasons (a requested backend raises them; otherwise `reference` runs, with a warning)."""
    inputs, summary = _describe(q, k, v, bias, aux, ints, floats)
    name = _dispatch.resolve("attention", backend or None, inputs(), summary)
    if name == "triton":  # a limit the reasons cannot see (the spans of the outputs and gradients the launcher
        # allocates, of dout): never loop, never launch
        if backend:
            raise _dispatch.BackendNotSupported(f"attention: backend='triton' cannot run {summary()}: {exc}")
        _env.warn(f"flashtx.attention: {exc}; using the reference implementation")
        return "reference"
    return name


@triton_op("flashtx::attn_fwd", mutates_args=())
def attn_fwd(q: Tensor, k: Tensor, v: Tensor, bias: Optional[Tensor], aux: list[Optional[Tensor]], ints: list[int],
             floats: list[float], backend: str) -> tuple[Tensor, Tensor, Tensor]:
    """(out (B, Hq, Sq, Dv), m2 (B, Hq, Sq), l2 (B, Hq, Sq)) of q (B, Hq, Sq, D), k (B, Hkv, Sk, D),
    v (B, Hkv, Sk, Dv) (with Ints.bshd: out (B, Sq, Hq, Dv) of (B, S, H, D) q, k, v); see the module docstring."""
    no_aux = _all_none(aux)
    name = _plan(q, k, v, bias, aux, ints, floats, backend, no_aux)
    out = out_layout(q, v.shape[-1], bool(ints[7]))  # (B, Hq, Sq, Dv) over (B, Sq, Hq, Dv) memory; bshd: that
    masks = spec_of(bias, aux, ints, floats, no_aux)
    try:
        m2, l2 = _BACKENDS[name].forward(q, k, v, out, scale=floats[0], causal=bool(ints[0]),
                                         bottom_right=bool(ints[1]), masks=masks, bshd=bool(ints[7]))
    except LimitExceeded as exc:
        m2, l2 = _BACKENDS[_replan(q, k, v, bias, aux, ints, floats, backend, exc)].forward(
            q, k, v, out, scale=floats[0], causal=bool(ints[0]), bottom_right=bool(ints[1]), masks=masks,
            bshd=bool(ints[7]))
    return out, m2, l2


@triton_op("flashtx::attn_bwd", mutates_args=())
def attn_bwd(do: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, m2: Tensor, l2: Tensor, dl2: Optional[Tensor],
             bias: Optional[Tensor], aux: list[Optional[Tensor]], ints: list[int], floats: list[float], backend: str,
             bias_grad: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dq, dk, dv, dbias), each gradient laid out like its input; dbias is the bias's gradient (its shape)
    when bias_grad, else empty. dl2 is the cotangent of the lse (log2 units), or None. Arguments as the
    forward's."""
    it, fl = Ints(*ints), Floats(*floats)
    no_aux = _all_none(aux)
    name = _plan(q, k, v, bias, aux, ints, floats, backend, no_aux)
    dq, dk, dv = empty_like_layout(q, q.shape[3]), empty_like_layout(k, k.shape[3]), empty_like_layout(v, v.shape[3])
    dbias = torch.empty_like(bias, memory_format=torch.contiguous_format) if bias_grad else q.new_empty(0)
    kw = dict(scale=fl.scale, causal=bool(it.causal), bottom_right=bool(it.bottom_right),
              masks=spec_of(bias, aux, it, fl, no_aux), dbias=dbias if bias_grad else None, bshd=bool(it.bshd))
    try:
        _BACKENDS[name].backward(do, q, k, v, out, m2, l2, dl2, dq, dk, dv, **kw)
    except LimitExceeded as exc:
        _BACKENDS[_replan(q, k, v, bias, aux, ints, floats, backend, exc)].backward(
            do, q, k, v, out, m2, l2, dl2, dq, dk, dv, **kw)
    return dq, dk, dv, dbias


# A custom_op, not a triton_op: its output shape for varlen is (nseq, H, max_seqlen_q, max_seqlen_k),
# and it is a testing aid (O(Sq * Sk) memory) that no model step traces.
@torch.library.custom_op("flashtx::attn_probs", mutates_args=())
def attn_probs(q: Tensor, k: Tensor, v: Tensor, m2: Tensor, l2: Tensor, bias: Optional[Tensor],
               aux: list[Optional[Tensor]], ints: list[int], floats: list[float], backend: str) -> Tensor:
    """The probabilities of the forward that returned (m2, l2): (B, H, Sq, Sk) (varlen (nseq, H,
    max_seqlen_q, max_seqlen_k)) in m2's dtype, entries dropped by dropout negated."""
    it, fl = Ints(*ints), Floats(*floats)
    name = _plan(q, k, v, bias, aux, ints, floats, backend, _all_none(aux))
    q, k, v = bhsd(ints[7], q, k, v)
    kw = dict(scale=fl.scale, causal=bool(it.causal), bottom_right=bool(it.bottom_right),
              masks=spec_of(bias, aux, it, fl))
    try:
        return _BACKENDS[name].probs(q, k, v, m2, l2, **kw)
    except LimitExceeded as exc:
        return _BACKENDS[_replan(q, k, v, bias, aux, [*ints[:7], 0], floats, backend, exc)].probs(q, k, v, m2, l2,
                                                                                                **kw)


@attn_probs.register_fake
def _(q, k, v, m2, l2, bias, aux, ints, floats, backend):
    it, a = Ints(*ints), Aux(*aux)
    q, k = bhsd(ints[7], q, k)
    B, Sq, Sk = q.shape[0], q.shape[2], k.shape[2]
    if a.cu_seqlens_q is not None:
        B, Sq, Sk = a.cu_seqlens_q.shape[0] - 1, it.max_seqlen_q, it.max_seqlen_k
    return q.new_empty((B, q.shape[1], Sq, Sk), dtype=m2.dtype)


def _setup_context(ctx, inputs, output):
    q, k, v, bias, aux, ints, floats, backend = inputs
    out, m2, l2 = output
    ctx.mark_non_differentiable(m2)  # lse = m2 + l2: its cotangent reaches l2 alone
    ctx.set_materialize_grads(False)
    no_aux = _all_none(aux)
    if no_aux:
        ctx.save_for_backward(q, k, v, out, m2, l2, savable(bias))  # fewer saved slots to unpack in the common case
    else:
        ctx.save_for_backward(q, k, v, out, m2, l2, *map(savable, (bias, *aux)))
    ctx.args = (ints, floats, backend, len(aux) if no_aux else 0)


def savable(t):
    """t as autograd can save it: an inference tensor (a mask, lengths or slopes made under torch.inference_mode,
    e.g. cached in an eval pass) cloned (autograd refuses to save one; SDPA, whose backward reads no mask, takes a
    bool mask made so). Such a tensor cannot change in place outside inference mode, so the clone is its value.
    Eager calls (a compiled step's setup sees fake tensors: there such a mask still cannot be saved)."""
    return t.clone() if t is not None and t.is_inference() else t


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
