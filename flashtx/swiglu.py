"""Fused SwiGLU activation, silu(gate) * up: validation and the public functions.

Layers, as for attention: the Triton kernel (flashtx.triton_kernels.swiglu, no autograd), the
registered ops with their autograd (flashtx._swiglu_op), `swiglu(gate, up)` / `swiglu_packed(x)`
here, and the module flashtx.nn.SwiGLU.

The forward saves only its inputs; the backward recomputes silu from them. With
`inplace_backward=True` the backward writes the input gradients over the saved inputs (the gate
and up tensors, or the packed x) and returns those buffers as the gradients: no new activation
memory in backward, but after backward those inputs hold gradients, not their values.
"""
from __future__ import annotations

import torch
from torch import Tensor

from . import _dispatch, _swiglu_lane
from ._library import call
from ._swiglu_op import SWIGLU_BACKENDS, SwigluInputs, swiglu_op, swiglu_packed_op  # noqa: F401
from ._validate import check_flag, check_tensor, grad_leaf, has_internal_overlap, views_overlap


# ----------------------------------------------------------------------------------- public API
def _select(t: Tensor, backend) -> str:
    """The backend for t's (device, dtype), resolved once and cached (a constant under torch.compile)."""
    if backend is not None and not isinstance(backend, str):
        raise TypeError(f"backend must be None or a string; got {type(backend).__name__}")
    return _dispatch.plan_device("swiglu", backend, t.device, t.dtype)


_dispatch.STANDINS["swiglu"] = lambda device, dtype: SwigluInputs(torch.empty(0, device=device, dtype=dtype))


def swiglu(gate, up, *, inplace_backward=False, backend=None):
    """Fused SwiGLU activation: ``silu(gate) * up`` in one pass, forward and backward.

    Args:
        gate, up: (..., H), same shape, dtype (float16, bfloat16, float32; float64 for tests)
            and device; any strides. Typically x @ W1 and x @ W3 of a LLaMA MLP.
        inplace_backward: write dgate/dup over gate/up in backward and return those buffers as
            the gradients (saves two activations). Opt-in: after backward, gate and up hold their
            gradients; use it only when nothing else reads them (e.g. fresh projection outputs).
            gate and up must share no element (the halves of one [gate | up] tensor are fine), and
            neither may be a leaf that requires grad, or a view of one (a parameter or an input).
            Where only one of them requires grad, the backward is out of place (the other keeps
            its values). Under torch.compile the backward is out of place (the overlap cannot be checked
            while tracing), and so it is under saved-tensor hooks (non-reentrant activation
            checkpointing, offloading), which skip autograd's check that saved tensors are unchanged.
        backend: None (automatic), "triton" or "reference".

    Returns:
        (..., H), contiguous, in gate's dtype. Math is fp32 (fp64 for fp64). The backward saves
        only gate and up and recomputes silu.

    Example:
        >>> h = flashtx.swiglu(x @ w1.T, x @ w3.T)          # (B, S, H)
    """
    out = _swiglu_lane.forward(gate, up, inplace_backward, backend)  # a repeated plain call: one lookup
    if out is not None:
        return out
    _check(gate, up, inplace_backward)
    name = _select(gate, backend)
    if torch.compiler.is_compiling():
        # Dynamo cannot read storage pointers, so the overlap of gate and up is unknown when tracing:
        # the compiled backward is out of place (always correct; the compiler plans its own memory)
        inplace_backward = False
    return call(swiglu_op, gate, up, bool(inplace_backward), name)


def _check(gate, up, inplace_backward) -> None:
    """swiglu's argument checks (flashtx._swiglu_lane runs them too, on a call signature's first call)."""
    check_tensor("gate", gate)
    check_tensor("up", up)
    check_flag("inplace_backward", inplace_backward)
    if gate.dtype != up.dtype:
        raise TypeError(f"gate and up must have the same dtype; got {gate.dtype} and {up.dtype}")
    if gate.device != up.device:
        raise ValueError(f"gate and up must be on one device; got {gate.device} and {up.device}")
    if gate.shape != up.shape or gate.dim() == 0:
        raise ValueError(f"gate and up must have the same shape (..., H) with at least 1 dim; got gate "
                         f"{tuple(gate.shape)} and up {tuple(up.shape)}")
    if inplace_backward and (has_internal_overlap(gate) or has_internal_overlap(up)
                             or (not torch.compiler.is_compiling() and views_overlap(gate, up))):
        raise ValueError("inplace_backward=True needs gate and up with no shared elements (the gradients of both are "
                         "written over them); they may overlap (the same tensor, overlapping slices, a stride-0 dim, "
                         "or strides that do not nest, from as_strided)")
    if inplace_backward:
        _refuse_grad_leaf("gate", gate)
        _refuse_grad_leaf("up", up)


def _refuse_grad_leaf(name: str, t) -> None:
    if grad_leaf(t):
        raise ValueError(f"inplace_backward=True would overwrite {name}, a leaf tensor that requires grad (or a "
                         "view of one: a parameter or an input), with its gradient; pass inplace_backward=False, or "
                         "apply it to a non-leaf such as a projection's output")


def swiglu_packed(x, *, inplace_backward=False, backend=None):
    """Fused SwiGLU of a packed projection: ``silu(x[..., :H]) * x[..., H:]``.

    Args:
        x: (..., 2H) holding [gate | up], e.g. the output of one fused (W1 | W3) linear layer.
            float16, bfloat16, float32 (float64 for tests); any strides.
        inplace_backward: write dx = [dgate | dup] over x in backward and return x's buffer as
            its gradient (opt-in; x then holds its gradient, not its value; not for a leaf that
            requires grad, or a view of one). Out of place under torch.compile (a compiled
            backward may not write its saved inputs: Inductor would copy x for it) and under
            saved-tensor hooks (non-reentrant activation checkpointing, offloading), as swiglu.
        backend: None (automatic), "triton" or "reference".

    Returns:
        (..., H), contiguous, in x's dtype. The backward's dx (..., 2H) is one contiguous tensor.

    Example:
        >>> h = flashtx.swiglu_packed(x @ w13.T)             # w13: (2H, dim) = cat(W1, W3)
    """
    out = _swiglu_lane.forward_packed(x, inplace_backward, backend)  # a repeated plain call: one lookup
    if out is not None:
        return out
    _check_packed(x, inplace_backward)
    name = _select(x, backend)
    return call(swiglu_packed_op, x, bool(inplace_backward), name)


def _check_packed(x, inplace_backward) -> None:
    """swiglu_packed's argument checks (flashtx._swiglu_lane runs them too, on a call signature's first call)."""
    check_tensor("x", x)
    check_flag("inplace_backward", inplace_backward)
    if x.dim() == 0 or x.shape[-1] % 2:
        raise ValueError(f"x must be (..., 2H) holding [gate | up], with an even last dim; got shape {tuple(x.shape)}")
    if inplace_backward and has_internal_overlap(x):
        raise ValueError("inplace_backward=True writes x's gradient over x, but some elements of x may share memory "
                         "(a stride-0 dim, e.g. from expand(), or strides that do not nest, from as_strided; x has "
                         f"shape {tuple(x.shape)} and strides {x.stride()}); pass inplace_backward=False or "
                         "x.contiguous()")
    if inplace_backward:
        _refuse_grad_leaf("x", x)
