"""csrc/binding.cpp's argument checks on CPU, compiled and run: the binding built with -DFTX_HOST_CHECK and
csrc/host_check/ (the ops on the CPU dispatch key; stub launchers that launch nothing but check what the kernels
assume of every pointer, stride and size they get, and fail "kernel launch failed: host check: ..." otherwise).

Each case below calls torch.ops.flashtx_cuda.* with one argument wrong (None or an undefined tensor where an
optional or a required tensor goes, an empty dim, a wrong dtype or device, a bad stride or offset, shared memory
in the append's writes, values out of range with check_values) and expects the binding's own error naming that
argument, or a result where the binding must take the input. A random sweep then checks the property that holds
it together: whatever the binding lets through satisfies the launchers' assumptions. The GPU half (the kernels
on those inputs) is tests/test_cuda_ext_gpu.py.

The library registers the flashtx_cuda namespace, which would make flashtx.cuda_ext think the extension is
loaded: the cases run in a subprocess. Needs g++ and torch's C++ headers (any torch wheel: no CUDA toolkit).
"""
import functools
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
CSRC = ROOT / "csrc"
TORCH_DIR = Path(torch.__file__).resolve().parent
GXX = shutil.which("g++")
DEV = "CPU (host check)"  # the device the host-check build names where the real one says CUDA
pytestmark = [pytest.mark.xdist_group("cuda-ext-host-check"),
              pytest.mark.skipif(GXX is None, reason="g++ not found: cannot build csrc/binding.cpp's host check"),
              pytest.mark.skipif(not (TORCH_DIR / "include" / "ATen" / "ATen.h").exists(),
                                 reason="this torch has no C++ headers")]


def host_check_cmd(out: str) -> list[str]:
    """g++ of csrc/binding.cpp (-DFTX_HOST_CHECK) and csrc/host_check/launchers.cpp into `out`, against the
    installed torch (warnings as errors, as the syntax check of the real build)."""
    inc, lib = TORCH_DIR / "include", TORCH_DIR / "lib"
    return [GXX, "-std=c++20", "-O0", "-shared", "-fPIC", "-Wall", "-Wextra", "-Werror", "-DFTX_HOST_CHECK",
            f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
            "-I", str(CSRC / "host_check"), "-I", str(CSRC), "-isystem", str(inc),
            "-isystem", str(inc / "torch" / "csrc" / "api" / "include"),
            str(CSRC / "binding.cpp"), str(CSRC / "host_check" / "launchers.cpp"),
            f"-L{lib}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{lib}", "-o", out]


# ---------------------------------------------------------------------------------------------
# The cases (built and run in the subprocess: _run)
# ---------------------------------------------------------------------------------------------

CAP = 320  # the paged cache's capacity: 20 pages of 16
dec_op, rot_op = "flashtx_cuda::decode_attention: ", "flashtx_cuda::rotary_append: "


def _paged(dtype=torch.float16, d=64, hkv=1):
    """test_guards_and_check_values's cache on CPU: 43 pages of 16 inside a NaN pool, block table (2, 20)."""
    g = torch.Generator().manual_seed(0)
    pool = torch.full((63, 16, hkv, d), float("nan"), dtype=dtype)
    pool[10:53] = torch.randn(43, 16, hkv, d, generator=g).to(dtype)
    kc = pool[10:53]
    bt = torch.randperm(43, generator=g)[:40].reshape(2, 20).to(torch.int32)
    return kc, kc.clone(), bt


def _dec(q=None, kc=None, vc=None, lens=None, bt="paged", idx=None, scale=0.125, causal=False, splits=1, check=False):
    """A decode_attention call: the paged fp16 D = 64 case of the GPU guard test, with what is given replaced."""
    pk, pv, pbt = _paged()
    q = torch.randn(2, 1, 4, 64).half() if q is None else q
    kc = pk if kc is None else kc
    vc = (pv if kc is pk else kc.clone()) if vc is None else vc
    lens = torch.tensor([100, 30], dtype=torch.int32) if lens is None else lens
    bt = pbt if isinstance(bt, str) else bt
    return lambda ops: ops.decode_attention(q, kc, vc, lens, bt, idx, scale, causal, splits, check)


