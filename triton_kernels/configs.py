"""Tile configurations for every Triton kernel, in one place.

Each kernel has an ordered list of candidate configs per padded head dim. The launcher picks the
first candidate whose estimated shared memory fits the target GPU, so an RTX 3090 (sm_86,
101,376 bytes a block) never launches a config that only fits an A100 or H100. The compile check
(tests/test_compile.py) compiles every config that this selection can return for sm_80, sm_86 and
sm_90 without a GPU and checks the compiler's real shared memory against the limit.

Provenance: the candidates started from the shapes FlashAttention-2's Triton tutorial uses on
Ampere (A100) and were trimmed with the compile check (Triton 3.9's ptxas for sm_86) until none
spills or exceeds the RTX 3090's shared memory. They have not been timed on a GPU yet: speed
tuning belongs to the benchmark issue, and bench/RESULTS.md records every GPU run.
"""
from __future__ import annotations

import dataclasses
import functools
import os


@dataclasses.dataclass(frozen=True)
class Target:
    """What config selection needs to know about a GPU."""

    arch: int  # compute capability as 10 * major + minor, e.g. 86
    max_shared: int  # max dynamic shared memory per block, bytes
    warp_size: int = 32


# Max dynamic shared memory per block (cudaDevAttrMaxSharedMemoryPerBlockOptin), from NVIDIA's
# CUDA C++ Programming Guide, "Compute capabilities" table.
KNOWN_TARGETS = {
    80: Target(80, 166_912),  # A100
    86: Target(86, 101_376),  # RTX 3090 / A10 / A40
    89: Target(89, 101_376),  # RTX 4090 / L4 / L40
    90: Target(90, 232_448),  # H100 / H200
}

# One config for Triton's interpreter: blocks small enough that test shapes (S up to a few
# hundred) span several tiles in both directions, and unequal BLOCK_M / BLOCK_N so that the
# causal tile-skipping logic is exercised for non-square tiles.
INTERPRETER_TARGET = Target(0, 1 << 30)


@dataclasses.dataclass(frozen=True)
class TileConfig:
    block_m: int  # rows of Q per tile
    block_n: int  # rows of K/V per tile
    num_warps: int
    num_stages: int
    reason: str = ""

    @property
    def launch_kwargs(self) -> dict:
        return {"num_warps": self.num_warps, "num_stages": self.num_stages}


# Candidates, best first, per kernel, element size (2: fp16/bf16, 4: fp32) and padded head dim
# (the larger of the qk and v dims). Every entry was compiled for sm_80/86/90 by the compile check
# (no spills, shared memory within the limit); the register notes are from sm_86's ptxas.
_FWD = {
    2: {
        64: [TileConfig(128, 64, 8, 3, "FA2 tutorial's Ampere tile for D<=64; 4 warps spill on sm_80")],
        # 128x64 K/V tiles spilled 24 bytes on sm_80 with varlen + window (255 registers); 128x32
        # stays under 230 registers for every variant.
        128: [TileConfig(128, 32, 8, 2, "8 warps hold the 128x128 fp32 accumulator without spills; 48 KB")],
        256: [TileConfig(64, 32, 8, 2, "64x256 accumulator over 8 warps; 68 KB fits sm_86")],
    },
    4: {
        64: [TileConfig(64, 32, 8, 2, "fp32 tiles are twice the bytes; 64x64 spills on sm_90")],
        128: [TileConfig(16, 16, 4, 1, "fp32 at D=128: every larger tile tried spills on sm_86 or sm_90")],
        256: [TileConfig(32, 32, 8, 1, "96 KB: just fits sm_86")],
    },
}

# dK/dV kernel: block_m is the q tile it streams, block_n the K/V rows it owns.
_BWD_DKDV = {
    2: {
        # FA2 tutorial's dK/dV tile is 32x128 with 3 stages; with the window/varlen/mask bounds it
        # spills 16-40 bytes on sm_80/86 (255 registers), so 16 q rows per step (no spills anywhere).
        64: [TileConfig(16, 128, 8, 2, "128 K/V rows, 8 warps for 2 accumulators; 16 q rows per step")],
        128: [TileConfig(32, 64, 8, 2, "128 K/V rows spill at D=128; 64 rows use 218 registers")],
        256: [TileConfig(32, 32, 8, 1, "dK and dV accumulators of 32x256 fp32; 80 KB")],
    },
    4: {
        64: [TileConfig(32, 32, 8, 1, "fp32: 16x64 and 16x32 tiles spilled 16-40 bytes on sm_86 or sm_90")],
        128: [TileConfig(16, 16, 4, 1, "fp32 at D=128: 16x32 spills on sm_80")],
        # fp32 at D=256: every tile tried spilled on sm_86, so none is offered (reference fallback).
        256: [],
    },
}

