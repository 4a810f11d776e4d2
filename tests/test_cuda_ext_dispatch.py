"""The CUDA extension as flashtx's decode backend "cuda" (flashtx.flash_attn_with_kvcache(...,
backend="cuda")), without a GPU: registration order, the reasons it refuses with, automatic dispatch
never picking it while unmeasured, and the Python glue against the Triton path with the extension's ops
stood in by the float64 references (conftest's `standin` fixture)."""
import pytest
import torch

import flashtx
from flashtx import cuda_ext

from flashtx import _cuda_ext_api, _decode_op, _dispatch
from flashtx._dispatch import BackendNotSupported
from conftest import decode_on_both_backends


def _kv_case(B=2, Sq=1, Hq=4, Hkv=2, D=64, cap=48, paged=False, dtype=torch.float32):
    torch.manual_seed(0)
    q = torch.randn(B, Sq, Hq, D, dtype=dtype)
    if paged:
        kc = torch.randn(B * cap // 16 + 2, 16, Hkv, D, dtype=dtype)
        bt = torch.randperm(kc.shape[0])[:B * cap // 16].reshape(B, cap // 16).to(torch.int32)
    else:
        kc, bt = torch.randn(B, cap, Hkv, D, dtype=dtype), None
    return q, kc, torch.randn_like(kc), bt


def test_cuda_backend_is_registered_after_triton():
    for op in ("kvcache_append", "kvcache_attention"):
        names = list(_dispatch.IMPLS[op])
        assert "cuda" in names and names.index("triton") < names.index("cuda"), names
        assert isinstance(_dispatch.IMPLS[op]["cuda"], _cuda_ext_api.DecodeCUDA)


def test_cuda_backend_refused_here_with_reasons(fresh_plans):
    q, kc, vc, _ = _kv_case()
    if cuda_ext.available():
        pytest.skip("the extension is available here")
    with pytest.raises(BackendNotSupported) as e:
        flashtx.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=5, backend="cuda")
    msg = str(e.value)
    assert "backend='cuda' cannot run" in msg and cuda_ext.unavailable_reason() in msg
    assert "q is on cpu; the extension runs CUDA tensors only" in msg
    assert cuda_ext.NOT_MEASURED not in msg.split("All backends:")[0]  # asked for by name: not a reason
    reasons = _dispatch.IMPLS["kvcache_attention"]["cuda"].not_supported_reasons(_decode_op.DecodeInputs(q, kc, vc))
    assert reasons[-1] == cuda_ext.NOT_MEASURED and reasons[0] == cuda_ext.unavailable_reason()


def test_cuda_backend_lists_what_the_kernels_lack(standin):
    q, kc, vc, _ = _kv_case(D=64)
    impl = _dispatch.IMPLS["kvcache_attention"]["cuda"]
    inp = _decode_op.DecodeInputs(q, kc, vc, {}, automatic=False)
    assert impl.not_supported_reasons(inp) == []  # 'available', CPU allowed: explicit use runs
    assert impl.not_supported_reasons(_decode_op.DecodeInputs(q, kc, vc, {})) == [cuda_ext.NOT_MEASURED]
    k = torch.randn(2, 2, 2, 64)
    cos = torch.randn(40, 8)
    call = dict(k=k, rotary_cos=cos, cache_leftpad=torch.zeros(2, dtype=torch.int32), alibi=torch.ones(4),
                window=(8, 0), softcap=5.0, capacity=48)
    reasons = "\n".join(impl.not_supported_reasons(_decode_op.DecodeInputs(q, kc, vc[..., :32], call,
                                                                          automatic=False)))
    for words in ("softcap", "alibi_slopes", "window_size", "cache_leftpad", "Snew = 2 tokens with Sq = 1",
                  "v head dim 32", "40 rows for a cache capacity of 48"):
        assert words in reasons, (words, reasons)
    reasons = "; ".join(impl.not_supported_reasons(_decode_op.DecodeInputs(
        q.half(), kc.half()[:, :, :, :64], vc.half(), dict(rotary_cos=torch.randn(48, 4), capacity=48),
        automatic=False)))
    assert "without new k, v" in reasons and "rotary_dim 8 is not a multiple of 16" in reasons
    reasons = impl.not_supported_reasons(_decode_op.DecodeInputs(q.double(), kc.double()[..., :48],
                                                                 vc.double()[..., :48], {}, automatic=False))
    assert any("float64 is not supported" in r for r in reasons) and any("head dim 48" in r for r in reasons)
    # through the public function: each refusal raises, naming the feature
    with pytest.raises(BackendNotSupported, match="softcap is not implemented"):
        flashtx.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=5, softcap=5.0, backend="cuda")
    with pytest.raises(BackendNotSupported, match="cache_leftpad is not implemented"):
        flashtx.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=5, cache_leftpad=torch.ones(2, dtype=torch.int32),
                                        backend="cuda")


