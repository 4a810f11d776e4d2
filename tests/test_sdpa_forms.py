"""SDPA's less common argument forms, in flashtx.attention and under flashtx.patch_sdpa: torch.nn.attention.bias's
CausalBias masks (upper-left / lower-right), other __torch_function__ subclass masks, lazily negated views, a
0-dim tensor scale, and dropout_p's one message for every out-of-range value."""
import warnings

import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICE, randn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import CausalBias, causal_lower_right, causal_upper_left

import flashtx
from flashtx import sdpa_patch


@pytest.fixture(autouse=True)
def unpatched():
    """Every test starts and ends with torch's own SDPA and no remembered warnings."""
    original = F.scaled_dot_product_attention
    sdpa_patch._warned.clear()
    yield
    sdpa_patch.disable()
    assert F.scaled_dot_product_attention is original


def _math_sdpa(*args, **kw):
    """torch's SDPA on its MATH backend (its CPU flash backend errs on some edge rows), rows seeing no key 0."""
    with sdpa_kernel(SDPBackend.MATH):
        return torch.nan_to_num(F.scaled_dot_product_attention(*args, **kw), nan=0.0)


def _causal(make, sq, sk) -> CausalBias:
    with warnings.catch_warnings():  # (lower_right warns of NaN rows when sq > sk)
        warnings.simplefilter("ignore")
        return make(sq, sk)


@pytest.mark.parametrize("sq,sk", [(5, 3), (3, 5), (17, 17)])
@pytest.mark.parametrize("make", [causal_upper_left, causal_lower_right])
@pytest.mark.parametrize("patched", [False, True])
def test_causal_bias_mask(make, sq, sk, patched):
    """A CausalBias is causal attention in its alignment (it holds no mask values; flashtx read its storage)."""
    q = randn(2, 3, sq, 16, dtype=torch.float64, requires_grad=True)
    k, v = (randn(2, 3, sk, 16, dtype=torch.float64, requires_grad=True) for _ in range(2))
    mask = _causal(make, sq, sk)
    ref = _math_sdpa(q, k, v, attn_mask=mask)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no fallback: flashtx runs it
        if patched:
            with flashtx.patch_sdpa():
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        else:
            out = flashtx.attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=0)
    dout = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), dout), torch.autograd.grad(ref, (q, k, v), dout)):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)


def test_causal_bias_errors():
    q = randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="attn_mask is a CausalBias.*is_causal must be False; got True"):
        flashtx.attention(q, q, q, attn_mask=causal_upper_left(4, 4), is_causal=True)
    with pytest.raises(ValueError, match="CausalBias for 3 queries and 9 keys; the inputs have 4 and 4"):
        flashtx.attention(q, q, q, attn_mask=causal_upper_left(3, 9))
    with flashtx.patch_sdpa(), warnings.catch_warnings(), pytest.raises((ValueError, RuntimeError)):
        warnings.simplefilter("error", UserWarning)  # torch's error, no fallback warning
        F.scaled_dot_product_attention(q, q, q, attn_mask=causal_upper_left(4, 4), is_causal=True)


class _Wrapped(torch.Tensor):
    """A tensor subclass with its own __torch_function__ and real values (as_subclass): a mask like any other."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return super().__torch_function__(func, types, args, kwargs or {})


def test_subclass_masks():
    """A __torch_function__ subclass holding its values is read as a mask; a CausalBias (no values) given to
    flash_attn_func's attn_bias is refused by name (its storage was read)."""
    q = randn(1, 2, 4, 8, dtype=torch.float64)
    plain = randn(4, 4, dtype=torch.float64)
    want = _math_sdpa(q, q, q, attn_mask=plain)
    torch.testing.assert_close(flashtx.attention(q, q, q, attn_mask=plain.as_subclass(_Wrapped)).as_subclass(
        torch.Tensor), want, atol=1e-12, rtol=0)
    with flashtx.patch_sdpa(), warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        out = F.scaled_dot_product_attention(q, q, q, attn_mask=plain.as_subclass(_Wrapped))
    torch.testing.assert_close(out.as_subclass(torch.Tensor), want, atol=1e-12, rtol=0)
    qb = q.transpose(1, 2)  # (B, S, H, D)
    with pytest.raises(TypeError, match="attn_bias is a torch.nn.attention.bias.CausalBias, which holds no mask"):
        flashtx.flash_attn_func(qb, qb, qb, attn_bias=causal_lower_right(4, 4))
    bias = torch.nn.Parameter(plain.clone())  # (a Parameter is a plain mask)
    torch.testing.assert_close(flashtx.attention(q, q, q, attn_mask=bias), want, atol=1e-12, rtol=0)


