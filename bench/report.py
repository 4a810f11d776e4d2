"""Turn pytest-benchmark's JSON into a markdown report and PNG plots.

    python -m bench.report results.json [--out DIR]

Writes DIR/report.md (also printed) with: where the numbers come from (GPU, versions, date), ratio
tables (ratio = provider's median time / flashtx's, so > 1 means flashtx is faster; for attention
this equals the TFLOP/s ratio), a peak-memory table, a model training-step table (tokens/s per
provider and flashtx's tokens/s over each), and issue 3's targets as measured in this run (judged in
bench/report_targets.py: from idle and back to back; a missing or failed flashtx row is a miss). A run whose
device-script steps (machine_info["flashtx_run"]["steps"]) did not all end ok opens with an INCOMPLETE banner.
With matplotlib, also DIR/attention.png (TFLOP/s against sequence length, one panel per
(pass, D, causal), grouped bars as in FlashAttention's README), DIR/attention_gqa.png and
DIR/rope_swiglu.png (GB/s). Times are extra_info["median_ms"] (CUDA events, see bench/harness.py).
Pure Python apart from matplotlib: it needs no GPU, torch or triton.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

from .report_breakdown import breakdown_table
from .report_targets import (  # noqa: F401 (ratio, copy_share, TARGETS, TIMINGS: bench.report's API too)
    TARGETS, TIMINGS, copy_share, measured, overhead_met, overhead_ratio, ratio, targets, variant_ideal)

_copy_share = copy_share
ATTN_ORDER = ["flashtx", "sdpa-flash", "sdpa-efficient", "sdpa-cudnn", "flash_attn", "xformers", "flex",
              "sdpa-math", "eager"]
MEM_ORDER = ["flashtx", "sdpa-flash", "sdpa-efficient", "eager", "sdpa-math", "copy", "compiled", "liger"]
PASSES = ["fwd", "bwd", "fwd+bwd"]
MODEL_ORDER = ["flashtx", "sdpa", "eager"]  # bench/test_models.py's providers
OVERHEAD_ORDER = ["attention fwd (no grad)", "attention fwd (with grad)", "attention bwd", "attention fwd+bwd",
                  "flash_attn_func fwd (no grad)", "patched SDPA fwd (no grad)", "rope q+k fwd", "rope q+k bwd",
                  "swiglu fwd", "swiglu bwd", "decode step (append + attend)"]  # bench/overhead.py's rows
VARIANT_ORDER = ["full", "window1024", "varlen16x1k", "bias", "boolmask", "softcap+alibi", "dropout0.1"]

SMOKE_BANNER = ("**Smoke run (BENCH_SMOKE=1): tiny shapes on a CPU, flashtx through Triton's interpreter. "
                "It checks that the benchmarks, the JSON and this report work; its times mean nothing and "
                "must not be quoted or recorded in bench/RESULTS.md.**")


def load(path: str | Path) -> dict:
    with open(path) as f:
        return json.load(f)


def records(data: dict) -> list[dict]:
    """The extra_info of every flashtx-bench result (others are ignored). A record without a status did not
    get through bench/harness.py's run_case (it writes the status with the times): "unknown", not "ok". One cut
    off after its timed rounds (the device script's timeout) has its from-idle times but neither its back-to-back
    time nor the flops/bytes written last: `cut_off` True, and the tables say so."""
    out = []
    for b in data.get("benchmarks", []):
        ei = dict(b.get("extra_info") or {})
        if "op" in ei and "provider" in ei:
            ei.setdefault("status", "unknown")
            if ei["status"] == "ok" and (("tflops" in ei and "flops" not in ei) or ("gbs" in ei and "bytes" not in ei)):
                ei["cut_off"] = True
            out.append(ei)
    return out


def _key(r: dict) -> tuple:
    if r["op"] == "overhead":
        return ("overhead", r.get("row", r.get("pass", "")))
    if r["op"] == "model-train":
        return ("model-train", r.get("pass", "train"), r["model"], r["dtype"], r["batch"], r["seqlen"])
    if r["op"] == "attention-variant":
        return ("attention-variant", r["pass"], r["dtype"], r["seqlen"], r["variant"])
    if r["op"] == "attention-bias":
        return ("attention-bias", r["pass"], r["dtype"], r["batch"], r["seqlen"], r["heads"], r["headdim"])
    if r["op"] == "decode":
        return ("decode", r.get("pass", "fwd"), r["batch"], r["heads"], r["kv_heads"], r["seqlen"], r["dtype"])
    if r["op"] == "attention":
        return ("attention", r["pass"], r["headdim"], bool(r["causal"]), r["heads"], r["kv_heads"], r["dtype"],
                r["seqlen"])
    return (r["op"], r["pass"], r.get("model", ""), r.get("dtype", ""), r.get("tokens", r.get("seqlen")))


def grouped(recs: list[dict]) -> dict:
    """{case key: {provider: record}} in a stable order."""
    g: dict = defaultdict(dict)
    for r in recs:
        g[_key(r)][r["provider"]] = r
    def order(k):
        pass_rank = PASSES.index(k[1]) if k[1] in PASSES else len(PASSES)
        return (k[0], pass_rank, *[str(x).zfill(12) for x in k[2:]])
    return dict(sorted(g.items(), key=lambda kv: order(kv[0])))


def _pair(case: dict, provider: str) -> str:
    """'idle / steady' ratio cell: from idle (one call, launch and host time included), then back to back; '- '
    after the slash when one side has no back-to-back time (the idle ratio alone only when neither has one)."""
    idle, steady = ratio(case, provider), ratio(case, provider, "steady_ms")
    if not isinstance(idle, float):
        return _cell(idle)
    if steady is None and not any((case.get(p) or {}).get("steady_ms") for p in ("flashtx", provider)):
        return _cell(idle)
    return f"{_cell(idle)} / {_cell(steady)}"


def _cell(x) -> str:
    if x is None:
        return "-"
    if isinstance(x, str):
        return x
    return f"{x:.2f}x"


def _num(r: dict | None, field: str, fmt: str = "{:.1f}") -> str:
    if r is None:
        return "-"
    if r["status"] != "ok":
        return r["status"]
    v = r.get(field)
    return "-" if v is None else fmt.format(v)


def _steady(r: dict | None) -> str:
    """Steady-state ms per call (back to back); '*' when the host could not keep ahead (launch-bound), then with the
    GPU's own time beside it where the harness measured it (kernel_ms: its kernels' device time, torch.profiler)."""
    if r is None or r.get("status") != "ok" or r.get("steady_ms") is None:
        if r is not None and r.get("cut_off"):
            return "cut off"
        return "-" if r is None or r.get("status") == "ok" else r["status"]
    kernel = f" (kernel {r['kernel_ms']:.3f})" if r.get("steady_host_bound") and r.get("kernel_ms") else ""
    return f"{r['steady_ms']:.3f}" + ("*" if r.get("steady_host_bound") else "") + kernel


def header(data: dict, source: str) -> list[str]:
    mi = (data.get("machine_info") or {}).get("flashtx_bench", {})
    gpu = f"- GPU: {mi.get('gpu', 'unknown')}"
    if "capability" in mi:
        gpu += (f" (sm_{str(mi['capability']).replace('.', '')}, {mi.get('sm_count', '?')} SMs, "
                f"{mi.get('memory_gb', '?')} GB)")
    lines = [f"- results: `{source}`, written {data.get('datetime', '?')} "
             f"(pytest-benchmark {data.get('version', '?')})",
             gpu,
             f"- torch {mi.get('torch', '?')} (CUDA {mi.get('cuda', '?')}), triton {mi.get('triton', '?')}, "
             f"flashtx {mi.get('flashtx', '?')}"]
    if mi.get("peak_tflops_16"):
        lines.append(f"- datasheet peaks: {mi['peak_tflops_16']} TFLOP/s dense fp16/bf16, {mi['peak_gbs']} GB/s "
                     f"({mi.get('peak_source', '')})")
    else:
        lines.append("- GPU not in bench/gpus.py's peak table: absolute numbers only, no % of peak")
    commit = data.get("commit_info") or {}
    run = run_info(data)
    if run.get("commit"):  # (the device's copy of .git may be stale: pytest-benchmark's commit_info reads it)
        lines.append(f"- flashtx tree the device script ran: {run['commit']}")
    elif commit.get("id"):
        lines.append(f"- commit {str(commit['id'])[:12]}{' (dirty tree)' if commit.get('dirty') else ''}")
    if isinstance(run.get("bench_env"), dict):
        env = ", ".join(f"{k}={v}" if v is not None else f"{k} unset" for k, v in sorted(run["bench_env"].items()))
        lines.append(f"- benchmark environment: {env or '(none set)'}")
    steps = run_steps(data)
    if steps:
        lines.append("- device script steps: " + "; ".join(
            f"{st.get('name', '?')}: {st.get('verdict', '?')}"
            + (f" ({st['seconds']:.0f} s)" if isinstance(st.get("seconds"), (int, float)) else "") for st in steps))
    return lines


def run_info(data: dict) -> dict:
    """What bench/device_check.sh merged about its run: machine_info["flashtx_run"] (steps, commit, bench_env),
    over a top-level "flashtx_run" (older JSON: tree, script, tune). {} when neither is there."""
    out = dict(data.get("flashtx_run") or {}) if isinstance(data.get("flashtx_run"), dict) else {}
    mi = (data.get("machine_info") or {}).get("flashtx_run")
    return {**out, **mi} if isinstance(mi, dict) else out


def run_steps(data: dict) -> list[dict]:
    steps = run_info(data).get("steps")
    return [st for st in steps if isinstance(st, dict)] if isinstance(steps, list) else []


# device_check.sh steps ("step" key) whose rows this JSON holds: only their end decides whether the results are
# complete (a cut prewarm, or a tune or hostprof out of time, leaves every benchmark row as measured)
RESULT_STEPS = ("bench", "models")


def incomplete_banner(data: dict) -> list[str]:
    """The run's result-writing steps (RESULT_STEPS; every step for a record without the "step" key) that did not
    end "ok" (timed out, failed, skipped), as the report's opening lines: a report of an incomplete run must not
    read as a complete one. [] when they all ended ok, or none is listed."""
    bad = [st for st in run_steps(data)
           if st.get("verdict") != "ok" and st.get("step", RESULT_STEPS[0]) in RESULT_STEPS]
    if not bad:
        return []
    what = "; ".join(f"{st.get('name', '?')}: {st.get('verdict') or 'no verdict'}"
                     + (f" after {st['seconds']:.0f} s" if isinstance(st.get("seconds"), (int, float))
                        and st.get("verdict") != "skipped" else "")
                     for st in bad)
    return [f"**INCOMPLETE RUN: {len(bad)} of {len(run_steps(data))} device-script steps did not end ok ({what}). "
            "Rows those steps would have written are missing or cut off; a missing flashtx row counts as a miss "
            "in the Targets, and nothing here may be read as a complete run.**", ""]


def attention_table(groups: dict, gqa: bool) -> list[str]:
    cases = {k: v for k, v in groups.items() if k[0] == "attention" and (k[4] != k[5]) == gqa}
    if not cases:
        return []
    providers = [p for p in ATTN_ORDER[1:] if any(p in c for c in cases.values())]
    lines = ["| pass | D | causal | Hq/Hkv | N | dtype | flashtx ms | steady ms | TFLOP/s | steady TFLOP/s | % peak "
             "| MB | "
             + " | ".join(f"vs {p}" for p in providers) + " |",
             "|" + "---|" * (12 + len(providers))]
    for (_, pass_, d, causal, hq, hkv, dtype, n), c in cases.items():
        ours = c.get("flashtx")
        lines.append(f"| {pass_} | {d} | {'yes' if causal else 'no'} | {hq}/{hkv} | {n} | {dtype} | "
                     f"{_num(ours, 'median_ms', '{:.3f}')} | {_steady(ours)} | {_num(ours, 'tflops')} | "
                     f"{_num(ours, 'tflops_steady')} | {_num(ours, 'pct_peak_tflops')} | "
                     f"{_num(ours, 'peak_mem_mb', '{:.0f}')} | " + " | ".join(_pair(c, p) for p in providers) + " |")
    return lines


def bias_table(groups: dict) -> list[str]:
    """Window attention with a learned (1, H, N, N) bias over many windows (bench/test_attention_bias.py): flashtx's
    times and the ratio of each provider's."""
    cases = {k: v for k, v in groups.items() if k[0] == "attention-bias"}
    if not cases:
        return []
    providers = [p for p in ("flashtx-128-rows", "sdpa-efficient", "sdpa-math", "eager")
                 if any(p in c for c in cases.values())]
    lines = ["| pass | windows | N | H | D | dtype | flashtx ms | steady ms | TFLOP/s | MB | "
             + " | ".join(f"vs {p}" for p in providers) + " |", "|" + "---|" * (10 + len(providers))]
    for (_, pass_, dtype, windows, n, h, d), c in cases.items():
        ours = c.get("flashtx")
        lines.append(f"| {pass_} | {windows} | {n} | {h} | {d} | {dtype} | {_num(ours, 'median_ms', '{:.3f}')} | "
                     f"{_steady(ours)} | {_num(ours, 'tflops')} | {_num(ours, 'peak_mem_mb', '{:.0f}')} | "
                     + " | ".join(_pair(c, p) for p in providers) + " |")
    return lines


