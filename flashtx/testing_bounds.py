"""A bounds checker for Triton's interpreter: every load and store a kernel makes, where its mask is on,
must fall inside the storage of one of the kernel's tensor arguments.

A GPU reports an out-of-bounds access as "an illegal memory access" (when it reports it at all: a few bytes
past an allocation usually land in the caching allocator's pool and read garbage silently). The interpreter
reads raw host addresses and reports nothing. This turns every such access into an `OutOfBounds` error that
names the kernel, the access and the offending address, so CPU tests prove "never a read or write outside a
buffer" for the code that runs on a GPU.

    with flashtx.testing_bounds.checking():
        flashtx.attention(q, k, v)          # raises OutOfBounds on any stray access

The CPU test suite runs every test inside it (an autouse fixture in tests/conftest.py; off on a GPU, and
`FLASHTX_CHECK_BOUNDS=0` turns it off). Only the interpreter is checked (`TRITON_INTERPRET=1` /
`FLASHTX_INTERPRET=1`); compiled kernels are untouched.
"""
from __future__ import annotations

import contextlib
import threading

import numpy as np

__all__ = ["OutOfBounds", "checking", "active"]


class OutOfBounds(AssertionError):
    """A kernel touched memory outside every tensor argument's storage."""


_state = threading.local()


def active() -> bool:
    """True inside `checking()`."""
    return getattr(_state, "depth", 0) > 0


def _tensor_ranges(args) -> list[tuple[int, int]]:
    """[start, end) byte ranges of the storages behind the tensor arguments (tuples and descriptors too)."""
    out = []

    def visit(a):
        if isinstance(a, (tuple, list)):
            for x in a:
                visit(x)
        elif hasattr(a, "untyped_storage"):  # a tensor
            st = a.untyped_storage()
            if st.nbytes():
                out.append((st.data_ptr(), st.data_ptr() + st.nbytes()))
        elif getattr(a, "base", None) is not None:  # a TensorDescriptor or Triton's TensorWrapper
            visit(a.base)

    visit(args)
    return out


class _Kernel:
    """What one launch may touch: its name and its sorted, merged byte ranges."""

    def __init__(self, name: str, ranges: list[tuple[int, int]]):
        self.name = name
        merged: list[list[int]] = []
        for lo, hi in sorted(ranges):
            if merged and lo <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], hi)
            else:
                merged.append([lo, hi])
        self.starts = np.array([r[0] for r in merged], dtype=np.uint64)
        self.ends = np.array([r[1] for r in merged], dtype=np.uint64)

    def check(self, what: str, ptrs: np.ndarray, mask, nbytes: int) -> None:
        p = np.asarray(ptrs, dtype=np.uint64)
        if mask is not None:
            p = p[np.broadcast_to(np.asarray(mask, dtype=bool), p.shape)]
        p = p.ravel()
        if p.size == 0:
            return
        i = np.searchsorted(self.starts, p, side="right").astype(np.int64) - 1
        ok = (i >= 0)
        ends = self.ends[np.clip(i, 0, None)] if self.ends.size else np.zeros_like(p)
        ok &= p + np.uint64(nbytes) <= ends
        if not ok.all():
            bad = p[~ok]
            ranges = ", ".join(f"[{hex(int(a))}, {hex(int(b))})" for a, b in zip(self.starts, self.ends))
            raise OutOfBounds(
                f"{self.name}: {what} of {bad.size} element(s) outside every tensor argument, first at "
                f"{hex(int(bad[0]))} ({nbytes} B each); the arguments span {ranges or 'nothing'}")


_kernel_stack: list[_Kernel] = []


def _install() -> None:
    """Wrap the interpreter's launch and memory ops once; the wrappers check only while `active()`."""
    from triton.runtime import interpreter as ti

    if getattr(ti, "_flashtx_bounds", False):
        return
    builder = ti.InterpreterBuilder
    load, store = builder.create_masked_load, builder.create_masked_store
    rmw, cas = builder.create_atomic_rmw, builder.create_atomic_cas
    call = ti.GridExecutor.__call__

    def current():
        return _kernel_stack[-1] if _kernel_stack and active() else None

    def masked_load(self, ptrs, mask, other, *a, **k):
        kern = current()
        if kern is not None:
            kern.check("load", ptrs.data, mask.data, ptrs.get_element_ty().primitive_bitwidth // 8)
        return load(self, ptrs, mask, other, *a, **k)

    def masked_store(self, ptrs, value, mask, *a, **k):
        kern = current()
        if kern is not None:
            kern.check("store", ptrs.data, mask.data, np.asarray(value.data).dtype.itemsize)
        return store(self, ptrs, value, mask, *a, **k)

    def atomic_rmw(self, op, ptr, val, mask, *a, **k):
        kern = current()
        if kern is not None:
            kern.check("atomic", ptr.data, mask.data, np.asarray(val.data).dtype.itemsize)
        return rmw(self, op, ptr, val, mask, *a, **k)

    def atomic_cas(self, ptr, cmp, val, *a, **k):
        kern = current()
        if kern is not None:
            kern.check("atomic_cas", ptr.data, None, np.asarray(val.data).dtype.itemsize)
        return cas(self, ptr, cmp, val, *a, **k)

    def grid_call(self, *args, **kwargs):
        if not active():
            return call(self, *args, **kwargs)
        # The interpreter runs on host copies of the arguments; for CPU tensors they share storage with
        # the caller's, so the caller's ranges are the ones the kernel's pointers fall in.
        _kernel_stack.append(_Kernel(getattr(self.fn, "__name__", "kernel"),
                                     _tensor_ranges(list(args) + list(kwargs.values()))))
        try:
            return call(self, *args, **kwargs)
        finally:
            _kernel_stack.pop()

    builder.create_masked_load, builder.create_masked_store = masked_load, masked_store
    builder.create_atomic_rmw, builder.create_atomic_cas = atomic_rmw, atomic_cas
    ti.GridExecutor.__call__ = grid_call
    ti._flashtx_bounds = True


@contextlib.contextmanager
def checking():
    """Within this block, interpreted kernels raise `OutOfBounds` on any masked-in access outside their
    tensor arguments' storages. Inputs must be CPU tensors (the interpreter's own device)."""
    _install()
    _state.depth = getattr(_state, "depth", 0) + 1
    try:
        yield
    finally:
        _state.depth -= 1
