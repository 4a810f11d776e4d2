"""flashtx.patch_sdpa: F.scaled_dot_product_attention routed through flashtx.attention, exact restore,
explicit fallbacks with one warning per reason, and a nanoGPT-style model that needs no change."""
import math
import warnings

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from conftest import DEVICE, assert_close_to_reference, randn, spy_attention_calls
from torch import nn

import flashtx
from flashtx import sdpa_patch


@pytest.fixture(autouse=True)
def unpatched():
    """Every test starts and ends with torch's own SDPA and no remembered warnings."""
    original = torch.nn.functional.scaled_dot_product_attention
    sdpa_patch._warned.clear()
    yield original
    sdpa_patch.disable()
    assert torch.nn.functional.scaled_dot_product_attention is original


@pytest.fixture
def calls(monkeypatch):
    """Records each call that reaches flashtx's attention through the patch: the op (functional._run, which
    flashtx.attention calls and the patch calls directly for a plain call it has checked itself), or a plain
    call's lane (flashtx._attention_lane, which either calls first; it returns None where it does not take it)."""
    seen = []
    spy_attention_calls(monkeypatch, lambda q: seen.append(tuple(q.shape)))
    return seen


class CausalSelfAttention(nn.Module):
    """nanoGPT's attention, verbatim in substance: it calls F.scaled_dot_product_attention."""

    def __init__(self, n_embd=32, n_head=4, dropout=0.0):
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.n_head, self.n_embd, self.dropout = n_head, n_embd, dropout

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=None, dropout_p=self.dropout if self.training else 0, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


def test_enable_disable_and_context_manager_restore_exactly(unpatched):
    original = unpatched
    mine = sdpa_patch.scaled_dot_product_attention
    assert not sdpa_patch.is_enabled()
    with flashtx.patch_sdpa():
        assert F.scaled_dot_product_attention is mine
        assert torch.nn.functional.scaled_dot_product_attention is mine
        with flashtx.patch_sdpa():  # nested
            assert sdpa_patch.is_enabled()
        assert sdpa_patch.is_enabled()  # the outer block still holds it
    assert F.scaled_dot_product_attention is original

    sdpa_patch.enable()
    sdpa_patch.enable()  # idempotent
    with flashtx.patch_sdpa():
        pass
    assert sdpa_patch.is_enabled()  # a block inside enable() leaves it enabled
    sdpa_patch.disable()
    sdpa_patch.disable()
    assert F.scaled_dot_product_attention is original

    with pytest.raises(KeyError):
        with flashtx.patch_sdpa():
            raise KeyError("boom")
    assert F.scaled_dot_product_attention is original  # restored on error too


def test_disable_refuses_to_clobber_a_later_patch(unpatched):
    sdpa_patch.enable()
    other = lambda *a, **kw: None  # noqa: E731
    F.scaled_dot_product_attention = other
    try:
        with pytest.raises(RuntimeError, match="replaced by something else"):
            sdpa_patch.disable()
    finally:
        F.scaled_dot_product_attention = sdpa_patch.scaled_dot_product_attention
    sdpa_patch.disable()
    assert F.scaled_dot_product_attention is unpatched


def test_nanogpt_attention_runs_on_flashtx_unchanged(calls):
    torch.manual_seed(0)
    layer = CausalSelfAttention().to(DEVICE)
    ref = CausalSelfAttention().to(DEVICE).double()
    ref.load_state_dict(layer.state_dict())
    x = randn(2, 11, 32, requires_grad=True)
    x64, xe = x.detach().double().requires_grad_(True), x.detach().clone().requires_grad_(True)
    with flashtx.patch_sdpa():
        out = layer(x)
        out.backward(torch.ones_like(out))
    assert calls == [(2, 4, 11, 8)]
    grads = [p.grad.clone() for p in layer.parameters()]
    layer.zero_grad()
    out_e, out_ref = layer(xe), ref(x64)  # torch's SDPA (math) in fp32 and fp64
    assert_close_to_reference("nanoGPT attention", out, out_ref, out_e)
    out_e.backward(torch.ones_like(out_e))
    out_ref.backward(torch.ones_like(out_ref))
    assert_close_to_reference("dx", x.grad, x64.grad, xe.grad, grad=True)
    for name, g, pr, pe in zip(dict(layer.named_parameters()), grads, ref.parameters(), layer.parameters()):
        assert_close_to_reference(f"d {name}", g, pr.grad, pe.grad, grad=True)


