"""Attention benchmarks, shaped as FlashAttention's own benchmark (benchmarks/benchmark_flash_attention.py):
B*N = 16k tokens and H*D = 2048, so every sequence length does the same work per token; D in {64, 128};
N from 512 to 16k; causal and not; forward, backward, forward+backward. Plus GQA as LLaMA-3-8B:
32 query heads, 8 K/V heads, D = 128.

Every provider gets the same shapes and dtype (BENCH_DTYPE: bf16, the default, or fp16) in its
native layout, contiguous. The quick subset (`--quick` or `-m quick`) is D = 128 at N = 2k and 8k, and
D = 64 causal at N = 2k (GPT-2's head size, as in bench/test_models.py's compiled step).
A smoke run (BENCH_SMOKE=1) runs each case with 1/64 of the sequence length, batch 1 and 1/8 of the
heads (bench/harness.py).
"""
from __future__ import annotations

import pytest

from . import gpus, harness
from .providers import ATTENTION_PROVIDERS, DESCRIPTION, AttnCase, attention_case

TOKENS = 16 * 1024   # B * N, as FlashAttention's benchmark
HIDDEN = 2048        # H * D, as FlashAttention's benchmark
SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
HEADDIMS = (64, 128)
PASSES = ("fwd", "bwd", "fwd+bwd")
QUICK_SEQLENS = (2048, 8192)
GQA_HEADS = (32, 8)  # LLaMA-3-8B: 32 query heads share 8 K/V heads, D = 128
GQA_SEQLENS = (2048, 4096, 8192, 16384)


def _quick(provider: str, d: int, seqlen: int, causal: bool) -> bool:
    if not (d == 128 and seqlen in QUICK_SEQLENS or d == 64 and seqlen == 2048 and causal):
        return False
    # FlexAttention compiles per shape and pass (~10-30 s each): one causal shape in the quick set
    return provider != "flex" or (seqlen == 2048 and causal)


def _params():
    for pass_ in PASSES:
        for d in HEADDIMS:
            for causal in (False, True):
                for seqlen in SEQLENS:
                    for provider in ATTENTION_PROVIDERS:
                        marks = [pytest.mark.quick] if _quick(provider, d, seqlen, causal) else []
                        yield pytest.param(pass_, d, seqlen, causal, provider, marks=marks,
                                           id=f"{pass_}-d{d}-n{seqlen}-{'causal' if causal else 'full'}-{provider}")


def _gqa_params():
    for pass_ in PASSES:
        for seqlen in GQA_SEQLENS:
            for provider in ATTENTION_PROVIDERS:
                marks = [pytest.mark.quick] if seqlen == 2048 and provider != "flex" else []
                yield pytest.param(pass_, seqlen, provider, marks=marks, id=f"{pass_}-n{seqlen}-causal-{provider}")


def make_case(batch: int, hq: int, hkv: int, seqlen: int, d: int, causal: bool) -> AttnCase:
    dims = harness.smoke_dims(batch=(batch, batch), hq=(hq, 8), hkv=(hkv, 8), seqlen=(seqlen, 64))
    return AttnCase(**dims, d=d, causal=causal, dtype=harness.DTYPE)


def run_attention(benchmark, provider: str, case: AttnCase, pass_: str) -> None:
    benchmark.group = (f"attention {pass_} D={case.d} {'causal' if case.causal else 'full'} "
                       f"Hq/Hkv={case.hq}/{case.hkv} N={case.seqlen}")
    is_ours = provider == "flashtx"
    prepare, step = harness.build_or_skip(provider, lambda: attention_case(provider, case, pass_), fail_fast=is_ours)
    info = {**case.info(), "provider": provider, "provider_desc": getattr(step, "desc", None) or DESCRIPTION[provider],
            "pass": pass_}
    flops = gpus.attention_flops(case.batch, case.hq, case.seqlen, case.seqlen, case.d, case.causal, pass_)
    harness.run_case(benchmark, prepare=prepare, step=step, info=info, flops=flops, dtype=case.dtype,
                     fail_fast=is_ours, breakdown=is_ours and pass_ == "bwd")  # (its time by kernel)


@pytest.mark.gpu
@pytest.mark.parametrize("pass_, d, seqlen, causal, provider", list(_params()))
def test_attention(benchmark, pass_, d, seqlen, causal, provider):
    h = HIDDEN // d
    case = make_case(TOKENS // seqlen, h, h, seqlen, d, causal)
    run_attention(benchmark, provider, case, pass_)


@pytest.mark.gpu
@pytest.mark.parametrize("pass_, seqlen, provider", list(_gqa_params()))
def test_attention_gqa(benchmark, pass_, seqlen, provider):
    hq, hkv = GQA_HEADS
    case = make_case(TOKENS // seqlen, hq, hkv, seqlen, 128, True)
    run_attention(benchmark, provider, case, pass_)
