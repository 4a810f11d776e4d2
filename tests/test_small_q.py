"""Decoding through flashtx.attention / flash_attn_func / the patched SDPA (flashtx._small_q): a few queries
without autograd run the split-KV decode kernels. Against the float64 reference under the tolerance rule, in
every layout; the calls the decode kernels must not take run the training forward; the output is laid out
(B, Sq, Hq, Dv) in memory, as the training forward's; SMALL_Q_DECODE turns it off."""
import pytest
import torch
from conftest import (DEVICE, KERNEL_DTYPES, PRECISE_DTYPE, assert_close_to_reference, dtype_id, poisoned_allocations,
                      precise_atol, randn)

import flashtx
from flashtx import _small_q, _validate, reference


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
    (1, 4, 2, 5, 6, 32, 32),  # one key more than queries (routed; Sk <= Sq runs the training forward)
]


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "b{}-h{}x{}-q{}-k{}-d{}x{}".format(*c))
@pytest.mark.parametrize("api", ["flash", "attention", "hf-views"])
def test_few_queries_run_the_decode_kernels(routes, case, dtype, api):
    B, Hq, Hkv, Sq, Sk, D, Dv = case
    q, k, v = randn(B, Sq, Hq, D, dtype=dtype), randn(B, Sk, Hkv, D, dtype=dtype), randn(B, Sk, Hkv, Dv, dtype=dtype)
    causal = Sq > 1 and api == "flash"  # attention's is top-left: the training forward's, with Sq < Sk
    lse = None
    with torch.no_grad(), poisoned_allocations():  # an output the kernels leave unwritten is NaN
        if api == "flash":  # (B, S, H, D), causal bottom-right
            out = flashtx.flash_attn_func(q, k, v, causal=causal).transpose(1, 2)  # (return_attn_probs: not routed)
        else:  # (B, H, S, D): contiguous, or views of (B, S, H, D) tensors as transformers makes them
            qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
            if api == "attention":
                qh, kh, vh = (t.contiguous() for t in (qh, kh, vh))
            out, lse = flashtx.attention(qh, kh, vh, is_causal=causal, enable_gqa=True, return_lse=True)
    assert routes == ["decode"], routes  # q in any layout: out is (B, Sq, Hq, Dv) in memory either way
    assert out.transpose(1, 2).is_contiguous(), out.stride()
    # attention's (B, Hq, Sq, Dv) out is a tensor of its own, not a transposed view of the op's output: returned
    # from a compiled function, such a view made torch 2.15 guard on Sq != Hq (a recompile where they met)
    assert api == "flash" or out._base is None
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
    want, want_lse = _ref(qh, kh, vh, causal=causal, bottom_right=True)
    eager, _ = _ref(qh, kh, vh, causal=causal, bottom_right=True, dtype=dtype)
    assert_close_to_reference("out", out, want, eager)
    if lse is not None:  # lse is float32 for 16-bit inputs: its eager baseline is the reference in float32 on
        # float32 copies (an fp16 eager lse cast up errs ~1,000x more and would pass an lse rounded through fp16)
        _, eager_lse = _ref(qh, kh, vh, causal=causal, bottom_right=True, dtype=lse.dtype)
        assert eager_lse.dtype == lse.dtype
        assert_close_to_reference("lse", lse, want_lse, eager_lse)


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
    """Each call is a routed one (q laid out (B, Sq, Hq, D), as transformers' views) with one thing changed."""
    dt = torch.float32
    q = randn(2, 3, 4, 16, dtype=dt).transpose(1, 2)  # (B, Hq, Sq, D) view of a (B, Sq, Hq, D) tensor
    k, v = (randn(2, 40, 4, 16, dtype=dt).transpose(1, 2) for _ in range(2))
    with torch.no_grad():
        flashtx.attention(q, k, v)
    assert routes == ["decode"], routes
    grad_q = q.detach().clone().requires_grad_()
    calls = {
        "autograd": lambda: flashtx.attention(grad_q, k, v),
        "top-left causal, Sq < Sk": lambda: flashtx.attention(q, k, v, is_causal=True),
        "top-left window, Sq < Sk": lambda: flashtx.attention(q, k, v, window_size=(8, 0)),
        "top-left window (2, 36), Sq < Sk": lambda: flashtx.attention(q, k, v, window_size=(2, 36)),
        "query_mask": lambda: flashtx.attention(q, k, v, query_mask=torch.ones(2, 3, dtype=torch.bool, device=DEVICE)),
        "kv_lens": lambda: flashtx.attention(q, k, v, kv_lens=torch.tensor([40, 7], device=DEVICE)),
        "attn_mask": lambda: flashtx.attention(q, k, v, attn_mask=torch.zeros(3, 40, device=DEVICE)),
        "float attn_mask over keys": lambda: flashtx.attention(q, k, v, attn_mask=torch.zeros(2, 1, 1, 40,
                                                                                              device=DEVICE)),
        "bool attn_mask per head": lambda: flashtx.attention(q, k, v, attn_mask=_keys_seen(2, 4, 1, 40)),
        "bool attn_mask and key_mask": lambda: flashtx.attention(
            q, k, v, attn_mask=_keys_seen(2, 1, 1, 40), key_mask=torch.ones(2, 40, dtype=torch.bool, device=DEVICE)),
        "dropout": lambda: flashtx.attention(q, k, v, dropout_p=0.5),
        "17 queries": lambda: flashtx.attention(randn(2, 17, 4, 16, dtype=dt).transpose(1, 2), k, v),
        "strided last dim": lambda: flashtx.attention(randn(2, 3, 4, 32, dtype=dt)[..., ::2].transpose(1, 2), k, v),
        "backend='reference'": lambda: flashtx.attention(q, k, v, backend="reference"),
        "SMALL_Q_MAX lowered": lambda: _with_max(2, lambda: flashtx.attention(q, k, v)),
        "Sq = Sk": lambda: flashtx.attention(q, k[:, :, :3], v[:, :, :3]),
        "Sq = Sk = 1, top-left causal": lambda: flashtx.attention(q[:, :, :1], k[:, :, :1], v[:, :, :1],
                                                                  is_causal=True),
        "Sq > Sk, bottom-right causal": lambda: flashtx.flash_attn_func(q.transpose(1, 2), k[:, :, :2].transpose(1, 2),
                                                                        v[:, :, :2].transpose(1, 2), causal=True),
        "no keys": lambda: flashtx.attention(q, k[:, :, :0], v[:, :, :0]),
    }
    for name, fn in calls.items():
        routes.clear()
        with torch.no_grad() if name != "autograd" else torch.enable_grad():
            fn()
        assert "decode" not in routes and routes[:1] in (["train"], []), (name, routes)
    calls = {  # the same with one query, or laid out as the decode kernels write: the decode kernels
        "backend='triton'": lambda: flashtx.attention(q[:, :, :1], k, v, backend="triton"),
        "one key more than queries": lambda: flashtx.attention(q, k[:, :, :4], v[:, :, :4]),
        "one query laid out (B, Hq, Sq, D)": lambda: flashtx.attention(q[:, :, :1].contiguous(), k, v),
        # any q layout: attention's output is (B, Sq, Hq, Dv) in memory whatever q's, as the decode kernels write it
        "q laid out (B, Hq, Sq, D)": lambda: flashtx.attention(q.contiguous(), k, v),
        "flash_attn_func, q laid out (B, Hq, Sq, D)": lambda: flashtx.flash_attn_func(
            q.contiguous().transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)),
        "flash_attn_func, q laid out (Sq, B, Hq, D)": lambda: flashtx.flash_attn_func(
            randn(3, 2, 4, 16, dtype=dt).transpose(0, 1), k.transpose(1, 2), v.transpose(1, 2)),
        "one query laid out (Hq, B, D)": lambda: flashtx.attention(
            randn(4, 3, 16, dtype=dt).permute(1, 0, 2)[:, :, None], randn(3, 4, 20, 16, dtype=dt),
            randn(3, 4, 20, 16, dtype=dt)),
        "16 queries": lambda: flashtx.attention(randn(2, 16, 4, 16, dtype=dt).transpose(1, 2), k, v),
        "key_mask": lambda: flashtx.attention(q, k, v, key_mask=torch.ones(2, 40, dtype=torch.bool, device=DEVICE)),
        "bool attn_mask over keys": lambda: flashtx.attention(q, k, v, attn_mask=_keys_seen(2, 1, 1, 40)),
        "bool attn_mask per query": lambda: flashtx.attention(q, k, v, attn_mask=_keys_seen(2, 1, 3, 40)),
        "top-left window (2, 37), Sq < Sk": lambda: flashtx.attention(q, k, v, window_size=(2, 37)),
    }
    for name, fn in calls.items():
        routes.clear()
        with torch.no_grad():
            fn()
        assert routes == ["decode"], (name, routes)


