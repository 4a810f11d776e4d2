"""The optional CUDA extension without a GPU (issue 16): every .cu file compiles for sm_80, sm_86
and sm_90 under the spill gate and fits each arch's shared memory; csrc/RESOURCES.md is current;
binding.cpp passes g++ -fsyntax-only against the installed torch headers; and the host-side Python
(split heuristic, argument checks, fakes, available() reasons, lock-file detection, setup.py's
switch) works on CPU. The kernels' numerics are tests/test_cuda_ext_gpu.py's (GPU only).

Without nvcc (or g++) the compile tests skip saying so; the host-side tests always run.
"""
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from flashtx import _cuda_build as B
from flashtx import cuda_ext
from flashtx.cuda_ext_reference import cache_rows, decode_attention_ref, rotary_append_ref

NVCC = B.find_nvcc()
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not found (set CUDA_HOME or put nvcc on PATH): the "
                                                     "CUDA compile checks cannot run")
# the module fixture runs once: its tests share one xdist worker (pytest -n auto --dist loadgroup)
pytestmark = pytest.mark.xdist_group("cuda-ext-build")


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    """The nvcc compile check (both .cu files in parallel) and, alongside, g++ -fsyntax-only of the binding."""
    if NVCC is None:
        pytest.skip("nvcc not found (set CUDA_HOME or put nvcc on PATH): the CUDA compile checks cannot run")
    home = B.cuda_home(NVCC)
    inc = B.cuda_include_dir(home) if home else None
    gxx = None
    if inc and __import__("shutil").which("g++"):
        stand_in = B.write_stand_in(str(tmp_path_factory.mktemp("stand_in")))
        torch_inc = os.path.join(os.path.dirname(torch.__file__), "include")
        cmd = B.binding_syntax_cmd(torch_inc, inc, stand_in)
        gxx = (cmd, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    t0 = time.time()
    results = B.compile_check(NVCC)
    nvcc_s = time.time() - t0
    syntax = None
    if gxx is not None:
        out, _ = gxx[1].communicate(timeout=600)
        syntax = (gxx[0], gxx[1].returncode, out)
    return {"results": results, "nvcc_s": nvcc_s, "syntax": syntax, "home": home, "include": inc}


@needs_nvcc
def test_every_kernel_compiles_without_spills_and_fits(builds, capsys):
    results = builds["results"]
    with capsys.disabled():
        print(f"\n{B.resources_markdown(results, B.nvcc_version(NVCC))}(nvcc: {builds['nvcc_s']:.1f} s)")
    for res in results:
        assert res["rc"] == 0, f"nvcc failed (a spill fails it under -Werror):\n{res['cmd']}\n{res['output'][-4000:]}"
    bad = [f"{r['kernel']} sm_{r['arch']}: {'; '.join(B.problems(r))}"
           for res in results for r in res["records"] if B.problems(r)]
    assert not bad, "kernels failing the gate:\n" + "\n".join(bad)


@needs_nvcc
@pytest.mark.parametrize("arch", B.ARCHS, ids=lambda a: f"sm_{a}")
def test_every_kernel_variant_is_covered(builds, arch):
    names = B.demangle([r["kernel"] for res in builds["results"] for r in res["records"] if r["arch"] == arch])
    got = set(names.values())
    for t in ("half", "bf16", "float"):
        for d in (64, 128):
            for rows in (8, 32):
                assert f"decode_attention_kernel<{t}, {d}, {rows}>" in got
            assert f"decode_combine_kernel<{t}, {d}>" in got
        assert f"rotary_append_kernel<{t}, float>" in got
    assert "rotary_append_kernel<half, half>" in got and "rotary_append_kernel<bf16, bf16>" in got


@needs_nvcc
def test_resources_md_is_current(builds):
    recorded = B.RESOURCES_MD.read_text()
    here = B.nvcc_version(NVCC)
    if B.recorded_nvcc_version(recorded) != here:
        pytest.skip(f"csrc/RESOURCES.md was generated with nvcc {B.recorded_nvcc_version(recorded)}, this is {here}: "
                    "register counts differ between versions")
    assert B.resources_markdown(builds["results"], here) == recorded, (
        "csrc/RESOURCES.md is stale: run python -m flashtx._cuda_build --write")


@needs_nvcc
def test_cuda_home_is_nvccs_real_install(builds):
    """The nvcc wrapper pitfall: CUDA_HOME comes from nvcc -dryrun's TOP, where the headers are."""
    assert builds["home"] and builds["include"], f"no cuda_runtime_api.h under {builds['home']}"
    assert Path(builds["include"], "cuda_runtime_api.h").exists()


@needs_nvcc
def test_binding_syntax(builds):
    if builds["syntax"] is None:
        pytest.skip("g++ or the CUDA runtime headers not found: cannot syntax-check csrc/binding.cpp")
    cmd, rc, out = builds["syntax"]
    assert rc == 0, f"g++ -fsyntax-only csrc/binding.cpp failed:\n{' '.join(cmd)}\n{out[-4000:]}"


def _string_literal_concat(src: str, start: str) -> list[str]:
    """The m.def("...") schemas of binding.cpp, with adjacent string literals joined."""
    out = []
    for m in re.finditer(re.escape(start) + r"\(((?:\s*\"[^\"]*\")+)\)", src):
        out.append("".join(re.findall(r"\"([^\"]*)\"", m.group(1))))
    return out


def test_schemas_match_binding():
    src = (B.ROOT / B.BINDING).read_text()
    assert sorted(_string_literal_concat(src, "m.def")) == sorted(cuda_ext.SCHEMAS.values())
    for name in cuda_ext.SCHEMAS:
        assert f'm.impl("{name}"' in src
    assert "TORCH_LIBRARY(flashtx_cuda, m)" in src and "TORCH_LIBRARY_IMPL(flashtx_cuda, CUDA, m)" in src
    assert "#include <pybind11" not in src and "torch/extension.h" not in src and "PYBIND11_MODULE" not in src


def test_rows_per_cta_mirrors_the_launcher():
    src = (B.ROOT / "csrc" / "decode_attention.cu").read_text()
    m = re.search(r"ftx_decode_rows_per_cta\(int group_rows\) \{ return group_rows <= (\d+) \? (\d+) : (\d+); \}", src)
    assert m, "ftx_decode_rows_per_cta changed: update flashtx.cuda_ext.rows_per_cta and this test"
    lim, small, big = map(int, m.groups())
    for rows in (1, 4, 8, 9, 16, 32, 33, 64):
        assert cuda_ext.rows_per_cta(rows) == (small if rows <= lim else big)
    assert cuda_ext.decode_ctas(2, 32, 8, 1) == 2 * 8  # 4 rows a KV head: one block
    assert cuda_ext.decode_ctas(1, 64, 4, 4) == 4 * 2  # 64 rows a KV head: two blocks of 32


def test_num_splits_heuristic():
    h = cuda_ext.num_splits_heuristic
    assert h(108, 132, 64, 128) == 1  # the blocks of one split fill >= 80% of the SMs
    assert h(1, 4, 8, 128) == 4  # efficiency .25, .5, .75, 1.0: all 4 SMs
    assert h(8, 108, 1, 128) == 1  # one block of keys: nothing to split
    assert h(1, 132, 5, 128) == 5  # capped by the key blocks
    assert h(0, 132, 8, 128) == 1  # no blocks (an empty q): nothing to split (it divided by zero)
    for ctas, sms, nb in [(8, 108, 32), (16, 132, 32), (3, 80, 200), (40, 132, 7)]:
        s = h(ctas, sms, nb, 128)
        assert 1 <= s <= min(sms, nb, 128)
        eff = lambda n: (ctas * n / sms) / -(-ctas * n // sms)  # noqa: E731
        assert eff(s) >= 0.85 * max(eff(n) for n in range(1, min(sms, nb, 128) + 1)
                                    if n == 1 or -(-nb // n) != -(-nb // (n - 1)))
    # decode: one long sequence splits; a big batch does not; a short cache does not
    assert cuda_ext.choose_num_splits(1, 32, 8, 1, 32768, 132, 4) > 1
    assert cuda_ext.choose_num_splits(64, 32, 8, 1, 32768, 132, 2) == 1
    assert cuda_ext.choose_num_splits(8, 32, 8, 1, 8192, 132, 2) == 4  # 64 blocks, 2 an SM (flash-attn's count): 4
    assert cuda_ext.choose_num_splits(8, 32, 8, 1, 8192, 132, 4) == 7  # 4 an SM (an H100 occupancy): 448 of 528
    assert cuda_ext.choose_num_splits(1, 32, 8, 1, 200, 132, 4) == 1
    assert cuda_ext.choose_num_splits(1, 32, 8, 1, 10**7, 132, 4) <= cuda_ext.MAX_SPLITS


def _recorded_resources() -> dict:
    """csrc/RESOURCES.md's decode_attention_kernel rows: {(type, D, ROWS): [(registers, static smem), per arch]}."""
    out = {}
    for m in re.finditer(r"^\| `decode_attention_kernel<(\w+), (\d+), (\d+)>` \| [^|]+\|(.*)\|$",
                         B.RESOURCES_MD.read_text(), re.M):
        cells = [c.strip() for c in m.group(4).split("|")]
        out[(m.group(1), int(m.group(2)), int(m.group(3)))] = [
            tuple(int(x.replace(",", "")) for x in c.split(" / ")[:2]) for c in cells]
    return out


def test_split_count_occupancy_mirrors_the_kernels_resources():
    """decode_smem_bytes is what nvcc allocated for every decode kernel (csrc/RESOURCES.md, which
    test_resources_md_is_current keeps current), and no kernel takes more registers than decode_ctas_per_sm
    assumes; so the blocks an SM runs at once, which the split count fills, are the GPU's real occupancy."""
    rec = _recorded_resources()
    assert len(rec) == 12, sorted(rec)
    for (t, d, rows), per_arch in rec.items():
        elt = {"half": 2, "bf16": 2, "float": 4}[t]
        for regs, smem in per_arch:
            assert smem == cuda_ext.decode_smem_bytes(elt, d, rows), (t, d, rows, smem)
            assert regs <= cuda_ext.DECODE_REGS_BOUND, (t, d, rows, regs)
    # double-buffered K/V where two buffers fit the 48 KB of static shared memory (fp16 D = 128, 8 rows); one buffer
    # where they do not (fp16 D = 64, 32 rows: 50,560 bytes with two)
    assert cuda_ext.decode_smem_bytes(2, 128, 8) == 38496 and cuda_ext.decode_smem_bytes(2, 64, 32) == 31616
    h100 = dict(threads_per_sm=2048, regs_per_sm=65536, smem_per_sm=233472)
    rtx3090 = dict(threads_per_sm=1536, regs_per_sm=65536, smem_per_sm=102400)
    assert cuda_ext.decode_ctas_per_sm(2, 128, 8, **h100) == 4  # registers bound it
    assert cuda_ext.decode_ctas_per_sm(2, 128, 8, **rtx3090) == 2  # shared memory bounds it
    assert cuda_ext.decode_ctas_per_sm(4, 128, 32, **rtx3090) == 2
    assert cuda_ext.decode_ctas_per_sm(2, 128, 8, threads_per_sm=128, regs_per_sm=65536, smem_per_sm=1) == 1


def _args(dtype=torch.float16, d=64, batch=2, sq=1, hq=8, hkv=2, paged=False):
    q = torch.randn(batch, sq, hq, d, dtype=dtype)
    if paged:
        kc = torch.randn(10, 16, hkv, d, dtype=dtype)
        bt = torch.arange(batch * 4, dtype=torch.int32).reshape(batch, 4)
    else:
        kc, bt = torch.randn(batch, 64, hkv, d, dtype=dtype), None
    return q, kc, kc.clone(), torch.full((batch,), 5, dtype=torch.int32), bt


@pytest.mark.parametrize("case, exc, words", [
    ("dtype", TypeError, ["q must be float16, bfloat16 or float32", "torch.float64"]),
    ("head_dim", ValueError, ["head dim must be 64 or 128", "(2, 1, 8, 96)"]),
    ("gqa", ValueError, ["q's heads (8) must be a multiple of the caches' heads (3)"]),
    ("no_heads", ValueError, ["the caches must not be empty", "(2, 64, 0, 64)"]),  # (was a ZeroDivisionError)
    ("lens_dtype", TypeError, ["cache_seqlens must be int32", "torch.int64"]),
    ("lens_shape", ValueError, ["cache_seqlens must have shape (B,) = (2,)", "(3,)"]),
    ("last_dim", ValueError, ["k_cache must be contiguous in its last dim"]),
    ("cache_dtype", TypeError, ["v_cache must have q's dtype torch.float16", "torch.bfloat16"]),
    ("cache_rows", ValueError, ["k_cache has 1 batch rows but q has B = 2", "cache_batch_idx"]),
    ("block_table_shape", ValueError, ["block_table must be (B, max_blocks) = (2, >0)", "(3, 4)"]),
    ("block_table_dtype", TypeError, ["block_table must be int32", "torch.int64"]),
    ("paged_and_idx", ValueError, ["cache_batch_idx cannot be used with a paged cache"]),
    ("num_splits", ValueError, ["num_splits must be in [1, 128]", "129"]),
])
def test_decode_argument_checks(case, exc, words):
    q, kc, vc, lens, bt = _args(paged=case.startswith(("block", "paged")))
    idx, ns = None, 1
    if case == "dtype":
        q = q.double()
    elif case == "head_dim":
        q = torch.randn(2, 1, 8, 96, dtype=torch.float16)
    elif case == "gqa":
        kc = vc = torch.randn(2, 64, 3, 64, dtype=torch.float16)
    elif case == "no_heads":
        kc = vc = torch.randn(2, 64, 0, 64, dtype=torch.float16)
    elif case == "lens_dtype":
        lens = lens.long()
    elif case == "lens_shape":
        lens = torch.zeros(3, dtype=torch.int32)
    elif case == "last_dim":
        kc = torch.randn(2, 64, 2, 128, dtype=torch.float16)[..., ::2]
    elif case == "cache_dtype":
        vc = vc.bfloat16()
    elif case == "cache_rows":
        kc, vc = kc[:1], vc[:1]
    elif case == "block_table_shape":
        bt = torch.zeros(3, 4, dtype=torch.int32)
    elif case == "block_table_dtype":
        bt = bt.long()
    elif case == "paged_and_idx":
        idx = torch.zeros(2, dtype=torch.int32)
    elif case == "num_splits":
        ns = 129
    with pytest.raises(exc) as info:
        cuda_ext.check_decode_args(q, kc, vc, lens, bt, idx, ns)
    assert str(info.value).startswith("flashtx.cuda_ext.decode_attention: ")
    for w in words:
        assert w in str(info.value), str(info.value)


@pytest.mark.parametrize("case, words", [
    ("k_seq", ["k and v must be (B, Sq, Hkv, D) with q's B, Sq, D = 2, 2, 64"]),
    ("cos_rows", ["cos/sin must cover every cache position: 10 rows for a cache capacity of 64"]),
    ("rotary_dim", ["rotary_dim = 2 * cos.shape[1] must be a multiple of 16 in [16, 64]", "got 12"]),
    ("cos_dtype", ["cos must be float32 or q's dtype torch.float16", "torch.float64"]),
    ("one_of", ["pass both cos and sin, or neither"]),
])
def test_rotary_append_argument_checks(case, words):
    q, kc, vc, lens, _ = _args(sq=2)
    k = v = torch.randn(2, 2, 2, 64, dtype=torch.float16)
    cos = sin = torch.randn(64, 32)
    if case == "k_seq":
        k = v = torch.randn(2, 1, 2, 64, dtype=torch.float16)
    elif case == "cos_rows":
        cos = sin = torch.randn(10, 32)
    elif case == "rotary_dim":
        cos = sin = torch.randn(64, 6)
    elif case == "cos_dtype":
        cos = sin = cos.double()
    elif case == "one_of":
        sin = None
    with pytest.raises((ValueError, TypeError)) as info:
        cuda_ext.check_rotary_append_args(q, k, v, kc, vc, cos, sin, lens)
    for w in words:
        assert w in str(info.value), str(info.value)
    # the valid call passes and reports the rotary dim
    assert cuda_ext.check_rotary_append_args(q, torch.randn(2, 2, 2, 64, dtype=torch.float16),
                                             torch.randn(2, 2, 2, 64, dtype=torch.float16), kc, vc,
                                             torch.randn(64, 16), torch.randn(64, 16), lens) == 32


def test_binding_limits_on_meta_tensors():
    """The binding's limits, mirrored by the checks the fakes run: the grid (Hkv x row chunks), a cache capacity
    past 2**30 (int positions in the kernels' key loop), int32 per-token and table-row counts in rotary_append."""
    m = dict(device="meta")
    q, kc = torch.empty(1, 1024, 2048, 64, dtype=torch.float16, **m), torch.empty(1, 64, 2048, 64, dtype=torch.float16,
                                                                                 **m)
    lens = torch.empty(1, dtype=torch.int32, **m)
    with pytest.raises(ValueError, match="Hkv x row chunks = 2048 x 32 passes the grid's 65535"):
        cuda_ext.check_decode_args(q, kc, kc, lens)
    q1, pages = torch.empty(1, 1, 8, 64, dtype=torch.float16, **m), torch.empty(10, 16, 2, 64, dtype=torch.float16, **m)
    bt = torch.empty(1, 2**26 + 1, dtype=torch.int32, **m)
    with pytest.raises(ValueError, match=r"the cache capacity \(1073741840 positions\) must be <= 2\*\*30"):
        cuda_ext.check_decode_args(q1, pages, pages, lens, bt)
    assert cuda_ext.check_decode_args(q1, pages, pages, lens, bt[:, :2**26]) == 2**30
    k = torch.empty(1, 1, 2, 64, dtype=torch.float16, **m)
    cos = torch.empty(2**31, 16, **m)
    with pytest.raises(ValueError, match=r"cos/sin have 2147483648 rows; at most 2\*\*31 - 1"):
        cuda_ext.check_rotary_append_args(q1, k, k, pages, pages, cos, cos, lens, bt[:, :2**26])
    wide = torch.empty(1, 1, 2**25, 64, dtype=torch.float16, **m)
    with pytest.raises(ValueError, match=r"\(Hq \+ 2 Hkv\) \* D = \(33554432 \+ 2 \* 33554432\) \* 64"):
        cuda_ext.check_rotary_append_args(wide, wide, wide, torch.empty(1, 64, 2**25, 64, dtype=torch.float16, **m),
                                          torch.empty(1, 64, 2**25, 64, dtype=torch.float16, **m), None, None, lens)


def test_fakes_give_shapes_on_meta_tensors():
    q, kc, vc, lens, bt = (t if t is None else t.to("meta") for t in _args(dtype=torch.bfloat16, d=128, sq=3,
                                                                            paged=True))
    out, lse = cuda_ext._decode_fake(q, kc, vc, lens, bt, None, 0.1, True, 4, False)
    assert out.shape == q.shape and out.dtype == torch.bfloat16 and out.device.type == "meta"
    assert lse.shape == (2, 8, 3) and lse.dtype == torch.float32
    k = torch.empty(2, 3, 2, 128, dtype=torch.bfloat16, device="meta")
    cos = torch.empty(64, 64, device="meta")
    qr = cuda_ext._rotary_append_fake(q, k, k, kc, vc, cos, cos, lens, bt, None, False, True, False)
    assert qr.shape == q.shape and qr.dtype == q.dtype


def test_schemas_trace_under_torch_compile():
    """The schemas + fakes as the library would register them (here with an eager reference as the
    CPU kernel): torch.compile(fullgraph=True) traces both ops without a graph break."""
    code = textwrap.dedent("""
        import torch
        from flashtx import cuda_ext
        from flashtx.cuda_ext_reference import decode_attention_ref, rotary_append_ref
        lib = torch.library.Library("flashtx_cuda", "DEF")
        for s in cuda_ext.SCHEMAS.values():
            lib.define(s)
        def dec(q, kc, vc, lens, bt, idx, scale, causal, ns, cv):
            o, l = decode_attention_ref(q, kc, vc, lens, bt, idx, scale, causal)
            return o.to(q.dtype), l.float()
        def rot(q, k, v, kc, vc, cos, sin, lens, bt, idx, inter, qc, cv):
            qr, kn, vn = rotary_append_ref(q, k, v, kc, vc, lens, cos, sin, inter, qc, bt, idx)
            kc.copy_(kn); vc.copy_(vn)
            return qr.to(q.dtype)
        lib.impl("decode_attention", dec, "CPU")
        lib.impl("rotary_append", rot, "CPU")
        cuda_ext._register_fakes()
        def step(q, k, v, kc, vc, cos, sin, lens):
            qr = torch.ops.flashtx_cuda.rotary_append(q, k, v, kc, vc, cos, sin, lens, None, None, False, True, False)
            return torch.ops.flashtx_cuda.decode_attention(qr, kc, vc, lens + 1, None, None, 0.125, True, 1, False)
        q = torch.randn(2, 1, 4, 64); k = torch.randn(2, 1, 2, 64); v = torch.randn(2, 1, 2, 64)
        kc = torch.randn(2, 16, 2, 64); vc = torch.randn(2, 16, 2, 64)
        cos, sin = torch.randn(16, 32), torch.randn(16, 32); lens = torch.tensor([3, 7], dtype=torch.int32)
        kc2, vc2 = kc.clone(), vc.clone()
        eager = step(q, k, v, kc, vc, cos, sin, lens)
        comp = torch.compile(step, fullgraph=True, backend="aot_eager")(q, k, v, kc2, vc2, cos, sin, lens)
        assert torch.allclose(eager[0], comp[0], atol=1e-5) and torch.allclose(kc, kc2)
        print("ok")
    """)
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "FLASHTX_INTERPRET")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300,
                          cwd=str(B.ROOT))
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout[-3000:] + proc.stderr[-3000:]


def test_available_says_why_not(monkeypatch):
    if torch.version.cuda is None:
        assert not cuda_ext.available()
        assert "CPU-only build" in cuda_ext.unavailable_reason()
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(B, "find_nvcc", lambda: None)
    monkeypatch.setattr(cuda_ext, "_ops_registered", lambda: False)
    monkeypatch.setattr(cuda_ext, "aot_library", lambda: None)
    monkeypatch.setitem(cuda_ext._state, "loaded", None)
    monkeypatch.setitem(cuda_ext._state, "error", None)
    monkeypatch.delenv(cuda_ext.ENV_AUTO, raising=False)
    why = cuda_ext.unavailable_reason()
    assert why.startswith("not built: ") and "nvcc not found" in why
    with pytest.raises(RuntimeError, match="cannot build flashtx's CUDA extension: nvcc not found"):
        cuda_ext.build()
    # automatic choice: off even if everything were there, with the reason
    reasons = cuda_ext.not_supported_reasons(torch.zeros(1, 1, 2, 96, dtype=torch.float64))
    assert any("CUDA tensors only" in r for r in reasons)
    assert any("float64 is not supported" in r for r in reasons)
    assert any("head dim 96" in r for r in reasons)
    assert cuda_ext.NOT_MEASURED in reasons and "backend='cuda'" in cuda_ext.NOT_MEASURED
    monkeypatch.setattr(cuda_ext, "unavailable_reason", lambda *a: None)
    assert cuda_ext.not_supported_reasons(automatic=False) == []
    assert cuda_ext.not_supported_reasons() != []  # MEASURED_FASTER is False: never chosen automatically


def test_functions_refuse_without_the_extension():
    if cuda_ext.available():
        pytest.skip("the extension is available here")
    q, kc, vc, lens, _ = _args()
    with pytest.raises(RuntimeError, match="the CUDA extension is not available: "):
        cuda_ext.decode_attention(q, kc, vc, lens)


def test_lock_file_detection(tmp_path):
    assert cuda_ext.lock_problem(str(tmp_path)) is None
    cuda_ext.wait_for_lock(str(tmp_path), wait_s=0)  # no lock: returns at once
    lock = tmp_path / "lock"
    lock.touch()
    msg = cuda_ext.lock_problem(str(tmp_path))
    assert "another process is building" in msg and f"rm {lock}" in msg
    with pytest.raises(RuntimeError, match=re.escape(f"rm {lock}")):
        cuda_ext.wait_for_lock(str(tmp_path), wait_s=0.1, poll_s=0.02)
    old = time.time() - 2 * cuda_ext.STALE_LOCK_S
    os.utime(lock, (old, old))
    msg = cuda_ext.lock_problem(str(tmp_path))
    assert msg.startswith("stale lock file") and f"delete it: rm {lock}" in msg
    t0 = time.time()
    with pytest.raises(RuntimeError, match="stale lock file"):
        cuda_ext.wait_for_lock(str(tmp_path), wait_s=60)
    assert time.time() - t0 < 5  # a stale lock fails at once instead of waiting


def test_build_directory_follows_torch_extensions_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert cuda_ext.build_directory() == os.path.join(str(tmp_path), "flashtx_cuda")


def test_parse_resource_usage():
    text = textwrap.dedent("""\
        ptxas info    : 0 bytes gmem
        ptxas info    : Compiling entry function '_Z1kv' for 'sm_86'
        ptxas info    : Function properties for _Z1kv
            8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads
        ptxas info    : Used 255 registers, used 1 barriers, 1024 bytes smem, 356 bytes cmem[0]
        ptxas info    : Compiling entry function '_Z1jv' for 'sm_90'
        ptxas info    : Function properties for _Z1jv
            0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
        ptxas info    : Used 32 registers, used 0 barriers, 356 bytes cmem[0]
    """)
    a, b = B.parse_resource_usage(text)
    assert (a["kernel"], a["arch"], a["registers"], a["smem"], a["spill_stores"]) == ("_Z1kv", 86, 255, 1024, 4)
    assert len(B.problems(a)) == 2  # spills and a stack frame
    assert (b["arch"], b["registers"], b["smem"]) == (90, 32, 0) and not B.problems(b)
    assert B.problems(dict(b, arch=86, smem=101_377)) == ["101377 B smem > 49152 B"]


def _run_setup(env_value):
    """setup.py with setuptools.setup replaced: the keyword arguments it would build with."""
    code = textwrap.dedent("""
        import json, runpy, setuptools
        seen = {}
        setuptools.setup = lambda **kw: seen.update(kw)
        try:
            runpy.run_path("setup.py", run_name="__main__")
        except SystemExit as e:
            print("EXIT", e); raise SystemExit(0)
        print("KW", json.dumps(sorted(seen)))
    """)
    env = dict(os.environ)
    env.pop("FLASHTX_BUILD_CUDA", None)
    if env_value is not None:
        env["FLASHTX_BUILD_CUDA"] = env_value
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=str(B.ROOT),
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip().splitlines()[-1]


def test_plain_install_stays_pure_python():
    assert _run_setup(None) == "KW []"
    assert _run_setup("0") == "KW []"
    assert _run_setup("off") == "KW []"


def test_setup_refuses_a_build_switch_it_does_not_know():
    """FLASHTX_BUILD_CUDA=maybe must not silently install without the extension (nor build it)."""
    assert _run_setup("maybe") == ("EXIT FLASHTX_BUILD_CUDA='maybe': set it to 1 to build the CUDA extension, or to 0 "
                                   "(or unset it) not to")


def test_arch_lists_in_every_common_spelling():
    assert B.parse_archs("80;86;90") == B.parse_archs("8.0 8.6 9.0+PTX") == B.parse_archs("sm_80,sm_86,sm_90") == [
        80, 86, 90]
    assert B.parse_archs("") == [] and B.parse_archs("10.0;sm_120") == [100, 120]
    for bad, words in (("90a", "'90a' is not a compute capability"), ("7.5", "sm_75 is below sm_80"),
                       ("8", "'8' is not a compute capability")):
        with pytest.raises(ValueError, match=f"FLASHTX_CUDA_ARCHS='{bad}': {words}"):
            B.parse_archs(bad)


def test_cuda_home_that_does_not_hold_the_nvcc_in_use_is_not_trusted(monkeypatch, tmp_path):
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "missing"))
    monkeypatch.setattr(B, "cuda_home", lambda nvcc=None: "/the/real/top")
    assert B.resolve_cuda_home("/usr/bin/nvcc") == "/the/real/top"
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "nvcc").write_text("")
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))
    assert B.resolve_cuda_home(str(tmp_path / "bin" / "nvcc")) == str(tmp_path)


