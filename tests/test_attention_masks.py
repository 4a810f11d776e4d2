"""Sliding windows, padding masks and lengths through the attention kernels (varlen: test_attention_varlen.py).

Every case runs the real Triton kernels (interpreter on CPU, CUDA on a GPU), forward and
backward, against the float64 reference with an explicit (B, Sq, Sk) visibility mask
(flashtx.reference.visibility), under the tolerance rule of conftest.assert_close_to_reference,
with NaN-poisoned allocations so unwritten rows fail.
"""
import dataclasses

import pytest
import torch
import triton
import triton.language as tl
from conftest import (DEVICE, KERNEL_DTYPES, ON_GPU, PRECISE_DTYPE, assert_close_to_reference, dtype_id,
                      poisoned_allocations, precise_atol, randn, to64, to_dtype)

import flashtx
from flashtx import reference
from flashtx.triton_kernels.attention_common import kv_loop_bounds, q_loop_bounds


@dataclasses.dataclass(frozen=True)
class MCase:
    name: str
    sq: int
    sk: int
    hq: int = 2
    hkv: int = 2
    causal: bool = False
    window: tuple = (-1, -1)
    shell: str = "flash"  # "flash": (B, S, H, D), bottom-right; "sdpa": (B, H, S, D), top-left
    key_mask: str = ""  # "", "random", "left" (left padding), "empty-row" (batch 1 all padding)
    query_mask: str = ""
    kv_lens: tuple | None = None
    q_lens: tuple | None = None
    b: int = 2
    d: int = 32


CASES = [
    MCase("window-self", 150, 150, window=(37, 11)),
    MCase("window-causal", 150, 150, causal=True, window=(40, -1)),
    MCase("window-left-only-cross-gqa", 70, 190, hq=4, hkv=2, window=(50, -1)),
    MCase("window-right-only-sq-gt-sk", 190, 70, window=(-1, 9)),
    MCase("window-zero-diagonal", 64, 64, window=(0, 0), b=1),
    MCase("sdpa-window-causal-top-left", 90, 150, causal=True, window=(30, -1), shell="sdpa"),
    MCase("sdpa-window-both", 150, 90, window=(12, 20), shell="sdpa", hq=4, hkv=1),
    MCase("key-mask-random-gqa", 77, 130, hq=4, hkv=2, key_mask="random"),
    MCase("key-mask-left-padding-causal", 100, 100, causal=True, key_mask="left", query_mask="left"),
    MCase("query-mask-cross", 130, 60, query_mask="random", shell="sdpa"),
    MCase("all-padding-batch-row", 70, 90, key_mask="empty-row", query_mask="random", causal=True),
    MCase("kv-lens-gqa", 40, 150, hq=4, hkv=1, kv_lens=(150, 33)),
    MCase("lens-causal-bottom-right-per-sequence", 120, 150, causal=True, q_lens=(120, 45), kv_lens=(97, 150)),
    MCase("lens-zero-length", 60, 60, q_lens=(60, 0, 41), kv_lens=(0, 60, 55), causal=True, b=3),
    MCase("sdpa-encoder-decoder-both-padded", 70, 130, hq=4, hkv=2, shell="sdpa", q_lens=(50, 70),
          kv_lens=(130, 61)),
    MCase("sdpa-lens-causal-top-left", 90, 90, causal=True, shell="sdpa", q_lens=(90, 31), kv_lens=(64, 90)),
    MCase("everything", 130, 110, hq=4, hkv=2, causal=True, window=(45, -1), key_mask="random",
          query_mask="random", q_lens=(130, 100), kv_lens=(90, 110)),
]
# fp64 and fp32 for every case would double the interpreter time: fp16 (where the tolerance rule
# has teeth) for all, the other kernel dtypes for a representative few.
FULL_DTYPE_CASES = {"window-causal", "key-mask-left-padding-causal", "lens-causal-bottom-right-per-sequence",
                    "everything"}


def seq_mask(kind: str, b: int, s: int) -> torch.Tensor | None:
    if not kind:
        return None
    if kind == "random":
        m = torch.rand(b, s, device=DEVICE) > 0.3
    elif kind == "left":  # batch row r starts with 7 * r padding tokens (batched generation)
        m = torch.arange(s, device=DEVICE)[None, :] >= 7 * torch.arange(b, device=DEVICE)[:, None] + 3
    elif kind == "empty-row":
        m = torch.rand(b, s, device=DEVICE) > 0.3
        m[1] = False
    else:
        raise KeyError(kind)
    return m


