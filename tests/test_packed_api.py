"""flash-attn's packed forms (flashtx/packed.py): the same results and gradients as the unpacked call on
the slices, against the float64 reference, on fused-projection layouts (non-contiguous slices); bad
packing gets an error naming the argument, and so do bad arguments to pad_input (bert_padding's)."""
import pytest
import torch
from conftest import DEVICE, PRECISE_DTYPE, precise_atol, randn

import flashtx
from flashtx import reference


def _ref(q, k, v, causal):  # (B, S, H, D) in, (B, Sq, Hq, D) out: the float64 reference (GQA too), bottom-right
    qh, kh, vh = (t.transpose(1, 2).to(PRECISE_DTYPE) for t in (q, k, v))
    out = reference.attention(qh, kh, vh, scale=q.shape[-1] ** -0.5, causal=causal, bottom_right=True)
    return out.transpose(1, 2)


@pytest.mark.parametrize("causal", [False, True])
def test_qkvpacked_matches_the_reference_and_the_unpacked_call(causal):
    torch.manual_seed(0)
    B, S, H, D = 2, 37, 3, 16
    w = randn(B, S, 3 * H * D + 5, dtype=PRECISE_DTYPE)[..., :3 * H * D]  # a fused projection, padded rows
    qkv = w.view(B, S, 3, H, D).requires_grad_(True)
    out = flashtx.flash_attn_qkvpacked_func(qkv, causal=causal)
    q, k, v = qkv.unbind(2)
    assert out.shape == (B, S, H, D)
    torch.testing.assert_close(out, _ref(q, k, v, causal).to(out.dtype), atol=precise_atol(1e-12), rtol=0)
    g = randn(*out.shape, dtype=out.dtype)
    (dqkv,) = torch.autograd.grad(out, qkv, g)
    q2, k2, v2 = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out2 = flashtx.flash_attn_func(q2, k2, v2, causal=causal)
    grads = torch.autograd.grad(out2, (q2, k2, v2), g)
    same = dict(atol=precise_atol(0.0), rtol=0)  # the same kernels on the same values: bitwise on CPU
    torch.testing.assert_close(out, out2, **same)
    assert dqkv.shape == qkv.shape
    torch.testing.assert_close(dqkv, torch.stack(grads, 2), **same)


def test_kvpacked_gqa_cross_attention_matches_the_reference():
    torch.manual_seed(1)
    q = randn(2, 9, 4, 16, dtype=PRECISE_DTYPE, requires_grad=True)
    kv = randn(2, 21, 2, 2, 16, dtype=PRECISE_DTYPE, requires_grad=True)  # (B, Sk, 2, Hkv, D): GQA 4/2
    out = flashtx.flash_attn_kvpacked_func(q, kv, causal=True)
    torch.testing.assert_close(out, _ref(q, kv[:, :, 0], kv[:, :, 1], True).to(out.dtype), atol=precise_atol(1e-12),
                               rtol=0)
    (dkv,) = torch.autograd.grad(out.sum(), kv)
    assert dkv.shape == kv.shape and torch.isfinite(dkv).all() and dkv.abs().sum() > 0


def test_varlen_packed_forms_match_the_unpacked_varlen_call():
    torch.manual_seed(2)
    lens = [5, 11, 1]
    cu = torch.tensor([0, 5, 16, 17], dtype=torch.int32, device=DEVICE)
    total, H, D = sum(lens), 2, 16
    qkv = randn(total, 3, H, D, dtype=PRECISE_DTYPE)
    out = flashtx.flash_attn_varlen_qkvpacked_func(qkv, cu, max(lens), causal=True)
    want = flashtx.flash_attn_varlen_func(*qkv.unbind(1), cu, cu, max(lens), max(lens), causal=True)
    same = dict(atol=precise_atol(0.0), rtol=0)
    assert out.shape == (total, H, D)
    torch.testing.assert_close(out, want, **same)
    q, kv = randn(total, 4, D, dtype=PRECISE_DTYPE), randn(total, 2, H, D, dtype=PRECISE_DTYPE)
    out = flashtx.flash_attn_varlen_kvpacked_func(q, kv, cu, cu, max(lens), max(lens))
    want = flashtx.flash_attn_varlen_func(q, *kv.unbind(1), cu, cu, max(lens), max(lens))
    assert out.shape == (total, 4, D)
    torch.testing.assert_close(out, want, **same)


