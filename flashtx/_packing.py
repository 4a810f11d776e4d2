"""Gradients of packed inputs written in place: q, k, v (or k, v) that are slices of one tensor (a fused QKV
projection's (B, S, 3, H, D) output, flash-attn's packed forms) get gradients that are the same slices of one
buffer, so the packed gradient is that buffer, not a stack of three copies (flash-attn writes dqkv's slices
the same way).

Two halves, both eager-only (a traced call keeps separate gradients and autograd's stack):
- `grads_like(ts)`: where the tensors are equal-strided slices of one dense packed tensor, empty gradients laid
  out as the same slices of one new buffer; the attention lane's backward writes into them.
- `Unpack`: the packed forms' unbind, whose backward returns that buffer as the packed gradient when the slices'
  gradients are exactly its slices (ints only: storage, offsets, strides), and stacks them otherwise.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ._lanes import eager

# Packed tensors below this many elements take autograd's unbind and its stack. This path's Python (an Unpack node,
# the backward's packing checks: ~26 us more per forward + backward, measured on CPU with the launches stubbed)
# exceeds the copy it saves at small sizes (2**20 fp16 elements: 4 MB moved, 1-5 us on an H200 or RTX 3090), where
# a step waits on the host; at training sizes the attention kernels take milliseconds, the host runs ahead of them,
# and the copy (and the memory of a second packed gradient) is what costs.
MIN_NUMEL = 1 << 20


def _dense(shape, strides) -> bool:
    """Whether (shape, strides) covers numel elements from offset 0 exactly once (a permuted contiguous layout)."""
    expected = 1
    for size, stride in sorted(zip(shape, strides), key=lambda p: p[1]):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def part_stride(ts) -> int:
    """The element stride between consecutive tensors of ts when they are equal slices of one dense packed tensor
    (same dtype, shape, strides and storage, consecutive at one stride, the whole storage theirs); 0 otherwise."""
    t0 = ts[0]
    if t0.numel() == 0 or any(type(t) is not Tensor for t in ts):
        return 0
    size = t0.element_size()
    step = ts[1].data_ptr() - t0.data_ptr()
    if step <= 0 or step % size:
        return 0
    base, shape, strides = t0.untyped_storage().data_ptr(), t0.shape, t0.stride()
    for i, t in enumerate(ts):
        if (t.dtype != t0.dtype or t.shape != shape or t.stride() != strides or t.data_ptr() != t0.data_ptr() + i * step
                or t.untyped_storage().data_ptr() != base):
            return 0
    sp = step // size
    if not _dense((*shape, len(ts)), (*strides, sp)):
        return 0
    return sp


def grads_like(ts, sp: int) -> tuple:
    """Empty gradients for ts (equal slices of one dense packed tensor, sp = part_stride(ts)), laid out as the same
    slices of one new buffer."""
    t0 = ts[0]
    buf = torch.empty(len(ts) * t0.numel(), dtype=t0.dtype, device=t0.device)
    return tuple(buf.as_strided(t0.shape, t0.stride(), i * sp) for i in range(len(ts)))


def _reassembled(grads, shape, strides, dtype, dim: int):
    """The gradient of a packed tensor (shape, strides, dtype) as the buffer whose slices along dim grads are (no
    copy), or None where they are not exactly those slices of a buffer holding nothing else."""
    g0 = grads[0]
    if any(g is None for g in grads) or g0.dtype != dtype or g0.storage_offset() != 0:
        return None
    rest = list(strides)
    sp = rest.pop(dim)
    if (tuple(rest) != g0.stride() or part_stride(grads) != sp
            or g0.untyped_storage().nbytes() != len(grads) * g0.numel() * g0.element_size()):
        return None
    return g0.as_strided(shape, strides, 0)


class Unpack(torch.autograd.Function):
    """packed.unbind(dim), whose backward hands back the buffer the slices' gradients were written in when they are
    its slices (grads_like's), else their stack (unbind's backward)."""

    @staticmethod
    def forward(ctx, packed, dim):
        ctx.set_materialize_grads(False)
        ctx.meta = (packed.shape, packed.stride(), packed.dtype, packed.device, dim)
        return packed.unbind(dim)

    @staticmethod
    def backward(ctx, *grads):
        shape, strides, dtype, device, dim = ctx.meta
        whole = _reassembled(grads, shape, strides, dtype, dim)
        if whole is not None:
            return whole, None
        part = shape[:dim] + shape[dim + 1:]
        return torch.stack([torch.zeros(part, dtype=dtype, device=device) if g is None else g for g in grads],
                           dim), None


def unbind(packed: Tensor, dim: int):
    """packed.unbind(dim) whose gradient reuses the slices' gradients' buffer where they are its slices (Unpack); the
    plain unbind where nothing records it or anything traces it."""
    if torch.is_grad_enabled() and packed.requires_grad and type(packed) is Tensor and eager() \
            and packed.numel() >= MIN_NUMEL:  # (eager() before numel(): a traced size is not compared, not guarded)
        return Unpack.apply(packed, dim)
    return packed.unbind(dim)
