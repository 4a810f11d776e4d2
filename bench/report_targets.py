"""The ratios bench/report.py tables, and its "Targets, measured in this run" section.

A target is judged over the cases whose baseline (the provider it is measured against, or the same run's copy)
was measured: a case where the baseline ran but flashtx is absent, failed (OOM, an error) or has no such time
(a record cut off before its back-to-back rounds) is a MISS, and said so ("flashtx absent or failed in k of n
cases"); a target none of whose cases were measured prints "not measured in this run", never MET. Each target
is judged from idle (median_ms: one call, launch and host time included) and back to back (steady_ms), as
bench/README.md says. Pure Python: no torch, triton or GPU.
"""
from __future__ import annotations

import statistics
from collections import Counter, defaultdict

from . import gpus

# Targets on attention ratios: (issue, pass, provider, minimum ratio provider_time / flashtx_time, shortest N,
# what it says). Each is judged twice: from idle (one call: launch and host time count) and back to back.
TARGETS = [(3, "fwd", "sdpa-flash", 1.0, 0, "attention forward >= 1.0x SDPA-FLASH (FlashAttention-2 inside PyTorch)"),
           (3, "bwd", "sdpa-flash", 0.8, 0, "attention backward >= 0.8x SDPA-FLASH"),
           (3, "fwd+bwd", "sdpa-efficient", 1.5, 0,
            "attention fwd+bwd >= 1.5x SDPA-EFFICIENT (xformers' kernel inside PyTorch)"),
           (13, "fwd", "sdpa-flash", 1.15, 2048, "attention forward >= 1.15x SDPA-FLASH at N >= 2k"),
           (13, "fwd", "sdpa-cudnn", 0.75, 2048, "attention forward >= 0.75x SDPA-CUDNN at N >= 2k"),
           (13, "bwd", "sdpa-flash", 1.0, 2048, "attention backward >= 1.0x SDPA-FLASH at N >= 2k")]
TIMINGS = (("median_ms", "from idle"), ("steady_ms", "back to back"))
# Back to back, the same buffers are reused call after call: a case whose bytes fit in L2 (the H100's is 50 MB, the
# H200's about 60 MB) may run from L2, and its "GB/s" is then not HBM bandwidth. Bandwidth targets are judged back
# to back only on cases moving at least 4x that.
L2_BYTES = 60e6
STEADY_MIN_BYTES = 4 * L2_BYTES
L2_NOTE = (f"only cases moving >= {STEADY_MIN_BYTES / 1e6:.0f} MB, 4x the ~60 MB L2: back to back, smaller ones "
           "may run from L2")


def measured(r: dict | None, field: str = "median_ms") -> bool:
    """r ran to the end of `field`'s measurement: status "ok" and a nonzero value."""
    return bool(r) and r.get("status") == "ok" and bool(r.get(field))


def ratio(case: dict, provider: str, field: str = "median_ms"):
    """provider time / flashtx time, from idle (median_ms) or back to back (field="steady_ms"); the provider's
    status ('OOM'), 'flashtx <status>', or None (not run, or no such time recorded) when there is no ratio."""
    ours, other = case.get("flashtx"), case.get(provider)
    if other is None or ours is None:
        return None
    if other["status"] != "ok":
        return other["status"]
    if ours["status"] != "ok":
        return f"flashtx {ours['status']}"
    if not other.get(field) or not ours.get(field):
        return None
    return other[field] / ours[field]


def copy_share(c: dict, field: str = "gbs", copy_field: str | None = None) -> float | None:
    """flashtx's GB/s over the same run's copy of as many bytes (field "gbs": from idle, "gbs_steady": back to
    back, "gbs_kernel": its kernel time, against the copy's `copy_field`, by default the same field); None when
    either did not run or has no such figure."""
    ours, copy = c.get("flashtx"), c.get("copy")
    copy_field = copy_field or field
    if not (measured(ours, field) and measured(copy, copy_field)):
        return None
    return ours[field] / copy[copy_field]


def _why_absent(r: dict | None, field: str) -> str:
    if r is None:
        return "absent"
    if r.get("status") != "ok":
        return str(r.get("status"))
    return "no back-to-back time" if field.endswith("steady") or field == "steady_ms" else f"no {field}"


def judged(case: dict, provider: str, field: str = "median_ms"):
    """For a target: None when the baseline `provider` was not measured (the case does not count); a string
    (why) when it was and flashtx was not (a miss); else provider time / flashtx time."""
    if not measured(case.get(provider), field):
        return None
    ours = case.get("flashtx")
    if not measured(ours, field):
        return _why_absent(ours, field)
    return case[provider][field] / ours[field]


