"""flashtx._interpreter: device function calls skip re-patching triton.language inside a launch, and compute
the same. Interpreter only: on a GPU device functions are inlined by the compiler and nothing here runs."""
import numpy as np
import pytest
import torch

from conftest import ON_GPU

pytestmark = pytest.mark.skipif(ON_GPU, reason="Triton's interpreter only (a GPU compiles device calls inline)")

if not ON_GPU:
    import triton
    import triton.language as tl
    from triton.runtime import interpreter as ti

    from flashtx import _interpreter

    @triton.jit
    def _inner(x, k):
        return x * k + 1.0

    @triton.jit
    def _outer(x, k, N_CALLS: tl.constexpr):
        for _ in range(0, N_CALLS):
            x = _inner(x, k)
        return x

    @triton.jit
    def _kernel(X, Y, n, k, BLOCK: tl.constexpr, N_CALLS: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(X + offs, mask=offs < n, other=0.0)
        tl.store(Y + offs, _outer(x, k, N_CALLS), mask=offs < n)

    @triton.jit
    def _cdiv_kernel(X, Y, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(Y + offs, tl.cdiv(tl.load(X + offs, mask=offs < n, other=0), 5), mask=offs < n)


def _run(n=37, k=0.5, n_calls=3):
    x = torch.randn(n, dtype=torch.float64)
    y = torch.full_like(x, float("nan"))  # poisoned
    _kernel[(triton.cdiv(n, 16),)](x, y, n, k, BLOCK=16, N_CALLS=n_calls)
    want = x.clone()
    for _ in range(n_calls):
        want = want * k + 1.0
    return y, want


def _count_patches(monkeypatch):
    calls = []
    original = ti._patch_lang

    def counting(fn):
        calls.append((fn.__name__, _interpreter.patched(tl)))
        return original(fn)

    monkeypatch.setattr(ti, "_patch_lang", counting)
    return calls


def test_installed_on_this_triton():
    # conftest turns the interpreter on before flashtx loads, so flashtx._env installed it: a Triton whose
    # InterpretedFunction.__call__ is not the known one would fail here, not silently run slower
    assert getattr(ti.InterpretedFunction, "_flashtx_fast_calls", False), triton.__version__
    assert _interpreter.speed_up_device_calls()  # and installing twice is a no-op


def test_a_launch_patches_once_and_nested_calls_reuse_it(monkeypatch):
    calls = _count_patches(monkeypatch)
    # outside a launch. (Not tl.core: a kernel that calls a standard-library device function, tl.cdiv say,
    # leaves it patched for good, Triton's own behaviour: standard.py sees only `core`, which the launch of a
    # kernel seeing `tl` does not patch, so that call patches it and drops the scope.)
    assert not _interpreter.patched(tl)
    y, want = _run()
    # 3 programs x (1 _outer + 3 _inner) device calls, none re-patching: only the launch patched, once
    assert calls == [("_kernel", False)]
    np.testing.assert_array_equal(y.numpy(), want.numpy())
    assert not _interpreter.patched(tl)  # the launch's scope restored every builtin


def test_a_call_on_unpatched_modules_takes_tritons_path(monkeypatch):
    # the probe decides: with it saying "unpatched", every device call re-patches as Triton does, and
    # the results are the same
    calls = _count_patches(monkeypatch)
    monkeypatch.setattr(_interpreter, "patched", lambda lang: False)
    y, want = _run()
    assert [name for name, _ in calls] == ["_kernel"] + ["_outer", "_inner", "_inner", "_inner"] * 3
    np.testing.assert_array_equal(y.numpy(), want.numpy())


def test_a_standard_library_call_patches_tl_core_at_most_once(monkeypatch):
    # tl.cdiv is a device function of triton.language.standard, whose globals hold `core`, not `tl`: while
    # tl.core is unpatched its call takes Triton's path, which patches tl.core and keeps it patched (Triton's own
    # behaviour); from then on it is as fast as the rest, and the kernel computes the same either way
    calls = _count_patches(monkeypatch)
    n = 37
    x = torch.arange(n, dtype=torch.int32) * 7
    for _ in range(2):
        y = torch.full_like(x, -1)
        _cdiv_kernel[(triton.cdiv(n, 16),)](x, y, n, BLOCK=16)  # 3 programs
        torch.testing.assert_close(y, (x + 4) // 5, rtol=0, atol=0)  # ceil division
    names = [name for name, _ in calls]
    assert names.count("_cdiv_kernel") == 2 and names.count("cdiv") <= 1, names
    assert _interpreter.patched(tl.core)


def test_device_errors_still_name_the_failure():
    x = torch.randn(8, dtype=torch.float64)
    # range() of a string fails inside _outer, a device call on the fast path: the error names the cause
    with pytest.raises(ti.InterpreterError, match="cannot be interpreted as an integer"):
        _kernel[(1,)](x, x, 8, 0.5, BLOCK=8, N_CALLS="three")
