"""The caches' host-side state around the decode steps: KVCache.reorder (beam search) moves every row's state
together; a PagedKVCache keeps allocating in eager calls after a compiled step (continuous batching), and a full
KVCache is refused by name there; new_cache's device and rotary tables. Outputs are compared with the same
calls on a cache that never took the detour (PRECISE_DTYPE)."""
import pytest
import torch
from conftest import DEVICE, PRECISE_DTYPE, precise_atol, randn
from torch._dynamo.testing import CompileCounter

from flashtx.nn import MultiheadAttention, RotaryEmbedding

pytestmark = [pytest.mark.filterwarnings("error:.*using the reference implementation"),
              pytest.mark.usefixtures("fresh_plans")]

E, H, HKV = 32, 4, 2


def _layer(max_seq_len=64):
    torch.manual_seed(0)
    return MultiheadAttention(E, H, HKV, rotary=RotaryEmbedding(8, max_seq_len=max_seq_len), causal=True,
                              dtype=PRECISE_DTYPE).to(DEVICE).eval()


def _close(got, want, msg=None):
    torch.testing.assert_close(got, want, atol=precise_atol(1e-12), rtol=0, msg=msg)


def test_reorder_moves_each_rows_state_together():
    """Beam search: rows reordered (one repeated) after a left-padded prompt; the next steps equal those of a cache
    that was given the rows in that order from the start (the k/v setters alone left leftpad and key_mask behind:
    the next step erred by ~0.3)."""
    layer = _layer()
    B, P = 3, 5
    x = randn(B, P + 2, E, dtype=PRECISE_DTYPE)
    mask = torch.ones(B, P, dtype=torch.bool, device=DEVICE)
    mask[0, :3] = False  # row 0 left-padded, row 2 by one
    mask[2, :1] = False
    perm = [2, 0, 0]
    with torch.no_grad():
        cache = layer.new_cache(B, 16)
        layer(x[:, :P], key_mask=mask, cache=cache)
        assert cache.reorder(torch.tensor(perm, device=DEVICE)) is cache
        want_cache = layer.new_cache(B, 16)
        layer(x[perm, :P], key_mask=mask[perm], cache=want_cache)
        for t in (P, P + 1):
            _close(layer(x[perm, t:t + 1], cache=cache), layer(x[perm, t:t + 1], cache=want_cache), f"step {t}")
    assert cache.leftpad.tolist() == want_cache.leftpad.tolist() == [1, 3, 3]


def test_reorder_and_setter_errors():
    cache = _layer().new_cache(2, 8)
    for bad in ([0], [0, 2], [0, -1], [0.0, 1], torch.tensor([0.0, 1.0]), torch.zeros(2, 1, dtype=torch.int64)):
        with pytest.raises((TypeError, ValueError), match="KVCache.reorder: index must be"):
            cache.reorder(bad)
    with pytest.raises(ValueError, match=r"KVCache.k must be assigned a tensor of shape \(2, 2, 8, 8\)"):
        cache.k = cache.k[:1]
    cache.v = cache.v.flip(0).contiguous()  # the same shape: taken (the buffers only)
    assert cache.v.shape == (2, 2, 8, 8)


def test_paged_cache_allocates_in_eager_calls_after_a_compiled_step():
    """allocate_all, a compiled decode step, free(1), then an eager prefill into slot 1 (continuous batching):
    the eager call allocates the pages it needs, as without the compiled step (it refused: block_table -1, on a
    GPU a device-side assert)."""
    layer = _layer()
    x, step_x, prompt = (randn(2, n, E, dtype=PRECISE_DTYPE) for n in (4, 1, 6))
    mask = torch.zeros(2, 6, dtype=torch.bool, device=DEVICE)
    mask[0, 0] = True
    mask[1] = True  # slot 1: a new prompt of 6 tokens; slot 0: one more token
    step = torch.compile(layer, fullgraph=True, backend="eager")
    outs = []
    with torch.no_grad():
        for compiled in (True, False):
            cache = layer.new_cache(2, max_len=32, paged=True, num_pages=5)
            cache.allocate(0, 16)
            cache.allocate(1, 16)
            layer(x, cache=cache)
            (step if compiled else layer)(step_x, cache=cache)
            cache.free(1)
            outs.append((layer(prompt, key_mask=mask, cache=cache), cache.seqlens.tolist(), cache.free_pages))
    (got, lens, free), (want, want_lens, want_free) = outs
    assert lens == want_lens == [6, 6] and free == want_free
    _close(got[0, :1], want[0, :1])
    _close(got[1], want[1])


