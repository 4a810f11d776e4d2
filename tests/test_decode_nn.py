"""flashtx.nn decoding through flash_attn_with_kvcache: contiguous and paged caches match the uncached
forward, dynamic-NTK RoPE with a cache (issue 17), torch.compile without graph breaks or recompiles,
and CUDA-graph capture of a decode step (GPU only)."""
import pytest
import torch
import torch._dynamo
from conftest import DEVICE, ON_GPU, randn
from torch._dynamo.testing import CompileCounter

from flashtx.nn import MultiheadAttention, PagedKVCache, RotaryEmbedding, TransformerBlock

E, H, HKV = 32, 4, 2


def decode(layer, x, cache, prompt: int):
    """The prompt in one call, then one token at a time -> (B, S, E)."""
    outs = [layer(x[:, :prompt], cache=cache)]
    for t in range(prompt, x.shape[1]):
        outs.append(layer(x[:, t:t + 1], cache=cache))
    return torch.cat(outs, dim=1)


def test_dynamic_ntk_rope_cached_matches_full_forward():
    """Issue 17: a cache longer than the rotary's original length must not change the frequencies."""
    torch.manual_seed(0)
    rope = RotaryEmbedding(8, max_seq_len=16, scaling={"type": "dynamic", "factor": 4.0})
    layer = MultiheadAttention(E, H, HKV, rotary=rope, causal=True, dtype=torch.float64).to(DEVICE).eval()
    x = randn(2, 10, E, dtype=torch.float64)
    with torch.no_grad():
        full = layer(x)
        for paged in (False, True):
            cached = decode(layer, x, layer.new_cache(2, max_len=64, paged=paged), prompt=6)
            torch.testing.assert_close(cached, full, atol=1e-12, rtol=0, msg=f"paged={paged}")


def test_dynamic_ntk_rope_past_original_length_uses_length_in_use():
    """Past the original length each call's new key is rotated with the frequencies of the length in
    use (cache length + S), as a fresh module's cos_sin(length + S) gives."""
    torch.manual_seed(0)
    scaling = {"type": "dynamic", "factor": 4.0}
    rope = RotaryEmbedding(8, max_seq_len=4, scaling=scaling)
    layer = MultiheadAttention(E, H, HKV, rotary=rope, causal=True, dtype=torch.float64).to(DEVICE).eval()
    x = randn(1, 7, E, dtype=torch.float64)
    cache = layer.new_cache(1, max_len=32)
    with torch.no_grad():
        decode(layer, x, cache, prompt=3)
        k_raw = layer.qkv(x).unflatten(-1, (H + 2 * HKV, 8))[:, :, H:H + HKV]  # (1, S, Hkv, D) before RoPE
    for pos in range(3, 7):
        cos, sin = RotaryEmbedding(8, max_seq_len=4, scaling=scaling).cos_sin(pos + 1)
        c, s = cos[pos].double(), sin[pos].double()
        k = k_raw[0, pos]  # (Hkv, D), NeoX halves
        want = torch.cat((k[:, :4] * c - k[:, 4:] * s, k[:, 4:] * c + k[:, :4] * s), -1)
        torch.testing.assert_close(cache.k[0, :, pos], want, atol=1e-6, rtol=0, msg=f"position {pos}")


@pytest.mark.parametrize("page_size", [16, 32])
def test_block_paged_and_contiguous_caches_match_uncached(page_size):
    torch.manual_seed(0)
    block = TransformerBlock(E, H, HKV, hidden_dim=48, rotary=RotaryEmbedding(8, interleaved=True),
                             dtype=torch.float64).to(DEVICE).eval()
    x = randn(2, 21, E, dtype=torch.float64)
    with torch.no_grad():
        full = block(x)
        for kw in (dict(), dict(paged=True, page_size=page_size)):
            cache = block.new_cache(2, max_len=40, **kw)
            got = decode(block, x, cache, prompt=18 if not kw else 5)  # 18 > DECODE_MAX_S: the prefill path
            torch.testing.assert_close(got, full, atol=1e-12, rtol=0, msg=str(kw))