def _rot(q=None, k=None, v=None, kc=None, vc=None, cos="table", sin="table", lens=None, bt="paged", idx=None,
         check=False):
    """A rotary_append call: fp16 D = 64, Sq = 1, 4 query heads, 1 KV head, rotary_dim 32 (fp32 tables)."""
    pk, pv, pbt = _paged()
    table = torch.randn(CAP, 16)
    q = torch.randn(2, 1, 4, 64).half() if q is None else q
    k = torch.randn(2, 1, 1, 64).half() if k is None else k
    v = torch.randn(2, 1, 1, 64).half() if v is None else v
    kc = pk.clone() if kc is None else kc
    vc = pv if vc is None else vc
    cos = table if isinstance(cos, str) else cos
    sin = table.clone() if isinstance(sin, str) else sin
    lens = torch.tensor([5, 30], dtype=torch.int32) if lens is None else lens
    bt = pbt if isinstance(bt, str) else bt
    return lambda ops: ops.rotary_append(q, k, v, kc, vc, cos, sin, lens, bt, idx, False, True, check)


def _undefined(which):
    """flashtx_host_check::call_with_undefined (csrc/host_check/launchers.cpp): the ops with undefined tensors."""
    q, kc, lens = torch.randn(2, 1, 4, 64).half(), torch.randn(2, 16, 1, 64).half(), torch.tensor([3, 5]).int()
    args = (q, kc, kc.clone(), lens, torch.randn(2, 1, 1, 64).half(), torch.randn(16, 16), which)
    return lambda ops: torch.ops.flashtx_host_check.call_with_undefined(*args)


def _misaligned(shape, dtype=torch.float16):
    n = 1
    for s in shape:
        n *= s
    return torch.randn(n + 1).to(dtype)[1:].view(shape)


