"""flashtx.nn decoding through flash_attn_with_kvcache: contiguous and paged caches match the uncached
forward, dynamic-NTK RoPE with a cache (issue 17), torch.compile without graph breaks or recompiles,
and CUDA-graph capture of a decode step (GPU only).

The comparisons of cached decoding with the uncached forward run PRECISE_DTYPE (float64 in the interpreter at
~1e-12, float32 on a GPU, whose Triton backends refuse float64, at FP32_ATOL): never the reference backend,
whose silent use (a warning) fails here."""
import copy

import pytest
import torch
import torch._dynamo
from conftest import DEVICE, ON_GPU, PRECISE_DTYPE, assert_close_to_reference, precise_atol, randn
from test_nn_block import eager_block
from torch._dynamo.testing import CompileCounter

from flashtx.nn import KVCache, MultiheadAttention, PagedKVCache, RotaryEmbedding, TransformerBlock

# a call that no fast backend can run falls back to the reference with a warning: here an error (plans are fresh
# per test, so that the once-per-reason warning is given in every test that falls back)
pytestmark = [pytest.mark.filterwarnings("error:.*using the reference implementation"),
              pytest.mark.usefixtures("fresh_plans")]

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
    layer = MultiheadAttention(E, H, HKV, rotary=rope, causal=True, dtype=PRECISE_DTYPE).to(DEVICE).eval()
    x = randn(2, 10, E, dtype=PRECISE_DTYPE)
    with torch.no_grad():
        full = layer(x)
        for paged in (False, True):
            cached = decode(layer, x, layer.new_cache(2, max_len=64, paged=paged), prompt=6)
            torch.testing.assert_close(cached, full, atol=precise_atol(1e-12), rtol=0, msg=f"paged={paged}")


def test_dynamic_ntk_rope_past_original_length_uses_length_in_use():
    """Past the original length each call's new key is rotated with the frequencies of the length in
    use (cache length + S), as a fresh module's cos_sin(length + S) gives."""
    torch.manual_seed(0)
    scaling = {"type": "dynamic", "factor": 4.0}
    rope = RotaryEmbedding(8, max_seq_len=4, scaling=scaling)
    layer = MultiheadAttention(E, H, HKV, rotary=rope, causal=True, dtype=PRECISE_DTYPE).to(DEVICE).eval()
    x = randn(1, 7, E, dtype=PRECISE_DTYPE)
    cache = layer.new_cache(1, max_len=32)
    with torch.no_grad():
        decode(layer, x, cache, prompt=3)
        k_raw = layer.qkv(x).unflatten(-1, (H + 2 * HKV, 8))[:, :, H:H + HKV]  # (1, S, Hkv, D) before RoPE
    for pos in range(3, 7):
        cos, sin = RotaryEmbedding(8, max_seq_len=4, scaling=scaling).cos_sin(pos + 1)
        c, s = cos[pos].double(), sin[pos].double()
        k = k_raw[0, pos].double()  # (Hkv, D), NeoX halves
        want = torch.cat((k[:, :4] * c - k[:, 4:] * s, k[:, 4:] * c + k[:, :4] * s), -1)
        torch.testing.assert_close(cache.k[0, :, pos].double(), want, atol=precise_atol(1e-6), rtol=0,
                                   msg=f"position {pos}")


