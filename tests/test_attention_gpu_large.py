"""GPU only: the mask, bias and score-modifier paths at sequence length 4k in fp16 and bf16 (issue 5's
and 6's GPU part), under the tolerance rule against a float64 reference on the GPU.

Skipped without a CUDA GPU (the interpreter tests cover the same code paths at small shapes).
bench/device_check.sh runs them in its `pytest tests (GPU)` step.
"""
import pytest
import torch
from conftest import ON_GPU, assert_close_to_reference, randn, to64, to_dtype

import flashtx
from flashtx import reference

pytestmark = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU: 4k-token checks of the fast kernels")

B, H, HKV, S, D = 1, 4, 2, 4096, 64


def _slopes():
    return torch.tensor([2 ** (-8 * (h + 1) / H) for h in range(H)], device="cuda")


CASES = {
    # name: (flash_attn_func kwargs builder, reference kwargs builder); flash layout, bottom-right causal
    "bias-causal": (lambda t: dict(causal=True, attn_bias=t["bias"]), lambda t: dict(causal=True, bias=t["bias"])),
    "window-keymask-lens": (
        lambda t: dict(causal=True, window_size=(1000, -1), key_mask=t["km"], kv_lens=t["kl"], q_lens=t["kl"]),
        lambda t: dict(vis=reference.visibility(S, S, batch=B, causal=True, bottom_right=True, window=(1000, -1),
                                                key_mask=t["km"], kv_lens=t["kl"], q_lens=t["kl"], device="cuda"))),
    "softcap-alibi": (lambda t: dict(causal=True, softcap=30.0, alibi_slopes=_slopes()),
                      lambda t: dict(causal=True, softcap=30.0, alibi=reference.alibi_bias(_slopes(), S, S,
                                                                                         device="cuda"))),
}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("name", list(CASES))
def test_large_masked_paths(name, dtype):
    torch.manual_seed(61)
    q, k, v = randn(B, S, H, D, dtype=dtype), randn(B, S, HKV, D, dtype=dtype), randn(B, S, HKV, D, dtype=dtype)
    t = {"bias": randn(1, H, S, S, dtype=dtype, scale=0.5), "km": torch.rand(B, S, device="cuda") > 0.1,
         "kl": torch.tensor([S - 77], device="cuda")}
    flash_kw, ref_kw = CASES[name]
    leaves = [x.requires_grad_() for x in (q, k, v)]
    if name == "bias-causal":
        leaves.append(t["bias"].requires_grad_())
    out = flashtx.flash_attn_func(q, k, v, backend="triton", **flash_kw(t))
    dout = randn(*out.shape, dtype=dtype)
    grads = torch.autograd.grad(out, leaves, dout)
    results = []
    for ins in (to64(*leaves), to_dtype(dtype, *leaves)):
        tt = dict(t, bias=ins[3]) if name == "bias-causal" else t
        o = reference.attention(*(x.transpose(1, 2) for x in ins[:3]), bottom_right=True, **ref_kw(tt)).transpose(1, 2)
        results.append((o, torch.autograd.grad(o, ins, dout.to(o.dtype))))
        del o
    (o64, g64), (oe, ge) = results
    assert_close_to_reference("out", out, o64, oe)
    for gname, g, r, e in zip(("dq", "dk", "dv", "dbias"), grads, g64, ge):
        assert_close_to_reference(gname, g, r, e, grad=True)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
def test_large_dropout_equals_reference_with_its_own_mask(dtype):
    torch.manual_seed(62)
    s = 2048
    q, k, v = (randn(B, s, H, D, dtype=dtype) for _ in range(3))
    torch.manual_seed(63)
    out, _, probs = flashtx.flash_attn_func(q, k, v, causal=True, dropout_p=0.2, return_attn_probs=True)
    keep = probs >= 0
    ref = reference.attention(*(x.double().transpose(1, 2) for x in (q, k, v)), causal=True, bottom_right=True,
                              keep=keep, dropout_p=0.2).transpose(1, 2)
    eager = reference.attention(*(x.transpose(1, 2) for x in (q, k, v)), causal=True, bottom_right=True,
                                keep=keep, dropout_p=0.2).transpose(1, 2)
    assert_close_to_reference("out", out, ref, eager)
    vis_frac = (probs < 0).sum().item() / (B * H * s * (s + 1) / 2)
    assert 0.19 < vis_frac < 0.21
