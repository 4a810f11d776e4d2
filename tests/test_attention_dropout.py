"""Dropout's draws: one Philox stream, the same in every kernel, lane and backend.

The kernels keep P[b, h, i, j] by a Philox draw at counter (i * Sk_b + j, b * H + h) (sequence-local i, j);
flashtx.reference computes the same draws in torch, so the reference backend gives the Triton
backend's mask and a backward that falls back to the reference keeps the forward's. The draws
depend on nothing but the seed and the indices: not on the padded bounds of a varlen call, and
they do not repeat when a sequence's queries x keys pass 2**32.
"""
import warnings

import pytest
import torch
import triton
import triton.language as tl
from conftest import DEVICE, PRECISE_DTYPE, precise_atol, randn

import flashtx
from flashtx import _dispatch, reference
from flashtx.triton_kernels import attention_bwd_launch, attention_common, launch
from flashtx.triton_kernels.attention_common import DROPOUT_WIDE, dropout_keep, mask_args
from flashtx.triton_kernels.limits import LimitExceeded
from flashtx.triton_kernels.mask_spec import MaskSpec

P = 0.4


def _grads(out, leaves):
    return torch.autograd.grad(out, leaves, torch.ones_like(out))


def _close(a, b, atol):
    return all(torch.allclose(x.double(), y.double(), atol=atol) for x, y in zip(a, b))


@pytest.mark.parametrize("case", ["gqa-causal", "lens+key_mask", "sdpa-shell"])
def test_the_reference_backend_draws_the_kernels_mask(case):
    """Same seed, both backends: equal outputs and gradients (float64 in the interpreter)."""
    torch.manual_seed(3)
    B, Hq, Hkv, Sq, Sk, D = 2, 4, 2, 19, 27, 16
    q = randn(B, Sq, Hq, D, dtype=PRECISE_DTYPE, requires_grad=True)
    k, v = (randn(B, Sk, Hkv, D, dtype=PRECISE_DTYPE, requires_grad=True) for _ in range(2))
    kw = {}
    if case == "lens+key_mask":
        kw = dict(kv_lens=torch.tensor([27, 11], dtype=torch.int32, device=DEVICE),
                  key_mask=torch.rand(B, Sk, device=DEVICE) > 0.2)

    def call(backend, p):
        torch.manual_seed(9)
        if case == "sdpa-shell":  # (B, H, S, D), enable_gqa
            return flashtx.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), dropout_p=p,
                                     enable_gqa=True, backend=backend)
        return flashtx.flash_attn_func(q, k, v, dropout_p=p, causal=case == "gqa-causal", backend=backend, **kw)

    runs = [(out, *_grads(out, (q, k, v))) for out in (call("triton", P), call("reference", P))]
    assert _close(runs[0], runs[1], precise_atol(1e-12))
    assert not torch.allclose(runs[0][0], call("triton", 0.0))  # dropout was applied


def test_varlen_reference_backend_and_bounds_leave_the_mask_alone():
    """Packed sequences: the reference backend draws the kernels' mask, and neither a looser max_seqlen nor
    0-dim tensor bounds nor return_attn_probs changes it (the counter holds sequence-local i and j)."""
    torch.manual_seed(4)
    cu_q = torch.tensor([0, 7, 8, 20], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, 9, 15, 29], dtype=torch.int32, device=DEVICE)
    q = randn(20, 4, 16, dtype=PRECISE_DTYPE, requires_grad=True)
    k, v = (randn(29, 2, 16, dtype=PRECISE_DTYPE, requires_grad=True) for _ in range(2))

    def run(msq, msk, backend="triton", **kw):
        torch.manual_seed(11)
        return flashtx.flash_attn_varlen_func(q, k, v, cu_q, cu_k, msq, msk, dropout_p=P, causal=True,
                                              backend=backend, **kw)

    base = run(12, 14)
    assert torch.equal(base, run(12, 29)) and torch.equal(base, run(20, 40))
    t = torch.tensor
    assert torch.equal(base, run(t(12), t(14))) and torch.equal(base, run(t(12), t(14), return_attn_probs=True)[0])
    ref = run(12, 14, backend="reference")
    assert _close((base, *_grads(base, (q, k, v))), (ref, *_grads(ref, (q, k, v))), precise_atol(1e-12))


