"""Attention's lanes and plans keyed by everything that changes a result: a call that differs from a memoised one in
one argument only (scale, causality, the backend asked for, a score modifier, a mask's layout, varlen's causality or
longest sequence, grad) gets its own lane or plan, not the first call's. And the dispatch tables' bookkeeping: one
fallback warning per set of reasons, clear_plans() forgetting device answers, a requested backend in the plan key.
Each test failed under one surviving mutation of a mutation round over the attention host code."""
import warnings

import pytest
import torch

import flashtx
from flashtx import _dispatch, _env
from flashtx.backends import BACKENDS

from conftest import DEVICE, ON_GPU, precise_atol, precise_randn

pytestmark = pytest.mark.usefixtures("fresh_plans")
ATOL = precise_atol(1e-10)


def _qkv(b=1, h=2, s=20, d=16):
    return tuple(precise_randn(b, h, s, d) for _ in range(3))


def _key_mask(s=20):
    km = torch.ones(1, s, dtype=torch.bool, device=DEVICE)
    km[0, -3:] = False
    return km


@pytest.mark.parametrize("first, second", [
    ({"scale": 0.5}, {"scale": 0.25}),
    ({}, {"is_causal": True}),
    ({"key_mask": "km", "scale": 0.5}, {"key_mask": "km", "scale": 0.25}),
    ({"key_mask": "km", "softcap": 5.0}, {"key_mask": "km", "softcap": 2.0}),
    ({"attn_mask": "per-batch"}, {"attn_mask": "per-head"}),
], ids=["scale", "causal", "masked-scale", "masked-softcap", "mask-layout"])
def test_a_call_differing_in_one_argument_gets_its_own_lane(first, second):
    q, k, v = _qkv()
    masks = {"km": _key_mask(), "per-batch": precise_randn(1, 1, 20, 20), "per-head": precise_randn(1, 2, 20, 20)}

    def kw(d):
        return {n: masks.get(a, a) if isinstance(a, str) else a for n, a in d.items()}

    for _ in range(3):  # memoised
        flashtx.attention(q, k, v, **kw(first))
    got = flashtx.attention(q, k, v, **kw(second))
    want = flashtx.attention(q, k, v, **kw(second), backend="reference")
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


def test_backend_reference_after_automatic_calls_runs_the_reference(monkeypatch):
    ref = BACKENDS["reference"]
    seen, real = [], ref.forward
    monkeypatch.setattr(ref, "forward", lambda *a, **kw: seen.append(1) or real(*a, **kw))
    q, k, v = _qkv()
    for _ in range(3):
        flashtx.attention(q, k, v)
    assert seen == []
    flashtx.attention(q, k, v, backend="reference")
    assert seen == [1]


@pytest.mark.parametrize("first, second", [
    (dict(causal=False), dict(causal=True)),
    (dict(cu_q=[0, 80, 160], max_q=80), dict(cu_q=[0, 10, 160], max_q=150)),
], ids=["causal", "longest-query"])
def test_varlen_lanes_key_causality_and_the_longest_sequence(first, second):
    """The second call's grid is planned for its own longest sequence (150 query rows, not 80: rows left
    unwritten otherwise) and its own causality."""
    q = precise_randn(160, 2, 16)
    k, v = precise_randn(20, 2, 16), precise_randn(20, 2, 16)
    cu_k = torch.tensor([0, 7, 20], dtype=torch.int32, device=DEVICE)

    def call(c, backend=None):
        cu_q = torch.tensor(c.get("cu_q", [0, 80, 160]), dtype=torch.int32, device=DEVICE)
        return flashtx.flash_attn_varlen_func(q, k, v, cu_q, cu_k, c.get("max_q", 80), 13,
                                              causal=c.get("causal", False), backend=backend)

    for _ in range(3):
        call(first)
    torch.testing.assert_close(call(second), call(second, "reference"), atol=ATOL, rtol=0)


@pytest.fixture
def no_backward_tile(refuse_tiles):
    """A GPU whose tile tables hold no backward config (the forward's fit)."""
    refuse_tiles("attn_bwd")


@pytest.mark.parametrize("lse", [False, True], ids=["lane", "op"])
def test_inference_runs_triton_and_a_grad_call_after_it_falls_back(no_backward_tile, lse):
    """Without a backward tile: an inference call runs Triton (its plan does not ask for the backward), and a grad
    call after it, with the same shapes, is planned anew: it warns and runs the reference (the plain lane, and the
    op's path with return_lse)."""
    q, k, v = _qkv()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # (fallback warnings, not third-party deprecations)
        for _ in range(3):
            flashtx.attention(q, k, v, return_lse=lse)
    qg = q.clone().requires_grad_()
    with pytest.warns(UserWarning, match="no fast backend"):
        out = flashtx.attention(qg, k, v, return_lse=lse)
    out = out[0] if lse else out
    out.sum().backward()
    assert qg.grad is not None


def test_one_fallback_warning_per_set_of_reasons():
    """Head dim 320 (past the Triton tiles): the reasons are the same for a non-causal and a causal call, two plan
    keys: one warning."""
    q, k, v = (precise_randn(1, 2, 8, 320) for _ in range(3))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        flashtx.attention(q, k, v)
        flashtx.attention(q, k, v, is_causal=True)
    assert sum("no fast backend" in str(w.message) for w in seen) == 1, [str(w.message) for w in seen]


@pytest.mark.skipif(ON_GPU, reason="switches Triton's interpreter off for CPU tensors (CPU only)")
def test_clear_plans_forgets_what_each_device_ran(monkeypatch):
    g, u = precise_randn(8, 64), precise_randn(8, 64)
    flashtx.swiglu(g, u)
    assert _dispatch.plan_device("swiglu", None, g.device, g.dtype) == "triton"
    monkeypatch.setattr(_env, "INTERPRET", False)  # no interpreter: CPU tensors have no Triton backend
    _dispatch.clear_plans()
    assert _dispatch.plan_device("swiglu", None, g.device, g.dtype) == "reference"


def test_a_requested_backend_is_part_of_the_plan_key():
    g, u = precise_randn(8, 64), precise_randn(8, 64)
    flashtx.swiglu(g, u)  # automatic: Triton, planned
    assert _dispatch.plan_kinds("swiglu", None, g.device.type, g.device.index, g.dtype) == "triton"
    assert _dispatch.plan_kinds("swiglu", "reference", g.device.type, g.device.index, g.dtype) == "reference"
