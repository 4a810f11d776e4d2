"""torch.compile through RoPE and SwiGLU with the Triton backend (in Triton's interpreter on CPU):
no graph breaks (torch._dynamo.explain), the registered ops stay whole nodes, and
torch.compile(fullgraph=True, backend="aot_eager") matches eager, forward and backward."""
import pytest
import torch
import torch._dynamo
from conftest import DEVICE, randn

import flashtx

BACKEND = "triton"


def _rope_qk(q, k, cos, sin):
    qo, ko = flashtx.apply_rotary_qk(q, k, cos, sin, seqlen_offsets=1, backend=BACKEND)
    return qo * 2 + 1, ko


def _rope_interleaved_bhsd(q, k, cos, sin):
    qb, kb = q.transpose(1, 2), k.transpose(1, 2)  # (B, H, S, D)
    return flashtx.apply_rotary_qk(qb, kb, cos, sin, interleaved=True, layout="bhsd", backend=BACKEND)


def _swiglu(g, u):
    return flashtx.swiglu(g, u, backend=BACKEND) * 3


def _swiglu_packed(x):
    return flashtx.swiglu_packed(x, backend=BACKEND)


def _swiglu_inplace_bwd(g, u):
    return flashtx.swiglu(g * 1, u * 1, inplace_backward=True, backend=BACKEND)


def rope_inputs():
    q, k = randn(2, 6, 4, 8, requires_grad=True), randn(2, 6, 2, 8, requires_grad=True)
    ang = torch.rand(8, 3, dtype=torch.float64, device=DEVICE) * 6
    return q, k, ang.cos().float(), ang.sin().float()


CASES = {
    "rope_qk": (_rope_qk, rope_inputs),
    "rope_interleaved_bhsd": (_rope_interleaved_bhsd, rope_inputs),
    "swiglu": (_swiglu, lambda: (randn(3, 5, 24, requires_grad=True), randn(3, 5, 24, requires_grad=True))),
    "swiglu_packed": (_swiglu_packed, lambda: (randn(3, 5, 48, requires_grad=True),)),
    "swiglu_inplace_backward": (_swiglu_inplace_bwd,
                                lambda: (randn(4, 24, requires_grad=True), randn(4, 24, requires_grad=True))),
}


def _outs(o):
    return o if isinstance(o, tuple) else (o,)


def _run(fn, inputs):
    outs = _outs(fn(*inputs))
    leaves = [t for t in inputs if t.requires_grad]
    grads = torch.autograd.grad(outs, leaves, [torch.ones_like(o) * 0.5 for o in outs])
    return [o.detach() for o in outs], grads


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_no_graph_breaks_and_compiled_matches_eager(case):
    fn, make = case
    torch._dynamo.reset()
    inputs = make()
    ex = torch._dynamo.explain(fn)(*inputs)
    assert ex.graph_break_count == 0, ex.break_reasons
    assert ex.graph_count == 1
    ops = {str(n.target) for g in ex.graphs for n in g.graph.nodes if n.op == "call_function"}
    assert any(o.startswith("flashtx.") for o in ops), ops
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    out_c, grads_c = _run(compiled, inputs)
    out_e, grads_e = _run(fn, inputs)
    for a, b in zip(out_c + list(grads_c), out_e + list(grads_e)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_nn_modules_compile_without_graph_breaks():
    """flashtx.nn.RotaryEmbedding (q and k) and flashtx.nn.SwiGLU, training (out-of-place RoPE) and
    inference (torch.no_grad): fullgraph, and the same numbers as eager."""
    torch.manual_seed(0)
    rope = flashtx.nn.RotaryEmbedding(8, device=DEVICE)
    mlp = flashtx.nn.SwiGLU(16, 24).to(DEVICE)

    def block(x, q, k):
        qo, ko = rope(q, k, backend=BACKEND)
        return mlp(x), qo, ko

    x = randn(2, 6, 16, requires_grad=True)
    q, k = randn(2, 6, 4, 8, requires_grad=True), randn(2, 6, 2, 8, requires_grad=True)
    rope.cos_sin(6)  # tables built before tracing (a cache miss would be traced too, but once)
    torch._dynamo.reset()
    ex = torch._dynamo.explain(block)(x, q, k)
    assert ex.graph_break_count == 0, ex.break_reasons
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    out_c, grads_c = _run(compiled, (x, q, k))
    out_e, grads_e = _run(block, (x, q, k))
    for a, b in zip(out_c + list(grads_c), out_e + list(grads_e)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    with torch.no_grad():
        xi, qi, ki = x.detach(), q.detach().clone(), k.detach().clone()
        got = compiled(xi, qi, ki)
        want = block(xi, q.detach().clone(), k.detach().clone())
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