@functools.lru_cache(maxsize=None)
def _cases() -> dict:
    """name -> (call, expected): "ok", or the words the error ("<type>: <message>") must contain."""
    kc, vc, bt = _paged()
    bad = bt.clone()
    bad[0, 2], bad[1, 0] = -1, kc.shape[0] + 5
    lens = torch.tensor([100, 30], dtype=torch.int32)
    q = torch.randn(2, 1, 4, 64).half()
    contig = torch.randn(2, 64, 1, 64).half()
    cases = {
        # tests/test_cuda_ext_gpu.py::test_guards_and_check_values, line by line (its line 271 crashed on an H100)
        "guard_pages_masked": (_dec(bt=bad), "ok"),
        "guard_pages_checked": (_dec(bt=bad, check=True),
                                [dec_op, "block_table has entries outside [0, num_blocks = 43)"]),
        "guard_lens_checked": (_dec(lens=lens + CAP, check=True), [dec_op, "cache_seqlens must lie in [0, 320]"]),
        "guard_lens_clamped": (_dec(lens=lens + 10 * CAP), "ok"),
        "guard_append_full_row_dropped": (_rot(cos=None, sin=None, lens=torch.tensor([CAP, 5]).int()), "ok"),
        "guard_append_full_row_checked": (_rot(cos=None, sin=None, lens=torch.tensor([CAP, 5]).int(), check=True),
                                          [rot_op, "cache_seqlens must lie in [0, 319]"]),
        # tests/test_cuda_ext_gpu.py::test_binding_checks_name_the_argument
        "head_dim_96": (_dec(q=torch.randn(1, 1, 4, 96).half(), kc=torch.randn(1, 16, 1, 96).half(),
                             lens=torch.ones(1).int(), bt=None), [dec_op, "head dim must be 64 or 128"]),
        "lens_int64": (_dec(lens=lens.long()), [dec_op, "cache_seqlens must be int32; got Long"]),
        "cache_last_dim_strided": (_dec(kc=torch.randn(43, 16, 1, 128).half()[..., ::2], vc=kc),
                                   [dec_op, "k_cache must be contiguous in its last dim"]),
        "cache_misaligned": (_dec(kc=_misaligned((43, 16, 1, 64)), vc=kc), [dec_op, "k_cache's data must be 16-byte "
                                                                                    "aligned"]),
        # None where an optional goes, and undefined tensors (C++ callers; Python's None is an empty optional)
        "optionals_none_contiguous": (_dec(kc=contig, bt=None), "ok"),
        "optionals_undefined": (_undefined("optionals"), "ok"),
        "q_undefined": (_undefined("q"), [dec_op, f"q must be a {DEV} tensor; got an undefined tensor"]),
        "k_cache_undefined": (_undefined("k_cache"), [dec_op, "k_cache must be a", "got an undefined tensor"]),
        "v_cache_undefined": (_undefined("v_cache"), [dec_op, "v_cache must be a", "got an undefined tensor"]),
        "lens_undefined": (_undefined("cache_seqlens"), [dec_op, "cache_seqlens must be a", "undefined tensor"]),
        "rotary_tables_undefined": (_undefined("cos_sin"), "ok"),
        "rotary_cos_undefined": (_undefined("cos"), [rot_op, "pass both cos and sin, or neither"]),
        "k_undefined": (_undefined("k"), [rot_op, "k must be a", "got an undefined tensor"]),
        # q
        "q_float64": (_dec(q=q.double()), [dec_op, "q must be float16, bfloat16 or float32; got Double"]),
        "q_3d": (_dec(q=q[0]), [dec_op, "q must have 4 dims; got shape [1, 4, 64]"]),
        "q_meta": (_dec(q=q.to("meta")), [dec_op, f"q must be a {DEV} tensor; got device meta"]),
        "q_sparse": (_dec(q=q.float().to_sparse()), ["NotImplementedError: Could not run 'flashtx_cuda::"
                                                     "decode_attention' with arguments from the 'SparseCPU' backend"]),
        "q_meta_alone": (_dec(q=q.to("meta"), kc=kc.to("meta"), vc=vc.to("meta"), lens=lens.to("meta"),
                              bt=bt.to("meta")), [dec_op, f"q must be a {DEV} tensor; got device meta"]),
        "q_head_stride": (_dec(q=torch.randn(2, 1, 4, 65).half()[..., :64]), [dec_op, "q's strides must be "
                                                                                      "multiples of 8"]),
        "q_misaligned": (_dec(q=_misaligned((2, 1, 4, 64))), [dec_op, "q's data must be 16-byte aligned"]),
        "q_expanded": (_dec(q=q[:, :, :1].expand(2, 1, 4, 64)), "ok"),  # read only: stride 0 is a whole vector
        "q_empty_batch": (_dec(q=q[:0], kc=contig, lens=lens[:0], bt=None, check=True), "ok"),
        "q_empty_sq": (_dec(q=q[:, :0], check=True), "ok"),
        "q_empty_heads": (_dec(q=q[:, :, :0], check=True), "ok"),
        # the caches
        "cache_dtype": (_dec(vc=vc.bfloat16()), [dec_op, "v_cache must have q's dtype Half; got BFloat16"]),
        "cache_meta": (_dec(kc=kc.to("meta"), vc=vc.to("meta")), [dec_op, f"k_cache must be a {DEV} tensor"]),
        "cache_sparse": (_dec(kc=kc.float().to_sparse(), q=q.float()), ["NotImplementedError: ", "SparseCPU"]),
        "cache_shapes_differ": (_dec(vc=vc[:40]), [dec_op, "k_cache and v_cache must have the same shape"]),
        "cache_head_dim": (_dec(kc=torch.randn(43, 16, 1, 128).half()), [dec_op, "the caches' head dim must be q's"]),
        "cache_no_rows": (_dec(kc=kc[:0], vc=vc[:0]), [dec_op, "the caches must not be empty", "[0, 16, 1, 64]"]),
        "cache_no_slots": (_dec(kc=kc[:, :0], vc=vc[:, :0]), [dec_op, "the caches must not be empty"]),
        "cache_no_heads": (_dec(kc=kc[:, :, :0], vc=vc[:, :, :0]), [dec_op, "the caches must not be empty",
                                                                  "[43, 16, 0, 64]"]),
        "cache_rows_short": (_dec(kc=contig[:1], bt=None), [dec_op, "k_cache has 1 batch rows but q has B = 2"]),
        "cache_heads_gqa": (_dec(kc=torch.randn(43, 16, 3, 64).half()), [dec_op, "q's heads (4) must be a multiple "
                                                                                 "of the caches' heads (3)"]),
        "cache_expanded_read": (_dec(kc=kc[:1].expand(43, 16, 1, 64), vc=vc), "ok"),  # decode only reads
        "cache_capacity_over_2_30": (_dec(q=q[:1], kc=torch.zeros(1, 2**15, 1, 64).half(), lens=lens[:1],
                                          bt=torch.zeros(1, 2**15 + 1, dtype=torch.int32)),
                                     [dec_op, "the cache capacity (1073774592 positions) must be <= 2**30"]),
        # cache_seqlens
        "lens_shape": (_dec(lens=torch.zeros(3).int()), [dec_op, "cache_seqlens must be a contiguous (B,) = (2,)"]),
        "lens_strided": (_dec(lens=torch.zeros(2, 2).int()[:, 0]), [dec_op, "cache_seqlens must be a contiguous"]),
        "lens_2d": (_dec(lens=torch.zeros(2, 1).int()), [dec_op, "cache_seqlens must be a contiguous (B,)"]),
        "lens_meta": (_dec(lens=lens.to("meta")), [dec_op, f"cache_seqlens must be a {DEV} tensor"]),
        "lens_negative_checked": (_dec(lens=-lens, check=True), [dec_op, "cache_seqlens must lie in [0, 320]"]),
        # block_table
        "bt_int64": (_dec(bt=bt.long()), [dec_op, "block_table must be int32; got Long"]),
        "bt_no_blocks": (_dec(bt=bt[:, :0]), [dec_op, "block_table must be (B, max_blocks) = (2, >0)"]),
        "bt_rows": (_dec(bt=torch.zeros(3, 20).int()), [dec_op, "block_table must be (B, max_blocks) = (2, >0)"]),
        "bt_1d": (_dec(bt=bt[0]), [dec_op, "block_table must be (B, max_blocks)"]),
        "bt_last_dim_strided": (_dec(bt=torch.zeros(2, 40).int()[:, ::2]), [dec_op, "contiguous last dim"]),
        "bt_meta": (_dec(bt=bt.to("meta")), [dec_op, f"block_table must be a {DEV} tensor"]),
        "bt_rows_expanded": (_dec(bt=bt[:1].expand(2, 20)), "ok"),  # rows read the same pages: fine
        "bt_with_batch_idx": (_dec(idx=torch.zeros(2).int()), [dec_op, "cache_batch_idx cannot be used with a "
                                                                       "paged cache"]),
        # cache_batch_idx
        "idx_int64": (_dec(kc=contig, bt=None, idx=torch.zeros(2).long()), [dec_op, "cache_batch_idx must be int32"]),
        "idx_shape": (_dec(kc=contig, bt=None, idx=torch.zeros(3).int()), [dec_op, "cache_batch_idx must be a "
                                                                                   "contiguous (B,) = (2,)"]),
        "idx_meta": (_dec(kc=contig, bt=None, idx=torch.zeros(2).int().to("meta")), [dec_op, "cache_batch_idx must "
                                                                                             f"be a {DEV} tensor"]),
        "idx_out_of_range_masked": (_dec(kc=contig, bt=None, lens=torch.tensor([3, 5]).int(),
                                         idx=torch.tensor([0, 7]).int()), "ok"),
        "idx_out_of_range_checked": (_dec(kc=contig, bt=None, lens=torch.tensor([3, 5]).int(),
                                          idx=torch.tensor([0, 7]).int(), check=True),
                                     [dec_op, "cache_batch_idx must lie in [0, 2); got [0, 7]"]),
        "idx_rows_beyond_batch": (_dec(kc=contig[:1], bt=None, lens=torch.tensor([3, 5]).int(),
                                       idx=torch.tensor([0, 0]).int(), check=True), "ok"),
        # the launch
        "splits_0": (_dec(splits=0), [dec_op, "num_splits must be in [1, 128]; got 0"]),
        "splits_129": (_dec(splits=129), [dec_op, "num_splits must be in [1, 128]; got 129"]),
        "splits_128": (_dec(splits=128), "ok"),
        "grid_rows": (_dec(q=torch.zeros(1, 1, 1, 64).half().expand(1, 1024, 2048, 64),
                           kc=torch.zeros(1, 16, 2048, 64).half(), lens=lens[:1], bt=None),
                      [dec_op, "Hkv x row chunks = 2048 x 32 passes the grid's 65535"]),
        "grid_batch": (_dec(q=torch.zeros(1, 1, 1, 64).half().expand(65536, 1, 1, 64),
                            kc=torch.zeros(1, 16, 1, 64).half(), lens=torch.zeros(65536).int(),
                            bt=torch.zeros(65536, 1).int()), [dec_op, "B, Sq and Hq must be <= 65535"]),
        "fp32_bf16_d128": (_dec(q=torch.randn(2, 3, 4, 128), kc=torch.randn(2, 64, 2, 128), bt=None,
                                lens=torch.tensor([64, 0]).int(), causal=True, splits=3, check=True), "ok"),
        # rotary_append
        "append_plain": (_rot(check=True), "ok"),
        "append_no_tables": (_rot(cos=None, sin=None), "ok"),
        "append_cos_only": (_rot(sin=None), [rot_op, "pass both cos and sin, or neither"]),
        "append_sin_only": (_rot(cos=None), [rot_op, "pass both cos and sin, or neither"]),
        "append_cos_float64": (_rot(cos=torch.randn(CAP, 16).double()), [rot_op, "cos must be float32 or q's dtype "
                                                                                  "Half; got Double"]),
        "append_cos_transposed": (_rot(cos=torch.randn(16, CAP).t()), [rot_op, "cos must be a contiguous (S_rot, "
                                                                              "rotary_dim / 2) tensor"]),
        "append_cos_3d": (_rot(cos=torch.randn(CAP, 16, 1)), [rot_op, "cos must be a contiguous (S_rot"]),
        "append_cos_meta": (_rot(cos=torch.randn(CAP, 16).to("meta")), [rot_op, f"cos must be a {DEV} tensor"]),
        "append_sin_misaligned": (_rot(sin=_misaligned((CAP, 16), torch.float32)), [rot_op, "sin's data must be "
                                                                                           "16-byte aligned"]),
        "append_tables_differ": (_rot(sin=torch.randn(CAP, 8)), [rot_op, "cos and sin must have the same shape"]),
        "append_tables_short": (_rot(cos=torch.randn(100, 16), sin=torch.randn(100, 16)),
                                [rot_op, "cos/sin must cover every cache position: 100 rows for a cache capacity of "
                                         "320"]),
        "append_rotary_dim_12": (_rot(cos=torch.randn(CAP, 6), sin=torch.randn(CAP, 6)),
                                 [rot_op, "rotary_dim = 2 * cos.shape[1] must be a multiple of 16 in [16, 64]",
                                  "got 12"]),
        "append_rotary_dim_0": (_rot(cos=torch.randn(CAP, 0), sin=torch.randn(CAP, 0)), [rot_op, "got 0"]),
        "append_rotary_dim_past_d": (_rot(cos=torch.randn(CAP, 40), sin=torch.randn(CAP, 40)), [rot_op, "got 80"]),
        "append_k_sq": (_rot(k=torch.randn(2, 2, 1, 64).half()), [rot_op, "k and v must be (B, Sq, Hkv, D)"]),
        "append_k_dtype": (_rot(k=torch.randn(2, 1, 1, 64)), [rot_op, "k must have q's dtype Half; got Float"]),
        "append_v_meta": (_rot(v=torch.randn(2, 1, 1, 64).half().to("meta")), [rot_op, f"v must be a {DEV} tensor"]),
        "append_k_heads": (_rot(k=torch.randn(2, 1, 2, 64).half(), v=torch.randn(2, 1, 2, 64).half()),
                           [rot_op, "the caches' heads (1) must be k's (2)"]),
        "append_cache_expanded": (_rot(kc=kc[:1].expand(43, 16, 1, 64)), [rot_op, "k_cache has slots that share "
                                                                                  "memory"]),
        "append_caches_same": (_rot(kc=vc, vc=vc), [rot_op, "k_cache and v_cache share memory"]),
        "append_caches_overlap": (_rot(kc=(pool := torch.randn(44, 16, 1, 64).half())[:43], vc=pool[1:]),
                                  [rot_op, "k_cache and v_cache share memory"]),
        "append_q_in_k_cache": (_rot(kc=kc, q=kc[0, :8].reshape(2, 1, 4, 64)), [rot_op, "q shares memory with "
                                                                                         "k_cache"]),
        "append_k_in_v_cache": (_rot(vc=vc, k=vc[0, :2].reshape(2, 1, 1, 64)), [rot_op, "k shares memory with "
                                                                                         "v_cache"]),
        "append_k_is_v": (_rot(k=(kv := torch.randn(2, 1, 1, 64).half()), v=kv), "ok"),  # both only read
        "append_bad_pages_dropped": (_rot(bt=bad, lens=torch.tensor([33, 2]).int()), "ok"),
        "append_bad_pages_checked": (_rot(bt=bad, lens=torch.tensor([33, 2]).int(), check=True),
                                     [rot_op, "block_table has entries outside"]),
        "append_empty_batch": (_rot(q=q[:0], k=torch.randn(0, 1, 1, 64).half(), v=torch.randn(0, 1, 1, 64).half(),
                                    lens=lens[:0], bt=bt[:0], check=True), "ok"),
        "append_tables_in_dtype": (_rot(cos=torch.randn(CAP, 16).half(), sin=torch.randn(CAP, 16).half()), "ok"),
    }
    return cases