@pytest.mark.parametrize("page_size", [16, 32])
def test_block_paged_and_contiguous_caches_match_uncached(page_size):
    torch.manual_seed(0)
    block = TransformerBlock(E, H, HKV, hidden_dim=48, rotary=RotaryEmbedding(8, interleaved=True),
                             dtype=PRECISE_DTYPE).to(DEVICE).eval()
    x = randn(2, 21, E, dtype=PRECISE_DTYPE)
    with torch.no_grad():
        full = block(x)
        for kw in (dict(), dict(paged=True, page_size=page_size)):
            cache = block.new_cache(2, max_len=40, **kw)
            got = decode(block, x, cache, prompt=18 if not kw else 5)  # 18 > DECODE_MAX_S: the prefill path
            torch.testing.assert_close(got, full, atol=precise_atol(1e-12), rtol=0, msg=str(kw))


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
    for bad in (3, -1, 1.0, True, None, "1"):  # free(-1) used to free the last sequence; free(3) an IndexError from
        # a list; the wrong types a TypeError
        error = IndexError if bad in (3, -1) else TypeError
        with pytest.raises(error, match=r"seq must be an int in \[0, 3\) \(the batch index\)"):
            cache.free(bad)
        with pytest.raises(error, match=r"seq must be an int in \[0, 3\)"):
            cache.allocate(bad, 1)
    with pytest.raises(ValueError, match=r"num_tokens must be an int >= 0; got -5"):
        cache.allocate(0, -5)
    assert cache.free_pages == 0  # nothing was freed or allocated by the refused calls


def test_paged_layer_refuses_holes_and_grad():
    layer = MultiheadAttention(E, H, HKV, causal=True).to(DEVICE).eval()
    cache = layer.new_cache(2, max_len=16, paged=True)
    x = randn(2, 3, E)
    holes = torch.tensor([[True, False, True], [True] * 3], device=DEVICE)
    with torch.no_grad():
        with pytest.raises(ValueError, match="row 0 must read pad\\* real\\* pad\\*"):
            layer(x, key_mask=holes, cache=cache)
        layer(x, cache=cache)
        late_pad = torch.tensor([[True] * 3, [False, True, True]], device=DEVICE)
        with pytest.raises(ValueError, match="row 1 has leading padding, but its sequence already holds"):
            layer(x, key_mask=late_pad, cache=cache)
    assert cache.seqlens.tolist() == [3, 3]  # refused calls change nothing
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


def graph_decoding_setup(paged):
    """A float16 block on the GPU, 12 tokens, their eager decoding (a 4-token prompt, then steps), and a fresh cache
    holding the prompt (pages allocated up front: a graph cannot allocate): (block, x, eager, cache, [prompt out])."""
    torch.manual_seed(0)
    block = TransformerBlock(64, 8, 2, rotary=RotaryEmbedding(8), dtype=torch.float16).cuda().eval()
    x = torch.randn(4, 12, 64, device="cuda", dtype=torch.float16)
    with torch.no_grad():
        eager = decode(block, x, block.new_cache(4, max_len=64, paged=paged), prompt=4)
        cache = block.new_cache(4, max_len=64, paged=paged)
        if paged:
            cache.self_attn.allocate_all(64)
        return block, x, eager, cache, [block(x[:, :4], cache=cache)]


def check_graph_decoding(label, block, x, eager, outs):
    """eager and the graph's steps (outs) against the block's math: float64, and float16 eager (the tolerance rule)."""
    with torch.no_grad():
        out_ref = eager_block(copy.deepcopy(block).double(), x.double())
        out_e = eager_block(block, x)
    assert_close_to_reference("eager decoding", eager, out_ref, out_e)
    assert_close_to_reference(label, torch.cat(outs, 1), out_ref, out_e)


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a CUDA GPU")
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_decode_step_captured_in_cuda_graph(paged):
    block, x, eager, cache, outs = graph_decoding_setup(paged)
    with torch.no_grad():
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
    check_graph_decoding("graph-replayed decoding", block, x, eager, outs)


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a CUDA GPU")
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_compiled_decode_step_runs_in_cuda_graphs(paged):
    """torch.compile(mode="reduce-overhead") of a decode step: CUDA-graph trees capture it (no skip: every input it
    mutates, the caches and their lengths, is a static address) and its replays equal eager decoding. The CPU half:
    test_compile_gpu_path.py's test_compiled_nn_decoding_writes_the_caches_in_place."""
    from torch._dynamo.utils import counters
    from torch._inductor import cudagraph_trees

    block, x, eager, cache, outs = graph_decoding_setup(paged)
    torch._dynamo.reset()
    counters.clear()
    step = torch.compile(lambda t: block(t, cache=cache), mode="reduce-overhead", fullgraph=True)
    with torch.no_grad():
        for t in range(4, 12):
            outs.append(step(x[:, t:t + 1]).clone())  # (a replay's output is overwritten by the next)
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
    assert cudagraph_trees.get_manager(torch.cuda.current_device(), create_if_none_exists=False) is not None
    check_graph_decoding("compiled decoding in CUDA graphs", block, x, eager, outs)


