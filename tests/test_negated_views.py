"""Lazily negated views (the negative bit, e.g. z.conj().imag) are refused by name, on the general path and on the
lanes that replay a plan for a layout seen before: the kernels read the stored, unnegated values (PyTorch's own
ops resolve the bit first), so such a view gave results of the wrong sign (found by an audit, 2026-12-05)."""
import pytest
import torch
from conftest import DEVICE

import flashtx


def negated(*shape):
    """A float32 view with its negative bit set, strides (..., 2)."""
    return torch.randn(*shape, dtype=torch.complex64, device=DEVICE).conj().imag


def plain_like(*shape):
    """A plain float32 view laid out as negated(*shape) (the lanes key on layouts)."""
    return torch.randn(*shape[:-1], 2 * shape[-1], device=DEVICE)[..., 1::2]


def rand(*shape):
    return torch.randn(*shape, device=DEVICE)


CASES = {
    "swiglu gate": ("gate", lambda t: flashtx.swiglu(t(4, 8), rand(4, 8))),
    "swiglu up": ("up", lambda t: flashtx.swiglu(rand(4, 8), t(4, 8))),
    "swiglu_packed": ("x", lambda t: flashtx.swiglu_packed(t(4, 8))),
    "rope x": ("x", lambda t: flashtx.apply_rotary(t(2, 6, 3, 8), rand(6, 4), rand(6, 4))),
    "rope k": ("k", lambda t: flashtx.apply_rotary_qk(rand(2, 6, 3, 8), t(2, 6, 1, 8), rand(6, 4), rand(6, 4))),
    "rope cos": ("cos", lambda t: flashtx.apply_rotary(rand(2, 6, 3, 8), t(6, 4), rand(6, 4))),
    "attn_mask": ("attn_mask", lambda t: flashtx.attention(rand(1, 2, 5, 8), rand(1, 2, 5, 8), rand(1, 2, 5, 8),
                                                           attn_mask=t(5, 5))),
    "kvcache q": ("q", lambda t: flashtx.flash_attn_with_kvcache(t(2, 1, 4, 16), rand(2, 16, 4, 16),
                                                                 rand(2, 16, 4, 16), cache_seqlens=5)),
    "kvcache k_cache": ("k_cache", lambda t: flashtx.flash_attn_with_kvcache(rand(2, 1, 4, 16), t(2, 16, 4, 16),
                                                                             rand(2, 16, 4, 16), cache_seqlens=5)),
    "kvcache rotary_sin": ("rotary_sin", lambda t: flashtx.flash_attn_with_kvcache(
        rand(2, 1, 4, 16), rand(2, 16, 4, 16), rand(2, 16, 4, 16), k=rand(2, 1, 4, 16), v=rand(2, 1, 4, 16),
        rotary_cos=rand(16, 4), rotary_sin=t(16, 4),
        cache_seqlens=torch.full((2,), 5, dtype=torch.int32, device=DEVICE))),
    "kvcache k": ("k", lambda t: flashtx.flash_attn_with_kvcache(
        rand(2, 1, 4, 16), rand(2, 16, 4, 16), rand(2, 16, 4, 16), k=t(2, 1, 4, 16), v=rand(2, 1, 4, 16),
        cache_seqlens=torch.full((2,), 5, dtype=torch.int32, device=DEVICE))),
}


def unit_negated(*shape):
    """A float32 view with its negative bit set and a unit last stride (torch._neg_view; or as_strided over a
    negated view): one the backends do not copy (a copy would resolve the bit)."""
    return torch._neg_view(torch.randn(*shape, device=DEVICE))


def _no_grad(fn, *a, **kw):
    with torch.no_grad():
        return fn(*a, **kw)


ATTENTION = {
    "attention q": ("q", lambda t: flashtx.attention(t(1, 2, 5, 8), rand(1, 2, 5, 8), rand(1, 2, 5, 8))),
    "attention v causal": ("v", lambda t: flashtx.attention(rand(1, 2, 5, 8), rand(1, 2, 5, 8), t(1, 2, 5, 8),
                                                            is_causal=True)),
    "flash_attn_func k": ("k", lambda t: flashtx.flash_attn_func(rand(1, 5, 2, 8), t(1, 5, 2, 8), rand(1, 5, 2, 8))),
    "decoding attention q": ("q", lambda t: _no_grad(flashtx.attention, t(1, 2, 1, 8), rand(1, 2, 5, 8),
                                                   rand(1, 2, 5, 8))),  # (flashtx._small_q_lane)
    "decoding flash_attn_func v": ("v", lambda t: _no_grad(flashtx.flash_attn_func, rand(1, 2, 2, 8), rand(1, 5, 2, 8),
                                                           t(1, 5, 2, 8), causal=True)),
    "varlen q": ("q", lambda t: flashtx.flash_attn_varlen_func(
        t(5, 2, 8), rand(5, 2, 8), rand(5, 2, 8), *[torch.tensor([0, 5], dtype=torch.int32, device=DEVICE)] * 2, 5, 5)),
}


@pytest.mark.parametrize("case", list(ATTENTION))
def test_negated_attention_inputs_are_refused_by_name(case):
    """q, k, v are validated in ints and bools on the common path (and the lanes take them before): a negated view
    with a unit last stride, which no backend copies, gave a wrong answer there."""
    name, call = ATTENTION[case]
    for _ in range(2):
        call(lambda *s: rand(*s))  # a lane for the layout (a decoding call's: made on its second call)
    for _ in range(2):
        with pytest.raises(ValueError, match=rf"^{name} is a lazily negated view"):
            call(unit_negated)


@pytest.mark.parametrize("case", list(CASES))
def test_negated_views_are_refused_by_name(case):
    name, call = CASES[case]
    for _ in range(2):  # the plain layout twice: any lane for it exists
        call(plain_like)
    assert negated(2, 2).is_neg()
    for _ in range(2):
        with pytest.raises(ValueError, match=rf"^{name} is a lazily negated view .*pass {name}\.resolve_neg\(\)"):
            call(negated)
