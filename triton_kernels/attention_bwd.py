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

import triton
import triton.language as tl

from .attention_common import (alibi_slope2, dropout_keep, kv_loop_bounds, loop_part, modifier_scalars, program_hb,
                               q_loop_bounds, scalar_in, score_mods, seq_bounds, visible)


@triton.jit
def _attn_bwd_preprocess(O, DO, DLSE, DELTA,
                         stride_ob, stride_oh, stride_om, stride_od,
                         stride_dob, stride_doh, stride_dom, stride_dod,
                         H, Sq, D_V, dlse_scale_hi, dlse_scale_lo,
                         BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_DV2: tl.constexpr,
                         HAS_DLSE: tl.constexpr, ACC: tl.constexpr):
    """delta of BLOCK_M rows; a split value head dim (BLOCK_DV2 > 0) is summed piece by piece."""
    pid_m = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)  # grid (q tiles, heads, batch): each axis stays within CUDA's limits
    pid_bh = b.to(tl.int64) * H + h  # (B * H can pass 2**31)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    o_base = O + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh
    do_base = DO + b.to(tl.int64) * stride_dob + h.to(tl.int64) * stride_doh
    offs_d = tl.arange(0, BLOCK_DV)
    mask = (offs_m[:, None] < Sq) & (offs_d[None, :] < D_V)
    o = tl.load(o_base + offs_m[:, None] * stride_om + offs_d[None, :] * stride_od, mask=mask, other=0.0)
    do = tl.load(do_base + offs_m[:, None] * stride_dom + offs_d[None, :] * stride_dod, mask=mask, other=0.0)
    delta = tl.sum(o.to(ACC) * do.to(ACC), 1)  # (BLOCK_M,)
    if BLOCK_DV2 > 0:  # columns [BLOCK_DV, BLOCK_DV + BLOCK_DV2), (BLOCK_M, BLOCK_DV2)
        offs_d2 = BLOCK_DV + tl.arange(0, BLOCK_DV2)
        mask2 = (offs_m[:, None] < Sq) & (offs_d2[None, :] < D_V)
        o2 = tl.load(o_base + offs_m[:, None] * stride_om + offs_d2[None, :] * stride_od, mask=mask2, other=0.0)
        do2 = tl.load(do_base + offs_m[:, None] * stride_dom + offs_d2[None, :] * stride_dod, mask=mask2, other=0.0)
        delta += tl.sum(o2.to(ACC) * do2.to(ACC), 1)
    row = pid_bh * Sq + offs_m
    if HAS_DLSE:
        # lse = logsumexp(s) has d lse / d s = P, which folds into dS = P * (dP - delta + dlse)
        dlse = tl.load(DLSE + row, mask=offs_m < Sq, other=0.0).to(ACC)
        delta = delta - dlse * scalar_in(dlse_scale_hi, dlse_scale_lo, ACC)
    tl.store(DELTA + row, delta, mask=offs_m < Sq)


