"""Decoding against a KV cache: fused RoPE + append, a split-KV attention forward, and its combine.

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
attention_common); rows that see no key give 0 and lse -inf.
"""
from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from .attention_common import scalar_in, tanh
from .configs import INTERPRETER_TARGET, KNOWN_TARGETS, ElementwiseConfig, Target, head_dim_bucket
from .launch import (ACC_DTYPE, LAUNCHES, LOG2E, TORCH_ACC_DTYPE, Launch, cdiv, dot_precision, head_block, split_f32,
                     target_for)


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
        x1 = tl.load(x_ptrs_h + i1 * stride_xd, mask=m, other=0.0).to(ACC)
        x2 = tl.load(x_ptrs_h + i2 * stride_xd, mask=m, other=0.0).to(ACC)
        tl.store(o_ptrs_h + i1 * stride_od, (x1 * c - x2 * s).to(o_ptrs_h.dtype.element_ty), mask=m)
        tl.store(o_ptrs_h + i2 * stride_od, (x1 * s + x2 * c).to(o_ptrs_h.dtype.element_ty), mask=m)
        lo = 2 * R2
    d = tl.arange(0, BLOCK_D)[None, :]
    m = ok & (d >= lo) & (d < D)  # columns past the rotary part are copied
    x = tl.load(x_ptrs_h + d * stride_xd, mask=m, other=0.0)
    tl.store(o_ptrs_h + d * stride_od, x.to(o_ptrs_h.dtype.element_ty), mask=m)