def judged_share(case: dict, field: str = "gbs"):
    """As judged, for flashtx's share of the same run's copy bandwidth (the baseline is the copy)."""
    if not measured(case.get("copy"), field):
        return None
    ours = case.get("flashtx")
    return copy_share(case, field) if measured(ours, field) else _why_absent(ours, field)


def case_bytes(case: dict) -> float | None:
    return next((r["bytes"] for r in (case.get("flashtx"), case.get("copy")) if r and r.get("bytes")), None)


def verdict(results: list, minimum: float, what: str, fmt: str = "{:.2f}x") -> str:
    """One target line over the judged cases: floats are measured values, strings are cases where the baseline
    ran and flashtx did not (each a miss)."""
    values = [x for x in results if isinstance(x, float)]
    absent = [x for x in results if isinstance(x, str)]
    n = len(values) + len(absent)
    if not n:
        return f"- {what}: not measured in this run"
    missed = sum(v < minimum for v in values) + len(absent)
    state = f"**MET** in all {n}" if not missed else f"**MISSED** in {missed} of {n}"
    spread = (f"min {fmt.format(min(values))}, median {fmt.format(statistics.median(values))}, "
              f"max {fmt.format(max(values))}") if values else ""
    if not absent:
        return f"- {what}: {state} cases ({spread})"
    why = ", ".join(f"{k} {w}" for w, k in Counter(absent).most_common())
    return (f"- {what}: {state} cases: flashtx absent or failed in {len(absent)} of {n} cases ({why})"
            + (f"; the {len(values)} measured: {spread}" if values else ""))


def judged_on(keys: list) -> str:
    """The attention cases a verdict was judged on (report._key's tuples), e.g. "judged on D=64 causal Hq/Hkv
    32/8 at N 2048, 4096; D=128 ..." (a run's -k may leave whole shapes out: a verdict speaks for these only)."""
    shapes: dict = defaultdict(set)
    for k in keys:
        shapes[(k[2], k[3], k[4], k[5])].add(k[7])
    return "; ".join(f"D={d} {'causal' if causal else 'full'} Hq/Hkv {hq}/{hkv} at N {', '.join(map(str, sorted(ns)))}"
                     for (d, causal, hq, hkv), ns in sorted(shapes.items()))


def _attention_verdict(attn: dict, select, provider: str, field: str, minimum: float, what: str) -> str | None:
    """verdict over the attention cases `select` keeps whose baseline was measured, naming the shapes judged;
    None when no case was judged and the timing is the steady one (only the from-idle line says "not measured")."""
    res = [(k, r) for k, c in attn.items() if select(k) for r in [judged(c, provider, field)] if r is not None]
    if not res and field != "median_ms":
        return None
    line = verdict([r for _, r in res], minimum, what)
    return line + (f" [judged on {judged_on([k for k, _ in res])}]" if res else "")


def targets(groups: dict) -> list[str]:
    lines = []
    attn = {k: v for k, v in groups.items() if k[0] == "attention"}
    for issue, pass_, provider, minimum, min_n, what in TARGETS:
        for field, how in TIMINGS:
            lines.append(_attention_verdict(attn, lambda k: k[1] == pass_ and k[7] >= min_n, provider, field,
                                            minimum, f"{what}, {how} (issue {issue})"))
    for field, how in TIMINGS:
        lines.append(_attention_verdict(attn, lambda k: k[7] == 2048, "eager", field, 3.0,
                                        f"attention >= 3x eager at N = 2k (each pass and shape measured), {how}"))
    lines = [line for line in lines if line is not None]
    lines += memory_lines(attn) + model_lines(groups) + overhead_lines(groups)
    for op in ("rope", "swiglu"):
        lines += bandwidth_lines([c for k, c in groups.items() if k[0] == op], 0.8,
                                 f"{op} >= 80% of the measured copy bandwidth")
    return lines + decode_targets(groups)


