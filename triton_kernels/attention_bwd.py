"""Flash attention backward: P is recomputed from the saved row statistics (m2, l2), never stored.

Three kernels, no atomics, so gradients are bitwise reproducible:
1. `_attn_bwd_preprocess`: delta = rowsum(dO * O) (minus the lse cotangent, when there is one).
2. `_attn_bwd_dkdv`: one program owns a K/V tile of one (batch, kv head) and loops over the q
   tiles of every q head in its GQA group, so dK/dV are reduced over the group in registers.
3. `_attn_bwd_dq`: one program owns a q tile and loops over the K/V tiles it can see.
With s2 = q.k * scale * log2(e) and P = exp2(s2 - m2) * exp2(-l2):
    dV = P^T dO,  dP = dO V^T,  dS = P * (dP - delta),  dQ = scale * dS K,  dK = scale * dS^T Q.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .attention_common import (NO_MASKS, MaskSpec, dropout_keep, kv_loop_bounds, loop_part, mask_args,
                               modifier_scalars, q_loop_bounds, scalar_in, score_mods, seq_bounds, stride_args,
                               visible)
from .configs import PREPROCESS_BLOCK_M, estimate_shared_memory, select_config
from .launch import ACC_DTYPE, TORCH_ACC_DTYPE, LOG2E, Launch, cdiv, dot_precision, head_block, split_f32, target_for


@triton.jit
def _attn_bwd_preprocess(O, DO, DLSE, DELTA,
                         stride_ob, stride_oh, stride_om, stride_od,
                         stride_dob, stride_doh, stride_dom, stride_dod,
                         H, Sq, D_V, dlse_scale_hi, dlse_scale_lo,
                         BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr, HAS_DLSE: tl.constexpr,
                         ACC: tl.constexpr):
    pid_m = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)  # grid (q tiles, heads, batch): each axis stays within CUDA's limits
    pid_bh = b * H + h
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_DV)
    mask = (offs_m[:, None] < Sq) & (offs_d[None, :] < D_V)
    o = tl.load(O + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh
                + offs_m[:, None] * stride_om + offs_d[None, :] * stride_od, mask=mask, other=0.0)
    do = tl.load(DO + b.to(tl.int64) * stride_dob + h.to(tl.int64) * stride_doh
                 + offs_m[:, None] * stride_dom + offs_d[None, :] * stride_dod, mask=mask, other=0.0)
    delta = tl.sum(o.to(ACC) * do.to(ACC), 1)  # (BLOCK_M,)
    row = pid_bh.to(tl.int64) * Sq + offs_m
    if HAS_DLSE:
        # lse = logsumexp(s) has d lse / d s = P, which folds into dS = P * (dP - delta + dlse)
        dlse = tl.load(DLSE + row, mask=offs_m < Sq, other=0.0).to(ACC)
        delta = delta - dlse * scalar_in(dlse_scale_hi, dlse_scale_lo, ACC)
    tl.store(DELTA + row, delta, mask=offs_m < Sq)


@triton.jit
def _dkdv_tiles(dk, dv, k, v, key_ok, q_base, do_base, m2_base, l2_base, delta_base, mb_base, offs_n, start, end, Sq_b, Sk_b,
                causal_shift, window_shift, qk_scale, stride_qm, stride_qd, stride_dom, stride_dod, stride_mm,
                stride_mn, D_QK, D_V, softcap2, slope2, log2e, seed, bh, Sk, dropout_p, drop_scale,
                BLOCK_M: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr, MASKED: tl.constexpr,
                CAUSAL: tl.constexpr, WINDOW: tl.constexpr, KEY_MASK: tl.constexpr, MASK_KIND: tl.constexpr,
                SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, DROPOUT: tl.constexpr, ACC: tl.constexpr,
                DOT_PREC: tl.constexpr):
    """Add the contributions of q rows [start, end) of one head to this K/V tile's dK, dV."""
    offs_dqk = tl.arange(0, BLOCK_DQK)
    offs_dv = tl.arange(0, BLOCK_DV)
    alibi_shift = Sk_b - Sq_b
    for start_m in range(start, end, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        # rows past Sq_b read as zeros (q, dO, delta) and m2 -inf, so they add nothing
        row_ok = offs_m < Sq_b
        qt = tl.load(q_base + offs_m[None, :] * stride_qm + offs_dqk[:, None] * stride_qd,
                     mask=row_ok[None, :] & (offs_dqk[:, None] < D_QK), other=0.0)  # (BLOCK_DQK, BLOCK_M)
        do = tl.load(do_base + offs_m[:, None] * stride_dom + offs_dv[None, :] * stride_dod,
                     mask=row_ok[:, None] & (offs_dv[None, :] < D_V), other=0.0)  # (BLOCK_M, BLOCK_DV)
        m2 = tl.load(m2_base + offs_m, mask=row_ok, other=float("-inf"))
        inv_l = tl.exp2(-tl.load(l2_base + offs_m, mask=row_ok, other=0.0))  # 1 / row sum
        delta = tl.load(delta_base + offs_m, mask=row_ok, other=0.0)
        m2 = tl.where(m2 == float("-inf"), float("inf"), m2)  # rows that see no key: P = exp2(s - inf) = 0
        st = tl.dot(k, qt, out_dtype=ACC, input_precision=DOT_PREC) * qk_scale  # (BLOCK_N, BLOCK_M) = S^T
        st, tt = score_mods(st, offs_m[None, :], offs_n[:, None], row_ok[None, :] & (offs_n[:, None] < Sk_b),
                            mb_base, stride_mm, stride_mn, softcap2, slope2, alibi_shift, log2e,
                            MASK_KIND, SOFTCAP, ALIBI)
        pt = tl.exp2(st - m2[None, :]) * inv_l[None, :]
        if MASKED:
            pt = tl.where(visible(offs_m[None, :], offs_n[:, None], Sq_b, Sk_b, causal_shift, window_shift, key_ok,
                                  CAUSAL, WINDOW, KEY_MASK), pt, 0.0)
        dpt = tl.dot(v, tl.trans(do), out_dtype=ACC, input_precision=DOT_PREC)  # (BLOCK_N, BLOCK_M) = dP^T
        if DROPOUT:  # out = (P * keep / (1 - p)) V: the same factor scales dV's P and dP
            keep = dropout_keep(seed, bh, offs_m[None, :], offs_n[:, None], Sk, dropout_p)
            dv += tl.dot(tl.where(keep, pt * drop_scale, 0.0).to(do.dtype), do, out_dtype=ACC,
                         input_precision=DOT_PREC)
            dpt = tl.where(keep, dpt * drop_scale, 0.0)
        else:
            dv += tl.dot(pt.to(do.dtype), do, out_dtype=ACC, input_precision=DOT_PREC)
        dst = pt * (dpt - delta[None, :])  # dL/d(scores), natural units
        if SOFTCAP:
            dst = dst * (1.0 - tt * tt)  # d/dx softcap * tanh(x / softcap)
        dk += tl.dot(dst.to(qt.dtype), tl.trans(qt), out_dtype=ACC, input_precision=DOT_PREC)
    return dk, dv


@triton.jit
def _attn_bwd_dkdv(Q, K, V, DO, M2, L2, DELTA, DK, DV, Q_LENS, KV_LENS, CU_Q, CU_K, KM, QM, MB, AL, RNG,
                   stride_qb, stride_qh, stride_qm, stride_qd,
                   stride_kb, stride_kh, stride_kn, stride_kd,
                   stride_vb, stride_vh, stride_vn, stride_vd,
                   stride_dob, stride_doh, stride_dom, stride_dod,
                   stride_dkb, stride_dkh, stride_dkn, stride_dkd,
                   stride_dvb, stride_dvh, stride_dvn, stride_dvd,
                   stride_lb, stride_lh, stride_kmb, stride_kmn, stride_qmb, stride_qmn,
                   stride_mb, stride_mh, stride_mm, stride_mn, stride_alb,
                   H, GROUP, Sq, Sk, D_QK, D_V, bottom_right, right, left,
                   qk_scale_hi, qk_scale_lo, sm_scale_hi, sm_scale_lo,
                   softcap_hi, softcap_lo, log2e_hi, log2e_lo, dropout_p, drop_scale_hi, drop_scale_lo,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
                   CAUSAL: tl.constexpr, WINDOW: tl.constexpr, KEY_MASK: tl.constexpr, QUERY_MASK: tl.constexpr,
                   LENS: tl.constexpr, VARLEN: tl.constexpr, MASK_KIND: tl.constexpr, EVERY_TILE: tl.constexpr,
                   SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, DROPOUT: tl.constexpr,
                   ACC: tl.constexpr, DOT_PREC: tl.constexpr):
    pid_n = tl.program_id(0)
    kvh = tl.program_id(1)
    b = tl.program_id(2)
    q_start, k_start, Sq_b, Sk_b, Sq_mem, Sk_mem, causal_shift, window_shift = seq_bounds(
        b, Sq, Sk, Q_LENS, KV_LENS, CU_Q, CU_K, bottom_right, right, left, LENS, VARLEN)
    n0 = pid_n * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_dqk = tl.arange(0, BLOCK_DQK)
    offs_dv = tl.arange(0, BLOCK_DV)
    key_row = offs_n < Sk_b  # padding keys read as 0 and get zero gradients
    k = tl.load(K + b.to(tl.int64) * stride_kb + kvh.to(tl.int64) * stride_kh + k_start.to(tl.int64) * stride_kn
                + offs_n[:, None] * stride_kn + offs_dqk[None, :] * stride_kd,
                mask=key_row[:, None] & (offs_dqk[None, :] < D_QK), other=0.0)  # (BLOCK_N, BLOCK_DQK)
    v = tl.load(V + b.to(tl.int64) * stride_vb + kvh.to(tl.int64) * stride_vh + k_start.to(tl.int64) * stride_vn
                + offs_n[:, None] * stride_vn + offs_dv[None, :] * stride_vd,
                mask=key_row[:, None] & (offs_dv[None, :] < D_V), other=0.0)  # (BLOCK_N, BLOCK_DV)
    key_ok = key_row[:, None]
    if KEY_MASK:  # this program's keys never change: read their mask once
        key_ok = tl.load(KM + b.to(tl.int64) * stride_kmb + offs_n[:, None] * stride_kmn, mask=key_ok, other=0) != 0
    qk_scale = scalar_in(qk_scale_hi, qk_scale_lo, ACC)
    drop_scale = scalar_in(drop_scale_hi, drop_scale_lo, ACC)
    dk = tl.zeros([BLOCK_N, BLOCK_DQK], dtype=ACC)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=ACC)

    lo, free_lo, free_hi, hi = q_loop_bounds(n0, Sq_b, Sk_b, causal_shift, window_shift, BLOCK_M, BLOCK_N,
                                             CAUSAL, WINDOW, EVERY_TILE)
    for g in range(0, GROUP):  # the q heads that share this K/V head, reduced here: no atomics
        h = kvh * GROUP + g
        q_base = Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh + q_start.to(tl.int64) * stride_qm
        do_base = DO + b.to(tl.int64) * stride_dob + h.to(tl.int64) * stride_doh + q_start.to(tl.int64) * stride_dom
        row_base = b.to(tl.int64) * stride_lb + h.to(tl.int64) * stride_lh + q_start
        mb_base = MB + b.to(tl.int64) * stride_mb + h.to(tl.int64) * stride_mh
        softcap2, log2e, slope2, seed = modifier_scalars(b, h, AL, stride_alb, RNG, softcap_hi, softcap_lo,
                                                         log2e_hi, log2e_lo, ALIBI, DROPOUT, ACC)
        # masked tiles before the unmasked range (causal diagonal), unmasked, masked tail (window edge, Sq_b)
        for part in tl.static_range(3):
            start, end = loop_part(part, lo, free_lo, free_hi, hi)
            dk, dv = _dkdv_tiles(dk, dv, k, v, key_ok, q_base, do_base, M2 + row_base, L2 + row_base, DELTA + row_base,
                                 mb_base,
                                 offs_n, start, end, Sq_b, Sk_b, causal_shift, window_shift, qk_scale,
                                 stride_qm, stride_qd, stride_dom, stride_dod, stride_mm, stride_mn, D_QK, D_V,
                                 softcap2, slope2, log2e, seed, b * H + h, Sk, dropout_p, drop_scale,
                                 BLOCK_M, BLOCK_DQK, BLOCK_DV, part != 1, CAUSAL, WINDOW, KEY_MASK, MASK_KIND,
                                 SOFTCAP, ALIBI, DROPOUT, ACC, DOT_PREC)

    dk = dk * scalar_in(sm_scale_hi, sm_scale_lo, ACC)
    tl.store(DK + b.to(tl.int64) * stride_dkb + kvh.to(tl.int64) * stride_dkh + k_start.to(tl.int64) * stride_dkn
             + offs_n[:, None] * stride_dkn + offs_dqk[None, :] * stride_dkd, dk.to(DK.dtype.element_ty),
             mask=(offs_n[:, None] < Sk_mem) & (offs_dqk[None, :] < D_QK))
    tl.store(DV + b.to(tl.int64) * stride_dvb + kvh.to(tl.int64) * stride_dvh + k_start.to(tl.int64) * stride_dvn
             + offs_n[:, None] * stride_dvn + offs_dv[None, :] * stride_dvd, dv.to(DV.dtype.element_ty),
             mask=(offs_n[:, None] < Sk_mem) & (offs_dv[None, :] < D_V))