def decode_masked(layer, x, mask, cache, prompt: int, **kw):
    """As decode, passing each call's slice of the key mask."""
    outs = [layer(x[:, :prompt], key_mask=mask[:, :prompt], cache=cache, **kw)]
    for t in range(prompt, x.shape[1]):
        outs.append(layer(x[:, t:t + 1], key_mask=mask[:, t:t + 1], cache=cache, **kw))
    return torch.cat(outs, dim=1)


def no_flash_attn_func(*args, **kwargs):
    raise AssertionError("cached call took the flash_attn_func path")


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("scaling", [None, {"type": "dynamic", "factor": 2.0}], ids=["rope", "dynamic"])
def test_left_padded_decoding_uses_leftpad_and_matches_uncached(paged, scaling, monkeypatch):
    """Left-padded prompts decode through flash_attn_with_kvcache (cache_leftpad), never flash_attn_func,
    and equal the uncached forward over the same padded tokens at every real position (PRECISE_DTYPE).
    Row 3 is padding through the prompt and two steps: a KVCache stores that padding (all rows share
    positions), a PagedKVCache keeps nothing of an all-padding call, so there row 3 starts at position
    0 and equals the uncached forward of its real tokens alone. (Dynamic-NTK within its original
    length: past it cached keys keep their frequencies, see test_dynamic_ntk_rope_past_original_length.)"""
    torch.manual_seed(0)
    rope = RotaryEmbedding(8, max_seq_len=16, scaling=scaling)
    block = TransformerBlock(E, H, HKV, hidden_dim=48, rotary=rope, dtype=PRECISE_DTYPE).to(DEVICE).eval()
    x = randn(4, 12, E, dtype=PRECISE_DTYPE)
    lead = torch.tensor([0, 3, 5, 8], device=DEVICE)  # row 3 is all padding through the prompt and step 6, 7
    mask = torch.arange(12, device=DEVICE)[None, :] >= lead[:, None]
    with torch.no_grad():
        full = block(x, key_mask=mask)
        monkeypatch.setattr("flashtx.nn.attention.flash_attn_func", no_flash_attn_func)
        cache = block.new_cache(4, max_len=32, paged=paged)
        got = decode_masked(block, x, mask, cache, prompt=6)
        if paged:
            full[3, 8:] = block(x[3:, 8:])[0]
    assert cache.self_attn.leftpad.tolist() == ([0, 3, 5, 0] if paged else lead.tolist())
    if paged:
        assert cache.self_attn.seqlens.tolist() == [12, 12, 12, 4]
    else:
        assert not cache.self_attn.holes
    torch.testing.assert_close(got[mask], full[mask], atol=precise_atol(1e-12), rtol=0)