def case_inputs(case: MCase, dtype):
    if case.shell == "flash":
        shapes = [(case.b, case.sq, case.hq, case.d), (case.b, case.sk, case.hkv, case.d),
                  (case.b, case.sk, case.hkv, case.d)]
    else:
        shapes = [(case.b, case.hq, case.sq, case.d), (case.b, case.hkv, case.sk, case.d),
                  (case.b, case.hkv, case.sk, case.d)]
    q, k, v = (randn(*s, dtype=dtype, requires_grad=True) for s in shapes)
    lens = lambda t: torch.tensor(t, device=DEVICE) if t is not None else None  # noqa: E731
    kw = dict(key_mask=seq_mask(case.key_mask, case.b, case.sk), query_mask=seq_mask(case.query_mask, case.b, case.sq),
              kv_lens=lens(case.kv_lens), q_lens=lens(case.q_lens))
    return q, k, v, kw


def run_case(case: MCase, q, k, v, kw, backend="triton"):
    if case.shell == "flash":
        return flashtx.flash_attn_func(q, k, v, causal=case.causal, window_size=case.window, backend=backend, **kw)
    return flashtx.attention(q, k, v, is_causal=case.causal, window_size=case.window, enable_gqa=True,
                             backend=backend, **kw)


def case_visibility(case: MCase, kw) -> torch.Tensor:
    return reference.visibility(case.sq, case.sk, batch=case.b, causal=case.causal, bottom_right=case.shell == "flash",
                                window=case.window, device=DEVICE, **kw)


def reference_case(case: MCase, q, k, v, vis):
    if case.shell == "flash":
        return reference.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), vis=vis).transpose(1, 2)
    return reference.attention(q, k, v, vis=vis)


PARAMS = [pytest.param(c, dt, id=f"{c.name}-{dtype_id(dt)}") for c in CASES for dt in KERNEL_DTYPES
          if c.name in FULL_DTYPE_CASES or dt == KERNEL_DTYPES[0]]


@pytest.mark.parametrize("case,dtype", PARAMS)
def test_masked_forward_backward_match_reference(case, dtype):
    torch.manual_seed(sum(map(ord, case.name)))
    q, k, v, kw = case_inputs(case, dtype)
    with poisoned_allocations():
        out = run_case(case, q, k, v, kw)
        do = randn(*out.shape, dtype=dtype)
        grads = torch.autograd.grad(out, (q, k, v), do)
    vis = case_visibility(case, kw)
    assert vis.any(), "a case where nothing is visible tests nothing"
    q64, k64, v64 = to64(q, k, v)
    ref = reference_case(case, q64, k64, v64, vis)
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), do.to(torch.float64))
    qe, ke, ve = to_dtype(dtype, q, k, v)
    eager = reference_case(case, qe, ke, ve, vis)
    eager_grads = torch.autograd.grad(eager, (qe, ke, ve), do)
    assert_close_to_reference("out", out, ref, eager)
    scale = max(float(r.abs().max()) for r in ref_grads)
    for name, g, r, e in zip(("dq", "dk", "dv"), grads, ref_grads, eager_grads):
        assert_close_to_reference(name, g, r, e, grad=True, scale=scale)

    # rows that see no key, and keys no row sees, are exactly 0 (not NaN, not tiny)
    seq = 1 if case.shell == "flash" else 2  # the sequence dim of the shell's layout
    empty_rows = ~vis.any(-1)  # (B, Sq)
    unseen_keys = ~vis.any(-2)  # (B, Sk)
    for t, mask in ((out, empty_rows), (grads[0], empty_rows), (grads[1], unseen_keys), (grads[2], unseen_keys)):
        sel = t.movedim(seq, 1)[mask]  # (n, H, D) or (n, D)... rows of masked positions
        assert torch.isfinite(t).all() and (sel == 0).all()


