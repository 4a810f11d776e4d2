"""The attention kernels' tile loops (attention_common.kv_loop_bounds, q_loop_bounds and loop_part) against
visibility itself, over random lengths, alignments, windows, tile shapes and tile positions.

The forward and dQ loop over key tiles, dK/dV over query tiles, each in three parts: masked, unmasked, masked.
The kernel tests see a wrong bound only at the one residue (modulo a tile) where it moves a tile into the
unmasked part or out of the loop, and their shapes do not hit every residue (a mutation of dK/dV's first fully
visible row, `all_vis - 1`, passed them). Here the bounds the kernels compute (one interpreter launch per tile
shape and flag set, thousands of cases each) must satisfy, case by case:
- every visible (query, key) pair of the tile is in a visited tile, and no tile is visited twice;
- every tile of the unmasked part lies inside the lengths and is visible to every row (every key) of the tile;
- lo, the unmasked bounds and (for queries) hi are multiples of the tile, as the loops step from them.
"""
import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from conftest import DEVICE

from flashtx.triton_kernels.attention_common import kv_loop_bounds, loop_part, q_loop_bounds

N_ARGS, N_OUT = 6, 20  # (m0, n0, Sq_b, Sk_b, causal_shift, window_shift); 10 values per side


@triton.jit
def _store_side(out, c, ok, lo, mid_lo, mid_hi, hi):
    z = c * 0  # (the bounds may be Python ints: broadcast them)
    tl.store(out + 0, (z + lo).to(tl.int32), mask=ok)
    tl.store(out + 1, (z + mid_lo).to(tl.int32), mask=ok)
    tl.store(out + 2, (z + mid_hi).to(tl.int32), mask=ok)
    tl.store(out + 3, (z + hi).to(tl.int32), mask=ok)
    for part in tl.static_range(3):
        start, end = loop_part(part, lo, mid_lo, mid_hi, hi)
        tl.store(out + 4 + 2 * part, (z + start).to(tl.int32), mask=ok)
        tl.store(out + 5 + 2 * part, (z + end).to(tl.int32), mask=ok)


@triton.jit
def _bounds_many(ARGS, OUT, N, BM: tl.constexpr, BN: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
                 KEY_MASK: tl.constexpr, BLOCK: tl.constexpr):
    """Per case: kv_loop_bounds' four values and loop_part's three (start, end) for the q tile at m0, then the same
    of q_loop_bounds for the key tile at n0 (OUT: int32 (N, 20))."""
    c = tl.arange(0, BLOCK)
    ok = c < N
    a = ARGS + c * 6
    m0 = tl.load(a + 0, mask=ok, other=0)
    n0 = tl.load(a + 1, mask=ok, other=0)
    Sq_b = tl.load(a + 2, mask=ok, other=0)
    Sk_b = tl.load(a + 3, mask=ok, other=0)
    cs = tl.load(a + 4, mask=ok, other=0)
    ws = tl.load(a + 5, mask=ok, other=0)
    lo, full_lo, full_hi, hi = kv_loop_bounds(m0, Sq_b, Sk_b, cs, ws, BM, BN, CAUSAL, WINDOW, KEY_MASK)
    _store_side(OUT + c * 20, c, ok, lo, full_lo, full_hi, hi)
    lo, free_lo, free_hi, hi = q_loop_bounds(n0, Sq_b, Sk_b, cs, ws, BM, BN, CAUSAL, WINDOW, KEY_MASK)
    _store_side(OUT + c * 20 + 10, c, ok, lo, free_lo, free_hi, hi)


