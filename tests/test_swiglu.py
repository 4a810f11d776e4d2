"""Fused SwiGLU: kernels (in Triton's interpreter on CPU) against eager silu(gate) * up, and the
LLaMA MLP layer against an eager LLaMA MLP with the same weights."""
import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICE, KERNEL_DTYPES, ON_GPU, assert_close_to_reference, dtype_id, poisoned_allocations, randn

import flashtx
from flashtx import BackendNotSupported
from flashtx._swiglu_op import (swiglu_bwd_inplace_op, swiglu_bwd_op, swiglu_op, swiglu_packed_bwd_inplace_op,
                            swiglu_packed_bwd_op, swiglu_packed_op)


def eager_swiglu(g, u):
    return F.silu(g) * u


SHAPES = {"rows0": (0, 8), "cols0": (4, 0), "one": (1, 1), "row1_h37": (1, 37), "3d_5x3x40": (5, 3, 40),
          "odd_17x33": (17, 33)}


def make_inputs(shape, dtype, layout):
    """(gate, up) leaves in the requested layout and the tensors to pass (maybe strided views)."""
    if layout == "contiguous":
        g, u = randn(*shape, dtype=dtype, requires_grad=True), randn(*shape, dtype=dtype, requires_grad=True)
        return (g, u), (g, u)
    if layout == "transposed":  # last dim not unit-stride
        g = randn(*reversed(shape), dtype=dtype).transpose(0, -1).requires_grad_(True)
        u = randn(*reversed(shape), dtype=dtype).transpose(0, -1).requires_grad_(True)
        return (g, u), (g, u)
    # "sliced": every other column of a wider leaf
    wg, wu = (randn(*shape[:-1], 2 * shape[-1], dtype=dtype, requires_grad=True) for _ in range(2))
    return (wg, wu), (wg[..., ::2], wu[..., ::2])


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "sliced"])
@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=dtype_id)
def test_swiglu_matches_eager(dtype, layout, shape):
    leaves, (g, u) = make_inputs(shape, dtype, layout)
    with poisoned_allocations():
        out = flashtx.swiglu(g, u)
    g64, u64 = (t.detach().double().requires_grad_(True) for t in (g, u))
    ge, ue = (t.detach().clone().requires_grad_(True) for t in (g, u))
    ref, eager = eager_swiglu(g64, u64), eager_swiglu(ge, ue)
    assert_close_to_reference("out", out, ref, eager)
    dout = randn(*out.shape, dtype=dtype)
    with poisoned_allocations():
        dg, du = torch.autograd.grad(out, (g, u), dout)
    ref.backward(dout.double())
    eager.backward(dout)
    # dgate = dout * up * s * (1 + gate * (1 - s)) cancels to ~0 near gate = -1.28: its ulps are those of dout * up
    assert_close_to_reference("dgate", dg, g64.grad, ge.grad, grad=True, scale=_cancelling(dout, u64))
    assert_close_to_reference("dup", du, u64.grad, ue.grad, grad=True)


PACKED_SHAPES = {"rows0": (0, 8), "cols0": (4, 0), "one": (1, 2), "3d_4x3x26": (4, 3, 26), "odd_h_9x66": (9, 66)}


@pytest.mark.parametrize("shape", PACKED_SHAPES.values(), ids=PACKED_SHAPES.keys())
@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "row_strided"])
@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=dtype_id)
def test_swiglu_packed_matches_eager(dtype, strided, shape):
    if strided:  # every other row of a taller leaf
        leaf = randn(*shape[:-2], 2 * shape[-2], shape[-1], dtype=dtype, requires_grad=True)
        x = leaf[..., ::2, :]
    else:
        leaf = x = randn(*shape, dtype=dtype, requires_grad=True)
    h = shape[-1] // 2
    with poisoned_allocations():
        out = flashtx.swiglu_packed(x)
    x64 = x.detach().double().requires_grad_(True)
    xe = x.detach().clone().requires_grad_(True)
    ref, eager = eager_swiglu(x64[..., :h], x64[..., h:]), eager_swiglu(xe[..., :h], xe[..., h:])
    assert_close_to_reference("out", out, ref, eager)
    dout = randn(*out.shape, dtype=dtype)
    with poisoned_allocations():
        dx, = torch.autograd.grad(out, x, dout)
    ref.backward(dout.double())
    eager.backward(dout)
    assert_close_to_reference("dx", dx, x64.grad, xe.grad, grad=True, scale=_cancelling(dout, x64[..., h:]))