@pytest.mark.parametrize("call,pattern", [
    (lambda: flashtx.flash_attn_qkvpacked_func(randn(2, 8, 2, 4, 16)),
     r"qkv must be 5-D \(B, S, 3, H, D\).*\(2, 8, 2, 4, 16\)"),
    (lambda: flashtx.flash_attn_qkvpacked_func(randn(2, 8, 4, 16)), r"qkv must be 5-D"),
    (lambda: flashtx.flash_attn_kvpacked_func(randn(2, 8, 4, 16), randn(2, 8, 3, 4, 16)),
     r"kv must be 5-D \(B, S, 2, H, D\) with 2 at dim 2; got shape \(2, 8, 3, 4, 16\)"),
    (lambda: flashtx.flash_attn_varlen_qkvpacked_func(randn(8, 4, 16), torch.tensor([0, 8], dtype=torch.int32), 8),
     r"qkv must be 4-D \(total, 3, H, D\)"),
    (lambda: flashtx.flash_attn_varlen_kvpacked_func(randn(8, 4, 16), [1, 2], None, None, 8, 8),
     r"kv must be a torch.Tensor; got list"),
    # kv against q, named as the user passed them (not as the unpacked k, v)
    (lambda: flashtx.flash_attn_kvpacked_func(randn(2, 8, 4, 16), randn(2, 8, 2, 3, 16)),
     r"q's heads \(4\) must be a multiple of kv's heads \(3\)"),
    (lambda: flashtx.flash_attn_kvpacked_func(randn(2, 8, 4, 16), randn(2, 8, 2, 4, 16, dtype=torch.float64)),
     r"kv must have q's dtype torch.float32; got torch.float64"),
    (lambda: flashtx.flash_attn_kvpacked_func(randn(2, 8, 4, 16), randn(3, 8, 2, 4, 16)),
     r"kv must have q's batch size 2; got kv of shape \(3, 8, 2, 4, 16\)"),
    (lambda: flashtx.flash_attn_varlen_kvpacked_func(randn(8, 4, 16), randn(8, 2, 4, 8), None, None, 8, 8),
     r"kv must have q's head dim 16; got kv of shape \(8, 2, 4, 8\)"),
    (lambda: flashtx.flash_attn_varlen_kvpacked_func(randn(8, 4, 16), randn(8, 2, 4, 16), None, None, 8, 8,
                                                     block_table=torch.zeros(1, 1, dtype=torch.int32)),
     r"block_table is not an argument of the packed forms"),
    # the varlen qkv form's one cu_seqlens and max_seqlen, named as it takes them (not as cu_seqlens_q/_k)
    (lambda: flashtx.flash_attn_varlen_qkvpacked_func(randn(8, 3, 4, 16), torch.tensor([0, 9], dtype=torch.int32),
                                                      8),
     r"^cu_seqlens\[-1\] must equal total \(qkv.shape\[0\]\) = 8"),
    (lambda: flashtx.flash_attn_varlen_qkvpacked_func(randn(8, 3, 4, 16), torch.tensor([0, 8]), 8),
     r"^cu_seqlens must be an int32 tensor \(as flash-attn\); got dtype torch.int64"),
    (lambda: flashtx.flash_attn_varlen_qkvpacked_func(randn(8, 3, 4, 16), torch.tensor([0, 3, 8],
                                                                                       dtype=torch.int32), 4),
     r"^max_seqlen = 4 is less than the longest sequence in cu_seqlens \(sequence 1: 5 rows\)"),
    (lambda: flashtx.flash_attn_varlen_qkvpacked_func(randn(8, 3, 4, 16), torch.tensor([0, 8], dtype=torch.int32),
                                                      8, nonsense=1),
     r"unexpected keyword argument 'nonsense'"),
    # the varlen kv form's total is kv's
    (lambda: flashtx.flash_attn_varlen_kvpacked_func(randn(8, 4, 16), randn(7, 2, 4, 16),
                                                     torch.tensor([0, 8], dtype=torch.int32),
                                                     torch.tensor([0, 8], dtype=torch.int32), 8, 8),
     r"^cu_seqlens_k\[-1\] must equal total_k \(kv.shape\[0\]\) = 7"),
    (lambda: flashtx.flash_attn_varlen_kvpacked_func(randn(8, 4, 16), randn(8, 2, 4, 16),
                                                     torch.tensor([0, 8], dtype=torch.int32),
                                                     torch.tensor([0, 8], dtype=torch.int32), 8, 8, nonsense=1),
     r"flash_attn_varlen_kvpacked_func\(\) got an unexpected keyword argument 'nonsense'"),
])
def test_bad_packing_gets_a_clear_error(call, pattern):
    with pytest.raises((ValueError, TypeError), match=pattern):
        call()


def test_qkvpacked_traces_without_graph_breaks():
    """The packed forms add only views in front of flash_attn_func: Dynamo traces them in one graph."""
    import torch._dynamo

    def block(x, w):
        qkv = (x @ w).view(2, 9, 3, 2, 8)  # a fused projection: (B, S, 3, H, D)
        return flashtx.flash_attn_qkvpacked_func(qkv, causal=True).sum()

    x = randn(2, 9, 16, dtype=torch.float32)
    w = randn(16, 48, dtype=torch.float32, requires_grad=True)
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(block)(x, w)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1
    loss = torch.compile(block, fullgraph=True, backend="aot_eager")(x, w)
    torch.testing.assert_close(loss, block(x, w), atol=precise_atol(0.0), rtol=0)


