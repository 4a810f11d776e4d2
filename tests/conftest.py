"""Shared test setup and helpers.

Without a GPU the kernels run in Triton's interpreter on CPU tensors; the switch must be set
before triton is first imported, hence at the very top of this file.
"""
import os

import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ.setdefault("FLASHTX_INTERPRET", "1")
    os.environ.setdefault("TRITON_INTERPRET", "1")

import contextlib  # noqa: E402

import pytest  # noqa: E402

from flashtx import testing  # noqa: E402

DEVICE = "cuda" if ON_GPU else "cpu"
# The interpreter computes bf16 wrongly (triton-lang/triton#11584) and float64 is for gradchecks
# there; a GPU runs the dtypes users train in.
KERNEL_DTYPES = [torch.float16, torch.bfloat16, torch.float32] if ON_GPU else [torch.float16, torch.float32,
                                                                               torch.float64]
OUTPUT_FACTOR, GRAD_FACTOR = testing.OUTPUT_FACTOR, testing.GRAD_FACTOR  # noqa: E402
max_err = testing.max_err
# Exact-comparison tests run the Triton kernels in float64 against a float64 result, at 1e-11..1e-14.
# float64 goes through the kernels only in the interpreter (a GPU refuses it: BackendNotSupported), so on
# a GPU those tests give the kernels float32 copies of the same values, keep the float64 reference, and
# compare at FP32_ATOL: over 5x the largest float32 error of these small cases as measured with the
# kernels in float32 in the interpreter (at most 1.7e-6; values up to ~10, sums of < 100 terms), while
# a wrong mask, position or scale errs by ~0.1-1.
PRECISE_DTYPE = torch.float32 if ON_GPU else torch.float64
FP32_ATOL = 1e-5


def precise_atol(interpreter_atol: float) -> float:
    """The atol of a PRECISE_DTYPE comparison: interpreter_atol in float64, FP32_ATOL on a GPU."""
    return FP32_ATOL if ON_GPU else interpreter_atol


def dtype_id(dt: torch.dtype) -> str:
    return str(dt).replace("torch.", "")


def randn(*shape, dtype=torch.float32, device=DEVICE, requires_grad=False, scale=1.0):
    """Fresh random data (never zeros)."""
    t = (torch.randn(*shape, dtype=torch.float64, device=device) * scale).to(dtype)
    return t.requires_grad_(requires_grad)


def precise_randn(*shape, **kw):
    """randn in PRECISE_DTYPE (float64 in the interpreter, float32 on a GPU) unless a dtype is given."""
    kw.setdefault("dtype", PRECISE_DTYPE)
    return randn(*shape, **kw)


def to64(*ts):
    """Detached float64 leaf copies that require grad, for the reference."""
    return tuple(t.detach().to(torch.float64).requires_grad_(True) for t in ts)


def to_dtype(dtype, *ts):
    """Detached same-dtype leaf copies that require grad, for the eager baseline."""
    return tuple(t.detach().to(dtype).requires_grad_(True) for t in ts)


def assert_close_to_reference(name: str, actual: torch.Tensor, ref64: torch.Tensor, eager: torch.Tensor, *,
                              grad: bool = False, scale: float = 0.0) -> None:
    """The tolerance rule: err(kernel) <= factor * err(same-dtype eager) + a few ulps.

    err(x) is the max abs difference from the float64 reference; factor is 2 for outputs and 3 for
    gradients. The ulps are taken at max(|ref64|, scale): pass the magnitude of the terms that
    cancel when the exact result is ~0 (e.g. dq with one key). NaN or a missing value fails.
    """
    assert actual.shape == ref64.shape, f"{name}: shape {tuple(actual.shape)} != reference {tuple(ref64.shape)}"
    err_k, bound = testing.tolerance_check(actual, ref64, eager, grad=grad, scale=scale)
    err_e = max_err(eager, ref64)
    factor = GRAD_FACTOR if grad else OUTPUT_FACTOR
    assert err_k <= bound, (f"{name} ({dtype_id(actual.dtype)}): kernel error {err_k:.3e} > bound {bound:.3e} "
                            f"({factor:g} x eager error {err_e:.3e} + ulp floor)")


