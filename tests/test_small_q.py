"""Decoding through flashtx.attention / flash_attn_func / the patched SDPA (flashtx._small_q): a few queries
without autograd run the split-KV decode kernels. Against the float64 reference under the tolerance rule, in
every layout; the calls the decode kernels must not take run the training forward; the output keeps q's
memory order; SMALL_Q_DECODE turns it off."""
import pytest
import torch
from conftest import DEVICE, KERNEL_DTYPES, assert_close_to_reference, dtype_id, poisoned_allocations, randn

import flashtx
from flashtx import _small_q, reference


@pytest.fixture
def routes(monkeypatch):
    """The ops each call ran: 'decode' (the decode kernels) or 'train' (the training forward)."""
    seen = []
    real_decode, real_run = _small_q.call, flashtx.functional.call

    def decode(op, *args):
        seen.append("decode")
        return real_decode(op, *args)

    def train(op, *args):
        seen.append("train" if op is flashtx._attention_op.attn_fwd else op._name)
        return real_run(op, *args)

    monkeypatch.setattr(_small_q, "call", decode)
    monkeypatch.setattr(flashtx.functional, "call", train)
    return seen


def _ref(q, k, v, *, causal=False, bottom_right=False, window=(-1, -1), softcap=0.0, alibi=None, dtype=None):
    """out, lse of the reference in `dtype` (float64: the ground truth; q's dtype: the eager baseline)."""
    dtype = dtype or torch.float64
    q, k, v = (t.to(dtype) for t in (q, k, v))
    Sq, Sk = q.shape[2], k.shape[2]
    vis = reference.visibility(Sq, Sk, causal=causal, bottom_right=bottom_right, window=window, device=q.device)
    bias = None if alibi is None else reference.alibi_bias(alibi, Sq, Sk, device=q.device).to(dtype)
    return reference.attention(q, k, v, vis=vis, softcap=softcap, alibi=bias, return_lse=True)


CASES = [  # (B, Hq, Hkv, Sq, Sk, D, Dv)
    (2, 8, 2, 1, 100, 64, 64),  # GQA 4, one token
    (3, 4, 4, 1, 37, 32, 48),  # MHA, Dv != D
    (1, 6, 1, 3, 70, 64, 64),  # MQA, speculative decoding
    (2, 4, 2, 16, 300, 16, 16),  # the most queries routed
    (2, 2, 1, 1, 0, 32, 32),  # no keys: zeros, lse -inf
    (1, 4, 2, 5, 5, 32, 32),  # Sq = Sk
]


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "b{}-h{}x{}-q{}-k{}-d{}x{}".format(*c))
@pytest.mark.parametrize("api", ["flash", "attention", "hf-views"])
def test_few_queries_run_the_decode_kernels(routes, case, dtype, api):
    B, Hq, Hkv, Sq, Sk, D, Dv = case
    q, k, v = randn(B, Sq, Hq, D, dtype=dtype), randn(B, Sk, Hkv, D, dtype=dtype), randn(B, Sk, Hkv, Dv, dtype=dtype)
    causal = Sq > 1 and (api == "flash" or Sq == Sk)  # attention's is top-left: the same as bottom-right at Sq = Sk
    lse = None
    with torch.no_grad(), poisoned_allocations():  # an output the kernels leave unwritten is NaN
        if api == "flash":  # (B, S, H, D), causal bottom-right
            out = flashtx.flash_attn_func(q, k, v, causal=causal).transpose(1, 2)  # (return_attn_probs: not routed)
        else:  # (B, H, S, D): contiguous, or views of (B, S, H, D) tensors as transformers makes them
            qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
            if api == "attention":
                qh, kh, vh = (t.contiguous() for t in (qh, kh, vh))
            out, lse = flashtx.attention(qh, kh, vh, is_causal=causal, enable_gqa=True, return_lse=True)
    if api == "attention" and Sq > 1:  # q laid out (B, Hq, Sq, D): the training forward keeps that order
        assert routes == ["train"] and out.is_contiguous(), (routes, out.stride())
    else:
        assert routes == ["decode"], routes
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
    want, want_lse = _ref(qh, kh, vh, causal=causal, bottom_right=True)
    eager, eager_lse = _ref(qh, kh, vh, causal=causal, bottom_right=True, dtype=dtype)
    assert_close_to_reference("out", out, want, eager)
    if lse is not None and Sk:
        assert_close_to_reference("lse", lse, want_lse, eager_lse.to(lse.dtype))
    elif lse is not None:
        assert torch.isneginf(lse).all() and (out == 0).all()


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=dtype_id)
def test_score_modifiers_and_bottom_right_windows_are_the_decode_kernels_too(routes, dtype):
    B, Hq, Hkv, Sq, Sk, D = 2, 4, 2, 3, 90, 32
    q, k, v = randn(B, Sq, Hq, D, dtype=dtype), randn(B, Sk, Hkv, D, dtype=dtype), randn(B, Sk, Hkv, D, dtype=dtype)
    slopes = torch.rand(B, Hq, device=DEVICE) * 0.3
    kw = dict(window=(20, 0), softcap=3.0, alibi=slopes)
    with torch.no_grad():
        out = flashtx.flash_attn_func(q, k, v, causal=True, window_size=(20, 0), softcap=3.0, alibi_slopes=slopes)
    assert routes == ["decode"]
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
    want, _ = _ref(qh, kh, vh, causal=True, bottom_right=True, **kw)
    eager, _ = _ref(qh, kh, vh, causal=True, bottom_right=True, dtype=dtype, **kw)
    assert_close_to_reference("out", out.transpose(1, 2), want, eager)


