"""Every kernel family under a GPU's concurrency, modelled in the interpreter (tests/program_order.py): each
launch's programs run forward, reversed and shuffled, and the bytes each program reads and writes are recorded.
A kernel passes when no two programs write the same bytes, no program reads bytes another writes, no program
reads back its own stores without a barrier, and the results are bit-identical in every order. The interpreter's
serial loop hides all of these; a GPU does not (a split-KV combine fused with its partials, an in-place op whose
tiles overlap, a reduction into a buffer by whichever program comes last).

The calls cover the launches users make: the attention forward and backward (causal GQA with and without the
dK/dV split over the group; a learned bias broadcast over heads, whose gradient each dQ program folds over (batch,
head); varlen with a window; dropout, ALiBi, softcap, a key mask and the probabilities), decoding (a paged cache with
rotary append, split-KV and its combine; a contiguous cache with cache_batch_idx and left padding; the few-query
lane), RoPE in place on q and k and its backward, varlen and position_ids RoPE, SwiGLU and packed SwiGLU with an
in-place backward, and the device-side index and cu_seqlens checks.
"""
import pytest
import torch
from conftest import DEVICE, ON_GPU
from program_order import ORDERS, program_order

import flashtx

pytestmark = pytest.mark.skipif(ON_GPU, reason="models a GPU's program order in Triton's interpreter (CPU tensors)")


def _randn(*shape, seed, grad=False, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype).to(DEVICE)
    return t.requires_grad_(grad)


def _attention_gqa_causal():
    q, k, v = _randn(2, 4, 33, 16, seed=1, grad=True), _randn(2, 2, 33, 16, seed=2, grad=True), \
        _randn(2, 2, 33, 16, seed=3, grad=True)
    out = flashtx.attention(q, k, v, is_causal=True, enable_gqa=True)
    return (out, *torch.autograd.grad(out, (q, k, v), _randn(*out.shape, seed=4)))


def _attention_learned_bias():
    """Learned biases broadcast over (batch, head), over queries and over keys: each dQ program folds the
    gradient of its (batch, head)s into one buffer (a tile, a partial row per q tile, row sums)."""
    q, k, v = (_randn(2, 3, 37, 16, seed=s, grad=True) for s in (5, 6, 7))
    res = []
    for i, shape in enumerate(((1, 1, 37, 37), (2, 1, 1, 37), (1, 3, 37, 1))):
        bias = _randn(*shape, seed=8 + i, grad=True)
        out = flashtx.attention(q, k, v, attn_mask=bias, is_causal=i == 1)
        res += [out, *torch.autograd.grad(out, (q, k, v, bias), _randn(*out.shape, seed=11 + i))]
    return res


def _varlen_window():
    cu = torch.tensor([0, 9, 30, 47], dtype=torch.int32, device=DEVICE)
    q, k, v = (_randn(47, 2, 16, seed=s, grad=True) for s in (10, 11, 12))
    out = flashtx.flash_attn_varlen_func(q, k, v, cu, cu, 21, 21, causal=True, window_size=(7, 0))
    return (out, *torch.autograd.grad(out, (q, k, v), _randn(*out.shape, seed=13)))


def _decode_paged_rotary_split():
    B, Hq, Hkv, D, page, per = 3, 4, 2, 16, 16, 5
    kc, vc = _randn(B * per + 2, page, Hkv, D, seed=14), _randn(B * per + 2, page, Hkv, D, seed=15)
    bt = torch.randperm(B * per + 2, generator=torch.Generator().manual_seed(16))[:B * per].view(B, per)
    lens = torch.tensor([40, 7, 70], dtype=torch.int32, device=DEVICE)
    ang = torch.arange(80)[:, None].double() * torch.rand(1, D // 4, dtype=torch.float64,
                                                          generator=torch.Generator().manual_seed(17))
    q, k, v = _randn(B, 2, Hq, D, seed=18), _randn(B, 2, Hkv, D, seed=19), _randn(B, 2, Hkv, D, seed=20)
    out, lse = flashtx.flash_attn_with_kvcache(
        q, kc, vc, k, v, rotary_cos=ang.cos().float().to(DEVICE), rotary_sin=ang.sin().float().to(DEVICE),
        cache_seqlens=lens, block_table=bt.to(torch.int32).to(DEVICE), causal=True, num_splits=3,
        return_softmax_lse=True)
    return out, lse, kc, vc