@triton.jit
def _kv_append(Q, QO, KN, VN, KC, VC, COS, SIN, SEQLENS, BIDX, BT,
               stride_qb, stride_qm, stride_qh, stride_qd, stride_qob, stride_qom, stride_qoh, stride_qod,
               stride_knb, stride_knm, stride_knh, stride_knd, stride_vnb, stride_vnm, stride_vnh, stride_vnd,
               stride_kcb, stride_kcn, stride_kch, stride_kcd, stride_vcb, stride_vcn, stride_vch, stride_vcd,
               stride_cos, stride_sin, stride_btb,
               Sq, Snew, Hq, Hkv, D, DV, R2, PAGE,
               BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
               BLOCK_R2: tl.constexpr, ROTARY: tl.constexpr, INTERLEAVED: tl.constexpr, Q_SAME_POS: tl.constexpr,
               HAS_KV: tl.constexpr, PAGED: tl.constexpr, BATCH_IDX: tl.constexpr, ACC: tl.constexpr):
    """Program (t, b): token t of sequence b. Writes k[b, t] (rotated) and v[b, t] into the cache at
    position cache_seqlens[b] + t, and q[b, t] rotated (position cache_seqlens[b] + t, or + 0 with
    Q_SAME_POS) into QO, for every head at once."""
    t = tl.program_id(0)
    b = tl.program_id(1)
    base = tl.load(SEQLENS + b).to(tl.int32)
    j = tl.arange(0, BLOCK_R2)[None, :]
    if ROTARY:
        q_pos = base + t
        if Q_SAME_POS:
            q_pos = base
        cm = (j < R2) & (j * 0 + t < Sq)  # (scalar & block masks trip the interpreter: keep them blocks)
        cq = tl.load(COS + q_pos.to(tl.int64) * stride_cos + j, mask=cm, other=1.0).to(ACC)
        sq = tl.load(SIN + q_pos.to(tl.int64) * stride_sin + j, mask=cm, other=0.0).to(ACC)
        hq = tl.arange(0, BLOCK_HQ)[:, None]
        _rope_copy(Q + b.to(tl.int64) * stride_qb + t * stride_qm + hq * stride_qh,
                   QO + b.to(tl.int64) * stride_qob + t * stride_qom + hq * stride_qoh, stride_qd, stride_qod,
                   (hq < Hq) & (hq * 0 + t < Sq), cq, sq, D, R2, BLOCK_D, BLOCK_R2, ROTARY, INTERLEAVED, ACC)
    if HAS_KV:
        hk = tl.arange(0, BLOCK_HKV)[:, None]
        pos = hk * 0 + base + t  # (BLOCK_HKV, 1): every head's row is at the same position
        ok = (hk < Hkv) & (pos - base < Snew)
        cb = b.to(tl.int64)
        if BATCH_IDX:
            cb = tl.load(BIDX + b).to(tl.int64)
        page = pos  # block_table entries of the positions (paged only)
        if PAGED:
            page = tl.load(BT + b.to(tl.int64) * stride_btb + pos // PAGE, mask=ok, other=0)
        row = _cache_rows(pos, page, cb, stride_kcb, stride_kcn, PAGE, PAGED)
        vrow = _cache_rows(pos, page, cb, stride_vcb, stride_vcn, PAGE, PAGED)
        ck = j.to(ACC) * 0.0 + 1.0
        sk = j.to(ACC) * 0.0
        if ROTARY:
            cm = (j < R2) & (j * 0 + t < Snew)
            ck = tl.load(COS + (base + t).to(tl.int64) * stride_cos + j, mask=cm, other=1.0).to(ACC)
            sk = tl.load(SIN + (base + t).to(tl.int64) * stride_sin + j, mask=cm, other=0.0).to(ACC)
        _rope_copy(KN + b.to(tl.int64) * stride_knb + t * stride_knm + hk * stride_knh,
                   KC + row + hk * stride_kch, stride_knd, stride_kcd, ok, ck, sk, D, R2,
                   BLOCK_D, BLOCK_R2, ROTARY, INTERLEAVED, ACC)
        _rope_copy(VN + b.to(tl.int64) * stride_vnb + t * stride_vnm + hk * stride_vnh,
                   VC + vrow + hk * stride_vch, stride_vnd, stride_vcd, ok, ck, sk, DV, R2,
                   BLOCK_DV, BLOCK_R2, False, INTERLEAVED, ACC)


@triton.jit
def _decode_fwd(Q, KC, VC, O, LSE, SEQLENS, LEFTPAD, BIDX, BT, AL, KM,
                stride_qb, stride_qm, stride_qh, stride_qd,
                stride_kb, stride_kn, stride_kh, stride_kd,
                stride_vb, stride_vn, stride_vh, stride_vd,
                stride_os, stride_ob, stride_om, stride_oh, stride_od,
                stride_ls, stride_lb, stride_lh, stride_lm, stride_btb, stride_alb, stride_kmb, stride_kmm, stride_kmn,
                Sq, SNEW, GROUP, M_TILES, NUM_SPLITS, D, DV, PAGE, right, left, qk_scale_hi, qk_scale_lo,
                softcap_hi, softcap_lo, log2e_hi, log2e_lo,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                CAUSAL: tl.constexpr, WINDOW: tl.constexpr, LEFTPAD_ON: tl.constexpr, PAGED: tl.constexpr,
                BATCH_IDX: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, ACC: tl.constexpr,
                DOT_PREC: tl.constexpr, LENS_ON: tl.constexpr = True, KEY_MASK: tl.constexpr = False,
                QUERY_MASK: tl.constexpr = False):
    pid_s = tl.program_id(0)
    kvh = tl.program_id(1) // M_TILES
    mt = tl.program_id(1) % M_TILES
    b = tl.program_id(2)
    end = SNEW + b * 0  # keys [start, end) of this sequence: without lengths, the first SNEW of the cache
    if LENS_ON:
        end = tl.load(SEQLENS + b).to(tl.int32) + SNEW
    start = end * 0
    if LEFTPAD_ON:
        start = tl.load(LEFTPAD + b).to(tl.int32)
    cb = b.to(tl.int64)
    if BATCH_IDX:
        cb = tl.load(BIDX + b).to(tl.int64)
    shift = end - Sq  # query i sits at position shift + i (bottom-right)

    offs_r = mt * BLOCK_M + tl.arange(0, BLOCK_M)  # rows (query i, head g) of the KV group
    i = offs_r // GROUP
    h = kvh * GROUP + offs_r % GROUP  # (BLOCK_M,) q head of each row
    row_ok = offs_r < GROUP * Sq
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q = tl.load(Q + b.to(tl.int64) * stride_qb + i[:, None] * stride_qm + h[:, None].to(tl.int64) * stride_qh
                + offs_d[None, :] * stride_qd, mask=row_ok[:, None] & (offs_d[None, :] < D), other=0.0)  # (M, D)
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
        krow = _cache_rows(offs_n, page, cb, stride_kb, stride_kn, PAGE, PAGED)
        vrow = _cache_rows(offs_n, page, cb, stride_vb, stride_vn, PAGE, PAGED)
        kt = tl.load(KC + krow[None, :] + kvh.to(tl.int64) * stride_kh + offs_d[:, None] * stride_kd,
                     mask=n_ok[None, :] & (offs_d[:, None] < D), other=0.0)  # (D, N)
        v = tl.load(VC + vrow[:, None] + kvh.to(tl.int64) * stride_vh + offs_dv[None, :] * stride_vd,
                    mask=n_ok[:, None] & (offs_dv[None, :] < DV), other=0.0)  # (N, Dv)
        s = tl.dot(q, kt, out_dtype=ACC, input_precision=DOT_PREC) * qk_scale  # (M, N), log2 units
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
    o_ptr = (O + pid_s.to(tl.int64) * stride_os + b.to(tl.int64) * stride_ob + i[:, None] * stride_om
             + h[:, None].to(tl.int64) * stride_oh + offs_dv[None, :] * stride_od)
    tl.store(o_ptr, o.to(O.dtype.element_ty), mask=row_ok[:, None] & (offs_dv[None, :] < DV))
    tl.store(LSE + pid_s.to(tl.int64) * stride_ls + b.to(tl.int64) * stride_lb + h.to(tl.int64) * stride_lh
             + i * stride_lm, lse, mask=row_ok)


@triton.jit
def _decode_combine(OP, LP, O, LSE, stride_ps, stride_pb, stride_pm, stride_ph, stride_pd,
                    stride_lps, stride_lpb, stride_lph, stride_lpm,
                    stride_ob, stride_om, stride_oh, stride_od, stride_lb, stride_lh, stride_lm,
                    Sq, DV, NUM_SPLITS, BLOCK_R: tl.constexpr, BLOCK_DV: tl.constexpr, ACC: tl.constexpr):
    """Program (row tile, q head, batch): out = sum_s 2^(lse_s - lse) o_s, lse = log2 sum_s 2^lse_s."""
    h = tl.program_id(1)
    b = tl.program_id(2)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_dv = tl.arange(0, BLOCK_DV)
    r_ok = rows < Sq
    m = tl.full([BLOCK_R], float("-inf"), dtype=ACC)
    l = tl.zeros([BLOCK_R], dtype=ACC)
    acc = tl.zeros([BLOCK_R, BLOCK_DV], dtype=ACC)
    b64, h64 = b.to(tl.int64), h.to(tl.int64)  # the partials span splits x B x Sq x Hq x Dv: past int32
    for s in range(0, NUM_SPLITS):
        s64 = tl.full([], s, tl.int64)
        lse_s = tl.load(LP + s64 * stride_lps + b64 * stride_lpb + h64 * stride_lph + rows * stride_lpm, mask=r_ok,
                        other=float("-inf")).to(ACC)
        o_s = tl.load(OP + s64 * stride_ps + b64 * stride_pb + rows[:, None] * stride_pm + h64 * stride_ph
                      + offs_dv[None, :] * stride_pd, mask=r_ok[:, None] & (offs_dv[None, :] < DV),
                      other=0.0).to(ACC)
        m_new = tl.maximum(m, lse_s)
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_ref)
        w = tl.exp2(lse_s - m_ref)
        l = l * alpha + w
        acc = acc * alpha[:, None] + w[:, None] * o_s
        m = m_new
    empty = l == 0.0
    o = tl.where(empty[:, None], 0.0, acc / tl.where(empty, 1.0, l)[:, None])
    lse = tl.where(empty, float("-inf"), m + tl.log2(tl.where(empty, 1.0, l)))
    tl.store(O + b64 * stride_ob + rows[:, None] * stride_om + h64 * stride_oh
             + offs_dv[None, :] * stride_od, o.to(O.dtype.element_ty), mask=r_ok[:, None] & (offs_dv[None, :] < DV))
    tl.store(LSE + b64 * stride_lb + h64 * stride_lh + rows * stride_lm, lse, mask=r_ok)


