"""Host overhead: the Python time from a public flashtx call to its kernel launch (issue 12, item 3).

    python -m bench.overhead [--repeats 200] [--calls 50] [--json FILE]

For each row it times a tiny call (shapes small enough that the host, not the device, is what
costs), back to back, and prints microseconds per call beside the target and the same call of
the PyTorch op a user would otherwise make (SDPA for attention, the eager expression for RoPE and
SwiGLU):

- CPU (no GPU): every flashtx kernel launch is replaced by a no-op with
  `flashtx.triton_kernels.launch.stub_launches()`, and flashtx runs its Triton backend with
  Triton's interpreter switched on (FLASHTX_INTERPRET=1), so the dispatch, validation, planning
  and autograd path timed is the one a GPU takes, minus the launch itself. The baselines are the
  real PyTorch calls on CPU tensors of the same tiny shapes (their compute is a few microseconds).
- GPU: the same stubbed measurement ("python to launch"), and beside it the real call with its
  launches ("with launch": host time to enqueue, measured over many calls without synchronizing
  in between, so device time is not counted while the launch queue has room). Baselines are real
  calls timed the same way, so their time includes their CUDA launch: on a GPU the <= 2x verdict
  takes flashtx's "with launch" time (`ratio_basis` "with launch"), never the stubbed one.

Method: gc disabled; each row warms up (untimed calls) first; then `repeats` rounds, each timing
`calls` back-to-back calls with a CPU-time clock (Python work is what is measured, and a shared
machine's preemption is not) and dividing; flashtx's and the baseline's rounds alternate so drift on
a shared machine hits both alike; the median round is reported. The clock (each row's `clock`):
- CPU tensors: time.thread_time_ns, the calling thread's CPU time. Autograd runs a CPU backward on
  the calling thread, so the backward rows are all counted.
- CUDA tensors: time.process_time_ns, every thread of the process. Autograd runs the backward of
  CUDA tensors (flashtx's Python backward included) on its per-device worker thread, which the
  calling thread's clock never sees: thread time would drop the backward from the bwd rows.
Rows whose calls have a lane (attention, with or without masks, varlen, RoPE, SwiGLU, decoding) also time the
same call with flashtx's lanes off ("general path":
the flashtx::attn_fwd / rotary_qk / swiglu / kvcache_* ops' path), in the same rounds.
Targets (issue 12): attention forward <= 25 us and forward+backward <= 80 us of Python; RoPE and
SwiGLU <= 15 us per direction; each <= 2x the baseline's time at the same call, same machine and
run. A miss is printed as such; nothing here fails on a miss (timing tests must not fail from
noise in CI): bench/test_overhead.py records the numbers with pytest-benchmark, and
tests/test_bench_overhead.py only checks that every row is reported.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

if not torch.cuda.is_available():  # before flashtx imports triton: the Triton backend on CPU tensors
    os.environ.setdefault("FLASHTX_INTERPRET", "1")

import flashtx  # noqa: E402
from flashtx.triton_kernels.launch import stub_launches  # noqa: E402

# Issue 12's targets, microseconds of Python per call
TARGET_FWD_US, TARGET_FWD_BWD_US, TARGET_ELEMENTWISE_US, MAX_RATIO = 25.0, 80.0, 15.0, 2.0


@dataclass
class Row:
    name: str  # e.g. "attention fwd (no grad)"
    target_us: float | None
    baseline: str  # what the flashtx call is compared with
    build: Callable[[str, torch.dtype], tuple[Callable[[], object], Callable[[], object]]]
    # The same autograd structure through a no-op Python autograd.Function (same inputs and outputs, empty
    # gradients): what any Python-defined op pays here before doing anything, so a row's target can be read
    # against it. None for rows without autograd.
    floor: Callable[[str, torch.dtype], Callable[[], object]] | None = None
    # plain attention and RoPE calls: also timed with flashtx's lanes off (the ops' general path), same rounds
    lane: bool = False


@dataclass
class Result:
    name: str
    target_us: float | None
    baseline: str
    ours_us: float
    base_us: float
    launch_us: float | None = None  # GPU only: the real call with its launches
    ours_spread_us: float = 0.0  # interquartile range of the rounds
    base_spread_us: float = 0.0
    launches: int = 0
    extra: dict = field(default_factory=dict)
    floor_us: float | None = None  # Row.floor's time, same rounds
    general_us: float | None = None  # Row.lane: the same call with the lane off, same rounds
    clock: str = "thread CPU time"  # CLOCKS' name of the clock the rounds were timed with

    @property
    def ratio_basis(self) -> str:
        """What the <= 2x compares: on a GPU the baseline's time includes its CUDA launch, so flashtx's
        must too ("with launch"); without a GPU (launch_us None) the stubbed time."""
        return "with launch" if self.launch_us is not None else "launches stubbed"

    @property
    def ratio(self) -> float:
        """flashtx us / baseline us (<= MAX_RATIO is met): the inverse direction of bench.report's other ratios."""
        ours = self.launch_us if self.launch_us is not None else self.ours_us
        return ours / self.base_us if self.base_us > 0 else float("inf")

    @property
    def met_target(self) -> bool | None:
        return None if self.target_us is None else self.ours_us <= self.target_us

    @property
    def met_ratio(self) -> bool:
        return self.ratio <= MAX_RATIO

    @property
    def met(self) -> bool:
        return self.met_ratio and self.met_target is not False

    def as_dict(self) -> dict:
        return {"row": self.name, "us_per_call": self.ours_us, "target_us": self.target_us,
                "baseline": self.baseline, "baseline_us_per_call": self.base_us, "ratio": self.ratio,
                "max_ratio": MAX_RATIO, "with_launch_us_per_call": self.launch_us, "iqr_us": self.ours_spread_us,
                "baseline_iqr_us": self.base_spread_us, "launches_per_call": self.launches,
                "met_target": self.met_target, "met_ratio": self.met_ratio, "met": self.met,
                "floor_us_per_call": self.floor_us, "general_path_us_per_call": self.general_us,
                "ratio_basis": self.ratio_basis, "clock": self.clock, **self.extra}


