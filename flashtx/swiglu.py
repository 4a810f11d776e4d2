"""Fused SwiGLU activation, silu(gate) * up: custom ops, backends and the public functions.

Three layers, as for attention: the Triton kernel (flashtx.triton_kernels.swiglu, no autograd),
the custom ops here, and `swiglu(gate, up)` / `swiglu_packed(x)`.

The forward saves only its inputs; the backward recomputes silu from them. With
`inplace_backward=True` the backward writes the input gradients over the saved inputs (the gate
and up tensors, or the packed x) and returns those buffers as the gradients: no new activation
memory in backward, but after backward those inputs hold gradients, not their values.
"""
from __future__ import annotations

import math

import dataclasses

import torch
from torch import Tensor

from . import reference
from ._validate import check_tensor, has_internal_overlap, refuse_double_backward, views_overlap
from .backends import select_backend_for, triton_device_reasons


# ----------------------------------------------------------------------------------- backends
@dataclasses.dataclass(frozen=True)
class SwigluInputs:
    gate: Tensor

    @property
    def device(self) -> torch.device:
        return self.gate.device

    @property
    def dtype(self) -> torch.dtype:
        return self.gate.dtype


class SwigluTriton:
    """flashtx's Triton SwiGLU kernel: CUDA tensors, or CPU tensors in Triton's interpreter."""

    name = "triton"

    def not_supported_reasons(self, inp: SwigluInputs) -> list[str]:
        return triton_device_reasons(inp.device, inp.dtype)

    def forward(self, g, u, out) -> None:
        from .triton_kernels.swiglu import swiglu_forward

        swiglu_forward(g, u, out)

    def backward(self, do, g, u, dg, du) -> None:
        from .triton_kernels.swiglu import swiglu_backward

        swiglu_backward(do, g, u, dg, du)


class SwigluReference:
    """Eager PyTorch (flashtx.reference.swiglu): any device and float dtype."""

    name = "reference"

    def not_supported_reasons(self, inp: SwigluInputs) -> list[str]:
        return []

    def forward(self, g, u, out) -> None:
        out.copy_(reference.swiglu(g, u))

    def backward(self, do, g, u, dg, du) -> None:
        a, b = reference.swiglu_backward(do, g, u)  # computed fully before dg/du (maybe g/u) are written
        dg.copy_(a)
        du.copy_(b)


SWIGLU_BACKENDS = {"triton": SwigluTriton(), "reference": SwigluReference()}


def _rows(t: Tensor) -> Tensor:
    """(..., H) -> (M, H): a view whenever strides allow (always for the packed halves of a 2-D x)."""
    return t.reshape(math.prod(t.shape[:-1]), t.shape[-1])  # not -1: a size-0 dim makes -1 ambiguous


def _rows_inplace(t: Tensor, write) -> None:
    """Run write(rows) on an (M, H) view of t, or on a copy that is copied back into t."""
    try:
        rows = t.view(math.prod(t.shape[:-1]), t.shape[-1])
    except RuntimeError:  # strides do not allow a flat view: work on a copy
        rows = _rows(t).clone()
        write(rows)
        t.copy_(rows.view(t.shape))
        return
    write(rows)


# ----------------------------------------------------------------------------------- custom ops
@torch.library.custom_op("flashtx::swiglu", mutates_args=())
def swiglu_op(gate: Tensor, up: Tensor, inplace_backward: bool, backend: str) -> Tensor:
    """silu(gate) * up for gate, up (..., H); the output is contiguous."""
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    SWIGLU_BACKENDS[backend].forward(_rows(gate), _rows(up), _rows(out))
    return out


@swiglu_op.register_fake
def _(gate, up, inplace_backward, backend):
    return gate.new_empty(gate.shape)


@torch.library.custom_op("flashtx::swiglu_bwd", mutates_args=())
def swiglu_bwd_op(dout: Tensor, gate: Tensor, up: Tensor, backend: str) -> tuple[Tensor, Tensor]:
    """(dgate, dup), contiguous, for the incoming gradient dout (..., H)."""
    dg = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    du = torch.empty(up.shape, dtype=up.dtype, device=up.device)
    SWIGLU_BACKENDS[backend].backward(_rows(dout), _rows(gate), _rows(up), _rows(dg), _rows(du))
    return dg, du