def _cancelling(dout, up64) -> float:
    """The magnitude of the terms that cancel in dgate (see test_swiglu_matches_eager), for the ulp floor: with a
    single element (a (1, 1) gate), an exact dgate near 0 would otherwise floor at ulps of ~0 (a flaky bound)."""
    return float((dout.double() * up64.detach()).abs().max()) if dout.numel() else 0.0


def test_gradcheck_float64():
    g = randn(3, 2, 19, dtype=torch.float64, requires_grad=True, scale=3.0)
    u = randn(3, 2, 19, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(flashtx.swiglu, (g, u), fast_mode=True)
    x = randn(5, 22, dtype=torch.float64, requires_grad=True, scale=3.0)
    assert torch.autograd.gradcheck(flashtx.swiglu_packed, (x,), fast_mode=True)


@pytest.mark.parametrize("lane", [True, False], ids=["lane", "op"])
@pytest.mark.parametrize("form", ["packed", "split"])
def test_inplace_backward_twice_fails_loudly(form, lane, monkeypatch):
    """In-place gradients consume the saved inputs: a second backward must raise, not be wrong, naming the op and
    the way out (torch's own error named neither). inplace_backward=False backpropagates twice."""
    from flashtx import _swiglu_lane

    monkeypatch.setattr(_swiglu_lane, "LANE", lane)
    for inplace in (True, False):
        g = randn(3, 16, requires_grad=True)
        x = g * 1
        if form == "packed":
            out = flashtx.swiglu_packed(x, inplace_backward=inplace)
        else:
            out = flashtx.swiglu(x[:, :8], x[:, 8:], inplace_backward=inplace)
        out.sum().backward(retain_graph=True)
        first = g.grad.clone()
        if inplace:
            with pytest.raises(RuntimeError, match="swiglu: a second backward .* pass inplace_backward=False"):
                out.sum().backward()
        else:
            out.sum().backward()
            torch.testing.assert_close(g.grad, 2 * first)


@pytest.mark.parametrize("layout", ["contiguous", "transposed_3d"])
@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=dtype_id)
def test_inplace_backward_same_numbers_and_reuses_buffers(dtype, layout):
    shape = (4, 3, 10)
    g0, u0 = randn(*shape, dtype=dtype, requires_grad=True), randn(*shape, dtype=dtype, requires_grad=True)
    dout = randn(*shape, dtype=dtype)
    if layout == "contiguous":
        def prep(t):
            return t * 1
    else:  # a permuted copy: no flat (M, H) view exists, exercising the copy-back path
        def prep(t):
            return (t * 1).permute(1, 0, 2).contiguous().permute(1, 0, 2)
    ref = torch.autograd.grad(flashtx.swiglu(prep(g0), prep(u0)), (g0, u0), dout)
    g, u = prep(g0), prep(u0)
    g.retain_grad(), u.retain_grad()
    out = flashtx.swiglu(g, u, inplace_backward=True)
    out.backward(dout)
    assert torch.equal(g0.grad, ref[0]) and torch.equal(u0.grad, ref[1])
    # documented: after backward the saved inputs hold their gradients
    assert torch.equal(g.detach(), ref[0]) and torch.equal(u.detach(), ref[1])

    x0 = randn(2, 5, 12, dtype=dtype, requires_grad=True)
    d = randn(2, 5, 6, dtype=dtype)
    ref_x, = torch.autograd.grad(flashtx.swiglu_packed(x0 * 1), x0, d)
    x = x0 * 1
    flashtx.swiglu_packed(x, inplace_backward=True).backward(d)
    assert torch.equal(x0.grad, ref_x) and torch.equal(x.detach(), ref_x)


