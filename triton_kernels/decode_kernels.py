"""The decoding kernels: fused RoPE + append, a split-KV attention forward, and its combine (their configs, plans
and launchers: triton_kernels.decode).

Layouts (strides only, so flash-attn's (B, S, H, D) caches and flashtx.nn's (B, H, S, D) buffers
viewed as (B, S, H, D) run without copies):
- q (B, Sq, Hq, D); new k, v (B, Snew, Hkv, D|Dv); out (B, Sq, Hq, Dv).
- contiguous cache: (Bc, S_cache, Hkv, D); sequence b lives in cache row cache_batch_idx[b] (or b).
- paged cache (PAGED): (num_pages, PAGE, Hkv, D); logical position j of sequence b is row j % PAGE
  of page block_table[b, j // PAGE]. Every K/V row is addressed through its page (a gather of
  D-contiguous rows), so any page size works; flashtx asks for multiples of 16.

Positions are cache indices: sequence b's keys are [start_b, end_b) with start_b = cache_leftpad[b]
(0 without) and end_b = cache_seqlens[b] + SNEW (the tokens just appended: the attention reads the
lengths from before the append, so no device op adds them), or SNEW alone without lengths (LENS_ON off:
attention over a whole K/V tensor, flashtx._small_q). Queries are aligned bottom-right:
query i sits at position end_b - Sq + i, sees keys j <= end_b - Sq + i + right (causal: right = 0)
and j >= end_b - Sq + i - left (window), and ALiBi adds -slope * |end_b - Sq + i - j|, as flash-attn.

The forward packs a KV group: the M rows of a tile are (query i, head g) pairs r = i * GROUP + g of
the GROUP q heads sharing one K/V head, padded to BLOCK_M >= 16, so every K/V tile loaded feeds all
of them through one tl.dot. Program (split, kv head x M tile, batch) folds its split's share of the
visible key tiles into an online softmax; with one split it writes out/lse directly, otherwise
fp32 partials that `_decode_combine` merges by their log-sum-exp. Scores are in log2 units (see
attention_common); rows that see no key give 0 and lse -inf. Index guards: the index check (decode_check.py) refuses
out-of-range lengths, rows, pages and table rows before these kernels run; where it did not run (flashtx.nn's
sealed caches) the kernels still touch nothing outside their tensors: lengths are clamped to the capacity, rows and
pages out of range are neither read nor written, table rows out of range rotate by nothing.
With DOT_HALVES (fp32 inputs, 32- and 64-wide
heads: plan_decode) a score is the sum of two half-D dots, two short rounding chains instead of one long one.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .attention_common import scalar_in, tanh


@triton.jit
def _cache_rows(pos, page, cb, stride_cb, stride_cn, PAGE, PAGED: tl.constexpr):
    """int64 offsets of logical positions `pos` of a sequence in a cache: paged, in the pages `page` (its
    block_table entries at pos // PAGE, loaded by the caller: torch.compile's analysis of a traced kernel counts
    a pointer passed to a helper whose result addresses a store as written, so block_table would be a mutated
    input); else in cache row cb."""
    if PAGED:
        return page.to(tl.int64) * stride_cb + (pos % PAGE).to(tl.int64) * stride_cn
    else:
        return cb * stride_cb + pos.to(tl.int64) * stride_cn


@triton.jit
def _rope_copy(x_ptrs_h, o_ptrs_h, stride_xd, stride_od, ok, c, s, D, R2, BLOCK_D: tl.constexpr,
               BLOCK_R2: tl.constexpr, ROTARY: tl.constexpr, INTERLEAVED: tl.constexpr, ACC: tl.constexpr):
    """Copy rows (H, D) from x to o, rotating the first 2 * R2 columns by (c, s) when ROTARY.

    x_ptrs_h/o_ptrs_h: (BLOCK_H, 1) row pointers; ok: (BLOCK_H, 1) rows to touch; c, s: (1, BLOCK_R2).
    """
    lo = 0
    if ROTARY:
        j = tl.arange(0, BLOCK_R2)[None, :]
        if INTERLEAVED:  # GPT-J pairs (x[2j], x[2j + 1])
            i1 = 2 * j
            i2 = 2 * j + 1
        else:  # NeoX halves (x[j], x[j + R2])
            i1 = j
            i2 = j + R2
        m = ok & (j < R2)
        i1, i2 = i1.to(tl.int64), i2.to(tl.int64)  # column x stride can pass int32 (a D-major cache)
        x1 = tl.load(x_ptrs_h + i1 * stride_xd, mask=m, other=0.0).to(ACC)
        x2 = tl.load(x_ptrs_h + i2 * stride_xd, mask=m, other=0.0).to(ACC)
        tl.store(o_ptrs_h + i1 * stride_od, (x1 * c - x2 * s).to(o_ptrs_h.dtype.element_ty), mask=m)
        tl.store(o_ptrs_h + i2 * stride_od, (x1 * s + x2 * c).to(o_ptrs_h.dtype.element_ty), mask=m)
        lo = 2 * R2
    d = tl.arange(0, BLOCK_D)[None, :]
    m = ok & (d >= lo) & (d < D)  # columns past the rotary part are copied
    x = tl.load(x_ptrs_h + d.to(tl.int64) * stride_xd, mask=m, other=0.0)
    tl.store(o_ptrs_h + d.to(tl.int64) * stride_od, x.to(o_ptrs_h.dtype.element_ty), mask=m)


@triton.jit
def _kv_append(Q, QO, KN, VN, KC, VC, COS, SIN, SEQLENS, BIDX, BT,
               stride_qb, stride_qm, stride_qh, stride_qd, stride_qob, stride_qom, stride_qoh, stride_qod,
               stride_knb, stride_knm, stride_knh, stride_knd, stride_vnb, stride_vnm, stride_vnh, stride_vnd,
               stride_kcb, stride_kcn, stride_kch, stride_kcd, stride_vcb, stride_vcn, stride_vch, stride_vcd,
               stride_cos, stride_sin, stride_btb,
               Sq, Snew, Hq, Hkv, D, DV, R2, PAGE, CAPACITY, ROWS, COS_ROWS,
               BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
               BLOCK_R2: tl.constexpr, ROTARY: tl.constexpr, INTERLEAVED: tl.constexpr, Q_SAME_POS: tl.constexpr,
               HAS_KV: tl.constexpr, PAGED: tl.constexpr, BATCH_IDX: tl.constexpr, ACC: tl.constexpr):
    """Program (t, b): token t of sequence b. Writes k[b, t] (rotated) and v[b, t] into the cache at
    position cache_seqlens[b] + t, and q[b, t] rotated (position cache_seqlens[b] + t, or + 0 with
    Q_SAME_POS) into QO, for every head at once.

    Guards (the index check normally refuses such calls first; these keep every access inside its tensor when it
    did not run, e.g. flashtx.nn's sealed caches): a row is written only at a position in [0, CAPACITY) of a cache
    row (or page) in [0, ROWS); table rows outside [0, COS_ROWS) read as the identity rotation."""
    t = tl.program_id(0)
    b = tl.program_id(1)
    base = tl.load(SEQLENS + b).to(tl.int32)
    j = tl.arange(0, BLOCK_R2)[None, :]
    if ROTARY:
        q_pos = base + t
        if Q_SAME_POS:
            q_pos = base
        cm = (j < R2) & (j * 0 + t < Sq) & (j * 0 + q_pos >= 0) & (j * 0 + q_pos < COS_ROWS)  # (scalar & block
        # masks trip the interpreter: keep them blocks)
        cq = tl.load(COS + q_pos.to(tl.int64) * stride_cos + j, mask=cm, other=1.0).to(ACC)
        sq = tl.load(SIN + q_pos.to(tl.int64) * stride_sin + j, mask=cm, other=0.0).to(ACC)
        hq = tl.arange(0, BLOCK_HQ)[:, None]
        hq64 = hq.to(tl.int64)  # (BLOCK_HQ, 1): head x stride can pass int32
        _rope_copy(Q + b.to(tl.int64) * stride_qb + t.to(tl.int64) * stride_qm + hq64 * stride_qh,
                   QO + b.to(tl.int64) * stride_qob + t.to(tl.int64) * stride_qom + hq64 * stride_qoh,
                   stride_qd, stride_qod, (hq < Hq) & (hq * 0 + t < Sq), cq, sq, D, R2, BLOCK_D, BLOCK_R2, ROTARY,
                   INTERLEAVED, ACC)
    if HAS_KV:
        hk = tl.arange(0, BLOCK_HKV)[:, None]
        hk64 = hk.to(tl.int64)  # (BLOCK_HKV, 1): head x stride can pass int32 (a (B, Hkv, S, D) cache)
        pos = hk * 0 + base + t  # (BLOCK_HKV, 1): every head's row is at the same position
        ok = (hk < Hkv) & (pos - base < Snew) & (pos >= 0) & (pos < CAPACITY)
        cb = b.to(tl.int64)
        if BATCH_IDX:
            cb = tl.load(BIDX + b).to(tl.int64)
            cbv = hk.to(tl.int64) * 0 + cb  # (a block: scalar & block masks trip the interpreter)
            ok = ok & (cbv >= 0) & (cbv < ROWS)
        page = pos  # block_table entries of the positions (paged only)
        if PAGED:
            page = tl.load(BT + b.to(tl.int64) * stride_btb + pos // PAGE, mask=ok, other=0)
            ok = ok & (page >= 0) & (page < ROWS)
        row = _cache_rows(pos, page, cb, stride_kcb, stride_kcn, PAGE, PAGED)
        vrow = _cache_rows(pos, page, cb, stride_vcb, stride_vcn, PAGE, PAGED)
        ck = j.to(ACC) * 0.0 + 1.0
        sk = j.to(ACC) * 0.0
        if ROTARY:
            cm = (j < R2) & (j * 0 + t < Snew) & (j * 0 + base + t >= 0) & (j * 0 + base + t < COS_ROWS)
            ck = tl.load(COS + (base + t).to(tl.int64) * stride_cos + j, mask=cm, other=1.0).to(ACC)
            sk = tl.load(SIN + (base + t).to(tl.int64) * stride_sin + j, mask=cm, other=0.0).to(ACC)
        _rope_copy(KN + b.to(tl.int64) * stride_knb + t.to(tl.int64) * stride_knm + hk64 * stride_knh,
                   KC + row + hk64 * stride_kch, stride_knd, stride_kcd, ok, ck, sk, D, R2,
                   BLOCK_D, BLOCK_R2, ROTARY, INTERLEAVED, ACC)
        _rope_copy(VN + b.to(tl.int64) * stride_vnb + t.to(tl.int64) * stride_vnm + hk64 * stride_vnh,
                   VC + vrow + hk64 * stride_vch, stride_vnd, stride_vcd, ok, ck, sk, DV, R2,
                   BLOCK_DV, BLOCK_R2, False, INTERLEAVED, ACC)


@triton.jit
def _decode_fwd(Q, KC, VC, O, LSE, SEQLENS, LEFTPAD, BIDX, BT, AL, KM,
                stride_qb, stride_qm, stride_qh, stride_qd,
                stride_kb, stride_kn, stride_kh, stride_kd,
                stride_vb, stride_vn, stride_vh, stride_vd,
                stride_os, stride_ob, stride_om, stride_oh, stride_od,
                stride_ls, stride_lb, stride_lh, stride_lm, stride_btb, stride_alb, stride_kmb, stride_kmm, stride_kmn,
                Sq, SNEW, GROUP, M_TILES, NUM_SPLITS, D, DV, PAGE, CAPACITY, ROWS, right, left, qk_scale_hi,
                qk_scale_lo,
                softcap_hi, softcap_lo, log2e_hi, log2e_lo,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                CAUSAL: tl.constexpr, WINDOW: tl.constexpr, LEFTPAD_ON: tl.constexpr, PAGED: tl.constexpr,
                BATCH_IDX: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, ACC: tl.constexpr,
                DOT_PREC: tl.constexpr, LENS_ON: tl.constexpr = True, KEY_MASK: tl.constexpr = False,
                QUERY_MASK: tl.constexpr = False, DOT_HALVES: tl.constexpr = False):
    pid_s = tl.program_id(0)
    kvh = tl.program_id(1) // M_TILES
    mt = tl.program_id(1) % M_TILES
    b = tl.program_id(2)
    end = SNEW + b * 0  # keys [start, end) of this sequence: without lengths, the first SNEW of the cache
    if LENS_ON:  # (guards, as _kv_append's: the keys end within the cache, in a cache row that exists; pages below)
        end = tl.minimum(tl.load(SEQLENS + b).to(tl.int32) + SNEW, CAPACITY)
    start = end * 0
    if LEFTPAD_ON:
        start = tl.load(LEFTPAD + b).to(tl.int32)
    cb = b.to(tl.int64)
    if BATCH_IDX:
        cb = tl.load(BIDX + b).to(tl.int64)
        end = tl.where((cb >= 0) & (cb < ROWS), end, 0)
    shift = end - Sq  # query i sits at position shift + i (bottom-right)

    offs_r = mt * BLOCK_M + tl.arange(0, BLOCK_M)  # rows (query i, head g) of the KV group
    i = offs_r // GROUP
    h = kvh * GROUP + offs_r % GROUP  # (BLOCK_M,) q head of each row
    row_ok = offs_r < GROUP * Sq
    offs_d = tl.arange(0, BLOCK_D // 2 if DOT_HALVES else BLOCK_D)  # q's and K's columns (of each half)
    offs_dv = tl.arange(0, BLOCK_DV)
    q_rows = (Q + b.to(tl.int64) * stride_qb + i[:, None].to(tl.int64) * stride_qm
              + h[:, None].to(tl.int64) * stride_qh)
    q = tl.load(q_rows + offs_d[None, :].to(tl.int64) * stride_qd, mask=row_ok[:, None] & (offs_d[None, :] < D),
                other=0.0)  # (M, D), or its first half
    q_hi = q  # (DOT_HALVES: its second half)
    if DOT_HALVES:
        d_hi = offs_d + BLOCK_D // 2
        q_hi = tl.load(q_rows + d_hi[None, :].to(tl.int64) * stride_qd, mask=row_ok[:, None] & (d_hi[None, :] < D),
                       other=0.0)
    qk_scale = scalar_in(qk_scale_hi, qk_scale_lo, ACC)
    log2e = scalar_in(log2e_hi, log2e_lo, ACC)
    softcap2 = scalar_in(softcap_hi, softcap_lo, ACC)
    slope2 = tl.zeros([BLOCK_M], dtype=ACC)
    if ALIBI:
        slope2 = tl.load(AL + b.to(tl.int64) * stride_alb + h, mask=row_ok, other=0.0).to(ACC) * log2e

    # the keys any row of this tile may see, then this split's share of whole BLOCK_N tiles
    i_first = (mt * BLOCK_M) // GROUP
    i_last = tl.minimum((mt * BLOCK_M + BLOCK_M - 1) // GROUP, Sq - 1)
    lo = start
    hi = end
    if CAUSAL:
        hi = tl.minimum(hi, shift + i_last + right + 1)
    if WINDOW:
        lo = tl.maximum(lo, shift + i_first - left)
    lo = tl.maximum(lo, 0)
    hi = tl.maximum(hi, lo)
    lo_tile = (lo // BLOCK_N) * BLOCK_N
    per_split = tl.cdiv(tl.cdiv(hi - lo_tile, BLOCK_N), NUM_SPLITS) * BLOCK_N
    s_lo = lo_tile + pid_s * per_split
    s_hi = tl.minimum(hi, s_lo + per_split)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=ACC)
    l_i = tl.zeros([BLOCK_M], dtype=ACC)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=ACC)
    for n0 in range(s_lo, s_hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = (offs_n >= lo) & (offs_n < hi)  # never read outside [start, end): pages there may be unset
        page = offs_n  # block_table entries of the keys (paged only)
        if PAGED:
            page = tl.load(BT + b.to(tl.int64) * stride_btb + offs_n // PAGE, mask=n_ok, other=0)
            # a page out of range reads the last page instead (in bounds; such a state's answer is unspecified): a mask
            # on the loaded page would change the loads' pipelining and vector width (compile check, sm_90)
            # (one unsigned min: -1 -> the last; tl.cast, not .to: a pool of one page makes ROWS - 1 a Python int, as
            # Triton compiles an int argument of 1 as a constant)
            page = tl.minimum(page.to(tl.uint32), tl.cast(ROWS - 1, tl.uint32))
        krow = _cache_rows(offs_n, page, cb, stride_kb, stride_kn, PAGE, PAGED)
        vrow = _cache_rows(offs_n, page, cb, stride_vb, stride_vn, PAGE, PAGED)
        # int64 columns (a D-major cache's column x stride passes int32), hoisted by the compiler: the same loop and
        # registers as int32 ones (an int64 (D, 1) vector formed before the loop kept up to 44 more registers live)
        k_cols = KC + krow[None, :] + kvh.to(tl.int64) * stride_kh
        kt = tl.load(k_cols + offs_d[:, None].to(tl.int64) * stride_kd, mask=n_ok[None, :] & (offs_d[:, None] < D),
                     other=0.0)  # (D, N), or its first half
        v = tl.load(VC + vrow[:, None] + kvh.to(tl.int64) * stride_vh + offs_dv[None, :].to(tl.int64) * stride_vd,
                    mask=n_ok[:, None] & (offs_dv[None, :] < DV), other=0.0)  # (N, Dv)
        s = tl.dot(q, kt, out_dtype=ACC, input_precision=DOT_PREC) * qk_scale  # (M, N), log2 units
        if DOT_HALVES:  # q.k as two independent half-D sums (fp32/fp64 inputs: see plan_decode). Each half is scaled
            # before the add: Triton folds dot(a, b) + dot(c, d) into one chained accumulation, the long sum again
            kt_hi = tl.load(k_cols + d_hi[:, None].to(tl.int64) * stride_kd,
                            mask=n_ok[None, :] & (d_hi[:, None] < D), other=0.0)
            s = s + tl.dot(q_hi, kt_hi, out_dtype=ACC, input_precision=DOT_PREC) * qk_scale
        if SOFTCAP:
            s = softcap2 * tanh(s / softcap2)
        qpos = shift + i[:, None]
        if ALIBI:
            s = s - slope2[:, None] * tl.abs(qpos - offs_n[None, :]).to(ACC)
        vis = row_ok[:, None] & n_ok[None, :]
        if KEY_MASK:  # (B, Sq | 1, capacity) uint8, nonzero = visible (flashtx._small_q's key_mask). The scores only:
            # K/V of padding keys are in bounds, and loads whose masks waited on this one would not pipeline
            km = KM + b.to(tl.int64) * stride_kmb
            if QUERY_MASK:  # a row per query (a bool attn_mask over queries and keys: speculative decoding's)
                seen = tl.load(km + i[:, None].to(tl.int64) * stride_kmm + offs_n[None, :].to(tl.int64) * stride_kmn,
                               mask=row_ok[:, None] & n_ok[None, :], other=0)  # (M, N)
                vis = vis & (seen != 0)
            else:  # one row for every query
                real = tl.load(km + offs_n.to(tl.int64) * stride_kmn, mask=n_ok, other=0)
                vis = vis & (real != 0)[None, :]
        if CAUSAL:
            vis = vis & (offs_n[None, :] <= qpos + right)
        if WINDOW:
            vis = vis & (offs_n[None, :] >= qpos - left)
        s = tl.where(vis, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing visible yet: subtract 0, not -inf
        p = tl.exp2(s - m_ref[:, None])
        alpha = tl.exp2(m_i - m_ref)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, out_dtype=ACC, input_precision=DOT_PREC)
        m_i = m_new

    empty = (l_i == 0.0) | (offs_r >= GROUP * Sq)
    o = tl.where(empty[:, None], 0.0, acc / tl.where(empty, 1.0, l_i)[:, None])
    lse = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
    o_ptr = (O + pid_s.to(tl.int64) * stride_os + b.to(tl.int64) * stride_ob + i[:, None].to(tl.int64) * stride_om
             + h[:, None].to(tl.int64) * stride_oh + offs_dv[None, :] * stride_od)
    tl.store(o_ptr, o.to(O.dtype.element_ty), mask=row_ok[:, None] & (offs_dv[None, :] < DV))
    tl.store(LSE + pid_s.to(tl.int64) * stride_ls + b.to(tl.int64) * stride_lb + h.to(tl.int64) * stride_lh
             + i * stride_lm, lse, mask=row_ok)


@triton.jit
def _decode_combine(OP, LP, O, LSE, stride_ps, stride_pb, stride_pm, stride_ph, stride_pd,
                    stride_lps, stride_lpb, stride_lph, stride_lpm,
                    stride_ob, stride_om, stride_oh, stride_od, stride_lb, stride_lh, stride_lm,
                    Sq, DV, NUM_SPLITS, BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_DV: tl.constexpr,
                    ACC: tl.constexpr):
    """Program (row tile, q head, batch): out = sum_s 2^(lse_s - lse) o_s, lse = log2 sum_s 2^lse_s. The splits are
    read BLOCK_S at a time, as one (BLOCK_R, BLOCK_S, BLOCK_DV) tile: every split's loads of a chunk are in flight at
    once (a loop over single splits waits out one load latency per split, 30 at batch 1; flash-attn's combine reads
    all of its splits' LSEs first too)."""
    h = tl.program_id(1)
    b = tl.program_id(2)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_dv = tl.arange(0, BLOCK_DV)
    offs_s = tl.arange(0, BLOCK_S)
    r_ok = rows < Sq
    m = tl.full([BLOCK_R], float("-inf"), dtype=ACC)
    l = tl.zeros([BLOCK_R], dtype=ACC)
    acc = tl.zeros([BLOCK_R, BLOCK_DV], dtype=ACC)
    b64, h64 = b.to(tl.int64), h.to(tl.int64)  # the partials span splits x B x Sq x Hq x Dv: past int32
    r64 = rows.to(tl.int64)  # (BLOCK_R,): and one split's Sq x Hq x Dv too
    lp_rows = LP + b64 * stride_lpb + h64 * stride_lph + r64[:, None] * stride_lpm  # (BLOCK_R, 1)
    op_rows = (OP + b64 * stride_pb + h64 * stride_ph + r64[:, None, None] * stride_pm
               + offs_dv[None, None, :] * stride_pd)  # (BLOCK_R, 1, BLOCK_DV)
    dv_ok = offs_dv[None, None, :] < DV
    for s0 in range(0, NUM_SPLITS, BLOCK_S):
        split = s0 + offs_s  # (BLOCK_S,)
        s_ok = split < NUM_SPLITS
        s64 = split.to(tl.int64)
        lse_s = tl.load(lp_rows + s64[None, :] * stride_lps, mask=r_ok[:, None] & s_ok[None, :],
                        other=float("-inf")).to(ACC)  # (BLOCK_R, BLOCK_S)
        o_s = tl.load(op_rows + s64[None, :, None] * stride_ps, mask=r_ok[:, None, None] & s_ok[None, :, None] & dv_ok,
                      other=0.0).to(ACC)  # (BLOCK_R, BLOCK_S, BLOCK_DV)
        m_new = tl.maximum(m, tl.max(lse_s, 1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing seen yet: subtract 0, not -inf
        alpha = tl.exp2(m - m_ref)
        w = tl.exp2(lse_s - m_ref[:, None])  # (BLOCK_R, BLOCK_S): 0 for splits that saw no key (lse -inf)
        l = l * alpha + tl.sum(w, 1)
        acc = acc * alpha[:, None] + tl.sum(w[:, :, None] * o_s, 1)
        m = m_new
    empty = l == 0.0
    o = tl.where(empty[:, None], 0.0, acc / tl.where(empty, 1.0, l)[:, None])
    lse = tl.where(empty, float("-inf"), m + tl.log2(tl.where(empty, 1.0, l)))
    tl.store(O + b64 * stride_ob + r64[:, None] * stride_om + h64 * stride_oh
             + offs_dv[None, :] * stride_od, o.to(O.dtype.element_ty), mask=r_ok[:, None] & (offs_dv[None, :] < DV))
    tl.store(LSE + b64 * stride_lb + h64 * stride_lh + r64 * stride_lm, lse, mask=r_ok)


__all__ = ["_kv_append", "_decode_fwd", "_decode_combine"]
