"""The caches' lifecycle. KVCache.crop / PagedKVCache.crop: speculative decoding's rollback. A step of draft
tokens, the rejected ones cropped, then more steps: every kept output equals the uncached forward over the accepted
tokens alone (PRECISE_DTYPE), through flash_attn_with_kvcache, and the host's counts stay right (a full cache is
still refused by name, not early). KVCache.reset after calls with gradients."""
import pytest
import torch
from conftest import DEVICE, PRECISE_DTYPE, precise_atol, randn

from flashtx.nn import MultiheadAttention, RotaryEmbedding

pytestmark = [pytest.mark.filterwarnings("error:.*using the reference implementation"),
              pytest.mark.usefixtures("fresh_plans")]

E, H, HKV = 32, 4, 2


def no_flash_attn_func(*args, **kwargs):
    raise AssertionError("cached call took the flash_attn_func path")


def _layer():
    torch.manual_seed(0)
    return MultiheadAttention(E, H, HKV, rotary=RotaryEmbedding(8), causal=True,
                              dtype=PRECISE_DTYPE).to(DEVICE).eval()


def _close(got, want, msg):
    torch.testing.assert_close(got, want, atol=precise_atol(1e-12), rtol=0, msg=msg)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("negative", [False, True])
def test_crop_drops_rejected_drafts_and_decoding_continues(paged, negative, monkeypatch):
    """Prompt, a step of 3 drafts of which the first is accepted, crop, 3 more tokens one at a time: the outputs
    of the accepted draft and of the later tokens are the uncached forward's over prompt + accepted + later."""
    monkeypatch.setattr("flashtx.nn.attention.flash_attn_func", no_flash_attn_func)
    layer = _layer()
    B, P = 2, 5
    prompt, drafts, later = (randn(B, n, E, dtype=PRECISE_DTYPE) for n in (P, 3, 3))
    cache = layer.new_cache(B, max_len=16, paged=paged)
    with torch.no_grad():
        full = layer(torch.cat((prompt, drafts[:, :1], later), 1))  # (B, P + 4, E)
        _close(layer(prompt, cache=cache), full[:, :P], "prompt")
        out = layer(drafts, cache=cache)
        _close(out[:, :1], full[:, P:P + 1], "the accepted draft")  # (causal: it saw no rejected one)
        assert cache.crop(-2 if negative else P + 1) is cache
        held = cache.seqlens.tolist() if paged else [int(cache.length)] * B
        assert held == [P + 1] * B
        for t in range(3):
            _close(layer(later[:, t:t + 1], cache=cache), full[:, P + 1 + t:P + 2 + t], f"token {t} after the crop")


def test_paged_crop_keeps_its_own_count_per_sequence(monkeypatch):
    """Sequence 0 keeps 1 of its 3 drafts, sequence 1 all 3, sequence 2 none: each then decodes on from its own
    length, matching its own uncached forward."""
    monkeypatch.setattr("flashtx.nn.attention.flash_attn_func", no_flash_attn_func)
    layer = _layer()
    B, P = 3, 4
    prompt, drafts, later = (randn(B, n, E, dtype=PRECISE_DTYPE) for n in (P, 3, 2))
    keep = [1, 3, 0]
    cache = layer.new_cache(B, max_len=32, paged=True, page_size=16)
    with torch.no_grad():
        layer(prompt, cache=cache)
        layer(drafts, cache=cache)
        cache.crop(torch.tensor([P + n for n in keep]))
        assert cache.seqlens.tolist() == [P + n for n in keep]
        outs = [layer(later[:, t:t + 1], cache=cache) for t in range(2)]
        for b, n in enumerate(keep):
            full = layer(torch.cat((prompt[b:b + 1], drafts[b:b + 1, :n], later[b:b + 1]), 1))[0]  # (P + n + 2, E)
            for t in range(2):
                _close(outs[t][b, 0], full[P + n + t], f"sequence {b}, token {t}")


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_crop_counts_on_the_host_and_refuses_bad_lengths_by_name(paged):
    """After a crop the cache holds exactly what it kept: it fills up to max_len again and is refused by name
    one token past it; lengths outside [-held, held] (or of another type) are refused, the cache unchanged."""
    layer = _layer()
    cache = layer.new_cache(1, max_len=16, paged=paged)
    x = randn(1, 16, E, dtype=PRECISE_DTYPE)
    name = "PagedKVCache" if paged else "KVCache"
    with torch.no_grad():
        layer(x[:, :10], cache=cache)
        for bad, error in ((11, ValueError), (-11, ValueError), (2.0, TypeError), (True, TypeError)):
            with pytest.raises(error, match=rf"{name}.crop: "):
                cache.crop(bad)
        if paged:
            with pytest.raises(TypeError, match="PagedKVCache.crop: lengths must be an int or 1 ints"):
                cache.crop([3, 4])
        assert (cache.seqlens.tolist() if paged else [int(cache.length)]) == [10]
        cache.crop(4)
        layer(x[:, 4:16], cache=cache)  # 12 more: full again
        with pytest.raises(ValueError, match=f"{name} is full"):
            layer(x[:, :1], cache=cache)