# ------------------------------------------------------------------------------------------- host side
@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    block_n: int  # keys per tile
    max_block_m: int  # rows (query x head pairs) per tile, at most
    num_warps: int
    num_stages: int
    reason: str = ""

    @property
    def launch_kwargs(self) -> dict:
        return {"num_warps": self.num_warps, "num_stages": self.num_stages}


# Per element size and head-dim bucket. Decoding is bandwidth-bound: K/V tiles of 64 rows (16 KB
# each at D = 128 in fp16) in flight, a 16..64-row q tile. Checked by the compile check (no spills,
# shared memory within sm_86's limit); not yet timed on a GPU.
_DECODE = {
    2: {64: DecodeConfig(64, 64, 4, 3, "K+V tiles 16 KB a stage"),
        128: DecodeConfig(64, 64, 4, 2, "K+V tiles 32 KB a stage"),
        256: DecodeConfig(32, 32, 4, 2, "K+V tiles 32 KB a stage")},
    4: {64: DecodeConfig(32, 32, 4, 2, "fp32: half the rows of fp16"),
        128: DecodeConfig(16, 16, 8, 2, "fp32 at D = 128: 32-key tiles spilled on sm_86/90; 4 warps spilled"
                            " without lengths or with a key mask, as 8 warps at 1 stage on Triton 3.6"),
        256: DecodeConfig(16, 16, 4, 1, "fp32 at D = 256")},
}
# Interpreter: 16-key tiles so test caches span many tiles, splits and pages.
_DECODE_INTERPRETER = DecodeConfig(16, 32, 1, 1, "interpreter")
MAX_SPLITS = 128


