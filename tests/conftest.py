"""Shared test setup and helpers.

Without a GPU the kernels run in Triton's interpreter on CPU tensors; the switch must be set
before triton is first imported, hence at the very top of this file.
"""
import os

import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ.setdefault("FLASHTX_INTERPRET", "1")
    os.environ.setdefault("TRITON_INTERPRET", "1")

import contextlib  # noqa: E402

import pytest  # noqa: E402

from flashtx import testing  # noqa: E402

DEVICE = "cuda" if ON_GPU else "cpu"
# The interpreter computes bf16 wrongly (triton-lang/triton#11584) and float64 is for gradchecks
# there; a GPU runs the dtypes users train in.
KERNEL_DTYPES = [torch.float16, torch.bfloat16, torch.float32] if ON_GPU else [torch.float16, torch.float32,
                                                                               torch.float64]
OUTPUT_FACTOR, GRAD_FACTOR = testing.OUTPUT_FACTOR, testing.GRAD_FACTOR  # noqa: E402
max_err = testing.max_err


def dtype_id(dt: torch.dtype) -> str:
    return str(dt).replace("torch.", "")


def randn(*shape, dtype=torch.float32, device=DEVICE, requires_grad=False, scale=1.0):
    """Fresh random data (never zeros)."""
    t = (torch.randn(*shape, dtype=torch.float64, device=device) * scale).to(dtype)
    return t.requires_grad_(requires_grad)


def to64(*ts):
    """Detached float64 leaf copies that require grad, for the reference."""
    return tuple(t.detach().to(torch.float64).requires_grad_(True) for t in ts)


def to_dtype(dtype, *ts):
    """Detached same-dtype leaf copies that require grad, for the eager baseline."""
    return tuple(t.detach().to(dtype).requires_grad_(True) for t in ts)


def assert_close_to_reference(name: str, actual: torch.Tensor, ref64: torch.Tensor, eager: torch.Tensor, *,
                              grad: bool = False, scale: float = 0.0) -> None:
    """The tolerance rule: err(kernel) <= factor * err(same-dtype eager) + a few ulps.

    err(x) is the max abs difference from the float64 reference; factor is 2 for outputs and 3 for
    gradients. The ulps are taken at max(|ref64|, scale): pass the magnitude of the terms that
    cancel when the exact result is ~0 (e.g. dq with one key). NaN or a missing value fails.
    """
    assert actual.shape == ref64.shape, f"{name}: shape {tuple(actual.shape)} != reference {tuple(ref64.shape)}"
    err_k, bound = testing.tolerance_check(actual, ref64, eager, grad=grad, scale=scale)
    err_e = max_err(eager, ref64)
    factor = GRAD_FACTOR if grad else OUTPUT_FACTOR
    assert err_k <= bound, (f"{name} ({dtype_id(actual.dtype)}): kernel error {err_k:.3e} > bound {bound:.3e} "
                            f"({factor:g} x eager error {err_e:.3e} + ulp floor)")


@contextlib.contextmanager
def poisoned_allocations():
    """Make torch.empty / empty_like return NaN-filled (or -1) tensors, so unwritten outputs fail."""
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def fill(t):
        if t.is_floating_point():
            t.fill_(float("nan"))
        elif t.dtype != torch.bool:
            t.fill_(-1)
        return t

    def empty(*a, **kw):
        return fill(real_empty(*a, **kw))

    def empty_like(*a, **kw):
        return fill(real_empty_like(*a, **kw))

    torch.empty, torch.empty_like = empty, empty_like
    try:
        yield
    finally:
        torch.empty, torch.empty_like = real_empty, real_empty_like


@pytest.fixture
def poison():
    """Fixture form of poisoned_allocations()."""
    with poisoned_allocations():
        yield


GRADCHECK_TOL = dict(atol=1e-8, rtol=1e-6)


def gradcheck_each_input(fn, inputs, raise_exception=True) -> bool:
    """Fast-mode gradcheck one input at a time.

    Fast mode checks one random projection of the whole Jacobian; with all inputs at once, a 0.1%
    error in dK can hide under dQ's and dV's share of it (seen). One input at a time it cannot.
    """
    ok = True
    for i in range(len(inputs)):
        def fn_i(x, i=i):
            return fn(*[x if j == i else t.detach() for j, t in enumerate(inputs)])

        ok &= torch.autograd.gradcheck(fn_i, (inputs[i],), fast_mode=True, raise_exception=raise_exception,
                                       **GRADCHECK_TOL)
    return ok