def test_contiguous_cache_with_holes_falls_back_and_matches_uncached():
    """A key mask with padding after real tokens cannot be a leftpad: the KVCache attends through
    flash_attn_func over its stored mask (eager), still equal to the uncached forward."""
    torch.manual_seed(0)
    layer = MultiheadAttention(E, H, HKV, rotary=RotaryEmbedding(8), causal=True,
                               dtype=PRECISE_DTYPE).to(DEVICE).eval()
    x = randn(2, 9, E, dtype=PRECISE_DTYPE)
    mask = torch.ones(2, 9, dtype=torch.bool, device=DEVICE)
    mask[0, 2:4] = False  # a hole in the prompt
    mask[1, 6] = False  # a padded decode step after real tokens
    with torch.no_grad():
        full = layer(x, key_mask=mask)
        cache = layer.new_cache(2, max_len=16)
        got = decode_masked(layer, x, mask, cache, prompt=5)
    assert cache.holes
    torch.testing.assert_close(got[mask], full[mask], atol=precise_atol(1e-12), rtol=0)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_compiled_padded_decode_step_no_breaks_one_trace(paged):
    """A decode step given a key_mask (left-padded prompt) compiles with fullgraph, calls
    flash_attn_with_kvcache's op (not flash_attn_func's) and is traced once as the cache grows."""
    torch.manual_seed(0)
    block = TransformerBlock(E, H, HKV, hidden_dim=48, rotary=RotaryEmbedding(8)).to(DEVICE).eval()
    x = randn(2, 10, E)
    mask = torch.ones(2, 10, dtype=torch.bool, device=DEVICE)
    mask[1, :3] = False

    def fresh():
        cache = block.new_cache(2, max_len=16, paged=paged)
        if paged:
            cache.self_attn.allocate_all(16)
        return cache

    with torch.no_grad():
        full = block(x, key_mask=mask)
        cache = fresh()
        block(x[:, :4], key_mask=mask[:, :4], cache=cache)
        ex = torch._dynamo.explain(block)(x[:, 4:5], key_mask=mask[:, 4:5], cache=cache)
        assert ex.graph_break_count == 0, ex.break_reasons
        ops = {str(n.target) for g in ex.graphs for n in g.graph.nodes if str(n.target).startswith("flashtx.")}
        assert "flashtx.kvcache_attention.default" in ops and "flashtx.attn_fwd.default" not in ops, ops
        cache = fresh()
        counter = CompileCounter()
        compiled = torch.compile(block, fullgraph=True, backend=counter)
        outs = [block(x[:, :4], key_mask=mask[:, :4], cache=cache)]
        outs += [compiled(x[:, t:t + 1], key_mask=mask[:, t:t + 1], cache=cache) for t in range(4, 10)]
    assert counter.frame_count == 1  # six decode steps, one trace
    got = torch.cat(outs, 1)
    torch.testing.assert_close(got[mask], full[mask], atol=1e-5, rtol=1e-5)


