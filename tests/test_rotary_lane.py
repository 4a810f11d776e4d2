"""flashtx._rotary_lane: a plain RoPE call (int seqlen_offsets, no position ids or cu_seqlens) planned once per call
signature. It must compute exactly what the general path (validation, the flashtx::rotary(_qk) ops) computes, with
the same launches and the same backward, in place and out of place; raise what the general path raises; take only
the calls it may; replay one lane for a decode loop's new offset each step; and be forgotten with the plans."""
import pytest
import torch

import flashtx
from flashtx import _dispatch, _lanes, _rotary_lane, reference
from flashtx.triton_kernels import launch

from conftest import DEVICE, PRECISE_DTYPE, count_calls, poisoned_allocations, precise_atol, randn


pytestmark = pytest.mark.usefixtures("fresh_plans")


@pytest.fixture
def lane_fires(monkeypatch):
    """How many launches a lane fired."""
    return count_calls(monkeypatch, _rotary_lane._Lane, "fire")


def _tables(seqlen_ro, r2, batch=None):
    shape = (seqlen_ro, r2) if batch is None else (batch, seqlen_ro, r2)
    return torch.rand(shape, dtype=PRECISE_DTYPE, device=DEVICE), torch.rand(shape, dtype=PRECISE_DTYPE, device=DEVICE)


def _want(x, cos, sin, offset, interleaved, layout, conjugate=False):
    """The float64 formula: x (B, S, H, D) or (B, H, S, D) rotated at positions s + offset."""
    xs = x if layout == "bshd" else x.transpose(1, 2)  # (B, S, H, D)
    B, S, H, D = xs.shape
    c, s = (cos, sin) if cos.dim() == 3 else (cos[None], sin[None])
    tables = torch.arange(B, device=DEVICE).repeat_interleave(S) if c.shape[0] > 1 else \
        torch.zeros(B * S, dtype=torch.long, device=DEVICE)
    pos = (torch.arange(S, device=DEVICE) + offset).repeat(B)
    out = reference.rotary_tokens(xs.reshape(B * S, H, D), c, s, tables, pos, interleaved=interleaved,
                                  conjugate=conjugate).view(B, S, H, D)
    return out if layout == "bshd" else out.transpose(1, 2)


CASES = {  # name: (B, S, Hq, Hk, D, rotary_dim, per-batch tables, layout, interleaved)
    "bshd-half": (2, 7, 3, 1, 16, 16, False, "bshd", False),
    "bhsd-interleaved-partial": (1, 9, 2, 2, 32, 16, False, "bhsd", True),
    "per-batch-tables": (2, 5, 2, 1, 16, 8, True, "bhsd", False),
    "q-only": (2, 6, 3, None, 16, 16, False, "bshd", False),
}


def _x(B, S, H, D, layout, grad):
    x = randn(B, S, H, D, dtype=PRECISE_DTYPE)  # (B, S, H, D) memory; bhsd: a (B, H, S, D) view of it
    return (x if layout == "bshd" else x.transpose(1, 2)).detach().requires_grad_(grad)


def _call(q, k, cos, sin, offset, interleaved, layout, inplace):
    if k is None:
        return (flashtx.apply_rotary(q, cos, sin, interleaved=interleaved, seqlen_offsets=offset, layout=layout,
                                     inplace=inplace), None)
    return flashtx.apply_rotary_qk(q, k, cos, sin, interleaved=interleaved, seqlen_offsets=offset, layout=layout,
                                   inplace=inplace)


