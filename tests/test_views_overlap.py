"""flashtx._overlap.views_overlap (the in-place RoPE and SwiGLU paths ask it whether two views share memory)
against a brute-force check of their element offsets, on random views of one storage, asked twice (the second
answer comes from its memo, which keys layouts and the offset difference, never the storage)."""
import random

import torch

from flashtx import _overlap


def _offsets(t):
    idx = torch.arange(t.untyped_storage().nbytes() // t.element_size())
    return set(idx.as_strided(t.shape, t.stride(), t.storage_offset()).flatten().tolist())


def test_views_overlap_is_exact_for_one_stride_and_remembered():
    rng = random.Random(0)
    _overlap._OVERLAPS.clear()
    base = torch.zeros(4096)
    for _ in range(300):
        dims = rng.randint(1, 3)
        shape = tuple(rng.randint(1, 5) for _ in range(dims))
        stride = tuple(rng.choice([1, 2, 3, 7, 16, 40]) for _ in range(dims))
        same = rng.random() < 0.7
        stride_b = stride if same else tuple(rng.choice([1, 2, 5, 16]) for _ in range(dims))
        a = base.as_strided(shape, stride, rng.randint(0, 300))
        b = base.as_strided(shape, stride_b, rng.randint(0, 300))
        truth = bool(_offsets(a) & _offsets(b))
        for _ in range(2):  # computed, then remembered
            got = _overlap.views_overlap(a, b)
            if same:
                assert got == truth, (shape, stride, a.storage_offset(), b.storage_offset())
            else:
                assert got or not truth  # conservative: never "disjoint" for views that share an element
    assert _overlap._OVERLAPS  # the memo was used
    # the memo keys the offset difference, so views elsewhere in another storage get their own answer
    other = torch.zeros(4096)
    assert not _overlap.views_overlap(base[:8], other[:8])
    assert _overlap.views_overlap(other[:8], other[4:12]) and not _overlap.views_overlap(other[:8], other[8:16])
