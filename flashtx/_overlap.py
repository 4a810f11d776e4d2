"""Whether views share memory: the in-place paths (RoPE, SwiGLU's backward, the KV-cache append) refuse or avoid
writes through a layout that revisits memory, or into a view another input reads."""
from __future__ import annotations

import torch


def _sorted_by_first(items: list, reverse: bool = False) -> list:
    """items (tuples) sorted by their first element (ties in any order), by insertion with `<`: under torch.compile
    each comparison of symbolic sizes becomes a guard, where Dynamo refuses sorted() over symbolic keys (a view's
    in-place call under dynamic shapes did not compile). A handful of dims: quadratic is nothing."""
    out: list = []
    for item in items:
        i = len(out)
        while i > 0 and ((out[i - 1][0] < item[0]) if reverse else (item[0] < out[i - 1][0])):
            i -= 1
        out.insert(i, item)
    return out


def has_internal_overlap(t: torch.Tensor) -> bool:
    """May two elements of t share memory? True for a stride-0 dim of size > 1 (expand(): the overlap PyTorch's
    in-place ops refuse) and for strides that do not nest (an as_strided view that revisits memory, which PyTorch
    writes into without a word). Conservative: nesting means each dim's stride, in increasing order, passes the
    reach of the smaller ones; a layout that fails it is reported even where no two elements coincide."""
    if t.is_contiguous() or t.numel() == 0:
        return False
    reach = 0  # the largest offset the dims of smaller stride reach (ties: the second of equal strides overlaps)
    for stride, size in _sorted_by_first(list(zip(t.stride(), t.shape))):
        if size > 1:
            if stride <= reach:
                return True
            reach += stride * (size - 1)
    return False


_OVERLAP_SEARCH_LIMIT = 10_000  # nodes of the exact search below before answering "may overlap"


_OVERLAPS: dict = {}  # views_overlap's answers for plain tensors of one storage, by layout and offset difference


def views_overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Do a and b share an element? Exact for views with the same strides (slices of one tensor, as
    q and k of a fused qkv projection); conservative (memory spans intersect) otherwise. The answer depends
    only on the layouts and the offset difference: memoised per those for plain tensors (a model asks it of
    the same q, k layout every layer; the search costs ~6 us, the lookup ~1)."""
    if a.numel() == 0 or b.numel() == 0 or a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    if a.is_meta and a.untyped_storage()._cdata != b.untyped_storage()._cdata:
        return False  # (every meta storage's data pointer is 0: tell them apart by the storage itself)
    if type(a) is not torch.Tensor or type(b) is not torch.Tensor or torch.compiler.is_compiling():
        return _overlap(a, b)  # (a fake or traced tensor's sizes may be symbolic: unhashable)
    key = (a.dtype, a.shape, a.stride(), b.dtype, b.shape, b.stride(), b.storage_offset() - a.storage_offset())
    hit = _OVERLAPS.get(key)
    if hit is None:
        if len(_OVERLAPS) >= 1024:
            _OVERLAPS.clear()
        hit = _OVERLAPS[key] = _overlap(a, b)
    return hit


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """views_overlap's answer for two non-empty tensors of one storage."""
    if a.dtype != b.dtype or a.dim() != b.dim() or a.stride() != b.stride():
        def span(t):
            lo = t.storage_offset() * t.element_size()
            return lo, lo + (sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride())) + 1) * t.element_size()
        (a0, a1), (b0, b1) = span(a), span(b)
        return a0 < b1 and b0 < a1
    # a's element (i) and b's element (j) coincide iff sum_k (i_k - j_k) * stride_k = offset(b) - offset(a),
    # with i_k - j_k in [-(b.shape[k] - 1), a.shape[k] - 1]. Search the digits, largest stride first.
    dims = _sorted_by_first([(abs(st), -(nb - 1), na - 1) for st, na, nb in zip(a.stride(), a.shape, b.shape)
                             if st != 0], reverse=True)
    reach = [0] * (len(dims) + 1)  # reach[k]: the most that dims k.. can add or subtract
    for k in range(len(dims) - 1, -1, -1):
        st, lo, hi = dims[k]
        reach[k] = reach[k + 1] + st * max(-lo, hi)
    budget = [_OVERLAP_SEARCH_LIMIT]

    def solvable(k: int, rest: int) -> bool:
        budget[0] -= 1
        if budget[0] < 0:
            return True  # too many candidates to decide: say "may overlap"
        if k == len(dims):
            return rest == 0
        st, lo, hi = dims[k]
        first, last = max(lo, -((reach[k + 1] - rest) // st)), min(hi, (rest + reach[k + 1]) // st)
        return any(solvable(k + 1, rest - t * st) for t in range(first, last + 1))

    return solvable(0, b.storage_offset() - a.storage_offset())
