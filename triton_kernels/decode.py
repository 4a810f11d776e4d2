"""Decoding against a KV cache, host side: per-target configs, the split heuristic, plans and launchers for the
kernels of triton_kernels.decode_kernels (their layouts and semantics are described there), and the compile
check's plans."""
from __future__ import annotations

import torch

from .configs import (INTERPRETER_TARGET, KNOWN_TARGETS, ElementwiseConfig, Target, combine_chunk, decode_config,
                      decode_programs_per_sm)
from .targets import num_splits_heuristic
from .decode_kernels import _decode_combine, _decode_fwd, _kv_append
from .launch import (ACC_DTYPE, LAUNCHES, LOG2E, TORCH_ACC_DTYPE, Launch, cdiv, dot_precision, head_block, rows_tile,
                     split_f32, target_for)
from .limits import MAX_GRID_YZ

MAX_SPLITS = 128


def _pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def split_count(q, k_cache, v_cache, block_table, num_splits: int, target: Target) -> int:
    """Key-range splits per sequence: num_splits clamped to the key tiles (at most MAX_SPLITS), or for 0
    flash-attn's heuristic (num_splits_heuristic) for the target's SM count times the programs of the tile an SM
    holds (configs.decode_programs_per_sm; 4 programs in all in the interpreter)."""
    B, Sq, Hq, D = q.shape
    Hkv, DV = k_cache.shape[2], v_cache.shape[3]
    cfg = decode_config(D, DV, q.element_size(), target)
    m_tiles = cdiv(Hq // Hkv * Sq, rows_tile(Hq // Hkv * Sq, 16, cfg.max_block_m))
    capacity = block_table.shape[1] * k_cache.shape[1] if block_table is not None else k_cache.shape[1]
    if not isinstance(capacity, int):  # symbolic (torch.compile, dynamic shapes: a growing K/V): a choice that
        key_tiles = MAX_SPLITS  # does not guard on it, as for a long one (splits past the keys see none: lse -inf)
    else:
        key_tiles = cdiv(capacity, cfg.block_n)
    if num_splits <= 0:
        per_sm = decode_programs_per_sm(cfg, _pow2(D), _pow2(DV), q.element_size(), target)  # (padded head dims)
        slots = target.sm_count * per_sm if target.sm_count else 4  # (the interpreter: 4)
        programs = B * Hkv * m_tiles
        if not isinstance(programs, int):  # a symbolic batch (torch.compile): decided on this trace's sizes, without
            # a guard (any split count is correct; a guard on the wave arithmetic compiled a graph per batch size)
            programs = getattr(programs.node, "hint", None) or slots  # (unknown: no split)
        num_splits = num_splits_heuristic(programs, slots, key_tiles, MAX_SPLITS)
    return max(1, min(num_splits, key_tiles, MAX_SPLITS))


def check_grid(B: int, Sq: int, Hq: int, Hkv: int, m_tiles: int, splits: int) -> None:
    """Raise ValueError where a decode launch's grid passes CUDA's limit on grid dims y and z (MAX_GRID_YZ): the
    batch (the append's y, the forward's and the combine's z), kv heads x query tiles (the forward's y) and, with key
    splits, the q heads (the combine's y). Checked when the launches are planned (once per call signature)."""
    if B > MAX_GRID_YZ:
        raise ValueError(f"q's batch ({B}) is above {MAX_GRID_YZ}, CUDA's limit on grid dims y and z, where the "
                         "decode kernels put it; split the batch")
    if Hkv * m_tiles > MAX_GRID_YZ:
        raise ValueError(f"k_cache's {Hkv} kv heads x {m_tiles} query tiles (of q's {Sq} queries x {Hq // Hkv} heads "
                         f"per kv head) = {Hkv * m_tiles} programs on CUDA grid dim y, above its limit {MAX_GRID_YZ}; "
                         "pass fewer queries per call")
    if splits > 1 and Hq > MAX_GRID_YZ:
        raise ValueError(f"q's {Hq} heads are above {MAX_GRID_YZ}, CUDA's limit on grid dim y, where the split-KV "
                         f"combine puts them ({splits} key splits); pass num_splits=1")


def check_launch_grid(q, k_cache, v_cache, block_table, num_splits: int, target=None) -> None:
    """check_grid for plan_append's and plan_decode's launches of these inputs, before either runs (the append must
    not write the caches of a call whose forward is then refused)."""
    B, Sq, Hq, D = q.shape
    Hkv = k_cache.shape[2]
    target = target if target is not None else target_for(q)
    cfg = decode_config(D, v_cache.shape[3], q.element_size(), target)
    m_tiles = cdiv(Hq // Hkv * Sq, rows_tile(Hq // Hkv * Sq, 16, cfg.max_block_m))
    splits = split_count(q, k_cache, v_cache, block_table, num_splits, target) if Hq > MAX_GRID_YZ else 1
    check_grid(B, Sq, Hq, Hkv, m_tiles, splits)


def plan_append(q, q_out, k, v, k_cache, v_cache, cos, sin, seqlens, batch_idx, block_table, *,
                interleaved: bool, q_same_pos: bool, target=None) -> Launch | None:
    """Rotate q into q_out (when cos is given) and write rotated k, and v into the cache at seqlens. Raises
    ValueError past CUDA's grid limits (check_grid)."""
    B, Sq, Hq, D = q.shape
    Snew = k.shape[1] if k is not None else 0
    rotary = cos is not None
    if B == 0 or (not rotary or Sq == 0) and Snew == 0:
        return None
    if B > MAX_GRID_YZ:
        check_grid(B, Sq, Hq, 1, 1, 1)
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
                CAPACITY=k_cache.shape[1] * (block_table.shape[1] if block_table is not None else 1),
                ROWS=k_cache.shape[0], COS_ROWS=cos.shape[0] if rotary else 0,
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
    Raises ValueError past CUDA's grid limits (check_grid).
    """
    B, Sq, Hq, D = q.shape
    Hkv, DV = k_cache.shape[2], v_cache.shape[3]
    target = target if target is not None else target_for(q)
    cfg = decode_config(D, DV, q.element_size(), target)
    group = Hq // Hkv
    block_m = rows_tile(group * Sq, 16, cfg.max_block_m)  # (query x head rows: 16 at least, tl.dot's minimum)
    m_tiles = cdiv(group * Sq, block_m)
    paged = block_table is not None
    num_splits = split_count(q, k_cache, v_cache, block_table, num_splits, target)
    check_grid(B, Sq, Hq, Hkv, m_tiles, num_splits)
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
    # fp32 (and fp64) inputs: q.k as two half-D dots, added. A tl.dot of inputs as wide as its accumulator sums the D
    # products in one chain (the interpreter's matmul, a GPU's FMA dot); two chains of D / 2 err ~1/sqrt(2) as much
    # (the scores' rms error at D = 64: 1.10e-6 -> 0.83e-6; a blocked CPU matmul's, the eager baseline's: 0.71e-6).
    # Half types lose nothing to the chain (fp16/bf16 products are exact in fp32); TF32 rounds the inputs far more.
    # 32- and 64-wide tiles only (the compile check, sm_86: at 64 the fp32 tile needs 96 registers, not 254; at 128,
    # 80-126 where one dot takes 52-80; at 256 it spills).
    dot_halves = (q.dtype in (torch.float32, torch.float64) and dot_precision(q.dtype) == "ieee"
                  and head_block(D) in (32, 64))
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
                PAGE=k_cache.shape[1] if paged else 1,
                CAPACITY=k_cache.shape[1] * (block_table.shape[1] if paged else 1), ROWS=k_cache.shape[0],
                right=(0 if causal else right) if has_right else 0,
                left=max(left, 0), qk_scale_hi=sc_hi, qk_scale_lo=sc_lo, softcap_hi=cap_hi, softcap_lo=cap_lo,
                log2e_hi=l2_hi, log2e_lo=l2_lo, BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_D=head_block(D),
                BLOCK_DV=head_block(DV), CAUSAL=has_right, WINDOW=left >= 0, LEFTPAD_ON=leftpad is not None,
                PAGED=paged, BATCH_IDX=batch_idx is not None, SOFTCAP=bool(softcap), ALIBI=alibi is not None,
                ACC=ACC_DTYPE[q.dtype], DOT_PREC=dot_precision(q.dtype), LENS_ON=seqlens is not None,
                KEY_MASK=key_mask is not None, QUERY_MASK=km_query != 0, DOT_HALVES=dot_halves)
    launches = [Launch(_decode_fwd, (num_splits, Hkv * m_tiles, B), args, cfg)]
    if num_splits > 1:
        block_r = rows_tile(Sq, 1, 16)  # (a symbolic Sq: 16, one graph for every count)
        cargs = dict(OP=o_dst, LP=l_dst, O=out, LSE=lse2,
                     **dict(zip(("stride_ps", "stride_pb", "stride_pm", "stride_ph", "stride_pd"), o_st)),
                     **dict(zip(("stride_lps", "stride_lpb", "stride_lph", "stride_lpm"), l_st)),
                     **dict(zip(("stride_ob", "stride_om", "stride_oh", "stride_od"), out.stride())),
                     **dict(zip(("stride_lb", "stride_lh", "stride_lm"), lse2.stride())),
                     Sq=Sq, DV=DV, NUM_SPLITS=num_splits, BLOCK_R=block_r,
                     BLOCK_S=combine_chunk(block_r, head_block(DV), target), BLOCK_DV=head_block(DV),
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
                                     scale, causal, window, softcap, num_splits, snew, key_mask)[:4],
                 twice=seqlens is None)  # (no lengths: the few-query route, whose keys may grow a token a call)


def decode_entry(q, k_cache, v_cache, out, lse2, seqlens, leftpad, batch_idx, block_table, alibi, *, scale: float,
                 causal: bool, window=(-1, -1), softcap: float = 0.0, num_splits: int = 0, snew: int = 0,
                 key_mask=None):
    """(entry, splits): the memoised launches (LaunchCache.entry) decode_attention would replay for these tensors
    (or None where it plans every call), and the split count whose partials, (splits, B, Sq, Hq, Dv) and
    (splits, B, Hq, Sq) in the accumulator dtype, a replay binds as its last two tensors (None for 1 split), in
    _DECODE_ROLES' order. flashtx._decode_lane and _small_q_lane keep it per call signature and fire it themselves."""
    key, roles, tensors, build, splits = _decode_cache_args(q, k_cache, v_cache, out, lse2, seqlens, leftpad,
                                                            batch_idx, block_table, alibi, scale, causal, window,
                                                            softcap, num_splits, snew, key_mask)
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
    several (the combine kernel, for 1 and 4 queries), contiguous and paged caches, every option at once, and the
    append."""
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
                    if splits > 1:  # (Sq = 4: 4-row tiles, chunks of fewer splits: configs.combine_chunk; the paged
                        # MHA partials' strides are another variant)
                        plans.append((f"decode_combine {name.split(' ', 1)[1]}", launches[1]))
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
            kn = torch.empty(B, 1, Hkv, d, dtype=dtype)
            q = torch.empty(B, 1, 4 * Hkv, d, dtype=dtype)
            kc = torch.empty(B * S // P, P, Hkv, d, dtype=dtype)
            # float32 tables, and tables in q's dtype (flash-attn's flash_attn_with_kvcache requires those)
            for tdt in dict.fromkeys((torch.float32, dtype)):
                cos = torch.empty(S, d // 4, dtype=tdt)
                plans.append((f"kv_append D={d} {str(dtype)[6:]} paged rotary"
                              + (f" {str(tdt)[6:]} tables" if tdt != torch.float32 else ""),
                              plan_append(q, torch.empty_like(q), kn, kn, kc, kc, cos, cos,
                                          torch.zeros(B, dtype=torch.int32), None,
                                          torch.zeros(B, S // P, dtype=torch.int32),
                                          interleaved=False, q_same_pos=False, target=target)))
    return plans


__all__ = ["plan_decode", "plan_append", "decode_attention", "kv_append", "num_splits_heuristic", "compile_plans",
           "check_grid", "check_launch_grid", "KNOWN_TARGETS"]
