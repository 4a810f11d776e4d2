"""Decoding benchmarks: one new token (Sq = 1) attending over a KV cache, as flash-attn's
flash_attn_with_kvcache is used in generation. Batch 1, 8, 64; context 1k, 8k, 32k, 128k; D = 128;
Hq/Hkv = 32/8 (GQA, LLaMA-3-8B) and 8/8; bf16 (BENCH_DTYPE). Decoding is bandwidth-bound, so the
figure of merit is GB/s of K/V read (batch x context x Hkv x D x 2 tensors x element size).

Providers: flashtx.flash_attn_with_kvcache (split-KV kernels, num_splits heuristic); SDPA's
backends given q (B, Hq, 1, D) and the whole cache as k/v (enable_gqa for GQA); xformers'
Triton split-K kernel (`triton_splitKF`, passed explicitly with op=); flashtx.attention over the
cache (what transformers' attn_implementation="ftx" and the patched SDPA call: the same decode kernels,
through flashtx._small_q); the CUDA extension's decode (backend="cuda", csrc/), when it was built (the device
script's tests_gpu step builds it; never a first build here); flashtx's training forward (flash_attn_func with
flashtx._small_q off), to show what the split-KV path buys; and `copy`, a device-to-device copy of as many bytes,
the bandwidth a read of the cache can reach. GPU only: without
one every case is skipped (bench/conftest.py). The quick subset is batch 8 at 8k context, GQA 32/8; a
smoke run (BENCH_SMOKE=1) runs it at 1/4 of the batch, 1/8 of the heads and 1/64 of the context.

The pass "append-rotary" times a whole generation step of one layer: the new token's k and v
appended into the cache at cache_seqlens, q and k rotated there first (NeoX RoPE over all of D, LLaMA's), then
attention over the context. Providers: flashtx.flash_attn_with_kvcache with k, v and the rotary tables (RoPE and
append fused in the Triton decode path), the same with backend="cuda" (the extension's rotary_append, then its
decode), `sdpa-eager` (what transformers' static cache does: eager RoPE, index_copy_ into the cache, SDPA's own
backend choice) and copy. GQA 32/8 only; the quick case is QUICK's.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import flashtx
from flashtx import _small_q

from . import harness
from .providers import xformers_ops_without_cpp
from .harness import DEVICE, Unavailable

BATCHES = (1, 8, 64)
CONTEXTS = (1024, 8192, 32768, 131072)
HEADS = ((32, 8), (8, 8))
D = 128
PROVIDERS = {
    "flashtx": "flashtx.flash_attn_with_kvcache (Triton split-KV)",
    "sdpa-flash": "SDPA FLASH_ATTENTION backend, q (B, Hq, 1, D) over the cache",
    "sdpa-efficient": "SDPA EFFICIENT_ATTENTION backend, q (B, Hq, 1, D) over the cache",
    "sdpa-cudnn": "SDPA CUDNN_ATTENTION backend, q (B, Hq, 1, D) over the cache",
    "xformers-splitk": "xformers memory_efficient_attention_forward with op=triton_splitKF",
    "flashtx-attention": "flashtx.attention, q (B, Hq, 1, D) over the cache (the decode kernels via flashtx._small_q)",
    "flashtx-train": "flashtx.flash_attn_func over the cache, on the training forward (flashtx._small_q off)",
    "flashtx-cuda": "flashtx.flash_attn_with_kvcache(backend='cuda'): the CUDA extension's split-KV decode (csrc/), "
                    "when built (issue 16)",
    "copy": "device-to-device copy moving as many bytes as K/V read (bandwidth reference)",
}


def _kv_bytes(batch: int, hkv: int, ctx: int, dtype) -> int:
    """The bytes a decode step must read: K and V of every cached position, once."""
    return 2 * batch * ctx * hkv * D * torch.finfo(dtype).bits // 8


def _build(provider: str, batch: int, hq: int, hkv: int, ctx: int, dtype):
    if provider == "copy":  # half read, half written: its GB/s is the ceiling a read of the cache can reach
        prepare, step = harness.copy_case(_kv_bytes(batch, hkv, ctx, dtype), dtype)
        state = prepare()
        return lambda: step(state)
    q = torch.randn(batch, 1, hq, D, device=DEVICE, dtype=dtype)  # (B, 1, Hq, D)
    kc = torch.randn(batch, ctx, hkv, D, device=DEVICE, dtype=dtype)  # (B, ctx, Hkv, D)
    vc = torch.randn_like(kc)
    if provider == "flashtx":
        lens = torch.full((batch,), ctx, dtype=torch.int32, device=DEVICE)
        return lambda: flashtx.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, causal=True)
    if provider == "flashtx-cuda":
        _load_cuda_ext()
        lens = torch.full((batch,), ctx, dtype=torch.int32, device=DEVICE)
        return lambda: flashtx.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, causal=True, backend="cuda")
    if provider == "flashtx-attention":  # transformers' attn_implementation="ftx" and the patched SDPA call this
        qh, kh, vh = q.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2)  # (B, H, S, D) views
        return lambda: flashtx.attention(qh, kh, vh, enable_gqa=hq != hkv)
    if provider == "flashtx-train":  # the training forward: flashtx._small_q would give Sq = 1 to the decode kernels
        def step():
            was, _small_q.SMALL_Q_DECODE = _small_q.SMALL_Q_DECODE, False
            try:
                return flashtx.flash_attn_func(q, kc, vc, causal=True)
            finally:
                _small_q.SMALL_Q_DECODE = was
        return step
    if provider.startswith("sdpa-"):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = {"sdpa-flash": SDPBackend.FLASH_ATTENTION, "sdpa-efficient": SDPBackend.EFFICIENT_ATTENTION,
                   "sdpa-cudnn": SDPBackend.CUDNN_ATTENTION}[provider]
        qh, kh, vh = q.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2)  # (B, H, S, D) views

        def step():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(qh, kh, vh, enable_gqa=hq != hkv)
        return step
    if provider == "xformers-splitk":
        xops, _ = xformers_ops_without_cpp()  # (raises Unavailable without xformers)
        from xformers.ops import fmha
        op = getattr(fmha.triton_splitk, "FwOp", None)
        if op is None:
            raise Unavailable("this xformers has no triton_splitk.FwOp")
        g = hq // hkv  # xformers' 5-D GQA layout (B, S, Hkv, G, D), K/V broadcast over G without copies
        q5 = q.view(batch, 1, hkv, g, D)
        k5, v5 = (t[:, :, :, None].expand(batch, ctx, hkv, g, D) for t in (kc, vc))
        return lambda: xops.memory_efficient_attention_forward(q5, k5, v5, op=op)
    raise KeyError(provider)


def _load_cuda_ext() -> None:
    """The CUDA extension, loaded (AOT) or from a JIT build already on disk (bench/device_check.sh's tests_gpu step
    builds it in tests/test_cuda_ext_gpu.py; reloading an unchanged build takes ~2 s). Never a first build here:
    it takes a minute, inside the timed benchmarks' limit. Unavailable says why."""
    import os

    from flashtx import cuda_ext
    from flashtx._cuda_build import EXT_NAME

    if not cuda_ext.load(build_if_missing=False):
        build_dir = cuda_ext.build_directory()
        if not os.path.exists(os.path.join(build_dir, f"{EXT_NAME}.so")):
            raise Unavailable(f"the CUDA extension is not loaded ({cuda_ext.unavailable_reason(False)}) and has no "
                              f"JIT build in {build_dir} (flashtx.cuda_ext.build() or the tests_gpu step makes one)")
        busy = cuda_ext.lock_problem(build_dir)
        if busy is not None:
            raise Unavailable(f"the CUDA extension's JIT build is busy: {busy}")
        cuda_ext.build()  # nothing to compile: loads the library
    why = cuda_ext.unavailable_reason(False)
    if why is not None:
        raise Unavailable(f"the CUDA extension cannot run here: {why}")