def test_full_kvcache_refused_by_name_in_eager_calls_after_a_compiled_step():
    layer = _layer()
    cache = layer.new_cache(2, max_len=6)
    step = torch.compile(layer, fullgraph=True, backend="eager")
    with torch.no_grad():
        layer(randn(2, 4, E, dtype=PRECISE_DTYPE), cache=cache)
        step(randn(2, 1, E, dtype=PRECISE_DTYPE), cache=cache)
        with pytest.raises(ValueError, match="KVCache is full: it holds 5 of max_len=6 positions and 2 more"):
            layer(randn(2, 2, E, dtype=PRECISE_DTYPE), key_mask=torch.ones(2, 2, dtype=torch.bool, device=DEVICE),
                  cache=cache)
        assert int(cache.length) == 5 and bool(cache.key_mask.all())
        layer(randn(2, 1, E, dtype=PRECISE_DTYPE), cache=cache)
    assert int(cache.length) == 6


def test_new_cache_device_index_zero():
    """device=0 is cuda:0, as torch reads it (it was taken as 'not given': a cache on the parameters' device)."""
    layer = _layer()
    if torch.cuda.is_available():
        assert layer.new_cache(2, 8, device=0).k.device == torch.device("cuda", 0)
    else:
        with pytest.raises((RuntimeError, AssertionError)):  # torch's: no CUDA device 0 here
            layer.new_cache(2, 8, device=0)


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_compiled_steps_traced_once_with_a_cache_longer_than_the_rotary_tables(paged, mode):
    """The first step compiled, on a cache longer than the rotary tables: new_cache grows the tables, so no traced
    step does (which changed their length and traced the step again)."""
    layer = _layer(max_seq_len=16)
    x = randn(2, 4, E, dtype=PRECISE_DTYPE)
    counter = CompileCounter()
    step = torch.compile(layer, fullgraph=True, backend=counter)
    with torch.no_grad():
        want = layer(x)
    with torch.no_grad() if mode == "no_grad" else torch.inference_mode():  # (inference tables: rebuilt in a trace)
        cache = layer.new_cache(2, 64, paged=paged)
        if paged:
            cache.allocate_all(64)
        outs = [step(x[:, t:t + 1], cache=cache) for t in range(4)]
    _close(torch.cat(outs, 1), want)
    assert counter.frame_count == 1


def test_block_cache_reorder():
    """A cross block's caches reordered together (beam search in an encoder-decoder); a paged one refused."""
    from flashtx.nn import TransformerBlock

    torch.manual_seed(0)
    block = TransformerBlock(E, H, HKV, hidden_dim=48, cross=True, kdim=E, dtype=PRECISE_DTYPE).to(DEVICE).eval()
    x, mem = randn(3, 4, E, dtype=PRECISE_DTYPE), randn(3, 5, E, dtype=PRECISE_DTYPE)
    perm = [1, 1, 0]
    with torch.no_grad():
        cache, want_cache = block.new_cache(3, 8, memory_len=5), block.new_cache(3, 8, memory_len=5)
        block(x[:, :3], mem, cache=cache)
        block(x[perm, :3], mem[perm], cache=want_cache)
        assert cache.reorder(perm) is cache
        _close(block(x[perm, 3:], cache=cache), block(x[perm, 3:], cache=want_cache))
        paged = block.new_cache(3, 16, memory_len=5, paged=True)
        with pytest.raises(TypeError, match="PagedKVCache, which has no reorder"):
            paged.reorder(perm)


def _cross_block():
    from flashtx.nn import TransformerBlock

    torch.manual_seed(0)
    return TransformerBlock(E, H, HKV, hidden_dim=48, cross=True, kdim=24, dtype=PRECISE_DTYPE).to(DEVICE).eval()