@triton.jit
def _dq_tiles(dq, q, do, m2, inv_l, delta, k_base, v_base, km_base, mb_base, offs_m, start, end, Sq_b, Sk_b, causal_shift,
              window_shift, qk_scale, stride_kn, stride_kd, stride_vn, stride_vd, stride_kmn, stride_mm, stride_mn,
              D_QK, D_V, softcap2, slope2, log2e, seed, bh, Sk, dropout_p, drop_scale,
              BLOCK_N: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr, MASKED: tl.constexpr,
              CAUSAL: tl.constexpr, WINDOW: tl.constexpr, KEY_MASK: tl.constexpr, MASK_KIND: tl.constexpr,
              SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, DROPOUT: tl.constexpr, ACC: tl.constexpr,
              DOT_PREC: tl.constexpr):
    """Add the contributions of key tiles [start, end) to this q tile's dQ (unscaled)."""
    offs_dqk = tl.arange(0, BLOCK_DQK)
    offs_dv = tl.arange(0, BLOCK_DV)
    alibi_shift = Sk_b - Sq_b
    for start_n in range(start, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kt = tl.load(k_base + offs_n[None, :] * stride_kn + offs_dqk[:, None] * stride_kd,
                     mask=(offs_n[None, :] < Sk_b) & (offs_dqk[:, None] < D_QK), other=0.0)  # (BLOCK_DQK, BLOCK_N)
        vt = tl.load(v_base + offs_n[None, :] * stride_vn + offs_dv[:, None] * stride_vd,
                     mask=(offs_n[None, :] < Sk_b) & (offs_dv[:, None] < D_V), other=0.0)  # (BLOCK_DV, BLOCK_N)
        s = tl.dot(q, kt, out_dtype=ACC, input_precision=DOT_PREC) * qk_scale  # (BLOCK_M, BLOCK_N)
        s, t = score_mods(s, offs_m[:, None], offs_n[None, :], (offs_m[:, None] < Sq_b) & (offs_n[None, :] < Sk_b),
                          mb_base, stride_mm, stride_mn, softcap2, slope2, alibi_shift, log2e,
                          MASK_KIND, SOFTCAP, ALIBI)
        p = tl.exp2(s - m2[:, None]) * inv_l[:, None]
        if MASKED:
            key_ok = offs_n[None, :] < Sk_b
            if KEY_MASK:
                key_ok = tl.load(km_base + offs_n[None, :] * stride_kmn, mask=key_ok, other=0) != 0
            p = tl.where(visible(offs_m[:, None], offs_n[None, :], Sq_b, Sk_b, causal_shift, window_shift, key_ok,
                                 CAUSAL, WINDOW, KEY_MASK), p, 0.0)
        dp = tl.dot(do, vt, out_dtype=ACC, input_precision=DOT_PREC)  # (BLOCK_M, BLOCK_N)
        if DROPOUT:
            keep = dropout_keep(seed, bh, offs_m[:, None], offs_n[None, :], Sk, dropout_p)
            dp = tl.where(keep, dp * drop_scale, 0.0)
        ds = p * (dp - delta[:, None])
        if SOFTCAP:
            ds = ds * (1.0 - t * t)
        dq += tl.dot(ds.to(kt.dtype), tl.trans(kt), out_dtype=ACC, input_precision=DOT_PREC)
    return dq


@triton.jit
def _attn_bwd_dq(Q, K, V, DO, M2, L2, DELTA, DQ, Q_LENS, KV_LENS, CU_Q, CU_K, KM, QM, MB, AL, RNG,
                 stride_qb, stride_qh, stride_qm, stride_qd,
                 stride_kb, stride_kh, stride_kn, stride_kd,
                 stride_vb, stride_vh, stride_vn, stride_vd,
                 stride_dob, stride_doh, stride_dom, stride_dod,
                 stride_dqb, stride_dqh, stride_dqm, stride_dqd,
                 stride_lb, stride_lh, stride_kmb, stride_kmn, stride_qmb, stride_qmn,
                 stride_mb, stride_mh, stride_mm, stride_mn, stride_alb,
                 H, GROUP, Sq, Sk, D_QK, D_V, bottom_right, right, left,
                 qk_scale_hi, qk_scale_lo, sm_scale_hi, sm_scale_lo,
                 softcap_hi, softcap_lo, log2e_hi, log2e_lo, dropout_p, drop_scale_hi, drop_scale_lo,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
                 CAUSAL: tl.constexpr, WINDOW: tl.constexpr, KEY_MASK: tl.constexpr, QUERY_MASK: tl.constexpr,
                 LENS: tl.constexpr, VARLEN: tl.constexpr, MASK_KIND: tl.constexpr, EVERY_TILE: tl.constexpr,
                 SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, DROPOUT: tl.constexpr,
                 ACC: tl.constexpr, DOT_PREC: tl.constexpr):
    pid_m = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)  # grid (q tiles, heads, batch): each axis stays within CUDA's limits
    q_start, k_start, Sq_b, Sk_b, Sq_mem, Sk_mem, causal_shift, window_shift = seq_bounds(
        b, Sq, Sk, Q_LENS, KV_LENS, CU_Q, CU_K, bottom_right, right, left, LENS, VARLEN)
    kvh = h // GROUP
    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_dqk = tl.arange(0, BLOCK_DQK)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_ok = offs_m < Sq_b
    q_off = b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh + q_start.to(tl.int64) * stride_qm
    q = tl.load(Q + q_off + offs_m[:, None] * stride_qm + offs_dqk[None, :] * stride_qd,
                mask=row_ok[:, None] & (offs_dqk[None, :] < D_QK), other=0.0)  # (BLOCK_M, BLOCK_DQK)
    do = tl.load(DO + b.to(tl.int64) * stride_dob + h.to(tl.int64) * stride_doh + q_start.to(tl.int64) * stride_dom
                 + offs_m[:, None] * stride_dom + offs_dv[None, :] * stride_dod,
                 mask=row_ok[:, None] & (offs_dv[None, :] < D_V), other=0.0)  # (BLOCK_M, BLOCK_DV)
    row = b.to(tl.int64) * stride_lb + h.to(tl.int64) * stride_lh + q_start + offs_m
    m2 = tl.load(M2 + row, mask=row_ok, other=float("-inf"))
    m2 = tl.where(m2 == float("-inf"), float("inf"), m2)  # rows that see no key: P = exp2(s - inf) = 0
    inv_l = tl.exp2(-tl.load(L2 + row, mask=row_ok, other=0.0))  # 1 / row sum
    delta = tl.load(DELTA + row, mask=row_ok, other=0.0)
    qk_scale = scalar_in(qk_scale_hi, qk_scale_lo, ACC)
    drop_scale = scalar_in(drop_scale_hi, drop_scale_lo, ACC)
    softcap2, log2e, slope2, seed = modifier_scalars(b, h, AL, stride_alb, RNG, softcap_hi, softcap_lo,
                                                     log2e_hi, log2e_lo, ALIBI, DROPOUT, ACC)
    dq = tl.zeros([BLOCK_M, BLOCK_DQK], dtype=ACC)

    k_base = K + b.to(tl.int64) * stride_kb + kvh.to(tl.int64) * stride_kh + k_start.to(tl.int64) * stride_kn
    v_base = V + b.to(tl.int64) * stride_vb + kvh.to(tl.int64) * stride_vh + k_start.to(tl.int64) * stride_vn
    km_base = KM + b.to(tl.int64) * stride_kmb
    mb_base = MB + b.to(tl.int64) * stride_mb + h.to(tl.int64) * stride_mh
    lo, full_lo, full_hi, hi = kv_loop_bounds(m0, Sq_b, Sk_b, causal_shift, window_shift, BLOCK_M, BLOCK_N,
                                              CAUSAL, WINDOW, EVERY_TILE)
    for part in tl.static_range(3):  # masked head (window edge), unmasked, masked tail (causal diagonal, Sk_b)
        start, end = loop_part(part, lo, full_lo, full_hi, hi)
        dq = _dq_tiles(dq, q, do, m2, inv_l, delta, k_base, v_base, km_base, mb_base, offs_m, start, end, Sq_b, Sk_b,
                       causal_shift, window_shift, qk_scale, stride_kn, stride_kd, stride_vn, stride_vd, stride_kmn,
                       stride_mm, stride_mn, D_QK, D_V, softcap2, slope2, log2e, seed, b * H + h, Sk, dropout_p,
                       drop_scale, BLOCK_N, BLOCK_DQK, BLOCK_DV, part != 1, CAUSAL, WINDOW, KEY_MASK, MASK_KIND,
                       SOFTCAP, ALIBI, DROPOUT, ACC, DOT_PREC)
    dq = dq * scalar_in(sm_scale_hi, sm_scale_lo, ACC)
    tl.store(DQ + b.to(tl.int64) * stride_dqb + h.to(tl.int64) * stride_dqh + q_start.to(tl.int64) * stride_dqm
             + offs_m[:, None] * stride_dqm + offs_dqk[None, :] * stride_dqd, dq.to(DQ.dtype.element_ty),
             mask=(offs_m[:, None] < Sq_mem) & (offs_dqk[None, :] < D_QK))


