"""attn_mask / attn_bias: boolean and additive masks of every broadcast shape, the learned-bias
gradient, and their combinations with causal, GQA, padding and windows.

Each case runs the Triton kernels (interpreter on CPU) and compares out, dq, dk, dv and the bias
gradient with the float64 reference (flashtx.reference.attention) under the tolerance rule.
"""
import dataclasses
import math

import pytest
import torch
from conftest import (DEVICE, KERNEL_DTYPES, ON_GPU, PRECISE_DTYPE, assert_close_to_reference, dtype_id,
                      gradcheck_each_input, poisoned_allocations, precise_atol, randn, to64, to_dtype)

import flashtx
from flashtx import _dispatch, reference

B, HQ, HKV, SQ, SK, D = 2, 4, 2, 37, 45, 16


@dataclasses.dataclass(frozen=True)
class BiasCase:
    shape: tuple  # the user's mask shape, broadcastable to (B, HQ, SQ, SK)
    kind: str = "float"  # "float" (learned bias, requires grad) or "bool"
    causal: bool = False
    strided: bool = False  # the mask is a non-contiguous view

    @property
    def id(self):
        return (f"{self.kind}-{'x'.join(map(str, self.shape))}" + ("-causal" if self.causal else "")
                + ("-strided" if self.strided else ""))


CASES = [
    BiasCase((SQ, SK)),
    BiasCase((1, HQ, SQ, SK), causal=True),
    BiasCase((HQ, SQ, SK), strided=True),
    BiasCase((B, 1, 1, SK)),
    BiasCase((B, HQ, SQ, SK), causal=True, strided=True),
    BiasCase((B, 1, SQ, 1)),
    BiasCase((SK,)),
    BiasCase((B, HQ, SQ, SK), kind="bool", causal=True),
    BiasCase((B, 1, SQ, SK), kind="bool", strided=True),
    BiasCase((1, 1, 1, SK), kind="bool"),
]


def make_mask(case: BiasCase, seed: int):
    torch.manual_seed(seed)
    if case.kind == "bool":
        m = torch.rand(case.shape[::-1] if case.strided else case.shape, device=DEVICE) > 0.3
    else:
        m = torch.randn(case.shape[::-1] if case.strided else case.shape, dtype=torch.float64, device=DEVICE)
    if case.strided:
        m = m.permute(*reversed(range(m.dim())))  # same shape, reversed strides
    return m


@pytest.mark.parametrize("dtype", [d for d in KERNEL_DTYPES if d != torch.float64], ids=dtype_id)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_attn_mask_matches_reference(case, dtype):
    torch.manual_seed(31)
    q, k, v = randn(B, HQ, SQ, D, dtype=dtype), randn(B, HKV, SK, D, dtype=dtype), randn(B, HKV, SK, D, dtype=dtype)
    mask = make_mask(case, 32)
    bias = mask if case.kind == "bool" else mask.to(dtype)
    qk = [t.requires_grad_() for t in (q, k, v)]
    leaves = qk + ([bias.requires_grad_()] if case.kind == "float" else [])
    with poisoned_allocations():
        out = flashtx.attention(q, k, v, attn_mask=bias, is_causal=case.causal, enable_gqa=True, backend="triton")
        dout = randn(*out.shape, dtype=dtype)
        grads = torch.autograd.grad(out, leaves, dout)
    ref_leaves = to64(*leaves) if case.kind == "float" else to64(*qk) + (mask,)
    eager_leaves = to_dtype(dtype, *leaves) if case.kind == "float" else to_dtype(dtype, *qk) + (mask,)
    results = []
    for ins in (ref_leaves, eager_leaves):
        o = reference.attention(*ins[:3], causal=case.causal, bias=ins[3])
        results.append((o, torch.autograd.grad(o, [t for t in ins if t.requires_grad], dout.to(o.dtype))))
    (o64, g64), (oe, ge) = results
    assert_close_to_reference("out", out, o64, oe)
    for name, g, r, e in zip(("dq", "dk", "dv", "dbias"), grads, g64, ge):
        assert g.shape == r.shape, f"{name}: {tuple(g.shape)} != {tuple(r.shape)}"
        assert_close_to_reference(name, g, r, e, grad=True)