@swiglu_bwd_op.register_fake
def _(dout, gate, up, backend):
    return gate.new_empty(gate.shape), up.new_empty(up.shape)


@torch.library.custom_op("flashtx::swiglu_bwd_", mutates_args=("gate", "up"))
def swiglu_bwd_inplace_op(dout: Tensor, gate: Tensor, up: Tensor, backend: str) -> None:
    """Overwrite gate with dgate and up with dup."""
    b = SWIGLU_BACKENDS[backend]
    do = _rows(dout)

    def write_gate(g):
        _rows_inplace(up, lambda u: b.backward(do, g, u, g, u))

    _rows_inplace(gate, write_gate)


@swiglu_bwd_inplace_op.register_fake
def _(dout, gate, up, backend):
    return None


def _setup(ctx, inputs, output):
    gate, up, inplace_backward, backend = inputs
    ctx.save_for_backward(gate, up)  # the only state kept for backward
    ctx.args = (inplace_backward, backend)


def _backward(ctx, dout):
    gate, up = ctx.saved_tensors
    inplace_backward, backend = ctx.args
    if inplace_backward:
        swiglu_bwd_inplace_op(dout, gate, up, backend)
        return gate, up, None, None
    dg, du = swiglu_bwd_op(dout, gate, up, backend)
    return dg, du, None, None


swiglu_op.register_autograd(_backward, setup_context=_setup)
refuse_double_backward(swiglu_bwd_op, "swiglu", "torch.nn.functional.silu(gate) * up")


@torch.library.custom_op("flashtx::swiglu_packed", mutates_args=())
def swiglu_packed_op(x: Tensor, inplace_backward: bool, backend: str) -> Tensor:
    """silu(x[..., :H]) * x[..., H:] for x (..., 2H); the output (..., H) is contiguous."""
    h = x.shape[-1] // 2
    out = torch.empty((*x.shape[:-1], h), dtype=x.dtype, device=x.device)
    x2 = _rows(x)  # (M, 2H)
    SWIGLU_BACKENDS[backend].forward(x2[:, :h], x2[:, h:], _rows(out))
    return out


@swiglu_packed_op.register_fake
def _(x, inplace_backward, backend):
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))


@torch.library.custom_op("flashtx::swiglu_packed_bwd", mutates_args=())
def swiglu_packed_bwd_op(dout: Tensor, x: Tensor, backend: str) -> Tensor:
    """dx (..., 2H), contiguous, holding [dgate | dup]."""
    h = x.shape[-1] // 2
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    x2, dx2 = _rows(x), _rows(dx)  # (M, 2H)
    SWIGLU_BACKENDS[backend].backward(_rows(dout), x2[:, :h], x2[:, h:], dx2[:, :h], dx2[:, h:])
    return dx


@swiglu_packed_bwd_op.register_fake
def _(dout, x, backend):
    return x.new_empty(x.shape)


@torch.library.custom_op("flashtx::swiglu_packed_bwd_", mutates_args=("x",))
def swiglu_packed_bwd_inplace_op(dout: Tensor, x: Tensor, backend: str) -> None:
    """Overwrite x (..., 2H) with its gradient [dgate | dup]."""
    h = x.shape[-1] // 2
    do = _rows(dout)
    _rows_inplace(x, lambda x2: SWIGLU_BACKENDS[backend].backward(do, x2[:, :h], x2[:, h:], x2[:, :h], x2[:, h:]))


@swiglu_packed_bwd_inplace_op.register_fake
def _(dout, x, backend):
    return None


def _setup_packed(ctx, inputs, output):
    x, inplace_backward, backend = inputs
    ctx.save_for_backward(x)
    ctx.args = (inplace_backward, backend)


def _backward_packed(ctx, dout):
    (x,) = ctx.saved_tensors
    inplace_backward, backend = ctx.args
    if inplace_backward:
        swiglu_packed_bwd_inplace_op(dout, x, backend)
        return x, None, None
    return swiglu_packed_bwd_op(dout, x, backend), None, None


