"""Fused rotary position embedding (RoPE): one kernel for forward and backward (no autograd here).

For each token at position p and each pair index j < R2 = rotary_dim / 2, the pair (x1, x2) is
rotated by theta = angle(p, j), with c = cos[p, j], s = sin[p, j]:

    out1 = x1 * c - x2 * s        half (NeoX/LLaMA) style: x1 = x[j], x2 = x[j + R2]
    out2 = x1 * s + x2 * c        interleaved (GPT-J) style: x1 = x[2j], x2 = x[2j + 1]

Columns from rotary_dim to D are copied unchanged (partial rotary). The backward is the same
kernel with CONJUGATE (rotation by -theta, i.e. s -> -s), since the rotation is orthogonal.

Addressing: x is a (B, S, H, D) view with any strides, so (B, H, S, D) tensors run without
copies. Packed varlen x (total, H, D) is passed as a (1, total, H, D) view with VARLEN: program
b then covers rows cu_seqlens[b] .. cu_seqlens[b+1]. One launch can rotate two tensors (q and k,
with different head counts) that share positions and cos/sin. cos/sin are (Bc, seqlen_ro, R2)
with a batch stride that is 0 for a shared table. Math is fp32 (fp64 for fp64 inputs); positions
outside [0, seqlen_ro) give NaN rows, since checking them on the host would need a device sync.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .configs import ElementwiseConfig, Target, rotary_config
from .launch import ACC_DTYPE, Launch, target_for

MIN_BLOCK = 2  # smallest tl.arange width used for the rotary and pass-through column blocks


@triton.jit
def _rotate_head(x_rows, o_rows, row_mask, cos, sin, offs_j, offs_p, R2, D_REST, stride_xd, stride_od,
                 INTERLEAVED: tl.constexpr, COPY_REST: tl.constexpr, ACC: tl.constexpr):
    """Rotate one head of BLOCK_S tokens. x_rows/o_rows: (BLOCK_S,) int64 element offsets of
    x[.., 0] / out[.., 0] added to the base pointers by the caller (passed as pointer blocks)."""
    jm = row_mask[:, None] & (offs_j[None, :] < R2)  # (BLOCK_S, BLOCK_R2)
    if INTERLEAVED:
        c1 = 2 * offs_j
        c2 = c1 + 1
    else:
        c1 = offs_j
        c2 = offs_j + R2
    x1 = tl.load(x_rows[:, None] + c1[None, :] * stride_xd, mask=jm, other=0.0).to(ACC)  # (BLOCK_S, BLOCK_R2)
    x2 = tl.load(x_rows[:, None] + c2[None, :] * stride_xd, mask=jm, other=0.0).to(ACC)
    o1 = x1 * cos - x2 * sin
    o2 = x1 * sin + x2 * cos
    tl.store(o_rows[:, None] + c1[None, :] * stride_od, o1.to(o_rows.dtype.element_ty), mask=jm)
    tl.store(o_rows[:, None] + c2[None, :] * stride_od, o2.to(o_rows.dtype.element_ty), mask=jm)
    if COPY_REST:  # partial rotary, out of place: columns [2 * R2, D) pass through unchanged
        cp = 2 * R2 + offs_p
        pm = row_mask[:, None] & (offs_p[None, :] < D_REST)  # (BLOCK_S, BLOCK_REST)
        rest = tl.load(x_rows[:, None] + cp[None, :] * stride_xd, mask=pm, other=0.0)
        tl.store(o_rows[:, None] + cp[None, :] * stride_od, rest, mask=pm)


@triton.jit
def _rotary_kernel(Q, K, QO, KO, COS, SIN, OFFSETS, POS, CU_SEQLENS,
                   stride_qb, stride_qs, stride_qh, stride_qd,
                   stride_qob, stride_qos, stride_qoh, stride_qod,
                   stride_kb, stride_ks, stride_kh, stride_kd,
                   stride_kob, stride_kos, stride_koh, stride_kod,
                   stride_cb, stride_cs, stride_cd, stride_sb, stride_ss, stride_sd,
                   stride_pb, stride_ps,
                   S, HQ, HK, R2, D_REST, seqlen_ro, pos_offset,
                   BLOCK_S: tl.constexpr, BLOCK_R2: tl.constexpr, BLOCK_REST: tl.constexpr,
                   HEADS_PER_PROG: tl.constexpr, INTERLEAVED: tl.constexpr, CONJUGATE: tl.constexpr,
                   HAS_K: tl.constexpr, VARLEN: tl.constexpr, HAS_OFFSETS: tl.constexpr,
                   HAS_POS: tl.constexpr, COPY_REST: tl.constexpr, ACC: tl.constexpr):
    pid_s = tl.program_id(0)
    b = tl.program_id(1)  # batch index (varlen: sequence index)
    pid_h = tl.program_id(2)  # head group: q groups first, then k groups
    if VARLEN:
        start = tl.load(CU_SEQLENS + b).to(tl.int64)  # first row of sequence b in (total, H, D)
        seqlen = tl.load(CU_SEQLENS + b + 1).to(tl.int64) - start
        xb = 0  # rows are absolute: the batch stride is unused
    else:
        start = 0
        seqlen = S
        xb = b.to(tl.int64)
    offs_s = pid_s * BLOCK_S + tl.arange(0, BLOCK_S)  # (BLOCK_S,) index within the sequence
    row_mask = offs_s < seqlen
    rows = start + offs_s.to(tl.int64)  # (BLOCK_S,) row in x's sequence dim

    # positions (BLOCK_S,): explicit ids, or index + per-batch / global offset
    if HAS_POS:
        pos = tl.load(POS + xb * stride_pb + rows * stride_ps, mask=row_mask, other=0).to(tl.int64)
    elif HAS_OFFSETS:
        pos = rows - start + tl.load(OFFSETS + b).to(tl.int64)
    else:
        pos = rows - start + pos_offset
    in_range = (pos >= 0) & (pos < seqlen_ro)
    safe_pos = tl.where(in_range, pos, 0)

    # cos/sin tile (BLOCK_S, BLOCK_R2) in the accumulator dtype, loaded once for all heads
    offs_j = tl.arange(0, BLOCK_R2)
    cmask = row_mask[:, None] & (offs_j[None, :] < R2)
    cb = b.to(tl.int64)
    cos = tl.load(COS + cb * stride_cb + safe_pos[:, None] * stride_cs + offs_j[None, :] * stride_cd,
                  mask=cmask, other=0.0).to(ACC)
    sin = tl.load(SIN + cb * stride_sb + safe_pos[:, None] * stride_ss + offs_j[None, :] * stride_sd,
                  mask=cmask, other=0.0).to(ACC)
    cos = tl.where(in_range[:, None], cos, float("nan"))  # out-of-range positions poison their rows
    if CONJUGATE:
        sin = -sin  # rotation by -theta: the backward
    offs_p = tl.arange(0, BLOCK_REST)

    n_q_groups = tl.cdiv(HQ, HEADS_PER_PROG)
    if pid_h < n_q_groups:
        q_rows = Q + xb * stride_qb + rows * stride_qs  # (BLOCK_S,) pointers to q[b, s, 0, 0]
        qo_rows = QO + xb * stride_qob + rows * stride_qos
        h0 = pid_h * HEADS_PER_PROG
        for h in range(h0, tl.minimum(h0 + HEADS_PER_PROG, HQ)):
            hh = tl.cast(h, tl.int64)
            _rotate_head(q_rows + hh * stride_qh, qo_rows + hh * stride_qoh, row_mask, cos, sin, offs_j, offs_p,
                         R2, D_REST, stride_qd, stride_qod, INTERLEAVED, COPY_REST, ACC)
    elif HAS_K:
        k_rows = K + xb * stride_kb + rows * stride_ks
        ko_rows = KO + xb * stride_kob + rows * stride_kos
        h0 = (pid_h - n_q_groups) * HEADS_PER_PROG
        for h in range(h0, tl.minimum(h0 + HEADS_PER_PROG, HK)):
            hh = tl.cast(h, tl.int64)
            _rotate_head(k_rows + hh * stride_kh, ko_rows + hh * stride_koh, row_mask, cos, sin, offs_j, offs_p,
                         R2, D_REST, stride_kd, stride_kod, INTERLEAVED, COPY_REST, ACC)


def _pow2(n: int) -> int:
    return max(MIN_BLOCK, 1 << max(n - 1, 0).bit_length())


def plan_rotary(q, qo, k, ko, cos, sin, *, offsets=None, offset: int = 0, position_ids=None, cu_seqlens=None,
                max_seqlen: int = 0, interleaved: bool = False, conjugate: bool = False,
                target: Target | None = None) -> Launch:
    """The launch that writes rotate(q) into qo (and rotate(k) into ko when k is given).

    q, qo: (B, S, Hq, D) views, any strides (qo may be q itself: in place). k, ko: (B, S, Hk, D) or
    None. Varlen: q is (1, total, Hq, D), cu_seqlens (nseq + 1,) int32/int64, max_seqlen >= the
    longest sequence. cos, sin: (Bc, seqlen_ro, R2) with Bc in {1, B} (stride 0 when 1 is fine).
    offsets: (B,) ints or None (then `offset`); position_ids: (B, S) ints, or (1, total) for varlen.
    """
    B, S, Hq, D = q.shape
    r2 = cos.shape[-1]
    varlen = cu_seqlens is not None
    nb = cu_seqlens.shape[0] - 1 if varlen else B
    seq = max_seqlen if varlen else S
    target = target if target is not None else target_for(q)
    cfg: ElementwiseConfig = rotary_config(2 * r2, seq, target)
    has_k = k is not None
    k_, ko_ = (k, ko) if has_k else (q, qo)  # placeholders, never read when HAS_K is False
    copy_rest = qo is not q and D > 2 * r2  # in place (qo is q): the pass-through columns are already there
    cbs = cos.stride(0) if cos.shape[0] > 1 else 0
    sbs = sin.stride(0) if sin.shape[0] > 1 else 0
    pos_strides = (0, 0)
    if position_ids is not None:
        pos_strides = (0 if varlen else position_ids.stride(0), position_ids.stride(1))
    args = dict(
        Q=q, K=k_, QO=qo, KO=ko_, COS=cos, SIN=sin, OFFSETS=offsets, POS=position_ids, CU_SEQLENS=cu_seqlens,
        stride_qb=q.stride(0), stride_qs=q.stride(1), stride_qh=q.stride(2), stride_qd=q.stride(3),
        stride_qob=qo.stride(0), stride_qos=qo.stride(1), stride_qoh=qo.stride(2), stride_qod=qo.stride(3),
        stride_kb=k_.stride(0), stride_ks=k_.stride(1), stride_kh=k_.stride(2), stride_kd=k_.stride(3),
        stride_kob=ko_.stride(0), stride_kos=ko_.stride(1), stride_koh=ko_.stride(2), stride_kod=ko_.stride(3),
        stride_cb=cbs, stride_cs=cos.stride(1), stride_cd=cos.stride(2),
        stride_sb=sbs, stride_ss=sin.stride(1), stride_sd=sin.stride(2),
        stride_pb=pos_strides[0], stride_ps=pos_strides[1],
        S=S, HQ=Hq, HK=k.shape[2] if has_k else 0, R2=r2, D_REST=D - 2 * r2, seqlen_ro=cos.shape[1],
        pos_offset=int(offset),
        BLOCK_S=cfg.block_rows, BLOCK_R2=_pow2(r2), BLOCK_REST=_pow2(D - 2 * r2),
        HEADS_PER_PROG=cfg.block_cols, INTERLEAVED=bool(interleaved), CONJUGATE=bool(conjugate),
        HAS_K=has_k, VARLEN=varlen, HAS_OFFSETS=offsets is not None, HAS_POS=position_ids is not None,
        COPY_REST=copy_rest, ACC=ACC_DTYPE[q.dtype],
    )
    n_groups = triton.cdiv(Hq, cfg.block_cols) + (triton.cdiv(k.shape[2], cfg.block_cols) if has_k else 0)
    grid = (triton.cdiv(max(seq, 1), cfg.block_rows), nb, n_groups)
    return Launch(_rotary_kernel, grid, args, cfg)


def rotary(q, qo, k=None, ko=None, cos=None, sin=None, **kw) -> None:
    """Rotate q into qo (and k into ko) in one launch; see plan_rotary for shapes. Returns nothing.

    Empty inputs (no rows, no heads, or no sequences) launch nothing.
    """
    nb = kw["cu_seqlens"].shape[0] - 1 if kw.get("cu_seqlens") is not None else q.shape[0]
    seq = kw.get("max_seqlen", 0) if kw.get("cu_seqlens") is not None else q.shape[1]
    heads = q.shape[2] + (k.shape[2] if k is not None else 0)
    if nb <= 0 or seq <= 0 or heads == 0 or q.shape[3] == 0:
        return
    plan_rotary(q, qo, k, ko, cos, sin, **kw).run()


def compile_plans(target: Target) -> list[tuple[str, Launch]]:
    """Representative launches for the compile check: fp16/bf16, head dims 64/128/256, half and
    interleaved, full and partial rotary, q+k (GQA) and single tensors, varlen and position ids."""
    plans = []
    for dtype in (torch.float16, torch.bfloat16):
        for d in (64, 128, 256):
            for interleaved in (False, True):
                q = torch.empty(2, 16, 8, d, dtype=dtype)  # (B, S, Hq, D)
                k = torch.empty(2, 16, 2, d, dtype=dtype)  # (B, S, Hk, D): GQA
                cos = torch.empty(1, 64, d // 2, dtype=torch.float32)  # (1, seqlen_ro, R2)
                style = "interleaved" if interleaved else "half"
                plans.append((f"rotary_qk_{style}_d{d}_{dtype}",
                              plan_rotary(q, torch.empty_like(q), k, torch.empty_like(k), cos, cos,
                                          interleaved=interleaved, target=target)))
                plans.append((f"rotary_qk_bwd_{style}_d{d}_{dtype}",
                              plan_rotary(q, torch.empty_like(q), k, torch.empty_like(k), cos, cos,
                                          interleaved=interleaved, conjugate=True, target=target)))
            # partial rotary (half the head), out of place: the pass-through copy
            q = torch.empty(2, 16, 8, d, dtype=dtype)
            cos = torch.empty(1, 64, d // 4, dtype=torch.float32)
            plans.append((f"rotary_partial_d{d}_{dtype}",
                          plan_rotary(q, torch.empty_like(q), None, None, cos, cos, target=target)))
            # varlen with per-sequence offsets, in place
            x = torch.empty(1, 40, 8, d, dtype=dtype)  # (1, total, H, D)
            cu = torch.tensor([0, 10, 40], dtype=torch.int32)
            offs = torch.zeros(2, dtype=torch.int32)
            cos = torch.empty(1, 64, d // 2, dtype=torch.float32)
            plans.append((f"rotary_varlen_inplace_d{d}_{dtype}",
                          plan_rotary(x, x, None, None, cos, cos, offsets=offs, cu_seqlens=cu, max_seqlen=30,
                                      target=target)))
            # per-batch tables and position ids (the HF apply_rotary_pos_emb path), (B, H, S, D) layout
            q = torch.empty(2, 8, 16, d, dtype=dtype).transpose(1, 2)  # (B, S, H, D) view of (B, H, S, D)
            cos = torch.empty(2, 16, d // 2, dtype=dtype)
            pos = torch.zeros(2, 16, dtype=torch.int64)
            plans.append((f"rotary_posids_bhsd_d{d}_{dtype}",
                          plan_rotary(q, torch.empty_like(q), None, None, cos, cos, position_ids=pos,
                                      target=target)))
    return plans
