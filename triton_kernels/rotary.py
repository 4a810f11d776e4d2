"""Fused rotary position embedding (RoPE): one kernel for forward and backward (no autograd here).

For each token at position p and each pair index j < R2 = rotary_dim / 2, the pair (x1, x2) is
rotated by theta = angle(p, j), with c = cos[p, j], s = sin[p, j]:

    out1 = x1 * c - x2 * s        half (NeoX/LLaMA) style: x1 = x[j], x2 = x[j + R2]
    out2 = x1 * s + x2 * c        interleaved (GPT-J) style: x1 = x[2j], x2 = x[2j + 1]

Columns from rotary_dim to D are copied unchanged (partial rotary). The backward is the same
kernel with CONJUGATE (rotation by -theta, i.e. s -> -s), since the rotation is orthogonal.

Tiling (as Liger's kernel): a program rotates a (positions, heads, R2) tile of q or of k, all
the heads of a position tile when they fit, so cos/sin are read once per position tile and
broadcast over the heads. One launch covers q and k (grid axis 0: q tiles, then k tiles, each
with its own tile shape; axis 1: batch). The NeoX halves are two contiguous loads; interleaved
(GPT-J) pairs are one contiguous load of 2 * R2 columns split into x1/x2 in registers
(tl.reshape + tl.split, and tl.join to store), not stride-2 loads, so both layouts vectorise.

Addressing: x is a (B, S, H, D) tensor with any strides, or a (B, H, S, D) one (heads_first:
its strides are read in that order, no view is made). Packed varlen x is (total, H, D) (or a
(1, total, H, D) view) with VARLEN: grid row b then covers rows cu_seqlens[b] .. cu_seqlens[b+1]
(tiles past the sequence's end, from max_seqlen being an upper bound, return at once; max_seqlen is
clamped to the total, so the grid never outgrows the data). cos/sin are (seqlen_ro, R2) or
(Bc, seqlen_ro, R2), with a batch stride that is 0 for a shared table. Math is fp32 (fp64 for fp64
inputs); positions outside [0, seqlen_ro) give NaN rows, since checking them on the host would need
a device sync.
"""
from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from .configs import Target, rotary_config
from .launch import ACC_DTYPE, LAUNCHES, Launch, pow2_bucket, target_for
from .limits import INT32_MAX, MAX_GRID_YZ, least, surely

MIN_BLOCK = 2  # smallest tl.arange width used for the pair and pass-through column blocks



