"""bench/report.py's table of where a call's device time went, kernel by kernel (harness.measure_kernel's
kernel_breakdown_us, for the cases a benchmark profiles with run_case(breakdown=True)): which kernel of a
multi-kernel call took the time, e.g. the backward's preprocess, dK/dV and dQ and its reductions, or a decoding
step's index check, append, attention and combine."""
from __future__ import annotations


def _case(r: dict) -> str:
    what = " ".join(str(x) for x in (r.get("op"), r.get("variant"), r.get("pass")) if x)
    return f"{what}, {r['shape']}" if r.get("shape") else what


def breakdown_table(groups: dict) -> list[str]:
    """One row per profiled record: its kernel time per call, its back-to-back time, and each kernel's share."""
    rows = []
    for cases in groups.values():
        for provider, r in cases.items():
            parts = r.get("kernel_breakdown_us")
            if r.get("status") != "ok" or not parts or not r.get("kernel_ms"):
                continue
            total = sum(parts.values()) or 1.0
            kernels = ", ".join(f"`{name.replace('|', '/')}` {us:.1f} ({100.0 * us / total:.0f}%)"
                                for name, us in parts.items())
            steady = f"{r['steady_ms']:.3f}" if r.get("steady_ms") is not None else "-"
            rows.append(f"| {_case(r)} | {provider} | {r['kernel_ms']:.3f} | {steady} | {kernels} |")
    if not rows:
        return []
    return ["| case | provider | kernel ms | steady ms | kernels (us per call, share of the kernel time) |",
            "|---|---|---|---|---|", *rows]
