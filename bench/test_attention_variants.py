"""flashtx's attention variants timed against plain causal attention on the same tokens (issue 5's
GPU part): a sliding window and varlen must cost in proportion to the keys each query sees,
because the kernels skip the tiles nobody sees; a learned bias, a boolean mask, softcap + ALiBi
and dropout show what each option costs on top of the same causal attention.

All at 16k tokens, H = 16, D = 128 (BENCH_DTYPE, bf16 by default), causal:
- `full`: B = 4 sequences of N = 4096 (the baseline);
- `window1024`: the same with window_size = (1024, 0): each query sees at most 1025 keys, so
  (4096*1025 - 1025**2/2) / (4096**2/2) ~= 0.44 of the causal work (~0.48 counted in 128x64 tiles);
- `varlen16x1k`: 16 documents of 1024 tokens packed into one (16k, H, D) batch: 16 causal 1k
  triangles against 4 of 4k, 0.25 of the causal work;
- `bias`: a learned (1, H, N, N) bias, with its gradient in fwd+bwd;
- `boolmask`: a (B, 1, 1, N) key-padding style bool attn_mask;
- `softcap+alibi`, `dropout0.1`.
The FLOP count is the causal one of the dense case for every variant (so TFLOP/s compare times
directly: a variant that skips work shows a higher "effective" rate). Each record also carries
`ideal_fraction`, the variant's (query, key) pairs over the full causal run's (bench.gpus.visible_pairs;
1.0 for the options that skip nothing), which the report prints beside the measured time ratio.
Provider `flashtx-plain-tiles` (every variant but `full`) runs the same call with configs.py's
specialisation tiles off (MASKED, MODIFIED and the bias-gradient dQ's own tiles: the plain table's
instead), so the report can say whether the spill-free tiles trimmed for masks and score modifiers
beat the plain ones on this GPU.
A smoke run (BENCH_SMOKE=1) shrinks B, N and H, and with N the window and the document length.
"""
from __future__ import annotations

import contextlib

import pytest
import torch

import flashtx
from flashtx import _dispatch
from flashtx.triton_kernels import configs

from . import gpus, harness

DTYPE = harness.DTYPE
D = 128
B, N, H = harness.smoke_dims(b=(4, 2), n=(4096, 32), h=(16, 8)).values()
WINDOW = DOC = N // 4  # window1024 (0.44 of the causal pairs at N = 4096) and varlen16x1k's documents (0.25)
VARIANTS = ("full", "window1024", "varlen16x1k", "bias", "boolmask", "softcap+alibi", "dropout0.1")
QUICK = ("full", "window1024", "varlen16x1k", "bias")
PLAIN_TILES = "flashtx-plain-tiles"
PLAIN_BWD_TILES = "flashtx-plain-bwd-tiles"  # the backward's kernels only (the learned bias: which pass lost the time)
BWD_KERNELS = ("attn_bwd_dkdv", "attn_bwd_dq", "attn_bwd_dq_dbias")


@contextlib.contextmanager
def plain_tiles(kernels: tuple | None = None):
    """configs.select_config without its specialisation tables: MASKED / MODIFIED empty and the bias-gradient
    dQ on dQ's plain tiles (what flashtx launched before they existed), for every kernel or only `kernels`. Plans
    are rebuilt inside and after."""
    saved = ({f: dict(t) for f, t in configs.MODIFIED.items()}, {f: dict(t) for f, t in configs.MASKED.items()},
             {f: t["attn_bwd_dq_dbias"] for f, t in configs.TABLES.items()})

    def reset():  # clear_plans forgets the launch cache too
        configs._select.cache_clear()
        _dispatch.clear_plans()

    try:
        for fam, tables in configs.TABLES.items():
            configs.MODIFIED[fam], configs.MASKED[fam] = (
                ({}, {}) if kernels is None else
                tuple({k: v for k, v in saved[i][fam].items() if k not in kernels} for i in (0, 1)))
            if kernels is None or "attn_bwd_dq_dbias" in kernels:
                tables["attn_bwd_dq_dbias"] = tables["attn_bwd_dq"]
        reset()
        yield
    finally:
        for fam, tables in configs.TABLES.items():
            configs.MODIFIED[fam], configs.MASKED[fam] = saved[0][fam], saved[1][fam]
            tables["attn_bwd_dq_dbias"] = saved[2][fam]
        reset()