def variants_table(groups: dict) -> list[str]:
    """flashtx's variants against its own full causal run on the same tokens (bench/test_attention_variants.py):
    a window or varlen that skips tiles takes a fraction of the time; "ideal" is the fraction of the full run's
    (query, key) pairs the variant computes (report_targets.variant_ideal), what a perfect skip would take."""
    cases = {k: v.get("flashtx") for k, v in groups.items() if k[0] == "attention-variant"}
    plain = {k: v.get("flashtx-plain-tiles") for k, v in groups.items() if k[0] == "attention-variant"}
    plain_bwd = {k: v.get("flashtx-plain-bwd-tiles") for k, v in groups.items() if k[0] == "attention-variant"}
    if not cases:
        return []
    rank = {v: i for i, v in enumerate(VARIANT_ORDER)}
    cases = dict(sorted(cases.items(), key=lambda kv: (PASSES.index(kv[0][1]) if kv[0][1] in PASSES else 9,
                                                       *kv[0][2:4], rank.get(kv[0][4], len(rank)), kv[0][4])))
    # plain tiles / these: the same call with configs.py's specialisation tiles off (> 1: the trimmed tiles win);
    # "bwd": off in the backward's kernels only (the learned bias's fwd+bwd)
    lines = ["| pass | variant | dtype | flashtx ms | time / full causal | ideal (pairs / full causal's) "
             "| effective TFLOP/s | MB | plain tiles / these |", "|---" * 9 + "|"]
    for key, r in cases.items():
        _, pass_, dtype, n, variant = key
        full = cases.get(("attention-variant", pass_, dtype, n, "full"))
        rel = vs_plain = "-"
        if measured(r) and measured(full):
            rel = f"{r['median_ms'] / full['median_ms']:.2f}"
            if measured(r, "steady_ms") and measured(full, "steady_ms"):
                rel += f" / {r['steady_ms'] / full['steady_ms']:.2f}"
        ideal = variant_ideal(variant, n, r or plain.get(key))
        p, pb = plain.get(key), plain_bwd.get(key)
        if r and p and r.get("status") == p.get("status") == "ok":
            vs_plain = f"{p['median_ms'] / r['median_ms']:.2f}x"
        if r and pb and r.get("status") == pb.get("status") == "ok":
            vs_plain = ("" if vs_plain == "-" else vs_plain + ", ") + f"{pb['median_ms'] / r['median_ms']:.2f}x bwd"
        lines.append(f"| {pass_} | {variant} | {dtype} | {_num(r, 'median_ms', '{:.3f}')} | {rel} | "
                     f"{'-' if ideal is None else f'{ideal:.2f}'} | "
                     f"{_num(r, 'tflops')} | {_num(r, 'peak_mem_mb', '{:.0f}')} | {vs_plain} |")
    return lines


