"""The decode (KV-cache) tile and split sweep of `python -m bench.tune --kernels decode`.

Times triton_kernels/decode_kernels.py's `_decode_fwd` through flashtx.flash_attn_with_kvcache (Sq = 1, bf16,
Hq/Hkv = 32/8 as LLaMA-3-8B, contiguous caches (B, ctx, Hkv, D) full to ctx, no append) over tiles
DecodeConfig(block_n, max_block_m, num_warps, num_stages) forced into configs._DECODE (forced_tile) and split
counts around decode.split_count's heuristic (flash-attn 2's rule, configs.decode_programs_per_sm programs an SM).

Plan per head dim (128, then 64), within the wall-clock budget:
  1. at the first case, every tile (the shipped default first) at the heuristic's split count;
  2. there, the best TOP_TILES tiles at 2x, 4x and 0.5x the heuristic's count (clamped, deduplicated);
  3. at the other cases, the default at the heuristic's count and the best TOP_PAIRS (tile, split multiple).
Output: a table per case (ms, GB/s of K/V read, % of a device copy's bandwidth, speedup over the default) and
`DecodeConfig(...)` lines to paste into configs_bandwidth.py's _DECODE, ranked by the geometric mean over cases
of time / default's.
"""
from __future__ import annotations

import contextlib
import datetime
import itertools
import math
import sys
import time
from collections import defaultdict

HQ, HKV = 32, 8  # LLaMA-3-8B's GQA
HEADDIMS = (128, 64)
CASES = ((8, 8192), (1, 8192), (8, 32768), (1, 32768))  # (B, ctx), in priority order
BLOCK_NS, WARPS, STAGES = (64, 128, 256), (4, 8), (2, 3, 4)
MULTIPLES = (1, 2, 4, 0.5)  # of the heuristic's split count; 1 first
TOP_TILES = 3  # tiles timed at every split multiple (step 2)
TOP_PAIRS = 2  # (tile, multiple) pairs timed beside the default at the other cases (step 3)
ELT = 2  # bf16


def max_block_m(d: int) -> int:
    return 32 if d > 128 else 64


def shared_memory(tile, d: int, dv: int, elt: int = ELT) -> int:
    """Bytes of shared memory a tile is assumed to need: DecodeConfig.shared_memory's estimate (num_stages - 1 K
    and V buffers and a q tile) and 8 KB of margin. A tile that still does not fit fails to compile, and its row
    records that."""
    return tile.shared_memory(d, dv, elt) + 8192


def ident(tile) -> tuple:
    return tile.block_n, tile.max_block_m, tile.num_warps, tile.num_stages  # DecodeConfig's positional args


def candidates(d: int, target) -> list:
    """The shipped tile first (always: it is the baseline), then every (block_n, warps, stages) whose
    shared_memory fits target.max_shared."""
    from flashtx.triton_kernels.configs import DecodeConfig, decode_config

    default = decode_config(d, d, ELT, target)
    out = [default]
    for bn in BLOCK_NS:
        for w in WARPS:
            for s in STAGES:
                tile = DecodeConfig(bn, max_block_m(d), w, s, "bench.tune candidate")
                if ident(tile) != ident(default) and shared_memory(tile, d, d) <= target.max_shared:
                    out.append(tile)
    return out


@contextlib.contextmanager
def forced_tile(tile, d: int, elt: int = ELT):
    """configs.decode_config returns `tile` for head dim d's bucket (GPU targets; the interpreter keeps its own)
    inside: the entry of configs._DECODE is replaced, and restored on exit; every memoised plan, launch, lane and
    split count is dropped on entry and exit."""
    from flashtx import _dispatch
    from flashtx.triton_kernels import configs

    home = sys.modules[configs.decode_config.__module__]  # where decode_config reads it (configs re-exports it)
    table = home._DECODE[2 if elt <= 2 else 4]
    bucket = configs.head_dim_bucket(d)
    saved = table[bucket]
    _dispatch.clear_plans()  # the launch cache (lanes included) and decode._SPLITS too
    try:
        table[bucket] = tile
        yield tile
    finally:
        table[bucket] = saved
        _dispatch.clear_plans()