def test_all_padding_batch_row_gives_zero_output_and_gradients_not_nan():
    torch.manual_seed(11)
    dtype = KERNEL_DTYPES[0]
    q = randn(3, 40, 2, 16, dtype=dtype, requires_grad=True)
    k = randn(3, 56, 2, 16, dtype=dtype, requires_grad=True)
    v = randn(3, 56, 2, 16, dtype=dtype, requires_grad=True)
    key_mask = torch.ones(3, 56, dtype=torch.bool, device=DEVICE)
    key_mask[1] = False
    for kw in (dict(key_mask=key_mask), dict(kv_lens=torch.tensor([56, 0, 20], device=DEVICE)),
               dict(q_lens=torch.tensor([40, 0, 40], device=DEVICE))):
        with poisoned_allocations():
            out = flashtx.flash_attn_func(q, k, v, causal=True, backend="triton", **kw)
            gq, gk, gv = torch.autograd.grad(out.float().sum(), (q, k, v))
        for t in (out, gq, gk, gv):
            assert torch.isfinite(t).all()
        assert (out[1] == 0).all() and (gq[1] == 0).all() and (gk[1] == 0).all() and (gv[1] == 0).all()
        assert (out[0].abs().sum(-1) > 0).all()


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_sdpa_shell_window_and_key_mask_match_torch_sdpa(causal):
    """Same numbers as torch's SDPA given the equivalent explicit boolean attn_mask (top-left
    window i - 8 <= j <= i + 6, or <= i when causal), rows with no visible key excluded (SDPA
    gives NaN there, flashtx 0)."""
    torch.manual_seed(12)
    q = randn(2, 4, 45, 16, dtype=torch.float64)
    k = randn(2, 2, 60, 16, dtype=torch.float64)
    v = randn(2, 2, 60, 16, dtype=torch.float64)
    key_mask = torch.rand(2, 60, device=DEVICE) > 0.3
    i, j = torch.arange(45, device=DEVICE)[:, None], torch.arange(60, device=DEVICE)[None, :]
    mask = ((j >= i - 8) & (j <= i + (0 if causal else 6)))[None, None] & key_mask[:, None, None, :]
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    ref = torch.where(mask.any(-1, keepdim=True), ref, 0.0)
    if DEVICE == "cuda":
        q, k, v = q.float(), k.float(), v.float()
    out = flashtx.attention(q, k, v, is_causal=causal, window_size=(8, 6), key_mask=key_mask, enable_gqa=True,
                            backend="triton")
    assert torch.allclose(out.double(), ref, atol=1e-5 if DEVICE == "cuda" else 1e-12)


def test_kv_lens_equal_key_mask_equal_truncation():
    """Right padding three ways: kv_lens, the matching key_mask, and slicing the padding off."""
    torch.manual_seed(13)
    dtype = KERNEL_DTYPES[0]
    q, k, v = (randn(2, s, 2, 32, dtype=dtype) for s in (33, 70, 70))
    lens = torch.tensor([70, 29], device=DEVICE)
    a = flashtx.flash_attn_func(q, k, v, kv_lens=lens, backend="triton")
    b = flashtx.flash_attn_func(q, k, v, key_mask=torch.arange(70, device=DEVICE)[None] < lens[:, None],
                                backend="triton")
    c = flashtx.flash_attn_func(q[1:], k[1:, :29], v[1:, :29], backend="triton")
    # each of the three against the float64 reference of the right-padded batch, under the rule
    vis = reference.visibility(33, 70, batch=2, kv_lens=lens, device=DEVICE)

    def ref(q, k, v):
        return reference.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), vis=vis).transpose(1, 2)

    r, e = ref(*to64(q, k, v)), ref(q, k, v)
    assert_close_to_reference("kv_lens", a, r, e)
    assert_close_to_reference("key_mask", b, r, e)
    assert_close_to_reference("truncated", c, r[1:], e[1:])
    # and they agree with each other: in fp16 the rule's bound (2 x eager's fp16 error + 2 ulps at max |out|, ~7e-3)
    # is looser than the agreement the three paths of one kernel have. The interpreter runs the same tiles on the same
    # keys all three ways: bitwise equal (seen); a GPU may tile the truncated call otherwise: fp32 accumulation order
    # then shows as ~1 fp16 ulp
    if ON_GPU:
        assert torch.allclose(a.float(), b.float(), atol=1e-3)
        assert torch.allclose(a[1:].float(), c.float(), atol=1e-3)
    else:
        assert torch.equal(a, b) and torch.equal(a[1:], c)


