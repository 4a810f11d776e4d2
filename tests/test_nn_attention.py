"""flashtx.nn.MultiheadAttention: outputs and gradients against its math written out (conftest.eager_mha)
under the tolerance rule, KV-cache decoding against the full forward, and its input errors."""
import copy

import pytest
import torch
from conftest import DEVICE, assert_close_to_reference, dtype_id, eager_mha, randn

import flashtx
from flashtx.nn import KVCache, MultiheadAttention, RotaryEmbedding

E, H = 32, 4  # head_dim 8
DTYPES = [torch.float32, torch.float16]

# id: (num_kv_heads, causal, cross, rotary dim or None, key padding)
CASES = {
    "self-mha": (4, False, False, None, None),
    "self-gqa-causal-rope": (2, True, False, 8, None),
    "self-mqa-causal-partial-rope-leftpad": (1, True, False, 4, "left"),
    "self-gqa-rightpad": (2, False, False, 8, "right"),
    "cross-gqa-pad": (2, False, True, None, "right"),
}


def key_padding(kind, B, S):
    """(B, S) bool, True = real token: batch row 0 padded (3 tokens) on the given side."""
    m = torch.ones(B, S, dtype=torch.bool, device=DEVICE)
    if kind == "left":
        m[0, :3] = False
    elif kind == "right":
        m[0, -3:] = False
    return m if kind else None


def make_layer(hkv, causal, cross, rot, dtype, **kw):
    torch.manual_seed(0)
    rotary = RotaryEmbedding(rot, base=100.0) if rot else None
    return MultiheadAttention(E, H, hkv, causal=causal, cross=cross, rotary=rotary, **kw).to(DEVICE, dtype)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_layer_matches_written_out_math(case, dtype):
    hkv, causal, cross, rot, pad = CASES[case]
    layer = make_layer(hkv, causal, cross, rot, dtype)
    ref, eager = copy.deepcopy(layer).double(), copy.deepcopy(layer)
    B, S, Sm = 2, 7, 6
    x = randn(B, S, E, dtype=dtype, requires_grad=True)
    memory = randn(B, Sm, E, dtype=dtype, requires_grad=True) if cross else None
    km = key_padding(pad, B, Sm if cross else S)
    inputs = [x] + ([memory] if cross else [])
    x64 = [t.detach().double().requires_grad_(True) for t in inputs]
    xe = [t.detach().clone().requires_grad_(True) for t in inputs]

    out = layer(*inputs, key_mask=km)
    out_ref = eager_mha(ref, *x64, key_mask=km)
    out_e = eager_mha(eager, *xe, key_mask=km)
    assert out.shape == (B, S, E) and out.dtype == dtype
    assert_close_to_reference("output", out, out_ref, out_e)

    d = randn(B, S, E, dtype=dtype)
    for o, g in ((out, d), (out_ref, d.double()), (out_e, d)):
        o.backward(g)
    for name, a, r, e in zip(("dx", "dmemory"), inputs, x64, xe):
        assert_close_to_reference(name, a.grad, r.grad, e.grad, grad=True)
    params = dict(layer.named_parameters())
    ref_params, eager_params = dict(ref.named_parameters()), dict(eager.named_parameters())
    for name, p in params.items():
        assert_close_to_reference(f"d {name}", p.grad, ref_params[name].grad, eager_params[name].grad, grad=True)


def test_dropout_is_passed_only_in_training(monkeypatch):
    seen = []
    real = flashtx.nn.attention.attention

    def spy(*a, **kw):
        seen.append(kw["dropout_p"])
        return real(*a, **{**kw, "dropout_p": 0.0})  # the op's dropout is tested with the op

    monkeypatch.setattr(flashtx.nn.attention, "attention", spy)
    layer = make_layer(2, True, False, None, torch.float32, dropout=0.25, backend="reference")
    x = randn(1, 4, E)
    layer.train()(x)
    layer.eval()(x)
    assert seen == [0.25, 0.0]