def models_table(groups: dict) -> list[str]:
    """Training-step throughput of one model per provider (bench/test_models.py), and flashtx's
    tokens/s over each other provider's (> 1 means flashtx is faster); each "from idle / back to back" when the
    JSON has the back-to-back tokens/s (tokens_per_s_steady)."""
    cases = {k: v for k, v in groups.items() if k[0] == "model-train"}
    if not cases:
        return []
    providers = [p for p in MODEL_ORDER if any(p in c for c in cases.values())]
    providers += sorted({p for c in cases.values() for p in c} - set(providers))
    others = [p for p in providers if p != "flashtx"]
    both = any(r.get("tokens_per_s_steady") for c in cases.values() for r in c.values())
    how = " (from idle / back to back)" if both else ""
    lines = ["| model | dtype | B | S | tokens/step | " + " | ".join(f"{p} tokens/s{how}" for p in providers) + " | "
             + " | ".join(f"flashtx / {p}{how}" for p in others) + " | peak MB (" + " / ".join(providers) + ") |",
             "|" + "---|" * (6 + len(providers) + len(others))]

    def tps(r):
        cell = _num(r, "tokens_per_s", "{:,.0f}")
        if both and measured(r, "tokens_per_s"):
            cell += " / " + _num(r, "tokens_per_s_steady", "{:,.0f}")
        return cell + (" (graph breaks)" if (r or {}).get("fullgraph") is False else "")

    for (_, _, model, dtype, batch, seqlen), c in cases.items():
        ours = c.get("flashtx")
        tokens = next((r["tokens"] for r in c.values() if r.get("tokens")), batch * seqlen)
        cells = []
        for p in others:
            other = c.get(p)
            if other is None or ours is None:
                cells.append("-")
            elif other["status"] != "ok":
                cells.append(other["status"])
            elif ours["status"] != "ok":
                cells.append(f"flashtx {ours['status']}")
            elif measured(ours, "tokens_per_s") and measured(other, "tokens_per_s"):
                cell = f"{ours['tokens_per_s'] / other['tokens_per_s']:.2f}x"
                if both:
                    steady = measured(ours, "tokens_per_s_steady") and measured(other, "tokens_per_s_steady")
                    cell += (f" / {ours['tokens_per_s_steady'] / other['tokens_per_s_steady']:.2f}x" if steady
                             else " / -")
                cells.append(cell)
            else:
                cells.append("-")
        lines.append(f"| {model} | {dtype} | {batch} | {seqlen} | {tokens} | "
                     + " | ".join(tps(c.get(p)) for p in providers) + " | " + " | ".join(cells) + " | "
                     + " / ".join(_num(c.get(p), "peak_mem_mb", "{:.0f}") for p in providers) + " |")
    return lines


