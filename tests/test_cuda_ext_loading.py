"""How flashtx.cuda_ext gets its library, without a GPU: load() (the AOT library, then a JIT build only where
asked), the reasons unavailable_reason() gives, build()'s steps before nvcc runs (the lock, ninja, the arch list
and PTX, the cache folder torch uses), and setup.py's switch and arch list. Every step is stubbed where it would
compile or load a library; the compile itself is tests/test_cuda_ext.py's."""
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from torch.utils import cpp_extension

from flashtx import _cuda_build as B
from flashtx import cuda_ext

pytestmark = pytest.mark.xdist_group("cuda-ext-build")  # (setup.py's subprocesses beside tests/test_cuda_ext.py's)


@pytest.fixture
def unloaded(monkeypatch):
    """cuda_ext as in a fresh process with no library: nothing registered, no AOT library, no switch; build()
    and torch.ops.load_library record their calls instead of running."""
    calls = {"build": 0, "load_library": [], "fakes": 0}
    monkeypatch.setattr(cuda_ext, "_ops_registered", lambda: False)
    monkeypatch.setattr(cuda_ext, "aot_library", lambda: None)
    monkeypatch.setitem(cuda_ext._state, "loaded", None)
    monkeypatch.setitem(cuda_ext._state, "error", None)
    monkeypatch.delenv(cuda_ext.ENV_AUTO, raising=False)

    def build(*a, **k):
        calls["build"] += 1
        cuda_ext._state["loaded"] = "JIT stub"
        return "stub"

    def fakes():
        calls["fakes"] += 1

    monkeypatch.setattr(cuda_ext, "build", build)
    monkeypatch.setattr(cuda_ext, "_register_fakes", fakes)
    monkeypatch.setattr(torch.ops, "load_library", lambda path: calls["load_library"].append(path))
    return calls


