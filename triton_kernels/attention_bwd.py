"""Flash attention backward: P is recomputed from the saved log-sum-exp, never stored.

Three kernels, no atomics, so gradients are bitwise reproducible:
1. `_attn_bwd_preprocess`: delta = rowsum(dO * O) (minus the lse cotangent, when there is one).
2. `_attn_bwd_dkdv`: one program owns a K/V tile of one (batch, kv head) and loops over the q
   tiles of every q head in its GQA group, so dK/dV are reduced over the group in registers.
3. `_attn_bwd_dq`: one program owns a q tile and loops over the K/V tiles it can see.
With s2 = q.k * scale * log2(e) and P = exp2(s2 - lse2):
    dV = P^T dO,  dP = dO V^T,  dS = P * (dP - delta),  dQ = scale * dS K,  dK = scale * dS^T Q.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .attention_common import kv_loop_bounds, q_loop_bounds, scalar_in, visible
from .configs import PREPROCESS_BLOCK_M, estimate_shared_memory, select_config
from .launch import ACC_DTYPE, TORCH_ACC_DTYPE, LOG2E, Launch, dot_precision, head_block, split_f32, target_for


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
def _dkdv_tiles(dk, dv, k, v, q_base, do_base, lse_base, delta_base, offs_n, start, end, Sq, Sk, causal_shift,
                qk_scale, stride_qm, stride_qd, stride_dom, stride_dod, D_QK, D_V,
                BLOCK_M: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
                MASKED: tl.constexpr, CAUSAL: tl.constexpr, ACC: tl.constexpr, DOT_PREC: tl.constexpr):
    """Add the contributions of q rows [start, end) of one head to this K/V tile's dK, dV."""
    offs_dqk = tl.arange(0, BLOCK_DQK)
    offs_dv = tl.arange(0, BLOCK_DV)
    for start_m in range(start, end, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        # rows past Sq read as zeros (q, dO, delta) so they add nothing
        qt = tl.load(q_base + offs_m[None, :] * stride_qm + offs_dqk[:, None] * stride_qd,
                     mask=(offs_m[None, :] < Sq) & (offs_dqk[:, None] < D_QK), other=0.0)  # (BLOCK_DQK, BLOCK_M)
        do = tl.load(do_base + offs_m[:, None] * stride_dom + offs_dv[None, :] * stride_dod,
                     mask=(offs_m[:, None] < Sq) & (offs_dv[None, :] < D_V), other=0.0)  # (BLOCK_M, BLOCK_DV)
        lse = tl.load(lse_base + offs_m, mask=offs_m < Sq, other=0.0)
        delta = tl.load(delta_base + offs_m, mask=offs_m < Sq, other=0.0)
        lse = tl.where(lse == float("-inf"), 0.0, lse)  # rows that see no key: all their scores are masked
        st = tl.dot(k, qt, out_dtype=ACC, input_precision=DOT_PREC) * qk_scale  # (BLOCK_N, BLOCK_M) = S^T
        pt = tl.exp2(st - lse[None, :])
        if MASKED:
            pt = tl.where(visible(offs_m[None, :], offs_n[:, None], Sq, Sk, causal_shift, CAUSAL), pt, 0.0)
        dv += tl.dot(pt.to(do.dtype), do, out_dtype=ACC, input_precision=DOT_PREC)
        dpt = tl.dot(v, tl.trans(do), out_dtype=ACC, input_precision=DOT_PREC)  # (BLOCK_N, BLOCK_M) = dP^T
        dst = pt * (dpt - delta[None, :])
        dk += tl.dot(dst.to(qt.dtype), tl.trans(qt), out_dtype=ACC, input_precision=DOT_PREC)
    return dk, dv


@triton.jit
def _attn_bwd_dkdv(Q, K, V, DO, LSE, DELTA, DK, DV,
                   stride_qb, stride_qh, stride_qm, stride_qd,
                   stride_kb, stride_kh, stride_kn, stride_kd,
                   stride_vb, stride_vh, stride_vn, stride_vd,
                   stride_dob, stride_doh, stride_dom, stride_dod,
                   stride_dkb, stride_dkh, stride_dkn, stride_dkd,
                   stride_dvb, stride_dvh, stride_dvn, stride_dvd,
                   H, GROUP, Sq, Sk, D_QK, D_V, causal_shift,
                   qk_scale_hi, qk_scale_lo, sm_scale_hi, sm_scale_lo,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
                   CAUSAL: tl.constexpr, ACC: tl.constexpr, DOT_PREC: tl.constexpr):
    pid_n = tl.program_id(0)
    kvh = tl.program_id(1)
    b = tl.program_id(2)
    n0 = pid_n * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_dqk = tl.arange(0, BLOCK_DQK)
    offs_dv = tl.arange(0, BLOCK_DV)
    k = tl.load(K + b.to(tl.int64) * stride_kb + kvh.to(tl.int64) * stride_kh
                + offs_n[:, None] * stride_kn + offs_dqk[None, :] * stride_kd,
                mask=(offs_n[:, None] < Sk) & (offs_dqk[None, :] < D_QK), other=0.0)  # (BLOCK_N, BLOCK_DQK)
    v = tl.load(V + b.to(tl.int64) * stride_vb + kvh.to(tl.int64) * stride_vh
                + offs_n[:, None] * stride_vn + offs_dv[None, :] * stride_vd,
                mask=(offs_n[:, None] < Sk) & (offs_dv[None, :] < D_V), other=0.0)  # (BLOCK_N, BLOCK_DV)
    qk_scale = scalar_in(qk_scale_hi, qk_scale_lo, ACC)
    dk = tl.zeros([BLOCK_N, BLOCK_DQK], dtype=ACC)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=ACC)

    lo, free_lo, free_hi, hi = q_loop_bounds(n0, Sq, Sk, causal_shift, BLOCK_M, BLOCK_N, CAUSAL)
    for g in range(0, GROUP):  # the q heads that share this K/V head, reduced here: no atomics
        h = kvh * GROUP + g
        q_base = Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
        do_base = DO + b.to(tl.int64) * stride_dob + h.to(tl.int64) * stride_doh
        row_base = (b * H + h).to(tl.int64) * Sq
        # masked tiles before the unmasked range (causal diagonal), unmasked, masked tail
        dk, dv = _dkdv_tiles(dk, dv, k, v, q_base, do_base, LSE + row_base, DELTA + row_base, offs_n,
                             lo, tl.minimum(free_lo, hi), Sq, Sk, causal_shift, qk_scale,
                             stride_qm, stride_qd, stride_dom, stride_dod, D_QK, D_V,
                             BLOCK_M, BLOCK_DQK, BLOCK_DV, True, CAUSAL, ACC, DOT_PREC)
        dk, dv = _dkdv_tiles(dk, dv, k, v, q_base, do_base, LSE + row_base, DELTA + row_base, offs_n,
                             free_lo, free_hi, Sq, Sk, causal_shift, qk_scale,
                             stride_qm, stride_qd, stride_dom, stride_dod, D_QK, D_V,
                             BLOCK_M, BLOCK_DQK, BLOCK_DV, False, CAUSAL, ACC, DOT_PREC)
        dk, dv = _dkdv_tiles(dk, dv, k, v, q_base, do_base, LSE + row_base, DELTA + row_base, offs_n,
                             tl.maximum(free_lo, free_hi), hi, Sq, Sk, causal_shift, qk_scale,
                             stride_qm, stride_qd, stride_dom, stride_dod, D_QK, D_V,
                             BLOCK_M, BLOCK_DQK, BLOCK_DV, True, CAUSAL, ACC, DOT_PREC)

    dk = dk * scalar_in(sm_scale_hi, sm_scale_lo, ACC)
    tl.store(DK + b.to(tl.int64) * stride_dkb + kvh.to(tl.int64) * stride_dkh
             + offs_n[:, None] * stride_dkn + offs_dqk[None, :] * stride_dkd, dk.to(DK.dtype.element_ty),
             mask=(offs_n[:, None] < Sk) & (offs_dqk[None, :] < D_QK))
    tl.store(DV + b.to(tl.int64) * stride_dvb + kvh.to(tl.int64) * stride_dvh
             + offs_n[:, None] * stride_dvn + offs_dv[None, :] * stride_dvd, dv.to(DV.dtype.element_ty),
             mask=(offs_n[:, None] < Sk) & (offs_dv[None, :] < D_V))


