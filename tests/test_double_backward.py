"""Double backward (a gradient of a gradient, as a gradient penalty needs) is not implemented by
flashtx's fused ops: differentiating their backward raises a NotImplementedError that says so and
names what to use instead, never torch's "no autograd formula was registered" (which tells the
user to register one) and never a wrong number. First-order gradients still flow as usual."""
from __future__ import annotations

import pytest
import torch
from conftest import randn

import flashtx


def _attention():
    q, k, v = (randn(1, 2, 8, 16, requires_grad=True) for _ in range(3))
    return flashtx.attention(q, k, v, is_causal=True), q


def _swiglu():
    g, u = randn(4, 8, requires_grad=True), randn(4, 8, requires_grad=True)
    return flashtx.swiglu(g, u), g


def _swiglu_packed():
    x = randn(4, 16, requires_grad=True)
    return flashtx.swiglu_packed(x), x


# inplace_backward=True: the gradients written over the inputs carried the forward's autograd history, so a
# double backward silently differentiated the wrong graph (an outside review found second derivatives of 1.0)
def _swiglu_inplace():
    g = randn(4, 8, requires_grad=True)
    return flashtx.swiglu(g * 1.0, randn(4, 8), inplace_backward=True), g


def _swiglu_packed_inplace():
    x = randn(4, 16, requires_grad=True)
    return flashtx.swiglu_packed(x * 1.0, inplace_backward=True), x


@pytest.mark.parametrize("make,what,instead", [
    (_attention, "attention", "scaled_dot_product_attention"),
    (_swiglu, "swiglu", r"silu\(gate\) \* up"),
    (_swiglu_packed, "swiglu_packed", r"silu\(x\[\.\.\., :H\]\)"),
    (_swiglu_inplace, "swiglu", r"silu\(gate\) \* up"),
    (_swiglu_packed_inplace, "swiglu_packed", r"silu\(x\[\.\.\., :H\]\)"),
], ids=["attention", "swiglu", "swiglu_packed", "swiglu-inplace-backward", "swiglu_packed-inplace-backward"])
def test_double_backward_is_refused_clearly(make, what, instead):
    out, x = make()
    (g,) = torch.autograd.grad(out.square().sum(), x, create_graph=True)  # first order works
    assert torch.isfinite(g).all() and g.abs().sum() > 0
    with pytest.raises(NotImplementedError, match=rf"flashtx: {what} has no double backward .*use .*{instead}"):
        g.sum().backward()