def test_a_backward_that_falls_back_to_the_reference_keeps_the_forwards_mask(monkeypatch):
    """The automatic backend re-plans a backward that Triton refuses (here: a gradient's span, simulated) on
    the reference backend: its gradients are those of the forward's own mask (return_attn_probs')."""
    torch.manual_seed(5)
    q, k, v = (randn(1, 12, 2, 16, dtype=PRECISE_DTYPE, requires_grad=True) for _ in range(3))
    torch.manual_seed(0)
    out, _, probs = flashtx.flash_attn_func(q, k, v, dropout_p=0.5, return_attn_probs=True)

    def refuse(**views):
        raise LimitExceeded("dout (simulated): its sequence span overflows the kernels' int32 offsets")

    monkeypatch.setattr(attention_bwd_launch, "check_spans", refuse)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        grads = _grads(out, (q, k, v))
    assert any("using the reference" in str(w.message) for w in caught), [str(w.message) for w in caught]
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = reference.attention(*(t.transpose(1, 2) for t in leaves), keep=probs >= 0, dropout_p=0.5).transpose(1, 2)
    assert _close(grads, _grads(ref, leaves), precise_atol(1e-11))


@triton.jit
def _keep_rows(OUT, seed, bh, row0, Sk_b, p, N: tl.constexpr, DROPOUT: tl.constexpr):
    offs_m = row0 + tl.arange(0, 2)
    offs_n = tl.arange(0, N)
    keep = dropout_keep(seed, bh, offs_m[:, None], offs_n[None, :], Sk_b, p, DROPOUT)
    tl.store(OUT + tl.arange(0, 2)[:, None] * N + offs_n[None, :], keep.to(tl.int8))


def test_draws_do_not_repeat_past_2_to_the_32_entries_and_match_the_reference():
    """In a 128k-key sequence, rows i and i + 2**32 / Sk_b (where a one-word i * Sk_b + j counter wraps) draw
    different masks in the wide variant; the one-word variant draws the same numbers below 2**32; each equals
    the reference's draw (reference.philox4x32 at the same counter)."""
    N, seed, sk = 64, 123456789, 2**17

    def kernel_rows(bh, row0, wide):
        out = torch.zeros(2, N, dtype=torch.int8, device=DEVICE)
        _keep_rows[(1,)](out, seed, bh, row0, sk, 0.5, N=N, DROPOUT=DROPOUT_WIDE if wide else 1)
        return out.bool()

    def reference_rows(bh, row0):
        idx = torch.arange(row0, row0 + 2, device=DEVICE)[:, None] * sk + torch.arange(N, device=DEVICE)[None, :]
        r0, _, _, _ = reference.philox4x32(torch.tensor([seed], device=DEVICE), idx & 0xFFFFFFFF,
                                           torch.tensor(bh, device=DEVICE), idx >> 32, torch.tensor(0, device=DEVICE))
        return (r0 >> 8).double() * 2.0 ** -24 >= 0.5

    wrap = 5 + 2**32 // sk
    assert not torch.equal(kernel_rows(3, 5, True), kernel_rows(3, wrap, True))
    assert torch.equal(kernel_rows(3, wrap, True), reference_rows(3, wrap))
    for bh in (0, 3, 2**31 + 7):
        assert torch.equal(kernel_rows(bh, 5, False), kernel_rows(bh, 5, True))
        assert torch.equal(kernel_rows(bh, 5, False), reference_rows(bh, 5))
    assert not torch.equal(kernel_rows(0, 5, False), kernel_rows(3, 5, False))


def test_the_wide_counter_is_planned_exactly_where_a_sequence_can_pass_2_to_the_32_entries():
    """mask_args picks DROPOUT_WIDE from the call's bounds: Sq * Sk (varlen: max_seqlen_q * max_seqlen_k)."""
    rng = torch.zeros(1, dtype=torch.int64)

    def planned(sq, sk, varlen=None):
        q, k = torch.empty(1, 1, sq, 8, device="meta"), torch.empty(1, 1, sk, 8, device="meta")
        kw = {}
        if varlen is not None:
            cu = torch.tensor([0, sq], dtype=torch.int32)
            kw = dict(cu_seqlens_q=cu, cu_seqlens_k=torch.tensor([0, sk], dtype=torch.int32),
                      max_seqlen_q=varlen[0], max_seqlen_k=varlen[1])
        spec = MaskSpec(dropout_p=0.1, rng=rng, **kw)
        return mask_args(spec, False, False, q, k, torch.empty(1, 1, sq, device="meta"))[0]["DROPOUT"]

    assert planned(2**16, 2**16) == 1 and planned(2**16, 2**16 + 1) == DROPOUT_WIDE
    assert planned(3 * 2**15, 2**17, varlen=(2**15, 2**17)) == 1  # the sequences' bound, not the totals
    assert planned(2**16, 2**17, varlen=(2**16, 2**17)) == DROPOUT_WIDE


