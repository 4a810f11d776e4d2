"""Tile configurations for every Triton kernel, in one place: the attention tables here, the memory-bound kernels'
(RoPE, SwiGLU, decoding) in configs_bandwidth and the GPUs' facts in targets, both re-exported here.

Attention tiles come from per-architecture tables (sm_80; sm_86/89; sm_90), and every entry names
its source: a timed sweep (bench.tune on an H200, sm_90's forward), an anchor's published table
(FlashAttention-2's launch templates, FlexAttention's defaults in PyTorch's inductor, Triton's
fused-attention tutorial, FlagAttention's RTX 3090 configs) and, where ours differs, why.

Spills: a tile that spills registers should ship only where a GPU timed it faster. Every 16-bit
forward, dK/dV and dQ tile nobody has timed compiles without spills under Triton 3.6, 3.8 and 3.9 (those
changed on 2026-12-06, sm_90's modifier dK/dV at 64 and 128 and plain and masked dQ at 256: under 3.6 and 3.9,
3.8 not installed), at
head dims 64, 128 and 256, in every specialisation the compile check covers: plain (causal or not,
MHA or a GQA group), with visibility masks (MASKED below), with every score modifier at once
(MODIFIED), and the bias-gradient dQ. That is all of sm_80 and sm_86/89, which nobody here can time,
and all of sm_90 but what a GPU timed (some spill: the fastest or within 2% of it): its plain forward
tiles at head dims 64 and 128 (bench.tune on an H200; masked launches use them too), its plain dK/dV
tiles there and its bias-gradient dQ at 128 (an H100, 2026-12-06).
Where the anchor's tile spills, the entry is the nearest spill-free tile of a compile sweep
(tile_sweep.py), often the same tile with 8 warps; on sm_90 one whose dots issue wgmma
(compile_check.mma_kind). The compile check (tests/test_compile.py) compiles every entry for its
architecture, proves it fits shared memory, reports every spill and fails on one in that set. Still
spilling, and listed by the compile check: fp32, head dim 192 and the split head dims, and the
opt-in GQA split and TMA tiles; they wait for a sweep or a GPU.
The no-spill rule holds at sequence lengths that are multiples of 16, the compile check's 128. At other lengths
Triton compiles another variant of each kernel (no divisibility hint on Sq, Sk, the window, a mask's row stride).
Every attention plan compiled at 113 (`compile_check --seqlen 113`, 2026-12-07, Triton 3.9): all fit their GPU;
only the launches that read an attn_mask tile need other shared memory (up to one (block_m, block_n) mask tile more:
estimate_shared_memory's mask_elt; CI checks them at 113 too); of the no-spill set, sm_80 10 of 121 spill there
(8-40 bytes), sm_86 8 of 122 (8-184) and sm_90 8 of 86 (24-336), nearly all with every option (a mask tile), the
rest sm_80/86's dK/dV at 64 causal (8-24) and sm_80's full dQ at 128 and dK/dV at 256 (8). Reported, not fixed: a
sweep at both lengths waits for a GPU to weigh them. Query and key counts of different divisibility (e.g. 32 queries
over 257 keys): once, 2026-12-07, Triton 3.9, fp16 with every option and a bool, fp16 or learned fp16 (1, H, Sq, Sk)
mask, forward, dK/dV and dQ at head dims 64/128/256 on sm_80/86/90 (324 compiles, not in CI): 128 queries over 113
keys take the shared memory of 113 over 113, and 113 over 128 that of 128 over 128, with the same spills (the one
exception fewer: sm_90's bias-gradient dQ at 128, 1,408 bytes against 1,424) and registers within 23 of them; none
past its GPU or its estimate. The key count decides. The short-sequence cuts below are compiled at 49 and 64 tokens.
bench/RESULTS.md records every GPU run.

Selection: the table of the target's family, with the score-modifier table (MODIFIED) first when
the launch modifies scores and the visibility-mask table (MASKED) first when a window, key/query
masks, lengths or varlen decide what each query sees (a tile trimmed for one specialisation never
slows the plain one), the full-attention table (FULL) first for a plain launch without a causal mask,
then, if nothing fits the target's shared memory (an unknown part), the smaller families' entries.
"""
from __future__ import annotations

import dataclasses
import functools

from .. import _env
from .targets import INTERPRETER_TARGET, KNOWN_TARGETS, Target, head_dim_bucket  # noqa: F401 (re-exported)


@dataclasses.dataclass(frozen=True)
class TileConfig:
    block_m: int  # rows of Q per tile
    block_n: int  # rows of K/V per tile
    num_warps: int
    num_stages: int
    reason: str = ""  # the source of the entry, and why it differs from it
    # attn_fwd on sm_90 and later: K/V tiles through device-side tensor descriptors (TMA) where the
    # tensors allow it (attention_fwd.tma_ok); elsewhere, or for other inputs, the pointer loads
    tma: bool = False

    @property
    def launch_kwargs(self) -> dict:
        return {"num_warps": self.num_warps, "num_stages": self.num_stages}


