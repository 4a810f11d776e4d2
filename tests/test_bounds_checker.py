"""flashtx.testing_bounds, which every CPU test runs under (conftest._bounds_checked): it must catch a
kernel's stray load or store, and pass in-bounds ones (masked-off lanes may point anywhere)."""
import os

import pytest
import torch

from conftest import ON_GPU

pytestmark = pytest.mark.skipif(ON_GPU, reason="checks Triton's interpreter (CPU); a GPU runs compiled kernels")

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")
from flashtx import testing_bounds  # noqa: E402


@triton.jit
def _copy(X, Y, n, extra_load, extra_store, BLOCK: tl.constexpr):
    o = tl.arange(0, BLOCK)
    x = tl.load(X + o, mask=o < n + extra_load, other=0.0)
    tl.store(Y + o, x, mask=o < n + extra_store)


def _run(x, y, extra_load=0, extra_store=0):
    _copy[(1,)](x, y, x.numel(), extra_load, extra_store, BLOCK=32)


def test_the_suite_runs_under_it():
    assert testing_bounds.active() == (os.environ.get("FLASHTX_CHECK_BOUNDS") != "0")


@pytest.mark.parametrize("extra_load,extra_store,what", [(1, 0, "load of 1 "), (0, 1, "store of 1 "),
                                                         (-10, 3, "store of 3 ")])
def test_a_stray_access_raises(extra_load, extra_store, what):
    x, y = torch.randn(10), torch.empty(10)
    with testing_bounds.checking(), pytest.raises(Exception, match=f"_copy: {what}element"):
        _run(x, y, extra_load, extra_store)


def test_in_bounds_and_masked_off_lanes_pass():
    x, y = torch.randn(10), torch.full((10,), float("nan"))
    with testing_bounds.checking():
        _run(x, y)  # lanes 10..31 point past both buffers, masked off
    assert torch.equal(x, y)
    base = torch.randn(40)
    with testing_bounds.checking():  # a view may reach the rest of its own storage
        _run(base[5:15], torch.empty(10), extra_load=20)

