"""Varlen (packed sequences) through the attention kernels: each sequence of a packed batch against the
same sequence alone and against the float64 reference (outputs and gradients, under the tolerance rule of
conftest.assert_close_to_reference), max_seqlen bounds, unpad/pad (bert_padding's), and torch.compile with
tensor max_seqlen. Split from test_attention_masks.py (windows, padding masks, lengths).
"""
import warnings

import pytest
import torch
from conftest import (DEVICE, KERNEL_DTYPES, ON_GPU, assert_close_to_reference, dtype_id,
                      poisoned_allocations, randn, to64, to_dtype)

import flashtx
from flashtx import reference
from flashtx.triton_kernels.launch import stub_launches

# ----------------------------------------------------------------------------------------------
# Varlen
# ----------------------------------------------------------------------------------------------
def packed(lens_q, lens_k, hq=4, hkv=2, d=32, dtype=torch.float32):
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    q = randn(int(cu_q[-1]), hq, d, dtype=dtype, requires_grad=True)
    k = randn(int(cu_k[-1]), hkv, d, dtype=dtype, requires_grad=True)
    v = randn(int(cu_k[-1]), hkv, d, dtype=dtype, requires_grad=True)
    return q, k, v, cu_q, cu_k


VARLEN_CASES = [
    ("self-causal", [50, 1, 97, 20], [50, 1, 97, 20], True, (-1, -1)),
    ("cross-gqa", [13, 70, 0, 33], [90, 7, 12, 40], False, (-1, -1)),
    ("cross-causal-window", [70, 30, 5], [40, 100, 5], True, (25, -1)),
    ("window-both", [64, 100], [80, 100], False, (10, 10)),
]


def _seq_attention(q, k, v, vis):
    """reference.attention on one sequence in the varlen layout (S, H, D), vis (Sq, Sk)."""
    return reference.attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                               vis=vis[None])[0].transpose(0, 1)


