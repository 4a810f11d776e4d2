"""KV-cache decoding, RoPE and SwiGLU in a fixed-seed sample of a randomized campaign (see
tests/test_fuzz_attention.py for the method): contiguous/paged caches, cache_batch_idx, cache_leftpad, RoPE
and split counts; RoPE in every layout and position mode, in place and out of place; SwiGLU with odd widths,
strided inputs and inplace_backward; the GPU tile configs run in the interpreter; and the two bugs the
campaign found (aliased appends, the reference backend with no keys), as regressions.
"""
import math
import random

import pytest
import torch
from conftest import DEVICE, ON_GPU, PRECISE_DTYPE
from fuzz_cases import DIMS, F64, assert_unchanged, check, grads, layout_view, snapshot

import flashtx
from flashtx import reference
from flashtx.triton_kernels import attention_bwd_launch, launch


# --------------------------------------------------------------------------------------------- decode
def decode_reference(q, kc, vc, k, v, lens, *, bt, bidx, leftpad, cos, sin, interleaved, causal, window, softcap,
                     slopes, scale):
    """(out, lse, k_cache, v_cache after the append), float64, gathering each sequence's keys."""
    B, Sq, Hq, D = q.shape
    kc, vc = kc.double().clone(), vc.double().clone()
    page, Snew = kc.shape[1], 0 if k is None else k.shape[1]
    moves = causal or tuple(window) != (-1, -1)
    out = torch.zeros(B, Sq, Hq, vc.shape[-1], dtype=F64, device=q.device)
    lse = torch.full((B, Hq, Sq), float("-inf"), dtype=F64, device=q.device)

    def slot(b, j):
        if bt is not None:
            return int(bt[b, j // page]), j % page
        return (int(bidx[b]) if bidx is not None else b), j

    def rot(x, pos):
        return reference.rotary_tokens(x, cos[None].double(), sin[None].double(), torch.zeros_like(pos), pos,
                                       interleaved=interleaved)
    for b in range(B):
        L0, qb = int(lens[b]), q[b].double()
        if cos is not None:
            qb = rot(qb, (torch.arange(Sq, device=q.device) + L0) if moves else torch.full((Sq,), L0,
                                                                                        device=q.device))
        for s in range(Snew):
            kt = k[b, s][None].double()
            kc[slot(b, L0 + s)] = rot(kt, torch.tensor([L0 + s], device=q.device))[0] if cos is not None else kt[0]
            vc[slot(b, L0 + s)] = v[b, s].double()
        end, start = L0 + Snew, int(leftpad[b]) if leftpad is not None else 0
        if end == 0:
            continue
        K = torch.stack([kc[slot(b, j)] for j in range(end)]).transpose(0, 1)[None]
        V = torch.stack([vc[slot(b, j)] for j in range(end)]).transpose(0, 1)[None]
        i, j = torch.arange(Sq, device=q.device)[:, None], torch.arange(end, device=q.device)[None, :]
        pos, (left, right) = end - Sq + i, window
        right = 0 if causal else right
        vis = (j >= start) & ((j <= pos + right) if right >= 0 else True) & ((j >= pos - left) if left >= 0 else True)
        alibi = None
        if slopes is not None:
            sl = slopes.reshape(-1, Hq)[b if slopes.dim() == 2 else 0].double()
            alibi = -sl[None, :, None, None] * (pos - j).abs()[None, None].double()
        o, l_ = reference.attention(qb.transpose(0, 1)[None], K, V, scale=scale, vis=vis[None], softcap=softcap,
                                    alibi=alibi, return_lse=True)
        out[b], lse[b] = o[0].transpose(0, 1), l_[0]
    return out, lse, kc, vc


def decode_cache(shape, kind, gen):
    N, S, H, D = shape
    if kind == "bhsd":
        return torch.randn(N, H, S, D, dtype=F64, generator=gen).to(DEVICE, PRECISE_DTYPE).transpose(1, 2)
    if kind == "slice":
        return torch.randn(N + 1, S + 2, H + 1, D + 3, dtype=F64, generator=gen).to(
            DEVICE, PRECISE_DTYPE)[1:, 1:S + 1, :H, 2:D + 2]
    return torch.randn(shape, dtype=F64, generator=gen).to(DEVICE, PRECISE_DTYPE)


@pytest.mark.parametrize("seed", [2001, 2007, 2018, 2026, 2033, 2049, 2058, 2064, 2077, 2085, 2101, 2117, 2139,
                                  2150])
def test_decode_random_combination(seed):
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    B, Sq, Snew = rng.choice([1, 2, 3]), rng.choice([1, 1, 2, 3, 5, 9]), rng.choice([0, 1, 1, 2, 5])
    Hkv, G, D = rng.choice([1, 2, 3]), rng.choice([1, 2, 4, 5]), rng.choice(DIMS)
    Dv, Hq = (D if rng.random() < 0.7 else rng.choice(DIMS)), Hkv * G
    page = rng.choice([None, None, 16, 32, 48])
    bt = bidx = None
    if page:
        per = rng.choice([1, 2, 3])
        npages = B * per + rng.choice([0, 1, 3])
        bt = torch.randperm(npages, generator=gen)[:B * per].view(B, per).to(torch.int32).to(DEVICE)
        cshape, cap = (npages, page, Hkv), per * page
    else:
        cap = max(rng.choice([1, 5, 16, 17, 33, 64, 100]), Snew)
        rows = B + (rng.choice([0, 1, 3]) if rng.random() < 0.4 else 0)
        cshape = (rows, cap, Hkv)
        if rows > B or rng.random() < 0.3:
            bidx = torch.randperm(rows, generator=gen)[:B].to(torch.int32).to(DEVICE)
    kind = rng.choice(["contig", "bhsd", "slice"])
    kc, vc = decode_cache(cshape + (D,), kind, gen), decode_cache(cshape + (Dv,), kind, gen)
    q = torch.randn(B, Sq, Hq, D, dtype=F64, generator=gen).to(DEVICE, PRECISE_DTYPE)
    if rng.random() < 0.4:
        q = q.transpose(1, 2).contiguous().transpose(1, 2)
    k = v = None
    if Snew:
        k = torch.randn(B, Snew, Hkv, D, dtype=F64, generator=gen).to(DEVICE, PRECISE_DTYPE)
        v = torch.randn(B, Snew, Hkv, Dv, dtype=F64, generator=gen).to(DEVICE, PRECISE_DTYPE)
    lens = torch.tensor([rng.randint(0, cap - Snew) for _ in range(B)], dtype=torch.int32, device=DEVICE)
    leftpad = torch.tensor([rng.randint(0, int(x) + Snew) for x in lens], dtype=torch.int32, device=DEVICE) \
        if rng.random() < 0.3 else None
    causal = rng.random() < 0.5
    window = (-1, -1) if rng.random() < 0.6 else (rng.choice([-1, 0, 1, 4, 20]), rng.choice([-1, 0, 3]))
    cos = sin = None
    interleaved = rng.random() < 0.5
    if rng.random() < 0.35 and D >= 2:
        moves = causal or window != (-1, -1)
        ro = int(max(int(x) + max(Snew, Sq if moves else 1) for x in lens)) + rng.choice([0, 1, 10])
        ang = torch.rand(ro, rng.randint(1, D // 2), dtype=F64, generator=gen) * 6.3
        cos, sin = (t.to(DEVICE, rng.choice([torch.float32, PRECISE_DTYPE])) for t in (ang.cos(), ang.sin()))
    softcap = 0.0 if rng.random() < 0.8 else 10.0
    slopes = (torch.rand((Hq,) if rng.random() < 0.5 else (B, Hq), generator=gen) * 0.5).float().to(DEVICE) \
        if rng.random() < 0.25 else None
    scale = None if rng.random() < 0.8 else 0.37
    ref = decode_reference(q, kc, vc, k, v, lens, bt=bt, bidx=bidx, leftpad=leftpad, cos=cos, sin=sin,
                           interleaved=interleaved, causal=causal, window=window, softcap=softcap, slopes=slopes,
                           scale=scale or 1 / math.sqrt(D))
    snap = snapshot([q, k, v, lens, bt, bidx, leftpad, cos, sin, slopes])
    out, lse = flashtx.flash_attn_with_kvcache(
        q, kc, vc, k, v, rotary_cos=cos, rotary_sin=sin, cache_seqlens=lens, cache_batch_idx=bidx,
        cache_leftpad=leftpad, block_table=bt, softmax_scale=scale, causal=causal, window_size=window,
        softcap=softcap, rotary_interleaved=interleaved, alibi_slopes=slopes,
        num_splits=rng.choice([0, 1, 2, 3, 7, 64]), return_softmax_lse=True, backend="triton")
    check("out", out, ref[0])
    check("lse", lse, ref[1])
    check("k_cache", kc, ref[2])
    check("v_cache", vc, ref[3])
    assert_unchanged(snap)


# --------------------------------------------------------------------------------------------- rotary
@pytest.mark.parametrize("seed", [8003, 8011, 8019, 8028, 8036, 8047, 8052, 8068, 8073, 8090, 8104, 8122, 8135,
                                  8149])
def test_rotary_random_combination(seed):
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    layout = rng.choice(["bshd", "bhsd", "varlen"])
    B, S, H, Hk = rng.choice([1, 2, 3]), rng.choice([1, 2, 5, 17, 33]), rng.choice([1, 2, 3, 5]), rng.choice([1, 2])
    D = rng.choice([2, 3, 4, 8, 15, 16, 17, 64, 65, 130])
    r2 = rng.randint(1, D // 2)
    qk, interleaved = rng.random() < 0.5, rng.random() < 0.5
    if layout == "varlen":
        seqlens = [rng.choice([0, 1, 2, 5, 17]) for _ in range(B)]
        cu = torch.tensor([0] + [sum(seqlens[:i + 1]) for i in range(B)], dtype=rng.choice([torch.int32, torch.int64]))
        total = int(cu[-1])
        shapes, longest = [(total, H, D), (total, Hk, D)], max(seqlens)
    else:
        cu, longest = None, S
        shapes = [(B, S, H, D), (B, S, Hk, D)] if layout == "bshd" else [(B, H, S, D), (B, Hk, S, D)]
    inplace = rng.choice([False, False, True, None])
    x_leaf, x = layout_view(shapes[0], rng.choice(["contig", "perm", "slice", "step"] +
                                                  (["expand"] if inplace is False else [])), rng, gen)
    k_leaf, k = layout_view(shapes[1], rng.choice(["contig", "perm", "slice"]), rng, gen) if qk else (None, None)
    mode, kw = rng.choice(["none", "int", "tensor", "ids"]), {}
    if mode == "int":
        kw["seqlen_offsets"] = rng.randint(0, 20)
    elif mode == "tensor":
        kw["seqlen_offsets"] = torch.randint(0, 20, (B,), generator=gen).to(DEVICE)
    elif mode == "ids":
        kw["position_ids"] = torch.randint(0, 40, (total,) if cu is not None else (rng.choice([1, B]), S),
                                           generator=gen).to(DEVICE)
    if "position_ids" in kw:
        need = int(kw["position_ids"].max()) + 1 if kw["position_ids"].numel() else 1
    else:
        off = kw.get("seqlen_offsets", 0)
        need = longest + (int(off.max()) if isinstance(off, torch.Tensor) else off)
    per_batch = rng.choice([None, 1, B])
    tshape = (max(need, 1) + rng.choice([0, 3]), r2) if per_batch is None else (per_batch, max(need, 1), r2)
    ang = torch.rand(tshape, dtype=F64, generator=gen) * 6.3
    cos, sin = (t.to(DEVICE, rng.choice([torch.float16, torch.float32, F64])) for t in (ang.cos(), ang.sin()))
    if cu is not None:
        kw["cu_seqlens"] = cu.to(DEVICE)
    # reference: a flat token list, with each token's table and position
    if cu is not None:
        tb = torch.repeat_interleave(torch.arange(B), torch.tensor(seqlens)).to(DEVICE)
        idx = torch.arange(total, device=DEVICE) - kw["cu_seqlens"].long()[tb]
        tok = untok = (lambda t, like=None: t)  # noqa: E731
    else:
        tb = torch.arange(B, device=DEVICE)[:, None].expand(B, S).reshape(-1)
        idx = torch.arange(S, device=DEVICE)[None, :].expand(B, S).reshape(-1)
        bhsd = layout == "bhsd"

        def tok(t):
            return (t.transpose(1, 2) if bhsd else t).reshape(B * S, -1, D)

        def untok(t, like=None):
            t = t.reshape(B, S, -1, D)
            return t.transpose(1, 2) if bhsd else t
    if "position_ids" in kw:
        pos = kw["position_ids"].expand(B, S).reshape(-1) if cu is None else kw["position_ids"]
    else:
        off = kw.get("seqlen_offsets", 0)
        pos = idx + (off.long()[tb] if isinstance(off, torch.Tensor) else off)
    table_index = tb if per_batch not in (None, 1) else torch.zeros_like(tb)
    c3, s3 = ((t if t.dim() == 3 else t[None]).double() for t in (cos, sin))

    def ref_rot(t):
        return untok(reference.rotary_tokens(tok(t.double()), c3, s3, table_index, pos.long(),
                                             interleaved=interleaved))
    call_kw = dict(interleaved=interleaved, layout="bhsd" if layout == "bhsd" else "bshd", backend="triton", **kw)
    refs = [ref_rot(x)] + ([ref_rot(k)] if qk else [])
    snap = snapshot([x_leaf, k_leaf, cos, sin, *kw.values()]) if inplace is False else []
    xin, kin = (x * 1.0, None if k is None else k * 1.0) if inplace is not False else (x, k)
    if qk:
        outs = list(flashtx.apply_rotary_qk(xin, kin, cos, sin, inplace=inplace, **call_kw))
    else:
        outs = [flashtx.apply_rotary(xin, cos, sin, inplace=inplace, **call_kw)]
    if inplace is True:
        assert outs[0] is xin
    for name, a, b in zip(("x", "k"), outs, refs):
        check(name, a, b)
    leaves = [x_leaf] + ([k_leaf] if qk else [])
    douts = [torch.randn(o.shape, dtype=F64, generator=gen).to(DEVICE) for o in outs]
    got = grads(sum((o * d.to(o.dtype)).sum() for o, d in zip(outs, douts)), leaves)
    want = grads(sum((r * d).sum() for r, d in zip(refs, douts)), leaves)
    for name, a, b in zip(("dx", "dk"), got, want):
        check(name, a, b)
    assert_unchanged(snap)


# --------------------------------------------------------------------------------------------- swiglu
@pytest.mark.parametrize("seed", [9001, 9004, 9013, 9022, 9037, 9041, 9058, 9066])
def test_swiglu_random_combination(seed):
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    lead = tuple(rng.choice([1, 2, 3, 5, 17]) for _ in range(rng.choice([0, 1, 2, 3])))
    H = rng.choice([1, 2, 3, 7, 15, 17, 31, 33, 63, 65, 127, 129, 257])
    while math.prod(lead) * H > 3000:
        lead = tuple(max(1, x // 2) for x in lead)
    packed, ib = rng.random() < 0.4, rng.random() < 0.4
    kinds = ["contig", "perm", "slice", "step"] + ([] if ib else ["expand"])
    if packed:
        leaf, x = layout_view(lead + (2 * H,), rng.choice(kinds), rng, gen)
        if ib:  # the buffer backward overwrites: a non-leaf of the same layout
            x = (leaf * 1.0).as_strided(x.shape, x.stride(), x.storage_offset())
        ins, leaves = [x], [leaf]
        out = flashtx.swiglu_packed(x, inplace_backward=ib, backend="triton")
        ref = torch.nn.functional.silu(x.double()[..., :H]) * x.double()[..., H:]
    else:
        style = rng.choice(kinds + ["halves", "interleaved"])
        if style in ("halves", "interleaved"):
            leaf = torch.randn(lead + (2 * H,), dtype=F64, generator=gen).to(DEVICE, PRECISE_DTYPE).requires_grad_()
            base = leaf * 1.0 if ib else leaf
            g, u = (base[..., :H], base[..., H:]) if style == "halves" else (base[..., 0::2], base[..., 1::2])
            leaves = [leaf]
        else:
            (gl, g), (ul, u) = (layout_view(lead + (H,), kind, rng, gen) for kind in (style, rng.choice(kinds)))
            if ib:
                g = (gl * 1.0).as_strided(g.shape, g.stride(), g.storage_offset())
                u = (ul * 1.0).as_strided(u.shape, u.stride(), u.storage_offset())
            leaves = [gl, ul]
        ins = [g, u]
        out = flashtx.swiglu(g, u, inplace_backward=ib, backend="triton")
        ref = torch.nn.functional.silu(g.double()) * u.double()
    check("out", out, ref)
    assert out.is_contiguous()
    dout = torch.randn(out.shape, dtype=F64, generator=gen).to(DEVICE)
    want = grads((ref * dout).sum(), leaves)
    want_in = grads((ref * dout).sum(), ins)
    snap = [] if ib else snapshot(leaves)
    got = grads((out * dout.to(out.dtype)).sum(), leaves)
    for i, (a, b) in enumerate(zip(got, want)):
        check(f"grad {i}", a, b)
    if ib:  # documented: after backward the inputs' buffers hold their gradients
        for i, (t, r) in enumerate(zip(ins, want_in)):
            check(f"in-place gradient buffer {i}", t, r)
    assert_unchanged(snap)


# ------------------------------------------------------------------------------ GPU tiles in the interpreter
@pytest.mark.skipif(ON_GPU, reason="runs a GPU's tile configs in Triton's interpreter (the GPU runs them natively)")
@pytest.mark.parametrize("gpu_target", [90, 86], indirect=True, ids=str)
def test_gpu_tile_configs_stay_in_bounds(gpu_target, monkeypatch):
    """The sm_90 / sm_86 tiles (128-row blocks, the SM-count split heuristics) that the interpreter's own small
    tiles never exercise, with split head dims and the GQA dK/dV split on: the combination of the 2026-11-30
    GPU illegal memory access (MQA 4:1, head dims 96/160, strided inputs), float64 against the reference, and
    a decode with splits, paged."""
    arch = gpu_target.arch
    monkeypatch.setattr(launch, "SPLIT_HEAD_DIMS", True)
    monkeypatch.setattr(attention_bwd_launch, "AUTO_GQA_SPLIT", True)
    gen = torch.Generator().manual_seed(arch)
    B, Hq, Hkv, Sq, Sk = 2, 4, 1, 70, 113
    q, k, v = (torch.randn(B, h, s, d + 8, dtype=F64, generator=gen)[..., 4:4 + d].requires_grad_()
               for h, s, d in ((Hq, Sq, 96), (Hkv, Sk, 96), (Hkv, Sk, 160)))
    out = flashtx.attention(q, k, v, enable_gqa=True, is_causal=arch == 86, backend="triton")
    q64, k64, v64 = (t.detach().requires_grad_() for t in (q, k, v))
    ref = reference.attention(q64, k64, v64, causal=arch == 86)
    check("out", out, ref)
    dout = torch.randn(out.shape, dtype=F64, generator=gen)
    for name, a, b in zip("qkv", grads((out * dout).sum(), [q, k, v]), grads((ref * dout).sum(), [q64, k64, v64])):
        check("d" + name, a, b)
    qd = torch.randn(3, 2, 8, 64, dtype=F64, generator=gen)
    kc, vc = (torch.randn(10, 16, 2, 64, dtype=F64, generator=gen) for _ in range(2))
    bt = torch.randperm(10, generator=gen)[:9].view(3, 3).to(torch.int32)
    lens = torch.tensor([0, 17, 46], dtype=torch.int32)
    ref = decode_reference(qd, kc, vc, None, None, lens, bt=bt, bidx=None, leftpad=None, cos=None, sin=None,
                           interleaved=False, causal=True, window=(-1, -1), softcap=0.0, slopes=None,
                           scale=1 / 8)
    out, lse = flashtx.flash_attn_with_kvcache(qd, kc, vc, cache_seqlens=lens, block_table=bt, causal=True,
                                               return_softmax_lse=True, backend="triton")
    check("decode out", out, ref[0])
    check("decode lse", lse, ref[1])


# ------------------------------------------------------ what the campaign found (fixed), as regressions
def _aliased_append(kind):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 1, 2, 16, dtype=F64, generator=gen).to(DEVICE, PRECISE_DTYPE)
    k, v = (torch.randn(2, 1, 1, 16, dtype=F64, generator=gen).to(DEVICE, PRECISE_DTYPE) for _ in range(2))
    lens = torch.tensor([3, 3], dtype=torch.int32, device=DEVICE)
    if kind == "expanded cache":  # one cache row viewed as both sequences' rows (stride 0)
        kc, vc = (torch.randn(1, 32, 1, 16, dtype=F64, generator=gen).to(DEVICE, PRECISE_DTYPE).expand(2, 32, 1, 16)
                  for _ in range(2))
        return dict(q=q, k_cache=kc, v_cache=vc, k=k, v=v, cache_seqlens=lens)
    if kind == "expanded positions":  # one position viewed as all 32 (stride 0 along the sequence)
        kc, vc = (torch.randn(2, 1, 1, 16, dtype=F64, generator=gen).to(DEVICE, PRECISE_DTYPE).expand(2, 32, 1, 16)
                  for _ in range(2))
        return dict(q=q, k_cache=kc, v_cache=vc, k=k, v=v, cache_seqlens=lens)
    if kind == "k_cache is v_cache":  # v's append would overwrite k's
        kc = torch.randn(2, 32, 1, 16, dtype=F64, generator=gen).to(DEVICE, PRECISE_DTYPE)
        return dict(q=q, k_cache=kc, v_cache=kc, k=k, v=v, cache_seqlens=lens)
    kc, vc = (torch.randn(4, 16, 1, 16, dtype=F64, generator=gen).to(DEVICE, PRECISE_DTYPE) for _ in range(2))
    bt = torch.tensor([[0, 1], [0, 2]], dtype=torch.int32, device=DEVICE)  # both append at row 3 of page 0
    return dict(q=q, k_cache=kc, v_cache=vc, k=k, v=v, cache_seqlens=lens, block_table=bt)


@pytest.mark.parametrize("kind", ["expanded cache", "expanded positions", "k_cache is v_cache", "shared page"])
def test_decode_append_into_one_slot_twice_is_refused(kind):
    """Two sequences whose appended tokens land in one cache slot would overwrite each other (one attending to
    the other's new key; a race on a GPU): a stride-0 cache dim (batch or positions) or k_cache sharing v_cache's
    memory is refused from strides and storage (on every device),
    a block_table that shares a page at the append positions from its values (host-side: on CPU tensors; a
    repeated cache_batch_idx is refused on every device, tests/test_decode_device_check.py)."""
    if kind == "shared page" and ON_GPU:
        pytest.skip("the shared-page check reads block_table on the host: CPU tensors only (see the note)")
    try:
        flashtx.flash_attn_with_kvcache(**_aliased_append(kind), backend="triton")
    except ValueError as exc:
        assert "k_cache" in str(exc) or "block_table" in str(exc), str(exc)
        return
    raise AssertionError("two sequences appended into one cache slot and nothing was refused")


@pytest.mark.parametrize("call", ["probs", "decode"])
def test_reference_backend_with_no_keys(call, monkeypatch):
    """The reference backend (the automatic one for CPU tensors without the interpreter) gives what the kernels
    give with zero keys: output 0, lse -inf, empty probabilities (it crashed in amax over the empty key dim)."""
    monkeypatch.setattr(flashtx.functional, "PROBS_WITHOUT_DROPOUT", True)  # (flash-attn's: none without dropout)
    if call == "probs":
        q, k = torch.randn(1, 3, 2, 16, device=DEVICE), torch.randn(1, 0, 2, 16, device=DEVICE)
        out, lse, probs = flashtx.flash_attn_func(q, k, k, return_attn_probs=True, backend="reference")
        assert probs.shape == (1, 2, 3, 0) and bool((out == 0).all()) and bool(torch.isneginf(lse).all())
    else:
        q, kc = torch.randn(2, 1, 2, 16, device=DEVICE), torch.randn(2, 0, 1, 16, device=DEVICE)
        out = flashtx.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=torch.zeros(2, dtype=torch.int32,
                                                                                    device=DEVICE),
                                              backend="reference")
        assert bool((out == 0).all())