def test_paged_continuous_batching_ragged_lengths_and_page_reuse(monkeypatch):
    """Sequences at different lengths in one PagedKVCache: a right-padded ragged prefill, decode steps,
    a finished sequence freed and a new prompt prefilled into its slot while the others take one token
    (trailing padding is not kept). Every real output equals the uncached forward (PRECISE_DTYPE) of that
    sequence alone; freed pages are reused."""
    torch.manual_seed(0)
    block = TransformerBlock(E, H, HKV, hidden_dim=48, rotary=RotaryEmbedding(8),
                             dtype=PRECISE_DTYPE).to(DEVICE).eval()
    seqs = [randn(1, n, E, dtype=PRECISE_DTYPE) for n in (20, 9, 14, 11)]  # seqs[3] replaces seqs[1]
    cache = block.new_cache(3, max_len=48, paged=True, page_size=16, num_pages=4).self_attn  # 4 pages in all
    bc = type(block.new_cache(1, 16))(cache)  # a BlockCache around the paged cache
    monkeypatch.setattr("flashtx.nn.attention.flash_attn_func", no_flash_attn_func)
    got = [[] for _ in seqs]  # per sequence: its outputs at real positions, in order
    slot = [0, 1, 2]  # slot b holds sequence slot[b]
    pos = [0, 0, 0]  # next token of each slot's sequence

    def step(take):  # take[b]: tokens slot b consumes this call (0 = idle)
        S = max(take)
        xb = torch.zeros(3, S, E, dtype=PRECISE_DTYPE, device=DEVICE)
        mask = torch.zeros(3, S, dtype=torch.bool, device=DEVICE)
        for b, n in enumerate(take):
            xb[b, :n] = seqs[slot[b]][0, pos[b]:pos[b] + n]
            mask[b, :n] = True
        out = block(xb, key_mask=mask, cache=bc)
        for b, n in enumerate(take):
            got[slot[b]].append(out[b, :n])
            pos[b] += n

    with torch.no_grad():
        step([5, 9, 3])  # ragged prefill
        assert cache.seqlens.tolist() == [5, 9, 3]
        step([1, 0, 1])  # slot 1 idle
        step([1, 0, 1])
        assert cache.seqlens.tolist() == [7, 9, 5]
        old_pages = set(cache.block_table[1].tolist()) - {-1}
        assert cache.free_pages == 1 and len(old_pages) == 1
        cache.free(1)  # sequence 1 done (all 9 tokens in)
        assert cache.free_pages == 2 and cache.block_table[1].tolist() == [-1, -1, -1]
        slot[1], pos[1] = 3, 0
        step([1, 11, 1])  # a new prompt in slot 1, one token for the others
        assert cache.seqlens.tolist() == [8, 11, 6]
        assert old_pages <= set(cache.block_table.flatten().tolist())  # the freed page is in use again
        assert cache.free_pages == 0  # (slot 0's pages cover seqlens + S: its padding is written, not kept)
        while pos[0] < 20:
            step([1, 0, 1 if pos[2] < 14 else 0])
        assert cache.seqlens.tolist() == [20, 11, 14]
        assert cache.free_pages == 0 and cache.leftpad.tolist() == [0, 0, 0]
        for i, x in enumerate(seqs):
            want = block(x)[0]
            torch.testing.assert_close(torch.cat(got[i]), want[:len(torch.cat(got[i]))], atol=precise_atol(1e-12), rtol=0,
                                       msg=f"sequence {i}")
            assert len(torch.cat(got[i])) == x.shape[1] or i == 1 and len(torch.cat(got[i])) == 9


@pytest.mark.parametrize("pad", ["right", "left", "holes"])
def test_cross_attention_cache_matches_uncached(pad, monkeypatch):
    """Cross-attention over a cached, padded memory: decode steps go through flash_attn_with_kvcache
    (cache_seqlens = each memory's end, cache_leftpad = its start; no append); a mask with holes
    keeps the training kernels. Equal to the uncached layer."""
    torch.manual_seed(0)
    layer = MultiheadAttention(E, H, HKV, cross=True, kdim=24, dtype=PRECISE_DTYPE).to(DEVICE).eval()
    x, memory = randn(3, 4, E, dtype=PRECISE_DTYPE), randn(3, 7, 24, dtype=PRECISE_DTYPE)
    n = torch.tensor([7, 4, 1], device=DEVICE)
    ar = torch.arange(7, device=DEVICE)[None, :]
    mask = {"right": ar < n[:, None], "left": ar >= 7 - n[:, None],
            "holes": ((ar % 2 == 0) | (ar == 1)).expand(3, 7)}[pad]
    with torch.no_grad():
        full = layer(x, memory, key_mask=mask)
        if pad != "holes":
            monkeypatch.setattr("flashtx.nn.attention.attention", no_flash_attn_func)
        cache = layer.new_cache(3, max_len=9)  # longer than the memory
        got = torch.cat([layer(x[:, :2], memory, key_mask=mask, cache=cache)]
                        + [layer(x[:, t:t + 1], cache=cache) for t in (2, 3)], 1)
    assert cache.holes == (pad == "holes")
    torch.testing.assert_close(got, full, atol=precise_atol(1e-12), rtol=0)


def test_cached_call_with_a_bad_key_mask_changes_nothing():
    layer = MultiheadAttention(E, H, HKV, causal=True).to(DEVICE).eval()
    x = randn(2, 3, E)
    for paged in (False, True):
        cache = layer.new_cache(2, max_len=8, paged=paged)
        with torch.no_grad(), pytest.raises(ValueError, match="key_mask must have shape"):
            layer(x, key_mask=torch.ones(2, 4, dtype=torch.bool, device=DEVICE), cache=cache)
        with torch.no_grad():
            layer(x, cache=cache)
            layer(x, cache=cache)  # 6 of 8 positions: the refused call claimed none
        assert (cache.seqlens if paged else cache.length.expand(2)).tolist() == [6, 6]