def test_calls_the_decode_kernels_must_not_take_run_the_training_forward(routes):
    dt = torch.float32
    q, k, v = randn(2, 4, 3, 16, dtype=dt), randn(2, 4, 40, 16, dtype=dt), randn(2, 4, 40, 16, dtype=dt)
    grad_q = q.clone().requires_grad_()
    calls = {
        "autograd": lambda: flashtx.attention(grad_q, k, v),
        "top-left causal, Sq < Sk": lambda: flashtx.attention(q, k, v, is_causal=True),
        "top-left window, Sq < Sk": lambda: flashtx.attention(q, k, v, window_size=(8, 0)),
        "key_mask": lambda: flashtx.attention(q, k, v, key_mask=torch.ones(2, 40, dtype=torch.bool, device=DEVICE)),
        "kv_lens": lambda: flashtx.attention(q, k, v, kv_lens=torch.tensor([40, 7], device=DEVICE)),
        "attn_mask": lambda: flashtx.attention(q, k, v, attn_mask=torch.zeros(3, 40, device=DEVICE)),
        "dropout": lambda: flashtx.attention(q, k, v, dropout_p=0.5),
        "17 queries": lambda: flashtx.attention(randn(2, 17, 4, 16, dtype=dt).transpose(1, 2), k, v),
        "3 queries laid out (B, Hq, Sq, D)": lambda: flashtx.attention(q, k, v),
        "flash_attn_func, 3 queries laid out (B, Hq, Sq, D)": lambda: flashtx.flash_attn_func(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)),
        "strided last dim": lambda: flashtx.attention(randn(2, 4, 3, 32, dtype=dt)[..., ::2], k, v),
        "backend='reference'": lambda: flashtx.attention(q, k, v, backend="reference"),
    }
    for name, fn in calls.items():
        routes.clear()
        with torch.no_grad() if name != "autograd" else torch.enable_grad():
            fn()
        assert "decode" not in routes and routes[:1] in (["train"], []), (name, routes)
    calls = {  # the same, one query: the decode kernels
        "backend='triton'": lambda: flashtx.attention(q[:, :, :1], k, v, backend="triton"),
        "top-left causal, Sq = 1": lambda: flashtx.attention(q[:, :, :1], k[:, :, :1], v[:, :, :1], is_causal=True),
        "3 queries laid out (B, Sq, Hq, D)": lambda: flashtx.attention(q.transpose(1, 2).contiguous().transpose(1, 2),
                                                                       k, v),
    }
    for name, fn in calls.items():
        routes.clear()
        with torch.no_grad():
            fn()
        assert routes == ["decode"], (name, routes)


def test_small_q_decode_off_runs_the_training_forward(routes, monkeypatch):
    q, k, v = randn(1, 1, 4, 32), randn(1, 50, 2, 32), randn(1, 50, 2, 32)
    with torch.no_grad():
        on = flashtx.flash_attn_func(q, k, v)
        monkeypatch.setattr(_small_q, "SMALL_Q_DECODE", False)
        off = flashtx.flash_attn_func(q, k, v)
    assert routes == ["decode", "train"]
    assert (on - off).abs().max() < 1e-5


def test_patched_sdpa_decodes_through_the_decode_kernels(routes):
    q, k, v = randn(2, 8, 1, 64), randn(2, 8, 200, 64), randn(2, 8, 200, 64)
    with torch.no_grad():
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        with flashtx.patch_sdpa():
            got = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    assert routes == ["decode"]
    assert (got - want).abs().max() < 1e-5
