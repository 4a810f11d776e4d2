"""Calls the kernels cannot serve get a clear error (flashtx's own API) or torch's SDPA (the patch), never a crash
deep inside torch or a silently wrong answer: torch.func transforms, forward-mode AD, nested and sparse tensors,
a non-bool enable_gqa. Each also after a lane exists for the same layout (a warm call signature)."""
import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.attention
import torch.nn.functional as F
from conftest import DEVICE, randn

import flashtx

pytestmark = pytest.mark.usefixtures("fresh_plans")
ORIGINAL = flashtx.sdpa_patch._ORIGINAL


def _qkv(b=2, h=2, sq=8, sk=10, d=16):
    return randn(b, h, sq, d), randn(b, h, sk, d), randn(b, h, sk, d)


def _bshd(q, k, v):
    return [t.transpose(1, 2).contiguous() for t in (q, k, v)]


CALLS = {
    "attention": lambda q, k, v: flashtx.attention(q, k, v, is_causal=True),
    "flash_attn_func": lambda q, k, v: flashtx.flash_attn_func(*_bshd(q, k, v), causal=True),
}


@pytest.mark.parametrize("api", sorted(CALLS))
def test_forward_ad_tangents_are_refused_not_dropped(api):
    """A dual input's tangent was dropped (the output had none: a wrong forward derivative): now refused."""
    q, k, v = _qkv()
    CALLS[api](q, k, v)  # a lane for this signature
    with fwAD.dual_level():
        dq = fwAD.make_dual(q, torch.randn_like(q))
        with pytest.raises(NotImplementedError, match="forward-mode AD"):
            CALLS[api](dq, k, v)
        out = CALLS[api](q, k, v)  # no tangent: runs
    torch.testing.assert_close(out, CALLS[api](q, k, v))


def test_forward_ad_errors_mention_patch_sdpa_only_for_attention():
    """The hint that patch_sdpa sends such SDPA calls to torch belongs to attention's error, not SwiGLU's."""
    q, k, v = _qkv()
    gate, up = randn(3, 8), randn(3, 8)
    with fwAD.dual_level():
        with pytest.raises(NotImplementedError, match="forward-mode AD.*patch_sdpa"):
            flashtx.attention(fwAD.make_dual(q, torch.randn_like(q)), k, v, backend="triton")
        with pytest.raises(NotImplementedError, match="forward-mode AD") as info:
            flashtx.swiglu(fwAD.make_dual(gate, torch.randn_like(gate)), up)
    assert "patch_sdpa" not in str(info.value)


def test_forward_ad_errors_point_to_backward_mode_only_for_differentiable_ops():
    """The cache append has no derivative at all: its error says so instead of pointing to backward mode."""
    q, k, v = _qkv()
    kc, vc = randn(2, 8, 2, 16), randn(2, 8, 2, 16)  # (B, S_cache, Hkv, D)
    lens = torch.tensor([3, 5], dtype=torch.int32)
    with fwAD.dual_level():
        for sq in (8, 64):  # (no grad: a short query takes the decoding route, kvcache_attention)
            q = randn(2, 2, sq, 16)
            with pytest.raises(NotImplementedError, match="forward-mode AD.*use backward-mode autograd"):
                flashtx.attention(fwAD.make_dual(q, torch.randn_like(q)), k, v)
        new = randn(2, 1, 2, 16)  # (B, 1, Hkv, D)
        with pytest.raises(NotImplementedError, match="forward-mode AD") as info:
            flashtx.flash_attn_with_kvcache(randn(2, 1, 4, 16), kc, vc, fwAD.make_dual(new, torch.randn_like(new)),
                                            new, cache_seqlens=lens)
    assert "it is not differentiable" in str(info.value) and "backward-mode" not in str(info.value), info.value


@pytest.mark.parametrize("api", sorted(CALLS))
def test_torch_func_transforms_are_refused_clearly(api):
    q, k, v = _qkv(b=3)
    CALLS[api](q[0:1], k[0:1], v[0:1])
    with pytest.raises(NotImplementedError, match="torch.func transforms"):
        torch.func.vmap(lambda a, b, c: CALLS[api](a[None], b[None], c[None]))(q, k, v)
    with pytest.raises(NotImplementedError, match="torch.func transforms"):
        torch.func.grad(lambda a: CALLS[api](a, k[0:1], v[0:1]).sum())(q[0:1])


