"""flashtx.flash_attn_with_kvcache against a float64 loop reference: contiguous and paged caches,
ragged lengths, cache_batch_idx, left padding, appends across pages, RoPE, GQA, splits, score
modifiers; nothing written outside the new tokens' cache rows; clear errors for bad input.

Outputs are held to the tolerance rule (conftest.assert_close_to_reference) against the loop reference in float64,
with the same loop in the kernels' dtype as the eager baseline (independent of flashtx's own backends: a baseline
that shared their argument handling would err as they do, and widen the bound for a shared bug). The feature
tests run PRECISE_DTYPE (float64 in the interpreter, float32 on a GPU, whose Triton backend refuses float64) and a
few cases in float16; a silent fallback to the reference backend fails (the warning is an error here)."""
import math

import pytest
import torch
from conftest import DEVICE, KERNEL_DTYPES, PRECISE_DTYPE, assert_close_to_reference, dtype_id, poisoned_allocations

import flashtx
from flashtx import _decode_lane, _decode_op, reference

# A call without backend= that no fast backend can run falls back to the reference with a warning: here an error
# (and plans are fresh per test, so that the once-per-reason warning is given in every test that falls back).
pytestmark = [pytest.mark.filterwarnings("error:.*using the reference implementation"),
              pytest.mark.usefixtures("fresh_plans")]
HALF = torch.float16  # a kernel dtype on a GPU and in the interpreter (whose bf16 is wrong, see conftest)


def rotate(x, cos, sin, pos, interleaved):
    """x (N, H, D) rotated at positions pos (N,) in float64 (columns past the tables pass through)."""
    return reference.rotary_tokens(x.double(), cos[None].double(), sin[None].double(),
                                   torch.zeros_like(pos), pos, interleaved=interleaved)


