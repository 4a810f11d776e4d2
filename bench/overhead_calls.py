"""The calls bench/overhead.py times: per row, a builder (dev, dtype) -> (flashtx's call, the baseline's call), each
a no-argument function that makes one call (forward, or forward and backward); the no-op autograd floors; the stub
that replaces the launches. Small shapes: the Python around the kernels is what is timed, not the kernels."""
from __future__ import annotations

import torch
import torch.nn.functional as F

import flashtx

def _rand(*shape, dev, dtype, grad=False):
    return torch.randn(*shape, device=dev, dtype=dtype).requires_grad_(grad)


def _fwd(ours, base):
    def build(dev, dtype):
        q, k, v = (_rand(1, 2, 16, 64, dev=dev, dtype=dtype) for _ in range(3))
        return (lambda: ours(q, k, v)), (lambda: base(q, k, v))
    return build


def _attention_fwd(q, k, v):
    with torch.no_grad():
        return flashtx.attention(q, k, v, is_causal=True)


def _sdpa_fwd(q, k, v):
    with torch.no_grad():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _attention_grad_fwd(dev, dtype):
    q, k, v = (_rand(1, 2, 16, 64, dev=dev, dtype=dtype, grad=True) for _ in range(3))
    return (lambda: flashtx.attention(q, k, v, is_causal=True)), \
        (lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))


def _attention_bwd(dev, dtype):
    """torch.autograd.grad over a forward built once (retain_graph): the backward alone."""
    def one(fn):
        qkv = tuple(_rand(1, 2, 16, 64, dev=dev, dtype=dtype, grad=True) for _ in range(3))
        out = fn(*qkv, is_causal=True)
        dout = torch.randn_like(out)
        return lambda: torch.autograd.grad(out, qkv, dout, retain_graph=True)
    return one(flashtx.attention), one(F.scaled_dot_product_attention)


def _attention_fwd_bwd(dev, dtype):
    def one(fn):
        qkv = tuple(_rand(1, 2, 16, 64, dev=dev, dtype=dtype, grad=True) for _ in range(3))
        dout = torch.randn(1, 2, 16, 64, device=dev, dtype=dtype)
        return lambda: torch.autograd.grad(fn(*qkv, is_causal=True), qkv, dout)
    return one(flashtx.attention), one(F.scaled_dot_product_attention)


def _flash_attn_func(dev, dtype):
    q, k, v = (_rand(1, 16, 2, 64, dev=dev, dtype=dtype) for _ in range(3))  # (B, S, H, D)
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))  # the same tensors as SDPA's (B, H, S, D)

    def ours():
        with torch.no_grad():
            return flashtx.flash_attn_func(q, k, v, causal=True)
    return ours, (lambda: _sdpa_fwd(qt, kt, vt))


def _patched_sdpa(dev, dtype):
    """F.scaled_dot_product_attention inside flashtx.patch_sdpa() (entered once around the timing, as a
    model enters it once around its step) against torch's own SDPA (the function the patch replaced)."""
    from flashtx import sdpa_patch
    q, k, v = (_rand(1, 2, 16, 64, dev=dev, dtype=dtype) for _ in range(3))

    def ours():
        with torch.no_grad():
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)  # looked up at call time

    def base():
        with torch.no_grad():
            return sdpa_patch._ORIGINAL(q, k, v, is_causal=True)
    ours.context = flashtx.patch_sdpa
    return ours, base


def _rope_eager(q, k, cos, sin):
    def rot(x):
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)
    return q * cos + rot(q) * sin, k * cos + rot(k) * sin


def _rope_inputs(dev, dtype, grad):
    q, k = _rand(1, 4, 16, 64, dev=dev, dtype=dtype, grad=grad), _rand(1, 2, 16, 64, dev=dev, dtype=dtype, grad=grad)
    cos, sin = flashtx.nn.RotaryEmbedding(64).cos_sin(16, device=dev)  # (S, D/2) fp32
    fcos, fsin = torch.cat((cos, cos), -1).to(dtype), torch.cat((sin, sin), -1).to(dtype)
    return q, k, cos, sin, fcos, fsin


def _rope_fwd(dev, dtype):
    q, k, cos, sin, fcos, fsin = _rope_inputs(dev, dtype, False)

    def ours():
        with torch.no_grad():
            return flashtx.apply_rotary_qk(q, k, cos, sin, layout="bhsd")

    def base():
        with torch.no_grad():
            return _rope_eager(q, k, fcos, fsin)
    return ours, base


def _rope_bwd(dev, dtype):
    q, k, cos, sin, fcos, fsin = _rope_inputs(dev, dtype, True)

    def one(outs):
        douts = tuple(torch.randn_like(o) for o in outs)
        return lambda: torch.autograd.grad(outs, (q, k), douts, retain_graph=True)
    return one(flashtx.apply_rotary_qk(q, k, cos, sin, layout="bhsd")), one(_rope_eager(q, k, fcos, fsin))


