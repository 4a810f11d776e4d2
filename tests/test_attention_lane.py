"""flashtx._attention_lane: a plain attention call (no mask, bias, lengths, ALiBi, dropout or lse; a window and a
softcap keyed) planned once per call signature. It must compute exactly what the general path (functional._run -> the
flashtx::attn_fwd op) computes, with the same launches and the same backward, for every shell that uses it
(attention, flash_attn_func, the patched SDPA); take only the calls it may; and be forgotten with the plans."""
import pytest
import torch
import torch.nn.functional as F

import flashtx
from flashtx import _attention_lane, _dispatch, _lanes, _small_q, reference
from flashtx.triton_kernels import autotune, launch, precision
from flashtx.triton_kernels.configs import TileConfig

from conftest import DEVICE, PRECISE_DTYPE, count_calls, poisoned_allocations, precise_atol, randn


pytestmark = pytest.mark.usefixtures("fresh_plans")


@pytest.fixture
def lane_runs(monkeypatch):
    """How many forwards ran through a lane."""
    return count_calls(monkeypatch, _attention_lane._Lane, "run")


def _shell(name):
    """(call(q, k, v, causal, backend) on (B, H, S, D) views -> (B, H, S, Dv), the reference's bottom_right)."""
    if name == "attention":
        return (lambda q, k, v, causal, backend: flashtx.attention(q, k, v, is_causal=causal, enable_gqa=True,
                                                                    backend=backend)), False
    if name == "flash_attn_func":
        def flash(q, k, v, causal, backend):
            t = (x.transpose(1, 2) for x in (q, k, v))  # the (B, S, H, D) tensors the views came from
            return flashtx.flash_attn_func(*t, causal=causal, backend=backend).transpose(1, 2)
        return flash, True

    def patched(q, k, v, causal, backend):  # the patched SDPA has no backend argument: the automatic one
        with flashtx.patch_sdpa():
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    return patched, False


def _inputs(shell, B, Hq, Hkv, Sq, Sk, D, Dv, grad):
    """(B, H, S, D) views: of (B, S, H, D) tensors for flash_attn_func, else of (B, S, H, D) memory too
    (non-contiguous views, as a model's q.transpose(1, 2))."""
    q = randn(B, Sq, Hq, D, dtype=PRECISE_DTYPE).transpose(1, 2)
    k = randn(B, Sk, Hkv, D, dtype=PRECISE_DTYPE).transpose(1, 2)
    v = randn(B, Sk, Hkv, Dv, dtype=PRECISE_DTYPE).transpose(1, 2)
    return tuple(t.requires_grad_(grad) for t in (q, k, v))


CASES = {  # name: (B, Hq, Hkv, Sq, Sk, D, Dv)
    "self": (2, 2, 2, 23, 23, 16, 16),
    "gqa-cross-long-q": (1, 4, 2, 37, 19, 32, 16),
    "cross-long-k": (2, 2, 1, 21, 45, 16, 32),  # Sq > 16: not the small-query route's
}


