"""flashtx.nn.TransformerBlock and RMSNorm against their math written out, under the tolerance rule;
BlockCache decoding against the full forward."""
import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICE, assert_close_to_reference, dtype_id, eager_mha, randn

from flashtx.nn import RMSNorm, RotaryEmbedding, TransformerBlock, llama_hidden_dim

E, H = 32, 4


def eager_norm(m, x):
    if isinstance(m, RMSNorm):  # LlamaRMSNorm: fp32 statistics, cast back, then scale
        h = x if x.dtype == torch.float64 else x.float()
        return m.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + m.eps)).to(x.dtype)
    return F.layer_norm(x, (x.shape[-1],), m.weight, m.bias, m.eps)


def eager_block(b, x, memory=None, key_mask=None, memory_mask=None):
    """TransformerBlock's math: pre-norm residual sublayers, eager attention, written-out SwiGLU."""
    x = x + eager_mha(b.attn, eager_norm(b.attn_norm, x), key_mask=key_mask)
    if b.cross_attn is not None:
        x = x + eager_mha(b.cross_attn, eager_norm(b.cross_norm, x), memory, key_mask=memory_mask)
    gate, up = F.linear(eager_norm(b.mlp_norm, x), b.mlp.w13.weight, b.mlp.w13.bias).chunk(2, dim=-1)
    return x + F.linear(F.silu(gate) * up, b.mlp.w2.weight, b.mlp.w2.bias)


CASES = {  # id: constructor kwargs, whether batch row 0 is padded
    "decoder-rms-rope-gqa": (dict(num_kv_heads=2, rotary=True), False),
    "encoder-layernorm-bias-pad": (dict(causal=False, norm="layer", bias=True), True),
    "cross-decoder-mqa-pad": (dict(num_kv_heads=1, cross=True, rotary=True), True),
}


def make_block(kw, dtype=torch.float32):
    torch.manual_seed(0)
    kw = dict(kw)
    if kw.pop("rotary", False):
        kw["rotary"] = RotaryEmbedding(8, base=100.0)
    b = TransformerBlock(E, H, hidden_dim=48, **kw)
    for p in b.parameters():  # norms start at ones/zeros: perturb so their gradients mean something
        p.data.add_(0.05 * torch.randn_like(p))
    return b.to(DEVICE, dtype)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=dtype_id)
def test_block_matches_written_out_math(case, dtype):
    kw, padded = CASES[case]
    block = make_block(kw, dtype)
    ref, eager = copy.deepcopy(block).double(), copy.deepcopy(block)
    B, S, Sm = 2, 6, 5
    x = randn(B, S, E, dtype=dtype, requires_grad=True)
    memory = randn(B, Sm, E, dtype=dtype) if kw.get("cross") else None
    key_mask = torch.ones(B, S, dtype=torch.bool, device=DEVICE)
    memory_mask = torch.ones(B, Sm, dtype=torch.bool, device=DEVICE) if memory is not None else None
    if padded:
        key_mask[0, -2:] = False
        if memory_mask is not None:
            memory_mask[0, -2:] = False
    x64, xe = x.detach().double().requires_grad_(True), x.detach().clone().requires_grad_(True)
    mem64 = memory.double() if memory is not None else None

    out = block(x, memory, key_mask=key_mask, memory_mask=memory_mask)
    out_ref = eager_block(ref, x64, mem64, key_mask, memory_mask)
    out_e = eager_block(eager, xe, memory, key_mask, memory_mask)
    assert_close_to_reference("block output", out, out_ref, out_e)
    d = randn(B, S, E, dtype=dtype)
    out.backward(d)
    out_ref.backward(d.double())
    out_e.backward(d)
    assert_close_to_reference("dx", x.grad, x64.grad, xe.grad, grad=True)
    pr, pe = dict(ref.named_parameters()), dict(eager.named_parameters())
    for name, p in block.named_parameters():
        assert_close_to_reference(f"d {name}", p.grad, pr[name].grad, pe[name].grad, grad=True)