C = TileConfig
FLEX_H100 = "FlexAttention sm_90 default (inductor flex_attention.py _h100_default_config / _get_nv_config)"
FLEX_A100 = "FlexAttention sm_80 default (inductor flex_attention.py _a100_default_config / _get_nv_config)"
FLAG_3090 = "FlagAttention RTX 3090 config (128x64 for D<=64, 128x32 for D=128, 4 warps)"
TUTORIAL = "Triton fused-attention tutorial (06-fused-attention.py)"
KEPT = "flashtx's previous compile-checked tile (no anchor fits our shared-memory estimate here)"
FA2_192 = ("FlashAttention-2's hdim-192 forward tile (128x64, 8 warps, sm_80 and later; flash_fwd_launch_template.h "
           "run_mha_fwd_hdim192)")
DERIVED_192 = "no anchor has an fp32 head dim 192 tile (FlexAttention pads it to 256): the "
TUNE_H200 = ("bench.tune on an H200 (2026-11-30, second run, bench/RESULTS.md; Triton 3.6), the best of 6-7 timed "
             "candidates at N = 4k (1k and 16k not yet timed): ")
TUNE_H100 = "bench.tune on an H100 (2026-12-06, Triton 3.6): the whole backward, bf16, causal and not, N = 2k-16k: "
SWEEP = ("compile sweep (python -m flashtx.triton_kernels.tile_sweep, Triton 3.6 and 3.9; not timed on a GPU): ")
FA2_BWD = "FlashAttention-2's backward tile for this arch and head dim (flash_bwd_launch_template.h run_mha_bwd_hdim*)"
FA2_BWD_192 = ("FlashAttention-2's hdim-192 backward tile (64x64, 8 warps; flash_bwd_launch_template.h "
               "run_mha_bwd_hdim192, one kernel for dK/dV and dQ)")

