"""float64 torch.autograd.gradcheck through the Triton attention kernels themselves.

Without a GPU the kernels run in Triton's interpreter, where float64 works; on a GPU the Triton
backend refuses float64, so these checks are interpreter-only.
"""
import dataclasses
import sys

import pytest
import torch
from conftest import ON_GPU, gradcheck_each_input

import flashtx

pytestmark = pytest.mark.skipif(ON_GPU, reason="float64 Triton kernels run only in the interpreter")
@dataclasses.dataclass(frozen=True)
class GradCase:
    name: str
    sq: int
    sk: int
    hq: int = 2
    hkv: int = 2
    causal: bool = False
    bottom_right: bool = False
    d: int = 16
    dv: int = 16


GRAD_CASES = [
    GradCase("full", 37, 37),
    GradCase("causal-top-left", 37, 37, causal=True),
    GradCase("gqa-4-causal", 29, 29, hq=4, hkv=1, causal=True),
    GradCase("cross-sq-lt-sk", 19, 45, hq=4, hkv=2),
    GradCase("causal-bottom-right-sq-gt-sk", 45, 19, causal=True, bottom_right=True),  # rows with no key
    GradCase("causal-top-left-sq-lt-sk-dv24", 19, 45, causal=True, dv=24),
]


@pytest.mark.parametrize("case", GRAD_CASES, ids=lambda c: c.name)
def test_gradcheck_float64_through_triton_kernels(case):
    torch.manual_seed(7)
    q = torch.randn(1, case.hq, case.sq, case.d, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, case.hkv, case.sk, case.d, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, case.hkv, case.sk, case.dv, dtype=torch.float64, requires_grad=True)

    if case.bottom_right:
        def fn(q, k, v):
            return flashtx.flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True,
                                           backend="triton")
    else:
        def fn(q, k, v):
            return flashtx.attention(q, k, v, is_causal=case.causal, enable_gqa=True, backend="triton")

    assert gradcheck_each_input(fn, (q, k, v))


def test_gradcheck_through_lse():
    torch.manual_seed(8)
    q, k, v = (torch.randn(1, 2, s, 16, dtype=torch.float64, requires_grad=True) for s in (23, 31, 31))

    def fn(q, k, v):
        out, lse = flashtx.attention(q, k, v, is_causal=True, return_lse=True, backend="triton")
        return out, lse

    assert gradcheck_each_input(fn, (q, k, v))


@pytest.mark.parametrize("which", ["dq", "dk", "dv"])
def test_gradcheck_catches_a_wrong_gradient(which, monkeypatch):
    """The checks above can fail: a 0.1% error planted in one gradient of the Triton backend is caught (in the op's
    backward and in the attention lane's, which fires the same launches without the op)."""
    from flashtx import _attention_lane
    from flashtx.backends import TritonBackend

    real_backward, real_lane = TritonBackend.backward, _attention_lane._lane_backward
    index = "dq dk dv".split().index(which)
    planted_in = []

    def planted(self, do, q, k, v, out, m2, l2, dl2, dq, dk, dv, **kw):
        real_backward(self, do, q, k, v, out, m2, l2, dl2, dq, dk, dv, **kw)
        (dq, dk, dv)[index].mul_(1.001)
        planted_in.append("op")

    def planted_lane(ctx, dout):
        grads = real_lane(ctx, dout)
        if grads is not None:
            grads[index].mul_(1.001)
            planted_in.append("lane")
        return grads

    monkeypatch.setattr(TritonBackend, "backward", planted)
    monkeypatch.setattr(_attention_lane, "_lane_backward", planted_lane)
    # On failure, fast-mode gradcheck recomputes the full Jacobian just to word its message (minutes
    # in the interpreter); the verdict is already made, so skip that.
    gc_module = sys.modules["torch.autograd.gradcheck"]
    if hasattr(gc_module, "_run_slow_mode_and_get_error"):
        monkeypatch.setattr(gc_module, "_run_slow_mode_and_get_error", lambda *a, **k: "planted error detected")
    torch.manual_seed(9)
    q, k, v = (torch.randn(1, 2, 21, 16, dtype=torch.float64, requires_grad=True) for _ in range(3))

    def fn(q, k, v):
        return flashtx.attention(q, k, v, is_causal=True, backend="triton")

    assert not gradcheck_each_input(fn, (q, k, v), raise_exception=False)
    assert "lane" in planted_in  # (the lane took the backwards it could)
