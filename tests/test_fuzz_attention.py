"""Attention (varlen and dropout too) in a fixed-seed sample of a randomized campaign over every op family
(tests/test_fuzz_ops.py holds decoding, RoPE and SwiGLU), each case a random combination of
options far wider than one test's parameter grid: odd sizes (1, 3, 17, 33, 65, 129), head dims 1..256 incl.
non-powers of two, GQA ratios, Sq != Sk both ways, both causal alignments, windows, key/query masks and
lengths (out-of-range lengths too: clamped), bias with broadcast dims and gradient, softcap, ALiBi,
non-contiguous inputs (permuted, sliced with a storage offset, stepped, expanded); inference calls (no
autograd, few queries: the decode kernels' route); varlen with empty sequences; dropout checked against its own
returned probabilities.

Every case runs under conftest's bounds checker (no masked-in access outside the kernels' tensor arguments),
in PRECISE_DTYPE against the float64 references (flashtx.reference, or an independent formula), at ~1e-10
relative to the result's magnitude, gradients included, and checks that no input was modified. The case
generator is seeded by the test id, so a failing id reproduces alone.
"""
import math
import random

import pytest
import torch
from conftest import DEVICE, PRECISE_DTYPE
from fuzz_cases import (DIMS, F64, SEQS, TOL, assert_unchanged, check, grads, layout_view, snapshot,
                        zeros_if_none)

import flashtx
from flashtx import _dispatch, reference
from flashtx.triton_kernels import attention_bwd_launch, launch


@pytest.fixture
def kernel_paths(monkeypatch):
    """set(split_head_dims, gqa_split): turn the off-by-default split paths on for one case (gqa_split forces
    the dK/dV GQA split, which the interpreter's unknown SM count never picks by itself)."""
    orig = attention_bwd_launch.gqa_split_factor

    def set_paths(split_head_dims=False, gqa_split=False):
        monkeypatch.setattr(launch, "SPLIT_HEAD_DIMS", bool(split_head_dims))
        if gqa_split:
            monkeypatch.setattr(attention_bwd_launch, "gqa_split_factor",
                                lambda q, k, v, spec, g, *a: orig(q, k, v, spec, True if g is None else g, *a))
        _dispatch.clear_plans()

    yield set_paths
    _dispatch.clear_plans()


# ------------------------------------------------------------------------------------------ attention
def attention_case(rng):
    p = dict(shell=rng.choice(["sdpa", "flash"]), B=rng.choice([1, 2, 3]), Hkv=rng.choice([1, 2, 3]),
             group=rng.choice([1, 2, 3, 4]), Sq=rng.choice(SEQS), Sk=rng.choice(SEQS), D=rng.choice(DIMS))
    p["Dv"] = p["D"] if rng.random() < 0.6 else rng.choice(DIMS)
    while p["B"] * p["Hkv"] * p["group"] * p["Sq"] * p["Sk"] * (p["D"] + p["Dv"]) > 150_000:
        for key, floor in (("B", 1), ("group", 1), ("Hkv", 1)):
            if p[key] > floor:
                p[key] -= 1
                break
        else:
            p["Sq"], p["Sk"], p["D"], p["Dv"] = min(p["Sq"], 33), min(p["Sk"], 33), min(p["D"], 64), min(p["Dv"], 64)
    p["layouts"] = [rng.choice(["contig", "perm", "slice", "step", "expand"]) for _ in range(3)]
    p["packed"] = p["shell"] == "flash" and rng.random() < 0.2
    p["requires_grad"] = [rng.random() < 0.8 for _ in range(3)]
    p["causal"] = rng.random() < 0.4
    p["window"] = (-1, -1) if rng.random() < 0.6 else (rng.choice([-1, 0, 1, 3, 17]), rng.choice([-1, 0, 2, 17]))
    p["key_mask"], p["query_mask"] = rng.random() < 0.25, rng.random() < 0.2
    p["kv_lens"], p["q_lens"], p["lens_out_of_range"] = rng.random() < 0.25, rng.random() < 0.2, rng.random() < 0.3
    p["mask"] = rng.choice([None, None, "bool", "float", "float"])
    p["mask_full"] = [rng.random() < 0.5 for _ in range(4)]
    p["mask_rank"], p["mask_grad"], p["mask_neg_inf"] = rng.choice([2, 3, 4]), rng.random() < 0.6, rng.random() < 0.3
    p["softcap"] = 0.0 if rng.random() < 0.75 else rng.choice([0.5, 5.0, 30.0])
    p["alibi"] = rng.choice([None, None, None, "h", "bh"])
    p["scale"] = rng.choice([None, None, None, 0.0, 0.3, -0.2])
    p["return_lse"] = rng.random() < 0.4
    p["loss"] = rng.choice(["dense", "dense", "sum", "strided", "lse_only"])
    p["split_head_dims"], p["gqa_split"] = rng.random() < 0.2, rng.random() < 0.2
    return p