# TABLES[family][kernel][element size][head-dim bucket]: one tile per entry. The element size is 2
# (fp16/bf16) or 4 (fp32); the bucket is the larger register tile width (64, 128 or 256: a head dim padded
# to a power of two), or for attn_fwd and the backward also 192 (a head dim split in two power-of-two pieces,
# launch.head_split: 144-192 = 128 + 16..64); a width uses the smallest bucket that holds it.
# attn_bwd_dkdv: block_m = q rows streamed, block_n = K/V rows owned (FlexAttention's BLOCK_M1/N1);
# attn_bwd_dq: block_m = q rows owned, block_n = K/V rows streamed (BLOCK_M2/N2).
TABLES = {
    "sm90": {
        "attn_fwd": {
            2: {64: C(128, 64, 4, 3, TUNE_H200 + "D=64: 1.047x causal, 0.993x full (bf16) over the FlexAttention "
                       "sm_90 default it replaced, 128x128 w4 s3; 128x64 w8 s4 was 1.043x full but 0.835x causal"),
                128: C(64, 64, 4, 3, TUNE_H200 + "D=128: 1.052x / 1.034x causal, 1.032x / 0.997x full (bf16 / fp16) "
                       "over the FlexAttention sm_90 default it replaced, 128x64 w8 s3"),
                192: C(128, 64, 8, 3, FA2_192 + " with FlexAttention sm_90's 3 stages (its 128 entry's); no spills "
                       "without score modifiers, 104 bytes with every option"),
                256: C(64, 32, 4, 3, FLEX_H100)},
            4: {64: C(128, 32, 4, 3, FLEX_H100),
                128: C(32, 64, 4, 3, FLEX_H100),
                192: C(32, 32, 4, 2, DERIVED_192 + "256 entry's tile: fp32 spills at either width (752 bytes "
                       "split vs 2,008 padded), more stages do not help"),
                256: C(32, 32, 4, 2, FLEX_H100 + " with 2 stages: 3 exceed 232,448 bytes by our estimate")},
        },
        "attn_bwd_dkdv": {
            2: {64: C(64, 64, 4, 3, TUNE_H100 + "1.7-1.8x the 8-warp tile it replaced (2.42 -> 1.44 ms causal at "
                       "2k), the fastest or within 2% at every N; FlexAttention's; spills 112 bytes (Triton 3.9)"),
                128: C(32, 64, 4, 3, TUNE_H100 + "1.8-1.9x causal, 2.0x full over 8 warps (2.05 -> 1.16 ms causal at "
                       "2k), the fastest causal; 64x128 8 warps 5-11% slower causal, 11% faster full. Spills 40 bytes"),
                192: C(64, 64, 8, 2, FA2_BWD_192 + " with 2 stages: 180,224 bytes by our estimate"),
                256: C(32, 32, 8, 3, SWEEP + FLEX_H100 + " is 64x64 4 warps 2 stages (over our shared-memory "
                       "estimate); our previous 32x64 8 warps spilled 328-624 bytes; 32x32 8 warps 3 stages "
                       "spills none, masked or modified either")},
            4: {64: C(32, 32, 8, 1, KEPT + "; FlexAttention uses 16x16 for every fp32 backward"),
                128: C(16, 16, 4, 1, FLEX_H100 + " (fp32)"),
                192: C(16, 16, 4, 1, DERIVED_192 + "128 and 256 entries' tile (FlexAttention's fp32 16x16)"),
                256: C(16, 16, 4, 1, FLEX_H100 + " (fp32)")},
        },
        "attn_bwd_dq": {
            2: {64: C(64, 64, 4, 3, FLEX_H100),
                128: C(128, 64, 8, 3, FLEX_H100),
                192: C(64, 64, 8, 3, FA2_BWD_192 + " with FlexAttention sm_90's 3 stages (its 128 entry's)"),
                256: C(64, 32, 8, 3, SWEEP + FLEX_H100 + " 64x64 8 warps spilled 176-632 bytes; 64x32 8 warps 3 "
                       "stages spills none and issues wgmma (Triton 3.6 and 3.9; 3.8 not checked), where the "
                       "previous 32x64 8 warps issued mma.sync (fewer than 64 q rows)")},
            4: {64: C(64, 32, 8, 2, KEPT + "; FlexAttention uses 16x16 for every fp32 backward"),
                128: C(16, 16, 4, 1, FLEX_H100 + " (fp32)"),
                192: C(16, 16, 4, 1, DERIVED_192 + "128 and 256 entries' tile (FlexAttention's fp32 16x16)"),
                256: C(16, 16, 4, 1, FLEX_H100 + " (fp32)")},
        },
    },
    "sm80": {
        "attn_fwd": {
            2: {64: C(128, 64, 4, 3, FLEX_A100),
                128: C(128, 64, 8, 3, FLEX_A100),
                192: C(128, 32, 8, 3, FA2_192 + " with half the K/V rows and FlexAttention sm_80's 3 stages: "
                       "128x64 spills without score modifiers (24 bytes; 856 with every option), 128x32 only "
                       "with every option (176)"),
                256: C(32, 64, 4, 2, FLEX_A100 + " with 2 stages: 3 exceed 166,912 bytes by our estimate")},
            4: {64: C(128, 32, 4, 3, FLEX_A100),
                128: C(128, 32, 4, 3, FLEX_A100),
                192: C(64, 16, 4, 3, DERIVED_192 + "256 entry's tile (FlexAttention sm_80 fp32): no spills "
                       "split (608 bytes padded)"),
                256: C(64, 16, 4, 3, FLEX_A100)},
        },
        "attn_bwd_dkdv": {
            2: {64: C(32, 128, 8, 3, SWEEP + FLEX_A100 + " (also the tutorial's dK/dV tile) with 8 warps: 4 spill "
                       "104-184 bytes; 8 keep its shared memory and resident warps, 255 registers, no spills"),
                128: C(32, 64, 8, 3, SWEEP + FLEX_A100 + " 32x128 spills 6 KB (4 warps) or 144-160 bytes (8 warps), "
                       + FA2_BWD + " 64x128 8 warps 6 KB, 64x64 8 warps 8 bytes without a causal mask (Triton 3.6); "
                       "32x64 8 warps 3 stages spills none, with masks or every score modifier either"),
                192: C(32, 32, 8, 2, "sm_86's 192 entry: " + FA2_BWD_192 + " fits sm_80 only with 1 stage by "
                       "our estimate, and ptxas gives it (and the 256 entry's 32x64 2 stages, split) 32 registers "
                       "and 5-10 KB of stack; 32x32 2 stages: 255 registers, no spills, with every option too"),
                256: C(32, 64, 8, 2, FLEX_A100 + " is 32x128 3 stages: K/V rows halved and 2 stages to fit")},
            4: {64: C(32, 32, 8, 1, KEPT + "; FlexAttention uses 16x16 for every fp32 backward"),
                128: C(16, 16, 4, 1, FLEX_A100 + " (fp32)"),
                192: C(16, 16, 4, 1, DERIVED_192 + "128 and 256 entries' tile (FlexAttention's fp32 16x16)"),
                256: C(16, 16, 4, 1, FLEX_A100 + " (fp32)")},
        },
        "attn_bwd_dq": {
            2: {64: C(128, 32, 8, 3, SWEEP + FLEX_A100 + " (also the tutorial's dQ tile) with 8 warps: 4 spill 8 "
                       "bytes without a causal mask"),
                128: C(64, 128, 8, 2, SWEEP + FLEX_A100 + " 128x32 spills 632 bytes (4 warps) or 8 (8 warps); "
                       + FA2_BWD + " 64x128 8 warps 2 stages spills none"),
                192: C(64, 32, 8, 2, FA2_BWD_192 + " with half the K/V rows (the 256 entry's tile): its 64x64 "
                       "2 stages compiles to 128 registers and 1.8 KB of spills split; 64x32 spills 8 bytes "
                       "(624 with every option)"),
                256: C(64, 32, 8, 2, FLEX_A100 + " is 128x32 3 stages: q rows halved and 2 stages to fit")},
            4: {64: C(64, 32, 8, 2, KEPT + "; FlexAttention uses 16x16 for every fp32 backward"),
                128: C(16, 32, 8, 1, KEPT),
                192: C(16, 32, 8, 1, DERIVED_192 + "128 and 256 entries' tile"),
                256: C(16, 32, 8, 1, KEPT)},
        },
    },
    "sm86": {  # RTX 3090 / A10 / A40 / RTX 4090 / L4 / L40: 101,376 bytes a block
        "attn_fwd": {
            2: {64: C(128, 64, 4, 3, FLAG_3090),
                128: C(128, 32, 8, 2, SWEEP + FLAG_3090 + " with 8 warps: 4 spill 16 bytes without a causal mask; "
                       "8 keep its 48 KB (2 blocks an SM) and 8 resident warps an SM, ~192 registers"),
                192: C(128, 32, 8, 2, FA2_192 + " with half the K/V rows and 2 stages, as FlagAttention's "
                       "RTX 3090 D=128 tile (128x32): 99,328 bytes by our estimate"),
                256: C(64, 32, 8, 2, KEPT + "; 68 KB")},
            4: {64: C(64, 32, 8, 2, KEPT),
                128: C(32, 32, 4, 2, "FlexAttention's sm_90 fp32 32x64 with half the K/V rows to fit sm_86"),
                192: C(32, 32, 8, 1, DERIVED_192 + "256 entry's tile: 56 KB split, no spills"),
                256: C(32, 32, 8, 1, KEPT + "; 96 KB")},
        },
        "attn_bwd_dkdv": {
            2: {64: C(32, 128, 8, 3, SWEEP + FLEX_A100 + " (sm_8x) with 8 warps: 4 spill 128-184 bytes; 8 keep its "
                       "shared memory, 255 registers, no spills (" + FA2_BWD + " is 8 warps too)"),
                128: C(32, 64, 8, 2, "FlexAttention sm_86/89: 64x64 2 stages; q rows halved to fit our estimate"),
                192: C(32, 32, 8, 2, "the 256 entry's tile with 2 stages (86,016 bytes by our estimate): "
                       + FA2_BWD_192 + " does not fit sm_86 by our estimate even with 1 stage"),
                256: C(32, 32, 8, 1, KEPT + "; 80 KB")},
            4: {64: C(32, 32, 8, 1, KEPT),
                128: C(16, 16, 4, 1, "FlexAttention fp32 backward (16x16, 4 warps, 1 stage)"),
                192: C(16, 16, 4, 1, DERIVED_192 + "128 and 256 entries' tile (FlexAttention's fp32 16x16)"),
                256: C(16, 16, 4, 1, "FlexAttention fp32 backward (16x16, 4 warps, 1 stage)")},
        },
        "attn_bwd_dq": {
            2: {64: C(128, 32, 8, 3, SWEEP + FLEX_A100 + " (sm_8x) with 8 warps: 4 spill 8 bytes; 8 spill none"),
                128: C(64, 64, 8, 2, SWEEP + FA2_BWD + " (64x64 8 warps on sm_86): FlexAttention's 128x32 8 warps "
                       "2 stages spills 8 bytes"),
                192: C(64, 32, 8, 2, FA2_BWD_192 + " with half the K/V rows and 2 stages to fit sm_86: 98,304 "
                       "bytes by our estimate"),
                256: C(32, 32, 8, 1, KEPT + "; 64 KB")},
            4: {64: C(64, 32, 8, 2, KEPT),
                128: C(16, 32, 8, 1, KEPT),
                192: C(16, 32, 8, 1, DERIVED_192 + "128 and 256 entries' tile"),
                256: C(16, 32, 8, 1, KEPT + "; 96 KB")},
        },
    },
}

