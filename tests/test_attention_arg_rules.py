"""Attention's argument rules a mutation round found untested: views read as given (strided lengths, transposed
ALiBi slopes), refusals by name (ALiBi's batch, a bool softcap, varlen's sequence counts, CausalBias forms, value's
lead dims), what the small-query route keeps (v's gradient alone, dropout without grad), lengths given for one side
only, patched SDPA's error for a mask that broadcasts the output, its per-kind check on the GPU's branch, and the
op's backward through out or lse alone."""

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

import flashtx
from flashtx import sdpa_patch

from conftest import DEVICE, precise_atol, precise_randn

pytestmark = pytest.mark.usefixtures("fresh_plans")
ATOL = precise_atol(1e-10)


def _qkv(b=2, h=3, sq=20, sk=20, d=16, grad=False):
    q = precise_randn(b, h, sq, d, requires_grad=grad)
    return q, *(precise_randn(b, h, sk, d, requires_grad=grad) for _ in range(2))


def _ref(q, k, v, **kw):
    return flashtx.attention(q, k, v, **kw, backend="reference")


def test_strided_kv_lens_are_read_as_given():
    q, k, v = _qkv()
    lens = torch.tensor([20, -1, 7, -1], device=DEVICE)[::2]  # (2,) with stride 2: [20, 7]
    torch.testing.assert_close(flashtx.attention(q, k, v, kv_lens=lens), _ref(q, k, v, kv_lens=lens.contiguous()),
                               atol=ATOL, rtol=0)


def test_transposed_alibi_slopes_are_read_as_given():
    q, k, v = _qkv()
    slopes = torch.rand(3, 2, device=DEVICE).t()  # (B, H) = (2, 3), not contiguous
    torch.testing.assert_close(flashtx.attention(q, k, v, alibi_slopes=slopes),
                               _ref(q, k, v, alibi_slopes=slopes.contiguous()), atol=ATOL, rtol=0)


@pytest.mark.parametrize("call, words", [
    (lambda q, k, v: flashtx.attention(q, k, v, alibi_slopes=torch.rand(5, 3, device=DEVICE)),
     "alibi_slopes must have shape (nheads,) = (3,) or (batch, nheads) = (2, 3); got (5, 3)"),
    (lambda q, k, v: flashtx.attention(q, k, v, softcap=False),
     "softcap must be 0 (off) or a float in [2**-100, 2**100]; got False"),
    (lambda q, k, v: flashtx.attention(q, k, v, attn_mask=causal_lower_right(20, 20), is_causal=None),
     "attn_mask is a CausalBias, which is causal itself: is_causal must be False; got None"),
    (lambda q, k, v: flashtx.attention(q, k, v, attn_mask=causal_lower_right(20, 20), is_causal=1),
     "is_causal must be False; got 1"),
    (lambda q, k, v: flashtx.attention(q, k, v, attn_mask=causal_lower_right(20, 30)),
     "attn_mask is a CausalBias for 20 queries and 30 keys; the inputs have 20 and 20"),
    (lambda q, k, v: flashtx.attention(q[None].expand(2, -1, -1, -1, -1), k[None].expand(2, -1, -1, -1, -1),
                                       v[None].expand(3, -1, -1, -1, -1)),
     "query, key, value must have the same leading (batch) dims"),
    (lambda q, k, v: flashtx.flash_attn_varlen_func(
        q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1),
        torch.tensor([0, 7, 20], dtype=torch.int32, device=DEVICE),
        torch.tensor([0, 5, 12, 20], dtype=torch.int32, device=DEVICE), 13, 8),
     "cu_seqlens_q and cu_seqlens_k must describe the same number of sequences; got shapes (3,) and (4,)"),
], ids=["alibi-batch", "softcap-bool", "causal-bias-None", "causal-bias-1", "causal-bias-lengths", "value-lead-dims",
        "varlen-counts"])
def test_refused_by_name(call, words):
    with pytest.raises(ValueError) as info:
        call(*_qkv())
    assert words in str(info.value), str(info.value)


def test_a_decode_shaped_call_where_only_v_learns_gets_vs_gradient():
    q, k = precise_randn(1, 2, 4, 16), precise_randn(1, 2, 20, 16)
    v = precise_randn(1, 2, 20, 16, requires_grad=True)
    km = torch.ones(1, 20, dtype=torch.bool, device=DEVICE)
    km[0, -3:] = False
    flashtx.attention(q, k, v, key_mask=km).sum().backward()
    v64 = v.detach().double().requires_grad_()
    _ref(q.double(), k.double(), v64, key_mask=km).sum().backward()
    torch.testing.assert_close(v.grad.double(), v64.grad, atol=ATOL, rtol=0)