def memory_table(groups: dict) -> list[str]:
    """Peak extra memory (MB) of fwd+bwd per provider: B*N is fixed, so O(N) memory is flat in N."""
    cases = {k: v for k, v in groups.items() if k[0] == "attention" and k[1] == "fwd+bwd" and k[4] == k[5]}
    if not cases:
        return []
    providers = [p for p in MEM_ORDER if any(p in c for c in cases.values())]
    lines = ["| D | causal | N | " + " | ".join(providers) + " |", "|" + "---|" * (3 + len(providers))]
    for (_, _, d, causal, _, _, _, n), c in cases.items():
        lines.append(f"| {d} | {'yes' if causal else 'no'} | {n} | "
                     + " | ".join(_num(c.get(p), "peak_mem_mb", "{:.0f}") for p in providers) + " |")
    return lines


def _bandwidth_cells(c: dict) -> str:
    ours = c.get("flashtx")
    pct, pct_steady = (f"{100 * x:.0f}%" if x is not None else "-"
                       for x in (_copy_share(c), _copy_share(c, "gbs_steady")))
    return (f"{_num(ours, 'median_ms', '{:.3f}')} | {_steady(ours)} | {_num(ours, 'gbs', '{:.0f}')} | "
            f"{_num(ours, 'gbs_steady', '{:.0f}')} | {pct} | {pct_steady} | {_num(ours, 'pct_peak_gbs')}")


