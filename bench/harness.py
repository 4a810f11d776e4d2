"""How every benchmark is timed and recorded (one place, so every provider is measured alike).

Method (see /work/.library/device/METHOD.md, and bench/README.md):
  1. `prepare()` builds the state once (e.g. the forward graph a backward-only case needs), outside
     any timing.
  2. Warm-up: the step runs `WARMUP` times untimed (compilation, autotuning, cuBLAS handles). The
     second warm-up call also measures peak memory: torch.cuda.max_memory_allocated() during the
     call minus memory_allocated() just before it (the call's outputs and workspace included).
  3. Rounds run through `benchmark.pedantic`: its untimed `setup` flushes the L2 (writes a 256 MB
     buffer, as triton.testing.do_bench does; H100/H200 L2 is 50/60 MB) and synchronizes; the
     timed target records a CUDA event, runs the step, records an event and synchronizes. The
     events' elapsed times give `median_ms`, the number every TFLOP/s, GB/s and ratio uses.
     pytest-benchmark's own stats (host clock around the same target) also include launch
     overhead and one synchronize (~10-30 us); they are kept but not used by the report.
  4. Rounds: enough to fill BENCH_BUDGET_S seconds (default 0.2), at least 10 and at most 200.
  5. Steady state (`measure_steady`): the same step back to back, without flush or synchronize,
     in one pair of events (or a CUDA-graph replay with BENCH_STEADY=graph): `steady_ms`, the
     kernel time a training loop sees, beside `median_ms` (= `latency_ms`), the latency from idle.
     Every provider gets it, sized by time (`steady_plan`): about BENCH_BUDGET_S seconds in all from
     the per-call estimate `median_ms`, 3-20 calls a round, 3-5 rounds.
  6. Kernel time (`measure_kernel`), only for the memory-bound cases (bytes given: RoPE, SwiGLU, decoding) whose
     back-to-back time was launch-bound (`steady_host_bound`: the host, not the GPU, set the pace, e.g.
     autograd.grad's ~100 us a call on the H100 host of 2026-12-06 over a 34 us RoPE kernel): the device time of
     every kernel, copy and memset one call launches, summed from torch.profiler's CUPTI records over as many
     back-to-back calls: `kernel_ms` (and gbs_kernel), what the call costs the GPU once the host keeps ahead.
     Deferred until every case has been timed (`measure_deferred_kernels`, from bench/conftest.py after the
     test loop, within BENCH_KERNEL_BUDGET_S, default 20 s): the case is prepared afresh, and no timing runs
     after a profiler session (one that left CUPTI attached would slow every later launch). Cases a benchmark
     asks it of (`run_case(breakdown=True)`: flashtx's backward, learned bias, decoding) are profiled too, after
     those: each profile also splits the device time by kernel (`kernel_breakdown_us`), so a run says which
     kernel of a multi-kernel call took the time.
An out-of-memory during prepare or warm-up is recorded (extra_info status "OOM") instead of failing.

Smoke run (BENCH_SMOKE=1, for machines without a GPU): every benchmark runs on CPU tensors at tiny
shapes (each test file shrinks its own, see `smoke_dims`), flashtx through Triton's interpreter, in
fp16 unless BENCH_DTYPE says otherwise, with 2 warm-up calls and 2-3 host-clocked rounds and no peak
memory. It checks the pipeline a GPU run depends on (builders, passes, skips, extra_info, the JSON,
bench.report and its plots); its times mean nothing, and the JSON and the report say so.
"""
from __future__ import annotations

import gc
import math
import os
import statistics
import time
import warnings
from typing import Any, Callable

import pytest
import torch

from flashtx.sdpa_patch import FALLBACK_WARNING  # (how patch_sdpa's warning of a call it hands to torch opens)

from . import gpus