COMPILED_OPS = {
    "attention": lambda q: flashtx.attention(q, q, q, is_causal=True),
    "swiglu": lambda q: flashtx.swiglu(q, q),
    "rotary": lambda q: flashtx.apply_rotary(q, torch.ones(8, 8, device=q.device, dtype=q.dtype),
                                             torch.zeros(8, 8, device=q.device, dtype=q.dtype), layout="bhsd"),
}


@pytest.mark.parametrize("how", ["jvp", "dual"])
@pytest.mark.parametrize("op", sorted(COMPILED_OPS))
def test_forward_ad_under_torch_compile_is_refused_not_zeroed(op, how):
    """Compiled, forward-mode AD is refused with flashtx's error too (fuzz, 2026-12-07: torch.compile of a
    torch.func.jvp through flashtx gave all-zero tangents, and a dual input a None tangent, silently): the check ran
    after the compiled path's early return; a traced tensor shows no tangent, so an open dual level refuses."""
    f = COMPILED_OPS[op]
    x = randn(1, 2, 8, 16)
    torch._dynamo.reset()
    # (torch 2.15's Dynamo refuses a dual input itself: either refusal, never a dropped tangent)
    with pytest.raises(Exception, match="not supported|does not support input tensors that carry") as info:
        if how == "jvp":
            torch.compile(lambda x: torch.func.jvp(f, (x,), (torch.ones_like(x),))[1], backend="aot_eager",
                          fullgraph=True)(x)
        else:
            with fwAD.dual_level():
                torch.compile(f, backend="aot_eager", fullgraph=True)(fwAD.make_dual(x, torch.ones_like(x)))
    assert "flashtx::" in str(info.value) or "carry a forward-mode AD tangent" in str(info.value)
    torch._dynamo.reset()
    assert torch._dynamo.explain(f)(x).graph_break_count == 0  # (the check costs plain compiled calls nothing)


def test_patched_sdpa_sends_transforms_and_forward_ad_to_torch():
    q, k, v = _qkv(b=3)
    t = torch.randn_like(q)
    want_vmap = torch.func.vmap(ORIGINAL)(q, k, v)
    want_grad = torch.func.grad(lambda a: ORIGINAL(a, k, v, is_causal=True).sum())(q)
    math = torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH)  # torch's backend with a jvp
    with fwAD.dual_level(), math:
        want_jvp = fwAD.unpack_dual(ORIGINAL(fwAD.make_dual(q, t), k, v)).tangent
    with flashtx.patch_sdpa(), pytest.warns(UserWarning, match="goes to torch's"):
        F.scaled_dot_product_attention(q, k, v)  # a lane for this signature
        got_vmap = torch.func.vmap(F.scaled_dot_product_attention)(q, k, v)
        got_grad = torch.func.grad(lambda a: F.scaled_dot_product_attention(a, k, v, is_causal=True).sum())(q)
        with fwAD.dual_level(), torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
            got_jvp = fwAD.unpack_dual(F.scaled_dot_product_attention(fwAD.make_dual(q, t), k, v)).tangent
    for got, want in ((got_vmap, want_vmap), (got_grad, want_grad), (got_jvp, want_jvp)):
        assert got is not None
        torch.testing.assert_close(got, want)


def _nested(*lens, d=16):
    return torch.nested.nested_tensor([torch.randn(2, n, d) for n in lens]).to(DEVICE)


def test_nested_inputs_are_refused_by_name():
    n = _nested(8, 5)
    with pytest.raises(TypeError, match="query is a nested tensor"):
        flashtx.attention(n, n, n)
    with pytest.raises(TypeError, match="q is a nested tensor"):
        flashtx.flash_attn_func(n, n, n)
    with pytest.raises(TypeError, match="q is a nested tensor"):
        flashtx.flash_attn_varlen_func(n, n, n, torch.tensor([0, 8], dtype=torch.int32, device=DEVICE),
                                       torch.tensor([0, 8], dtype=torch.int32, device=DEVICE), 8, 8)