def test_gqa_and_scale_are_passed(calls):
    q, k = randn(1, 4, 6, 8), randn(1, 2, 6, 8)
    want = F.scaled_dot_product_attention(q, k, k, scale=0.3, enable_gqa=True)
    with flashtx.patch_sdpa():
        got = F.scaled_dot_product_attention(q, k, k, scale=0.3, enable_gqa=True)
    assert len(calls) == 1
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_one_key_value_head_broadcasts_without_enable_gqa(calls):
    """SDPA broadcasts K/V with one head over the query heads (no enable_gqa needed): flashtx runs it as MQA."""
    q, k, v = randn(2, 4, 6, 8, requires_grad=True), randn(2, 1, 7, 8, requires_grad=True), randn(2, 1, 7, 8,
                                                                                                   requires_grad=True)
    want = F.scaled_dot_product_attention(*(t.double() for t in (q, k, v)), is_causal=True)
    eager = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    with flashtx.patch_sdpa():
        got = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert calls == [(2, 4, 6, 8)]
    assert_close_to_reference("out", got, want, eager)
    g = torch.randn_like(got)
    for name, a, w, e in zip("qkv", torch.autograd.grad(got, (q, k, v), g),
                             torch.autograd.grad(want, (q, k, v), g.double()), torch.autograd.grad(eager, (q, k, v), g)):
        assert_close_to_reference(f"d{name}", a, w, e, grad=True)


@pytest.mark.parametrize("is_causal", ["no", "False", 1, 0, None])
def test_a_non_bool_is_causal_gets_torchs_error(is_causal, calls):
    """torch's SDPA refuses is_causal="no" (truthy) with a TypeError; the patch must not run it as causal."""
    q = randn(1, 2, 5, 8)
    with pytest.raises(TypeError):
        F.scaled_dot_product_attention(q, q, q, is_causal=is_causal)
    with flashtx.patch_sdpa(), warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        with pytest.raises(TypeError):
            F.scaled_dot_product_attention(q, q, q, is_causal=is_causal)
        with pytest.raises(TypeError):  # with a mask too
            F.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(5, 5, dtype=torch.bool, device=DEVICE),
                                           is_causal=is_causal)
    assert calls == []


FALLBACKS = {  # id: (make inputs -> (args, kwargs), reason the warning names)
    "broadcast-batch": (lambda: ((randn(2, 2, 5, 8), randn(1, 2, 5, 8), randn(1, 2, 5, 8)), {}),
                        "broadcasting batch dims"),
    "rank-mismatch": (lambda: ((randn(2, 2, 5, 8), randn(5, 8), randn(5, 8)), {}), "query, key, value must have the same rank"),
    "unbatched-key": (lambda: ((randn(2, 2, 5, 8), randn(2, 5, 8), randn(2, 5, 8)), {}),
                      "query, key, value must have the same rank"),
    # torch broadcasts one query head over the K/V heads (an output of Hkv heads); flashtx.attention refuses it
    "one-query-head": (lambda: ((randn(2, 1, 5, 8), randn(2, 4, 6, 8), randn(2, 4, 6, 8)), {}),
                       "one query head broadcast over several key/value heads"),
    # scales torch takes and flashtx's float32 kernels do not (a plain call, and one with a mask)
    "scale-tiny": (lambda: ((randn(1, 2, 5, 8), randn(1, 2, 5, 8), randn(1, 2, 5, 8)), dict(scale=1e-40)),
                   r"a scale outside flashtx's range"),
    "scale-huge-masked": (lambda: ((randn(1, 2, 5, 8), randn(1, 2, 5, 8), randn(1, 2, 5, 8)),
                                   dict(scale=1e35, attn_mask=torch.ones(5, 5, dtype=torch.bool, device=DEVICE))),
                          r"a scale outside flashtx's range"),
}


@pytest.mark.parametrize("case", list(FALLBACKS))
def test_unsupported_calls_fall_back_with_one_warning(case, calls):
    make, reason = FALLBACKS[case]
    args, kw = make()
    want = F.scaled_dot_product_attention(*args, **kw)
    with flashtx.patch_sdpa():
        with pytest.warns(UserWarning, match=f"goes to torch's scaled_dot_product_attention: {reason}"):
            got = F.scaled_dot_product_attention(*args, **kw)
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)  # the same reason warns only once
            F.scaled_dot_product_attention(*args, **kw)
    assert calls == []
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("heads,kw", [((2, 0, 0), dict(enable_gqa=True)), ((2, 0, 0), {}), ((0, 0, 0), dict(scale=1e-40)),
                                      ((2, 2, 0), dict(enable_gqa=True)), ((2, 0, 0), dict(scale=1e-40)),
                                      ((2, 0, 0), dict(attn_mask=torch.ones(4, 4, dtype=torch.bool)))])
