"""The index check of KV-cache decoding on the device: one tiny kernel, one flag.

flashtx.flash_attn_with_kvcache follows cache_seqlens, cache_leftpad, cache_batch_idx, block_table
and the rotary positions into its caches and tables. On CPU it reads them on the host and names the
first bad entry; on a GPU (no host sync) `_decode_check` evaluates every condition in one program
and writes FLAG[0] = 1 (all in range) or 0, which one torch._assert_async then checks, before the
append and attention kernels run (a device-side assert stops every later kernel of the stream):

- 0 <= cache_seqlens[b] and end_b = cache_seqlens[b] + Snew <= the cache's capacity;
- 0 <= cache_leftpad[b] <= end_b;
- 0 <= cache_batch_idx[b] < k_cache.shape[0], and, when k, v are appended to at most DISTINCT_MAX_B sequences,
  no row twice (two sequences would write one cache row);
- 0 <= block_table[b, p] < num_pages (= k_cache.shape[0]) for every page the kernels touch: those that hold a
  position in [first_b, end_b), where first_b is the first appended position (Snew > 0) or the first key a query
  may see, whichever is lower: max(cache_leftpad[b], end_b - key_span) with key_span = Sq + the window's left
  side (windowed), else cache_leftpad[b] (or 0). Other entries are never read, so they may hold anything (past a
  sequence's length, or pages that a serving engine freed behind a sliding window or before the left padding);
- the last rotated position, max(end_b - 1, cache_seqlens[b] + q_extra), is a row of the RoPE tables.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .configs import INTERPRETER_TARGET, ElementwiseConfig
from .launch import LAUNCHES, Launch, target_for


@triton.jit
def _decode_check(FLAG, SEQLENS, LEFTPAD, BIDX, BT, B, SNEW, CAPACITY, ROWS, stride_btb, PAGES, PAGE, COS_ROWS,
                  Q_EXTRA, KEY_SPAN, BLOCK_B: tl.constexpr, BLOCK_P: tl.constexpr, LEFTPAD_ON: tl.constexpr,
                  BATCH_IDX: tl.constexpr, DISTINCT: tl.constexpr, PAGED: tl.constexpr, ROTARY: tl.constexpr):
    """One program over the batch in BLOCK_B blocks (and each block's table in BLOCK_P columns)."""
    bad = tl.zeros([BLOCK_B], dtype=tl.int32)
    for b0 in range(0, B, BLOCK_B):
        offs = b0 + tl.arange(0, BLOCK_B)
        live = offs < B
        lens = tl.load(SEQLENS + offs, mask=live, other=0).to(tl.int64)
        end = lens + SNEW
        ok = (lens >= 0) & (end <= CAPACITY)
        first = lens * 0  # the first position the kernels touch (the pages checked)
        if LEFTPAD_ON:
            lp = tl.load(LEFTPAD + offs, mask=live, other=0).to(tl.int64)
            ok = ok & (lp >= 0) & (lp <= end)
            first = lp
        if BATCH_IDX:
            bi = tl.load(BIDX + offs, mask=live, other=0).to(tl.int64)
            ok = ok & (bi >= 0) & (bi < ROWS)
            if DISTINCT:  # appending: no two sequences may write one cache row
                for c0 in range(0, B, BLOCK_B):
                    offs2 = c0 + tl.arange(0, BLOCK_B)
                    bi2 = tl.load(BIDX + offs2, mask=offs2 < B, other=0).to(tl.int64)
                    same = (bi[:, None] == bi2[None, :]) & (offs[:, None] != offs2[None, :]) & (offs2[None, :] < B)
                    ok = ok & (tl.max(same.to(tl.int32), 1) == 0)
        if ROTARY:
            ok = ok & (tl.maximum(end - 1, lens + Q_EXTRA) < COS_ROWS)
        if PAGED:
            first = tl.where(KEY_SPAN >= 0, tl.maximum(first, end - KEY_SPAN), first)  # (a window's first key)
            first = tl.where(SNEW > 0, tl.minimum(first, lens), first)  # (the first appended position)
            for p0 in range(0, PAGES, BLOCK_P):
                cols = p0 + tl.arange(0, BLOCK_P)
                start = cols[None, :].to(tl.int64) * PAGE  # (1, BLOCK_P) the pages' first positions
                used = live[:, None] & (cols[None, :] < PAGES) & (start < end[:, None]) & \
                    (start + PAGE > first[:, None])
                pg = tl.load(BT + offs[:, None].to(tl.int64) * stride_btb + cols[None, :], mask=used,
                             other=0).to(tl.int64)  # (BLOCK_B, BLOCK_P)
                page_bad = tl.where(used & ((pg < 0) | (pg >= ROWS)), 1, 0)
                ok = ok & (tl.max(page_bad, 1) == 0)
        bad += tl.where(live & ~ok, 1, 0)
    tl.store(FLAG, (tl.sum(bad, 0) == 0).to(tl.int32))


# The repeated-row check compares every pair of cache_batch_idx entries in this one program: (B / 64)**2 tile
# pairs, 16 at B = 256. Past this batch the caller must ensure distinct rows when appending, as with flash-attn.
DISTINCT_MAX_B = 256


def plan_check(flag, seqlens, leftpad, batch_idx, block_table, *, snew: int, capacity: int, rows: int, page: int,
               cos_rows: int, q_extra: int, key_span: int = -1, target=None) -> Launch:
    """The check of seqlens (B,) [, leftpad (B,), batch_idx (B,), block_table (B, pages)] into flag (1,) int32.

    capacity: positions per sequence (cache length, or pages x page size); rows: k_cache.shape[0] (cache
    rows, or pages); page: the page size (paged caches); cos_rows: the RoPE tables' rows (-1: no tables);
    q_extra: Sq - 1 when the queries are rotated at successive positions, else 0; key_span: Sq + the window's
    left side (-1: no window). Index tensors int32 or int64, contiguous.
    """
    B = seqlens.shape[0]
    paged = block_table is not None
    pages = block_table.shape[1] if paged else 0
    # Tiles by range, and the sizes passed as they come (no int()): under torch.compile they are symbolic, and a
    # power of two of the batch or an int() of the capacity would compile a graph per batch size or table width
    block_b = 16 if B <= 16 else 64
    block_p = 16 if pages <= 16 else 32  # a (64, 32) table tile at most: no spills
    dummy = seqlens  # never read
    args = dict(FLAG=flag, SEQLENS=seqlens, LEFTPAD=leftpad if leftpad is not None else dummy,
                BIDX=batch_idx if batch_idx is not None else dummy, BT=block_table if paged else dummy,
                B=B, SNEW=snew, CAPACITY=capacity, ROWS=rows,
                stride_btb=block_table.stride(0) if paged else 0, PAGES=pages,
                PAGE=page if paged else 1, COS_ROWS=cos_rows if cos_rows >= 0 else 0,
                Q_EXTRA=q_extra, KEY_SPAN=key_span, BLOCK_B=block_b, BLOCK_P=block_p, LEFTPAD_ON=leftpad is not None,
                BATCH_IDX=batch_idx is not None, DISTINCT=batch_idx is not None and snew > 0 and B <= DISTINCT_MAX_B,
                PAGED=paged,
                ROTARY=cos_rows >= 0)
    warps = 1 if (target or target_for(seqlens)) is INTERPRETER_TARGET else 4
    return Launch(_decode_check, (1,), args, ElementwiseConfig(block_b, block_p, warps, 1))


_ROLES = ("FLAG", "SEQLENS", "LEFTPAD", "BIDX", "BT")  # the kernel argument of each launch-cache input


def _check_cache_args(flag, seqlens, leftpad, batch_idx, block_table, snew: int, capacity: int, rows: int, page: int,
                      cos_rows: int, q_extra: int, key_span: int) -> tuple:
    """(key, roles, tensors, build) of the check's launch-cache entry (LaunchCache.run / .entry)."""
    return (("decode_check", seqlens.device, snew, capacity, rows, page, cos_rows, q_extra, key_span), _ROLES,
            (flag, seqlens, leftpad, batch_idx, block_table),
            lambda: [plan_check(flag, seqlens, leftpad, batch_idx, block_table, snew=snew, capacity=capacity,
                                rows=rows, page=page, cos_rows=cos_rows, q_extra=q_extra, key_span=key_span)])


def decode_check(flag, seqlens, leftpad, batch_idx, block_table, *, snew: int, capacity: int, rows: int, page: int,
                 cos_rows: int, q_extra: int, key_span: int = -1) -> None:
    """Launch the check (see plan_check); nothing for an empty batch (flag stays as the caller set it)."""
    if seqlens.shape[0] == 0:
        return
    LAUNCHES.run(*_check_cache_args(flag, seqlens, leftpad, batch_idx, block_table, snew, capacity, rows, page,
                                    cos_rows, q_extra, key_span))


def decode_check_entry(flag, seqlens, leftpad, batch_idx, block_table, *, snew: int, capacity: int, rows: int,
                       page: int, cos_rows: int, q_extra: int, key_span: int = -1):
    """The memoised launch (LaunchCache.entry) decode_check would replay for these tensors (in _ROLES' order), or
    None where it plans every call. flashtx._decode_lane keeps it per call signature (a non-empty batch)."""
    return LAUNCHES.entry(*_check_cache_args(flag, seqlens, leftpad, batch_idx, block_table, snew, capacity, rows,
                                             page, cos_rows, q_extra, key_span))


def compile_plans(target) -> list:
    """The check for the compile check: small and large batches, contiguous (every option) and paged
    caches, int32 and int64 indices."""
    plans = []
    for B, paged, opts, dtype in ((2, False, False, torch.int32), (2, False, True, torch.int32),
                                  (4, True, True, torch.int32), (300, True, True, torch.int64),
                                  (200, False, True, torch.int64)):  # the repeated-row check over 4 x 4 tiles
        lens = torch.zeros(B, dtype=dtype)
        flag = torch.empty(1, dtype=torch.int32)
        bt = torch.zeros(B, 64, dtype=dtype) if paged else None
        launch = plan_check(flag, lens, lens if opts else None, lens if opts and not paged else None, bt,
                            snew=1, capacity=1024, rows=B * 64 if paged else B, page=16, cos_rows=4096 if opts else -1,
                            q_extra=0, target=target)
        name = f"decode_check B={B} {str(dtype)[6:]}{' paged' if paged else ''}{' all-options' if opts else ''}"
        plans.append((name, launch))
    return plans


__all__ = ["plan_check", "decode_check", "compile_plans"]