def test_automatic_dispatch_never_picks_cuda(standin, monkeypatch):
    q, kc, vc, _ = _kv_case()
    assert not cuda_ext.MEASURED_FASTER
    assert _decode_op.select(q, kc, vc, None, {"capacity": 48}) == "triton"
    assert _decode_op.select(q, kc, vc, "cuda", {"capacity": 48}) == "cuda"
    # even with Triton unable to run and the extension 'available', automatic takes the reference
    monkeypatch.setattr(_decode_op.DecodeTriton, "not_supported_reasons", lambda self, inp: ["(test) no Triton"])
    _dispatch.clear_plans()
    with pytest.warns(UserWarning, match="not measured faster than the Triton kernel"):
        assert _decode_op.select(q, kc, vc, None, {"capacity": 48}) == "reference"
    calls = []
    monkeypatch.setattr(_cuda_ext_api.DecodeCUDA, "attention", lambda self, *a, **k: calls.append(1))
    flashtx.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=5)
    assert calls == []


def test_automatic_cuda_pick_is_judged_on_the_call(standin, monkeypatch):
    """Once MEASURED_FASTER is set, with Triton unable to run, automatic dispatch picks the extension on kinds
    alone (device, dtype, head dims); a call with a feature its kernels lack (softcap, ALiBi, a window,
    cache_leftpad) must then go to the next backend that can run it, not to the kernels that would ignore
    it."""
    monkeypatch.setattr(cuda_ext, "MEASURED_FASTER", True)
    monkeypatch.setattr(_decode_op.DecodeTriton, "not_supported_reasons", lambda self, inp: ["(test) no Triton"])
    calls = []
    real = _cuda_ext_api.DecodeCUDA.attention
    monkeypatch.setattr(_cuda_ext_api.DecodeCUDA, "attention", lambda self, *a, **k: (calls.append(1),
                                                                                      real(self, *a, **k)))
    q, kc, vc, _ = _kv_case()
    lens = torch.tensor([5, 30], dtype=torch.int32)
    want = flashtx.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, backend="reference")
    got = flashtx.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens)
    assert calls == [1]  # the plain call runs the extension
    assert (got - want).abs().max() < 1e-5
    for kw in (dict(softcap=5.0), dict(alibi_slopes=torch.rand(4)), dict(window_size=(3, 0)),
               dict(cache_leftpad=torch.tensor([1, 2], dtype=torch.int32))):
        with pytest.warns(UserWarning, match="no fast backend"):
            got = flashtx.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, **kw)
        assert calls == [1], kw  # not the extension
        want = flashtx.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, backend="reference", **kw)
        assert (got - want).abs().max() < 1e-5, kw