# The dQ kernel writing the attn_mask gradient (attention_bwd.py, DBIAS) adds a (block_m, block_n) fp32
# tile staged in shared memory for the read-modify-write of dS (measured: 8 KB more at 64x64 on sm_90),
# so it is its own specialisation: dQ's tile where that still fits, else a smaller one just for it.
_DB = (SWEEP + "the bias-gradient dQ holds dS and its partial sums too, with bias layouts (1, H, Sq, Sk) and "
       "(B, 1, 1, Sk): ")
for _fam, _overrides in {
    "sm90": {2: {64: C(32, 64, 8, 2, _DB + "dQ's 64x64 4 warps spills 0.6-1.2 KB, 32x64 3 stages 8 bytes under "
                                    "Triton 3.6"),
                 128: C(128, 64, 8, 3, "dQ's own tile (spills 1.1-1.4 KB here): a learned (1, H, N, N) bias at N=4k "
                        "ran fwd+bwd in 9.73 ms on the plain tiles, 17.56 on a sweep's spill-free 16x64 8 warps and "
                        "the modifier tiles (an H100, 2026-12-06, bench/RESULTS.md)"),
                 256: C(16, 64, 8, 1, _DB + "dQ's 64x64 spilled 1.3-1.6 KB, 16x64 2 stages 56 bytes under Triton "
                                     "3.6, 16x32 2 stages 32 bytes under 3.8; 16x64 1 stage none under 3.6-3.9")}},
    "sm80": {2: {64: C(32, 64, 8, 2, _DB + "dQ's 128x32 spills 176-304 bytes"),
                 128: C(16, 64, 8, 2, _DB + "32x32 8 warps spills 48 bytes under Triton 3.6 (bias broadcast over "
                                     "heads and queries), 64x32 168-376; 16 q rows, the dS tile's staging fits"),
                 256: C(16, 32, 8, 1, _DB + "dQ's 64x32 spills 296-560 bytes, 16x32 2 stages 8")}},
    "sm86": {2: {64: C(32, 64, 8, 2, _DB + "dQ's 128x32 spills 8-120 bytes"),
                 128: C(16, 64, 8, 2, _DB + "64x32 (what fits beside the dS tile's staging at dQ's rows) spills "
                                     "24-232 bytes, 32x32 16 bytes under Triton 3.8 (bias (B, 1, 1, Sk)); "
                                     "sm_80's 16x64 none under 3.6-3.9"),
                 192: C(32, 32, 8, 2, "dQ's 64x32 with half the q rows: the dS tile's staging does not fit "
                                      "sm_86 beside 64 rows at head dim 192 (73,728 + 4,096 bytes by our estimate)"),
                 256: C(16, 64, 8, 1, _DB + "dQ's 32x32 spills 24 bytes")}},
}.items():
    TABLES[_fam]["attn_bwd_dq_dbias"] = {elt: {**by_bucket, **_overrides.get(elt, {})}
                                         for elt, by_bucket in TABLES[_fam]["attn_bwd_dq"].items()}