@pytest.mark.parametrize("grad", [False, True], ids=["no-grad", "grad"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("shell", ["attention", "flash_attn_func", "patched-sdpa"])
def test_the_lane_computes_what_the_general_path_computes(shell, case, causal, grad, lane_runs, monkeypatch):
    """Three calls of one signature with fresh data each: the lane's outputs and gradients equal the general
    path's bit for bit (the same kernels and launches) and the float64 reference's; the lane ran them all."""
    call, bottom_right = _shell(shell)
    B, Hq, Hkv, Sq, Sk, D, Dv = CASES[case]
    backend = "triton" if shell == "flash_attn_func" else None  # both: a named backend takes the lane too
    for seed in range(3):
        torch.manual_seed(seed)
        q, k, v = _inputs(shell, B, Hq, Hkv, Sq, Sk, D, Dv, grad)
        with torch.set_grad_enabled(grad):
            got = call(q, k, v, causal, backend)
            monkeypatch.setattr(_attention_lane, "LANE", False)
            want = call(q, k, v, causal, backend)
            monkeypatch.setattr(_attention_lane, "LANE", True)
        assert torch.equal(got, want) and got.stride() == want.stride()
        ref = reference.attention(q.detach(), k.detach(), v.detach(), causal=causal, bottom_right=bottom_right)
        assert (got - ref).abs().max() < precise_atol(1e-12)
        if grad:
            assert got.grad_fn.name() == want.grad_fn.name()  # the op's node (AttnFwdBackward), or a transpose of it
            assert shell == "flash_attn_func" or got.grad_fn.name() == "AttnFwdBackward"
            dout = torch.randn_like(got)
            g_lane = torch.autograd.grad(got, (q, k, v), dout)
            g_op = torch.autograd.grad(want, (q, k, v), dout)
            for a, b in zip(g_lane, g_op):
                assert torch.equal(a, b) and a.stride() == b.stride()
        else:
            assert got.grad_fn is None
    assert len(lane_runs) == 3


OPTIONS = {  # name: (window_size, softcap): the scalar options a lane keys on
    "window": ((5, 0), 0.0),
    "window-both-sides": ((4, 3), 0.0),
    "softcap": ((-1, -1), 3.0),
    "window-softcap": ((6, -1), 2.5),  # Gemma 2's layers: both
}


def _optioned(shell, window, softcap):
    """(call(q, k, v, causal) on (B, H, S, D) views with window_size and softcap, bottom_right)."""
    if shell == "attention":
        return (lambda q, k, v, causal: flashtx.attention(q, k, v, is_causal=causal, enable_gqa=True,
                                                          window_size=window, softcap=softcap)), False

    def flash(q, k, v, causal):
        t = (x.transpose(1, 2) for x in (q, k, v))
        return flashtx.flash_attn_func(*t, causal=causal, window_size=window, softcap=softcap).transpose(1, 2)
    return flash, True


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])  # (causal sets a window's right to 0)
@pytest.mark.parametrize("grad", [False, True], ids=["no-grad", "grad"])
@pytest.mark.parametrize("option", sorted(OPTIONS))
@pytest.mark.parametrize("shell", ["attention", "flash_attn_func"])
def test_windows_and_softcaps_take_the_lane(shell, option, grad, causal, lane_runs, monkeypatch):
    """A sliding window and a softcap (scalars) are keyed, not refused: three calls with fresh data, outputs and
    gradients bit for bit the general path's, and the float64 reference's; the lane ran them all."""
    window, softcap = OPTIONS[option]
    call, bottom_right = _optioned(shell, window, softcap)
    B, Hq, Hkv, Sq, Sk, D, Dv = CASES["gqa-cross-long-q"]
    for seed in range(3):
        torch.manual_seed(seed)
        q, k, v = _inputs(shell, B, Hq, Hkv, Sq, Sk, D, Dv, grad)
        with torch.set_grad_enabled(grad):
            got = call(q, k, v, causal)
            monkeypatch.setattr(_attention_lane, "LANE", False)
            want = call(q, k, v, causal)
            monkeypatch.setattr(_attention_lane, "LANE", True)
        assert torch.equal(got, want) and got.stride() == want.stride()
        vis = reference.visibility(Sq, Sk, causal=causal, bottom_right=bottom_right, window=window, device=DEVICE)
        ref = reference.attention(q.detach(), k.detach(), v.detach(), vis=vis, softcap=softcap)
        assert (got - ref).abs().max() < precise_atol(1e-12)
        if grad:
            dout = torch.randn_like(got)
            for a, b in zip(torch.autograd.grad(got, (q, k, v), dout), torch.autograd.grad(want, (q, k, v), dout)):
                assert torch.equal(a, b) and a.stride() == b.stride()
    assert len(lane_runs) == 3 and _kinds() == (1, 1 if grad else 0)


def test_each_window_and_softcap_has_its_own_lane(lane_runs):
    """One set of tensors called with each option in turn, twice: each call equals the general path's own answer
    for its option (a key without the window or softcap would replay another option's plan: a wrong answer)."""
    q, k, v = _inputs("attention", 1, 4, 2, 37, 19, 32, 16, True)
    options = [((-1, -1), 0.0), ((4, 2), 0.0), *OPTIONS.values()]  # (4, 2) vs (4, 3): only the right side differs
    for _ in range(2):
        for window, softcap in options:
            call, _ = _optioned("attention", window, softcap)
            got = call(q, k, v, False)
            with torch.no_grad():
                vis = reference.visibility(37, 19, causal=False, window=window, device=DEVICE)
                ref = reference.attention(q, k, v, vis=vis, softcap=softcap)
            assert (got - ref).abs().max() < precise_atol(1e-12), (window, softcap)
    assert len(lane_runs) == 2 * len(options) and _kinds() == (len(options), 0)