def _cdiv(a: int, b: int) -> int:
    """Host-side ceil division (triton.cdiv is a JIT function: calling it on the host is slow)."""
    return -(-a // b)


@triton.jit
def _rotate_tile(X, O, COS, SIN, POS, OFFSETS, b, xb, start, seqlen, s0, h0, H,
                 stride_xs, stride_xh, stride_xd, stride_os, stride_oh, stride_od,
                 stride_cs, stride_cd, stride_ss, stride_sd, stride_pb, stride_ps,
                 R2, D_REST, seqlen_ro, pos_offset,
                 BLOCK_S: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_R2: tl.constexpr, BLOCK_REST: tl.constexpr,
                 INTERLEAVED: tl.constexpr, CONJUGATE: tl.constexpr, HAS_OFFSETS: tl.constexpr,
                 HAS_POS: tl.constexpr, COPY_REST: tl.constexpr, ACC: tl.constexpr, WIDE: tl.constexpr):
    """Rotate the (BLOCK_S positions, BLOCK_H heads) tile at (s0, h0) of one sequence. X/O already
    point at the sequence's batch entry; rows are start + s (varlen: absolute rows)."""
    offs_s = s0 + tl.arange(0, BLOCK_S)  # (BLOCK_S,) index within the sequence
    row_mask = offs_s < seqlen
    rows = start + offs_s.to(tl.int64)  # (BLOCK_S,) row in x's sequence dim

    # positions (BLOCK_S,): explicit ids, or index + per-sequence / global offset
    if HAS_POS:
        pos = tl.load(POS + xb * stride_pb + rows * stride_ps, mask=row_mask, other=0).to(tl.int64)
    elif HAS_OFFSETS:
        pos = offs_s.to(tl.int64) + tl.load(OFFSETS + b).to(tl.int64)
    else:
        pos = offs_s.to(tl.int64) + pos_offset
    in_range = (pos >= 0) & (pos < seqlen_ro)
    safe_pos = tl.where(in_range, pos, 0)

    # cos/sin (BLOCK_S, BLOCK_R2), loaded once for every head of the tile, in the accumulator dtype
    offs_j = tl.arange(0, BLOCK_R2)
    if WIDE:  # a column offset times its stride passes 2**31 (the plan says so): int64, as rows and heads are
        offs_j = offs_j.to(tl.int64)
    cmask = row_mask[:, None] & (offs_j[None, :] < R2)
    cos = tl.load(COS + safe_pos[:, None] * stride_cs + offs_j[None, :] * stride_cd, mask=cmask, other=0.0).to(ACC)
    sin = tl.load(SIN + safe_pos[:, None] * stride_ss + offs_j[None, :] * stride_sd, mask=cmask, other=0.0).to(ACC)
    cos = tl.where(in_range[:, None], cos, float("nan"))  # out-of-range positions poison their rows
    if CONJUGATE:
        sin = -sin  # rotation by -theta: the backward
    cos = cos[:, None, :]  # (BLOCK_S, 1, BLOCK_R2), broadcast over heads
    sin = sin[:, None, :]

    offs_h = h0 + tl.arange(0, BLOCK_H)  # (BLOCK_H,)
    m3 = row_mask[:, None, None] & (offs_h < H)[None, :, None]  # (BLOCK_S, BLOCK_H, 1)
    x_rows = X + rows[:, None, None] * stride_xs + offs_h.to(tl.int64)[None, :, None] * stride_xh
    o_rows = O + rows[:, None, None] * stride_os + offs_h.to(tl.int64)[None, :, None] * stride_oh
    out_ty = O.dtype.element_ty
    if INTERLEAVED:
        # pairs (x[2j], x[2j+1]): one contiguous (.., 2 * BLOCK_R2) load, split into x1/x2 in registers
        offs_c = tl.arange(0, 2 * BLOCK_R2)
        if WIDE:
            offs_c = offs_c.to(tl.int64)
        cm = m3 & (offs_c < 2 * R2)[None, None, :]
        x = tl.load(x_rows + offs_c[None, None, :] * stride_xd, mask=cm, other=0.0).to(ACC)
        x1, x2 = tl.split(tl.reshape(x, (BLOCK_S, BLOCK_H, BLOCK_R2, 2)))  # (BLOCK_S, BLOCK_H, BLOCK_R2) each
        o1 = x1 * cos - x2 * sin
        o2 = x1 * sin + x2 * cos
        o = tl.reshape(tl.join(o1, o2), (BLOCK_S, BLOCK_H, 2 * BLOCK_R2))
        tl.store(o_rows + offs_c[None, None, :] * stride_od, o.to(out_ty), mask=cm)
    else:
        # halves (x[j], x[j + R2]): two contiguous loads
        jm = m3 & (offs_j < R2)[None, None, :]
        c1 = offs_j[None, None, :]
        x1 = tl.load(x_rows + c1 * stride_xd, mask=jm, other=0.0).to(ACC)  # (BLOCK_S, BLOCK_H, BLOCK_R2)
        x2 = tl.load(x_rows + (c1 + R2) * stride_xd, mask=jm, other=0.0).to(ACC)
        o1 = x1 * cos - x2 * sin
        o2 = x1 * sin + x2 * cos
        tl.store(o_rows + c1 * stride_od, o1.to(out_ty), mask=jm)
        tl.store(o_rows + (c1 + R2) * stride_od, o2.to(out_ty), mask=jm)
    if COPY_REST:  # partial rotary, out of place: columns [2 * R2, D) pass through unchanged
        offs_p = tl.arange(0, BLOCK_REST)
        if WIDE:
            offs_p = offs_p.to(tl.int64)
        cp = (2 * R2 + offs_p)[None, None, :]
        pm = m3 & (offs_p < D_REST)[None, None, :]
        rest = tl.load(x_rows + cp * stride_xd, mask=pm, other=0.0)
        tl.store(o_rows + cp * stride_od, rest.to(out_ty), mask=pm)


@triton.jit
def _rotary_kernel(Q, K, QO, KO, COS, SIN, OFFSETS, POS, CU_SEQLENS,
                   stride_qb, stride_qs, stride_qh, stride_qd,
                   stride_qob, stride_qos, stride_qoh, stride_qod,
                   stride_kb, stride_ks, stride_kh, stride_kd,
                   stride_kob, stride_kos, stride_koh, stride_kod,
                   stride_cb, stride_cs, stride_cd, stride_sb, stride_ss, stride_sd,
                   stride_pb, stride_ps,
                   S, HQ, HK, R2, D_REST, seqlen_ro, pos_offset, n_q_progs, n_sq_tiles, n_sk_tiles,
                   BLOCK_SQ: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_SK: tl.constexpr, BLOCK_HK: tl.constexpr,
                   BLOCK_R2: tl.constexpr, BLOCK_REST: tl.constexpr,
                   INTERLEAVED: tl.constexpr, CONJUGATE: tl.constexpr,
                   HAS_K: tl.constexpr, VARLEN: tl.constexpr, HAS_OFFSETS: tl.constexpr,
                   HAS_POS: tl.constexpr, COPY_REST: tl.constexpr, ACC: tl.constexpr, WIDE: tl.constexpr = False):
    pid = tl.program_id(0)  # q tiles first (position tiles fastest), then k tiles
    b = tl.program_id(1)  # batch index (varlen: sequence index)
    if VARLEN:
        start = tl.load(CU_SEQLENS + b).to(tl.int64)  # first row of sequence b in (total, H, D)
        seqlen = tl.load(CU_SEQLENS + b + 1).to(tl.int64) - start
        xb = 0  # rows are absolute: the batch stride is unused
    else:
        start = 0
        seqlen = S
        xb = b.to(tl.int64)
    cos_b = COS + b.to(tl.int64) * stride_cb  # stride_cb is 0 for a table shared by the batch
    sin_b = SIN + b.to(tl.int64) * stride_sb
    if pid < n_q_progs:
        h_tile = pid // n_sq_tiles
        s0 = (pid - h_tile * n_sq_tiles) * BLOCK_SQ
        if s0 < seqlen:  # varlen grids cover max_seqlen, an upper bound
            _rotate_tile(Q + xb * stride_qb, QO + xb * stride_qob, cos_b, sin_b, POS, OFFSETS, b, xb, start, seqlen,
                         s0, h_tile * BLOCK_HQ, HQ, stride_qs, stride_qh, stride_qd, stride_qos, stride_qoh,
                         stride_qod, stride_cs, stride_cd, stride_ss, stride_sd, stride_pb, stride_ps,
                         R2, D_REST, seqlen_ro, pos_offset, BLOCK_SQ, BLOCK_HQ, BLOCK_R2, BLOCK_REST,
                         INTERLEAVED, CONJUGATE, HAS_OFFSETS, HAS_POS, COPY_REST, ACC, WIDE)
    elif HAS_K:
        kp = pid - n_q_progs
        h_tile = kp // n_sk_tiles
        s0 = (kp - h_tile * n_sk_tiles) * BLOCK_SK
        if s0 < seqlen:
            _rotate_tile(K + xb * stride_kb, KO + xb * stride_kob, cos_b, sin_b, POS, OFFSETS, b, xb, start, seqlen,
                         s0, h_tile * BLOCK_HK, HK, stride_ks, stride_kh, stride_kd, stride_kos, stride_koh,
                         stride_kod, stride_cs, stride_cd, stride_ss, stride_sd, stride_pb, stride_ps,
                         R2, D_REST, seqlen_ro, pos_offset, BLOCK_SK, BLOCK_HK, BLOCK_R2, BLOCK_REST,
                         INTERLEAVED, CONJUGATE, HAS_OFFSETS, HAS_POS, COPY_REST, ACC, WIDE)


def _pow2(n: int) -> int:
    return max(MIN_BLOCK, 1 << max(n - 1, 0).bit_length())


_STATIC: dict = {}  # everything but the sizes of the sequence axis -> _Static; see _static


class _Static:
    """What a launch takes from its key alone (head counts, head and rotary dims, dtype, flags, target):
    the q and k tile configs, every constexpr and the head tiles. `small` holds the variants for
    sequences shorter than the position tiles (rotary_config shrinks them to the next power of two
    of the sequence length)."""

    __slots__ = ("cfg_q", "block_sq", "block_sk", "n_hq_tiles", "n_hk_tiles", "consts", "small")

    def __init__(self, key, seq):
        r2, d, hq, hk, dtype, interleaved, conjugate, has_k, varlen, has_offsets, has_pos, copy_rest, target = key
        cfg_q, cfg_k = rotary_config(r2, hq, seq, target), rotary_config(r2, max(hk, 1), seq, target)
        self.cfg_q, self.block_sq, self.block_sk = cfg_q, cfg_q.block_rows, cfg_k.block_rows
        self.n_hq_tiles = _cdiv(hq, cfg_q.block_cols)
        self.n_hk_tiles = _cdiv(hk, cfg_k.block_cols) if has_k else 0
        self.consts = dict(
            HQ=hq, HK=hk, R2=r2, D_REST=d - 2 * r2,
            BLOCK_SQ=cfg_q.block_rows, BLOCK_HQ=cfg_q.block_cols, BLOCK_SK=cfg_k.block_rows,
            BLOCK_HK=cfg_k.block_cols, BLOCK_R2=_pow2(r2), BLOCK_REST=_pow2(d - 2 * r2),
            INTERLEAVED=bool(interleaved), CONJUGATE=bool(conjugate), HAS_K=has_k, VARLEN=varlen,
            HAS_OFFSETS=has_offsets, HAS_POS=has_pos, COPY_REST=copy_rest, ACC=ACC_DTYPE[dtype])
        self.small: dict = {}


def _static(key: tuple, seq) -> _Static:
    """The cached _Static of a launch: the configs rotary_config(r2, heads, seq, target) gives.

    The key (see _Static) holds no sequence length or token count: rotary_config only shrinks the
    position tile to the next power of two of short sequences (decoding), so seq picks one of a few
    shrunken variants (pow2_bucket); a symbolic seq (torch.compile's dynamic shapes) takes the full tile, so
    one graph serves every length. A symbolic head count or dim (unhashable) is planned the same way, without
    the cache."""
    try:
        st = _STATIC.get(key)
        cached = True
    except TypeError:  # a SymInt in the key (torch.compile with dynamic head counts or dims)
        st, cached = None, False
    if st is None:
        st = _Static(key, 1 << 62)
        if cached:
            _STATIC[key] = st
    cap = max(st.block_sq, st.block_sk)
    b = pow2_bucket(seq, cap)
    if b == cap:
        return st
    small = st.small.get(b)
    if small is None:
        small = st.small[b] = _Static(key, b)
    return small


def _total(q, heads_first: bool):
    """The rows of q's sequence dim: S, or the total of packed (total, H, D) / (1, total, H, D) q."""
    return q.shape[0] if q.dim() == 3 else q.shape[2 if heads_first else 1]


def _plan(q, qo, k, ko, cos, sin, offsets, offset, position_ids, cu_seqlens, max_seqlen, interleaved: bool,
          conjugate: bool, heads_first: bool, target: Target | None):
    """(kernel arguments, grid, _Static) of the launch plan_rotary describes; None when it would
    cover nothing (no rows, heads, sequences or columns)."""
    varlen = cu_seqlens is not None
    # strides as (batch, sequence, head, dim), unpacked in the tensor's own order (no views)
    if q.dim() == 3:  # packed (total, H, D): the strides of its (1, total, H, D) view
        S, hq, D = q.shape
        B = 1
        qss, qsh, qsd = q.stride()
        oss, osh, osd = qo.stride()
        qsb, osb = S * qss, S * oss
    elif heads_first:  # (B, H, S, D)
        B, hq, S, D = q.shape
        qsb, qsh, qss, qsd = q.stride()
        osb, osh, oss, osd = qo.stride()
    else:
        B, S, hq, D = q.shape
        qsb, qss, qsh, qsd = q.stride()
        osb, oss, osh, osd = qo.stride()
    has_k = k is not None
    if not has_k:
        hk = 0  # placeholders below, never read when HAS_K is False
        ksb, kss, ksh, ksd, kosb, koss, kosh, kosd = qsb, qss, qsh, qsd, osb, oss, osh, osd
    elif k.dim() == 3:
        hk = k.shape[1]
        kss, ksh, ksd = k.stride()
        koss, kosh, kosd = ko.stride()
        ksb, kosb = S * kss, S * koss
    elif heads_first:
        hk = k.shape[1]
        ksb, ksh, kss, ksd = k.stride()
        kosb, kosh, koss, kosd = ko.stride()
    else:
        hk = k.shape[2]
        ksb, kss, ksh, ksd = k.stride()
        kosb, koss, kosh, kosd = ko.stride()
    nb = cu_seqlens.shape[0] - 1 if varlen else B
    # rows per sequence the grid covers: max_seqlen is an upper bound, clamped to the total (no sequence is
    # longer), so a loose one (10**9) cannot grow the grid past the data (or CUDA's grid limit)
    seq = least(max_seqlen, S) if varlen else S
    if nb <= 0 or surely(seq <= 0) or hq + hk == 0 or D == 0:
        return None
    if nb > MAX_GRID_YZ:  # grid axis 1 (CUDA's y); a host check, so the interpreter refuses what a GPU would
        raise ValueError(f"rotary: {nb} {'sequences' if varlen else 'batch entries'} exceed CUDA's grid limit of "
                         f"{MAX_GRID_YZ} per launch; split the call")
    r2 = cos.shape[-1]
    copy_rest = qo is not q and D > 2 * r2  # in place (qo is q): the pass-through columns are already there
    key = (r2, D, hq, hk, q.dtype, interleaved, conjugate, has_k, varlen, offsets is not None,
           position_ids is not None, copy_rest, target if target is not None else target_for(q))
    st = _static(key, seq)
    if cos.dim() == 2:
        cbs = sbs = 0
        (scs, scd), (sss, ssd) = cos.stride(), sin.stride()
    else:
        cbs, scs, scd = cos.stride()
        sbs, sss, ssd = sin.stride()
        if cos.shape[0] == 1:
            cbs = sbs = 0
    if position_ids is not None:
        pb, ps = position_ids.stride()
        if varlen:
            pb = 0
    else:
        pb = ps = 0
    n_sq, n_sk = -(-seq // st.block_sq), -(-seq // st.block_sk)  # position tiles (ceil division); seq >= 1
    n_q_progs = n_sq * st.n_hq_tiles
    args = dict(st.consts)
    args.update(
        Q=q, K=k if has_k else q, QO=qo, KO=ko if has_k else qo, COS=cos, SIN=sin, OFFSETS=offsets,
        POS=position_ids, CU_SEQLENS=cu_seqlens,
        stride_qb=qsb, stride_qs=qss, stride_qh=qsh, stride_qd=qsd,
        stride_qob=osb, stride_qos=oss, stride_qoh=osh, stride_qod=osd,
        stride_kb=ksb, stride_ks=kss, stride_kh=ksh, stride_kd=ksd,
        stride_kob=kosb, stride_kos=koss, stride_koh=kosh, stride_kod=kosd,
        stride_cb=cbs, stride_cs=scs, stride_cd=scd, stride_sb=sbs, stride_ss=sss, stride_sd=ssd,
        # pos_offset: an int, or symbolic under torch.compile (an int() would compile a graph per offset)
        stride_pb=pb, stride_ps=ps, S=S, seqlen_ro=cos.shape[-2], pos_offset=offset,
        n_q_progs=n_q_progs, n_sq_tiles=n_sq, n_sk_tiles=n_sk,
        # int64 column offsets only where int32 would wrap: columns (and their masked lanes) reach 2D + 256
        WIDE=(2 * D + 256) * max(abs(qsd), abs(osd), abs(ksd), abs(kosd), abs(scd), abs(ssd)) > INT32_MAX)
    return args, (n_q_progs + n_sk * st.n_hk_tiles, nb), st


def plan_rotary(q, qo, k, ko, cos, sin, *, offsets=None, offset: int = 0, position_ids=None, cu_seqlens=None,
                max_seqlen: int = 0, interleaved: bool = False, conjugate: bool = False, heads_first: bool = False,
                target: Target | None = None) -> Launch:
    """The launch that writes rotate(q) into qo (and rotate(k) into ko when k is given).

    q, qo: (B, S, Hq, D), any strides (qo may be q itself: in place), or (B, Hq, S, D) with
    heads_first. k, ko: (B, S, Hk, D) (heads_first: (B, Hk, S, D)) or None. Varlen: q is
    (total, Hq, D) (or a (1, total, Hq, D) view), cu_seqlens (nseq + 1,) int32/int64, max_seqlen >=
    the longest sequence (clamped to total). cos, sin: (seqlen_ro, R2) or (Bc, seqlen_ro, R2) with Bc in
    {1, B}.
    offsets: (B,) ints or None (then `offset`); position_ids: (B, S) ints, or (1, total) for varlen.
    Grid: (q tiles + k tiles, B or nseq); each tile is (positions, heads) of one tensor.
    Empty inputs must not be planned (see rotary).
    """
    plan = _plan(q, qo, k, ko, cos, sin, offsets, offset, position_ids, cu_seqlens, max_seqlen, interleaved,
                 conjugate, heads_first, target)
    if plan is None:
        raise ValueError("plan_rotary: nothing to launch (no rows, heads, sequences or columns)")
    args, grid, st = plan
    return Launch(_rotary_kernel, grid, args, st.cfg_q)


_ROLES = ("Q", "QO", "K", "KO", "COS", "SIN", "OFFSETS", "POS", "CU_SEQLENS")


def rotary_launch(q, qo, k, ko, cos, sin, offsets, offset, position_ids, cu_seqlens, max_seqlen, interleaved,
                  conjugate, heads_first) -> None:
    """plan_rotary(...).run() with positional arguments (the per-call path); launches nothing for empty
    inputs (no rows, no heads, no sequences or no columns)."""
    if cu_seqlens is not None:  # the bound _plan uses, so that looser bounds share a launch-cache entry
        max_seqlen = least(max_seqlen, _total(q, heads_first))
    # Replayed from the launch cache for a repeated signature (a GPU then launches the compiled kernel
    # directly, see launch.DIRECT_LAUNCH). An int offset other than 0 (decoding: the cache length, a new
    # value each step) would key an entry per step: the tables are narrowed to the rows [offset, offset + S)
    # instead (views: same positions, same values), so every step replays one entry at offset 0. Where the
    # tables are too short for that (varlen, or a direct call that relies on the kernel's NaN for positions
    # past the table) it is planned every call. offset and max_seqlen are never int()'d (the cache is not
    # consulted while tracing, so a SymInt stays symbolic).
    if type(offset) is int and offset:
        seq = _total(q, heads_first)
        if cu_seqlens is not None or offset + seq > cos.shape[-2]:
            for step in _build(q, qo, k, ko, cos, sin, offsets, offset, position_ids, cu_seqlens, max_seqlen,
                               interleaved, conjugate, heads_first)():
                step.run()
            return
        cos, sin, offset = cos.narrow(-2, offset, seq), sin.narrow(-2, offset, seq), 0
    LAUNCHES.run(*_cache_args(q, qo, k, ko, cos, sin, offsets, offset, position_ids, cu_seqlens, max_seqlen,
                              interleaved, conjugate, heads_first))


def rotary_entry(q, qo, k, ko, cos, sin, interleaved: bool, heads_first: bool, conjugate: bool = False):
    """The memoised launch (LaunchCache.entry) rotary_launch would replay for a rotation (conjugate: the backward's)
    at offset 0 without offsets, position ids or cu_seqlens (tables narrowed by the caller), or None where it
    plans every call. flashtx._rotary_lane keeps it per call signature and fires it itself."""
    return LAUNCHES.entry(*_cache_args(q, qo, k, ko, cos, sin, None, 0, None, None, 0, interleaved, conjugate,
                                       heads_first))


def _build(q, qo, k, ko, cos, sin, offsets, offset, position_ids, cu_seqlens, max_seqlen, interleaved, conjugate,
           heads_first):
    def build():
        plan = _plan(q, qo, k, ko, cos, sin, offsets, offset, position_ids, cu_seqlens, max_seqlen, interleaved,
                     conjugate, heads_first, None)
        if plan is None:
            return []
        args, grid, st = plan
        return [Launch(_rotary_kernel, grid, args, st.cfg_q)]
    return build


def _cache_args(q, qo, k, ko, cos, sin, offsets, offset, position_ids, cu_seqlens, max_seqlen, interleaved,
                conjugate, heads_first) -> tuple:
    """LaunchCache.run's / entry's arguments for a launch: key, roles, tensors, build. `qo is q` keys too: the plan
    branches on it (COPY_REST), and an in-place entry replayed out of place would leave a partial rotary's
    pass-through columns unwritten (the signature sees shapes, not identities)."""
    return (("rotary", q.device, offset, max_seqlen, interleaved, conjugate, heads_first, qo is q), _ROLES,
            (q, qo, k, ko, cos, sin, offsets, position_ids, cu_seqlens),
            _build(q, qo, k, ko, cos, sin, offsets, offset, position_ids, cu_seqlens, max_seqlen, interleaved,
                   conjugate, heads_first))


def rotary(q, qo, k=None, ko=None, cos=None, sin=None, *, offsets=None, offset: int = 0, position_ids=None,
           cu_seqlens=None, max_seqlen: int = 0, interleaved: bool = False, conjugate: bool = False,
           heads_first: bool = False) -> None:
    """Rotate q into qo (and k into ko) in one launch; see plan_rotary for shapes. Returns nothing.

    Empty inputs (no rows, no heads, or no sequences) launch nothing.
    """
    rotary_launch(q, qo, k, ko, cos, sin, offsets, offset, position_ids, cu_seqlens, max_seqlen, interleaved,
                  conjugate, heads_first)


def compile_plans(target: Target) -> list[tuple[str, Launch]]:
    """Representative launches for the compile check: fp16/bf16 (and fp32 at D=128), head dims
    64/128/256, half and interleaved, forward and backward (conjugate), q+k at LLaMA-3-8B's
    32/8 heads (so q and k get different tiles) and 8/2, full and partial rotary, varlen with
    offsets in place, position ids with per-batch tables in the (B, H, S, D) layout, the Hugging Face
    call (per-batch half-precision tables, no position ids), and decoding."""
    plans = []
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        for d in ((64, 128, 256) if dtype != torch.float32 else (128,)):
            for interleaved in (False, True):
                style = "interleaved" if interleaved else "half"
                for hq, hk in ((32, 8), (8, 2)):
                    # S = 64: every tile is as tall as rotary_config makes it (32 positions for 2 heads at D=64)
                    q = torch.empty(2, 64, hq, d, dtype=dtype)  # (B, S, Hq, D)
                    k = torch.empty(2, 64, hk, d, dtype=dtype)  # (B, S, Hk, D): GQA
                    cos = torch.empty(1, 64, d // 2, dtype=torch.float32)  # (1, seqlen_ro, R2)
                    for conj in (False, True):
                        plans.append((f"rotary_qk_{'bwd' if conj else 'fwd'}_{style}_h{hq}x{hk}_d{d}_{dtype}",
                                      plan_rotary(q, torch.empty_like(q), k, torch.empty_like(k), cos, cos,
                                                  interleaved=interleaved, conjugate=conj, target=target)))
                # partial rotary (half the head), out of place: the pass-through copy
                q = torch.empty(2, 16, 8, d, dtype=dtype)
                cos = torch.empty(1, 64, d // 4, dtype=torch.float32)
                plans.append((f"rotary_partial_{style}_d{d}_{dtype}",
                              plan_rotary(q, torch.empty_like(q), None, None, cos, cos, interleaved=interleaved,
                                          target=target)))
            # varlen with per-sequence offsets, q and k in place
            x = torch.empty(1, 40, 8, d, dtype=dtype)  # (1, total, H, D)
            kx = torch.empty(1, 40, 2, d, dtype=dtype)
            cu = torch.tensor([0, 10, 40], dtype=torch.int32)
            offs = torch.zeros(2, dtype=torch.int32)
            cos = torch.empty(1, 64, d // 2, dtype=torch.float32)
            plans.append((f"rotary_varlen_inplace_d{d}_{dtype}",
                          plan_rotary(x, x, kx, kx, cos, cos, offsets=offs, cu_seqlens=cu, max_seqlen=30,
                                      target=target)))
            # per-batch tables and position ids (the HF apply_rotary_pos_emb path), (B, H, S, D) layout
            q = torch.empty(2, 8, 16, d, dtype=dtype).transpose(1, 2)  # (B, S, H, D) view of (B, H, S, D)
            cos = torch.empty(2, 16, d // 2, dtype=dtype)
            pos = torch.zeros(2, 16, dtype=torch.int64)
            plans.append((f"rotary_posids_bhsd_d{d}_{dtype}",
                          plan_rotary(q, torch.empty_like(q), None, None, cos, cos, position_ids=pos,
                                      target=target)))
            # the HF call (integrations.transformers.apply_rotary_pos_emb): q and k (B, H, S, D) at 32/8 heads,
            # per-batch tables in the activations' dtype read as the first half of each (B, S, D) row
            q = torch.empty(2, 32, 64, d, dtype=dtype).transpose(1, 2)  # (B, S, H, D) view of (B, H, S, D)
            k = torch.empty(2, 8, 64, d, dtype=dtype).transpose(1, 2)
            tab = torch.empty(2, 64, d, dtype=dtype)[..., : d // 2]  # (B, S, R2), row stride D
            plans.append((f"rotary_hf_qk_bhsd_d{d}_{dtype}",
                          plan_rotary(q, torch.empty_like(q), k, torch.empty_like(k), tab, tab, target=target)))
            # decoding: one token, q and k in place, per-sequence offsets
            q = torch.empty(4, 1, 32, d, dtype=dtype)
            k = torch.empty(4, 1, 8, d, dtype=dtype)
            cos = torch.empty(1, 4096, d // 2, dtype=torch.float32)
            plans.append((f"rotary_decode_inplace_d{d}_{dtype}",
                          plan_rotary(q, q, k, k, cos, cos, offsets=torch.zeros(4, dtype=torch.int32),
                                      target=target)))
    # the int64-column variant (WIDE: strides too large for int32 column offsets) of a q+k and a partial plan
    for prefix in ("rotary_qk_fwd_half_h32x8", "rotary_qk_fwd_interleaved_h32x8", "rotary_partial_half"):
        label, launch = next(p for p in plans if p[0].startswith(prefix))
        plans.append((label.replace("rotary_", "rotary_wide_", 1),
                      dataclasses.replace(launch, args={**launch.args, "WIDE": True})))
    return plans
