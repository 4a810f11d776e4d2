"""What flashtx reads from its environment: the on/off switches (one parser, as Triton reads TRITON_INTERPRET),
and an install without a usable triton (the reference backend must still work)."""
import os
import re
import subprocess
import sys
import textwrap

import pytest

from flashtx import _env
from flashtx.triton_kernels import configs

VALUES = ["1", "true", "TRUE", "yes", "Y", "on", "", "0", "false", "No", "n", "off", "2", " 1", "t", "enabled"]


@pytest.mark.parametrize("value", VALUES, ids=repr)
def test_triton_interpret_is_read_as_triton_reads_it(value, monkeypatch):
    """flashtx and Triton must agree whether kernels are interpreted: a disagreement sends CUDA tensors to the
    interpreter's tiles (or skips launches while tracing) with no warning."""
    triton = pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", value)
    assert _env.triton_interpret() is configs.interpreter_active() is bool(triton.knobs.runtime.interpret)


@pytest.mark.parametrize("value", VALUES, ids=repr)
def test_switches_take_on_or_off_values_and_warn_on_anything_else(value, monkeypatch, recwarn):
    monkeypatch.setenv("FLASHTX_SOME_SWITCH", value)
    on = _env.flag("FLASHTX_SOME_SWITCH")
    known = value.strip().lower() in _env.ON + _env.OFF
    assert on is (value.strip().lower() in _env.ON)
    said = [str(w.message) for w in recwarn if "FLASHTX_SOME_SWITCH" in str(w.message)]
    assert said == ([] if known else [f"FLASHTX_SOME_SWITCH={value!r} is not an on/off value: it is taken as off "
                                      "(on: 1, true, yes, y, on; off: 0, false, no, n, off or unset)"])


def test_an_unknown_autotune_value_warns_and_stays_off():
    """FLASHTX_AUTOTUNE=disable must not turn autotuning on (it did: anything not in a short off-list was on)."""
    code = "import flashtx.triton_kernels.configs as c; print(c._autotune_hook is None)"
    env = dict(os.environ, FLASHTX_AUTOTUNE="disable")
    proc = subprocess.run([sys.executable, "-W", "always", "-c", code], capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "True"
    assert "FLASHTX_AUTOTUNE='disable' is not an on/off value" in proc.stderr


def _without_triton(tmp_path, code: str, *args: str) -> subprocess.CompletedProcess:
    """Run Python where `import triton` fails, as on a machine without it (macOS, a CPU-only install)."""
    (tmp_path / "sitecustomize.py").write_text("import sys\nsys.modules['triton'] = None\n")
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "FLASHTX_INTERPRET")}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, *args, *(["-c", code] if code else [])], capture_output=True, text=True,
                          env=env, timeout=600)


def test_without_triton_every_op_runs_on_the_reference_backend(tmp_path):
    """The package must import and run without triton (README: "flashtx still works on its reference backend");
    a module-level import of a kernel module broke that."""
    code = textwrap.dedent("""
        import torch, flashtx
        from flashtx import _env
        from flashtx.nn import TransformerBlock
        assert not _env.HAS_TRITON and "triton" in _env.TRITON_IMPORT_ERROR
        q, k, v = (torch.randn(1, 2, 8, 16, requires_grad=True) for _ in range(3))
        flashtx.attention(q, k, v, is_causal=True).sum().backward()
        cos, sin = torch.randn(8, 4), torch.randn(8, 4)
        flashtx.apply_rotary(torch.randn(1, 8, 2, 16), cos, sin)
        flashtx.swiglu(torch.randn(3, 8), torch.randn(3, 8))
        kc, vc = torch.zeros(1, 16, 2, 16), torch.zeros(1, 16, 2, 16)
        flashtx.flash_attn_with_kvcache(q.detach().transpose(1, 2)[:, :1], kc, vc, kc[:, :1] + 1, vc[:, :1] + 1,
                                        cache_seqlens=torch.tensor([3], dtype=torch.int32))
        block = TransformerBlock(32, 2, 1, causal=True).eval()
        with torch.no_grad():
            cache = block.new_cache(1, max_len=16)
            block(torch.randn(1, 5, 32), cache=cache); block(torch.randn(1, 1, 32), cache=cache)
        print("ok")
    """)
    proc = _without_triton(tmp_path, code)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout[-2000:] + proc.stderr[-3000:]


def test_main_without_triton_says_why_and_checks_the_reference(tmp_path):
    proc = _without_triton(tmp_path, "", "-m", "flashtx")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert re.search(r"Triton kernels run nowhere \((triton is not installed|importing triton failed)", proc.stdout)
    assert "PASS  float32  reference attention" in proc.stdout and " 0 failed" in proc.stdout


def test_interpreter_off_reason_names_the_switch(monkeypatch):
    monkeypatch.setattr(_env, "INTERPRET", False)
    monkeypatch.setattr(_env, "HAS_TRITON", True)
    monkeypatch.setattr(_env, "INTERPRET_TOO_LATE", False)
    assert _env.interpreter_off_reason() == "FLASHTX_INTERPRET is not set"
    monkeypatch.setattr(_env, "INTERPRET", True)
    assert _env.interpreter_off_reason() is None


def test_the_test_commands_xdist_groups_stay_on_one_worker(tmp_path):
    """`pytest -n auto --dist loadgroup tests` (the README's command) relies on xdist_group keeping a module whose
    fixture runs a long subprocess (the compile check) on one worker; with pytest 9.2 and pytest-xdist 3.8 the group
    tag is lost and every worker runs it (pyproject pins pytest < 9.2 for that)."""
    pytest.importorskip("xdist")
    (tmp_path / "test_grouped.py").write_text(textwrap.dedent("""
        import os
        import pytest
        pytestmark = pytest.mark.xdist_group("one")

        @pytest.fixture(scope="module")
        def once():
            with open(os.environ["GROUP_LOG"], "a") as f:
                f.write(os.environ.get("PYTEST_XDIST_WORKER", "-") + "\\n")

        @pytest.mark.parametrize("i", range(12))
        def test_grouped(once, i):
            pass
    """))
    (tmp_path / "test_plain.py").write_text("".join(f"def test_{i}():\n    pass\n" for i in range(24)))
    log = tmp_path / "workers.txt"
    env = {**os.environ, "GROUP_LOG": str(log)}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadgroup", "-q", "-p",
                           "no:cacheprovider", "-p", "no:randomly", str(tmp_path)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert len(log.read_text().split()) == 1, f"the group's module fixture ran on {log.read_text().split()}"
