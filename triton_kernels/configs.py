"""Tile configurations for every Triton kernel, in one place.

Each kernel has an ordered list of candidate configs per padded head dim. The launcher picks the
first candidate whose estimated shared memory fits the target GPU, so an RTX 3090 (sm_86,
101,376 bytes a block) never launches a config that only fits an A100 or H100. The compile check
(tests/test_compile.py) compiles every config that this selection can return for sm_80, sm_86 and
sm_90 without a GPU and checks the compiler's real shared memory against the limit.

Provenance: the candidates are starting points taken from the shapes FlashAttention-2's Triton
tutorial uses on Ampere (A100), trimmed so that D=128 fits the RTX 3090. They have not been tuned
on a GPU yet; bench/RESULTS.md records every GPU run and any re-tuning it justified.
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


# Candidates, best first, per kernel and padded head dim (the larger of the qk and v dims).
_FWD = {
    64: [
        TileConfig(128, 64, 4, 3, "FA2 tutorial's Ampere choice for D<=64: 128 q rows amortise K/V loads"),
        TileConfig(64, 64, 4, 2, "fallback when 3 stages do not fit"),
    ],
    128: [
        TileConfig(128, 64, 8, 3, "8 warps keep the 128x128 accumulator out of local memory; fits sm_80/90"),
        TileConfig(128, 64, 8, 2, "2 stages: the largest that fits sm_86's 99 KB"),
        TileConfig(64, 64, 4, 2, "fallback"),
    ],
    256: [
        TileConfig(128, 64, 8, 2, "sm_80/sm_90 have the shared memory for 128-row tiles at D=256"),
        TileConfig(64, 32, 4, 2, "fits sm_86: 64 q rows, 2 stages of 32 K/V rows"),
        TileConfig(32, 32, 4, 1, "last resort"),
    ],
}

# dK/dV kernel: block_m is the q tile it loops over, block_n the K/V rows it owns.
_BWD_DKDV = {
    64: [
        TileConfig(32, 128, 4, 3, "FA2 tutorial's dK/dV tile: 128 K/V rows held, 32 q rows streamed"),
        TileConfig(32, 64, 4, 2, "fallback"),
    ],
    128: [
        TileConfig(32, 128, 8, 2, "128 K/V rows with 8 warps for the two 128x128 accumulators"),
        TileConfig(32, 64, 4, 2, "fits sm_86"),
        TileConfig(16, 64, 4, 1, "fallback"),
    ],
    256: [
        TileConfig(32, 64, 8, 2, "fits sm_80/sm_90"),
        TileConfig(16, 64, 8, 1, "fits sm_86: dK and dV accumulators take 2x64x256 fp32 registers"),
        TileConfig(16, 32, 4, 1, "last resort"),
    ],
}

# dQ kernel: block_m is the q tile it owns, block_n the K/V tile it loops over.
_BWD_DQ = {
    64: [
        TileConfig(128, 32, 4, 3, "FA2 tutorial's dQ tile: 128 q rows held, 32 K/V rows streamed"),
        TileConfig(64, 32, 4, 2, "fallback"),
    ],
    128: [
        TileConfig(128, 32, 8, 2, "8 warps for the 128x128 dQ accumulator"),
        TileConfig(64, 32, 4, 2, "fits sm_86"),
        TileConfig(32, 32, 4, 1, "fallback"),
    ],
    256: [
        TileConfig(64, 32, 8, 2, "fits sm_80/sm_90"),
        TileConfig(32, 32, 4, 1, "fits sm_86"),
        TileConfig(16, 32, 4, 1, "last resort"),
    ],
}

# The interpreter runs tiles as numpy arrays: bigger tiles are faster there, but tests need
# several tiles per sequence. BLOCK_M != BLOCK_N on purpose (see INTERPRETER_TARGET).
_INTERPRETER = {
    "attn_fwd": TileConfig(64, 32, 1, 1, "interpreter"),
    "attn_bwd_dkdv": TileConfig(32, 64, 1, 1, "interpreter"),
    "attn_bwd_dq": TileConfig(64, 32, 1, 1, "interpreter"),
}

CANDIDATES = {"attn_fwd": _FWD, "attn_bwd_dkdv": _BWD_DKDV, "attn_bwd_dq": _BWD_DQ}

# Rows per program of the delta = rowsum(dO * O) preprocess: pure bandwidth, no tiling concerns.
PREPROCESS_BLOCK_M = 64


def head_dim_bucket(d: int) -> int:
    """Smallest config bucket that holds a padded head dim (16..256)."""
    for bucket in (64, 128, 256):
        if d <= bucket:
            return bucket
    raise ValueError(f"head dim {d} is above the largest supported (256)")


def estimate_shared_memory(kernel: str, cfg: TileConfig, block_dqk: int, block_dv: int, elt: int) -> int:
    """Upper estimate of the shared memory a config needs, in bytes.

    Triton keeps `num_stages` buffers of each streamed tile in shared memory and stages the
    resident tiles and the dot operands that need a layout change there too. The compile check
    asserts that this estimate is never below what the compiler reports.
    """
    m, n, s = cfg.block_m, cfg.block_n, max(cfg.num_stages, 1)
    if kernel == "attn_fwd":
        streamed = n * (block_dqk + block_dv)  # K and V tiles
        resident = m * block_dqk + m * n  # Q tile, P re-laid out as a dot operand
    elif kernel == "attn_bwd_dkdv":
        streamed = m * (block_dqk + block_dv)  # Q and dO tiles
        resident = n * (block_dqk + block_dv) + 2 * m * n  # K, V, P^T and dS^T as operands
    elif kernel == "attn_bwd_dq":
        streamed = n * (block_dqk + block_dv)  # K and V tiles
        resident = m * (block_dqk + block_dv) + m * n  # Q, dO, dS as an operand
    else:
        raise KeyError(kernel)
    return (s * streamed + resident) * elt


def interpreter_active() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def select_config(kernel: str, block_dqk: int, block_dv: int, elt: int, target: Target) -> TileConfig:
    """First candidate that fits `target`'s shared memory (the interpreter has its own)."""
    if target is INTERPRETER_TARGET:
        return _INTERPRETER[kernel]
    return _select(kernel, block_dqk, block_dv, elt, target)