def test_bias_gradient_is_deterministic_and_mask_is_never_expanded():
    """Two backward passes give bitwise-equal bias gradients (a fixed reduction order, no atomics),
    and the kernels see the (1, H, Sq, Sk) bias through stride-0 batch views, never a copy."""
    torch.manual_seed(33)
    q, k, v = (randn(B, HQ, SQ, D, requires_grad=True) for _ in range(3))
    bias = randn(1, HQ, SQ, SK, requires_grad=True)
    k, v = (randn(B, HQ, SK, D, requires_grad=True) for _ in range(2))
    runs = []
    for _ in range(2):
        out = flashtx.attention(q, k, v, attn_mask=bias, backend="triton")
        runs.append(torch.autograd.grad(out.square().sum(), (q, k, v, bias)))
    for a, b in zip(*runs):
        assert torch.equal(a, b)
    from flashtx.triton_kernels.attention_common import mask_args
    from flashtx.triton_kernels.mask_spec import MaskSpec

    args, *_ = mask_args(MaskSpec(attn_mask=bias.detach()), False, False, q, k, q[..., 0])
    assert args["MB"].data_ptr() == bias.data_ptr() and args["stride_mb"] == 0


def test_rows_masked_out_by_the_bias_give_zero_output_and_finite_gradients():
    torch.manual_seed(34)
    dt = PRECISE_DTYPE  # float64 through the kernels in the interpreter, float32 on a GPU
    q, k, v = (randn(B, HQ, SQ, D, dtype=dt, requires_grad=True) for _ in range(3))
    k, v = (randn(B, HQ, SK, D, dtype=dt, requires_grad=True) for _ in range(2))
    bias = randn(B, 1, SQ, SK, dtype=dt)
    bias[0, 0, 5] = float("-inf")  # query row 5 of batch 0: every score -inf
    bias[1, 0, :, 3] = float("-inf")  # key 3 of batch 1 hidden from everyone
    bias.requires_grad_()
    out = flashtx.attention(q, k, v, attn_mask=bias, backend="triton")
    assert torch.all(out[0, :, 5] == 0)
    grads = torch.autograd.grad(out.sum(), (q, k, v, bias))
    assert all(torch.isfinite(g).all() for g in grads)
    assert torch.all(grads[0][0, :, 5] == 0) and torch.all(grads[3][0, 0, 5] == 0)
    assert torch.all(grads[3][1, 0, :, 3] == 0)
    ref = reference.attention(*to64(q, k, v), bias=bias.detach().double())
    assert torch.allclose(out.double(), ref, atol=precise_atol(1e-12))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_flash_shell_attn_bias_with_gqa_padding_and_window(causal):
    """flash_attn_func's attn_bias= with GQA, key/query masks and a window: bottom-right causal."""
    torch.manual_seed(35)
    q, k, v = randn(B, SQ, HQ, D, dtype=torch.float64), randn(B, SK, HKV, D, dtype=torch.float64), \
        randn(B, SK, HKV, D, dtype=torch.float64)
    bias = randn(1, HQ, SQ, SK, dtype=torch.float64, requires_grad=True)
    km, qm = torch.rand(B, SK, device=DEVICE) > 0.2, torch.rand(B, SQ, device=DEVICE) > 0.2
    kw = dict(causal=causal, window_size=(20, -1), key_mask=km, query_mask=qm)
    # the kernels get float64 leaves in the interpreter, float32 ones on a GPU; the reference is float64
    ins = to_dtype(PRECISE_DTYPE, q, k, v)
    kbias = bias if bias.dtype == PRECISE_DTYPE else to_dtype(PRECISE_DTYPE, bias)[0]
    out = flashtx.flash_attn_func(*ins, attn_bias=kbias, backend="triton", **kw)
    g = torch.autograd.grad(out.sum(), ins + (kbias,))
    ins_r, bias_r = to64(q, k, v), bias.detach().clone().requires_grad_()
    vis = reference.visibility(SQ, SK, batch=B, causal=causal, bottom_right=True, window=(20, -1), key_mask=km,
                               query_mask=qm, device=DEVICE)
    ref = reference.attention(*(t.transpose(1, 2) for t in ins_r), vis=vis, bias=bias_r).transpose(1, 2)
    gr = torch.autograd.grad(ref.sum(), ins_r + (bias_r,))
    assert torch.allclose(out.double(), ref, atol=precise_atol(1e-12))
    for a, b in zip(g, gr):
        assert torch.allclose(a.double(), b, atol=precise_atol(1e-11))