def _few_query_lane():
    q, k, v = _randn(2, 4, 1, 16, seed=21), _randn(2, 2, 45, 16, seed=22), _randn(2, 2, 45, 16, seed=23)
    with torch.no_grad():
        return tuple(flashtx.attention(q, k, v, enable_gqa=True) for _ in range(3))  # the lane fires from call 2


def _rope_inplace():
    q, k = _randn(2, 11, 4, 32, seed=24), _randn(2, 11, 2, 32, seed=25)
    ang = torch.arange(11)[:, None].double() * torch.rand(1, 12, dtype=torch.float64,
                                                          generator=torch.Generator().manual_seed(26))
    cos, sin = ang.cos().float().to(DEVICE), ang.sin().float().to(DEVICE)  # rotary dim 24 of 32
    fq, fk = flashtx.apply_rotary_qk(q, k, cos, sin, inplace=True)
    qg, kg = _randn(2, 11, 4, 32, seed=27, grad=True), _randn(2, 11, 2, 32, seed=28, grad=True)
    rq, rk = flashtx.apply_rotary_qk(qg, kg, cos, sin, interleaved=True)
    return (fq, fk, rq, rk, *torch.autograd.grad((rq, rk), (qg, kg), (_randn(*rq.shape, seed=29),
                                                                      _randn(*rk.shape, seed=30))))


def _swiglu_inplace_backward():
    g0, u0 = _randn(5, 3, 200, seed=31, grad=True), _randn(5, 3, 200, seed=32, grad=True)
    gate, up = g0 * 1.0, u0 * 1.0  # non-leaves: the backward writes the gradients into them
    out = flashtx.swiglu(gate, up, inplace_backward=True)
    return (out, *torch.autograd.grad(out, (g0, u0), _randn(*out.shape, seed=33)))


def _attention_modifiers():
    """Dropout (its keep mask is a function of the position: order-free), ALiBi, softcap, a key mask and a window,
    forward and backward, and the probabilities flash_attn_func returns for tests."""
    q, k, v = (_randn(2, 29, 4, 16, seed=s, grad=True) for s in (34, 35, 36))
    keep = torch.rand(2, 29, generator=torch.Generator().manual_seed(37)) > 0.2
    slopes = torch.rand(4, generator=torch.Generator().manual_seed(38)).to(DEVICE)
    torch.manual_seed(39)
    out = flashtx.flash_attn_func(q, k, v, dropout_p=0.25, causal=True, window_size=(9, 0), softcap=3.0,
                                  alibi_slopes=slopes, key_mask=keep.to(DEVICE))
    grads = torch.autograd.grad(out, (q, k, v), _randn(*out.shape, seed=40))
    with torch.no_grad():
        flashtx.functional.PROBS_WITHOUT_DROPOUT = True  # (flash-attn's: none without dropout)
        try:
            probs = flashtx.flash_attn_func(q, k, v, causal=True, softcap=3.0, return_attn_probs=True)
        finally:
            flashtx.functional.PROBS_WITHOUT_DROPOUT = False
    return (out, *grads, *probs)


def _swiglu_packed():
    x0 = _randn(7, 2 * 150, seed=41, grad=True)
    x = x0 * 1.0
    out = flashtx.swiglu_packed(x, inplace_backward=True)
    return (out, *torch.autograd.grad(out, (x0,), _randn(*out.shape, seed=42)))


