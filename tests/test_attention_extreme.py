"""Extreme inputs (issue 17, items 3 and 4): rows whose scores all tie at a huge finite value, and
int64 lengths beyond int32.

A float attn_mask of -1e9 or torch.finfo(torch.float32).min (as Hugging Face builds masks) on a
whole row makes every score of that row the same huge number: fp32 SDPA gives the uniform softmax
(the mean of V) there, and so must both backends, forward and backward. Rows masked with -inf keep
flashtx's documented 0 output and -inf lse.

Window bounds near and past int32 mean unbounded (a bound >= MAX_SEQ), through every path, and the kernels'
int32 loop bounds do not wrap at sequences of MAX_SEQ.
"""
import pytest
import torch
import triton
import triton.language as tl
from conftest import DEVICE, KERNEL_DTYPES, assert_close_to_reference, dtype_id, randn

import flashtx
from flashtx.testing import FLOOR_ULPS
from flashtx.triton_kernels.attention_common import kv_loop_bounds, q_loop_bounds, seq_bounds

B, H, SQ, SK, D = 1, 2, 21, 37, 16
BACKENDS = ["reference", "triton"]


def _sdpa_fp32(q, k, v, bias):
    """fp32 SDPA (math backend) outputs and gradients: the behaviour to match."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v, bias = (t.detach().float().requires_grad_(True) for t in (q, k, v, bias))
    with sdpa_kernel(SDPBackend.MATH):
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    return out, q, k, v, bias


def _bias(fill: float, partial: bool) -> torch.Tensor:
    """(B, H, SQ, SK) bias of small random values; rows 3..6 fully at `fill` (with partial, rows 8..10
    at `fill` on all but the first five keys)."""
    torch.manual_seed(5)
    bias = torch.randn(B, H, SQ, SK, dtype=torch.float64, device=DEVICE) * 0.5
    bias[:, :, 3:7] = fill
    if partial:
        bias[:, :, 8:11, 5:] = fill
    return bias.float()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fill", [-1e9, torch.finfo(torch.float32).min], ids=["-1e9", "finfo.min"])
@pytest.mark.parametrize("partial", [False, True], ids=["full-rows", "partial-rows"])
def test_rows_tied_at_a_huge_value_match_fp32_sdpa(backend, fill, partial):
    q, k, v = (randn(B, H, s, D, requires_grad=True) for s in (SQ, SK, SK))
    bias = _bias(fill, partial).requires_grad_(True)
    out, lse = flashtx.attention(q, k, v, attn_mask=bias, backend=backend, return_lse=True)
    ref, rq, rk, rv, rb = _sdpa_fp32(q, k, v, bias)
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=1e-5)
    # the tied rows are the uniform softmax: the mean of V
    torch.testing.assert_close(out[:, :, 3:7], v.mean(2, keepdim=True).expand(B, H, 4, D), atol=2e-6, rtol=1e-5)
    # the backends floor the bias at -2**125 (so that bias * log2(e) stays finite in fp32): the lse of a
    # row that ties there is about -2**125, not finfo.min; every other row's is exact
    s = (q.double() @ k.double().transpose(-2, -1)) * D ** -0.5 + bias.double().clamp(min=-2.0 ** 125)
    torch.testing.assert_close(lse.double(), torch.logsumexp(s, -1), atol=1e-5, rtol=1e-6)
    do = randn(B, H, SQ, D)
    dl = randn(B, H, SQ)
    torch.autograd.backward((out, lse), (do, dl))
    s32 = (rq @ rk.transpose(-2, -1)) * D ** -0.5 + rb
    m = s32.amax(-1, keepdim=True).detach()  # torch.logsumexp's fp32 gradient has the very bug fixed here
    torch.autograd.backward((ref, (m + torch.log(torch.exp(s32 - m).sum(-1, keepdim=True))).squeeze(-1)), (do, dl))
    for name, a, r in (("dq", q, rq), ("dk", k, rk), ("dv", v, rv), ("dbias", bias, rb)):
        torch.testing.assert_close(a.grad, r.grad, atol=2e-5, rtol=1e-4, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_rows_at_minus_inf_keep_zero_output_and_lse(backend):
    q, k, v = (randn(B, H, s, D, requires_grad=True) for s in (SQ, SK, SK))
    bias = _bias(float("-inf"), partial=True)
    out, lse = flashtx.attention(q, k, v, attn_mask=bias, backend=backend, return_lse=True)
    assert (out[:, :, 3:7] == 0).all() and torch.isneginf(lse[:, :, 3:7]).all()
    out.sum().backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
    assert (q.grad[:, :, 3:7] == 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_int64_lengths_beyond_int32_are_clamped_not_wrapped(backend):
    """kv_lens = 2**32 + 3 means 'all keys' (clamped to Sk), not 3 (its low 32 bits)."""
    q, k, v = (randn(2, H, s, D) for s in (SQ, SK, SK))
    big = torch.tensor([2**32 + 3, 2**33 + 5], dtype=torch.int64, device=DEVICE)
    neg = torch.tensor([-(2**32) + 4, 7], dtype=torch.int64, device=DEVICE)  # low 32 bits of the first: 4
    out = flashtx.attention(q, k, v, kv_lens=big, q_lens=big, backend=backend)
    torch.testing.assert_close(out, flashtx.attention(q, k, v, backend="reference"), atol=2e-6, rtol=1e-5)
    out = flashtx.attention(q, k, v, kv_lens=neg, backend=backend)
    assert (out[0] == 0).all()  # a negative length clamps to 0: no keys, zero output
    ref = flashtx.attention(q[1:], k[1:, :, :7], v[1:, :, :7], backend="reference")
    torch.testing.assert_close(out[1:], ref, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_probs_and_eager_reference_of_tied_rows_are_uniform(backend, monkeypatch):
    """return_attn_probs (recomputed from the saved row statistics) and flashtx.reference.attention
    give 1 / Sk on rows that tie at a huge value."""
    monkeypatch.setattr(flashtx.functional, "PROBS_WITHOUT_DROPOUT", True)  # (flash-attn's: none without dropout)
    q, k, v = (randn(B, s, H, D) for s in (SQ, SK, SK))  # flash layout (B, S, H, D)
    bias = _bias(torch.finfo(torch.float32).min, partial=False)
    out, lse, probs = flashtx.flash_attn_func(q, k, v, attn_bias=bias, return_attn_probs=True, backend=backend)
    torch.testing.assert_close(probs[:, :, 3:7].float(), torch.full((B, H, 4, SK), 1.0 / SK), atol=1e-7, rtol=1e-6)
    torch.testing.assert_close(probs.sum(-1).float(), torch.ones(B, H, SQ), atol=1e-6, rtol=1e-6)
    ref = flashtx.reference.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), bias=_bias(-1e9, False))
    torch.testing.assert_close(ref[:, :, 3:7], v.transpose(1, 2).mean(2, keepdim=True).expand(B, H, 4, D),
                               atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=dtype_id)
def test_saturated_rows_keep_gradients_within_the_cancellation_floor(backend, dtype):
    """One key dominates every row (scaled logit ~40 above the rest, so P is one-hot to fp64 precision):
    the exact dq and dk are ~1e-13, eager softmax's backward cancels them exactly, and FlashAttention's
    dS = P * (dP - delta) keeps an fp32 ulp of the terms that cancel (README, tolerance rule). out and dv
    are held to the plain rule, dq and dk to the rule with 4 fp32 ulps of scale * |dP| * |K|."""
    torch.manual_seed(11)
    b, h, s, d = 1, 2, 24, 32
    q1 = randn(b, h, 1, d, dtype=torch.float64)
    q1 = q1 / q1.norm(dim=-1, keepdim=True) * (40.0 * d ** 0.5) ** 0.5  # q1 . q1 * d**-0.5 = 40
    q = q1.expand(b, h, s, d).contiguous()
    k = randn(b, h, s, d, dtype=torch.float64) * 0.1
    k[:, :, 5] = q1[:, :, 0]
    v, do = randn(b, h, s, d, dtype=torch.float64), randn(b, h, s, d, dtype=torch.float64)
    q, k = q.to(dtype).double(), k.to(dtype).double()  # exactly representable in dtype
    v, do = v.to(dtype).double(), do.to(dtype).double()
    outs = {}
    for name, fn, dt in (("kernel", lambda *t: flashtx.attention(*t, backend=backend), dtype),
                         ("eager", flashtx.reference.attention, dtype),
                         ("ref64", flashtx.reference.attention, torch.float64)):
        ts = [t.to(dt).clone().requires_grad_(True) for t in (q, k, v)]
        out = fn(*ts)
        out.backward(do.to(dt))
        outs[name] = (out, *(t.grad for t in ts))
    assert (outs["ref64"][1].abs().max() < 1e-10) and (outs["ref64"][2].abs().max() < 1e-10)  # saturated
    cancel = float(d ** -0.5 * (do @ v.transpose(-2, -1)).abs().max() * k.abs().max())
    # the ulps of the terms that cancel are fp32's (the kernels' accumulator): as a magnitude for dtype's floor
    cancel *= FLOOR_ULPS[torch.float32] * torch.finfo(torch.float32).eps / (FLOOR_ULPS[dtype] * torch.finfo(dtype).eps)
    for i, name in enumerate(("out", "dq", "dk", "dv")):
        assert_close_to_reference(name, outs["kernel"][i], outs["ref64"][i], outs["eager"][i], grad=i > 0,
                                  scale=cancel if name in ("dq", "dk") else 0.0)


# Window bounds near and past int32 (audit of 2026-12-02): the kernels add bounds to positions in int32,
# so (0, 2**31 - 1) wrapped to zeros, (2**31 - 1, 0) gave a wrong dK/dV, Sq > Sk with (2**31 - 1, -1)
# looped over ~2**31 keys, and 2**64 raised Triton's OverflowError. A bound >= MAX_SEQ is unbounded.
HUGE = [2**31 - 1, 2**31 + 5, 2**64]
EDGE_WINDOWS = [(0, h) for h in HUGE] + [(h, 0) for h in HUGE] + [(h, -1) for h in HUGE] + [(-1, h) for h in HUGE] \
    + [(2**29 - 1, 3), (5, 2**29 - 1), (2**29, 2**29)]


def _meaning(w):
    """w with each bound that reaches past these short sequences as -1 (what it means)."""
    return tuple(-1 if x >= 64 else x for x in w)


@pytest.mark.parametrize("window", EDGE_WINDOWS, ids=str)
@pytest.mark.parametrize("sq,sk", [(SQ, SK), (SK, SQ)], ids=["sq<sk", "sq>sk"])
def test_window_bounds_past_int32_mean_unbounded(window, sq, sk):
    """flash_attn_func (bottom-right) forward and backward, against the reference with the bounds' meaning."""
    q, k, v = (randn(1, s, H, D, requires_grad=True) for s in (sq, sk, sk))  # (B, S, H, D)
    out = flashtx.flash_attn_func(q, k, v, window_size=window, backend="triton")
    r64 = tuple(t.detach().double().requires_grad_(True) for t in (q, k, v))
    ref = flashtx.flash_attn_func(*r64, window_size=_meaning(window), backend="reference")
    torch.testing.assert_close(out.double(), ref.detach(), atol=2e-6, rtol=1e-5)
    do = randn(1, sq, H, D)
    grads = torch.autograd.grad(out, (q, k, v), do)
    ref_grads = torch.autograd.grad(ref, r64, do.double())
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads):
        torch.testing.assert_close(g.double(), r, atol=2e-5, rtol=1e-4, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("window", [(0, 2**31 - 1), (-1, 2**31 + 5), (2**31 - 1, -1), (2**64, 2**64)], ids=str)
@pytest.mark.parametrize("sq", [1, 3, SK + 2], ids=lambda n: f"sq{n}")
def test_top_left_window_bounds_past_int32_without_grad(window, sq):
    """flashtx.attention (top-left) without grad: a few queries take the split-KV decode kernels, whose
    shifted bounds (right - (Sk - Sq)) wrapped back into range; more queries the training forward."""
    q, k, v = (randn(2, H, s, D) for s in (sq, SK, SK))
    with torch.no_grad():
        out = flashtx.attention(q, k, v, window_size=window, backend="triton")
    ref = flashtx.attention(q.double(), k.double(), v.double(), window_size=_meaning(window), backend="reference")
    torch.testing.assert_close(out.double(), ref, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("window", [(-1, 2**31 - 1), (2**31 - 1, 2**31 - 1), (2**40, 0)], ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["plain", "causal"])
def test_kvcache_window_bounds_past_int32(window, causal):
    """flash_attn_with_kvcache: (-1, 2**31 - 1) over 8 cached keys returned zeros with lse -inf."""
    kc, vc = (randn(2, 32, H, D) for _ in range(2))
    q = randn(2, 3, H, D)
    lens = torch.tensor([8, 20], dtype=torch.int32, device=DEVICE)
    with torch.no_grad():
        out, lse = flashtx.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, window_size=window, causal=causal,
                                                   return_softmax_lse=True)
        ref, ref_lse = flashtx.flash_attn_with_kvcache(q.double(), kc.double(), vc.double(), cache_seqlens=lens,
                                                       window_size=_meaning(window), causal=causal,
                                                       return_softmax_lse=True, backend="reference")
    torch.testing.assert_close(out.double(), ref, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=2e-6, rtol=1e-5)


def test_window_bound_at_max_seq_is_unbounded():
    from flashtx._validate import check_window
    from flashtx.triton_kernels.limits import MAX_SEQ

    assert check_window("w", (MAX_SEQ, MAX_SEQ - 1)) == (-1, MAX_SEQ - 1)
    assert check_window("w", (2**64, 7)) == (-1, 7)


@triton.jit
def _bounds(OUT, Sq, Sk, bottom_right, right, left, m0, n0, BM: tl.constexpr, BN: tl.constexpr):
    """The attention kernels' loop bounds for one tile pair: kv_loop_bounds' then q_loop_bounds' four values."""
    _, _, Sq_b, Sk_b, _, _, cs, ws = seq_bounds(0, Sq, Sk, 0, 0, 0, 0, 0, 0, bottom_right, right, left, False, False)
    a, b, c, d = kv_loop_bounds(m0, Sq_b, Sk_b, cs, ws, BM, BN, True, True, False)
    e, f, g, h = q_loop_bounds(n0, Sq_b, Sk_b, cs, ws, BM, BN, True, True, False)
    tl.store(OUT + 0, a)
    tl.store(OUT + 1, b)
    tl.store(OUT + 2, c)
    tl.store(OUT + 3, d)
    tl.store(OUT + 4, e)
    tl.store(OUT + 5, f)
    tl.store(OUT + 6, g)
    tl.store(OUT + 7, h)


def _cdiv(a, b):
    return -(-a // b)


def _exact_bounds(Sq, Sk, bottom_right, right, left, m0, n0, BM, BN):
    """kv_loop_bounds and q_loop_bounds (CAUSAL and WINDOW, no key mask) in Python ints, which never wrap."""
    align = (Sk - Sq) * bottom_right
    cs, ws = align + right, align - left
    last = min(m0 + BM, Sq) - 1
    hi = min(Sk, max(last + 1 + cs, 0))
    full = min(Sk, max(m0 + 1 + cs, 0))
    lo = max(m0 + ws, 0) // BN * BN
    full_lo = _cdiv(max(last + ws, 0), BN) * BN
    hi = lo if last < m0 else max(hi, lo)
    kv = (lo, full_lo, min(full // BN * BN, hi), hi)
    qhi, free_hi = _cdiv(Sq, BM) * BM, Sq // BM * BM
    qlo = max(n0 - cs, 0) // BM * BM
    free_lo = _cdiv(max(n0 + BN - 1 - cs, qlo), BM) * BM
    qhi = min(qhi, _cdiv(min(Sq, max(n0 + BN - ws, 0)), BM) * BM)
    free_hi = min(free_hi, max(n0 - ws + 1, 0) // BM * BM)
    free_hi = free_lo if n0 + BN > Sk else free_hi
    qhi = 0 if n0 >= Sk else qhi
    return kv + (min(qlo, qhi), free_lo, free_hi, qhi)


@pytest.mark.parametrize("bottom_right", [0, 1], ids=["top-left", "bottom-right"])
def test_loop_bounds_do_not_wrap_at_max_seq(bottom_right):
    """The kernels' int32 loop bounds (seq_bounds, kv_loop_bounds, q_loop_bounds) at sequences of MAX_SEQ and
    the largest bounds check_window keeps (MAX_SEQ - 1), against the same arithmetic in Python ints. At MAX_SEQ
    = 2**30 the backward's n0 + BLOCK_N - window_shift wrapped (a key tile's dK/dV got no query)."""
    from flashtx.triton_kernels.limits import MAX_SEQ

    big, BM, BN = MAX_SEQ, 128, 128
    for Sq, Sk in ((big, big), (big, 100), (100, big)):
        for right, left in ((big - 1, big - 1), (0, big - 1), (big - 1, 0), (3, 5)):
            for m0, n0 in ((0, 0), (Sq - Sq % BM or Sq - BM, Sk - Sk % BN or Sk - BN), (Sq // 2, 64)):
                out = torch.zeros(8, dtype=torch.int64, device=DEVICE)
                _bounds[(1,)](out, Sq, Sk, bottom_right, right, left, m0, n0, BM=BM, BN=BN)
                want = _exact_bounds(Sq, Sk, bottom_right, right, left, m0, n0, BM, BN)
                assert out.tolist() == list(want), (Sq, Sk, right, left, m0, n0)


# ----------------------------------------------------------------------------------------------
# NaN inputs propagate as in the reference: a query row or key with a NaN makes NaN exactly the output rows
# whose scores it reaches (softcap's tanh once turned a NaN score into -softcap: a finite answer)
# ----------------------------------------------------------------------------------------------
def _nan_case(mod: str, where: str):
    torch.manual_seed(11)
    q, k, v = (torch.randn(1, 2, 40, 16, dtype=torch.float64, device=DEVICE) for _ in range(3))
    {"q": q, "k": k}[where][0, 1, 17, 3] = float("nan")  # (query 17, or key 17: rows 17.. see it, causal)
    kw = dict(is_causal=True)
    if mod == "softcap":
        kw["softcap"] = 5.0
    elif mod == "alibi":
        kw["alibi_slopes"] = torch.tensor([0.5, 0.25], device=DEVICE)
    elif mod == "window":
        kw["window_size"] = (8, 0)  # (key 17 is seen by rows 17..25 only)
    elif mod == "bias":
        kw["attn_mask"] = torch.randn(1, 2, 40, 40, dtype=torch.float64, device=DEVICE)
    return q, k, v, kw


@pytest.mark.parametrize("where", ["q", "k"])
@pytest.mark.parametrize("mod", ["plain", "softcap", "alibi", "window", "bias"])
def test_a_nan_query_or_key_gives_nan_rows_where_the_reference_does(mod, where):
    q, k, v, kw = _nan_case(mod, where)
    ref = flashtx.attention(q, k, v, backend="reference", **kw)
    expect = torch.isnan(ref).any(-1)  # (B, H, S): the rows the NaN reaches
    assert expect.any() and not expect.all()
    for dtype in KERNEL_DTYPES:
        cast = {n: (t.to(dtype) if n == "attn_mask" else t) for n, t in kw.items()}
        out = flashtx.attention(q.to(dtype), k.to(dtype), v.to(dtype), backend="triton", **cast)
        got = torch.isnan(out)
        assert torch.equal(got.any(-1), expect), f"{dtype_id(dtype)}: NaN rows differ from the reference's"
        assert torch.equal(got.all(-1), expect), f"{dtype_id(dtype)}: a row the NaN reaches is not all NaN"


@pytest.mark.parametrize("softcap", [0.0, 5.0])
def test_a_nan_in_the_kv_cache_gives_nan_rows_where_the_reference_does(softcap):
    """flash_attn_with_kvcache (the split-KV decode kernels, several splits): a NaN key at cache position 9 of
    sequence 0 makes that sequence's query heads of its kv head NaN, nothing else; as the reference backend."""
    torch.manual_seed(12)
    B, Hq, Hkv, D, cap = 2, 4, 2, 16, 64
    q = torch.randn(B, 1, Hq, D, dtype=torch.float64, device=DEVICE)
    kc, vc = (torch.randn(B, cap, Hkv, D, dtype=torch.float64, device=DEVICE) for _ in range(2))
    kc[0, 9, 1, 4] = float("nan")
    lens = torch.tensor([40, 33], dtype=torch.int32, device=DEVICE)
    ref = flashtx.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, softcap=softcap, backend="reference")
    expect = torch.isnan(ref).any(-1)  # (B, 1, Hq)
    assert expect[0, 0, 2:].all() and expect.sum() == 2
    for dtype in KERNEL_DTYPES:
        out = flashtx.flash_attn_with_kvcache(q.to(dtype), kc.to(dtype), vc.to(dtype), cache_seqlens=lens,
                                              softcap=softcap, num_splits=3, backend="triton")
        got = torch.isnan(out)
        assert torch.equal(got.any(-1), expect) and torch.equal(got.all(-1), expect), dtype_id(dtype)