def _cancelling(q, k, v, do, vis) -> dict:
    """test_attention.cancelling for one sequence in the varlen layout (S, H, D) (float64) with visibility vis
    (Sq, Sk): {"dq": (rows, magnitude), "dk": (keys, magnitude)}, the query rows that see exactly one key (their dq
    is ~0 through cancellation: dS = P * (dP - delta) with P = 1, O = V_j) and the keys only such rows see, with
    the magnitude of the cancelling terms there for their ulp floor."""
    q, k, v, do = (t.detach().transpose(0, 1) for t in (q, k, v, do))  # (H, S, D)
    k, v = (t.repeat_interleave(q.shape[0] // k.shape[0], dim=0) for t in (k, v))
    rows = vis.sum(-1) == 1
    keys = vis.any(0) & ~(vis & ~rows[:, None]).any(0)
    sm_scale = q.shape[-1] ** -0.5
    dp_terms = (do.abs() @ v.abs().transpose(-1, -2)).masked_fill(~(vis & rows[:, None]), 0.0)  # (H, Sq, Sk)
    dq_mag = sm_scale * float((dp_terms * k.abs().amax(-1)[:, None, :]).max()) if rows.any() else 0.0
    dk_mag = sm_scale * float((dp_terms * q.abs().amax(-1)[:, :, None]).max()) if keys.any() else 0.0
    return {"dq": (rows, dq_mag), "dk": (keys, dk_mag)}


def _check_seq_grad(name, g, r, e, cancel=None):
    """assert_close_to_reference for a gradient (S, H, D), its floor at its own magnitude; the positions in cancel
    = (an (S,) bool, magnitude) checked apart with the floor at that magnitude (see _cancelling)."""
    if cancel is None or not cancel[0].any():
        assert_close_to_reference(name, g, r, e, grad=True)
        return
    sel, magnitude = cancel
    assert_close_to_reference(f"{name} where it cancels", g[sel], r[sel], e[sel], grad=True, scale=magnitude)
    if not sel.all():
        assert_close_to_reference(name, g[~sel], r[~sel], e[~sel], grad=True)


@pytest.mark.parametrize("name,lq,lk,causal,window", VARLEN_CASES, ids=[c[0] for c in VARLEN_CASES])
def test_varlen_equals_each_sequence_alone(name, lq, lk, causal, window):
    torch.manual_seed(sum(map(ord, name)))
    dtype = KERNEL_DTYPES[0]
    q, k, v, cu_q, cu_k = packed(lq, lk, dtype=dtype)
    with poisoned_allocations():
        out = flashtx.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lq), max(lk), causal=causal,
                                             window_size=window, backend="triton")
        do = randn(*out.shape, dtype=dtype)
        grads = torch.autograd.grad(out, (q, k, v), do)
    assert out.shape == (sum(lq), 4, 32)
    for b in range(len(lq)):
        qs, ks = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        if lq[b] == 0:
            continue
        qb, kb, vb = (t[s].detach().clone().requires_grad_(True) for t, s in ((q, qs), (k, ks), (v, ks)))
        ob = flashtx.flash_attn_func(qb[None], kb[None], vb[None], causal=causal, window_size=window,
                                     backend="triton")[0]
        gb = torch.autograd.grad(ob, (qb, kb, vb), do[qs])
        # the packed call's slice and the call on the sequence alone, each against the sequence's float64
        # reference under the rule
        vis = reference.visibility(lq[b], lk[b], causal=causal, bottom_right=True, window=window, device=DEVICE)[0]
        q64, k64, v64 = to64(qb, kb, vb)
        r = _seq_attention(q64, k64, v64, vis)
        rg = torch.autograd.grad(r, (q64, k64, v64), do[qs].to(torch.float64))
        qe, ke, ve = to_dtype(dtype, qb, kb, vb)
        e = _seq_attention(qe, ke, ve, vis)
        eg = torch.autograd.grad(e, (qe, ke, ve), do[qs])
        # and the two agree with each other (in fp16 more closely than the rule's bound): the same kernel on the same
        # rows and tiles is bitwise equal in the interpreter (seen); a GPU may tile the packed call otherwise, equal
        # up to the order of fp32 accumulation
        tol = dict(atol=1e-6, rtol=0) if dtype == torch.float32 else dict(atol=2e-3, rtol=2e-3)
        for g, gs in zip((out[qs], *(g[s] for g, s in zip(grads, (qs, ks, ks)))), (ob, *gb)):
            assert torch.allclose(g.float(), gs.float(), **tol) if ON_GPU else torch.equal(g, gs), name
        cancel = _cancelling(q64, k64, v64, do[qs].to(torch.float64), vis)
        for tag, o, gs in (("varlen", out[qs], [g[s] for g, s in zip(grads, (qs, ks, ks))]), ("alone", ob, gb)):
            assert_close_to_reference(f"{name} seq {b} {tag} out", o, r, e)
            for gname, g, r_, e_ in zip(("dq", "dk", "dv"), gs, rg, eg):
                _check_seq_grad(f"{name} seq {b} {tag} {gname}", g, r_, e_, cancel.get(gname))