@contextlib.contextmanager
def poisoned_allocations():
    """Make every uninitialised allocation the code under test can make return NaN-filled (or -1) tensors, so
    unwritten outputs fail: torch.empty / empty_like / empty_strided and Tensor.new_empty / new_empty_strided
    (flashtx allocates outputs with all of them, e.g. q.new_empty in the ops). Zero-filling allocations
    (zeros, new_zeros) are left alone: their zeros are meant."""
    def fill(t):
        with torch.no_grad():  # an allocation made with requires_grad=True is a leaf: fill it as data
            if t.is_floating_point() or t.is_complex():
                t.fill_(float("nan"))
            elif t.dtype != torch.bool:
                t.fill_(-1)
        return t

    def poisoned(real):
        def alloc(*a, **kw):
            return fill(real(*a, **kw))
        return alloc

    functions = [(torch, name) for name in ("empty", "empty_like", "empty_strided")]
    methods = [(torch.Tensor, name) for name in ("new_empty", "new_empty_strided")]
    saved = [(owner, name, owner.__dict__.get(name, None) if owner is torch.Tensor else getattr(owner, name))
             for owner, name in functions + methods]
    for owner, name in functions + methods:
        setattr(owner, name, poisoned(getattr(owner, name)))  # methods: the inherited TensorBase descriptor
    try:
        yield
    finally:
        for owner, name, real in saved:
            if real is None:  # a method torch.Tensor inherits (from torch._C.TensorBase): drop the stand-in
                delattr(owner, name)
            else:
                setattr(owner, name, real)


@pytest.fixture
def poison():
    """Fixture form of poisoned_allocations()."""
    with poisoned_allocations():
        yield


GRADCHECK_TOL = dict(atol=1e-8, rtol=1e-6)


def gradcheck_each_input(fn, inputs, raise_exception=True) -> bool:
    """Fast-mode gradcheck one input at a time.

    Fast mode checks one random projection of the whole Jacobian; with all inputs at once, a 0.1%
    error in dK can hide under dQ's and dV's share of it (seen). One input at a time it cannot.
    """
    ok = True
    for i in range(len(inputs)):
        def fn_i(x, i=i):
            return fn(*[x if j == i else t.detach() for j, t in enumerate(inputs)])

        ok &= torch.autograd.gradcheck(fn_i, (inputs[i],), fast_mode=True, raise_exception=raise_exception,
                                       **GRADCHECK_TOL)
    return ok


# ----------------------------------------------------------------------------------- flashtx.nn helpers
def rotate_half(x):
    """NeoX/LLaMA rotation: (x1, x2) -> (-x2, x1) on the two halves of the last dim."""
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def eager_rope(t, cos, sin, offset=0):
    """t (B, S, H, D) rotated eagerly at positions offset..offset+S-1 by (L, r/2) tables; columns
    past r = 2 * cos.shape[-1] pass through (partial rotary)."""
    S, r = t.shape[1], 2 * cos.shape[-1]
    c = torch.cat((cos, cos), -1)[offset:offset + S].to(t.dtype)[None, :, None]  # (1, S, 1, r)
    s = torch.cat((sin, sin), -1)[offset:offset + S].to(t.dtype)[None, :, None]
    rot = t[..., :r] * c + rotate_half(t[..., :r]) * s
    return torch.cat((rot, t[..., r:]), dim=-1)