@pytest.mark.parametrize("pad", [None, "left"], ids=["nopad", "leftpad"])
def test_kv_cache_decoding_matches_full_forward(pad):
    """Prefill in chunks then single tokens: each call projects only its new tokens, writes them into
    the preallocated buffers in place and sees keys <= its own position (bottom-right)."""
    layer = make_layer(2, True, False, 8, torch.float32).eval()
    B, S = 2, 9
    x = randn(B, S, E)
    km = key_padding(pad, B, S)
    with torch.no_grad():
        out_ref = eager_mha(copy.deepcopy(layer).double(), x.double(), key_mask=km)
        out_e = eager_mha(layer, x, key_mask=km)
        projected = []
        hook = layer.qkv.register_forward_hook(lambda m, inp, out: projected.append(inp[0].shape[1]))
        cache = layer.new_cache(B, max_len=12)
        ptr = cache.k.data_ptr()
        chunks = [(0, 4), (4, 5), (5, 6), (6, 9)]
        outs = [layer(x[:, a:b], key_mask=None if km is None else km[:, a:b], cache=cache) for a, b in chunks]
        hook.remove()
    assert projected == [b - a for a, b in chunks]  # no re-projection of past tokens
    assert cache.k.data_ptr() == ptr and int(cache.length) == S and cache._host_length == S
    assert_close_to_reference("cached decoding", torch.cat(outs, dim=1), out_ref, out_e)
    assert cache.padded == (km is not None)
    if km is not None:
        assert torch.equal(cache.key_mask[:, :S], km) and bool(cache.key_mask[:, S:].all())
    assert cache.reset() is cache and int(cache.length) == 0 and not cache.padded


def test_cross_attention_cache_projects_memory_once():
    layer = make_layer(2, False, True, None, torch.float32).eval()
    B, S, Sm = 2, 5, 6
    x, memory = randn(B, S, E), randn(B, Sm, E)
    km = key_padding("right", B, Sm)
    with torch.no_grad():
        full = layer(x, memory, key_mask=km)
        out_e = eager_mha(layer, x, memory, key_mask=km)
        out_ref = eager_mha(copy.deepcopy(layer).double(), x.double(), memory.double(), key_mask=km)
        calls = []
        hook = layer.kv_proj.register_forward_hook(lambda m, inp, out: calls.append(inp[0].shape))
        cache = layer.new_cache(B, max_len=Sm)
        outs = [layer(x[:, :2], memory, key_mask=km, cache=cache)] + [layer(x[:, i:i + 1], cache=cache)
                                                                        for i in range(2, S)]
        hook.remove()
    assert len(calls) == 1 and cache.filled
    assert_close_to_reference("cross with cache", torch.cat(outs, 1), out_ref, out_e)
    assert_close_to_reference("cross without cache", full, out_ref, out_e)


def test_cache_rejects_what_it_cannot_do():
    layer = make_layer(2, True, False, None, torch.float32, backend="reference").eval()
    x = randn(2, 5, E)
    cache = layer.new_cache(2, max_len=6)
    layer(x, cache=cache)
    with pytest.raises(ValueError, match=r"KVCache is full: it holds 5 of max_len=6 positions and 2 more"):
        layer(x[:, :2], cache=cache)
    with pytest.raises(ValueError, match="attn_mask cannot be combined with a KV cache"):
        layer(x[:, :1], attn_mask=torch.ones(1, 6, dtype=torch.bool, device=DEVICE), cache=cache)
    with pytest.raises(ValueError, match="KVCache for batch size 1"):
        layer(x[:1, :1], cache=cache)
    with pytest.raises(ValueError, match="needs causal=True"):
        make_layer(2, False, False, None, torch.float32).eval()(x, cache=layer.new_cache(2, 8))
    dropout = make_layer(2, True, False, None, torch.float32, dropout=0.1)
    with pytest.raises(ValueError, match=r"training mode with dropout=0.1; call .eval\(\) first"):
        dropout(x, cache=dropout.new_cache(2, 8))
    with pytest.raises(ValueError, match=r"KVCache.append: k must be \(2, 2, 3, 8\)"):
        cache.append(randn(2, 2, 3, 8, dtype=torch.float16), randn(2, 2, 3, 8), None)
    with pytest.raises(TypeError, match=r"key_mask must be a bool tensor of shape \(2, 1\)"):
        cache.reset().append(randn(2, 2, 1, 8), randn(2, 2, 1, 8), torch.ones(2, 1, device=DEVICE))
    with pytest.raises(ValueError, match="max_len must be an int >= 1; got 0"):
        KVCache(1, 1, 0, 8)