def test_varlen_max_seqlen_beyond_the_total_is_clamped():
    """max_seqlen is an upper bound (flash-attn): 2**40 runs the same grid as the total length (issue
    17.7: the interpreter tried 2**34 programs; CUDA would fail the launch), with the same result."""
    torch.manual_seed(3)
    q, k, v, cu_q, cu_k = packed([5, 9, 2], [7, 3, 8], dtype=KERNEL_DTYPES[0])
    grids = []
    with stub_launches(lambda kernel, grid, args: grids.append(grid)):
        flashtx.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 2**40, 2**40, causal=True, backend="triton")
    assert grids and max(g[0] for g in grids) <= 16  # q tiles over at most total_q = 16 rows
    want = flashtx.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 9, 8, causal=True, backend="triton")
    got = flashtx.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 2**40, 2**40, causal=True, backend="triton")
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=dtype_id)
def test_varlen_matches_reference(dtype):
    torch.manual_seed(14)
    lq, lk = [30, 0, 77, 9], [45, 12, 60, 9]
    q, k, v, cu_q, cu_k = packed(lq, lk, dtype=dtype)
    with poisoned_allocations():
        out = flashtx.flash_attn_varlen_func(q, k, v, cu_q, cu_k, torch.tensor(77), torch.tensor(60), causal=True,
                                             window_size=(20, -1), backend="triton")
        do = randn(*out.shape, dtype=dtype)
        grads = torch.autograd.grad(out, (q, k, v), do)
    vis = reference.varlen_visibility(cu_q, cu_k, sum(lq), sum(lk), causal=True, window=(20, -1), device=DEVICE)

    def ref(q, k, v):
        return reference.attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                   vis=vis)[0].transpose(0, 1)

    q64, k64, v64 = to64(q, k, v)
    r = ref(q64, k64, v64)
    rg = torch.autograd.grad(r, (q64, k64, v64), do.to(torch.float64))
    qe, ke, ve = to_dtype(dtype, q, k, v)
    e = ref(qe, ke, ve)
    eg = torch.autograd.grad(e, (qe, ke, ve), do)
    assert_close_to_reference("out", out, r, e)
    scale = max(float(g.abs().max()) for g in rg)
    for name, g, r_, e_ in zip(("dq", "dk", "dv"), grads, rg, eg):
        assert_close_to_reference(name, g, r_, e_, grad=True, scale=scale)


def test_unpad_pad_round_trip_and_padded_equals_varlen():
    """unpad_input -> flash_attn_varlen_func -> pad_input equals the padded call with masks
    (left padding here, which lengths cannot express)."""
    torch.manual_seed(15)
    dtype = KERNEL_DTYPES[0]
    B, S, H, D = 3, 37, 2, 16
    x = randn(B, S, H, D, dtype=dtype, requires_grad=True)
    mask = torch.arange(S, device=DEVICE)[None, :] >= torch.tensor([0, 10, 30], device=DEVICE)[:, None]
    xu, idx, cu, max_len, seqlens = flashtx.unpad_input(x, mask)
    assert xu.shape == (int(mask.sum()), H, D) and cu.dtype == torch.int32 and max_len == 37
    assert seqlens.tolist() == [37, 27, 7] and cu.tolist() == [0, 37, 64, 71]
    back = flashtx.pad_input(xu, idx, B, S)
    assert torch.equal(back, torch.where(mask[..., None, None], x, 0))
    (g,) = torch.autograd.grad(back.float().sum(), (x,))
    assert torch.equal(g, mask[..., None, None].expand_as(g).to(g.dtype))

    q, k, v = (randn(B, S, H, D, dtype=dtype) for _ in range(3))
    qu, ku, vu = (flashtx.unpad_input(t, mask)[0] for t in (q, k, v))
    packed_out = flashtx.flash_attn_varlen_func(qu, ku, vu, cu, cu, max_len, max_len, causal=True, backend="triton")
    padded = flashtx.flash_attn_func(q, k, v, causal=True, key_mask=mask, query_mask=mask, backend="triton")
    # left padding: bottom-right alignment of the padded call is the packed call's alignment; both against the
    # float64 reference of the padded batch under the rule (padding rows see no key: 0 in all three)
    vis = reference.visibility(S, S, batch=B, causal=True, bottom_right=True, key_mask=mask, query_mask=mask,
                               device=DEVICE)

    def ref(q, k, v):
        return reference.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), vis=vis).transpose(1, 2)

    r, e = ref(*to64(q, k, v)), ref(q, k, v)
    assert_close_to_reference("padded", padded, r, e)
    assert_close_to_reference("packed", flashtx.pad_input(packed_out, idx, B, S), r, e)
    # and the two agree to ~1 fp16 ulp (seen: the left-padded call's tiles start elsewhere, so fp32 accumulation order
    # differs): tighter than the rule's fp16 bound (~1e-2 here)
    assert torch.allclose(flashtx.pad_input(packed_out, idx, B, S).float(), padded.float(), atol=2e-3)