# dQ kernel: block_m is the q tile it owns, block_n the K/V tile it streams.
_BWD_DQ = {
    2: {
        64: [TileConfig(128, 32, 8, 3, "FA2 tutorial's dQ tile: 128 q rows held, 32 K/V rows streamed")],
        128: [TileConfig(64, 32, 4, 2, "64 q rows at D=128: 50 KB, no spills")],
        256: [TileConfig(32, 32, 8, 1, "64 KB; 64 q rows spill at D=256")],
    },
    4: {
        64: [TileConfig(64, 32, 8, 2, "fp32: half the q rows of fp16")],
        128: [TileConfig(16, 32, 8, 1, "fp32 at D=128: 32 q rows spill on sm_90")],
        256: [TileConfig(16, 32, 8, 1, "fp32 at D=256: 96 KB")],
    },
}

# The interpreter runs tiles as numpy arrays: bigger tiles are faster there, but tests need
# several tiles per sequence. BLOCK_M != BLOCK_N on purpose (see INTERPRETER_TARGET).
_INTERPRETER = {
    "attn_fwd": TileConfig(64, 32, 1, 1, "interpreter"),
    "attn_bwd_dkdv": TileConfig(32, 64, 1, 1, "interpreter"),
    "attn_bwd_dq": TileConfig(64, 32, 1, 1, "interpreter"),
    "attn_scores": TileConfig(32, 16, 1, 1, "interpreter"),
}

# The attn_mask-gradient / probabilities kernel (attention_scores.py) loads what the dQ kernel
# loads (Q and dO tiles held, K and V tiles streamed) and holds one (block_m, block_n) fp32
# accumulator instead of dQ's (block_m, D); its four nested loops need smaller tiles at D >= 128.
_SCORES = {
    2: {
        64: [TileConfig(128, 32, 8, 3, "dQ's tile: no spills with every option")],
        # 64x32, 32x32 over 4 warps, 32x32 in 2 stages, 32x16 and 16x32 each spilled 8-88 bytes
        # somewhere (sm_80/86/90, Triton 3.6 or 3.9); one stage does not
        128: [TileConfig(32, 32, 8, 1, "no spills on sm_80/86/90 with Triton 3.6 and 3.9")],
        256: [TileConfig(16, 32, 4, 1, "32x32 spilled 8-16 bytes on sm_80/86")],
    },
    4: {
        64: [TileConfig(32, 32, 8, 1, "fp32: dQ's 64x32 spilled 16 bytes on sm_86 with Triton 3.6")],
        128: [TileConfig(16, 16, 8, 1, "fp32 at D=128: 16x32, 32x32 and 16x16 over 4 warps spilled")],
        # fp32 at D=256: 16x16 over 8 warps still spilled ~100 bytes, so none (as dK/dV's): reference fallback
        256: [],
    },
}

CANDIDATES = {"attn_fwd": _FWD, "attn_bwd_dkdv": _BWD_DKDV, "attn_bwd_dq": _BWD_DQ, "attn_scores": _SCORES}

# Score modifiers (attn_mask, softcap, ALiBi, dropout) add live registers per score tile (the
# mask tile, tanh, the Philox state). Where the plain tile spilled with every option at once
# (compile check, sm_86 ptxas of Triton 3.9), these smaller tiles are tried first instead.
_MODIFIED = {
    "attn_fwd": {2: {64: [TileConfig(64, 32, 4, 3, "every option: 128x64 (and 64x64) spilled ~50 bytes on sm_86")]}},
    "attn_bwd_dkdv": {2: {128: [TileConfig(16, 32, 4, 2, "every option: 32x64 and 16x64 spilled 8 bytes")]}},
    "attn_bwd_dq": {2: {128: [TileConfig(32, 32, 4, 2, "every option: 64 q rows spilled 8 bytes")]}},
}

# Rows per program of the delta = rowsum(dO * O) preprocess: pure bandwidth, no tiling concerns.
PREPROCESS_BLOCK_M = 64


def head_dim_bucket(d: int) -> int:
    """Smallest config bucket that holds a padded head dim (16..256)."""
    for bucket in (64, 128, 256):
        if d <= bucket:
            return bucket
    raise ValueError(f"head dim {d} is above the largest supported (256)")


