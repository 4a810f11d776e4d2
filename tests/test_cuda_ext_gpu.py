"""GPU only: build the CUDA extension (csrc/) and compare its ops with float64 eager references
(flashtx/cuda_ext_reference.py) on the GPU.

decode_attention: contiguous and paged caches (page sizes 16 and 64), ragged cache_seqlens (full,
1, mid, 0), GQA groups 1/4/8 (and 16/48: up to 5 blocks of rows per KV head), Sq 1-4, causal and not,
forced and chosen num_splits, cache_batch_idx, strided q. Cache positions no row may read are poisoned
with NaN, so a kernel that reads past cache_seqlens or an unused page gives NaN; the guard tests put the
pages inside NaN (a page index just outside the pool reads NaN) and compare with the keys that remain.
rotary_append: NeoX and interleaved, full and partial rotary, cos/sin in fp32 and in the input dtype;
written slots against the reference, every other slot (poisoned) unchanged. Plus the guards, check_values
and torch.compile.

Skipped without a CUDA GPU, or without nvcc/a CUDA torch to build the extension (the reason says
which); the CPU half of issue 16 is tests/test_cuda_ext.py.
"""
import math

import pytest
import torch

from flashtx import cuda_ext
from conftest import assert_close_to_reference, decode_on_both_backends

from flashtx.cuda_ext_reference import decode_attention_ref, rotary_append_ref


ATOL = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 2e-5}  # outputs are O(1)
CAP = 320  # cache capacity (positions): 5 pages of 64, 20 of 16
# the module fixture builds once: its tests share one xdist worker (pytest -n auto --dist loadgroup)
pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: runs the CUDA extension"),
              pytest.mark.xdist_group("cuda-ext-gpu")]


@pytest.fixture(scope="module", autouse=True)
def ext():
    reasons = cuda_ext.build_env_reasons()
    if not cuda_ext.load() and reasons:
        pytest.skip("cannot build the CUDA extension here: " + "; ".join(reasons))
    if not cuda_ext.load():
        cuda_ext.build()  # JIT; raises with the reason if it fails
    assert cuda_ext.available(), cuda_ext.unavailable_reason()


def _caches(batch, hkv, d, dtype, lens, page, *, poison_from=None, b_cache=None, gen=None):
    """Contiguous (b_cache, CAP, hkv, d) caches with NaN at positions >= poison_from[b] (default
    lens), and their paged copies (pages shuffled, 3 spare NaN pages) with the block table."""
    b_cache = b_cache or batch
    poison_from = lens if poison_from is None else poison_from
    kc, vc = (torch.randn(b_cache, CAP, hkv, d, device="cuda", generator=gen).to(dtype) for _ in range(2))
    for b in range(min(batch, b_cache)):
        kc[b, int(poison_from[b]):] = float("nan")
        vc[b, int(poison_from[b]):] = float("nan")
    if page is None:
        return kc, vc, None
    nb = CAP // page
    perm = torch.randperm(batch * nb + 3, device="cuda", generator=gen)[: batch * nb]
    kp = torch.full((batch * nb + 3, page, hkv, d), float("nan"), device="cuda", dtype=dtype)
    vp = kp.clone()
    kp[perm] = kc[:batch].reshape(batch * nb, page, hkv, d)
    vp[perm] = vc[:batch].reshape(batch * nb, page, hkv, d)
    return kp, vp, perm.reshape(batch, nb).int()


def _err(actual, ref):
    """max |actual - ref| / max(1, |ref|): absolute below 1, relative above (dtype rounding scales)."""
    return ((actual.double() - ref).abs() / ref.abs().clamp_min(1)).max().item()