@pytest.mark.skipif(ON_GPU, reason="float64 Triton kernels run only in the interpreter")
@pytest.mark.parametrize("shape", [(1, 2, 21, 26), (2, 1, 1, 26)], ids=["heads-x-seq", "batch-keys"])
def test_gradcheck_bias_path(shape):
    torch.manual_seed(36)
    q = torch.randn(2, 2, 21, 16, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, 1, 26, 16, dtype=torch.float64, requires_grad=True) for _ in range(2))
    bias = torch.randn(*shape, dtype=torch.float64, requires_grad=True)

    def fn(q, k, v, bias):
        return flashtx.attention(q, k, v, attn_mask=bias, is_causal=True, enable_gqa=True, backend="triton")

    assert gradcheck_each_input(fn, (q, k, v, bias))


def test_bool_mask_equals_additive_minus_inf():
    torch.manual_seed(37)
    q, k, v = (randn(B, HQ, SQ, D, dtype=PRECISE_DTYPE) for _ in range(3))
    keep = torch.rand(B, 1, SQ, SQ, device=DEVICE) > 0.5
    add = torch.zeros(keep.shape, dtype=PRECISE_DTYPE, device=DEVICE).masked_fill(~keep, -math.inf)
    a = flashtx.attention(q, k, v, attn_mask=keep, backend="triton")
    b = flashtx.attention(q, k, v, attn_mask=add, backend="triton")
    # adding 0 or -inf to a score is exact, so the two paths agree bitwise in float32 (GPU) as in float64
    assert torch.allclose(a, b, atol=1e-13)


@pytest.mark.skipif(ON_GPU, reason="compares the two backends' float64 gradients at 1e-12 (up to ~200 here); "
                    "float64 runs through the Triton kernels only in the interpreter; on a GPU "
                    "test_attn_mask_matches_reference checks the bias gradient in fp16/bf16/fp32")
@pytest.mark.parametrize("shape", [(B, 1, 1, SK), (HQ, SQ, SK)], ids=["batch-keys", "heads-x-seq"])
def test_reference_backend_gives_the_same_bias_gradient(shape):
    """The reference backend (CPU default, fallback) sums the bias gradient over broadcast dims too."""
    torch.manual_seed(38)
    base = (randn(B, HQ, SQ, D, dtype=torch.float64), randn(B, HKV, SK, D, dtype=torch.float64),
            randn(B, HKV, SK, D, dtype=torch.float64), randn(*shape, dtype=torch.float64))
    grads = []
    for backend in ("triton", "reference"):
        ins = to64(*base)
        out = flashtx.attention(*ins[:3], attn_mask=ins[3], is_causal=True, enable_gqa=True, softcap=4.0,
                                backend=backend)
        grads.append((out,) + torch.autograd.grad(out.square().sum(), ins))
    for a, b in zip(*grads):
        assert a.shape == b.shape and torch.allclose(a, b, atol=1e-12)


@pytest.mark.parametrize("value", [float("nan"), 3e38, -3e38, float("inf"), float("-inf"),
                                   torch.finfo(torch.float32).min], ids=lambda v: f"{v:g}")