def _keys_seen(*shape):
    """A bool attn_mask of `shape`, True = attend, every row seeing some key."""
    m = torch.rand(shape, device=DEVICE) < 0.7
    m[..., 0] = True
    return m


def _with_max(n, fn):
    was, _small_q.SMALL_Q_MAX = _small_q.SMALL_Q_MAX, n
    try:
        return fn()
    finally:
        _small_q.SMALL_Q_MAX = was


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=dtype_id)
def test_more_routed_calls_match_the_reference(routes, dtype, monkeypatch):
    """ALiBi (H,) slopes with a top-left window through attention (its bounds shifted to bottom-right ones),
    3-D and 5-D inputs; slopes that require grad are warned about (the kernels give them no gradient)."""
    B, Hq, Hkv, D = 2, 4, 2, 32
    q, k, v = randn(B, 3, Hq, D, dtype=dtype), randn(B, 7, Hkv, D, dtype=dtype), randn(B, 7, Hkv, D, dtype=dtype)
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
    slopes = (torch.rand(Hq, device=DEVICE) * 0.5).requires_grad_()
    monkeypatch.setattr(_validate, "_warned_alibi", [])
    with pytest.warns(UserWarning, match="alibi_slopes requires grad"):
        out = flashtx.attention(qh, kh, vh, window_size=(2, 4), alibi_slopes=slopes, enable_gqa=True)
    assert out.grad_fn is None  # slopes get no gradient, as on the training forward
    kw = dict(window=(2, 4), alibi=slopes.detach())
    want, eager = _ref(qh, kh, vh, **kw)[0], _ref(qh, kh, vh, dtype=dtype, **kw)[0]
    assert_close_to_reference("out, ALiBi + window", out, want, eager)

    q3, k3 = randn(Hq, 1, D, dtype=dtype), randn(Hq, 9, D, dtype=dtype)
    with torch.no_grad():  # (H, S, D) and (B1, B2, H, S, D) inputs
        out3 = flashtx.attention(q3, k3, k3)
        out5 = flashtx.attention(qh[None, :, :, :1], kh[None].repeat_interleave(2, 2), vh[None].repeat_interleave(2, 2))
    want3, eager3 = _ref(q3[None], k3[None], k3[None])[0], _ref(q3[None], k3[None], k3[None], dtype=dtype)[0]
    assert_close_to_reference("out, 3-D", out3, want3[0], eager3[0])
    ke, ve = kh.repeat_interleave(2, 1), vh.repeat_interleave(2, 1)
    want5, eager5 = _ref(qh[:, :, :1], ke, ve), _ref(qh[:, :, :1], ke, ve, dtype=dtype)
    assert_close_to_reference("out, 5-D", out5[0], want5[0], eager5[0])
    assert routes == ["decode"] * 3, routes


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


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("Sq", [1, 3])
def test_padded_batches_as_transformers_decodes_them(routes, dtype, Sq):
    """A (B, Sk) key mask (left padding, a hole, a row with no real key) with transformers' top-left window
    (-1, Sk - Sq) (the bottom-right causal mask), and a top-left window with a left bound, through attention."""
    B, Hq, Hkv, Sk, D = 3, 4, 2, 50, 32
    q = randn(B, Sq, Hq, D, dtype=dtype).transpose(1, 2)  # (B, Hq, Sq, D) views, as transformers makes them
    k, v = (randn(B, Sk, Hkv, D, dtype=dtype).transpose(1, 2) for _ in range(2))
    key_mask = torch.ones(B, Sk, dtype=torch.bool, device=DEVICE)
    key_mask[0, :7] = False  # left padding
    key_mask[1, 20:23] = False  # a hole
    key_mask[2] = False  # no real key: 0 output, lse -inf
    for window in ((-1, Sk - Sq), (5, Sk - Sq)):
        routes.clear()
        with torch.no_grad():
            out, lse = flashtx.attention(q, k, v, key_mask=key_mask, window_size=window, enable_gqa=True,
                                         return_lse=True)
        assert routes == ["decode"], (window, routes)
        vis = reference.visibility(Sq, Sk, batch=B, window=window, key_mask=key_mask, device=DEVICE)
        want, want_lse = reference.attention(q.double(), k.double(), v.double(), vis=vis, return_lse=True)
        eager = reference.attention(q, k, v, vis=vis)
        assert_close_to_reference(f"out, window {window}", out[:2], want[:2], eager[:2])
        assert (out[2] == 0).all() and torch.isneginf(lse[2]).all()
        assert (lse[:2].double() - want_lse[:2]).abs().max() < 1e-2


