"""Score modifiers and dropout inside the attention kernels: softcap, ALiBi, dropout.

softcap and ALiBi are compared with the float64 reference under the tolerance rule and
gradchecked in float64 through the kernels. Dropout is checked by its own contract: the same
seed gives bitwise-equal results, the kept fraction is within statistical bounds, and the output
and gradients equal reference attention computed with the kernel's own returned dropout mask.
"""
import dataclasses

import pytest
import torch
from conftest import (DEVICE, KERNEL_DTYPES, ON_GPU, PRECISE_DTYPE, assert_close_to_reference, dtype_id,
                      gradcheck_each_input, poisoned_allocations, precise_atol, randn, to64, to_dtype)

import flashtx
from flashtx import reference

B, HQ, HKV, D = 2, 4, 2, 16


@dataclasses.dataclass(frozen=True)
class ModCase:
    sq: int
    sk: int
    softcap: float = 0.0
    alibi: str = ""  # "", "heads" ((H,) slopes) or "batch" ((B, H) slopes)
    causal: bool = False
    shell: str = "flash"  # "flash" (B, S, H, D), bottom-right; "sdpa" (B, H, S, D)

    @property
    def id(self):
        parts = [self.shell, f"{self.sq}x{self.sk}"]
        parts += [f"softcap{self.softcap:g}"] if self.softcap else []
        parts += [f"alibi-{self.alibi}"] if self.alibi else []
        return "-".join(parts + (["causal"] if self.causal else []))


CASES = [
    ModCase(37, 45, softcap=2.0),
    ModCase(45, 37, softcap=0.5, causal=True),
    ModCase(37, 45, alibi="heads", causal=True),
    ModCase(45, 29, alibi="batch"),
    ModCase(33, 33, softcap=5.0, alibi="batch", causal=True, shell="sdpa"),
    ModCase(1, 40, softcap=1.0, alibi="heads", causal=True),
]


def slopes_for(case):
    if not case.alibi:
        return None
    g = torch.Generator().manual_seed(41)
    shape = (HQ,) if case.alibi == "heads" else (B, HQ)
    return (torch.rand(shape, generator=g) * 0.5 + 0.05).to(DEVICE)


def run_flashtx(case, q, k, v, **kw):
    slopes = slopes_for(case)
    if case.shell == "flash":
        return flashtx.flash_attn_func(q, k, v, causal=case.causal, softcap=case.softcap, alibi_slopes=slopes,
                                       backend="triton", **kw)
    return flashtx.attention(q, k, v, is_causal=case.causal, softcap=case.softcap, alibi_slopes=slopes,
                             enable_gqa=True, backend="triton", **kw)


def run_reference(case, q, k, v):
    slopes = slopes_for(case)
    flash = case.shell == "flash"
    if flash:
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    alibi = reference.alibi_bias(slopes, case.sq, case.sk, device=DEVICE) if slopes is not None else None
    out = reference.attention(q, k, v, causal=case.causal, bottom_right=flash, softcap=case.softcap, alibi=alibi)
    return out.transpose(1, 2) if flash else out


def make_qkv(case, dtype):
    if case.shell == "flash":
        return randn(B, case.sq, HQ, D, dtype=dtype), randn(B, case.sk, HKV, D, dtype=dtype), \
            randn(B, case.sk, HKV, D, dtype=dtype)
    return randn(B, HQ, case.sq, D, dtype=dtype), randn(B, HKV, case.sk, D, dtype=dtype), \
        randn(B, HKV, case.sk, D, dtype=dtype)


@pytest.mark.parametrize("dtype", [d for d in KERNEL_DTYPES if d != torch.float64], ids=dtype_id)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_softcap_and_alibi_match_reference(case, dtype):
    torch.manual_seed(42)
    q, k, v = (t.mul(3.0).requires_grad_() for t in make_qkv(case, dtype))  # large scores: softcap bites
    with poisoned_allocations():
        out = run_flashtx(case, q, k, v)
        dout = randn(*out.shape, dtype=dtype)
        grads = torch.autograd.grad(out, (q, k, v), dout)
    results = []
    for ins in (to64(q, k, v), to_dtype(dtype, q, k, v)):
        o = run_reference(case, *ins)
        results.append((o, torch.autograd.grad(o, ins, dout.to(o.dtype))))
    (o64, g64), (oe, ge) = results
    assert_close_to_reference("out", out, o64, oe)
    for name, g, r, e in zip(("dq", "dk", "dv"), grads, g64, ge):
        assert_close_to_reference(name, g, r, e, grad=True)