def test_zero_key_value_heads_get_flashtx_error_not_torchs_crash(heads, kw, calls):
    """torch 2.11's SDPA dies of SIGFPE (it divides by the K/V head count) on these: the patch raises instead,
    whichever route the call would take (a plain call, a refused scale, a mask). torch is not called here."""
    hq, hk, hv = heads
    q, k, v = randn(1, hq, 4, 8), randn(1, hk, 4, 8), randn(1, hv, 4, 8)
    kw = {n: (a.to(DEVICE) if isinstance(a, torch.Tensor) else a) for n, a in kw.items()}
    name = "key" if hk == 0 else "value"
    with flashtx.patch_sdpa(), warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no fallback warning either
        with pytest.raises(ValueError, match=rf"{name} must have at least one head \(dim -3\), got {name} "
                                             rf"\(1, 0, 4, 8\)"):
            F.scaled_dot_product_attention(q, k, v, **kw)
    assert calls == []
    assert flashtx.sdpa_patch.unsupported_reason(q, k, v, **kw) is not None


@pytest.mark.parametrize("mask", [False, True])
def test_no_heads_at_all_is_an_empty_output_from_flashtx(mask, calls):
    """0 query heads and 0 K/V heads: flashtx.attention's empty output (torch 2.11's SDPA would crash)."""
    q = randn(1, 0, 4, 8, requires_grad=True)
    kw = dict(attn_mask=torch.ones(4, 4, dtype=torch.bool, device=DEVICE)) if mask else {}
    with flashtx.patch_sdpa(), warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        out = F.scaled_dot_product_attention(q, q, q, **kw)
    assert out.shape == (1, 0, 4, 8) and len(calls) == 1
    out.sum().backward()
    assert q.grad.shape == q.shape


def test_calls_torch_rejects_get_torchs_error_without_a_warning(calls):
    q, k = randn(1, 4, 5, 8), randn(1, 2, 5, 8)
    with flashtx.patch_sdpa(), warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # fallback warnings (not third-party deprecations)
        with pytest.raises(RuntimeError):
            F.scaled_dot_product_attention(q, k, k)  # GQA heads without enable_gqa
    assert calls == []


@pytest.mark.parametrize("kind", ["bool", "additive", "learned-bias"])
def test_masks_go_to_flashtx(kind, calls):
    """attn_mask (bool, additive, or a bias that requires grad) runs on flashtx.attention, as SDPA computes it."""
    q, k, v = randn(2, 2, 6, 8), randn(2, 2, 7, 8), randn(2, 2, 7, 8)
    vis = torch.rand(2, 1, 6, 7, device=DEVICE) > 0.3
    vis[..., 0] = True
    if kind == "bool":
        mask = vis
    elif kind == "additive":
        mask = torch.zeros(vis.shape, device=DEVICE).masked_fill(~vis, -math.inf)
    else:
        mask = randn(1, 2, 6, 7, requires_grad=True)  # a learned bias, broadcast over the batch
    # SDPA's math backend as the reference: its memory-efficient backward fails on this odd shape on
    # CUDA ("LSE is not correctly aligned"), and the math one is what the others approximate anyway
    with sdpa_kernel(SDPBackend.MATH):
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    with flashtx.patch_sdpa(), warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # fallback warnings (not third-party deprecations)
        got = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert len(calls) == 1
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    if mask.requires_grad:
        (g_want,) = torch.autograd.grad(want.sum(), mask)
        (g_got,) = torch.autograd.grad(got.sum(), mask)
        torch.testing.assert_close(g_got, g_want, rtol=1e-5, atol=1e-5)


def test_dropout_goes_to_flashtx(calls):
    q = randn(1, 2, 16, 8)
    with flashtx.patch_sdpa(), warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # fallback warnings (not third-party deprecations)
        out = F.scaled_dot_product_attention(q, q, q, dropout_p=0.5)
    assert len(calls) == 1
    assert not torch.allclose(out, F.scaled_dot_product_attention(q, q, q))  # dropout was applied