@pytest.mark.parametrize("rot", [None, 8, 4], ids=["norope", "rope", "partial-rope"])
def test_empty_sequence_without_cache(rot):
    """S = 0 and no cache: an empty output and gradients, with rotary as without (rotary raised "cos/sin must
    hold at least one position"), in training and in inference (the in-place rotary path)."""
    layer = make_layer(2, True, False, rot, torch.float32)
    x = randn(2, 0, E, requires_grad=True)
    out = layer(x)
    assert out.shape == (2, 0, E)
    out.sum().backward()
    assert x.grad.shape == x.shape and torch.equal(layer.qkv.weight.grad, torch.zeros_like(layer.qkv.weight))
    with torch.no_grad():
        assert layer.eval()(x).shape == (2, 0, E)


@pytest.mark.parametrize("kwargs, match", [
    (dict(embed_dim=30, num_heads=4), r"embed_dim \(30\) must be divisible by num_heads \(4\)"),
    (dict(embed_dim=32, num_heads=4, num_kv_heads=3), r"num_heads \(4\) must be a multiple of num_kv_heads \(3\)"),
    (dict(embed_dim=32, num_heads=4, rotary=RotaryEmbedding(16)), r"rotary.dim \(16\) must be <= head_dim \(8\)"),
    (dict(embed_dim=32, num_heads=4, cross=True, rotary=RotaryEmbedding(8)), "rotary is for self-attention"),
    (dict(embed_dim=32, num_heads=4, cross=True, causal=True), "cross=True with causal=True"),
    (dict(embed_dim=32, num_heads=4, dropout=1.5), r"dropout must be a number in \[0, 1\] .*; got 1.5"),
    (dict(embed_dim=32, num_heads=0), "num_heads must be an int >= 1; got 0"),
    (dict(embed_dim=32, num_heads=4, kdim=16), "kdim is only meaningful with cross=True"),
    (dict(embed_dim=32, num_heads=4, causal="False"), "causal must be a bool; got str 'False'"),  # truthy
    (dict(embed_dim=32, num_heads=4, cross=1), "cross must be a bool; got int 1"),
    (dict(embed_dim=32, num_heads=4, backend="bogus"), r"backend must be None or one of \['reference', 'triton'\] "
                                                       r".*got 'bogus'"),  # (it was refused at the first call)
], ids=["indivisible", "kv-heads", "rotary-dim", "cross-rotary", "cross-causal", "dropout", "heads", "kdim",
        "causal-str", "cross-int", "backend"])