def bandwidth_lines(cases: list[dict], floor: float, what: str, fmt: str = "{:.0%}") -> list[str]:
    """flashtx's share of the copy's bandwidth >= floor: from idle over every case, back to back over the cases
    too big for L2 (STEADY_MIN_BYTES)."""
    lines = [verdict([r for c in cases for r in [judged_share(c)] if r is not None], floor, f"{what}, from idle",
                     fmt)]
    steady = [c for c in cases if judged_share(c, "gbs_steady") is not None]
    big = [c for c in steady if (case_bytes(c) or 0) >= STEADY_MIN_BYTES]
    if steady and not big:
        lines.append(f"- {what}, back to back: not judged: no measured case moves >= "
                     f"{STEADY_MIN_BYTES / 1e6:.0f} MB (4x the ~60 MB L2; smaller ones may run from L2 back to back)")
    elif big:
        lines.append(verdict([judged_share(c, "gbs_steady") for c in big], floor, f"{what}, back to back ({L2_NOTE})",
                             fmt))
    # the launch-bound cases (gbs_kernel: only there): the GPU's own time, against the copy back to back (one kernel)
    kernel = [x for c in big for x in [copy_share(c, "gbs_kernel", "gbs_steady")] if x is not None]
    if kernel:
        lines.append(verdict(kernel, floor, f"{what}, kernel time of the cases whose back to back was launch-bound "
                             "(torch.profiler; the copy back to back)", fmt))
    shares = [x for c in cases for x in [copy_share(c)] if x is not None] + [
        x for c in big for x in [copy_share(c, "gbs_steady")] if x is not None]
    if any(x > 1.02 for x in shares):
        lines[-1] += (f" (a share of {max(shares):.0%}: faster than the copy of as many bytes, so that case's copy "
                      "reference or flashtx's time is suspect)")
    return lines


def memory_lines(attn: dict) -> list[str]:
    lines = []
    mem = {k: v for k, v in attn.items() if k[1] == "fwd+bwd" and k[4] == k[5]}
    for p in ("flashtx", "eager"):
        by_cfg = defaultdict(list)
        for k, c in mem.items():
            if measured(c.get(p), "peak_mem_mb"):
                by_cfg[(k[2], k[3])].append((k[7], c[p]["peak_mem_mb"]))
        for (d, causal), pts in sorted(by_cfg.items()):
            if len(pts) >= 2:
                (n0, m0), (n1, m1) = min(pts), max(pts)
                lines.append(f"- memory, {p}, fwd+bwd D={d} {'causal' if causal else 'full'} (B*N fixed): "
                             f"{m0:.0f} MB at N={n0} -> {m1:.0f} MB at N={n1} ({m1 / m0:.1f}x; flat means O(N))")
    return lines


def model_lines(groups: dict) -> list[str]:
    """The compiled GPT step (bench/test_models.py): fullgraph, then tokens/s vs SDPA from idle and back to back."""
    lines = []
    for k, c in groups.items():
        if k[0] != "model-train":
            continue
        ours, sdpa = c.get("flashtx"), c.get("sdpa")
        where = f"{k[2]} B={k[4]} S={k[5]}"
        what = f"compiled training step ({where})"
        if ours and ours.get("fullgraph") is False:
            lines.append(f"- {what}, flashtx with torch.compile(fullgraph=True): **FAILED** "
                         f"({ours.get('fullgraph_status') or 'graph break'})")
        elif ours and ours.get("fullgraph") is True:
            lines.append(f"- {what}, flashtx with torch.compile(fullgraph=True): **MET** (no graph break)")
        for field, how in (("tokens_per_s", "from idle"), ("tokens_per_s_steady", "back to back")):
            head = f"- {what} tokens/s >= 1.0x SDPA (issue 12), {how}"
            if not measured(sdpa, field):
                if field == "tokens_per_s":
                    lines.append(f"{head}: not measured in this run (no SDPA tokens/s)")
                continue
            if not measured(ours, field):
                lines.append(f"{head}: **MISSED**: flashtx absent or failed ({_why_absent(ours, field)})")
                continue
            r = ours[field] / sdpa[field]
            state = "**MET**" if r >= 1.0 and ours.get("fullgraph") is not False else "**MISSED**"
            note = " (not fullgraph: does not count)" if ours.get("fullgraph") is False else ""
            lines.append(f"{head}: {state}, {r:.2f}x{note}")
    return lines


def overhead_ratio(r: dict) -> tuple[float | None, str]:
    """(flashtx us / baseline us, what flashtx's us is) of a host-overhead row, the figure its <= 2x is judged on.
    On a GPU the baseline's time includes its CUDA launch, so flashtx's must too: "with launch". bench/overhead.py
    records its basis; an older GPU row (no ratio_basis, a with-launch time) is recomputed from that time."""
    if r.get("ratio_basis"):
        return r.get("ratio"), r["ratio_basis"]
    if r.get("with_launch_us_per_call") and r.get("baseline_us_per_call"):
        return r["with_launch_us_per_call"] / r["baseline_us_per_call"], "with launch"
    return r.get("ratio"), "launches stubbed"


