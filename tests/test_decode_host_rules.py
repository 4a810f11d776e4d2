"""flash_attn_with_kvcache's host rules a mutation round over the decode host code found untested: refusals by name
(index tensors on another device, integer or complex inputs, an expanded cache to append into, a v_cache of other
heads, rotary tables one row short, a bad page the window reaches), layouts read as given (a lane's q of other
strides, a lazily negated q after a lane exists, a column-major sin beside a contiguous cos), flash-attn's rotation
of q under a window without causality, and a value head dim past the Triton tiles. Each test failed under one
surviving mutation."""
import pytest
import torch

import flashtx
from flashtx import _decode_op
from flashtx._dispatch import BackendNotSupported
from flashtx.backends import MAX_HEAD_DIM

from conftest import DEVICE, PRECISE_DTYPE, precise_atol

pytestmark = pytest.mark.usefixtures("fresh_plans")
HALF = torch.float16


def rand(*shape, dtype=HALF, seed=None):
    g = None if seed is None else torch.Generator().manual_seed(seed)
    return torch.randn(*shape, dtype=torch.float64, generator=g).to(dtype).to(DEVICE)


def lens(*n):
    return torch.tensor(n, dtype=torch.int32, device=DEVICE)


@pytest.mark.parametrize("name", ["cache_seqlens", "cache_leftpad", "cache_batch_idx"])
def test_index_tensors_on_another_device_are_refused_by_name(name):
    q, kc, vc = rand(2, 1, 2, 16), rand(2, 32, 2, 16), rand(2, 32, 2, 16)
    kw = dict(cache_seqlens=lens(3, 4))
    kw[name] = torch.tensor([0, 1] if name == "cache_batch_idx" else [3, 4], dtype=torch.int32, device="meta")
    with torch.no_grad(), pytest.raises(ValueError, match=f"{name} must be on q's device"):
        flashtx.flash_attn_with_kvcache(q, kc, vc, causal=True, **kw)


@pytest.mark.parametrize("dtype", [torch.int32, torch.complex64, torch.bool])
def test_inputs_of_a_dtype_no_kernel_takes_are_refused_by_name(dtype):
    q, kc, vc = (torch.ones(*s, dtype=dtype, device=DEVICE) for s in ((2, 1, 2, 16), (2, 32, 2, 16), (2, 32, 2, 16)))
    with torch.no_grad(), pytest.raises(TypeError, match=f"q has dtype {dtype}; allowed: float16, bfloat16"):
        flashtx.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens(3, 4))


def test_appending_into_an_expanded_cache_is_refused():
    kc = torch.zeros(1, 32, 2, 16, dtype=HALF, device=DEVICE).expand(2, 32, 2, 16)
    vc = torch.zeros(2, 32, 2, 16, dtype=HALF, device=DEVICE)
    q, k, v = (rand(2, 1, 2, 16) for _ in range(3))
    with torch.no_grad(), pytest.raises(ValueError, match="k_cache has stride 0 along batch"):
        flashtx.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=lens(3, 3), causal=True)


def test_a_v_cache_of_other_heads_is_refused():
    q, kc, vc = rand(2, 1, 2, 16), rand(2, 32, 2, 16), rand(2, 32, 1, 16)
    with torch.no_grad(), pytest.raises(ValueError, match="v_cache must match its first three dims"):
        flashtx.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens(3, 5), causal=True)


def test_rotary_tables_must_hold_the_new_tokens_position():
    """The new token of sequence 0 goes to position 5: a 5-row table lacks it, a 6-row one holds it."""
    q, k, v = (rand(2, 1, 2, 16) for _ in range(3))
    kc, vc = rand(2, 32, 2, 16), rand(2, 32, 2, 16)
    ang = torch.rand(6, 4, device=DEVICE)
    with torch.no_grad():
        with pytest.raises(ValueError, match="rotary_cos/rotary_sin have 5 positions but sequence 0 needs position 5"):
            flashtx.flash_attn_with_kvcache(q, kc, vc, k, v, rotary_cos=ang[:5].cos(), rotary_sin=ang[:5].sin(),
                                            cache_seqlens=lens(5, 0), causal=True)
        flashtx.flash_attn_with_kvcache(q, kc, vc, k, v, rotary_cos=ang.cos(), rotary_sin=ang.sin(),
                                        cache_seqlens=lens(5, 0), causal=True)


def test_a_bad_page_at_the_windows_first_key_is_refused():
    """window (9, 0) for the query at position 40 reaches back to key 31, the last row of page 1: a bad entry there is
    read, so it is refused (the pages before it are never touched and may hold anything)."""
    g = torch.Generator().manual_seed(0)
    kc, vc = (torch.randn(8, 16, 2, 16, generator=g).to(HALF).to(DEVICE) for _ in range(2))
    bt = torch.arange(8, dtype=torch.int32).view(2, 4).to(DEVICE)
    bt[0, 1] = 1000
    q, k, v = (rand(2, 1, 2, 16) for _ in range(3))
    with torch.no_grad(), pytest.raises(ValueError, match=r"block_table\[0, 1\] = 1000 is not a page index"):
        flashtx.flash_attn_with_kvcache(q, kc, vc, k, v, block_table=bt, cache_seqlens=lens(40, 40), causal=True,
                                        window_size=(9, 0))


