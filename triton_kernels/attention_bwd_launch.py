"""Flash attention backward, host side: the launches of attention_bwd.py's kernels (plan_backward), the
host steps after them (GqaReduce, DbiasReduce), the launch-cache entry point (attention_backward) and the
compile check's plans."""
from __future__ import annotations

import torch

from . import attention_common
from .attention_common import (MASK_ROLES, NO_MASKS, MaskSpec, batch_y, mask_args, mask_elt, stride_args,
                               wide_dropout_plans)
from .configs import PREPROCESS_BLOCK_M, estimate_shared_memory, fit_rows, select_config
from .launch import (ACC_DTYPE, LAUNCHES, LOG2E, TORCH_ACC_DTYPE, HostStep, Launch, Scratch, cdiv, dot_precision,
                     head_split, split_f32, target_for, tma_ok)
from .limits import INT32_MAX, LimitExceeded, bhsd, check_limits, check_spans, surely, undecided


class GqaReduce:
    """Host step after a split dK/dV kernel (SPLIT > 1): dK, dV = the fp32 per-q-head partials summed
    over each GQA group, in a fixed order (torch's sum: deterministic)."""

    def __init__(self, dk_part, dv_part, dk, dv, split: int):
        self.parts, self.outs, self.split = (dk_part, dv_part), (dk, dv), split

    def run(self):
        for part, out in zip(self.parts, self.outs):
            B, Hs = part.shape[:2]
            out.copy_(part.view(B, Hs // self.split, self.split, *part.shape[2:]).sum(2))


class DbiasReduce(HostStep):
    """Host step after the dQ kernel: the bias gradient from its fp32 buffer (the plan's Scratch), summed in a
    fixed order (torch's sum over a fixed shape is deterministic) over the groups of a summed batch / head axis
    (dbias_groups) and the per-q-tile partial rows when the mask broadcasts over queries, then cast to the mask's
    dtype. A cached plan replays it on the call's buffer and dbias."""

    TENSORS = ("buf", "dbias")

    def __init__(self, buf, dbias, sum_m: bool):
        self.buf, self.dbias, self.sum_m = buf, dbias, sum_m

    def run(self):
        buf, dbias = self.buf, self.dbias
        dims = [d for d in (0, 1) if buf.shape[d] != dbias.shape[d]] + ([2] if self.sum_m else [])  # groups, rows
        dbias.copy_(buf.sum(dims, keepdim=True) if dims else buf)  # one reduction, then the cast


# The dQ kernel sums the bias gradient over a broadcast batch / head axis serially, one program per gradient
# tile; its grid is then q tiles x the other axis alone (a (1, H, S, S) T5 / Swin relative-position bias over
# thousands of Swin windows: 1 x H programs, each looping over every window). dbias_groups splits a summed
# axis into groups (divisors of it), each with an fp32 partial of its own, summed after the kernel
# (DbiasReduce), the fewest that give the grid DBIAS_FILL_WAVES programs an SM (2: as gqa_split_factor), unless
# the partials would pass DBIAS_PARTIALS_BYTES (256 MiB: at S = 4k one (S, S) fp32 partial is 64 MiB). Untimed on a GPU:
# chosen from grid arithmetic.
DBIAS_FILL_WAVES = 2
DBIAS_INTERPRETER_PROGRAMS = 8  # the interpreter's Target knows no SM count (decode's split heuristic: 4 slots)
DBIAS_PARTIALS_BYTES = 256 << 20


def _divisor(n: int, want: int, cap: int) -> int:
    """The smallest divisor of n that is >= want (n when want > n), or when that passes cap the largest one <= cap."""
    up = next(d for d in range(min(max(want, 1), n), n + 1) if n % d == 0)
    return up if up <= cap else next(d for d in range(min(n, max(cap, 1)), 0, -1) if n % d == 0)


def dbias_groups(n_b: int, n_h: int, programs: int, group_bytes: int, target, fill: int | None = None
                 ) -> tuple[int, int]:
    """The (batches, heads) each group of a bias gradient summed over n_b batches x n_h heads (1 where that axis is
    not summed) takes: n_b x n_h (one group) when `programs` programs a group fill the target, else divisors of them
    (the kernel loops over exactly n_b x n_h, so that 1 x 1 stays the specialised constant of the plain dQ kernel):
    the fewest groups that fill it, batch split first, within DBIAS_PARTIALS_BYTES of fp32 partials of `group_bytes`
    each. fill: the programs wanted (None: the target's)."""
    if fill is None:
        fill = DBIAS_FILL_WAVES * target.sm_count if target is not None and target.sm_count else \
            DBIAS_INTERPRETER_PROGRAMS
    want = cdiv(fill, max(programs, 1))
    cap = max(1, DBIAS_PARTIALS_BYTES // max(group_bytes, 1))
    g_b = _divisor(n_b, want, cap)
    g_h = _divisor(n_h, cdiv(want, g_b), cap // g_b)
    return n_b // g_b, n_h // g_h


def dbias_plan(dbias, B: int, H: int, Sq: int, Sk: int, block_m: int, acc_dtype, target=None,
               fill: int | None = None) -> tuple[dict, tuple, object]:
    """dQ-kernel arguments for writing the attn_mask gradient `dbias` ((B|1, H|1, Sq|1, Sk|1)), the grid's
    (heads, batch) extents, and the host step after it (None when the kernel writes dbias itself: in its
    dtype, rounded once as a cast would, where no (batch, head) adds to what another stored). target: the
    GPU whose grid a summed axis is split for, or `fill` programs (dbias_groups); None: the interpreter's."""
    sum_b, sum_h = dbias.shape[0] == 1 and B > 1, dbias.shape[1] == 1 and H > 1
    sum_m, sum_n = dbias.shape[2] == 1 and Sq > 1, dbias.shape[3] == 1 and Sk > 1
    rows = cdiv(Sq, block_m) if sum_m else dbias.shape[2]
    g_b, g_h, c_b, c_h = 1, 1, 1, 1
    if sum_b or sum_h:
        programs = cdiv(Sq, block_m) * (1 if sum_h else H) * (1 if sum_b else B)
        group_bytes = (1 if sum_h else H) * (1 if sum_b else B) * rows * dbias.shape[3] * acc_dtype.itemsize
        c_b, c_h = dbias_groups(B if sum_b else 1, H if sum_h else 1, programs, group_bytes, target, fill)
        g_b, g_h = B // c_b if sum_b else 1, H // c_h if sum_h else 1
    buf, finish = dbias, None
    if sum_m or g_b * g_h > 1 or ((sum_b or sum_h) and dbias.dtype != acc_dtype):  # partials, or sums in fp32
        buf = torch.empty(g_b if sum_b else dbias.shape[0], g_h if sum_h else dbias.shape[1], rows, dbias.shape[3],
                          dtype=acc_dtype, device=dbias.device)
        finish = DbiasReduce(buf, dbias, sum_m)
    strides = [0 if n == 1 else st for n, st in zip(buf.shape, buf.stride())]
    if sum_m:
        strides[2] = buf.stride(2)  # partial rows are indexed by q tile
    if (buf.shape[2] - 1) * strides[2] + (buf.shape[3] - 1) * strides[3] > INT32_MAX:  # a dense (Sq, Sk) slice
        raise LimitExceeded(f"the attn_mask gradient's (Sq, Sk) = ({Sq}, {Sk}) slice overflows the kernels' int32 "
                            "offsets")
    args = dict(DB=buf, **{f"stride_db{ax}": st for ax, st in zip("bhmn", strides)},
                n_b=c_b if sum_b else 1, n_h=c_h if sum_h else 1, DBIAS=True, DB_SUM_M=sum_m, DB_SUM_N=sum_n)
    return args, (g_h if sum_h else H, g_b if sum_b else B), finish


# The automatic GQA dK/dV split (gqa_split=None) is off for now: its first GPU run (2026-11-30, H200) is
# implicated in an illegal memory access that Triton's interpreter does not reproduce (see launch.SPLIT_HEAD_DIMS);
# the 2026-11-30 kernels without it passed there. gqa_split=True still splits (tests, bench.tune).
# The op reads it per call; flashtx._attention_lane reads it when it plans a call signature and replays that
# plan (an unsplit backward, also correct): after changing it, call flashtx._dispatch.clear_plans().
AUTO_GQA_SPLIT = False


def gqa_split_factor(q, k, v, spec: MaskSpec, gqa_split: bool | None, causal: bool = True) -> int:
    """Programs per K/V head of the dK/dV kernel: the GQA group size (one program per q head, fp32
    partials summed afterwards) when gqa_split, or when None (and AUTO_GQA_SPLIT) and the K/V-head grid
    fills under 2 waves of the GPU; else 1. The tile config and the GPU are looked up only for that
    last decision (causal: the launch's, which picks the tile). q, k, v: (B, H, S, D) views."""
    group = q.shape[1] // k.shape[1]
    if group == 1 or gqa_split is False or (gqa_split is None and not AUTO_GQA_SPLIT):
        return 1
    if gqa_split is None:
        target = target_for(q)
        c1 = select_config("attn_bwd_dkdv", sum(head_split(q.shape[3])), sum(head_split(v.shape[3])),
                           q.element_size(), target, spec.modifies_scores, spec.masks_visibility, causal)
        B = spec.cu_seqlens_q.shape[0] - 1 if spec.varlen else q.shape[0]
        Sk = spec.max_seqlen_k if spec.varlen else k.shape[2]
        if cdiv(Sk, c1.block_n) * k.shape[1] * B >= 2 * target.sm_count:
            return 1
    return group


def gqa_partials(dk, dv, split: int, dtype) -> tuple:
    """Uninitialised fp32 (fp64 for fp64) per-q-head dK/dV partials (B, Hkv * split, Sk, D) for a split dK/dV."""
    return tuple(torch.empty(t.shape[0], t.shape[1] * split, *t.shape[2:], dtype=TORCH_ACC_DTYPE[dtype],
                             device=t.device) for t in (dk, dv))


def plan_backward(do, q, k, v, out, m2, l2, delta, dq, dk, dv, *, scale: float, causal: bool,
                  bottom_right: bool, dlse2: torch.Tensor | None = None, spec: MaskSpec = NO_MASKS,
                  dbias: torch.Tensor | None = None, target=None, gqa_parts: tuple | None = None,
                  dbias_fill: int | None = None) -> list:
    """The launches of the backward, in order: preprocess, dK/dV, dQ (which also writes the attn_mask
    gradient into `dbias` when given, shaped like spec.attn_mask), and a DbiasReduce host step when the
    bias gradient goes through a buffer (see dbias_plan; dbias_fill: its `fill`).

    gqa_parts: (dk, dv) partials from gqa_partials to split dK/dV over the GQA group (one program per
    q head); the caller sums them (GqaReduce, as attention_backward does). None: no split.

    (B, H, S, D) views; varlen: (1, H, total, D) views of the packed tensors, m2/l2/delta (1, H, total).
    """
    # (here: attention_bwd re-exports this module)
    from .attention_bwd import _attn_bwd_dkdv, _attn_bwd_dq, _attn_bwd_preprocess

    H, Sq_rows, D_QK = q.shape[1], q.shape[2], q.shape[3]
    Hkv, D_V = k.shape[1], v.shape[3]
    target = target if target is not None else target_for(q)
    (dqk1, dqk2), (dv1, dv2) = head_split(D_QK), head_split(D_V)  # two column pieces each, or (width, 0)
    block_dqk, block_dv = dqk1 + dqk2, dv1 + dv2  # the register tile widths configs see
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
        BLOCK_M=PREPROCESS_BLOCK_M, BLOCK_DV=dv1, BLOCK_DV2=dv2, HAS_DLSE=dlse2 is not None, ACC=acc))

    margs, B, Sq, Sk = mask_args(spec, causal, bottom_right, q, k, m2)
    tile_elt = mask_elt(margs, Sq, Sk, q.dtype)
    by = batch_y(margs, B)  # grids (tiles, batch, heads): programs reading one tile of a batch-shared mask adjacent
    common = dict(Q=q, K=k, V=v, DO=do, M2=m2, L2=l2, DELTA=delta,
                  **stride_args("q", q, spec), **stride_args("k", k, spec), **stride_args("v", v, spec),
                  **stride_args("do", do, spec), Sq=Sq, Sk=Sk, D_QK=D_QK, D_V=D_V,
                  qk_scale_hi=qk_hi, qk_scale_lo=qk_lo, sm_scale_hi=sm_hi, sm_scale_lo=sm_lo,
                  BLOCK_DQK=dqk1, BLOCK_DQK2=dqk2, BLOCK_DV=dv1, BLOCK_DV2=dv2, ACC=acc, DOT_PREC=prec, BATCH_Y=by,
                  **margs)
    c1 = fit_rows(select_config("attn_bwd_dkdv", block_dqk, block_dv, q.element_size(), target, spec.modifies_scores,
                                spec.masks_visibility, causal), Sq)  # (q rows streamed)
    group = H // Hkv
    tiles_n = cdiv(Sk, c1.block_n)
    dk_out, dv_out, split = dk, dv, 1
    if gqa_parts is not None:  # per-q-head partials the caller allocated and sums
        dk_out, dv_out = gqa_parts
        split = dk_out.shape[1] // Hkv
    unsplit = not (dqk2 or dv2)  # descriptors read whole head dims (TileConfig.tma)
    tma1 = c1.tma and unsplit and tma_ok(q) and tma_ok(do)  # the streamed Q / dO tiles
    dkdv = Launch(_attn_bwd_dkdv, (tiles_n, B, Hkv * split) if by else (tiles_n, Hkv * split, B), dict(
        common, DK=dk_out, DV=dv_out, **stride_args("dk", dk_out, spec), **stride_args("dv", dv_out, spec), H=H,
        GROUP=group, SPLIT=split, ONE_HEAD=group // split == 1,
        BLOCK_M=c1.block_m, BLOCK_N=c1.block_n, TMA=tma1), c1,
        estimate_shared_memory("attn_bwd_dkdv", c1, block_dqk, block_dv, q.element_size(), target, tile_elt),
        descriptors=("Q", "DO") if tma1 else ())
    dq_kernel = "attn_bwd_dq" if dbias is None else "attn_bwd_dq_dbias"  # its own tile (configs.py)
    # a learned mask wider than q (an fp32 bias under autocast) stages like an fp32 launch: the fp32 tile (configs.py,
    # the comment after estimate_shared_memory: sm_90's 16-bit tile did not fit with it)
    dq_elt = q.element_size()
    if dbias is not None and margs["MB"].element_size() > dq_elt:
        dq_elt = 4
    c2 = fit_rows(select_config(dq_kernel, block_dqk, block_dv, dq_elt, target, spec.modifies_scores,
                                spec.masks_visibility, causal), Sq)  # (q rows owned)
    finish = None
    if dbias is not None:  # the attn_mask gradient is dS: written by the dQ kernel as it forms dS
        db_args, (grid_h, grid_b), finish = dbias_plan(dbias, B, H, Sq, Sk, c2.block_m, TORCH_ACC_DTYPE[q.dtype],
                                                       target, dbias_fill)
    else:
        db_args, (grid_h, grid_b) = dict(DB=delta, stride_dbb=0, stride_dbh=0, stride_dbm=0, stride_dbn=0, n_b=1,
                                         n_h=1, DBIAS=False, DB_SUM_M=False, DB_SUM_N=False), (H, B)
    tma2 = c2.tma and unsplit and tma_ok(k) and tma_ok(v)  # the streamed K / V tiles
    dqk = Launch(_attn_bwd_dq, (cdiv(Sq, c2.block_m), *((grid_b, grid_h) if by else (grid_h, grid_b))), dict(
        common, DQ=dq, **stride_args("dq", dq, spec), **db_args, H=H, GROUP=H // Hkv,
        BLOCK_M=c2.block_m, BLOCK_N=c2.block_n, TMA=tma2), c2,
        estimate_shared_memory(dq_kernel, c2, block_dqk, block_dv, q.element_size(), target, tile_elt),
        descriptors=("K", "V") if tma2 else ())
    if finish is None:
        return [pre, dkdv, dqk]
    return [Scratch(finish.buf), pre, dkdv, dqk, finish]  # (the buffer: allocated afresh by each cached replay)


# the kernel argument of each launch-cache input; the last three are allocated by attention_backward itself
_ROLES = ("DO", "Q", "K", "V", "O", "M2", "L2", "DQ", "DK", "DV", "DLSE", "DB", *MASK_ROLES, "DELTA", "DK_PART",
          "DV_PART")
_ROLES_PLAIN = _ROLES[:12] + _ROLES[-3:]  # without the mask tensors (MaskSpec.launch_key's)


def attention_backward(do, q, k, v, out, m2, l2, *, scale: float, causal: bool = False, bottom_right: bool = False,
                       dlse2: torch.Tensor | None = None, spec: MaskSpec = NO_MASKS, grads=None, dbias=None,
                       gqa_split: bool | None = None, bshd: bool = False):
    """Gradients of attention_forward from its (out, m2, l2). do is dL/dout; dlse2 an optional
    dL/dlse2, the cotangent of lse2 = m2 + l2 (log2 units). bshd: do, q, k, v, out (and the gradients)
    are (B, S, H, D) tensors, read through their strides, as attention_forward's.

    Returns (dq, dk, dv) shaped like (q, k, v), written into `grads` when given (any strides with
    a unit last stride). Padding rows/keys and rows that see no key get exactly zero gradient.
    dbias: a tensor shaped like spec.attn_mask (additive) that receives the mask's gradient, summed
    over its broadcast (size-1) dims.
    gqa_split: one program per q head for dK/dV (see _attn_bwd_dkdv); None decides from the grid size.
    """
    dq, dk, dv = grads if grads is not None else (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))
    if surely(q.numel() == 0) or surely(k.numel() == 0):
        if dbias is not None:
            dbias.zero_()
        return dq.zero_(), dk.zero_(), dv.zero_()
    if dbias is not None and (undecided(q.numel() == 0) or undecided(k.numel() == 0)):
        dbias.zero_()  # traced over a size read on the device: with no query or key row no kernel writes dbias
    # the kernels index m2, l2 and delta with m2's strides, and the preprocess writes delta (and reads dlse2) densely:
    # row statistics another caller made non-contiguous are copied (no-ops for the forward's own)
    m2, l2 = m2.contiguous(), l2.contiguous()
    dlse2 = dlse2.contiguous() if dlse2 is not None else None
    delta = torch.empty(m2.shape, dtype=TORCH_ACC_DTYPE[q.dtype], device=q.device)
    parts, split = (None, None), 1
    if (q.shape[2] != k.shape[2]) if bshd else (q.shape[1] != k.shape[1]):  # GQA: maybe split dK/dV
        split = gqa_split_factor(*bhsd(bshd, q, k, v), spec, gqa_split, causal)
    if split > 1:  # the partials are allocated here, so the plan has no host step and replays from the cache
        parts = gqa_partials(*bhsd(bshd, dk, dv), split, q.dtype)
    LAUNCHES.run(*_cache_args(do, q, k, v, out, m2, l2, dq, dk, dv, dlse2, dbias, delta, parts, split, scale, causal,
                              bottom_right, spec, bshd))
    if split > 1:
        GqaReduce(*parts, *bhsd(bshd, dk, dv), split).run()
    return dq, dk, dv


def backward_entry(do, q, k, v, out, m2, l2, dq, dk, dv, delta, *, scale: float, causal: bool, bottom_right: bool,
                   bshd: bool, spec: MaskSpec = NO_MASKS, dbias=None):
    """The memoised launches (LaunchCache.entry) attention_backward would replay for these tensors without lse
    cotangent (delta allocated as it allocates it), or None where it plans every call or splits dK/dV over the
    GQA group (a host step follows). flashtx._attention_lane keeps them per call signature and fires them itself,
    with the tensors in the order of _ROLES_PLAIN, or of _ROLES where spec has mask tensors (spec.launch_key's).
    With dbias (the attn_mask's gradient, allocated as attention_backward's callers allocate it) the entry may be
    a _HostEntry (its buffer and DbiasReduce): fired with a list of the tensors. Raises LimitExceeded as
    attention_backward does."""
    if (q.shape[2] != k.shape[2]) if bshd else (q.shape[1] != k.shape[1]):
        if gqa_split_factor(*bhsd(bshd, q, k, v), spec, None, causal) > 1:
            return None
    if not (m2.is_contiguous() and l2.is_contiguous()):  # attention_backward copies them (delta's layout is m2's)
        return None
    return LAUNCHES.entry(*_cache_args(do, q, k, v, out, m2, l2, dq, dk, dv, None, dbias, delta, (None, None), 1,
                                       scale, causal, bottom_right, spec, bshd), host=dbias is not None)


def _cache_args(do, q, k, v, out, m2, l2, dq, dk, dv, dlse2, dbias, delta, parts, split, scale, causal, bottom_right,
                spec, bshd) -> tuple:
    """LaunchCache.run's / entry's arguments for a backward: key, roles, tensors, build, derived."""
    static, tensors = spec.launch_key()

    def build():  # once per call signature (limits included: a replay has the shapes it was planned for)
        vs = bhsd(bshd, do, q, k, v, out, dq, dk, dv)  # (B, H, S, D) views: a replay binds the tensors themselves
        check_limits(vs[1], vs[2], vs[3], spec.attn_mask, spec.cu_seqlens_q)
        check_spans(dout=vs[0], out=vs[4], dq=vs[5], dk=vs[6], dv=vs[7])
        return plan_backward(*vs[:5], m2, l2, delta, *vs[5:], scale=scale, causal=causal, bottom_right=bottom_right,
                             dlse2=dlse2, spec=spec, dbias=dbias, gqa_parts=parts if split > 1 else None)

    return (("attn_bwd", q.device, dot_precision(q.dtype), scale, causal, bottom_right, split, bshd, static),
            _ROLES if tensors else _ROLES_PLAIN, (do, q, k, v, out, m2, l2, dq, dk, dv, dlse2, dbias, *tensors, delta,
                                                  *parts),
            build, 3)  # derived: delta (m2's shape) and the GQA partials (dk, dv and split's), allocated by the caller


def compile_plans(target) -> list:
    """Every backward config `target` can launch (head dims 64/128/192/256, 192 split 128 + 64, and the
    forward's split head dims 96, 160 and 192/128; fp16, bf16, fp32; causal or not; fp16/bf16 also with a
    window, key/query masks, lengths and varlen)."""
    from .attention_fwd import _split_cases, compile_cases

    plans, S = [], attention_common.PLAN_SEQLEN
    cases = [(d, d, *rest) for d, *rest in compile_cases((64, 128, 192, 256))] + list(_split_cases())
    for dqk, dvd, dtype, name, causal, spec in cases:
        q, k, dq, dk = (torch.empty(1, 2, S, dqk, dtype=dtype) for _ in range(4))
        v, o, do, dv = (torch.empty(1, 2, S, dvd, dtype=dtype) for _ in range(4))
        m2, l2, delta = (torch.empty(1, 2, S, dtype=torch.float32) for _ in range(3))
        try:
            pre, dkdv, dqk_ = plan_backward(do, q, k, v, o, m2, l2, delta, dq, dk, dv, scale=dqk ** -0.5,
                                            causal=causal, bottom_right=spec.varlen, spec=spec, target=target)
        except RuntimeError:  # no config fits: the backend reports it and never launches
            continue
        tag = f"D={dqk} {str(dtype)[6:]} {name}" if dqk == dvd else f"D={dqk}/{dvd} {str(dtype)[6:]} {name}"
        if name == "causal=True":
            plans.append((f"attn_bwd_preprocess {tag}", pre))
        plans += [(f"attn_bwd_dkdv {tag}", dkdv), (f"attn_bwd_dq {tag}", dqk_)]
    return plans + wide_dropout_plans(plans) + _fused_compile_plans(target) + _mask_dtype_compile_plans(target)


def _fused_compile_plans(target) -> list:
    """The dQ kernel writing the attn_mask gradient (fp16/bf16 with every option, the mask broadcast
    over batch, or over heads and queries, or full (stored in its dtype); fp32 with a full mask), and dK/dV of a
    GQA group (4 q heads a K/V head, causal fp16), unsplit and split over its heads; head dims 64/128/192 (split
    128 + 64)/256. A broadcast mask's plan loops over the summed axis (as a grid that fills the GPU does), and
    fp16 (1, H, S, S) once more with a program per (batch, head) (dbias_groups' split, as a small grid). With that
    mask (the batch shares it) at head dims 64 and 128, fp16, also the forward and dK/dV: their (tiles, batch,
    heads) grid ("batch-y", attention_common.batch_y)."""
    from .attention_fwd import all_options_spec, plan_forward

    B, H, S = 2, 2, attention_common.PLAN_SEQLEN
    plans = []
    for d in (64, 128, 192, 256):
        cases = [(dt, shape) for dt in (torch.float16, torch.bfloat16)
                 for shape in ((1, H, S, S), (B, 1, 1, S), (B, H, S, S))]  # the last: stored in its dtype
        for dtype, shape, fill in [(dt, sh, 1) for dt, sh in cases] + [(torch.float16, (1, H, S, S), None),
                                                                       (torch.float32, (B, H, S, S), 1)]:
            q, k, v, o, do, dq, dk, dv = (torch.empty(B, H, S, d, dtype=dtype) for _ in range(8))
            m2, l2, delta = (torch.empty(B, H, S, dtype=torch.float32) for _ in range(3))
            spec = (MaskSpec(attn_mask=torch.empty(shape, dtype=dtype)) if dtype == torch.float32
                    else all_options_spec(B, S, H, shape, dtype))
            try:
                launches = plan_backward(do, q, k, v, o, m2, l2, delta, dq, dk, dv, scale=d ** -0.5, causal=True,
                                         bottom_right=False, spec=spec, dbias=torch.empty(shape, dtype=dtype),
                                         target=target, dbias_fill=fill)
            except RuntimeError:  # no config fits: the backend reports it and never launches
                continue
            dq_launch = next(st for st in launches if type(st) is Launch and st.kernel.__name__ == "_attn_bwd_dq")
            plans.append((f"attn_bwd_dq+dbias D={d} {str(dtype)[6:]} {'x'.join(map(str, shape))}"
                          f"{' split' if fill is None else ''}", dq_launch))
            if d in (64, 128) and dtype == torch.float16 and shape[0] == 1 and fill == 1:  # a mask the batch shares:
                # the forward and dK/dV grids put the batch before heads (batch_y; dQ's is above)
                dkdv = next(st for st in launches if type(st) is Launch and st.kernel.__name__ == "_attn_bwd_dkdv")
                fwd = plan_forward(q, k, v, o, m2, l2, scale=d ** -0.5, causal=True, bottom_right=False, spec=spec,
                                   target=target)
                assert fwd.args["BATCH_Y"] and dkdv.args["BATCH_Y"], "a batch-y compile plan must take that grid"
                plans += [(f"attn_fwd D={d} float16 batch-y", fwd), (f"attn_bwd_dkdv D={d} float16 batch-y", dkdv)]
        q, o, do, dq = (torch.empty(1, 4, S, d, dtype=torch.float16) for _ in range(4))
        k, v, dk, dv = (torch.empty(1, 1, S, d, dtype=torch.float16) for _ in range(4))
        m2, l2, delta = (torch.empty(1, 4, S, dtype=torch.float32) for _ in range(3))
        try:
            launches = plan_backward(do, q, k, v, o, m2, l2, delta, dq, dk, dv, scale=d ** -0.5, causal=True,
                                     bottom_right=False, target=target)
            full = plan_backward(do, q, k, v, o, m2, l2, delta, dq, dk, dv, scale=d ** -0.5, causal=False,
                                 bottom_right=False, target=target)
            split = plan_backward(do, q, k, v, o, m2, l2, delta, dq, dk, dv, scale=d ** -0.5, causal=True,
                                  bottom_right=False, target=target, gqa_parts=gqa_partials(dk, dv, 4, q.dtype))
        except RuntimeError:
            continue
        # a GQA group (GROUP > 1) is its own specialisation of the dK/dV kernel: the tiles' loop covers its heads
        # (without a causal mask, on the full-attention tile where configs.FULL has one)
        plans += [(f"attn_bwd_dkdv D={d} float16 gqa", launches[1]),
                  (f"attn_bwd_dkdv D={d} float16 gqa-full", full[1]),
                  (f"attn_bwd_dkdv+gqa-split D={d} float16 causal", split[1])]
    return plans + _tma_compile_plans(target) + _short_compile_plans(target)


def _fwd_bwd_launches(target, B: int, H: int, S: int, d: int, causal: bool, spec, dbias) -> list:
    """(kernel label, Launch) of the forward, dK/dV and dQ ("attn_bwd_dq+dbias" with dbias) of fp16 (B, H, S, d)
    inputs with `spec`; none where no config fits (the backend reports that and never launches)."""
    from .attention_fwd import plan_forward

    q, k, v, o, do, dq, dk, dv = (torch.empty(B, H, S, d, dtype=torch.float16) for _ in range(8))
    m2, l2, delta = (torch.empty(B, H, S, dtype=torch.float32) for _ in range(3))
    try:
        fwd = plan_forward(q, k, v, o, m2, l2, scale=d ** -0.5, causal=causal, bottom_right=False, spec=spec,
                           target=target)
        bwd = plan_backward(do, q, k, v, o, m2, l2, delta, dq, dk, dv, scale=d ** -0.5, causal=causal,
                            bottom_right=False, spec=spec, dbias=dbias, target=target)
    except RuntimeError:
        return []
    labels = {"_attn_fwd": "attn_fwd", "_attn_bwd_dkdv": "attn_bwd_dkdv",
              "_attn_bwd_dq": "attn_bwd_dq" if dbias is None else "attn_bwd_dq+dbias"}
    return [(labels[launch.kernel.__name__], launch)
            for launch in [fwd] + [st for st in bwd if type(st) is Launch and st.kernel.__name__ in labels]]


def _mask_dtype_compile_plans(target) -> list:
    """16-bit queries with an attn_mask of another dtype (flashtx takes bool and every float mask as it is): fp16
    with every option and a (1, H, S, S) bool, fp32 or fp64 mask (the float ones learned: the dQ writes their
    gradient), the forward, dK/dV and dQ, head dims 64/128/256. Labelled "mask-<dtype>"."""
    from .attention_fwd import all_options_spec

    B, H, S = 2, 2, attention_common.PLAN_SEQLEN
    plans = []
    for d in (64, 128, 256):
        for mdt in (torch.bool, torch.float32, torch.float64):
            dbias = None if mdt == torch.bool else torch.empty(1, H, S, S, dtype=mdt)
            plans += [(f"{kernel} D={d} float16 mask-{str(mdt)[6:]}", launch) for kernel, launch in _fwd_bwd_launches(
                target, B, H, S, d, True, all_options_spec(B, S, H, (1, H, S, S), mdt), dbias)]
    return plans


def _short_compile_plans(target) -> list:
    """The tiles configs.fit_rows cuts for a short sequence, where it cuts one: the forward, dK/dV and dQ, fp16, plain
    (causal or not), with visibility masks, with a score modifier (softcap), and with every option (the dQ then writes
    the (1, H, S, S) bias's gradient), head dims 64/128/192/256; at 49 rows (Swin's windows), labelled "short-<spec>",
    and at 64, a multiple of 16 (another variant of each kernel: a Q-Former's 32 queries over themselves),
    "short64-<spec>". None in `compile_check --seqlen`'s other passes (their lengths are their own)."""
    from .attention_fwd import all_options_spec

    if attention_common.PLAN_SEQLEN != 128:
        return []
    B, H = 2, 2
    plans = []
    for S, tag in ((49, "short-"), (64, "short64-")):
        lens = torch.full((B,), S, dtype=torch.int32)
        mask = torch.ones(B, S, dtype=torch.bool)
        specs = (("causal=False", False, NO_MASKS), ("causal=True", True, NO_MASKS),
                 ("window+masks+lens", True, MaskSpec(window=(16, 0), key_mask=mask, query_mask=mask, q_lens=lens,
                                                      kv_lens=lens)),
                 ("softcap", True, MaskSpec(softcap=30.0)), ("all-options", True, all_options_spec(B, S, H, left=64)))
        for d in (64, 128, 192, 256):
            for name, causal, spec in specs:
                dbias = None if spec.attn_mask is None else torch.empty_like(spec.attn_mask)
                plans += [(f"{kernel} D={d} float16 {tag}{name}", launch)
                          for kernel, launch in _fwd_bwd_launches(target, B, H, S, d, causal, spec, dbias)
                          if "fit_rows" in launch.config.reason]  # (an uncut tile is compiled by the plans above)
    return plans


def _tma_compile_plans(target) -> list:
    """sm_90 and later: each backward TMA tuning candidate (autotune.TMA_CANDIDATES), plain causal fp16; the
    first per kernel and head dim also varlen + window in bf16 (descriptors of per-sequence rows)."""
    from .attention_fwd import compile_cases
    from .autotune import TMA_CANDIDATES, TMA_MIN_ARCH, describe, forced

    if target.arch < TMA_MIN_ARCH:
        return []
    plans = []
    cases = {name: (causal, spec) for _, _, name, causal, spec in compile_cases((64,))}
    for kernel, index in (("attn_bwd_dkdv", 1), ("attn_bwd_dq", 2)):
        for d, cands in TMA_CANDIDATES[kernel][2].items():
            for i, cfg in enumerate(cands):
                for dtype, name in [(torch.float16, "causal=True")] + ([(torch.bfloat16, "varlen+window")] if i == 0
                                                                         else []):
                    causal, spec = cases[name]
                    S = attention_common.PLAN_SEQLEN
                    q, k, v, o, do, dq, dk, dv = (torch.empty(1, 2, S, d, dtype=dtype) for _ in range(8))
                    m2, l2, delta = (torch.empty(1, 2, S, dtype=torch.float32) for _ in range(3))
                    with forced(kernel, cfg):
                        launch = plan_backward(do, q, k, v, o, m2, l2, delta, dq, dk, dv, scale=d ** -0.5,
                                               causal=causal, bottom_right=spec.varlen, spec=spec,
                                               target=target)[index]
                    assert launch.args["TMA"], "a TMA compile plan must read through descriptors"
                    plans.append((f"{kernel}+tma D={d} {str(dtype)[6:]} {name} {describe(cfg)}", launch))
    return plans
