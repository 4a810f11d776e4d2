"""bench/report.py's judgement of launch-bound cases on their kernel time (bench/harness.py, Method 6), on SYNTHETIC
records fabricated here: none was measured, and none may be copied into bench/RESULTS.md or the README."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root, for `import bench`

from bench import report  # noqa: E402
from test_bench_report import _bw  # noqa: E402


def test_launch_bound_cases_are_judged_on_their_kernel_time_too():
    """Synthetic (fabricated) RoPE bwd records at 16k tokens: flashtx's back to back was launch-bound (autograd's host
    time set the pace), so the harness also recorded its kernels' device time (kernel_ms, gbs_kernel). The table
    shows it beside the steady time and a third target line judges it against the copy back to back; a case that
    was not launch-bound has no such line."""
    big = 336e6
    ours = _bw("rope", "flashtx", "bwd", 16384, big, 1400.0, 1500.0)
    ours.update(steady_host_bound=True, kernel_ms=big / 2900.0 / 1e6, gbs_kernel=2900.0)
    recs = [ours, _bw("rope", "copy", "bwd", 16384, big, 3000.0, 3200.0)]
    md = report.build_report({"benchmarks": [{"extra_info": ei} for ei in recs]}, "s.json", None)
    assert f"{big / 1500.0 / 1e6:.3f}* (kernel {big / 2900.0 / 1e6:.3f})" in md
    assert ("rope >= 80% of the measured copy bandwidth, back to back (only cases moving >= 240 MB, 4x the ~60 MB "
            "L2: back to back, smaller ones may run from L2): **MISSED** in 1 of 1 cases (min 47%") in md
    assert ("rope >= 80% of the measured copy bandwidth, kernel time of the cases whose back to back was launch-bound "
            "(torch.profiler; the copy back to back): **MET** in all 1 cases (min 91%") in md
    del ours["gbs_kernel"], ours["kernel_ms"]
    md = report.build_report({"benchmarks": [{"extra_info": ei} for ei in recs]}, "s.json", None)
    assert "kernel time of the cases" not in md and "(kernel " not in md


def test_profiled_cases_show_their_device_time_by_kernel():
    """Synthetic (fabricated) records: a learned-bias fwd+bwd whose profile split its device time by kernel
    (harness.measure_kernel's kernel_breakdown_us) gets a row in the 'Device time by kernel' table, each kernel with
    its microseconds and share, and its back-to-back time beside the kernel time; a record without a breakdown (or
    not ok) gets none, and without any the table is absent."""
    rec = {"op": "attention-variant", "variant": "bias", "provider": "flashtx", "pass": "fwd+bwd", "dtype": "bfloat16",
           "seqlen": 4096, "status": "ok", "shape": "B=4 H=16 S=4096 D=128 bias", "median_ms": 9.9, "steady_ms": 9.5,
           "kernel_ms": 9.0, "kernel_breakdown_us": {"_attn_bwd_dq": 4500.0, "_attn_bwd_dkdv": 3600.0,
                                                    "_attn_fwd": 900.0}}
    other = dict(rec, variant="full", shape="B=4 H=16 S=4096 D=128 full")
    del other["kernel_breakdown_us"]
    md = report.build_report({"benchmarks": [{"extra_info": ei} for ei in (rec, other)]}, "s.json", None)
    assert "## Device time by kernel (torch.profiler, per call, back to back)" in md
    assert ("| attention-variant bias fwd+bwd, B=4 H=16 S=4096 D=128 bias | flashtx | 9.000 | 9.500 | "
            "`_attn_bwd_dq` 4500.0 (50%), `_attn_bwd_dkdv` 3600.0 (40%), `_attn_fwd` 900.0 (10%) |") in md
    assert "D=128 full | flashtx" not in md
    md = report.build_report({"benchmarks": [{"extra_info": other}]}, "s.json", None)
    assert "Device time by kernel" not in md