@triton.jit
def _dkdv_tile(dk, dv, dk2, dv2, k, v, k2, v2, key_ok, q_rows, do_rows, m2_rows, l2_rows, delta_rows, mb_rows,
               h, start_m, slope2, bH, offs_n, Sq_b, Sk_b, causal_shift, window_shift, qk_scale, stride_qh, stride_qm,
               stride_qd, stride_doh, stride_dom, stride_dod, stride_lh, stride_mh, stride_mm, stride_mn, D_QK, D_V,
               softcap2, log2e, seed, dropout_p, drop_scale,
               BLOCK_M: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DQK2: tl.constexpr, BLOCK_DV: tl.constexpr,
               BLOCK_DV2: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
               KEY_MASK: tl.constexpr, MASK_KIND: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
               DROPOUT: tl.constexpr, ACC: tl.constexpr, DOT_PREC: tl.constexpr, TMA: tl.constexpr):
    """Add q head h's rows [start_m, start_m + BLOCK_M) to this K/V tile's dK, dV (see _dkdv_tiles)."""
    offs_dqk = tl.arange(0, BLOCK_DQK)
    offs_dv = tl.arange(0, BLOCK_DV)
    hq = h.to(tl.int64)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    # rows past Sq_b read as zeros (q, dO, delta) and m2 -inf, so they add nothing
    row_ok = offs_m < Sq_b
    q_base = q_rows  # (TMA: the descriptor)
    if TMA:
        qt = q_rows.load([start_m, 0]).T  # (BLOCK_DQK, BLOCK_M)
        do = do_rows.load([start_m, 0])  # (BLOCK_M, BLOCK_DV)
        do_base = do_rows
    else:
        q_base = q_rows + hq * stride_qh
        do_base = do_rows + hq * stride_doh
        qt = tl.load(q_base + offs_m[None, :] * stride_qm + offs_dqk[:, None] * stride_qd,
                     mask=row_ok[None, :] & (offs_dqk[:, None] < D_QK), other=0.0)  # (BLOCK_DQK, BLOCK_M)
        do = tl.load(do_base + offs_m[:, None] * stride_dom + offs_dv[None, :] * stride_dod,
                     mask=row_ok[:, None] & (offs_dv[None, :] < D_V), other=0.0)  # (BLOCK_M, BLOCK_DV)
    row = hq * stride_lh
    m2 = tl.load(m2_rows + row + offs_m, mask=row_ok, other=float("-inf"))
    inv_l = tl.exp2(-tl.load(l2_rows + row + offs_m, mask=row_ok, other=0.0))  # 1 / row sum
    delta = tl.load(delta_rows + row + offs_m, mask=row_ok, other=0.0)
    m2 = tl.where(m2 == float("-inf"), float("inf"), m2)  # rows that see no key: P = exp2(s - inf) = 0
    st = tl.dot(k, qt, out_dtype=ACC, input_precision=DOT_PREC)  # (BLOCK_N, BLOCK_M) = S^T
    qt2 = qt  # placeholder: read only when the head dim is split
    if BLOCK_DQK2 > 0:  # Q's second column piece, (BLOCK_DQK2, BLOCK_M), accumulated into S^T
        offs_dqk2 = BLOCK_DQK + tl.arange(0, BLOCK_DQK2)
        qt2 = tl.load(q_base + offs_m[None, :] * stride_qm + offs_dqk2[:, None] * stride_qd,
                      mask=row_ok[None, :] & (offs_dqk2[:, None] < D_QK), other=0.0)
        st = tl.dot(k2, qt2, st, out_dtype=ACC, input_precision=DOT_PREC)
    st = st * qk_scale
    st, tt = score_mods(st, offs_m[None, :], offs_n[:, None], row_ok[None, :] & (offs_n[:, None] < Sk_b),
                        mb_rows + hq * stride_mh, stride_mm, stride_mn, softcap2, slope2, Sk_b - Sq_b, log2e,
                        MASK_KIND, SOFTCAP, ALIBI)
    pt = tl.exp2(st - m2[None, :]) * inv_l[None, :]
    if MASKED:
        pt = tl.where(visible(offs_m[None, :], offs_n[:, None], Sq_b, Sk_b, causal_shift, window_shift, key_ok,
                              CAUSAL, WINDOW, KEY_MASK), pt, 0.0)
    dpt = tl.dot(v, tl.trans(do), out_dtype=ACC, input_precision=DOT_PREC)  # (BLOCK_N, BLOCK_M) = dP^T
    do2 = do  # placeholder: read only when the value head dim is split
    if BLOCK_DV2 > 0:  # dO's second column piece, (BLOCK_M, BLOCK_DV2), accumulated into dP^T
        offs_dv2 = BLOCK_DV + tl.arange(0, BLOCK_DV2)
        do2 = tl.load(do_base + offs_m[:, None] * stride_dom + offs_dv2[None, :] * stride_dod,
                      mask=row_ok[:, None] & (offs_dv2[None, :] < D_V), other=0.0)
        dpt = tl.dot(v2, tl.trans(do2), dpt, out_dtype=ACC, input_precision=DOT_PREC)
    pv = pt  # the P^T that dV sees
    if DROPOUT:  # out = (P * keep / (1 - p)) V: the same factor scales dV's P and dP
        keep = dropout_keep(seed, bH + h, offs_m[None, :], offs_n[:, None], Sk_b, dropout_p, DROPOUT)
        pv = tl.where(keep, pt * drop_scale, 0.0)
        dpt = tl.where(keep, dpt * drop_scale, 0.0)
    dv += tl.dot(pv.to(do.dtype), do, out_dtype=ACC, input_precision=DOT_PREC)
    if BLOCK_DV2 > 0:
        dv2 += tl.dot(pv.to(do2.dtype), do2, out_dtype=ACC, input_precision=DOT_PREC)  # (BLOCK_N, BLOCK_DV2)
    dst = pt * (dpt - delta[None, :])  # dL/d(scores), natural units
    if SOFTCAP:
        dst = dst * (1.0 - tt * tt)  # d/dx softcap * tanh(x / softcap)
    dk += tl.dot(dst.to(qt.dtype), tl.trans(qt), out_dtype=ACC, input_precision=DOT_PREC)
    if BLOCK_DQK2 > 0:
        # (BLOCK_N, BLOCK_DQK2)
        dk2 += tl.dot(dst.to(qt2.dtype), tl.trans(qt2), out_dtype=ACC, input_precision=DOT_PREC)
    return dk, dv, dk2, dv2