def _swiglu_fwd(dev, dtype):
    g, u = _rand(16, 256, dev=dev, dtype=dtype), _rand(16, 256, dev=dev, dtype=dtype)

    def ours():
        with torch.no_grad():
            return flashtx.swiglu(g, u)

    def base():
        with torch.no_grad():
            return F.silu(g) * u
    return ours, base


def _swiglu_bwd(dev, dtype):
    g, u = _rand(16, 256, dev=dev, dtype=dtype, grad=True), _rand(16, 256, dev=dev, dtype=dtype, grad=True)

    def one(out):
        dout = torch.randn_like(out)
        return lambda: torch.autograd.grad(out, (g, u), dout, retain_graph=True)
    return one(flashtx.swiglu(g, u)), one(F.silu(g) * u)


def _decode(dev, dtype):
    """One generation step of flash_attn_with_kvcache (append the new k/v at cache_seqlens, attend; B=2,
    Hq/Hkv = 8/2, D=64, a 256-slot cache) against SDPA over the cache's first 100 keys (enable_gqa)."""
    q, k, v = _rand(2, 1, 8, 64, dev=dev, dtype=dtype), _rand(2, 1, 2, 64, dev=dev, dtype=dtype), \
        _rand(2, 1, 2, 64, dev=dev, dtype=dtype)
    kc, vc = _rand(2, 256, 2, 64, dev=dev, dtype=dtype), _rand(2, 256, 2, 64, dev=dev, dtype=dtype)
    lens = torch.full((2,), 99, dtype=torch.int32, device=dev)
    qh, kh, vh = q.transpose(1, 2), kc[:, :100].transpose(1, 2), vc[:, :100].transpose(1, 2)  # (B, H, S, D)

    def ours():
        with torch.no_grad():
            return flashtx.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=lens, causal=True)

    def base():
        with torch.no_grad():
            return F.scaled_dot_product_attention(qh, kh, vh, enable_gqa=True)
    return ours, base


def _decode_device_check(dev, dtype):
    """_decode with the index check a GPU runs (the check kernel's launch and torch._assert_async of its flag), on
    CPU too: flashtx.decode._values_readable answers False for the call (a CPU tensor's values are otherwise read
    on the host). On a GPU, the same row as _decode."""
    import flashtx.decode as fd

    ours, base = _decode(dev, dtype)
    if torch.device(dev).type != "cpu":
        return ours, base
    readable = fd._values_readable

    def device_check():
        fd._values_readable = _never
        try:
            return ours()
        finally:
            fd._values_readable = readable
    return device_check, base


def _window_softcap(dev, dtype):
    """flash_attn_func with a sliding window and a softcap (Gemma 2's layers; a window alone is Mistral's),
    forward and backward, against SDPA's causal forward and backward on the same tensors: host cost only, SDPA
    has neither option."""
    def one(fn, sdpa):
        qkv = tuple(_rand(1, 16, 2, 64, dev=dev, dtype=dtype, grad=True) for _ in range(3))  # (B, S, H, D)
        dout = torch.randn(1, 16, 2, 64, device=dev, dtype=dtype)
        dout = dout.transpose(1, 2) if sdpa else dout  # the (B, H, S, D) view SDPA's output is
        return lambda: torch.autograd.grad(fn(*qkv), qkv, dout)
    return (one(lambda q, k, v: flashtx.flash_attn_func(q, k, v, causal=True, window_size=(8, 0), softcap=30.0),
                False),
            one(lambda q, k, v: F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                               v.transpose(1, 2), is_causal=True), True))


def _key_mask(dev, dtype):
    """flashtx.attention with a (B, Sk) key mask and is_causal (a padded batch, as transformers' integration passes
    it), forward and backward, against SDPA's with the same padding as a bool (B, 1, 1, Sk) attn_mask: one key of
    16 is padding."""
    keep = torch.ones(1, 16, dtype=torch.bool, device=dev)
    keep[0, 0] = False  # left padding

    def one(fn, mask):
        qkv = tuple(_rand(1, 2, 16, 64, dev=dev, dtype=dtype, grad=True) for _ in range(3))  # (B, H, S, D)
        dout = torch.randn(1, 2, 16, 64, device=dev, dtype=dtype)
        return lambda: torch.autograd.grad(fn(*qkv, mask), qkv, dout)
    return (one(lambda q, k, v, m: flashtx.attention(q, k, v, is_causal=True, key_mask=m), keep),
            one(lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m), keep[:, None, None]
                & torch.ones(16, 16, dtype=torch.bool, device=dev).tril()))


def _learned_bias(dev, dtype):
    """flashtx.attention with a learned (1, H, S, S) attn_mask that requires grad (Swin's relative-position bias,
    shared by the windows: its gradient sums over the batch), forward and backward with the bias's gradient,
    against SDPA's with the same bias (its EFFICIENT backend on a GPU computes the bias gradient); B=4, H=2, S=16."""
    def one(fn):
        qkv = tuple(_rand(4, 2, 16, 64, dev=dev, dtype=dtype, grad=True) for _ in range(3))  # (B, H, S, D)
        bias = _rand(1, 2, 16, 16, dev=dev, dtype=dtype, grad=True)
        dout = torch.randn(4, 2, 16, 64, device=dev, dtype=dtype)
        return lambda: torch.autograd.grad(fn(*qkv, attn_mask=bias), (*qkv, bias), dout)
    return one(flashtx.attention), one(F.scaled_dot_product_attention)