def test_cross_block_refuses_a_bad_memory_or_cross_cache_before_the_self_attention_appends():
    """An invalid-input fuzz: a cross block's cached call with memory of another dtype or device, or a hand-built
    BlockCache whose cross cache has another dtype, head count or batch, raised inside the cross-attention (torch's
    Linear error, not naming memory) after the self-attention had appended its tokens: the retry stored them twice
    and its output was off by ~0.6. Each is now refused by name first, and the retry equals a fresh cache's call."""
    from flashtx.nn import KVCache
    from flashtx.nn.block import BlockCache

    block = _cross_block()
    x, mem = randn(2, 3, E, dtype=PRECISE_DTYPE), randn(2, 9, 24, dtype=PRECISE_DTYPE)
    other = torch.float32 if PRECISE_DTYPE != torch.float32 else torch.float64
    cache, fresh = (block.new_cache(2, 16, memory_len=9) for _ in range(2))
    own = cache.self_attn
    cross = dict(dtype=PRECISE_DTYPE, device=DEVICE)
    bad = [(mem.to(other), cache, f"memory must be {PRECISE_DTYPE}, the layer's dtype"),
           (mem.long(), cache, f"memory must be {PRECISE_DTYPE}"),
           (mem.to("meta"), cache, "memory must be on the layer's device"),
           (mem, BlockCache(own, KVCache(2, HKV, 9, 8, dtype=other, device=DEVICE)), "cache.cross_attn holds"),
           (mem, BlockCache(own, KVCache(2, HKV + 1, 9, 8, **cross)), "cache holds 3 KV heads"),
           (mem, BlockCache(own, KVCache(3, HKV, 9, 8, **cross)), "for batch size 2")]
    with torch.no_grad():
        for memory, c, match in bad:
            with pytest.raises(ValueError, match=match):
                block(x, memory, cache=c)
            assert int(own.length) == 0 and own._host_length == 0, match
        _close(block(x, mem, cache=cache), block(x, mem, cache=fresh))
        step = randn(2, 1, E, dtype=PRECISE_DTYPE)
        _close(block(step, cache=cache), block(step, cache=fresh))


def test_a_refused_call_on_a_meta_cache_keeps_its_error():
    """The undo of a refused masked call indexed the key mask with a boolean mask, which meta tensors cannot
    (NotImplementedError from torch.nonzero replaced the ValueError naming key_mask); it fills a slice now."""
    layer = _layer()
    cache = layer.new_cache(2, 20, device="meta")
    with torch.no_grad(), pytest.raises(ValueError, match="key_mask must be on the activations' device meta"):
        layer(randn(2, 3, E, dtype=PRECISE_DTYPE), key_mask=torch.ones(2, 3, dtype=torch.bool, device=DEVICE),
              cache=cache)
    assert cache._host_length == 0 and not cache.padded


def test_new_cache_flags_and_scaling_without_a_rule_are_refused():
    """paged="False" (a truthy string) built a PagedKVCache; a scaling dict with a factor and no type applied no
    scaling (the factor dropped silently)."""
    from flashtx.nn import TransformerBlock

    layer, block = _layer(), TransformerBlock(E, H, HKV, hidden_dim=48)
    for make in (lambda p: layer.new_cache(2, 8, paged=p), lambda p: block.new_cache(2, 8, paged=p)):
        for flag in ("False", [0]):
            with pytest.raises(TypeError, match="paged"):
                make(flag)
    with pytest.raises(ValueError, match="scaling has a factor but no 'type'"):
        RotaryEmbedding(8, scaling={"factor": 2.0})
    assert RotaryEmbedding(8, scaling={"rope_theta": 5e5}).scaling is None  # transformers 5's form, no rule: none


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_a_meta_layer_decodes_with_a_meta_cache(paged):
    """Shape inference on the meta device: a prompt and a step through a meta cache give meta outputs (fuzz,
    2026-12-07: every meta storage's data pointer is 0, so k_cache and v_cache 'shared memory' and the contiguous
    cache's call was refused)."""
    import warnings

    with torch.device("meta"):
        layer = MultiheadAttention(E, H, HKV, rotary=RotaryEmbedding(8), causal=True).eval()
        cache = layer.new_cache(2, 16, paged=paged)
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (the reference implementation runs meta tensors, and says so)
            layer(torch.randn(2, 3, E), cache=cache)
            out = layer(torch.randn(2, 1, E), cache=cache)
    assert out.is_meta and out.shape == (2, 1, E)