def test_dropout_applies_without_grad_on_the_small_query_route():
    q, k, v = precise_randn(1, 2, 4, 16), precise_randn(1, 2, 40, 16), precise_randn(1, 2, 40, 16)
    km = torch.ones(1, 40, dtype=torch.bool, device=DEVICE)
    with torch.no_grad():
        plain = flashtx.attention(q, k, v, key_mask=km)
        dropped = flashtx.attention(q, k, v, key_mask=km, dropout_p=0.5)
    assert (dropped - plain).abs().max() > 0.1


def test_kv_lens_alone_leaves_every_query_row():
    """flash_attn_func with kv_lens only (Sq = 20 > Sk = 10): every query row is real, as with full q_lens."""
    q = precise_randn(2, 20, 2, 16)
    k, v = precise_randn(2, 10, 2, 16), precise_randn(2, 10, 2, 16)
    kv = torch.tensor([10, 6], device=DEVICE)
    got = flashtx.flash_attn_func(q, k, v, kv_lens=kv)
    want = flashtx.flash_attn_func(q, k, v, kv_lens=kv, q_lens=torch.tensor([20, 20], device=DEVICE))
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    assert got[:, 10:].abs().amax() > 0


def test_patched_sdpa_gives_torchs_error_for_a_mask_that_broadcasts_the_output():
    q, k, v = _qkv(b=1)
    m = torch.zeros(3, 3, 20, 20, dtype=q.dtype, device=DEVICE)  # batch 3 over an output of batch 1
    with pytest.raises(RuntimeError) as torchs:
        F.scaled_dot_product_attention(q, k, v, attn_mask=m)
    with flashtx.patch_sdpa(), pytest.raises(RuntimeError) as patched:
        F.scaled_dot_product_attention(q, k, v, attn_mask=m)
    assert str(patched.value) == str(torchs.value)


@pytest.fixture
def gpu_branch_without(monkeypatch, refuse_tiles):
    """patch_sdpa's per-kind check on DEVICE's calls (on CPU a stand-in for CUDA's: sdpa_patch._GPU), with the tile
    tables refusing the kernels whose names start with the given prefix (refuse_tiles)."""
    monkeypatch.setattr(sdpa_patch, "_GPU", torch.device(DEVICE).type)
    return refuse_tiles


def test_patched_sdpa_asks_the_tiles_a_learned_bias_needs(gpu_branch_without):
    gpu_branch_without("attn_bwd_dq_dbias")
    q, k, v = (torch.randn(1, 2, 20, 16, device=DEVICE, requires_grad=True) for _ in range(3))
    assert sdpa_patch.unsupported_reason(q, k, v, attn_mask=torch.zeros(1, 2, 20, 20, device=DEVICE)) is None
    why = sdpa_patch.unsupported_reason(q, k, v, attn_mask=torch.zeros(1, 2, 20, 20, device=DEVICE,
                                                                    requires_grad=True))
    assert why is not None and "attn_bwd_dq_dbias" in why, why


def test_patched_sdpa_asks_again_when_grad_is_needed(gpu_branch_without):
    gpu_branch_without("attn_bwd")
    q, k, v = (torch.randn(1, 2, 20, 16, device=DEVICE) for _ in range(3))
    assert sdpa_patch.unsupported_reason(q, k, v) is None  # inference: the forward's tile fits
    why = sdpa_patch.unsupported_reason(q.requires_grad_(), k, v)
    assert why is not None and "attn_bwd" in why, why


@pytest.mark.parametrize("use", ["out", "lse"])
def test_the_ops_backward_through_out_or_lse_alone(use):
    def grads(backend):
        torch.manual_seed(0)
        q, k, v = _qkv(b=1, h=2, grad=True)
        out, lse = flashtx.attention(q, k, v, return_lse=True, backend=backend)
        (out if use == "out" else lse).sum().backward()
        return q.grad, k.grad, v.grad

    for got, want in zip(grads(None), grads("reference")):
        torch.testing.assert_close(got, want, atol=precise_atol(1e-9), rtol=0)