ATTENTION_SEEDS = [1003, 1009, 1016, 1024, 1031, 1042, 1050, 1066, 1078, 1090, 1111, 1123, 1207, 1301, 1402, 1433,
                   1458, 1507, 1561, 1599]


def inference_case(rng):
    """attention_case without autograd and with at most 16 queries (decoding: flashtx._small_q routes these calls
    to the split-KV decode kernels when they qualify), query masks and lengths rarer, layouts mostly routable."""
    p = attention_case(rng)
    p["requires_grad"], p["mask_grad"], p["packed"] = [False] * 3, False, False
    p["split_head_dims"] = p["gqa_split"] = False
    p["Sq"] = rng.choice([1, 1, 2, 3, 5, 16])
    for key in ("query_mask", "q_lens", "kv_lens"):
        p[key] = p[key] and rng.random() < 0.3
    if p["mask"] == "bool" and rng.random() < 0.7:
        p["mask_full"][1] = p["mask_full"][2] = False  # (B | 1, 1, 1, Sk | 1): a key mask
    if rng.random() < 0.7:
        p["layouts"] = [rng.choice(["contig", "slice", "expand"]) for _ in range(3)]
    return p


@pytest.mark.parametrize("seed", ATTENTION_SEEDS)
def test_attention_random_combination(seed, kernel_paths):
    _attention_combination(seed, kernel_paths, attention_case)


INFERENCE_SEEDS = [5008, 5011, 5025, 5033, 5034, 5044, 5051, 5003, 5020, 5032, 5047, 5069]  # the first 7 route


def test_inference_seeds_take_the_decode_kernels(routes):
    """Guard on INFERENCE_SEEDS: the first 7 run the decode kernels and the last 5 the training forward, so that
    the sample tests both (a routing change that moves them: pick seeds again, e.g. by printing `counts`)."""
    counts = []
    for seed in INFERENCE_SEEDS:
        routes.clear()
        with torch.no_grad():
            _attention_combination(seed, lambda *a: None, inference_case)
        counts.append(routes.count("decode"))
    assert [c > 0 for c in counts] == [True] * 7 + [False] * 5, counts


@pytest.mark.parametrize("seed", INFERENCE_SEEDS)
def test_attention_inference_random_combination(seed, kernel_paths):
    with torch.no_grad():  # the views are made from leaves: without it they would record autograd
        _attention_combination(seed, kernel_paths, inference_case)


