"""The self-check's checks of the ops beyond the plain calls in flashtx.selfcheck: varlen, packed QKV,
dropout, lse, decoding against a paged KV cache, RoPE on q and k together, packed SwiGLU.

Each function (device, dtype) -> [(name, runner(backend) -> CheckResult, reasons(backend), backend names)], as
flashtx.selfcheck.CHECKS takes them. Dropout is judged against the reference backend on the same seed (it draws
the kernels' Philox mask: flashtx.reference.dropout_keep); decoding, which has no backward, by its outputs only.
"""
from __future__ import annotations

import torch

from . import reference
from .backends import BACKENDS, AttentionInputs, triton_device_reasons

VARLEN_NAME = "flash_attn_varlen_func (3 packed sequences, GQA, causal bottom-right)"
PACKED_NAME = "flash_attn_qkvpacked_func (a view of a wider projection, causal)"
DROPOUT_NAME = "attention (dropout 0.2, GQA, causal; the reference backend on the same seed)"
LSE_NAME = "attention lse (return_lse=True, its gradient)"
DECODE_NAME = "flash_attn_with_kvcache (paged cache, append with interleaved RoPE, GQA, 2 queries)"
ROTARY_QK_NAME = "apply_rotary_qk (GPT-J interleaved pairs, position_ids, GQA: q and k together)"
SWIGLU_PACKED_NAME = "swiglu_packed (silu(x[..., :H]) * x[..., H:])"


def _attention_reasons(device, dtype):
    def reasons(backend):
        q = torch.empty(2, 4, 33, 64, device=device, dtype=dtype)
        kv = torch.empty(2, 2, 45, 64, device=device, dtype=dtype)
        return BACKENDS[backend].not_supported_reasons(AttentionInputs(q, kv, kv, True))
    return reasons


def attention_variant_checks(device, dtype) -> list[tuple]:
    from .functional import attention, flash_attn_varlen_func
    from .packed import flash_attn_qkvpacked_func
    from .selfcheck import _compare

    cu_q = torch.tensor([0, 17, 18, 40], device=device, dtype=torch.int32)
    cu_k = torch.tensor([0, 25, 31, 52], device=device, dtype=torch.int32)
    vis = reference.varlen_visibility(cu_q, cu_k, 40, 52, causal=True, device=device)

    def make_varlen():
        return (torch.randn(40, 4, 64, device=device, dtype=torch.float64),
                torch.randn(52, 2, 64, device=device, dtype=torch.float64),
                torch.randn(52, 2, 64, device=device, dtype=torch.float64))

    def varlen(backend):
        def run(q, k, v):
            return flash_attn_varlen_func(q, k, v, cu_q, cu_k, 22, 25, causal=True, backend=backend)

        def ref(q, k, v):  # (total, H, D) -> one packed row (1, H, total, D)
            return reference.attention(*(t.transpose(0, 1)[None] for t in (q, k, v)), vis=vis)[0].transpose(0, 1)

        return _compare(VARLEN_NAME, dtype, backend, run, ref, make_varlen)

    def make_packed():  # a fused projection's output (B, S, 3 * H * D + 8): qkv is a strided view of it
        return (torch.randn(2, 33, 3 * 4 * 64 + 8, device=device, dtype=torch.float64),)

    def packed(backend):
        def qkv(x):
            return x[..., 8:].unflatten(-1, (3, 4, 64))  # (B, S, 3, H, D)

        def ref(x):
            q, k, v = (t.transpose(1, 2) for t in qkv(x).unbind(2))
            return reference.attention(q, k, v, causal=True, bottom_right=True).transpose(1, 2)

        return _compare(PACKED_NAME, dtype, backend,
                        lambda x: flash_attn_qkvpacked_func(qkv(x), causal=True, backend=backend), ref, make_packed)

    def make_bhsd():
        return (torch.randn(2, 4, 33, 64, device=device, dtype=torch.float64),
                torch.randn(2, 2, 45, 64, device=device, dtype=torch.float64),
                torch.randn(2, 2, 45, 64, device=device, dtype=torch.float64))

    def dropout(backend):
        def run(q, k, v, which=backend):
            torch.manual_seed(123)  # the same draw for the kernel, the truth and the eager baseline
            return attention(q, k, v, dropout_p=0.2, is_causal=True, enable_gqa=True, backend=which)

        return _compare(DROPOUT_NAME, dtype, backend, run, lambda q, k, v: run(q, k, v, "reference"), make_bhsd)

    def lse(backend):  # lse does not depend on v: k serves as both
        def ref(q, k):  # lse is float32 for 16-bit inputs: so is its eager baseline
            up = [t if t.dtype == torch.float64 else t.float() for t in (q, k)]
            return reference.attention(up[0], up[1], up[1], causal=True, return_lse=True)[1]

        return _compare(LSE_NAME, dtype, backend,
                        lambda q, k: attention(q, k, k, is_causal=True, enable_gqa=True, return_lse=True,
                                               backend=backend)[1], ref, lambda: make_bhsd()[:2],
                        out_dtype=torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype)

    reasons = _attention_reasons(device, dtype)
    names = tuple(BACKENDS)
    return [(VARLEN_NAME, varlen, reasons, names), (PACKED_NAME, packed, reasons, names),
            (DROPOUT_NAME, dropout, reasons, names), (LSE_NAME, lse, reasons, names)]