def plan_backward(do, q, k, v, out, m2, l2, delta, dq, dk, dv, *, scale: float, causal: bool,
                  bottom_right: bool, dlse2: torch.Tensor | None = None, spec: MaskSpec = NO_MASKS,
                  dbias: torch.Tensor | None = None, target=None) -> list[Launch]:
    """The launches of the backward (preprocess, dK/dV, dQ, and the attn_mask gradient into `dbias`
    when given, shaped like spec.attn_mask), in order.

    (B, H, S, D) views; varlen: (1, H, total, D) views of the packed tensors, m2/l2/delta (1, H, total).
    """
    H, Sq_rows, D_QK = q.shape[1], q.shape[2], q.shape[3]
    Hkv, D_V = k.shape[1], v.shape[3]
    target = target if target is not None else target_for(q)
    block_dqk, block_dv = head_block(D_QK), head_block(D_V)
    acc = ACC_DTYPE[q.dtype]
    prec = dot_precision(q.dtype)
    qk_hi, qk_lo = split_f32(scale * LOG2E)
    sm_hi, sm_lo = split_f32(scale)
    # dlse2 is the cotangent of lse2 (log2 units); dS needs that of the natural lse: dlse2 * log2(e)
    dl_hi, dl_lo = split_f32(LOG2E)

    # delta is per row: the preprocess runs over every stored row (varlen: the packed rows, B = 1)
    pre = Launch(_attn_bwd_preprocess, (cdiv(Sq_rows, PREPROCESS_BLOCK_M), H, out.shape[0]), dict(
        O=out, DO=do, DLSE=dlse2 if dlse2 is not None else delta, DELTA=delta,
        **stride_args("o", out), **stride_args("do", do), H=H, Sq=Sq_rows, D_V=D_V,
        dlse_scale_hi=dl_hi, dlse_scale_lo=dl_lo,
        BLOCK_M=PREPROCESS_BLOCK_M, BLOCK_DV=block_dv, HAS_DLSE=dlse2 is not None, ACC=acc))

    margs, B, Sq, Sk = mask_args(spec, causal, bottom_right, q, k, m2)
    common = dict(Q=q, K=k, V=v, DO=do, M2=m2, L2=l2, DELTA=delta,
                  **stride_args("q", q, spec), **stride_args("k", k, spec), **stride_args("v", v, spec),
                  **stride_args("do", do, spec), Sq=Sq, Sk=Sk, D_QK=D_QK, D_V=D_V,
                  qk_scale_hi=qk_hi, qk_scale_lo=qk_lo, sm_scale_hi=sm_hi, sm_scale_lo=sm_lo,
                  BLOCK_DQK=block_dqk, BLOCK_DV=block_dv, ACC=acc, DOT_PREC=prec, **margs)
    c1 = select_config("attn_bwd_dkdv", block_dqk, block_dv, q.element_size(), target, spec.modifies_scores)
    dkdv = Launch(_attn_bwd_dkdv, (cdiv(Sk, c1.block_n), Hkv, B), dict(
        common, DK=dk, DV=dv, **stride_args("dk", dk, spec), **stride_args("dv", dv, spec), H=H,
        GROUP=H // Hkv,
        BLOCK_M=c1.block_m, BLOCK_N=c1.block_n), c1,
        estimate_shared_memory("attn_bwd_dkdv", c1, block_dqk, block_dv, q.element_size(), target))
    c2 = select_config("attn_bwd_dq", block_dqk, block_dv, q.element_size(), target, spec.modifies_scores)
    dqk = Launch(_attn_bwd_dq, (cdiv(Sq, c2.block_m), H, B), dict(
        common, DQ=dq, **stride_args("dq", dq, spec), H=H, GROUP=H // Hkv,
        BLOCK_M=c2.block_m, BLOCK_N=c2.block_n), c2,
        estimate_shared_memory("attn_bwd_dq", c2, block_dqk, block_dv, q.element_size(), target))
    launches = [pre, dkdv, dqk]
    if dbias is not None:
        from .attention_scores import plan_scores

        launches.append(plan_scores(q, k, v, m2, l2, dbias, scale=scale, causal=causal, bottom_right=bottom_right,
                                    spec=spec, do=do, delta=delta, target=target))
    return launches