@pytest.mark.parametrize("offset", [0, 3])
@pytest.mark.parametrize("grad", [False, True], ids=["no-grad", "grad"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_the_lane_computes_what_the_general_path_computes(case, grad, offset, lane_fires, monkeypatch):
    """Three out-of-place calls of one signature with fresh data each (poisoned outputs): the lane's outputs and
    gradients equal the general path's bit for bit and the float64 formula's; the lane ran every call."""
    B, S, Hq, Hk, D, rd, per_batch, layout, inter = CASES[case]
    cos, sin = _tables(S + offset + 2, rd // 2, B if per_batch else None)
    results = {}
    for lane in (True, False):
        monkeypatch.setattr(_rotary_lane, "LANE", lane)
        for seed in range(3):
            torch.manual_seed(seed)
            q, k = _x(B, S, Hq, D, layout, grad), None if Hk is None else _x(B, S, Hk, D, layout, grad)
            with torch.set_grad_enabled(grad), poisoned_allocations():
                got = [t for t in _call(q, k, cos, sin, offset, inter, layout, False) if t is not None]
            grads = []
            if grad:
                douts = [torch.randn_like(t) for t in got]
                grads = torch.autograd.grad(got, [t for t in (q, k) if t is not None], douts)
                assert all(type(t.grad_fn).__name__ == ("RotaryQkBackward" if k is not None else "RotaryBackward")
                           for t in got)
                for t, g in zip((q, k), grads):
                    dout = douts[0] if t is q else douts[1]
                    assert (g - _want(dout, cos, sin, offset, inter, layout, conjugate=True)).abs().max() < \
                        precise_atol(1e-12)
            for x, t in zip((q, k), got):
                assert (t - _want(x.detach(), cos, sin, offset, inter, layout)).abs().max() < precise_atol(1e-12)
            results.setdefault(lane, []).append([t.detach() for t in (*got, *grads)])
        if lane:  # with grad, the backward's conjugate rotation through a lane of its own too
            assert len(lane_fires) == (6 if grad else 3) and len(_lanes.TABLE) == (2 if grad else 1)
    assert all(torch.equal(a, b) for ra, rb in zip(results[True], results[False]) for a, b in zip(ra, rb))


@pytest.mark.parametrize("used", ["both", "q", "k"])
def test_a_lane_nodes_backward_rotates_through_a_conjugate_lane(used, monkeypatch):
    """The backward of a lane's node (either output's gradient, or both) is the conjugate rotation, through a lane
    of its own keyed like a forward's: the op's backward is not called, the gradients equal the general path's bit
    for bit. With create_graph the op's backward runs (it records its own node), and the gradients of the
    gradients (with respect to the output gradients) agree too."""
    cos, sin = _tables(12, 8)
    q, k = _x(2, 5, 3, 16, "bhsd", True), _x(2, 5, 1, 16, "bhsd", True)
    douts = [randn(*t.shape, dtype=PRECISE_DTYPE).requires_grad_() for t in (q, k)]
    pick = {"both": (0, 1), "q": (0,), "k": (1,)}[used]

    def grads(create_graph=False):
        outs = flashtx.apply_rotary_qk(q, k, cos, sin, seqlen_offsets=4, layout="bhsd")
        g = torch.autograd.grad([outs[i] for i in pick], (q, k), [douts[i] for i in pick], create_graph=create_graph,
                                allow_unused=True)
        if not create_graph:
            return g
        live = [t for t in g if t is not None]
        return torch.autograd.grad(live, [douts[i] for i in pick], [torch.ones_like(t) for t in live])

    monkeypatch.setattr(_rotary_lane, "LANE", False)
    want, want2 = grads(), grads(create_graph=True)
    monkeypatch.setattr(_rotary_lane, "LANE", True)
    op_backwards = count_calls(monkeypatch, _rotary_lane, "rotated_grads")
    for _ in range(2):
        got = grads()
        assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(got, want))
    assert op_backwards == [] and len(_lanes.TABLE) == 2
    got2 = grads(create_graph=True)
    assert len(op_backwards) == 1 and len(_lanes.TABLE) == 2
    assert all(torch.equal(a, b) for a, b in zip(got2, want2))


def test_a_forward_and_a_backward_of_one_signature_keep_their_own_lanes():
    """A no-grad forward with backend="triton" of the very tensors a backward rotates (its conjugate lane's key but
    for the direction), before and after that backward: each rotates its own way."""
    cos, sin = _tables(12, 8)
    q, k = _x(2, 5, 3, 16, "bshd", True), _x(2, 5, 1, 16, "bshd", True)
    dq, dk = randn(2, 5, 3, 16, dtype=PRECISE_DTYPE), randn(2, 5, 1, 16, dtype=PRECISE_DTYPE)
    for _ in range(2):
        with torch.no_grad():
            fq, fk = flashtx.apply_rotary_qk(dq, dk, cos, sin, seqlen_offsets=2, backend="triton")
        gq, gk = torch.autograd.grad(flashtx.apply_rotary_qk(q, k, cos, sin, seqlen_offsets=2), (q, k), (dq, dk))
        for d, f, g in ((dq, fq, gq), (dk, fk, gk)):
            assert (f - _want(d, cos, sin, 2, False, "bshd")).abs().max() < precise_atol(1e-12)
            assert (g - _want(d, cos, sin, 2, False, "bshd", conjugate=True)).abs().max() < precise_atol(1e-12)


@pytest.mark.parametrize("inplace", [True, None])
def test_in_place_calls_rotate_q_and_k_themselves(inplace, lane_fires):
    """In place without autograd (inference; inplace=None is the HF integration's): q and k rotated in their own
    memory, their version counters bumped (as the in-place op's), the lane used. A q that shares memory with k
    is refused (True) or rotated out of place (None) as by the general path."""
    cos, sin = _tables(12, 8)
    for _ in range(2):
        q, k = _x(2, 6, 3, 16, "bhsd", False), _x(2, 6, 1, 16, "bhsd", False)
        q0, k0, vq, vk = q.clone(), k.clone(), q._version, k._version
        with torch.no_grad():
            qo, ko = flashtx.apply_rotary_qk(q, k, cos, sin, seqlen_offsets=2, layout="bhsd", inplace=inplace)
        assert qo is q and ko is k and q._version > vq and k._version > vk
        assert (q - _want(q0, cos, sin, 2, False, "bhsd")).abs().max() < precise_atol(1e-12)
        assert (k - _want(k0, cos, sin, 2, False, "bhsd")).abs().max() < precise_atol(1e-12)
    assert len(lane_fires) == 2
    for _ in range(2):  # one tensor: its launch stands q in for the absent k (launch._slot binds it by identity)
        x = _x(2, 6, 3, 16, "bshd", False)
        x0, vx = x.clone(), x._version
        with torch.no_grad():
            assert flashtx.apply_rotary(x, cos, sin, seqlen_offsets=1, inplace=inplace) is x
        assert x._version > vx and (x - _want(x0, cos, sin, 1, False, "bshd")).abs().max() < precise_atol(1e-12)
    assert len(lane_fires) == 4 and all(_lanes.TABLE.values())

    x = randn(2, 6, 2, 16, dtype=PRECISE_DTYPE)
    q, k = x[:, :, :1], x[:, :, :1]  # the same elements
    x0 = x.clone()
    with torch.no_grad():
        if inplace:
            with pytest.raises(ValueError, match="separate memory"):
                flashtx.apply_rotary_qk(q, k, cos, sin, inplace=True)
            assert torch.equal(x, x0)
        else:
            qo, ko = flashtx.apply_rotary_qk(q, k, cos, sin, inplace=None)
            assert qo is not q and torch.equal(x, x0)
            assert (qo - _want(x0[:, :, :1], cos, sin, 0, False, "bshd")).abs().max() < precise_atol(1e-12)


def test_a_decode_loop_replays_one_lane_and_checks_each_offset(lane_fires):
    """A new int offset each step (the cache length) narrows the tables and replays one lane; an offset past the
    table still raises the general path's error, although the signature has a lane."""
    cos, sin = _tables(8, 8)
    for step in range(1, 6):
        x = _x(2, 1, 2, 16, "bshd", False)
        got = flashtx.apply_rotary(x, cos, sin, seqlen_offsets=step)
        assert (got - _want(x, cos, sin, step, False, "bshd")).abs().max() < precise_atol(1e-12)
    assert len(_lanes.TABLE) == 1 and len(lane_fires) == 5
    with pytest.raises(ValueError, match="positions up to 8 are needed"):
        flashtx.apply_rotary(x, cos, sin, seqlen_offsets=8)
    with pytest.raises(ValueError, match="seqlen_offsets must be >= 0"):
        flashtx.apply_rotary(x, cos, sin, seqlen_offsets=-1)


BAD = {  # name: (keyword changes to a good call, error type, message)
    "layout": (dict(layout="sbhd"), ValueError, "layout must be one of"),
    "short table": (dict(S=9), ValueError, "positions up to"),
    "k dtype": (dict(k_dtype=torch.float32), TypeError, "q and k must share dtype"),
    "table grad": (dict(table_grad=True), NotImplementedError, "cos requires grad"),
    "backend": (dict(backend=3), TypeError, "backend must be None or a string"),
    "interleaved": (dict(interleaved=torch.tensor([True, False])), TypeError, "interleaved must be a bool"),
}


@pytest.mark.parametrize("bad", sorted(BAD))
def test_bad_calls_raise_the_general_paths_error_before_and_after_a_lane(bad):
    """Each bad call raises what the general path raises, on a first call and after good calls of the same
    signature have made a lane."""
    change, error, match = BAD[bad]
    cos, sin = _tables(8, 8)

    def call(**kw):
        S = kw.get("S", 4)
        q = randn(1, S, 2, 16, dtype=PRECISE_DTYPE, requires_grad=True)
        k = randn(1, S, 1, 16, dtype=kw.get("k_dtype", PRECISE_DTYPE))
        c = cos.clone().requires_grad_(kw.get("table_grad", False))
        return flashtx.apply_rotary_qk(q, k, c, sin, layout=kw.get("layout", "bshd"),
                                       interleaved=kw.get("interleaved", False), backend=kw.get("backend"))
    for lane in ("first call", "after a lane"):
        with pytest.raises(error, match=match):
            call(**change)
        call()
        call()


def test_only_plain_eager_calls_take_the_lane_and_lanes_go_with_the_plans(lane_fires):
    """Position ids, cu_seqlens, Parameters, a named reference backend and in place under autograd take the general
    path (each still right); clear_plans drops the lanes."""
    cos, sin = _tables(16, 8)
    x = randn(2, 5, 2, 16, dtype=PRECISE_DTYPE)
    want = _want(x, cos, sin, 0, False, "bshd")
    pos = torch.arange(5, device=DEVICE).expand(2, 5)
    cu = torch.tensor([0, 5, 10], dtype=torch.int32, device=DEVICE)
    p = torch.nn.Parameter(x.clone())
    for _ in range(2):
        outs = [flashtx.apply_rotary(x, cos, sin, position_ids=pos),
                flashtx.apply_rotary(x.reshape(10, 2, 16), cos, sin, cu_seqlens=cu, max_seqlen=5).view(2, 5, 2, 16),
                flashtx.apply_rotary(p, cos, sin).detach(),
                flashtx.apply_rotary(x, cos, sin, backend="reference")]
        y = x.clone().requires_grad_(True) * 1.0
        outs.append(flashtx.apply_rotary(y, cos, sin, inplace=True).detach())
        for got in outs:
            assert (got - want).abs().max() < precise_atol(1e-12)
    assert lane_fires == [] and not any(_lanes.TABLE.values())
    flashtx.apply_rotary(x, cos, sin)
    assert len(lane_fires) == 1 and any(_lanes.TABLE.values())
    _dispatch.clear_plans()
    assert len(_lanes.TABLE) == 0
    launch.LAUNCHES.clear()


@pytest.mark.parametrize("forward_lane", [False, True], ids=["general-then-lane", "lane-then-general"])
def test_checkpoint_recomputes_through_either_path(forward_lane, monkeypatch):
    """A non-reentrant checkpoint compares what the forward and its recompute save: the lane's node saves the
    caller's tables and offset, as the op's does (not the narrowed views it launches on), so a forward through
    one path and a recompute through the other (a lane dropped or made between them) agree."""
    from torch.utils.checkpoint import checkpoint

    cos, sin = _tables(10, 4)
    x = _x(2, 5, 2, 8, "bshd", True)
    dout = torch.randn(2, 5, 2, 8, dtype=PRECISE_DTYPE, device=DEVICE)
    monkeypatch.setattr(_rotary_lane, "LANE", True)
    flashtx.apply_rotary(x.detach(), cos, sin, seqlen_offsets=3)  # the lane exists for the recompute
    monkeypatch.setattr(_rotary_lane, "LANE", forward_lane)
    y = checkpoint(lambda t: flashtx.apply_rotary(t, cos, sin, seqlen_offsets=3), x, use_reentrant=False)
    monkeypatch.setattr(_rotary_lane, "LANE", not forward_lane)
    (grad,) = torch.autograd.grad(y, x, dout)
    assert (grad - _want(dout, cos, sin, 3, False, "bshd", conjugate=True)).abs().max() < precise_atol(1e-12)


def test_k_none_and_sparse_tensors_get_the_general_paths_errors():
    """apply_rotary_qk needs k (apply_rotary rotates one tensor); a sparse q or table is refused by layout, also
    after a dense call whose strides a sparse tensor's match (all zero) has made a lane."""
    cos, sin = _tables(8, 4)
    q = randn(1, 4, 2, 8, dtype=PRECISE_DTYPE)
    for inplace in (False, True):
        with pytest.raises(TypeError, match="k must be a torch.Tensor; got NoneType"):
            flashtx.apply_rotary_qk(q, None, cos, sin, inplace=inplace)
    flat = torch.tensor(0.5, dtype=PRECISE_DTYPE, device=DEVICE)
    for _ in range(2):
        flashtx.apply_rotary(flat.expand(1, 4, 2, 8), cos, sin)  # strides (0, 0, 0, 0)
        flashtx.apply_rotary(q, flat.expand(8, 4), flat.expand(8, 4))
    with pytest.raises(TypeError, match="x has layout torch.sparse_coo"):
        flashtx.apply_rotary(q.to_sparse(), cos, sin)
    with pytest.raises(TypeError, match="cos has layout torch.sparse_coo"):
        flashtx.apply_rotary(q, cos.to_sparse(), flat.expand(8, 4))
    with pytest.raises(TypeError, match="cos has layout torch.sparse_coo"):
        flashtx.apply_rotary(q, cos.to_sparse(), sin, seqlen_offsets=2)