def _rope_varlen_positions():
    x = _randn(23, 3, 16, seed=43)  # packed (total, H, D) rows of sequences 5, 11, 7
    cu = torch.tensor([0, 5, 16, 23], dtype=torch.int32, device=DEVICE)
    ang = torch.arange(40)[:, None].double() * torch.rand(1, 8, dtype=torch.float64,
                                                          generator=torch.Generator().manual_seed(44))
    cos, sin = ang.cos().float().to(DEVICE), ang.sin().float().to(DEVICE)
    a = flashtx.apply_rotary(x, cos, sin, cu_seqlens=cu, max_seqlen=11, seqlen_offsets=3)
    y = _randn(2, 9, 3, 16, seed=45)
    pos = torch.randint(0, 40, (2, 9), generator=torch.Generator().manual_seed(46)).to(DEVICE)
    return a, flashtx.apply_rotary(y, cos, sin, position_ids=pos, interleaved=True)


def _decode_contiguous_batch_idx():
    kc, vc = _randn(5, 60, 2, 16, seed=47), _randn(5, 60, 2, 16, seed=48)
    q, k, v = _randn(3, 1, 4, 16, seed=49), _randn(3, 1, 2, 16, seed=50), _randn(3, 1, 2, 16, seed=51)
    out, lse = flashtx.flash_attn_with_kvcache(
        q, kc, vc, k, v, cache_seqlens=torch.tensor([30, 3, 58], dtype=torch.int32, device=DEVICE),
        cache_batch_idx=torch.tensor([4, 0, 2], dtype=torch.int32, device=DEVICE),
        cache_leftpad=torch.tensor([2, 0, 5], dtype=torch.int32, device=DEVICE), softcap=5.0, window_size=(20, 0),
        num_splits=0, return_softmax_lse=True)
    return out, lse, kc, vc


def _device_checks(monkeypatch):
    """The GPU's device-side checks of cu_seqlens and of the decode indices (one-program kernels), not the CPU's
    host reads."""
    import flashtx._validate as validate
    from flashtx import decode

    monkeypatch.setattr(validate, "_values_readable", lambda t: False)
    monkeypatch.setattr(decode, "_values_readable", lambda t: False)