@functools.lru_cache(maxsize=None)
def _select(kernel: str, block_dqk: int, block_dv: int, elt: int, target: Target) -> TileConfig:
    candidates = CANDIDATES[kernel][head_dim_bucket(max(block_dqk, block_dv))]
    for cfg in candidates:
        if estimate_shared_memory(kernel, cfg, block_dqk, block_dv, elt) <= target.max_shared:
            return cfg
    raise RuntimeError(
        f"no {kernel} config fits sm_{target.arch} ({target.max_shared} bytes of shared memory) "
        f"for head dims {block_dqk}/{block_dv} with {elt}-byte elements"
    )


def launchable_configs(kernel: str, target: Target) -> list[tuple[int, int, TileConfig]]:
    """Every (block_dqk, elt, config) selection can return for `target`; for the compile check."""
    out = []
    for d in (64, 128, 256):
        for elt in (2, 4):
            try:
                out.append((d, elt, _select(kernel, d, d, elt, target)))
            except RuntimeError:
                pass
    return out


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
    block_cols: int  # rotary: heads per program (a loop); swiglu: columns per program
    num_warps: int
    num_stages: int = 1  # no software-pipelined loop to stage
    reason: str = ""

    @property
    def launch_kwargs(self) -> dict:
        return {"num_warps": self.num_warps, "num_stages": self.num_stages}


# Elements of one head's rotary part a rotary program holds per head: 4 warps x 32 threads x 16
# elements, i.e. two 16-byte fp16 vectors per thread for each of x's halves. E.g. rotary_dim 128
# gives 16 positions per program.
ROTARY_TILE_ELEMENTS = 2048
ROTARY_NUM_WARPS = 4  # 128 threads: one 16-element row of the (positions, rotary_dim) tile each
# A program loads its cos/sin tile once and reuses it for this many heads (a loop). 4 keeps a
# 32-head model at 8 head groups, so even a 4k-token prefill (256 position tiles) has thousands of
# programs, while cos/sin reloads drop to a quarter.
ROTARY_HEADS_PER_PROGRAM = 4
# Interpreter: tiny tiles so that test shapes (S ~ 5-20, H ~ 3) span several position tiles and
# head groups, exercising every mask.
ROTARY_INTERPRETER = ElementwiseConfig(4, 2, 1, 1, "interpreter: several tiles in test-sized shapes")

# SwiGLU tiles are (rows, columns) of the (M, H) activations. 1024 columns = 2 KB of fp16 per row:
# fully coalesced, and LLaMA hidden sizes (11008, 14336, 28672) are multiples of 256 so at most
# one partial column tile per row.
SWIGLU_MAX_BLOCK_H = 1024
# Elements per program: 4 warps x 32 threads x 32 elements, i.e. four 16-byte fp16 vectors per
# thread for each tensor (forward reads 2 and writes 1; backward reads 3 and writes 2).
SWIGLU_TILE_ELEMENTS = 4096
SWIGLU_NUM_WARPS = 4
# Interpreter: 4 x 16 tiles so test shapes (M ~ 1-20, H ~ 1-40) cover partial tiles both ways.
SWIGLU_INTERPRETER = ElementwiseConfig(4, 16, 1, 1, "interpreter: several tiles in test-sized shapes")


def _pow2_at_least(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def rotary_config(rotary_dim: int, seqlen: int, target: Target) -> ElementwiseConfig:
    """Positions and heads per program for a rotary launch (any target; no shared memory)."""
    if target is INTERPRETER_TARGET:
        return ROTARY_INTERPRETER
    width = _pow2_at_least(max(rotary_dim, 2))
    rows = max(1, ROTARY_TILE_ELEMENTS // width)
    rows = min(rows, _pow2_at_least(max(seqlen, 1)))  # decoding (S = 1) wastes no lanes on padding
    return ElementwiseConfig(rows, ROTARY_HEADS_PER_PROGRAM, ROTARY_NUM_WARPS, 1,
                             f"{ROTARY_TILE_ELEMENTS}-element tile per head, cos/sin reused over heads")


def swiglu_config(hidden: int, rows: int, target: Target) -> ElementwiseConfig:
    """(rows, columns) tile of a SwiGLU launch, forward and backward alike."""
    if target is INTERPRETER_TARGET:
        return SWIGLU_INTERPRETER
    cols = min(SWIGLU_MAX_BLOCK_H, _pow2_at_least(max(hidden, 1)))
    block_rows = max(1, SWIGLU_TILE_ELEMENTS // cols)
    block_rows = min(block_rows, _pow2_at_least(max(rows, 1)))
    return ElementwiseConfig(block_rows, cols, SWIGLU_NUM_WARPS, 1,
                             f"{SWIGLU_TILE_ELEMENTS}-element tile, rows of up to {SWIGLU_MAX_BLOCK_H} columns")