def test_constructor_errors(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        MultiheadAttention(**kwargs)


@pytest.mark.parametrize("make, match", [
    (lambda: flashtx.nn.TransformerBlock(32, 4, cross="no"), "cross must be a bool; got str 'no'"),
    (lambda: RotaryEmbedding(8, interleaved="False"), "interleaved must be a bool; got str 'False'"),
    (lambda: flashtx.nn.SwiGLU(8, 16, inplace_backward="False"), "inplace_backward must be a bool; got str"),
    (lambda: flashtx.nn.SwiGLU(8, 16, packed=0), "packed must be a bool; got int 0"),
], ids=["block-cross", "rotary-interleaved", "swiglu-inplace", "swiglu-packed"])
def test_module_flags_must_be_bools(make, match):
    """A flag given as a string or an int is refused, as SDPA refuses is_causal="no": bool("False") is True, which
    turned on what the caller meant to turn off (the in-place backward, causality, GPT-J pairs)."""
    with pytest.raises(TypeError, match=match):
        make()


@pytest.mark.parametrize("cross", [False, True], ids=["self", "cross"])
def test_forward_errors_name_the_argument(cross):
    layer = make_layer(2, False, cross, None, torch.float32, backend="reference")
    x = randn(2, 5, E)
    with pytest.raises(ValueError, match=r"x must be \(B, S, embed_dim\) = \(B, S, 32\); got shape \(2, 5, 16\)"):
        layer(randn(2, 5, 16))
    if cross:
        with pytest.raises(ValueError, match="cross-attention needs memory"):
            layer(x)
        with pytest.raises(ValueError, match=r"memory must be \(B, Sm, kdim\) = \(2, Sm, 32\); got \(1, 4, 32\)"):
            layer(x, randn(1, 4, E))
    else:
        with pytest.raises(ValueError, match="memory is for cross-attention"):
            layer(x, x)
        with pytest.raises(TypeError, match="key_mask must be a bool tensor"):
            layer(x, key_mask=torch.ones(2, 5, device=DEVICE))


@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_attn_mask_is_passed_through(kind):
    layer = make_layer(2, False, False, 8, torch.float32)
    B, S = 2, 6
    vis = torch.rand(B, 1, S, S, device=DEVICE) > 0.4
    vis |= torch.eye(S, dtype=torch.bool, device=DEVICE)
    mask = vis if kind == "bool" else torch.zeros(vis.shape, device=DEVICE).masked_fill(~vis, float("-inf"))
    x = randn(B, S, E, requires_grad=True)
    x64, xe = x.detach().double().requires_grad_(True), x.detach().clone().requires_grad_(True)
    out = layer(x, attn_mask=mask)
    out_ref = eager_mha(copy.deepcopy(layer).double(), x64, attn_mask=mask if kind == "bool" else mask.double())
    out_e = eager_mha(layer, xe, attn_mask=mask)
    assert_close_to_reference("output with attn_mask", out, out_ref, out_e)
    for o in (out, out_ref, out_e):
        o.sum().backward()
    assert_close_to_reference("dx with attn_mask", x.grad, x64.grad, xe.grad, grad=True)


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_a_forward_hook_keeps_the_qkv_output_it_saw(mode):
    """Without autograd the rotary rotates q and k in place; they are views of the qkv projection's output, so a
    forward hook that kept that output (activation caching, probes) must not see it rotated."""
    layer = make_layer(2, True, False, 8, torch.float32).eval()
    x = randn(2, 5, E)
    kept = []
    hook = layer.qkv.register_forward_hook(lambda m, inp, out: kept.append(out))
    with torch.no_grad() if mode == "no_grad" else torch.inference_mode():
        y = layer(x)
        want = layer.qkv(x)
    hook.remove()
    assert torch.equal(kept[0], want)
    torch.testing.assert_close(y, eager_mha(layer, x), atol=1e-5, rtol=1e-5)


def test_gradients_flow_through_a_kv_cache_over_several_calls():
    """Calls with gradients write the cache out of place (as transformers' DynamicCache), so one backward over
    several cached calls gives the uncached forward's gradients (in-place writes raised autograd's error)."""
    layer = make_layer(2, True, False, 8, torch.float64)
    x = randn(2, 9, E, dtype=torch.float64, requires_grad=True)
    cache = layer.new_cache(2, max_len=12)
    outs = [layer(x[:, a:b], cache=cache) for a, b in ((0, 4), (4, 5), (5, 9))]
    torch.cat(outs, 1).square().sum().backward()
    got = [x.grad.clone()] + [p.grad.clone() for p in layer.parameters()]
    x.grad = None
    layer.zero_grad()
    eager_mha(layer, x).square().sum().backward()
    want = [x.grad] + [p.grad for p in layer.parameters()]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-10, rtol=1e-10)


def test_kv_cache_k_and_v_are_views_that_can_be_reassigned():
    """KVCache keeps (B, max_len, Hkv, D) buffers (flash-attn's layout: the decode op writes them in place, traced
    too); .k / .v are their (B, Hkv, max_len, D) views, and assigning one (rows reordered, as beam search does) keeps
    its transpose as the buffer, which the next step reads."""
    torch.manual_seed(5)
    m = MultiheadAttention(E, H, num_kv_heads=2, causal=True).to(DEVICE).eval()
    cache = m.new_cache(2, 16)
    assert cache.k.shape == (2, 2, 16, E // H) and cache.k.data_ptr() == cache._k.data_ptr()
    x = randn(2, 5, E)
    with torch.no_grad():
        m(x, cache=cache)
        cache.k, cache.v = cache.k[[1, 0]], cache.v[[1, 0]]  # swap the two sequences' caches
        step = randn(2, 1, E)
        got = m(step, cache=cache)
        want = m(torch.cat([x[[1, 0]], step], 1))[:, -1:]  # the swapped prompts, uncached
    assert cache._k.shape == (2, 16, 2, E // H)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