def _attention_combination(seed, kernel_paths, make_case):
    rng = random.Random(seed)
    p = make_case(rng)
    kernel_paths(p["split_head_dims"], p["gqa_split"])
    gen = torch.Generator().manual_seed(seed)
    B, Hkv, G, Sq, Sk, D, Dv = (p[n] for n in ("B", "Hkv", "group", "Sq", "Sk", "D", "Dv"))
    Hq, flash = Hkv * G, p["shell"] == "flash"
    if p["packed"]:  # q, k, v: head slices of one (B, S, Hq + 2 Hkv, D) projection output
        buf = torch.randn(B, max(Sq, Sk), Hq + 2 * Hkv, max(D, Dv), dtype=F64, generator=gen)
        buf = buf.to(DEVICE, PRECISE_DTYPE).requires_grad_(True)
        leaves, (q, k, v) = [buf], (buf[:, :Sq, :Hq, :D], buf[:, :Sk, Hq:Hq + Hkv, :D], buf[:, :Sk, Hq + Hkv:, :Dv])
    else:
        shapes = ([(B, Sq, Hq, D), (B, Sk, Hkv, D), (B, Sk, Hkv, Dv)] if flash else
                  [(B, Hq, Sq, D), (B, Hkv, Sk, D), (B, Hkv, Sk, Dv)])
        made = [layout_view(s, kind, rng, gen) for s, kind in zip(shapes, p["layouts"])]
        for (leaf, _), req in zip(made, p["requires_grad"]):
            leaf.requires_grad_(req)
        leaves = [leaf for leaf, _ in made if leaf.requires_grad]
        q, k, v = (view for _, view in made)
    kw = {}

    def lens(S):
        lo, hi = (-3, S + 4) if p["lens_out_of_range"] else (0, S)
        t = torch.tensor([rng.randint(lo, hi) for _ in range(2 * B)], dtype=rng.choice([torch.int32, torch.int64]))
        return (t[::2] if rng.random() < 0.5 else t[:B]).to(DEVICE)  # strided too
    if p["key_mask"]:
        km = torch.rand(B, Sk, generator=gen) < 0.7
        kw["key_mask"] = (km.t().contiguous().t() if rng.random() < 0.5 else km).to(DEVICE)
    if p["query_mask"]:
        kw["query_mask"] = (torch.rand(B, Sq, generator=gen) < 0.7).to(DEVICE)
    if p["kv_lens"]:
        kw["kv_lens"] = lens(Sk)
    if p["q_lens"]:
        kw["q_lens"] = lens(Sq)
    bias = None
    if p["mask"]:
        shape = tuple(s if full else 1 for s, full in zip((B, Hq, Sq, Sk), p["mask_full"]))[4 - p["mask_rank"]:]
        if p["mask"] == "bool":
            bias = (torch.rand(shape, generator=gen) < 0.8).to(DEVICE)
        else:
            bias = torch.randn(shape, dtype=F64, generator=gen)
            if p["mask_neg_inf"]:
                bias = bias.masked_fill(torch.rand(shape, generator=gen) < 0.2, float("-inf"))
            bias = bias.to(DEVICE, PRECISE_DTYPE).requires_grad_(p["mask_grad"])
            if p["mask_grad"]:
                leaves.append(bias)
    slopes = None
    if p["alibi"]:
        slopes = (torch.rand(Hq if p["alibi"] == "h" else (B, Hq), generator=gen) * 0.5).float().to(DEVICE)
    snap = snapshot([q, k, v, bias, slopes, *kw.values()])
    common = dict(window_size=p["window"], softcap=p["softcap"], alibi_slopes=slopes, backend="triton", **kw)
    if flash:
        res = flashtx.flash_attn_func(q, k, v, softmax_scale=p["scale"], causal=p["causal"], attn_bias=bias,
                                      return_attn_probs=p["return_lse"], **common)
        out, lse = (res[0], res[1]) if p["return_lse"] else (res, None)
        out4, (qh, kh, vh) = out.transpose(1, 2), (t.transpose(1, 2) for t in (q, k, v))
    else:
        res = flashtx.attention(q, k, v, attn_mask=bias, is_causal=p["causal"], scale=p["scale"], enable_gqa=G > 1,
                                return_lse=p["return_lse"], **common)
        out, lse = res if p["return_lse"] else (res, None)
        out4, qh, kh, vh = out, q, k, v
    vis = reference.visibility(Sq, Sk, batch=B, causal=p["causal"], bottom_right=flash, window=p["window"],
                               device=DEVICE, **kw)
    alibi = None if slopes is None else reference.alibi_bias(slopes, Sq, Sk, q_lens=kw.get("q_lens"),
                                                             kv_lens=kw.get("kv_lens"), device=DEVICE)
    rbias = None if bias is None else bias[(None,) * (4 - bias.dim())]
    rbias = rbias if rbias is None or rbias.dtype == torch.bool else rbias.double()
    ref, ref_lse = reference.attention(qh.double(), kh.double(), vh.double(), scale=p["scale"], vis=vis, bias=rbias,
                                       softcap=p["softcap"], alibi=alibi, return_lse=True)
    check("out", out4, ref)
    if lse is not None:
        check("lse", lse, ref_lse)
    if leaves:
        dout = torch.randn(out4.shape, dtype=F64, generator=gen).to(DEVICE)
        if p["loss"] == "sum":
            dout = torch.ones_like(dout)
        elif p["loss"] == "strided" or (p["loss"] == "lse_only" and lse is not None):
            keep = torch.zeros_like(dout)
            if p["loss"] == "strided":
                keep[..., ::2] = 1.0
            dout = keep
        loss = {"sum": lambda: out.sum(), "strided": lambda: out4[..., ::2].sum()}.get(
            p["loss"], lambda: (out4 * dout.to(out.dtype)).sum())()
        ref_loss = (ref * dout).sum()
        if lse is not None:
            dl = torch.randn(lse.shape, dtype=F64, generator=gen).to(DEVICE)
            fin = torch.isfinite(ref_lse).detach()
            loss = loss + (torch.where(fin, lse, 0) * dl.to(lse.dtype)).sum()
            ref_loss = ref_loss + (torch.where(fin, ref_lse, 0) * dl).sum()
        got = zeros_if_none(grads(loss, leaves), leaves)
        want = zeros_if_none(grads(ref_loss, leaves), leaves)
        for i, (a, b) in enumerate(zip(got, want)):
            check(f"gradient of input {i}", a, b)
    assert_unchanged(snap)