def decode_config(d: int, dv: int, elt: int, target: Target) -> DecodeConfig:
    if target is INTERPRETER_TARGET:
        return _DECODE_INTERPRETER
    return _DECODE[2 if elt <= 2 else 4][head_dim_bucket(max(d, dv))]


def _pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def num_splits_heuristic(programs: int, key_tiles: int, sms: int, max_splits: int = MAX_SPLITS) -> int:
    """flash-attn's rule: with too few (batch x kv head x M tile) programs to fill the GPU, split the
    keys; among split counts up to the tiles available, take the smallest whose wave efficiency
    (programs / (waves x SMs)) is within 85% of the best."""
    if programs >= 0.8 * sms or key_tiles <= 1:
        return 1
    max_splits = min(max_splits, sms, key_tiles)
    eff = []
    for s in range(1, max_splits + 1):
        waves = (programs * s + sms - 1) // sms
        eff.append(programs * s / (waves * sms))
    best = max(eff)
    return next(s for s, e in enumerate(eff, 1) if e >= 0.85 * best)


def split_count(q, k_cache, v_cache, block_table, num_splits: int, target: Target) -> int:
    """Key-range splits per sequence: num_splits clamped to the key tiles (at most MAX_SPLITS), or for 0
    flash-attn's heuristic (num_splits_heuristic) for the target's SM count (4 in the interpreter)."""
    B, Sq, Hq, D = q.shape
    Hkv, DV = k_cache.shape[2], v_cache.shape[3]
    cfg = decode_config(D, DV, q.element_size(), target)
    m_tiles = cdiv(Hq // Hkv * Sq, max(16, min(cfg.max_block_m, _pow2(Hq // Hkv * Sq))))
    capacity = block_table.shape[1] * k_cache.shape[1] if block_table is not None else k_cache.shape[1]
    if not isinstance(capacity, int):  # symbolic (torch.compile, dynamic shapes: a growing K/V): a choice that
        key_tiles = MAX_SPLITS  # does not guard on it, as for a long one (splits past the keys see none: lse -inf)
    else:
        key_tiles = cdiv(capacity, cfg.block_n)
    if num_splits <= 0:
        num_splits = num_splits_heuristic(B * Hkv * m_tiles, key_tiles, target.sm_count or 4)
    return max(1, min(num_splits, key_tiles, MAX_SPLITS))


def plan_append(q, q_out, k, v, k_cache, v_cache, cos, sin, seqlens, batch_idx, block_table, *,
                interleaved: bool, q_same_pos: bool, target=None) -> Launch | None:
    """Rotate q into q_out (when cos is given) and write rotated k, and v into the cache at seqlens."""
    B, Sq, Hq, D = q.shape
    Snew = k.shape[1] if k is not None else 0
    rotary = cos is not None
    if B == 0 or (not rotary or Sq == 0) and Snew == 0:
        return None
    Hkv, DV = k_cache.shape[2], v_cache.shape[3]
    dummy = seqlens
    R2 = cos.shape[1] if rotary else 0
    qo = q_out if rotary else q
    kn, vn = (k, v) if k is not None else (k_cache, v_cache)  # never read
    st = lambda t: tuple(t.stride())  # noqa: E731
    args = dict(Q=q, QO=qo, KN=kn, VN=vn, KC=k_cache, VC=v_cache, COS=cos if rotary else dummy,
                SIN=sin if rotary else dummy, SEQLENS=seqlens, BIDX=batch_idx if batch_idx is not None else dummy,
                BT=block_table if block_table is not None else dummy,
                **dict(zip(("stride_qb", "stride_qm", "stride_qh", "stride_qd"), st(q))),
                **dict(zip(("stride_qob", "stride_qom", "stride_qoh", "stride_qod"), st(qo))),
                **dict(zip(("stride_knb", "stride_knm", "stride_knh", "stride_knd"), st(kn))),
                **dict(zip(("stride_vnb", "stride_vnm", "stride_vnh", "stride_vnd"), st(vn))),
                **dict(zip(("stride_kcb", "stride_kcn", "stride_kch", "stride_kcd"), st(k_cache))),
                **dict(zip(("stride_vcb", "stride_vcn", "stride_vch", "stride_vcd"), st(v_cache))),
                stride_cos=cos.stride(0) if rotary else 0, stride_sin=sin.stride(0) if rotary else 0,
                stride_btb=block_table.stride(0) if block_table is not None else 0,
                Sq=Sq if rotary else 0, Snew=Snew, Hq=Hq, Hkv=Hkv, D=D, DV=DV, R2=R2,
                PAGE=k_cache.shape[1] if block_table is not None else 1,
                BLOCK_HQ=_pow2(Hq), BLOCK_HKV=_pow2(Hkv), BLOCK_D=_pow2(D), BLOCK_DV=_pow2(DV),
                BLOCK_R2=_pow2(max(R2, 1)), ROTARY=rotary, INTERLEAVED=bool(interleaved), Q_SAME_POS=bool(q_same_pos),
                HAS_KV=Snew > 0, PAGED=block_table is not None, BATCH_IDX=batch_idx is not None,
                ACC=ACC_DTYPE[q.dtype])
    warps = 1 if (target or target_for(q)) is INTERPRETER_TARGET else 4
    return Launch(_kv_append, (max(Sq if rotary else 0, Snew), B), args, ElementwiseConfig(1, 1, warps, 1))


def plan_decode(q, k_cache, v_cache, out, lse2, seqlens, leftpad, batch_idx, block_table, alibi, *, scale: float,
                causal: bool, window=(-1, -1), softcap: float = 0.0, num_splits: int = 0, snew: int = 0, target=None,
                partials=None, key_mask=None) -> list[Launch]:
    """Launches for attention of q (B, Sq, Hq, D) over the cache; see the module docstring.

    seqlens: (B,) int32 (or int64) lengths before the append of snew tokens (the keys end at seqlens + snew), or
    None: every sequence's keys are the cache's first snew positions (attention over a whole K/V tensor);
    leftpad/batch_idx/block_table/alibi: optional. out (B, Sq, Hq, Dv), lse2 (B, Hq, Sq) in log2 units.
    partials: (o (S, B, Sq, Hq, Dv), lse (S, B, Hq, Sq)) in the accumulator dtype for S = split_count(...) > 1
    splits, or None to allocate them. key_mask: (B, Sq | 1, capacity) uint8 (a bool mask's view), nonzero = visible
    (to query i: row i, or to every query: one row), or None (contiguous caches only: indexed by position).
    """
    B, Sq, Hq, D = q.shape
    Hkv, DV = k_cache.shape[2], v_cache.shape[3]
    target = target if target is not None else target_for(q)
    cfg = decode_config(D, DV, q.element_size(), target)
    group = Hq // Hkv
    block_m = max(16, min(cfg.max_block_m, _pow2(group * Sq)))
    m_tiles = cdiv(group * Sq, block_m)
    paged = block_table is not None
    num_splits = split_count(q, k_cache, v_cache, block_table, num_splits, target)
    left, right = (int(x) for x in window)
    has_right = bool(causal) or right >= 0
    if num_splits > 1:
        acc = TORCH_ACC_DTYPE[q.dtype]
        if partials is None:
            partials = (torch.empty(num_splits, B, Sq, Hq, DV, dtype=acc, device=q.device),
                        torch.empty(num_splits, B, Hq, Sq, dtype=acc, device=q.device))
        o_dst, l_dst = partials
        o_st, l_st = tuple(o_dst.stride()), tuple(l_dst.stride())
    else:
        o_dst, l_dst = out, lse2
        o_st, l_st = (0, *out.stride()), (0, *lse2.stride())
    dummy = seqlens if seqlens is not None else q  # never read (its flag is off)
    # a key mask's query stride: 0 for one row for every query (or a row broadcast over the queries)
    km_query = key_mask.stride(1) if key_mask is not None and key_mask.shape[1] > 1 else 0
    sc_hi, sc_lo = split_f32(scale * LOG2E)
    cap_hi, cap_lo = split_f32(float(softcap) * LOG2E)
    l2_hi, l2_lo = split_f32(LOG2E)
    args = dict(Q=q, KC=k_cache, VC=v_cache, O=o_dst, LSE=l_dst, SEQLENS=dummy,
                LEFTPAD=leftpad if leftpad is not None else dummy, BIDX=batch_idx if batch_idx is not None else dummy,
                BT=block_table if paged else dummy, AL=alibi if alibi is not None else dummy,
                KM=key_mask if key_mask is not None else dummy,
                **dict(zip(("stride_qb", "stride_qm", "stride_qh", "stride_qd"), q.stride())),
                **dict(zip(("stride_kb", "stride_kn", "stride_kh", "stride_kd"), k_cache.stride())),
                **dict(zip(("stride_vb", "stride_vn", "stride_vh", "stride_vd"), v_cache.stride())),
                **dict(zip(("stride_os", "stride_ob", "stride_om", "stride_oh", "stride_od"), o_st)),
                **dict(zip(("stride_ls", "stride_lb", "stride_lh", "stride_lm"), l_st)),
                stride_btb=block_table.stride(0) if paged else 0,
                stride_alb=alibi.stride(0) if alibi is not None and alibi.shape[0] > 1 else 0,
                stride_kmb=key_mask.stride(0) if key_mask is not None else 0, stride_kmm=km_query,
                stride_kmn=key_mask.stride(2) if key_mask is not None else 0,
                Sq=Sq, SNEW=snew, GROUP=group, M_TILES=m_tiles, NUM_SPLITS=num_splits, D=D, DV=DV,
                PAGE=k_cache.shape[1] if paged else 1, right=(0 if causal else right) if has_right else 0,
                left=max(left, 0), qk_scale_hi=sc_hi, qk_scale_lo=sc_lo, softcap_hi=cap_hi, softcap_lo=cap_lo,
                log2e_hi=l2_hi, log2e_lo=l2_lo, BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_D=head_block(D),
                BLOCK_DV=head_block(DV), CAUSAL=has_right, WINDOW=left >= 0, LEFTPAD_ON=leftpad is not None,
                PAGED=paged, BATCH_IDX=batch_idx is not None, SOFTCAP=bool(softcap), ALIBI=alibi is not None,
                ACC=ACC_DTYPE[q.dtype], DOT_PREC=dot_precision(q.dtype), LENS_ON=seqlens is not None,
                KEY_MASK=key_mask is not None, QUERY_MASK=km_query != 0)
    launches = [Launch(_decode_fwd, (num_splits, Hkv * m_tiles, B), args, cfg)]
    if num_splits > 1:
        block_r = min(_pow2(Sq), 16)
        cargs = dict(OP=o_dst, LP=l_dst, O=out, LSE=lse2,
                     **dict(zip(("stride_ps", "stride_pb", "stride_pm", "stride_ph", "stride_pd"), o_st)),
                     **dict(zip(("stride_lps", "stride_lpb", "stride_lph", "stride_lpm"), l_st)),
                     **dict(zip(("stride_ob", "stride_om", "stride_oh", "stride_od"), out.stride())),
                     **dict(zip(("stride_lb", "stride_lh", "stride_lm"), lse2.stride())),
                     Sq=Sq, DV=DV, NUM_SPLITS=num_splits, BLOCK_R=block_r, BLOCK_DV=head_block(DV),
                     ACC=ACC_DTYPE[q.dtype])
        warps = 1 if target is INTERPRETER_TARGET else 4
        launches.append(Launch(_decode_combine, (cdiv(Sq, block_r), Hq, B), cargs,
                               ElementwiseConfig(block_r, 1, warps, 1)))
    return launches


# the kernel argument each launch-cache input is passed as (the split partials: "OP"/"LP" of the combine)
_APPEND_ROLES = ("Q", "QO", "KN", "VN", "KC", "VC", "COS", "SIN", "SEQLENS", "BIDX", "BT")
_DECODE_ROLES = ("Q", "KC", "VC", "O", "LSE", "SEQLENS", "LEFTPAD", "BIDX", "BT", "AL", "KM", "OP", "LP")


def _append_cache_args(q, q_out, k, v, k_cache, v_cache, cos, sin, seqlens, batch_idx, block_table, interleaved,
                       q_same_pos) -> tuple:
    """LaunchCache.run's / entry's arguments (key, roles, tensors, build) for plan_append's launch."""
    def build():
        launch = plan_append(q, q_out, k, v, k_cache, v_cache, cos, sin, seqlens, batch_idx, block_table,
                             interleaved=interleaved, q_same_pos=q_same_pos)
        return [launch] if launch is not None else []

    return (("kv_append", q.device, bool(interleaved), bool(q_same_pos)), _APPEND_ROLES,
            (q, q_out, k, v, k_cache, v_cache, cos, sin, seqlens, batch_idx, block_table), build)


def kv_append(q, q_out, k, v, k_cache, v_cache, cos, sin, seqlens, batch_idx, block_table, *, interleaved: bool,
              q_same_pos: bool) -> None:
    """Run plan_append's launch (nothing when there is nothing to write), replayed per call signature."""
    LAUNCHES.run(*_append_cache_args(q, q_out, k, v, k_cache, v_cache, cos, sin, seqlens, batch_idx, block_table,
                                     interleaved, q_same_pos))


def kv_append_entry(q, q_out, k, v, k_cache, v_cache, cos, sin, seqlens, batch_idx, block_table, *,
                    interleaved: bool, q_same_pos: bool):
    """The memoised launch (LaunchCache.entry) kv_append would replay for these tensors (tensors in
    _APPEND_ROLES' order), or None where it plans every call. flashtx._decode_lane keeps it per call signature."""
    return LAUNCHES.entry(*_append_cache_args(q, q_out, k, v, k_cache, v_cache, cos, sin, seqlens, batch_idx,
                                              block_table, interleaved, q_same_pos))


_SPLITS: dict = {}  # split_count per (shapes, dtype, device, num_splits) of eager calls


def decode_attention(q, k_cache, v_cache, out, lse2, seqlens, leftpad, batch_idx, block_table, alibi, *,
                     scale: float, causal: bool, window=(-1, -1), softcap: float = 0.0, num_splits: int = 0,
                     snew: int = 0, key_mask=None) -> None:
    """Run plan_decode's launches (nothing for an empty q), replayed per call signature; the split
    partials are allocated here, so that a replay rebinds them like every other tensor."""
    if out.numel() == 0 and lse2.numel() == 0:
        return
    LAUNCHES.run(*_decode_cache_args(q, k_cache, v_cache, out, lse2, seqlens, leftpad, batch_idx, block_table, alibi,
                                     scale, causal, window, softcap, num_splits, snew, key_mask)[:4])


def decode_entry(q, k_cache, v_cache, out, lse2, seqlens, leftpad, batch_idx, block_table, alibi, *, scale: float,
                 causal: bool, window=(-1, -1), softcap: float = 0.0, num_splits: int = 0, snew: int = 0):
    """(entry, splits): the memoised launches (LaunchCache.entry) decode_attention would replay for these tensors
    (or None where it plans every call), and the split count whose partials, (splits, B, Sq, Hq, Dv) and
    (splits, B, Hq, Sq) in the accumulator dtype, a replay binds as its last two tensors (None for 1 split), in
    _DECODE_ROLES' order. flashtx._decode_lane keeps it per call signature and fires it itself."""
    key, roles, tensors, build, splits = _decode_cache_args(q, k_cache, v_cache, out, lse2, seqlens, leftpad,
                                                            batch_idx, block_table, alibi, scale, causal, window,
                                                            softcap, num_splits, snew, None)
    return LAUNCHES.entry(key, roles, tensors, build), splits


def _decode_cache_args(q, k_cache, v_cache, out, lse2, seqlens, leftpad, batch_idx, block_table, alibi, scale,
                       causal, window, softcap, num_splits, snew, key_mask) -> tuple:
    """LaunchCache.run's / entry's arguments (key, roles, tensors, build) for plan_decode's launches, and the split
    count (its partials allocated here, so that a replay rebinds them like every other tensor)."""
    if type(q) is torch.Tensor:  # eager (fake tensors' symbolic shapes are not hashable)
        key = (q.shape, k_cache.shape, v_cache.shape[3], None if block_table is None else block_table.shape[1],
               q.dtype, q.device, num_splits)
        splits = _SPLITS.get(key)
        if splits is None:
            if len(_SPLITS) >= 512:
                _SPLITS.clear()
            splits = _SPLITS[key] = split_count(q, k_cache, v_cache, block_table, num_splits, target_for(q))
    else:
        splits = split_count(q, k_cache, v_cache, block_table, num_splits, target_for(q))
    o_part = l_part = None
    if splits > 1:
        B, Sq, Hq, _ = q.shape
        acc = TORCH_ACC_DTYPE[q.dtype]
        o_part = torch.empty(splits, B, Sq, Hq, v_cache.shape[3], dtype=acc, device=q.device)
        l_part = torch.empty(splits, B, Hq, Sq, dtype=acc, device=q.device)
    window = (int(window[0]), int(window[1]))
    return (("decode", q.device, dot_precision(q.dtype), float(scale), bool(causal), window, float(softcap), splits,
             snew), _DECODE_ROLES,
            (q, k_cache, v_cache, out, lse2, seqlens, leftpad, batch_idx, block_table, alibi, key_mask, o_part, l_part),
            lambda: plan_decode(q, k_cache, v_cache, out, lse2, seqlens, leftpad, batch_idx, block_table, alibi,
                                scale=scale, causal=causal, window=window, softcap=softcap, num_splits=splits,
                                snew=snew, partials=(o_part, l_part) if splits > 1 else None, key_mask=key_mask),
            splits)


def compile_plans(target) -> list:
    """Decode configs for the compile check: D 64/128/256, fp16/bf16/fp32, GQA 4 and MHA, one split and
    several (the combine kernel), contiguous and paged caches, every option at once, and the append."""
    plans = []
    B, S, P, Hkv = 2, 1024, 64, 2
    for d in (64, 128, 256):
        for dtype in (torch.float16, torch.bfloat16, torch.float32):
            for group, sq, paged, opts in ((4, 1, False, False), (1, 1, True, False), (4, 4, True, True)):
                if dtype == torch.float32 and opts:
                    continue
                q = torch.empty(B, sq, Hkv * group, d, dtype=dtype)
                if paged:
                    kc, vc = (torch.empty(B * S // P, P, Hkv, d, dtype=dtype) for _ in range(2))
                    bt = torch.zeros(B, S // P, dtype=torch.int32)
                else:
                    kc, vc = (torch.empty(B, S, Hkv, d, dtype=dtype) for _ in range(2))
                    bt = None
                seq = torch.full((B,), S, dtype=torch.int32)
                out = torch.empty(B, sq, Hkv * group, d, dtype=dtype)
                lse = torch.empty(B, Hkv * group, sq, dtype=torch.float32)
                al = torch.ones(1, Hkv * group) if opts else None
                lp = seq if opts else None
                name = f"decode D={d} {str(dtype)[6:]} G={group} Sq={sq}{' paged' if paged else ''}" \
                       f"{' all-options' if opts else ''}"
                for splits in (1, 4):
                    launches = plan_decode(q, kc, vc, out, lse, seq, lp, None, bt, al, scale=d ** -0.5, causal=True,
                                           window=(256, -1) if opts else (-1, -1), softcap=30.0 if opts else 0.0,
                                           num_splits=splits, target=target)
                    plans.append((f"{name} splits={splits}", launches[0]))
                    if splits > 1 and not opts:
                        plans.append((f"decode_combine D={d} {str(dtype)[6:]} Sq={sq}", launches[1]))
                if group > 1 and not paged:  # without lengths: attention over a whole K/V (flashtx._small_q), with
                    # and without a key mask (transformers' padded batches: and a window's right bound)
                    for km in (None, torch.empty(B, 1, S, dtype=torch.uint8)):
                        launches = plan_decode(q, kc, vc, out, lse, None, None, None, None, None, scale=d ** -0.5,
                                               causal=False, window=(-1, -1) if km is None else (-1, 0), num_splits=4,
                                               snew=S, target=target, key_mask=km)
                        plans.append((f"{name} no-lengths{'' if km is None else ' key-mask'} splits=4", launches[0]))
                    q4, o4 = (torch.empty(B, 4, Hkv * group, d, dtype=dtype) for _ in range(2))  # a mask per query
                    launches = plan_decode(q4, kc, vc, o4, torch.empty(B, Hkv * group, 4), None, None, None, None,
                                           None, scale=d ** -0.5, causal=False, num_splits=4, snew=S, target=target,
                                           key_mask=torch.empty(B, 4, S, dtype=torch.uint8))
                    plans.append((name.replace(f"Sq={sq}", "Sq=4") + " no-lengths query-mask splits=4", launches[0]))
            cos = torch.empty(S, d // 4, dtype=torch.float32)
            kn = torch.empty(B, 1, Hkv, d, dtype=dtype)
            q = torch.empty(B, 1, 4 * Hkv, d, dtype=dtype)
            kc = torch.empty(B * S // P, P, Hkv, d, dtype=dtype)
            plans.append((f"kv_append D={d} {str(dtype)[6:]} paged rotary",
                          plan_append(q, torch.empty_like(q), kn, kn, kc, kc, cos, cos,
                                      torch.zeros(B, dtype=torch.int32), None, torch.zeros(B, S // P, dtype=torch.int32),
                                      interleaved=False, q_same_pos=False, target=target)))
    return plans


__all__ = ["plan_decode", "plan_append", "decode_attention", "kv_append", "num_splits_heuristic", "compile_plans",
           "KNOWN_TARGETS"]