def test_patched_sdpa_sends_strided_nested_tensors_to_torch():
    qs, ks, vs = (torch.nested.nested_tensor([randn(2, 8, 16), randn(2, 8, 16)]) for _ in range(3))
    want = ORIGINAL(qs, ks, vs)
    with flashtx.patch_sdpa(), pytest.warns(UserWarning, match="nested"):
        got = F.scaled_dot_product_attention(qs, ks, vs)
    torch.testing.assert_close(got.to_padded_tensor(0.0), want.to_padded_tensor(0.0))


def _sparse(t):
    return t.to_sparse()


OPTIONS = {  # flashtx.attention keyword -> (a valid dense value for _qkv(), the argument's name in the message)
    "attn_mask": (lambda: torch.ones(8, 10, dtype=torch.bool, device=DEVICE), "attn_mask"),
    "key_mask": (lambda: torch.ones(2, 10, dtype=torch.bool, device=DEVICE), "key_mask"),
    "kv_lens": (lambda: torch.full((2,), 7, dtype=torch.int32, device=DEVICE), "kv_lens"),
    "alibi_slopes": (lambda: torch.rand(2, device=DEVICE), "alibi_slopes"),
}


@pytest.mark.parametrize("option", sorted(OPTIONS))
def test_sparse_option_tensors_are_refused_by_name(option):
    make, name = OPTIONS[option]
    q, k, v = _qkv()
    flashtx.attention(q, k, v, **{option: make()})  # a lane for the dense layout
    for bad in (_sparse(make()), torch.nested.nested_tensor([make()])):
        with pytest.raises(TypeError, match=f"{name} (has layout|is a nested tensor)"):
            flashtx.attention(q, k, v, **{option: bad})


def test_sparse_cu_seqlens_and_block_table_are_refused_by_name():
    q = randn(10, 2, 16)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32, device=DEVICE)
    with pytest.raises(TypeError, match="cu_seqlens_q has layout"):
        flashtx.flash_attn_varlen_func(q, q, q, _sparse(cu), cu, 6, 6)
    cache = randn(2, 16, 2, 16)
    table = torch.tensor([[0], [1]], dtype=torch.int32, device=DEVICE)
    with pytest.raises(TypeError, match="block_table has layout"):
        flashtx.flash_attn_varlen_func(q, cache, cache, cu, cu, 6, 6, block_table=_sparse(table))


@pytest.mark.parametrize("value", ["no", 1, 0.5])
def test_enable_gqa_must_be_a_bool_as_in_torch(value):
    q, k, v = randn(2, 4, 8, 16), randn(2, 2, 10, 16), randn(2, 2, 10, 16)
    with pytest.raises(TypeError, match="enable_gqa must be a bool"):
        flashtx.attention(q, k, v, enable_gqa=value)
    with pytest.raises(TypeError, match="enable_gqa must be a bool"):
        flashtx.attention(q, k[:, :1].expand(2, 4, 10, 16), v[:, :1].expand(2, 4, 10, 16), enable_gqa=value)  # MHA
    with pytest.raises(TypeError), flashtx.patch_sdpa():
        F.scaled_dot_product_attention(q, k, v, enable_gqa=value)  # torch's own error


def test_return_lse_must_be_a_bool():
    with pytest.raises(TypeError, match="return_lse must be a bool"):
        flashtx.attention(*_qkv(), return_lse="no")


def test_flash_attn_shape_errors_print_the_callers_shapes():
    q, k = randn(2, 8, 3, 16), randn(2, 10, 2, 16)
    with pytest.raises(ValueError, match=r"q \(2, 8, 3, 16\), k \(2, 10, 2, 16\), v \(2, 10, 2, 16\)"):
        flashtx.flash_attn_func(q, k, k.clone())
    cu = torch.tensor([0, 12], dtype=torch.int32, device=DEVICE)
    q3, k3 = randn(12, 3, 16), randn(12, 2, 16)
    with pytest.raises(ValueError, match=r"q \(12, 3, 16\), k \(12, 2, 16\), v \(12, 2, 16\)"):
        flashtx.flash_attn_varlen_func(q3, k3, k3.clone(), cu, cu, 12, 12)