BANDWIDTH_HEAD = "flashtx ms | steady ms | GB/s | steady GB/s | % of copy | steady % of copy | % peak BW"


def memory_bound_table(groups: dict) -> list[str]:
    cases = {k: v for k, v in groups.items() if k[0] in ("rope", "swiglu")}
    if not cases:
        return []
    others = [p for p in ("eager", "compiled", "liger") if any(p in c for c in cases.values())]
    lines = ["| op | pass | model | tokens | " + BANDWIDTH_HEAD + " | " + " | ".join(f"vs {p}" for p in others) + " |",
             "|" + "---|" * (11 + len(others))]
    for (op, pass_, model, _, tokens), c in cases.items():
        lines.append(f"| {op} | {pass_} | {model} | {tokens} | {_bandwidth_cells(c)} | "
                     + " | ".join(_pair(c, p) for p in others) + " |")
    return lines


def decode_table(groups: dict) -> list[str]:
    """Decoding (bench/test_decode.py): GB/s of K/V read against the same run's copy, and each provider's
    time over flashtx's. Step: `attend` (Sq = 1 over the cache) or `append-rotary` (RoPE + append + attend)."""
    cases = {k: v for k, v in groups.items() if k[0] == "decode"}
    if not cases:
        return []
    others = [p for p in ("sdpa-flash", "sdpa-efficient", "sdpa-cudnn", "xformers-splitk", "flashtx-cuda",
                          "flashtx-attention", "flashtx-train", "sdpa-eager") if any(p in c for c in cases.values())]
    lines = ["| step | B | Hq/Hkv | context | dtype | " + BANDWIDTH_HEAD + " | "
             + " | ".join(f"vs {p}" for p in others) + " |", "|" + "---|" * (12 + len(others))]
    for (_, pass_, batch, hq, hkv, ctx, dtype), c in cases.items():
        step = "attend" if pass_ == "fwd" else pass_
        lines.append(f"| {step} | {batch} | {hq}/{hkv} | {ctx} | {dtype} | {_bandwidth_cells(c)} | "
                     + " | ".join(_pair(c, p) for p in others) + " |")
    return lines


