"""Flash attention forward: tiled over K/V with an online softmax (no autograd here).

One program owns BLOCK_M query rows of one (batch, q head) and streams the K/V tiles its rows can
see, keeping the running row max `m`, row sum `l` and output accumulator in registers. It writes
O and the per-row statistics m2 (row max, log2 units) and l2 = log2(l) that the backward uses to
recompute P = exp2((s2 - m2) - l2).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import attention_common
from .attention_common import (MASK_ROLES, NO_MASKS, MaskSpec, batch_y, dropout_keep, kv_loop_bounds, loop_part,
                               mask_args, mask_elt, modifier_scalars, program_hb, scalar_in, score_mods, seq_bounds,
                               stride_args, visible, wide_dropout_plans)
from .configs import estimate_shared_memory, fit_rows, select_config
from .launch import (ACC_DTYPE, LAUNCHES, LOG2E, TORCH_ACC_DTYPE, Launch, cdiv, dot_precision, head_split,
                     split_f32, target_for, tma_ok)
from .limits import bhsd, check_limits, check_spans, surely


@triton.jit
def _fwd_tiles(acc, acc2, m_i, l_i, q, q2, k_base, v_base, km_base, mb_base, offs_m, start, end, Sq_b, Sk_b,
               causal_shift, window_shift, qk_scale, stride_kn, stride_kd, stride_vn, stride_vd, stride_kmn, stride_mm,
               stride_mn, D_QK, D_V, softcap2, slope2, log2e, seed, bh, dropout_p,
               BLOCK_N: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DQK2: tl.constexpr, BLOCK_DV: tl.constexpr,
               BLOCK_DV2: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
               KEY_MASK: tl.constexpr, MASK_KIND: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
               DROPOUT: tl.constexpr, ACC: tl.constexpr, DOT_PREC: tl.constexpr, TMA: tl.constexpr):
    """Fold key tiles [start, end) into the online-softmax state (acc, acc2, m_i, l_i).

    TMA: k_base / v_base are tensor descriptors of this sequence's K / V rows (rows past Sk_b read as 0).

    Head dims split in two column pieces (launch.head_split) when BLOCK_DQK2 / BLOCK_DV2 > 0: q2 holds
    Q's columns [BLOCK_DQK, BLOCK_DQK + BLOCK_DQK2), acc2 the output's columns [BLOCK_DV, BLOCK_DV +
    BLOCK_DV2). Unsplit, q2 / acc2 are placeholders that are never read (and returned unchanged).
    """
    offs_dqk = tl.arange(0, BLOCK_DQK)
    offs_dv = tl.arange(0, BLOCK_DV)
    alibi_shift = Sk_b - Sq_b  # ALiBi is aligned bottom-right, as flash-attn's
    # (tl.range(..., warp_specialize=True) was tried for sm_90, 2026-12-06, with Triton 3.6 and 3.9: their Hopper
    # NVGPUWarpSpecialization pass fails on this loop at 4 warps, and at 8 warps, TMA tiles included, leaves it
    # unpartitioned (no ttg.warp_specialize op, no setmaxnreg); issue 13's item 5 rests on TMA alone for now)
    for start_n in range(start, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        key_in = offs_n < Sk_b  # keys past Sk_b (padding) read as 0
        # K^T tile (BLOCK_DQK, BLOCK_N) and V tile (BLOCK_N, BLOCK_DV)
        if TMA:
            kt = k_base.load([start_n, 0]).T
            v = v_base.load([start_n, 0])
        else:
            kt = tl.load(k_base + offs_n[None, :] * stride_kn + offs_dqk[:, None] * stride_kd,
                         mask=key_in[None, :] & (offs_dqk[:, None] < D_QK), other=0.0)
            v = tl.load(v_base + offs_n[:, None] * stride_vn + offs_dv[None, :] * stride_vd,
                        mask=key_in[:, None] & (offs_dv[None, :] < D_V), other=0.0)
        s = tl.dot(q, kt, out_dtype=ACC, input_precision=DOT_PREC)  # (BLOCK_M, BLOCK_N)
        if BLOCK_DQK2 > 0:  # the second column piece of K^T, (BLOCK_DQK2, BLOCK_N), accumulated into s
            offs_dqk2 = BLOCK_DQK + tl.arange(0, BLOCK_DQK2)
            kt2 = tl.load(k_base + offs_n[None, :] * stride_kn + offs_dqk2[:, None] * stride_kd,
                          mask=key_in[None, :] & (offs_dqk2[:, None] < D_QK), other=0.0)
            s = tl.dot(q2, kt2, s, out_dtype=ACC, input_precision=DOT_PREC)
        s = s * qk_scale  # log2 units
        in_bounds = (offs_m[:, None] < Sq_b) & (offs_n[None, :] < Sk_b)
        s, _ = score_mods(s, offs_m[:, None], offs_n[None, :], in_bounds, mb_base, stride_mm, stride_mn,
                          softcap2, slope2, alibi_shift, log2e, MASK_KIND, SOFTCAP, ALIBI)
        if MASKED:
            key_ok = offs_n[None, :] < Sk_b
            if KEY_MASK:
                key_ok = tl.load(km_base + offs_n[None, :] * stride_kmn, mask=key_ok, other=0) != 0
            vis = visible(offs_m[:, None], offs_n[None, :], Sq_b, Sk_b, causal_shift, window_shift, key_ok,
                          CAUSAL, WINDOW, KEY_MASK)
            s = tl.where(vis, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # a row with nothing visible so far keeps m = -inf; subtract 0 instead of -inf
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_ref = m_new
        p = tl.exp2(s - m_ref[:, None])  # (BLOCK_M, BLOCK_N)
        alpha = tl.exp2(m_i - m_ref)  # rescales what was accumulated under the old max
        l_i = l_i * alpha + tl.sum(p, 1)  # the softmax normaliser counts dropped entries too
        if DROPOUT:
            p = tl.where(dropout_keep(seed, bh, offs_m[:, None], offs_n[None, :], Sk_b, dropout_p, DROPOUT), p, 0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, out_dtype=ACC, input_precision=DOT_PREC)
        if BLOCK_DV2 > 0:  # the second column piece of V, (BLOCK_N, BLOCK_DV2), into its own accumulator
            offs_dv2 = BLOCK_DV + tl.arange(0, BLOCK_DV2)
            v2 = tl.load(v_base + offs_n[:, None] * stride_vn + offs_dv2[None, :] * stride_vd,
                         mask=key_in[:, None] & (offs_dv2[None, :] < D_V), other=0.0)
            acc2 = acc2 * alpha[:, None] + tl.dot(p.to(v2.dtype), v2, out_dtype=ACC, input_precision=DOT_PREC)
        m_i = m_new
    return acc, acc2, m_i, l_i


@triton.jit
def _attn_fwd(Q, K, V, O, M2, L2, Q_LENS, KV_LENS, CU_Q, CU_K, KM, QM, MB, AL, RNG,
              stride_qb, stride_qh, stride_qm, stride_qd,
              stride_kb, stride_kh, stride_kn, stride_kd,
              stride_vb, stride_vh, stride_vn, stride_vd,
              stride_ob, stride_oh, stride_om, stride_od,
              stride_lb, stride_lh, stride_kmb, stride_kmn, stride_qmb, stride_qmn,
              stride_mb, stride_mh, stride_mm, stride_mn, stride_alb,
              H, GROUP, Sq, Sk, D_QK, D_V, bottom_right, right, left, qk_scale_hi, qk_scale_lo,
              softcap_hi, softcap_lo, log2e_hi, log2e_lo, dropout_p, drop_scale_hi, drop_scale_lo,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DQK2: tl.constexpr,
              BLOCK_DV: tl.constexpr, BLOCK_DV2: tl.constexpr,
              CAUSAL: tl.constexpr, WINDOW: tl.constexpr, KEY_MASK: tl.constexpr, QUERY_MASK: tl.constexpr,
              LENS: tl.constexpr, VARLEN: tl.constexpr, MASK_KIND: tl.constexpr, EVERY_TILE: tl.constexpr,
              SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, DROPOUT: tl.constexpr,
              ACC: tl.constexpr, DOT_PREC: tl.constexpr, TMA: tl.constexpr, BATCH_Y: tl.constexpr):
    """One BLOCK_M tile of one (batch, q head), grid (q tiles, heads, batch) (BATCH_Y: (q tiles, batch, heads),
    batch_y). TMA (sm_90+, unsplit head dims, 16-byte aligned K/V rows:
    tma_ok): K/V tiles are read through device-side tensor descriptors, so the Tensor Memory Accelerator
    copies them and zero-fills rows past the sequence; otherwise through masked pointer loads."""
    tl.static_assert(not TMA or (BLOCK_DQK2 == 0 and BLOCK_DV2 == 0), "TMA reads unsplit head dims only")
    pid_m = tl.program_id(0)
    if CAUSAL:  # longest first: under a causal mask a q tile's work grows with its index (FA3's LPT order)
        pid_m = tl.num_programs(0) - 1 - pid_m
    h, b = program_hb(BATCH_Y)  # each grid axis stays within CUDA's limits
    kvh = h // GROUP  # GQA/MQA: q heads [kvh*GROUP, (kvh+1)*GROUP) share K/V head kvh
    m0 = pid_m * BLOCK_M
    lq, lk, cq0, cq1, ck0, ck1 = b, b, b, b, b, b  # read by seq_bounds only under LENS / VARLEN
    if LENS:
        lq, lk = tl.load(Q_LENS + b), tl.load(KV_LENS + b)
    if VARLEN:
        cq0, cq1, ck0, ck1 = tl.load(CU_Q + b), tl.load(CU_Q + b + 1), tl.load(CU_K + b), tl.load(CU_K + b + 1)
    q_start, k_start, Sq_b, Sk_b, Sq_mem, Sk_mem, causal_shift, window_shift = seq_bounds(
        b, Sq, Sk, lq, lk, cq0, cq1, ck0, ck1, bottom_right, right, left, LENS, VARLEN)
    q_base = Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh + q_start.to(tl.int64) * stride_qm
    k_base = K + b.to(tl.int64) * stride_kb + kvh.to(tl.int64) * stride_kh + k_start.to(tl.int64) * stride_kn
    v_base = V + b.to(tl.int64) * stride_vb + kvh.to(tl.int64) * stride_vh + k_start.to(tl.int64) * stride_vn
    o_base = O + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh + q_start.to(tl.int64) * stride_om
    if TMA:  # descriptors of this sequence's rows: K (Sk_b, D_QK), V (Sk_b, D_V); one row at least
        rows = tl.maximum(Sk_b, 1)
        k_base = tl.make_tensor_descriptor(k_base, shape=[rows, D_QK], strides=[stride_kn, 1],
                                           block_shape=[BLOCK_N, BLOCK_DQK])
        v_base = tl.make_tensor_descriptor(v_base, shape=[rows, D_V], strides=[stride_vn, 1],
                                           block_shape=[BLOCK_N, BLOCK_DV])
    km_base = KM + b.to(tl.int64) * stride_kmb
    mb_base = MB + b.to(tl.int64) * stride_mb + h.to(tl.int64) * stride_mh
    softcap2, log2e, slope2, seed = modifier_scalars(b, h, AL, stride_alb, RNG, softcap_hi, softcap_lo,
                                                     log2e_hi, log2e_lo, ALIBI, DROPOUT, ACC)
    bh = b * H + h  # (past 2**31 it wraps; dropout_keep reads its 32 bits as unsigned)

    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_dqk = tl.arange(0, BLOCK_DQK)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_in = offs_m < Sq_b
    q = tl.load(q_base + offs_m[:, None] * stride_qm + offs_dqk[None, :] * stride_qd,
                mask=row_in[:, None] & (offs_dqk[None, :] < D_QK), other=0.0)  # (BLOCK_M, BLOCK_DQK)
    q2 = q  # placeholder: read only when the head dim is split
    if BLOCK_DQK2 > 0:
        offs_dqk2 = BLOCK_DQK + tl.arange(0, BLOCK_DQK2)
        q2 = tl.load(q_base + offs_m[:, None] * stride_qm + offs_dqk2[None, :] * stride_qd,
                     mask=row_in[:, None] & (offs_dqk2[None, :] < D_QK), other=0.0)  # (BLOCK_M, BLOCK_DQK2)
    qk_scale = scalar_in(qk_scale_hi, qk_scale_lo, ACC)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=ACC)  # running row max (log2 units)
    l_i = tl.zeros([BLOCK_M], dtype=ACC)  # running row sum of exp2(s - m)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=ACC)  # running P @ V (its first column piece when split)
    acc2 = l_i  # placeholder: an accumulator only when the value head dim is split
    if BLOCK_DV2 > 0:
        acc2 = tl.zeros([BLOCK_M, BLOCK_DV2], dtype=ACC)  # P @ V's columns [BLOCK_DV, BLOCK_DV + BLOCK_DV2)

    # masked tiles left of the unmasked range (window edge), unmasked, masked tail (causal diagonal, Sk_b)
    lo, full_lo, full_hi, hi = kv_loop_bounds(m0, Sq_b, Sk_b, causal_shift, window_shift, BLOCK_M, BLOCK_N,
                                              CAUSAL, WINDOW, EVERY_TILE)
    for part in tl.static_range(3):
        start, end = loop_part(part, lo, full_lo, full_hi, hi)
        acc, acc2, m_i, l_i = _fwd_tiles(acc, acc2, m_i, l_i, q, q2, k_base, v_base, km_base, mb_base, offs_m,
                                         start, end, Sq_b, Sk_b, causal_shift, window_shift, qk_scale, stride_kn,
                                         stride_kd, stride_vn, stride_vd, stride_kmn, stride_mm, stride_mn, D_QK, D_V,
                                         softcap2, slope2, log2e, seed, bh, dropout_p,
                                         BLOCK_N, BLOCK_DQK, BLOCK_DQK2, BLOCK_DV, BLOCK_DV2, part != 1, CAUSAL,
                                         WINDOW, KEY_MASK, MASK_KIND, SOFTCAP, ALIBI, DROPOUT, ACC, DOT_PREC, TMA)

    # Rows that saw no key (masked out, padding, or before the causal diagonal) have l = 0 or are
    # past Sq_b / masked by query_mask: output 0, m2 = -inf, l2 = 0 (the backward gives them P = 0).
    empty = (l_i == 0.0) | (offs_m >= Sq_b)
    if QUERY_MASK:
        qm = tl.load(QM + b.to(tl.int64) * stride_qmb + offs_m * stride_qmn, mask=offs_m < Sq_b, other=0)
        empty = empty | (qm == 0)
    inv_l = 1.0 / tl.where(empty, 1.0, l_i)
    if DROPOUT:
        inv_l = inv_l * scalar_in(drop_scale_hi, drop_scale_lo, ACC)  # kept entries scaled by 1 / (1 - p)
    o = tl.where(empty[:, None], 0.0, acc * inv_l[:, None])
    m2 = tl.where(empty, float("-inf"), m_i)
    l2 = tl.log2(tl.where(empty, 1.0, l_i))  # kept apart from m2: m2 + l2 rounds to m2 when |m2| is huge
    tl.store(o_base + offs_m[:, None] * stride_om + offs_dv[None, :] * stride_od, o.to(O.dtype.element_ty),
             mask=(offs_m[:, None] < Sq_mem) & (offs_dv[None, :] < D_V))
    if BLOCK_DV2 > 0:
        offs_dv2 = BLOCK_DV + tl.arange(0, BLOCK_DV2)
        o2 = tl.where(empty[:, None], 0.0, acc2 * inv_l[:, None])
        tl.store(o_base + offs_m[:, None] * stride_om + offs_dv2[None, :] * stride_od, o2.to(O.dtype.element_ty),
                 mask=(offs_m[:, None] < Sq_mem) & (offs_dv2[None, :] < D_V))
    row = b.to(tl.int64) * stride_lb + h.to(tl.int64) * stride_lh + q_start + offs_m
    tl.store(M2 + row, m2, mask=offs_m < Sq_mem)
    tl.store(L2 + row, l2, mask=offs_m < Sq_mem)


def plan_forward(q, k, v, out, m2, l2, *, scale: float, causal: bool, bottom_right: bool,
                 spec: MaskSpec = NO_MASKS, target=None, config=None) -> Launch:
    """The launch that computes out, m2 and l2 from q, k, v ((B, H, S, D) views; varlen (1, H, total, D)).
    config: the tile config to use instead of select_config's, cut for a short sequence (fit_rows; given: the
    compile check's TMA candidates, as they are)."""
    H, D_QK = q.shape[1], q.shape[3]
    Hkv, D_V = k.shape[1], v.shape[3]
    target = target if target is not None else target_for(q)
    (dqk1, dqk2), (dv1, dv2) = head_split(D_QK), head_split(D_V)
    block_dqk, block_dv = dqk1 + dqk2, dv1 + dv2  # the register tile widths configs see
    margs, B, Sq, Sk = mask_args(spec, causal, bottom_right, q, k, m2)
    cfg = config or fit_rows(select_config("attn_fwd", block_dqk, block_dv, q.element_size(), target,
                                           spec.modifies_scores, spec.masks_visibility, causal), Sq)
    hi, lo = split_f32(scale * LOG2E)
    tma = cfg.tma and not (dqk2 or dv2) and tma_ok(k) and tma_ok(v)
    args = dict(
        Q=q, K=k, V=v, O=out, M2=m2, L2=l2,
        **stride_args("q", q, spec), **stride_args("k", k, spec), **stride_args("v", v, spec),
        **stride_args("o", out, spec),
        H=H, GROUP=H // Hkv, Sq=Sq, Sk=Sk, D_QK=D_QK, D_V=D_V,
        qk_scale_hi=hi, qk_scale_lo=lo,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_DQK=dqk1, BLOCK_DQK2=dqk2, BLOCK_DV=dv1, BLOCK_DV2=dv2,
        ACC=ACC_DTYPE[q.dtype], DOT_PREC=dot_precision(q.dtype), TMA=tma, BATCH_Y=batch_y(margs, B), **margs,
    )
    grid = (cdiv(Sq, cfg.block_m), B, H) if args["BATCH_Y"] else (cdiv(Sq, cfg.block_m), H, B)
    est = estimate_shared_memory("attn_fwd", cfg, block_dqk, block_dv, q.element_size(), target,
                                 mask_elt(margs, Sq, Sk, q.dtype))
    return Launch(_attn_fwd, grid, args, cfg, est, descriptors=("K", "V") if tma else ())


