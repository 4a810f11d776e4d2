"""flashtx._swiglu_lane: a plain swiglu / swiglu_packed call planned once per call signature. It must compute exactly
what the general path (validation, the flashtx::swiglu(_packed) ops and their backwards) computes, in place and out
of place; raise what the general path raises; take only the calls it may; and hand the backward to the op's where
the lane's cannot serve it."""
import pytest
import torch
import torch.nn.functional as F

import flashtx
from flashtx import _dispatch, _lanes, _swiglu_lane, _swiglu_op

from conftest import PRECISE_DTYPE, count_calls, poisoned_allocations, precise_atol, randn


pytestmark = pytest.mark.usefixtures("fresh_plans")


@pytest.fixture
def fires(monkeypatch):
    """How many launch entries the lane fired (forward and backward)."""
    return count_calls(monkeypatch, _lanes, "fire")


@pytest.fixture
def op_backwards(monkeypatch):
    """How many times the ops' own backwards ran as the lane nodes' fallbacks (one record for both)."""
    calls = []
    for name in ("_backward", "_backward_packed"):
        real = getattr(_swiglu_lane, name)
        monkeypatch.setattr(_swiglu_lane, name, lambda *a, real=real: calls.append(1) or real(*a))
    return calls


def _want(g, u, dout=None):
    """silu(g) * u, or its gradients (dg, du) for dout, in float64."""
    g, u = g.detach().double().requires_grad_(), u.detach().double().requires_grad_()
    y = F.silu(g) * u
    return y if dout is None else torch.autograd.grad(y, (g, u), dout.double())


LAYOUTS = {  # name: (shape, a function of a fresh (shape) tensor giving the argument: views whose rows are views)
    "2d": ((5, 24), lambda t: t),
    "3d": ((2, 3, 16), lambda t: t),
    "row-strided": ((4, 2, 40), lambda t: t[:, :, :20]),  # rows are a view with a row stride of 40
}


def _inputs(name, packed, grad):
    shape, view = LAYOUTS[name]
    if packed:
        shape = (*shape[:-1], 2 * shape[-1])
    # with grad, non-leaf tensors (a projection's output): an in-place backward refuses a leaf that requires grad
    ts = [view(randn(*shape, dtype=PRECISE_DTYPE, requires_grad=grad) * 1) for _ in range(1 if packed else 2)]
    return ts


def _call(ts, inplace):
    if len(ts) == 1:
        return flashtx.swiglu_packed(ts[0], inplace_backward=inplace)
    return flashtx.swiglu(*ts, inplace_backward=inplace)


def _split(ts):
    if len(ts) == 1:
        h = ts[0].shape[-1] // 2
        return ts[0][..., :h], ts[0][..., h:]
    return ts