def test_unpad_input_reads_any_nonzero_as_real_and_checks_the_mask_shape():
    x = randn(2, 4, 3)
    xu, idx, cu, max_len, seqlens = flashtx.unpad_input(x, torch.tensor([[0, 2, 1, 1], [1, -1, 1, 0]], device=DEVICE))
    assert seqlens.tolist() == [3, 3] and cu.tolist() == [0, 3, 6] and max_len == 3  # counts agree with the rows
    assert idx.tolist() == [1, 2, 3, 4, 5, 6] and torch.equal(xu, x.reshape(8, 3)[idx])
    with pytest.raises(ValueError, match=r"attention_mask must be a \(B, S\) = \(2, 4\) tensor .*got \(2, 3\)"):
        flashtx.unpad_input(x, torch.ones(2, 3, dtype=torch.bool, device=DEVICE))


def test_varlen_traces_under_torch_compile_with_tensor_max_seqlen():
    import torch._dynamo

    torch.manual_seed(16)
    q, k, v, cu_q, cu_k = packed([9, 20], [9, 20], dtype=torch.float32)

    def fn(q, k, v, cu_q, cu_k, max_len):
        return flashtx.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_len, max_len, causal=True).sum()

    torch._dynamo.reset()
    explanation = torch._dynamo.explain(fn)(q, k, v, cu_q, cu_k, torch.tensor(20))
    assert explanation.graph_break_count == 0
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    loss = compiled(q, k, v, cu_q, cu_k, torch.tensor(20))
    (gq,) = torch.autograd.grad(loss, (q,))
    eager = fn(q, k, v, cu_q, cu_k, 20)
    (gq2,) = torch.autograd.grad(eager, (q,))
    assert torch.allclose(loss, eager) and torch.allclose(gq, gq2)




@pytest.mark.parametrize("option", ["dropout", "alibi", "probs"])
def test_varlen_general_path_backward_copies_no_gradient(option):
    """A varlen call off the lane (dropout, ALiBi, probabilities) hands back the op's (1, total, H, D) output
    squeezed, a view both ways: indexing it ([0]) made autograd write dout into a zero-filled (1, total, H, D)
    copy (select's backward) on every backward."""
    torch.manual_seed(4)
    cu = torch.tensor([0, 5, 16], dtype=torch.int32, device=DEVICE)
    q, k, v = (randn(16, 2, 16, requires_grad=True) for _ in range(3))
    kw = {"dropout": dict(dropout_p=0.25), "alibi": dict(alibi_slopes=torch.rand(2, device=DEVICE)),
          "probs": dict(return_attn_probs=True)}[option]
    res = flashtx.flash_attn_varlen_func(q, k, v, cu, cu, 11, 11, causal=True, **kw)
    out = res[0] if option == "probs" else res
    assert out.shape == (16, 2, 16) and out.grad_fn.name() == "SqueezeBackward1"
    with torch.autograd.profiler.profile() as prof:
        out.backward(randn(16, 2, 16))
    assert not {e.name for e in prof.function_events} & {"aten::select_backward", "aten::zeros"}
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


def _full_checks_pass(q, k, v) -> bool:
    """What flash_attn_varlen_func checks of q, k, v when packed_qkv_ok declines: check_tensor, the 3-D rule and
    check_qkv on the (1, H, total, D) views. True where none raises."""
    from flashtx._validate import check_qkv, check_tensor

    try:
        for n, t in (("q", q), ("k", k), ("v", v)):
            check_tensor(n, t)
            if t.dim() != 3:
                return False
        check_qkv(("q", "k", "v"), *(t.transpose(0, 1)[None] for t in (q, k, v)), "(total, H, D)", allow_gqa=True)
    except (TypeError, ValueError):
        return False
    return True