# The probabilities kernel (attention_scores.py: return_attn_probs, for tests and small sizes) loads
# what the dQ kernel loads; no anchor has one, so every family keeps the previous compile-checked tiles.
_SCORES = {
    2: {64: C(128, 32, 8, 3, KEPT), 128: C(32, 32, 8, 1, KEPT), 256: C(16, 32, 4, 1, KEPT)},
    4: {64: C(32, 32, 8, 1, KEPT), 128: C(16, 16, 8, 1, KEPT), 256: C(16, 16, 4, 1, KEPT + " (spills)")},
}
for _family in TABLES.values():
    _family["attn_scores"] = _SCORES

# Score modifiers (attn_mask, softcap, ALiBi, dropout) add live registers per score tile. Entries
# here are tried before TABLES for launches that modify scores, so a tile trimmed for them never
# slows the plain launch. Each is the tile_sweep's spill-free tile closest to the plain one with
# every score modifier at once (the compile check's all-options case); where the plain tile spills
# none there, no entry. sm_90's plain forward tiles were timed (bench.tune) without modifiers; these were
# not: bench/test_attention_variants.py's flashtx-plain-tiles provider times them against the plain.
_MOD = SWEEP + "the plain tile spills with every score modifier at once ("
MODIFIED: dict = {
    "sm90": {"attn_fwd": {2: {64: C(128, 32, 8, 3, _MOD + "4 warps: 2.5 KB; 8 warps 24 bytes under Triton "
                                     "3.8); 8 warps, half the K/V rows, as sm_80/86's"),
                              128: C(64, 32, 4, 3, _MOD + "64x64: 16 bytes); half the K/V rows"),
                              256: C(64, 32, 8, 3, _MOD + "4 warps: 64 bytes); 8 warps, the same tile")}},
             "attn_bwd_dkdv": {2: {64: C(32, 64, 8, 3, _MOD + "64x64 8 warps: 64-192 bytes; 32x64 4 warps 8 under "
                                         "Triton 3.6); half the q rows, 8 warps: wgmma, no spills under 3.6 and 3.9 "
                                         "(3.8 not checked). It replaces 64x32 8 warps, which issued mma.sync "
                                         "(fewer than 64 K/V rows). Untimed"),
                                   128: C(16, 64, 8, 3, _MOD + "the causal 32x64 4 warps: 168-256 bytes under "
                                          "Triton 3.9, 8 warps 96-152 (24 under 3.6), 16x64 4 warps 8-16); half the "
                                          "K/V rows and a quarter of the q rows of FlexAttention's 64x128, 8 warps: "
                                          "wgmma, no spills under 3.6 and 3.9 (3.8 not checked). It replaces 32x32 8 "
                                          "warps, which issued mma.sync (fewer than 64 K/V rows); that was among the "
                                          "modifier tiles of the learned-bias backward that ran 2.0x slower than on "
                                          "the plain tiles (an H100, 2026-12-06; which kernel lost the time is not "
                                          "known). Untimed")}},
             "attn_bwd_dq": {2: {64: C(64, 32, 4, 3, _MOD + "64x64: 624 bytes); half the K/V rows"),
                                 128: C(128, 32, 8, 3, _MOD + "128x64: 976 bytes); half the K/V rows"),
                                 256: C(32, 64, 8, 2, _MOD + "64x32 8 warps: 56-232 bytes, 64x16 128); the "
                                        "previous plain entry: mma.sync, for want of a spill-free wgmma tile")}}},
    "sm80": {"attn_fwd": {2: {64: C(128, 32, 8, 3, _MOD + "128x64 4 warps: 2 KB); 8 warps, half the K/V rows"),
                              128: C(64, 64, 8, 2, _MOD + "128x64 8 warps: 552-608 bytes); half the q rows, 2 "
                                     "stages (128x32 spills 8-16 bytes)")}},
             "attn_bwd_dkdv": {2: {64: C(64, 32, 8, 3, _MOD + "32x128 8 warps: 216-304 bytes); a quarter of the K/V "
                                         "rows, twice the q rows (32x64 spills 176)"),
                                   256: C(32, 32, 8, 2, _MOD + "32x64: 344 bytes); half the K/V rows")}},
             "attn_bwd_dq": {2: {128: C(64, 32, 8, 3, _MOD + "64x128 8 warps: 568-616 bytes); a quarter of the K/V "
                                       "rows, 3 stages"),
                                 256: C(32, 32, 8, 2, _MOD + "64x32: 48 bytes); half the q rows")}}},
    "sm86": {"attn_fwd": {2: {64: C(128, 32, 8, 3, _MOD + "128x64 4 warps: 1.9 KB); 8 warps, half the K/V rows")}},
             "attn_bwd_dkdv": {2: {64: C(64, 32, 8, 3, _MOD + "32x128 8 warps: 192-272 bytes); a quarter of the K/V "
                                         "rows, twice the q rows (32x64 spills 96)")}}},
}