from bench.overhead_calls import (  # noqa: E402
    _fwd, _attention_fwd, _sdpa_fwd, _attention_grad_fwd, _attention_bwd, _attention_fwd_bwd, _flash_attn_func,
    _patched_sdpa, _rope_fwd, _rope_bwd, _swiglu_fwd, _swiglu_bwd, _decode, _decode_device_check, _window_softcap,
    _key_mask, _varlen_device_check, _hf_decode, _learned_bias, _floor_fwd, _floor_bwd, _stub)

SDPA = "F.scaled_dot_product_attention, same call"
ROWS = [
    Row("attention fwd (no grad)", TARGET_FWD_US, SDPA, _fwd(_attention_fwd, _sdpa_fwd), lane=True),
    Row("attention fwd (with grad)", TARGET_FWD_US, SDPA, _attention_grad_fwd, _floor_fwd, lane=True),
    Row("attention bwd", None, SDPA, _attention_bwd, _floor_bwd(*[(1, 2, 16, 64)] * 3), lane=True),
    Row("attention fwd+bwd", TARGET_FWD_BWD_US, SDPA, _attention_fwd_bwd, _floor_bwd(*[(1, 2, 16, 64)] * 3,
                                                                                      fwd_too=True), lane=True),
    Row("flash_attn_func fwd (no grad)", TARGET_FWD_US, SDPA + " (B, H, S, D) views", _flash_attn_func, lane=True),
    Row("patched SDPA fwd (no grad)", TARGET_FWD_US, "F.scaled_dot_product_attention unpatched", _patched_sdpa,
        lane=True),
    Row("rope q+k fwd", TARGET_ELEMENTWISE_US, "eager rotate_half RoPE (transformers)", _rope_fwd, lane=True),
    Row("rope q+k bwd", TARGET_ELEMENTWISE_US, "eager rotate_half RoPE backward", _rope_bwd,
        _floor_bwd((1, 4, 16, 64), (1, 2, 16, 64), two_outputs=True), lane=True),
    Row("swiglu fwd", TARGET_ELEMENTWISE_US, "F.silu(gate) * up", _swiglu_fwd, lane=True),
    Row("swiglu bwd", TARGET_ELEMENTWISE_US, "F.silu(gate) * up backward", _swiglu_bwd,
        _floor_bwd((16, 256), (16, 256)), lane=True),
    Row("flash_attn_func window+softcap fwd+bwd", None, "SDPA causal fwd+bwd (neither option)", _window_softcap,
        lane=True),
    Row("attention key_mask fwd+bwd", None, "SDPA fwd+bwd, the padding and causal mask as a bool attn_mask",
        _key_mask, lane=True),
    Row("attention learned bias fwd+bwd (its gradient summed over the batch)", None,
        "SDPA fwd+bwd with the same learned attn_mask", _learned_bias, lane=True),
    Row("varlen fwd+bwd, the GPU's cu_seqlens check", None, "SDPA causal fwd+bwd over the packed rows",
        _varlen_device_check, lane=True),
    Row("decode step (append + attend)", None, "SDPA over the cached keys (enable_gqa)", _decode, lane=True),
    Row("attention decode step, transformers' padded form (no grad)", TARGET_FWD_US,
        SDPA + ", the padding as a bool attn_mask", _hf_decode, lane=True),
    Row("decode step, the GPU's index check", None, "SDPA over the cached keys (enable_gqa)", _decode_device_check,
        lane=True),
]
ROW_NAMES = [r.name for r in ROWS]


