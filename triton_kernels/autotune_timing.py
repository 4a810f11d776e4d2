"""Timing one attention tile config for triton_kernels/autotune.py: the pass that runs a kernel through
flashtx.attention on synthetic inputs (a private generator, the caller's RNG state restored), with the kernel's
config forced. autotune.tune_now and `python -m bench.tune` call it as autotune.time_candidate."""
from __future__ import annotations

import contextlib

from .configs import TileConfig


def time_candidate(kernel: str, cfg: TileConfig, *, d: int, dv: int | None = None, causal: bool, dtype, seqlen: int,
                   tokens: int = 16384, hidden: int = 2048, warmup_ms: float = 10, rep_ms: float = 40,
                   device: str = "cuda", modified: bool = False) -> float:
    """Median ms of the pass that runs `kernel` (forward for attn_fwd, the backward for the others)
    through flashtx.attention on `device` tensors (B * seqlen = tokens, H * d = hidden), with `kernel`'s
    config forced to `cfg`. The backward's forward is recorded with grad enabled whatever the caller's
    mode: the hook tunes a backward kernel from inside a backward, where autograd has turned grad off. modified:
    time the kernels with a score modifier (softcap), as the key's launches run them. The inputs come from a
    private generator, and the caller's RNG state is restored: a user's dropout masks (and a reentrant
    checkpoint's recompute of them) never see the tuning."""
    import torch

    dev = torch.device(device)
    index = dev.index if dev.index is not None or dev.type != "cuda" else torch.cuda.current_device()
    with torch.random.fork_rng(devices=[index] if dev.type == "cuda" else []), \
            (torch.cuda.device(index) if dev.type == "cuda" else contextlib.nullcontext()):
        return _time_candidate(kernel, cfg, d, dv, causal, dtype, seqlen, tokens, hidden, warmup_ms, rep_ms, device,
                               modified)


def _time_candidate(kernel, cfg, d, dv, causal, dtype, seqlen, tokens, hidden, warmup_ms, rep_ms, device,
                    modified) -> float:
    import torch

    import flashtx

    from . import autotune
    dv = dv or d
    b, h = max(1, tokens // seqlen), max(1, hidden // d)
    gen = torch.Generator(device=device).manual_seed(0)
    q, k = (torch.randn(b, h, seqlen, d, device=device, dtype=dtype, generator=gen) for _ in range(2))
    v = torch.randn(b, h, seqlen, dv, device=device, dtype=dtype, generator=gen)
    kw = dict(is_causal=causal, backend="triton", softcap=30.0 if modified else 0.0)
    from .launch import head_split

    widths = (sum(head_split(d)), sum(head_split(dv)), q.element_size())  # what select_config sees for them
    with autotune.forced(kernel, cfg, widths):
        if kernel == "attn_fwd":
            def fn():
                with torch.no_grad():
                    return flashtx.attention(q, k, v, **kw)
        else:
            qkv = tuple(t.requires_grad_() for t in (q, k, v))
            with torch.enable_grad():
                out = flashtx.attention(*qkv, **kw)
            dout = torch.empty_like(out).normal_(generator=gen)  # (out's layout, as a loss's gradient has it)

            def fn():
                return torch.autograd.grad(out, qkv, dout, retain_graph=True)
        return float(autotune.bench(fn, warmup_ms, rep_ms))  # (autotune's: tests stand it in there)
