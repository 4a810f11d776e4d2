"""Host overhead of flashtx's public calls, recorded with pytest-benchmark (issue 12, item 3).

Each row of bench/overhead.py (`python -m bench.overhead` prints the same as a table) becomes one
benchmark: extra_info holds the medians of the interleaved flashtx/baseline rounds (op "overhead",
`us_per_call`, `baseline_us_per_call`, `ratio`, `target_us`, `met`), which bench.report turns
into its "Host overhead" table; pytest-benchmark's own columns are a second timing of flashtx's
stubbed call. Runs on CPU (launches stubbed, Triton's interpreter on) and on a GPU.

It runs only with --benchmark-only, and never fails on a missed target (a timed test would fail
from noise in CI): tests/test_bench_overhead.py checks that the tool runs and reports every row.
OVERHEAD_REPEATS (default 40 here, 5 in a smoke run; 200 for `python -m bench.overhead`) sets the rounds per row.
"""
from __future__ import annotations

import os

import pytest
import torch

from . import harness, overhead

REPEATS = int(os.environ.get("OVERHEAD_REPEATS", "5" if harness.SMOKE else "40"))


@pytest.mark.quick
@pytest.mark.parametrize("row", overhead.ROWS, ids=[r.name.replace(" ", "_").replace("(", "").replace(")", "")
                                                    for r in overhead.ROWS])
def test_overhead(benchmark, request, row):
    if not request.config.getoption("benchmark_only", default=False):
        pytest.skip("host-overhead timing runs only with --benchmark-only (it records numbers; it is not a test)")
    dev, _ = overhead.device_and_dtype()
    overhead.check_path(dev)
    benchmark.group = "host overhead (us per call)"
    threads = torch.get_num_threads()
    if dev == "cpu":  # as bench.overhead.run: one intra-op thread
        torch.set_num_threads(1)
    try:
        res = overhead.measure_row(row, repeats=REPEATS, calls=50, warmup=50, benchmark=benchmark)
    finally:
        torch.set_num_threads(threads)
    env = overhead.environment()
    benchmark.extra_info.update(op="overhead", provider="flashtx", status="ok",
                                gpu=harness.gpu_name() if harness.SMOKE else env["gpu"] or env["cpu"],
                                device=dev, dtype=env["dtype"], **res.as_dict())