def test_contiguous_cache_drops_its_host_length_in_a_captured_step(monkeypatch):
    """A step captured in a CUDA graph advances `length` on the device at every replay, unseen by the host:
    the contiguous cache, like the paged one, stops trusting its host mirror from the captured step on, and
    checks fullness on the device (stand-in: CPU tensors with the CUDA capture queries stubbed)."""
    layer = MultiheadAttention(E, H, HKV, causal=True).to(DEVICE).eval()
    x = randn(2, 3, E)
    cache = layer.new_cache(2, max_len=8)
    with torch.no_grad():
        layer(x, cache=cache)
    assert cache._host_length == 3
    with monkeypatch.context() as m:
        m.setattr(torch.cuda, "is_available", lambda: True)
        m.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
        cache._claim(1)  # what the captured step's append does first
    assert cache._host_length is None
    with torch.no_grad():
        layer(x[:, :1], cache=cache)  # eager again: checked on the device, no stale mirror
    assert cache._host_length is None and int(cache.length) == 4
    cache.reset()
    assert cache._host_length == 0


@pytest.mark.parametrize("kind", ["contiguous", "paged", "cross"])
def test_a_cache_of_another_dtype_than_the_step_is_refused_by_name(kind):
    """Under autocast the projections give the autocast dtype while new_cache defaults to the parameters': every
    cached path (decode, long prefill, cross-attention) refuses with the dtype to create the cache with."""
    cross = kind == "cross"
    layer = MultiheadAttention(E, H, HKV, causal=not cross, cross=cross).to(DEVICE).eval()
    cache = layer.new_cache(2, max_len=32, paged=kind == "paged")
    x = randn(2, 20, E)  # fp32, as the parameters; a prefill longer than the decode path's 16 tokens
    with torch.no_grad(), pytest.raises(ValueError, match=r"KV cache holds torch.float32 but .* torch.float16 .* "
                                                          r"new_cache\(..., dtype=torch.float16\)"):
        with torch.autocast(DEVICE, dtype=torch.float16):
            layer(x, memory=randn(2, 5, E) if cross else None, cache=cache)


@pytest.mark.parametrize("kind", ["contiguous", "paged", "cross"])
def test_a_cache_of_another_layer_shape_is_refused_by_name(kind):
    """A cache made by a layer with other KV heads or head dims: a clear error naming the cache (not an index_copy_
    error, nor blame on the layer's own k/v), before any bookkeeping."""
    cross = kind == "cross"
    layer = MultiheadAttention(E, H, HKV, causal=not cross, cross=cross).to(DEVICE).eval()
    x, memory = randn(2, 3, E), (randn(2, 5, E) if cross else None)
    for other in (MultiheadAttention(E, H, 1, causal=not cross, cross=cross),  # Hkv 1 against 2
                  MultiheadAttention(2 * E, H, HKV, causal=not cross, cross=cross)):  # head_dim 16 against 8
        cache = other.to(DEVICE).new_cache(2, max_len=32, paged=kind == "paged")
        before = _cache_state(cache)
        with torch.no_grad(), pytest.raises(ValueError, match=rf"cache holds {other.num_kv_heads} KV heads of "
                                                              rf"head_dim {other.head_dim} .* num_kv_heads={HKV}, "
                                                              rf"head_dim={E // H}: create the cache with this"):
            layer(x, memory=memory, cache=cache)
        assert _cache_state(cache) == before


def _cache_state(cache) -> tuple:
    """Everything a cached call's bookkeeping changes, as plain values."""
    if isinstance(cache, PagedKVCache):
        return (cache.seqlens.tolist(), cache.leftpad.tolist(), cache.block_table.tolist(), list(cache._free),
                [list(p) for p in cache._pages], None if cache._host_lens is None else list(cache._host_lens))
    return (int(cache.length), cache.leftpad.tolist(), cache.key_mask.tolist(), cache.padded, cache.holes,
            cache._host_length)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("S", [1, 3, 20], ids=lambda s: f"S{s}")  # 20 > DECODE_MAX_S: the prefill path