@pytest.mark.parametrize("inplace", [False, True], ids=["out-of-place", "inplace-backward"])
@pytest.mark.parametrize("grad", [False, True], ids=["no-grad", "grad"])
@pytest.mark.parametrize("packed", [False, True], ids=["separate", "packed"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_the_lane_computes_what_the_general_path_computes(layout, packed, grad, inplace, fires, op_backwards,
                                                         monkeypatch):
    """Three calls of one signature with fresh data each (poisoned outputs): the lane's outputs and gradients equal
    the general path's bit for bit and the float64 formula's; the lane fired every forward and every backward, and
    the ops' backwards never ran. In place, the gradients are the inputs' own buffers, as the op's."""
    results = {}
    for lane in (True, False):
        monkeypatch.setattr(_swiglu_lane, "LANE", lane)
        for seed in range(3):
            torch.manual_seed(seed)
            ts = _inputs(layout, packed, grad)
            want_out = _want(*_split(ts))
            with torch.set_grad_enabled(grad), poisoned_allocations():
                out = _call(ts, inplace)
            assert (out - want_out).abs().max() < precise_atol(1e-12) and out.is_contiguous()
            got = [out.detach()]
            if grad:
                assert type(out.grad_fn).__name__ == ("SwigluPackedBackward" if packed else "SwigluBackward")
                dout = torch.randn_like(out)
                want = _want(*_split(ts), dout)
                kept = [t.detach().clone() for t in ts]
                with poisoned_allocations():
                    grads = torch.autograd.grad(out, ts, dout)
                if packed:
                    assert (grads[0] - torch.cat(want, -1)).abs().max() < precise_atol(1e-12)
                else:
                    assert all((a - b).abs().max() < precise_atol(1e-12) for a, b in zip(grads, want))
                if inplace:  # the gradients overwrote the inputs' own memory
                    assert all(g.data_ptr() == t.data_ptr() for g, t in zip(grads, ts))
                else:
                    assert all(torch.equal(t.detach(), k) for t, k in zip(ts, kept))
                got += [g.clone() for g in grads]
            results.setdefault(lane, []).append(got)
        if lane:
            assert len(fires) == (6 if grad else 3) and op_backwards == []
            assert all(_lanes.TABLE.values()) and len(_lanes.TABLE) == (2 if grad else 1)
    assert all(torch.equal(a, b) for ra, rb in zip(results[True], results[False]) for a, b in zip(ra, rb))


@pytest.mark.parametrize("packed", [False, True], ids=["separate", "packed"])
def test_an_inplace_backward_bumps_the_inputs_versions(packed):
    """The in-place backward's writes are recorded as the in-place op's are: the inputs' version counters move, so
    a second backward through the retained graph (which would read gradients as inputs) raises (naming the op)."""
    ts = _inputs("3d", packed, True)
    for _ in range(2):  # the second: through the lane made by the first
        ts = [t.detach().clone().requires_grad_() * 1 for t in ts]
        out = _call(ts, True)
        versions = [t._version for t in ts]
        dout = torch.randn_like(out)
        torch.autograd.grad(out, ts, dout, retain_graph=True)
        assert all(t._version > v for t, v in zip(ts, versions))
        with pytest.raises(RuntimeError, match="swiglu: a second backward"):
            torch.autograd.grad(out, ts, dout)


def test_create_graph_strided_douts_and_swapped_data_take_the_ops_backward(fires, op_backwards):
    """The ops' backward (always right) runs for create_graph (which then refuses a double backward as the op's
    does), a dout whose rows are not a view (a transposed gradient), and a saved input whose .data was swapped
    for another layout."""
    g, u = randn(6, 16, dtype=PRECISE_DTYPE, requires_grad=True), randn(6, 16, dtype=PRECISE_DTYPE,
                                                                       requires_grad=True)
    dout = randn(16, 6, dtype=PRECISE_DTYPE).t()  # (6, 16), strides (1, 6): a row is not contiguous, but a view
    want = _want(g, u, dout)
    out = flashtx.swiglu(g, u)
    grads = torch.autograd.grad(out, (g, u), dout, create_graph=True)
    assert len(op_backwards) == 1 and all((a - b).abs().max() < precise_atol(1e-12) for a, b in zip(grads, want))
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(grads[0].sum(), g)

    g, u = randn(2, 3, 8, dtype=PRECISE_DTYPE, requires_grad=True), randn(2, 3, 8, dtype=PRECISE_DTYPE,
                                                                         requires_grad=True)
    dout = randn(3, 2, 8, dtype=PRECISE_DTYPE).transpose(0, 1)  # (2, 3, 8) whose (6, 8) rows need a copy
    for _ in range(2):  # (the second: the refusal is remembered)
        grads = torch.autograd.grad(flashtx.swiglu(g, u), (g, u), dout)
        assert all((a - b).abs().max() < precise_atol(1e-12) for a, b in zip(grads, _want(g, u, dout)))
    assert len(op_backwards) == 3

    y = randn(4, 8, dtype=PRECISE_DTYPE, requires_grad=True)
    w = randn(4, 8, dtype=PRECISE_DTYPE, requires_grad=True)
    flashtx.swiglu(y, w)  # a lane for (4, 8) contiguous
    out = flashtx.swiglu(y, w)
    out.grad_fn.saved_tensors  # noqa: B018  (saved as they are)
    swapped = randn(8, 4, dtype=PRECISE_DTYPE).t()
    y.data = swapped  # the saved gate now has other strides: not what the lane's plan reads
    dout = randn(4, 8, dtype=PRECISE_DTYPE)
    n = len(op_backwards)
    dg, du = torch.autograd.grad(out, (y, w), dout)
    want = _want(swapped, w, dout)
    assert len(op_backwards) == n + 1
    assert all((a - b).abs().max() < precise_atol(1e-12) for a, b in zip((dg, du), want))

    # the same shape and strides in another dtype: a replay planned for the forward's dtype must not read it (on a
    # GPU a direct launch would run the kernel compiled for that dtype; the interpreter would not notice)
    out = flashtx.swiglu(y, w)
    other = torch.float32 if PRECISE_DTYPE != torch.float32 else torch.float64
    y.data = y.data.to(other)
    (du,) = torch.autograd.grad(out, (w,), dout)  # (y's own gradient edge does not survive the swap)
    assert len(op_backwards) == n + 2
    assert (du - _want(y.detach(), w, dout)[1]).abs().max() < precise_atol(1e-6)


def test_checkpointing_takes_the_ops_backward_out_of_place(op_backwards):
    """Under saved-tensor hooks (a non-reentrant checkpoint) the in-place backward is out of place, through the
    op's backward, as the general path's rule says; the gradients are right and the inputs untouched."""
    from torch.utils.checkpoint import checkpoint

    g, u = randn(5, 12, dtype=PRECISE_DTYPE, requires_grad=True), randn(5, 12, dtype=PRECISE_DTYPE,
                                                                       requires_grad=True)
    flashtx.swiglu(g.detach(), u.detach(), inplace_backward=True)  # a lane exists
    g2, u2 = g * 1.0, u * 1.0
    out = checkpoint(lambda a, b: flashtx.swiglu(a, b, inplace_backward=True), g2, u2, use_reentrant=False)
    dout = randn(5, 12, dtype=PRECISE_DTYPE)
    grads = torch.autograd.grad(out, (g, u), dout)
    assert len(op_backwards) == 1
    assert all((a - b).abs().max() < precise_atol(1e-12) for a, b in zip(grads, _want(g, u, dout)))


BAD = {  # name: (a call, error type, message)
    "dtype": (lambda g, u: flashtx.swiglu(g, u.float()), TypeError, "same dtype"),
    "shape": (lambda g, u: flashtx.swiglu(g, u[:, :4]), ValueError, "same shape"),
    "overlap": (lambda g, u: flashtx.swiglu(g, g, inplace_backward=True), ValueError, "no shared elements"),
    "expanded": (lambda g, u: flashtx.swiglu(g[:1].expand(4, 8), u, inplace_backward=True), ValueError,
                 "no shared elements"),
    "odd packed": (lambda g, u: flashtx.swiglu_packed(g[:, :7]), ValueError, "even last dim"),
    "backend": (lambda g, u: flashtx.swiglu(g, u, backend=3), TypeError, "backend must be None or a string"),
    "sparse": (lambda g, u: flashtx.swiglu(g.to_sparse(), u), TypeError, "gate has layout torch.sparse_coo"),
    "sparse packed": (lambda g, u: flashtx.swiglu_packed(g.to_sparse()), TypeError, "x has layout torch.sparse_coo"),
}


@pytest.mark.parametrize("bad", sorted(BAD))
def test_bad_calls_raise_the_general_paths_error_before_and_after_a_lane(bad):
    """Each bad call raises what the general path raises, on a first call and after good calls whose signature
    it shares have made a lane (gate and up being one tensor is seen per call: it depends on addresses)."""
    call, error, match = BAD[bad]
    g, u = randn(4, 8, dtype=PRECISE_DTYPE), randn(4, 8, dtype=PRECISE_DTYPE)
    for _ in ("first call", "after a lane"):
        with pytest.raises(error, match=match):
            call(g, u)
        flashtx.swiglu(g, u, inplace_backward=True)
        flashtx.swiglu_packed(g, inplace_backward=True)
        flashtx.swiglu(g[:1].expand(4, 8), u)
    assert sum(map(bool, _lanes.TABLE.values())) == 3


def test_only_plain_eager_calls_take_the_lane_and_lanes_go_with_the_plans(fires):
    """Parameters, a named reference backend, rows that are not a view (a transposed 3-D tensor) and empty tensors
    take the general path (each still right), and a non-bool inplace_backward its TypeError; clear_plans drops the
    lanes."""
    g, u = randn(2, 3, 8, dtype=PRECISE_DTYPE), randn(2, 3, 8, dtype=PRECISE_DTYPE)
    want = _want(g, u)
    gt, ut = g.transpose(0, 1).contiguous().transpose(0, 1), u.transpose(0, 1).contiguous().transpose(0, 1)
    for _ in range(2):
        outs = [flashtx.swiglu(torch.nn.Parameter(g.clone()), u).detach(),
                flashtx.swiglu(g, u, backend="reference"),
                flashtx.swiglu(gt, ut)]
        with pytest.raises(TypeError, match="inplace_backward must be a bool; got int 1"):
            flashtx.swiglu(g, u, inplace_backward=1)
        for got in outs:
            assert (got - want).abs().max() < precise_atol(1e-12)
        assert flashtx.swiglu(g[:0], u[:0]).shape == (0, 3, 8)
    assert fires == [] and not any(_lanes.TABLE.values())
    flashtx.swiglu(g, u)
    assert len(fires) == 1 and any(_lanes.TABLE.values())
    _dispatch.clear_plans()
    assert len(_lanes.TABLE) == 0


def test_the_lane_node_saves_what_the_ops_node_saves(monkeypatch):
    """A lane's node and the op's node save the same tensors and arguments (so a hook, a checkpoint's recompute
    or the op's backward, run as the lane node's fallback, finds what the op's saves)."""
    g, u = (randn(3, 8, dtype=PRECISE_DTYPE, requires_grad=True) * 1 for _ in range(2))  # non-leaf: in place
    nodes = {}
    for lane in (True, False):
        monkeypatch.setattr(_swiglu_lane, "LANE", lane)
        out = flashtx.swiglu(g, u, inplace_backward=True)
        nodes[lane] = out  # (the output kept alive: on torch 2.11 the saved tensors were gone once it was dropped)
    a, b = nodes[True].grad_fn, nodes[False].grad_fn
    assert type(a).__name__ == type(b).__name__ == "SwigluBackward"
    assert all(x is y for x, y in zip(a.saved_tensors, b.saved_tensors)) and a.args == b.args
    assert _swiglu_op._backward is _swiglu_lane._backward


@pytest.mark.parametrize("packed", [False, True], ids=["separate", "packed"])
def test_douts_of_other_strides_get_entries_of_their_own(packed, fires):
    """One forward lane, backwards with a contiguous dout and then a column-major one (its rows still a view): each
    replays an entry planned for its own strides, and both are right."""
    ts = _inputs("2d", packed, True)
    out = _call(ts, False)
    for dout in (randn(*out.shape, dtype=PRECISE_DTYPE), randn(*reversed(out.shape), dtype=PRECISE_DTYPE).t()):
        for _ in range(2):
            grads = torch.autograd.grad(out, ts, dout, retain_graph=True)
            want = _want(*_split(ts), dout)
            got = grads if not packed else grads[0].chunk(2, -1)
            assert all((a - b).abs().max() < precise_atol(1e-12) for a, b in zip(got, want))
    assert len(fires) == 5 and len(_lanes.TABLE) == 3