@pytest.mark.parametrize("shell", ["attention", "flash_attn_func"])
def test_a_bad_window_or_softcap_gets_the_general_paths_error(shell):
    """Before and after a lane exists for the signature: the same ValueError as with the lanes off."""
    q, k, v = _inputs("attention", 1, 2, 2, 20, 20, 16, 16, False)
    for window, softcap, match in (((-2, 0), 0.0, "window_size must be a pair"), ((4, 0), -1.0, "softcap must be 0"),
                                   ((4, 0), True, "softcap must be 0")):
        for lane_first in (False, True):
            if lane_first:
                _optioned(shell, (4, 0), 0.0)[0](q, k, v, True)
            with pytest.raises(ValueError, match=match):
                _optioned(shell, window, softcap)[0](q, k, v, True)


def _launches(fn):
    calls = []
    with launch.stub_launches(lambda kernel, grid, args: calls.append((kernel, grid, dict(args)))):
        fn()
    return calls


def test_the_lane_launches_what_the_op_launches(monkeypatch):
    """Recorded launches (stubbed): the same kernel, grid and arguments; tensors alike (dtype, shape, strides),
    the inputs themselves (same memory), outputs freshly allocated. And torch's TF32 switch is part of the
    signature: an fp32 call planned with TF32 off is planned again when it is turned on."""
    q, k, v = (randn(1, 2, 20, 16) for _ in range(3))  # float32

    def run():
        return flashtx.attention(q, k, v, is_causal=True)

    monkeypatch.setattr(_attention_lane, "LANE", False)
    want = _launches(run)  # the op's, TF32 off (torch's default)
    monkeypatch.setattr(_attention_lane, "LANE", True)
    for tf32 in (False, True, False):
        monkeypatch.setattr(precision, "allow_tf32", lambda: tf32)
        _launches(run)  # makes the lane (a miss)
        got = _launches(run)
        assert len(got) == len(want) == 1
        (kg, gg, ag), (kw, gw, aw) = got[0], want[0]
        assert kg is kw and gg == gw and ag.keys() == aw.keys()
        for name, a in ag.items():
            b = aw[name]
            if name == "DOT_PREC":
                assert a == ("tf32" if tf32 else "ieee")
            elif isinstance(a, torch.Tensor):
                assert (a.dtype, a.shape, a.stride()) == (b.dtype, b.shape, b.stride()), name
                if name in ("Q", "K", "V"):
                    assert a.data_ptr() == b.data_ptr()
            else:
                assert a == b, name


def _kinds():
    """How many forward and backward lanes the table holds."""
    bwd = sum(1 for key in _lanes.TABLE if key[0] == "attn_bwd")
    return len(_lanes.TABLE) - bwd, bwd


def test_lane_outputs_are_written_in_full():
    """Allocations filled with NaN (poisoned): every output and gradient element is written, by the lanes."""
    q, k, v = (randn(2, 3, 19, 16, dtype=PRECISE_DTYPE, requires_grad=True) for _ in range(3))
    dout = randn(2, 3, 19, 16, dtype=PRECISE_DTYPE)
    with poisoned_allocations():
        for _ in range(2):  # a miss, then a hit
            out = flashtx.attention(q, k, v, is_causal=True)
            grads = torch.autograd.grad(out, (q, k, v), dout)
    assert _kinds() == (1, 1)
    qr, kr, vr = (t.detach().requires_grad_() for t in (q, k, v))
    ref = reference.attention(qr, kr, vr, causal=True)
    assert (out - ref).abs().max() < precise_atol(1e-12)
    for g, r in zip(grads, torch.autograd.grad(ref, (qr, kr, vr), dout)):
        assert (g - r).abs().max() < precise_atol(1e-11)