def eager_mha(layer, x, memory=None, key_mask=None, attn_mask=None):
    """flashtx.nn.MultiheadAttention's math written out with its own parameters, in x's dtype:
    projections, eager RoPE, K/V heads repeated, an explicit (B, H, S, Sk) softmax (rows that see
    no key give 0, as in flashtx), output projection."""
    import math

    import torch.nn.functional as F

    B, S, _ = x.shape
    Hq, Hkv, D = layer.num_heads, layer.num_kv_heads, layer.head_dim
    if layer.cross:
        q = F.linear(x, layer.q_proj.weight, layer.q_proj.bias).view(B, S, Hq, D)
        kv = F.linear(memory, layer.kv_proj.weight, layer.kv_proj.bias).view(B, memory.shape[1], 2 * Hkv, D)
        k, v = kv[:, :, :Hkv], kv[:, :, Hkv:]
    else:
        qkv = F.linear(x, layer.qkv.weight, layer.qkv.bias).view(B, S, Hq + 2 * Hkv, D)
        q, k, v = qkv[:, :, :Hq], qkv[:, :, Hq:Hq + Hkv], qkv[:, :, Hq + Hkv:]
    if layer.rotary is not None:
        cos, sin = layer.rotary.cos_sin(S)
        q, k = eager_rope(q, cos, sin), eager_rope(k, cos, sin)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, S, D)
    k, v = (t.repeat_interleave(Hq // Hkv, dim=1) for t in (k, v))
    scores = q @ k.transpose(-1, -2) / math.sqrt(D)  # (B, Hq, S, Sk)
    Sk = k.shape[2]
    vis = torch.ones(S, Sk, dtype=torch.bool, device=x.device)
    if layer.causal:
        vis = vis.tril()
    vis = vis[None, None]
    if key_mask is not None:
        vis = vis & key_mask[:, None, None, :]
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            vis = vis & attn_mask
        else:
            scores = scores + attn_mask
    p = torch.softmax(scores.masked_fill(~vis, float("-inf")), dim=-1).nan_to_num(0.0)
    out = (p @ v).transpose(1, 2).reshape(B, S, Hq * D)
    return F.linear(out, layer.out_proj.weight, layer.out_proj.bias)


@pytest.fixture
def fresh_plans():
    """Every cached plan (backends, launch entries, lanes) forgotten before and after the test."""
    from flashtx import _dispatch

    _dispatch.clear_plans()
    yield
    _dispatch.clear_plans()


class StandinOps:
    """torch.ops.flashtx_cuda as the float64 references, behind the binding's own argument checks
    (the fakes run them): what a GPU would run, minus the kernels."""

    @staticmethod
    def decode_attention(q, k_cache, v_cache, lens, bt, bidx, scale, causal, num_splits, check_values):
        from flashtx import cuda_ext
        from flashtx.cuda_ext_reference import decode_attention_ref

        cuda_ext._decode_fake(q, k_cache, v_cache, lens, bt, bidx, scale, causal, num_splits, check_values)
        out, lse = decode_attention_ref(q, k_cache, v_cache, lens, bt, bidx, scale, causal)
        return out.to(q.dtype), lse.float()

    @staticmethod
    def rotary_append(q, k, v, k_cache, v_cache, cos, sin, lens, bt, bidx, interleaved, q_causal, check_values):
        from flashtx import cuda_ext
        from flashtx.cuda_ext_reference import rotary_append_ref

        cuda_ext._rotary_append_fake(q, k, v, k_cache, v_cache, cos, sin, lens, bt, bidx, interleaved, q_causal,
                                     check_values)
        q_rot, kc, vc = rotary_append_ref(q, k, v, k_cache, v_cache, lens, cos, sin, interleaved, q_causal, bt, bidx)
        k_cache.copy_(kc)
        v_cache.copy_(vc)
        return q_rot.to(q.dtype)


@pytest.fixture
def standin(monkeypatch, fresh_plans):
    """The CUDA extension 'available' on CPU tensors, its ops replaced by StandinOps."""
    from flashtx import _cuda_ext_api, cuda_ext

    monkeypatch.setattr(cuda_ext, "unavailable_reason", lambda *a, **k: None)
    monkeypatch.setattr(cuda_ext, "load", lambda *a, **k: True)
    monkeypatch.setattr(cuda_ext, "DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(_cuda_ext_api, "_ops", lambda: StandinOps)
    monkeypatch.setattr(_cuda_ext_api, "_sm_resources", lambda index: (4, 2048, 65536, 102400))  # 4 sm_86 SMs


@pytest.fixture
def refuse_tiles(monkeypatch, fresh_plans):
    """refuse_tiles(prefix): a GPU whose tile tables hold no config for the kernels whose names start with prefix
    (configs.select_config raises for them, as on CUDA when none fits); plans are forgotten each time."""
    from flashtx import _dispatch
    from flashtx.triton_kernels import configs
    # the launchers bind select_config when first imported: imported before the stand-in, they keep the real one
    from flashtx.triton_kernels import attention_bwd_launch, attention_fwd, attention_scores  # noqa: F401

    real = configs.select_config

    def refuse(prefix: str) -> None:
        def select(kernel, *a, **kw):
            if kernel.startswith(prefix):
                raise RuntimeError(f"stand-in: no {kernel} tile fits this GPU's shared memory")
            return real(kernel, *a, **kw)
        monkeypatch.setattr(configs, "select_config", select)
        _dispatch.clear_plans()
    return refuse


def count_calls(monkeypatch, owner, name: str) -> list:
    """Patch owner.name (a function or method) to record each call, then run it; returns the record (a list that
    grows by one per call)."""
    calls, real = [], getattr(owner, name)
    monkeypatch.setattr(owner, name, lambda *a, **kw: calls.append(1) or real(*a, **kw))
    return calls


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """An empty autotune cache directory (FLASHTX_CACHE_DIR), the tuner's memory reset before and after, and the
    tuner off afterwards."""
    from flashtx.triton_kernels import autotune

    monkeypatch.setenv("FLASHTX_CACHE_DIR", str(tmp_path))
    autotune.reset_memory()
    yield tmp_path
    autotune.autotune(False)
    autotune.reset_memory()


@pytest.fixture
def split_head_dims(monkeypatch):
    """Head dims split in two power-of-two pieces (launch.SPLIT_HEAD_DIMS, off by default for now) for
    one test; cached plans are forgotten before and after."""
    from flashtx import _dispatch
    from flashtx.triton_kernels import launch

    _dispatch.clear_plans()
    monkeypatch.setattr(launch, "SPLIT_HEAD_DIMS", True)
    yield
    _dispatch.clear_plans()


@pytest.fixture
def routes(monkeypatch):
    """The ops each attention call ran, in order: 'decode' (the split-KV decode kernels, through
    flashtx._small_q), 'lane' (those kernels through a decoding call's lane, flashtx._small_q_lane) or 'train'
    (the training forward, through the op or a plain call's lane; another op of functional's: its name)."""
    import flashtx
    from flashtx import _attention_lane, _small_q, _small_q_lane

    seen = []
    real_decode, real_run, real_lane = _small_q.call, flashtx.functional.call, _attention_lane._Lane.run
    real_small = _small_q_lane._Lane.run

    def small(self, q, k, v, mask):
        seen.append("lane")
        return real_small(self, q, k, v, mask)

    def decode(op, *args):
        seen.append("decode")
        return real_decode(op, *args)

    def train(op, *args):
        seen.append("train" if op is flashtx._attention_op.attn_fwd else op._name)
        return real_run(op, *args)

    def lane(self, q, k, v, masks=()):
        seen.append("train")
        return real_lane(self, q, k, v, masks)

    monkeypatch.setattr(_small_q, "call", decode)
    monkeypatch.setattr(flashtx.functional, "call", train)
    monkeypatch.setattr(_attention_lane._Lane, "run", lane)
    monkeypatch.setattr(_small_q_lane._Lane, "run", small)
    return seen


def spy_attention_calls(monkeypatch, record) -> None:
    """Call record(q) for each call that reaches flashtx's attention forward: the op's general path
    (functional._run, which the shells and the SDPA patch call) or a plain or decoding call's lane
    (flashtx._attention_lane, _small_q_lane, which they try first; they return None for a call they leave to the
    general path)."""
    import flashtx
    from flashtx import _attention_lane, _small_q_lane

    real_run, real_lane, real_small = flashtx.functional._run, _attention_lane.forward, _small_q_lane.forward

    def run(q, *a, **kw):
        record(q)
        return real_run(q, *a, **kw)

    def lane(q, *a, **kw):
        out = real_lane(q, *a, **kw)
        if out is not None:
            record(q)
        return out

    def small(lane_key, q, *a):
        out = real_small(lane_key, q, *a)
        if out is not None:
            record(q)
        return out

    monkeypatch.setattr(flashtx.functional, "_run", run)
    monkeypatch.setattr(_attention_lane, "forward", lane)
    monkeypatch.setattr(_small_q_lane, "forward", small)


@pytest.fixture
def gpu_target(monkeypatch, request):
    """Plan every launch as for configs.KNOWN_TARGETS[request.param] (use with indirect parametrization): each
    flashtx module's target_for is stood in, so the interpreter runs that GPU's tiles and SM-count heuristics.
    Cached plans (decode splits too) are forgotten before and after."""
    import sys

    from flashtx import _dispatch
    from flashtx.triton_kernels import configs

    target = configs.KNOWN_TARGETS[request.param]
    for mod in list(sys.modules.values()):
        if getattr(mod, "__name__", "").startswith("flashtx") and hasattr(mod, "target_for"):
            monkeypatch.setattr(mod, "target_for", lambda t: target)
    _dispatch.clear_plans()
    yield target
    _dispatch.clear_plans()


def same_launch_args(a: dict, b: dict) -> bool:
    """Two launches' argument dicts are equal: the same values, and for tensors the same bytes viewed alike
    (dtype, data pointer, shape and strides)."""
    if a.keys() != b.keys():
        return False
    for name, x in a.items():
        y = b[name]
        if isinstance(x, torch.Tensor):
            if not (isinstance(y, torch.Tensor) and x.dtype == y.dtype and x.data_ptr() == y.data_ptr()
                    and x.shape == y.shape and x.stride() == y.stride()):
                return False
        elif x != y:
            return False
    return True


@pytest.fixture(autouse=True)
def _bounds_checked():
    """Every interpreted kernel launch in every test must keep its masked-in loads and stores inside its
    tensor arguments' storages (flashtx.testing_bounds): a stray access fails the test here, where on a GPU
    it would be an illegal memory access or silent garbage. It adds ~5% to the CPU suite;
    FLASHTX_CHECK_BOUNDS=0 turns it off."""
    if ON_GPU or os.environ.get("FLASHTX_CHECK_BOUNDS") == "0":
        yield
        return
    from flashtx import testing_bounds

    with testing_bounds.checking():
        yield


@pytest.fixture(autouse=True)
def _release_gpu_memory():
    """On a GPU, each test hands the memory its process's caching allocator kept back to the driver: the GPU suite
    runs in parallel workers (beside device_check.sh's prewarm), and on an 80 GB H100 (2026-12-06) the 6 GB fixtures
    of the wide-offset tests ran out of memory while other workers held tens of GB cached from earlier tests."""
    yield
    if ON_GPU and torch.cuda.memory_reserved() > (1 << 30):
        import gc

        gc.collect()
        torch.cuda.empty_cache()


def decode_on_both_backends(q, kc, vc, k, v, cos, sin, lens, block_table) -> dict:
    """flash_attn_with_kvcache (causal, appending k and v, rotary) with backend "triton" and "cuda", each on its own
    copy of the caches: backend -> (out, lse, k_cache, v_cache)."""
    import flashtx

    res = {}
    for backend in ("triton", "cuda"):
        kc_b, vc_b = kc.clone(), vc.clone()
        res[backend] = (*flashtx.flash_attn_with_kvcache(q, kc_b, vc_b, k, v, cos, sin, cache_seqlens=lens,
                                                         block_table=block_table, causal=True,
                                                         return_softmax_lse=True, backend=backend), kc_b, vc_b)
    return res


_ASSERT_ASYNC = torch._assert_async


@pytest.fixture(autouse=True)
def cuda_assert_rule(monkeypatch):
    """torch._assert_async as CUDA's takes it: a message of 255 bytes or more raises, as on a GPU (torch 2.11:
    "Message length must be smaller than 255"; CPU's has no limit). Every CPU test, so any test that forces a
    GPU's device-side check path on CPU runs under it (a GPU applies the real rule)."""
    if ON_GPU:
        return

    def assert_async(cond, msg=None):
        if msg is not None and len(msg.encode()) >= 255:
            raise RuntimeError("Message length must be smaller than 255 (CUDA's torch._assert_async; a stand-in)")
        return _ASSERT_ASYNC(cond) if msg is None else _ASSERT_ASYNC(cond, msg)
    monkeypatch.setattr(torch, "_assert_async", assert_async)


@pytest.fixture(autouse=True)
def _opt_in_paths(monkeypatch):
    """FLASHTX_TEST_SPLIT_HEAD_DIMS=1 / FLASHTX_TEST_AUTO_GQA_SPLIT=1 run every test with that off-by-default
    path on (launch.SPLIT_HEAD_DIMS, attention_bwd_launch.AUTO_GQA_SPLIT), so a GPU run can bisect them one
    at a time (bench/device_check.sh's `bisect` step)."""
    flags = [(name, attr) for name, attr in (("FLASHTX_TEST_SPLIT_HEAD_DIMS", "SPLIT_HEAD_DIMS"),
                                             ("FLASHTX_TEST_AUTO_GQA_SPLIT", "AUTO_GQA_SPLIT"))
             if os.environ.get(name) == "1"]
    if not flags:
        yield
        return
    from flashtx import _dispatch
    from flashtx.triton_kernels import attention_bwd_launch, launch

    for _, attr in flags:
        monkeypatch.setattr(launch if attr == "SPLIT_HEAD_DIMS" else attention_bwd_launch, attr, True)
    _dispatch.clear_plans()
    yield
    _dispatch.clear_plans()


# The xdist groups (test_compile, test_bench_smoke, test_compile_gpu_path, the CUDA extension's files) are the
# modules whose fixture runs a long subprocess once (the compile check alone is most of CI's time on 2 cores):
# collected first, so under `pytest -n auto --dist loadgroup` workers start them while the others take the
# rest, instead of the slowest group starting late and ending last.
def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: item.get_closest_marker("xdist_group") is None)  # stable: the order is kept
