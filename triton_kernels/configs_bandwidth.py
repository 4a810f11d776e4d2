"""Tile configs of the memory-bound kernels: fused RoPE (rotary.py), fused SwiGLU (swiglu.py) and the split-KV
decode forward (decode_kernels.py). Re-exported by configs, where the attention tables are."""
from __future__ import annotations

import dataclasses
import functools

from .targets import INTERPRETER_TARGET, Target, head_dim_bucket


# ==================================================================================================
# Elementwise kernels: fused RoPE (rotary.py) and fused SwiGLU (swiglu.py)
# ==================================================================================================
# Both are memory-bound single passes with no tl.dot and no shared-memory staging, so, unlike the
# attention tiles (configs.py), their configs do not depend on the target's shared memory: the goal is
# enough bytes in flight per thread to saturate HBM, without spilling registers. They have not
# been tuned on a GPU yet (bench/RESULTS.md will record it).


@dataclasses.dataclass(frozen=True)
class ElementwiseConfig:
    block_rows: int  # rotary: positions per program; swiglu: rows per program
    block_cols: int  # rotary: heads per program; swiglu: columns per program
    num_warps: int
    num_stages: int = 1  # no software-pipelined loop to stage
    reason: str = ""

    @functools.cached_property
    def launch_kwargs(self) -> dict:  # built once per config (launches read it per call)
        return {"num_warps": self.num_warps, "num_stages": self.num_stages}


# --------------------------------------------------------------------------------------- RoPE
# One program rotates a (positions, heads, rotary_dim / 2) tile of q (or of k): all the heads of a
# position tile at once when they fit (Liger's layout), so cos/sin are loaded once per position
# tile and broadcast over the heads. q and k share one launch but have their own tile shapes (a
# k tile sized for 32 q heads would be 75% masked with 8 KV heads).
#
# Tile budget: 2048 pairs per half = 16 elements per thread per half with 4 warps, i.e. two
# 16-byte fp16/bf16 vectors per thread for x1, two for x2 (the NeoX halves are two contiguous
# loads; the interleaved pairs are one contiguous load of 2 * R2 columns, split in registers).
# That is 8 KB read + 8 KB written per program in fp16; at ~16 resident programs per SM that is
# ~128 KB in flight per SM, several times what an H100/H200 SM needs to cover HBM latency (Little:
# 4.8 TB/s x ~0.6 us / 132 SMs ~ 22 KB), while the fp32 working set (x1, x2, o1, o2: 64
# registers, plus the broadcast cos/sin) stays far from spilling.
# LLaMA-3-8B (32 q / 8 kv heads, R2 = 64): q tiles 1 x 32 x 64, k tiles 4 x 8 x 64.
ROTARY_TILE_PAIRS = 2048
ROTARY_NUM_WARPS = 4
# Interpreter: tiny tiles so that test shapes (S ~ 5-20, H ~ 1-5) span several position tiles and
# head tiles, exercising every mask. Wider head counts get wider head tiles, at most INTERPRETER_TILES
# of them (still several): the interpreter runs programs one after another, so README- and
# benchmark-sized calls (32 heads) took 16 head tiles.
ROTARY_INTERPRETER = ElementwiseConfig(2, 2, 1, 1, "interpreter: several tiles in test-sized shapes")
INTERPRETER_TILES = 4  # tiles along a keyed width (heads, SwiGLU columns) the interpreter's tiles aim at

# -------------------------------------------------------------------------------------- SwiGLU
# (rows, columns) tiles of the (M, H) activations, on a flat grid (column tiles fastest, so
# consecutive programs stream consecutive memory). 4096 elements over 8 warps = 16 per thread per
# tensor: two 16-byte fp16/bf16 vectors. Forward: 16 KB read + 8 KB written per program (fp16);
# backward: 24 KB read + 16 KB written. The backward's fp32 working set (g, u, do, s, dg, du) is
# ~96 registers per thread: no spills (compile check).
SWIGLU_TILE_ELEMENTS = 4096
SWIGLU_NUM_WARPS = 8
# Column tiles, widest first: the widest that divides H, else the widest whose padding is at most
# 1/32 of the row (see swiglu_block_h). LLaMA widths get no masked tail at all: 11008 = 43 x 256,
# 14336 = 7 x 2048, 28672 = 14 x 2048.
SWIGLU_BLOCK_H_CANDIDATES = (2048, 1024, 512, 256)
SWIGLU_MAX_PAD_FRACTION = 1 / 32
# Interpreter: 4 x 16 tiles so test shapes (M ~ 1-20, H ~ 1-40) cover partial tiles both ways; wider rows
# get wider column tiles, INTERPRETER_TILES of them (as RoPE's head tiles).
SWIGLU_INTERPRETER = ElementwiseConfig(4, 16, 1, 1, "interpreter: several tiles in test-sized shapes")