@pytest.mark.parametrize("shell", ["attention", "flash_attn_func"])
def test_the_backward_lane_fires_the_ops_own_backward_entry(shell, monkeypatch):
    """A lane's backward runs the launch entry that the op's backward (flashtx::attn_bwd) replays for the same
    tensors: the very object in the launch cache, found there after a general-path backward. The op's backward
    is not called while the lane takes it; the gradients equal the op's bit for bit."""
    from flashtx.triton_kernels.launch import LAUNCHES

    call, _ = _shell(shell)
    q, k, v = _inputs(shell, 1, 4, 2, 21, 21, 16, 16, True)
    dout = randn(1, 21, 4, 16, dtype=PRECISE_DTYPE).transpose(1, 2)  # (B, S, H, D) memory, as a model's
    monkeypatch.setattr(_attention_lane, "LANE", False)
    want = torch.autograd.grad(call(q, k, v, True, None), (q, k, v), dout)
    entries = {id(e) for e in LAUNCHES.entries.values()}
    monkeypatch.setattr(_attention_lane, "LANE", True)
    op_backwards = count_calls(monkeypatch, _attention_lane, "_backward")
    for _ in range(2):
        got = torch.autograd.grad(call(q, k, v, True, None), (q, k, v), dout)
        for a, b in zip(got, want):
            assert torch.equal(a, b) and a.stride() == b.stride()
    (bwd,) = [lane for key, lane in _lanes.TABLE.items() if key[0] == "attn_bwd"]
    assert id(bwd) in entries and op_backwards == []


def test_backwards_the_lane_must_not_take(monkeypatch):
    """The op's backward runs (and no backward lane is made) under saved-tensor hooks (checkpointing, offloading:
    they may unpack other tensors) and with the lanes off; a dout with a strided last dim (out.sum()'s expanded
    ones) takes the backward lane, copied first as the backend copies it; and the gradients are right each time."""
    from torch.utils.checkpoint import checkpoint

    q, k, v = (randn(1, 2, 20, 16, dtype=PRECISE_DTYPE, requires_grad=True) for _ in range(3))
    qr, kr, vr = (t.detach().requires_grad_() for t in (q, k, v))
    ref = reference.attention(qr, kr, vr, causal=True)
    dout = randn(1, 2, 20, 16, dtype=PRECISE_DTYPE)
    want = torch.autograd.grad(ref, (qr, kr, vr), dout, retain_graph=True)
    want_sum = torch.autograd.grad(ref.sum(), (qr, kr, vr))
    op_backwards = count_calls(monkeypatch, _attention_lane, "_backward")

    def fwd(*t):
        return flashtx.attention(*t, is_causal=True)

    runs = [(lambda: torch.autograd.grad(fwd(q, k, v).sum(), (q, k, v)), want_sum)]
    relaid = lambda t: t.transpose(1, 2).contiguous().transpose(1, 2) if t.dim() == 4 else t.clone()  # noqa: E731
    with torch.autograd.graph.saved_tensors_hooks(relaid, lambda t: t):  # unpacks other strides than saved
        out = fwd(q, k, v)
    runs.append((lambda: torch.autograd.grad(out, (q, k, v), dout), want))
    runs.append((lambda: torch.autograd.grad(checkpoint(fwd, q, k, v, use_reentrant=False), (q, k, v), dout), want))
    for run, expected in runs:
        for g, r in zip(run(), expected):
            assert (g - r).abs().max() < precise_atol(1e-11)
    assert len(op_backwards) == 2 and _kinds() == (1, 1)  # (the sum's backward: a lane for the copy's strides)
    out = fwd(q, k, v)
    monkeypatch.setattr(_attention_lane, "LANE", False)
    for g, r in zip(torch.autograd.grad(out, (q, k, v), dout), want):
        assert (g - r).abs().max() < precise_atol(1e-11)
    assert len(op_backwards) == 3 and _kinds() == (1, 1)


def test_each_dout_layout_gets_its_own_backward_lane():
    """Two backwards through one graph (retain_graph), with a dout of (B, H, S, D) memory and one of (B, S, H, D)
    memory: each is planned for its own strides (review: a key without dout's strides replayed the first plan
    for the second and got wrong gradients)."""
    q, k, v = (randn(1, 3, 20, 16, dtype=PRECISE_DTYPE, requires_grad=True) for _ in range(3))
    qr, kr, vr = (t.detach().requires_grad_() for t in (q, k, v))
    out, ref = flashtx.attention(q, k, v, is_causal=True), reference.attention(qr, kr, vr, causal=True)
    for dout in (randn(1, 3, 20, 16, dtype=PRECISE_DTYPE), randn(1, 20, 3, 16, dtype=PRECISE_DTYPE).transpose(1, 2)):
        got = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
        for g, r in zip(got, torch.autograd.grad(ref, (qr, kr, vr), dout, retain_graph=True)):
            assert (g - r).abs().max() < precise_atol(1e-11)
    assert _kinds() == (1, 2)


