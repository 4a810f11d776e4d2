"""What flashtx.nn's KV caches share: argument checks, the buffers' static marking, whether values may be read on
the host, key-mask runs, and `_Sealed`, the proof that the caches' index state is still what flashtx wrote
(`ranges_known`)."""
from __future__ import annotations

import numbers

import torch
from torch import Tensor

from .._library import device_assert


def _check_pos_int(name: str, v, minimum: int = 1) -> int:
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}; got {v!r}")
    return int(v)


def _check_mask(name: str, m, batch: int, seqlen: int, device) -> Tensor | None:
    """None, or a (batch, seqlen) bool tensor on `device` (True = real token)."""
    if m is None:
        return None
    if not isinstance(m, Tensor) or m.dtype != torch.bool:
        got = f"dtype {m.dtype}" if isinstance(m, Tensor) else type(m).__name__
        raise TypeError(f"{name} must be a bool tensor of shape ({batch}, {seqlen}) with True = real token; got {got}")
    if tuple(m.shape) != (batch, seqlen):
        raise ValueError(f"{name} must have shape (B, S) = ({batch}, {seqlen}) (True = real token); "
                         f"got shape {tuple(m.shape)}")
    if m.device != device:
        raise ValueError(f"{name} must be on the activations' device {device}; got {m.device}")
    return m


def _static(t: Tensor) -> Tensor:
    """t marked as a static address: a compiled step writes the caches' buffers and lengths in place, and CUDA-graph
    trees (torch.compile(mode="reduce-overhead")) capture a step only when every input it mutates is static (as
    transformers' StaticCache marks its buffers). Unguarded: another cache's buffers re-record the graph instead of
    recompiling the step. Only a 16-byte aligned t (what the compiled kernels assume of a static input, whose
    alignment is not checked again; a fresh allocation is): an unaligned one assigned by the user stays an ordinary
    input."""
    if not torch.compiler.is_compiling() and t.data_ptr() % 16 == 0:
        torch._dynamo.mark_static_address(t, guard=False)
    return t


def _same_as(name: str, value, like: Tensor) -> Tensor:
    """value, checked to have like's shape, dtype and device (a cache buffer assigned by the user)."""
    if not isinstance(value, Tensor) or value.shape != like.shape or value.dtype != like.dtype or \
            value.device != like.device:
        got = f"{tuple(value.shape)}, {value.dtype} on {value.device}" if isinstance(value, Tensor) else \
            type(value).__name__
        raise ValueError(f"KVCache.{name} must be assigned a tensor of shape {tuple(like.shape)} (B, Hkv, max_len, "
                         f"D), {like.dtype} on {like.device}; got {got}")
    return value


def _host_readable() -> bool:
    """Whether tensor values may be read on the host now (not traced, not inside a CUDA-graph capture)."""
    if torch.compiler.is_compiling():
        return False
    return not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def _mask_runs(key_mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(lead, real, ar): per row the count of leading False (S when none is True), of True, and arange(S)."""
    S = key_mask.shape[1]
    lead = S - key_mask.int().cummax(1).values.sum(1)  # (B,) int64
    return lead, key_mask.sum(1), torch.arange(S, device=key_mask.device)


def _left_padded(key_mask: Tensor) -> tuple[Tensor, Tensor]:
    """(lead, ok): per row the count of leading padding (S for a row of padding only) and whether the row is left
    padding only (pad* real*)."""
    lead, _, ar = _mask_runs(key_mask)
    return lead, (key_mask == (ar[None, :] >= lead[:, None])).all(1)


def _check_ok(ok: Tensor, readable: bool, message: str) -> None:
    """Raise ValueError(message) where a row of ok (B,) is False; traced/captured: a device-side assert."""
    if readable:
        if not bool(ok.all()):
            raise ValueError(message.format(int((~ok).nonzero()[0])))
    else:
        device_assert(ok.all(), message.format("?"))


def _stamp(*ts) -> tuple | None:
    """What tells whether these state tensors still hold what flashtx last wrote: each one's identity, data pointer
    and version counter (every in-place write bumps it), or None where one keeps no version (an inference tensor)."""
    try:
        return tuple([None if t is None else (id(t), t.data_ptr(), t._version) for t in ts])
    except RuntimeError:  # "Inference tensors do not track version counter"
        return None


class _Sealed:
    """The proof behind `ranges_known()` (shared by both caches): `_seal` records the state tensors' stamps where
    every index value they hold is known in range (the host mirror counts the lengths, the rest flashtx wrote from
    checked values); a later in-place write by anyone else changes a stamp. The methods that write state reseal only
    where the state was sealed before (`_intact`), so a value written behind the cache's back is never sealed.
    Writes that bump no version counter (through .data, DLPack, .numpy()) go unseen: the decode kernels' own guards
    (triton_kernels/decode_kernels.py; the CUDA extension's alike) keep every access inside the buffers then, and
    the answer for such a state is unspecified."""

    _sealed: tuple | None = None

    def _state(self) -> tuple | None:
        raise NotImplementedError

    def _mirrored(self) -> bool:
        raise NotImplementedError

    def _seal(self, ok: bool = True) -> None:
        """Seal the state as it is now where `ok` (the caller knows it in range), else unseal it."""
        self._sealed = self._state() if ok and self._mirrored() and _host_readable() else None

    def _intact(self) -> bool:
        """Sealed, and the state tensors unchanged since (eager only: a traced or captured step's writes are
        replayed without Python, so the state it touches is never sealed)."""
        return self._sealed is not None and _host_readable() and self._mirrored() and self._state() == self._sealed

    @staticmethod
    def _unwritten(sealed: tuple | None, lengths: Tensor) -> bool:
        """Whether a failed call's undo may reseal: the state was sealed at its start (`sealed`, the stamps) and
        the lengths tensor (the state's first) was not written since (a call writes it last, on success)."""
        stamp = _stamp(lengths)
        return sealed is not None and stamp is not None and stamp[0] == sealed[0]

    def ranges_known(self) -> bool:
        """Whether every index the decode kernels follow into this cache (lengths, leftpad, page table) is known in
        range without reading it: eager (not traced or captured), the host mirror of the lengths kept, and the
        state tensors unchanged since flashtx last wrote them (their version counters). flashtx.nn's decode steps
        then skip flash_attn_with_kvcache's per-call index check (a check kernel and a device-side assert on a
        GPU); a cache whose state was written in place from outside (or made of inference tensors) keeps the
        check. Change the state through the cache's methods (reset, crop, allocate, free, reorder)."""
        return self._intact()