def test_sdpa_shell_takes_sdpa_dropout_forms():
    """flashtx.attention takes what F.scaled_dot_product_attention takes: dropout_p = 1 (every probability
    dropped: out and gradients 0, lse as without dropout) and a 0-dim tensor (its value); nn layers take 1."""
    torch.manual_seed(6)
    q, k, v = (randn(1, 2, 9, 16, dtype=PRECISE_DTYPE, requires_grad=True) for _ in range(3))
    out, lse = flashtx.attention(q, k, v, dropout_p=1.0, return_lse=True)
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.equal(lse, flashtx.attention(q, k, v, return_lse=True)[1])
    assert all(torch.equal(g, torch.zeros_like(g)) for g in _grads(out, (q, k, v)))
    assert torch.equal(flashtx.attention(q, k, v, dropout_p=torch.tensor(1.0)), out)
    for p in (torch.tensor(0.3), torch.tensor(0.3, dtype=torch.float64)):
        torch.manual_seed(2)
        a = flashtx.attention(q, k, v, dropout_p=p)
        torch.manual_seed(2)
        assert torch.equal(a, flashtx.attention(q, k, v, dropout_p=p.item()))
    torch.manual_seed(2)
    plain = flashtx.attention(q, k, v, dropout_p=torch.tensor(0.0))
    assert torch.equal(plain, flashtx.attention(q, k, v))
    with pytest.raises(ValueError, match=r"dropout_p must be a float in \[0, 1\].*got tensor\(\[0.3000, 0.3000\]\)"):
        flashtx.attention(q, k, v, dropout_p=torch.tensor([0.3, 0.3]))
    layer = flashtx.nn.MultiheadAttention(32, 2, dropout=1.0).to(device=DEVICE, dtype=PRECISE_DTYPE)
    x = randn(1, 5, 32, dtype=PRECISE_DTYPE)
    assert torch.equal(layer(x), layer.out_proj(torch.zeros_like(x)))  # training: every probability dropped


def test_the_wide_counter_kernels_draw_what_the_narrow_ones_draw(monkeypatch, fresh_plans):
    """Every attention kernel's DROPOUT_WIDE variant (forward, dK/dV, dQ, probabilities), forced for a small
    call: the same out, gradients and dropped entries as the one-word counter."""
    torch.manual_seed(7)
    q = randn(2, 13, 4, 16, dtype=PRECISE_DTYPE, requires_grad=True)
    k, v = (randn(2, 21, 2, 16, dtype=PRECISE_DTYPE, requires_grad=True) for _ in range(2))

    def run():
        torch.manual_seed(12)
        out, _, probs = flashtx.flash_attn_func(q, k, v, dropout_p=P, causal=True, return_attn_probs=True,
                                                backend="triton")
        return (out, probs, *_grads(out, (q, k, v)))

    narrow = run()
    monkeypatch.setattr(attention_common, "WIDE_COUNTER_PAST", 0)
    _dispatch.clear_plans()  # (the narrow run's plans and launches are kept per call signature)
    seen = {}
    real = launch.run_kernel

    def spy(kernel, grid, args, *rest):
        if "DROPOUT" in args:
            seen[kernel.__name__] = args["DROPOUT"]
        return real(kernel, grid, args, *rest)

    monkeypatch.setattr(launch, "run_kernel", spy)
    wide = run()
    assert seen == {"_attn_fwd": DROPOUT_WIDE, "_attn_probs": DROPOUT_WIDE, "_attn_bwd_dkdv": DROPOUT_WIDE,
                    "_attn_bwd_dq": DROPOUT_WIDE}, seen
    assert all(torch.equal(a, b) for a, b in zip(narrow, wide))