def loop_reference(q, kc, vc, k, v, *, lens, batch_idx=None, leftpad=None, block_table=None, cos=None, sin=None,
                   interleaved=True, causal=False, window=(-1, -1), softcap=0.0, alibi=None, scale=None, dtype=None):
    """(out (B, Sq, Hq, Dv), lse (B, Hq, Sq), k_cache, v_cache after the append), one sequence, head and query at
    a time: all float64 (dtype None); or the eager baseline in `dtype` (rotated rows and the output rounded to
    dtype, the math in float32 for half dtypes: out and the caches in dtype, lse in the math's dtype)."""
    B, Sq, Hq, D = q.shape
    work = torch.float64 if dtype is None else torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    rounded = (lambda t: t) if dtype is None else (lambda t: t.to(dtype).to(torch.float64))
    kc, vc = kc.double().clone(), vc.double().clone()
    Hkv, page = kc.shape[2], kc.shape[1]
    scale = scale or 1 / math.sqrt(D)
    out = torch.zeros(B, Sq, Hq, vc.shape[-1], dtype=work)
    lse = torch.full((B, Hq, Sq), float("-inf"), dtype=work)
    moves = causal or tuple(window) != (-1, -1)

    def slot(b, j):
        if block_table is not None:
            return int(block_table[b, j // page]), j % page
        return (int(batch_idx[b]) if batch_idx is not None else b), j

    for b in range(B):
        L0 = int(lens[b])
        Snew = k.shape[1] if k is not None else 0
        qb = q[b].double()
        if cos is not None:
            qpos = torch.arange(Sq) + L0 if moves else torch.full((Sq,), L0)
            qb = rounded(rotate(qb, cos, sin, qpos, interleaved))
        for t in range(Snew):
            kt = k[b, t:t + 1].double()
            if cos is not None:
                kt = rounded(rotate(kt, cos, sin, torch.tensor([L0 + t]), interleaved))
            kc[slot(b, L0 + t)] = kt[0]
            vc[slot(b, L0 + t)] = v[b, t].double()
        end, start = L0 + Snew, int(leftpad[b]) if leftpad is not None else 0
        for h in range(Hq):
            g = h // (Hq // Hkv)
            for i in range(Sq):
                p = end - Sq + i
                keys = [j for j in range(start, end) if (window[1] < 0 and not causal or j <= p + (0 if causal else
                        window[1])) and (window[0] < 0 or j >= p - window[0])]
                if not keys:
                    continue
                K = torch.stack([kc[slot(b, j)][g] for j in keys]).to(work)
                V = torch.stack([vc[slot(b, j)][g] for j in keys]).to(work)
                s = K @ qb[i, h].to(work) * scale
                if softcap:
                    s = softcap * torch.tanh(s / softcap)
                if alibi is not None:
                    sl = alibi.reshape(-1, Hq)[b if alibi.dim() == 2 else 0, h].to(work)
                    s = s - sl * (p - torch.tensor(keys, dtype=work)).abs()
                lse[b, h, i] = torch.logsumexp(s, 0)
                out[b, i, h] = torch.softmax(s, 0) @ V
    if dtype is not None:
        return out.to(dtype), lse, kc.to(dtype), vc.to(dtype)
    return out, lse, kc, vc


def make_cache(B, Hkv, D, cap, dtype, page=None, extra_rows=0, seed=0, spare_pages=3):
    """(k_cache, v_cache, block_table): contiguous (B + extra_rows, cap, Hkv, D), or paged with
    shuffled pages (and `spare_pages` unused ones) so that logical and physical order differ."""
    g = torch.Generator().manual_seed(seed)
    if page is None:
        shape, bt = (B + extra_rows, cap, Hkv, D), None
    else:
        per = -(-cap // page)
        npages = B * per + spare_pages
        bt = torch.randperm(npages, generator=g)[:B * per].view(B, per).to(torch.int32)
        shape = (npages, page, Hkv, D)
    kc = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    vc = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    return kc.to(DEVICE), vc.to(DEVICE), bt.to(DEVICE) if bt is not None else None


def rand(*shape, dtype):
    return torch.randn(*shape, dtype=torch.float64).to(dtype).to(DEVICE)


def run_case(dtype, *, B=3, Sq=1, Snew=1, Hq=4, Hkv=2, D=16, cap=80, page=None, lens=None, rotary=None,
             splits=1, batch_idx=None, leftpad=None, extra_rows=0, backend="triton", tables=torch.float32,
             spare_pages=3, **kw):
    """One call of flash_attn_with_kvcache (fresh random caches and tokens) against loop_reference under the
    tolerance rule: out with the reference backend's out in `dtype` as the eager baseline, lse (float32 for
    half inputs) with its lse, computed in lse's dtype (the reference backend computes in float32 for half
    inputs); the caches after the append likewise (new rows copies, or rotated copies with RoPE), every row
    outside the append bit-identical. Returns (out, lse)."""
    kc, vc, bt = make_cache(B, Hkv, D, cap, dtype, page, extra_rows, seed=int(torch.randint(2**31, ())),
                            spare_pages=spare_pages)
    lens = torch.tensor(lens if lens is not None else [cap - Snew - 7 * b for b in range(B)], dtype=torch.int32)
    q = rand(B, Sq, Hq, D, dtype=dtype)
    k, v = (rand(B, Snew, Hkv, D, dtype=dtype) for _ in range(2)) if Snew else (None, None)
    cos = sin = None
    if rotary is not None:
        ang = torch.arange(cap)[:, None].double() * torch.rand(1, D // 4, dtype=torch.float64)
        cos, sin = ang.cos().to(tables).to(DEVICE), ang.sin().to(tables).to(DEVICE)  # (cap, D / 4)
    bi = torch.tensor(batch_idx, dtype=torch.int32).to(DEVICE) if batch_idx is not None else None
    lp = torch.tensor(leftpad, dtype=torch.int32).to(DEVICE) if leftpad is not None else None
    ref = loop_reference(q, kc, vc, k, v, lens=lens, batch_idx=bi, leftpad=lp, block_table=bt, cos=cos, sin=sin,
                         interleaved=rotary == "interleaved", **kw)
    out_e, lse_e, kce, vce = (t.to(DEVICE) for t in loop_reference(  # the eager baseline: the same loop in dtype
        q, kc, vc, k, v, lens=lens, batch_idx=bi, leftpad=lp, block_table=bt, cos=cos, sin=sin,
        interleaved=rotary == "interleaved", dtype=dtype, **kw))
    kc0, vc0 = kc.clone(), vc.clone()
    args = dict(rotary_cos=cos, rotary_sin=sin, cache_seqlens=lens.to(DEVICE), cache_batch_idx=bi, cache_leftpad=lp,
                block_table=bt, rotary_interleaved=rotary == "interleaved", num_splits=splits,
                return_softmax_lse=True, causal=kw.get("causal", False), window_size=kw.get("window", (-1, -1)),
                softcap=kw.get("softcap", 0.0), alibi_slopes=kw.get("alibi"))
    out, lse = flashtx.flash_attn_with_kvcache(q, kc, vc, k, v, backend=backend, **args)
    assert out.dtype == dtype and out.shape == (B, Sq, Hq, D)
    assert lse.dtype == lse_e.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert_close_to_reference("out", out, ref[0].to(DEVICE), out_e)
    fin = torch.isfinite(ref[1])
    assert torch.equal(torch.isfinite(lse.cpu()), fin), "lse: -inf rows differ"
    assert torch.isneginf(lse.cpu()[~fin]).all(), "lse: rows that see no key must be -inf"
    assert_close_to_reference("lse", lse, ref[1].to(DEVICE), lse_e)
    # the cache: new rows as the reference wrote them (rounded to dtype; exact copies without RoPE),
    # everything else bit-identical
    written = (ref[2].to(dtype) != kc0.cpu()) | (ref[3].to(dtype) != vc0.cpu())
    for name, got, want, eager, before in (("k_cache", kc, ref[2], kce, kc0), ("v_cache", vc, ref[3], vce, vc0)):
        assert_close_to_reference(name, got, want.to(DEVICE), eager)
        if rotary is None or name == "v_cache":
            assert torch.equal(got.cpu(), want.to(dtype)), f"{name}: the appended rows are not exact copies"
        assert torch.equal(got.cpu()[~written], before.cpu()[~written]), f"{name}: rows outside the append changed"
    return out, lse


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("page", [None, 16, 64], ids=lambda p: f"page{p}" if p else "contiguous")
@pytest.mark.parametrize("splits", [1, 3])
def test_decode_matches_loop_reference(dtype, page, splits):
    run_case(dtype, page=page, splits=splits, causal=True)


@pytest.mark.parametrize("splits", [1, 3])
def test_a_pool_of_one_page(splits):
    """A paged cache whose pool is one page: Triton compiles the pool's row count (1) as a constant, and the
    kernel's clamp of a page to the pool's last one failed to compile on a GPU (2026-12-07)."""
    run_case(torch.float16, B=1, Snew=2, cap=64, page=64, spare_pages=0, lens=[40], rotary="neox", splits=splits,
             causal=True)


@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("Sq", [1, 3])
def test_gqa_groups_and_speculative_queries(group, Sq):
    run_case(PRECISE_DTYPE, Hq=2 * group, Hkv=2, Sq=Sq, Snew=Sq, page=16, splits=2, causal=True)


@pytest.mark.parametrize("rotary", ["interleaved", "neox"])
@pytest.mark.parametrize("causal", [True, False])
def test_rotary_with_append(rotary, causal):
    run_case(PRECISE_DTYPE, Sq=2, Snew=2, rotary=rotary, causal=causal, page=16)


def test_append_crosses_page_boundaries_ragged():
    # lengths 13, 30, 47 with 5 new tokens cross 16-row pages; 256-row pages hold everything in one
    for page in (16, 256):
        run_case(PRECISE_DTYPE, B=3, Sq=5, Snew=5, lens=[13, 30, 47], page=page, cap=64, splits=3, causal=True,
                 rotary="neox")


def test_batch_idx_and_leftpad():
    run_case(torch.float32, B=3, batch_idx=[4, 0, 2], extra_rows=2, leftpad=[3, 0, 20], lens=[40, 9, 60],
             causal=True, splits=2)


@pytest.mark.parametrize("lane", [False, True])
@pytest.mark.parametrize("case", ["window", "leftpad", "window-append-more-than-sq"])
def test_pages_the_kernels_never_touch_may_hold_anything(case, lane, monkeypatch):
    """A serving engine frees the pages behind a sliding window or before the left padding (flash-attn never
    reads them): their block_table entries may hold anything (-1, a huge index), and the call runs (the
    interpreter's bounds check proves nothing there is read). An entry of a page the kernels touch is refused."""
    monkeypatch.setattr(_decode_lane, "LANE", lane)
    B, Sq, Hq, Hkv, D, page, cap = 3, 2, 4, 2, 16, 16, 128
    Snew = 5 if case == "window-append-more-than-sq" else Sq
    window = (-1, -1) if case == "leftpad" else (19, 0)
    lens = torch.tensor([100, 77, 40], dtype=torch.int32)
    leftpad = torch.tensor([70, 33, 17], dtype=torch.int32) if case == "leftpad" else None
    end = lens.long() + Snew
    first = leftpad.long() if leftpad is not None else end - Sq - window[0]
    first = torch.minimum(first, lens.long())  # the appended positions are written
    kc, vc, bt = make_cache(B, Hkv, D, cap, PRECISE_DTYPE, page, seed=int(torch.randint(2**31, ())))
    bt = bt.cpu()
    freed = torch.arange(bt.shape[1])[None, :] * page + page <= first[:, None]  # (B, pages) wholly before first
    assert freed.sum(1).min() >= 1, freed  # every sequence has a freed page
    bt[freed] = torch.tensor([-1, 10**6, -(2**30)]).repeat(B, bt.shape[1])[: B, : bt.shape[1]][freed].int()
    bt = bt.to(DEVICE)
    q = rand(B, Sq, Hq, D, dtype=PRECISE_DTYPE)
    k, v = rand(B, Snew, Hkv, D, dtype=PRECISE_DTYPE), rand(B, Snew, Hkv, D, dtype=PRECISE_DTYPE)
    lp = leftpad.to(DEVICE) if leftpad is not None else None
    ref = loop_reference(q, kc, vc, k, v, lens=lens, leftpad=lp, block_table=bt.cpu(), causal=True, window=window)
    out_e, lse_e = (t.to(DEVICE) for t in loop_reference(q, kc, vc, k, v, lens=lens, leftpad=lp, block_table=bt.cpu(),
                                                         causal=True, window=window, dtype=PRECISE_DTYPE)[:2])
    kc0, vc0 = kc.clone(), vc.clone()
    args = dict(cache_seqlens=lens.to(DEVICE), cache_leftpad=lp, block_table=bt, causal=True, window_size=window,
                num_splits=2, return_softmax_lse=True)
    for _ in range(2):  # (the second call: a lane's, where on)
        kc.copy_(kc0), vc.copy_(vc0)
        out, lse = flashtx.flash_attn_with_kvcache(q, kc, vc, k, v, **args)
        assert_close_to_reference("out", out, ref[0].to(DEVICE), out_e)
        assert_close_to_reference("lse", lse, ref[1].to(DEVICE), lse_e)
        assert torch.equal(kc.cpu(), ref[2].to(PRECISE_DTYPE)) and torch.equal(vc.cpu(), ref[3].to(PRECISE_DTYPE))
    touched = (~freed).int().argmax(1)  # each sequence's first page in use
    bt[1, touched[1]] = -1
    with pytest.raises(ValueError, match=rf"block_table\[1, {int(touched[1])}\] = -1 is not a page index"):
        flashtx.flash_attn_with_kvcache(q, kc, vc, k, v, **args)


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_a_cache_with_more_rows_than_the_batch_serves_its_first_rows(backend):
    """Without cache_batch_idx, sequence b uses cache row b (flash-attn's rule): a cache allocated for a larger
    batch serves a smaller one, and its rows past B are left bit-identical (run_case checks)."""
    run_case(PRECISE_DTYPE, B=2, extra_rows=3, lens=[40, 9], causal=True, splits=2, rotary="neox", backend=backend)
    a = _args(page=None)
    a.pop("block_table")
    with pytest.raises(ValueError, match=r"k_cache has 1 rows but q's batch is 2: the cache needs at least B rows"):
        flashtx.flash_attn_with_kvcache(**dict(a, k_cache=a["k_cache"][:1], v_cache=a["v_cache"][:1]))
    run_case(PRECISE_DTYPE, B=2, leftpad=[5, 17], lens=[40, 60], page=16, causal=True, splits=4, rotary="neox")


@pytest.mark.parametrize("splits", [1, 2, 5, 0])
def test_splits_heuristic_and_many(splits):
    run_case(PRECISE_DTYPE, B=2, cap=160, lens=[150, 3], Snew=0, splits=splits, causal=True)


def test_window_softcap_alibi():
    alibi = torch.rand(2, 4, dtype=torch.float32).to(DEVICE)
    run_case(PRECISE_DTYPE, B=2, Sq=3, Snew=3, window=(20, 0), softcap=5.0, alibi=alibi, splits=3, page=16)
    run_case(torch.float32, B=2, Sq=2, Snew=1, window=(10, 1), alibi=alibi[0], splits=2)


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("rotary", ["interleaved", "neox"])
def test_rotary_tables_in_q_dtype(dtype, rotary):
    """rotary_cos/rotary_sin in q's dtype, as flash-attn's flash_attn_with_kvcache requires them (fp16/bf16 tables:
    the drop-in's common case; the other tests pass float32 tables): the append kernel reads them as they are."""
    run_case(dtype, Sq=2, Snew=2, rotary=rotary, causal=True, page=16, splits=2, tables=dtype)


def test_features_in_half_precision():
    """The feature tests' cases in float16 (they run PRECISE_DTYPE): GQA with speculative queries, an
    interleaved-RoPE append across pages, splits; cache_batch_idx, leftpad, NeoX RoPE; window, softcap, ALiBi."""
    run_case(HALF, Hq=8, Hkv=2, Sq=3, Snew=3, page=16, splits=2, causal=True, rotary="interleaved")
    run_case(HALF, B=3, batch_idx=[4, 0, 2], extra_rows=2, leftpad=[3, 0, 20], lens=[40, 9, 60], causal=True,
             splits=2, rotary="neox")
    run_case(HALF, B=2, Sq=3, Snew=3, window=(20, 0), softcap=5.0, alibi=torch.rand(2, 4).to(DEVICE), splits=3,
             page=16)


def test_rows_that_see_no_key_give_zero_and_neg_inf():
    # leftpad == end: sequence 0 has no keys; window (0, 0) with Sq > keys of seq 1 leaves early rows empty
    out, lse = run_case(PRECISE_DTYPE, B=2, Sq=3, Snew=0, lens=[30, 2], leftpad=[30, 0], causal=True, splits=4)
    assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.isneginf(lse[0]).all()
    assert torch.isneginf(lse[1, :, 0]).all() and torch.equal(out[1, 0], torch.zeros_like(out[1, 0]))


@pytest.mark.parametrize("lane", [True, False], ids=["lane", "general-path"])
def test_outputs_fully_written_with_poisoned_allocations(lane, monkeypatch):
    """Allocations NaN-filled (conftest.poisoned_allocations), in a kernel dtype: every element of out and lse must be
    written, the rows that see no key too (all of sequence 0: leftpad == its end; query 0 of sequence 1, causal with
    two keys and three queries), with splits that get no keys. The lane (flashtx._decode_lane) allocates its
    outputs with torch.empty, the general path (LANE off: flashtx._decode_op's ops) with q.new_empty."""
    monkeypatch.setattr(_decode_lane, "LANE", lane)
    with poisoned_allocations():
        out, lse = run_case(HALF, B=3, Sq=3, Snew=1, lens=[40, 1, 60], leftpad=[41, 0, 10], page=16, splits=3,
                            causal=True, rotary="neox")
    assert torch.isfinite(out).all(), "out: unwritten (NaN) elements"
    assert not torch.isnan(lse).any(), "lse: unwritten (NaN) elements"
    assert torch.isneginf(lse[0]).all() and torch.equal(out[0], torch.zeros_like(out[0]))  # the rows without keys
    assert torch.isneginf(lse[1, :, 0]).all() and torch.equal(out[1, 0], torch.zeros_like(out[1, 0]))
    assert torch.isfinite(lse[1, :, 1:]).all() and torch.isfinite(lse[2]).all()


def test_triton_and_reference_backends_agree():
    for backend in ("triton", "reference"):
        run_case(PRECISE_DTYPE, Sq=2, Snew=2, page=16, splits=2, causal=True, rotary="interleaved", backend=backend)


def test_cache_as_bhsd_buffers_viewed_bshd():
    """flashtx.nn's (B, Hkv, S, D) buffers, viewed as (B, S, Hkv, D): strides only, no copies."""
    B, Hkv, S, D, dt = 2, 2, 40, 16, PRECISE_DTYPE
    kb, vb = rand(B, Hkv, S, D, dtype=dt), rand(B, Hkv, S, D, dtype=dt)
    q, k, v = rand(B, 1, 4, D, dtype=dt), rand(B, 1, Hkv, D, dtype=dt), rand(B, 1, Hkv, D, dtype=dt)
    lens = torch.tensor([10, 30], dtype=torch.int32).to(DEVICE)
    ref = loop_reference(q, kb.transpose(1, 2), vb.transpose(1, 2), k, v, lens=lens, causal=True)
    kbe, vbe = kb.clone(), vb.clone()
    out = flashtx.flash_attn_with_kvcache(q, kb.transpose(1, 2), vb.transpose(1, 2), k, v, cache_seqlens=lens,
                                         causal=True, num_splits=2)
    assert _decode_op.select(q, kb.transpose(1, 2), vb.transpose(1, 2), None) == "triton"  # (not the reference)
    eager = flashtx.flash_attn_with_kvcache(q, kbe.transpose(1, 2), vbe.transpose(1, 2), k, v, cache_seqlens=lens,
                                           causal=True, backend="reference")
    assert_close_to_reference("out", out, ref[0].to(DEVICE), eager)
    assert torch.equal(kb.transpose(1, 2).cpu().double(), ref[2]) and torch.equal(vb.transpose(1, 2).cpu().double(),
                                                                                   ref[3])


# ----------------------------------------------------------------------------------------- errors
def _args(B=2, page=16):
    kc, vc, bt = make_cache(B, 2, 16, 64, torch.float32, page)
    q, k, v = rand(B, 1, 4, 16, dtype=torch.float32), rand(B, 1, 2, 16, dtype=torch.float32), \
        rand(B, 1, 2, 16, dtype=torch.float32)
    return dict(q=q, k_cache=kc, v_cache=vc, k=k, v=v, block_table=bt,
                cache_seqlens=torch.tensor([3, 10], dtype=torch.int32).to(DEVICE))


@pytest.mark.parametrize("change, error, match", [
    (lambda a: a.update(cache_seqlens=torch.tensor([3, 64], dtype=torch.int32)), ValueError, "cache_seqlens\\[1\\]"),
    (lambda a: a["block_table"].__setitem__((1, 0), 999), ValueError, "block_table\\[1, 0\\] = 999"),
    (lambda a: a["block_table"].__setitem__((0, 0), -1), ValueError, "block_table\\[0, 0\\] = -1"),
    (lambda a: a.update(k_cache=a["k_cache"].half()), TypeError, "k_cache must have q's dtype"),
    (lambda a: a.update(cache_seqlens=a["cache_seqlens"].float()), TypeError, "cache_seqlens must be an int32"),
    (lambda a: a.update(k_cache=a["k_cache"].new_zeros(12, 24, 2, 16), v_cache=a["v_cache"].new_zeros(12, 24, 2, 16)),
     ValueError,
     "multiple of 16; got 24"),
    (lambda a: a.update(k_cache=a["k_cache"].to("meta")), ValueError, "k_cache must be on q's device"),
    (lambda a: a.update(cache_batch_idx=torch.zeros(2, dtype=torch.int32)), ValueError, "cache_batch_idx cannot"),
    (lambda a: a.update(v=None), ValueError, "k and v together"),
    (lambda a: a.update(cache_leftpad=torch.tensor([0, 12], dtype=torch.int32)), ValueError,
     r"cache_leftpad\[1\] = 12 must be in \[0, 11\] \(cache_seqlens\[1\] \+ the 1 new tokens\)"),
    (lambda a: a.update(rotary_cos=torch.ones(5, 4, dtype=torch.int64), rotary_sin=torch.ones(5, 4)), TypeError,
     r"rotary_cos must be a float tensor \(seqlen_ro, rotary_dim / 2\); got dtype torch.int64"),
    (lambda a: a.update(rotary_cos=torch.ones(5), rotary_sin=torch.ones(5)), ValueError,
     r"rotary_cos must be a float tensor \(seqlen_ro, rotary_dim / 2\); got shape \(5,\)"),
    (lambda a: a.update(k_cache=a["k_cache"][:, :, :0], v_cache=a["v_cache"][:, :, :0], k=a["k"][:, :, :0],
                        v=a["v"][:, :, :0]), ValueError, "k_cache and v_cache need at least 1 kv head"),
    (lambda a: a.update(rotary_cos=torch.ones(5, 4), rotary_sin=torch.ones(5, 4)), ValueError,
     "rotary_cos/rotary_sin have 5 positions"),
    (lambda a: a.update(num_splits=-1), ValueError, "num_splits"),
    (lambda a: a.update(block_table=a["block_table"][0]), ValueError,
     r"block_table must have shape \(B, max_pages_per_seq\) = \(2, any\); got \(4,\)"),
    (lambda a: a.update(block_table=a["block_table"].short()), TypeError, r"block_table must be an int32 \(or int64\)"),
    (lambda a: a.update(q=a["q"][..., :0], k_cache=a["k_cache"][..., :0], k=a["k"][..., :0]), ValueError,
     "head dim >= 1; got 0"),
    # sparse and nested tensors: the layout named (they were let through to the kernels' launchers)
    (lambda a: a.update(k_cache=a["k_cache"].to_sparse()), TypeError, "k_cache has layout torch.sparse_coo"),
    (lambda a: a.update(v=a["v"].to_sparse()), TypeError, "v has layout torch.sparse_coo"),
    (lambda a: a.update(k_cache=torch.nested.nested_tensor(list(a["k_cache"]))), TypeError,
     "k_cache is a nested tensor"),
    (lambda a: a.update(cache_seqlens=a["cache_seqlens"].to_sparse()), TypeError,
     "cache_seqlens has layout torch.sparse_coo"),
    (lambda a: a.update(block_table=a["block_table"].to_sparse()), TypeError,
     "block_table has layout torch.sparse_coo"),
])
@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_bad_input_names_the_argument(change, error, match):
    a = _args()
    change(a)
    kc0 = a["k_cache"].clone()
    with pytest.raises(error, match=match):
        flashtx.flash_attn_with_kvcache(**a)
    if a["k_cache"].device.type != "meta" and a["k_cache"].layout is torch.strided and not a["k_cache"].is_nested:
        assert torch.equal(a["k_cache"], kc0), "a refused call must not write"


@pytest.mark.parametrize("B", [1, 2])
def test_a_page_listed_twice_cannot_receive_two_new_tokens_in_one_row(B):
    """Host-side (CPU tensors; a GPU caller must ensure it): a sequence whose block table lists one page twice
    would append two tokens to one row; refused for one sequence too (it was checked only when B > 1)."""
    a = {n: t.cpu() if isinstance(t, torch.Tensor) else t for n, t in _args(B=B).items()}
    a["block_table"][0, 1] = a["block_table"][0, 0]
    a.update(cache_seqlens=torch.zeros(B, dtype=torch.int32), k=a["k"].expand(B, 17, 2, 16),
             v=a["v"].expand(B, 17, 2, 16))  # positions 0..16 of sequence 0: rows 0..15 of the page, then row 0
    with pytest.raises(ValueError, match="two new tokens would be appended to the same page row"):
        flashtx.flash_attn_with_kvcache(**a)


def test_contiguous_errors():
    a = _args(page=None)
    a.pop("block_table")
    with pytest.raises(ValueError, match="cache_batch_idx\\[0\\] = 7"):
        flashtx.flash_attn_with_kvcache(**a, cache_batch_idx=torch.tensor([7, 0], dtype=torch.int32))
    with pytest.raises(ValueError, match="must not repeat"):
        flashtx.flash_attn_with_kvcache(**a, cache_batch_idx=torch.tensor([1, 1], dtype=torch.int32))


def test_refuses_grad():
    a = _args()
    a["q"].requires_grad_(True)
    with pytest.raises(RuntimeError, match="inference-only"):
        flashtx.flash_attn_with_kvcache(**a)
    with torch.no_grad():
        flashtx.flash_attn_with_kvcache(**a)


def test_strided_index_tensors_are_read_by_value():
    """cache_seqlens / cache_batch_idx / cache_leftpad / block_table / rotary tables given as strided views
    (an outside review: the kernels read them flat, so a [::2] view of validated values appended at position
    50 of a 32-slot cache, outside the buffer). Same answer as contiguous copies, nothing written outside."""
    torch.manual_seed(8)
    B, H, D, cap = 2, 1, 16, 32
    big_k, big_v = torch.zeros(B, 64, H, D, device=DEVICE), torch.zeros(B, 64, H, D, device=DEVICE)
    kc, vc = big_k[:, :cap], big_v[:, :cap]  # the caches: 32 positions of 64-long rows
    lens = torch.tensor([4, 50, 6, 50], dtype=torch.int32, device=DEVICE)[::2]  # values [4, 6]
    q, k, v = (torch.randn(B, 1, H, D, device=DEVICE) for _ in range(3))
    cos, sin = (torch.randn(16, cap, device=DEVICE).t()[:, :4] for _ in range(2))  # (32, 4), column-major
    with torch.no_grad():
        out = flashtx.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=lens, rotary_cos=cos, rotary_sin=sin,
                                              causal=True, backend="triton")
        kc2, vc2 = torch.zeros(B, cap, H, D, device=DEVICE), torch.zeros(B, cap, H, D, device=DEVICE)
        want = flashtx.flash_attn_with_kvcache(q, kc2, vc2, k, v, cache_seqlens=lens.contiguous(),
                                               rotary_cos=cos.contiguous(), rotary_sin=sin.contiguous(),
                                               causal=True, backend="triton")
    assert torch.equal(big_k[:, cap:], torch.zeros_like(big_k[:, cap:]))  # nothing past the cache
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)
    assert torch.equal(out, want)


def test_column_sliced_rotary_tables_are_read_in_place():
    """flash-attn's cos[:, :rotary_dim // 2] of a wider table (unit column stride, a longer row stride) is read with
    its row stride, as the kernels read any table: no copy of the whole table per step (an audit: two (seqlen_ro,
    rotary_dim / 2) copies per layer and token), the step's lane serves it, and the answer is the copies'."""
    torch.manual_seed(9)
    B, H, D, cap = 2, 2, 16, 32
    q, k, v = (torch.randn(B, 1, H, D, device=DEVICE) for _ in range(3))
    lens = torch.tensor([4, 9], dtype=torch.int32, device=DEVICE)
    cos, sin = (torch.randn(cap, 16, device=DEVICE)[:, :4] for _ in range(2))  # rotary_dim 8 of a 32-wide table
    results = []
    for tables in ((cos, sin), (cos, sin), (cos.contiguous(), sin.contiguous())):
        kc, vc = torch.zeros(B, cap, H, D, device=DEVICE), torch.zeros(B, cap, H, D, device=DEVICE)
        with torch.no_grad(), torch.autograd.profiler.profile() as prof:
            out = flashtx.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=lens, rotary_cos=tables[0],
                                                  rotary_sin=tables[1], causal=True, backend="triton")
        assert "aten::clone" not in {e.name for e in prof.function_events}
        results.append((out, kc, vc))
    for got in results[:2]:
        for a, b in zip(got, results[2]):
            assert torch.equal(a, b)
    from flashtx import _lanes
    sliced = [lane for key, lane in _lanes.TABLE.items() if key[0] == "decode" and key[5][4][3] == cos.stride()]
    assert sliced and all(sliced)  # planned for the sliced tables (a lane, not False: the general path's)


def test_an_int_cache_seqlens_past_the_cache_names_the_argument():
    q = torch.randn(2, 1, 2, 16, device=DEVICE)
    kc, vc = torch.randn(2, 32, 2, 16, device=DEVICE), torch.randn(2, 32, 2, 16, device=DEVICE)
    for bad in (2**40, -1, 32):
        with pytest.raises(ValueError, match=rf"cache_seqlens = {bad}: with the 1 new tokens it must stay within "
                                             r"the cache's 32 positions"):
            flashtx.flash_attn_with_kvcache(q, kc, vc, kc[:, :1].clone(), vc[:, :1].clone(), cache_seqlens=bad)


def test_appending_without_cache_seqlens_is_refused_by_name():
    """cache_seqlens=None means every cache is full (flash-attn's rule), so new k/v have nowhere to go: flash-attn
    requires cache_seqlens with k, v; the message must name it (not an entry of a tensor the caller never passed)."""
    q = torch.randn(2, 1, 2, 16, device=DEVICE)
    kc, vc = torch.randn(2, 32, 2, 16, device=DEVICE), torch.randn(2, 32, 2, 16, device=DEVICE)
    before = kc.clone(), vc.clone()
    with pytest.raises(ValueError, match=r"cache_seqlens is None \(each cache full: 32 positions\) but 1 new k/v"):
        flashtx.flash_attn_with_kvcache(q, kc, vc, kc[:, :1].clone(), vc[:, :1].clone())
    assert torch.equal(kc, before[0]) and torch.equal(vc, before[1])
    out = flashtx.flash_attn_with_kvcache(q, kc, vc)  # without new tokens None stays the whole cache
    want, eager = (reference.attention(*(t.transpose(1, 2).to(dt) for t in (q, kc, vc))).transpose(1, 2)
                   for dt in (torch.float64, q.dtype))
    assert_close_to_reference("out", out, want, eager)


@pytest.mark.parametrize("dtype, D, tf32, halves", [
    (torch.float32, 64, False, True), (torch.float32, 48, False, True), (torch.float32, 32, False, True),
    (torch.float64, 64, False, True), (torch.float32, 16, False, False), (torch.float32, 128, False, False),
    (torch.float32, 64, True, False), (torch.float16, 64, False, False)], ids=str)
def test_fp32_scores_are_two_half_dots(dtype, D, tf32, halves):
    """Inputs as wide as the accumulator dot q.k as two half-D chains (DOT_HALVES), 32- and 64-wide tiles only; half
    types and TF32 one dot. Both tile sets: the interpreter's and sm_86's."""
    from flashtx.triton_kernels import decode
    from flashtx.triton_kernels.configs import INTERPRETER_TARGET, KNOWN_TARGETS
    # set and restored by hand: pytest >= 9.2's monkeypatch deletes on undo an attribute that torch's cuBLASModule
    # serves through __getattr__ (not in its __dict__), which that module refuses (an error at teardown)
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = tf32
    try:
        q, out = torch.empty(1, 3, 6, D, dtype=dtype), torch.empty(1, 3, 6, D, dtype=dtype)
        kc = torch.empty(1, 70, 1, D, dtype=dtype)
        for target in (INTERPRETER_TARGET, KNOWN_TARGETS[86]):
            launches = decode.plan_decode(q, kc, kc, out, torch.empty(1, 6, 3), None, None, None, None, None,
                                          scale=D ** -0.5, causal=True, num_splits=2, snew=70, target=target)
            assert launches[0].args["DOT_HALVES"] is halves, target
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev
