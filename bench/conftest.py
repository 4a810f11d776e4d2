"""pytest options for the benchmark suite.

- `--quick` (or `-m quick`): only the quick subset (about 2 minutes on the H200 at 29be9ff; the current
  subset has not been timed on a GPU).
- Without a CUDA GPU every benchmark is skipped with the reason, and the run exits 0.
- BENCH_SMOKE=1: the smoke run of bench/harness.py (CPU, tiny shapes, Triton's interpreter), which
  runs the GPU benchmarks anyway to check the pipeline; the JSON's machine_info says `smoke`.
- pytest-benchmark's machine_info gets the GPU, its datasheet peaks and the torch/triton/flashtx
  versions, so every JSON says where it came from.
"""
from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("BENCH_SMOKE", "") == "1":  # before anything imports triton
    os.environ.setdefault("TRITON_INTERPRET", "1")
elif not torch.cuda.is_available():  # bench/test_overhead.py times flashtx's Triton path on CPU (launches stubbed)
    os.environ.setdefault("FLASHTX_INTERPRET", "1")

NO_GPU_REASON = ("no CUDA GPU here (torch.cuda.is_available() is False): the GPU benchmarks are skipped; "
                 "run `pytest bench --benchmark-only` on a machine with one")


def pytest_addoption(parser):
    parser.addoption("--quick", action="store_true", default=False,
                     help="flashtx bench: run only the quick subset (tests marked quick)")


def pytest_configure(config):
    config.addinivalue_line("markers", "quick: the quick benchmark subset (about 2 min at 29be9ff; not timed since)")
    config.addinivalue_line("markers", "gpu: needs a CUDA device")


# files timed after every other (a stable sort): the newest cases, so that a bench step that overruns its limit
# (bench/device_check.sh: 139 of its 150 s on 2026-12-06) cuts these, not the RoPE / SwiGLU rows collected last
LAST = ("bench/test_attention_bias.py",)


def pytest_collection_modifyitems(config, items):
    bench_items = [it for it in items if it.nodeid.startswith("bench/")]
    if config.getoption("--quick"):
        keep = [it for it in items if it not in bench_items or it.get_closest_marker("quick")]
        dropped = [it for it in items if it not in keep]
        if dropped:
            config.hook.pytest_deselected(items=dropped)
            items[:] = keep
    items.sort(key=lambda it: it.nodeid.startswith(LAST))
    from . import harness
    if not torch.cuda.is_available() and not harness.SMOKE:
        skip = pytest.mark.skip(reason=NO_GPU_REASON)
        for it in items:
            if it.get_closest_marker("gpu"):
                it.add_marker(skip)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtestloop(session):
    """After every case has been timed (not after an interrupt or a stop): the kernel times of the launch-bound
    memory-bound cases (bench/harness.py, Method 6), before pytest-benchmark writes the JSON at session finish."""
    outcome = yield
    if outcome.excinfo is None and not session.shouldfail and not session.shouldstop:
        from . import harness
        harness.measure_deferred_kernels()


def pytest_benchmark_update_machine_info(config, machine_info):
    import flashtx

    from . import gpus, harness
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    info = {"torch": torch.__version__, "triton": triton_version, "flashtx": flashtx.__version__,
            "cuda": torch.version.cuda, "smoke": harness.SMOKE}
    if harness.SMOKE:
        info.update(gpu=harness.SMOKE_NAME)
    elif torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        props = torch.cuda.get_device_properties(0)
        peak = gpus.lookup(name)
        info.update(gpu=name, capability=f"{props.major}.{props.minor}", sm_count=props.multi_processor_count,
                    memory_gb=round(props.total_memory / 1e9, 1))
        if peak:
            info.update(peak_tflops_16=peak.tflops_16, peak_gbs=peak.gbs, peak_source=peak.source)
    machine_info["flashtx_bench"] = info