# the kernel argument of each launch-cache input, with the mask tensors and without (MaskSpec.launch_key's)
_ROLES, _ROLES_PLAIN = ("Q", "K", "V", "O", *MASK_ROLES, "M2", "L2"), ("Q", "K", "V", "O", "M2", "L2")


def attention_forward(q, k, v, *, scale: float, causal: bool = False, bottom_right: bool = False,
                      spec: MaskSpec = NO_MASKS, out: torch.Tensor | None = None, bshd: bool = False):
    """Flash attention forward on (B, H, S, D) views (any strides with a unit last stride); bshd: q, k, v
    (and out) are (B, S, H, D) tensors instead, read through their strides (no views made per call).

    q: (B, Hq, Sq, Dqk); k: (B, Hkv, Sk, Dqk); v: (B, Hkv, Sk, Dv), Hq a multiple of Hkv.
    spec: window / masks / lengths / varlen (see MaskSpec; varlen: (1, H, total, D) views).
    Returns (out, m2, l2): out (B, Hq, Sq, Dv) (bshd: (B, Sq, Hq, Dv)) in q's dtype (written into `out`
    if given); m2 and
    l2 (B, Hq, Sq) contiguous, fp32 (fp64 for fp64 inputs): m2 the row max of the scaled scores in
    log2 units, l2 = log2(sum exp2(s2 - m2)); rows that see no key have m2 = -inf, l2 = 0 (and
    output 0). The row log-sum-exp is (m2 + l2) * ln 2.
    """
    if bshd:
        B, Sq, H, _ = q.shape
        Sk = k.shape[1]
    else:
        B, H, Sq, _ = q.shape
        Sk = k.shape[2]
    if out is None:
        shape = (B, Sq, H, v.shape[3]) if bshd else (B, H, Sq, v.shape[3])
        out = torch.empty(shape, dtype=q.dtype, device=q.device)
    acc, dev = TORCH_ACC_DTYPE[q.dtype], q.device
    m2, l2 = torch.empty(B, H, Sq, dtype=acc, device=dev), torch.empty(B, H, Sq, dtype=acc, device=dev)
    if surely(out.numel() == 0):
        return out, m2, l2
    if surely(Sk == 0):  # no keys: every row sees none, so 0 output and lse -inf (as fully masked rows; SDPA too)
        return out.zero_(), m2.fill_(float("-inf")), l2.zero_()
    LAUNCHES.run(*_cache_args(q, k, v, out, m2, l2, scale, causal, bottom_right, spec, bshd))
    return out, m2, l2