def test_a_call_that_fails_after_the_bookkeeping_leaves_the_cache_as_it_was(paged, S, monkeypatch):
    """Audit of 2026-12-02: the caches advanced lengths, leftpad, the stored mask and pages before the attention
    call raised, so the next call hid a real token (off by 0.65 from a fresh cache). Now a failed call is undone;
    the retry matches a cache that never saw it. The failure is raised where the attention runs (a stand-in for
    any refusal there: a backend, a device, autograd)."""
    torch.manual_seed(0)
    layer = MultiheadAttention(E, H, HKV, causal=True, rotary=RotaryEmbedding(8), dtype=PRECISE_DTYPE).to(DEVICE)
    layer.eval()
    x = randn(2, 4 + S, E, dtype=PRECISE_DTYPE)
    prompt_mask = torch.tensor([[False, True, True, True], [True] * 4], device=DEVICE)  # left padding
    step_mask = torch.ones(2, S, dtype=torch.bool, device=DEVICE)  # a contiguous cache stores it (padded)
    if paged and S > 1:
        step_mask[1, -1] = False  # trailing padding: sequence 1 keeps S - 1 tokens
    import flashtx.nn.attention as nn_attention

    def fail(*args, **kwargs):
        raise RuntimeError("refused")

    caches = [layer.new_cache(2, max_len=64, paged=paged, **(dict(page_size=16) if paged else {})) for _ in range(2)]
    with torch.no_grad():
        for cache in caches:
            layer(x[:, :4], key_mask=prompt_mask, cache=cache)
        before = _cache_state(caches[0])
        name = "kvcache_step" if paged or S <= 16 else "flash_attn_func"  # the path this call takes (decoding:
        # flash_attn_with_kvcache's body, decode.kvcache_step)
        with monkeypatch.context() as m, pytest.raises(RuntimeError, match="refused"):
            m.setattr(nn_attention, name, fail)
            layer(x[:, 4:], key_mask=step_mask, cache=caches[0])
        assert _cache_state(caches[0]) == before
        got, want = (layer(x[:, 4:], key_mask=step_mask, cache=c) for c in caches)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    assert _cache_state(caches[0]) == _cache_state(caches[1])


def test_paged_layer_with_grad_is_refused_and_the_retry_is_right():
    """The audit's repro: a paged cache used with grad enabled raised "inference-only" but kept the call's leftpad,
    and the retry under no_grad hid a real token."""
    torch.manual_seed(0)
    layer = MultiheadAttention(E, H, HKV, causal=True, dtype=PRECISE_DTYPE).to(DEVICE).eval()
    x = randn(2, 3, E, dtype=PRECISE_DTYPE)
    mask = torch.tensor([[False, True, True], [True] * 3], device=DEVICE)
    cache, fresh = (layer.new_cache(2, max_len=32, paged=True) for _ in range(2))
    with pytest.raises(RuntimeError, match="inference-only"):
        layer(x, key_mask=mask, cache=cache)
    assert _cache_state(cache) == _cache_state(fresh)
    with torch.no_grad():
        torch.testing.assert_close(layer(x, key_mask=mask, cache=cache), layer(x, key_mask=mask, cache=fresh),
                                   atol=0, rtol=0)