def test_kvcache_attention_without_lengths_is_attention_over_the_first_snew_keys():
    """The op flashtx._small_q calls: cache_seqlens None, snew = 11 of a 20-row cache; Triton and the reference
    backend against the float64 reference over those 11 keys, out in both layouts (heads_first: SDPA's shape as a
    tensor of its own, not a view)."""
    q = randn(2, 1, 4, 32, dtype=PRECISE_DTYPE)
    kc, vc = (randn(2, 20, 2, 32, dtype=PRECISE_DTYPE) for _ in range(2))
    want, want_lse = _ref(q.transpose(1, 2), kc[:, :11].transpose(1, 2), vc[:, :11].transpose(1, 2))
    for backend in ("triton", "reference"):
        for heads_first in (False, True):
            out, lse2 = torch.ops.flashtx.kvcache_attention(q, kc, vc, None, None, None, None, None, None,
                                                            32 ** -0.5, False, -1, -1, 0.0, 0, 11, backend, heads_first)
            # heads_first: (B, Hq, Sq, Dv) laid out (B, Sq, Hq, Dv), a tensor of its own; else (B, Sq, Hq, Dv)
            B, Sq, Hq, Dv = q.shape
            shape = (B, Hq, Sq, Dv) if heads_first else (B, Sq, Hq, Dv)
            layout = (Sq * Hq * Dv, Dv, Hq * Dv, 1) if heads_first else (Sq * Hq * Dv, Hq * Dv, Dv, 1)
            assert (out._base, out.shape, out.stride()) == (None, shape, layout), (backend, heads_first)
            got = out if heads_first else out.transpose(1, 2)
            assert (got - want).abs().max() < precise_atol(1e-12), (backend, heads_first)
            assert (lse2 * _small_q.LN2 - want_lse).abs().max() < precise_atol(1e-12), (backend, heads_first)


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("shape", [(3, 1, 1, 50), (1, 1, 1, 50), (50,), (3, 1, 1, 1)], ids=str)
@pytest.mark.parametrize("Sq", [1, 3])
def test_bool_masks_over_keys_are_key_masks(routes, dtype, shape, Sq):
    """A bool attn_mask broadcast over heads and queries (transformers' static-cache decoding step passes
    (B, 1, 1, Sk)) runs the decode kernels as a key mask: per batch row or for all, over keys or all-or-none,
    with a row that sees no key (0, lse -inf), against the float64 reference."""
    B, Hq, Hkv, Sk, D = 3, 4, 2, 50, 32
    q = randn(B, Sq, Hq, D, dtype=dtype).transpose(1, 2)  # (B, Hq, Sq, D) views, as transformers makes them
    k, v = (randn(B, Sk, Hkv, D, dtype=dtype).transpose(1, 2) for _ in range(2))
    mask = torch.rand(shape, device=DEVICE) < 0.6
    mask.view(-1)[-1] = True  # the last batch row sees a key
    if mask.dim() == 4 and mask.shape[0] == B:
        mask[0] = False  # a batch row that sees no key
    with torch.no_grad():
        out, lse = flashtx.attention(q, k, v, attn_mask=mask, enable_gqa=True, return_lse=True)
    assert routes == ["decode"], routes
    key_mask = torch.broadcast_to(mask, (B, 1, 1, Sk))[:, 0, 0]  # (B, Sk)
    vis = reference.visibility(Sq, Sk, batch=B, key_mask=key_mask, device=DEVICE)
    want, want_lse = reference.attention(q.double(), k.double(), v.double(), vis=vis, return_lse=True)
    eager = reference.attention(q, k, v, vis=vis)
    seen = key_mask.any(1)  # (B,) rows with a key
    assert_close_to_reference("out", out[seen], want[seen], eager[seen])
    assert (out[~seen] == 0).all() and torch.isneginf(lse[~seen]).all()
    assert (lse[seen].double() - want_lse[seen]).abs().max() < 1e-2


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("shape", ["B1QK", "11QK", "B1Q1", "QK"])
@pytest.mark.parametrize("Sq", [2, 5])
def test_bool_masks_per_query_are_rows_of_the_key_mask(routes, dtype, shape, Sq):
    """A bool attn_mask over queries and keys, the same for every head (transformers' static-cache step with
    several new tokens, speculative decoding's tree masks: (B, 1, Sq, max_len)), runs the decode kernels with a
    mask row per query: a static cache's causal rows behind left padding, random rows, a query that sees no key
    (0, lse -inf), a batch row that sees none, against the float64 reference."""
    B, Hq, Hkv, Sk, D = 3, 4, 2, 50, 32
    q = randn(B, Sq, Hq, D, dtype=dtype).transpose(1, 2)  # (B, Hq, Sq, D) views, as transformers makes them
    k, v = (randn(B, Sk, Hkv, D, dtype=dtype).transpose(1, 2) for _ in range(2))
    j, i = torch.arange(Sk, device=DEVICE), torch.arange(Sq, device=DEVICE)
    lead = torch.tensor([0, 7, 3], device=DEVICE)[:, None, None]  # (B, 1, 1) left padding
    full = (j <= 30 + i[:, None]) & (j >= lead)  # (B, Sq, Sk): Sq new tokens at 30.. of a static cache
    full[1] &= torch.rand(Sq, Sk, device=DEVICE) < 0.7  # random rows (a tree's)
    full[1, 0] = False  # a query that sees no key
    full[2] = False  # a batch row that sees none
    mask = {"B1QK": full[:, None], "11QK": full[1:2, None], "B1Q1": full[:, None, :, :1].expand(B, 1, Sq, 1).clone(),
            "QK": full[1]}[shape]
    if shape == "B1Q1":
        mask[0, 0, 1:] = False  # all-or-none per query
    with torch.no_grad():
        out, lse = flashtx.attention(q, k, v, attn_mask=mask, enable_gqa=True, return_lse=True)
    assert routes == ["decode"], routes
    vis = torch.broadcast_to(mask, (B, 1, Sq, Sk))[:, 0]  # (B, Sq, Sk)
    want, want_lse = reference.attention(q.double(), k.double(), v.double(), vis=vis, return_lse=True)
    eager = reference.attention(q, k, v, vis=vis)
    seen = vis.any(-1)[:, None, :].expand(B, Hq, Sq)  # (B, Hq, Sq) rows with a key
    assert_close_to_reference("out", out[seen], want[seen], eager[seen])
    assert (out[~seen] == 0).all() and torch.isneginf(lse[~seen]).all()
    assert (lse[seen].double() - want_lse[seen]).abs().max() < 1e-2


