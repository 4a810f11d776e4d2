"""flashtx.nn's decode steps skip flash_attn_with_kvcache's per-call index check (on a GPU a check kernel and a
device-side assert each step and layer) where the cache's index state is sealed: still what flashtx last wrote
(KVCache / PagedKVCache.ranges_known). Any write from outside (lengths, leftpad, page table), an inference-tensor
cache or a refused call's unsealed state turns the check back on, and an out-of-range value is then refused by name
as before. The counts are of decode._check_ranges calls, the check on either branch (host or device)."""
import pytest
import torch
from conftest import DEVICE, ON_GPU, PRECISE_DTYPE, precise_atol, randn

import flashtx._decode_lane as decode_lane
import flashtx.decode as decode
from flashtx.nn import MultiheadAttention, RotaryEmbedding

pytestmark = [pytest.mark.filterwarnings("error:.*using the reference implementation"),
              pytest.mark.usefixtures("fresh_plans")]

E, H, HKV = 32, 4, 2


@pytest.fixture
def checks(monkeypatch):
    """The index checks the decode steps run (both paths: the lane's and the general one), on the GPU's branch
    where the values are not read on the host (a CPU tensor's are otherwise): a list of one entry per check."""
    calls = []
    real = decode._check_ranges

    def counted(*args, **kwargs):
        calls.append(args[2])  # (the lengths tensor)
        return real(*args, **kwargs)

    monkeypatch.setattr(decode, "_check_ranges", counted)
    monkeypatch.setattr(decode_lane, "_check_ranges", counted)
    return calls


def _layer():
    torch.manual_seed(0)
    return MultiheadAttention(E, H, HKV, rotary=RotaryEmbedding(8), causal=True,
                              dtype=PRECISE_DTYPE).to(DEVICE).eval()


def _cache(layer, paged: bool, B: int = 2, max_len: int = 64):
    return layer.new_cache(B, max_len, paged=paged, **(dict(page_size=16) if paged else {}))


def _prompted_twins(what: str, prompt: int, tokens: int):
    """(layer, x (2, tokens, E), cache, twin): two caches of max_len 32 (paged where `what` is a paged cache's
    state) given the same prompt of x's first `prompt` tokens."""
    paged = what in ("seqlens", "block_table")
    layer = _layer()
    x = randn(2, tokens, E, dtype=PRECISE_DTYPE)
    caches = _cache(layer, paged, max_len=32), _cache(layer, paged, max_len=32)
    with torch.no_grad():
        for c in caches:
            layer(x[:, :prompt], cache=c)
    return layer, x, *caches


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_a_sealed_cache_decodes_without_the_check_and_equals_a_checked_one(paged, checks, monkeypatch):
    """A prompt and 20 steps (crossing a page bound): no index check on a fresh cache, and outputs bit-equal to the
    same steps with the check forced (ranges_known off)."""
    layer = _layer()
    x = randn(2, 24, E, dtype=PRECISE_DTYPE)
    with torch.no_grad():
        sealed, checked = _cache(layer, paged), _cache(layer, paged)
        got = [layer(x[:, :4], cache=sealed)] + [layer(x[:, i:i + 1], cache=sealed) for i in range(4, 24)]
        assert sealed.ranges_known() and checks == []
        with monkeypatch.context() as m:
            m.setattr(type(checked), "ranges_known", lambda self: False)
            m.setattr(type(checked), "_intact", lambda self: False)
            want = [layer(x[:, :4], cache=checked)] + [layer(x[:, i:i + 1], cache=checked) for i in range(4, 24)]
        assert len(checks) == 21  # every call of the checked cache (the prompt's too: 4 tokens decode)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=0, rtol=0)


@pytest.mark.parametrize("what", ["length", "leftpad", "seqlens", "block_table"])
def test_a_state_write_from_outside_turns_the_check_back_on(what, checks):
    """Lengths, leftpad or the page table written behind the cache's back (here with the values they held): the
    next step checks the indices again; its output is the sealed cache's."""
    layer, x, cache, sealed = _prompted_twins(what, prompt=4, tokens=5)
    with torch.no_grad():
        assert cache.ranges_known() and checks == []
        state = getattr(cache, what)
        state.copy_(state.clone())
        assert not cache.ranges_known() and sealed.ranges_known()
        got, want = layer(x[:, 4:], cache=cache), layer(x[:, 4:], cache=sealed)
        assert len(checks) == 1
    torch.testing.assert_close(got, want, atol=0, rtol=0)


@pytest.mark.skipif(ON_GPU, reason="on a GPU the refusal is a device-side assert, which ends the process: "
                                   "tests/test_device_asserts_gpu.py runs those in processes of their own")