def heuristic_splits(tile, d: int, case: tuple, target) -> int:
    """decode.split_count(num_splits=0) for this tile at case (B, ctx) (shapes only: meta tensors)."""
    import torch

    from flashtx.triton_kernels import decode

    B, ctx = case
    q = torch.empty(B, 1, HQ, d, dtype=torch.bfloat16, device="meta")  # (B, Sq, Hq, D)
    kv = torch.empty(B, ctx, HKV, d, dtype=torch.bfloat16, device="meta")  # (B, ctx, Hkv, D)
    with forced_tile(tile, d):
        return decode.split_count(q, kv, kv, None, 0, target)


def _clamp(heuristic: int, mult: float, key_tiles: int) -> int:
    from flashtx.triton_kernels.decode import MAX_SPLITS

    return max(1, min(int(heuristic * mult), key_tiles, MAX_SPLITS))


def split_multiples(heuristic: int, key_tiles: int) -> list[tuple[float, int]]:
    """[(multiple, splits)] for MULTIPLES of the heuristic's count, clamped to [1, min(key_tiles, MAX_SPLITS)],
    without repeated counts (the first multiple giving a count keeps it)."""
    out, seen = [], set()
    for m in MULTIPLES:
        s = _clamp(heuristic, m, key_tiles)
        if s not in seen:
            seen.add(s)
            out.append((m, s))
    return out


def kv_bytes(case: tuple, d: int, dv: int | None = None, elt: int = ELT) -> int:
    """K/V bytes a decode step reads: B * ctx * Hkv * (D + Dv) * elt."""
    B, ctx = case
    return B * ctx * HKV * (d + (dv or d)) * elt


class _Broken(Exception):
    """A row left the GPU unusable."""