@pytest.mark.parametrize("lane", [True, False], ids=["lane", "op"])
@pytest.mark.parametrize("packed", [False, True], ids=["swiglu", "packed"])
def test_inplace_gradients_are_detached(packed, lane, monkeypatch):
    """The in-place backward's gradients are the saved inputs' memory, but not the saved tensors themselves: those
    carry the forward's graph, so autograd.grad (or a hook) handed the caller a gradient that backpropagated into
    the projection's weight (W.grad off by ~20 in the review's repro). Eager's gradient is a constant."""
    from flashtx import _swiglu_lane

    monkeypatch.setattr(_swiglu_lane, "LANE", lane)
    x, w0 = randn(3, 4, dtype=torch.float64), randn(8, 4, dtype=torch.float64)
    grads = {}
    for inplace in (False, True):
        w = w0.clone().requires_grad_(True)
        h = x @ w.T  # (3, 8): a projection's fresh output
        inputs = [h] if packed else [h[:, :4], h[:, 4:]]  # (the gradients of the op's own inputs)
        out = flashtx.swiglu_packed(*inputs, inplace_backward=inplace) if packed else \
            flashtx.swiglu(*inputs, inplace_backward=inplace)
        got = torch.autograd.grad(out.sum(), inputs, retain_graph=not inplace)
        assert all(not d.requires_grad and d.grad_fn is None for d in got)
        ((w ** 2).sum() + sum(d.pow(2).sum() for d in got)).backward()  # the gradients are constants: W.grad is 2W
        torch.testing.assert_close(w.grad, 2 * w0, rtol=0, atol=0)
        grads[inplace] = [d.clone() for d in got]
    torch.testing.assert_close(grads[True], grads[False], rtol=0, atol=0)


def test_inplace_backward_rejects_overlapping_inputs():
    x = randn(3, 8)
    rows = randn(12).as_strided((3, 4), (1, 1))  # rows overlap with no 0 stride: gate[0, 1] is gate[1, 0]
    for gate, up in ((x, x), (x[:, :5], x[:, 3:]), (randn(3, 1).expand(3, 8), randn(3, 8)), (rows, randn(3, 4))):
        with pytest.raises(ValueError, match="inplace_backward=True needs gate and up with no shared elements"):
            flashtx.swiglu(gate, up, inplace_backward=True)
    y = randn(6, 4)
    flashtx.swiglu(y[:3], y[3:], inplace_backward=True)  # disjoint spans are fine


@pytest.mark.parametrize("packed", [False, True], ids=["swiglu", "packed"])
def test_inplace_backward_refuses_a_leaf_that_requires_grad(packed):
    """A leaf that requires grad (a parameter, an input), or a view of one, would have its values overwritten by its
    gradient: refused on a signature's first call and on a repeated one (the lane, warmed by a non-leaf of the
    same layout). Without autograd, or on a non-leaf, it runs."""
    def call(x):
        return flashtx.swiglu_packed(x, inplace_backward=True) if packed else \
            flashtx.swiglu(x[:, :4], x[:, 4:], inplace_backward=True)

    leaf = randn(3, 8, requires_grad=True)
    before = leaf.detach().clone()
    for x in (leaf, leaf[1:]):
        with pytest.raises(ValueError, match="would overwrite .*a leaf tensor that requires grad"):
            call(x)
        call(x.detach() * 1 + 0 * x)  # a non-leaf of x's layout: the lane for it
        with pytest.raises(ValueError, match="would overwrite .*a leaf tensor that requires grad"):
            call(x)
    assert torch.equal(leaf.detach(), before) and leaf.grad is None
    with torch.no_grad():
        call(leaf)
    out = call(leaf * 1)
    out.sum().backward()
    assert leaf.grad is not None