# ------------------------------------------------------------------------------------------ timing
def _sync(dev: str) -> None:
    if dev == "cuda":
        torch.cuda.synchronize()


# name -> clock. On CUDA tensors autograd runs backward nodes (flashtx's Python backward included) on its
# per-device worker thread, not the caller's: only the process's CPU time sees them. On CPU tensors the
# backward runs on the calling thread, whose CPU time leaves out other threads' noise.
CLOCKS = {"thread CPU time": time.thread_time_ns, "process CPU time (all threads)": time.process_time_ns}


def clock_for(dev: str) -> str:
    return "process CPU time (all threads)" if dev == "cuda" else "thread CPU time"


def _round_us(fn: Callable[[], object], calls: int, clock: Callable[[], int] = time.thread_time_ns) -> float:
    t0 = clock()
    for _ in range(calls):
        fn()
    return (clock() - t0) / calls / 1e3


def _median_iqr(xs: list[float]) -> tuple[float, float]:
    if len(xs) < 2:
        return xs[0], 0.0
    q = statistics.quantiles(xs, n=4)
    return statistics.median(xs), q[2] - q[0]


def time_pair(fns: list[Callable[[], object]], dev: str, repeats: int, calls: int, warmup: int) -> list[list[float]]:
    """Per-call microseconds of each fn, `repeats` rounds of `calls` calls, rounds interleaved, on dev's clock
    (clock_for)."""
    clock = CLOCKS[clock_for(dev)]
    for fn in fns:
        for _ in range(warmup):
            fn()
    _sync(dev)
    out: list[list[float]] = [[] for _ in fns]
    was = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        for _ in range(repeats):
            for i, fn in enumerate(fns):
                out[i].append(_round_us(fn, calls, clock))
                _sync(dev)  # outside the round's clock: device time is not host overhead
    finally:
        if was:
            gc.enable()
    return out


def device_and_dtype() -> tuple[str, torch.dtype]:
    if torch.cuda.is_available():
        return "cuda", torch.float16
    # CPU: float32, so the baselines run PyTorch's CPU fast paths (its fp16 CPU paths are slower and
    # would flatter the ratio); flashtx's validation and planning are the same for every dtype.
    return "cpu", torch.float32


def check_path(dev: str) -> None:
    """On CPU, flashtx must take its Triton backend (the interpreter on), or the row times the reference."""
    if dev == "cpu" and not flashtx._env.INTERPRET:
        raise RuntimeError("bench.overhead on CPU needs Triton's interpreter (FLASHTX_INTERPRET=1 set before "
                           "flashtx/triton is imported): otherwise flashtx takes its reference backend")


@contextlib.contextmanager
def _direct_launch(on: bool):
    from flashtx.triton_kernels import launch

    prev, launch.DIRECT_LAUNCH = launch.DIRECT_LAUNCH, on
    try:
        yield
    finally:
        launch.DIRECT_LAUNCH = prev