def estimate_shared_memory(kernel: str, cfg: TileConfig, block_dqk: int, block_dv: int, elt: int,
                           target: Target | None = None) -> int:
    """Upper estimate of the shared memory a config needs, in bytes.

    Triton keeps `num_stages` buffers of each streamed tile in shared memory and stages the
    resident tiles and the dot operands that need a layout change there too. On Hopper (sm_90)
    the (block_m, block_n) P / dS operand of the second dot is staged too (measured: the compile
    check's sm_90 builds with score modifiers). The compile check asserts that this estimate is
    never below what the compiler reports.
    """
    hopper = cfg.block_m * cfg.block_n * elt if target is not None and target.arch >= 90 else 0
    m, n, s = cfg.block_m, cfg.block_n, max(cfg.num_stages, 1)
    if kernel == "attn_fwd":
        streamed = n * (block_dqk + block_dv)  # K and V tiles
        resident = m * block_dqk  # Q tile
    elif kernel == "attn_bwd_dkdv":
        streamed = m * (block_dqk + block_dv)  # Q and dO tiles
        resident = n * (block_dqk + block_dv) + m * max(block_dqk, block_dv)  # K, V, a transposed q/dO tile
    elif kernel in ("attn_bwd_dq", "attn_scores"):
        streamed = n * (block_dqk + block_dv)  # K and V tiles
        resident = m * (block_dqk + block_dv)  # Q and dO tiles
    else:
        raise KeyError(kernel)
    return (s * streamed + resident) * elt + hopper


def interpreter_active() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


_autotune_hook = None  # set by triton_kernels/autotune.py when autotuning is on (FLASHTX_AUTOTUNE=1); None: off
if os.environ.get("FLASHTX_AUTOTUNE", "0").strip().lower() not in ("", "0", "false", "no", "off"):
    from . import autotune as _autotune  # noqa: E402,F401  (installs the hook)


def select_config(kernel: str, block_dqk: int, block_dv: int, elt: int, target: Target,
                  modified: bool = False) -> TileConfig:
    """First candidate that fits `target`'s shared memory (the interpreter has its own).

    modified: the launch uses score modifiers (attn_mask, softcap, ALiBi or dropout).
    """
    if _autotune_hook is not None and target is not INTERPRETER_TARGET:  # a tuned (cached) config, or None
        tuned = _autotune_hook(kernel, block_dqk, block_dv, elt, target, modified)
        if tuned is not None:
            return tuned
    if target is INTERPRETER_TARGET:
        return _INTERPRETER[kernel]
    return _select(kernel, block_dqk, block_dv, elt, target, modified)


@functools.lru_cache(maxsize=None)
def _select(kernel: str, block_dqk: int, block_dv: int, elt: int, target: Target, modified: bool) -> TileConfig:
    size, bucket = 2 if elt <= 2 else 4, head_dim_bucket(max(block_dqk, block_dv))
    candidates = CANDIDATES[kernel][size][bucket]
    if modified:
        candidates = _MODIFIED.get(kernel, {}).get(size, {}).get(bucket, []) + candidates
    for cfg in candidates:
        if estimate_shared_memory(kernel, cfg, block_dqk, block_dv, elt, target) <= target.max_shared:
            return cfg
    raise RuntimeError(
        f"no {kernel} config fits sm_{target.arch} ({target.max_shared} bytes of shared memory) "
        f"for head dims {block_dqk}/{block_dv} with {elt}-byte elements"
    )


@functools.lru_cache(maxsize=None)
def cuda_target(device_index: int) -> Target:
    """Target for a visible CUDA device, read from the driver."""
    import torch

    props = torch.cuda.get_device_properties(device_index)
    arch = props.major * 10 + props.minor
    smem = getattr(props, "shared_memory_per_block_optin", 0) or KNOWN_TARGETS.get(arch, KNOWN_TARGETS[86]).max_shared
    return Target(arch, int(smem))


# ==================================================================================================
# Elementwise kernels: fused RoPE (rotary.py) and fused SwiGLU (swiglu.py)
# ==================================================================================================
# Both are memory-bound single passes with no tl.dot and no shared-memory staging, so, unlike the
# attention tiles above, their configs do not depend on the target's shared memory: the goal is
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
# head tiles, exercising every mask.
ROTARY_INTERPRETER = ElementwiseConfig(2, 2, 1, 1, "interpreter: several tiles in test-sized shapes")

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
# Interpreter: 4 x 16 tiles so test shapes (M ~ 1-20, H ~ 1-40) cover partial tiles both ways.
SWIGLU_INTERPRETER = ElementwiseConfig(4, 16, 1, 1, "interpreter: several tiles in test-sized shapes")


def _pow2_at_least(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def rotary_config(r2: int, heads: int, seqlen: int, target: Target) -> ElementwiseConfig:
    """(positions, heads) per program of a rotary tile of R2 = rotary_dim / 2 pairs (any target; no
    shared memory). block_rows x block_cols x pow2(R2) <= ROTARY_TILE_PAIRS, heads first."""
    if target is INTERPRETER_TARGET:
        return ROTARY_INTERPRETER
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
        return SWIGLU_INTERPRETER
    cols = min(swiglu_block_h(hidden), _pow2_at_least(max(hidden, 1)))
    block_rows = max(1, SWIGLU_TILE_ELEMENTS // cols)
    block_rows = min(block_rows, _pow2_at_least(max(rows, 1)))
    return ElementwiseConfig(block_rows, cols, SWIGLU_NUM_WARPS, 1,
                             f"{SWIGLU_TILE_ELEMENTS}-element tile, {cols} columns (little padding at this width)")