@pytest.mark.parametrize("value", ["no", 1, None])
def test_inplace_backward_must_be_a_bool(value):
    x = randn(3, 8)
    with pytest.raises(TypeError, match="inplace_backward must be a bool"):
        flashtx.swiglu(x[:, :4], x[:, 4:], inplace_backward=value)
    with pytest.raises(TypeError, match="inplace_backward must be a bool"):
        flashtx.swiglu_packed(x, inplace_backward=value)


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_packed_inplace_backward_refuses_expanded_x(backend):
    """Issue 17 item 2: an expanded (stride-0) x gave a silently wrong gradient on the Triton path
    (error ~3) and failed late, inside backward, on the reference path; refused up front now, as
    swiglu() refuses the same input, and without inplace_backward the gradient is right."""
    leaf = randn(1, 8, requires_grad=True)
    x = (leaf * 1).expand(3, 8)  # (3, 8) with row stride 0
    with pytest.raises(ValueError, match=r"inplace_backward=True writes x's gradient over x.*stride-0.*"
                                         r"shape \(3, 8\) and strides \(0, 1\)"):
        flashtx.swiglu_packed(x, inplace_backward=True, backend=backend)
    d = randn(3, 4)
    (got,) = torch.autograd.grad(flashtx.swiglu_packed(x, backend=backend), leaf, d)
    l64 = leaf.detach().double().requires_grad_(True)
    x64 = l64.expand(3, 8)
    (ref,) = torch.autograd.grad(eager_swiglu(x64[:, :4], x64[:, 4:]), l64, d.double())
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)


def test_inplace_backward_on_the_interleaved_halves_of_one_tensor():
    """x[:, :4] and x[:, 4:] share no element (their spans interleave): in-place backward is safe and
    gives the out-of-place gradient."""
    torch.manual_seed(3)
    x0 = randn(5, 8, requires_grad=True)
    do = randn(5, 4)
    (ref,) = torch.autograd.grad(flashtx.swiglu(x0[:, :4], x0[:, 4:]), x0, do)
    x = x0.detach().clone().requires_grad_()
    h = x * 1  # a non-leaf whose halves the backward may overwrite
    (got,) = torch.autograd.grad(flashtx.swiglu(h[:, :4], h[:, 4:], inplace_backward=True), x, do)
    assert torch.equal(got, ref)


def _swiglu_inputs():
    return randn(6, 20, dtype=torch.float64, scale=4.0), randn(6, 20, dtype=torch.float64)


@pytest.mark.skipif(ON_GPU, reason="float64 runs through the Triton kernel only in the interpreter, and in float32 a "
                    "GPU's exp differs from torch's by a few ulps; on a GPU test_swiglu_matches_eager checks the "
                    "kernel in fp16/bf16/fp32 against float64 under the tolerance rule")
def test_backends_agree():
    g, u = _swiglu_inputs()
    torch.testing.assert_close(flashtx.swiglu(g, u, backend="triton"), flashtx.swiglu(g, u, backend="reference"),
                               rtol=0, atol=1e-14)


def test_bf16_falls_back():
    """In the interpreter bf16 is refused by the kernel and runs the reference; on a GPU it runs the kernel."""
    g, u = _swiglu_inputs()
    gb, ub = g.to(torch.bfloat16), u.to(torch.bfloat16)
    if DEVICE == "cpu":
        with pytest.raises(BackendNotSupported, match="bfloat16"):
            flashtx.swiglu(gb, ub, backend="triton")
    if DEVICE == "cpu":
        with pytest.warns(UserWarning, match="using the reference"):
            out = flashtx.swiglu(gb, ub)
    else:
        out = flashtx.swiglu(gb, ub)
    ref = eager_swiglu(gb.double(), ub.double())
    assert (out.double() - ref).abs().max() <= torch.finfo(torch.bfloat16).eps * ref.abs().max()


def test_custom_ops_opcheck():
    g, u = randn(3, 10, requires_grad=True), randn(3, 10, requires_grad=True)
    x = randn(3, 20, requires_grad=True)
    d = randn(3, 10)
    torch.library.opcheck(swiglu_op, (g, u, False, "triton"))
    torch.library.opcheck(swiglu_bwd_op, (d, g.detach(), u.detach(), "triton"))
    torch.library.opcheck(swiglu_bwd_inplace_op, (d, g.detach().clone(), u.detach().clone(), "triton"))
    torch.library.opcheck(swiglu_packed_op, (x, False, "triton"))
    torch.library.opcheck(swiglu_packed_bwd_op, (d, x.detach(), "triton"))
    torch.library.opcheck(swiglu_packed_bwd_inplace_op, (d, x.detach().clone(), "triton"))