@triton.jit
def _dq_tiles(dq, q, do, lse, delta, k_base, v_base, offs_m, start, end, Sq, Sk, causal_shift, qk_scale,
              stride_kn, stride_kd, stride_vn, stride_vd, D_QK, D_V,
              BLOCK_N: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
              MASKED: tl.constexpr, CAUSAL: tl.constexpr, ACC: tl.constexpr, DOT_PREC: tl.constexpr):
    """Add the contributions of key tiles [start, end) to this q tile's dQ (unscaled)."""
    offs_dqk = tl.arange(0, BLOCK_DQK)
    offs_dv = tl.arange(0, BLOCK_DV)
    for start_n in range(start, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kt = tl.load(k_base + offs_n[None, :] * stride_kn + offs_dqk[:, None] * stride_kd,
                     mask=(offs_n[None, :] < Sk) & (offs_dqk[:, None] < D_QK), other=0.0)  # (BLOCK_DQK, BLOCK_N)
        vt = tl.load(v_base + offs_n[None, :] * stride_vn + offs_dv[:, None] * stride_vd,
                     mask=(offs_n[None, :] < Sk) & (offs_dv[:, None] < D_V), other=0.0)  # (BLOCK_DV, BLOCK_N)
        s = tl.dot(q, kt, out_dtype=ACC, input_precision=DOT_PREC) * qk_scale  # (BLOCK_M, BLOCK_N)
        p = tl.exp2(s - lse[:, None])
        if MASKED:
            p = tl.where(visible(offs_m[:, None], offs_n[None, :], Sq, Sk, causal_shift, CAUSAL), p, 0.0)
        dp = tl.dot(do, vt, out_dtype=ACC, input_precision=DOT_PREC)  # (BLOCK_M, BLOCK_N)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(kt.dtype), tl.trans(kt), out_dtype=ACC, input_precision=DOT_PREC)
    return dq


@triton.jit
def _attn_bwd_dq(Q, K, V, DO, LSE, DELTA, DQ,
                 stride_qb, stride_qh, stride_qm, stride_qd,
                 stride_kb, stride_kh, stride_kn, stride_kd,
                 stride_vb, stride_vh, stride_vn, stride_vd,
                 stride_dob, stride_doh, stride_dom, stride_dod,
                 stride_dqb, stride_dqh, stride_dqm, stride_dqd,
                 H, GROUP, Sq, Sk, D_QK, D_V, causal_shift,
                 qk_scale_hi, qk_scale_lo, sm_scale_hi, sm_scale_lo,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
                 CAUSAL: tl.constexpr, ACC: tl.constexpr, DOT_PREC: tl.constexpr):
    pid_m = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)  # grid (q tiles, heads, batch): each axis stays within CUDA's limits
    pid_bh = b * H + h
    kvh = h // GROUP
    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_dqk = tl.arange(0, BLOCK_DQK)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_mask = offs_m < Sq
    q = tl.load(Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
                + offs_m[:, None] * stride_qm + offs_dqk[None, :] * stride_qd,
                mask=row_mask[:, None] & (offs_dqk[None, :] < D_QK), other=0.0)  # (BLOCK_M, BLOCK_DQK)
    do = tl.load(DO + b.to(tl.int64) * stride_dob + h.to(tl.int64) * stride_doh
                 + offs_m[:, None] * stride_dom + offs_dv[None, :] * stride_dod,
                 mask=row_mask[:, None] & (offs_dv[None, :] < D_V), other=0.0)  # (BLOCK_M, BLOCK_DV)
    row = pid_bh.to(tl.int64) * Sq + offs_m
    lse = tl.load(LSE + row, mask=row_mask, other=0.0)
    lse = tl.where(lse == float("-inf"), 0.0, lse)  # rows that see no key: every tile is masked
    delta = tl.load(DELTA + row, mask=row_mask, other=0.0)
    qk_scale = scalar_in(qk_scale_hi, qk_scale_lo, ACC)
    dq = tl.zeros([BLOCK_M, BLOCK_DQK], dtype=ACC)

    k_base = K + b.to(tl.int64) * stride_kb + kvh.to(tl.int64) * stride_kh
    v_base = V + b.to(tl.int64) * stride_vb + kvh.to(tl.int64) * stride_vh
    full_end, end = kv_loop_bounds(m0, Sk, causal_shift, BLOCK_M, BLOCK_N, CAUSAL)
    dq = _dq_tiles(dq, q, do, lse, delta, k_base, v_base, offs_m, 0, full_end, Sq, Sk, causal_shift, qk_scale,
                   stride_kn, stride_kd, stride_vn, stride_vd, D_QK, D_V,
                   BLOCK_N, BLOCK_DQK, BLOCK_DV, False, CAUSAL, ACC, DOT_PREC)
    dq = _dq_tiles(dq, q, do, lse, delta, k_base, v_base, offs_m, full_end, end, Sq, Sk, causal_shift, qk_scale,
                   stride_kn, stride_kd, stride_vn, stride_vd, D_QK, D_V,
                   BLOCK_N, BLOCK_DQK, BLOCK_DV, True, CAUSAL, ACC, DOT_PREC)
    dq = dq * scalar_in(sm_scale_hi, sm_scale_lo, ACC)
    tl.store(DQ + b.to(tl.int64) * stride_dqb + h.to(tl.int64) * stride_dqh
             + offs_m[:, None] * stride_dqm + offs_dqk[None, :] * stride_dqd, dq.to(DQ.dtype.element_ty),
             mask=row_mask[:, None] & (offs_dqk[None, :] < D_QK))