def _hf_decode(dev, dtype):
    """One decoding step as transformers' attn_implementation="ftx" passes it to flashtx.attention (flashtx's
    decoding lane: _small_q_lane): a (B, Sk) key mask with the bottom-right window (-1, Sk - 1); B=2, Hq/Hkv = 8/2,
    D=64, Sk = 100, one padded key; q a (B, Hq, 1, D) view of the projection, k and v the DynamicCache's contiguous
    (B, Hkv, Sk, D) tensors. Against SDPA with the same padding as the (B, 1, 1, Sk) bool mask transformers gives
    it."""
    q = _rand(2, 1, 8, 64, dev=dev, dtype=dtype).transpose(1, 2)
    k, v = (_rand(2, 2, 100, 64, dev=dev, dtype=dtype) for _ in range(2))
    keep = torch.ones(2, 100, dtype=torch.bool, device=dev)
    keep[0, 0] = False  # left padding

    def ours():
        with torch.no_grad():
            return flashtx.attention(q, k, v, key_mask=keep, window_size=(-1, 99), enable_gqa=True)

    def base():
        with torch.no_grad():
            return F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None, None], enable_gqa=True)
    return ours, base


def _varlen_device_check(dev, dtype):
    """flash_attn_varlen_func over two packed sequences (5 + 11 rows, H=2, D=64, causal), forward and backward,
    with the cu_seqlens check a GPU runs (one check kernel for both tensors and an assert of each flag), on CPU
    too (flashtx._validate._values_readable answers False for the call); against SDPA's causal forward and
    backward over the packed rows as one sequence."""
    import flashtx._validate as validate

    cu = torch.tensor([0, 5, 16], dtype=torch.int32, device=dev)
    qkv = tuple(_rand(16, 2, 64, dev=dev, dtype=dtype, grad=True) for _ in range(3))  # (total, H, D)
    dout = torch.randn(16, 2, 64, device=dev, dtype=dtype)
    ref = tuple(_rand(1, 2, 16, 64, dev=dev, dtype=dtype, grad=True) for _ in range(3))
    dref = torch.randn(1, 2, 16, 64, device=dev, dtype=dtype)

    def ours():
        readable = validate._values_readable
        validate._values_readable = _never
        try:
            out = flashtx.flash_attn_varlen_func(*qkv, cu, cu, 11, 11, causal=True)
        finally:
            validate._values_readable = readable
        return torch.autograd.grad(out, qkv, dout)

    def base():
        return torch.autograd.grad(F.scaled_dot_product_attention(*ref, is_causal=True), ref, dref)
    return ours, base


def _never(t) -> bool:
    return False


class _Noop(torch.autograd.Function):
    """n inputs -> one output like the first; the backward returns n empty gradients: no work at all."""

    @staticmethod
    def forward(ctx, *xs):
        ctx.n = len(xs)
        return torch.empty_like(xs[0])

    @staticmethod
    def backward(ctx, g):
        return tuple(torch.empty_like(g) for _ in range(ctx.n))


class _Noop2(torch.autograd.Function):
    """(a, b) -> two outputs like them (RoPE's q and k); the backward returns two empty gradients."""

    @staticmethod
    def forward(ctx, a, b):
        return torch.empty_like(a), torch.empty_like(b)

    @staticmethod
    def backward(ctx, ga, gb):
        return torch.empty_like(ga), torch.empty_like(gb)


def _floor_fwd(dev, dtype):
    qkv = tuple(_rand(1, 2, 16, 64, dev=dev, dtype=dtype, grad=True) for _ in range(3))
    return lambda: _Noop.apply(*qkv)


def _floor_bwd(*shapes, fwd_too=False, two_outputs=False):
    """torch.autograd.grad through a no-op Function of inputs `shapes` (retain_graph, as the rows), or through
    a fresh forward each call (fwd_too); two_outputs: RoPE's (q, k) -> (q', k')."""
    def build(dev, dtype):
        ins = tuple(_rand(*s, dev=dev, dtype=dtype, grad=True) for s in shapes)
        if fwd_too:
            dout = torch.randn(*shapes[0], device=dev, dtype=dtype)
            return lambda: torch.autograd.grad(_Noop.apply(*ins), ins, dout)
        outs = _Noop2.apply(*ins) if two_outputs else (_Noop.apply(*ins),)
        douts = tuple(torch.randn_like(o) for o in outs)
        return lambda: torch.autograd.grad(outs, ins, douts, retain_graph=True)
    return build


def _stub(kernel, grid, args) -> None:
    """The no-op launch of the timed rounds; the decode index check's flag is written as the kernel would
    for in-range inputs (a device tensor that torch._assert_async reads)."""
    flag = args.get("FLAG")
    if flag is not None:
        flag.fill_(1)