# Visibility masks (a window, key/query masks, lengths, varlen) add live registers for the row and
# column predicates: tried before TABLES for launches that mask (MaskSpec.masks_visibility), after
# MODIFIED when the launch also modifies scores.
# sm_80 and sm_86/89: the spill-free tile closest to the plain one with a window, key/query masks and lengths,
# and with varlen + window (the compile check's masked cases); no entry where the plain tile spills none.
_MASK = SWEEP + "the plain tile spills with visibility masks ("
MASKED: dict = {
    "sm90": {"attn_bwd_dq": {2: {128: C(128, 64, 8, 2, _MASK + "64 bytes with varlen + window under Triton 3.9); "
                                      "the same tile, 2 stages"),
                                 256: C(64, 16, 8, 3, _MASK + "64x32: 88-304 bytes with varlen + window under "
                                      "Triton 3.9); half the K/V rows: wgmma, no spills under 3.6 and 3.9 (3.8 not "
                                      "checked). Untimed")}},
             "attn_bwd_dkdv": {2: {64: C(32, 64, 4, 3, _MASK + "64x64 4 warps: 8-88 bytes); its timed 4-warp "
                                         "neighbour (plain: 5-9% slower at 4k), wgmma and no spills"),
                                   128: C(16, 64, 4, 3, _MASK + "32x64 4 warps: 32 bytes with varlen + window); half "
                                          "the q rows: wgmma and no spills, masked or not (Triton 3.9). Untimed")}}},
    "sm80": {"attn_fwd": {2: {64: C(128, 64, 8, 3, _MASK + "4 warps: 8 bytes); 8 warps, the same tile"),
                              128: C(128, 32, 8, 3, _MASK + "128x64: 8-24 bytes with varlen + window); half the "
                                     "K/V rows"),
                              256: C(32, 64, 8, 2, _MASK + "4 warps: 8 bytes under Triton 3.6); 8 warps, the same "
                                     "tile")}},
             "attn_bwd_dkdv": {2: {64: C(128, 32, 8, 3, _MASK + "32x128: 16-40 bytes); a quarter of the K/V rows, "
                                         "4x the q rows (64x32 spills 8 bytes with varlen under Triton 3.6)"),
                                   256: C(32, 32, 8, 2, _MASK + "32x64: 128 bytes); half the K/V rows")}}},
    "sm86": {"attn_fwd": {2: {64: C(128, 64, 8, 3, _MASK + "4 warps: 8-48 bytes); 8 warps, the same tile")}},
             "attn_bwd_dkdv": {2: {64: C(64, 32, 8, 3, _MASK + "32x128: 8-24 bytes); a quarter of the K/V rows, "
                                         "twice the q rows")}}},
}

# Plain launches without a causal mask (no window, masks, lengths or varlen, no score modifier: an encoder's,
# cross-attention's): tried before TABLES, and only where a GPU timed the full case apart from the causal one.
FULL: dict = {
    "sm90": {"attn_bwd_dkdv": {2: {128: C(64, 128, 8, 3, TUNE_H100 + "full attention: the fastest at every N, 2.2-2.3x "
                                          "the 8-warp 32x64 it replaced and 11% faster than the causal tile (32x64 4 "
                                          "warps) at 4k; FlexAttention sm_90's dK/dV tile")}}},
}

# Families in the order selection falls back through when the target's own entries do not fit.
FALLBACK_ORDER = ("sm86",)


def family(arch: int) -> str:
    """The table family of a compute capability: sm90 for 9.0 and later, sm80 for 8.0, else sm86."""
    return "sm90" if arch >= 90 else "sm80" if arch == 80 else "sm86"


# Short sequences: a q tile longer than the sequence (128 rows over Swin's 49-token windows or a Q-Former's 32 queries)
# computes scores, exponentials and products for padding rows. fit_rows cuts such a tile to SHORT_ROWS rows (the
# 64-query tile of the memory-efficient forward that SDPA-EFFICIENT runs at head dims <= 64; on sm_90 the M of one warp
# group's wgmma), with the table's warps and stages: the program does half the work or less and its loads are the same
# (rows past a sequence are never read). Derived, untimed: bench/test_attention_bias.py's Swin case runs such tiles. The
# compile check builds them (attention_bwd_launch._short_compile_plans: fp16, 49 rows and 64 (a multiple of 16: another
# variant of each kernel), plain causal or not, with visibility masks, with a score modifier, and every option with the
# bias gradient): wgmma on sm_90, and no spills where the table's tile spills none, except at head dim 192 (split head
# dims, off by default) with visibility masks (32-64 bytes at either length; the table's 0-48) or every option (56-424
# at 49, 56-112 at 64; the table's 128-200). Cutting the warps with the rows (8 -> 4) spilled 8-56 bytes on sm_80/86/90
# where the table's tile spilled none; cutting dK/dV's 128 K/V rows (sm_90's full-attention tile at 128) over at most
# 64 keys spilled 104 bytes (280 with 4 warps). sm_90's bias-gradient dQ at 128 (a timed tile that spills 1.1-1.4 KB)
# spills 600 bytes cut at 49 rows, 440 at 64. (Those comparisons are with the tables' tiles at 128 tokens; at 49, where
# both run, the tables' every-option forward tiles spill 24 bytes on sm_90 at 64 and 184 on sm_86 at 128, and the cut
# ones none.)
# The interpreter's tiles are 64 rows or fewer already.
SHORT_ROWS = 64