APPEND_PROVIDERS = {
    "flashtx": "flashtx.flash_attn_with_kvcache(k=, v=, rotary_cos=, rotary_sin=): RoPE + append + decode (Triton)",
    "flashtx-cuda": "the same with backend='cuda': the CUDA extension's rotary_append, then its decode (issue 16)",
    "sdpa-eager": "eager RoPE of q and k, index_copy_ of k/v into the cache, SDPA's default backend over it "
                  "(transformers' static cache)",
    "copy": "device-to-device copy moving as many bytes as K/V read (bandwidth reference)",
}


def _rotary_tables(n: int, dtype):
    """NeoX RoPE tables (n, D / 2), base 10000, in the inputs' dtype (as transformers casts them)."""
    inv = 1.0 / 10000 ** (torch.arange(0, D, 2, device=DEVICE, dtype=torch.float32) / D)
    ang = torch.arange(n, device=DEVICE, dtype=torch.float32)[:, None] * inv  # (n, D / 2)
    return ang.cos().to(dtype), ang.sin().to(dtype)


def _build_append(provider: str, batch: int, hq: int, hkv: int, ctx: int, dtype):
    """One step: ctx - 1 tokens cached, the new one appended at ctx - 1, attention over ctx keys. The cache holds
    ctx positions, so every provider reads all of them; a step at a fixed position is idempotent when repeated."""
    if provider == "copy":
        prepare, step = harness.copy_case(_kv_bytes(batch, hkv, ctx, dtype), dtype)
        state = prepare()
        return lambda: step(state)
    q = torch.randn(batch, 1, hq, D, device=DEVICE, dtype=dtype)  # (B, 1, Hq, D)
    k, v = (torch.randn(batch, 1, hkv, D, device=DEVICE, dtype=dtype) for _ in range(2))  # (B, 1, Hkv, D)
    kc = torch.randn(batch, ctx, hkv, D, device=DEVICE, dtype=dtype)  # (B, ctx, Hkv, D)
    vc = torch.randn_like(kc)
    cos, sin = _rotary_tables(ctx, dtype)  # (ctx, D / 2)
    if provider in ("flashtx", "flashtx-cuda"):
        backend = None
        if provider == "flashtx-cuda":
            _load_cuda_ext()
            backend = "cuda"
        lens = torch.full((batch,), ctx - 1, dtype=torch.int32, device=DEVICE)
        return lambda: flashtx.flash_attn_with_kvcache(q, kc, vc, k, v, rotary_cos=cos, rotary_sin=sin,
                                                       cache_seqlens=lens, causal=True, rotary_interleaved=False,
                                                       backend=backend)
    if provider == "sdpa-eager":
        pos = torch.tensor([ctx - 1], device=DEVICE)
        half = D // 2

        def rope(x, c, s):  # (B, 1, H, D); c, s: (1, 1, 1, D / 2)
            x1, x2 = x[..., :half], x[..., half:]
            return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)

        def step():
            c, s = cos[pos][None, :, None], sin[pos][None, :, None]
            qr, kr = rope(q, c, s), rope(k, c, s)
            kc.index_copy_(1, pos, kr)
            vc.index_copy_(1, pos, v)
            return F.scaled_dot_product_attention(qr.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2),
                                                  enable_gqa=hq != hkv)
        return step
    raise KeyError(provider)