def overhead_table(groups: dict) -> list[str]:
    """Host overhead (bench/test_overhead.py): Python microseconds per call, launches stubbed; on a GPU also with
    the launch, the figure its <= 2x baseline is judged on (the baseline's time includes its launch). The ratio
    column is flashtx / baseline, the inverse of every other ratio here: <= 2x is met."""
    rows = [c.get("flashtx") for k, c in groups.items() if k[0] == "overhead"]
    rows = [r for r in rows if r]
    if not rows:
        return []
    order = {name: i for i, name in enumerate(OVERHEAD_ORDER)}
    rows.sort(key=lambda r: order.get(r.get("row"), len(order)))
    with_launch = any(r.get("with_launch_us_per_call") is not None for r in rows)
    via_jit = any(r.get("with_launch_via_jit_us_per_call") is not None for r in rows)
    floor = any(r.get("floor_us_per_call") is not None for r in rows)
    clock = any(r.get("clock") for r in rows)
    lines = ["| call | flashtx us/call | target us | baseline | baseline us/call | flashtx / baseline (<= 2x) | "
             + ("with launch us/call | " if with_launch else "")
             + ("launched via JITFunction.run us/call | " if via_jit else "")
             + ("no-op autograd floor us/call | " if floor else "") + ("clock | " if clock else "") + "verdict |",
             "|" + "---|" * (7 + with_launch + via_jit + floor + clock)]
    for r in rows:
        met_target, met_ratio, _ = overhead_met(r)
        x, basis = overhead_ratio(r)
        misses = []
        if met_target is False:
            below = r.get("floor_us_per_call") is not None and r["target_us"] < r["floor_us_per_call"]
            misses.append("target, below the floor" if below else "target")
        if met_ratio is False:
            misses.append(f"{r.get('max_ratio', 2):.0f}x baseline")
        verdict = "met" if not misses else "MISSED (" + ", ".join(misses) + ")"
        cell = "-" if x is None else f"{x:.2f}x" + (" (with launch)" if basis == "with launch" else "")
        lines.append(f"| {r.get('row')} | {_num(r, 'us_per_call')} | {_num(r, 'target_us', '{:.0f}')} | "
                     f"{r.get('baseline', '-')} | {_num(r, 'baseline_us_per_call')} | {cell} | "
                     + (f"{_num(r, 'with_launch_us_per_call')} | " if with_launch else "")
                     + (f"{_num(r, 'with_launch_via_jit_us_per_call')} | " if via_jit else "")
                     + (f"{_num(r, 'floor_us_per_call')} | " if floor else "")
                     + (f"{r.get('clock') or '-'} | " if clock else "") + f"{verdict} |")
    return lines