def test_the_common_case_check_accepts_exactly_what_the_full_checks_accept():
    """packed_qkv_ok, the varlen call's checks in ints and bools, answers True exactly where the checks that name
    what is wrong pass: over totals, heads (GQA, MQA, a non-multiple, 0), head dims (Dv != D, 0), ranks, dtypes,
    devices' dtypes mixed, lazily negated views, non-tensors and Parameters (subclasses: the full path)."""
    from flashtx._validate import packed_qkv_ok

    def t(shape, dtype=torch.float32):
        return torch.zeros(shape, dtype=dtype)

    neg = torch.zeros(6, 2, 8, dtype=torch.complex64).conj().imag  # (its negative bit set)
    with warnings.catch_warnings():  # (torch's "prototype stage" warning)
        warnings.simplefilter("ignore")
        nested = torch.nested.nested_tensor([t((2, 8)), t((3, 8))])  # (2, j, 8)
    cases = [(t((6, 2, 8)), t((9, 2, 8)), t((9, 2, 16))), (t((6, 4, 8)), t((9, 2, 8)), t((9, 2, 8))),
             (t((6, 4, 8)), t((9, 1, 8)), t((9, 1, 8))), (t((6, 3, 8)), t((9, 2, 8)), t((9, 2, 8))),
             (t((6, 2, 8)), t((9, 0, 8)), t((9, 0, 8))), (t((6, 0, 8)), t((9, 2, 8)), t((9, 2, 8))),
             (t((6, 2, 8)), t((9, 2, 8)), t((8, 2, 8))), (t((6, 2, 8)), t((9, 2, 4)), t((9, 2, 8))),
             (t((6, 2, 8)), t((9, 3, 8)), t((9, 2, 8))), (t((6, 2, 0)), t((9, 2, 0)), t((9, 2, 8))),
             (t((6, 2, 8)), t((9, 2, 8)), t((9, 2, 0))), (t((0, 2, 8)), t((0, 2, 8)), t((0, 2, 8))),
             (t((1, 6, 2, 8)), t((9, 2, 8)), t((9, 2, 8))), (t((6, 2, 8)), t((9, 2)), t((9, 2, 8))),
             (t((6, 2, 8), torch.int32), t((9, 2, 8)), t((9, 2, 8))),
             (t((6, 2, 8), torch.float16), t((9, 2, 8)), t((9, 2, 8))),
             (t((6, 2, 8), torch.float16),) * 3, (t((6, 2, 8), torch.float64),) * 3, (t((6, 2, 8), torch.int32),) * 3,
             (t((6, 6, 8)), t((9, 3, 8)), t((9, 2, 8))), (t((6, 2, 8, 5)), t((9, 2, 8)), t((9, 2, 8))),
             (nested, t((9, 2, 8)), t((9, 2, 8))),
             (neg, t((6, 2, 8)), t((6, 2, 8))), (t((6, 2, 8)), neg, t((6, 2, 8))),
             (t((6, 2, 8)), t((6, 2, 8)), neg), (t((6, 2, 8)), t((9, 2, 8)).transpose(0, 1).contiguous()
                                                 .transpose(0, 1), t((9, 2, 8))[:, :, :]),
             (torch.nn.Parameter(t((6, 2, 8))), t((9, 2, 8)), t((9, 2, 8))), ([[0.0]], t((9, 2, 8)), t((9, 2, 8)))]
    decided = 0
    for q, k, v in cases:
        fast = packed_qkv_ok(q, k, v)
        full = _full_checks_pass(q, k, v)
        if fast:
            assert full, f"packed_qkv_ok took a call the full checks refuse: {[x.shape for x in (q, k, v)]}"
        elif type(q) is torch.Tensor and type(k) is torch.Tensor and type(v) is torch.Tensor:
            assert not full, f"packed_qkv_ok declined plain tensors the full checks pass: " \
                             f"{[(x.shape, x.dtype) for x in (q, k, v)]}"
        decided += fast
    assert 0 < decided < len(cases)  # both answers were given