def attention_backward(do, q, k, v, out, m2, l2, *, scale: float, causal: bool = False, bottom_right: bool = False,
                       dlse2: torch.Tensor | None = None, spec: MaskSpec = NO_MASKS, grads=None, dbias=None):
    """Gradients of attention_forward from its (out, m2, l2). do is dL/dout; dlse2 an optional
    dL/dlse2, the cotangent of lse2 = m2 + l2 (log2 units).

    Returns (dq, dk, dv) shaped like (q, k, v), written into `grads` when given (any strides with
    a unit last stride). Padding rows/keys and rows that see no key get exactly zero gradient.
    dbias: a tensor shaped like spec.attn_mask (additive) that receives the mask's gradient, summed
    over its broadcast (size-1) dims.
    """
    dq, dk, dv = grads if grads is not None else (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))
    if q.numel() == 0 or k.numel() == 0:
        if dbias is not None:
            dbias.zero_()
        return dq.zero_(), dk.zero_(), dv.zero_()
    delta = torch.empty(m2.shape, dtype=TORCH_ACC_DTYPE[q.dtype], device=q.device)
    for launch in plan_backward(do, q, k, v, out, m2, l2, delta, dq, dk, dv, scale=scale, causal=causal,
                                bottom_right=bottom_right, dlse2=dlse2, spec=spec, dbias=dbias):
        launch.run()
    return dq, dk, dv


def compile_plans(target) -> list:
    """Every backward config `target` can launch (head dims 64/128/256; fp16, bf16, fp32; causal or not;
    fp16/bf16 also with a window, key/query masks, lengths and varlen)."""
    from .attention_fwd import compile_cases

    plans = []
    for d, dtype, name, causal, spec in compile_cases():
        q, k, v, o, do, dq, dk, dv = (torch.empty(1, 2, 128, d, dtype=dtype) for _ in range(8))
        m2, l2, delta = (torch.empty(1, 2, 128, dtype=torch.float32) for _ in range(3))
        try:
            pre, dkdv, dqk = plan_backward(do, q, k, v, o, m2, l2, delta, dq, dk, dv, scale=d ** -0.5,
                                           causal=causal, bottom_right=spec.varlen, spec=spec, target=target)
        except RuntimeError:  # no config fits: the backend reports it and never launches
            continue
        tag = f"D={d} {str(dtype)[6:]} {name}"
        if name == "causal=True":
            plans.append((f"attn_bwd_preprocess {tag}", pre))
        plans += [(f"attn_bwd_dkdv {tag}", dkdv), (f"attn_bwd_dq {tag}", dqk)]
    return plans