swiglu_packed_op.register_autograd(_backward_packed, setup_context=_setup_packed)
refuse_double_backward(swiglu_packed_bwd_op, "swiglu_packed", "silu(x[..., :H]) * x[..., H:] in eager PyTorch")


# ----------------------------------------------------------------------------------- public API
def _select(op: str, t: Tensor, backend, summary: str) -> str:
    if backend is not None and not isinstance(backend, str):
        raise TypeError(f"backend must be None or a string; got {type(backend).__name__}")
    return select_backend_for(op, SWIGLU_BACKENDS, SwigluInputs(t), backend, summary)


def swiglu(gate, up, *, inplace_backward=False, backend=None):
    """Fused SwiGLU activation: ``silu(gate) * up`` in one pass, forward and backward.

    Args:
        gate, up: (..., H), same shape, dtype (float16, bfloat16, float32; float64 for tests)
            and device; any strides. Typically x @ W1 and x @ W3 of a LLaMA MLP.
        inplace_backward: write dgate/dup over gate/up in backward and return those buffers as
            the gradients (saves two activations). Opt-in: after backward, gate and up hold their
            gradients; use it only when nothing else reads them (e.g. fresh projection outputs).
            gate and up must share no element (the halves of one [gate | up] tensor are fine).
        backend: None (automatic), "triton" or "reference".

    Returns:
        (..., H), contiguous, in gate's dtype. Math is fp32 (fp64 for fp64). The backward saves
        only gate and up and recomputes silu.

    Example:
        >>> h = flashtx.swiglu(x @ w1.T, x @ w3.T)          # (B, S, H)
    """
    check_tensor("gate", gate)
    check_tensor("up", up)
    if gate.dtype != up.dtype:
        raise TypeError(f"gate and up must have the same dtype; got {gate.dtype} and {up.dtype}")
    if gate.device != up.device:
        raise ValueError(f"gate and up must be on one device; got {gate.device} and {up.device}")
    if gate.shape != up.shape or gate.dim() == 0:
        raise ValueError(f"gate and up must have the same shape (..., H) with at least 1 dim; got gate "
                         f"{tuple(gate.shape)} and up {tuple(up.shape)}")
    if inplace_backward and (views_overlap(gate, up) or has_internal_overlap(gate) or has_internal_overlap(up)):
        raise ValueError("inplace_backward=True needs gate and up with no shared elements (the gradients of both are "
                         "written over them); they overlap (the same tensor, overlapping slices, or a stride-0 dim)")
    name = _select("swiglu", gate, backend, f"gate/up {tuple(gate.shape)}, dtype={gate.dtype}, device={gate.device}")
    return swiglu_op(gate, up, bool(inplace_backward), name)


def swiglu_packed(x, *, inplace_backward=False, backend=None):
    """Fused SwiGLU of a packed projection: ``silu(x[..., :H]) * x[..., H:]``.

    Args:
        x: (..., 2H) holding [gate | up], e.g. the output of one fused (W1 | W3) linear layer.
            float16, bfloat16, float32 (float64 for tests); any strides.
        inplace_backward: write dx = [dgate | dup] over x in backward and return x's buffer as
            its gradient (opt-in; x then holds its gradient, not its value).
        backend: None (automatic), "triton" or "reference".

    Returns:
        (..., H), contiguous, in x's dtype. The backward's dx (..., 2H) is one contiguous tensor.

    Example:
        >>> h = flashtx.swiglu_packed(x @ w13.T)             # w13: (2H, dim) = cat(W1, W3)
    """
    check_tensor("x", x)
    if x.dim() == 0 or x.shape[-1] % 2:
        raise ValueError(f"x must be (..., 2H) holding [gate | up], with an even last dim; got shape {tuple(x.shape)}")
    name = _select("swiglu_packed", x, backend, f"x {tuple(x.shape)}, dtype={x.dtype}, device={x.device}")
    return swiglu_packed_op(x, bool(inplace_backward), name)