def _pow2_at_least(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def _interpreter_config(base: ElementwiseConfig, width: int) -> ElementwiseConfig:
    """base, or for a width (heads, columns) that base's column tile splits into more than INTERPRETER_TILES
    tiles, the narrowest power-of-two column tile that splits it into at most INTERPRETER_TILES."""
    cols = _pow2_at_least(-(-max(width, 1) // INTERPRETER_TILES))
    if cols <= base.block_cols:
        return base
    return dataclasses.replace(base, block_cols=cols,
                               reason=f"{base.reason}; {cols}-wide column tiles at width {width}")


def rotary_config(r2: int, heads: int, seqlen: int, target: Target) -> ElementwiseConfig:
    """(positions, heads) per program of a rotary tile of R2 = rotary_dim / 2 pairs (any target; no
    shared memory). block_rows x block_cols x pow2(R2) <= ROTARY_TILE_PAIRS, heads first."""
    if target is INTERPRETER_TARGET:
        return _interpreter_config(ROTARY_INTERPRETER, heads)
    width = _pow2_at_least(max(r2, 1))
    block_h = max(1, min(_pow2_at_least(max(heads, 1)), ROTARY_TILE_PAIRS // width))
    block_s = max(1, ROTARY_TILE_PAIRS // (width * block_h))
    block_s = min(block_s, _pow2_at_least(max(seqlen, 1)))  # decoding (S = 1) wastes no lanes on padding
    return ElementwiseConfig(block_s, block_h, ROTARY_NUM_WARPS, 1,
                             f"{ROTARY_TILE_PAIRS} pairs per tile, heads first; cos/sin loaded once per tile")


def swiglu_block_h(hidden: int) -> int:
    """Column tile: the widest candidate that divides `hidden` (no masked tail at all), else the
    widest whose padding is at most SWIGLU_MAX_PAD_FRACTION of the padded row; never wider than
    the next power of two of `hidden`."""
    fits = [c for c in SWIGLU_BLOCK_H_CANDIDATES if c <= _pow2_at_least(max(hidden, 1))]
    for c in fits:
        if hidden % c == 0:
            return c
    for c in fits:
        padded = -(-hidden // c) * c
        if padded - hidden <= SWIGLU_MAX_PAD_FRACTION * padded:
            return c
    return fits[-1] if fits else _pow2_at_least(max(hidden, 1))


def swiglu_config(hidden: int, rows: int, target: Target) -> ElementwiseConfig:
    """(rows, columns) tile of a SwiGLU launch, forward and backward alike."""
    if target is INTERPRETER_TARGET:
        return _interpreter_config(SWIGLU_INTERPRETER, hidden)
    cols = min(swiglu_block_h(hidden), _pow2_at_least(max(hidden, 1)))
    block_rows = max(1, SWIGLU_TILE_ELEMENTS // cols)
    block_rows = min(block_rows, _pow2_at_least(max(rows, 1)))
    return ElementwiseConfig(block_rows, cols, SWIGLU_NUM_WARPS, 1,
                             f"{SWIGLU_TILE_ELEMENTS}-element tile, {cols} columns (little padding at this width)")


# ==================================================================================================
# Decoding (decode_kernels.py, launched by decode.py): the split-KV forward over a KV cache
# ==================================================================================================
@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    block_n: int  # keys per tile
    max_block_m: int  # rows (query x head pairs) per tile, at most
    num_warps: int
    num_stages: int
    reason: str = ""

    @property
    def launch_kwargs(self) -> dict:
        return {"num_warps": self.num_warps, "num_stages": self.num_stages}

    def shared_memory(self, d: int, dv: int, elt: int) -> int:
        """Upper estimate of a program's shared memory, bytes: num_stages - 1 K and V buffers (Triton's pipeliner:
        the compile check reports 38,912 bytes for 64 keys at 2 stages and 71,680 at 3, D = 128 16-bit) and a q tile
        of max_block_m rows."""
        return max(self.num_stages - 1, 1) * self.block_n * (d + dv) * elt + self.max_block_m * d * elt


def decode_programs_per_sm(cfg: DecodeConfig, d: int, dv: int, elt: int, target: Target) -> int:
    """Programs of this tile the split heuristic counts an SM as running at once. By threads, flash-attn 2's count:
    2 of its 128-thread blocks (flash_api.cpp, set_params_splitkv: num_splits_heuristic(..., multiProcessorCount *
    2, ...), "to hard-code the fact that we're using 128 threads per block"), so 2 at 4 warps, 1 at 8; but no more
    than fit the SM's shared memory by cfg.shared_memory (target.max_shared, a block's limit, standing for the
    SM's): one 72-82 KB 16-bit tile on sm_86/89, where flash-attn 2 still counts two of its 80 KB blocks."""
    by_threads = max(1, 8 // cfg.num_warps)
    return max(1, min(by_threads, target.max_shared // max(cfg.shared_memory(d, dv, elt), 1)))


# Per element size and head-dim bucket. Decoding is bandwidth-bound: what matters is K/V bytes in flight per SM.
# 16-bit: flash-attn 2's split-KV forward tiles (flash_fwd_launch_template.h run_mha_fwd_splitkv_dispatch: 64 rows,
# kBlockN = 256 / 128 / 64 keys at head dims <= 64 / 128 / 256, 4 warps), with 2 stages (at head dim 64 half the
# keys, 3 stages): 72-77 KB of shared memory, within sm_86's 101,376 bytes; no spills with every option on
# sm_80/86/90 (compile check). The 64-key tiles they replace (untimed) reached 56% of copy bandwidth back to back
# at B = 8, 8k keys, GQA 32/8 on an H100 (2026-12-06, bench/RESULTS.md), where SDPA's FlashAttention-2 ran 1.6x
# faster. Not yet timed on a GPU.
FA2_SPLITKV = "flash-attn 2's split-KV forward tile (kBlockN keys, 4 warps; run_mha_fwd_splitkv_dispatch)"
_DECODE = {
    2: {64: DecodeConfig(128, 64, 4, 3, FA2_SPLITKV + " has 256 keys: with 2 stages, 8 bytes of spills on sm_90 "
                         "(Triton 3.9, the no-lengths lane) and up to 244 registers; half the keys with 3 stages keeps "
                         "64 KB of K/V ahead (71,680 bytes of shared memory), at most 128 registers, no spills"),
        128: DecodeConfig(128, 64, 4, 2, FA2_SPLITKV + ", 2 stages: K+V tiles 64 KB a stage"),
        256: DecodeConfig(64, 32, 4, 2, FA2_SPLITKV + ", 2 stages: K+V tiles 64 KB a stage; at most 32 rows (the "
                            "previous tile's: a (64, 256) fp32 accumulator would spill at 4 warps)")},
    4: {64: DecodeConfig(32, 32, 4, 2, "fp32: compile-checked (no anchor has an fp32 decode tile)"),
        128: DecodeConfig(16, 16, 8, 2, "fp32 at D = 128: 32-key tiles spilled on sm_86/90; 4 warps spilled"
                            " without lengths or with a key mask, as 8 warps at 1 stage on Triton 3.6"),
        256: DecodeConfig(16, 16, 4, 1, "fp32 at D = 256")},
}
# Interpreter: 16-key tiles so test caches span many tiles, splits and pages.
_DECODE_INTERPRETER = DecodeConfig(16, 32, 1, 1, "interpreter")


def decode_config(d: int, dv: int, elt: int, target: Target) -> DecodeConfig:
    """The decode forward's tile for head dims (d, dv) at this element size (the same on every arch so far)."""
    if target is INTERPRETER_TARGET:
        return _DECODE_INTERPRETER
    return _DECODE[2 if elt <= 2 else 4][head_dim_bucket(max(d, dv))]


# The split-KV combine (decode_kernels._decode_combine) reads its splits' partials a chunk at a time, every load of a
# chunk in flight at once: COMBINE_CHUNK_ELEMENTS elements of (rows, splits, value head dim) a chunk, so 32 splits at
# one row and head dim 128 (flash-attn 2's heuristic gives a batch-1 decode on an H100 about 30 splits), 32 fp32
# registers a thread at 4 warps. Derived, untimed. The interpreter's chunks are 2 splits: tests cross their bounds.
COMBINE_CHUNK_ELEMENTS = 4096
COMBINE_CHUNK_INTERPRETER = 2


def combine_chunk(block_r: int, block_dv: int, target: Target) -> int:
    """Splits a chunk of _decode_combine reads at once (BLOCK_S, a power of two), for row tile block_r and value
    tile block_dv."""
    if target is INTERPRETER_TARGET:
        return COMBINE_CHUNK_INTERPRETER
    return max(1, min(32, COMBINE_CHUNK_ELEMENTS // (block_r * block_dv)))