# ------------------------------------------------------------------------------------------- plots
def _steady_or_idle(cases: dict, field: str) -> tuple[str, str]:
    """(the field to plot, its label): the back-to-back figure (field + "_steady", what a training loop sees and
    FlashAttention's plots show) when every measured row has it, else the from-idle one (older runs)."""
    rows = [r for c in cases.values() for r in c.values() if r and r["status"] == "ok"]
    if rows and all(r.get(f"{field}_steady") is not None for r in rows):
        return f"{field}_steady", "back to back"
    return field, "from idle"


def _bars(ax, cases: dict, field: str, providers: list[str], xlabels: list, title: str, ylabel: str):
    import numpy as np
    field, how = _steady_or_idle(cases, field)
    ylabel = f"{ylabel}, {how}"
    width = 0.8 / max(1, len(providers))
    x = np.arange(len(xlabels))
    for i, p in enumerate(providers):
        vals = []
        for lab in xlabels:
            r = cases.get(lab, {}).get(p)
            vals.append(r[field] if r and r["status"] == "ok" and r.get(field) is not None else 0.0)
        bars = ax.bar(x + (i - (len(providers) - 1) / 2) * width, vals, width, label=p)
        for b, v, lab in zip(bars, vals, xlabels):
            r = cases.get(lab, {}).get(p)
            text = f"{v:.0f}" if v else ("OOM" if r and r["status"] == "OOM" else "")
            if text:
                ax.annotate(text, (b.get_x() + b.get_width() / 2, b.get_height()), ha="center", va="bottom",
                            fontsize=6, rotation=90)
    ax.set_xticks(x, [str(v) for v in xlabels])
    ax.set_title(title, fontsize=9)
    ax.set_ylabel(ylabel, fontsize=8)


def plot_attention(groups: dict, path: Path, gqa: bool, gpu: str) -> bool:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    panels: dict = defaultdict(dict)
    for k, c in groups.items():
        if k[0] == "attention" and (k[4] != k[5]) == gqa:
            panels[(k[1], k[2], k[3], k[4], k[5], k[6])][k[7]] = c
    if not panels:
        return False
    passes = [p for p in PASSES if any(k[0] == p for k in panels)]
    cols = sorted({k[1:] for k in panels})
    fig, axes = plt.subplots(len(passes), len(cols), figsize=(4.2 * len(cols), 3.2 * len(passes)), squeeze=False)
    for i, pass_ in enumerate(passes):
        for j, col in enumerate(cols):
            ax = axes[i][j]
            cases = panels.get((pass_, *col))
            if not cases:
                ax.axis("off")
                continue
            providers = [p for p in ATTN_ORDER if any(p in c for c in cases.values())]
            d, causal, hq, hkv, dtype = col
            _bars(ax, cases, "tflops", providers, sorted(cases),
                  f"{pass_}, D={d}, {'causal' if causal else 'non-causal'}, Hq/Hkv={hq}/{hkv}, {dtype}",
                  "TFLOP/s")
            ax.set_xlabel("sequence length", fontsize=8)
    handles, labels = axes[0][0].get_legend_handles_labels()
    for row in axes:
        for ax in row:
            for h, lab in zip(*ax.get_legend_handles_labels()):
                if lab not in labels:
                    handles.append(h)
                    labels.append(lab)
    top = 1 - 0.6 / fig.get_figheight()  # room for the title and the legend, in figure fractions
    fig.suptitle(f"Attention speed on {gpu} ({'GQA, ' if gqa else ''}B*N = 16k tokens)", y=0.995)
    fig.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, 1 - 0.25 / fig.get_figheight()),
               ncol=min(len(labels), 9), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, top))
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return True