def overhead_met(r: dict) -> tuple[bool | None, bool | None, bool]:
    """(met_target, met_ratio, met) of a host-overhead row, the ratio judged as overhead_ratio says."""
    x, _ = overhead_ratio(r)
    met_ratio = r.get("met_ratio") if x is None else x <= r.get("max_ratio", 2.0)
    met_target = r.get("met_target")
    return met_target, met_ratio, met_ratio is not False and met_target is not False


def overhead_lines(groups: dict) -> list[str]:
    over = [c["flashtx"] for k, c in groups.items() if k[0] == "overhead" and "flashtx" in c]
    if not over:
        return []
    missed = [r.get("row", "?") for r in over if not overhead_met(r)[2]]
    state = f"**MET** in all {len(over)}" if not missed else f"**MISSED** in {len(missed)} of {len(over)}"
    basis = " (on a GPU, flashtx's time with its launch)" if any(
        overhead_ratio(r)[1] == "with launch" for r in over) else ""
    return [f"- host overhead (issue 12: attention fwd <= 25 us, fwd+bwd <= 80 us, RoPE/SwiGLU <= 15 us, "
            f"each <= 2x the baseline{basis}): {state} calls" + (f" ({', '.join(missed)})" if missed else "")]


def decode_targets(groups: dict) -> list[str]:
    """Issue 15's targets at context >= 8k: K/V read at >= 80% of copy for batch >= 8 (>= 60% at batch 1),
    >= 1.5x the best SDPA backend, >= 1.0x xformers' triton_splitKF; each from idle and back to back. Judged on
    the attend-only step (pass "fwd"); the RoPE + append step is tabled, not judged (the issue sets no target)."""
    cases = {k: c for k, c in groups.items() if k[0] == "decode" and k[1] == "fwd" and k[5] >= 8192}
    if not cases:
        return ["- decoding (issue 15): not measured in this run"]
    lines = []
    for label, floor, pick in (("batch >= 8", 80, lambda b: b >= 8), ("batch 1", 60, lambda b: b == 1)):
        lines += bandwidth_lines([c for k, c in cases.items() if pick(k[2])], floor / 100,
                                 f"decoding at context >= 8k, {label}: K/V read >= {floor}% of the measured copy "
                                 "bandwidth (issue 15)", "{:.1%}")
    sdpa = ("sdpa-flash", "sdpa-efficient", "sdpa-cudnn")
    for field, how in TIMINGS:
        best = []
        for c in cases.values():
            rs = [r for p in sdpa for r in [judged(c, p, field)] if r is not None]
            if rs:  # the fastest SDPA backend has the smallest time ratio; flashtx missing: the same string for each
                floats = [r for r in rs if isinstance(r, float)]
                best.append(min(floats) if floats else rs[0])
        if best or field == "median_ms":
            lines.append(verdict(best, 1.5, f"decoding at context >= 8k >= 1.5x the best SDPA backend, {how} "
                                            "(issue 15)"))
        xf = [r for c in cases.values() for r in [judged(c, "xformers-splitk", field)] if r is not None]
        if xf or field == "median_ms":
            lines.append(verdict(xf, 1.0, f"decoding at context >= 8k >= 1.0x xformers triton_splitKF, {how} "
                                          "(issue 15)"))
    return lines


# ------------------------------------------------------------------------------- the variants' ideal cost
def variant_ideal(variant: str, n: int, r: dict | None = None) -> float | None:
    """The fraction of the full causal run's (query, key) pairs a variant computes: the time a kernel that skips
    every tile nobody sees would take, relative to full causal (tile granularity makes it a little more: a
    window of 1024 at N = 4096 is 0.44 of the pairs, 0.48 of the 128x64 tiles). From the record's window and
    doc_len (bench/test_attention_variants.py writes them), else from the variant's name; None if unknown."""
    r = r or {}
    if r.get("ideal_fraction") is not None:
        return r["ideal_fraction"]
    full = gpus.visible_pairs(n, n, True)
    if variant.startswith("window"):
        w = r.get("window") or int(variant[len("window"):] or 0)
        return gpus.visible_pairs(n, n, True, window=w) / full if w else None
    if variant.startswith("varlen"):
        doc = r.get("doc_len")
        if not doc:  # "varlen16x1k": documents of 1k
            size = variant.split("x")[-1]
            doc = int(size[:-1]) * 1024 if size.endswith("k") else int(size) if size.isdigit() else 0
        return (n / doc) * gpus.visible_pairs(doc, doc, True) / full if doc and n % doc == 0 else None
    if variant in ("full", "bias", "boolmask", "softcap+alibi", "dropout0.1"):
        return 1.0  # every causal pair: what these cost above 1.00 is the option's own work
    return None