@pytest.mark.parametrize("what", ["length", "leftpad", "seqlens", "block_table"])
def test_an_out_of_range_write_from_outside_is_refused_by_name(what, checks):
    """Out-of-range state written from outside: refused by name (the host's count alone would let the kernels
    write past the cache)."""
    paged = what in ("seqlens", "block_table")
    layer = _layer()
    x = randn(2, 5, E, dtype=PRECISE_DTYPE)
    with torch.no_grad():
        cache = _cache(layer, paged, max_len=32)
        layer(x[:, :4], cache=cache)
        if what == "length":
            cache.length.fill_(40)  # past max_len
        elif what == "leftpad":
            cache.leftpad[1] = 9  # past the length
        elif what == "seqlens":
            cache.seqlens[0] = 31  # the host count says 4; the page holding position 31 is gone
            cache.block_table[0, 1] = -1
        else:
            cache.block_table[1, 0] = 10 ** 6  # no such page
        with pytest.raises(ValueError, match="cache_seqlens|cache_leftpad|block_table"):
            layer(x[:, 4:], cache=cache)
        assert len(checks) == 1


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_inference_tensors_and_traced_state_keep_the_check(paged, checks):
    """A cache made under inference_mode has no version counters to seal (each step checks); reset() outside it
    does not change that (its tensors stay inference tensors)."""
    layer = _layer()
    x = randn(2, 5, E, dtype=PRECISE_DTYPE)
    with torch.inference_mode():
        cache = _cache(layer, paged)
        want = [layer(x[:, :4], cache=cache), layer(x[:, 4:], cache=cache)]
    assert not cache.ranges_known() and len(checks) == 2
    with torch.no_grad():
        fresh = _cache(layer, paged)
        got = [layer(x[:, :4], cache=fresh), layer(x[:, 4:], cache=fresh)]
    assert len(checks) == 2  # (the sealed cache: none)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=precise_atol(1e-12), rtol=0)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_methods_that_write_the_state_keep_the_seal_only_where_it_held(paged, checks):
    """crop / reorder / free / allocate / a refused call's undo reseal a sealed cache (its steps stay unchecked),
    but never bless a value written from outside before them; reset() rewrites every state tensor and seals."""
    layer = _layer()
    x = randn(2, 8, E, dtype=PRECISE_DTYPE)
    with torch.no_grad():
        cache = _cache(layer, paged)
        layer(x[:, :4], cache=cache)
        if paged:
            cache.crop([3, 2])
            cache.allocate(1, 40)
            cache.free(1)
        else:
            cache.crop(3)
            cache.reorder([1, 0])
        assert cache.ranges_known()
        with pytest.raises(ValueError):  # refused before any state is written for good (a wrong-width input)
            layer(randn(2, 1, E + 1, dtype=PRECISE_DTYPE), cache=cache)
        mask = torch.ones(2, 1, dtype=torch.bool, device=DEVICE)
        with pytest.raises(RuntimeError, match="refused"):  # refused after the bookkeeping: undone, resealed
            import flashtx.nn.attention as nn_attention

            real = nn_attention.kvcache_step
            nn_attention.kvcache_step = lambda *a: (_ for _ in ()).throw(RuntimeError("refused"))
            try:
                layer(x[:, 4:5], key_mask=mask, cache=cache)
            finally:
                nn_attention.kvcache_step = real
        assert cache.ranges_known()
        layer(x[:, 4:5], cache=cache)
        assert checks == []
        (cache.seqlens if paged else cache.length).add_(1)  # from outside: a value the host count does not know
        if paged:
            cache.allocate(0, 48)
            cache.crop([2, 0])
        else:
            cache.crop(2)
        assert not cache.ranges_known()  # crop and allocate kept it unsealed
        layer(x[:, 5:6], cache=cache)
        assert len(checks) == 1
        cache.reset()
        assert cache.ranges_known()
        layer(x[:, :1], cache=cache)
        assert len(checks) == 1


@pytest.mark.parametrize("what", ["length", "leftpad", "seqlens", "block_table"])
def test_a_write_that_bypasses_the_version_counter_stays_inside_the_buffers(what, checks):
    """A write through .data (or DLPack, .numpy()) bumps no version counter, so the seal cannot see it and the step
    runs unchecked (fuzz, 2026-12-07: with a length past max_len the interpreter segfaulted). The decode kernels'
    own guards keep every access inside its tensor (the bounds checker of the CPU suite would raise) and write no
    row outside the cache: lengths are clamped to the capacity, rows and pages out of range are neither read nor
    written. The answer for such a state is unspecified."""
    paged = what in ("seqlens", "block_table")
    layer, x, cache, plain = _prompted_twins(what, prompt=5, tokens=9)
    with torch.no_grad():
        before = (cache.k if paged else cache._k).clone()  # (the pool, or the (B, max_len, Hkv, D) buffer)
        state = getattr(cache, what).data
        if what == "length":
            state.fill_(30)  # 30 + 4 new > max_len 32
        elif what == "leftpad":
            state.fill_(-7)  # read as 0, the value it held
        elif what == "seqlens":
            state[0], state[1] = 30, -40  # sequence 0's pages end at 16 (the host allocated for 9); -40: no row
        else:
            state[0, 0], state[1, 0] = -3, 10 ** 6  # pages that do not exist
        assert cache.ranges_known()  # (the seal cannot tell)
        out = layer(x[:, 5:9], cache=cache)
        assert checks == []
        after = cache.k if paged else cache._k
        if what == "length":  # positions 30 and 31 written, nothing past them (nor wrapped below)
            torch.testing.assert_close(after[:, :30], before[:, :30], atol=0, rtol=0)
            assert not torch.equal(after[:, 30:], before[:, 30:])
        elif what == "leftpad":
            torch.testing.assert_close(out, layer(x[:, 5:9], cache=plain), atol=0, rtol=0)
        else:  # every write dropped: positions without a page, a negative position, pages out of range
            torch.testing.assert_close(after, before, atol=0, rtol=0)
