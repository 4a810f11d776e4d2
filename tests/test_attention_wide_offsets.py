"""Attention inputs whose element offsets would pass int32 in the kernels (rows, mask entries or dout rows far apart,
outputs and gradients allocated dense beside expanded inputs): computed right, or refused before any launch, never
a read or write outside a tensor (the interpreter segfaulted on each of these before). The buffers are a few GiB
of address space, of which only the elements written are touched."""
import pytest
import torch
from conftest import DEVICE

import flashtx
from flashtx.triton_kernels import attention_bwd_launch, launch
from flashtx.triton_kernels.attention_scores import attention_probs
from flashtx.triton_kernels.limits import LimitExceeded

pytestmark = pytest.mark.usefixtures("fresh_plans")
F64 = torch.float64


def _sdpa64(q, k, v, **kw):
    return torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), **kw)


@pytest.mark.parametrize("which", ["key_mask", "query_mask"])
def test_a_mask_whose_entries_are_far_apart(which):
    """A (B, S) bool mask with a column stride of 2**28: the kernels read entry j at j x stride (int32); the check
    makes such a mask contiguous."""
    gen = torch.Generator().manual_seed(0)
    S, st = 16, 2**28
    q, k, v = (torch.randn(1, 1, S, 16, generator=gen).to(DEVICE).requires_grad_() for _ in range(3))
    pattern = torch.tensor([1, 0, 1, 1, 0, 1, 1, 1, 1, 0, 1, 0, 1, 1, 0, 1], dtype=torch.bool, device=DEVICE)
    buf = torch.zeros((S - 1) * st + 1, dtype=torch.bool, device=DEVICE)
    m = buf.as_strided((1, S), (0, st))
    m.copy_(pattern[None])
    out = flashtx.attention(q, k, v, **{which: m}, backend="triton")
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    if which == "key_mask":
        ref = _sdpa64(q64, k64, v64, attn_mask=pattern[None, None, None, :])
    else:
        ref = _sdpa64(q64, k64, v64) * pattern[:, None]  # rows of no query: zero
    assert (out.double() - ref).abs().max() < 1e-5
    g = torch.randn(out.shape, generator=gen).to(DEVICE)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(ref, (q64, k64, v64), g.double())):
        assert (a.double() - b).abs().max() < 1e-5


@pytest.mark.parametrize("api", ["attention", "flash_attn_func"])
def test_a_dout_whose_rows_are_far_apart(api):
    """autograd hands the backward any strides: a dout with rows 2**27 apart (fp16: 17 rows span past 2**31) is
    copied before the kernels read it."""
    gen = torch.Generator().manual_seed(1)
    S, D, st = 17, 16, 2**27
    q, k, v = (torch.randn(1, 1, S, D, generator=gen, dtype=torch.float16).to(DEVICE) for _ in range(3))
    g0 = torch.randn(1, 1, S, D, generator=gen, dtype=torch.float16).to(DEVICE)
    buf = torch.empty((S - 1) * st + D, dtype=torch.float16, device=DEVICE)
    g = buf.as_strided((1, 1, S, D), (0, 0, st, 1))
    g.copy_(g0)
    if api == "attention":
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        out = flashtx.attention(qq, kk, vv, backend="triton")
        out.backward(g)
        dq = qq.grad
    else:
        qq, kk, vv = (t.transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v))
        out = flashtx.flash_attn_func(qq, kk, vv, backend="triton")
        out.backward(g.transpose(1, 2))
        dq = qq.grad.transpose(1, 2)
    q64 = q.double().requires_grad_()
    (want,) = torch.autograd.grad(_sdpa64(q64, k, v), q64, g0.double())
    assert (dq.double() - want).abs().max() < 2e-2


def test_a_dense_output_beside_an_expanded_query_is_refused_before_any_launch():
    """q expanded over 2**27 + 64 rows spans nothing, but its output is allocated dense (rows D apart): the forward's
    plan checks the output's span and refuses a requested `triton`."""
    q = torch.randn(1, 1, 1, 16, dtype=torch.float16, device=DEVICE).expand(1, 1, 2**27 + 64, 16)
    k, v = (torch.randn(1, 1, 16, 16, dtype=torch.float16, device=DEVICE) for _ in range(2))
    launches = []
    with launch.stub_launches(lambda kernel, grid, args: launches.append(kernel)):
        with pytest.raises(flashtx.BackendNotSupported, match=r"out \(1, 1, 134217792, 16\).*overflows"):
            flashtx.attention(q, k, v, backend="triton")
    assert launches == []


def test_dense_key_gradients_beside_expanded_keys_are_refused_before_any_launch():
    """k and v of one head and one row expanded to (B, Sk, H, D), as a MQA model may pass them to flash_attn_func:
    dk and dv are allocated dense, (Sk, H, D) past 2**31 elements. The backward's plan refuses a requested `triton`
    (the forward is stubbed: only the plans matter here)."""
    H, D, Sk = 64, 16, 2**21 + 1
    q = torch.randn(1, 1, H, D, dtype=torch.float16, device=DEVICE).requires_grad_()
    k0, v0 = (torch.randn(1, 1, 1, D, dtype=torch.float16, device=DEVICE).requires_grad_() for _ in range(2))
    k, v = k0.expand(1, Sk, H, D), v0.expand(1, Sk, H, D)
    launches = []
    with launch.stub_launches(lambda kernel, grid, args: launches.append(kernel)):
        out = flashtx.flash_attn_func(q, k, v, backend="triton")
        n = len(launches)
        with pytest.raises(flashtx.BackendNotSupported, match=r"d[kv] .*overflows"):
            out.sum().backward()
    assert len(launches) == n  # the backward launched nothing


def test_the_bias_gradient_and_probabilities_slices_are_bounded():
    """A learned bias broadcast over (Sq, Sk) = (129, 2**24) has a dense (Sq, Sk) gradient, and so do the returned
    probabilities: past 2**31 elements per slice they are refused (LimitExceeded: the op re-plans), at 127 rows not.
    Meta tensors: only the plans' checks run."""
    meta = dict(device="meta", dtype=torch.float32)
    for Sq, refused in ((129, True), (127, False)):
        dbias = torch.empty(1, 1, Sq, 2**24, **meta)
        if refused:
            with pytest.raises(LimitExceeded, match="attn_mask gradient"):
                attention_bwd_launch.dbias_plan(dbias, 1, 1, Sq, 2**24, 64, torch.float32)
        else:
            attention_bwd_launch.dbias_plan(dbias, 1, 1, Sq, 2**24, 64, torch.float32)
    q, k = torch.empty(1, 1, 129, 16, **meta), torch.empty(1, 1, 2**24, 16, **meta)
    m2 = torch.empty(1, 1, 129, **meta)
    with pytest.raises(LimitExceeded, match="probabilities"):
        attention_probs(q, k, k, m2, m2, scale=0.25)