@triton.jit
def _dkdv_tiles(dk, dv, dk2, dv2, k, v, k2, v2, key_ok, q_rows, do_rows, m2_rows, l2_rows, delta_rows, mb_rows,
                al_row, h0, n_heads, bH, offs_n, start, end,
                Sq_b, Sk_b, causal_shift, window_shift, qk_scale, stride_qh, stride_qm, stride_qd, stride_doh,
                stride_dom, stride_dod, stride_lh, stride_mh, stride_mm, stride_mn, D_QK, D_V, softcap2, log2e, seed,
                dropout_p, drop_scale,
                BLOCK_M: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DQK2: tl.constexpr, BLOCK_DV: tl.constexpr,
                BLOCK_DV2: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
                KEY_MASK: tl.constexpr, MASK_KIND: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
                DROPOUT: tl.constexpr, ACC: tl.constexpr, DOT_PREC: tl.constexpr, TMA: tl.constexpr,
                ONE_HEAD: tl.constexpr):
    """Add the contributions of q rows [start, end) of q heads h0 .. h0 + n_heads - 1 to this K/V tile's dK, dV.

    ONE_HEAD (n_heads 1: MHA, a GQA split, TMA): a loop over head h0's q tiles. Else (a GQA group): one loop over
    (head, q tile) pairs, not a loop of heads around a loop of tiles: that runtime-bounded outer loop made ptxas
    spill 4-8x more (sm_90: 632 bytes against 112 at D = 64, 864 against 272 at D = 128; sm_80 spilled where one
    head spills none). q_rows / do_rows / m2_rows / l2_rows / delta_rows / mb_rows point at head 0's rows of this
    sequence (+ h * their head stride); al_row at this batch's ALiBi slopes; bH = b * H (dropout's stream).
    TMA: q_rows / do_rows are tensor descriptors of head h0's Q / dO rows (rows past Sq_b read as 0).

    Split head dims (BLOCK_DQK2 / BLOCK_DV2 > 0): k2 / v2 hold K's / V's second column piece and dk2 / dv2
    accumulate the gradients' second pieces; unsplit they are placeholders, never read, returned unchanged."""
    if ONE_HEAD:
        slope2 = alibi_slope2(al_row, h0, log2e, ALIBI, ACC)
        for start_m in range(start, end, BLOCK_M):
            dk, dv, dk2, dv2 = _dkdv_tile(
                dk, dv, dk2, dv2, k, v, k2, v2, key_ok, q_rows, do_rows, m2_rows, l2_rows, delta_rows, mb_rows, h0,
                start_m, slope2, bH, offs_n, Sq_b, Sk_b, causal_shift, window_shift, qk_scale, stride_qh, stride_qm,
                stride_qd, stride_doh, stride_dom, stride_dod, stride_lh, stride_mh, stride_mm, stride_mn, D_QK, D_V,
                softcap2, log2e, seed, dropout_p, drop_scale, BLOCK_M, BLOCK_DQK, BLOCK_DQK2, BLOCK_DV, BLOCK_DV2,
                MASKED, CAUSAL, WINDOW, KEY_MASK, MASK_KIND, SOFTCAP, ALIBI, DROPOUT, ACC, DOT_PREC, TMA)
    else:
        n_m = tl.cdiv(tl.maximum(end - start, 0), BLOCK_M)  # q tiles of one head in [start, end)
        for it in range(0, n_m * n_heads):
            h = h0 + it // n_m
            slope2 = alibi_slope2(al_row, h, log2e, ALIBI, ACC)
            dk, dv, dk2, dv2 = _dkdv_tile(
                dk, dv, dk2, dv2, k, v, k2, v2, key_ok, q_rows, do_rows, m2_rows, l2_rows, delta_rows, mb_rows, h,
                start + (it % n_m) * BLOCK_M, slope2, bH, offs_n, Sq_b, Sk_b, causal_shift, window_shift, qk_scale,
                stride_qh, stride_qm, stride_qd, stride_doh, stride_dom, stride_dod, stride_lh, stride_mh, stride_mm,
                stride_mn, D_QK, D_V, softcap2, log2e, seed, dropout_p, drop_scale, BLOCK_M, BLOCK_DQK, BLOCK_DQK2,
                BLOCK_DV, BLOCK_DV2, MASKED, CAUSAL, WINDOW, KEY_MASK, MASK_KIND, SOFTCAP, ALIBI, DROPOUT, ACC,
                DOT_PREC, TMA)
    return dk, dv, dk2, dv2


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
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DQK2: tl.constexpr,
                   BLOCK_DV: tl.constexpr, BLOCK_DV2: tl.constexpr,
                   CAUSAL: tl.constexpr, WINDOW: tl.constexpr, KEY_MASK: tl.constexpr, QUERY_MASK: tl.constexpr,
                   LENS: tl.constexpr, VARLEN: tl.constexpr, MASK_KIND: tl.constexpr, EVERY_TILE: tl.constexpr,
                   SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, DROPOUT: tl.constexpr,
                   ACC: tl.constexpr, DOT_PREC: tl.constexpr, TMA: tl.constexpr, ONE_HEAD: tl.constexpr,
                   BATCH_Y: tl.constexpr):
    """dK/dV of one K/V tile from GROUP // SPLIT of the q heads sharing its K/V head. SPLIT = 1: the
    whole GQA group, reduced in registers, written to DK/DV at the K/V head. SPLIT = GROUP: one q head
    per program (a grid GROUP times larger), each writing its partial at head index pid_h
    of fp32 (B, Hkv * SPLIT, Sk, D) buffers that the host sums in a fixed order (deterministic).
    Split head dims (BLOCK_DQK2 / BLOCK_DV2 > 0, launch.head_split) keep each second column piece in
    its own tiles and accumulators. TMA (sm_90+, unsplit, 16-byte aligned rows: launch.tma_ok): the
    streamed Q / dO tiles are read through device-side tensor descriptors. ONE_HEAD: GROUP // SPLIT == 1
    (the q tiles of one head; else one loop over the group's (head, q tile) pairs: _dkdv_tiles). Grid (K/V
    tiles, Hkv * SPLIT, batch), or (K/V tiles, batch, Hkv * SPLIT) under BATCH_Y (batch_y)."""
    tl.static_assert(not TMA or (BLOCK_DQK2 == 0 and BLOCK_DV2 == 0), "TMA reads unsplit head dims only")
    pid_n = tl.program_id(0)
    pid_h, b = program_hb(BATCH_Y)  # pid_h: kvh * SPLIT + the part of the group
    kvh = pid_h // SPLIT
    per_prog = GROUP // SPLIT
    g0 = (pid_h % SPLIT) * per_prog
    lq, lk, cq0, cq1, ck0, ck1 = b, b, b, b, b, b  # read by seq_bounds only under LENS / VARLEN
    if LENS:
        lq, lk = tl.load(Q_LENS + b), tl.load(KV_LENS + b)
    if VARLEN:
        cq0, cq1, ck0, ck1 = tl.load(CU_Q + b), tl.load(CU_Q + b + 1), tl.load(CU_K + b), tl.load(CU_K + b + 1)
    q_start, k_start, Sq_b, Sk_b, Sq_mem, Sk_mem, causal_shift, window_shift = seq_bounds(
        b, Sq, Sk, lq, lk, cq0, cq1, ck0, ck1, bottom_right, right, left, LENS, VARLEN)
    n0 = pid_n * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_dqk = tl.arange(0, BLOCK_DQK)
    offs_dv = tl.arange(0, BLOCK_DV)
    key_row = offs_n < Sk_b  # padding keys read as 0 and get zero gradients
    k_base = K + b.to(tl.int64) * stride_kb + kvh.to(tl.int64) * stride_kh + k_start.to(tl.int64) * stride_kn
    v_base = V + b.to(tl.int64) * stride_vb + kvh.to(tl.int64) * stride_vh + k_start.to(tl.int64) * stride_vn
    k = tl.load(k_base + offs_n[:, None] * stride_kn + offs_dqk[None, :] * stride_kd,
                mask=key_row[:, None] & (offs_dqk[None, :] < D_QK), other=0.0)  # (BLOCK_N, BLOCK_DQK)
    v = tl.load(v_base + offs_n[:, None] * stride_vn + offs_dv[None, :] * stride_vd,
                mask=key_row[:, None] & (offs_dv[None, :] < D_V), other=0.0)  # (BLOCK_N, BLOCK_DV)
    dk = tl.zeros([BLOCK_N, BLOCK_DQK], dtype=ACC)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=ACC)
    k2, dk2 = k, key_row  # placeholders: second column pieces only when a head dim is split
    v2, dv2 = v, key_row
    if BLOCK_DQK2 > 0:
        offs_dqk2 = BLOCK_DQK + tl.arange(0, BLOCK_DQK2)
        k2 = tl.load(k_base + offs_n[:, None] * stride_kn + offs_dqk2[None, :] * stride_kd,
                     mask=key_row[:, None] & (offs_dqk2[None, :] < D_QK), other=0.0)  # (BLOCK_N, BLOCK_DQK2)
        dk2 = tl.zeros([BLOCK_N, BLOCK_DQK2], dtype=ACC)
    if BLOCK_DV2 > 0:
        offs_dv2 = BLOCK_DV + tl.arange(0, BLOCK_DV2)
        v2 = tl.load(v_base + offs_n[:, None] * stride_vn + offs_dv2[None, :] * stride_vd,
                     mask=key_row[:, None] & (offs_dv2[None, :] < D_V), other=0.0)  # (BLOCK_N, BLOCK_DV2)
        dv2 = tl.zeros([BLOCK_N, BLOCK_DV2], dtype=ACC)
    key_ok = key_row[:, None]
    if KEY_MASK:  # this program's keys never change: read their mask once
        key_ok = tl.load(KM + b.to(tl.int64) * stride_kmb + offs_n[:, None] * stride_kmn, mask=key_ok, other=0) != 0
    qk_scale = scalar_in(qk_scale_hi, qk_scale_lo, ACC)
    drop_scale = scalar_in(drop_scale_hi, drop_scale_lo, ACC)

    lo, free_lo, free_hi, hi = q_loop_bounds(n0, Sq_b, Sk_b, causal_shift, window_shift, BLOCK_M, BLOCK_N,
                                             CAUSAL, WINDOW, EVERY_TILE)
    # head 0's rows of this sequence: each q head's are + h * its head stride
    q_rows = Q + b.to(tl.int64) * stride_qb + q_start.to(tl.int64) * stride_qm
    do_rows = DO + b.to(tl.int64) * stride_dob + q_start.to(tl.int64) * stride_dom
    row_base = b.to(tl.int64) * stride_lb + q_start
    mb_rows = MB + b.to(tl.int64) * stride_mb
    al_row = AL + b.to(tl.int64) * stride_alb
    h0 = kvh * GROUP + g0  # the q heads that share this K/V head, reduced here: no atomics
    softcap2, log2e, _, seed = modifier_scalars(b, h0, AL, stride_alb, RNG, softcap_hi, softcap_lo,
                                                log2e_hi, log2e_lo, False, DROPOUT, ACC)
    if TMA:  # descriptors of one head's rows, Q (Sq_b, D_QK) and dO (Sq_b, D_V), one row at least: a loop of heads
        for g in range(0, per_prog):
            h = h0 + g
            q_desc = tl.make_tensor_descriptor(q_rows + h.to(tl.int64) * stride_qh, shape=[tl.maximum(Sq_b, 1), D_QK],
                                               strides=[stride_qm, 1], block_shape=[BLOCK_M, BLOCK_DQK])
            do_desc = tl.make_tensor_descriptor(do_rows + h.to(tl.int64) * stride_doh,
                                                shape=[tl.maximum(Sq_b, 1), D_V], strides=[stride_dom, 1],
                                                block_shape=[BLOCK_M, BLOCK_DV])
            for part in tl.static_range(3):
                start, end = loop_part(part, lo, free_lo, free_hi, hi)
                dk, dv, dk2, dv2 = _dkdv_tiles(
                    dk, dv, dk2, dv2, k, v, k2, v2, key_ok, q_desc, do_desc, M2 + row_base, L2 + row_base,
                    DELTA + row_base, mb_rows, al_row, h, 1, b * H, offs_n, start, end, Sq_b, Sk_b, causal_shift,
                    window_shift, qk_scale, stride_qh, stride_qm, stride_qd, stride_doh, stride_dom, stride_dod,
                    stride_lh, stride_mh, stride_mm, stride_mn, D_QK, D_V, softcap2, log2e, seed, dropout_p,
                    drop_scale, BLOCK_M, BLOCK_DQK, BLOCK_DQK2, BLOCK_DV, BLOCK_DV2, part != 1, CAUSAL, WINDOW,
                    KEY_MASK, MASK_KIND, SOFTCAP, ALIBI, DROPOUT, ACC, DOT_PREC, TMA, True)
    else:
        # masked tiles before the unmasked range (causal diagonal), unmasked, masked tail (window edge, Sq_b), each
        # over every head of the group
        for part in tl.static_range(3):
            start, end = loop_part(part, lo, free_lo, free_hi, hi)
            dk, dv, dk2, dv2 = _dkdv_tiles(
                dk, dv, dk2, dv2, k, v, k2, v2, key_ok, q_rows, do_rows, M2 + row_base, L2 + row_base,
                DELTA + row_base, mb_rows, al_row, h0, per_prog, b * H, offs_n, start, end, Sq_b, Sk_b, causal_shift,
                window_shift, qk_scale, stride_qh, stride_qm, stride_qd, stride_doh, stride_dom, stride_dod,
                stride_lh, stride_mh, stride_mm, stride_mn, D_QK, D_V, softcap2, log2e, seed, dropout_p,
                drop_scale, BLOCK_M, BLOCK_DQK, BLOCK_DQK2, BLOCK_DV, BLOCK_DV2, part != 1, CAUSAL, WINDOW,
                KEY_MASK, MASK_KIND, SOFTCAP, ALIBI, DROPOUT, ACC, DOT_PREC, TMA, ONE_HEAD)

    sm_scale = scalar_in(sm_scale_hi, sm_scale_lo, ACC)
    dk_base = DK + b.to(tl.int64) * stride_dkb + pid_h.to(tl.int64) * stride_dkh + k_start.to(tl.int64) * stride_dkn
    dv_base = DV + b.to(tl.int64) * stride_dvb + pid_h.to(tl.int64) * stride_dvh + k_start.to(tl.int64) * stride_dvn
    key_out = offs_n[:, None] < Sk_mem
    tl.store(dk_base + offs_n[:, None] * stride_dkn + offs_dqk[None, :] * stride_dkd,
             (dk * sm_scale).to(DK.dtype.element_ty), mask=key_out & (offs_dqk[None, :] < D_QK))
    tl.store(dv_base + offs_n[:, None] * stride_dvn + offs_dv[None, :] * stride_dvd, dv.to(DV.dtype.element_ty),
             mask=key_out & (offs_dv[None, :] < D_V))
    if BLOCK_DQK2 > 0:
        offs_dqk2 = BLOCK_DQK + tl.arange(0, BLOCK_DQK2)
        tl.store(dk_base + offs_n[:, None] * stride_dkn + offs_dqk2[None, :] * stride_dkd,
                 (dk2 * sm_scale).to(DK.dtype.element_ty), mask=key_out & (offs_dqk2[None, :] < D_QK))
    if BLOCK_DV2 > 0:
        offs_dv2 = BLOCK_DV + tl.arange(0, BLOCK_DV2)
        tl.store(dv_base + offs_n[:, None] * stride_dvn + offs_dv2[None, :] * stride_dvd, dv2.to(DV.dtype.element_ty),
                 mask=key_out & (offs_dv2[None, :] < D_V))


