"""The SwiGLU ops: backends in flashtx._dispatch, triton_ops with their autograd (no validation here).

Ops (schemas as torch.library infers them); every tensor is (..., H) (packed: (..., 2H)):

    flashtx::swiglu(Tensor gate, Tensor up, bool inplace_backward, str backend) -> Tensor
    flashtx::swiglu_bwd(Tensor dout, Tensor gate, Tensor up, str backend) -> (Tensor, Tensor)
    flashtx::swiglu_bwd_(Tensor dout, Tensor(a!) gate, Tensor(b!) up, str backend) -> ()
    flashtx::swiglu_packed(Tensor x, bool inplace_backward, str backend) -> Tensor
    flashtx::swiglu_packed_bwd(Tensor dout, Tensor x, str backend) -> Tensor
    flashtx::swiglu_packed_bwd_(Tensor dout, Tensor(a!) x, str backend) -> ()

The forward saves only its inputs; the backward recomputes silu from them. The `_` ops write the
gradients over the saved inputs (inplace_backward=True). Each op is a flashtx._library.triton_op:
its body is its fake impl too (launches are skipped on fake tensors).
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from . import _dispatch, reference
from ._lanes import no_saved_tensor_hooks, traced
from ._library import call, register_autograd, triton_op
from ._validate import refuse_double_backward
from .backends import triton_device_reasons


# ----------------------------------------------------------------------------------- backends
class SwigluInputs(_dispatch.OpInputs):
    """What dispatch looks at (built only when a plan is resolved)."""

    __slots__ = ("gate",)
    primary = "gate"

    def __init__(self, gate: Tensor):
        self.gate = gate


class SwigluTriton:
    """flashtx's Triton SwiGLU kernel: CUDA tensors, or CPU tensors in Triton's interpreter."""

    name = "triton"

    def not_supported_reasons(self, inp: SwigluInputs) -> list[str]:
        return triton_device_reasons(inp.device, inp.dtype)

    def forward(self, g, u, out) -> None:
        _kernels().swiglu_forward(g, u, out)

    def backward(self, do, g, u, dg, du) -> None:
        _kernels().swiglu_backward(do, g, u, dg, du)

    def backward_packed(self, do, x, dx) -> None:
        """dx (M, 2H) = [dgate | dup] of x = [gate | up] (dx may be x), do (M, H)."""
        _kernels().swiglu_backward_packed(do, x, dx)


_KERNELS = []  # [flashtx.triton_kernels.swiglu] once imported (it imports triton: not at flashtx's import)


def _kernels():
    if not _KERNELS:
        from .triton_kernels import swiglu as mod

        _KERNELS.append(mod)
    return _KERNELS[0]


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

    def backward_packed(self, do, x, dx) -> None:
        h = x.shape[-1] // 2
        self.backward(do, x[:, :h], x[:, h:], dx[:, :h], dx[:, h:])


_dispatch.register("swiglu", "triton", SwigluTriton())
_dispatch.register("swiglu", "reference", SwigluReference())
SWIGLU_BACKENDS = _dispatch.IMPLS["swiglu"]  # the registry's entries, in preference order (selfcheck reads it)


def _rows(t: Tensor) -> Tensor:
    """(..., H) -> (M, H): a view whenever strides allow (always for the packed halves of a 2-D x)."""
    if t.dim() == 2:
        return t
    return t.reshape(math.prod(t.shape[:-1]), t.shape[-1])  # not -1: a size-0 dim makes -1 ambiguous


def _rows_inplace(t: Tensor, write) -> None:
    """Run write(rows) on an (M, H) view of t, or on a copy that is copied back into t."""
    if t.dim() == 2:
        write(t)
        return
    try:
        rows = t.view(math.prod(t.shape[:-1]), t.shape[-1])
    except RuntimeError:  # strides do not allow a flat view: work on a copy
        rows = _rows(t).clone()
        write(rows)
        t.copy_(rows.view(t.shape))
        return
    write(rows)


# ----------------------------------------------------------------------------------- custom ops
_CONTIGUOUS = torch.contiguous_format  # outputs and gradients are contiguous whatever the inputs' strides


@triton_op("flashtx::swiglu", mutates_args=())
def swiglu_op(gate: Tensor, up: Tensor, inplace_backward: bool, backend: str) -> Tensor:
    """silu(gate) * up for gate, up (..., H); the output is contiguous."""
    out = torch.empty_like(gate, memory_format=_CONTIGUOUS)
    SWIGLU_BACKENDS[backend].forward(_rows(gate), _rows(up), _rows(out))
    return out



@triton_op("flashtx::swiglu_bwd", mutates_args=())
def swiglu_bwd_op(dout: Tensor, gate: Tensor, up: Tensor, backend: str) -> tuple[Tensor, Tensor]:
    """(dgate, dup), contiguous, for the incoming gradient dout (..., H)."""
    dg = torch.empty_like(gate, memory_format=_CONTIGUOUS)
    du = torch.empty_like(up, memory_format=_CONTIGUOUS)
    SWIGLU_BACKENDS[backend].backward(_rows(dout), _rows(gate), _rows(up), _rows(dg), _rows(du))
    return dg, du



@triton_op("flashtx::swiglu_bwd_", mutates_args=("gate", "up"))
def swiglu_bwd_inplace_op(dout: Tensor, gate: Tensor, up: Tensor, backend: str) -> None:
    """Overwrite gate with dgate and up with dup."""
    b = SWIGLU_BACKENDS[backend]
    do = _rows(dout)

    def write_gate(g):
        _rows_inplace(up, lambda u: b.backward(do, g, u, g, u))

    _rows_inplace(gate, write_gate)


def _setup(ctx, inputs, output):
    gate, up, inplace_backward, backend = inputs
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(gate, up)  # the only state kept for backward
    # in place only where both inputs take a gradient: one that needs none (a frozen projection's output, cached
    # features) must keep its values
    ctx.args = (inplace_backward and gate.requires_grad and up.requires_grad and no_saved_tensor_hooks(), backend)


def refuse_spent(ctx) -> None:
    """Raise for a second backward over a node whose in-place backward already overwrote its saved inputs
    (retain_graph=True), before unpacking them: torch's own error would name neither the op nor the way out."""
    if getattr(ctx, "spent", False):
        raise RuntimeError("flashtx swiglu: a second backward through a call made with inplace_backward=True "
                           "(retain_graph=True): the first one overwrote the saved inputs with their gradients; "
                           "pass inplace_backward=False to backpropagate through it more than once")