def plot_memory_bound(groups: dict, path: Path, gpu: str) -> bool:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    panels: dict = defaultdict(dict)
    for k, c in groups.items():
        if k[0] in ("rope", "swiglu"):
            panels[(k[0], k[1], k[2])][k[4]] = c
    if not panels:
        return False
    keys = sorted(panels)
    fig, axes = plt.subplots(1, len(keys), figsize=(4.2 * len(keys), 3.4), squeeze=False)
    for ax, key in zip(axes[0], keys):
        cases = panels[key]
        providers = [p for p in ("flashtx", "liger", "compiled", "eager", "copy")
                     if any(p in c for c in cases.values())]
        _bars(ax, cases, "gbs", providers, sorted(cases), f"{key[0]} {key[1]}, {key[2]}", "GB/s")
        ax.set_xlabel("tokens", fontsize=8)
        ax.legend(fontsize=6)
    fig.suptitle(f"RoPE and SwiGLU bandwidth on {gpu}")
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return True


def build_report(data: dict, source: str, out: Path | None) -> str:
    recs = records(data)
    groups = grouped(recs)
    mi = (data.get("machine_info") or {}).get("flashtx_bench", {})
    gpu = mi.get("gpu", "unknown GPU")
    smoke = bool(mi.get("smoke"))
    md = ["# flashtx benchmark report", ""]
    if smoke:
        md += [SMOKE_BANNER, ""]
    md += incomplete_banner(data)
    md += header(data, source) + [""]
    if not recs:
        md += ["No flashtx benchmark results in this file (every benchmark skipped, or another suite's JSON).", ""]
    timing = "host clock" if smoke else "CUDA events, L2 flushed before each round"
    md += [f"Ratios are the provider's median time over flashtx's ({timing}): "
           "> 1 means flashtx is faster. OOM: the provider ran out of memory. -: not run (skipped).",
           "flashtx ms is the latency of one call from an idle GPU (synchronized, L2 flushed: launch and host "
           "time included); steady ms is the time per call back to back (the kernel time a training loop sees), "
           "marked * where the host could not keep ahead of the GPU (launch-bound), with the GPU's own time per call "
           "beside it (kernel: the device time of the call's kernels, torch.profiler), what the call costs once the "
           "host keeps ahead.", ""]
    for title, lines in (("Attention", attention_table(groups, gqa=False)),
                         ("Attention, GQA", attention_table(groups, gqa=True)),
                         ("Attention variants (window and varlen skip tiles; masks, bias, softcap, ALiBi, dropout)",
                          variants_table(groups)),
                         ("Window attention with a learned relative-position bias (Swin)", bias_table(groups)),
                         ("Peak extra memory, attention fwd+bwd (MB)", memory_table(groups)),
                         ("RoPE and SwiGLU (memory-bound: GB/s of the fewest bytes)", memory_bound_table(groups)),
                         ("Decoding, Sq = 1 over a KV cache (GB/s of K/V read)", decode_table(groups)),
                         ("Model training step (tokens/s)", models_table(groups)),
                         ("Host overhead (Python us per call to the kernel launch, launches stubbed; "
                          "the ratio is flashtx / baseline)",
                          overhead_table(groups)),
                         ("Device time by kernel (torch.profiler, per call, back to back)", breakdown_table(groups))):
        if lines:
            md += [f"## {title}", ""] + lines + [""]
    md += ["## Targets, measured in this run", ""]
    md += ["- not evaluated: this is a smoke run"] if smoke else targets(groups)
    md += [""]
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            md += ["Plots: matplotlib is not importable here (pip install matplotlib), so no PNG was written.", ""]
        else:
            written = [name for name, ok in (
                ("attention.png", plot_attention(groups, out / "attention.png", False, gpu)),
                ("attention_gqa.png", plot_attention(groups, out / "attention_gqa.png", True, gpu)),
                ("rope_swiglu.png", plot_memory_bound(groups, out / "rope_swiglu.png", gpu))) if ok]
            md += [f"Plots: {', '.join(f'![{w}]({w})' for w in written) if written else 'no data to plot'}", ""]
        (out / "report.md").write_text("\n".join(md))
    return "\n".join(md)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.report", description=__doc__.splitlines()[0])
    ap.add_argument("json", help="pytest-benchmark JSON (pytest bench --benchmark-only --benchmark-json FILE)")
    ap.add_argument("--out", type=Path, default=None, help="folder for report.md and the PNG plots")
    args = ap.parse_args(argv)
    try:
        data = load(args.json)
    except (OSError, json.JSONDecodeError) as exc:
        print(f"cannot read {args.json}: {exc}", file=sys.stderr)
        return 2
    print(build_report(data, args.json, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
