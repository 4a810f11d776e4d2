"""The backward at split head dims (launch.head_split: 192 = 128 + 64, 96 = 64 + 32, 160 = 128 + 32, 80 = 64 + 16):
every kernel of it (preprocess, dK/dV, dQ with and without the fused attn_mask gradient, dK/dV split over
GQA heads) takes the split path, and its gradients meet the tolerance rule of
conftest.assert_close_to_reference against the float64 reference, or a float64 gradcheck.

test_attention_split.py's gradient cases (192/128 GQA causal, 96/160 MQA strided, 160/80, 192/192, masks
and lengths) run through the split backward too; these add what they do not reach.
"""
import pytest
import torch
from conftest import (DEVICE, KERNEL_DTYPES, ON_GPU, PRECISE_DTYPE, assert_close_to_reference, dtype_id,
                      gradcheck_each_input, poisoned_allocations, precise_atol, randn, to64, to_dtype)

import flashtx
from flashtx import reference
from flashtx.triton_kernels.attention_bwd import attention_backward, gqa_partials, plan_backward
from flashtx.triton_kernels.attention_common import MaskSpec
from flashtx.triton_kernels.attention_fwd import attention_forward
from flashtx.triton_kernels.launch import head_split

pytestmark = pytest.mark.usefixtures("split_head_dims")  # off by default for now (launch.SPLIT_HEAD_DIMS)


@pytest.mark.parametrize("dqk,dv", [(192, 128), (96, 160), (160, 80), (128, 192)])
def test_backward_launches_take_the_split_path(dqk, dv):
    """Preprocess (Dv only), dK/dV and dQ carry the split constexprs, with the bias gradient and GQA split too."""
    q, do, dq = (torch.empty(1, 4, 40, d, device=DEVICE) for d in (dqk, dv, dqk))
    k, dk = (torch.empty(1, 2, 40, dqk, device=DEVICE) for _ in range(2))
    v, dv_ = (torch.empty(1, 2, 40, dv, device=DEVICE) for _ in range(2))
    o = torch.empty_like(do)
    m2, l2, delta = (torch.empty(1, 4, 40, device=DEVICE) for _ in range(3))
    spec = MaskSpec(attn_mask=torch.empty(1, 4, 40, 40, device=DEVICE))
    launches = plan_backward(do, q, k, v, o, m2, l2, delta, dq, dk, dv_, scale=1.0, causal=True, bottom_right=False,
                             spec=spec, dbias=torch.empty(1, 4, 40, 40, device=DEVICE),
                             gqa_parts=gqa_partials(dk, dv_, 2, q.dtype))
    pre, dkdv, dqk_ = launches[:3]
    assert (pre.args["BLOCK_DV"], pre.args["BLOCK_DV2"]) == head_split(dv)
    for launch in (dkdv, dqk_):
        assert (launch.args["BLOCK_DQK"], launch.args["BLOCK_DQK2"]) == head_split(dqk)
        assert (launch.args["BLOCK_DV"], launch.args["BLOCK_DV2"]) == head_split(dv)
    assert dkdv.args["SPLIT"] == 2 and dqk_.args["DBIAS"]


def _check_grads(grads, ref_grads, eager_grads, names):
    scale = max(float(r.abs().max()) for r in ref_grads)
    for name, g, r, e in zip(names, grads, ref_grads, eager_grads):
        assert_close_to_reference(name, g, r, e, grad=True, scale=scale)


@pytest.mark.parametrize("dtype", KERNEL_DTYPES[:2], ids=dtype_id)
@pytest.mark.parametrize("bias_shape", [(1, 2, 45, 60), (2, 1, 1, 60)], ids=["1xHxSqxSk", "Bx1x1xSk"])
def test_split_attn_mask_gradient(bias_shape, dtype):
    """An additive attn_mask that requires grad: the dQ kernel writes its gradient (dS) as it forms it,
    from both pieces' dots; 192/128, GQA."""
    torch.manual_seed(11)
    B, Sq, Sk = 2, 45, 60
    q = randn(B, 2, Sq, 192, dtype=dtype, requires_grad=True)
    k = randn(B, 1, Sk, 192, dtype=dtype, requires_grad=True)
    v = randn(B, 1, Sk, 128, dtype=dtype, requires_grad=True)
    bias = randn(*bias_shape, dtype=dtype, requires_grad=True)
    with poisoned_allocations():
        out = flashtx.attention(q, k, v, attn_mask=bias, enable_gqa=True, backend="triton")
        do = randn(*out.shape, dtype=dtype)
        grads = torch.autograd.grad(out, (q, k, v, bias), do)
    leaves64, leaves_e = to64(q, k, v, bias), to_dtype(dtype, q, k, v, bias)
    ref = reference.attention(*leaves64[:3], bias=leaves64[3])
    eager = reference.attention(*leaves_e[:3], bias=leaves_e[3])
    assert_close_to_reference("out", out, ref, eager)
    _check_grads(grads, torch.autograd.grad(ref, leaves64, do.to(torch.float64)),
                 torch.autograd.grad(eager, leaves_e, do), ("dq", "dk", "dv", "dbias"))