def _nested():
    return torch.nested.nested_tensor([randn(2, 8), randn(3, 8)])


ERRORS = {
    "gate_not_tensor": (lambda: flashtx.swiglu([1.0], randn(1)), TypeError, "gate must be a torch.Tensor"),
    "gate_int": (lambda: flashtx.swiglu(torch.ones(2, dtype=torch.int64, device=DEVICE), randn(2)), TypeError,
                 "gate has dtype torch.int64"),
    # nested tensors reached the fast path's key (torch's internal error on their shape)
    "gate_nested": (lambda: flashtx.swiglu(_nested(), _nested()), TypeError, "gate is a nested tensor"),
    "up_nested": (lambda: flashtx.swiglu(randn(2, 8), _nested()), TypeError, "up is a nested tensor"),
    "x_nested": (lambda: flashtx.swiglu_packed(_nested()), TypeError, "x is a nested tensor"),
    "dtype_mismatch": (lambda: flashtx.swiglu(randn(2, 4), randn(2, 4, dtype=torch.float16)), TypeError,
                       "same dtype"),
    "shape_mismatch": (lambda: flashtx.swiglu(randn(2, 4), randn(2, 5)), ValueError,
                       r"gate \(2, 4\) and up \(2, 5\)"),
    "zero_dim": (lambda: flashtx.swiglu(torch.tensor(1.0), torch.tensor(2.0)), ValueError, "at least 1 dim"),
    "device_mismatch": (lambda: flashtx.swiglu(randn(2, 4), torch.empty(2, 4, device="meta")), ValueError,
                        "one device"),
    "packed_odd": (lambda: flashtx.swiglu_packed(randn(3, 7)), ValueError, r"even last dim; got shape \(3, 7\)"),
    "packed_not_tensor": (lambda: flashtx.swiglu_packed(3.0), TypeError, "x must be a torch.Tensor"),
    "backend_type": (lambda: flashtx.swiglu(randn(2), randn(2), backend=0), TypeError, "backend must be"),
    "backend_unknown": (lambda: flashtx.swiglu_packed(randn(2), backend="cuda"), ValueError, "one of"),
    "module_dim": (lambda: flashtx.nn.SwiGLU(0, 4), ValueError, "dim must be an int >= 1"),
    "module_hidden": (lambda: flashtx.nn.SwiGLU(4, 2.5), ValueError, "hidden_dim must be an int"),
    "state_dict_style": (lambda: flashtx.nn.SwiGLU(4, 6).state_dict_as("gguf"), ValueError, "style must be one of"),
}


@pytest.mark.parametrize("case", ERRORS.values(), ids=ERRORS.keys())
def test_errors(case):
    fn, exc, match = case
    with pytest.raises(exc, match=match):
        fn()


# ------------------------------------------------------------------------------- nn.SwiGLU
class EagerLlamaMLP(torch.nn.Module):
    """transformers' LlamaMLP, written out: down_proj(silu(gate_proj(x)) * up_proj(x))."""

    def __init__(self, dim, hidden, bias=False, dtype=torch.float32):
        super().__init__()
        self.gate_proj = torch.nn.Linear(dim, hidden, bias=bias, dtype=dtype, device=DEVICE)
        self.up_proj = torch.nn.Linear(dim, hidden, bias=bias, dtype=dtype, device=DEVICE)
        self.down_proj = torch.nn.Linear(hidden, dim, bias=bias, dtype=dtype, device=DEVICE)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "separate"])