def _check_decode(out, lse, dtype, *ref_args, truth=None, **ref_kw):
    """out and lse of a decode call against decode_attention_ref(*ref_args, **ref_kw) under the tolerance rule:
    float64 is the truth (or `truth`, (out, lse) in float64); the eager baselines are the reference in `dtype`
    (out) and in float32 (lse, which the kernels return in float32)."""
    ref_out, ref_lse = truth if truth is not None else decode_attention_ref(*ref_args, **ref_kw)
    eager_out, _ = decode_attention_ref(*ref_args, **ref_kw, dtype=dtype)
    _, eager_lse = decode_attention_ref(*ref_args, **ref_kw, dtype=torch.float32)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert torch.isfinite(out).all(), "NaN/inf in out: a poisoned (unused) cache position was read"
    assert_close_to_reference("out", out, ref_out, eager_out)
    empty = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse), empty) and (lse[empty] < 0).all()
    assert (out.transpose(1, 2)[empty] == 0).all()  # rows with no key: 0
    if (~empty).any():
        assert_close_to_reference("lse", lse[~empty], ref_lse[~empty], eager_lse[~empty])


@pytest.mark.parametrize("sq", [1, 2, 3, 4])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("page", [None, 16, 64], ids=["contig", "page16", "page64"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_decode_matches_reference(dtype, d, page, group, sq):
    gen = torch.Generator(device="cuda").manual_seed(d * 1000 + group * 10 + sq)
    batch, hkv = 4, 2
    lens = torch.tensor([CAP, 1, 173, 0], dtype=torch.int32, device="cuda")
    kc, vc, bt = _caches(batch, hkv, d, dtype, lens, page, gen=gen)
    q = torch.randn(batch, sq, hkv * group, d, device="cuda", generator=gen).to(dtype)
    for causal in (True, False):
        out, lse = cuda_ext.decode_attention(q, kc, vc, lens, block_table=bt, causal=causal, return_lse=True)
        _check_decode(out, lse, dtype, q, kc, vc, lens, block_table=bt, causal=causal)


@pytest.mark.parametrize("sq", [1, 3])
@pytest.mark.parametrize("group", [16, 48])
@pytest.mark.parametrize("page", [None, 16], ids=["contig", "page16"])
@pytest.mark.parametrize("d", [64, 128])
def test_decode_with_several_row_chunks_and_unused_pages(d, page, group, sq):
    """GQA groups of 16 and 48 (MQA as StarCoder's 48 heads): 16 x 3, 48 x 1 and 48 x 3 rows per KV head take
    2, 2 and 5 blocks of 32 (16 x 1 one), and block-table entries past each row's used pages are -1 (as vLLM
    pads; the kernel's page guard masks them), the pages inside NaN: a kernel that mapped a chunk's rows wrong,
    or read through a -1 entry past its guard, fails."""
    dtype = torch.float16
    gen = torch.Generator(device="cuda").manual_seed(d + group * 10 + sq)
    batch, hkv = 3, 1 if group == 48 else 2
    lens = torch.tensor([CAP, 37, 0], dtype=torch.int32, device="cuda")
    kc, vc, bt = _caches(batch, hkv, d, dtype, lens, page, gen=gen)
    if page is not None:
        kc, vc, bt = _inside_nan(kc), _inside_nan(vc), bt.clone()
        for b in range(batch):
            bt[b, -(-int(lens[b]) // page):] = -1
    q = torch.randn(batch, sq, hkv * group, d, device="cuda", generator=gen).to(dtype)
    for causal in (True, False):
        out, lse = cuda_ext.decode_attention(q, kc, vc, lens, block_table=bt, causal=causal, return_lse=True)
        ref_bt = None if bt is None else bt.clamp_min(0)  # (the reference reads no unused entry either)
        _check_decode(out, lse, dtype, q, kc, vc, lens, block_table=ref_bt, causal=causal)


@pytest.mark.parametrize("num_splits", [1, 2, 5, 16, 128])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=["fp16", "bf16", "fp32"])
def test_decode_splits(dtype, num_splits):
    gen = torch.Generator(device="cuda").manual_seed(num_splits)
    batch, hkv, group, d, sq = 3, 1, 8, 128, 2
    lens = torch.tensor([CAP, 100, 7], dtype=torch.int32, device="cuda")
    kc, vc, bt = _caches(batch, hkv, d, dtype, lens, 16, gen=gen)
    q = torch.randn(batch, sq, hkv * group, d, device="cuda", generator=gen).to(dtype)
    out, lse = cuda_ext.decode_attention(q, kc, vc, lens, block_table=bt, causal=True, num_splits=num_splits,
                                         return_lse=True, softmax_scale=0.07)
    _check_decode(out, lse, dtype, q, kc, vc, lens, block_table=bt, causal=True, softmax_scale=0.07)


@pytest.mark.parametrize("d", [64, 128])
def test_decode_cache_batch_idx_fp32_and_strided_q(d):
    gen = torch.Generator(device="cuda").manual_seed(7)
    batch, hkv, group, sq = 4, 2, 4, 1
    idx = torch.tensor([5, 0, 3, 1], dtype=torch.int32, device="cuda")
    lens = torch.tensor([9, CAP, 0, 64], dtype=torch.int32, device="cuda")
    kc, vc, _ = _caches(6, hkv, d, torch.float32, torch.full((6,), CAP), None, gen=gen)
    for b in range(batch):  # poison past each row's length in the cache row it maps to
        kc[int(idx[b]), int(lens[b]):] = float("nan")
        vc[int(idx[b]), int(lens[b]):] = float("nan")
    qkv = torch.randn(batch, sq, hkv * group + 2 * hkv, d, device="cuda", generator=gen)
    q = qkv[:, :, : hkv * group]  # strided over heads, as a view of a packed qkv projection
    out, lse = cuda_ext.decode_attention(q, kc, vc, lens, cache_batch_idx=idx, return_lse=True)
    _check_decode(out, lse, torch.float32, q, kc, vc, lens, cache_batch_idx=idx)


@pytest.mark.parametrize("cos_dtype", ["fp32", "same"])
@pytest.mark.parametrize("rot", ["full", "half"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "interleaved"])
@pytest.mark.parametrize("sq", [1, 4])
@pytest.mark.parametrize("page", [None, 16], ids=["contig", "page16"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_rotary_append_matches_reference(dtype, d, page, sq, interleaved, rot, cos_dtype):
    gen = torch.Generator(device="cuda").manual_seed(d + sq)
    batch, hkv, hq = 3, 2, 8
    lens = torch.tensor([0, 50, CAP - sq], dtype=torch.int32, device="cuda")
    kc, vc, bt = _caches(batch, hkv, d, dtype, lens, page, gen=gen)  # NaN from lens on: slots to write
    q = torch.randn(batch, sq, hq, d, device="cuda", generator=gen).to(dtype)
    k, v = (torch.randn(batch, sq, hkv, d, device="cuda", generator=gen).to(dtype) for _ in range(2))
    rd = d if rot == "full" else d // 2
    theta = torch.arange(CAP, device="cuda", dtype=torch.float64)[:, None] * 10000.0 ** (
        -torch.arange(rd // 2, device="cuda", dtype=torch.float64) * 2 / rd)
    cos, sin = (t.to(torch.float32 if cos_dtype == "fp32" else dtype) for t in (theta.cos(), theta.sin()))
    for q_causal in (True, False):
        kc2, vc2 = kc.clone(), vc.clone()
        q_rot = cuda_ext.rotary_append(q, k, v, kc2, vc2, lens, cos=cos, sin=sin, interleaved=interleaved,
                                       q_causal=q_causal, block_table=bt)
        rq, rk, rv = rotary_append_ref(q, k, v, kc, vc, lens, cos, sin, interleaved, q_causal, bt)
        tol = 2 * ATOL[dtype]
        assert _err(q_rot, rq) <= tol
        torch.testing.assert_close(kc2.double(), rk, atol=tol, rtol=tol, equal_nan=True)
        torch.testing.assert_close(vc2.double(), rv, atol=0, rtol=0, equal_nan=True)  # v is copied exactly


def test_flash_attn_with_kvcache_decode_loop():
    """Three decode steps through flash_attn_with_kvcache (RoPE + append + attention, paged) against
    the references step by step."""
    gen = torch.Generator(device="cuda").manual_seed(3)
    dtype, batch, hkv, hq, d = torch.bfloat16, 2, 2, 8, 128
    lens = torch.tensor([10, 40], dtype=torch.int32, device="cuda")
    kc, vc, bt = _caches(batch, hkv, d, dtype, lens, 64, gen=gen)
    rk, rv = kc.double(), vc.double()
    theta = torch.arange(CAP, device="cuda", dtype=torch.float64)[:, None] * 0.01 * torch.arange(
        d // 2, device="cuda", dtype=torch.float64)
    cos, sin = theta.cos().float(), theta.sin().float()
    for _ in range(3):
        q = torch.randn(batch, 1, hq, d, device="cuda", generator=gen).to(dtype)
        k, v = (torch.randn(batch, 1, hkv, d, device="cuda", generator=gen).to(dtype) for _ in range(2))
        out, lse = cuda_ext.flash_attn_with_kvcache(q, kc, vc, k, v, cos, sin, cache_seqlens=lens, block_table=bt,
                                                    causal=True, return_softmax_lse=True)
        rq, rk, rv = rotary_append_ref(q, k, v, rk, rv, lens, cos, sin, True, True, bt)
        # the truth in float64; the eager baselines on what the kernel reads: q and the caches rounded to dtype
        ro, rl = decode_attention_ref(rq, rk, rv, lens + 1, block_table=bt, causal=True)
        _check_decode(out, lse, dtype, rq.to(dtype), rk.to(dtype), rv.to(dtype), lens + 1, block_table=bt,
                      causal=True, truth=(ro, rl))
        lens = lens + 1


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("sq", [1, 3])
def test_backend_cuda_equals_triton(paged, sq):
    """flashtx.flash_attn_with_kvcache(..., backend="cuda") (RoPE + append + attention) against
    backend="triton" on the same inputs: out, lse (natural log) and the written caches; automatic
    dispatch still takes Triton (MEASURED_FASTER is False)."""
    from flashtx import _decode_op

    gen = torch.Generator(device="cuda").manual_seed(5)
    dtype, batch, hkv, hq, d = torch.float16, 2, 2, 8, 128
    lens = torch.tensor([17, 200], dtype=torch.int32, device="cuda")
    kc, vc, bt = _caches(batch, hkv, d, dtype, lens + sq, 16 if paged else None, gen=gen)
    kc, vc = kc.nan_to_num(0.0), vc.nan_to_num(0.0)  # compare the two paths, not their poison handling
    theta = torch.arange(CAP, device="cuda", dtype=torch.float64)[:, None] * 0.01 * torch.arange(
        d // 4, device="cuda", dtype=torch.float64)
    cos, sin = theta.cos().float(), theta.sin().float()
    q = torch.randn(batch, sq, hq, d, device="cuda", generator=gen).to(dtype)
    k, v = (torch.randn(batch, sq, hkv, d, device="cuda", generator=gen).to(dtype) for _ in range(2))
    res = decode_on_both_backends(q, kc, vc, k, v, cos, sin, lens, bt)
    for a, b in zip(res["triton"], res["cuda"]):
        torch.testing.assert_close(b.float(), a.float(), atol=ATOL[dtype], rtol=1e-2)
    assert _decode_op.select(q, kc, vc, None, {"capacity": CAP}) == "triton"


def _inside_nan(t: torch.Tensor, margin: int = 10) -> torch.Tensor:
    """t as a view into a larger NaN-filled buffer, `margin` pages of NaN on each side: a page index just
    outside t (-1, len(t) + 5) lands on NaN, so a kernel that read it gives NaN, not finite garbage."""
    pool = torch.full((t.shape[0] + 2 * margin, *t.shape[1:]), float("nan"), device=t.device, dtype=t.dtype)
    pool[margin:margin + t.shape[0]] = t
    return pool[margin:margin + t.shape[0]]


def _without_positions(cache, bt, keep):
    """(B, max kept, H, D) contiguous rows of a paged cache holding, per batch row b, its positions keep[b]."""
    rows = [cache[bt[b].long()].reshape(-1, *cache.shape[2:])[keep[b]] for b in range(len(keep))]
    out = torch.zeros(len(rows), max(r.shape[0] for r in rows), *cache.shape[2:], dtype=cache.dtype,
                      device=cache.device)
    for b, r in enumerate(rows):
        out[b, :r.shape[0]] = r
    return out


_ERRORS_SCRIPT = r"""
import faulthandler, sys
import torch
faulthandler.enable()
if sys.argv[1]:
    torch.ops.load_library(sys.argv[1])
from flashtx import cuda_ext
assert cuda_ext.load(), cuda_ext.unavailable_reason()
ops = torch.ops.flashtx_cuda
h = dict(device="cuda", dtype=torch.float16)
lens = torch.tensor([100, 30], dtype=torch.int32, device="cuda")
q, q96 = torch.randn(2, 1, 4, 64, **h), torch.randn(2, 1, 4, 96, **h)
kc = torch.randn(43, 16, 1, 64, **h)
bt = torch.randperm(43, device="cuda")[:40].reshape(2, 20).int()
bad = bt.clone()
bad[0, 2], bad[1, 0] = -1, 48
cases = [  # in this order: the first error without a sync, then the errors after check_values' sync
    ("head_dim", lambda: ops.decode_attention(q96, kc, kc, lens, None, None, 0.1, False, 1, False)),
    ("lens_int64", lambda: ops.decode_attention(q, kc, kc, lens.long(), bt, None, 0.1, False, 1, False)),
    ("bad_pages_checked_op", lambda: ops.decode_attention(q, kc, kc, lens, bad, None, 0.1, False, 1, True)),
    ("bad_pages_checked", lambda: cuda_ext.decode_attention(q, kc, kc, lens, block_table=bad, check_values=True)),
    ("lens_checked", lambda: cuda_ext.decode_attention(q, kc, kc, lens + 320, block_table=bt, check_values=True)),
    ("append_checked", lambda: cuda_ext.rotary_append(q, kc[:2, :1], kc[2:4, :1], kc.clone(), kc.clone(),
                                                      lens + 300, block_table=bt, check_values=True)),
]
for name, call in cases:
    print("calling", name, flush=True)
    try:
        call()
        print(name, "returned", flush=True)
    except RuntimeError as e:
        print(name, "RuntimeError:", str(e).splitlines()[0], flush=True)
torch.cuda.synchronize()
print("done", flush=True)
"""


def test_binding_errors_raise_in_a_process_of_their_own():
    """The binding's errors arrive as RuntimeErrors, checked in a fresh process: on an H100 (2026-12-06) the first
    error the extension raised in the suite (test_guards_and_check_values, its check_values=True call with bad pages)
    ended the pytest process with a segmentation fault, taking the other tests' reports with it. Here a crash fails
    this test only, showing which call crashed (the first error with no device sync, or one after check_values'
    sync) and, where gdb or cuda-gdb is installed, the C++ stack."""
    import os
    import shutil
    import subprocess
    import sys

    loaded = str(cuda_ext._state.get("loaded") or "")
    lib = loaded.split(" ", 1)[1] if loaded.startswith(("JIT ", "AOT ")) else ""
    env = dict(os.environ, FLASHTX_CUDA_EXT="1")
    cmd = [sys.executable, "-c", _ERRORS_SCRIPT, lib]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    _BINDING_ERRORS["crashed"] = proc.returncode != 0  # the in-process raises below then skip (this test fails)
    report = f"rc {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    debugger = shutil.which("gdb") or shutil.which("cuda-gdb")  # (the GPU machines have cuda-gdb only)
    if proc.returncode != 0 and debugger:
        gdb = subprocess.run([debugger, "-batch", "-ex", "run", "-ex", "bt 40", "--args", *cmd], capture_output=True,
                             text=True, timeout=300, env=env)
        report += f"\n{os.path.basename(debugger)}:\n" + gdb.stdout[-8000:] + gdb.stderr[-2000:]
    assert proc.returncode == 0 and proc.stdout.rstrip().endswith("done"), report
    got = dict(line.split(" ", 1) for line in proc.stdout.splitlines() if not line.startswith(("calling", "done")))
    want = {"head_dim": "head dim must be 64 or 128", "lens_int64": "cache_seqlens must be int32",
            "bad_pages_checked_op": "block_table has entries outside", "bad_pages_checked": "block_table has entries "
            "outside", "lens_checked": r"cache_seqlens must lie in [0, 320]",
            "append_checked": "cache_seqlens must lie in [0, 319]"}
    for name, words in want.items():
        assert got.get(name, "").startswith("RuntimeError:") and words in got[name], (name, report)


_BINDING_ERRORS: dict = {}


def _skip_if_binding_errors_crash() -> None:
    """The binding's errors raised in this process would end it (and the rest of this file's reports) if they crash
    it, as one did on the H100 of 2026-12-06: after test_binding_errors_raise_in_a_process_of_their_own saw a crash
    (it fails, with the stack), the tests that raise them here are skipped."""
    if _BINDING_ERRORS.get("crashed"):
        pytest.skip("the binding's errors crashed a fresh process (test_binding_errors_raise_in_a_process_of_their_own "
                    "failed with its stack): raising them in this process would end the run")


def test_guards_and_check_values():
    """Out-of-range pages and lengths without check_values: the kernels mask the keys of a bad page, clamp lengths to
    the capacity and drop an append past it (test_check_values_errors_in_process: the same values with
    check_values)."""
    dtype, batch, hkv, d = torch.float16, 2, 1, 64
    lens = torch.tensor([100, 30], dtype=torch.int32, device="cuda")
    kc, vc, bt = _caches(batch, hkv, d, dtype, lens, 16, gen=torch.Generator(device="cuda").manual_seed(0))
    kc, vc = _inside_nan(kc), _inside_nan(vc)
    q = torch.randn(batch, 1, 4, d, device="cuda", dtype=dtype)
    bad = bt.clone()
    bad[0, 2], bad[1, 0] = -1, kc.shape[0] + 5  # out-of-range pages inside the used range (NaN if read)
    out, lse = cuda_ext.decode_attention(q, kc, vc, lens, block_table=bad, return_lse=True)  # their keys masked
    keep = [torch.cat([torch.arange(0, 32), torch.arange(48, 100)]).cuda(), torch.arange(16, 30).cuda()]
    kept_k, kept_v = _without_positions(kc, bt, keep), _without_positions(vc, bt, keep)
    kept = torch.tensor([84, 14], dtype=torch.int32, device="cuda")
    _check_decode(out, lse, dtype, q, kept_k, kept_v, kept)  # attention over the keys that remain
    full = torch.full_like(lens, CAP)
    kf, vf, btf = _caches(batch, hkv, d, dtype, lens, 16, poison_from=full,
                          gen=torch.Generator(device="cuda").manual_seed(1))  # every position finite
    out, lse = cuda_ext.decode_attention(q, kf, vf, lens + 10 * CAP, block_table=btf, return_lse=True)
    _check_decode(out, lse, dtype, q, kf, vf, full, block_table=btf)  # clamped to the capacity
    k = v = torch.randn(batch, 1, hkv, d, device="cuda", dtype=dtype)
    kc2 = kc.clone()
    cuda_ext.rotary_append(q, k, v, kc2, vc.clone(), torch.tensor([CAP, 5], dtype=torch.int32, device="cuda"),
                           block_table=bt)  # row 0 is full: its write is dropped
    torch.cuda.synchronize()
    pos = 5
    assert torch.equal(kc2[bt[1, pos // 16], pos % 16], k[1, 0])
    changed = ~((kc2 == kc) | (kc2.isnan() & kc.isnan())).all(dim=(2, 3))  # (pages, slots) written
    assert changed.sum().item() == 1


def test_check_values_errors_in_process():
    """check_values=True: the bad pages and lengths test_guards_and_check_values passes are refused by name."""
    _skip_if_binding_errors_crash()
    dtype, batch, hkv, d = torch.float16, 2, 1, 64
    lens = torch.tensor([100, 30], dtype=torch.int32, device="cuda")
    kc, vc, bt = _caches(batch, hkv, d, dtype, lens, 16, gen=torch.Generator(device="cuda").manual_seed(0))
    q = torch.randn(batch, 1, 4, d, device="cuda", dtype=dtype)
    bad = bt.clone()
    bad[0, 2], bad[1, 0] = -1, kc.shape[0] + 5
    with pytest.raises(RuntimeError, match="block_table has entries outside"):
        cuda_ext.decode_attention(q, kc, vc, lens, block_table=bad, check_values=True)
    with pytest.raises(RuntimeError, match=r"cache_seqlens must lie in \[0, 320\]"):
        cuda_ext.decode_attention(q, kc, vc, lens + CAP, block_table=bt, check_values=True)
    k = v = torch.randn(batch, 1, hkv, d, device="cuda", dtype=dtype)
    with pytest.raises(RuntimeError, match=r"cache_seqlens must lie in \[0, 319\]"):
        cuda_ext.rotary_append(q, k, v, kc.clone(), vc.clone(), torch.tensor([CAP, 5], dtype=torch.int32,
                                                                             device="cuda"),
                               block_table=bt, check_values=True)


def test_binding_checks_name_the_argument():
    _skip_if_binding_errors_crash()
    q = torch.randn(1, 1, 4, 96, device="cuda", dtype=torch.float16)
    kc = torch.randn(1, 16, 1, 96, device="cuda", dtype=torch.float16)
    lens = torch.ones(1, dtype=torch.int32, device="cuda")
    with pytest.raises(RuntimeError, match="head dim must be 64 or 128"):
        torch.ops.flashtx_cuda.decode_attention(q, kc, kc, lens, None, None, 0.1, False, 1, False)
    q = torch.randn(1, 1, 4, 64, device="cuda", dtype=torch.float16)
    kc = torch.randn(1, 16, 1, 64, device="cuda", dtype=torch.float16)
    with pytest.raises(RuntimeError, match="cache_seqlens must be int32"):
        torch.ops.flashtx_cuda.decode_attention(q, kc, kc, lens.long(), None, None, 0.1, False, 1, False)
    with pytest.raises(RuntimeError, match="k_cache must be contiguous in its last dim"):
        big = torch.randn(1, 16, 1, 128, device="cuda", dtype=torch.float16)
        torch.ops.flashtx_cuda.decode_attention(q, big[..., ::2], kc, lens, None, None, 0.1, False, 1, False)
    with pytest.raises(RuntimeError, match="16-byte aligned"):
        flat = torch.randn(1 * 16 * 64 + 1, device="cuda", dtype=torch.float16)[1:].view(1, 16, 1, 64)
        torch.ops.flashtx_cuda.decode_attention(q, flat, kc, lens, None, None, 0.1, False, 1, False)


def test_torch_compile_fullgraph():
    batch, hkv, hq, d = 2, 2, 8, 64
    lens = torch.tensor([20, 5], dtype=torch.int32, device="cuda")
    kc, vc, bt = _caches(batch, hkv, d, torch.float16, lens + 1, 16)
    q = torch.randn(batch, 1, hq, d, device="cuda", dtype=torch.float16)
    k = v = torch.randn(batch, 1, hkv, d, device="cuda", dtype=torch.float16)
    cos = sin = torch.randn(CAP, d // 2, device="cuda")

    def step(q, k, v, kc, vc, lens):
        qr = torch.ops.flashtx_cuda.rotary_append(q, k, v, kc, vc, cos, sin, lens, bt, None, False, True, False)
        return torch.ops.flashtx_cuda.decode_attention(qr, kc, vc, lens + 1, bt, None, d ** -0.5, True, 2, False)

    kc1, vc1, kc2, vc2 = kc.clone(), vc.clone(), kc.clone(), vc.clone()
    eager = step(q, k, v, kc1, vc1, lens)
    comp = torch.compile(step, fullgraph=True)(q, k, v, kc2, vc2, lens)
    torch.testing.assert_close(comp[0], eager[0], atol=0, rtol=0)
    torch.testing.assert_close(kc2, kc1, atol=0, rtol=0, equal_nan=True)
    assert math.isfinite(comp[1].max().item())