def test_paged_claim_checks_every_sequence_before_changing_any():
    """A refusal on a later sequence ("full", "out of pages") used to leave the earlier ones with new pages and
    host lengths ahead of seqlens."""
    cache = PagedKVCache(2, 1, 8, num_pages=3, page_size=16, max_pages_per_seq=2)
    cache.allocate(1, 20)  # sequence 1: two pages, sequence 0 none; one page free
    cache._host_lens = [0, 20]
    state = _cache_state(cache)
    with pytest.raises(ValueError, match="PagedKVCache is full: sequence 1 holds 20 of max_len=32"):
        cache._claim(13)
    assert _cache_state(cache) == state
    cache._host_lens = [16, 0]  # sequence 0 needs 2 pages for 16 + 5 tokens, the pool holds 1
    state = _cache_state(cache)
    with pytest.raises(ValueError, match="out of pages: the batch needs 2 more for 5 tokens each, 1 are free"):
        cache._claim(5)
    assert _cache_state(cache) == state


def test_kv_cache_append_with_a_bad_key_mask_counts_nothing():
    cache = KVCache(2, 1, 8, 4)
    k = torch.zeros(2, 1, 3, 4)
    with pytest.raises(ValueError, match="key_mask must have shape"):
        cache.append(k, k, key_mask=torch.ones(2, 2, dtype=torch.bool))
    assert cache._host_length == 0
    cache.append(k, k)
    assert cache._host_length == 3 and int(cache.length) == 3


def test_a_full_cache_refuses_a_masked_call_by_name_and_stays_usable():
    """Review of the undo: a masked call to a full KVCache raised an IndexError from the undo's fill past max_len
    instead of "KVCache is full"."""
    layer = MultiheadAttention(E, H, HKV, causal=True).to(DEVICE).eval()
    cache = layer.new_cache(2, max_len=4)
    x, m = randn(2, 3, E), torch.ones(2, 3, dtype=torch.bool, device=DEVICE)
    with torch.no_grad():
        layer(x, key_mask=m, cache=cache)
        state = _cache_state(cache)
        with pytest.raises(ValueError, match="KVCache is full: it holds 3 of max_len=4 positions and 2 more"):
            layer(x[:, :2], key_mask=m[:, :2], cache=cache)
        assert _cache_state(cache) == state
        layer(x[:, :1], key_mask=m[:, :1], cache=cache)
    assert int(cache.length) == 4


def test_cross_block_without_memory_refuses_before_the_self_attention_appends():
    """A cross TransformerBlock's first cached call without memory raised after its self-attention had appended
    the tokens: the retry stored them twice."""
    block = TransformerBlock(E, H, HKV, hidden_dim=48, cross=True, kdim=E, dtype=PRECISE_DTYPE).to(DEVICE).eval()
    x, mem = randn(2, 3, E, dtype=PRECISE_DTYPE), randn(2, 4, E, dtype=PRECISE_DTYPE)
    cache, fresh = (block.new_cache(2, 8, memory_len=4) for _ in range(2))
    with torch.no_grad():
        with pytest.raises(ValueError, match="cross-attention cache is empty, pass memory on the first call"):
            block(x, cache=cache)
        assert int(cache.self_attn.length) == 0
        bad = [((randn(2, 4, E + 1, dtype=PRECISE_DTYPE),), {}, r"memory must be \(B, Sm, kdim\)"),
               ((randn(2, 9, E, dtype=PRECISE_DTYPE),), {}, "memory has 9 positions but the cross-attention cache "
                                                            "holds 4"),
               ((mem,), {"memory_mask": torch.ones(2, 4, dtype=torch.int32, device=DEVICE)},
                "memory_mask must be a bool tensor"),
               ((mem,), {"memory_mask": torch.ones(2, 5, dtype=torch.bool, device=DEVICE)},
                r"memory_mask must have shape \(B, S\) = \(2, 4\)")]
        for args, kw, match in bad:  # each refused before the self-attention appends (it raised after, once)
            with pytest.raises((ValueError, TypeError), match=match):
                block(x, *args, cache=cache, **kw)
            assert int(cache.self_attn.length) == 0
        torch.testing.assert_close(block(x, mem, cache=cache), block(x, mem, cache=fresh), atol=0, rtol=0)
        with pytest.raises(ValueError, match=r"cross-attention needs memory \(B, Sm, kdim\)$"):
            block(x)
