"""The RoPE and SwiGLU lanes' keys and refusals, and the general path's in-place backward rules.

A lane (flashtx._rotary_lane, flashtx._swiglu_lane) is planned once per call signature: two calls that differ only
in one argument the key must hold (a stride of k or of a table, gate's dtype, whether autograd records the call,
whether the backward runs in place) must not share a plan, and a lane must refuse what the general path refuses.
Each test here failed under a mutation that dropped that field or check (a mutation-testing round; the other
mutations were caught by the lanes' own test files). The in-place backward tests pin the general path's rules
(rows that are not a view, saved-tensor hooks, create_graph, torch.compile), which the lane tests do not reach."""

import pytest
import torch
import torch.nn.functional as F

import flashtx

from conftest import DEVICE, PRECISE_DTYPE, precise_randn

pytestmark = pytest.mark.usefixtures("fresh_plans")
P = PRECISE_DTYPE


def _rand(*shape, dtype=P):
    return torch.rand(*shape, dtype=dtype, device=DEVICE)




# ------------------------------------------------------------------------------------------ RoPE
def test_a_rotary_lane_still_refuses_tables_of_different_lengths():
    x, cos, sin = precise_randn(1, 3, 2, 8), _rand(8, 4), _rand(8, 4)
    flashtx.apply_rotary(x, cos, sin, seqlen_offsets=2)  # a lane for this signature
    with pytest.raises(ValueError, match="cos and sin must have the same shape"):
        flashtx.apply_rotary(x, cos, _rand(12, 4), seqlen_offsets=2)


def test_a_rotary_lane_is_keyed_by_ks_and_each_tables_strides():
    cos, sin = _rand(8, 4), _rand(8, 4)
    q = precise_randn(2, 5, 3, 8)
    flashtx.apply_rotary_qk(q, precise_randn(2, 5, 2, 8), cos, sin)  # lane: contiguous k
    k = precise_randn(2, 2, 5, 8).transpose(1, 2)  # the same shape, other strides
    _, got = flashtx.apply_rotary_qk(q, k, cos, sin)
    _, want = flashtx.apply_rotary_qk(q, k.contiguous(), cos, sin, backend="reference")
    torch.testing.assert_close(got, want)

    flashtx.apply_rotary(q, cos[:6], sin[:6])  # lane: contiguous (6, 4) tables
    cos_view = _rand(6, 8)[:, :4]  # (6, 4) with row stride 8; sin stays contiguous
    got = flashtx.apply_rotary(q, cos_view, sin[:6])
    torch.testing.assert_close(got, flashtx.apply_rotary(q, cos_view.contiguous(), sin[:6], backend="reference"))


def test_an_in_place_rotary_under_autograd_after_a_no_grad_one_of_the_same_signature():
    cos, sin = _rand(8, 4), _rand(8, 4)
    with torch.no_grad():
        flashtx.apply_rotary(precise_randn(1, 4, 2, 8), cos, sin, inplace=True)  # the no-grad lane
    x = precise_randn(1, 4, 2, 8, requires_grad=True)
    out = flashtx.apply_rotary(x * 1.0, cos, sin, inplace=True)
    dout = torch.randn_like(out)
    (got,) = torch.autograd.grad(out, x, dout)
    (want,) = torch.autograd.grad(flashtx.apply_rotary(x, cos, sin), x, dout)
    torch.testing.assert_close(got, want)


def test_an_int_interleaved_is_refused_after_a_lane_with_interleaved_true():
    x, cos, sin = precise_randn(1, 4, 2, 8), _rand(8, 4), _rand(8, 4)
    flashtx.apply_rotary(x, cos, sin, interleaved=True)  # 1 == True hashes alike: the lane's key would match
    with pytest.raises(TypeError, match="interleaved must be a bool"):
        flashtx.apply_rotary(x, cos, sin, interleaved=1)


def test_apply_rotary_qk_refuses_a_k_with_another_head_dim():
    cos, sin = _rand(8, 4), _rand(8, 4)
    with pytest.raises(ValueError, match="must differ only in the number of heads"):
        flashtx.apply_rotary_qk(precise_randn(1, 4, 2, 16), precise_randn(1, 4, 1, 8), cos, sin)


def test_position_ids_with_a_batch_neither_one_nor_b_are_refused_by_name():
    x, cos, sin = precise_randn(2, 4, 2, 8), _rand(8, 4), _rand(8, 4)
    with pytest.raises(ValueError, match=r"position_ids must have shape \(2, 4\) or \(1, 4\)"):
        flashtx.apply_rotary(x, cos, sin, position_ids=torch.arange(4, device=DEVICE).expand(3, 4))