def test_create_graph_with_a_dense_dout_gets_the_ops_refusal():
    """create_graph=True with a dout the lane could take (unit last stride): the op's double-backward refusal, as
    with the lanes off (review: the refusal test's out.sum() never reached the lane's grad-mode check)."""
    q, k, v = (randn(1, 2, 18, 16, dtype=PRECISE_DTYPE, requires_grad=True) for _ in range(3))
    dout = randn(1, 2, 18, 16, dtype=PRECISE_DTYPE)
    out = flashtx.attention(q, k, v, is_causal=True)
    torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)  # makes the backward lane
    assert _kinds() == (1, 1)
    (dq,) = torch.autograd.grad(out, q, dout, create_graph=True)
    with pytest.raises(NotImplementedError, match="no double backward"):
        dq.sum().backward()


def test_a_saved_tensor_whose_data_was_swapped_is_read_as_it_is_now():
    """q.data replaced between forward and backward (no version bump; .data is unsafe API) by a tensor of other
    strides or a smaller storage: the backward reads q as it is now (the op's backward), never with the strides
    the forward planned (review: the lane read past the new storage)."""
    k, v = (randn(1, 4, 4, 16, dtype=PRECISE_DTYPE, requires_grad=True) for _ in range(2))
    dout = randn(1, 4, 4, 16, dtype=PRECISE_DTYPE)
    q0 = randn(1, 4, 4, 16, dtype=PRECISE_DTYPE)
    torch.autograd.grad(flashtx.attention(q0, k, v), (k, v), dout)  # the lanes, for q's own strides
    for new in (randn(1, 4, 4, 16, dtype=PRECISE_DTYPE).transpose(1, 2), randn(16, dtype=PRECISE_DTYPE).expand(
            1, 4, 4, 16)):
        for lane in (False, True):
            q = q0.clone()
            out = flashtx.attention(q, k, v)
            q.data = new
            _attention_lane.LANE = lane
            try:
                grads = torch.autograd.grad(out, (k, v), dout)
            finally:
                _attention_lane.LANE = True
            if not lane:
                want = grads
        assert all(torch.equal(a, b) for a, b in zip(grads, want))


def test_a_saved_tensor_swapped_for_another_dtype_goes_to_the_ops_backward(monkeypatch):
    """q.data replaced by a tensor of the same shape and strides in another dtype: the lane's backward, planned for
    the forward's dtype, does not take it (on a GPU a direct launch would run the kernel compiled for that dtype on
    the new memory; the interpreter would not notice): the op's backward runs, whatever it makes of the call."""
    k, v = (randn(1, 4, 4, 16, dtype=PRECISE_DTYPE, requires_grad=True) for _ in range(2))
    dout = randn(1, 4, 4, 16, dtype=PRECISE_DTYPE)
    torch.autograd.grad(flashtx.attention(randn(1, 4, 4, 16, dtype=PRECISE_DTYPE), k, v), (k, v), dout)  # the lanes
    q = randn(1, 4, 4, 16, dtype=PRECISE_DTYPE)
    out = flashtx.attention(q, k, v)
    q.data = q.data.to(torch.float32 if PRECISE_DTYPE != torch.float32 else torch.float64)
    op_backwards = count_calls(monkeypatch, _attention_lane, "_backward")
    try:
        torch.autograd.grad(out, (k, v), dout)
    except Exception:  # noqa: BLE001  (the op's backward may refuse the mixed dtypes, in any way the kernels do)
        pass
    assert len(op_backwards) == 1