def _cases(rng, n: int, BM: int, BN: int) -> np.ndarray:
    """(n, 6) int32 cases: lengths 0..300 (tile multiples and their neighbours often), top-left or bottom-right
    alignment, right and left window sizes from 0 to past the lengths, and tile starts up to one tile past the
    lengths (a padded batch row's)."""
    def length():
        if rng.random() < 0.3:
            return max(0, int(rng.integers(0, 5)) * int(rng.choice([BM, BN])) + int(rng.integers(-1, 2)))
        return int(rng.integers(0, 301))

    rows = []
    for _ in range(n):
        Sq, Sk = length(), length()
        align = (Sk - Sq) * int(rng.integers(0, 2))
        right = int(rng.choice([0, rng.integers(0, 70), 400]))
        left = int(rng.choice([0, rng.integers(0, 70), 400]))
        m0 = int(rng.integers(0, Sq // BM + 2)) * BM
        n0 = int(rng.integers(0, Sk // BN + 2)) * BN
        rows.append((m0, n0, Sq, Sk, align + right, align - left))
    return np.array(rows, dtype=np.int32)


def _visible(rows, keys, Sq, Sk, cs, ws, causal, window):
    i, j = rows[:, None], keys[None, :]
    vis = (i >= 0) & (i < Sq) & (j >= 0) & (j < Sk)
    if causal:
        vis &= j <= i + cs
    if window:
        vis &= j >= i + ws
    return vis


def _tiles(out10, step: int):
    """[(tile start, masked)] the three loop parts visit (part 1 unmasked)."""
    return [(t, part != 1) for part in range(3) for t in range(out10[4 + 2 * part], out10[5 + 2 * part], step)]


def _check_side(name, out10, other, S_mine, step, vis_fn, other_full=True):
    """One side's bounds out10: the loop steps over tiles of `step` indices up to S_mine (keys for kv_loop_bounds),
    for a fixed tile whose valid indices are `other`; vis_fn(indices, other) -> (len(indices), len(other))
    visibility. other_full: whether an unmasked part needs the fixed tile whole (dK/dV's key tile: its loop has no
    key mask there; the forward's padding rows are never stored)."""
    lo, mid_lo, mid_hi, hi = (int(x) for x in out10[:4])
    assert lo % step == 0 and mid_lo % step == 0 and mid_hi % step == 0, f"{name}: bounds off the tile grid"
    tiles = _tiles(out10, step)
    starts = [t for t, _ in tiles]
    assert len(starts) == len(set(starts)), f"{name}: a tile visited twice: {starts}"
    assert all(t >= 0 for t in starts), f"{name}: a tile before index 0"
    idx = np.arange(0, max(S_mine, 0) + step)
    vis = vis_fn(idx, other)
    needed = idx[vis.any(1)] if len(other) else idx[:0]
    covered = np.zeros(len(idx), dtype=bool)
    for t in starts:
        covered[t:t + step] = True
    missed = needed[~covered[needed]]
    assert missed.size == 0, f"{name}: visible indices {missed.tolist()[:8]} in no visited tile"
    for t, masked in tiles:
        if masked or len(other) == 0:
            continue
        assert t + step <= S_mine, f"{name}: unmasked tile {t} runs past the length {S_mine}"
        assert other_full, f"{name}: an unmasked tile {t} for a partial fixed tile"
        assert vis[t:t + step].all(), f"{name}: unmasked tile {t} holds a hidden pair"


@pytest.mark.parametrize("key_mask", [False, True])
@pytest.mark.parametrize("causal,window", [(True, False), (False, True), (True, True), (False, False)],
                         ids=["causal", "window", "causal-window", "none"])
@pytest.mark.parametrize("BM,BN", [(16, 16), (32, 64), (64, 32), (128, 64), (64, 128)])
def test_tile_loops_visit_every_visible_pair_and_mask_every_hidden_one(BM, BN, causal, window, key_mask):
    rng = np.random.default_rng(BM * 1000 + BN * 10 + 4 * causal + 2 * window + key_mask)
    cases = _cases(rng, 1500, BM, BN)
    out = torch.full((len(cases), N_OUT), -(2**31), dtype=torch.int32, device=DEVICE)
    _bounds_many[(1,)](torch.from_numpy(cases).to(DEVICE), out, len(cases), BM=BM, BN=BN, CAUSAL=causal,
                       WINDOW=window, KEY_MASK=key_mask, BLOCK=2048)
    out = out.cpu().numpy()
    for (m0, n0, Sq, Sk, cs, ws), res in zip(cases.tolist(), out):
        where = f"Sq {Sq}, Sk {Sk}, causal shift {cs}, window shift {ws}, tile {BM}x{BN}"
        rows = np.arange(m0, min(m0 + BM, Sq))  # the q tile's valid rows
        _check_side(f"kv_loop_bounds(m0={m0}) [{where}]", res[:10], rows, Sk, BN,
                    lambda keys, rows: _visible(rows, keys, Sq, Sk, cs, ws, causal, window).T)
        keys = np.arange(n0, min(n0 + BN, Sk))  # the key tile's valid keys
        _check_side(f"q_loop_bounds(n0={n0}) [{where}]", res[10:], keys, Sq, BM,
                    lambda qrows, keys: _visible(qrows, keys, Sq, Sk, cs, ws, causal, window), n0 + BN <= Sk)
        if key_mask:  # every tile needs the key mask: no unmasked part
            assert all(masked for _, masked in _tiles(res[:10], BN)), "kv_loop_bounds: an unmasked tile with a key mask"
            assert all(masked for _, masked in _tiles(res[10:], BM)), "q_loop_bounds: an unmasked tile with a key mask"