# ---------------------------------------------------------------------------------------- SwiGLU
def test_a_swiglu_lane_is_keyed_by_ups_strides_and_gates_dtype():
    g = precise_randn(4, 8)
    flashtx.swiglu(g, precise_randn(4, 8))  # lane: contiguous gate and up
    u = precise_randn(8, 4).t()  # the same shape, strides (1, 4)
    torch.testing.assert_close(flashtx.swiglu(g, u), F.silu(g) * u)
    flashtx.swiglu(precise_randn(4, 8, dtype=torch.float16), precise_randn(4, 8, dtype=torch.float16))  # lane: float16
    with pytest.raises(TypeError, match="same dtype"):
        flashtx.swiglu(precise_randn(4, 8, dtype=torch.float32), precise_randn(4, 8, dtype=torch.float16))


def test_one_forward_lane_serves_in_place_and_out_of_place_backwards():
    """inplace_backward=True runs in place only where both inputs take a gradient: with a frozen up the same lane's
    backward runs out of place, into contiguous gradients, not with the in-place entry's strides (row stride 16)."""
    def run(up_grad):
        base = precise_randn(2, 4, 16, requires_grad=True)
        g = (base * 1.0)[..., :8]  # row stride 16
        u = (precise_randn(2, 4, 16, requires_grad=up_grad) * 1.0)[..., :8]
        g0, u0 = g.detach().clone().requires_grad_(), u.detach().clone()
        out = flashtx.swiglu(g, u, inplace_backward=True)
        dout = torch.randn_like(out)
        (dbase,) = torch.autograd.grad(out, base, dout)
        (want,) = torch.autograd.grad(F.silu(g0) * u0, g0, dout)
        torch.testing.assert_close(dbase[..., :8], want)
        assert not dbase[..., 8:].any()

    for up_grad in (True, True, False, False):  # in place (its entry made), then out of place on the same lane
        run(up_grad)


def test_the_general_paths_in_place_backward_keeps_a_frozen_up():
    live = precise_randn(3, 2, 8, requires_grad=True)
    gate = (live * 1.0).transpose(0, 1)  # (2, 3, 8) whose rows are not a view: the general path
    up = precise_randn(3, 2, 8).transpose(0, 1)
    keep = up.clone()
    out = flashtx.swiglu(gate, up, inplace_backward=True)
    out.backward(torch.ones_like(out))
    assert torch.equal(up, keep)


def test_the_general_paths_packed_backward_is_out_of_place_under_saved_tensor_hooks():
    x0 = precise_randn(4, 3, 20)

    def grad(hooks, inplace):
        w = x0.clone().requires_grad_(True)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t) if hooks else torch.enable_grad():
            x = (w * 1).transpose(0, 1)  # rows not a view: the op's path
            sq = (x ** 2).sum()  # saves x; its backward runs after swiglu_packed's
            return torch.autograd.grad(sq + flashtx.swiglu_packed(x, inplace_backward=inplace).sum(), w)[0]

    torch.testing.assert_close(grad(True, True), grad(False, False))


def test_create_graph_with_inplace_backward_runs_out_of_place_and_names_the_missing_double_backward():
    g0, u0 = precise_randn(4, 8, requires_grad=True), precise_randn(4, 8, requires_grad=True)
    g, u = g0 * 1.0, u0 * 1.0
    out = flashtx.swiglu(g, u, inplace_backward=True)
    dg, _ = torch.autograd.grad(out, (g, u), torch.ones_like(out), create_graph=True)
    assert dg.requires_grad and dg.data_ptr() != g.data_ptr()
    with pytest.raises(RuntimeError, match="swiglu has no double backward"):
        torch.autograd.grad(dg.sum(), g0)


def test_a_compiled_swiglu_of_one_tensor_with_inplace_backward_has_the_right_gradient():
    """Under torch.compile the backward runs out of place even where it runs eagerly (backend="eager"): overlap of
    gate and up is not checked while compiling."""
    import torch._dynamo

    torch._dynamo.reset()
    w = precise_randn(4, 8, requires_grad=True)
    f = torch.compile(lambda x: flashtx.swiglu(x, x, inplace_backward=True), backend="eager", fullgraph=True)
    out = f(w * 1.0)
    (got,) = torch.autograd.grad(out, w, torch.ones_like(out))
    w2 = w.detach().clone().requires_grad_()
    (want,) = torch.autograd.grad(F.silu(w2) * w2, w2, torch.ones_like(out))
    torch.testing.assert_close(got, want)