def _s(prefix: str, t: torch.Tensor) -> dict:
    return {f"stride_{prefix}{ax}": st for ax, st in zip("bhmd" if prefix in ("q", "o", "do", "dq") else "bhnd",
                                                         t.stride())}


def plan_backward(do, q, k, v, out, lse2, delta, dq, dk, dv, *, scale: float, causal: bool,
                  bottom_right: bool, dlse2: torch.Tensor | None = None, target=None) -> list[Launch]:
    """The three launches of the backward (preprocess, dK/dV, dQ), in order."""
    B, H, Sq, D_QK = q.shape
    Hkv, Sk, D_V = k.shape[1], k.shape[2], v.shape[3]
    target = target if target is not None else target_for(q)
    block_dqk, block_dv = head_block(D_QK), head_block(D_V)
    acc = ACC_DTYPE[q.dtype]
    prec = dot_precision(q.dtype)
    causal_shift = (Sk - Sq) if (causal and bottom_right) else 0
    qk_hi, qk_lo = split_f32(scale * LOG2E)
    sm_hi, sm_lo = split_f32(scale)
    # dlse2 is the cotangent of lse2 (log2 units); dS needs that of the natural lse: dlse2 * log2(e)
    dl_hi, dl_lo = split_f32(LOG2E)

    pre = Launch(_attn_bwd_preprocess, (triton.cdiv(Sq, PREPROCESS_BLOCK_M), H, B), dict(
        O=out, DO=do, DLSE=dlse2 if dlse2 is not None else delta, DELTA=delta,
        **_s("o", out), **_s("do", do), H=H, Sq=Sq, D_V=D_V, dlse_scale_hi=dl_hi, dlse_scale_lo=dl_lo,
        BLOCK_M=PREPROCESS_BLOCK_M, BLOCK_DV=block_dv, HAS_DLSE=dlse2 is not None, ACC=acc))

    common = dict(Q=q, K=k, V=v, DO=do, LSE=lse2, DELTA=delta, **_s("q", q), **_s("k", k), **_s("v", v),
                  **_s("do", do), Sq=Sq, Sk=Sk, D_QK=D_QK, D_V=D_V, causal_shift=causal_shift,
                  qk_scale_hi=qk_hi, qk_scale_lo=qk_lo, sm_scale_hi=sm_hi, sm_scale_lo=sm_lo,
                  BLOCK_DQK=block_dqk, BLOCK_DV=block_dv, CAUSAL=causal, ACC=acc, DOT_PREC=prec)
    c1 = select_config("attn_bwd_dkdv", block_dqk, block_dv, q.element_size(), target)
    dkdv = Launch(_attn_bwd_dkdv, (triton.cdiv(Sk, c1.block_n), Hkv, B), dict(
        common, DK=dk, DV=dv, **_s("dk", dk), **_s("dv", dv), H=H, GROUP=H // Hkv,
        BLOCK_M=c1.block_m, BLOCK_N=c1.block_n), c1,
        estimate_shared_memory("attn_bwd_dkdv", c1, block_dqk, block_dv, q.element_size()))
    c2 = select_config("attn_bwd_dq", block_dqk, block_dv, q.element_size(), target)
    dqk = Launch(_attn_bwd_dq, (triton.cdiv(Sq, c2.block_m), H, B), dict(
        common, DQ=dq, **_s("dq", dq), H=H, GROUP=H // Hkv, BLOCK_M=c2.block_m, BLOCK_N=c2.block_n), c2,
        estimate_shared_memory("attn_bwd_dq", c2, block_dqk, block_dv, q.element_size()))
    return [pre, dkdv, dqk]


def attention_backward(do, q, k, v, out, lse2, *, scale: float, causal: bool = False, bottom_right: bool = False,
                       dlse2: torch.Tensor | None = None, grads=None):
    """Gradients of attention_forward. Shapes as there; do is dL/dout, dlse2 an optional dL/dlse2.

    Returns (dq, dk, dv) shaped like (q, k, v), written into `grads` when given (any strides with
    a unit last stride).
    """
    dq, dk, dv = grads if grads is not None else (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))
    if q.numel() == 0 or k.numel() == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    delta = torch.empty(lse2.shape, dtype=TORCH_ACC_DTYPE[q.dtype], device=q.device)
    for launch in plan_backward(do, q, k, v, out, lse2, delta, dq, dk, dv, scale=scale, causal=causal,
                                bottom_right=bottom_right, dlse2=dlse2):
        launch.run()
    return dq, dk, dv


def compile_plans(target) -> list:
    """Every backward config `target` can launch (head dims 64/128/256; fp16, bf16, fp32; causal or not)."""
    plans = []
    for d in (64, 128, 256):
        for dtype in (torch.float16, torch.bfloat16, torch.float32):
            for causal in ((False, True) if dtype == torch.float16 else (True,)):
                q, k, v, o, do, dq, dk, dv = (torch.empty(1, 2, 128, d, dtype=dtype) for _ in range(8))
                lse2, delta = (torch.empty(1, 2, 128, dtype=torch.float32) for _ in range(2))
                try:
                    pre, dkdv, dqk = plan_backward(do, q, k, v, o, lse2, delta, dq, dk, dv, scale=d ** -0.5,
                                                   causal=causal, bottom_right=False, target=target)
                except RuntimeError:  # no config fits: the backend reports it and never launches
                    continue
                tag = f"D={d} {str(dtype)[6:]} causal={causal}"
                if causal:
                    plans.append((f"attn_bwd_preprocess {tag}", pre))
                plans += [(f"attn_bwd_dkdv {tag}", dkdv), (f"attn_bwd_dq {tag}", dqk)]
    return plans