SMOKE = os.environ.get("BENCH_SMOKE", "") == "1"
SMOKE_NAME = "CPU smoke run (BENCH_SMOKE=1): tiny shapes, Triton interpreter; the times mean nothing"
DEVICE = "cpu" if SMOKE else "cuda"
# bf16 is the default on a GPU; Triton's interpreter cannot do bf16 arithmetic, so a smoke run uses fp16
DTYPE = {"bf16": torch.bfloat16, "fp16": torch.float16}[os.environ.get("BENCH_DTYPE", "fp16" if SMOKE else "bf16")]

WARMUP = 2 if SMOKE else 3  # the second warm-up call measures peak memory
MIN_ROUNDS, MAX_ROUNDS = (2, 3) if SMOKE else (10, 200)
BUDGET_S = float(os.environ.get("BENCH_BUDGET_S", "0.2"))
_FLUSH_BYTES = 256 * 1024 * 1024
_flush_buf: torch.Tensor | None = None

OOM_ERRORS = (torch.OutOfMemoryError,)


class Unavailable(Exception):
    """A provider cannot run this case (not installed, backend refuses the inputs): skip, with the reason."""


def smoke_dims(**dims: int) -> dict:
    """The benchmark's dimensions, or in a smoke run each divided by the divisor given with it:
    smoke_dims(seqlen=(4096, 32), heads=(16, 8)) -> {"seqlen": 4096, "heads": 16}, or {128, 2}."""
    return {k: (max(1, n // div) if SMOKE else n) for k, (n, div) in dims.items()}


def synchronize() -> None:
    if not SMOKE:
        torch.cuda.synchronize()


def flush_l2() -> None:
    global _flush_buf
    if SMOKE:  # the CPU's caches are not what a smoke run measures
        return
    if _flush_buf is None:
        _flush_buf = torch.empty(_FLUSH_BYTES, dtype=torch.int8, device="cuda")
    _flush_buf.zero_()


def free_memory() -> None:
    gc.collect()
    if not SMOKE:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def gpu_name() -> str:
    if SMOKE:
        return SMOKE_NAME
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "none"


def peak_memory_of(step: Callable[[Any], Any], state: Any) -> float | None:
    """Peak extra device memory of one call, in MB (outputs included); None in a smoke run."""
    if SMOKE:
        step(state)
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = step(state)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return peak / 2**20


class _HostEvent:
    """torch.cuda.Event's record/synchronize/elapsed_time on the host clock (smoke runs)."""

    def record(self):
        self.t = time.perf_counter()

    def synchronize(self):
        pass

    def elapsed_time(self, end) -> float:
        return (end.t - self.t) * 1e3


def measure(step: Callable[[Any], Any], state: Any, benchmark=None) -> list[float]:
    """Per-round CUDA-event times in ms (L2 flushed before each round); through benchmark.pedantic
    when a pytest-benchmark fixture is given."""
    times: list[float] = []
    if SMOKE:
        start, end = _HostEvent(), _HostEvent()
    else:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def setup():
        flush_l2()
        synchronize()
        return (state,), {}

    def target(s):
        start.record()
        step(s)  # outputs are dropped after the events; freeing them costs no device time
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))

    # Estimate the time of one call (already warm) to size the rounds.
    setup()
    target(state)
    est_s = max(times.pop() / 1e3, 1e-6)
    rounds = int(min(MAX_ROUNDS, max(MIN_ROUNDS, math.ceil(BUDGET_S / est_s))))
    if benchmark is None:
        for _ in range(rounds):
            setup()
            target(state)
    else:
        benchmark.pedantic(target, setup=setup, rounds=rounds, iterations=1, warmup_rounds=0)
    return times


# BENCH_PREWARM=1 (bench/device_check.sh, in parallel workers before the timed run): prepare and warm
# up each case (compiles Triton kernels and torch.compile graphs into the on-disk caches), time nothing.
PREWARM = os.environ.get("BENCH_PREWARM", "") == "1"
# Back-to-back rounds, sized by time (steady_plan): at most STEADY_CALLS calls a round and STEADY_ROUNDS rounds (fast
# cases), at least STEADY_MIN_CALLS and STEADY_MIN_ROUNDS (slow ones: eager and SDPA-MATH at 8k took 5 s a case at
# 5 x 20 calls, 93 s of the 2026-11-30 bench step).
STEADY_CALLS = 2 if SMOKE else 20
STEADY_ROUNDS = 1 if SMOKE else 5
STEADY_MIN_CALLS = 2 if SMOKE else 3
STEADY_MIN_ROUNDS = 1 if SMOKE else 3
STEADY_MODE = os.environ.get("BENCH_STEADY", "events")  # "events" or "graph" (CUDA-graph replay, falls back)


def steady_plan(est_ms: float | None) -> tuple[int, int]:
    """(rounds, calls per round) of the back-to-back phase, so that it takes about BENCH_BUDGET_S in all
    (the same budget as the timed rounds) given `est_ms`, one call's time (the latency from idle, an
    overestimate of the steady time): calls = clamp(floor(budget / (STEADY_ROUNDS * est)), 3, 20), then
    rounds = clamp(floor(budget / (calls * est)), 3, 5). A case up to about 1.2 ms (at 0.12 s) keeps 5 x 20
    calls; a slow one gets 3 x 3 (about 9 x est: 0.45 s for a 50 ms eager fwd+bwd, not 5 s). No estimate
    (None, 0, nan): the most."""
    if SMOKE:
        return STEADY_ROUNDS, STEADY_CALLS
    if est_ms is None or not math.isfinite(est_ms) or est_ms <= 0:
        return STEADY_ROUNDS, STEADY_CALLS
    per_call_s = max(est_ms / 1e3, 1e-9)
    calls = min(STEADY_CALLS, max(STEADY_MIN_CALLS, int(BUDGET_S / (STEADY_ROUNDS * per_call_s) + 1e-6)))
    rounds = min(STEADY_ROUNDS, max(STEADY_MIN_ROUNDS, int(BUDGET_S / (calls * per_call_s) + 1e-6)))
    return rounds, calls


def measure_steady(step: Callable[[Any], Any], state: Any, est_ms: float | None = None) -> dict:
    """Steady-state time per call: `calls` calls back to back (no L2 flush, no synchronize in
    between) inside one pair of CUDA events, median over `rounds` rounds, both from steady_plan(est_ms)
    (at most STEADY_ROUNDS x STEADY_CALLS, at least 3 x 3, about BENCH_BUDGET_S in all). This is the kernel
    time a training loop sees while the host keeps ahead of the device; `steady_host_bound` says
    when it did not (the host took at least 90% of the device time to issue the calls, so the number
    is launch-bound). BENCH_STEADY=graph replays a CUDA graph of the calls instead (no host work
    between kernels); if capture fails it falls back to events and says why in `steady_method`."""
    method = ("host clock back to back, smoke run (not a measurement)" if SMOKE
              else "CUDA events around back-to-back calls")
    out: dict = {}
    rounds, calls = steady_plan(est_ms)
    if not SMOKE and STEADY_MODE == "graph":
        try:
            return _steady_graph(step, state, rounds, calls)
        except Exception as exc:  # noqa: BLE001 - capture refused (sync in the op, compiled code, ...)
            torch.cuda.synchronize()
            method += f" (graph capture failed: {type(exc).__name__}: {' '.join(str(exc).split())[:120]})"
    per_call, host_frac = [], []
    for _ in range(rounds):
        synchronize()
        if SMOKE:
            start, end = _HostEvent(), _HostEvent()
        else:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        h0 = time.perf_counter()
        start.record()
        for _ in range(calls):
            step(state)
        end.record()
        host_ms = (time.perf_counter() - h0) * 1e3
        end.synchronize()
        dev_ms = start.elapsed_time(end)
        per_call.append(dev_ms / calls)
        host_frac.append(host_ms / dev_ms if dev_ms > 0 else float("inf"))
    out.update(steady_ms=statistics.median(per_call), steady_method=method,
               steady_host_bound=bool(statistics.median(host_frac) >= 0.9), steady_calls=calls,
               steady_rounds=rounds)
    return out


KERNEL_METHOD = "torch.profiler (CUPTI): device time of the step's kernels, copies and memsets, summed per call"
BREAKDOWN_TOP = 8  # kernels named in kernel_breakdown_us (the rest summed under "other")


def measure_kernel(step: Callable[[Any], Any], state: Any, calls: int, top: int | None = None) -> dict:
    """Device time per call of what `step` launches (kernels, memcpy, memset), from torch.profiler's CUDA
    activity over `calls` back-to-back calls after one untimed call: {kernel_ms, kernel_method, kernel_calls,
    kernel_breakdown_us: {kernel name: us per call}, the `top` (default BREAKDOWN_TOP) longest, largest first, and
    "other"}, or {kernel_error} when the profiler gives no CUDA activity or fails (then nothing is claimed)."""
    from torch.profiler import ProfilerActivity, profile
    try:
        step(state)
        synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                step(state)
            synchronize()
        device = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        by_name: dict = {}
        for e in device:
            name = " ".join(str(getattr(e, "name", "?")).split())[:80]  # (C++ kernels' names run to pages)
            by_name[name] = by_name.get(name, 0.0) + e.time_range.elapsed_us()
        total_us = sum(by_name.values())
    except Exception as exc:  # noqa: BLE001 - CUPTI unavailable, another profiler active, ...
        return {"kernel_error": f"{type(exc).__name__}: {' '.join(str(exc).split())[:160]}"}
    if not device or total_us <= 0:
        return {"kernel_error": "the profiler recorded no CUDA activity"}
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1])
    top = BREAKDOWN_TOP if top is None else top
    breakdown = {name: us / calls for name, us in ranked[:top]}
    if len(ranked) > top:
        breakdown["other"] = sum(us for _, us in ranked[top:]) / calls
    return {"kernel_ms": total_us / 1e3 / calls, "kernel_method": KERNEL_METHOD, "kernel_calls": calls,
            "kernel_breakdown_us": breakdown}