@pytest.mark.skipif(ON_GPU, reason="float64 Triton kernels run only in the interpreter")
@pytest.mark.parametrize("case", [CASES[1], CASES[3], CASES[4]], ids=lambda c: c.id)
def test_gradcheck_softcap_alibi(case):
    torch.manual_seed(43)
    q, k, v = (t.mul(2.0).requires_grad_() for t in make_qkv(case, torch.float64))
    assert gradcheck_each_input(lambda q, k, v: run_flashtx(case, q, k, v), (q, k, v))


# ---------------------------------------------------------------------------------------------
# Dropout
# ---------------------------------------------------------------------------------------------

def _flash_qkv(sq=45, sk=53, dtype=torch.float64, requires_grad=True):
    torch.manual_seed(44)
    return randn(B, sq, HQ, D, dtype=dtype, requires_grad=requires_grad), \
        randn(B, sk, HKV, D, dtype=dtype, requires_grad=requires_grad), \
        randn(B, sk, HKV, D, dtype=dtype, requires_grad=requires_grad)


def test_dropout_same_seed_gives_bitwise_equal_outputs_and_gradients():
    q, k, v = _flash_qkv(dtype=torch.float32)
    runs = []
    for seed in (7, 7, 8):
        torch.manual_seed(seed)
        out = flashtx.flash_attn_func(q, k, v, dropout_p=0.3, causal=True, backend="triton")
        runs.append((out,) + torch.autograd.grad(out.square().sum(), (q, k, v)))
    assert all(torch.equal(a, b) for a, b in zip(runs[0], runs[1]))
    assert not torch.equal(runs[0][0], runs[2][0])  # another seed, another mask


@pytest.mark.parametrize("p", [0.1, 0.5, 0.8])
def test_dropout_kept_fraction_is_within_statistical_bounds(p):
    torch.manual_seed(45)
    q, k, v = (randn(2, 4, 64, 16, dtype=torch.float32) for _ in range(3))
    k, v = (randn(2, 4, 96, 16, dtype=torch.float32) for _ in range(2))
    _, _, probs = flashtx.flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), dropout_p=p,
                                          return_attn_probs=True, backend="triton")
    n = probs.numel()  # every entry is visible (no mask): P > 0, dropped ones negated
    kept = (probs > 0).sum().item() / n
    sigma = (p * (1 - p) / n) ** 0.5
    assert abs(kept - (1 - p)) < 6 * sigma, f"kept {kept:.4f}, expected {1 - p:.4f} +- {6 * sigma:.4f}"
    # and the draws are not trivially correlated along rows or columns
    keep = (probs > 0).double()
    assert abs(keep[..., 1:].mul(keep[..., :-1]).mean().item() - (1 - p) ** 2) < 0.02


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("extra", ["plain", "window+key_mask+softcap+alibi", "attn_bias"])
def test_dropout_equals_reference_with_the_kernels_own_mask(causal, extra):
    """out and dq/dk/dv equal reference attention computed with the dropout mask that
    return_attn_probs reports (the same draw in forward, backward and the probabilities)."""
    q, k, v = _flash_qkv(dtype=PRECISE_DTYPE)  # float64 through the kernels in the interpreter, float32 on a GPU
    p = 0.25
    kw, ref_kw = {}, {}
    vis_kw = {}
    if extra.startswith("window"):
        km = torch.rand(B, k.shape[1], device=DEVICE) > 0.2
        slopes = torch.rand(HQ, device=DEVICE)
        kw = dict(window_size=(15, -1), key_mask=km, softcap=3.0, alibi_slopes=slopes)
        vis_kw = dict(window=(15, -1), key_mask=km)
        ref_kw = dict(softcap=3.0, alibi=reference.alibi_bias(slopes, q.shape[1], k.shape[1], device=DEVICE))
    elif extra == "attn_bias":
        bias = randn(1, HQ, q.shape[1], k.shape[1], dtype=PRECISE_DTYPE, requires_grad=True)
        kw, ref_kw = dict(attn_bias=bias), dict(bias=bias)
    torch.manual_seed(46)
    out, lse, probs = flashtx.flash_attn_func(q, k, v, dropout_p=p, causal=causal, return_attn_probs=True,
                                              backend="triton", **kw)
    torch.manual_seed(46)
    out2 = flashtx.flash_attn_func(q, k, v, dropout_p=p, causal=causal, backend="triton", **kw)
    assert torch.equal(out, out2)
    leaves = [q, k, v] + ([kw["attn_bias"]] if "attn_bias" in kw else [])
    grads = torch.autograd.grad(out2, leaves, torch.ones_like(out2))
    keep = probs >= 0  # (B, H, Sq, Sk); invisible entries are 0 (kept or not: P = 0 there)
    vis = reference.visibility(q.shape[1], k.shape[1], batch=B, causal=causal, bottom_right=True, device=DEVICE,
                               **vis_kw)
    ref_leaves = leaves if PRECISE_DTYPE == torch.float64 else list(to64(*leaves))  # the reference in float64
    if "attn_bias" in kw:
        ref_kw = dict(bias=ref_leaves[3])
    ref = reference.attention(*(t.transpose(1, 2) for t in ref_leaves[:3]), vis=vis, keep=keep, dropout_p=p,
                              **ref_kw).transpose(1, 2)
    ref_grads = torch.autograd.grad(ref, ref_leaves, torch.ones_like(ref))
    assert torch.allclose(out.double(), ref, atol=precise_atol(1e-12))
    for a, b in zip(grads, ref_grads):
        assert torch.allclose(a.double(), b, atol=precise_atol(1e-11))
    dropped = (probs < 0) & vis[:, None]
    assert 0.15 < dropped.sum() / vis[:, None].expand_as(probs).sum() < 0.35  # about p of the visible entries