def test_growing_keys_memoise_a_signature_on_its_second_call(fresh_plans, monkeypatch):
    """Decoding over keys that grow by a token a call (transformers' DynamicCache) gives the launch cache a new
    signature every call: the route's launches are planned and run without being memoised (memoising each cost
    more than planning it, and a full table dropped every lane), and a signature that comes again is memoised,
    then replayed. Every call computes with its own tensors."""
    from flashtx.triton_kernels import decode, launch

    plans = []
    real = decode.plan_decode
    monkeypatch.setattr(decode, "plan_decode", lambda *a, **kw: plans.append(1) or real(*a, **kw))
    q = randn(2, 4, 1, 16, dtype=PRECISE_DTYPE)

    def step(sk, seed):
        torch.manual_seed(seed)
        k, v = randn(2, 2, sk, 16, dtype=PRECISE_DTYPE), randn(2, 2, sk, 16, dtype=PRECISE_DTYPE)
        with torch.no_grad():
            out = flashtx.attention(q, k, v, enable_gqa=True)
        want = reference.attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1))
        assert (out - want).abs().max() < precise_atol(1e-12)
    decode_entries = lambda: [s for s in launch.LAUNCHES.entries if s[0][0] == "decode"]  # noqa: E731
    for sk in range(20, 25):
        step(sk, sk)
    assert len(plans) == 5 and not decode_entries()  # planned every call, nothing memoised
    step(24, 1)  # the signature again: planned and memoised
    step(24, 2)  # replayed with its own tensors
    assert len(plans) == 6 and len(decode_entries()) == 1