def test_an_aot_library_loads_without_a_build_and_registers_the_fakes(unloaded, monkeypatch):
    monkeypatch.setattr(cuda_ext, "aot_library", lambda: "/site/flashtx/_flashtx_cuda.so")
    monkeypatch.setenv(cuda_ext.ENV_AUTO, "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert cuda_ext.load() is True
    assert unloaded["load_library"] == ["/site/flashtx/_flashtx_cuda.so"] and unloaded["build"] == 0
    assert cuda_ext._state["loaded"] == "AOT /site/flashtx/_flashtx_cuda.so"
    assert unloaded["fakes"] == 1  # torch.compile traces the AOT library's ops too


@pytest.mark.parametrize("exc", [OSError, RuntimeError])
def test_an_aot_library_that_fails_to_load_is_the_reason_and_starts_no_build(unloaded, monkeypatch, exc):
    """load() never raises: torch.ops.load_library's OSError (dlopen) or RuntimeError (a namespace registered
    twice, an ABI mismatch) becomes the reason; and the switch builds nothing over it (that build would hide it)."""
    def fail(path):
        raise exc("undefined symbol: _ZN3c10")

    monkeypatch.setattr(torch.ops, "load_library", fail)
    monkeypatch.setattr(cuda_ext, "aot_library", lambda: "/site/flashtx/_flashtx_cuda.so")
    monkeypatch.setenv(cuda_ext.ENV_AUTO, "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert cuda_ext.load() is False and unloaded["build"] == 0 and unloaded["fakes"] == 0
    assert cuda_ext.unavailable_reason() == ("loading /site/flashtx/_flashtx_cuda.so failed: undefined symbol: "
                                             "_ZN3c10")


def test_a_machine_that_could_build_but_has_no_gpu_says_so(unloaded, monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(B, "find_nvcc", lambda: "/usr/local/cuda/bin/nvcc")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cuda_ext.build_env_reasons() == []
    assert cuda_ext.unavailable_reason() == ("not built: no CUDA device is visible (it runs on one; build() compiles "
                                             "it anywhere)")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # with a GPU: how to build it
    why = cuda_ext.unavailable_reason(False)
    assert why.startswith("not built: build it with FLASHTX_BUILD_CUDA=1 pip install") and unloaded["build"] == 0


def test_a_loaded_library_without_a_gpu_is_not_available(unloaded, monkeypatch):
    monkeypatch.setattr(cuda_ext, "_ops_registered", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cuda_ext.load() is True
    assert cuda_ext.unavailable_reason() == "no CUDA device is visible" and cuda_ext.available() is False
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert cuda_ext.available() is True


def test_sources_missing_from_an_install_are_a_reason(monkeypatch, tmp_path):
    monkeypatch.setattr(B, "ROOT", tmp_path)  # an install without a source checkout: no csrc/ beside flashtx/
    reasons = cuda_ext.build_env_reasons()
    assert any(r.startswith(f"sources {list(B.SOURCES)} not found under {tmp_path}") and "pip install -e ." in r
               for r in reasons), reasons
    monkeypatch.setattr(B, "ROOT", B.CSRC.parent)
    assert not any(r.startswith("sources") for r in cuda_ext.build_env_reasons())


def test_the_switch_builds_for_a_backend_asked_by_name_on_cuda_tensors(unloaded, monkeypatch):
    """FLASHTX_CUDA_EXT=1 and backend='cuda' (automatic=False) on CUDA tensors: the first use builds; an automatic
    choice never does while the kernels are unmeasured (tests/test_cuda_ext.py: CPU tensors never do)."""
    monkeypatch.setenv(cuda_ext.ENV_AUTO, "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cuda_ext, "DEVICE_TYPES", ("cuda", "cpu"))  # CPU tensors stand in for CUDA ones
    q = torch.zeros(1, 1, 2, 64, dtype=torch.float16)
    cuda_ext.not_supported_reasons(q, automatic=True)
    assert unloaded["build"] == 0
    assert cuda_ext.not_supported_reasons(q, automatic=False) == [] and unloaded["build"] == 1


def test_fakes_are_registered_once(monkeypatch):
    """load() and build() both register the fakes: each op's once (torch 2.11 raises on a second registration)."""
    registered = []
    monkeypatch.setattr(torch.library, "register_fake", lambda name: registered.append(name) or (lambda fn: fn))
    monkeypatch.setitem(cuda_ext._state, "fakes", False)
    cuda_ext._register_fakes()
    cuda_ext._register_fakes()
    assert registered == ["flashtx_cuda::decode_attention", "flashtx_cuda::rotary_append"]


# ---------------------------------------------------------------------------------------------
# build(): what it does before nvcc runs
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("cuda, hip, abiflags, folder", [
    ("12.4", None, "", "_cu124"), ("13.0", None, "t", "t_cu130"), (None, None, "", "_cpu"),
    (None, "6.4.1", "", "_rocm641"),
])
def test_the_default_build_folder_is_torchs(monkeypatch, tmp_path, cuda, hip, abiflags, folder):
    """Without TORCH_EXTENSIONS_DIR, the folder torch.utils.cpp_extension itself builds in (so the lock problem
    names the lock torch waits on): for a CUDA version with a dot, a free-threaded Python, CPU and ROCm builds."""
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    monkeypatch.setattr(cpp_extension, "get_default_build_root", lambda: str(tmp_path))
    monkeypatch.setattr(torch.version, "cuda", cuda)
    monkeypatch.setattr(torch.version, "hip", hip)
    monkeypatch.setattr(sys, "abiflags", abiflags, raising=False)
    got = cuda_ext.build_directory()
    assert got == cpp_extension._get_build_directory(B.EXT_NAME, False)
    assert got == str(tmp_path / f"py{sys.version_info.major}{sys.version_info.minor}{folder}" / B.EXT_NAME)


def test_a_lock_older_than_the_stale_limit_fails_at_once(tmp_path):
    lock = tmp_path / "lock"
    lock.touch()
    old = time.time() - 10
    os.utime(lock, (old, old))
    t0 = time.time()
    with pytest.raises(RuntimeError, match="stale lock file"):
        cuda_ext.wait_for_lock(str(tmp_path), wait_s=60, stale_after_s=5)
    assert time.time() - t0 < 5


@pytest.mark.parametrize("env, gpu, want", [
    ("8.0", (9, 0), None),  # TORCH_CUDA_ARCH_LIST wins (torch's own rule): torch reads it
    ("", (8, 6), [86]),  # the visible GPU's own arch (not its major's)
    ("", None, [80, 86, 90]),  # no GPU, no list: every arch the package ships for
])
def test_build_archs(monkeypatch, env, gpu, want):
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", env)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu is not None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: gpu)
    assert cuda_ext._build_archs() == want


@pytest.fixture
def build_stubs(monkeypatch, tmp_path):
    """build() with every tool present but stubbed: cpp_extension.load records its keyword arguments."""
    seen = {}
    monkeypatch.setattr(cuda_ext, "build_env_reasons", lambda: [])
    monkeypatch.setattr(cuda_ext, "_ops_registered", lambda: False)
    monkeypatch.setattr(cuda_ext, "_register_fakes", lambda: None)
    monkeypatch.setitem(cuda_ext._state, "loaded", None)
    monkeypatch.setitem(cuda_ext._state, "error", None)
    monkeypatch.setattr(B, "find_nvcc", lambda: "/opt/cuda/bin/nvcc")
    monkeypatch.setattr(B, "resolve_cuda_home", lambda nvcc: "/opt/cuda")
    monkeypatch.setenv("CUDA_HOME", "/opt/cuda")
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", "/opt/cuda")
    monkeypatch.setattr(cpp_extension, "is_ninja_available", lambda: True)
    monkeypatch.setattr(cpp_extension, "load", lambda **kw: seen.update(kw) or "/build/flashtx_cuda.so")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    return seen


def test_build_passes_sass_for_each_arch_and_ptx_of_the_newest(build_stubs):
    assert cuda_ext.build(archs=[80, 90]) == "/build/flashtx_cuda.so"
    flags = build_stubs["extra_cuda_cflags"]
    assert flags[-3:] == ["-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_90,code=sm_90",
                          "-gencode=arch=compute_90,code=compute_90"]
    assert build_stubs["build_directory"] == cuda_ext.build_directory() and cuda_ext._state["loaded"].startswith("JIT")


def test_build_waits_on_the_lock_and_checks_ninja_first(build_stubs, monkeypatch):
    lock = os.path.join(cuda_ext.build_directory(), "lock")
    os.makedirs(os.path.dirname(lock))
    open(lock, "w").close()
    with pytest.raises(RuntimeError, match=f"another process is building the extension.*rm {lock}"):
        cuda_ext.build(lock_wait_s=0)
    os.remove(lock)
    monkeypatch.setattr(cpp_extension, "is_ninja_available", lambda: False)
    with pytest.raises(RuntimeError, match="ninja not found on PATH"):
        cuda_ext.build()
    assert build_stubs == {}  # cpp_extension.load never ran


# ---------------------------------------------------------------------------------------------
# _cuda_build and setup.py
# ---------------------------------------------------------------------------------------------

def test_ptx_is_of_the_newest_arch_in_any_order():
    assert B.gencode_flags([90, 80], ptx=True)[-1] == "-gencode=arch=compute_90,code=compute_90"
    assert B.gencode_flags([80, 86]) == ["-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_86,code=sm_86"]


def _fake_nvcc(folder, top_line: str = ""):
    """An executable nvcc script in folder/bin that prints `top_line` for -dryrun."""
    (folder / "bin").mkdir(parents=True)
    nvcc = folder / "bin" / "nvcc"
    nvcc.write_text(f"#!/bin/sh\necho '{top_line}' >&2\n")
    nvcc.chmod(0o755)
    return nvcc


def test_cuda_home_nvcc_comes_before_the_one_on_path(monkeypatch, tmp_path):
    home, other = tmp_path / "home", tmp_path / "other"
    _fake_nvcc(home), _fake_nvcc(other)
    monkeypatch.setenv("CUDA_HOME", str(home))
    monkeypatch.setenv("PATH", f"{other / 'bin'}{os.pathsep}{os.environ['PATH']}")
    assert B.find_nvcc() == str(home / "bin" / "nvcc")


def test_an_nvcc_without_top_is_trusted_only_beside_the_cuda_headers(tmp_path):
    nvcc = _fake_nvcc(tmp_path / "bare")
    assert B.cuda_home(str(nvcc)) is None  # no TOP line, no include/cuda_runtime_api.h above it
    (tmp_path / "bare" / "include").mkdir()
    (tmp_path / "bare" / "include" / "cuda_runtime_api.h").write_text("")
    assert B.cuda_home(str(nvcc)) == str((tmp_path / "bare").resolve())
    assert B.cuda_home(str(_fake_nvcc(tmp_path / "w", "#$ TOP=/opt/cuda-13"))) == os.path.realpath("/opt/cuda-13")


def _setup_args(env: dict) -> str:
    """setup.py run with CUDA torch, nvcc and CUDAExtension stubbed: what it builds with (or why it stops)."""
    code = textwrap.dedent("""
        import json, runpy, setuptools, torch
        from torch.utils import cpp_extension
        import importlib.util
        torch.version.cuda = "13.0"
        seen = {}
        setuptools.setup = lambda **kw: seen.update(kw)
        cpp_extension.CUDAExtension = lambda name, **kw: {"name": name, **kw}
        real_spec = importlib.util.spec_from_file_location
        def spec(name, path):  # setup.py's _cuda_build, with nvcc found where there is none
            s = real_spec(name, path)
            load = s.loader.exec_module
            def exec_module(m):
                load(m)
                m.find_nvcc = lambda: "/opt/cuda/bin/nvcc"
                m.resolve_cuda_home = lambda nvcc: "/opt/cuda"
            s.loader.exec_module = exec_module
            return s
        importlib.util.spec_from_file_location = spec
        try:
            runpy.run_path("setup.py", run_name="__main__")
        except SystemExit as e:
            print("EXIT", e); raise SystemExit(0)
        exts = seen.get("ext_modules", [])
        print("NVCC", json.dumps(exts[0]["extra_compile_args"]["nvcc"] if exts else None))
    """)
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("FLASHTX_")}, **env}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=str(B.ROOT),
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip().splitlines()[-1]


@pytest.mark.parametrize("switch", ["1", "on", "True", "YES"])
def test_setup_builds_for_every_spelling_of_yes(switch):
    out = _setup_args({"FLASHTX_BUILD_CUDA": switch})
    assert out.startswith("NVCC ") and "-gencode=arch=compute_86,code=sm_86" in out, out


def test_setup_builds_the_archs_it_is_given():
    out = _setup_args({"FLASHTX_BUILD_CUDA": "1", "FLASHTX_CUDA_ARCHS": "9.0"})
    assert "sm_90" in out and "sm_80" not in out and "sm_86" not in out, out
    out = _setup_args({"FLASHTX_BUILD_CUDA": "1", "FLASHTX_CUDA_ARCHS": "7.5"})
    assert out.startswith("EXIT FLASHTX_CUDA_ARCHS='7.5': sm_75 is below sm_80"), out