def test_return_attn_probs_without_dropout_are_the_softmax(monkeypatch):
    """flash-attn returns no probabilities without dropout (None: its way to the lse costs no O(Sq * Sk) tensor);
    the kernel's probabilities (what tests read with PROBS_WITHOUT_DROPOUT) are the softmax."""
    q, k, v = _flash_qkv(sq=30, sk=41, dtype=PRECISE_DTYPE, requires_grad=False)  # float32 on a GPU
    out0, lse0, none = flashtx.flash_attn_func(q, k, v, causal=True, return_attn_probs=True, backend="triton")
    assert none is None
    cu = torch.tensor([0, 30], dtype=torch.int32, device=DEVICE)
    cuk = torch.tensor([0, 41], dtype=torch.int32, device=DEVICE)
    res = flashtx.flash_attn_varlen_func(q[0], k[0], v[0], cu, cuk, 30, 41, causal=True, return_attn_probs=True)
    assert len(res) == 3 and res[2] is None and res[1].shape == (HQ, 30)
    monkeypatch.setattr(flashtx.functional, "PROBS_WITHOUT_DROPOUT", True)
    out, lse, probs = flashtx.flash_attn_func(q, k, v, causal=True, return_attn_probs=True, backend="triton")
    assert torch.equal(out, out0) and torch.equal(lse, lse0)
    q, k, v = (t.double() for t in (q, k, v))  # the reference in float64
    ref_out, ref_lse = reference.attention(*(t.transpose(1, 2) for t in (q, k, v)), causal=True, bottom_right=True,
                                           return_lse=True)
    eye = torch.eye(41, dtype=torch.float64, device=DEVICE).expand(B, HKV, 41, 41)
    ref_p = reference.attention(q.transpose(1, 2), k.transpose(1, 2), eye, causal=True, bottom_right=True)
    assert probs.shape == (B, HQ, 30, 41) and torch.allclose(probs.double(), ref_p, atol=precise_atol(1e-13))
    assert torch.allclose(lse.double(), ref_lse, atol=precise_atol(1e-12))
    assert torch.allclose(out.double(), ref_out.transpose(1, 2), atol=precise_atol(1e-12))


@pytest.mark.skipif(ON_GPU, reason="float64 Triton kernels run only in the interpreter")
def test_gradcheck_dropout_with_fixed_seed():
    q, k, v = (t.detach()[:1, :21].requires_grad_() for t in _flash_qkv())

    def fn(q, k, v):
        torch.manual_seed(47)  # the same mask on every call
        return flashtx.flash_attn_func(q, k, v, dropout_p=0.3, causal=True, backend="triton")

    assert gradcheck_each_input(fn, (q, k, v))


