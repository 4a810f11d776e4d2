"""Sweep the attention tile configs on this GPU and print a table ready to paste into configs.py.

    python -m bench.tune [--budget-s 330] [--json FILE] [--write-cache] [--quick] [--modified] [--kernels ...]
                         [--seqlens 4096,1024,16384] [--decode-budget-s 120]

Kernels attn_fwd, attn_bwd_dkdv and attn_bwd_dq; head dims 64 and 128; causal and not; bf16 and
fp16; N = 1k, 4k and 16k tokens per sequence at B*N = 16k tokens and H*D = 2048 (the shapes of
bench/test_attention.py). The candidates are triton_kernels/autotune.py's (configs.py's own choice
first); each is checked against the GPU's shared memory (configs.estimate_shared_memory) before it
is compiled, and one that fails to compile or launch is recorded and skipped.

Plan, within a wall-clock budget (default 330 s: 6 minutes on an H200 with margin; the first
compile of each config dominates):
  1. at N = 4k, time every candidate of every (kernel, D, causal, dtype) group, bf16 and D = 128
     first (the groups most users run), with triton.testing.do_bench (median, CUDA events);
  2. at N = 1k and 16k, time the group's default and its two best from step 1;
  3. on sm_90 and later, the TMA candidates at N = 4k, and those faster than the group's best other candidate
     at 1k and 16k (last: no GPU run has yet run a descriptor kernel, and one that faults breaks the CUDA
     context; the sweep then stops and keeps what it timed, and --write-cache caches no TMA tile).
A group or N the budget does not reach is listed as "not timed (budget)". Forward candidates time
the forward; dK/dV and dQ candidates time the whole backward with the other kernel at its default,
so differences between candidates are the tuned kernel's.

Output: a table per group (default ms, best config and ms, speedup) and, per (kernel, head dim),
the candidates ranked by the geometric mean over dtype, causal and N of their time over the
default's, as `TileConfig(...)` lines to paste into configs.py's tables (causal: the main tables; full:
configs.FULL). --write-cache stores the winner per kernel, head dim and causality in the autotune cache (the keys
FLASHTX_AUTOTUNE=1 reads).

`--modified` times every attention group with a score modifier (softcap 30; configs.MODIFIED's tiles are the
defaults, no TMA candidates), for the modifier tables and the modifier keys of --write-cache.

`--kernels decode` (opt-in; alone or in the comma list) also sweeps the decode (KV-cache) kernel's tiles and split
counts (bench/tune_decode.py: configs._DECODE's DecodeConfig lines to paste, under "decode" in --json; never
cached by --write-cache). With attention kernels it runs first, within --decode-budget-s of --budget-s.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections import defaultdict
from dataclasses import dataclass

KERNELS = ("attn_fwd", "attn_bwd_dkdv", "attn_bwd_dq")
ALL_KERNELS = (*KERNELS, "decode")  # decode: bench/tune_decode.py, opt-in (not in --kernels' default)
HEADDIMS = (128, 64)
DTYPES = ("bfloat16", "float16")
CAUSAL = (True, False)
N_FIRST = 4096
N_OTHERS = (1024, 16384)
TOP = 2  # candidates from step 1 re-timed at the other N


@dataclass(frozen=True)
class Group:
    kernel: str
    d: int
    causal: bool
    dtype: str
    modified: bool = False  # timed with a score modifier (softcap): configs.MODIFIED's tiles are the defaults

    @property
    def name(self) -> str:
        return (f"{self.kernel} D={self.d} {'causal' if self.causal else 'full'} {self.dtype}"
                + (" softcap" if self.modified else ""))


def groups(quick: bool = False, kernels: tuple = KERNELS, modified: bool = False) -> list[Group]:
    """Priority order: bf16 before fp16, D = 128 before 64, causal before full, fwd/dkdv/dq."""
    dtypes = DTYPES[:1] if quick else DTYPES
    return [Group(k, d, c, dt, modified) for dt in dtypes for d in HEADDIMS for c in CAUSAL for k in KERNELS
            if k in kernels]


def _ident(cfg) -> tuple:
    from flashtx.triton_kernels import autotune

    return autotune.ident_of(cfg)  # (block_m, block_n, warps, stages, tma)


def _config_args(ident) -> tuple[str, bool]:
    """(TileConfig's positional arguments, tma) of an ident (4 entries in runs before the TMA candidates)."""
    bm, bn, w, s, *tma = ident
    return f"{bm}, {bn}, {w}, {s}", bool(tma and tma[0])


def sweep(target, time_fn, *, budget_s: float, quick: bool = False, kernels: tuple = KERNELS,
          seqlens: tuple = (N_FIRST, *N_OTHERS), clock=time.monotonic,
          log=lambda *a: print(*a, file=sys.stderr, flush=True), healthy=lambda: True,
          progress=lambda out: None, modified: bool = False) -> dict:
    """Run the plan. time_fn(group, cfg, seqlen) -> ms (raises when the candidate cannot run).
    kernels: the KERNELS to tune; seqlens: step 1's N, then step 2's. modified: every group with a score modifier
    (softcap), configs.MODIFIED's tiles as the defaults (no TMA candidates).
    The TMA candidates (sm_90 and later; never yet run on a GPU) come last, at step 1's N, after every other
    timing: one that faults costs only their rows; those faster than the group's best other candidate there are
    timed at the other N too. healthy() is asked after a candidate raises; False (the CUDA context is broken: an
    illegal address is sticky) stops the sweep with what was timed. progress(out) gets the results so far after
    each row (main writes --json as it goes: a kernel that hangs the GPU ends the process with SIGKILL).
    Returns {"results": [{group fields, seqlen, config, ms | error}], "skipped": [...], "elapsed_s"}."""
    n_first, n_others = seqlens[0], tuple(seqlens[1:])
    from flashtx.triton_kernels import autotune

    t0 = clock()
    results: list[dict] = []
    skipped: list[str] = []
    step1: dict[Group, dict] = {}
    todo = groups(quick, kernels, modified)

    def run(g: Group, cfg, n: int, default: bool, timed: dict | None = None) -> None:
        if clock() - t0 > budget_s:
            skipped.append(f"{g.name} N={n} {autotune.describe(cfg)}")
            return
        row = {"kernel": g.kernel, "d": g.d, "causal": g.causal, "dtype": g.dtype, "modified": g.modified,
               "seqlen": n, "config": autotune.describe(cfg), "ident": list(_ident(cfg)), "default": default}
        try:
            row["ms"] = float(time_fn(g, cfg, n))
            if timed is not None:
                timed[_ident(cfg)] = (cfg, row["ms"])
        except Exception as exc:  # noqa: BLE001 - a candidate that cannot compile or launch here
            row["error"] = f"{type(exc).__name__}: {' '.join(str(exc).split())[:160]}"
            results.append(row)
            progress({"results": results, "skipped": skipped, "elapsed_s": clock() - t0})
            if not healthy():
                raise _Broken(f"{g.name} N={n} {autotune.describe(cfg)}") from exc
            return
        results.append(row)
        progress({"results": results, "skipped": skipped, "elapsed_s": clock() - t0})

    try:
        for g in todo:
            if clock() - t0 > budget_s:
                skipped.append(f"{g.name} N={n_first}")
                continue
            cands = autotune.candidates(g.kernel, g.d, g.d, 2, target, modified=g.modified, tma=False,
                                        causal=g.causal)
            timed: dict = {}
            for cfg in cands:
                run(g, cfg, n_first, cfg is cands[0], timed)
            step1[g] = {"default": cands[0] if cands else None, "timed": timed}
            summary = autotune.summarize({autotune.describe(c): ms for c, ms in timed.values()})
            log(f"  {g.name} N={n_first}: " + (summary if timed else "no candidate ran") + f" [{clock() - t0:.0f}s]")
        for n in n_others:
            for g in todo:
                s = step1.get(g)
                if not s or not s["timed"]:
                    continue
                ranked = sorted(s["timed"].values(), key=lambda cm: cm[1])[:TOP]
                again = [s["default"]] + [c for c, _ in ranked if _ident(c) != _ident(s["default"])]
                for cfg in again:
                    run(g, cfg, n, cfg is s["default"])
        for g in todo:  # the TMA candidates, last
            s = step1.get(g)
            if not s or s["default"] is None or _ident(s["default"]) not in s["timed"] or g.modified:
                continue  # no default time at N to compare with (or a modifier's sweep: no TMA candidates)
            tma = [c for c in autotune.candidates(g.kernel, g.d, g.d, 2, target, tma=True, causal=g.causal) if c.tma]
            timed = {}
            for cfg in tma:
                run(g, cfg, n_first, False, timed)
            best_plain = min(ms for _, ms in s["timed"].values())
            faster = [c for c, ms in timed.values() if ms < best_plain]
            for n in n_others:  # as the plain finalists were: the cache keeps only configs timed at every N
                for cfg in faster:
                    run(g, cfg, n, False)
            if tma:
                log(f"  {g.name} N={n_first}: {len(tma)} TMA candidates, {len(faster)} faster than the best other "
                    f"[{clock() - t0:.0f}s]")
    except KeyboardInterrupt:  # the device script's timeout sends SIGINT: keep what was timed
        skipped.append("interrupted (SIGINT): the rest was not timed")
    except _Broken as exc:
        skipped.append(f"stopped: the GPU failed after {exc} (a sticky CUDA error); the rest was not timed")
    return {"results": results, "skipped": skipped, "elapsed_s": clock() - t0}


class _Broken(Exception):
    """A candidate left the GPU unusable: nothing after it can be timed."""


def gpu_healthy() -> bool:
    """Whether the CUDA context still works after a candidate raised (an illegal address is sticky: every later
    launch and sync raises it)."""
    import torch

    try:
        torch.cuda.synchronize()
        torch.ones(1, device="cuda").add_(1).item()
    except Exception:  # noqa: BLE001 - any error here means the context is gone
        return False
    return True


def rank(results: list[dict]) -> dict[tuple[str, int, bool], list[tuple[tuple, float, int]]]:
    """Per (kernel, D, causal), as configs.py's tables (causal: the main ones; full: configs.FULL): candidates ranked
    by the geometric mean, over every (dtype, N) where both it and the default were timed, of its time over the
    default's: [(ident, geomean, cases)]."""
    default_ms = {}
    for r in results:
        if r.get("default") and "ms" in r:
            default_ms[(r["kernel"], r["d"], r["causal"], r["dtype"], r["seqlen"])] = r["ms"]
    logs: dict = defaultdict(lambda: defaultdict(list))
    for r in results:
        base = default_ms.get((r["kernel"], r["d"], r["causal"], r["dtype"], r["seqlen"]))
        if "ms" in r and base:
            logs[(r["kernel"], r["d"], r["causal"])][tuple(r["ident"])].append(math.log(r["ms"] / base))
    out = {}
    for kd, per in logs.items():
        out[kd] = sorted(((ident, math.exp(sum(v) / len(v)), len(v)) for ident, v in per.items()),
                         key=lambda x: (x[1], -x[2]))
    return out


def table(sweep_out: dict, gpu: str, triton_version: str) -> str:
    res = sweep_out["results"]
    modified = any(r.get("modified") for r in res)
    lines = [f"Tile-config sweep on {gpu} (triton {triton_version}), {sweep_out['elapsed_s']:.0f} s. "
             "Times: triton.testing.do_bench medians, ms; fwd kernels time the forward, dK/dV and dQ the backward"
             + (", with a score modifier (softcap 30); the defaults are configs.MODIFIED's tiles." if modified
                else "."),
             "", "| kernel | D | causal | dtype | N | default | default ms | best | best ms | speedup | candidates |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    by_case: dict = defaultdict(list)
    for r in res:
        by_case[(r["kernel"], r["d"], r["causal"], r["dtype"], r["seqlen"])].append(r)
    for (kernel, d, causal, dtype, n), rows in by_case.items():
        ok = [r for r in rows if "ms" in r]
        default = next((r for r in rows if r.get("default")), None)
        best = min(ok, key=lambda r: r["ms"]) if ok else None
        dms = default.get("ms") if default else None
        speed = f"{dms / best['ms']:.2f}x" if best and dms else "-"
        failed = sum("error" in r for r in rows)
        lines.append(f"| {kernel} | {d} | {'yes' if causal else 'no'} | {dtype} | {n} | "
                     f"{default['config'] if default else '-'} | {f'{dms:.3f}' if dms else '-'} | "
                     f"{best['config'] if best else '-'} | {best['ms']:.3f} | {speed} | "
                     f"{len(ok)} timed{f', {failed} failed' if failed else ''} |" if best else
                     f"| {kernel} | {d} | {'yes' if causal else 'no'} | {dtype} | {n} | - | - | - | - | - | "
                     f"{failed} failed |")
    stops = [x for x in sweep_out["skipped"] if x.startswith(("stopped:", "interrupted"))]
    budget = [x for x in sweep_out["skipped"] if x not in stops]
    lines += [""] + [f"**{x}**" for x in stops] if stops else []
    if budget:
        lines += ["", f"Not timed (budget): {len(budget)} candidate runs, e.g. " + "; ".join(budget[:6])]
    lines += ["", f"Paste into triton_kernels/configs.py ({'MODIFIED, ' if modified else ''}16-bit tables), best "
              "first per kernel, head dim and causality (causal: the main tables; full: configs.FULL); "
              "the number is the geometric mean of time / default's over the (dtype, N) cases timed:", ""]
    for (kernel, d, causal), ranked in sorted(rank(res).items(), key=lambda x: (x[0][:2], not x[0][2])):
        lines.append(f"# {kernel}, head dim {d}, {'causal' if causal else 'full (configs.FULL)'}")
        for ident, gm, cases in ranked[:3]:
            args, tma = _config_args(ident)
            lines.append(f"TileConfig({args}, \"tuned on {gpu}, triton {triton_version}: "
                         f"{gm:.2f}x the default's time over {cases} cases\"{', tma=True' if tma else ''}),")
    return "\n".join(lines)


def gpu_time_fn(seed: int = 0):
    import torch

    from flashtx.triton_kernels import autotune
    torch.manual_seed(seed)

    def time_fn(g: Group, cfg, seqlen: int) -> float:
        return autotune.time_candidate(g.kernel, cfg, d=g.d, causal=g.causal, dtype=getattr(torch, g.dtype),
                                       seqlen=seqlen, warmup_ms=5, rep_ms=25, modified=g.modified)
    return time_fn


def write_cache(sweep_out: dict, target, gpu: str, triton_version: str) -> list[str]:
    """The winner per (kernel, D, causal) into the autotune cache under the runtime keys: ranked first among the
    configs timed in as many cases as any (a tile timed at one N only cannot win on less evidence). TMA tiles
    are left out when the sweep stopped on a broken GPU or any TMA candidate failed: users' autotuning trusts a
    cached TMA winner."""
    from flashtx.triton_kernels import autotune
    from flashtx.triton_kernels.configs import TileConfig
    res = sweep_out["results"]
    modified = any(r.get("modified") for r in res)  # a --modified sweep: the modifier keys
    tma_ok = not any(x.startswith("stopped:") for x in sweep_out["skipped"]) and \
        not any("error" in r and _config_args(r["ident"])[1] for r in res)
    keys = []
    for (kernel, d, causal), ranked in rank(res).items():
        most = max(cases for _, _, cases in ranked)
        eligible = [x for x in ranked if x[2] == most and (tma_ok or not _config_args(x[0])[1])]
        if not eligible:
            continue
        (bm, bn, w, s, *tma), gm, cases = eligible[0]
        key = autotune.make_key(gpu=gpu, arch=target.arch, triton_version=triton_version, kernel=kernel,
                                dtype=autotune.DTYPE_ANY_16, block_dqk=d, block_dv=d, causal=bool(causal),
                                modified=modified)
        autotune.store(key, TileConfig(bm, bn, w, s, f"bench.tune: {gm:.2f}x the default's time over {cases} cases",
                                       bool(tma and tma[0])),
                       ms=None, timings={"geomean_vs_default": gm, "cases": cases})
        keys.append(key)
    return keys


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """main's arguments; kernels and seqlens as tuples (clear errors for bad input)."""
    ap = argparse.ArgumentParser(prog="python -m bench.tune", description=__doc__.splitlines()[0])
    ap.add_argument("--budget-s", type=float, default=330.0, help="wall-clock budget for the sweep (seconds)")
    ap.add_argument("--quick", action="store_true", help="bf16 only")
    ap.add_argument("--modified", action="store_true",
                    help="time every attention group with a score modifier (softcap): configs.MODIFIED's tiles against "
                         "the candidates")
    ap.add_argument("--json", default=None, help="write every timing here (decode's under \"decode\")")
    ap.add_argument("--write-cache", action="store_true",
                    help="store the attention winners in the autotune cache (decode is never cached)")
    ap.add_argument("--kernels", default=",".join(KERNELS),
                    help=f"comma list of {', '.join(ALL_KERNELS)} (decode is opt-in)")
    ap.add_argument("--seqlens", default=",".join(map(str, (N_FIRST, *N_OTHERS))),
                    help="comma list: every candidate at the first N, the default and the best two at the others")
    ap.add_argument("--decode-budget-s", type=float, default=120.0,
                    help="with attention kernels, the decode sweep's share of --budget-s (it runs first); "
                         "alone it has all of --budget-s")
    args = ap.parse_args(argv)
    kernels = tuple(k.strip() for k in args.kernels.split(",") if k.strip())
    bad = [k for k in kernels if k not in ALL_KERNELS]
    if bad or not kernels:
        ap.error(f"--kernels: got {args.kernels!r}{f' ({bad[0]!r} is unknown)' if bad else ''}; allowed: a comma "
                 f"list of {', '.join(ALL_KERNELS)}")
    try:
        seqlens = tuple(int(n) for n in args.seqlens.split(","))
    except ValueError:
        seqlens = ()
    from flashtx.triton_kernels.configs import SHORT_ROWS

    if not seqlens or min(seqlens) <= SHORT_ROWS:  # (at most SHORT_ROWS tokens: configs.fit_rows would cut every
        # 128-row candidate to 64 rows, timed under its own name)
        ap.error(f"--seqlens: got {args.seqlens!r}; allowed: a comma list of ints > {SHORT_ROWS} (first: the full "
                 "sweep)")
    for name in ("budget_s", "decode_budget_s"):
        if not getattr(args, name) > 0:
            ap.error(f"--{name.replace('_', '-')}: got {getattr(args, name)!r}; allowed: seconds > 0")
    args.kernels, args.seqlens = kernels, seqlens
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    attn = tuple(k for k in args.kernels if k in KERNELS)
    import torch
    if not torch.cuda.is_available():
        print("bench.tune: no CUDA GPU here; nothing to tune (the tuner is tested on CPU with a fake timer: "
              "tests/test_bench_tune.py, tests/test_bench_tune_decode.py)")
        return 0
    import triton

    from flashtx.triton_kernels.launch import target_for
    target = target_for(torch.empty(1, device="cuda"))
    gpu = torch.cuda.get_device_name()
    t_start = time.monotonic()
    out: dict = {"results": [], "skipped": [], "elapsed_s": 0.0}
    dec: dict | None = None

    def dump() -> None:
        if args.json:
            tmp = args.json + ".tmp"
            with open(tmp, "w") as f:
                json.dump({"gpu": gpu, "arch": target.arch, "triton": triton.__version__, "torch": torch.__version__,
                           **out, **({"decode": dec} if dec is not None else {})}, f, indent=1)
            os.replace(tmp, args.json)
    if "decode" in args.kernels:
        from bench import tune_decode
        time_fn, copy_fn, info = tune_decode.gpu_timers()
        dec = {"results": [], "skipped": [], "elapsed_s": 0.0}

        def dec_progress(d: dict) -> None:
            dec.update(d, timer=info["timer"])
            dump()
        dec_progress(tune_decode.sweep(target, time_fn, copy_fn=copy_fn, healthy=gpu_healthy, progress=dec_progress,
                                       budget_s=min(args.decode_budget_s, args.budget_s) if attn else args.budget_s))
    stopped = dec is not None and any(x.startswith(("stopped:", "interrupted")) for x in dec["skipped"])
    if attn and not stopped:
        out = sweep(target, gpu_time_fn(), budget_s=args.budget_s - (time.monotonic() - t_start), quick=args.quick,
                    modified=args.modified,
                    kernels=attn, seqlens=args.seqlens, healthy=gpu_healthy, progress=lambda o: (out.update(o), dump()))
        print(table(out, gpu, triton.__version__))
    if dec is not None:
        print(tune_decode.table(dec, gpu, triton.__version__))
    dump()
    if args.write_cache and attn:
        for key in write_cache(out, target, gpu, triton.__version__):
            print("cached:", key)
    return 0


if __name__ == "__main__":
    sys.exit(main())
