"""A GPU's concurrency in Triton's interpreter, for tests/test_program_order.py.

The interpreter runs a launch's programs one after another, in grid order, and each program's tensor ops
whole. A GPU runs the programs concurrently, in any order, and a program's loads and stores are spread over
threads. So a kernel whose result depends on program order, or whose programs touch each other's bytes, passes
every interpreter test and is wrong on a GPU. `program_order(order)` makes both visible:

- the programs of each launch run in `order`: "forward" (the interpreter's), "reverse" or "shuffle" (seeded);
- every masked-in load and store is recorded as the bytes it touches, per program, and each launch is checked:
  - two programs writing the same bytes, or one reading bytes another writes (a race on a GPU);
  - a program loading bytes it stored earlier (or storing them twice) with no barrier in between: on a GPU
    other threads may do the store and the load, and only a barrier (tl.debug_barrier) orders them.

Findings are collected in the list the context manager yields ("kernel: what"; its .launched names every
launch). It patches the interpreter's
InterpreterBuilder (set_grid_dim, set_grid_idx, create_masked_load/store, create_barrier) and GridExecutor
.__call__ (wrapped, not copied), which Triton 3.6 to 3.9 share. Plain and tensor-descriptor loads and stores go
through create_masked_load/store there and are recorded; atomics are not (no flashtx kernel uses one).
Single-threaded use only.
"""
from __future__ import annotations

import contextlib
import random

import numpy as np

ORDERS = ("forward", "reverse", "shuffle")


def _bytes(ptrs, mask, nbytes: int) -> np.ndarray:
    p = np.asarray(ptrs, dtype=np.uint64)
    if mask is not None:
        p = p[np.broadcast_to(np.asarray(mask, dtype=bool), p.shape)]
    p = np.unique(p.ravel())
    if nbytes > 1 and p.size:
        p = (p[:, None] + np.arange(nbytes, dtype=np.uint64)[None, :]).ravel()
    return p


def _check_launch(name: str, recs: list, findings: list) -> None:
    """recs: (program, kind, epoch, bytes) in execution order; epoch counts the program's barriers."""
    writes = [(p, b) for p, kind, _, b in recs if kind == "store" and b.size]
    if writes:
        wb = np.concatenate([b for _, b in writes])
        wp = np.concatenate([np.full(b.size, p, dtype=np.int64) for p, b in writes])
        order = np.argsort(wb, kind="stable")
        wb, wp = wb[order], wp[order]
        ub, start = np.unique(wb, return_index=True)
        wmin, wmax = np.minimum.reduceat(wp, start), np.maximum.reduceat(wp, start)
        if (wmin != wmax).any():
            findings.append(f"{name}: {int((wmin != wmax).sum())} bytes written by two programs")
        reads = [(p, b) for p, kind, _, b in recs if kind == "load" and b.size]
        if reads:
            rb = np.concatenate([b for _, b in reads])
            rp = np.concatenate([np.full(b.size, p, dtype=np.int64) for p, b in reads])
            idx = np.clip(np.searchsorted(ub, rb), 0, ub.size - 1)
            other = (ub[idx] == rb) & ((wmin[idx] != rp) | (wmax[idx] != rp))
            if other.any():
                findings.append(f"{name}: {int(other.sum())} bytes read by one program and written by another")
    stored: dict = {}  # program -> (epoch, bytes stored in that epoch)
    for p, kind, epoch, b in recs:
        ep, seen = stored.get(p, (epoch, None))
        if ep != epoch:
            seen = None
        if seen is not None and b.size and np.intersect1d(seen, b).size:
            findings.append(f"{name}: a program {'loads' if kind == 'load' else 'stores again'} bytes it stored, "
                            "with no barrier in between")
        if kind == "store":
            seen = b if seen is None else np.union1d(seen, b)
        stored[p] = (epoch, seen)


class _Findings(list):
    """The findings (strings); .launched: the kernels' names, one per launch."""

    def __init__(self):
        super().__init__()
        self.launched: list[str] = []


@contextlib.contextmanager
def program_order(order: str = "reverse", seed: int = 0):
    if order not in ORDERS:
        raise ValueError(f"order: got {order!r}; allowed: {', '.join(ORDERS)}")
    from triton.runtime import interpreter as ti

    B, G = ti.InterpreterBuilder, ti.GridExecutor
    saved = {n: getattr(B, n) for n in ("set_grid_dim", "set_grid_idx", "create_masked_load", "create_masked_store",
                                        "create_barrier")}
    call = G.__call__
    st = {"perm": None, "recs": None, "prog": 0, "epoch": {}}
    findings = _Findings()

    def set_grid_dim(self, nx, ny, nz):
        saved["set_grid_dim"](self, nx, ny, nz)
        perm = list(range(nx * ny * nz))
        if order == "reverse":
            perm.reverse()
        elif order == "shuffle":
            random.Random(seed * 1_000_003 + len(perm)).shuffle(perm)
        st["perm"] = perm

    def set_grid_idx(self, x, y, z):  # the interpreter's (x, y, z) loop, mapped through the permutation
        _, ny, nz = self.grid_dim
        i = st["perm"][(x * ny + y) * nz + z]
        st["prog"] = i
        x, r = divmod(i, ny * nz)
        saved["set_grid_idx"](self, x, *divmod(r, nz))

    def record(kind, ptrs, mask, nbytes):
        if st["recs"] is not None:
            p = st["prog"]
            st["recs"].append((p, kind, st["epoch"].get(p, 0), _bytes(ptrs, mask, nbytes)))

    def masked_load(self, ptrs, mask, *args, **kwargs):
        record("load", ptrs.data, mask.data, ptrs.get_element_ty().primitive_bitwidth // 8)
        return saved["create_masked_load"](self, ptrs, mask, *args, **kwargs)

    def masked_store(self, ptrs, value, mask, *args, **kwargs):
        record("store", ptrs.data, mask.data, np.asarray(value.data).dtype.itemsize)
        return saved["create_masked_store"](self, ptrs, value, mask, *args, **kwargs)

    def barrier(self, *args, **kwargs):
        st["epoch"][st["prog"]] = st["epoch"].get(st["prog"], 0) + 1
        return saved["create_barrier"](self, *args, **kwargs)

    def grid_call(self, *args, **kwargs):
        outer = st["recs"], st["epoch"]
        st["recs"], st["epoch"] = [], {}
        try:
            result = call(self, *args, **kwargs)
            name = getattr(self.fn, "__name__", "kernel")
            findings.launched.append(name)
            _check_launch(name, st["recs"], findings)
            return result
        finally:
            st["recs"], st["epoch"] = outer

    for n, fn in (("set_grid_dim", set_grid_dim), ("set_grid_idx", set_grid_idx), ("create_masked_load", masked_load),
                  ("create_masked_store", masked_store), ("create_barrier", barrier)):
        setattr(B, n, fn)
    G.__call__ = grid_call
    try:
        yield findings
    finally:
        for n, fn in saved.items():
            setattr(B, n, fn)
        G.__call__ = call
