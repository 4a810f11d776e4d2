"""The decode kernels' own index guards at their exact boundaries.

flashtx.nn's sealed caches skip the per-call index check (decode.kvcache_step with ranges_known=True), so a state
written from outside without a version bump (through .data) reaches the kernels unchecked. Their guards then keep
every access inside its tensor (the CPU suite's bounds checker, conftest._bounds_checked, fails a test on a stray
one) and write nothing outside the cache: a cache row or page equal to the count (one past the last), a rotary
position equal to the tables' row count, a left padding below one key tile. test_decode_nn_sealed.py drives such
states through flashtx.nn with values far out of range; a guard off by one (`<` for `<=`) passed it, so these
calls sit on the boundary. The answer for a sequence in such a state is unspecified; the others' answers are not.
"""
import pytest
import torch
from conftest import DEVICE, PRECISE_DTYPE

import flashtx
import flashtx.decode as dec

B, H, D, S = 2, 2, 16, 32


def _step(q, kc, vc, k, v, seqlens, *, cos=None, sin=None, batch_idx=None, leftpad=None, block_table=None):
    """kvcache_step without the index check (the sealed path), causal, 1 split; returns out (B, 1, H, D)."""
    return dec.kvcache_step(q, kc, vc, k, v, cos, sin, seqlens, batch_idx, leftpad, block_table, None, True,
                            (-1, -1), 0.0, False, None, 1, False, None, True)


def _rand(*shape):
    return torch.randn(*shape, dtype=PRECISE_DTYPE, device=DEVICE)


def _lens(*xs):
    return torch.tensor(xs, dtype=torch.int32, device=DEVICE)


@pytest.mark.parametrize("append", [True, False], ids=["append", "attend"])
def test_a_cache_row_one_past_the_last_is_neither_read_nor_written(append):
    torch.manual_seed(0)
    q = _rand(B, 1, H, D)
    k, v = (_rand(B, 1, H, D), _rand(B, 1, H, D)) if append else (None, None)
    kc, vc = _rand(3, S, H, D), _rand(3, S, H, D)  # 3 cache rows: sequence 1 points at row 3
    kc0, vc0 = kc.clone(), vc.clone()
    out = _step(q, kc, vc, k, v, _lens(5, 7), batch_idx=_lens(0, 3))
    kc1, vc1 = kc.clone(), vc.clone()
    kc.copy_(kc0), vc.copy_(vc0)
    want = flashtx.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=_lens(5, 7), cache_batch_idx=_lens(0, 2),
                                           causal=True, num_splits=1)  # (sequence 1 in a row that exists)
    torch.testing.assert_close(out[0], want[0], atol=0, rtol=0)  # sequence 0's answer unchanged
    assert torch.equal(kc1[1:], kc0[1:]) and torch.equal(vc1[1:], vc0[1:])  # no other row written
    if append:
        assert torch.equal(kc1[0, 5], k[0, 0]) and torch.equal(kc1[0, :5], kc0[0, :5])


def test_a_page_one_past_the_pool_is_never_written():
    torch.manual_seed(1)
    q, k, v = _rand(B, 1, H, D), _rand(B, 1, H, D), _rand(B, 1, H, D)
    kc, vc = _rand(4, 16, H, D), _rand(4, 16, H, D)  # 4 pages: sequence 1's first page is 4
    kc0, vc0 = kc.clone(), vc.clone()
    bt = torch.tensor([[0, 1], [4, 3]], dtype=torch.int32, device=DEVICE)
    _step(q, kc, vc, k, v, _lens(5, 7), block_table=bt)
    written = torch.zeros(4, 16, dtype=torch.bool, device=DEVICE)
    written[0, 5] = True  # sequence 0's token; sequence 1's (page 4, row 7) is dropped
    assert torch.equal(kc[~written], kc0[~written]) and torch.equal(vc[~written], vc0[~written])
    assert torch.equal(kc[0, 5], k[0, 0]) and torch.equal(vc[0, 5], v[0, 0])


def test_a_position_one_past_the_rotary_tables_rotates_by_nothing():
    """q and the new key at position 20 of tables with 20 rows (their own storage, so a read of row 20 is outside
    every argument): both stay unrotated, as the kernels' guard documents."""
    torch.manual_seed(2)
    q, k, v = _rand(1, 1, H, D), _rand(1, 1, H, D), _rand(1, 1, H, D)
    kc, vc = torch.zeros(1, S, H, D, dtype=PRECISE_DTYPE, device=DEVICE), _rand(1, S, H, D)
    cos, sin = _rand(20, D // 2), _rand(20, D // 2)
    vc0 = vc.clone()
    out = _step(q, kc, vc, k, v, _lens(20), cos=cos, sin=sin)
    assert torch.equal(kc[0, 20], k[0, 0])  # the key appended unrotated
    kc2, vc2 = kc.clone(), vc0.clone()
    want = _step(q, kc2, vc2, k, v, _lens(20))  # no rotary: q unrotated too
    torch.testing.assert_close(out, want, atol=0, rtol=0)


@pytest.mark.parametrize("leftpad", [-7, -100])
def test_a_negative_left_padding_reads_from_position_0(leftpad):
    """Below one key tile (-100) too: the keys start at 0, as with leftpad 0 (no read before the cache row)."""
    torch.manual_seed(3)
    q = _rand(B, 1, H, D)
    kc, vc = _rand(B, S, H, D), _rand(B, S, H, D)
    want = _step(q, kc, vc, None, None, _lens(9, 12), leftpad=_lens(0, 0))
    got = _step(q, kc, vc, None, None, _lens(9, 12), leftpad=_lens(leftpad, leftpad))
    torch.testing.assert_close(got, want, atol=0, rtol=0)
