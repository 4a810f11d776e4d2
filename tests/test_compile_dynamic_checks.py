"""Calls traced with dynamic shapes (torch.compile(dynamic=True), or a recompile that made a size dynamic): each case
compiles with fullgraph and equals eager. A fuzz of 2026-12-07 found these refused or failing to compile: the
reference backend's varlen masks, which read cu_seqlens on the host (unbacked sizes fullgraph refused; the default
backend of CPU tensors without the interpreter); shape checks written as `size in (1, other)` (Dynamo answers a
tuple's `in` by identity for symbolic sizes, so equal sizes were refused: a learned (H, S, S) bias, an ALiBi buffer,
(B, S) position_ids, per-batch cos/sin), and the overlap checks of the in-place paths, which sorted symbolic strides
("sort with non-constant keys": KV caches passed as views, RoPE in place on a fused projection's slices, SwiGLU's
in-place backward on a projection's halves). The checks are on the host, traced the same way on a GPU."""
import pytest
import torch

import flashtx

DT = torch.float64


class _Buffers(torch.nn.Module):
    """A module holding the call's tables as buffers (parameters): under torch.compile(dynamic=True) their sizes are
    symbolic too, where closed-over tensors would be constants."""

    def __init__(self, fn, **tensors):
        super().__init__()
        self.fn = fn
        for name, t in tensors.items():
            if isinstance(t, torch.nn.Parameter):
                self.register_parameter(name, t)
            else:
                self.register_buffer(name, t)

    def forward(self, *args):
        return self.fn(self, *args)


def _bias_param():
    return _Buffers(lambda m, q, k, v: flashtx.attention(q, k, v, attn_mask=m.bias),
                    bias=torch.nn.Parameter(torch.randn(2, 7, 7, dtype=DT))), \
        [torch.randn(3, 2, 7, 16, dtype=DT) for _ in range(3)]


def _alibi_buffer():
    return _Buffers(lambda m, q, k, v: flashtx.flash_attn_func(q, k, v, causal=True, alibi_slopes=m.slopes),
                    slopes=torch.tensor([2.0 ** (-i) for i in range(1, 5)])), \
        [torch.randn(2, 7, 4, 16, dtype=DT) for _ in range(3)]


def _position_ids():
    return _Buffers(lambda m, q: flashtx.apply_rotary(q, m.cos, m.sin, position_ids=m.pos, layout="bhsd"),
                    cos=torch.randn(5, 8, dtype=DT), sin=torch.randn(5, 8, dtype=DT),
                    pos=torch.arange(5).repeat(2, 1)), [torch.randn(2, 2, 5, 16, dtype=DT)]


def _batch_tables():  # transformers' (B, S, D) tables
    return _Buffers(lambda m, q, k: flashtx.apply_rotary_pos_emb(q, k, m.cos, m.sin)[0],
                    cos=torch.randn(2, 5, 16, dtype=DT), sin=torch.randn(2, 5, 16, dtype=DT)), \
        [torch.randn(2, 2, 5, 16, dtype=DT) for _ in range(2)]


def _kvcache_views():
    def f(q, kbuf, vbuf, kn, vn, lens):  # (B, H, S, D) buffers passed as (B, S, H, D) views
        return flashtx.flash_attn_with_kvcache(q, kbuf.transpose(1, 2), vbuf.transpose(1, 2), k=kn, v=vn,
                                               cache_seqlens=lens, causal=True)
    B, S, H, D = 2, 20, 2, 16
    return f, [torch.randn(B, 1, H, D, dtype=DT), torch.randn(B, H, S, D, dtype=DT), torch.randn(B, H, S, D, dtype=DT),
               torch.randn(B, 1, H, D, dtype=DT), torch.randn(B, 1, H, D, dtype=DT),
               torch.full((B,), 3, dtype=torch.int32)]


def _rope_in_place():
    cos, sin = torch.randn(40, 8, dtype=DT), torch.randn(40, 8, dtype=DT)

    def f(qkv):
        q, k = qkv[:, :, 0], qkv[:, :, 1]  # slices of one projection: views with the same strides
        flashtx.apply_rotary_qk(q, k, cos, sin, inplace=True)
        return qkv
    return f, [torch.randn(2, 7, 3, 2, 16, dtype=DT)]


def _swiglu_halves():
    w = torch.randn(4, 16, dtype=DT, requires_grad=True)

    def f(x):
        h = x @ w
        return flashtx.swiglu(h[..., :8], h[..., 8:], inplace_backward=True)
    return f, [torch.randn(2, 5, 4, dtype=DT, requires_grad=True)]


def _varlen_reference():
    def f(q, k, v, cu, slopes):  # (the reference backend's varlen masks read the offsets as tensors, not on the host)
        return flashtx.flash_attn_varlen_func(q, k, v, cu, cu, 5, 5, causal=True, alibi_slopes=slopes,
                                              backend="reference")
    return f, [torch.randn(9, 2, 16, dtype=DT, requires_grad=True) for _ in range(3)] + [
        torch.tensor([0, 4, 9], dtype=torch.int32), torch.rand(2, dtype=torch.float32)]


CASES = {"varlen-reference": _varlen_reference, "learned-bias": _bias_param, "alibi-buffer": _alibi_buffer,
         "position-ids": _position_ids, "batch-tables": _batch_tables, "kvcache-views": _kvcache_views,
         "rope-in-place": _rope_in_place, "swiglu-halves": _swiglu_halves}


@pytest.mark.parametrize("case", list(CASES))
def test_checks_trace_with_dynamic_shapes(case):
    torch.manual_seed(0)
    f, args = CASES[case]()
    want_args = [a.detach().clone().requires_grad_(a.requires_grad) for a in args]
    torch._dynamo.reset()
    with torch.set_grad_enabled(case == "swiglu-halves"):
        got = torch.compile(f, backend="aot_eager", fullgraph=True, dynamic=True)(*args)
        want = f(*want_args)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    if case == "swiglu-halves":  # (the backward runs the in-place kernel on the traced path too)
        g = torch.randn_like(want)
        torch.testing.assert_close(torch.autograd.grad(got, args, g), torch.autograd.grad(want, want_args, g),
                                   atol=0, rtol=0)
    for a, b in zip(args, want_args):  # (the in-place cases: the caches and the projection written alike)
        torch.testing.assert_close(a, b, atol=0, rtol=0)