# ----------------------------------------------------------------------------------------------
# Tiles outside the window are skipped: the loop bounds the kernels use, evaluated by the kernel code
# ----------------------------------------------------------------------------------------------
@triton.jit
def _bounds_probe(OUT_KV, OUT_Q, Sq_b, Sk_b, causal_shift, window_shift, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, KEY_MASK: tl.constexpr,
                  N_M: tl.constexpr, N_N: tl.constexpr):
    for t in range(N_M):
        lo, full_lo, full_hi, hi = kv_loop_bounds(t * BLOCK_M, Sq_b, Sk_b, causal_shift, window_shift, BLOCK_M,
                                                  BLOCK_N, CAUSAL, WINDOW, KEY_MASK)
        tl.store(OUT_KV + t * 4 + 0, lo)
        tl.store(OUT_KV + t * 4 + 1, full_lo)
        tl.store(OUT_KV + t * 4 + 2, full_hi)
        tl.store(OUT_KV + t * 4 + 3, hi)
    for t in range(N_N):
        lo, free_lo, free_hi, hi = q_loop_bounds(t * BLOCK_N, Sq_b, Sk_b, causal_shift, window_shift, BLOCK_M,
                                                 BLOCK_N, CAUSAL, WINDOW, KEY_MASK)
        tl.store(OUT_Q + t * 4 + 0, lo)
        tl.store(OUT_Q + t * 4 + 1, free_lo)
        tl.store(OUT_Q + t * 4 + 2, free_hi)
        tl.store(OUT_Q + t * 4 + 3, hi)


def loop_bounds(Sq, Sk, causal_shift, window_shift, bm, bn, causal, window, key_mask=False):
    n_m, n_n = triton.cdiv(max(Sq, 1), bm) + 1, triton.cdiv(max(Sk, 1), bn) + 1  # one tile past the end too
    kv = torch.full((n_m, 4), -7, dtype=torch.int32, device=DEVICE)
    qb = torch.full((n_n, 4), -7, dtype=torch.int32, device=DEVICE)
    _bounds_probe[(1,)](kv, qb, Sq, Sk, causal_shift, window_shift, bm, bn, causal, window, key_mask, n_m, n_n)
    return kv.tolist(), qb.tolist()


def tiles(lo, hi, step):
    return set(range(lo, hi, step)) if hi > lo else set()


