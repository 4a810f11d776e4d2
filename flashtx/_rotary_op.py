"""The RoPE ops: backends in flashtx._dispatch, triton_ops with their autograd (no validation here).

Ops (schemas as torch.library infers them):

    flashtx::rotary(Tensor x, Tensor cos, Tensor sin, Tensor?[] index, SymInt[] spec, str backend) -> Tensor
    flashtx::rotary_qk(Tensor q, Tensor k, Tensor cos, Tensor sin, Tensor?[] index, SymInt[] spec,
                       str backend) -> (Tensor, Tensor)
    flashtx::rotary_(Tensor(a!) q, Tensor(b!)? k, Tensor cos, Tensor sin, Tensor?[] index, SymInt[] spec,
                     str backend) -> ()

x, q, k: (B, S, H, D) with any strides, or (B, H, S, D) when spec's heads_first is 1 (the ops
read the strides in that order: no transposed views, so autograd records no view ops around
them); varlen: packed (total, H, D) (or a (1, total, H, D) view). Outputs are laid out as
empty_like(x). cos, sin: (seqlen_ro, R2), or (Bc, seqlen_ro, R2) with Bc in {1, B}. The optional
tensors and the scalars travel grouped, and are unpacked by name (see INDEX and SPEC):

    index = [offsets (B,) | None, position_ids (B, S) or (1, total) | None, cu_seqlens (nseq+1,) | None]
    spec = [offset, max_seqlen, interleaved (0/1), conjugate (0/1), heads_first (0/1; optional, 0)]

The backward of a rotation is the rotation by -theta: the same op with `conjugate` flipped. The
in-place `rotary_` has no autograd formula (torch.library refuses them for mutating ops);
flashtx.rotary runs it only where autograd records nothing, and otherwise writes the functional
op's result back (copy_), which autograd tracks.

Each op is a `flashtx._library.triton_op`: its body is its fake impl too, so it must run on fake
tensors (Launch.run skips the launch there) and stay free of data-dependent Python.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import _dispatch, reference
from ._library import call, register_autograd, triton_op
from .backends import triton_device_reasons

INDEX = ("offsets", "position_ids", "cu_seqlens")  # the order of `index`
SPEC = ("offset", "max_seqlen", "interleaved", "conjugate", "heads_first")  # the order of `spec`


# ----------------------------------------------------------------------------------- backends
class RotaryInputs(_dispatch.OpInputs):
    """What dispatch looks at (built only when a plan is resolved): x as (B, S, H, D) and its cos table."""

    __slots__ = ("x", "cos")
    primary = "x"

    def __init__(self, x: Tensor, cos: Tensor):
        self.x, self.cos = x, cos


class RotaryTriton:
    """flashtx's Triton rotary kernel: CUDA tensors, or CPU tensors in Triton's interpreter."""

    name = "triton"

    def not_supported_reasons(self, inp: RotaryInputs) -> list[str]:
        reasons = triton_device_reasons(inp.device, inp.dtype)
        if inp.cos.dtype == torch.bfloat16 and inp.device.type == "cpu":
            reasons.append("bfloat16 cos/sin are misread by Triton's interpreter (triton-lang/triton#11584)")
        return reasons

    def run(self, q, qo, k, ko, cos, sin, index, spec) -> None:
        launch = _KERNEL or _load_kernel()
        offsets, position_ids, cu_seqlens = index
        launch(q, qo, k, ko, cos, sin, offsets, spec[0], position_ids, cu_seqlens, spec[1], bool(spec[2]),
               bool(spec[3]), _heads_first(spec))


_KERNEL = None  # triton_kernels.rotary.rotary_launch, imported on first use (it imports triton)


def _load_kernel():
    global _KERNEL
    from .triton_kernels.rotary import rotary_launch

    _KERNEL = rotary_launch
    return rotary_launch


def _heads_first(spec) -> bool:
    return len(spec) > 4 and bool(spec[4])


def _bshd(x: Optional[Tensor], heads_first: bool) -> Optional[Tensor]:
    """x as a (B, S, H, D) view (packed (total, H, D): (1, total, H, D))."""
    if x is None:
        return None
    if x.dim() == 3:
        return x.unsqueeze(0)
    return x.transpose(1, 2) if heads_first else x


class RotaryReference:
    """Eager PyTorch (flashtx.reference.rotary_tokens): any device and float dtype. No
    data-dependent shapes or host reads, so it traces (and runs on fake tensors)."""

    name = "reference"

    def not_supported_reasons(self, inp: RotaryInputs) -> list[str]:
        return []

    def run(self, q, qo, k, ko, cos, sin, index, spec) -> None:
        offsets, position_ids, cu_seqlens = index
        offset, _max_seqlen, interleaved, conjugate = spec[:4]
        heads_first = _heads_first(spec)
        q, qo, k, ko = (_bshd(t, heads_first) for t in (q, qo, k, ko))
        if cos.dim() == 2:
            cos, sin = cos.unsqueeze(0), sin.unsqueeze(0)
        for x, out in ((q, qo), (k, ko)):
            if x is None or x.numel() == 0:
                continue
            B, S, H, D = x.shape
            dev = x.device
            rows = torch.arange(S, device=dev)  # (S,) index along x's sequence dim
            if cu_seqlens is None:
                # (B * S,); not repeat_interleave(S): torch.jit.trace on CUDA records its int as a CPU index
                # (index_select then raised, an H100 on 2026-12-06)
                tables = torch.arange(B, device=dev)[:, None].expand(B, S).reshape(-1)
                if position_ids is not None:
                    pos = position_ids.expand(B, S).reshape(-1)
                elif offsets is not None:
                    pos = (rows[None, :] + offsets.long()[:, None]).reshape(-1)
                else:
                    pos = (rows + offset).repeat(B)  # (B * S,)
                tokens = x.reshape(B * S, H, D)
            else:  # validation guarantees cu_seqlens[0] == 0 and cu_seqlens[-1] == total: every row is covered
                cu = cu_seqlens.long()
                tables = torch.searchsorted(cu[1:], rows, right=True)  # (total,) sequence of each row
                if position_ids is not None:
                    pos = position_ids[0]
                else:
                    pos = rows - cu[tables] + (offsets.long()[tables] if offsets is not None else offset)
                tokens = x[0]  # (total, H, D)
            if cos.shape[0] == 1:
                tables = torch.zeros_like(tables)
            res = reference.rotary_tokens(tokens, cos, sin, tables, pos, interleaved=bool(interleaved),
                                          conjugate=bool(conjugate))
            out.copy_(res.view(B, S, H, D))  # computed in full first: out may be x (in place)


_dispatch.register("rotary", "triton", RotaryTriton())
_dispatch.register("rotary", "reference", RotaryReference())
ROTARY_BACKENDS = _dispatch.IMPLS["rotary"]  # the registry's entries, in preference order (selfcheck reads it)


# ----------------------------------------------------------------------------------- ops
@triton_op("flashtx::rotary", mutates_args=())
def rotary_op(x: Tensor, cos: Tensor, sin: Tensor, index: list[Optional[Tensor]], spec: list[int],
              backend: str) -> Tensor:
    """Rotated copy of x (see the module docstring for its layouts), laid out as empty_like(x)."""
    out = torch.empty_like(x)
    ROTARY_BACKENDS[backend].run(x, out, None, None, cos, sin, index, spec)
    return out


@triton_op("flashtx::rotary_qk", mutates_args=())
def rotary_qk_op(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, index: list[Optional[Tensor]], spec: list[int],
                 backend: str) -> tuple[Tensor, Tensor]:
    """Rotated copies of q (B, S, Hq, D) and k (B, S, Hk, D) (or as the module docstring says), from one
    launch."""
    qo, ko = torch.empty_like(q), torch.empty_like(k)
    ROTARY_BACKENDS[backend].run(q, qo, k, ko, cos, sin, index, spec)
    return qo, ko


@triton_op("flashtx::rotary_", mutates_args=("q", "k"))
def rotary_inplace_op(q: Tensor, k: Optional[Tensor], cos: Tensor, sin: Tensor, index: list[Optional[Tensor]],
                      spec: list[int], backend: str) -> None:
    """Rotate q (and k, same launch) in place. No autograd formula (see the module docstring)."""
    ROTARY_BACKENDS[backend].run(q, q, k, k, cos, sin, index, spec)


def _conjugated(spec) -> list:
    offset, max_seqlen, interleaved, conjugate = spec[:4]
    return [offset, max_seqlen, interleaved, 1 - int(conjugate), *spec[4:]]


def _save(ctx, cos, sin, index, spec, backend) -> None:
    """What the backward needs: the tables and positions, and the spec with `conjugate` flipped."""
    ctx.set_materialize_grads(False)  # an unused output's gradient stays None: no zeros are rotated
    ctx.save_for_backward(cos, sin, *index)
    ctx.spec, ctx.backend = _conjugated(spec), backend


def _setup_rotary(ctx, inputs, output):
    x, cos, sin, index, spec, backend = inputs
    _save(ctx, cos, sin, index, spec, backend)


def _setup_rotary_qk(ctx, inputs, output):
    q, k, cos, sin, index, spec, backend = inputs
    _save(ctx, cos, sin, index, spec, backend)


def _rotary_backward(ctx, dout):
    if dout is None:
        return None, None, None, None, None, None
    return rotated_grads(ctx, ctx.saved_tensors, dout, None)[0], None, None, None, None, None


def _rotary_qk_backward(ctx, dq, dk):
    return (*rotated_grads(ctx, ctx.saved_tensors, dq, dk), None, None, None, None, None)


def rotated_grads(ctx, saved, dq, dk) -> tuple:
    """(dq, dk) rotated back (the conjugate rotation, each None where its gradient is) by the ops, from the node's
    saved tensors (unpacked once by the caller: checkpointing allows one unpacking)."""
    cos, sin, *index = saved
    if dq is not None and dk is not None:
        return call(rotary_qk_op, dq, dk, cos, sin, index, ctx.spec, ctx.backend)
    if dq is not None:
        return call(rotary_op, dq, cos, sin, index, ctx.spec, ctx.backend), None
    if dk is not None:
        return None, call(rotary_op, dk, cos, sin, index, ctx.spec, ctx.backend)
    return None, None


register_autograd(rotary_op, _rotary_backward, _setup_rotary)
register_autograd(rotary_qk_op, _rotary_qk_backward, _setup_rotary_qk)