def measure_row(row: Row, *, repeats: int, calls: int, warmup: int, benchmark=None) -> Result:
    """Time one row. With a pytest-benchmark fixture, flashtx's stubbed call is also timed through
    benchmark.pedantic (its own rounds, so the JSON and pytest's table have an entry); the numbers
    reported are the interleaved rounds' medians either way."""
    dev, dtype = device_and_dtype()
    ours, base = row.build(dev, dtype)
    launches: list = []
    with getattr(ours, "context", contextlib.nullcontext)():
        with stub_launches(lambda kernel, grid, args: _stub(kernel, grid, args) or launches.append(kernel)):
            ours()  # count the launches of one call (the stub is what is timed below)
        n_launch = len(launches)
        if n_launch == 0:
            raise RuntimeError(f"{row.name}: flashtx launched no kernel: it did not take its Triton backend")
        floor = row.floor(dev, dtype) if row.floor is not None else None
        extra_fns = ([floor] if floor else []) + ([_without_lane(ours)] if row.lane else [])
        with stub_launches(_stub):
            ours_t, base_t, *extra_t = time_pair([ours, base] + extra_fns, dev, repeats, calls, warmup)
            floor_t = extra_t[:1] if floor else []
            general_t = extra_t[-1] if row.lane else None
            if benchmark is not None:
                was = gc.isenabled()
                gc.disable()
                try:
                    benchmark.pedantic(ours, rounds=max(5, repeats // 4), iterations=calls, warmup_rounds=1)
                finally:
                    if was:
                        gc.enable()
        launch_us = None
        if dev == "cuda":  # the real call, launches included
            (real_t,) = time_pair([ours], dev, max(3, repeats // 2), calls, warmup)
            launch_us = statistics.median(real_t)
            # and with every launch through Triton's JITFunction.run (launch.DIRECT_LAUNCH off): what the
            # direct launch of the compiled kernel saves
            with _direct_launch(False):
                (jit_t,) = time_pair([ours], dev, max(3, repeats // 2), calls, warmup)
            jit_launch_us = statistics.median(jit_t)
    base_us, base_iqr = _median_iqr(base_t)
    extra = {"min_us_per_call": min(ours_t), "baseline_min_us_per_call": min(base_t), "rounds": len(ours_t),
             "calls_per_round": calls}
    if launch_us is not None:
        extra["with_launch_via_jit_us_per_call"] = jit_launch_us
    ours_us, ours_iqr = _median_iqr(ours_t)
    return Result(row.name, row.target_us, row.baseline, ours_us, base_us, launch_us, ours_iqr, base_iqr, n_launch,
                  extra, statistics.median(floor_t[0]) if floor_t else None,
                  statistics.median(general_t) if general_t else None, clock_for(dev))


def _without_lane(fn: Callable[[], object]) -> Callable[[], object]:
    """fn with flashtx's lanes (_attention_lane, _rotary_lane, _swiglu_lane, _decode_lane, _small_q_lane) off for
    the call: the ops' general path (the switches cost ~0.4 us)."""
    from flashtx import _attention_lane, _decode_lane, _rotary_lane, _small_q_lane, _swiglu_lane

    def general():
        _attention_lane.LANE = _rotary_lane.LANE = _swiglu_lane.LANE = _decode_lane.LANE = _small_q_lane.LANE = False
        try:
            return fn()
        finally:
            _attention_lane.LANE = _rotary_lane.LANE = _swiglu_lane.LANE = _decode_lane.LANE = True
            _small_q_lane.LANE = True
    return general


def environment() -> dict:
    dev, dtype = device_and_dtype()
    try:
        import triton
        tv = triton.__version__
    except ImportError:
        tv = None
    import platform
    info = {"device": dev, "dtype": str(dtype).replace("torch.", ""), "torch": torch.__version__, "triton": tv,
            "flashtx": flashtx.__version__, "python": platform.python_version(), "machine": platform.machine(),
            "cpu": platform.processor() or platform.machine(), "gpu": None,
            "cpu_threads": 1 if dev == "cpu" else torch.get_num_threads(),
            "mode": ("launches stubbed (stub_launches), Triton backend with the interpreter on" if dev == "cpu" else
                     "launches stubbed for 'us/call'; real launches for 'with launch', the figure the <= 2x "
                     "baseline verdict takes (the baseline's time includes its launch)"),
            "clock": clock_for(dev)}
    if dev == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
    try:
        import subprocess
        info["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                        cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip() or None
    except OSError:
        info["commit"] = None
    return info


def run(rows: list[Row] | None = None, *, repeats: int = 200, calls: int = 50, warmup: int = 50) -> list[Result]:
    dev, _ = device_and_dtype()
    check_path(dev)
    threads = torch.get_num_threads()
    if dev == "cpu":  # host overhead, not parallel compute: one intra-op thread (no pool wake-ups on a busy machine)
        torch.set_num_threads(1)
    try:
        return [measure_row(r, repeats=repeats, calls=calls, warmup=warmup) for r in (rows or ROWS)]
    finally:
        torch.set_num_threads(threads)


def _fmt(x: float | None, spec: str = "{:.1f}") -> str:
    return "-" if x is None else spec.format(x)


def table(results: list[Result], env: dict | None = None) -> str:
    env = env or environment()
    gpu = env["device"] == "cuda"
    head = ["row", "flashtx us/call", "target us", "baseline us/call",
            "flashtx / baseline (<= 2x)" + (", with launch" if gpu else "")]
    head += ["with launch us/call", "launched via JITFunction.run us/call"] if gpu else []
    head += ["no-op autograd floor us/call", "general path us/call", "launches", "clock", "verdict"]
    lines = [f"Host overhead: {env['mode']}; {env['device']} {env.get('gpu') or env.get('cpu')}, {env['dtype']}, "
             f"torch {env['torch']}, triton {env['triton']}, flashtx {env['flashtx']} ({env.get('commit') or '?'}). "
             f"Median of the rounds, timed with {env.get('clock') or clock_for(env['device'])}; nothing fails on a "
             "miss. The ratio is flashtx / baseline (<= 2x is met), the inverse of bench.report's other ratios.", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        misses = []
        if r.met_target is False:
            below = r.floor_us is not None and r.target_us < r.floor_us
            misses.append(f"{r.ours_us / r.target_us:.1f}x the target" + (" (the target is below the floor)"
                                                                          if below else ""))
        if not r.met_ratio:
            misses.append(f"{r.ratio:.1f}x the baseline")
        verdict = "met" if not misses else "MISSED: " + ", ".join(misses)
        cells = [r.name, _fmt(r.ours_us), _fmt(r.target_us, "{:.0f}"), _fmt(r.base_us), f"{r.ratio:.2f}x"]
        cells += [_fmt(r.launch_us), _fmt(r.extra.get("with_launch_via_jit_us_per_call"))] if gpu else []
        cells += [_fmt(r.floor_us), _fmt(r.general_us), str(r.launches), r.clock, verdict]
        lines.append("| " + " | ".join(cells) + " |")
    met = sum(r.met for r in results)
    lines += ["", f"Met {met} of {len(results)} rows (target and <= {MAX_RATIO:.0f}x baseline). The floor: the same "
              "calls through a no-op Python autograd.Function (torch's own cost of a Python-defined op here). The "
              "general path: the same call with flashtx's lanes off (the flashtx::attn_fwd / rotary_qk / swiglu / "
              "kvcache_* ops' path)."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.overhead", description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=int(os.environ.get("OVERHEAD_REPEATS", 200)),
                    help="timed rounds per row (median reported)")
    ap.add_argument("--calls", type=int, default=50, help="back-to-back calls per round")
    ap.add_argument("--warmup", type=int, default=50, help="untimed calls first")
    ap.add_argument("--rows", default="", help="comma list of substrings: only rows whose name contains one")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args(argv)
    rows = ROWS
    if args.rows:
        keys = [k.strip() for k in args.rows.split(",") if k.strip()]
        rows = [r for r in ROWS if any(k in r.name for k in keys)]
    results = run(rows, repeats=args.repeats, calls=args.calls, warmup=args.warmup)
    env = environment()
    print(table(results, env))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": env, "rows": [r.as_dict() for r in results]}, f, indent=1)
    return 0


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