def test_patched_model_compiles_without_graph_breaks():
    torch.manual_seed(0)
    layer = CausalSelfAttention().to(DEVICE)
    x = randn(2, 7, 32)
    with flashtx.patch_sdpa():
        ex = torch._dynamo.explain(layer)(x)
    assert ex.graph_break_count == 0, ex.break_reasons
    ops = {str(n.target) for g in ex.graphs for n in g.graph.nodes if n.op == "call_function"}
    assert "flashtx.attn_fwd.default" in ops


PLAIN_CASES = {  # 4-D calls without attn_mask or dropout: the patch's shortcut decides them in ints and bools
    "mha": lambda: (randn(2, 2, 5, 8), randn(2, 2, 7, 8), randn(2, 2, 7, 8), False),
    "gqa": lambda: (randn(1, 4, 5, 8), randn(1, 2, 5, 8), randn(1, 2, 5, 8), True),
    "gqa-without-enable_gqa": lambda: (randn(1, 4, 5, 8), randn(1, 2, 5, 8), randn(1, 2, 5, 8), False),
    "one-kv-head": lambda: (randn(1, 4, 5, 8), randn(1, 1, 5, 8), randn(1, 1, 5, 8), False),  # broadcast, as SDPA
    "no-kv-heads": lambda: (randn(1, 4, 5, 8), randn(1, 0, 5, 8), randn(1, 0, 5, 8), True),
    "dv-differs": lambda: (randn(1, 2, 5, 8), randn(1, 2, 5, 8), randn(1, 2, 5, 16), False),
    "d-mismatch": lambda: (randn(1, 2, 5, 8), randn(1, 2, 5, 4), randn(1, 2, 5, 4), False),
    "dtype-mismatch": lambda: (randn(1, 2, 5, 8), randn(1, 2, 5, 8).double(), randn(1, 2, 5, 8), False),
    "batch-mismatch": lambda: (randn(2, 2, 5, 8), randn(1, 2, 5, 8), randn(1, 2, 5, 8), False),
    "empty-keys": lambda: (randn(1, 2, 5, 8), randn(1, 2, 0, 8), randn(1, 2, 0, 8), False),
    "strided": lambda: (randn(1, 5, 2, 8).transpose(1, 2), randn(1, 7, 2, 8).transpose(1, 2),
                        randn(1, 7, 2, 8).transpose(1, 2), False),
    "head-dim-320": lambda: (randn(1, 2, 5, 320), randn(1, 2, 5, 320), randn(1, 2, 5, 320), False),  # no config
}


@pytest.mark.usefixtures("fresh_plans")
@pytest.mark.parametrize("gpu_branch", [False, True], ids=["device-branch", "gpu-branch"])
@pytest.mark.parametrize("case", list(PLAIN_CASES))
def test_plain_call_shortcut_agrees_with_every_check(case, gpu_branch, monkeypatch):
    """Where the shortcut accepts a call, the full list of checks gives the same reason (the shortcut runs flashtx
    without them when there is none); where it declines, the full checks decide, as before. gpu-branch: the GPU's
    checks (a kernel config for the inputs; on CPU sdpa_patch._GPU stood in by "cpu", as
    flashtx.testing_gpu_trace does), where head dim 320 has a reason."""
    if gpu_branch and DEVICE == "cpu":
        monkeypatch.setattr(sdpa_patch, "_GPU", "cpu")
    q, k, v, gqa = PLAIN_CASES[case]()
    full = sdpa_patch._full_reason(q, k, v, None, 0.0, True, gqa)
    if sdpa_patch._plain(q, k, v, None, 0.0, True, gqa):
        assert sdpa_patch._plain_reason(q, k, v) == full
    assert sdpa_patch.unsupported_reason(q, k, v, None, 0.0, True, None, gqa) == full
    on_gpu_branch = gpu_branch or DEVICE != "cpu"
    assert (full is not None and full.startswith("no fast flashtx backend")) == (case == "head-dim-320"
                                                                                and on_gpu_branch), full
    expected_plain = case in ("mha", "gqa", "one-kv-head", "dv-differs", "strided", "head-dim-320")
    assert sdpa_patch._plain(q, k, v, None, 0.0, True, gqa) == expected_plain
    assert not sdpa_patch._plain(q, k, v, None, 0.0, 1, gqa)  # a non-bool is_causal: torch's error