def _sweep(ops, n: int = 300) -> list[str]:
    """Random calls of both ops (dtypes, head dims, views at offsets and strides, expanded dims, paged or not):
    each must raise the binding's own RuntimeError or pass the stub launchers' checks. Returns the failures."""
    g = torch.Generator().manual_seed(0)

    def r(k):
        return int(torch.randint(0, k, (1,), generator=g))

    def view(shape, dtype):
        """shape as a view of a bigger tensor: an element offset, a wider last dim or more heads, or expanded."""
        kind = r(5)
        if kind == 1:  # offset by 0..8 elements
            off = r(9)
            n = 1
            for s in shape:
                n *= s
            return torch.randn(n + off).to(dtype)[off:].view(shape)
        if kind == 2:  # wider last dim (strides not whole vectors when it is odd)
            return torch.randn(*shape[:-1], shape[-1] + r(9)).to(dtype)[..., :shape[-1]]
        if kind == 3:  # more heads: strided over heads
            return torch.randn(*shape[:2], shape[2] + 1 + r(3), shape[3]).to(dtype)[:, :, :shape[2]]
        if kind == 4 and shape[0] > 1:  # expanded rows (stride 0)
            return torch.randn(1, *shape[1:]).to(dtype).expand(*shape)
        return torch.randn(*shape).to(dtype)

    bad = []
    for i in range(n):
        dtype = (torch.float16, torch.bfloat16, torch.float32)[r(3)]
        d = (64, 128, 96)[r(3)] if r(10) else 72
        B, Sq, hkv = 1 + r(3), 1 + r(4), 1 + r(2)
        hq = hkv * (1 + r(4))
        paged = r(2) == 1
        rows, slots = (6 + r(4), 16) if paged else (B + r(2), 32 + r(33))
        q = view((B, Sq, hq, d), dtype)
        kc, vc = view((rows, slots, hkv, d), dtype), view((rows, slots, hkv, d), dtype)
        lens = torch.randint(-3, 70, (B,), generator=g).to(torch.int32)
        bt = torch.randint(-1, rows + 1, (B, 1 + r(4)), generator=g).to(torch.int32) if paged else None
        idx = torch.randint(-1, rows + 1, (B,), generator=g).to(torch.int32) if not paged and r(2) else None
        try:
            if r(2):
                ops.decode_attention(q, kc, vc, lens, bt, idx, 0.1, bool(r(2)), 1 + r(6), bool(r(2)))
            else:
                k, v = view((B, Sq, hkv, d), dtype), view((B, Sq, hkv, d), dtype)
                rd = 2 * (1 + r(8)) * (16 // torch.empty(0, dtype=dtype).element_size())
                cos = torch.randn(rows * slots + r(3) * 16, rd // 2).to((torch.float32, dtype)[r(2)])
                tables = (cos, cos.clone()) if r(4) else (None, None)
                ops.rotary_append(q, k, v, kc, vc, *tables, lens, bt, idx, bool(r(2)), bool(r(2)), bool(r(2)))
        except RuntimeError as e:
            msg = str(e).splitlines()[0]
            if not msg.startswith("flashtx_cuda::") or "kernel launch failed" in msg:
                bad.append(f"call {i}: {msg}")
        except Exception as e:  # noqa: BLE001 (anything but the binding's RuntimeError is a failure)
            bad.append(f"call {i}: {type(e).__name__}: {e}")
    return bad


def _run(library: str) -> None:
    """In the subprocess: load the host-check library, run every case and the sweep, print the results (JSON)."""
    torch.ops.load_library(library)
    ops = torch.ops.flashtx_cuda
    out = {}
    for name, (call, _) in _cases().items():
        try:
            call(ops)
            out[name] = "ok"
        except Exception as e:  # noqa: BLE001 (reported, judged by the test)
            out[name] = f"{type(e).__name__}: {str(e).splitlines()[0]}"
    print(json.dumps({"cases": out, "sweep": _sweep(ops)}))


# ---------------------------------------------------------------------------------------------
# The tests
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def host_check(tmp_path_factory):
    """Build the host-check library (~20 s on 2 cores) and run everything in one subprocess."""
    lib = str(tmp_path_factory.mktemp("host_check") / "flashtx_cuda_host_check.so")
    cmd = host_check_cmd(lib)
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"the host-check build failed:\n{' '.join(cmd)}\n{proc.stdout[-3000:]}" \
                                 f"{proc.stderr[-6000:]}"
    build_s = time.time() - t0
    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
            f"import test_cuda_ext_binding_host as m; m._run({lib!r})")
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "FLASHTX_INTERPRET")}
    proc = subprocess.run([sys.executable, "-X", "faulthandler", "-c", code], capture_output=True, text=True,
                          timeout=600, env=env, cwd=str(ROOT))
    assert proc.returncode == 0, f"the host-check run failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}" \
                                 f"{proc.stderr[-6000:]}"
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]), build_s=build_s)


