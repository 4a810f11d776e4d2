"""Compile-time tile sweep: registers, spills and shared memory of every candidate tile, for GPUs
nobody here can time (sm_80, sm_86/89).

    python -m flashtx.triton_kernels.tile_sweep --arch 86 --only "attn_bwd_dkdv D=64 float16 causal=True"

For each compile-check launch whose label contains `--only` (compile_check's labels), it forces each
candidate tile (block_m x block_n x warps x stages, those whose estimated shared memory fits the
target) through `autotune.forced`, compiles the launch exactly as compile_check does, and prints
shared memory, registers, spilled bytes and the tensor-core instructions (compile_check.mma_kind: on sm_90,
wgmma or mma.sync), spill-free tiles first, largest work per program first.
It is the source of the configs.py entries marked COMPILE_SWEEP: a GPU run (bench.tune) replaces
them with timed ones. Needs TRITON_INTERPRET unset.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import itertools
import json
import os
import sys

from .configs import KNOWN_TARGETS, TileConfig, estimate_shared_memory, interpreter_active

BLOCKS = (16, 32, 64, 128)
WARPS = (4, 8)
STAGES = (1, 2, 3)


def kernel_of(label: str) -> str:
    """The configs.py kernel name of a compile-check label ("attn_bwd_dq+dbias D=64 ..." -> attn_bwd_dq_dbias)."""
    head = label.split()[0]
    return "attn_bwd_dq_dbias" if head.startswith("attn_bwd_dq+dbias") else head.split("+")[0]


def _head_dims(label: str) -> tuple[int, int]:
    """(register width of q/k, of v) a label's launch uses: D=64 -> (64, 64); D=192/128 -> padded."""
    from .launch import head_split

    dims = next(t for t in label.split() if t.startswith("D="))[2:].split("/")
    dqk, dv = int(dims[0]), int(dims[-1])
    return sum(head_split(dqk)), sum(head_split(dv))


def _elt(label: str) -> int:
    return 4 if " float32" in label else 2


def grid(label: str, target) -> list[TileConfig]:
    """Candidate tiles for one label whose estimated shared memory fits `target`."""
    kernel, (dqk, dv), elt = kernel_of(label), _head_dims(label), _elt(label)
    out = []
    blocks = BLOCKS if elt == 4 else BLOCKS[1:]  # 16-row tiles only for fp32 (16-bit tiles never need them)
    for m, n, w, s in itertools.product(blocks, blocks, WARPS, STAGES):
        if m * n < 16 * 32 * w // 4:  # fewer tile elements than a dot's minimum per warp: skip
            continue
        cfg = TileConfig(m, n, w, s, "tile_sweep")
        if estimate_shared_memory(kernel, cfg, dqk, dv, elt, target) <= target.max_shared:
            out.append(cfg)
    return out


def _one(arch: int, label: str, m: int, n: int, w: int, s: int) -> dict:
    from . import autotune
    from .compile_check import _resource_usage, compile_launch, launch_plans, mma_kind

    target = KNOWN_TARGETS[arch]
    cfg = TileConfig(m, n, w, s, "tile_sweep")
    row = {"label": label, "arch": arch, "config": f"M{m} N{n} w{w} s{s}", "block_m": m, "block_n": n,
           "num_warps": w, "num_stages": s}
    try:
        with autotune.forced(kernel_of(label), cfg):
            plans = dict(launch_plans(target))
        compiled = compile_launch(plans[label], target)
        regs, spill = _resource_usage(compiled.asm["cubin"])
        row.update(shared=int(compiled.metadata.shared), registers=regs, spill=spill,
                   mma=mma_kind(compiled.asm["ptx"]))
    except Exception as exc:  # noqa: BLE001 - report every failure in the table
        row.update(shared=-1, registers=-1, spill=-1, error=f"{type(exc).__name__}: {exc}"[:200])
    return row


def parse_config(text: str) -> TileConfig:
    """"128x64w4s3" -> TileConfig(128, 64, 4, 3)."""
    import re

    m = re.fullmatch(r"(\d+)x(\d+)w(\d+)s(\d+)", text.strip())
    if m is None:
        raise ValueError(f"--configs: expected MxNwWsS (e.g. 128x64w4s3), got {text!r}")
    return TileConfig(*map(int, m.groups()), "tile_sweep")


def sweep(arch: int, labels: list[str], jobs: int, only_configs: list[TileConfig] | None = None) -> list[dict]:
    target = KNOWN_TARGETS[arch]
    work = [(arch, label, c.block_m, c.block_n, c.num_warps, c.num_stages)
            for label in labels for c in (only_configs or grid(label, target))]
    if jobs <= 1:
        return [_one(*w) for w in work]
    with concurrent.futures.ProcessPoolExecutor(jobs) as pool:
        return list(pool.map(_one, *zip(*work)))


def ranked(rows: list[dict]) -> list[dict]:
    """Spill-free first, then most work per program (block_m x block_n), more stages, fewer warps."""
    ok = [r for r in rows if r.get("spill", -1) >= 0]
    return sorted(ok, key=lambda r: (r["spill"] > 0, -r["block_m"] * r["block_n"], -r["num_stages"],
                                     r["num_warps"], r["spill"]))


def main(argv=None) -> int:
    from .compile_check import _all_plans

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", type=int, required=True, choices=sorted(KNOWN_TARGETS))
    ap.add_argument("--only", required=True, action="append",
                    help="compile-check labels containing this text (repeatable)")
    ap.add_argument("--configs", default="", help="comma-separated tiles to compile instead of the whole grid, "
                    "e.g. 128x64w4s3,64x64w8s2")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args(argv)
    if interpreter_active():
        print("tile_sweep compiles kernels: run it with TRITON_INTERPRET unset", file=sys.stderr)
        return 2
    labels = [label for label, _ in _all_plans(KNOWN_TARGETS[args.arch])
              if any(o in label for o in args.only) and kernel_of(label).startswith("attn_")
              and kernel_of(label) != "attn_bwd_preprocess"
              and " short" not in label]  # (configs.fit_rows' cuts of the tables' tiles: a forced tile is cut too)
    only_configs = [parse_config(c) for c in args.configs.split(",") if c.strip()] or None
    rows = sweep(args.arch, labels, args.jobs, only_configs)
    for label in labels:
        print(f"\n{label} (sm_{args.arch})\n{'config':<18} {'shared':>8} {'regs':>5} {'spill':>6} {'mma':>9}")
        for r in ranked([r for r in rows if r["label"] == label]):
            print(f"{r['config']:<18} {r['shared']:>8} {r['registers']:>5} {r['spill']:>6} {r['mma']:>9}")
        for r in rows:
            if r["label"] == label and r.get("error"):
                print(f"{r['config']:<18} ERROR {r['error']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