def test_block_cache_decoding_matches_full_forward():
    block = make_block(dict(num_kv_heads=2, cross=True, rotary=True)).eval()
    B, S, Sm = 2, 7, 5
    x, memory = randn(B, S, E), randn(B, Sm, E)
    key_mask = torch.ones(B, S, dtype=torch.bool, device=DEVICE)
    key_mask[1, :2] = False  # left padding
    memory_mask = torch.ones(B, Sm, dtype=torch.bool, device=DEVICE)
    memory_mask[0, -1] = False
    with torch.no_grad():
        out_ref = eager_block(copy.deepcopy(block).double(), x.double(), memory.double(), key_mask, memory_mask)
        out_e = eager_block(block, x, memory, key_mask, memory_mask)
        cache = block.new_cache(B, max_len=S, memory_len=Sm)
        outs = [block(x[:, :3], memory, key_mask=key_mask[:, :3], memory_mask=memory_mask, cache=cache)]
        outs += [block(x[:, i:i + 1], key_mask=key_mask[:, i:i + 1], cache=cache) for i in range(3, S)]
    assert_close_to_reference("cached block decoding", torch.cat(outs, 1), out_ref, out_e)
    assert cache.reset() is cache and int(cache.self_attn.length) == 0 and not cache.cross_attn.filled


def test_block_errors():
    with pytest.raises(ValueError, match="norm must be one of"):
        TransformerBlock(E, H, norm="batch")
    with pytest.raises(ValueError, match=r"resid_dropout must be a number in \[0, 1\)"):
        TransformerBlock(E, H, resid_dropout=-0.1)
    with pytest.raises(ValueError, match="needs memory_len"):
        TransformerBlock(E, H, cross=True).new_cache(1, 4)
    with pytest.raises(ValueError, match="built with cross=False"):
        TransformerBlock(E, H).to(DEVICE)(randn(1, 3, E), randn(1, 3, E))


def test_llama_hidden_dim():
    assert llama_hidden_dim(4096, 256) == 11008  # LLaMA-7B's MLP width
    assert TransformerBlock(E, H).mlp.hidden_dim == llama_hidden_dim(E)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64], ids=dtype_id)
def test_rms_norm(dtype):
    norm = RMSNorm(E, eps=1e-5).to(DEVICE)
    norm.weight.data.normal_()
    x = randn(3, 4, E, dtype=dtype, scale=3.0)
    xf = x.double()
    want = norm.weight.double() * (xf / torch.sqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5))
    got = norm(x)
    assert got.dtype == torch.promote_types(dtype, torch.float32)  # weight * h, as LlamaRMSNorm
    assert_close_to_reference("rmsnorm", got, want, eager_norm(norm, x))
    assert RMSNorm(E, elementwise_affine=False).weight is None
    with pytest.raises(ValueError, match=r"RMSNorm\(32\) got x of shape \(2, 16\)"):
        norm(randn(2, 16))
    with pytest.raises(ValueError, match="dim must be an int >= 1"):
        RMSNorm(0)
    with pytest.raises(TypeError, match="RMSNorm needs a floating-point x; got dtype torch.int64"):
        norm(torch.ones(2, E, dtype=torch.int64, device=DEVICE))  # (its result was truncated to integers)
    with pytest.raises(TypeError, match="RMSNorm needs a dense x; got a nested tensor"):
        norm(torch.nested.nested_tensor([randn(2, E), randn(3, E)]))  # (torch's internal error on its shape)


def test_a_bare_layer_cache_is_refused_by_name():
    """A TransformerBlock takes the BlockCache of its new_cache; a bare KVCache gave an AttributeError."""
    block = TransformerBlock(32, 4, 2, hidden_dim=48).eval()
    cache = block.attn.new_cache(1, max_len=8)
    with torch.no_grad(), pytest.raises(TypeError, match="cache must be a BlockCache from TransformerBlock.new_cache"
                                                         ".*got KVCache"):
        block(torch.randn(1, 2, 32), cache=cache)