def sweep(target, time_fn, *, budget_s: float, copy_fn=lambda case, d: None, headdims=HEADDIMS, cases=CASES,
          clock=time.monotonic, log=lambda *a: print(*a, file=sys.stderr, flush=True), healthy=lambda: True,
          progress=lambda out: None) -> dict:
    """Run the plan. time_fn(d, tile, case, splits) -> ms (raises when the tile cannot run); copy_fn(case, d) ->
    ms of a device copy moving 2 x kv_bytes (read + write), or None; asked once per (case, d), after its first row.
    healthy() is asked after a row raises (False: a sticky CUDA error, the sweep stops); progress(out) gets the
    results after each row; SIGINT (KeyboardInterrupt) keeps what was timed.
    Returns {"results": [row], "copy": [{d, batch, ctx, ms, gbps}], "skipped": [...], "elapsed_s"}."""
    t0 = clock()
    results: list[dict] = []
    copies: list[dict] = []
    skipped: list[str] = []
    out = {"results": results, "copy": copies, "skipped": skipped, "elapsed_s": 0.0}
    copy_gbps: dict = {}

    def emit():
        out["elapsed_s"] = clock() - t0
        progress(out)

    def copy_bw(d, case):
        key = (d, *case)
        if key not in copy_gbps:
            ms = copy_fn(case, d)
            copy_gbps[key] = 2 * kv_bytes(case, d) / (ms * 1e6) if ms else None
            if ms:
                copies.append({"d": d, "batch": case[0], "ctx": case[1], "ms": ms, "gbps": copy_gbps[key]})
        return copy_gbps[key]

    def run(d, tile, case, mult, splits, h, default, step) -> dict | None:
        name = f"D={d} B={case[0]} ctx={case[1]} DecodeConfig{ident(tile)} splits={splits}"
        if clock() - t0 > budget_s:
            skipped.append(name)
            return None
        row = {"d": d, "batch": case[0], "ctx": case[1], "tile": list(ident(tile)), "splits": splits,
               "multiple": mult, "heuristic_splits": h, "default": default, "step": step}
        try:
            row["ms"] = float(time_fn(d, tile, case, splits))
            bw = copy_bw(d, case)  # after the case's first row: timed as the rows are (the first one decides how)
            row["gbps"] = kv_bytes(case, d) / (row["ms"] * 1e6)
            if bw:
                row["pct_copy"] = 100 * row["gbps"] / bw
        except Exception as exc:  # noqa: BLE001 - a tile that cannot compile or launch here
            row["error"] = f"{type(exc).__name__}: {' '.join(str(exc).split())[:160]}"
            results.append(row)
            emit()
            if not healthy():
                raise _Broken(name) from exc
            return row
        results.append(row)
        emit()
        return row

    done: set = set()  # (d, case, tile index, splits) timed or tried

    def at(d, i, tile, case, mult, step):
        """Tile cands[i] at case with `mult` x its heuristic's split count (once per count)."""
        h = heuristic_splits(tile, d, case, target)
        splits = _clamp(h, mult, -(-case[1] // tile.block_n))
        if (d, case, i, splits) in done:  # (a multiple clamped onto another's count)
            return None
        done.add((d, case, i, splits))
        return run(d, tile, case, mult, splits, h, i == 0, step)

    try:
        for d in headdims:
            first, others = cases[0], cases[1:]
            cands = candidates(d, target)
            timed = []  # (ms, tile, multiple) at the first case
            for i, tile in enumerate(cands):  # step 1
                row = at(d, i, tile, first, 1, 1)
                if row and "ms" in row:
                    timed.append((row["ms"], i, 1))
            best = sorted(timed)[:TOP_TILES]
            if timed:
                log(f"  decode D={d} B={first[0]} ctx={first[1]}: {len(timed)} of {len(cands)} tiles timed, best "
                    f"DecodeConfig{ident(cands[best[0][1]])} {best[0][0]:.4f} ms [{clock() - t0:.0f}s]")
            for _, i, _ in best:  # step 2
                h = heuristic_splits(cands[i], d, first, target)
                for mult, _ in split_multiples(h, -(-first[1] // cands[i].block_n))[1:]:
                    row = at(d, i, cands[i], first, mult, 2)
                    if row and "ms" in row:
                        timed.append((row["ms"], i, mult))
            pairs = [(i, m) for _, i, m in sorted(timed) if (i, m) != (0, 1)][:TOP_PAIRS]
            for case in others:  # step 3
                for i, mult in [(0, 1)] + pairs:
                    at(d, i, cands[i], case, mult, 3)
            log(f"  decode D={d}: {sum(r['d'] == d for r in results)} rows [{clock() - t0:.0f}s]")
    except KeyboardInterrupt:  # the device script's timeout sends SIGINT: keep what was timed
        skipped.append("interrupted (SIGINT): the rest was not timed")
    except _Broken as exc:
        skipped.append(f"stopped: the GPU failed after {exc} (a sticky CUDA error); the rest was not timed")
    out["elapsed_s"] = clock() - t0
    return out


def _default_ms(results: list[dict]) -> dict:
    return {(r["d"], r["batch"], r["ctx"]): r["ms"] for r in results
            if r["default"] and r["multiple"] == 1 and "ms" in r}


def rank(results: list[dict]) -> dict[int, list[tuple[tuple, float, float, int]]]:
    """Per head dim: (tile ident, split multiple, geomean of time / default's time, cases) over the cases where
    both were timed; those timed in the most cases first, then by the geometric mean."""
    base = _default_ms(results)
    logs: dict = defaultdict(lambda: defaultdict(list))
    for r in results:
        b = base.get((r["d"], r["batch"], r["ctx"]))
        if "ms" in r and b:
            logs[r["d"]][(tuple(r["tile"]), r["multiple"])].append(math.log(r["ms"] / b))
    out = {}
    for d, per in logs.items():
        most = max(len(v) for v in per.values())
        out[d] = sorted(((t, m, math.exp(sum(v) / len(v)), len(v)) for (t, m), v in per.items()),
                        key=lambda x: (x[3] < most, x[2]))
    return out


def _mult(m: float) -> str:
    return f"{m:g}x"


def _cases(n: int) -> str:
    return f"{n} case{'s' * (n != 1)}"


def split_winners(results: list[dict]) -> dict[int, dict[float, int]]:
    """Per head dim: {split multiple: cases whose fastest row used it}."""
    best: dict = {}
    for r in results:
        key = (r["d"], r["batch"], r["ctx"])
        if "ms" in r and (key not in best or r["ms"] < best[key]["ms"]):
            best[key] = r
    out: dict = defaultdict(lambda: defaultdict(int))
    for (d, _, _), r in best.items():
        out[d][r["multiple"]] += 1
    return {d: dict(v) for d, v in out.items()}


def paste_lines(results: list[dict], gpu: str, triton_version: str, date: str | None = None, top: int = 3) -> list:
    """`D: DecodeConfig(...),` lines per head dim, one per tile at its best split multiple, best first (see
    rank); then which split multiple won how many cases."""
    date = date or datetime.date.today().isoformat()
    lines = []
    for d, ranked in sorted(rank(results).items(), reverse=True):
        lines.append(f"# head dim {d}: configs_bandwidth._DECODE[2][{d}], best first")
        at_own = {t: (gm, c) for t, m, gm, c in ranked if m == 1}
        shown: set = set()
        for tile, m, gm, cases in ranked:
            if tile in shown or len(shown) == top:
                continue
            shown.add(tile)
            n = _cases(cases)
            own = at_own.get(tile)
            at = "" if m == 1 else (f" at {_mult(m)} the split heuristic's count (decode_programs_per_sm)"
                                    + (f"; {own[0]:.2f}x at its count over {_cases(own[1])}" if own else ""))
            lines.append(f"{d}: DecodeConfig({', '.join(map(str, tile))}, \"bench.tune on {gpu} ({date}, triton "
                         f"{triton_version}): {gm:.2f}x the default's time over {n}{at}\"),")
    for d, wins in sorted(split_winners(results).items(), reverse=True):
        n = sum(wins.values())
        m, k = max(wins.items(), key=lambda x: x[1])
        lines.append(f"# splits (D={d}): {_mult(m)} the heuristic's was fastest in {k} of {n} cases"
                     + "".join(f"; {_mult(mm)} in {kk}" for mm, kk in wins.items() if mm != m))
    return lines


def table(out: dict, gpu: str, triton_version: str) -> str:
    """Markdown: a table per (head dim, case), rows fastest first, then the lines to paste."""
    res = out["results"]
    lines = [f"Decode sweep on {gpu} (triton {triton_version}), {out['elapsed_s']:.0f} s: bf16, Sq = 1, "
             f"Hq/Hkv = {HQ}/{HKV}, full contiguous caches. ms: {out.get('timer', 'median')}; GB/s of K/V read; "
             "% of a device copy's bandwidth (read + write bytes / time); speedup over the default tile at the "
             "heuristic's split count."]
    base = _default_ms(res)
    copies = {(c["d"], c["batch"], c["ctx"]): c for c in out.get("copy", [])}
    by_case: dict = defaultdict(list)
    for r in res:
        by_case[(r["d"], r["batch"], r["ctx"])].append(r)
    for (d, B, ctx), rows in by_case.items():
        c = copies.get((d, B, ctx))
        lines += ["", f"### D={d} B={B} ctx={ctx}: K/V {kv_bytes((B, ctx), d) / 1e6:.0f} MB"
                  + (f", copy {c['gbps']:.0f} GB/s" if c else ""), "",
                  "| tile (block_n, max_block_m, warps, stages) | splits | ms | GB/s | % of copy | speedup |",
                  "|---|---|---|---|---|---|"]
        b = base.get((d, B, ctx))
        for r in sorted(rows, key=lambda r: r.get("ms", math.inf)):
            tile = ", ".join(map(str, r["tile"])) + (" (default)" if r["default"] else "")
            splits = f"{r['splits']} ({_mult(r['multiple'])})"
            if "ms" not in r:
                lines.append(f"| {tile} | {splits} | failed: {r['error'][:80]} | | | |")
                continue
            pct = f"{r['pct_copy']:.0f}%" if "pct_copy" in r else "-"
            speed = f"{b / r['ms']:.2f}x" if b else "-"
            lines.append(f"| {tile} | {splits} | {r['ms']:.4f} | {r['gbps']:.0f} | {pct} | {speed} |")
    stops = [x for x in out["skipped"] if x.startswith(("stopped:", "interrupted"))]
    budget = [x for x in out["skipped"] if x not in stops]
    lines += [""] + [f"**{x}**" for x in stops] if stops else []
    if budget:
        lines += ["", f"Not timed (budget): {len(budget)} decode rows, e.g. " + "; ".join(budget[:4])]
    lines += ["", "Paste into triton_kernels/configs_bandwidth.py's _DECODE[2] (the number: geometric mean over the "
              "cases timed of time / the default's at the heuristic's split count):", ""]
    lines += paste_lines(res, gpu, triton_version)
    return "\n".join(lines)


def make_inputs(case: tuple, d: int, device, dtype=None, hq: int = HQ, hkv: int = HKV, seed: int = 0) -> tuple:
    """(q (B, 1, Hq, D), k_cache, v_cache (B, ctx, Hkv, D), cache_seqlens (B,) int32 = ctx)."""
    import torch

    dtype = dtype or torch.bfloat16
    B, ctx = case
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(B, 1, hq, d, device=device, dtype=dtype, generator=g)
    kc, vc = (torch.randn(B, ctx, hkv, d, device=device, dtype=dtype, generator=g) for _ in range(2))
    lens = torch.full((B,), ctx, dtype=torch.int32, device=device)
    return q, kc, vc, lens


def decode_call(inputs: list, splits: int):
    """fn() running flashtx.flash_attn_with_kvcache on the Triton backend with `splits` key splits, on each of
    `inputs` (make_inputs tuples: a model's layers) in turn."""
    import flashtx

    calls = [lambda q=q, kc=kc, vc=vc, lens=lens: flashtx.flash_attn_with_kvcache(
        q, kc, vc, cache_seqlens=lens, num_splits=splits, backend="triton") for q, kc, vc, lens in inputs]
    turn = itertools.cycle(calls)
    return lambda: next(turn)()


def layers(nbytes: int, l2_bytes: int) -> int:
    """Caches to take turns on so that no call finds its K/V in L2 (at least 4x L2 in all; 1 when one is)."""
    return max(1, -(-4 * l2_bytes // max(nbytes, 1)))


def gpu_timers(rep_ms: int = 20):
    """(time_fn, copy_fn, info) for sweep on the current CUDA device. Rows time the steady state of back-to-back
    calls: triton.testing.do_bench_cudagraph when a call captures in a CUDA graph (probed once), else do_bench;
    the calls take turns on `layers` caches, as a model's layers do, where one cache is under 4x L2.
    info["timer"] says how (and why not a graph)."""
    import torch
    import triton.testing as tt

    l2 = int(getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "L2_cache_size", 0) or 0) \
        or 64 << 20  # (unknown: more than any GPU here has; H100 50 MB, H200 60 MB)
    info: dict = {"timer": None, "l2_bytes": l2}
    held: dict = {}  # one case's inputs at a time (B = 8, ctx = 32k: 1 GiB of K/V)

    def inputs(case, d):
        if (case, d) not in held:
            held.clear()
            torch.cuda.empty_cache()
            held[(case, d)] = [make_inputs(case, d, "cuda", seed=i) for i in range(layers(kv_bytes(case, d), l2))]
        return held[(case, d)]

    def graphs_work(fn) -> bool:
        if info["timer"] is None:
            try:
                s = torch.cuda.Stream()
                s.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(s):
                    fn()
                torch.cuda.current_stream().wait_stream(s)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    fn()
                g.replay()
                torch.cuda.synchronize()
                info["timer"] = "triton.testing.do_bench_cudagraph median"
            except Exception as exc:  # noqa: BLE001 - capture refused: time eagerly
                torch.cuda.synchronize()
                info["timer"] = (f"triton.testing.do_bench median (CUDA graph capture failed: {type(exc).__name__}: "
                                 f"{' '.join(str(exc).split())[:120]})")
            info["timer"] += f", calls taking turns on caches of 4x L2 ({l2 / 2 ** 20:.0f} MiB) in all"
        return info["timer"].startswith("triton.testing.do_bench_cudagraph")

    def time_fn(d, tile, case, splits) -> float:
        fn = decode_call(inputs(case, d), splits)
        with forced_tile(tile, d):
            fn()
            fn()  # compile and plan outside any capture
            torch.cuda.synchronize()
            if graphs_work(fn):
                return float(tt.do_bench_cudagraph(fn, rep=rep_ms, return_mode="median"))
            return float(tt.do_bench(fn, warmup=10, rep=rep_ms * 2, return_mode="median"))

    def copy_fn(case, d) -> float:
        """A device copy moving kv_bytes (read) + kv_bytes (written), timed as the rows are: back to back (in a CUDA
        graph where the rows are), taking turns on pairs of buffers of 4x L2 in all."""
        held.clear()
        torch.cuda.empty_cache()
        n = kv_bytes(case, d) // 2  # bf16 elements: kv_bytes read, as many written
        pairs = [(torch.randn(n, device="cuda", dtype=torch.bfloat16), torch.empty(n, dtype=torch.bfloat16,
                                                                                  device="cuda"))
                 for _ in range(layers(2 * kv_bytes(case, d), l2))]
        turn = itertools.cycle(pairs)

        def fn():
            src, dst = next(turn)
            dst.copy_(src)
        fn()
        torch.cuda.synchronize()
        if info["timer"] is not None and info["timer"].startswith("triton.testing.do_bench_cudagraph"):
            return float(tt.do_bench_cudagraph(fn, rep=rep_ms, return_mode="median"))
        return float(tt.do_bench(fn, warmup=10, rep=rep_ms * 2, return_mode="median"))  # (freed on return)

    return time_fn, copy_fn, info