def _gqa_split(monkeypatch):
    """dK/dV with one program per q head into partials, summed afterwards (automatic only where the grid is
    small on a GPU, and off by default until a GPU run): forced here."""
    from flashtx.triton_kernels import attention_bwd_launch
    from flashtx.triton_kernels.launch import LAUNCHES

    LAUNCHES.clear()  # an earlier test's plan for these shapes (lanes included) would replay without the split
    monkeypatch.setattr(attention_bwd_launch, "gqa_split_factor",
                        lambda q, k, v, spec, split, *a: q.shape[1] // k.shape[1])
    reduced = []
    run = attention_bwd_launch.GqaReduce.run
    monkeypatch.setattr(attention_bwd_launch.GqaReduce, "run", lambda self: reduced.append(1) or run(self))
    return lambda: reduced  # the partials were summed: the split ran


# name: (call, set-up, the kernels it must launch)
CALLS = {
    "attention-gqa-causal": (_attention_gqa_causal, None, {"_attn_fwd", "_attn_bwd_preprocess", "_attn_bwd_dkdv",
                                                           "_attn_bwd_dq"}),
    "attention-gqa-split": (_attention_gqa_causal, _gqa_split, {"_attn_bwd_dkdv", "_attn_bwd_dq"}),
    "attention-learned-bias": (_attention_learned_bias, None, {"_attn_fwd", "_attn_bwd_dq"}),
    "varlen-window": (_varlen_window, _device_checks, {"_cu_seqlens_check", "_attn_fwd", "_attn_bwd_dkdv"}),
    "decode-paged-rotary-split": (_decode_paged_rotary_split, _device_checks, {"_decode_check", "_kv_append",
                                                                               "_decode_fwd", "_decode_combine"}),
    "decode-contiguous-batch-idx": (_decode_contiguous_batch_idx, _device_checks, {"_decode_check", "_kv_append",
                                                                                   "_decode_fwd"}),
    "attention-modifiers": (_attention_modifiers, None, {"_attn_fwd", "_attn_bwd_dkdv", "_attn_bwd_dq",
                                                         "_attn_probs"}),
    "few-query-lane": (_few_query_lane, None, {"_decode_fwd"}),
    "rope-varlen-positions": (_rope_varlen_positions, _device_checks, {"_cu_seqlens_check", "_rotary_kernel"}),
    "swiglu-packed": (_swiglu_packed, None, {"_swiglu_kernel"}),
    "rope-inplace": (_rope_inplace, None, {"_rotary_kernel"}),
    "swiglu-inplace-backward": (_swiglu_inplace_backward, None, {"_swiglu_kernel"}),
}


@pytest.mark.parametrize("call", list(CALLS))
def test_no_kernel_depends_on_program_order(call, monkeypatch):
    fn, setup, kernels = CALLS[call]
    verify = setup(monkeypatch) if setup is not None else None
    results = {}
    for order in ORDERS:
        with program_order(order, seed=3) as findings:
            out = fn()
        launched = set(findings.launched)
        assert kernels <= launched, f"{call}: launched {sorted(launched)}, not all of {sorted(kernels)}"
        assert not findings, f"{order}: " + "; ".join(dict.fromkeys(findings))
        assert verify is None or verify(), f"{call}: the path it sets up did not run"
        results[order] = [t.detach().cpu() for t in out]
    if setup is not None:  # no plan made under the set-up outlives it
        from flashtx.triton_kernels.launch import LAUNCHES
        LAUNCHES.clear()
    for order in ORDERS[1:]:
        for i, (a, b) in enumerate(zip(results["forward"], results[order])):
            assert torch.equal(a.nan_to_num(), b.nan_to_num()), f"{call}: output {i} differs when run {order}"


def test_the_model_sees_order_races_and_missing_barriers():
    """The checker itself: a kernel whose programs all write one cell, one that reads its neighbour's output, and
    one that reads back its own store without a barrier are each caught (and reversing the neighbour-reader changes
    its result); with tl.debug_barrier before the read-back it passes."""
    import triton
    import triton.language as tl

    @triton.jit
    def _kernels(X, Y, MODE: tl.constexpr, BARRIER: tl.constexpr):
        i = tl.program_id(0)
        offs = tl.arange(0, 4)
        if MODE == 0:  # every program writes Y[0]
            tl.store(Y + offs * 0, tl.load(X + i * 4 + offs), mask=offs == 0)
        elif MODE == 1:  # program i reads what program i - 1 wrote
            prev = tl.load(Y + i * 4 - 4 + offs, mask=(offs * 0 + i) > 0, other=0.0)
            tl.store(Y + i * 4 + offs, prev + tl.load(X + i * 4 + offs))
        else:  # a read-back of this program's own store, through another index (other threads on a GPU)
            tl.store(Y + i * 4 + offs, tl.load(X + i * 4 + offs))
            if BARRIER:
                tl.debug_barrier()
            tl.store(Y + i * 4 + offs, tl.load(Y + i * 4 + 3 - offs) * 2)

    x = torch.arange(16, dtype=torch.float32, device=DEVICE)
    seen = {}
    for mode, barrier in ((0, False), (1, False), (2, False), (2, True)):
        for order in ("forward", "reverse"):
            y = torch.zeros(16, device=DEVICE)
            with program_order(order) as findings:
                _kernels[(4,)](x, y, MODE=mode, BARRIER=barrier)
            seen[(mode, barrier, order)] = (list(findings), y.clone())
    assert "written by two programs" in " ".join(seen[(0, False, "forward")][0])
    assert "read by one program and written by another" in " ".join(seen[(1, False, "reverse")][0])
    assert not torch.equal(seen[(1, False, "forward")][1], seen[(1, False, "reverse")][1])
    assert "no barrier in between" in " ".join(seen[(2, False, "forward")][0])
    assert not seen[(2, True, "forward")][0] and not seen[(2, True, "reverse")][0]