def test_a_backward_planned_after_a_clear_follows_the_new_plan(monkeypatch):
    """Plans dropped between a forward and its backward, and the backend choice now another (here: the planner
    stood in to pick the reference): the backward is planned again, as the op's is, and the lane does not take it."""
    q, k, v = (randn(1, 2, 18, 16, dtype=PRECISE_DTYPE, requires_grad=True) for _ in range(3))
    dout = randn(1, 2, 18, 16, dtype=PRECISE_DTYPE)
    out = flashtx.attention(q, k, v, is_causal=True)
    _dispatch.clear_plans()
    monkeypatch.setattr(_attention_lane, "_plan", lambda *a: "reference")
    op_backwards = count_calls(monkeypatch, _attention_lane, "_backward")
    torch.autograd.grad(out, (q, k, v), dout)
    assert len(op_backwards) == 1 and _kinds() == (0, 1) and not any(_lanes.TABLE.values())


def test_the_backward_lane_reads_tf32_at_backward_time(monkeypatch):
    """The backward reads torch's TF32 switch when it runs (as the op's does): a switch turned on between an fp32
    forward and its backward gives the backward TF32 dots, through another backward lane."""
    q, k, v = (randn(1, 2, 20, 16, requires_grad=True) for _ in range(3))  # float32
    dout = randn(1, 2, 20, 16)
    precs = []
    for tf32 in (False, True, False):
        out = flashtx.attention(q, k, v, is_causal=True)
        monkeypatch.setattr(precision, "allow_tf32", lambda: tf32)
        with launch.stub_launches(lambda kernel, grid, args: precs.append(args.get("DOT_PREC"))):
            torch.autograd.grad(out, (q, k, v), dout)
        monkeypatch.setattr(precision, "allow_tf32", lambda: False)
    assert precs[1:3] == ["ieee", "ieee"] and precs[4:6] == ["tf32", "tf32"] and precs[7:9] == ["ieee", "ieee"]
    assert _kinds() == (1, 2)


def test_the_lane_gradient_refuses_double_backward_as_the_op_does(monkeypatch):
    q, k, v = (randn(1, 2, 18, 16, dtype=PRECISE_DTYPE, requires_grad=True) for _ in range(3))
    for lane in (True, False):
        monkeypatch.setattr(_attention_lane, "LANE", lane)
        out = flashtx.attention(q, k, v, is_causal=True)
        (dq,) = torch.autograd.grad(out.sum(), q, create_graph=True)
        with pytest.raises(NotImplementedError, match="no double backward"):
            dq.sum().backward()
    # and a saved input changed in place before the backward is caught, as for any saved tensor
    out = flashtx.attention(q, k, v, is_causal=True)
    with torch.no_grad():
        k.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def test_the_lane_gradient_reaches_only_what_requires_grad():
    q = randn(1, 2, 18, 16, dtype=PRECISE_DTYPE)
    k, v = (randn(1, 2, 18, 16, dtype=PRECISE_DTYPE, requires_grad=True) for _ in range(2))
    for _ in range(2):
        out = flashtx.attention(q, k, v)
        dk, dv = torch.autograd.grad(out.square().sum(), (k, v))
    kr, vr = (t.detach().requires_grad_() for t in (k, v))
    ref = reference.attention(q, kr, vr)
    rk, rv = torch.autograd.grad(ref.square().sum(), (kr, vr))
    assert (dk - rk).abs().max() < precise_atol(1e-11) and (dv - rv).abs().max() < precise_atol(1e-11)
    assert q.grad is None and _kinds() == (1, 1)


def test_calls_the_lane_must_not_take(lane_runs, routes):
    """The small-query decode route's calls, strided last dims, masks and options, the reference backend: the
    general path runs them (and no lane of this module is made for them: the route's calls get their own,
    flashtx._small_q_lane), with the right result."""
    q1 = randn(2, 3, 2, 16, dtype=PRECISE_DTYPE).transpose(1, 2)  # laid out (B, S, H, D), as the route wants
    k1 = randn(2, 2, 40, 16, dtype=PRECISE_DTYPE)
    for _ in range(2):
        out = flashtx.attention(q1, k1, k1)  # Sq = 3 over 40 keys, no grad: the decode kernels
    assert routes == ["decode", "decode"]
    assert (out - reference.attention(q1, k1, k1)).abs().max() < precise_atol(1e-12)

    x = randn(1, 2, 20, 32, dtype=PRECISE_DTYPE)[..., ::2]  # last stride 2: the backend copies it
    keep = torch.ones(1, 20, dtype=torch.bool, device=DEVICE)
    for _ in range(2):
        strided = flashtx.attention(x, x, x, is_causal=True)
        masked = flashtx.attention(x, x, x, is_causal=True, key_mask=keep)
        lse = flashtx.attention(x, x, x, is_causal=True, return_lse=True)[0]
        named = flashtx.attention(x, x, x, is_causal=True, backend="reference")
    assert lane_runs == [] and not any(lane for key, lane in _lanes.TABLE.items() if key[0] != "small_q")
    want = reference.attention(x, x, x, causal=True)
    for got in (strided, masked, lse, named):
        assert (got - want).abs().max() < precise_atol(1e-12)