@pytest.mark.parametrize("dtype", KERNEL_DTYPES[:2], ids=dtype_id)
def test_split_softcap_alibi_gradients(dtype):
    """softcap's derivative and ALiBi act on s after both pieces' dots; 96/160 (both dims split), causal."""
    torch.manual_seed(12)
    B, H, Sq, Sk = 1, 2, 40, 50
    q = randn(B, H, Sq, 96, dtype=dtype, scale=2.0, requires_grad=True)
    k = randn(B, H, Sk, 96, dtype=dtype, scale=2.0, requires_grad=True)
    v = randn(B, H, Sk, 160, dtype=dtype, requires_grad=True)
    slopes = torch.rand(H, device=DEVICE, dtype=torch.float32)
    with poisoned_allocations():
        out = flashtx.attention(q, k, v, is_causal=True, softcap=2.0, alibi_slopes=slopes, backend="triton")
        do = randn(*out.shape, dtype=dtype)
        grads = torch.autograd.grad(out, (q, k, v), do)
    alibi = reference.alibi_bias(slopes, Sq, Sk, device=DEVICE)

    def ref_fn(q, k, v):
        return reference.attention(q, k, v, causal=True, softcap=2.0, alibi=alibi.to(q.dtype))

    leaves64, leaves_e = to64(q, k, v), to_dtype(dtype, q, k, v)
    ref, eager = ref_fn(*leaves64), ref_fn(*leaves_e)
    assert_close_to_reference("out", out, ref, eager)
    _check_grads(grads, torch.autograd.grad(ref, leaves64, do.to(torch.float64)),
                 torch.autograd.grad(eager, leaves_e, do), ("dq", "dk", "dv"))


@pytest.mark.parametrize("dtype", KERNEL_DTYPES[:2], ids=dtype_id)
@pytest.mark.parametrize("gqa_split", [True, False], ids=["gqa-split", "gqa-in-registers"])
def test_split_gqa_dkdv_partials(gqa_split, dtype):
    """dK/dV split over the GQA group (one program per q head, fp32 partials summed on the host) and
    reduced in registers, at 192/128 with 4 q heads per K/V head, causal."""
    torch.manual_seed(13)
    B, Sq, Sk, scale = 1, 50, 70, 192 ** -0.5
    q = randn(B, 4, Sq, 192, dtype=dtype)
    k = randn(B, 1, Sk, 192, dtype=dtype)
    v = randn(B, 1, Sk, 128, dtype=dtype)
    do = randn(B, 4, Sq, 128, dtype=dtype)
    with poisoned_allocations():
        out, m2, l2 = attention_forward(q, k, v, scale=scale, causal=True)
        grads = attention_backward(do, q, k, v, out, m2, l2, scale=scale, causal=True, gqa_split=gqa_split)
    leaves64, leaves_e = to64(q, k, v), to_dtype(dtype, q, k, v)
    ref = reference.attention(*leaves64, scale=scale, causal=True)
    eager = reference.attention(*leaves_e, scale=scale, causal=True)
    assert_close_to_reference("out", out, ref, eager)
    _check_grads(grads, torch.autograd.grad(ref, leaves64, do.to(torch.float64)),
                 torch.autograd.grad(eager, leaves_e, do), ("dq", "dk", "dv"))


def test_split_dropout_equals_reference_with_the_kernels_own_mask():
    """Dropout's keep mask scales dV's P and dP in both pieces: 160/80 (128 + 32, 64 + 16), causal, GQA."""
    torch.manual_seed(14)
    B, HQ, HKV, Sq, Sk, p = 1, 2, 1, 33, 41, 0.25
    q = randn(B, Sq, HQ, 160, dtype=PRECISE_DTYPE, requires_grad=True)
    k = randn(B, Sk, HKV, 160, dtype=PRECISE_DTYPE, requires_grad=True)
    v = randn(B, Sk, HKV, 80, dtype=PRECISE_DTYPE, requires_grad=True)
    torch.manual_seed(46)
    _, _, probs = flashtx.flash_attn_func(q, k, v, dropout_p=p, causal=True, return_attn_probs=True, backend="triton")
    torch.manual_seed(46)
    out = flashtx.flash_attn_func(q, k, v, dropout_p=p, causal=True, backend="triton")
    grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    keep = probs >= 0
    leaves = to64(q, k, v)
    ref = reference.attention(*(t.transpose(1, 2) for t in leaves), causal=True, bottom_right=True, keep=keep,
                              dropout_p=p).transpose(1, 2)
    ref_grads = torch.autograd.grad(ref, leaves, torch.ones_like(ref))
    assert torch.allclose(out.double(), ref, atol=precise_atol(1e-12))
    for a, b in zip(grads, ref_grads):
        assert torch.allclose(a.double(), b, atol=precise_atol(1e-11))
    assert (probs < 0).any()  # something was dropped


@pytest.mark.skipif(ON_GPU, reason="float64 Triton kernels run only in the interpreter")
@pytest.mark.parametrize("dqk,dv,bias", [(192, 96, False), (80, 48, True)], ids=["192-96-gqa", "80-48-attn_mask"])
def test_gradcheck_float64_at_split_head_dims(dqk, dv, bias):
    """float64 gradcheck through the split backward (small: the interpreter is slow), with an attn_mask
    that requires grad in the second case."""
    torch.manual_seed(15)
    q = torch.randn(1, 2, 13, dqk, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 1 if not bias else 2, 17, dqk, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, k.shape[1], 17, dv, dtype=torch.float64, requires_grad=True)
    inputs = (q, k, v) + ((torch.randn(1, 2, 13, 17, dtype=torch.float64, requires_grad=True),) if bias else ())

    def fn(q, k, v, b=None):
        return flashtx.attention(q, k, v, attn_mask=b, is_causal=b is None, enable_gqa=True, backend="triton")

    assert gradcheck_each_input(fn, inputs)
