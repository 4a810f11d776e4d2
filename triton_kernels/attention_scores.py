"""Score-shaped outputs of attention: the attn_mask (bias) gradient and the probabilities.

One kernel, `_attn_scores`, recomputes tiles of P = exp2(s2 - m2) / 2**l2 (with every mask, modifier
and the dropout draw of the forward) and either
- GRAD: accumulates dS = P * (dP - delta), the gradient of the scores, into an output shaped
  like the user's attn_mask: a dim of size 1 there (broadcast in the forward) is summed here, in
  a fixed loop order inside one program, so the bias gradient is deterministic (no atomics); or
- not GRAD: writes P itself, dropped entries negated (flash-attn's `return_attn_probs` for tests).

Each program owns one (BLOCK_M, BLOCK_N) tile of the output at one (batch, head) of the output
and loops over the batches (SUM over B), heads (over H), q tiles (SUM_M) and key tiles (SUM_N)
that fold into it. Tiles no query can see still run (P = 0 there); only this kernel's cost, not
the main kernels', grows with them.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .attention_common import (NO_MASKS, MaskSpec, dropout_keep, mask_args, modifier_scalars, scalar_in, score_mods,
                               seq_bounds, stride_args, visible)
from .configs import estimate_shared_memory, select_config
from .launch import ACC_DTYPE, LOG2E, Launch, cdiv, dot_precision, head_block, split_f32, target_for


@triton.jit
def _attn_scores(Q, K, V, DO, M2, L2, DELTA, OUT, Q_LENS, KV_LENS, CU_Q, CU_K, KM, QM, MB, AL, RNG,
                 stride_qb, stride_qh, stride_qm, stride_qd,
                 stride_kb, stride_kh, stride_kn, stride_kd,
                 stride_vb, stride_vh, stride_vn, stride_vd,
                 stride_dob, stride_doh, stride_dom, stride_dod,
                 stride_outb, stride_outh, stride_outm, stride_outn,
                 stride_lb, stride_lh, stride_kmb, stride_kmn, stride_qmb, stride_qmn,
                 stride_mb, stride_mh, stride_mm, stride_mn, stride_alb,
                 H, GROUP, Sq, Sk, D_QK, D_V, bottom_right, right, left, qk_scale_hi, qk_scale_lo,
                 softcap_hi, softcap_lo, log2e_hi, log2e_lo, dropout_p, drop_scale_hi, drop_scale_lo,
                 n_b, n_h, tiles_n,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
                 CAUSAL: tl.constexpr, WINDOW: tl.constexpr, KEY_MASK: tl.constexpr, QUERY_MASK: tl.constexpr,
                 LENS: tl.constexpr, VARLEN: tl.constexpr, MASK_KIND: tl.constexpr, EVERY_TILE: tl.constexpr,
                 SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, DROPOUT: tl.constexpr,
                 GRAD: tl.constexpr, SUM_M: tl.constexpr, SUM_N: tl.constexpr,
                 ACC: tl.constexpr, DOT_PREC: tl.constexpr):
    pid = tl.program_id(0)
    ho = tl.program_id(1)  # the output's head (0 when heads are summed)
    bo = tl.program_id(2)  # the output's batch (0 when batches are summed)
    tile_m = pid // tiles_n
    tile_n = pid % tiles_n
    offs_dqk = tl.arange(0, BLOCK_DQK)
    offs_dv = tl.arange(0, BLOCK_DV)
    qk_scale = scalar_in(qk_scale_hi, qk_scale_lo, ACC)
    drop_scale = scalar_in(drop_scale_hi, drop_scale_lo, ACC)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=ACC)  # (BLOCK_M, BLOCK_N) output tile
    for bi in range(0, n_b):
        b = bo + bi
        q_start, k_start, Sq_b, Sk_b, Sq_mem, Sk_mem, causal_shift, window_shift = seq_bounds(
            b, Sq, Sk, Q_LENS, KV_LENS, CU_Q, CU_K, bottom_right, right, left, LENS, VARLEN)
        m_lo = tile_m * BLOCK_M
        m_hi = m_lo + 1
        n_lo = tile_n * BLOCK_N
        n_hi = n_lo + 1
        if SUM_M:
            m_hi = Sq_b
        if SUM_N:
            n_hi = Sk_b
        for hi_ in range(0, n_h):
            h = ho + hi_
            kvh = h // GROUP
            softcap2, log2e, slope2, seed = modifier_scalars(b, h, AL, stride_alb, RNG, softcap_hi, softcap_lo,
                                                             log2e_hi, log2e_lo, ALIBI, DROPOUT, ACC)
            q_base = Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh + q_start.to(tl.int64) * stride_qm
            do_base = DO + b.to(tl.int64) * stride_dob + h.to(tl.int64) * stride_doh + q_start.to(tl.int64) * stride_dom
            k_base = K + b.to(tl.int64) * stride_kb + kvh.to(tl.int64) * stride_kh + k_start.to(tl.int64) * stride_kn
            v_base = V + b.to(tl.int64) * stride_vb + kvh.to(tl.int64) * stride_vh + k_start.to(tl.int64) * stride_vn
            row_base = b.to(tl.int64) * stride_lb + h.to(tl.int64) * stride_lh + q_start
            mb_base = MB + b.to(tl.int64) * stride_mb + h.to(tl.int64) * stride_mh
            for m0 in range(m_lo, m_hi, BLOCK_M):
                offs_m = m0 + tl.arange(0, BLOCK_M)
                row_ok = offs_m < Sq_b
                q = tl.load(q_base + offs_m[:, None] * stride_qm + offs_dqk[None, :] * stride_qd,
                            mask=row_ok[:, None] & (offs_dqk[None, :] < D_QK), other=0.0)  # (BLOCK_M, BLOCK_DQK)
                m2 = tl.load(M2 + row_base + offs_m, mask=row_ok, other=float("-inf"))
                m2 = tl.where(m2 == float("-inf"), float("inf"), m2)  # rows that see no key: P = 0
                inv_l = tl.exp2(-tl.load(L2 + row_base + offs_m, mask=row_ok, other=0.0))  # 1 / row sum
                if GRAD:
                    do = tl.load(do_base + offs_m[:, None] * stride_dom + offs_dv[None, :] * stride_dod,
                                 mask=row_ok[:, None] & (offs_dv[None, :] < D_V), other=0.0)  # (BLOCK_M, BLOCK_DV)
                    delta = tl.load(DELTA + row_base + offs_m, mask=row_ok, other=0.0)
                for n0 in range(n_lo, n_hi, BLOCK_N):
                    offs_n = n0 + tl.arange(0, BLOCK_N)
                    key_ok = offs_n[None, :] < Sk_b
                    kt = tl.load(k_base + offs_n[None, :] * stride_kn + offs_dqk[:, None] * stride_kd,
                                 mask=key_ok & (offs_dqk[:, None] < D_QK), other=0.0)  # (BLOCK_DQK, BLOCK_N)
                    s = tl.dot(q, kt, out_dtype=ACC, input_precision=DOT_PREC) * qk_scale  # (BLOCK_M, BLOCK_N)
                    s, t = score_mods(s, offs_m[:, None], offs_n[None, :], row_ok[:, None] & key_ok, mb_base,
                                      stride_mm, stride_mn, softcap2, slope2, Sk_b - Sq_b, log2e,
                                      MASK_KIND, SOFTCAP, ALIBI)
                    if KEY_MASK:
                        key_ok = tl.load(KM + b.to(tl.int64) * stride_kmb + offs_n[None, :] * stride_kmn,
                                         mask=key_ok, other=0) != 0
                    vis = visible(offs_m[:, None], offs_n[None, :], Sq_b, Sk_b, causal_shift, window_shift, key_ok,
                                  CAUSAL, WINDOW, KEY_MASK)
                    p = tl.where(vis, tl.exp2(s - m2[:, None]) * inv_l[:, None], 0.0)  # (BLOCK_M, BLOCK_N)
                    if GRAD:
                        vt = tl.load(v_base + offs_n[None, :] * stride_vn + offs_dv[:, None] * stride_vd,
                                     mask=(offs_n[None, :] < Sk_b) & (offs_dv[:, None] < D_V), other=0.0)
                        dp = tl.dot(do, vt, out_dtype=ACC, input_precision=DOT_PREC)  # (BLOCK_M, BLOCK_N)
                        if DROPOUT:
                            keep = dropout_keep(seed, b * H + h, offs_m[:, None], offs_n[None, :], Sk, dropout_p)
                            dp = tl.where(keep, dp * drop_scale, 0.0)
                        acc += p * (dp - delta[:, None])  # dL/d(bias) = dL/d(scores), natural units
                    else:
                        if DROPOUT:
                            keep = dropout_keep(seed, b * H + h, offs_m[:, None], offs_n[None, :], Sk, dropout_p)
                            p = tl.where(keep, p, -p)
                        acc = p

    out_base = OUT + bo.to(tl.int64) * stride_outb + ho.to(tl.int64) * stride_outh
    offs_m = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    if SUM_M and SUM_N:
        tl.store(out_base, tl.sum(tl.sum(acc, 1), 0).to(OUT.dtype.element_ty))
    elif SUM_M:
        tl.store(out_base + offs_n * stride_outn, tl.sum(acc, 0).to(OUT.dtype.element_ty), mask=offs_n < Sk)
    elif SUM_N:
        tl.store(out_base + offs_m * stride_outm, tl.sum(acc, 1).to(OUT.dtype.element_ty), mask=offs_m < Sq)
    else:
        tl.store(out_base + offs_m[:, None] * stride_outm + offs_n[None, :] * stride_outn,
                 acc.to(OUT.dtype.element_ty), mask=(offs_m[:, None] < Sq) & (offs_n[None, :] < Sk))


def plan_scores(q, k, v, m2, l2, out, *, scale: float, causal: bool, bottom_right: bool, spec: MaskSpec = NO_MASKS,
                do=None, delta=None, target=None) -> Launch:
    """The launch that fills `out` (4-D): with do/delta, the attn_mask gradient summed to out's shape
    (each dim 1 or full (B, Hq, Sq, Sk)); without, the probabilities (B, Hq, Sq, Sk), dropped
    entries negated. q, k, v: (B, H, S, D) views (varlen (1, H, total, D), out (nseq, H, max_q, max_k))."""
    H, D_QK = q.shape[1], q.shape[3]
    Hkv, D_V = k.shape[1], v.shape[3]
    target = target if target is not None else target_for(q)
    block_dqk, block_dv = head_block(D_QK), head_block(D_V)
    cfg = select_config("attn_scores", block_dqk, block_dv, q.element_size(), target, spec.modifies_scores)
    hi, lo = split_f32(scale * LOG2E)
    margs, B, Sq, Sk = mask_args(spec, causal, bottom_right, q, k, m2)
    grad = do is not None
    sum_b, sum_h = out.shape[0] == 1 and B > 1, out.shape[1] == 1 and H > 1
    sum_m, sum_n = out.shape[2] == 1 and Sq > 1, out.shape[3] == 1 and Sk > 1
    tiles_m = 1 if sum_m else cdiv(Sq, cfg.block_m)
    tiles_n = 1 if sum_n else cdiv(Sk, cfg.block_n)
    out_strides = [0 if n == 1 else st for n, st in zip(out.shape, out.stride())]
    args = dict(
        Q=q, K=k, V=v, DO=do if grad else q, M2=m2, L2=l2, DELTA=delta if grad else m2, OUT=out,
        **stride_args("q", q, spec), **stride_args("k", k, spec), **stride_args("v", v, spec),
        **stride_args("do", do if grad else q, spec),
        **{f"stride_out{ax}": st for ax, st in zip("bhmn", out_strides)},
        H=H, GROUP=H // Hkv, Sq=Sq, Sk=Sk, D_QK=D_QK, D_V=D_V, qk_scale_hi=hi, qk_scale_lo=lo,
        n_b=B if sum_b else 1, n_h=H if sum_h else 1, tiles_n=tiles_n,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_DQK=block_dqk, BLOCK_DV=block_dv,
        GRAD=grad, SUM_M=sum_m, SUM_N=sum_n,
        ACC=ACC_DTYPE[q.dtype], DOT_PREC=dot_precision(q.dtype), **margs,
    )
    grid = (tiles_m * tiles_n, 1 if sum_h else H, 1 if sum_b else B)
    est = estimate_shared_memory("attn_scores", cfg, block_dqk, block_dv, q.element_size(), target)
    return Launch(_attn_scores, grid, args, cfg, est)


def attention_probs(q, k, v, m2, l2, *, scale: float, causal: bool = False, bottom_right: bool = False,
                    spec: MaskSpec = NO_MASKS) -> torch.Tensor:
    """The attention probabilities of attention_forward's run (m2, l2 from it): (B, Hq, Sq, Sk) in the
    accumulator dtype (varlen: (nseq, Hq, max_seqlen_q, max_seqlen_k)), entries dropped by dropout
    negated, invisible ones 0. O(Sq * Sk) memory: for tests and small sizes."""
    B, Sq, Sk = q.shape[0], q.shape[2], k.shape[2]
    if spec.varlen:
        B, Sq, Sk = spec.cu_seqlens_q.shape[0] - 1, int(spec.max_seqlen_q), int(spec.max_seqlen_k)
    out = torch.zeros(B, q.shape[1], Sq, Sk, dtype=m2.dtype, device=q.device)
    if out.numel():
        plan_scores(q, k, v, m2, l2, out, scale=scale, causal=causal, bottom_right=bottom_right, spec=spec).run()
    return out


def compile_plans(target) -> list:
    """The bias-gradient kernel for head dims 64/128/256: fp16/bf16 with every option at once and
    the two kinds of broadcast (summed over batch; over heads and Sq), fp32 causal with a full
    bias; and the probabilities kernel (fp16, every option)."""
    from .attention_fwd import all_options_spec

    B, H, S = 2, 2, 128
    plans = []
    for d in (64, 128, 256):
        cases = [(dt, shape, True) for dt in (torch.float16, torch.bfloat16) for shape in ((1, H, S, S), (B, 1, 1, S))]
        cases += [(torch.float32, (B, H, S, S), True), (torch.float16, (B, H, S, S), False)]
        for dtype, shape, grad in cases:
            q, k, v, do = (torch.empty(B, H, S, d, dtype=dtype) for _ in range(4))
            m2, l2, delta = (torch.empty(B, H, S, dtype=torch.float32) for _ in range(3))
            if dtype == torch.float32:
                spec = MaskSpec(attn_mask=torch.empty(shape, dtype=dtype))
            else:
                spec = all_options_spec(B, S, H, shape, dtype)
            out = torch.empty(shape if grad else (B, H, S, S), dtype=dtype if grad else torch.float32)
            try:
                launch = plan_scores(q, k, v, m2, l2, out, scale=d ** -0.5, causal=True, bottom_right=False, spec=spec,
                                     do=do if grad else None, delta=delta if grad else None, target=target)
            except RuntimeError:  # no config fits: the backend reports it and never launches
                continue
            what = f"attn_dbias {shape}" if grad else "attn_probs"
            plans.append((f"{what} D={d} {str(dtype)[6:]}", launch))
    return plans