@pytest.mark.parametrize("case", [
    dict(name="contiguous Sq=1 GQA", Sq=1, Hq=4, Hkv=2, lens=[5, 0], causal=False),
    dict(name="contiguous Sq=4 causal empty rows", Sq=4, Hq=4, Hkv=1, lens=[2, 0], causal=True, int64=True),
    dict(name="paged Sq=3 rotary append causal", Sq=3, Hq=8, Hkv=2, lens=[17, 30], causal=True, paged=True,
         append=True, rotary=True, interleaved=False, splits=3),
    dict(name="contiguous batch_idx Sq=2 rotary append", Sq=2, Hq=4, Hkv=4, lens=[7, 40], causal=False,
         append=True, rotary=True, batch_idx=True, D=128),
    dict(name="paged Sq=1 append no rotary", Sq=1, Hq=2, Hkv=1, lens=[0, 47], causal=True, paged=True, append=True),
], ids=lambda c: c["name"])
def test_cuda_backend_glue_matches_triton(standin, case):
    """flash_attn_with_kvcache(..., backend="cuda") with the ops stood in by the float64 references
    equals the Triton kernels (interpreter): argument mapping, layouts, positions and lse units."""
    B, Sq, D = 2, case["Sq"], case.get("D", 64)
    q, kc, vc, bt = _kv_case(B, Sq, case["Hq"], case["Hkv"], D, paged=case.get("paged", False))
    lens = torch.tensor(case["lens"], dtype=torch.int64 if case.get("int64") else torch.int32)
    kw = dict(cache_seqlens=lens, block_table=bt, causal=case["causal"], return_softmax_lse=True,
              num_splits=case.get("splits", 0))
    if case.get("batch_idx"):
        kc, vc = torch.cat([kc, torch.randn_like(kc)]), torch.cat([vc, torch.randn_like(vc)])
        kw["cache_batch_idx"] = torch.tensor([3, 0], dtype=torch.int32)
    if case.get("append"):
        kw["k"], kw["v"] = torch.randn(B, Sq, case["Hkv"], D), torch.randn(B, Sq, case["Hkv"], D)
        if case.get("rotary"):
            theta = torch.arange(64)[:, None] * 0.3 ** torch.arange(D // 4)[None, :]  # rotary_dim = D / 2
            kw.update(rotary_cos=theta.cos(), rotary_sin=theta.sin(), rotary_interleaved=case.get("interleaved", True))
    results = {}
    for backend in ("triton", "cuda"):
        kc_b, vc_b = kc.clone(), vc.clone()
        out, lse = flashtx.flash_attn_with_kvcache(q.clone(), kc_b, vc_b, backend=backend, **kw)
        results[backend] = out, lse, kc_b, vc_b
    for name, a, b in zip(("out", "lse", "k_cache", "v_cache"), results["triton"], results["cuda"]):
        torch.testing.assert_close(b, a, atol=2e-5, rtol=2e-5, msg=lambda m: f"{name}: {m}")
    out, lse = results["cuda"][:2]
    if case["causal"] and not case.get("append") and min(case["lens"]) < Sq:  # rows that see no key
        b = case["lens"].index(min(case["lens"]))
        assert torch.all(out[b] == 0) and torch.all(lse[b] == float("-inf"))


@pytest.mark.parametrize("shape", [dict(Sq=0), dict(Hq=0), dict(B=0)], ids=lambda s: next(iter(s)) + "=0")
@pytest.mark.parametrize("append", [False, True], ids=["attend", "append"])
def test_cuda_backend_takes_empty_queries_as_triton(standin, shape, append):
    """An empty q with a cache long enough to split (capacity 1024 > 256 keys a split) returned an empty output
    through Triton but divided by zero in the split heuristic (no blocks) through "cuda" (a review of csrc)."""
    B, Sq, Hq, Hkv = shape.get("B", 2), shape.get("Sq", 1), shape.get("Hq", 4), 2
    torch.manual_seed(0)
    q = torch.randn(B, Sq, Hq, 64)
    kc, vc = torch.randn(B, 1024, Hkv, 64), torch.randn(B, 1024, Hkv, 64)  # (B = 0: an empty cache, as Triton takes)
    kw = dict(cache_seqlens=torch.full((B,), 300, dtype=torch.int32), return_softmax_lse=True)
    if append:
        kw.update(k=torch.randn(B, Sq, Hkv, 64), v=torch.randn(B, Sq, Hkv, 64))
    results = {}
    for backend in ("triton", "cuda"):
        kc_b, vc_b = kc.clone(), vc.clone()
        out, lse = flashtx.flash_attn_with_kvcache(q, kc_b, vc_b, backend=backend, **kw)
        results[backend] = out, lse, kc_b, vc_b
    for a, b in zip(results["triton"], results["cuda"]):
        assert a.shape == b.shape and torch.equal(a, b)


def test_cuda_backend_refuses_a_grid_it_cannot_launch_before_writing(standin):
    """Hkv x row chunks past 65535 (Triton's tiles of 64 rows fit where the extension's 32 do not) is a reason,
    judged before the append (the binding's launch failed after it had written the caches)."""
    impl = _dispatch.IMPLS["kvcache_attention"]["cuda"]
    q = torch.empty(1, 1024, 2048, 64, device="meta")  # 2048 KV heads x 32 chunks of 32 rows
    kc = torch.empty(1, 2048, 2048, 64, device="meta")
    reasons = impl.not_supported_reasons(_decode_op.DecodeInputs(q, kc, kc, {}, automatic=False))
    assert any("Hkv x row chunks = 2048 x 32 passes the grid's 65535" in r for r in reasons), reasons
    assert "2048 x 32" in cuda_ext.grid_reason(q[:, :993], kc)  # 993 rows: still 32 chunks
    assert cuda_ext.grid_reason(q[:, :992], kc) is None  # 992 rows: 2048 x 31 = 63488 blocks
    assert "B, Sq and Hq must be <= 65535" in cuda_ext.grid_reason(torch.empty(65536, 1, 2, 64, device="meta"), kc)
    assert impl.call_key(q, kc, kc, {}) != impl.call_key(q[:, :992], kc, kc, {})  # the plan key holds it


def test_direct_rotary_append_refuses_writes_that_share_memory(standin):
    """cuda_ext.rotary_append (the direct API) wrote k and v into one buffer, or through an expanded cache, where
    flashtx.flash_attn_with_kvcache refuses (the kernel's writes would race)."""
    q, kc, vc, _ = _kv_case(B=2, Sq=1, Hq=4, Hkv=2)
    k, v = torch.randn(2, 1, 2, 64), torch.randn(2, 1, 2, 64)
    with pytest.raises(ValueError, match="k_cache and v_cache share memory"):
        cuda_ext.rotary_append(q, k, v, kc, kc, 5)
    with pytest.raises(ValueError, match="k_cache has stride 0 along batch"):
        cuda_ext.rotary_append(q, k, v, kc[:1].expand_as(kc), vc, 5)
    revisit = kc.as_strided(kc.shape, (kc.stride(0), kc.stride(1), kc.shape[3] // 2, 1))  # heads overlap
    with pytest.raises(ValueError, match="k_cache has strides that revisit memory"):
        cuda_ext.rotary_append(q, k, v, revisit, vc, 5)
    with pytest.raises(ValueError, match="k shares memory with k_cache"):
        cuda_ext.rotary_append(q, kc[:, 5:6], v, kc, vc, 5)
    kc0 = kc.clone()
    cuda_ext.rotary_append(q, k, v, kc, vc, 5)  # the valid call writes position 5
    assert torch.equal(kc[:, 5:6], k) and torch.equal(kc[:, :5], kc0[:, :5])


def test_direct_api_checks_int64_lengths_before_narrowing(standin):
    """An int64 cache_seqlens of 2**32 + 10 was narrowed to 10 (and passed check_values as 10)."""
    q, kc, vc, _ = _kv_case(B=1)
    big = torch.tensor([2**32 + 10])
    with pytest.raises(ValueError, match=r"cache_seqlens must lie in \[0, 2\*\*31 - 1\]"):
        cuda_ext.decode_attention(q, kc, vc, big, check_values=True)
    with pytest.raises(ValueError, match=r"cache_seqlens must lie in \[0, 2\*\*31 - 1\]"):
        cuda_ext.decode_attention(q, kc, vc, -1)
    out = cuda_ext.decode_attention(q, kc, vc, torch.tensor([7]), check_values=True)  # int64 in range: converted
    torch.testing.assert_close(out, cuda_ext.decode_attention(q, kc, vc, 7), atol=0, rtol=0)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("sq", [1, 3])
def test_backend_cuda_equals_triton_on_the_device_check_path(standin, monkeypatch, cuda_assert_rule, paged, sq):
    """tests/test_cuda_ext_gpu.py::test_backend_cuda_equals_triton on CPU: its shapes (fp16, D = 128, rotary_dim =
    D / 2, a cache of 320 positions, pages of 16), with cache_seqlens treated as device-resident (the index check as
    a GPU runs it: one kernel and one torch._assert_async, under CUDA's message rule) and the extension's ops stood
    in by the float64 references. On an H100 (2026-12-06) all four cases failed at the backend="triton" call, before
    either backend ran: the check's message for a rotary append (299 bytes contiguous, 379 paged) broke CUDA's
    255-byte limit. The index check runs for both backends (flashtx.decode: _check_ranges before _backend)."""
    import flashtx.decode as fd

    monkeypatch.setattr(fd, "_values_readable", lambda t: False)
    torch.manual_seed(5)
    dtype, batch, hkv, hq, d, cap = torch.float16, 2, 2, 8, 128, 320
    lens = torch.tensor([17, 200], dtype=torch.int32)
    if paged:
        kc = torch.randn(batch * cap // 16 + 3, 16, hkv, d).to(dtype)
        bt = torch.randperm(kc.shape[0])[:batch * cap // 16].reshape(batch, -1).to(torch.int32)
    else:
        kc, bt = torch.randn(batch, cap, hkv, d).to(dtype), None
    vc = torch.randn_like(kc)
    theta = torch.arange(cap, dtype=torch.float64)[:, None] * 0.01 * torch.arange(d // 4, dtype=torch.float64)
    cos, sin = theta.cos().float(), theta.sin().float()
    q = torch.randn(batch, sq, hq, d).to(dtype)
    k, v = (torch.randn(batch, sq, hkv, d).to(dtype) for _ in range(2))
    res = decode_on_both_backends(q, kc, vc, k, v, cos, sin, lens, bt)
    for name, a, b in zip(("out", "lse", "k_cache", "v_cache"), res["triton"], res["cuda"]):
        torch.testing.assert_close(b.float(), a.float(), atol=2e-3, rtol=1e-2, msg=lambda m: f"{name}: {m}")


def test_direct_api_refuses_what_the_binding_cannot_take_before_the_op(standin, monkeypatch):
    """cuda_ext's functions refuse a non-tensor (None where a tensor is required; a list where an optional tensor
    goes) and an optional tensor on another device than q before the op, naming the argument (the binding refuses
    them too: tests/test_cuda_ext_binding_host.py)."""
    from conftest import StandinOps

    calls = []
    for name in ("decode_attention", "rotary_append"):
        real = getattr(StandinOps, name)
        monkeypatch.setattr(StandinOps, name, lambda *a, _real=real: calls.append(1) or _real(*a))
    q, kc, vc, bt = _kv_case(paged=True)
    lens = torch.tensor([5, 30], dtype=torch.int32)
    k = v = torch.randn(2, 1, 2, 64)
    cos = torch.randn(48, 16)
    refusals = [
        (TypeError, "decode_attention: q must be a tensor; got NoneType",
         lambda: cuda_ext.decode_attention(None, kc, vc, lens)),
        (TypeError, "decode_attention: k_cache must be a tensor; got NoneType",
         lambda: cuda_ext.decode_attention(q, None, vc, lens, block_table=bt)),
        (TypeError, "decode_attention: block_table must be a tensor or None; got list",
         lambda: cuda_ext.decode_attention(q, kc, vc, lens, block_table=bt.tolist())),
        (ValueError, "decode_attention: block_table must be on cpu like q; got meta",
         lambda: cuda_ext.decode_attention(q, kc, vc, lens, block_table=bt.to("meta"))),
        (ValueError, "decode_attention: cache_batch_idx must be on cpu like q; got meta",
         lambda: cuda_ext.decode_attention(q, kc[:2], vc[:2], lens, cache_batch_idx=torch.zeros(2, dtype=torch.int32,
                                                                                                   device="meta"))),
        (TypeError, "rotary_append: v must be a tensor; got NoneType",
         lambda: cuda_ext.rotary_append(q, k, None, kc, vc, lens, block_table=bt)),
        (ValueError, "rotary_append: sin must be on cpu like q; got meta",
         lambda: cuda_ext.rotary_append(q, k, v, kc, vc, lens, cos=cos, sin=cos.to("meta"), block_table=bt)),
        (TypeError, "flash_attn_with_kvcache: v_cache must be a tensor; got NoneType",
         lambda: cuda_ext.flash_attn_with_kvcache(q, kc, None, cache_seqlens=lens, block_table=bt)),
        (ValueError, "flash_attn_with_kvcache: rotary_cos must be on cpu like q; got meta",
         lambda: cuda_ext.flash_attn_with_kvcache(q, kc, vc, k, v, cos.to("meta"), cos, cache_seqlens=lens,
                                                  block_table=bt)),
    ]
    for exc, words, call in refusals:
        with pytest.raises(exc) as info:
            call()
        assert str(info.value) == f"flashtx.cuda_ext.{words}", str(info.value)
    assert calls == []  # nothing reached the ops
    cuda_ext.decode_attention(q, kc, vc, lens, block_table=bt)  # the valid call still runs
    assert calls == [1]