@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=dtype_id)
def test_module_matches_eager_llama_mlp(dtype, packed, bias):
    dim, hidden = 24, 40
    eager = EagerLlamaMLP(dim, hidden, bias, dtype)
    ref = EagerLlamaMLP(dim, hidden, bias, torch.float64)
    ref.load_state_dict({k: v.double() for k, v in eager.state_dict().items()})
    # packed: the default (in-place activation gradient); separate: out of place
    mlp = flashtx.nn.SwiGLU(dim, hidden, bias=bias, packed=packed, **({} if packed else {"inplace_backward": False}),
                            dtype=dtype, device=DEVICE)
    mlp.load_state_dict(eager.state_dict())  # transformers' names, converted by the pre-hook
    x = randn(2, 5, dim, dtype=dtype, requires_grad=True)
    x64, xe = x.detach().double().requires_grad_(True), x.detach().clone().requires_grad_(True)
    with poisoned_allocations():
        out = mlp(x)
    out_ref, out_e = ref(x64), eager(xe)
    assert_close_to_reference("out", out, out_ref, out_e)
    d = randn(*out.shape, dtype=dtype)
    out.backward(d), out_ref.backward(d.double()), out_e.backward(d)
    assert_close_to_reference("dx", x.grad, x64.grad, xe.grad, grad=True)
    grads = mlp.state_dict_as("hf")  # for the names; then fill in the gradients
    w1g, w3g = (mlp.w13.weight.grad.chunk(2) if packed else (mlp.w1.weight.grad, mlp.w3.weight.grad))
    for name, gk in (("gate_proj", w1g), ("up_proj", w3g), ("down_proj", mlp.w2.weight.grad)):
        assert f"{name}.weight" in grads
        assert_close_to_reference(f"d{name}", gk, getattr(ref, name).weight.grad, getattr(eager, name).weight.grad,
                                  grad=True)


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "separate"])
def test_module_backward_is_in_place_by_default(packed):
    """nn.SwiGLU's activation backward writes its gradient over the projection outputs (Liger's MLP does the
    same): after backward the captured outputs hold the gradient the projections received."""
    mlp = flashtx.nn.SwiGLU(6, 10, packed=packed, device=DEVICE)
    assert mlp.inplace_backward and "inplace_backward=True" in repr(mlp)
    projections = [mlp.w13] if packed else [mlp.w1, mlp.w3]
    outs, grads = {}, {}
    for lin in projections:  # outputs recorded by a wrapped forward: a forward hook turns in-place off (below)
        lin.forward = lambda x, lin=lin, f=lin.forward: (lambda o: outs.__setitem__(lin, (o, o.detach().clone()))
                                                         or o)(f(x))
        lin.register_full_backward_hook(lambda m, gi, go: grads.__setitem__(m, go[0]))
    mlp(randn(3, 6, requires_grad=True)).sum().backward()
    for lin in projections:
        buf, value = outs[lin]
        assert not torch.equal(buf, value)  # overwritten...
        assert torch.equal(buf, grads[lin])  # ...with the gradient handed to the projection
    mlp.inplace_backward = False
    mlp(randn(3, 6, requires_grad=True)).sum().backward()
    assert all(torch.equal(buf, value) for buf, value in outs.values())