@pytest.mark.parametrize("seed", [7002, 7011, 7023, 7037, 7048])
def test_attention_leading_dims_and_broadcast_masks(seed):
    """SDPA shell at ranks 2, 3, 5 and 6, the attn_mask broadcast over several leading dims (full and size-1
    mixed: the one case that is expanded and reshaped), with key masks over the flattened batch."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    rank = rng.choice([2, 3, 5, 6])
    lead = tuple(rng.choice([1, 2, 3]) for _ in range(max(0, rank - 3)))
    Hkv, G = (1, 1) if rank == 2 else (rng.choice([1, 2]), rng.choice([1, 2, 3]))
    Hq, Sq, Sk, D = Hkv * G, rng.choice(SEQS[:9]), rng.choice(SEQS[:9]), rng.choice([8, 17, 40, 64])
    shapes = [(Sq, D), (Sk, D), (Sk, D)] if rank == 2 else [lead + (h, s, D) for h, s in ((Hq, Sq), (Hkv, Sk),
                                                                                        (Hkv, Sk))]
    q, k, v = (torch.randn(s, dtype=F64, generator=gen).to(DEVICE, PRECISE_DTYPE).requires_grad_() for s in shapes)
    full = (Sq, Sk) if rank == 2 else lead + (Hq, Sq, Sk)
    r = rng.randint(1, len(full))
    mshape = tuple(s if rng.random() < 0.5 else 1 for s in full[len(full) - r:])
    mask = torch.randn(mshape, dtype=F64, generator=gen).to(DEVICE, PRECISE_DTYPE).requires_grad_()
    nb = math.prod(lead)
    key_mask = (torch.rand(nb, Sk, generator=gen) < 0.7).to(DEVICE) if rng.random() < 0.5 else None
    causal = bool(seed % 2)
    out, lse = flashtx.attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=G > 1, key_mask=key_mask,
                                 return_lse=True, backend="triton")
    q64, k64, v64, m64 = (t.detach().double().requires_grad_() for t in (q, k, v, mask))
    flat = (lambda t: t.reshape(nb, -1, t.shape[-2], t.shape[-1]))  # noqa: E731
    vis = reference.visibility(Sq, Sk, batch=nb, causal=causal, key_mask=key_mask, device=DEVICE)
    ref, ref_lse = reference.attention(flat(q64), flat(k64), flat(v64), vis=vis, return_lse=True,
                                       bias=m64.expand(full).reshape(nb, -1, Sq, Sk))
    check("out", out, ref.reshape(out.shape))
    check("lse", lse, ref_lse.reshape(lse.shape))
    dout = torch.randn(out.shape, dtype=F64, generator=gen).to(DEVICE)
    got = grads((out * dout.to(out.dtype)).sum(), [q, k, v, mask])
    want = grads((ref.reshape(out.shape) * dout).sum(), [q64, k64, v64, m64])
    for name, a, b in zip(("dq", "dk", "dv", "dmask"), got, want):
        check(name, a, b)


# --------------------------------------------------------------------------------------------- varlen
@pytest.mark.parametrize("seed", [3001, 3012, 3027, 3040, 3056, 3071, 3088, 3095])
def test_varlen_random_combination(seed, kernel_paths, monkeypatch):
    monkeypatch.setattr(flashtx.functional, "PROBS_WITHOUT_DROPOUT", True)  # (flash-attn's: none without dropout)
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    n = rng.choice([1, 2, 3, 4])
    lq = [rng.choice([0, 0, 1, 2, 3, 5, 17, 33, 65]) for _ in range(n)]
    lk = [rng.choice([0, 1, 3, 16, 17, 33, 64]) for _ in range(n)] if rng.random() < 0.7 else list(lq)
    lk[-1] = lk[-1] or 3  # some key (the reference needs one; no keys at all is tested elsewhere)
    Hkv, G, D = rng.choice([1, 2]), rng.choice([1, 2, 3]), rng.choice([8, 17, 40, 64, 96, 128])
    Dv = D if rng.random() < 0.6 else rng.choice([8, 24, 64])
    Hq = Hkv * G
    kernel_paths(rng.random() < 0.3, rng.random() < 0.3)
    cuq = torch.tensor([0] + [sum(lq[:i + 1]) for i in range(n)], dtype=torch.int32, device=DEVICE)
    cuk = torch.tensor([0] + [sum(lk[:i + 1]) for i in range(n)], dtype=torch.int32, device=DEVICE)
    tq, tk = sum(lq), sum(lk)
    made = [layout_view(s, rng.choice(["contig", "perm", "slice", "step"]), rng, gen)
            for s in ((tq, Hq, D), (tk, Hkv, D), (tk, Hkv, Dv))]
    leaves, (q, k, v) = [m[0] for m in made], [m[1] for m in made]
    causal = rng.random() < 0.5
    window = (-1, -1) if rng.random() < 0.6 else (rng.choice([-1, 0, 3, 17]), rng.choice([-1, 0, 5]))
    softcap = 0.0 if rng.random() < 0.7 else 2.0
    slopes = (torch.rand((Hq,) if rng.random() < 0.5 else (n, Hq), generator=gen) * 0.5).float().to(DEVICE) \
        if rng.random() < 0.3 else None
    max_q = max(lq) + rng.choice([0, 0, 7])
    max_k = torch.tensor(max(lk) + 1) if rng.random() < 0.3 else max(lk)
    snap = snapshot([q, k, v, cuq, cuk])
    out, lse, probs = flashtx.flash_attn_varlen_func(q, k, v, cuq, cuk, max_q, max_k, causal=causal,
                                                     window_size=window, softcap=softcap, alibi_slopes=slopes,
                                                     return_attn_probs=True, backend="triton")
    qh, kh, vh = (t.transpose(0, 1)[None].double() for t in (q, k, v))
    vis = reference.varlen_visibility(cuq, cuk, tq, tk, causal=causal, window=window, device=DEVICE)
    alibi = None if slopes is None else reference.varlen_alibi_bias(slopes, cuq, cuk, tq, tk, device=DEVICE)
    ref, ref_lse = reference.attention(qh, kh, vh, vis=vis, softcap=softcap, alibi=alibi, return_lse=True)
    ref, ref_lse = ref[0].transpose(0, 1), ref_lse[0]
    check("out", out, ref)
    check("lse", lse, ref_lse)
    p_ref = reference.attention(qh, kh, torch.eye(tk, dtype=F64, device=DEVICE).expand(1, Hkv, tk, tk), vis=vis,
                                softcap=softcap, alibi=alibi)[0]
    for b in range(n):
        blk = p_ref[:, int(cuq[b]):int(cuq[b + 1]), int(cuk[b]):int(cuk[b + 1])]
        check(f"probs[{b}]", probs[b, :, :blk.shape[1], :blk.shape[2]], blk, tol=max(TOL, 1e-6))
    dout = torch.randn(out.shape, dtype=F64, generator=gen).to(DEVICE)
    fin = torch.isfinite(ref_lse)
    dl = torch.randn(lse.shape, dtype=F64, generator=gen).to(DEVICE)
    got = zeros_if_none(grads((out * dout.to(out.dtype)).sum() + (torch.where(fin, lse, 0) * dl.to(lse.dtype)).sum(),
                              leaves), leaves)
    want = zeros_if_none(grads((ref * dout).sum() + (torch.where(fin, ref_lse, 0) * dl).sum(), leaves), leaves)
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        check(name, a, b)
    assert_unchanged(snap)


# -------------------------------------------------------------------------------------------- dropout
@pytest.mark.parametrize("seed", [4001, 4013, 4026, 4044])
def test_dropout_matches_its_own_probabilities(seed):
    """The signs of return_attn_probs are the keep mask: the output and the gradients (the backward
    regenerates the mask) must equal the reference's with that mask; the same torch seed gives the same
    result, in both shells."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    B, Hkv, G = rng.choice([1, 2]), rng.choice([1, 2]), rng.choice([1, 2, 3])
    S = rng.choice([5, 16, 17, 33])
    D, Hq, p_drop = rng.choice([16, 17, 40]), Hkv * G, rng.choice([0.1, 0.3, 0.5, 0.9])
    q = torch.randn(B, S, Hq, D, dtype=F64, generator=gen).to(DEVICE, PRECISE_DTYPE).requires_grad_()
    k, v = (torch.randn(B, S, Hkv, D, dtype=F64, generator=gen).to(DEVICE, PRECISE_DTYPE).requires_grad_()
            for _ in range(2))
    bias = torch.randn(1, Hq, S, S, dtype=F64, generator=gen).to(DEVICE, PRECISE_DTYPE) if seed % 2 else None
    kv_lens = torch.randint(0, S + 1, (B,), generator=gen).to(DEVICE) if rng.random() < 0.5 else None
    kw = dict(dropout_p=p_drop, softcap=rng.choice([0.0, 3.0]), attn_bias=bias, kv_lens=kv_lens, backend="triton")
    torch.manual_seed(seed)
    out, _, probs = flashtx.flash_attn_func(q, k, v, return_attn_probs=True, **kw)
    torch.manual_seed(seed)
    assert torch.equal(flashtx.flash_attn_func(q, k, v, **kw), out), "same seed, different dropout"
    torch.manual_seed(seed)
    sdpa = flashtx.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=bias,
                             dropout_p=p_drop, softcap=kw["softcap"], enable_gqa=G > 1, kv_lens=kv_lens,
                             backend="triton")
    assert torch.equal(sdpa.transpose(1, 2), out), "the SDPA and flash shells drop differently for one seed"
    vis = reference.visibility(S, S, batch=B, kv_lens=kv_lens, device=DEVICE)
    q64, k64, v64 = (t.detach().double().transpose(1, 2).requires_grad_() for t in (q, k, v))
    ref = reference.attention(q64, k64, v64, vis=vis, bias=None if bias is None else bias.double(),
                              softcap=kw["softcap"], keep=probs >= 0, dropout_p=p_drop).transpose(1, 2)
    check("out", out, ref)
    dout = torch.randn(out.shape, dtype=F64, generator=gen).to(DEVICE)
    got = grads((out * dout.to(out.dtype)).sum(), [q, k, v])
    want = grads((ref * dout).sum(), [q64, k64, v64])
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        check(name, a, b.transpose(1, 2))
