"""python -m flashtx, the main job: environment, backends, self-check; non-zero exit on failure."""
import os
import subprocess
import sys

import torch

from flashtx import _attention_lane, selfcheck
from flashtx.backends import TritonBackend


def test_main_job_runs_every_check_and_exits_zero():
    env = {k: v for k, v in os.environ.items() if k not in ("FLASHTX_INTERPRET", "TRITON_INTERPRET")}
    proc = subprocess.run([sys.executable, "-m", "flashtx"], capture_output=True, text=True, env=env, timeout=900)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert "torch " in out and "triton " in out and "Backends" in out
    for op in ("attention (SDPA shell", "flash_attn_func", "apply_rotary", "swiglu"):
        assert f"PASS  float16  triton    {op}" in out, op
    assert " 0 failed" in out


def test_self_check_fails_on_a_wrong_kernel(monkeypatch):
    """A Triton attention forward 1% off is caught by every attention check, whichever path a check's call
    takes: the op's (TritonBackend.forward) or a plain call's lane (flashtx._attention_lane)."""
    real, real_lane = TritonBackend.forward, _attention_lane._Lane.run

    def planted(self, q, k, v, out, **kw):
        stats = real(self, q, k, v, out, **kw)
        out.mul_(1.01)
        return stats

    def planted_lane(self, q, k, v):
        out, m2, l2 = real_lane(self, q, k, v)
        return out.mul_(1.01), m2, l2

    monkeypatch.setattr(TritonBackend, "forward", planted)
    monkeypatch.setattr(_attention_lane._Lane, "run", planted_lane)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    results = selfcheck.run_all(device, [torch.float32], report=lambda line: None)
    bad = [r for r in results if not r.skipped and not r.passed]
    n_attention = len(selfcheck.attention_checks(device, torch.float32))
    assert {r.backend for r in bad} == {"triton"} and len(bad) == n_attention == 4  # every attention check
