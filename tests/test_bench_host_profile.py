"""bench/host_profile.py runs (on CPU: its smoke mode, the interpreter at tiny shapes; the times mean
nothing) and reports a row per provider and pass, so the GPU step cannot rot unseen. In a subprocess:
bench's modules read BENCH_SMOKE when first imported, and this test process may have imported them for
real-GPU settings already."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the smoke mode is for machines without a GPU")


def test_host_profile_reports_each_provider_and_pass(tmp_path):
    out = tmp_path / "hp.json"
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")},
           "BENCH_SMOKE": "1", "FLASHTX_INTERPRET": "1", "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-m", "bench.host_profile", "--json", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "| flashtx | fwd |" in proc.stdout and "| flashtx | bwd |" in proc.stdout, proc.stdout[-3000:]
    rows = json.loads(out.read_text())
    assert {(r["provider"], r["pass"]) for r in rows} >= {("flashtx", "fwd"), ("flashtx", "bwd")}
    assert all(r["total_us"] >= r["host_call_us"] > 0 for r in rows)
