"""The attention probabilities (flash-attn's return_attn_probs, for tests and small sizes).

`_attn_probs` recomputes tiles of P = exp2(s2 - m2) * exp2(-l2) from the forward's row statistics,
with every mask, modifier and the dropout draw of the forward, and writes P itself, entries dropped
by dropout negated. (The attn_mask gradient, which this kernel used to compute in a separate pass,
is written by the backward's dQ kernel as it forms dS: attention_bwd.py.)
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import attention_common
from .attention_common import (NO_MASKS, MaskSpec, dropout_keep, mask_args, mask_elt, modifier_scalars, scalar_in,
                               score_mods, seq_bounds, stride_args, visible, wide_dropout_plans)
from .configs import estimate_shared_memory, select_config
from .launch import ACC_DTYPE, LOG2E, Launch, cdiv, dot_precision, head_block, split_f32, target_for
from .limits import INT32_MAX, LimitExceeded, check_limits


@triton.jit
def _attn_probs(Q, K, M2, L2, OUT, Q_LENS, KV_LENS, CU_Q, CU_K, KM, QM, MB, AL, RNG,
                stride_qb, stride_qh, stride_qm, stride_qd,
                stride_kb, stride_kh, stride_kn, stride_kd,
                stride_outb, stride_outh, stride_outm, stride_outn,
                stride_lb, stride_lh, stride_kmb, stride_kmn, stride_qmb, stride_qmn,
                stride_mb, stride_mh, stride_mm, stride_mn, stride_alb,
                H, GROUP, Sq, Sk, D_QK, bottom_right, right, left, qk_scale_hi, qk_scale_lo,
                softcap_hi, softcap_lo, log2e_hi, log2e_lo, dropout_p, tiles_n,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DQK: tl.constexpr,
                CAUSAL: tl.constexpr, WINDOW: tl.constexpr, KEY_MASK: tl.constexpr, QUERY_MASK: tl.constexpr,
                LENS: tl.constexpr, VARLEN: tl.constexpr, MASK_KIND: tl.constexpr, EVERY_TILE: tl.constexpr,
                SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, DROPOUT: tl.constexpr,
                ACC: tl.constexpr, DOT_PREC: tl.constexpr):
    pid = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    kvh = h // GROUP
    offs_m = (pid // tiles_n) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = (pid % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_dqk = tl.arange(0, BLOCK_DQK)
    lq, lk, cq0, cq1, ck0, ck1 = b, b, b, b, b, b  # read by seq_bounds only under LENS / VARLEN
    if LENS:
        lq, lk = tl.load(Q_LENS + b), tl.load(KV_LENS + b)
    if VARLEN:
        cq0, cq1, ck0, ck1 = tl.load(CU_Q + b), tl.load(CU_Q + b + 1), tl.load(CU_K + b), tl.load(CU_K + b + 1)
    q_start, k_start, Sq_b, Sk_b, Sq_mem, Sk_mem, causal_shift, window_shift = seq_bounds(
        b, Sq, Sk, lq, lk, cq0, cq1, ck0, ck1, bottom_right, right, left, LENS, VARLEN)
    softcap2, log2e, slope2, seed = modifier_scalars(b, h, AL, stride_alb, RNG, softcap_hi, softcap_lo,
                                                     log2e_hi, log2e_lo, ALIBI, DROPOUT, ACC)
    row_ok = offs_m < Sq_b
    key_ok = offs_n[None, :] < Sk_b
    q = tl.load(Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh + q_start.to(tl.int64) * stride_qm
                + offs_m[:, None] * stride_qm + offs_dqk[None, :] * stride_qd,
                mask=row_ok[:, None] & (offs_dqk[None, :] < D_QK), other=0.0)  # (BLOCK_M, BLOCK_DQK)
    kt = tl.load(K + b.to(tl.int64) * stride_kb + kvh.to(tl.int64) * stride_kh + k_start.to(tl.int64) * stride_kn
                 + offs_n[None, :] * stride_kn + offs_dqk[:, None] * stride_kd,
                 mask=key_ok & (offs_dqk[:, None] < D_QK), other=0.0)  # (BLOCK_DQK, BLOCK_N)
    row = b.to(tl.int64) * stride_lb + h.to(tl.int64) * stride_lh + q_start + offs_m
    m2 = tl.load(M2 + row, mask=row_ok, other=float("-inf"))
    m2 = tl.where(m2 == float("-inf"), float("inf"), m2)  # rows that see no key: P = 0
    inv_l = tl.exp2(-tl.load(L2 + row, mask=row_ok, other=0.0))  # 1 / row sum
    s = tl.dot(q, kt, out_dtype=ACC, input_precision=DOT_PREC) * scalar_in(qk_scale_hi, qk_scale_lo, ACC)
    s, _ = score_mods(s, offs_m[:, None], offs_n[None, :], row_ok[:, None] & key_ok,
                      MB + b.to(tl.int64) * stride_mb + h.to(tl.int64) * stride_mh, stride_mm, stride_mn,
                      softcap2, slope2, Sk_b - Sq_b, log2e, MASK_KIND, SOFTCAP, ALIBI)
    if KEY_MASK:
        key_ok = tl.load(KM + b.to(tl.int64) * stride_kmb + offs_n[None, :] * stride_kmn, mask=key_ok, other=0) != 0
    vis = visible(offs_m[:, None], offs_n[None, :], Sq_b, Sk_b, causal_shift, window_shift, key_ok,
                  CAUSAL, WINDOW, KEY_MASK)
    p = tl.where(vis, tl.exp2(s - m2[:, None]) * inv_l[:, None], 0.0)  # (BLOCK_M, BLOCK_N)
    if DROPOUT:
        p = tl.where(dropout_keep(seed, b * H + h, offs_m[:, None], offs_n[None, :], Sk_b, dropout_p, DROPOUT), p, -p)
    tl.store(OUT + b.to(tl.int64) * stride_outb + h.to(tl.int64) * stride_outh + offs_m[:, None] * stride_outm
             + offs_n[None, :] * stride_outn, p.to(OUT.dtype.element_ty),
             mask=(offs_m[:, None] < Sq) & (offs_n[None, :] < Sk))


def plan_probs(q, k, m2, l2, out, *, scale: float, causal: bool, bottom_right: bool, spec: MaskSpec = NO_MASKS,
               target=None) -> Launch:
    """The launch that writes the probabilities into `out` (B, Hq, Sq, Sk) (varlen: (nseq, H, max_q, max_k)).
    q, k: (B, H, S, D) views (varlen (1, H, total, D))."""
    H, D_QK = q.shape[1], q.shape[3]
    target = target if target is not None else target_for(q)
    block_dqk = head_block(D_QK)
    cfg = select_config("attn_scores", block_dqk, block_dqk, q.element_size(), target, spec.modifies_scores,
                        spec.masks_visibility)
    hi, lo = split_f32(scale * LOG2E)
    margs, B, Sq, Sk = mask_args(spec, causal, bottom_right, q, k, m2)
    for name in ("drop_scale_hi", "drop_scale_lo"):
        margs.pop(name)
    tiles_n = cdiv(Sk, cfg.block_n)
    args = dict(
        Q=q, K=k, M2=m2, L2=l2, OUT=out, **stride_args("q", q, spec), **stride_args("k", k, spec),
        **{f"stride_out{ax}": st for ax, st in zip("bhmn", out.stride())},
        H=H, GROUP=H // k.shape[1], Sq=Sq, Sk=Sk, D_QK=D_QK, qk_scale_hi=hi, qk_scale_lo=lo, tiles_n=tiles_n,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_DQK=block_dqk,
        ACC=ACC_DTYPE[q.dtype], DOT_PREC=dot_precision(q.dtype), **margs,
    )
    grid = (cdiv(Sq, cfg.block_m) * tiles_n, H, B)
    est = estimate_shared_memory("attn_scores", cfg, block_dqk, block_dqk, q.element_size(), target,
                                 mask_elt(margs, Sq, Sk, q.dtype))
    return Launch(_attn_probs, grid, args, cfg, est)


def attention_probs(q, k, v, m2, l2, *, scale: float, causal: bool = False, bottom_right: bool = False,
                    spec: MaskSpec = NO_MASKS) -> torch.Tensor:
    """The attention probabilities of attention_forward's run (m2, l2 from it): (B, Hq, Sq, Sk) in the
    accumulator dtype (varlen: (nseq, Hq, max_seqlen_q, max_seqlen_k)), entries dropped by dropout
    negated, invisible ones 0. O(Sq * Sk) memory: for tests and small sizes. v is unused."""
    check_limits(q, k, v, spec.attn_mask, spec.cu_seqlens_q)
    B, Sq, Sk = q.shape[0], q.shape[2], k.shape[2]
    if spec.varlen:
        B, Sq, Sk = spec.cu_seqlens_q.shape[0] - 1, int(spec.max_seqlen_q), int(spec.max_seqlen_k)
    if Sq * Sk > INT32_MAX:
        raise LimitExceeded(f"the probabilities' (Sq, Sk) = ({Sq}, {Sk}) slice overflows the kernels' int32 offsets")
    out = torch.zeros(B, q.shape[1], Sq, Sk, dtype=m2.dtype, device=q.device)
    if out.numel():
        plan_probs(q, k, m2, l2, out, scale=scale, causal=causal, bottom_right=bottom_right, spec=spec).run()
    return out


def compile_plans(target) -> list:
    """The probabilities kernel for head dims 64/128/256, fp16 with every option and fp32 causal."""
    from .attention_fwd import all_options_spec

    B, H, S = 2, 2, attention_common.PLAN_SEQLEN
    plans = []
    for d in (64, 128, 256):
        for dtype in (torch.float16, torch.float32):
            q, k = (torch.empty(B, H, S, d, dtype=dtype) for _ in range(2))
            m2, l2 = (torch.empty(B, H, S, dtype=torch.float32) for _ in range(2))
            spec = all_options_spec(B, S, H, (B, H, S, S), dtype) if dtype == torch.float16 else NO_MASKS
            out = torch.empty(B, H, S, S, dtype=torch.float32)
            try:
                launch = plan_probs(q, k, m2, l2, out, scale=d ** -0.5, causal=True, bottom_right=False, spec=spec,
                                    target=target)
            except RuntimeError:  # no config fits: the backend reports it and never launches
                continue
            plans.append((f"attn_probs D={d} {str(dtype)[6:]}", launch))
    return plans + wide_dropout_plans(plans)