def test_module_keeps_hooked_projection_outputs():
    """A forward hook on the projection (or a global one) may keep its output (captum-style attributions): the
    default module's backward then runs out of place, and the kept output still holds the activation."""
    mlp = flashtx.nn.SwiGLU(6, 10, device=DEVICE)
    kept = []
    handle = mlp.w13.register_forward_hook(lambda m, i, o: kept.append((o, o.detach().clone())))
    mlp(randn(3, 6, requires_grad=True)).sum().backward()
    handle.remove()
    handle = torch.nn.modules.module.register_module_forward_hook(
        lambda m, i, o: kept.append((o, o.detach().clone())) if m is mlp.w13 else None)
    try:
        mlp(randn(3, 6, requires_grad=True)).sum().backward()
    finally:
        handle.remove()
    assert len(kept) == 2 and all(torch.equal(buf, value) for buf, value in kept)


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "separate"])
def test_inplace_backward_is_out_of_place_under_saved_tensor_hooks(packed):
    """Saved-tensor hooks skip autograd's unchanged-saved-tensor check, and non-reentrant checkpointing hands every
    saver of a recomputed tensor one storage: an in-place backward corrupted another op's saved copy of the input
    with no error (a wrong gradient, seen before the fix). The backward runs out of place there."""
    from torch.utils.checkpoint import checkpoint

    x0 = randn(4, 20)

    def loss(x, inplace):
        h = flashtx.swiglu_packed(x, inplace_backward=inplace) if packed else \
            flashtx.swiglu(x[:, :10], x[:, 10:], inplace_backward=inplace)
        return h.sum() + (x ** 2).sum()  # pow saves x too

    def grad(inplace, wrap):
        w = x0.clone().requires_grad_(True)
        out = wrap(lambda t: loss(t * 1, inplace), w)  # t * 1: a fresh tensor inside, recomputed by checkpoint
        return torch.autograd.grad(out, w)[0]

    want = grad(False, lambda f, w: f(w))
    got = grad(True, lambda f, w: checkpoint(f, w, use_reentrant=False))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        w = x0.clone().requires_grad_(True)
        out = loss(w * 1, True)
        first = torch.autograd.grad(out, w, retain_graph=True)[0]
        second = torch.autograd.grad(out, w)[0]  # the saved inputs are intact: the same gradient again
    torch.testing.assert_close(first, want, rtol=0, atol=1e-6)
    torch.testing.assert_close(second, want, rtol=0, atol=1e-6)


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_state_dict_round_trips(bias):
    torch.manual_seed(0)
    packed = flashtx.nn.SwiGLU(6, 10, bias=bias, device=DEVICE)  # on x's device
    separate = flashtx.nn.SwiGLU(6, 10, bias=bias, packed=False, device=DEVICE)
    separate.load_state_dict(packed.state_dict())  # w13 -> w1/w3
    x = randn(3, 6)
    assert torch.equal(torch.cat((separate.w1.weight, separate.w3.weight)), packed.w13.weight)
    torch.testing.assert_close(separate(x), packed(x))  # (BLAS blocking differs with the output width)
    for style, names in (("meta", ("w1", "w3", "w2")), ("hf", ("gate_proj", "up_proj", "down_proj"))):
        sd = packed.state_dict_as(style, prefix="mlp.")
        assert set(sd) == {f"mlp.{n}.{k}" for n in names for k in (("weight", "bias") if bias else ("weight",))}
        assert sd[f"mlp.{names[0]}.weight"].shape == (10, 6) and sd[f"mlp.{names[2]}.weight"].shape == (6, 10)
        for target in (flashtx.nn.SwiGLU(6, 10, bias=bias, device=DEVICE),
                       flashtx.nn.SwiGLU(6, 10, bias=bias, packed=False, device=DEVICE)):
            holder = torch.nn.Module()
            holder.mlp = target
            holder.load_state_dict(sd)  # prefixed keys, as inside a model
            torch.testing.assert_close(target(x), packed(x))
            assert torch.equal(target.w2.weight, packed.w2.weight)
    # strict loading still reports genuinely missing weights
    with pytest.raises(RuntimeError, match="Missing key"):
        flashtx.nn.SwiGLU(6, 10).load_state_dict({"gate_proj.weight": torch.zeros(10, 6)})


def test_packed_inplace_backward_stays_in_place_under_dispatch_modes():
    """Only tracing (torch.compile's fake, proxy and functional modes) makes the in-place backward run out of place
    (a compiled backward may not write its saved inputs; tests/test_compile_gpu_path.py checks that): under another
    dispatch mode (FlopCounterMode, a memory tracker) and with forward AD open, eager calls keep it, so such a
    measurement sees the path the real run takes."""
    from torch.utils.flop_counter import FlopCounterMode

    x0 = randn(2, 5, 12, requires_grad=True)
    d = randn(2, 5, 6)
    ref_x, = torch.autograd.grad(flashtx.swiglu_packed(x0 * 1), x0, d)
    for ctx in (FlopCounterMode(display=False), torch.autograd.forward_ad.dual_level()):
        x0.grad = None
        x = x0 * 1
        with ctx:
            flashtx.swiglu_packed(x, inplace_backward=True).backward(d)
        assert torch.equal(x0.grad, ref_x) and torch.equal(x.detach(), ref_x), type(ctx).__name__