@pytest.mark.parametrize("gpu_target", [86], indirect=True, ids=lambda a: f"sm_{a}")
def test_lanes_are_forgotten_with_the_plans_and_made_by_no_tuner(gpu_target, lane_runs):
    """clear_plans (and LaunchCache.clear) drop every lane; while a tuner forces configs (LaunchCache off) a
    lane is neither used nor made, so the forced tile is what runs (sm_86's plans: the tuner's hook serves GPU
    targets)."""
    q = randn(1, 2, 24, 16, dtype=PRECISE_DTYPE)
    flashtx.attention(q, q, q, is_causal=True)
    assert len(_lanes.TABLE) == 1 and len(lane_runs) == 1
    _dispatch.clear_plans()
    assert len(_lanes.TABLE) == 0
    flashtx.attention(q, q, q, is_causal=True)
    assert len(_lanes.TABLE) == 1

    tile = TileConfig(16, 16, 1, 1, "test: a forced tile")
    blocks = []
    with autotune.forced("attn_fwd", tile), launch.stub_launches(
            lambda kernel, grid, args: blocks.append((args["BLOCK_M"], args["BLOCK_N"]))):
        assert len(_lanes.TABLE) == 0  # dropped when the tuner starts
        flashtx.attention(q, q, q, is_causal=True)
        flashtx.attention(q, q, q, is_causal=True)
        assert len(_lanes.TABLE) == 0
    assert blocks == [(16, 16), (16, 16)] and len(lane_runs) == 2


@pytest.mark.parametrize("gpu_target", [86], indirect=True, ids=lambda a: f"sm_{a}")
def test_a_tuner_forcing_a_backward_tile_bypasses_the_backward_lane(gpu_target):
    """A backward run while a tuner forces the dK/dV tile (the launch cache off) launches the forced tile, though
    its forward came from a lane and an earlier backward of the signature made a backward lane."""
    q, k, v = (randn(1, 2, 24, 16, dtype=PRECISE_DTYPE, requires_grad=True) for _ in range(3))
    dout = randn(1, 2, 24, 16, dtype=PRECISE_DTYPE)
    torch.autograd.grad(flashtx.attention(q, k, v, is_causal=True), (q, k, v), dout)
    assert _kinds() == (1, 1)
    out = flashtx.attention(q, k, v, is_causal=True)
    blocks = []
    with autotune.forced("attn_bwd_dkdv", TileConfig(16, 16, 1, 1, "test: a forced tile")), launch.stub_launches(
            lambda kernel, grid, args: blocks.append((args.get("BLOCK_M"), args.get("BLOCK_N")))):
        torch.autograd.grad(out, (q, k, v), dout)
        assert _kinds() == (0, 0)
    assert blocks[1] == (16, 16), blocks  # preprocess, dK/dV, dQ


class _Logged(torch.Tensor):
    """A __torch_function__ subclass that records what it sees."""
    seen: list = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        cls.seen.append(getattr(func, "__name__", str(func)))
        return super().__torch_function__(func, types, args, kwargs or {})


def test_tensor_subclasses_go_through_the_registered_op(lane_runs):
    """flash_attn_func takes subclasses (isinstance checks): they run the op (its own dispatch, which a subclass
    sees), never a lane a plain call of that signature made; and a call with Parameters leaves the signature's
    lane to plain calls (review: the first made a stored refusal that kept every later plain call out)."""
    x = [randn(1, 20, 2, 16, dtype=PRECISE_DTYPE) for _ in range(3)]
    flashtx.flash_attn_func(*x)  # makes the lane
    _Logged.seen.clear()
    out = flashtx.flash_attn_func(*(t.as_subclass(_Logged) for t in x))
    assert any("attn_fwd" in s for s in _Logged.seen) and type(out) is _Logged and len(lane_runs) == 1
    _dispatch.clear_plans()
    params = [torch.nn.Parameter(t.clone()) for t in x]
    flashtx.flash_attn_func(*params).sum().backward()
    assert len(lane_runs) == 1 and all(p.grad is not None for p in params)
    for t in x:
        t.requires_grad_()
    flashtx.flash_attn_func(*x)
    assert len(lane_runs) == 2