def test_paged_cache_allocates_and_frees_pages():
    cache = PagedKVCache(3, 2, 8, num_pages=6, page_size=16, max_pages_per_seq=3)
    cache.allocate(0, 20)
    cache.allocate(2, 5)
    assert cache.free_pages == 3 and cache.block_table[0, :2].tolist() == [0, 1] and cache.block_table[2, 0] == 2
    assert cache.block_table[1].tolist() == [-1, -1, -1]
    cache.free(0)
    assert cache.free_pages == 5 and cache.block_table[0].tolist() == [-1, -1, -1]
    with pytest.raises(ValueError, match="more than max_pages_per_seq=3"):
        cache.allocate(1, 49)
    cache.allocate_all(32)
    assert cache.free_pages == 0
    with pytest.raises(ValueError, match="out of pages"):
        PagedKVCache(2, 1, 8, num_pages=2).allocate_all(17)
    with pytest.raises(ValueError, match="page_size must be a multiple of 16"):
        PagedKVCache(1, 1, 8, num_pages=2, page_size=24)


def test_paged_layer_refuses_key_mask_and_grad():
    layer = MultiheadAttention(E, H, HKV, causal=True).to(DEVICE).eval()
    cache = layer.new_cache(2, max_len=16, paged=True)
    x = randn(2, 3, E)
    with pytest.raises(ValueError, match="PagedKVCache stores no key mask"):
        layer(x, key_mask=torch.ones(2, 3, dtype=torch.bool, device=DEVICE), cache=cache)
    with pytest.raises(RuntimeError, match="inference-only"):
        layer(x, cache=cache)  # parameters require grad and grad mode is on


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("scaling", [None, {"type": "dynamic", "factor": 2.0}], ids=["rope", "dynamic"])
def test_compiled_decode_step_no_breaks_one_trace(paged, scaling):
    torch.manual_seed(0)
    rope = RotaryEmbedding(8, max_seq_len=6, scaling=scaling)
    block = TransformerBlock(E, H, HKV, hidden_dim=48, rotary=rope).to(DEVICE).eval()
    x = randn(2, 10, E)
    with torch.no_grad():
        eager = decode(block, x, block.new_cache(2, max_len=16, paged=paged), prompt=4)
        cache = block.new_cache(2, max_len=16, paged=paged)
        if paged:
            cache.self_attn.allocate_all(16)  # a traced step cannot hand out pages
        block(x[:, :4], cache=cache)
        ex = torch._dynamo.explain(block)(x[:, 4:5], cache=cache)
        assert ex.graph_break_count == 0, ex.break_reasons
        ops = {str(n.target) for g in ex.graphs for n in g.graph.nodes if str(n.target).startswith("flashtx.")}
        assert "flashtx.kvcache_attention.default" in ops, ops
        cache = block.new_cache(2, max_len=16, paged=paged)
        if paged:
            cache.self_attn.allocate_all(16)
        counter = CompileCounter()
        compiled = torch.compile(block, fullgraph=True, backend=counter)
        outs = [block(x[:, :4], cache=cache)] + [compiled(x[:, t:t + 1], cache=cache) for t in range(4, 10)]
    assert counter.frame_count == 1  # six decode steps, one trace
    torch.testing.assert_close(torch.cat(outs, 1), eager, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a CUDA GPU")
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_decode_step_captured_in_cuda_graph(paged):
    torch.manual_seed(0)
    block = TransformerBlock(64, 8, 2, rotary=RotaryEmbedding(8), dtype=torch.float16).cuda().eval()
    x = torch.randn(4, 12, 64, device="cuda", dtype=torch.float16)
    with torch.no_grad():
        eager = decode(block, x, block.new_cache(4, max_len=64, paged=paged), prompt=4)
        cache = block.new_cache(4, max_len=64, paged=paged)
        if paged:
            cache.self_attn.allocate_all(64)
        outs = [block(x[:, :4], cache=cache)]
        static_x = x[:, 4:5].clone()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):  # warm up (compiles the kernels), then undo its append
            block(static_x, cache=cache)
            (cache.self_attn.seqlens if paged else cache.self_attn.length).sub_(1)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = block(static_x, cache=cache)
        # capture records the step (its length update too) without running it
        for t in range(4, 12):
            static_x.copy_(x[:, t:t + 1])
            graph.replay()
            outs.append(static_out.clone())
    torch.testing.assert_close(torch.cat(outs, 1), eager, atol=2e-3, rtol=2e-3)