@pytest.mark.parametrize("call,pattern", [
    (lambda: flashtx.pad_input(randn(5, 2), [0, 1, 2, 3, 4], 2, 4),
     r"indices must be a \(total,\) = \(5,\) int64 tensor \(unpad_input's\); got list"),
    (lambda: flashtx.pad_input(randn(5, 2), torch.arange(4, device=DEVICE), 2, 4),
     r"indices must be a \(total,\) = \(5,\) int64 tensor .*got torch.int64 of shape \(4,\)"),
    (lambda: flashtx.pad_input(randn(5, 2), torch.arange(5, device=DEVICE), -1, 4),
     r"batch must be an int >= 0; got -1"),
    (lambda: flashtx.pad_input(randn(5, 2), torch.arange(5, device=DEVICE), 1, 4),
     r"hidden_states holds 5 tokens, more than batch \* seqlen = 1 \* 4 positions"),
    (lambda: flashtx.pad_input("x", torch.arange(5, device=DEVICE), 2, 4),
     r"hidden_states must be a \(total, ...\) tensor; got str"),
    # on CPU (its values are read there): a negative index counted from the end, silently (an edge-case fuzz)
    (lambda: flashtx.pad_input(torch.randn(3, 2), torch.tensor([0, 1, -1]), 2, 3),
     r"indices must lie in \[0, batch \* seqlen = 6\) \(unpad_input's positions\); got values in \[-1, 1\]"),
    (lambda: flashtx.pad_input(torch.randn(3, 2), torch.tensor([0, 1, 6]), 2, 3),
     r"indices must lie in \[0, batch \* seqlen = 6\) .*got values in \[0, 6\]"),
], ids=["indices-list", "indices-shape", "batch", "too-many", "states", "negative-index", "index-past-the-end"])
def test_pad_input_checks_its_arguments(call, pattern):
    with pytest.raises(ValueError, match=pattern):
        call()


def test_packed_forms_name_themselves_and_flags_are_checked():
    """An edge-case fuzz: the packed forms' unknown keywords were refused as flash_attn_func's ("got multiple values
    for argument 'k'"), and deterministic took any value unchecked (every other flag is a bool)."""
    qkv = randn(1, 5, 3, 2, 16)
    q, kv = randn(1, 5, 2, 16), randn(1, 5, 2, 2, 16)
    with pytest.raises(TypeError, match=r"^flash_attn_qkvpacked_func\(\) got an unexpected keyword argument 'foo'"):
        flashtx.flash_attn_qkvpacked_func(qkv, foo=1)
    with pytest.raises(TypeError, match=r"^flash_attn_kvpacked_func\(\) got an unexpected keyword argument 'k'"):
        flashtx.flash_attn_kvpacked_func(q, kv, k=1)
    cu = torch.tensor([0, 5], dtype=torch.int32, device=DEVICE)
    calls = [lambda d: flashtx.flash_attn_func(q, q, q, deterministic=d),
             lambda d: flashtx.flash_attn_qkvpacked_func(qkv, deterministic=d),
             lambda d: flashtx.flash_attn_varlen_func(q[0], q[0], q[0], cu, cu, 5, 5, deterministic=d),
             lambda d: flashtx.flash_attn_varlen_qkvpacked_func(qkv[0], cu, 5, deterministic=d),
             lambda d: flashtx.flash_attn_varlen_kvpacked_func(q[0], kv[0], cu, cu, 5, 5, deterministic=d)]
    for call in calls:
        with pytest.raises(TypeError, match="deterministic must be a bool; got str 'x'"):
            call("x")
        torch.testing.assert_close(call(True), call(False), atol=0, rtol=0)


def test_varlen_probs_with_tensor_max_seqlen_span_max_seqlen(monkeypatch):
    """return_attn_probs gives (nseq, Hq, max_seqlen_q, max_seqlen_k) with a 0-dim tensor max_seqlen too (it was
    (nseq, Hq, total, total)): the tensor is read there (a test path; the grids never read it)."""
    monkeypatch.setattr(flashtx.functional, "PROBS_WITHOUT_DROPOUT", True)  # (flash-attn's: none without dropout)
    q, k, v = (randn(10, 2, 16) for _ in range(3))
    cu = torch.tensor([0, 4, 10], dtype=torch.int32, device=DEVICE)
    m = torch.tensor(6, device=DEVICE)
    out, _, probs = flashtx.flash_attn_varlen_func(q, k, v, cu, cu, m, m, return_attn_probs=True)
    ref, _, ref_probs = flashtx.flash_attn_varlen_func(q, k, v, cu, cu, 6, 6, return_attn_probs=True)
    assert probs.shape == ref_probs.shape == (2, 2, 6, 6)
    torch.testing.assert_close(probs, ref_probs, atol=0, rtol=0)
    torch.testing.assert_close(out, ref, atol=0, rtol=0)