def _build(variant: str, requires_grad: bool):
    """(fn, leaves): fn() runs the variant's forward on (B, N, H, D) tensors built here."""
    dev = harness.DEVICE
    q, k, v = (torch.randn(B, N, H, D, device=dev, dtype=DTYPE, requires_grad=requires_grad) for _ in range(3))
    leaves = [q, k, v]
    if variant == "varlen16x1k":
        cu = torch.arange(0, B * N + 1, DOC, device=dev, dtype=torch.int32)
        qp, kp, vp = (t.detach().reshape(B * N, H, D).requires_grad_(requires_grad) for t in (q, k, v))
        return (lambda: flashtx.flash_attn_varlen_func(qp, kp, vp, cu, cu, DOC, DOC, causal=True)), [qp, kp, vp]
    kw = {}
    if variant == "window1024":
        kw = dict(window_size=(WINDOW, 0))
    elif variant == "bias":
        bias = (0.1 * torch.randn(1, H, N, N, device=dev, dtype=DTYPE)).requires_grad_(requires_grad)
        kw, leaves = dict(attn_bias=bias), leaves + [bias]
    elif variant == "boolmask":
        kw = dict(attn_bias=torch.rand(B, 1, 1, N, device=dev) > 0.1)
    elif variant == "softcap+alibi":
        kw = dict(softcap=30.0, alibi_slopes=torch.tensor([2 ** (-8 * (h + 1) / H) for h in range(H)], device=dev))
    elif variant == "dropout0.1":
        kw = dict(dropout_p=0.1)
    return (lambda: flashtx.flash_attn_func(q, k, v, causal=True, **kw)), leaves


def _params():
    """(pass, variant, provider): flashtx on every variant; the plain tiles on every variant but full (whose tiles
    are the plain ones); the plain backward tiles on the learned bias's fwd+bwd. Quick: QUICK's flashtx rows and
    the bias's others."""
    for pass_ in ("fwd", "fwd+bwd"):
        for v in VARIANTS:
            for p in ("flashtx", PLAIN_TILES, PLAIN_BWD_TILES):
                if (p == PLAIN_TILES and v == "full") or (p == PLAIN_BWD_TILES and (v, pass_) != ("bias", "fwd+bwd")):
                    continue
                quick = v in QUICK and (p == "flashtx" or v == "bias")
                yield pytest.param(pass_, v, p, marks=[pytest.mark.quick] if quick else [], id=f"{v}-{p}-{pass_}")


@pytest.mark.gpu
@pytest.mark.parametrize("pass_,variant,provider", list(_params()))
def test_attention_variant(benchmark, variant, provider, pass_):
    benchmark.group = f"attention variants {pass_} causal B={B} N={N} H={H} D={D}"

    def build():
        fn, leaves = _build(variant, requires_grad=pass_ != "fwd")
        if pass_ == "fwd":
            def step(_):
                with torch.no_grad():
                    return fn()
        else:
            def step(_):
                out = fn()
                return torch.autograd.grad(out, leaves, torch.ones_like(out))
        return (lambda: None), step

    tiles = (plain_tiles() if provider == PLAIN_TILES else plain_tiles(BWD_KERNELS) if provider == PLAIN_BWD_TILES
             else contextlib.nullcontext())
    with tiles:
        _measure(benchmark, build, variant, provider, pass_)


def _measure(benchmark, build, variant, provider, pass_):
    prepare, step = harness.build_or_skip(provider, build, fail_fast=True)
    info = {"op": "attention-variant", "variant": variant, "provider": provider, "pass": pass_,
            "batch": B, "heads": H, "kv_heads": H, "seqlen": N, "headdim": D, "causal": True,
            "dtype": str(DTYPE).replace("torch.", ""), "shape": f"B={B} H={H} S={N} D={D} {variant}",
            "ideal_fraction": ideal_fraction(variant)}
    if variant == "window1024":
        info["window"] = WINDOW
    elif variant == "varlen16x1k":
        info["doc_len"] = DOC
    flops = gpus.attention_flops(B, H, N, N, D, True, pass_)
    # the time by kernel of flashtx's learned-bias and plain fwd+bwd (which of the backward's kernels a bias slows;
    # not the plain-tiles providers: the deferred profile runs after their tiles are restored)
    breakdown = provider == "flashtx" and pass_ == "fwd+bwd" and variant in ("full", "bias")
    harness.run_case(benchmark, prepare=prepare, step=step, info=info, flops=flops, dtype=DTYPE, fail_fast=True,
                     breakdown=breakdown)


def ideal_fraction(variant: str) -> float:
    """The variant's (query, key) pairs over the full causal run's: what its time would be, relative to `full`,
    if every tile nobody sees were skipped and the rest cost the same."""
    full = gpus.visible_pairs(N, N, True)
    if variant == "window1024":
        return gpus.visible_pairs(N, N, True, window=WINDOW) / full
    if variant == "varlen16x1k":
        return (N // DOC) * gpus.visible_pairs(DOC, DOC, True) / full
    return 1.0