def fit_rows(cfg: TileConfig, rows) -> TileConfig:
    """cfg with block_m cut to SHORT_ROWS where a sequence has at most SHORT_ROWS rows along it (rows: the
    per-sequence extent of the kernel's block_m dim, an int; a SymInt keeps the tile: no guard on a symbolic size)."""
    if type(rows) is not int or not 0 < rows <= SHORT_ROWS < cfg.block_m:  # (SHORT_ROWS = 0: never)
        return cfg
    return dataclasses.replace(cfg, block_m=SHORT_ROWS,
                               reason=f"{cfg.reason}; {SHORT_ROWS} rows for a short sequence (fit_rows)")


# The interpreter runs tiles as numpy arrays: bigger tiles are faster there, but tests need
# several tiles per sequence. BLOCK_M != BLOCK_N on purpose (see INTERPRETER_TARGET).
_INTERPRETER = {
    "attn_fwd": TileConfig(64, 32, 1, 1, "interpreter"),
    "attn_bwd_dkdv": TileConfig(32, 64, 1, 1, "interpreter"),
    "attn_bwd_dq": TileConfig(64, 32, 1, 1, "interpreter"),
    "attn_bwd_dq_dbias": TileConfig(64, 32, 1, 1, "interpreter"),
    "attn_scores": TileConfig(32, 16, 1, 1, "interpreter"),
}

# Rows per program of the delta = rowsum(dO * O) preprocess: pure bandwidth, no tiling concerns.
PREPROCESS_BLOCK_M = 64



def estimate_shared_memory(kernel: str, cfg: TileConfig, block_dqk: int, block_dv: int, elt: int,
                           target: Target | None = None, mask_elt: int = 0) -> int:
    """Upper estimate of the shared memory a config needs, in bytes.

    Triton keeps `num_stages` buffers of each streamed tile in shared memory and stages the
    resident tiles and the dot operands that need a layout change there too. On Hopper (sm_90)
    the (block_m, block_n) P / dS operand of the second dot is staged too (measured: the compile
    check's sm_90 builds with score modifiers; the forward with masks stages two). The compile check
    asserts that this estimate is never below what the compiler reports.

    mask_elt: bytes a (block_m, block_n) element of an attn_mask tile the launch loads may take
    (attention_common.mask_elt; 0: none or no staging). Where the key count and the mask's strides are not multiples
    of 16, or its dtype is not q's, Triton stages the tile in shared memory for a layout change (measured,
    compile_check --seqlen 113 and its "mask-<dtype>" plans, 2026-12-07: 8 KB more at 128x32 with an fp16 mask at 113
    tokens in sm_80/86's forward, 24 KB with an fp32 mask at 128). Launches count it; config selection does not (see
    the comment below).
    """
    hopper = cfg.block_m * cfg.block_n * elt if target is not None and target.arch >= 90 else 0
    m, n, s = cfg.block_m, cfg.block_n, max(cfg.num_stages, 1)
    return _estimate_tiles(kernel, m, n, s, block_dqk, block_dv, elt, hopper) + m * n * mask_elt


# Why config selection leaves estimate_shared_memory's mask_elt out: it would prune tiles that fit with room to spare
# (sm_86's dQ at head dim 128 with an fp16 attn_mask at 113 keys: estimated 98,304 + 24,576 bytes against its 101,376
# limit, compiled 69,632), since the tile terms are loose where the mask tile costs most. Instead the compile check
# builds every plan that loads a mask tile at 113 keys too, and with bool, fp32 and fp64 masks on fp16 queries
# (tests/test_compile.py), and proves each fits its target and the launch's estimate (with mask_elt). One did not:
# sm_90's bias-gradient dQ at head dim 128 with an fp32 (fp64) mask took 262,144 (327,680) bytes of 232,448, so a
# bias-gradient dQ whose mask is wider than q takes the fp32 tile (attention_bwd_launch.plan_backward). The
# autotuner, whose candidates no compile check covers at every length and mask dtype, prunes with it
# (autotune.candidates).


def _estimate_tiles(kernel: str, m: int, n: int, s: int, block_dqk: int, block_dv: int, elt: int, hopper: int) -> int:
    """estimate_shared_memory's tile terms (without a mask tile)."""
    if kernel == "attn_fwd":
        streamed = n * (block_dqk + block_dv)  # K and V tiles
        resident = m * block_dqk  # Q tile
        # + 8 bytes a row for the fp32 row max and sum (measured: 512 bytes beyond the tiles at 128 fp32
        # rows on sm_80); sm_90 stages a second (block_m, block_n) tile with masks (measured: 32 KB at 128x128)
        return (s * streamed + resident) * elt + 2 * hopper + 8 * m
    elif kernel == "attn_bwd_dkdv":
        streamed = m * (block_dqk + block_dv)  # Q and dO tiles
        resident = n * (block_dqk + block_dv) + m * max(block_dqk, block_dv)  # K, V, a transposed q/dO tile
        if hopper:  # + the q rows' fp32 statistics (m2, l2, delta) pipelined with them (measured: Triton 3.6's
            # sm_90 builds with every score modifier staged 384 bytes beyond the tiles at 16 q rows and 1 KB at
            # 32, 3 stages, head dim 64)
            return (s * streamed + resident) * elt + hopper + 12 * m * s
    elif kernel in ("attn_bwd_dq", "attn_bwd_dq_dbias", "attn_scores"):
        streamed = n * (block_dqk + block_dv)  # K and V tiles
        resident = m * (block_dqk + block_dv)  # Q and dO tiles
        if kernel == "attn_bwd_dq_dbias":
            return (s * streamed + resident) * elt + hopper + m * n * 4  # + the fp32 dS tile written out
    else:
        raise KeyError(kernel)
    return (s * streamed + resident) * elt + hopper


