"""Fused RoPE and SwiGLU against eager PyTorch, torch.compile'd eager, Liger-Kernel and a plain copy.

Both ops are memory-bound, so they are reported in GB/s of the fewest bytes they must move
(bench/gpus.py) and compared with `copy`: a device-to-device copy moving the same number of bytes,
the bandwidth a memory-bound kernel can hope for (issue 3's target: >= 80% of it).

Shapes (issue 14 item 3) as LLaMA-3-8B (32 q and 8 kv heads, D = 128; SwiGLU width 14336) and a
70B-like model (64 q and 8 kv heads, D = 128; SwiGLU width 28672) at 1k, 4k, 16k and 64k tokens
(batch 1). Layout (B, H, S, D) as Hugging Face models call RoPE. Each case records the latency from
idle (`median_ms`) and the steady-state time back to back (`steady_ms`, bench/harness.py) with GB/s
of both. The quick subset is LLaMA-3-8B at 4k and 16k tokens (QUICK). A smoke run (BENCH_SMOKE=1) divides tokens
by 256 (16k: 64 tokens; the interpreter runs RoPE's 2-position tiles one after another), the MLP width by 64
and the heads by 8.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import flashtx

from . import gpus, harness
from . import providers
from .providers import optional_import

DTYPE = harness.DTYPE
MODELS = {  # name: (q heads, kv heads, head dim, MLP intermediate size)
    "llama3-8b": (32, 8, 128, 14336),
    "llama3-70b": (64, 8, 128, 28672),  # LLaMA-3-70B's heads; SwiGLU width 28672 (its MLP is 28672 wide)
}
TOKENS = (1024, 4096, 16384, 65536)
PASSES = ("fwd", "bwd")
PROVIDERS = ("flashtx", "eager", "compiled", "liger", "copy")
DESCRIPTION = {
    "flashtx": "flashtx (Triton)",
    "eager": "eager PyTorch, as Hugging Face writes it",
    "compiled": "torch.compile'd eager",
    "liger": "Liger-Kernel",
    "copy": "device-to-device copy of the same number of bytes (bandwidth reference)",
}
# The quick subset: LLaMA-3-8B at 4k tokens (the latency-from-idle target's size) and at 16k (the bandwidth targets'
# size: past L2 back to back) without the eager rows
QUICK = {("llama3-8b", 4096): PROVIDERS, ("llama3-8b", 16384): ("flashtx", "compiled", "liger", "copy")}


def _params():
    for pass_ in PASSES:
        for model in MODELS:
            for tokens in TOKENS:
                for provider in PROVIDERS:
                    marks = [pytest.mark.quick] if provider in QUICK.get((model, tokens), ()) else []
                    yield pytest.param(pass_, model, tokens, provider, marks=marks,
                                       id=f"{pass_}-{model}-t{tokens}-{provider}")


# ------------------------------------------------------------------------------------- eager forms
def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_eager(q, k, cos, sin):
    """transformers' apply_rotary_pos_emb; cos/sin (S, D) with duplicated halves, in q's dtype."""
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def swiglu_eager(gate, up):
    return F.silu(gate) * up


_compiled: dict = {}


def compiled(fn):
    if fn not in _compiled:
        import torch._dynamo
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 256)
        _compiled[fn] = torch.compile(fn, dynamic=False)
    return _compiled[fn]


# ---------------------------------------------------------------------------------------- builders
def _rope_fn(provider: str, d: int, seqlen: int):
    half_cos, half_sin = flashtx.nn.RotaryEmbedding(d).cos_sin(seqlen, device=providers.DEVICE)  # (S, D/2) fp32
    full_cos = torch.cat((half_cos, half_cos), -1).to(DTYPE)
    full_sin = torch.cat((half_sin, half_sin), -1).to(DTYPE)
    if provider == "flashtx":
        return lambda q, k: flashtx.apply_rotary_qk(q, k, half_cos, half_sin, layout="bhsd")
    if provider == "eager":
        return lambda q, k: rope_eager(q, k, full_cos, full_sin)
    if provider == "compiled":
        f = compiled(rope_eager)
        return lambda q, k: f(q, k, full_cos, full_sin)
    if provider == "liger":
        rope = optional_import("liger_kernel.transformers.rope")
        c, s = full_cos[None], full_sin[None]  # (1, S, D)
        return lambda q, k: rope.liger_rotary_pos_emb(q, k, c, s)
    raise ValueError(provider)


def _swiglu_fn(provider: str):
    if provider == "flashtx":
        return flashtx.swiglu
    if provider == "eager":
        return swiglu_eager
    if provider == "compiled":
        return compiled(swiglu_eager)
    if provider == "liger":
        ops = optional_import("liger_kernel.ops.swiglu")
        return ops.LigerSiLUMulFunction.apply
    raise ValueError(provider)


def _fwd_bwd(fn, make_inputs, pass_):
    """(prepare, step): fwd without autograd; bwd as autograd.grad over a forward built once."""
    if pass_ == "fwd":
        def prepare():
            return make_inputs(False)

        def step(xs):
            with torch.no_grad():
                return fn(*xs)
    else:
        def prepare():
            xs = make_inputs(True)
            outs = fn(*xs)
            outs = outs if isinstance(outs, tuple) else (outs,)
            return outs, xs, tuple(torch.randn_like(o) for o in outs)

        def step(s):
            outs, xs, douts = s
            return torch.autograd.grad(outs, xs, douts, retain_graph=True)
    return prepare, step


def _record(benchmark, op, provider, pass_, model, tokens, shape, nbytes, build):
    benchmark.group = f"{op} {pass_} {model} tokens={tokens}"
    info = {"op": op, "provider": provider, "provider_desc": DESCRIPTION[provider], "pass": pass_,
            "model": model, "tokens": tokens, "seqlen": tokens, "dtype": str(DTYPE).replace("torch.", ""),
            "shape": shape}
    is_ours = provider == "flashtx"
    prepare, step = harness.build_or_skip(provider, build, fail_fast=is_ours)
    harness.run_case(benchmark, prepare=prepare, step=step, info=info, nbytes=nbytes, dtype=DTYPE,
                     fail_fast=is_ours)


@pytest.mark.gpu
@pytest.mark.parametrize("pass_, model, tokens, provider", list(_params()))
def test_rope(benchmark, pass_, model, tokens, provider):
    hq, hkv, d, _ = MODELS[model]
    hq, hkv, tokens = harness.smoke_dims(hq=(hq, 8), hkv=(hkv, 8), tokens=(tokens, 256)).values()
    elem = torch.empty((), dtype=DTYPE).element_size()
    nbytes = gpus.rope_bytes(tokens * hq * d, tokens * hkv * d, elem, pass_)

    def make_inputs(grad):  # (1, H, S, D) views of (1, S, H, D) memory: q_proj(x).view(B, S, H, D).transpose(1, 2),
        # as a transformers model passes them (and Liger's kernel expects: contiguous (1, H, S, D) tensors cost it a
        # copy of q and k first, up to 2x its bytes)
        q = torch.randn(1, tokens, hq, d, device=providers.DEVICE, dtype=DTYPE).transpose(1, 2).requires_grad_(grad)
        k = torch.randn(1, tokens, hkv, d, device=providers.DEVICE, dtype=DTYPE).transpose(1, 2).requires_grad_(grad)
        return q, k

    def build():
        if provider == "copy":
            return harness.copy_case(nbytes, DTYPE)
        return _fwd_bwd(_rope_fn(provider, d, tokens), make_inputs, pass_)

    _record(benchmark, "rope", provider, pass_, model, tokens,
            f"q (1, {hq}, {tokens}, {d}), k (1, {hkv}, {tokens}, {d}), (B, S, H, D) in memory", nbytes, build)


@pytest.mark.gpu
@pytest.mark.parametrize("pass_, model, tokens, provider", list(_params()))
def test_swiglu(benchmark, pass_, model, tokens, provider):
    inter, tokens = harness.smoke_dims(inter=(MODELS[model][3], 64), tokens=(tokens, 256)).values()
    elem = torch.empty((), dtype=DTYPE).element_size()
    nbytes = gpus.swiglu_bytes(tokens * inter, elem, pass_)

    def make_inputs(grad):
        return tuple(torch.randn(tokens, inter, device=providers.DEVICE, dtype=DTYPE).requires_grad_(grad) for _ in range(2))

    def build():
        if provider == "copy":
            return harness.copy_case(nbytes, DTYPE)
        return _fwd_bwd(_swiglu_fn(provider), make_inputs, pass_)

    _record(benchmark, "swiglu", provider, pass_, model, tokens, f"gate, up ({tokens}, {inter})", nbytes, build)
