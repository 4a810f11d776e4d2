"""Pieces shared by the attention kernels: visibility masks, loop bounds and scalars.

Conventions used by every attention kernel:
- Tensors are addressed through (batch, head, seq, dim) strides, so (B, H, S, D) and (B, S, H, D)
  layouts both run without copies.
- Query row i sees key column j iff j < Sk and, when CAUSAL, j <= i + causal_shift, where
  causal_shift is 0 for top-left alignment (SDPA) and Sk - Sq for bottom-right (flash-attn).
- Scores live in the log2 domain: s2 = (q . k) * scale * log2(e), so the softmax uses exp2, and
  the stored log-sum-exp `lse2` is in log2 units (natural lse = lse2 * ln 2).
- Float scalars arrive as float32 hi/lo pairs (hi + lo = value to ~48 bits) and are summed in the
  accumulator dtype, so float64 runs keep float64 accuracy.
"""
import triton
import triton.language as tl


@triton.jit
def scalar_in(hi, lo, DTYPE: tl.constexpr):
    """Rebuild a float argument in DTYPE from its float32 hi/lo halves."""
    return tl.cast(hi, DTYPE) + tl.cast(lo, DTYPE)


@triton.jit
def visible(q_idx, k_idx, Sq, Sk, causal_shift, CAUSAL: tl.constexpr):
    """Boolean tile: may query row q_idx attend to key k_idx (broadcast 2-D indices)."""
    vis = (q_idx < Sq) & (k_idx < Sk)
    if CAUSAL:
        vis = vis & (k_idx <= q_idx + causal_shift)
    return vis


@triton.jit
def kv_loop_bounds(m0, Sk, causal_shift, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    """Key range for the q tile starting at row m0, split for masking.

    Returns (full_end, end): key tiles in [0, full_end) are visible to every row of the q tile and
    lie inside Sk, so they need no mask; tiles in [full_end, end) need masking; keys from `end` on
    are invisible to the whole tile and are skipped.
    """
    if CAUSAL:
        end = tl.minimum(Sk, m0 + BLOCK_M + causal_shift)  # last row sees j <= m0 + BLOCK_M - 1 + shift
        full = tl.minimum(Sk, m0 + 1 + causal_shift)  # first row sees j <= m0 + shift
        end = tl.maximum(end, 0)
        full = tl.maximum(full, 0)
    else:
        end = Sk
        full = Sk
    full_end = (full // BLOCK_N) * BLOCK_N
    return full_end, end


@triton.jit
def q_loop_bounds(n0, Sq, Sk, causal_shift, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    """Query range for the K/V tile starting at key n0, split for masking.

    Returns (lo, free_lo, free_hi, hi): q tiles in [lo, hi) see at least one key of the tile; of
    those, [free_lo, free_hi) see all of its keys and lie inside Sq (no mask), the rest need
    masking. All bounds are multiples of BLOCK_M; free_hi <= free_lo means the unmasked range is
    empty.
    """
    hi = tl.cdiv(Sq, BLOCK_M) * BLOCK_M
    if CAUSAL:
        first = tl.maximum(n0 - causal_shift, 0)  # first row that sees key n0
        lo = (first // BLOCK_M) * BLOCK_M
        all_vis = tl.maximum(n0 + BLOCK_N - 1 - causal_shift, lo)  # first row that sees the tile's last key
        free_lo = tl.cdiv(all_vis, BLOCK_M) * BLOCK_M
    else:
        lo = 0
        free_lo = 0
    free_hi = (Sq // BLOCK_M) * BLOCK_M
    # A partial K/V tile needs the column mask in every q tile: empty the unmasked range.
    free_hi = tl.where(n0 + BLOCK_N > Sk, free_lo, free_hi)
    lo = tl.minimum(lo, hi)
    return lo, free_lo, free_hi, hi