def test_negated_views_fall_back_under_the_patch():
    """torch's SDPA takes a lazily negated view; the patch hands such a call to it (flashtx's kernels read the
    stored values) instead of raising."""
    z = torch.randn(1, 2, 5, 8, dtype=torch.complex128, device=DEVICE)
    neg, neg_mask = z.conj().imag, torch.randn(5, 5, dtype=torch.complex128, device=DEVICE).conj().imag
    assert neg.is_neg() and neg_mask.is_neg()
    q = randn(1, 2, 5, 8, dtype=torch.float64)
    for args, mask in (((neg, q, q), None), ((q, neg, q), None), ((q, q, neg), None), ((q, q, q), neg_mask)):
        sdpa_patch._warned.clear()
        with flashtx.patch_sdpa(), pytest.warns(UserWarning, match="lazily negated views"):
            out = F.scaled_dot_product_attention(*args, attn_mask=mask)
        ref = _math_sdpa(*(a.resolve_neg() for a in args), attn_mask=None if mask is None else mask.resolve_neg())
        torch.testing.assert_close(out, ref, atol=1e-12, rtol=0)
    with pytest.raises(ValueError, match="lazily negated view"):
        flashtx.attention(neg, q, q)  # the function itself refuses it, naming the fix


@pytest.mark.parametrize("scale", [torch.tensor(0.5), torch.tensor(2, dtype=torch.int64),
                                   torch.tensor(0.25, dtype=torch.float64)])
def test_tensor_scale(scale):
    """A 0-dim tensor scale is read as SDPA reads it, directly and under the patch (no fallback)."""
    q, k, v = (randn(1, 2, 6, 8, dtype=torch.float64) for _ in range(3))
    ref = _math_sdpa(q, k, v, scale=float(scale))
    torch.testing.assert_close(flashtx.attention(q, k, v, scale=scale), ref, atol=1e-12, rtol=0)
    with flashtx.patch_sdpa(), warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        torch.testing.assert_close(F.scaled_dot_product_attention(q, k, v, scale=scale), ref, atol=1e-12, rtol=0)
    with pytest.raises(TypeError, match="scale must be None or a real number; got Tensor"):
        flashtx.attention(q, k, v, scale=scale.reshape(1))


def test_bool_scale_reason():
    q = randn(1, 2, 6, 8, dtype=torch.float64)
    with flashtx.patch_sdpa(), pytest.warns(UserWarning, match="a scale that is not a real number"):
        F.scaled_dot_product_attention(q, q, q, scale=True)


@pytest.mark.parametrize("p", [-0.1, float("nan"), 1.5, float("inf")])
def test_dropout_p_out_of_range_one_message(p):
    q = randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match=r"dropout_p must be a float in \[0, 1\] \(or a 0-dim tensor of one\)"):
        flashtx.attention(q, q, q, dropout_p=p)


def test_tensor_scale_that_requires_grad():
    """Its gradient would be dropped: refused by name (torch's SDPA refuses it too; the patch hands it to torch)."""
    q = randn(1, 2, 6, 8, dtype=torch.float64, requires_grad=True)
    s = torch.tensor(0.5, dtype=torch.float64, requires_grad=True)
    with pytest.raises(TypeError, match="scale is a tensor that requires grad"):
        flashtx.attention(q, q, q, scale=s)
    with flashtx.patch_sdpa(), warnings.catch_warnings(), pytest.raises(TypeError):
        warnings.simplefilter("error", UserWarning)  # torch's error, no fallback warning
        F.scaled_dot_product_attention(q, q, q, scale=s)
    with torch.no_grad():  # no gradient recorded: read as a number
        torch.testing.assert_close(flashtx.attention(q, q, q, scale=s), _math_sdpa(q, q, q, scale=0.5), atol=1e-12,
                                   rtol=0)


def test_unsupported_reason_checks_the_scale_before_a_causal_bias():
    """unsupported_reason agrees with the call: a bad scale is the reason with a CausalBias mask too."""
    q = randn(1, 2, 4, 8)
    mask = causal_upper_left(4, 4)
    assert "scale outside flashtx's range" in sdpa_patch.unsupported_reason(q, q, q, mask, scale=2.0 ** -200)
    assert "not a real number" in sdpa_patch.unsupported_reason(q, q, q, mask, scale=True)
    assert sdpa_patch.unsupported_reason(q, q, q, mask, scale=0.5) is None