def decode_checks(device, dtype) -> list[tuple]:
    """flash_attn_with_kvcache: the Triton kernels against the reference backend in float64 (the truth) and in
    dtype (the eager baseline), on the same paged caches; out, lse and the appended caches."""
    from .decode import flash_attn_with_kvcache
    from .selfcheck import CheckResult
    from . import testing

    B, Hq, Hkv, D, page, pages = 3, 8, 2, 64, 16, 5
    lens = torch.tensor([40, 3, 61], device=device, dtype=torch.int32)
    table = torch.randperm(B * pages, device=device).reshape(B, pages).to(torch.int32)  # scattered pages
    theta = torch.arange(B * pages * page, device=device, dtype=torch.float64)[:, None] * 10000.0 ** (
        -torch.arange(D // 2, device=device, dtype=torch.float64) / (D // 2))
    cos, sin = theta.cos().float(), theta.sin().float()

    def run(backend):
        base = [torch.randn(B * pages, page, Hkv, D, device=device, dtype=torch.float64) for _ in range(2)] + [
            torch.randn(B, 2, Hq, D, device=device, dtype=torch.float64)] + [
            torch.randn(B, 2, Hkv, D, device=device, dtype=torch.float64) for _ in range(2)]

        def call(dt, which):
            kc, vc, q, k, v = (t.to(dt) for t in base)
            out, lse = flash_attn_with_kvcache(q, kc, vc, k, v, cos, sin, cache_seqlens=lens, block_table=table,
                                               causal=True, rotary_interleaved=True, return_softmax_lse=True,
                                               backend=which)
            return out, lse, kc, vc

        got, truth, eager = call(dtype, backend), call(torch.float64, "reference"), call(dtype, "reference")
        errors = {name: testing.tolerance_check(g, t, e)
                  for name, g, t, e in zip(("out", "lse", "k_cache", "v_cache"), got, truth, eager)}
        if got[0].dtype != dtype or got[0].shape != truth[0].shape:
            errors["out dtype/shape"] = (float("inf"), 0.0)
        return CheckResult(DECODE_NAME, dtype, backend, errors)

    def reasons(backend):
        return triton_device_reasons(torch.device(device), dtype) if backend == "triton" else []

    return [(DECODE_NAME, run, reasons, ("triton", "reference"))]


def elementwise_checks(device, dtype) -> list[tuple]:
    from .rotary import ROTARY_BACKENDS, RotaryInputs, apply_rotary_qk
    from .selfcheck import _compare
    from .swiglu import SWIGLU_BACKENDS, SwigluInputs, swiglu_packed

    S, R2, L = 33, 32, 64
    theta = torch.arange(L, device=device, dtype=torch.float64)[:, None] * 10000.0 ** (
        -torch.arange(R2, device=device, dtype=torch.float64) / R2)
    cos, sin = theta.cos().float(), theta.sin().float()
    pos = torch.randperm(L, device=device)[:S][None].expand(2, S).contiguous()  # (B, S) absolute positions

    def eager_pairs(x):  # GPT-J pairs (x[2j], x[2j+1]) rotated at `pos`, in x's dtype
        c, s = (t.to(x.dtype)[pos][:, :, None, :] for t in (cos, sin))  # (B, S, 1, R2)
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), -1).flatten(-2)

    def make_qk():
        return (torch.randn(2, S, 8, 2 * R2, device=device, dtype=torch.float64),
                torch.randn(2, S, 2, 2 * R2, device=device, dtype=torch.float64))

    def rotary_qk(backend):
        def run(q, k):
            qo, ko = apply_rotary_qk(q, k, cos, sin, interleaved=True, position_ids=pos, backend=backend)
            return torch.cat((qo, ko), dim=2)  # (B, S, Hq + Hk, D)

        return _compare(ROTARY_QK_NAME, dtype, backend, run,
                        lambda q, k: torch.cat((eager_pairs(q), eager_pairs(k)), dim=2), make_qk)

    def rotary_reasons(backend):
        x = torch.empty(2, S, 8, 2 * R2, device=device, dtype=dtype)
        return ROTARY_BACKENDS[backend].not_supported_reasons(RotaryInputs(x, cos[None]))

    def packed(backend):
        return _compare(SWIGLU_PACKED_NAME, dtype, backend, lambda x: swiglu_packed(x, backend=backend),
                        lambda x: torch.nn.functional.silu(x[..., :344]) * x[..., 344:],
                        lambda: (torch.randn(2, 33, 688, device=device, dtype=torch.float64),))

    def swiglu_reasons(backend):
        g = torch.empty(2, 33, 344, device=device, dtype=dtype)
        return SWIGLU_BACKENDS[backend].not_supported_reasons(SwigluInputs(g))

    return [(ROTARY_QK_NAME, rotary_qk, rotary_reasons, tuple(ROTARY_BACKENDS)),
            (SWIGLU_PACKED_NAME, packed, swiglu_reasons, tuple(SWIGLU_BACKENDS))]