def test_a_cache_of_a_block_with_other_cross_attention_is_refused_by_name():
    """A cross block given a self block's BlockCache crashed (no memory) or ran its cross-attention uncached."""
    torch.manual_seed(0)
    cross, plain = (TransformerBlock(32, 4, 2, hidden_dim=48, cross=c).eval() for c in (True, False))
    x, memory = torch.randn(1, 2, 32), torch.randn(1, 5, 32)
    with torch.no_grad():
        for block, cache, args in ((cross, plain.new_cache(1, max_len=8), (memory,)),
                                   (cross, plain.new_cache(1, max_len=8), ()),
                                   (plain, cross.new_cache(1, max_len=8, memory_len=5), ())):
            with pytest.raises(ValueError, match="cache is a BlockCache (with|without) a cross-attention cache, but "
                                                 "this block has"):
                block(x, *args, cache=cache)
            assert int(cache.self_attn.length) == 0  # refused before anything was stored


def test_block_arguments_are_checked_by_name():
    for kwargs, words in ((dict(kdim=16), "kdim is only meaningful with cross=True"),
                          (dict(norm="layer", norm_eps=-1.0), r"norm_eps must be a number >= 0; got -1.0")):
        with pytest.raises(ValueError, match=words):
            TransformerBlock(E, H, **kwargs)
    with pytest.raises(ValueError, match=r"dim must be an int >= 1; got '64'"):
        TransformerBlock("64", H)
    with pytest.raises(ValueError, match="memory_len is for cross blocks' caches"):
        TransformerBlock(E, H).new_cache(1, 4, memory_len=5)
    with pytest.raises(ValueError, match=r"num_pages must be an int >= 1; got 0"):
        TransformerBlock(E, H).new_cache(1, 4, paged=True, num_pages=0)
    block = TransformerBlock(E, H, cross=True).to(DEVICE).eval()
    cache = block.new_cache(1, 8, memory_len=4)
    with torch.no_grad(), pytest.raises(ValueError, match=r"memory has 6 positions but the cross-attention cache "
                                                          r"holds 4: create it with new_cache\(..., max_len>=6\) \(a "
                                                          r"TransformerBlock's: memory_len>=6\)"):
        block(randn(1, 2, E), randn(1, 6, E), cache=cache)


def test_block_without_inplace_backward_takes_a_second_backward():
    """retain_graph needs the MLP's activation gradient out of place: the block passes inplace_backward on."""
    block = TransformerBlock(E, H, inplace_backward=False).to(DEVICE)
    assert block.mlp.inplace_backward is False and TransformerBlock(E, H).mlp.inplace_backward is True
    x = randn(1, 5, E, requires_grad=True)
    y = block(x)
    (g1,) = torch.autograd.grad(y.sum(), x, retain_graph=True)
    (g2,) = torch.autograd.grad(y.sum(), x)
    assert torch.equal(g1, g2)


@pytest.mark.parametrize("norm", ["rms", "layer"])
def test_meta_built_block_materialises_with_reset_parameters(norm):
    """torch's meta-device recipe (FSDP's too): build on meta, to_empty(), then reset_parameters() on every module
    that has one. Every parameter and buffer flashtx.nn owns gets a value (RMSNorm's weight ones, RotaryEmbedding's
    inv_freq its frequencies), and the block computes what one built on the device computes with the same weights.
    torch.empty is poisoned meanwhile: an uninitialised value would be NaN."""
    from conftest import poisoned_allocations

    torch.manual_seed(0)
    with torch.device("meta"):
        meta = TransformerBlock(E, H, 2, norm=norm, rotary=RotaryEmbedding(E // H))
    with poisoned_allocations():
        meta.to_empty(device=DEVICE)
        for m in meta.modules():
            if hasattr(m, "reset_parameters"):
                m.reset_parameters()
    for name, t in [*meta.named_parameters(), *meta.named_buffers()]:
        assert torch.isfinite(t).all(), name
    built = TransformerBlock(E, H, 2, norm=norm, rotary=RotaryEmbedding(E // H)).to(DEVICE)
    for m in (meta.attn_norm, meta.mlp_norm):
        assert torch.equal(m.weight, torch.ones_like(m.weight))
    rope = [m for m in meta.modules() if isinstance(m, RotaryEmbedding)][0]
    want = [m for m in built.modules() if isinstance(m, RotaryEmbedding)][0]
    assert torch.equal(rope.inv_freq, want.inv_freq)
    built.load_state_dict(meta.state_dict())
    x = randn(2, 7, E)
    with torch.no_grad():
        torch.testing.assert_close(meta(x), built(x), rtol=0, atol=0)