@triton.jit
def _dq_tiles(dq, dq2, db_row, q, q2, do, do2, m2, inv_l, delta, k_base, v_base, km_base, mb_base, db_base, first,
              offs_m, start, end, Sq_b, Sk_b, causal_shift, window_shift, qk_scale, stride_kn, stride_kd, stride_vn,
              stride_vd,
              stride_kmn, stride_mm, stride_mn, stride_dbm, stride_dbn, D_QK, D_V, softcap2, slope2, log2e, seed, bh,
              Sq, Sk, dropout_p, drop_scale,
              BLOCK_N: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DQK2: tl.constexpr, BLOCK_DV: tl.constexpr,
              BLOCK_DV2: tl.constexpr, MASKED: tl.constexpr,
              CAUSAL: tl.constexpr, WINDOW: tl.constexpr, KEY_MASK: tl.constexpr, MASK_KIND: tl.constexpr,
              SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, DROPOUT: tl.constexpr, DBIAS: tl.constexpr,
              DB_SUM_M: tl.constexpr, DB_SUM_N: tl.constexpr, ACC: tl.constexpr, DOT_PREC: tl.constexpr,
              TMA: tl.constexpr):
    """Add the contributions of key tiles [start, end) to this q tile's dQ (unscaled), and with DBIAS
    their dS to the attn_mask gradient (`_dbias_tile`). TMA: k_base / v_base are tensor descriptors
    of the sequence's K / V rows (rows past Sk_b read as 0).

    Split head dims (BLOCK_DQK2 / BLOCK_DV2 > 0): q2 / do2 hold Q's / dO's second column piece and dq2
    accumulates dQ's; unsplit they are placeholders, never read, dq2 returned unchanged."""
    offs_dqk = tl.arange(0, BLOCK_DQK)
    offs_dv = tl.arange(0, BLOCK_DV)
    alibi_shift = Sk_b - Sq_b
    for start_n in range(start, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        if TMA:
            kt = k_base.load([start_n, 0]).T  # (BLOCK_DQK, BLOCK_N)
            vt = v_base.load([start_n, 0]).T  # (BLOCK_DV, BLOCK_N)
        else:
            kt = tl.load(k_base + offs_n[None, :] * stride_kn + offs_dqk[:, None] * stride_kd,
                         mask=(offs_n[None, :] < Sk_b) & (offs_dqk[:, None] < D_QK), other=0.0)  # (BLOCK_DQK, BLOCK_N)
            vt = tl.load(v_base + offs_n[None, :] * stride_vn + offs_dv[:, None] * stride_vd,
                         mask=(offs_n[None, :] < Sk_b) & (offs_dv[:, None] < D_V), other=0.0)  # (BLOCK_DV, BLOCK_N)
        s = tl.dot(q, kt, out_dtype=ACC, input_precision=DOT_PREC)  # (BLOCK_M, BLOCK_N)
        kt2 = kt  # placeholder: read only when the head dim is split
        if BLOCK_DQK2 > 0:  # K^T's second column piece, (BLOCK_DQK2, BLOCK_N), accumulated into s
            offs_dqk2 = BLOCK_DQK + tl.arange(0, BLOCK_DQK2)
            kt2 = tl.load(k_base + offs_n[None, :] * stride_kn + offs_dqk2[:, None] * stride_kd,
                          mask=(offs_n[None, :] < Sk_b) & (offs_dqk2[:, None] < D_QK), other=0.0)
            s = tl.dot(q2, kt2, s, out_dtype=ACC, input_precision=DOT_PREC)
        s = s * qk_scale
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
        if BLOCK_DV2 > 0:  # V^T's second column piece, (BLOCK_DV2, BLOCK_N), accumulated into dP
            offs_dv2 = BLOCK_DV + tl.arange(0, BLOCK_DV2)
            vt2 = tl.load(v_base + offs_n[None, :] * stride_vn + offs_dv2[:, None] * stride_vd,
                          mask=(offs_n[None, :] < Sk_b) & (offs_dv2[:, None] < D_V), other=0.0)
            dp = tl.dot(do2, vt2, dp, out_dtype=ACC, input_precision=DOT_PREC)
        if DROPOUT:
            keep = dropout_keep(seed, bh, offs_m[:, None], offs_n[None, :], Sk_b, dropout_p, DROPOUT)
            dp = tl.where(keep, dp * drop_scale, 0.0)
        ds = p * (dp - delta[:, None])  # dL/d(scores) = dL/d(attn_mask), natural units
        if DBIAS:
            db_row = _dbias_tile(ds, db_row, db_base, first, offs_m, offs_n, Sq, Sk, stride_dbm, stride_dbn,
                                 DB_SUM_M, DB_SUM_N)
        if SOFTCAP:
            ds = ds * (1.0 - t * t)
        dq += tl.dot(ds.to(kt.dtype), tl.trans(kt), out_dtype=ACC, input_precision=DOT_PREC)
        if BLOCK_DQK2 > 0:
            # (BLOCK_M, BLOCK_DQK2)
            dq2 += tl.dot(ds.to(kt2.dtype), tl.trans(kt2), out_dtype=ACC, input_precision=DOT_PREC)
    return dq, dq2, db_row


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
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DQK2: tl.constexpr,
                 BLOCK_DV: tl.constexpr, BLOCK_DV2: tl.constexpr,
                 CAUSAL: tl.constexpr, WINDOW: tl.constexpr, KEY_MASK: tl.constexpr, QUERY_MASK: tl.constexpr,
                 LENS: tl.constexpr, VARLEN: tl.constexpr, MASK_KIND: tl.constexpr, EVERY_TILE: tl.constexpr,
                 SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, DROPOUT: tl.constexpr,
                 DBIAS: tl.constexpr, DB_SUM_M: tl.constexpr, DB_SUM_N: tl.constexpr,
                 ACC: tl.constexpr, DOT_PREC: tl.constexpr, TMA: tl.constexpr, BATCH_Y: tl.constexpr):
    """dQ of one q tile for n_b batches x n_h heads in turn (1 x 1 unless the attn_mask gradient is
    broadcast over batch / heads: then program (m, j, i) takes batches [i n_b, (i + 1) n_b) and heads
    [j n_h, (j + 1) n_h), n_b and n_h dividing the batch and head counts, and sums their dS into its own
    partial of that gradient tile, DB[i, j], in a fixed order). With DBIAS, dS goes to DB (shaped like the
    attn_mask, or per-q-tile partials when it broadcasts over queries, DB_SUM_M); tiles the loop bounds skip
    get 0 there. TMA (sm_90+, unsplit, 16-byte aligned rows: launch.tma_ok): the streamed K / V tiles are read
    through tensor descriptors. Grid (q tiles, heads, batch) or groups of them; BATCH_Y: (q tiles, batch, heads)."""
    tl.static_assert(not TMA or (BLOCK_DQK2 == 0 and BLOCK_DV2 == 0), "TMA reads unsplit head dims only")
    pid_m = tl.program_id(0)  # not longest first as the forward: reversed, it spills more on sm_80/86
    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_dqk = tl.arange(0, BLOCK_DQK)
    offs_dv = tl.arange(0, BLOCK_DV)
    qk_scale = scalar_in(qk_scale_hi, qk_scale_lo, ACC)
    drop_scale = scalar_in(drop_scale_hi, drop_scale_lo, ACC)
    gh, gb = program_hb(BATCH_Y)  # this program's head and batch, or group of them
    b0, h0 = gb * n_b, gh * n_h
    for bi in range(0, n_b):  # (n_b = 1, specialised by Triton, unless a summed axis groups batches)
        b = b0 + bi
        lq, lk, cq0, cq1, ck0, ck1 = b, b, b, b, b, b  # read by seq_bounds only under LENS / VARLEN
        if LENS:
            lq, lk = tl.load(Q_LENS + b), tl.load(KV_LENS + b)
        if VARLEN:
            cq0, cq1, ck0, ck1 = tl.load(CU_Q + b), tl.load(CU_Q + b + 1), tl.load(CU_K + b), tl.load(CU_K + b + 1)
        q_start, k_start, Sq_b, Sk_b, Sq_mem, Sk_mem, causal_shift, window_shift = seq_bounds(
            b, Sq, Sk, lq, lk, cq0, cq1, ck0, ck1, bottom_right, right, left, LENS, VARLEN)
        row_ok = offs_m < Sq_b
        for hi_ in range(0, n_h):
            if DBIAS:  # the bias gradient is read back below where an earlier (batch, head) of this program stored
                tl.debug_barrier()  # it, by other threads: a barrier orders those stores before these loads
            h = h0 + hi_
            first = tl.where((bi == 0) & (hi_ == 0), 1, 0)  # the first (batch, head) stores, later ones add
            kvh = h // GROUP
            q_base = Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh + q_start.to(tl.int64) * stride_qm
            do_base = DO + b.to(tl.int64) * stride_dob + h.to(tl.int64) * stride_doh + q_start.to(tl.int64) * stride_dom
            q = tl.load(q_base + offs_m[:, None] * stride_qm + offs_dqk[None, :] * stride_qd,
                        mask=row_ok[:, None] & (offs_dqk[None, :] < D_QK), other=0.0)  # (BLOCK_M, BLOCK_DQK)
            do = tl.load(do_base + offs_m[:, None] * stride_dom + offs_dv[None, :] * stride_dod,
                         mask=row_ok[:, None] & (offs_dv[None, :] < D_V), other=0.0)  # (BLOCK_M, BLOCK_DV)
            dq = tl.zeros([BLOCK_M, BLOCK_DQK], dtype=ACC)
            q2, dq2, do2 = q, row_ok, do  # placeholders: second column pieces only when a head dim is split
            if BLOCK_DQK2 > 0:
                offs_dqk2 = BLOCK_DQK + tl.arange(0, BLOCK_DQK2)
                q2 = tl.load(q_base + offs_m[:, None] * stride_qm + offs_dqk2[None, :] * stride_qd,
                             mask=row_ok[:, None] & (offs_dqk2[None, :] < D_QK), other=0.0)  # (BLOCK_M, BLOCK_DQK2)
                dq2 = tl.zeros([BLOCK_M, BLOCK_DQK2], dtype=ACC)
            if BLOCK_DV2 > 0:
                offs_dv2 = BLOCK_DV + tl.arange(0, BLOCK_DV2)
                do2 = tl.load(do_base + offs_m[:, None] * stride_dom + offs_dv2[None, :] * stride_dod,
                              mask=row_ok[:, None] & (offs_dv2[None, :] < D_V), other=0.0)  # (BLOCK_M, BLOCK_DV2)
            row = b.to(tl.int64) * stride_lb + h.to(tl.int64) * stride_lh + q_start + offs_m
            m2 = tl.load(M2 + row, mask=row_ok, other=float("-inf"))
            m2 = tl.where(m2 == float("-inf"), float("inf"), m2)  # rows that see no key: P = exp2(s - inf) = 0
            inv_l = tl.exp2(-tl.load(L2 + row, mask=row_ok, other=0.0))  # 1 / row sum
            delta = tl.load(DELTA + row, mask=row_ok, other=0.0)
            softcap2, log2e, slope2, seed = modifier_scalars(b, h, AL, stride_alb, RNG, softcap_hi, softcap_lo,
                                                             log2e_hi, log2e_lo, ALIBI, DROPOUT, ACC)
            db_row = tl.zeros([BLOCK_M], dtype=ACC)  # the bias gradient summed over keys (DB_SUM_N)
            k_base = K + b.to(tl.int64) * stride_kb + kvh.to(tl.int64) * stride_kh + k_start.to(tl.int64) * stride_kn
            v_base = V + b.to(tl.int64) * stride_vb + kvh.to(tl.int64) * stride_vh + k_start.to(tl.int64) * stride_vn
            if TMA:  # descriptors of this sequence's rows: K (Sk_b, D_QK), V (Sk_b, D_V); one row at least
                k_base = tl.make_tensor_descriptor(k_base, shape=[tl.maximum(Sk_b, 1), D_QK], strides=[stride_kn, 1],
                                                   block_shape=[BLOCK_N, BLOCK_DQK])
                v_base = tl.make_tensor_descriptor(v_base, shape=[tl.maximum(Sk_b, 1), D_V], strides=[stride_vn, 1],
                                                   block_shape=[BLOCK_N, BLOCK_DV])
            km_base = KM + b.to(tl.int64) * stride_kmb
            mb_base = MB + b.to(tl.int64) * stride_mb + h.to(tl.int64) * stride_mh
            # this program's own tile of DB: indexed by (batch, head), or by group along a summed axis (n_b, n_h: 1
            # where not summed, so the group index is b, h itself)
            db_base = DB + gb.to(tl.int64) * stride_dbb + gh.to(tl.int64) * stride_dbh
            if DB_SUM_M:
                db_base += pid_m.to(tl.int64) * stride_dbm  # this q tile's partial row
            lo, full_lo, full_hi, hi = kv_loop_bounds(m0, Sq_b, Sk_b, causal_shift, window_shift, BLOCK_M, BLOCK_N,
                                                      CAUSAL, WINDOW, EVERY_TILE)
            for part in tl.static_range(3):  # masked head (window edge), unmasked, masked tail (causal diagonal, Sk_b)
                start, end = loop_part(part, lo, full_lo, full_hi, hi)
                dq, dq2, db_row = _dq_tiles(dq, dq2, db_row, q, q2, do, do2, m2, inv_l, delta, k_base, v_base, km_base,
                                            mb_base, db_base,
                                       first, offs_m, start, end, Sq_b, Sk_b, causal_shift, window_shift, qk_scale,
                                       stride_kn, stride_kd, stride_vn, stride_vd, stride_kmn, stride_mm, stride_mn,
                                       stride_dbm, stride_dbn, D_QK, D_V, softcap2, slope2, log2e, seed, b * H + h,
                                       Sq, Sk, dropout_p, drop_scale, BLOCK_N, BLOCK_DQK, BLOCK_DQK2, BLOCK_DV,
                                       BLOCK_DV2, part != 1, CAUSAL,
                                       WINDOW, KEY_MASK, MASK_KIND, SOFTCAP, ALIBI, DROPOUT, DBIAS, DB_SUM_M,
                                       DB_SUM_N, ACC, DOT_PREC, TMA)
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
            sm_scale = scalar_in(sm_scale_hi, sm_scale_lo, ACC)
            dq_base = DQ + b.to(tl.int64) * stride_dqb + h.to(tl.int64) * stride_dqh + q_start.to(tl.int64) * stride_dqm
            tl.store(dq_base + offs_m[:, None] * stride_dqm + offs_dqk[None, :] * stride_dqd,
                     (dq * sm_scale).to(DQ.dtype.element_ty),
                     mask=(offs_m[:, None] < Sq_mem) & (offs_dqk[None, :] < D_QK))
            if BLOCK_DQK2 > 0:
                offs_dqk2 = BLOCK_DQK + tl.arange(0, BLOCK_DQK2)
                tl.store(dq_base + offs_m[:, None] * stride_dqm + offs_dqk2[None, :] * stride_dqd,
                         (dq2 * sm_scale).to(DQ.dtype.element_ty),
                         mask=(offs_m[:, None] < Sq_mem) & (offs_dqk2[None, :] < D_QK))


# The host side lives in attention_bwd_launch.py (which imports the kernels above when it plans a launch);
# its names stay importable from here.
from .attention_bwd_launch import (DbiasReduce, GqaReduce, attention_backward, backward_entry,  # noqa: E402
                                   dbias_plan, gqa_partials, gqa_split_factor, plan_backward)

__all__ = ["DbiasReduce", "GqaReduce", "attention_backward", "backward_entry", "dbias_plan", "gqa_partials",
           "gqa_split_factor", "plan_backward"]