def test_the_build_on_first_use_waits_for_a_gpu(monkeypatch):
    """FLASHTX_CUDA_EXT=1 builds on first use only where the extension can run: not for CPU tensors, not on a
    machine without a CUDA device (build() and build_if_missing=True still build anywhere)."""
    built = []
    monkeypatch.setattr(cuda_ext, "build", lambda *a, **k: built.append(1) or "stub")
    monkeypatch.setattr(cuda_ext, "_ops_registered", lambda: False)
    monkeypatch.setattr(cuda_ext, "aot_library", lambda: None)
    monkeypatch.setitem(cuda_ext._state, "loaded", None)
    monkeypatch.setitem(cuda_ext._state, "error", None)
    monkeypatch.setenv(cuda_ext.ENV_AUTO, "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cuda_ext.not_supported_reasons(torch.zeros(1, 1, 2, 64, dtype=torch.float16), automatic=False)  # CPU tensors
    assert built == []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not cuda_ext.load() and built == []
    assert "no CUDA device is visible" in cuda_ext.unavailable_reason() or cuda_ext.build_env_reasons()
    cuda_ext.load(build_if_missing=True)
    assert built == [1]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    built.clear()
    cuda_ext.load()
    assert built == [1]  # with a GPU the switch builds


@pytest.mark.skipif(torch.version.cuda is not None, reason="this torch is a CUDA build: setup.py would build")
def test_aot_switch_on_cpu_torch_says_why():
    out = _run_setup("1")
    assert out.startswith("EXIT FLASHTX_BUILD_CUDA=1: ")
    assert ("CPU-only build" in out) or ("nvcc not found" in out)


@pytest.mark.parametrize("paged", [False, True])
def test_reference_paged_equals_contiguous(paged):
    """The eager reference the GPU test trusts: a paged cache with shuffled pages gives the same
    attention as the contiguous cache it was cut from, and matches SDPA on the gathered keys."""
    g = torch.Generator().manual_seed(0)
    batch, s_cache, hkv, d, page = 3, 64, 2, 64, 16
    q = torch.randn(batch, 2, 8, d, generator=g, dtype=torch.float64)
    kc, vc = (torch.randn(batch, s_cache, hkv, d, generator=g, dtype=torch.float64) for _ in range(2))
    lens = torch.tensor([64, 17, 1], dtype=torch.int32)
    out, lse = decode_attention_ref(q, kc, vc, lens, causal=True)
    if paged:
        perm = torch.randperm(batch * s_cache // page, generator=g)
        kp = torch.empty(batch * s_cache // page, page, hkv, d, dtype=torch.float64)
        vp = torch.empty_like(kp)
        kp[perm] = kc.reshape(-1, page, hkv, d)
        vp[perm] = vc.reshape(-1, page, hkv, d)
        bt = perm.reshape(batch, -1).int()
        assert torch.equal(cache_rows(kp, 1, 17, bt), kc[1, :17])
        out2, lse2 = decode_attention_ref(q, kp, vp, lens, block_table=bt, causal=True)
        torch.testing.assert_close(out2, out, rtol=0, atol=1e-12)
        torch.testing.assert_close(lse2, lse, rtol=0, atol=1e-12)
    for b in range(batch):
        n = int(lens[b])
        k, v = (t[b, :n].repeat_interleave(4, 1).transpose(0, 1) for t in (kc, vc))
        mask = torch.ones(2, n, dtype=torch.bool).tril(n - 2)
        ref = torch.nn.functional.scaled_dot_product_attention(q[b].transpose(0, 1), k, v, attn_mask=mask)
        rows = mask.any(-1)  # lens 1 with Sq 2: query 0 sees no key -> 0 and -inf
        torch.testing.assert_close(out[b].transpose(0, 1)[:, rows], ref[:, rows], rtol=0, atol=1e-12)
        assert torch.all(out[b][~rows] == 0) and torch.all(lse[b][:, ~rows] == float("-inf"))


def test_reference_rotary_append():
    """rotate_half (NeoX) and complex multiplication (interleaved) written out independently."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 2, 2, 64, generator=g, dtype=torch.float64)
    k, v = (torch.randn(1, 2, 1, 64, generator=g, dtype=torch.float64) for _ in range(2))
    kc, vc = torch.zeros(1, 8, 1, 64, dtype=torch.float64), torch.zeros(1, 8, 1, 64, dtype=torch.float64)
    theta = torch.arange(8, dtype=torch.float64)[:, None] * 0.1 * torch.arange(1, 17, dtype=torch.float64)
    cos, sin = theta.cos(), theta.sin()  # rotary_dim 32 of D 64
    lens = torch.tensor([5], dtype=torch.int32)
    qr, kn, vn = rotary_append_ref(q, k, v, kc, vc, lens, cos, sin, interleaved=False)
    x, c, s = k[0, 1, 0], cos[6], sin[6]
    half = torch.cat([-x[16:32], x[:16]])
    torch.testing.assert_close(kn[0, 6, 0, :32], x[:32] * torch.cat([c, c]) + half * torch.cat([s, s]))
    assert torch.equal(kn[0, 6, 0, 32:], x[32:]) and torch.equal(vn[0, 5:7, 0], v[0, :, 0])
    assert torch.all(kn[0, :5] == 0) and torch.all(kn[0, 7:] == 0)
    qr, kn, _ = rotary_append_ref(q, k, v, kc, vc, lens, cos, sin, interleaved=True, q_causal=False)
    rot = torch.polar(torch.ones(16, dtype=torch.float64), theta[5])  # not causal: every query at position 5
    z = torch.view_as_complex(q[0, 1, 1, :32].reshape(16, 2).contiguous()) * rot
    torch.testing.assert_close(qr[0, 1, 1, :32], torch.view_as_real(z).reshape(32))


def test_readme_documents_the_extension():
    readme = (B.ROOT / "README.md").read_text()
    sec = readme[readme.index("## Optional CUDA extension"):]
    for w in ("FLASHTX_BUILD_CUDA=1 pip install --no-build-isolation -e .", "FLASHTX_CUDA_EXT=1",
              "cuda_ext.build()", "off by default", "available()", 'backend="cuda"', "`backend=None`) never takes",
              "BackendNotSupported"):
        assert w in sec.split("\n## ")[0], w