QUICK = (8, 32, 8, 8192)  # (batch, Hq, Hkv, context) in the quick subset: bench/device_check.sh's bench step
# pass -> (providers, builder, id prefix, what the step does); the RoPE + append step runs GQA 32/8 only
STEPS = {"fwd": (PROVIDERS, _build, "", "Sq=1"),
         "append-rotary": (APPEND_PROVIDERS, _build_append, "append-rotary-", "Sq=1, RoPE + append")}


def _params():
    for pass_, (providers, _, prefix, _) in STEPS.items():
        for hq, hkv in HEADS if pass_ == "fwd" else HEADS[:1]:
            for batch in BATCHES:
                for ctx in CONTEXTS:
                    for provider in providers:
                        marks = [pytest.mark.quick] if (batch, hq, hkv, ctx) == QUICK else []
                        yield pytest.param(pass_, batch, hq, hkv, ctx, provider, marks=marks,
                                           id=f"{prefix}b{batch}-hq{hq}-hkv{hkv}-ctx{ctx}-{provider}")


@pytest.mark.gpu
@pytest.mark.parametrize("pass_, batch, hq, hkv, ctx, provider", list(_params()))
def test_decode(benchmark, pass_, batch, hq, hkv, ctx, provider):
    # a smoke run (BENCH_SMOKE=1): batch / 4, heads / 8, context / 64 (B=2, Hq/Hkv=4/1, 128 keys for the quick case)
    batch, hq, hkv, ctx = harness.smoke_dims(batch=(batch, 4), hq=(hq, 8), hkv=(hkv, 8), ctx=(ctx, 64)).values()
    providers, build, _, what = STEPS[pass_]
    benchmark.group = f"decode {what} D={D} Hq/Hkv={hq}/{hkv} B={batch} ctx={ctx}"
    dtype = harness.DTYPE
    info = {"op": "decode", "pass": pass_, "batch": batch, "heads": hq, "kv_heads": hkv, "seqlen": ctx, "headdim": D,
            "dtype": str(dtype).replace("torch.", ""), "provider": provider, "provider_desc": providers[provider],
            "shape": f"B={batch} Hq={hq} Hkv={hkv} ctx={ctx} D={D} {what}"}
    is_ours = provider == "flashtx"

    def prepare():
        return harness.build_or_skip(provider, lambda: build(provider, batch, hq, hkv, ctx, dtype), fail_fast=is_ours)

    with torch.no_grad():
        harness.run_case(benchmark, prepare=prepare, step=lambda step: step(), info=info,
                         nbytes=_kv_bytes(batch, hkv, ctx, dtype), dtype=dtype, fail_fast=is_ours,
                         breakdown=is_ours)  # (the check, append, attention and combine kernels apart)