def test_a_lazily_negated_q_is_refused_after_a_lane_exists():
    kc, vc = rand(2, 32, 2, 16), rand(2, 32, 2, 16)
    with torch.no_grad():
        for _ in range(3):
            flashtx.flash_attn_with_kvcache(rand(2, 1, 2, 16), kc, vc, cache_seqlens=lens(4, 9), causal=True)
        with pytest.raises(ValueError, match="q is a lazily negated view"):
            flashtx.flash_attn_with_kvcache(torch._neg_view(rand(2, 1, 2, 16)), kc, vc, cache_seqlens=lens(4, 9),
                                            causal=True)


def test_a_q_of_other_strides_after_a_lane_is_read_as_given():
    kc, vc = rand(2, 32, 2, 16, seed=1), rand(2, 32, 2, 16, seed=2)
    with torch.no_grad():
        for _ in range(3):
            flashtx.flash_attn_with_kvcache(rand(2, 2, 2, 16), kc, vc, cache_seqlens=lens(4, 9), causal=True)
        qt = rand(2, 2, 2, 16, seed=3).transpose(1, 2)  # (B, Sq, H, D) with other strides
        got = flashtx.flash_attn_with_kvcache(qt, kc, vc, cache_seqlens=lens(4, 9), causal=True)
        want = flashtx.flash_attn_with_kvcache(qt, kc, vc, cache_seqlens=lens(4, 9), causal=True, backend="reference")
    torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)  # (the fp16 output: ~2 ulp)


def test_a_column_major_sin_beside_a_contiguous_cos_is_read_as_given():
    q, k, v = (rand(2, 1, 2, 16, seed=i) for i in range(3))
    g = torch.Generator().manual_seed(0)
    cos = torch.randn(32, 4, generator=g).to(DEVICE)
    sin = torch.randn(4, 32, generator=g).to(DEVICE).t()  # stride(1) != 1
    outs = []
    for s in (sin, sin.contiguous()):
        kc, vc = (torch.zeros(2, 32, 2, 16, dtype=HALF, device=DEVICE) for _ in range(2))
        with torch.no_grad():
            outs.append((flashtx.flash_attn_with_kvcache(q, kc, vc, k, v, rotary_cos=cos, rotary_sin=s,
                                                         cache_seqlens=lens(4, 9), causal=True), kc))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_a_window_without_causality_rotates_q_at_each_tokens_position(backend):
    """flash-attn's rule: q's tokens are rotated at cache_seqlens + i when causal or with a local window (the same
    position for every token only for full non-causal attention)."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 1, 16, generator=g, dtype=torch.float64).to(PRECISE_DTYPE).to(DEVICE)
    kc, vc = (torch.randn(1, 32, 1, 16, generator=g, dtype=torch.float64).to(PRECISE_DTYPE).to(DEVICE)
              for _ in range(2))
    ang = (torch.arange(32, dtype=torch.float64)[:, None] * torch.rand(1, 8, generator=g, dtype=torch.float64))
    cos, sin = ang.cos().to(DEVICE), ang.sin().to(DEVICE)
    with torch.no_grad():
        got = flashtx.flash_attn_with_kvcache(q, kc, vc, rotary_cos=cos, rotary_sin=sin, cache_seqlens=lens(10),
                                              window_size=(4, 4), rotary_interleaved=False, backend=backend)
        q_rot = flashtx.apply_rotary_emb(q, cos, sin, seqlen_offsets=10, interleaved=False)  # positions 10, 11
        want = flashtx.flash_attn_with_kvcache(q_rot, kc, vc, cache_seqlens=lens(10), window_size=(4, 4),
                                               backend="reference")
    torch.testing.assert_close(got, want, atol=precise_atol(1e-10), rtol=0)


def test_a_value_head_dim_past_the_tiles_goes_to_the_reference():
    """Dv = 512 > MAX_HEAD_DIM (q's 16 fits): automatic dispatch plans the reference, backend='triton' refuses it;
    also after a call of the same q and caches with Dv = 16 was planned on Triton."""
    q, kc = rand(1, 1, 1, 16), rand(1, 16, 1, 16)
    small, wide = rand(1, 16, 1, 16), rand(1, 16, 1, 2 * MAX_HEAD_DIM)
    with torch.no_grad():
        assert _decode_op.select(q, kc, small, None) == "triton"
        flashtx.flash_attn_with_kvcache(q, kc, small, cache_seqlens=lens(5))
        assert _decode_op.select(q, kc, wide, None) == "reference"
        with pytest.raises(BackendNotSupported, match="backend='triton' cannot run kvcache_attention"):
            flashtx.flash_attn_with_kvcache(q, kc, wide, cache_seqlens=lens(5), backend="triton")
