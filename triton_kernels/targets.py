"""What config selection knows about a GPU (a Target), the GPUs it knows by compute capability, the
interpreter's stand-in, the head-dim buckets every tile table is keyed by, and the wave arithmetic of filling
one (flash-attn 2's split heuristic, for the decode kernels of Triton and of the CUDA extension). Pure Python."""
from __future__ import annotations

import dataclasses
import math

@dataclasses.dataclass(frozen=True)
class Target:
    """What config selection needs to know about a GPU."""

    arch: int  # compute capability as 10 * major + minor, e.g. 86
    max_shared: int  # max dynamic shared memory per block, bytes
    warp_size: int = 32
    sm_count: int = 0  # streaming multiprocessors (0: unknown), for grid-size decisions
    # the CUDA device index a cuda_target was read from (-1: none), for autotuning on the launch's own GPU; not
    # compared or hashed: two GPUs of one model select alike
    device: int = dataclasses.field(default=-1, compare=False)


# Max dynamic shared memory per block (cudaDevAttrMaxSharedMemoryPerBlockOptin), from NVIDIA's
# CUDA C++ Programming Guide, "Compute capabilities" table.
KNOWN_TARGETS = {
    80: Target(80, 166_912, sm_count=108),  # A100
    86: Target(86, 101_376, sm_count=82),  # RTX 3090 / A10 / A40
    89: Target(89, 101_376, sm_count=128),  # RTX 4090 / L4 / L40
    90: Target(90, 232_448, sm_count=132),  # H100 / H200
}

# One config for Triton's interpreter: blocks small enough that test shapes (S up to a few
# hundred) span several tiles in both directions, and unequal BLOCK_M / BLOCK_N so that the
# causal tile-skipping logic is exercised for non-square tiles.
INTERPRETER_TARGET = Target(0, 1 << 30)


def head_dim_bucket(d: int, buckets=(64, 128, 256)) -> int:
    """Smallest of `buckets` (ascending) that holds a register tile width d (16..256): a padded head dim,
    or a split one's two pieces together (launch.head_split, e.g. 192 = 128 + 64)."""
    for bucket in buckets:
        if d <= bucket:
            return bucket
    raise ValueError(f"head dim {d} is above the largest supported ({buckets[-1]})")


def num_splits_heuristic(programs: int, slots: int, key_blocks: int, max_splits: int) -> int:
    """flash-attn 2's num_splits_heuristic (flash_api.cpp): how many key-range splits to give each of `programs`
    programs (batch x KV heads x row tiles) over `key_blocks` key tiles, with `slots` programs running at once
    (flash-attn passes 2 a multiprocessor). 1 when one split already fills 80% of the slots; else, among the counts
    that change the key tiles a split gets (is_split_eligible: 64 tiles over 29 splits are 3 a split, as over 22,
    and 7 would get none), the fewest whose wave efficiency (programs x splits / (waves x slots)) is within 85% of
    the best, up to max_splits, the slots and the key tiles."""
    if programs <= 0 or programs >= 0.8 * slots:  # (no programs: an empty q, nothing to split)
        return 1
    max_splits = min(max_splits, slots, key_blocks)
    if max_splits <= 1:
        return 1

    def eligible(s: int) -> bool:
        return s == 1 or math.ceil(key_blocks / s) != math.ceil(key_blocks / (s - 1))

    eff = {}
    for s in range(1, max_splits + 1):
        if eligible(s):
            waves = programs * s / slots
            eff[s] = waves / math.ceil(waves)
    best = max(eff.values())
    return next(s for s, e in eff.items() if e >= 0.85 * best)
