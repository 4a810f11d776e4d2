"""Flash attention forward: tiled over K/V with an online softmax (no autograd here).

One program owns BLOCK_M query rows of one (batch, q head) and streams the K/V tiles its rows can
see, keeping the running row max `m`, row sum `l` and output accumulator in registers. It writes
O and the per-row log-sum-exp (log2 units) that the backward uses to recompute P.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .attention_common import kv_loop_bounds, scalar_in, visible
from .configs import estimate_shared_memory, select_config
from .launch import ACC_DTYPE, TORCH_ACC_DTYPE, LOG2E, Launch, dot_precision, head_block, split_f32, target_for


@triton.jit
def _fwd_tiles(acc, m_i, l_i, q, k_base, v_base, offs_m, start, end, Sq, Sk, causal_shift, qk_scale,
               stride_kn, stride_kd, stride_vn, stride_vd, D_QK, D_V,
               BLOCK_N: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
               MASKED: tl.constexpr, CAUSAL: tl.constexpr, ACC: tl.constexpr, DOT_PREC: tl.constexpr):
    """Fold key tiles [start, end) into the online-softmax state (acc, m_i, l_i)."""
    offs_dqk = tl.arange(0, BLOCK_DQK)
    offs_dv = tl.arange(0, BLOCK_DV)
    for start_n in range(start, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        # K^T tile (BLOCK_DQK, BLOCK_N) and V tile (BLOCK_N, BLOCK_DV); rows past Sk read as 0
        kt = tl.load(k_base + offs_n[None, :] * stride_kn + offs_dqk[:, None] * stride_kd,
                     mask=(offs_n[None, :] < Sk) & (offs_dqk[:, None] < D_QK), other=0.0)
        v = tl.load(v_base + offs_n[:, None] * stride_vn + offs_dv[None, :] * stride_vd,
                    mask=(offs_n[:, None] < Sk) & (offs_dv[None, :] < D_V), other=0.0)
        s = tl.dot(q, kt, out_dtype=ACC, input_precision=DOT_PREC) * qk_scale  # (BLOCK_M, BLOCK_N), log2 units
        if MASKED:
            vis = visible(offs_m[:, None], offs_n[None, :], Sq, Sk, causal_shift, CAUSAL)
            s = tl.where(vis, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # a row with nothing visible so far keeps m = -inf; subtract 0 instead of -inf
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_ref = m_new
        p = tl.exp2(s - m_ref[:, None])  # (BLOCK_M, BLOCK_N)
        alpha = tl.exp2(m_i - m_ref)  # rescales what was accumulated under the old max
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, out_dtype=ACC, input_precision=DOT_PREC)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _attn_fwd(Q, K, V, O, LSE,
              stride_qb, stride_qh, stride_qm, stride_qd,
              stride_kb, stride_kh, stride_kn, stride_kd,
              stride_vb, stride_vh, stride_vn, stride_vd,
              stride_ob, stride_oh, stride_om, stride_od,
              H, GROUP, Sq, Sk, D_QK, D_V, causal_shift, qk_scale_hi, qk_scale_lo,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
              CAUSAL: tl.constexpr, ACC: tl.constexpr, DOT_PREC: tl.constexpr):
    pid_m = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)  # grid (q tiles, heads, batch): each axis stays within CUDA's limits
    pid_bh = b * H + h
    kvh = h // GROUP  # GQA/MQA: q heads [kvh*GROUP, (kvh+1)*GROUP) share K/V head kvh
    m0 = pid_m * BLOCK_M
    q_base = Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
    k_base = K + b.to(tl.int64) * stride_kb + kvh.to(tl.int64) * stride_kh
    v_base = V + b.to(tl.int64) * stride_vb + kvh.to(tl.int64) * stride_vh
    o_base = O + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh

    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_dqk = tl.arange(0, BLOCK_DQK)
    offs_dv = tl.arange(0, BLOCK_DV)
    q = tl.load(q_base + offs_m[:, None] * stride_qm + offs_dqk[None, :] * stride_qd,
                mask=(offs_m[:, None] < Sq) & (offs_dqk[None, :] < D_QK), other=0.0)  # (BLOCK_M, BLOCK_DQK)
    qk_scale = scalar_in(qk_scale_hi, qk_scale_lo, ACC)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=ACC)  # running row max (log2 units)
    l_i = tl.zeros([BLOCK_M], dtype=ACC)  # running row sum of exp2(s - m)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=ACC)  # running P @ V

    full_end, end = kv_loop_bounds(m0, Sk, causal_shift, BLOCK_M, BLOCK_N, CAUSAL)
    acc, m_i, l_i = _fwd_tiles(acc, m_i, l_i, q, k_base, v_base, offs_m, 0, full_end, Sq, Sk, causal_shift,
                               qk_scale, stride_kn, stride_kd, stride_vn, stride_vd, D_QK, D_V,
                               BLOCK_N, BLOCK_DQK, BLOCK_DV, False, CAUSAL, ACC, DOT_PREC)
    acc, m_i, l_i = _fwd_tiles(acc, m_i, l_i, q, k_base, v_base, offs_m, full_end, end, Sq, Sk, causal_shift,
                               qk_scale, stride_kn, stride_kd, stride_vn, stride_vd, D_QK, D_V,
                               BLOCK_N, BLOCK_DQK, BLOCK_DV, True, CAUSAL, ACC, DOT_PREC)

    # Rows that saw no key (bottom-right causal with Sq > Sk) have l = 0: output 0, lse = -inf.
    empty = l_i == 0.0
    o = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
    tl.store(o_base + offs_m[:, None] * stride_om + offs_dv[None, :] * stride_od, o.to(O.dtype.element_ty),
             mask=(offs_m[:, None] < Sq) & (offs_dv[None, :] < D_V))
    tl.store(LSE + pid_bh.to(tl.int64) * Sq + offs_m, lse, mask=offs_m < Sq)


def plan_forward(q, k, v, out, lse2, *, scale: float, causal: bool, bottom_right: bool, target=None) -> Launch:
    """The launch that computes out and lse2 from q, k, v (all (B, H, S, D) views)."""
    B, H, Sq, D_QK = q.shape
    Hkv, Sk, D_V = k.shape[1], k.shape[2], v.shape[3]
    target = target if target is not None else target_for(q)
    block_dqk, block_dv = head_block(D_QK), head_block(D_V)
    cfg = select_config("attn_fwd", block_dqk, block_dv, q.element_size(), target)
    hi, lo = split_f32(scale * LOG2E)
    args = dict(
        Q=q, K=k, V=v, O=out, LSE=lse2,
        stride_qb=q.stride(0), stride_qh=q.stride(1), stride_qm=q.stride(2), stride_qd=q.stride(3),
        stride_kb=k.stride(0), stride_kh=k.stride(1), stride_kn=k.stride(2), stride_kd=k.stride(3),
        stride_vb=v.stride(0), stride_vh=v.stride(1), stride_vn=v.stride(2), stride_vd=v.stride(3),
        stride_ob=out.stride(0), stride_oh=out.stride(1), stride_om=out.stride(2), stride_od=out.stride(3),
        H=H, GROUP=H // Hkv, Sq=Sq, Sk=Sk, D_QK=D_QK, D_V=D_V,
        causal_shift=(Sk - Sq) if (causal and bottom_right) else 0,
        qk_scale_hi=hi, qk_scale_lo=lo,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_DQK=block_dqk, BLOCK_DV=block_dv,
        CAUSAL=causal, ACC=ACC_DTYPE[q.dtype], DOT_PREC=dot_precision(q.dtype),
    )
    grid = (triton.cdiv(Sq, cfg.block_m), H, B)
    est = estimate_shared_memory("attn_fwd", cfg, block_dqk, block_dv, q.element_size())
    return Launch(_attn_fwd, grid, args, cfg, est)


def attention_forward(q, k, v, *, scale: float, causal: bool = False, bottom_right: bool = False,
                      out: torch.Tensor | None = None):
    """Flash attention forward on (B, H, S, D) views (any strides with a unit last stride).

    q: (B, Hq, Sq, Dqk); k: (B, Hkv, Sk, Dqk); v: (B, Hkv, Sk, Dv), Hq a multiple of Hkv.
    Returns (out, lse2): out (B, Hq, Sq, Dv) in q's dtype (written into `out` if given);
    lse2 (B, Hq, Sq) contiguous, fp32 (fp64 for fp64 inputs), the row log-sum-exp of the scaled
    scores in log2 units, -inf for rows that see no key (their output is 0).
    """
    B, H, Sq, _ = q.shape
    if out is None:
        out = torch.empty(B, H, Sq, v.shape[3], dtype=q.dtype, device=q.device)
    lse2 = torch.empty(B, H, Sq, dtype=TORCH_ACC_DTYPE[q.dtype], device=q.device)
    if out.numel() == 0:
        return out, lse2
    plan_forward(q, k, v, out, lse2, scale=scale, causal=causal, bottom_right=bottom_right).run()
    return out, lse2


def compile_plans(target) -> list:
    """Every forward config `target` can launch (head dims 64/128/256; fp16, bf16, fp32; causal or not).

    For the compile check: small CPU tensors whose strides match a real (B, H, S, D) launch.
    """
    plans = []
    for d in (64, 128, 256):
        for dtype in (torch.float16, torch.bfloat16, torch.float32):
            for causal in ((False, True) if dtype == torch.float16 else (True,)):
                q, k, v, o = (torch.empty(1, 2, 128, d, dtype=dtype) for _ in range(4))
                lse2 = torch.empty(1, 2, 128, dtype=torch.float32)
                try:
                    launch = plan_forward(q, k, v, o, lse2, scale=d ** -0.5, causal=causal, bottom_right=False,
                                          target=target)
                except RuntimeError:  # no config fits: the backend reports it and never launches
                    continue
                plans.append((f"attn_fwd D={d} {str(dtype)[6:]} causal={causal}", launch))
    return plans