def _steady_graph(step, state, rounds: int, calls: int) -> dict:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            step(state)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            step(state)
    g.replay()
    torch.cuda.synchronize()
    per_call = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        per_call.append(start.elapsed_time(end) / calls)
    del g
    return {"steady_ms": statistics.median(per_call), "steady_method": "CUDA graph replay of back-to-back calls",
            "steady_host_bound": False, "steady_calls": calls, "steady_rounds": rounds}


def summarize(times: list[float]) -> dict:
    q = statistics.quantiles(times, n=4) if len(times) >= 2 else [times[0]] * 3
    how = "host clock, smoke run (not a measurement)" if SMOKE else "CUDA events, L2 flushed before each round"
    return {"median_ms": statistics.median(times), "min_ms": min(times), "iqr_ms": q[2] - q[0],
            "rounds": len(times), "timing": how, "latency_ms": statistics.median(times)}


def throughput(median_ms: float, *, flops: float | None = None, nbytes: float | None = None,
               dtype: torch.dtype | None = None) -> dict:
    """TFLOP/s and/or GB/s, and their percentage of the datasheet peak when the GPU is known."""
    out: dict = {}
    peak = gpus.lookup(gpu_name())
    s = median_ms / 1e3
    if flops is not None:
        out["tflops"] = flops / s / 1e12
        if peak and dtype in (torch.float16, torch.bfloat16):
            out["pct_peak_tflops"] = 100.0 * out["tflops"] / peak.tflops_16
    if nbytes is not None:
        out["gbs"] = nbytes / s / 1e9
        if peak:
            out["pct_peak_gbs"] = 100.0 * out["gbs"] / peak.gbs
    return out


