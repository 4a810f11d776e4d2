"""Window attention with a learned relative-position bias, as Swin Transformer's blocks run it: many short
sequences (the windows) sharing one (1, H, N, N) bias that requires grad, so its gradient is a sum over every
window. Swin-T's first stage at batch 32: 56x56 patches in 7x7 windows, 2048 windows of N = 49 tokens, H = 3,
D = 32 (BENCH_DTYPE, bf16 by default), not causal.

This is the shape where the bias gradient's sum over the batch decides the time: flashtx's dQ kernel splits the
summed windows into groups that fill the GPU (triton_kernels/attention_bwd_launch.py, dbias_groups) instead of
one program per (head, q tile) looping over all 2048. Providers: flashtx, SDPA's EFFICIENT (xformers' kernel,
which computes the bias gradient) and MATH backends, and eager attention (the module's own code); and
`flashtx-128-rows`, flashtx on its tables' q tiles of up to 128 rows (configs.fit_rows off: SHORT_ROWS = 0), so a
run compares them with the 64-row tiles flashtx cuts for these 49-token windows (untimed so far).
The quick subset: fwd+bwd, flashtx, flashtx-128-rows and SDPA-EFFICIENT. A smoke run (BENCH_SMOKE=1) takes 8 windows.
"""
from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

import flashtx
from flashtx import _dispatch
from flashtx.triton_kernels import configs

from . import gpus, harness
from .providers import eager_attention

DTYPE = harness.DTYPE
N, H, D = 49, 3, 32
WINDOWS = harness.smoke_dims(windows=(2048, 256))["windows"]
TABLE_ROWS = "flashtx-128-rows"
PROVIDERS = ("flashtx", TABLE_ROWS, "sdpa-efficient", "sdpa-math", "eager")
# the quick subset (the device script's bench step used 139 of its 150 s on 2026-12-06): the bias gradient's pass,
# flashtx against the one fused kernel that computes it too
QUICK = {("flashtx", "fwd+bwd"), (TABLE_ROWS, "fwd+bwd"), ("sdpa-efficient", "fwd+bwd")}


@contextlib.contextmanager
def table_rows():
    """configs.fit_rows off (the tables' q tiles whatever the sequence length); plans rebuilt inside and after."""
    saved = configs.SHORT_ROWS
    try:
        configs.SHORT_ROWS = 0
        _dispatch.clear_plans()
        yield
    finally:
        configs.SHORT_ROWS = saved
        _dispatch.clear_plans()


def _fn(provider: str, bias):
    """fn(q, k, v) -> out for (WINDOWS, H, N, D) tensors, adding `bias` (1, H, N, N) to the scaled scores."""
    if provider in ("flashtx", TABLE_ROWS):
        return lambda q, k, v: flashtx.attention(q, k, v, attn_mask=bias)
    if provider == "eager":
        return lambda q, k, v: eager_attention(q, k, v, None, D ** -0.5, bias=bias)
    from torch.nn.attention import SDPBackend, sdpa_kernel
    backend = {"sdpa-efficient": SDPBackend.EFFICIENT_ATTENTION, "sdpa-math": SDPBackend.MATH}[provider]

    def fn(q, k, v):
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    return fn


@pytest.mark.gpu
@pytest.mark.parametrize("provider,pass_", [
    pytest.param(p, pass_, marks=[pytest.mark.quick] if (p, pass_) in QUICK else [], id=f"{p}-{pass_}")
    for pass_ in ("fwd", "fwd+bwd") for p in PROVIDERS])
def test_window_attention_bias(benchmark, provider, pass_):
    benchmark.group = f"window attention, learned (1, H, N, N) bias {pass_} windows={WINDOWS} N={N} H={H} D={D}"

    def build():
        dev, grad = harness.DEVICE, pass_ != "fwd"
        q, k, v = (torch.randn(WINDOWS, H, N, D, device=dev, dtype=DTYPE, requires_grad=grad) for _ in range(3))
        bias = (0.1 * torch.randn(1, H, N, N, device=dev, dtype=DTYPE)).requires_grad_(grad)
        fn = _fn(provider, bias)
        if not grad:
            def step(_):
                with torch.no_grad():
                    return fn(q, k, v)
        else:
            def step(_):
                out = fn(q, k, v)
                return torch.autograd.grad(out, (q, k, v, bias), torch.ones_like(out))
        return (lambda: None), step

    with table_rows() if provider == TABLE_ROWS else contextlib.nullcontext():
        _measure(benchmark, build, provider, pass_)


def _measure(benchmark, build, provider, pass_):
    ours = provider in ("flashtx", TABLE_ROWS)
    prepare, step = harness.build_or_skip(provider, build, fail_fast=ours)
    info = {"op": "attention-bias", "provider": provider, "pass": pass_, "batch": WINDOWS, "heads": H,
            "kv_heads": H, "seqlen": N, "headdim": D, "causal": False, "dtype": str(DTYPE).replace("torch.", ""),
            "shape": f"windows={WINDOWS} H={H} N={N} D={D}, bias (1, H, N, N)"}
    harness.run_case(benchmark, prepare=prepare, step=step, info=info,
                     flops=gpus.attention_flops(WINDOWS, H, N, N, D, False, pass_), dtype=DTYPE,
                     fail_fast=ours, breakdown=provider == "flashtx" and pass_ == "fwd+bwd")
