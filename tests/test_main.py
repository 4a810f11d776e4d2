"""python -m flashtx, the main job: environment, backends, self-check; non-zero exit on failure."""
import os
import subprocess
import sys

import torch

from flashtx import _attention_lane, selfcheck, selfcheck_ops
from flashtx.backends import TritonBackend


def test_main_job_runs_every_check_and_exits_zero():
    env = {k: v for k, v in os.environ.items() if k not in ("FLASHTX_INTERPRET", "TRITON_INTERPRET")}
    proc = subprocess.run([sys.executable, "-m", "flashtx"], capture_output=True, text=True, env=env, timeout=900)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert "torch " in out and "triton " in out and "Backends" in out
    for op in ("attention (SDPA shell", "flash_attn_func", "apply_rotary", "swiglu", "flash_attn_varlen_func",
               "flash_attn_qkvpacked_func", "attention (dropout", "attention lse", "flash_attn_with_kvcache",
               "apply_rotary_qk", "swiglu_packed"):
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

    def planted_lane(self, q, k, v, *masks):
        out, m2, l2 = real_lane(self, q, k, v, *masks)
        return out.mul_(1.01), m2, l2

    monkeypatch.setattr(TritonBackend, "forward", planted)
    monkeypatch.setattr(_attention_lane._Lane, "run", planted_lane)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    lines = []
    results = selfcheck.run_all(device, [torch.float32], report=lines.append)
    bad = [r for r in results if not r.skipped and not r.passed]
    # every check of an attention output: the plain ones, varlen, packed QKV and dropout (lse is not out)
    want = {name for name, *_ in selfcheck.attention_checks(device, torch.float32)} | {
        selfcheck_ops.VARLEN_NAME, selfcheck_ops.PACKED_NAME, selfcheck_ops.DROPOUT_NAME}
    assert {r.backend for r in bad} == {"triton"} and {r.op for r in bad} == want and len(bad) == 7
    assert all("(OVER)" in line for line in lines if line.startswith("  FAIL"))  # the quantity that failed, named


def test_self_check_fails_on_wrong_decode_rope_swiglu_and_wrong_dtypes(monkeypatch):
    """The decode, RoPE (q and k) and packed SwiGLU checks catch a wrong Triton result, and an output of the
    wrong dtype fails even when its values are right."""
    import importlib

    from flashtx import _decode_lane, decode, rotary
    swiglu = importlib.import_module("flashtx.swiglu")  # (flashtx.swiglu the attribute is the function)

    monkeypatch.setattr(_decode_lane, "LANE", False)
    real_decode = decode.flash_attn_with_kvcache

    def bad_decode(*a, backend=None, **kw):
        out, lse = real_decode(*a, backend=backend, **kw)
        return (out * 1.01 if backend == "triton" else out), lse

    real_qk = rotary.apply_rotary_qk

    def bad_qk(*a, backend=None, **kw):
        qo, ko = real_qk(*a, backend=backend, **kw)
        return (qo.double() if backend == "triton" else qo), ko  # right values, wrong dtype

    real_packed = swiglu.swiglu_packed

    def bad_packed(x, *a, backend=None, **kw):
        out = real_packed(x, *a, backend=backend, **kw)
        return out * 1.01 if backend == "triton" else out

    monkeypatch.setattr(decode, "flash_attn_with_kvcache", bad_decode)
    monkeypatch.setattr(rotary, "apply_rotary_qk", bad_qk)
    monkeypatch.setattr(swiglu, "swiglu_packed", bad_packed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    checks = [c for make in (selfcheck_ops.decode_checks, selfcheck_ops.elementwise_checks)
              for c in make(device, torch.float32)]
    for name, run, _, _ in checks:
        assert not run("triton").passed, name
        assert run("reference").passed, name


def test_no_kernel_checked_is_a_failure(monkeypatch):
    """Where Triton's kernels should run (a GPU, or the interpreter) but every Triton check was skipped, only the
    reference was compared with itself: python -m flashtx says so and exits non-zero."""
    from flashtx import __main__ as main_mod

    def refuse(self, inp):
        return ["stand-in: triton refused"]

    monkeypatch.setattr(TritonBackend, "not_supported_reasons", refuse)
    monkeypatch.setattr(selfcheck, "CHECKS", selfcheck.CHECKS[:1])  # the attention checks suffice
    assert main_mod.main() == 1


def test_one_triton_check_skipped_is_a_failure(monkeypatch, capsys):
    """A Triton backend that wrongly refuses one op where its kernels should run (a GPU, or the interpreter): the
    check is NOT CHECKED and the exit status 1 (it was a skip, exit 0)."""
    from flashtx import __main__ as main_mod
    from flashtx.rotary import ROTARY_BACKENDS

    monkeypatch.setattr(type(ROTARY_BACKENDS["triton"]), "not_supported_reasons",
                        lambda self, inp: ["stand-in: triton refused rotary"])
    monkeypatch.setattr(selfcheck, "CHECKS", [selfcheck.rotary_checks, selfcheck.swiglu_checks])
    assert main_mod.main() == 1
    out = capsys.readouterr().out
    assert "NOT CHECKED: float16 triton apply_rotary" in out and "stand-in: triton refused rotary" in out
    assert "PASS  float16  triton    swiglu" in out  # the others still ran


def test_help_runs_no_check(capsys):
    import pytest

    from flashtx import __main__ as main_mod

    with pytest.raises(SystemExit) as e:
        main_mod.main(["--help"])
    assert e.value.code == 0 and "Exit status" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        main_mod.main(["--bogus"])
    assert e.value.code == 2


def test_runs_under_python_OO():
    """-OO strips docstrings: --help still works (its description was cut from the module docstring)."""
    proc = subprocess.run([sys.executable, "-OO", "-m", "flashtx", "--help"], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and "self-check of every op" in proc.stdout, proc.stdout + proc.stderr