def copy_case(nbytes: float, dtype: torch.dtype):
    """(prepare, step) of a device-to-device copy moving `nbytes` in all (read + write): the bandwidth
    reference the memory-bound benchmarks (RoPE, SwiGLU, decoding) are compared with in the same run."""
    n = int(nbytes // (2 * torch.empty((), dtype=dtype).element_size()))

    def prepare():
        return torch.randn(n, device=DEVICE, dtype=dtype), torch.empty(n, device=DEVICE, dtype=dtype)

    def step(s):
        s[1].copy_(s[0])
    return prepare, step


def build_or_skip(provider: str, build: Callable[[], Any], *, fail_fast: bool = False):
    """build() (the provider's setup: imports, masks, compiled functions), or skip with the reason (fail_fast:
    raise instead: flashtx must not refuse or fail a case it is benchmarked on)."""
    try:
        return build()
    except Unavailable as exc:
        synchronize()  # a probe's sticky CUDA error (an illegal address) raises here: an error, not a quiet skip
        if fail_fast:  # flashtx refusing a case it is benchmarked on is a failure, not a "-" in the tables
            raise
        pytest.skip(f"{provider}: {exc}")
    except (RuntimeError, NotImplementedError, ValueError, TypeError, AttributeError) as exc:
        if fail_fast:
            raise
        synchronize()
        pytest.skip(f"{provider} cannot be set up: {type(exc).__name__}: {' '.join(str(exc).split())[:400]}")


KERNEL_BUDGET_S = float(os.environ.get("BENCH_KERNEL_BUDGET_S", "20"))
# (extra_info, prepare, step, calls, nbytes, dtype, grad mode, judged by a target, kernels named):
# measure_deferred_kernels
_KERNEL_QUEUE: list = []


def record_steady(extra: dict, step, state, st: dict, *, flops=None, nbytes=None, dtype=None, prepare=None,
                  breakdown: bool = False, breakdown_top: int | None = None) -> None:
    """Into `extra`: the back-to-back measurement `st` and its throughput (*_steady); a memory-bound case (nbytes)
    whose back to back was launch-bound is queued for its kernel time (measure_deferred_kernels), and so is a case
    that asks for its time by kernel (breakdown, naming its `breakdown_top` longest kernels), after those."""
    extra.update(st)
    extra.update({f"{k}_steady": v for k, v in throughput(st["steady_ms"], flops=flops, nbytes=nbytes,
                                                            dtype=dtype).items()})
    judged = bool(st.get("steady_host_bound")) and nbytes is not None  # (the copy-share targets read its kernel_ms)
    if (judged or breakdown) and not SMOKE and prepare is not None:
        _KERNEL_QUEUE.append((extra, prepare, step, st["steady_calls"], nbytes, dtype, torch.is_grad_enabled(),
                              judged, breakdown_top))


def measure_deferred_kernels(budget_s: float | None = None, clock=time.monotonic) -> int:
    """The kernel time (measure_kernel) of every queued case, each prepared afresh, into its extra_info (kernel_ms,
    gbs_kernel), until `budget_s` (BENCH_KERNEL_BUDGET_S) has passed: a case not reached gets kernel_error. Run once
    every case has been timed (bench/conftest.py). Returns how many were timed."""
    budget_s = KERNEL_BUDGET_S if budget_s is None else budget_s
    t0, timed = clock(), 0
    queue, _KERNEL_QUEUE[:] = list(_KERNEL_QUEUE), []
    queue.sort(key=lambda q: (not q[7], q[0].get("provider") != "flashtx"))  # what targets judge first, flashtx's
    for extra, prepare, step, calls, nbytes, dtype, grad, _, top in queue:
        if clock() - t0 > budget_s:
            extra["kernel_error"] = f"not timed: BENCH_KERNEL_BUDGET_S ({budget_s:g} s) spent"
            continue
        state = None
        try:
            with torch.set_grad_enabled(grad):  # as the case ran (a decode test runs it under no_grad)
                state = prepare()
                kt = measure_kernel(step, state, calls, top)  # (one untimed call first: the case ran, so it is warm)
        except (Exception, pytest.skip.Exception, pytest.fail.Exception) as exc:  # noqa: BLE001 - an OOM, a provider
            # that refuses or fails now (build_or_skip skips): no number, the reason
            kt = {"kernel_error": f"{type(exc).__name__}: {' '.join(str(exc).split())[:160]}"}
        del state
        free_memory()
        extra.update(kt)
        if "kernel_ms" in kt:
            timed += 1
            extra.update({f"{k}_kernel": v for k, v in throughput(kt["kernel_ms"], nbytes=nbytes,
                                                                    dtype=dtype).items()})
    return timed


def run_case(benchmark, *, prepare: Callable[[], Any], step: Callable[[Any], Any], info: dict,
             flops: float | None = None, nbytes: float | None = None, dtype: torch.dtype | None = None,
             fail_fast: bool = False, steady: bool = True, breakdown: bool = False,
             breakdown_top: int | None = None) -> dict:
    """Prepare, warm up, measure memory, time; fill benchmark.extra_info. Skips (pytest.skip) with
    the reason when the provider refuses the case, unless fail_fast (flashtx itself must not fail or refuse).
    breakdown: also profile the case after the test loop for its device time by kernel (measure_deferred_kernels),
    naming its `breakdown_top` (default BREAKDOWN_TOP) longest kernels."""
    benchmark.extra_info.update(info)
    benchmark.extra_info["gpu"] = gpu_name()
    state = None
    caught: list = []
    try:
        with warnings.catch_warnings(record=True) as caught:  # SDPA says in warnings why a backend refuses
            warnings.simplefilter("always")
            if not PREWARM:  # the buffer (256 MB, once), here where an OOM is recorded; prewarm times nothing
                flush_l2()
            state = prepare()
            for i in range(WARMUP):
                if i == 1:
                    benchmark.extra_info["peak_mem_mb"] = peak_memory_of(step, state)
                else:
                    step(state)
            synchronize()
    except OOM_ERRORS as exc:
        del state
        free_memory()
        benchmark.extra_info.update(status="OOM", error=str(exc).splitlines()[0][:200])
        # Record the case so the JSON and the report show the OOM (one empty, meaningless round).
        benchmark.pedantic(lambda: None, rounds=1, iterations=1)
        return benchmark.extra_info
    except Unavailable as exc:
        synchronize()  # a sticky CUDA error raises here (free_memory's synchronize does on the path below)
        if fail_fast:
            raise
        pytest.skip(f"{info.get('provider')}: {exc}")
    except (RuntimeError, NotImplementedError, ValueError, TypeError) as exc:
        if fail_fast:
            raise
        del state
        free_memory()
        why = " ".join(str(exc).split())[:400]
        hints = "; ".join(dict.fromkeys(" ".join(str(w.message).split())[:200] for w in caught))[:600]
        pytest.skip(f"{info.get('provider')} cannot run this case: {type(exc).__name__}: {why}"
                    + (f" (warnings: {hints})" if hints else ""))
    for w in caught:  # a successful warm-up's warnings are not swallowed
        if fail_fast and str(w.message).startswith(FALLBACK_WARNING):
            raise RuntimeError(f"flashtx's row would time torch's SDPA: {w.message}")
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    if PREWARM:
        benchmark.extra_info.update(status="prewarm")
        del state
        free_memory()
        return benchmark.extra_info
    times = measure(step, state, benchmark)
    summary = summarize(times)
    benchmark.extra_info.update(summary, status="ok")
    benchmark.extra_info.update(throughput(summary["median_ms"], flops=flops, nbytes=nbytes, dtype=dtype))
    if steady:
        st = measure_steady(step, state, est_ms=summary["median_ms"])  # bounded by BENCH_BUDGET_S
        record_steady(benchmark.extra_info, step, state, st, flops=flops, nbytes=nbytes, dtype=dtype,
                      prepare=prepare, breakdown=breakdown, breakdown_top=breakdown_top)
    if flops is not None:
        benchmark.extra_info["flops"] = flops
    if nbytes is not None:
        benchmark.extra_info["bytes"] = nbytes
    del state
    free_memory()
    return benchmark.extra_info