def test_torchs_newer_tf32_api_is_read(monkeypatch, lane_runs):
    """torch.backends.cuda.matmul.fp32_precision = "tf32" (torch >= 2.9's API) makes torch's old allow_tf32
    getter raise: fp16/fp64 calls must not read it (review: the lane's key did, for every dtype), and fp32
    calls follow the new switch."""
    if not hasattr(torch.backends.cuda.matmul, "fp32_precision"):
        pytest.skip("this torch has only allow_tf32")
    prev = torch.backends.cuda.matmul.fp32_precision
    torch.backends.cuda.matmul.fp32_precision = "tf32"
    try:
        q = randn(1, 2, 20, 16, dtype=PRECISE_DTYPE)
        for _ in range(2):
            out = flashtx.attention(q, q, q)
        assert (out - reference.attention(q, q, q)).abs().max() < precise_atol(1e-12) and len(lane_runs) == 2
        x = randn(1, 2, 20, 16)  # float32
        assert precision.dot_precision(torch.float32) == "tf32"
        flashtx.attention(x, x, x)
        precs = []
        with launch.stub_launches(lambda kernel, grid, args: precs.append(args["DOT_PREC"])):
            flashtx.attention(x, x, x)
        assert precs == ["tf32"] and len(lane_runs) == 4
    finally:
        torch.backends.cuda.matmul.fp32_precision = prev
    assert precision.dot_precision(torch.float32) == ("tf32" if prev == "tf32" else "ieee")


def test_the_small_query_bound_is_read_per_call(monkeypatch, routes):
    """A no-grad call of 20 queries over 30 keys takes a lane; with the small-query route's bound raised past 20,
    the same signature goes to the decode kernels, as the general path sends it."""
    q = randn(1, 20, 2, 16, dtype=PRECISE_DTYPE).transpose(1, 2)  # (B, S, H, D) memory: the route's layout
    k = randn(1, 2, 30, 16, dtype=PRECISE_DTYPE)
    flashtx.attention(q, k, k)
    monkeypatch.setattr(_small_q, "SMALL_Q_MAX", 32)
    out = flashtx.attention(q, k, k)
    assert routes == ["train", "decode"]
    assert (out - reference.attention(q, k, k)).abs().max() < precise_atol(1e-12)


def test_a_lane_made_across_a_clear_is_not_kept(monkeypatch, lane_runs):
    """Another thread's clear_plans (here inside the lane's making, after it read the launch entry) drops what
    the lane was made from: the lane is not kept, and later calls are planned afresh (a flag that clear_plans
    made effective, split head dims, is what they launch)."""
    from flashtx.triton_kernels import attention_fwd

    q = randn(1, 2, 20, 48, dtype=PRECISE_DTYPE)  # head dim 48: one tile of 64, or (32, 16) split
    real = attention_fwd.forward_entry

    def entry_then_another_thread_clears(*a, **kw):
        e = real(*a, **kw)
        monkeypatch.setattr(launch, "SPLIT_HEAD_DIMS", True)
        _dispatch.clear_plans()
        return e

    monkeypatch.setattr(attention_fwd, "forward_entry", entry_then_another_thread_clears)
    out = flashtx.attention(q, q, q)
    monkeypatch.setattr(attention_fwd, "forward_entry", real)
    assert len(_lanes.TABLE) == 0 and lane_runs == []
    assert (out - reference.attention(q, q, q)).abs().max() < precise_atol(1e-12)
    blocks = []
    with launch.stub_launches(lambda kernel, grid, args: blocks.append((args["BLOCK_DQK"], args["BLOCK_DQK2"]))):
        flashtx.attention(q, q, q)
        flashtx.attention(q, q, q)
    assert blocks == [(32, 16), (32, 16)] and len(lane_runs) == 2  # a new lane, made now