@pytest.mark.skipif(DEVICE != "cpu", reason="the probe kernel runs in the interpreter")
@pytest.mark.parametrize("sk", [256, 1024, 4096])
def test_window_tiles_are_skipped_and_cost_scales_with_the_window(sk):
    """The kernels' own loop bounds: every visible (row, key) lies in a visited tile, unmasked tiles
    are fully visible, and each q tile visits about (window + BLOCK_M) / BLOCK_N key tiles (each
    K/V tile about (window + BLOCK_N) / BLOCK_M q tiles), whatever Sk is."""
    bm, bn, left, right = 32, 16, 48, 8
    Sq = sk
    kv, qb = loop_bounds(Sq, sk, right, -left, bm, bn, True, True)
    i = torch.arange(Sq)[:, None]
    j = torch.arange(sk)[None, :]
    vis = (j <= i + right) & (j >= i - left)
    max_kv_tiles = (left + right + bm) // bn + 2
    for t, (lo, full_lo, full_hi, hi) in enumerate(kv[:-1]):
        rows = vis[t * bm:(t + 1) * bm]
        need = torch.nonzero(rows.any(0)).flatten()
        visited = tiles(lo, min(full_lo, hi), bn) | tiles(full_lo, full_hi, bn) | tiles(max(full_lo, full_hi), hi, bn)
        assert {int(n) // bn * bn for n in need} <= visited, f"q tile {t} misses visible keys"
        for n in tiles(full_lo, full_hi, bn):
            assert rows[:, n:n + bn].all(), f"q tile {t}: key tile {n} runs unmasked but is not fully visible"
        assert len(visited) <= max_kv_tiles, f"q tile {t} visits {len(visited)} key tiles, window {left + right}"
    max_q_tiles = (left + right + bn) // bm + 2
    for t, (lo, free_lo, free_hi, hi) in enumerate(qb[:-1]):
        cols = vis[:, t * bn:(t + 1) * bn]
        need = torch.nonzero(cols.any(1)).flatten()
        visited = tiles(lo, min(free_lo, hi), bm) | tiles(free_lo, free_hi, bm) | tiles(max(free_lo, free_hi), hi, bm)
        assert {int(m) // bm * bm for m in need} <= visited, f"key tile {t} misses rows that see it"
        for m in tiles(free_lo, free_hi, bm):
            assert cols[m:m + bm].all(), f"key tile {t}: q tile {m} runs unmasked but is not fully visible"
        assert len(visited) <= max_q_tiles
    total = sum(len(tiles(lo, hi, bn)) for lo, _, _, hi in kv)
    assert total <= (Sq // bm + 1) * max_kv_tiles  # linear in S, not quadratic


@pytest.mark.skipif(DEVICE != "cpu", reason="the probe kernel runs in the interpreter")
def test_lengths_and_key_masks_bound_the_loops():
    """Padding q tiles visit no key tile; padding key tiles are seen by no q tile; a key mask
    leaves no tile unmasked."""
    kv, qb = loop_bounds(70, 100, 0, 0, 32, 16, False, False)
    assert all(hi <= 100 for *_, hi in kv)
    kv, qb = loop_bounds(40, 50, 0, 0, 32, 16, False, False, key_mask=True)
    assert all(full_hi <= full_lo for _, full_lo, full_hi, _ in kv)
    assert all(free_hi <= free_lo for _, free_lo, free_hi, _ in qb)
    # Sq_b = 40 of a 100-row buffer: the q tile at row 64 is all padding
    kv, qb = loop_bounds(40, 50, 0, 0, 32, 16, False, False)
    assert kv[2][3] <= kv[2][0]  # tile 2 (rows 64..95): empty range
    assert qb[4][3] <= qb[4][0]  # key tile 4 (keys 64..79 >= Sk_b = 50): seen by nobody


# ----------------------------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------------------------
def _bshd(b=2, sq=8, sk=8, h=2, d=16):
    return randn(b, sq, h, d), randn(b, sk, h, d), randn(b, sk, h, d)


def _varlen(**kw):
    q, k, v = (randn(10, 2, 16) for _ in range(3))
    cu = torch.tensor([0, 4, 10], dtype=torch.int32, device=DEVICE)
    args = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=6, max_seqlen_k=6)
    args.update(kw)
    return flashtx.flash_attn_varlen_func(q, k, v, **args)


ERRORS = [
    ("key-mask-shape", lambda: flashtx.flash_attn_func(*_bshd(), key_mask=torch.ones(2, 9, dtype=torch.bool,
                                                                                     device=DEVICE)),
     ValueError, r"key_mask must have shape \(B, S\) = \(2, 8\).*got shape \(2, 9\)"),
    ("key-mask-dtype", lambda: flashtx.flash_attn_func(*_bshd(), key_mask=torch.ones(2, 8, device=DEVICE)),
     TypeError, r"key_mask must be a bool tensor \(True = real token\) of shape \(2, 8\); got dtype torch.float32"),
    ("query-mask-shape", lambda: flashtx.attention(*(t.transpose(1, 2) for t in _bshd(sq=5)),
                                                   query_mask=torch.ones(5, dtype=torch.bool, device=DEVICE)),
     ValueError, r"query_mask must have shape \(B, S\) = \(2, 5\).*got shape \(5,\)"),
    ("kv-lens-dtype", lambda: flashtx.flash_attn_func(*_bshd(), kv_lens=torch.tensor([3.0, 4.0], device=DEVICE)),
     TypeError, r"kv_lens must be an int32 or int64 tensor of shape \(2,\); got dtype torch.float32"),
    ("q-lens-shape", lambda: flashtx.attention(*(t.transpose(1, 2) for t in _bshd()),
                                               q_lens=torch.tensor([3], device=DEVICE)),
     ValueError, r"q_lens must have shape \(B,\) = \(2,\); got shape \(1,\)"),
    ("lens-not-tensor", lambda: flashtx.flash_attn_func(*_bshd(), kv_lens=[3, 4]), TypeError,
     r"kv_lens must be None or an int32/int64 tensor of shape \(2,\); got list"),
    ("window-type", lambda: flashtx.attention(*(t.transpose(1, 2) for t in _bshd()), window_size=4), TypeError,
     r"window_size must be a pair \(left, right\)"),
    ("cu-dtype", lambda: _varlen(cu_seqlens_q=torch.tensor([0, 4, 10], device=DEVICE)), TypeError,
     r"cu_seqlens_q must be an int32 tensor \(as flash-attn\); got dtype torch.int64"),
    # zeros are bad cu_seqlens values too: kept on CPU (never bad values on a GPU); the shape check comes first
    ("cu-shape", lambda: _varlen(cu_seqlens_k=torch.zeros(2, 3, dtype=torch.int32)), ValueError,
     r"cu_seqlens_k must have shape \(nseq \+ 1,\).*got shape \(2, 3\)"),
    ("cu-nseq-differ",
     lambda: _varlen(cu_seqlens_k=torch.tensor([0, 10], dtype=torch.int32, device=DEVICE)), ValueError,
     r"same number of sequences; got shapes \(3,\) and \(2,\)"),
    ("max-seqlen", lambda: _varlen(max_seqlen_q=-1), ValueError, r"max_seqlen_q must be an int >= 0"),
    ("max-seqlen-tensor", lambda: _varlen(max_seqlen_k=torch.tensor([6, 6])), TypeError,
     r"max_seqlen_k must be an int or a 0-dim integer tensor"),
    ("max-seqlen-device", lambda: _varlen(max_seqlen_q=torch.tensor(6, device="meta")), ValueError,
     r"max_seqlen_q must be on the inputs' device .* \(or the CPU\); got meta"),
    ("varlen-causal-str", lambda: _varlen(causal="no"), TypeError, r"causal must be a bool; got str 'no'"),
    ("varlen-rank", lambda: flashtx.flash_attn_varlen_func(*_bshd(), torch.zeros(3, dtype=torch.int32),
                                                           torch.zeros(3, dtype=torch.int32), 4, 4),
     ValueError, r"q must be 3-D \(total, H, D\) for varlen; got shape \(2, 8, 2, 16\)"),
    ("varlen-dropout", lambda: _varlen(dropout_p=1.5), ValueError, r"dropout_p must be a float in \[0, 1\)"),
    ("varlen-alibi", lambda: _varlen(alibi_slopes=torch.ones(4, device=DEVICE)), ValueError,
     r"alibi_slopes must have shape \(nheads,\) = \(2,\) or \(batch, nheads\) = \(2, 2\); got \(4,\)"),
]


@pytest.mark.parametrize("make_call,exc,pattern", [e[1:] for e in ERRORS], ids=[e[0] for e in ERRORS])
def test_bad_mask_arguments_get_a_clear_error(make_call, exc, pattern):
    with pytest.raises(exc, match=pattern):
        make_call()


# Bad cu_seqlens / max_seqlen values (10 packed rows: sequences [0, 4) and [4, 10), longest 6). On
# CPU tensors (in both test modes: on a GPU these are checked by a device-side assert, which would
# end the test process) they get a ValueError naming the entry; before this check they read and
# wrote out of bounds or left rows unwritten.
CU_VALUE_ERRORS = [
    ("cu-past-end", dict(cu_seqlens_q=[0, 4, 20]),
     r"cu_seqlens_q\[-1\] must equal total_q \(q.shape\[0\]\) = 10.*got 20"),
    ("cu-short-of-end", dict(cu_seqlens_k=[0, 4, 9]),
     r"cu_seqlens_k\[-1\] must equal total_k \(k.shape\[0\]\) = 10.*got 9"),
    ("cu-negative-start", dict(cu_seqlens_q=[-4, 4, 10]), r"cu_seqlens_q\[0\] must be 0 .*got -4"),
    ("cu-decreasing", dict(cu_seqlens_k=[0, 7, 3, 10]), r"cu_seqlens_k must be non-decreasing.*"
     r"got cu_seqlens_k\[1\] = 7 > cu_seqlens_k\[2\] = 3"),
    # int32 differences wrap to three lengths >= 0 that sum to 10: checked in int64 (it ran the kernels out of bounds)
    ("cu-wraps-int32", dict(cu_seqlens_k=[0, 1431655769, -1431655758, 10]), r"cu_seqlens_k must be non-decreasing.*"
     r"got cu_seqlens_k\[1\] = 1431655769 > cu_seqlens_k\[2\] = -1431655758"),
    ("max-seqlen-q-small", dict(max_seqlen_q=5), r"max_seqlen_q = 5 is less than the longest sequence in "
     r"cu_seqlens_q \(sequence 1: 6 rows\); it must be at least 6"),
    ("max-seqlen-k-small-tensor", dict(max_seqlen_k=torch.tensor(2)), r"max_seqlen_k = 2 is less than the longest"),
]


@pytest.mark.parametrize("bad,pattern", [e[1:] for e in CU_VALUE_ERRORS], ids=[e[0] for e in CU_VALUE_ERRORS])
def test_bad_cu_seqlens_values_get_a_clear_error(bad, pattern):
    q, k, v = (torch.randn(10, 2, 16, dtype=torch.float64) for _ in range(3))
    args = dict(cu_seqlens_q=[0, 4, 10], cu_seqlens_k=[0, 4, 10], max_seqlen_q=6, max_seqlen_k=6) | bad
    if "cu_seqlens_k" in bad and len(bad["cu_seqlens_k"]) == 4:
        args["cu_seqlens_q"] = [0, 4, 6, 10]
    for n in ("cu_seqlens_q", "cu_seqlens_k"):
        args[n] = torch.tensor(args[n], dtype=torch.int32)
    with pytest.raises(ValueError, match=pattern):
        flashtx.flash_attn_varlen_func(q, k, v, **args)


@pytest.mark.parametrize("triton_check", [True, False], ids=["check-kernel", "torch-ops"])
def test_cu_seqlens_values_are_checked_on_device_without_a_sync(triton_check, monkeypatch):
    """Where values cannot be read for free (CUDA tensors, torch.compile), the same checks run
    through torch._assert_async: on CPU it raises at once, which is what this shows. The check kernel, or
    torch ops where Triton cannot run on the device."""
    import flashtx._device_checks as device_checks
    import flashtx._validate as validate

    monkeypatch.setattr(validate, "_values_readable", lambda t: False)
    if not triton_check:
        monkeypatch.setattr(device_checks, "triton_checks", lambda *a: False)
    q, k, v = (torch.randn(10, 2, 16, dtype=torch.float64) for _ in range(3))
    good = torch.tensor([0, 4, 10], dtype=torch.int32)
    flashtx.flash_attn_varlen_func(q, k, v, good, good, 6, 6)  # passes
    wraps = [0, 1431655769, -1431655758, 10]  # int32 differences >= 0 that sum to 10 (a tensor bound: not clamped)
    for cu, m in (([0, 4, 20], 6), ([0, 7, 3], 7), ([0, 4, 10], 5), (wraps, torch.tensor(2**40))):
        with pytest.raises(RuntimeError, match="flashtx: cu_seqlens_q must start at 0, never decrease and end at "
                                               "total_q"):
            flashtx.flash_attn_varlen_func(q, k, v, torch.tensor(cu, dtype=torch.int32),
                                           good if len(cu) == 3 else torch.tensor([0, 3, 6, 10], dtype=torch.int32),
                                           m, 6)


def test_reference_backend_takes_every_mask():
    """The reference backend (CPU default, fallback) computes the same masked attention."""
    torch.manual_seed(17)
    case = CASES[-1]
    q, k, v, kw = case_inputs(case, torch.float64)
    a = run_case(case, q, k, v, kw, backend="reference")
    # the Triton kernels take float64 in the interpreter only: on a GPU they get float32 copies
    b = run_case(case, *((q, k, v) if PRECISE_DTYPE == q.dtype else to_dtype(PRECISE_DTYPE, q, k, v)), kw,
                 backend="triton")
    assert torch.allclose(a, b.double(), atol=precise_atol(1e-12))


def test_masked_paths_allocate_no_n_by_n_tensor():
    """Window, masks, lengths and varlen keep the Triton path O(N) (see tests/test_memory.py)."""
    from test_memory import S, largest_op_allocation, qkv

    q, k, v = (t.transpose(1, 2).detach().requires_grad_(True) for t in qkv())  # (1, S, H, 16)
    o_n = q.numel() * q.element_size()
    key_mask = torch.rand(1, S, device=DEVICE) > 0.2
    lens = torch.tensor([S - 50], device=DEVICE)
    cu = torch.tensor([0, 100, S], dtype=torch.int32, device=DEVICE)

    def padded():
        out = flashtx.flash_attn_func(q, k, v, causal=True, window_size=(64, -1), key_mask=key_mask,
                                      query_mask=key_mask, kv_lens=lens, backend="triton")
        out.backward(torch.ones_like(out))

    def varlen():
        out = flashtx.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, S - 100, S - 100, causal=True,
                                             backend="triton")
        out.backward(torch.ones_like(out))

    for fn in (padded, varlen):
        peak = largest_op_allocation(fn)
        assert 0 < peak <= 4 * o_n, f"{fn.__name__}: an op allocated {peak} bytes; O(N) tensors are {o_n} bytes"


def test_padded_shells_trace_under_torch_compile():
    import torch._dynamo

    torch.manual_seed(18)
    q, k, v = (randn(2, 9, 2, 16, requires_grad=True) for _ in range(3))
    key_mask = torch.rand(2, 9, device=DEVICE) > 0.3
    lens = torch.tensor([9, 4], device=DEVICE)

    def fn(q, k, v, key_mask, lens):
        a = flashtx.flash_attn_func(q, k, v, causal=True, window_size=(3, -1), key_mask=key_mask, q_lens=lens)
        b = flashtx.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), kv_lens=lens,
                              query_mask=key_mask)
        return a.sum() + b.sum()

    torch._dynamo.reset()
    assert torch._dynamo.explain(fn)(q, k, v, key_mask, lens).graph_break_count == 0
    loss = torch.compile(fn, fullgraph=True, backend="aot_eager")(q, k, v, key_mask, lens)
    grads = torch.autograd.grad(loss, (q, k, v))
    eager = fn(q, k, v, key_mask, lens)
    eager_grads = torch.autograd.grad(eager, (q, k, v))
    assert torch.allclose(loss, eager) and all(torch.allclose(a, b) for a, b in zip(grads, eager_grads))