def forward_entry(q, k, v, out, m2, l2, *, scale: float, causal: bool, bottom_right: bool, bshd: bool,
                  spec: MaskSpec = NO_MASKS):
    """The memoised launches (LaunchCache.entry) attention_forward would replay for these tensors (out, m2, l2
    allocated as it allocates them), or None where it plans every call. flashtx._attention_lane keeps them per call
    signature and fires them itself, on (q, k, v, out, m2, l2), or with mask tensors (spec.launch_key's) on
    (q, k, v, out, *masks, m2, l2): _ROLES_PLAIN's or _ROLES' order. Raises LimitExceeded as attention_forward
    does."""
    return LAUNCHES.entry(*_cache_args(q, k, v, out, m2, l2, scale, causal, bottom_right, spec, bshd))


def _cache_args(q, k, v, out, m2, l2, scale, causal, bottom_right, spec, bshd) -> tuple:
    """LaunchCache.run's / entry's arguments for a forward: key, roles, tensors, build, derived."""
    static, tensors = spec.launch_key()

    def build():  # once per call signature (limits included: a replay has the shapes it was planned for)
        qv, kv, vv, ov = bhsd(bshd, q, k, v, out)  # (B, H, S, D) views: a replay binds q, k, v, out themselves
        check_limits(qv, kv, vv, spec.attn_mask, spec.cu_seqlens_q)
        check_spans(out=ov)
        return [plan_forward(qv, kv, vv, ov, m2, l2, scale=scale, causal=causal, bottom_right=bottom_right,
                             spec=spec)]

    return (("attn_fwd", q.device, dot_precision(q.dtype), scale, causal, bottom_right, bshd, static),
            _ROLES if tensors else _ROLES_PLAIN, (q, k, v, out, *tensors, m2, l2), build,
            2)  # derived: m2, l2, allocated from q


def all_options_spec(B: int, S: int, H: int = 2, bias_shape=None, dtype=torch.float16, left: int | None = None
                     ) -> MaskSpec:
    """Every option at once (the most registers): window (left size `left`, default S // 2), key/query masks,
    lengths, an additive attn_mask, softcap, ALiBi and dropout."""
    lens = torch.full((B,), S, dtype=torch.int32)
    mask = torch.ones(B, S, dtype=torch.bool)
    bias = torch.empty(bias_shape or (1, H, S, S), dtype=dtype)
    return MaskSpec(window=(S // 2 if left is None else left, 0), key_mask=mask, query_mask=mask, q_lens=lens,
                    kv_lens=lens, attn_mask=bias,
                    softcap=30.0, alibi_slopes=torch.ones(1, H), dropout_p=0.1, rng=torch.zeros(1, dtype=torch.int64))


def compile_cases(head_dims=(64, 128, 256)):
    """(head dim, dtype, name, causal, MaskSpec) of every case the compile check covers, forward and
    backward alike: head dims 64/128/256 (the forward adds 192, split 128 + 64); fp16, bf16, fp32;
    causal or not; fp16/bf16 also with the mask options (every option at once is the most registers;
    a separate varlen case covers its addressing), and with every option including attn_mask, softcap,
    ALiBi and dropout."""
    B, S = 1, attention_common.PLAN_SEQLEN
    lens = torch.full((B,), S, dtype=torch.int32)
    mask = torch.ones(B, S, dtype=torch.bool)
    cu = torch.arange(B + 1, dtype=torch.int32) * S
    masked = [("window+masks+lens", True, MaskSpec(window=(S // 2, 0), key_mask=mask, query_mask=mask, q_lens=lens,
                                                   kv_lens=lens)),
              ("varlen+window", True, MaskSpec(window=(S // 2, 0), cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=S,
                                               max_seqlen_k=S)),
              ("all-options", True, all_options_spec(B, S))]
    for d in head_dims:
        for dtype in (torch.float16, torch.bfloat16, torch.float32):
            if dtype == torch.float16:
                yield d, dtype, "causal=False", False, NO_MASKS
            yield d, dtype, "causal=True", True, NO_MASKS
            if dtype != torch.float32:
                for name, causal, spec in masked:
                    yield d, dtype, name, causal, spec


# Split head dims (launch.head_split) the compile check adds beyond compile_cases' 192:
# (Dqk, Dv, dtype, name, causal, MaskSpec): DeepSeek's MLA 192/128, and 96 (64 + 32) and 160 (128 + 32).
def _split_cases():
    S = attention_common.PLAN_SEQLEN
    masks = all_options_spec(1, S)
    for dqk, dv in ((192, 128), (96, 96), (160, 160)):
        yield dqk, dv, torch.float16, "causal=True", True, NO_MASKS
        yield dqk, dv, torch.float16, "all-options", True, masks


def compile_plans(target) -> list:
    """Every forward config `target` can launch (head dims 64/128/192/256, and the split head dims
    96, 160 and 192/128; fp16, bf16, fp32; causal or not; fp16/bf16 also with a window, key/query
    masks, lengths and varlen).

    For the compile check: small CPU tensors whose strides match a real (B, H, S, D) launch.
    """
    plans, S = [], attention_common.PLAN_SEQLEN
    cases = [(d, d, *rest) for d, *rest in compile_cases((64, 128, 192, 256))] + list(_split_cases())
    for dqk, dv, dtype, name, causal, spec in cases:
        q, k = (torch.empty(1, 2, S, dqk, dtype=dtype) for _ in range(2))
        v, o = (torch.empty(1, 2, S, dv, dtype=dtype) for _ in range(2))
        m2, l2 = (torch.empty(1, 2, S, dtype=torch.float32) for _ in range(2))
        try:
            launch = plan_forward(q, k, v, o, m2, l2, scale=dqk ** -0.5, causal=causal, bottom_right=spec.varlen,
                                  spec=spec, target=target)
        except RuntimeError:  # no config fits: the backend reports it and never launches
            continue
        dims = f"D={dqk}" if dqk == dv else f"D={dqk}/{dv}"
        plans.append((f"attn_fwd {dims} {str(dtype)[6:]} {name}", launch))
    return plans + wide_dropout_plans(plans) + _tma_compile_plans(target)


def _tma_compile_plans(target) -> list:
    """sm_90 and later: each TMA tuning candidate (autotune.TMA_CANDIDATES), plain causal fp16 and with every
    option in bf16; the first per head dim also varlen + window (descriptors of per-sequence rows)."""
    from .autotune import TMA_CANDIDATES, TMA_MIN_ARCH, describe

    if target.arch < TMA_MIN_ARCH:
        return []
    plans = []
    cases = {name: (causal, spec) for _, _, name, causal, spec in compile_cases((64,))}
    for d, cands in TMA_CANDIDATES["attn_fwd"][2].items():
        for i, cfg in enumerate(cands):
            runs = [(torch.float16, "causal=True"), (torch.bfloat16, "all-options")] + (
                [(torch.float16, "varlen+window")] if i == 0 else [])
            for dtype, name in runs:
                causal, spec = cases[name]
                S = attention_common.PLAN_SEQLEN
                q, k, v, o = (torch.empty(1, 2, S, d, dtype=dtype) for _ in range(4))
                m2, l2 = (torch.empty(1, 2, S, dtype=torch.float32) for _ in range(2))
                launch = plan_forward(q, k, v, o, m2, l2, scale=d ** -0.5, causal=causal, bottom_right=spec.varlen,
                                      spec=spec, target=target, config=cfg)
                assert launch.args["TMA"], "a TMA compile plan must read K/V through descriptors"
                plans.append((f"attn_fwd+tma D={d} {str(dtype)[6:]} {name} {describe(cfg)}", launch))
    return plans
