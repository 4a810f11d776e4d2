"""flashtx.nn's KV caches, bookkeeping a mutation round found untested: a cross-attention cache's padded memory
through reorder() and reset(), a refused call undoing the key mask and left padding (contiguous cache), leading
padding after real tokens (holes), a freed or cropped paged row's left padding, and the seal over state written
from outside (reorder, a block table replaced by a view). Each test failed under one surviving mutation; every
result is compared with the layer run without a cache."""
import pytest
import torch

import flashtx.nn.attention as nn_attention
from flashtx.nn import MultiheadAttention, RotaryEmbedding

from conftest import DEVICE, PRECISE_DTYPE, precise_atol, randn

P = PRECISE_DTYPE
ATOL = precise_atol(1e-10)
pytestmark = pytest.mark.usefixtures("fresh_plans")


def _self_layer():
    torch.manual_seed(0)
    return MultiheadAttention(32, 4, 2, rotary=RotaryEmbedding(8), causal=True, device=DEVICE, dtype=P).eval()


def _cross_layer():
    torch.manual_seed(0)
    return MultiheadAttention(32, 4, 2, cross=True, kdim=24, device=DEVICE, dtype=P).eval()


def _mask(*rows):
    return torch.tensor(rows, dtype=torch.bool, device=DEVICE)


def test_a_reordered_cross_cache_keeps_each_rows_memory_length():
    """Beam search over a right-padded memory: after reorder([1, 0]) each row attends to its own memory's keys."""
    layer = _cross_layer()
    x, mem = randn(2, 1, 32, dtype=P), randn(2, 7, 24, dtype=P)
    mask = _mask([True] * 5 + [False] * 2, [True] * 7)
    with torch.no_grad():
        cache = layer.new_cache(2, max_len=7)
        layer(x, mem, key_mask=mask, cache=cache)
        cache.reorder([1, 0])
        got = layer(x, mem, key_mask=mask, cache=cache)  # (the memory is read from the cache once it is filled)
        want = layer(x, mem[[1, 0]], key_mask=mask[[1, 0]])
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


def test_a_reset_cross_cache_forgets_the_old_memorys_length():
    layer = _cross_layer()
    x, mem = randn(2, 1, 32, dtype=P), randn(2, 7, 24, dtype=P)
    with torch.no_grad():
        cache = layer.new_cache(2, max_len=7)
        layer(x, mem, key_mask=_mask([True] * 3 + [False] * 4, [True] * 7), cache=cache)
        cache.reset()
        got = layer(x, mem, cache=cache)  # a new memory without a mask
        want = layer(x, mem)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


def _refuse(*a, **k):
    raise RuntimeError("stand-in: the step was refused")  # (after the cache's bookkeeping: undone)


def test_a_refused_masked_call_leaves_the_key_mask_as_it_was(monkeypatch):
    layer = _self_layer()
    x = randn(2, 3, 32, dtype=P)
    with torch.no_grad():
        cache = layer.new_cache(2, 16)
        layer(x[:, :2], key_mask=_mask([False, False], [True, True]), cache=cache)
        monkeypatch.setattr(nn_attention, "kvcache_step", _refuse)
        with pytest.raises(RuntimeError, match="stand-in"):
            layer(x[:, 2:3], key_mask=_mask([False], [True]), cache=cache)
    assert int(cache.length) == 2 and bool(cache.key_mask[:, 2:].all())


def test_a_refused_masked_call_leaves_a_contiguous_caches_left_padding(monkeypatch):
    layer = _self_layer()
    x = randn(2, 3, 32, dtype=P)
    mask = _mask([False, True, True], [True] * 3)
    with torch.no_grad():
        cache = layer.new_cache(2, 32)
        monkeypatch.setattr(nn_attention, "kvcache_step", _refuse)
        with pytest.raises(RuntimeError, match="stand-in"):
            layer(x, key_mask=mask, cache=cache)
        assert cache.leftpad.tolist() == [0, 0]
        monkeypatch.undo()
        got = layer(x, key_mask=mask, cache=cache)
        want = layer(x, key_mask=mask, cache=layer.new_cache(2, 32))
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


def test_leading_padding_after_real_tokens_makes_holes():
    layer = _self_layer()
    x = randn(2, 4, 32, dtype=P)
    m1, m2 = _mask([True, True], [True, True]), _mask([False, True], [True, True])
    with torch.no_grad():
        cache = layer.new_cache(2, 16)
        layer(x[:, :2], key_mask=m1, cache=cache)
        got = layer(x[:, 2:], key_mask=m2, cache=cache)
        want = layer(x, key_mask=torch.cat([m1, m2], 1))[:, 2:]
    assert cache.holes
    torch.testing.assert_close(got[0, 1:], want[0, 1:], atol=ATOL, rtol=0)  # (row 0's padded query is unspecified)
    torch.testing.assert_close(got[1], want[1], atol=ATOL, rtol=0)


def test_a_freed_paged_row_forgets_its_left_padding():
    layer = _self_layer()
    x = randn(2, 6, 32, dtype=P)
    with torch.no_grad():
        cache = layer.new_cache(2, 64, paged=True)
        layer(x[:, :4], key_mask=_mask([True] * 4, [False, False, True, True]), cache=cache)
        cache.free(1)
        assert cache.leftpad[1].item() == 0
        fresh = layer.new_cache(2, 64, paged=True)
        got = layer(x[:, :3], key_mask=_mask([True, False, False], [True] * 3), cache=cache)[1]
        want = layer(x[:, :3], cache=fresh)[1]
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


def test_a_paged_crop_into_the_left_padding_clamps_it():
    """Row 1 (left-padded by 2) cropped to 1 token: its left padding becomes 1, so the next real token sees itself
    (as a fresh cache of the same kept tokens would)."""
    layer = _self_layer()
    x = randn(2, 6, 32, dtype=P)
    with torch.no_grad():
        cache = layer.new_cache(2, 64, paged=True)
        layer(x[:, :4], key_mask=_mask([True] * 4, [False, False, True, True]), cache=cache)
        cache.crop([4, 1])
        assert cache.leftpad.tolist() == [0, 1] and cache.seqlens.tolist() == [4, 1]
        got = layer(x[:, 4:5], cache=cache)[1]
        want = layer(x[1:, 4:5])[0]  # the only key it sees: itself, at position 1
    assert got.isfinite().all()
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


def test_reorder_keeps_state_written_from_outside_unsealed():
    layer = _self_layer()
    x = randn(2, 5, 32, dtype=P)
    with torch.no_grad():
        cache = layer.new_cache(2, 32)
        layer(x[:, :4], cache=cache)
        cache.leftpad[1] = 9  # written from outside: past the length
        cache.reorder([0, 1])
        assert not cache.ranges_known()
        with pytest.raises(ValueError, match="leftpad"):
            layer(x[:, 4:], cache=cache)


def test_a_block_table_replaced_by_a_view_unseals_the_cache():
    layer = _self_layer()
    x = randn(2, 21, 32, dtype=P)
    with torch.no_grad():
        cache = layer.new_cache(2, 64, paged=True, page_size=16)
        layer(x[:, :20], cache=cache)
        assert cache.ranges_known()
        cache.block_table = cache.block_table[:, :1]  # the same data pointer: 16 positions a sequence, 20 held
        assert not cache.ranges_known()