@pytest.mark.parametrize("lane", [True, False])
def test_rows_past_q_lens_get_zero_output_and_neg_inf_lse(lane, monkeypatch):
    """Rows past q_lens are padding: out 0 and lse -inf (the lse store must cover the padded rows, not only the
    sequence's own: poisoned allocations would show a row left unwritten)."""
    from flashtx import _attention_lane

    monkeypatch.setattr(_attention_lane, "LANE", lane)
    torch.manual_seed(21)
    q, k, v = (randn(2, 2, 24, 16, dtype=PRECISE_DTYPE) for _ in range(3))
    ql = torch.tensor([10, 24], dtype=torch.int32, device=DEVICE)
    with poisoned_allocations():
        out, lse = flashtx.attention(q, k, v, q_lens=ql, return_lse=True)
    assert torch.isneginf(lse[0, :, 10:]).all() and torch.isfinite(lse[0, :, :10]).all() and \
        torch.isfinite(lse[1]).all()
    assert (out[0, :, 10:] == 0).all() and torch.isfinite(out).all()


def test_dropout_probabilities_respect_both_lengths():
    """return_attn_probs with dropout (flash-attn's probabilities: dropped entries negated) over q_lens and kv_lens:
    each real row's |P| sums to 1 over its sequence's keys and puts nothing past kv_lens; padded rows are 0."""
    torch.manual_seed(22)
    B, S, H, D = 2, 20, 2, 16
    q, k, v = (randn(B, S, H, D, dtype=PRECISE_DTYPE) for _ in range(3))
    ql = torch.tensor([8, 20], dtype=torch.int32, device=DEVICE)
    kl = torch.tensor([17, 20], dtype=torch.int32, device=DEVICE)
    _, _, probs = flashtx.flash_attn_func(q, k, v, dropout_p=0.25, return_attn_probs=True, q_lens=ql, kv_lens=kl)
    p = probs.abs().double()  # (B, H, S, S)
    torch.testing.assert_close(p[0, :, :8].sum(-1), torch.ones(H, 8, dtype=torch.float64, device=DEVICE))
    torch.testing.assert_close(p[1].sum(-1), torch.ones(H, S, dtype=torch.float64, device=DEVICE))
    assert (p[0, :, :, 17:] == 0).all() and (p[0, :, 8:] == 0).all()
