"""Where one call's latency from idle goes: host work before and between its kernel launches.

    python -m bench.host_profile [--json FILE]

The 2026-11-30 H200 runs measured flashtx's attention latency from idle (one call after a flush and a
synchronize) 0.12 ms (forward) and 0.55 ms (backward) above its back-to-back time at B = 8, H = 16, N = 2k,
D = 128, causal, bf16, where SDPA's FlashAttention-2 lost 0.04 and 0.17 ms: that difference is host time
the GPU waits for. This profiles one such call per (provider, pass) with torch.profiler and prints, from
the moment the call starts: when each kernel launch was issued on the host, when each kernel ran on the
GPU, and the call's end, so the gaps (Python before the first launch, between launches, the autograd
engine's hand-off) can be read off. Providers: flashtx and SDPA's FLASH backend (what the ratio compares).

Without a GPU it runs flashtx in Triton's interpreter on tiny shapes (BENCH_SMOKE=1, CPU events only),
so the script cannot rot; those numbers mean nothing.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

SMOKE = not torch.cuda.is_available()
if SMOKE:
    os.environ.setdefault("FLASHTX_INTERPRET", "1")
    os.environ.setdefault("BENCH_SMOKE", "1")

from torch.profiler import ProfilerActivity, profile  # noqa: E402

from . import harness  # noqa: E402
from .providers import AttnCase, attention_case  # noqa: E402

PROVIDERS = ("flashtx", "sdpa-flash")
PASSES = ("fwd", "bwd")
LAUNCH_NAMES = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC")


def case() -> AttnCase:
    if SMOKE:
        return AttnCase(1, 2, 2, 64, 32, True, torch.float32)
    return AttnCase(8, 16, 16, 2048, 128, True, torch.bfloat16)


def profile_call(provider: str, pass_: str, warmup: int = 5) -> dict:
    """One call from idle, profiled: {"total_us", "launches_us": [...], "kernels": [[name, start_us, end_us]]}
    with every time relative to the call's first host event."""
    prepare, step = attention_case(provider, case(), pass_)
    state = prepare()
    for _ in range(warmup):
        step(state)
    harness.flush_l2()
    harness.synchronize()
    activities = [ProfilerActivity.CPU] + ([] if SMOKE else [ProfilerActivity.CUDA])
    with profile(activities=activities) as prof:
        with torch.profiler.record_function("flashtx_bench_call"):
            step(state)
        harness.synchronize()
    events = prof.events()
    call = next(e for e in events if e.name == "flashtx_bench_call")
    t0 = call.time_range.start
    launches = sorted(e.time_range.start - t0 for e in events if e.name in LAUNCH_NAMES)
    kernels = sorted(([e.name[:60], e.time_range.start - t0, e.time_range.end - t0] for e in events
                      if e.device_type == torch.autograd.DeviceType.CUDA), key=lambda k: k[1])
    end = max([call.time_range.end - t0] + [k[2] for k in kernels])
    return {"provider": provider, "pass": pass_, "host_call_us": call.time_range.end - t0, "total_us": end,
            "launches_us": launches, "kernels": kernels}


def table(rows: list[dict]) -> str:
    lines = [f"One call from idle ({'SMOKE: CPU, interpreter, meaningless' if SMOKE else torch.cuda.get_device_name()}"
             f"; {case()}); times in us from the call's start.", "",
             "| provider | pass | host call returns | launches issued at | kernels run (start-end) | done |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        launches = ", ".join(f"{t:.0f}" for t in r["launches_us"]) or "-"
        kernels = ", ".join(f"{s:.0f}-{e:.0f}" for _, s, e in r["kernels"]) or "-"
        lines.append(f"| {r['provider']} | {r['pass']} | {r['host_call_us']:.0f} | {launches} | {kernels} | "
                     f"{r['total_us']:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.host_profile", description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None, help="also write the rows here")
    args = ap.parse_args(argv)
    rows = []
    # thrown away: the profiler's first use (CUPTI's set-up) would land in the first row's times
    with profile(activities=[ProfilerActivity.CPU] + ([] if SMOKE else [ProfilerActivity.CUDA])):
        torch.ones(8, device="cpu" if SMOKE else "cuda").add_(1)
        harness.synchronize()
    for provider in PROVIDERS:
        for pass_ in PASSES:
            try:
                rows.append(profile_call(provider, pass_))
            except Exception as exc:  # noqa: BLE001 - a provider this machine lacks (SDPA-FLASH on a CPU)
                print(f"{provider} {pass_}: not profiled ({type(exc).__name__}: {' '.join(str(exc).split())[:160]})")
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