def test_extreme_bias_values_give_what_sdpa_gives(value):
    """A NaN in the bias gives NaN (it is not dropped as masked), a huge finite bias wins its row (it does not
    overflow to NaN once scaled by log2(e)), +inf gives NaN and -inf masks, as torch's SDPA: Triton and reference
    backends, fp32, one column of the (Sq, Sk) bias set to the value."""
    import torch.nn.functional as F

    gen = torch.Generator(device=DEVICE).manual_seed(3)
    q, k, v = (torch.randn(1, 2, 5, 16, generator=gen, device=DEVICE) for _ in range(3))
    bias = torch.zeros(5, 7, device=DEVICE)
    k, v = torch.cat([k, k[:, :, :2]], 2), torch.cat([v, v[:, :, :2]], 2)  # Sk = 7
    bias[:, 2] = value
    want = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=bias.double())
    for backend in ("triton", "reference"):
        got = flashtx.attention(q, k, v, attn_mask=bias, backend=backend)
        assert torch.isnan(got).any() == torch.isnan(want).any(), (backend, got)
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5, equal_nan=True, msg=backend)


def test_a_full_half_precision_bias_gradient_is_stored_in_its_dtype():
    """A (B, H, Sq, Sk) fp16 bias: the dQ kernel stores its gradient in fp16 itself (no fp32 buffer the size of the
    bias and no cast pass after: an audit measured 2x the bias in fp32 plus a copy), rounded as the cast was (equal
    to the fp32 bias's gradient cast to fp16); broadcast masks keep the fp32 buffer their sums need."""
    from flashtx.triton_kernels.attention_bwd_launch import DbiasReduce, dbias_plan

    for shape, buffered in (((B, HQ, SQ, SK), False), ((B, HQ, SQ, 1), False), ((1, HQ, SQ, SK), True),
                            ((B, 1, SQ, SK), True), ((B, HQ, 1, SK), True)):
        args, _, finish = dbias_plan(torch.empty(shape, dtype=torch.float16), B, HQ, SQ, SK, 16, torch.float32)
        assert isinstance(finish, DbiasReduce) == buffered and (args["DB"].dtype == torch.float32) == buffered, shape
    torch.manual_seed(34)
    q = randn(B, HQ, SQ, D, dtype=torch.float16)
    k, v = randn(B, HKV, SK, D, dtype=torch.float16), randn(B, HKV, SK, D, dtype=torch.float16)
    dout = randn(B, HQ, SQ, D, dtype=torch.float16)
    for shape in ((B, HQ, SQ, SK), (B, HQ, SQ, 1)):  # (the second: row sums, stored once per row)
        bias = randn(*shape, dtype=torch.float16)
        grads = []
        for b in (bias, bias.float()):
            b = b.clone().requires_grad_(True)
            with poisoned_allocations():
                out = flashtx.attention(q, k, v, attn_mask=b, is_causal=True, enable_gqa=True, backend="triton")
                grads.append(torch.autograd.grad(out, b, dout)[0])
        assert grads[0].dtype == torch.float16 and torch.equal(grads[0], grads[1].to(torch.float16)), shape


_BARRIERS = r"""
import re
from flashtx.triton_kernels.compile_check import _all_plans, compile_launch
from flashtx.triton_kernels.configs import KNOWN_TARGETS
plans = _all_plans(KNOWN_TARGETS[80])
for want in ("attn_bwd_dq+dbias D=64", "attn_bwd_dq D=64"):
    label, launch = next((lab, p) for lab, p in plans if lab.startswith(want))
    ttir = compile_launch(launch, KNOWN_TARGETS[80]).asm["ttir"]
    ops = [line for line in ttir.splitlines() if not line.lstrip().startswith("#loc")]  # (paths: any text)
    print(want, sum(bool(re.search(r"\b(gpu|ttg)\.barrier\b", line)) for line in ops))
"""


