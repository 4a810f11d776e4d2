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