def _backward(ctx, dout):
    if dout is None:
        return None, None, None, None
    refuse_spent(ctx)
    gate, up = ctx.saved_tensors
    inplace_backward, backend = ctx.args
    # create_graph=True: the out-of-place op, whose gradients refuse a double backward clearly (the
    # overwritten inputs would carry the forward's autograd history: wrong second derivatives). Traced (a
    # compiled backward) too: the saved inputs are the backward graph's inputs, which it may not mutate, so
    # Inductor would copy them for the in-place op to write (more traffic than the out-of-place op, and no
    # memory saved)
    if inplace_backward and not torch.is_grad_enabled() and not traced():
        call(swiglu_bwd_inplace_op, dout, gate, up, backend)
        ctx.spent = True
        return gate.detach(), up.detach(), None, None  # (the saved tensors carry the forward's graph: a gradient
        # must not: autograd.grad or a hook would hand the caller a tensor that backpropagates into the forward)
    dg, du = call(swiglu_bwd_op, dout, gate, up, backend)
    return dg, du, None, None


register_autograd(swiglu_op, _backward, _setup)
refuse_double_backward(swiglu_bwd_op, "swiglu", "torch.nn.functional.silu(gate) * up")


@triton_op("flashtx::swiglu_packed", mutates_args=())
def swiglu_packed_op(x: Tensor, inplace_backward: bool, backend: str) -> Tensor:
    """silu(x[..., :H]) * x[..., H:] for x (..., 2H); the output (..., H) is contiguous."""
    h = x.shape[-1] // 2
    out = torch.empty((*x.shape[:-1], h), dtype=x.dtype, device=x.device)
    x2 = _rows(x)  # (M, 2H)
    SWIGLU_BACKENDS[backend].forward(x2[:, :h], x2[:, h:], _rows(out))
    return out



@triton_op("flashtx::swiglu_packed_bwd", mutates_args=())
def swiglu_packed_bwd_op(dout: Tensor, x: Tensor, backend: str) -> Tensor:
    """dx (..., 2H), contiguous, holding [dgate | dup]."""
    dx = torch.empty_like(x, memory_format=_CONTIGUOUS)
    x2, dx2 = _rows(x), _rows(dx)  # (M, 2H)
    SWIGLU_BACKENDS[backend].backward_packed(_rows(dout), x2, dx2)  # not through column views: see the kernel
    return dx



@triton_op("flashtx::swiglu_packed_bwd_", mutates_args=("x",))
def swiglu_packed_bwd_inplace_op(dout: Tensor, x: Tensor, backend: str) -> None:
    """Overwrite x (..., 2H) with its gradient [dgate | dup]."""
    do = _rows(dout)
    _rows_inplace(x, lambda x2: SWIGLU_BACKENDS[backend].backward_packed(do, x2, x2))



def _setup_packed(ctx, inputs, output):
    x, inplace_backward, backend = inputs
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(x)
    ctx.args = (inplace_backward and no_saved_tensor_hooks(), backend)


def _backward_packed(ctx, dout):
    if dout is None:
        return None, None, None
    refuse_spent(ctx)
    (x,) = ctx.saved_tensors
    inplace_backward, backend = ctx.args
    if inplace_backward and not torch.is_grad_enabled() and not traced():  # else out of place (see _backward)
        call(swiglu_packed_bwd_inplace_op, dout, x, backend)
        ctx.spent = True
        return x.detach(), None, None  # (not the saved x, which carries the forward's graph: see _backward)
    return call(swiglu_packed_bwd_op, dout, x, backend), None, None


register_autograd(swiglu_packed_op, _backward_packed, _setup_packed)
refuse_double_backward(swiglu_packed_bwd_op, "swiglu_packed", "silu(x[..., :H]) * x[..., H:] in eager PyTorch")