def test_the_bias_gradient_read_back_is_ordered_by_a_barrier():
    """The dQ kernel folds the bias gradient of each (batch, head) into what an earlier one of the same program
    stored, and other threads do the load and the store: only a barrier orders them on a GPU (the interpreter runs
    a program's tensor ops whole, so no CPU test sees it). The kernel's own barrier is in its TTIR (Triton 3.6:
    gpu.barrier, 3.9: ttg.barrier), before any barrier the compiler adds for its own staging; without a bias
    gradient there is none. Compiled for sm_80 in a subprocess, as the compile check does."""
    import os
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "FLASHTX_INTERPRET")}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run([sys.executable, "-c", _BARRIERS], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    counts = dict(line.rsplit(" ", 1) for line in proc.stdout.splitlines())
    assert int(counts["attn_bwd_dq+dbias D=64"]) >= 1 and int(counts["attn_bwd_dq D=64"]) == 0, proc.stdout


# (mask shape, batch, q heads): each broadcast over batch and/or heads, with few q tiles, so that the dQ kernel's
# grid is small and dbias_groups splits the summed axis (batch 5: a prime; (1, 1, 1, SK): the per-q-tile partial
# rows too)
GROUP_CASES = [((1, 1, SQ, SK), 6, 4), ((1, HQ, SQ, SK), 12, HQ), ((1, 1, 1, SK), 5, 4), ((B, 1, SQ, SK), B, 6)]


@pytest.mark.parametrize("shape,nb,nh", GROUP_CASES, ids=lambda c: "x".join(map(str, c)) if isinstance(c, tuple)
                         else str(c))
def test_bias_gradient_summed_in_groups_equals_one_chain(monkeypatch, shape, nb, nh):
    """A bias broadcast over batch / heads, on a grid that does not fill the GPU: the dQ kernel's programs take
    groups of the summed (batch, head) pairs, each summing into a partial of its own, and DbiasReduce adds the
    partials (dbias_groups). The same call with grouping off (one program per gradient tile, looping over every
    pair) and the float64 reference agree with it. The plan the call made is read back, so a test whose shapes
    stopped grouping fails."""
    from flashtx.triton_kernels import attention_bwd_launch as abl

    plans = []

    def recording(dbias, *args, **kwargs):
        got = real(dbias, *args, **kwargs)
        plans.append((got[1], got[0]["n_b"], got[0]["n_h"]))
        return got

    real = abl.dbias_plan
    monkeypatch.setattr(abl, "dbias_plan", recording)
    torch.manual_seed(39)
    q = randn(nb, nh, SQ, D, dtype=PRECISE_DTYPE)
    k, v = (randn(nb, 2, SK, D, dtype=PRECISE_DTYPE) for _ in range(2))
    bias, dout = randn(*shape, dtype=PRECISE_DTYPE), randn(nb, nh, SQ, D, dtype=PRECISE_DTYPE)
    results = []
    for grouped in (True, True, False):  # the second call replays the first's cached plan (a fresh buffer)
        if not grouped:
            monkeypatch.setattr(abl, "DBIAS_PARTIALS_BYTES", 0)  # one group: the partials' budget holds none
            _dispatch.clear_plans()  # (the first call's plan is cached: planned anew with the budget)
        ins = to_dtype(PRECISE_DTYPE, q, k, v, bias)
        with poisoned_allocations():
            out = flashtx.attention(*ins[:3], attn_mask=ins[3], is_causal=True, enable_gqa=True, backend="triton")
            results.append(torch.autograd.grad(out, ins, dout))
    assert len(plans) == 2 and all(torch.equal(a, b) for a, b in zip(results[0], results[1]))  # (two plans: 3 calls)
    (grid_h, grid_b), chain_b, chain_h = plans[0][0], plans[0][1], plans[0][2]
    groups = (grid_b if shape[0] == 1 else 1) * (grid_h if shape[1] == 1 else 1)
    assert groups > 1 and (grid_b * chain_b, grid_h * chain_h) == (nb, nh), plans
    assert plans[1][1] * plans[1][2] == (nb if shape[0] == 1 else 1) * (nh if shape[1] == 1 else 1), plans
    ins = to64(q.double(), k.double(), v.double(), bias.double())
    want = torch.autograd.grad(reference.attention(*ins[:3], causal=True, bias=ins[3]), ins, dout.double())
    for got in results:
        for a, b in zip(got, want):
            assert a.shape == b.shape and torch.allclose(a.double(), b, atol=precise_atol(1e-11)), (a - b).abs().max()


def test_bias_gradient_groups_fill_the_gpu_within_the_partials_budget():
    """dbias_groups on an H100's 132 SMs (meta tensors: nothing is allocated): a Swin-like (1, 3, 49, 49) bias over
    4096 windows takes 128 groups of 32 windows (3 x 128 programs, not 3 looping over every window); a T5 bias
    (1, 16, 4k, 4k) at batch 4 already fills the GPU (1024 programs: one group, as before); a (1, 1, 4k, 4k) one at
    batch 4 x 16 heads gets 4 groups, its 64 MiB fp32 partials held to DBIAS_PARTIALS_BYTES; groups are divisors
    of the summed axis, the fewest that fill the GPU (a prime batch: one a batch)."""
    from flashtx.triton_kernels.attention_bwd_launch import DBIAS_PARTIALS_BYTES, dbias_plan
    from flashtx.triton_kernels.targets import KNOWN_TARGETS

    def plan(shape, nb, nh, S, block_m):
        args, grid, finish = dbias_plan(torch.empty(shape, dtype=torch.bfloat16, device="meta"), nb, nh, S, S,
                                        block_m, torch.float32, KNOWN_TARGETS[90])
        return grid, args["n_b"], args["n_h"], tuple(args["DB"].shape), finish is not None

    assert plan((1, 3, 49, 49), 4096, 3, 49, 64) == ((3, 128), 32, 1, (128, 3, 49, 49), True)
    assert plan((1, 16, 4096, 4096), 4, 16, 4096, 64) == ((16, 1), 4, 1, (1, 16, 4096, 4096), True)
    got = plan((1, 1, 4096, 4096), 4, 16, 4096, 128)
    assert got == ((1, 4), 1, 16, (4, 1, 4096, 4096), True) and 4 * 4096 * 4096 * 4 <= DBIAS_PARTIALS_BYTES
    assert plan((1, 8, 64, 64), 7, 8, 64, 64) == ((8, 7), 1, 1, (7, 8, 64, 64), True)  # 8 programs: want 33 >= 7
    assert plan((1, 64, 64, 64), 7, 64, 64, 64) == ((64, 7), 1, 1, (7, 64, 64, 64), True)  # 64 programs: want 5
    assert plan((1, 64, 64, 64), 12, 64, 64, 64) == ((64, 6), 2, 1, (6, 64, 64, 64), True)  # 5 -> 6 groups of 2
    assert plan((1, 1, 64, 64), 6, 100, 64, 64) == ((50, 6), 1, 2, (6, 50, 64, 64), True)  # 1 program: 6 x 50 groups


NB = 3  # a batch unlike every head count here (HQ = 4, HKV = 2, 2 x HKV split): a swapped grid changes shape


@pytest.mark.parametrize("shape,by", [((1, HQ, 256, 256), True), ((1, 1, 256, 256), True), ((NB, HQ, 256, 256), False),
                                      ((NB, 1, 1, 256), False), ((1, HQ, 256, 256), False)],
                         ids=["1xHxSxS", "1x1xSxS", "BxHxSxS", "Bx1x1xS", "batch-1"])
@pytest.mark.parametrize("kind", ["float", "bool"])
@pytest.mark.parametrize("split", [1, 2], ids=["dkdv", "dkdv-gqa-split"])
def test_a_mask_shared_by_the_batch_puts_the_batch_before_heads_in_every_grid(shape, by, kind, split):
    """batch_y: a mask broadcast over a batch of two or more is read by every batch's programs, so the forward, dK/dV
    (also split over a GQA group's heads) and dQ grids are (tiles, batch, heads) with BATCH_Y, putting them next to
    each other (one DRAM read of each mask tile, the rest from L2); other masks keep (tiles, heads, batch). On an
    H100's plan (meta tensors), at a batch unlike the head counts. The results of such grids are checked against the
    reference by test_attn_mask_matches_reference and the group tests above (batch != heads there)."""
    from flashtx.triton_kernels.attention_bwd_launch import gqa_partials, plan_backward
    from flashtx.triton_kernels.attention_fwd import plan_forward
    from flashtx.triton_kernels.mask_spec import MaskSpec
    from flashtx.triton_kernels.targets import KNOWN_TARGETS

    nb = 1 if not by and shape[0] == 1 else NB
    S, meta = 256, dict(dtype=torch.bfloat16, device="meta")
    q, o, do, dq = (torch.empty(nb, HQ, S, 64, **meta) for _ in range(4))
    k, v, dk, dv = (torch.empty(nb, HKV, S, 64, **meta) for _ in range(4))
    m2, l2, delta = (torch.empty(nb, HQ, S, dtype=torch.float32, device="meta") for _ in range(3))
    mask = torch.empty(shape, **meta) if kind == "float" else torch.empty(shape, dtype=torch.bool, device="meta")
    spec, target = MaskSpec(attn_mask=mask.expand(nb, HQ, S, S)), KNOWN_TARGETS[90]
    dbias = torch.empty(shape, **meta) if kind == "float" else None
    fwd = plan_forward(q, k, v, o, m2, l2, scale=0.125, causal=True, bottom_right=False, spec=spec, target=target)
    steps = plan_backward(do, q, k, v, o, m2, l2, delta, dq, dk, dv, scale=0.125, causal=True, bottom_right=False,
                          spec=spec, dbias=dbias, target=target,
                          gqa_parts=gqa_partials(dk, dv, split, q.dtype) if split > 1 else None)
    dkdv, dqk = (next(s for s in steps if getattr(s, "kernel", None) is not None and s.kernel.__name__ == name)
                 for name in ("_attn_bwd_dkdv", "_attn_bwd_dq"))
    assert dkdv.args["SPLIT"] == split
    for launch, heads in ((fwd, HQ), (dkdv, HKV * split), (dqk, None)):
        assert launch.args["BATCH_Y"] is by, launch.kernel.__name__
        if heads is not None:
            assert launch.grid[1:] == ((nb, heads) if by else (heads, nb)), (launch.kernel.__name__, launch.grid)
    gb, gh = dqk.grid[1:] if by else dqk.grid[:0:-1]  # dQ's batch and head extents, or groups of them
    assert (gb * dqk.args["n_b"], gh * dqk.args["n_h"]) == (nb, HQ), dqk.grid


@pytest.mark.parametrize("chain", [False, True], ids=["grouped", "one-chain"])
def test_a_shared_bias_gradient_over_batches_of_different_lengths(monkeypatch, chain):
    """A (1, H, Sq, Sk) learned bias over a batch whose kv_lens differ: a dQ program summing several batches into one
    gradient tile meets key loops of different bounds (sequence 1 skips the tiles past its 8 keys). The first
    batch it takes stores, later ones add, whatever tiles each visits: the gradient is the float64 reference's
    (keys past a length contribute nothing)."""
    from flashtx.triton_kernels import attention_bwd_launch as abl

    if chain:
        monkeypatch.setattr(abl, "DBIAS_PARTIALS_BYTES", 0)  # one program per gradient tile loops over the batch
        _dispatch.clear_plans()
    torch.manual_seed(41)
    B, H, Sq, Sk = 2, 8, 32, 40
    q, k, v = (randn(B, H, S, 16, dtype=PRECISE_DTYPE) for S in (Sq, Sk, Sk))
    bias, g = randn(1, H, Sq, Sk, dtype=PRECISE_DTYPE), randn(B, H, Sq, 16, dtype=PRECISE_DTYPE)
    kl = torch.tensor([40, 8], dtype=torch.int32, device=DEVICE)
    ins = to_dtype(PRECISE_DTYPE, q, k, v, bias)
    with poisoned_allocations():
        got = torch.autograd.grad(flashtx.attention(*ins[:3], attn_mask=ins[3], kv_lens=kl, backend="triton"), ins,
                                  g)
    ins = to64(q.double(), k.double(), v.double(), bias.double())
    s = ins[0] @ ins[1].transpose(-1, -2) * 16 ** -0.5 + ins[3]
    s = s.masked_fill(torch.arange(Sk, device=DEVICE) >= kl.to(DEVICE)[:, None, None, None], float("-inf"))
    want = torch.autograd.grad(s.softmax(-1) @ ins[2], ins, g.double())
    for a, b in zip(got, want):
        assert torch.allclose(a.double(), b, atol=precise_atol(1e-11)), (a.double() - b).abs().max()