def test_dropout_in_the_sdpa_shell_and_the_reference_backend():
    """dropout_p in flashtx.attention: applied (differs from p=0), scaled by 1/(1-p) (the mean output
    matches), reproducible; the reference backend honours it too (with the kernels' draws: test_attention_dropout)."""
    torch.manual_seed(48)
    # float64 through the kernels in the interpreter, float32 on a GPU: every check below holds in either
    q, k, v = (randn(1, 2, 64, 16, dtype=PRECISE_DTYPE) for _ in range(3))
    v = v + 3.0  # a mean far from 0, so the 1/(1-p) rescaling shows
    base = flashtx.attention(q, k, v, backend="triton")
    for backend in ("triton", "reference"):
        torch.manual_seed(1)
        a = flashtx.attention(q, k, v, dropout_p=0.5, backend=backend)
        torch.manual_seed(1)
        b = flashtx.attention(q, k, v, dropout_p=0.5, backend=backend)
        assert torch.equal(a, b) and not torch.allclose(a, base)
        assert abs(a.mean().item() - base.mean().item()) < 0.3


@pytest.mark.skipif(ON_GPU, reason="float64 comparison of the two backends runs in the interpreter")
def test_varlen_with_softcap_alibi_matches_the_reference_backend(monkeypatch):
    monkeypatch.setattr(flashtx.functional, "PROBS_WITHOUT_DROPOUT", True)  # (flash-attn's: none without dropout)
    torch.manual_seed(49)
    cu_q = torch.tensor([0, 17, 18, 40], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, 25, 31, 52], dtype=torch.int32, device=DEVICE)
    q, k, v = randn(40, 4, 16, dtype=torch.float64), randn(52, 2, 16, dtype=torch.float64), \
        randn(52, 2, 16, dtype=torch.float64)
    slopes = torch.rand(3, 4, device=DEVICE)
    outs = []
    for backend in ("triton", "reference"):
        ins = to64(q, k, v)
        o, lse, probs = flashtx.flash_attn_varlen_func(*ins, cu_q, cu_k, 22, 25, causal=True, softcap=2.0,
                                                       alibi_slopes=slopes, window_size=(10, -1),
                                                       return_attn_probs=True, backend=backend)
        outs.append((o, lse, probs) + torch.autograd.grad(o.sum(), ins))
    for a, b in zip(*outs):
        assert torch.allclose(a, b, atol=1e-12)
    # each sequence alone gives the same as the packed run
    o = outs[0][0]
    for s in range(3):
        qs, ks, vs = q[cu_q[s]:cu_q[s + 1]][None], k[cu_k[s]:cu_k[s + 1]][None], v[cu_k[s]:cu_k[s + 1]][None]
        alone = flashtx.flash_attn_func(qs, ks, vs, causal=True, softcap=2.0, alibi_slopes=slopes[s],
                                        window_size=(10, -1), backend="triton")
        assert torch.allclose(alone[0], o[cu_q[s]:cu_q[s + 1]], atol=1e-12)


def test_every_option_traces_without_graph_breaks():
    """torch.compile(fullgraph=True) through attn_mask, softcap, ALiBi, dropout (its seed is drawn
    out of place, so traceable) and return_attn_probs; the compiled function runs forward and backward."""
    torch.manual_seed(50)
    q, k, v = (randn(1, 2, 24, 16, requires_grad=True) for _ in range(3))
    bias = randn(1, 2, 24, 24, requires_grad=True)
    slopes = torch.ones(2, device=DEVICE)

    def f(q, k, v, bias):
        return flashtx.attention(q, k, v, attn_mask=bias, dropout_p=0.1, is_causal=True, softcap=5.0,
                                 alibi_slopes=slopes)

    explained = torch._dynamo.explain(f)(q, k, v, bias)
    assert explained.graph_break_count == 0, explained.break_reasons
    out = torch.compile(f, fullgraph=True)(q, k, v, bias)
    assert torch.autograd.grad(out.sum(), bias)[0].shape == bias.shape
    g = torch.compile(lambda a, b, c: flashtx.flash_attn_func(a, b, c, dropout_p=0.2, return_attn_probs=True),
                      fullgraph=True)
    out, lse, probs = g(*(t.detach().transpose(1, 2) for t in (q, k, v)))
    assert probs.shape == (1, 2, 24, 24) and lse.shape == (1, 2, 24)
