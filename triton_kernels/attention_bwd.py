"""Flash attention backward: P is recomputed from the saved row statistics (m2, l2), never stored.

Three kernels, no atomics, so gradients are bitwise reproducible:
1. `_attn_bwd_preprocess`: delta = rowsum(dO * O) (minus the lse cotangent, when there is one).
2. `_attn_bwd_dkdv`: one program owns a K/V tile of one (batch, kv head) and loops over the q
   tiles of every q head in its GQA group, so dK/dV are reduced over the group in registers; or,
   when that grid is too small to fill the GPU, of one q head, its fp32 partials summed on the host
   in a fixed order (GqaReduce).
3. `_attn_bwd_dq`: one program owns a q tile and loops over the K/V tiles it can see. With a float
   attn_mask that requires grad it also writes dS, the mask's gradient, tile by tile (tiles that
   causal / window / lengths skip get 0), summing broadcast dims in a fixed order (dbias_plan).
Both loops skip invisible tiles and run the fully visible ones unmasked (loop_part). The score scale
is not folded into q or k (that would round fp16 q/k once more); its multiply fuses into the FMA
that subtracts m2 before exp2.
With s2 = q.k * scale * log2(e) and P = exp2(s2 - m2) * exp2(-l2):
    dV = P^T dO,  dP = dO V^T,  dS = P * (dP - delta),  dQ = scale * dS K,  dK = scale * dS^T Q.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .attention_common import (MASK_ROLES, NO_MASKS, MaskSpec, dropout_keep, kv_loop_bounds, loop_part,
                               mask_args, modifier_scalars, q_loop_bounds, scalar_in, score_mods, seq_bounds,
                               stride_args, visible)
from .configs import PREPROCESS_BLOCK_M, estimate_shared_memory, select_config
from .launch import (ACC_DTYPE, LAUNCHES, LOG2E, TORCH_ACC_DTYPE, Launch, cdiv, dot_precision, head_block,
                     split_f32, target_for)


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
def _dkdv_tiles(dk, dv, k, v, key_ok, q_base, do_base, m2_base, l2_base, delta_base, mb_base, offs_n, start, end,
                Sq_b, Sk_b, causal_shift, window_shift, qk_scale, stride_qm, stride_qd, stride_dom, stride_dod,
                stride_mm, stride_mn, D_QK, D_V, softcap2, slope2, log2e, seed, bh, Sk, dropout_p, drop_scale,
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
                   H, GROUP, SPLIT, Sq, Sk, D_QK, D_V, bottom_right, right, left,
                   qk_scale_hi, qk_scale_lo, sm_scale_hi, sm_scale_lo,
                   softcap_hi, softcap_lo, log2e_hi, log2e_lo, dropout_p, drop_scale_hi, drop_scale_lo,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
                   CAUSAL: tl.constexpr, WINDOW: tl.constexpr, KEY_MASK: tl.constexpr, QUERY_MASK: tl.constexpr,
                   LENS: tl.constexpr, VARLEN: tl.constexpr, MASK_KIND: tl.constexpr, EVERY_TILE: tl.constexpr,
                   SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, DROPOUT: tl.constexpr,
                   ACC: tl.constexpr, DOT_PREC: tl.constexpr):
    """dK/dV of one K/V tile from GROUP // SPLIT of the q heads sharing its K/V head. SPLIT = 1: the
    whole GQA group, reduced in registers, written to DK/DV at the K/V head. SPLIT = GROUP: one q head
    per program (a grid GROUP times larger), each writing its partial at head index program_id(1)
    of fp32 (B, Hkv * SPLIT, Sk, D) buffers that the host sums in a fixed order (deterministic)."""
    pid_n = tl.program_id(0)
    pid_h = tl.program_id(1)  # kvh * SPLIT + the part of the group
    b = tl.program_id(2)
    kvh = pid_h // SPLIT
    per_prog = GROUP // SPLIT
    g0 = (pid_h % SPLIT) * per_prog
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
    for g in range(g0, g0 + per_prog):  # q heads that share this K/V head, reduced here: no atomics
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
            dk, dv = _dkdv_tiles(dk, dv, k, v, key_ok, q_base, do_base, M2 + row_base, L2 + row_base,
                                 DELTA + row_base, mb_base, offs_n, start, end, Sq_b, Sk_b, causal_shift,
                                 window_shift, qk_scale, stride_qm, stride_qd, stride_dom, stride_dod, stride_mm,
                                 stride_mn, D_QK, D_V, softcap2, slope2, log2e, seed, b * H + h, Sk, dropout_p,
                                 drop_scale, BLOCK_M, BLOCK_DQK, BLOCK_DV, part != 1, CAUSAL, WINDOW, KEY_MASK,
                                 MASK_KIND, SOFTCAP, ALIBI, DROPOUT, ACC, DOT_PREC)

    dk = dk * scalar_in(sm_scale_hi, sm_scale_lo, ACC)
    tl.store(DK + b.to(tl.int64) * stride_dkb + pid_h.to(tl.int64) * stride_dkh + k_start.to(tl.int64) * stride_dkn
             + offs_n[:, None] * stride_dkn + offs_dqk[None, :] * stride_dkd, dk.to(DK.dtype.element_ty),
             mask=(offs_n[:, None] < Sk_mem) & (offs_dqk[None, :] < D_QK))
    tl.store(DV + b.to(tl.int64) * stride_dvb + pid_h.to(tl.int64) * stride_dvh + k_start.to(tl.int64) * stride_dvn
             + offs_n[:, None] * stride_dvn + offs_dv[None, :] * stride_dvd, dv.to(DV.dtype.element_ty),
             mask=(offs_n[:, None] < Sk_mem) & (offs_dv[None, :] < D_V))


@triton.jit
def _dq_tiles(dq, db_row, q, do, m2, inv_l, delta, k_base, v_base, km_base, mb_base, db_base, first, offs_m, start,
              end, Sq_b, Sk_b, causal_shift, window_shift, qk_scale, stride_kn, stride_kd, stride_vn, stride_vd,
              stride_kmn, stride_mm, stride_mn, stride_dbm, stride_dbn, D_QK, D_V, softcap2, slope2, log2e, seed, bh,
              Sq, Sk, dropout_p, drop_scale,
              BLOCK_N: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr, MASKED: tl.constexpr,
              CAUSAL: tl.constexpr, WINDOW: tl.constexpr, KEY_MASK: tl.constexpr, MASK_KIND: tl.constexpr,
              SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, DROPOUT: tl.constexpr, DBIAS: tl.constexpr,
              DB_SUM_M: tl.constexpr, DB_SUM_N: tl.constexpr, ACC: tl.constexpr, DOT_PREC: tl.constexpr):
    """Add the contributions of key tiles [start, end) to this q tile's dQ (unscaled), and with DBIAS
    their dS to the attn_mask gradient (`_dbias_tile`)."""
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
        ds = p * (dp - delta[:, None])  # dL/d(scores) = dL/d(attn_mask), natural units
        if DBIAS:
            db_row = _dbias_tile(ds, db_row, db_base, first, offs_m, offs_n, Sq, Sk, stride_dbm, stride_dbn,
                                 DB_SUM_M, DB_SUM_N)
        if SOFTCAP:
            ds = ds * (1.0 - t * t)
        dq += tl.dot(ds.to(kt.dtype), tl.trans(kt), out_dtype=ACC, input_precision=DOT_PREC)
    return dq, db_row


@triton.jit
def _dbias_tile(ds, db_row, db_base, first, offs_m, offs_n, Sq, Sk, stride_dbm, stride_dbn,
                SUM_M: tl.constexpr, SUM_N: tl.constexpr):
    """Fold a (BLOCK_M, BLOCK_N) dS tile into the bias-gradient buffer: added to what an earlier
    (batch, head) of this program stored there, or stored when `first`.

    SUM_N (the mask broadcasts over keys): rows summed in registers (db_row), stored after the key
    loop. SUM_M (over queries): the tile's column sums, into this q tile's partial row."""
    if SUM_N:
        db_row += tl.sum(ds, 1)
    elif SUM_M:
        ptrs = db_base + offs_n * stride_dbn  # (BLOCK_N,)
        ok = offs_n < Sk
        prev = tl.load(ptrs, mask=ok & (offs_n * 0 + first == 0), other=0.0)  # nothing to add to when first
        tl.store(ptrs, prev + tl.sum(ds, 0), mask=ok)
    else:
        ptrs = db_base + offs_m[:, None] * stride_dbm + offs_n[None, :] * stride_dbn  # (BLOCK_M, BLOCK_N)
        ok = (offs_m[:, None] < Sq) & (offs_n[None, :] < Sk)
        prev = tl.load(ptrs, mask=ok & (offs_m[:, None] * 0 + first == 0), other=0.0)
        tl.store(ptrs, prev + ds, mask=ok)
    return db_row


@triton.jit
def _dbias_zero(db_base, offs_m, start, end, Sq, Sk, stride_dbm, stride_dbn,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SUM_M: tl.constexpr):
    """Store 0 in the bias gradient of key tiles [start, end) (tiles the q tile never visits)."""
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        if SUM_M:
            tl.store(db_base + offs_n * stride_dbn, tl.zeros([BLOCK_N], dtype=db_base.dtype.element_ty),
                     mask=offs_n < Sk)
        else:
            tl.store(db_base + offs_m[:, None] * stride_dbm + offs_n[None, :] * stride_dbn,
                     tl.zeros([BLOCK_M, BLOCK_N], dtype=db_base.dtype.element_ty),
                     mask=(offs_m[:, None] < Sq) & (offs_n[None, :] < Sk))


@triton.jit
def _attn_bwd_dq(Q, K, V, DO, M2, L2, DELTA, DQ, DB, Q_LENS, KV_LENS, CU_Q, CU_K, KM, QM, MB, AL, RNG,
                 stride_qb, stride_qh, stride_qm, stride_qd,
                 stride_kb, stride_kh, stride_kn, stride_kd,
                 stride_vb, stride_vh, stride_vn, stride_vd,
                 stride_dob, stride_doh, stride_dom, stride_dod,
                 stride_dqb, stride_dqh, stride_dqm, stride_dqd,
                 stride_dbb, stride_dbh, stride_dbm, stride_dbn,
                 stride_lb, stride_lh, stride_kmb, stride_kmn, stride_qmb, stride_qmn,
                 stride_mb, stride_mh, stride_mm, stride_mn, stride_alb,
                 H, GROUP, Sq, Sk, D_QK, D_V, bottom_right, right, left, n_b, n_h,
                 qk_scale_hi, qk_scale_lo, sm_scale_hi, sm_scale_lo,
                 softcap_hi, softcap_lo, log2e_hi, log2e_lo, dropout_p, drop_scale_hi, drop_scale_lo,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
                 CAUSAL: tl.constexpr, WINDOW: tl.constexpr, KEY_MASK: tl.constexpr, QUERY_MASK: tl.constexpr,
                 LENS: tl.constexpr, VARLEN: tl.constexpr, MASK_KIND: tl.constexpr, EVERY_TILE: tl.constexpr,
                 SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, DROPOUT: tl.constexpr,
                 DBIAS: tl.constexpr, DB_SUM_M: tl.constexpr, DB_SUM_N: tl.constexpr,
                 ACC: tl.constexpr, DOT_PREC: tl.constexpr):
    """dQ of one q tile for n_b batches x n_h heads in turn (1 x 1 unless the attn_mask gradient is
    broadcast over batch / heads: then this program owns that gradient tile and sums into it in a
    fixed order). With DBIAS, dS goes to DB (shaped like the attn_mask, or per-q-tile partials when
    it broadcasts over queries, DB_SUM_M); tiles the loop bounds skip get 0 there."""
    pid_m = tl.program_id(0)
    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_dqk = tl.arange(0, BLOCK_DQK)
    offs_dv = tl.arange(0, BLOCK_DV)
    qk_scale = scalar_in(qk_scale_hi, qk_scale_lo, ACC)
    drop_scale = scalar_in(drop_scale_hi, drop_scale_lo, ACC)
    for bi in range(0, n_b):
        b = tl.program_id(2) + bi  # grid (q tiles, heads, batch); a summed axis has size 1
        q_start, k_start, Sq_b, Sk_b, Sq_mem, Sk_mem, causal_shift, window_shift = seq_bounds(
            b, Sq, Sk, Q_LENS, KV_LENS, CU_Q, CU_K, bottom_right, right, left, LENS, VARLEN)
        row_ok = offs_m < Sq_b
        for hi_ in range(0, n_h):
            h = tl.program_id(1) + hi_
            first = tl.where((bi == 0) & (hi_ == 0), 1, 0)  # the first (batch, head) stores, later ones add
            kvh = h // GROUP
            q = tl.load(Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh + q_start.to(tl.int64) * stride_qm
                        + offs_m[:, None] * stride_qm + offs_dqk[None, :] * stride_qd,
                        mask=row_ok[:, None] & (offs_dqk[None, :] < D_QK), other=0.0)  # (BLOCK_M, BLOCK_DQK)
            do = tl.load(DO + b.to(tl.int64) * stride_dob + h.to(tl.int64) * stride_doh
                         + q_start.to(tl.int64) * stride_dom + offs_m[:, None] * stride_dom
                         + offs_dv[None, :] * stride_dod,
                         mask=row_ok[:, None] & (offs_dv[None, :] < D_V), other=0.0)  # (BLOCK_M, BLOCK_DV)
            row = b.to(tl.int64) * stride_lb + h.to(tl.int64) * stride_lh + q_start + offs_m
            m2 = tl.load(M2 + row, mask=row_ok, other=float("-inf"))
            m2 = tl.where(m2 == float("-inf"), float("inf"), m2)  # rows that see no key: P = exp2(s - inf) = 0
            inv_l = tl.exp2(-tl.load(L2 + row, mask=row_ok, other=0.0))  # 1 / row sum
            delta = tl.load(DELTA + row, mask=row_ok, other=0.0)
            softcap2, log2e, slope2, seed = modifier_scalars(b, h, AL, stride_alb, RNG, softcap_hi, softcap_lo,
                                                             log2e_hi, log2e_lo, ALIBI, DROPOUT, ACC)
            dq = tl.zeros([BLOCK_M, BLOCK_DQK], dtype=ACC)
            db_row = tl.zeros([BLOCK_M], dtype=ACC)  # the bias gradient summed over keys (DB_SUM_N)
            k_base = K + b.to(tl.int64) * stride_kb + kvh.to(tl.int64) * stride_kh + k_start.to(tl.int64) * stride_kn
            v_base = V + b.to(tl.int64) * stride_vb + kvh.to(tl.int64) * stride_vh + k_start.to(tl.int64) * stride_vn
            km_base = KM + b.to(tl.int64) * stride_kmb
            mb_base = MB + b.to(tl.int64) * stride_mb + h.to(tl.int64) * stride_mh
            db_base = DB + b.to(tl.int64) * stride_dbb + h.to(tl.int64) * stride_dbh
            if DB_SUM_M:
                db_base += pid_m.to(tl.int64) * stride_dbm  # this q tile's partial row
            lo, full_lo, full_hi, hi = kv_loop_bounds(m0, Sq_b, Sk_b, causal_shift, window_shift, BLOCK_M, BLOCK_N,
                                                      CAUSAL, WINDOW, EVERY_TILE)
            for part in tl.static_range(3):  # masked head (window edge), unmasked, masked tail (causal diagonal, Sk_b)
                start, end = loop_part(part, lo, full_lo, full_hi, hi)
                dq, db_row = _dq_tiles(dq, db_row, q, do, m2, inv_l, delta, k_base, v_base, km_base, mb_base, db_base,
                                       first, offs_m, start, end, Sq_b, Sk_b, causal_shift, window_shift, qk_scale,
                                       stride_kn, stride_kd, stride_vn, stride_vd, stride_kmn, stride_mm, stride_mn,
                                       stride_dbm, stride_dbn, D_QK, D_V, softcap2, slope2, log2e, seed, b * H + h,
                                       Sq, Sk, dropout_p, drop_scale, BLOCK_N, BLOCK_DQK, BLOCK_DV, part != 1, CAUSAL,
                                       WINDOW, KEY_MASK, MASK_KIND, SOFTCAP, ALIBI, DROPOUT, DBIAS, DB_SUM_M,
                                       DB_SUM_N, ACC, DOT_PREC)
            if DBIAS:
                if DB_SUM_N:  # the row sums are complete (tiles not visited add 0)
                    if DB_SUM_M:  # one value per q tile: stored by the tile's first row
                        ptrs = db_base + offs_m * 0
                        lead = offs_m == m0
                        prev = tl.load(ptrs, mask=lead & (offs_m * 0 + first == 0), other=0.0)
                        tl.store(ptrs, prev + tl.sum(db_row, 0), mask=lead)
                    else:
                        ptrs = db_base + offs_m * stride_dbm
                        prev = tl.load(ptrs, mask=(offs_m < Sq) & (offs_m * 0 + first == 0), other=0.0)
                        tl.store(ptrs, prev + db_row, mask=offs_m < Sq)
                else:  # the first (batch, head) writes 0 where its loop never went: left of lo, right of hi
                    z_lo = tl.where(first != 0, lo, 0)
                    z_hi = tl.where(first != 0, tl.cdiv(tl.maximum(hi, lo), BLOCK_N) * BLOCK_N, Sk)
                    _dbias_zero(db_base, offs_m, 0, z_lo, Sq, Sk, stride_dbm, stride_dbn, BLOCK_M, BLOCK_N, DB_SUM_M)
                    _dbias_zero(db_base, offs_m, z_hi, Sk, Sq, Sk, stride_dbm, stride_dbn, BLOCK_M, BLOCK_N, DB_SUM_M)
            dq = dq * scalar_in(sm_scale_hi, sm_scale_lo, ACC)
            tl.store(DQ + b.to(tl.int64) * stride_dqb + h.to(tl.int64) * stride_dqh + q_start.to(tl.int64) * stride_dqm
                     + offs_m[:, None] * stride_dqm + offs_dqk[None, :] * stride_dqd, dq.to(DQ.dtype.element_ty),
                     mask=(offs_m[:, None] < Sq_mem) & (offs_dqk[None, :] < D_QK))


class GqaReduce:
    """Host step after a split dK/dV kernel (SPLIT > 1): dK, dV = the fp32 per-q-head partials summed
    over each GQA group, in a fixed order (torch's sum: deterministic)."""

    def __init__(self, dk_part, dv_part, dk, dv, split: int):
        self.parts, self.outs, self.split = (dk_part, dv_part), (dk, dv), split

    def run(self):
        for part, out in zip(self.parts, self.outs):
            B, Hs = part.shape[:2]
            out.copy_(part.view(B, Hs // self.split, self.split, *part.shape[2:]).sum(2))


class DbiasReduce:
    """Host step after the dQ kernel: the bias gradient from its buffer (a sum over the per-q-tile
    partials when the mask broadcasts over queries; a cast when the buffer is fp32 and the mask is not).
    torch's sum over a fixed shape is deterministic."""

    def __init__(self, buf, dbias, sum_m: bool):
        self.buf, self.dbias, self.sum_m = buf, dbias, sum_m

    def run(self):
        self.dbias.copy_(self.buf.sum(2, keepdim=True) if self.sum_m else self.buf)


def dbias_plan(dbias, B: int, H: int, Sq: int, Sk: int, block_m: int, acc_dtype) -> tuple[dict, tuple, object]:
    """dQ-kernel arguments for writing the attn_mask gradient `dbias` ((B|1, H|1, Sq|1, Sk|1)), the grid's
    (heads, batch) extents, and the host step after it (None when the kernel writes dbias itself)."""
    sum_b, sum_h = dbias.shape[0] == 1 and B > 1, dbias.shape[1] == 1 and H > 1
    sum_m, sum_n = dbias.shape[2] == 1 and Sq > 1, dbias.shape[3] == 1 and Sk > 1
    buf, finish = dbias, None
    if sum_m or dbias.dtype != acc_dtype:
        rows = cdiv(Sq, block_m) if sum_m else dbias.shape[2]
        buf = torch.empty(*dbias.shape[:2], rows, dbias.shape[3], dtype=acc_dtype, device=dbias.device)
        finish = DbiasReduce(buf, dbias, sum_m)
    strides = [0 if n == 1 else st for n, st in zip(buf.shape, buf.stride())]
    if sum_m:
        strides[2] = buf.stride(2)  # partial rows are indexed by q tile
    args = dict(DB=buf, **{f"stride_db{ax}": st for ax, st in zip("bhmn", strides)},
                n_b=B if sum_b else 1, n_h=H if sum_h else 1, DBIAS=True, DB_SUM_M=sum_m, DB_SUM_N=sum_n)
    return args, (1 if sum_h else H, 1 if sum_b else B), finish


def gqa_split_factor(q, k, spec: MaskSpec, c1, target, gqa_split: bool | None) -> int:
    """Programs per K/V head of the dK/dV kernel: the GQA group size (one program per q head, fp32
    partials summed afterwards) when gqa_split, or when None and the K/V-head grid fills under 2 waves
    of the GPU; else 1. c1: the dK/dV tile config."""
    group = q.shape[1] // k.shape[1]
    if group == 1 or gqa_split is False:
        return 1
    if gqa_split is None:
        B = spec.cu_seqlens_q.shape[0] - 1 if spec.varlen else q.shape[0]
        Sk = int(spec.max_seqlen_k) if spec.varlen else k.shape[2]
        if cdiv(Sk, c1.block_n) * k.shape[1] * B >= 2 * target.sm_count:
            return 1
    return group


def gqa_partials(dk, dv, split: int, dtype) -> tuple:
    """Uninitialised fp32 (fp64 for fp64) per-q-head dK/dV partials (B, Hkv * split, Sk, D) for a split dK/dV."""
    return tuple(torch.empty(t.shape[0], t.shape[1] * split, *t.shape[2:], dtype=TORCH_ACC_DTYPE[dtype],
                             device=t.device) for t in (dk, dv))


def plan_backward(do, q, k, v, out, m2, l2, delta, dq, dk, dv, *, scale: float, causal: bool,
                  bottom_right: bool, dlse2: torch.Tensor | None = None, spec: MaskSpec = NO_MASKS,
                  dbias: torch.Tensor | None = None, target=None, gqa_split: bool | None = None,
                  gqa_parts: tuple | None = None) -> list:
    """The launches of the backward, in order: preprocess, dK/dV, dQ (which also writes the attn_mask
    gradient into `dbias` when given, shaped like spec.attn_mask), and host steps: a GqaReduce when
    dK/dV is split over the GQA group (gqa_split_factor) into partials it allocates (not when the caller
    passes them as gqa_parts and sums them itself), a DbiasReduce when the bias gradient goes through a
    buffer (see dbias_plan).

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
    group = H // Hkv
    tiles_n = cdiv(Sk, c1.block_n)
    dk_out, dv_out, reduce = dk, dv, None
    if gqa_parts is not None:  # the caller allocated the per-q-head partials and sums them (attention_backward)
        dk_out, dv_out = gqa_parts
        split = dk_out.shape[1] // Hkv
    else:
        split = gqa_split_factor(q, k, spec, c1, target, gqa_split)
        if split > 1:
            dk_out, dv_out = gqa_partials(dk, dv, split, q.dtype)
            reduce = GqaReduce(dk_out, dv_out, dk, dv, split)
    dkdv = Launch(_attn_bwd_dkdv, (tiles_n, Hkv * split, B), dict(
        common, DK=dk_out, DV=dv_out, **stride_args("dk", dk_out, spec), **stride_args("dv", dv_out, spec), H=H,
        GROUP=group, SPLIT=split,
        BLOCK_M=c1.block_m, BLOCK_N=c1.block_n), c1,
        estimate_shared_memory("attn_bwd_dkdv", c1, block_dqk, block_dv, q.element_size(), target))
    dq_kernel = "attn_bwd_dq" if dbias is None else "attn_bwd_dq_dbias"  # its own tile (configs.py)
    c2 = select_config(dq_kernel, block_dqk, block_dv, q.element_size(), target, spec.modifies_scores)
    finish = None
    if dbias is not None:  # the attn_mask gradient is dS: written by the dQ kernel as it forms dS
        db_args, (grid_h, grid_b), finish = dbias_plan(dbias, B, H, Sq, Sk, c2.block_m, TORCH_ACC_DTYPE[q.dtype])
    else:
        db_args, (grid_h, grid_b) = dict(DB=delta, stride_dbb=0, stride_dbh=0, stride_dbm=0, stride_dbn=0, n_b=1,
                                         n_h=1, DBIAS=False, DB_SUM_M=False, DB_SUM_N=False), (H, B)
    dqk = Launch(_attn_bwd_dq, (cdiv(Sq, c2.block_m), grid_h, grid_b), dict(
        common, DQ=dq, **stride_args("dq", dq, spec), **db_args, H=H, GROUP=H // Hkv,
        BLOCK_M=c2.block_m, BLOCK_N=c2.block_n), c2,
        estimate_shared_memory(dq_kernel, c2, block_dqk, block_dv, q.element_size(), target))
    return [pre, dkdv, dqk] + [step for step in (reduce, finish) if step is not None]


_ROLES = ("DO", "Q", "K", "V", "O", "M2", "L2", "DELTA", "DQ", "DK", "DV", "DLSE", "DB", "DK_PART", "DV_PART",
          *MASK_ROLES)


def attention_backward(do, q, k, v, out, m2, l2, *, scale: float, causal: bool = False, bottom_right: bool = False,
                       dlse2: torch.Tensor | None = None, spec: MaskSpec = NO_MASKS, grads=None, dbias=None,
                       gqa_split: bool | None = None):
    """Gradients of attention_forward from its (out, m2, l2). do is dL/dout; dlse2 an optional
    dL/dlse2, the cotangent of lse2 = m2 + l2 (log2 units).

    Returns (dq, dk, dv) shaped like (q, k, v), written into `grads` when given (any strides with
    a unit last stride). Padding rows/keys and rows that see no key get exactly zero gradient.
    dbias: a tensor shaped like spec.attn_mask (additive) that receives the mask's gradient, summed
    over its broadcast (size-1) dims.
    gqa_split: one program per q head for dK/dV (see _attn_bwd_dkdv); None decides from the grid size.
    """
    dq, dk, dv = grads if grads is not None else (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))
    if q.numel() == 0 or k.numel() == 0:
        if dbias is not None:
            dbias.zero_()
        return dq.zero_(), dk.zero_(), dv.zero_()
    delta = torch.empty(m2.shape, dtype=TORCH_ACC_DTYPE[q.dtype], device=q.device)
    parts, split = (None, None), 1
    if q.shape[1] != k.shape[1]:  # GQA: split dK/dV over the group into partials allocated here, so the
        target = target_for(q)   # plan has no host step and replays from the launch cache
        c1 = select_config("attn_bwd_dkdv", head_block(q.shape[3]), head_block(v.shape[3]), q.element_size(), target,
                           spec.modifies_scores)
        split = gqa_split_factor(q, k, spec, c1, target, gqa_split)
        if split > 1:
            parts = gqa_partials(dk, dv, split, q.dtype)
    static, tensors = spec.launch_key()
    LAUNCHES.run(("attn_bwd", q.device, dot_precision(q.dtype), scale, causal, bottom_right, split, static),
                 _ROLES, (do, q, k, v, out, m2, l2, delta, dq, dk, dv, dlse2, dbias, *parts, *tensors),
                 lambda: plan_backward(do, q, k, v, out, m2, l2, delta, dq, dk, dv, scale=scale, causal=causal,
                                       bottom_right=bottom_right, dlse2=dlse2, spec=spec, dbias=dbias,
                                       gqa_parts=parts if split > 1 else None))
    if split > 1:
        GqaReduce(*parts, dk, dv, split).run()
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
    return plans + _fused_compile_plans(target)


def _fused_compile_plans(target) -> list:
    """The dQ kernel writing the attn_mask gradient (fp16/bf16 with every option, the mask broadcast
    over batch, or over heads and queries; fp32 with a full mask), and dK/dV split over GQA heads."""
    from .attention_fwd import all_options_spec

    B, H, S = 2, 2, 128
    plans = []
    for d in (64, 128, 256):
        cases = [(dt, shape) for dt in (torch.float16, torch.bfloat16) for shape in ((1, H, S, S), (B, 1, 1, S))]
        for dtype, shape in cases + [(torch.float32, (B, H, S, S))]:
            q, k, v, o, do, dq, dk, dv = (torch.empty(B, H, S, d, dtype=dtype) for _ in range(8))
            m2, l2, delta = (torch.empty(B, H, S, dtype=torch.float32) for _ in range(3))
            spec = (MaskSpec(attn_mask=torch.empty(shape, dtype=dtype)) if dtype == torch.float32
                    else all_options_spec(B, S, H, shape, dtype))
            try:
                launches = plan_backward(do, q, k, v, o, m2, l2, delta, dq, dk, dv, scale=d ** -0.5, causal=True,
                                         bottom_right=False, spec=spec, dbias=torch.empty(shape, dtype=dtype),
                                         target=target)
            except RuntimeError:  # no config fits: the backend reports it and never launches
                continue
            plans.append((f"attn_bwd_dq+dbias D={d} {str(dtype)[6:]} {'x'.join(map(str, shape))}", launches[2]))
        q, o, do, dq = (torch.empty(1, 4, S, d, dtype=torch.float16) for _ in range(4))
        k, v, dk, dv = (torch.empty(1, 1, S, d, dtype=torch.float16) for _ in range(4))
        m2, l2, delta = (torch.empty(1, 4, S, dtype=torch.float32) for _ in range(3))
        try:
            launches = plan_backward(do, q, k, v, o, m2, l2, delta, dq, dk, dv, scale=d ** -0.5, causal=True,
                                     bottom_right=False, target=target, gqa_split=True)
        except RuntimeError:
            continue
        plans.append((f"attn_bwd_dkdv+gqa-split D={d} float16 causal", launches[1]))
    return plans