def interpreter_active() -> bool:
    """Whether Triton interprets kernels: TRITON_INTERPRET read as Triton reads it."""
    return _env.triton_interpret()


_autotune_hook = None  # set by triton_kernels/autotune.py when autotuning is on (FLASHTX_AUTOTUNE=1); None: off
AUTOTUNE_REQUESTED = _env.flag("FLASHTX_AUTOTUNE")  # read once, here (configs is imported before autotune)
if AUTOTUNE_REQUESTED:
    from . import autotune as _autotune  # noqa: E402,F401  (installs the hook)


def select_config(kernel: str, block_dqk: int, block_dv: int, elt: int, target: Target,
                  modified: bool = False, masked: bool = False, causal: bool = True) -> TileConfig:
    """First candidate that fits `target`'s shared memory (the interpreter has its own).

    modified: the launch uses score modifiers (attn_mask, softcap, ALiBi or dropout).
    masked: a window, key/query masks, lengths or varlen decide visibility (MaskSpec.masks_visibility).
    causal: a causal mask (False with neither of the above: the FULL table first).
    An autotuned config (FLASHTX_AUTOTUNE) is keyed by `modified` and `causal` and timed with a modifier where it
    is set and a causal mask where that is;
    masked launches keep the MASKED tables (tuning times no visibility masks, and a plain winner spilled there).
    """
    if _autotune_hook is not None and target is not INTERPRETER_TARGET:  # a forced or tuned config, or None
        tuned = _autotune_hook(kernel, block_dqk, block_dv, elt, target, modified, masked, causal)
        if tuned is not None:
            return tuned
    if target is INTERPRETER_TARGET:
        return _INTERPRETER[kernel]
    return _select(kernel, block_dqk, block_dv, elt, target, modified, masked, causal)


def candidates(kernel: str, block_dqk: int, block_dv: int, elt: int, target: Target, modified: bool = False,
               masked: bool = False, causal: bool = True):
    """The entries selection tries for `target`, best first (see the module docstring)."""
    size, width = 2 if elt <= 2 else 4, max(block_dqk, block_dv)
    out = []
    fams = (family(target.arch),) + tuple(f for f in FALLBACK_ORDER if f != family(target.arch))
    for fam in fams:
        main = TABLES[fam].get(kernel, {}).get(size, {})
        bucket = _bucket(main, width)  # a specialisation entry serves exactly the main table's bucket
        tables = ([MODIFIED[fam]] if modified else []) + ([MASKED[fam]] if masked else []) + (
            [FULL.get(fam, {})] if not (causal or masked or modified) else [])
        for cfg in [t.get(kernel, {}).get(size, {}).get(bucket) for t in tables] + [main.get(bucket)]:
            if cfg is not None and cfg not in out:
                out.append(cfg)
    return out


POW2_BUCKETS = (64, 128, 256)


def _bucket(by_bucket: dict, width: int) -> int:
    """The bucket of register tile width `width`: the smallest of 64/128/256 and the table's own buckets
    (the 192 of split head dims) that holds it."""
    return head_dim_bucket(width, sorted(set(POW2_BUCKETS) | set(by_bucket)))


@functools.lru_cache(maxsize=None)
def _select(kernel: str, block_dqk: int, block_dv: int, elt: int, target: Target, modified: bool,
            masked: bool = False, causal: bool = True) -> TileConfig:
    for cfg in candidates(kernel, block_dqk, block_dv, elt, target, modified, masked, causal):
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
    return Target(arch, int(smem), sm_count=int(props.multi_processor_count), device=device_index)


# The memory-bound kernels' configs (RoPE, SwiGLU, decoding) live in configs_bandwidth; re-exported here, so
# every tile config is found through this module.
from .configs_bandwidth import (  # noqa: E402,F401
    _DECODE, _DECODE_INTERPRETER, FA2_SPLITKV, INTERPRETER_TILES, ROTARY_INTERPRETER, ROTARY_NUM_WARPS,
    ROTARY_TILE_PAIRS,
    SWIGLU_BLOCK_H_CANDIDATES, SWIGLU_INTERPRETER, SWIGLU_MAX_PAD_FRACTION, SWIGLU_NUM_WARPS,
    SWIGLU_TILE_ELEMENTS, DecodeConfig, ElementwiseConfig, _pow2_at_least, combine_chunk, decode_config,
    decode_programs_per_sm, rotary_config, swiglu_block_h, swiglu_config)
# (re-exported names are bound here too: monkeypatch a memory-bound kernel's number in configs_bandwidth, where its
# functions read it)