def test_crop_into_left_padding_leaves_the_row_without_real_tokens():
    """A row whose real tokens are all cropped away holds none again: its leftpad moves back to the length, so a
    new left-padded prompt may follow; a cross-attention memory cannot be cropped."""
    layer = _layer()
    cache = layer.new_cache(2, max_len=16)
    mask = torch.tensor([[True] * 6, [False] * 4 + [True] * 2], device=DEVICE)
    with torch.no_grad():
        layer(randn(2, 6, E, dtype=PRECISE_DTYPE), key_mask=mask, cache=cache)
        assert cache.leftpad.tolist() == [0, 4]
        cache.crop(3)
        assert cache.leftpad.tolist() == [0, 3] and bool(cache.key_mask[:, 3:].all())
    cross = MultiheadAttention(E, H, HKV, cross=True, dtype=PRECISE_DTYPE).to(DEVICE).eval()
    mem_cache = cross.new_cache(2, max_len=8)
    with torch.no_grad():
        cross(randn(2, 1, E, dtype=PRECISE_DTYPE), memory=randn(2, 8, E, dtype=PRECISE_DTYPE), cache=mem_cache)
    with pytest.raises(ValueError, match="KVCache.crop: this cache holds a cross-attention memory"):
        mem_cache.crop(4)


@pytest.mark.parametrize("cross", [False, True])
def test_reset_drops_the_graph_of_calls_with_gradients(cross):
    """A call with gradients writes a KVCache out of place (its graph held by the cache); reset() gives it fresh
    buffers, so the next call with gradients builds a new graph (it failed: 'backward through the graph a second
    time'), and nothing of the old graph stays held."""
    torch.manual_seed(0)
    layer = MultiheadAttention(E, H, HKV, causal=not cross, cross=cross, dtype=PRECISE_DTYPE).to(DEVICE).train()
    cache = layer.new_cache(1, max_len=8)
    for _ in range(2):
        x, mem = randn(1, 3, E, dtype=PRECISE_DTYPE), randn(1, 5, E, dtype=PRECISE_DTYPE)
        args = (x, mem) if cross else (x,)
        out = layer(*args, cache=cache)
        assert cache._k.requires_grad
        torch.testing.assert_close(out, layer(*args), atol=precise_atol(1e-12), rtol=0)
        out.sum().backward()
        cache.reset()
        assert not cache._k.requires_grad and not cache._v.requires_grad and int(cache.length) == 0


def test_crop_before_the_holes_decodes_on_the_kvcache_kernels_again(monkeypatch):
    """A key mask with padding after a real token (holes) keeps a KVCache on flash_attn_func; cropping away the
    positions after the last left-padding-only prefix brings decoding back to flash_attn_with_kvcache, equal to
    the uncached forward over the kept tokens."""
    layer = _layer()
    x = randn(2, 9, E, dtype=PRECISE_DTYPE)
    mask = torch.ones(2, 6, dtype=torch.bool, device=DEVICE)
    mask[1, :2] = False  # left padding: fine
    mask[0, 4] = False  # a hole in row 0 at position 4
    cache = layer.new_cache(2, max_len=16)
    with torch.no_grad():
        layer(x[:, :6], key_mask=mask, cache=cache)
        assert cache.holes
        cache.crop(4)
        assert not cache.holes and cache.leftpad.tolist() == [0, 2]
        monkeypatch.setattr("flashtx.nn.attention.flash_attn_func", no_flash_attn_func)
        keep = torch.cat((mask[:, :4], torch.ones(2, 3, dtype=torch.bool, device=DEVICE)), 1)
        full = layer(torch.cat((x[:, :4], x[:, 6:]), 1), key_mask=keep)  # (2, 7, E)
        for t in range(3):
            _close(layer(x[:, 6 + t:7 + t], cache=cache), full[:, 4 + t:5 + t], f"token {t}")