@pytest.mark.parametrize("name", list(_cases()))
def test_binding_check(host_check, name):
    _, expected = _cases()[name]
    got = host_check["cases"][name]
    if expected == "ok":
        assert got == "ok", got
    else:
        if expected[0] in (dec_op, rot_op):  # the binding's own check (else the dispatcher's, named in expected)
            assert got.startswith("RuntimeError: " + expected[0]), got
        for words in expected:
            assert words in got, (words, got)
        assert "kernel launch failed" not in got, got  # refused by a check, not by the launchers'


def test_what_the_binding_takes_the_launchers_take(host_check):
    """The random sweep: no call got past the binding's checks to break an assumption of the kernels (the stub
    launchers would have failed it), and none failed with anything but the binding's own RuntimeError."""
    assert host_check["sweep"] == [], "\n".join(host_check["sweep"][:20])


def test_host_check_launchers_mirror_the_real_ones():
    """The stubs' rows-per-block rule is the real launcher's (the binding sizes the grid check with it)."""
    real = (CSRC / "decode_attention.cu").read_text()
    stub = (CSRC / "host_check" / "launchers.cpp").read_text()
    rule = 'extern "C" int ftx_decode_rows_per_cta(int group_rows) { return group_rows <= 8 ? 8 : 32; }'
    assert rule in real and rule in stub
