"""bench/report.py's tables of attention variants and of Swin's window attention, on SYNTHETIC records fabricated
here: none was measured, and none may be copied into bench/RESULTS.md or the README."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root, for `import bench`

from bench import report  # noqa: E402
from test_bench_report import SYNTHETIC_GPU  # noqa: E402


def test_report_variants_table_relative_to_full_causal(tmp_path):
    """Synthetic variant timings: each row's time is divided by the full causal run's."""
    def var(variant, ms):
        return {"op": "attention-variant", "variant": variant, "provider": "flashtx", "pass": "fwd+bwd",
                "seqlen": 4096, "dtype": "bfloat16", "status": "ok", "median_ms": ms, "tflops": 100.0 / ms,
                "peak_mem_mb": 50.0, "gpu": SYNTHETIC_GPU}
    data = {"benchmarks": [{"extra_info": var("full", 8.0)}, {"extra_info": var("window1024", 2.0)},
                           {"extra_info": var("varlen16x1k", 2.4)},
                           {"extra_info": dict(var("window1024", 3.0), provider="flashtx-plain-tiles")},
                           {"extra_info": var("bias", 16.0)},
                           {"extra_info": dict(var("bias", 8.0), provider="flashtx-plain-tiles")},
                           {"extra_info": dict(var("bias", 4.0), provider="flashtx-plain-bwd-tiles")}]}
    md = report.build_report(data, "synthetic.json", None)
    # beside each, the ideal: the variant's (query, key) pairs over full causal's (window 1024 at 4096: 0.44)
    assert "| fwd+bwd | window1024 | bfloat16 | 2.000 | 0.25 | 0.44 | 50.0 | 50 | 1.50x |" in md  # plain: 3.0
    assert "| fwd+bwd | varlen16x1k | bfloat16 | 2.400 | 0.30 | 0.25 | 41.7 | 50 | - |" in md
    assert "| fwd+bwd | full | bfloat16 | 8.000 | 1.00 | 1.00 |" in md
    # the learned bias: plain tiles everywhere, and only in the backward's kernels
    assert "| fwd+bwd | bias | bfloat16 | 16.000 | 2.00 | 1.00 | 6.2 | 50 | 0.50x, 0.25x bwd |" in md


def test_report_window_bias_table_compares_the_table_tiles_and_sdpa():
    """Synthetic Swin window-attention timings: flashtx's row, with the ratio of its tables' 128-row tiles
    (flashtx-128-rows: configs.fit_rows off) and of SDPA-EFFICIENT (their time / flashtx's)."""
    def rec(provider, ms):
        return {"op": "attention-bias", "provider": provider, "pass": "fwd+bwd", "batch": 2048, "seqlen": 49,
                "heads": 3, "headdim": 32, "dtype": "bfloat16", "status": "ok", "median_ms": ms, "tflops": 10.0 / ms,
                "peak_mem_mb": 40.0, "gpu": SYNTHETIC_GPU}
    data = {"benchmarks": [{"extra_info": rec("flashtx", 2.0)}, {"extra_info": rec("flashtx-128-rows", 3.0)},
                           {"extra_info": rec("sdpa-efficient", 5.0)}]}
    md = report.build_report(data, "synthetic.json", None)
    assert "| pass | windows | N | H | D | dtype | flashtx ms | steady ms | TFLOP/s | MB | vs flashtx-128-rows | " \
           "vs sdpa-efficient |" in md, md
    assert "| fwd+bwd | 2048 | 49 | 3 | 32 | bfloat16 | 2.000 | cut off | 5.0 | 40 | 1.50x | 2.50x |" in md, md
