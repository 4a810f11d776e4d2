"""Index checks on the device, without a host sync: a Triton kernel writes a flag, one torch._assert_async per
flag checks it before the kernels that follow the indices run (a device-side assert stops every later kernel of
the stream, as PyTorch's own indexing does).

- `triton_checks(device_type, index)`: whether the check kernels can run there (else callers use torch ops).
- `flashtx::cu_seqlens_check` (triton_kernels/varlen_check.py): cu_seqlens of packed (varlen) batches, one or a
  pair in one launch; `assert_cu_seqlens` launches it and asserts its flags.

KV-cache decoding's own check (flashtx::kvcache_check) lives with its op in flashtx._decode_op.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import Tensor

from . import _env
from ._library import call, device_assert, triton_op
from .backends import triton_device_reasons

_CHECKABLE: dict = {}  # (device type, index) -> the Triton check kernels can run there


@torch.compiler.assume_constant_result  # a constant under torch.compile (no device query traced)
def triton_checks(device_type: str, index) -> bool:
    """Whether the device-side checks can be Triton kernels (else torch ops: no triton, an old GPU)."""
    if device_type == "cpu":
        return _env.INTERPRET and not _env.INTERPRETER_NUMPY_PROBLEM
    ok = _CHECKABLE.get((device_type, index))
    if ok is None:
        device = torch.device(device_type, index) if index is not None else torch.device(device_type)
        ok = _CHECKABLE[device_type, index] = not triton_device_reasons(device, torch.float32)
    return ok


@functools.cache
def _kernels():  # imported once, on first use (never without triton)
    from .triton_kernels import varlen_check

    return varlen_check


@triton_op("flashtx::cu_seqlens_check", mutates_args=())
def cu_seqlens_check(cu_a: Tensor, cu_b: Optional[Tensor], limits: list[Optional[Tensor]], ints: list[int]) -> Tensor:
    """(1,) int32 for cu_a alone, (2,) for cu_a and cu_b (each (N + 1,) int32 or int64, contiguous, the same N):
    entry j is 1 when tensor j starts at 0, never decreases, ends at its total (exactly, or at most) and has no
    sequence longer than its bound. ints: per tensor (total, exact, bounded, int bound); limits: per tensor a 0-dim
    integer tensor bound on the device (bounded), or None. Triton only (see triton_kernels/varlen_check.py)."""
    cus = [cu_a] if cu_b is None else [cu_a, cu_b]
    flag = torch.empty(len(cus), dtype=torch.int32, device=cu_a.device)
    _kernels().cu_seqlens_check(flag, cus, list(limits), list(ints[0::4]), list(ints[1::4]), list(ints[2::4]),
                                list(ints[3::4]))
    return flag


def assert_cu_seqlens(cus: list, limits: list, ints: list, messages: list) -> None:
    """Launch flashtx::cu_seqlens_check on one or two cu_seqlens tensors (see cu_seqlens_check) and assert each
    flag on the device with its message."""
    flag = call(cu_seqlens_check, cus[0], cus[1] if len(cus) == 2 else None, limits, ints)
    if len(cus) == 1:
        device_assert(flag, messages[0])
        return
    device_assert(flag[0], messages[0])
    device_assert(flag[1], messages[1])
