"""flashtx._attention_lane.forward_op: attention calls with option tensors (the padded shells' key/query masks,
lengths, attn_mask, ALiBi slopes and dropout; varlen's cu_seqlens) planned once per call signature, keyed by the
tensors' layouts and never by their values. Each must compute exactly what the flashtx::attn_fwd op computes on the
same arguments, with the op's own launch entries, forward and backward; and leave to the op what it must."""
import pytest
import torch

import flashtx
from flashtx import _attention_lane, _lanes, reference
from flashtx.triton_kernels.launch import LAUNCHES

from conftest import DEVICE, PRECISE_DTYPE, count_calls, poisoned_allocations, precise_atol, randn

pytestmark = pytest.mark.usefixtures("fresh_plans")

B, HQ, HKV, SQ, SK, D = 2, 4, 2, 21, 27, 16


def _qkv(grad, bshd=False):
    """Fresh (B, H, S, D) views of (B, S, H, D) memory (as a model's q.transpose(1, 2)), or the (B, S, H, D)
    tensors themselves with bshd."""
    ts = (randn(B, SQ, HQ, D, dtype=PRECISE_DTYPE), randn(B, SK, HKV, D, dtype=PRECISE_DTYPE),
          randn(B, SK, HKV, D, dtype=PRECISE_DTYPE))
    ts = ts if bshd else tuple(t.transpose(1, 2) for t in ts)
    return tuple(t.requires_grad_(grad) for t in ts)


def _lens(n, lo, hi):
    return torch.randint(lo, hi + 1, (n,), dtype=torch.int32, device=DEVICE)


def _key_mask():
    m = torch.rand(B, SK, device=DEVICE) > 0.3
    m[:, 0] = True  # every row sees a key (rows that see none are 0 either way; this keeps the reference simple)
    return m


# name: (shell, causal, kwargs(): the option tensors, fresh values each call). Shells: "sdpa" is flashtx.attention
# on (B, H, S, D) views, "flash" flash_attn_func on (B, S, H, D) tensors.
OPTIONS = {
    "key_mask": ("sdpa", True, lambda: dict(key_mask=_key_mask())),
    "key_mask+window": ("flash", True, lambda: dict(key_mask=_key_mask(), window_size=(7, 0))),  # transformers'
    "query_mask": ("flash", False, lambda: dict(query_mask=torch.rand(B, SQ, device=DEVICE) > 0.2)),
    "lens": ("flash", True, lambda: dict(q_lens=_lens(B, 1, SQ), kv_lens=_lens(B, 1, SK))),
    "bool_attn_mask": ("sdpa", False, lambda: dict(attn_mask=torch.rand(B, 1, SQ, SK, device=DEVICE) > 0.2)),
    "float_attn_mask": ("sdpa", True, lambda: dict(attn_mask=randn(1, HQ, SQ, SK, dtype=PRECISE_DTYPE))),
    "alibi": ("flash", True, lambda: dict(alibi_slopes=torch.rand(HQ, device=DEVICE, dtype=torch.float32))),
    "dropout": ("sdpa", False, lambda: dict(dropout_p=0.25)),
    "attn_bias+softcap": ("flash", False, lambda: dict(attn_bias=randn(B, 1, 1, SK, dtype=PRECISE_DTYPE),
                                                       softcap=4.0)),
}


def _call(shell, q, k, v, causal, kw):
    if shell == "sdpa":
        return flashtx.attention(q, k, v, is_causal=causal, enable_gqa=True, **kw)
    return flashtx.flash_attn_func(q, k, v, causal=causal, **kw)


@pytest.fixture
def lane_runs(monkeypatch):
    return count_calls(monkeypatch, _attention_lane._Lane, "run")


def _both(monkeypatch, fn, seed):
    """fn() through the lanes, then with them off (the op), each after torch.manual_seed(seed) (dropout's seed)."""
    torch.manual_seed(seed)
    got = fn()
    monkeypatch.setattr(_attention_lane, "LANE", False)
    torch.manual_seed(seed)
    want = fn()
    monkeypatch.setattr(_attention_lane, "LANE", True)
    return got, want


def _same_grads(got, want, inputs):
    dout = torch.randn_like(got)
    for a, b in zip(torch.autograd.grad(got, inputs, dout), torch.autograd.grad(want, inputs, dout)):
        assert torch.equal(a, b) and a.stride() == b.stride()


@pytest.mark.parametrize("grad", [False, True], ids=["no-grad", "grad"])
@pytest.mark.parametrize("option", sorted(OPTIONS))
def test_option_tensors_take_the_lane_and_compute_what_the_op_computes(option, grad, lane_runs, monkeypatch):
    """Three calls of one signature, each with fresh inputs and fresh option values (masks, lengths, biases,
    slopes, dropout seeds): outputs and gradients equal the op's bit for bit (the values are read each call, not
    planned), and every call ran through one lane (one forward lane, one backward lane)."""
    shell, causal, options = OPTIONS[option]
    for seed in range(3):
        q, k, v = _qkv(grad, bshd=shell == "flash")
        kw = options()
        with torch.set_grad_enabled(grad):
            got, want = _both(monkeypatch, lambda: _call(shell, q, k, v, causal, kw), seed)
        assert torch.equal(got, want) and got.stride() == want.stride()
        if grad:
            assert got.grad_fn.name() == want.grad_fn.name() == "AttnFwdBackward"
            _same_grads(got, want, (q, k, v))
        else:
            assert got.grad_fn is None
    assert len(lane_runs) == 3
    fwd = [key for key in _lanes.TABLE if key[0] == "attn_fwd_masks"]
    bwd = [key for key in _lanes.TABLE if key[0] == "attn_bwd"]
    assert len(fwd) == 1 and len(bwd) == (1 if grad else 0)


def test_the_lane_reads_each_calls_mask_against_the_reference():
    """Independent of the op: a key mask that changes each call, through the lane, against the float64
    reference (outputs and gradients)."""
    for _ in range(3):
        q, k, v = _qkv(True)
        km = _key_mask()
        out = flashtx.attention(q, k, v, is_causal=True, enable_gqa=True, key_mask=km)
        dout = randn(*out.shape, dtype=PRECISE_DTYPE)
        grads = torch.autograd.grad(out, (q, k, v), dout)
        qr, kr, vr = (t.detach().requires_grad_() for t in (q, k, v))
        vis = reference.visibility(SQ, SK, batch=B, causal=True, key_mask=km, device=DEVICE)
        ref = reference.attention(qr, kr, vr, vis=vis)
        assert (out - ref).abs().max() < precise_atol(1e-12)
        for g, r in zip(grads, torch.autograd.grad(ref, (qr, kr, vr), dout)):
            assert (g - r).abs().max() < precise_atol(1e-11)
    assert sum(1 for key in _lanes.TABLE if key[0] == "attn_fwd_masks") == 1


def _varlen_inputs(grad, nseq=3):
    """Packed q, k, v (total, H, D) with fresh lengths: (q, k, v, cu_q, cu_k, max_q, max_k). Totals fixed (SQ,
    SK) so the lengths, not the shapes, change between calls."""
    def cu(total):
        cuts = torch.sort(torch.randint(0, total + 1, (nseq - 1,))).values
        return torch.cat([torch.tensor([0]), cuts, torch.tensor([total])]).to(DEVICE, torch.int32)
    cq, ck = cu(SQ), cu(SK)
    q = randn(SQ, HQ, D, dtype=PRECISE_DTYPE, requires_grad=grad)
    k, v = (randn(SK, HKV, D, dtype=PRECISE_DTYPE, requires_grad=grad) for _ in range(2))
    return q, k, v, cq, ck


@pytest.mark.parametrize("values", ["host", "device"])
@pytest.mark.parametrize("same_cu", [False, True], ids=["cross", "self"])
@pytest.mark.parametrize("grad", [False, True], ids=["no-grad", "grad"])
def test_varlen_takes_the_lane(grad, same_cu, values, lane_runs, monkeypatch, request):
    """flash_attn_varlen_func: three batches of one total with fresh sequence lengths (one cu_seqlens tensor in
    both roles, or two): bit for bit the op's outputs and gradients, and the float64 reference's. values="device":
    the cu_seqlens values checked on the device, as a GPU does (forced on CPU)."""
    on_device = values == "device" or DEVICE != "cpu"
    if values == "device":
        from flashtx import _validate
        request.getfixturevalue("cuda_assert_rule")
        monkeypatch.setattr(_validate, "_values_readable", lambda t: False)
    for seed in range(3):
        q, k, v, cq, ck = _varlen_inputs(grad)
        if same_cu:
            k, v = (randn(SQ, HKV, D, dtype=PRECISE_DTYPE, requires_grad=grad) for _ in range(2))
            ck = cq

        def run():
            return flashtx.flash_attn_varlen_func(q, k, v, cq, ck, SQ, k.shape[0], causal=True)

        with torch.set_grad_enabled(grad):
            got, want = _both(monkeypatch, run, seed)
        assert torch.equal(got, want) and got.stride() == want.stride()
        vis = reference.varlen_visibility(cq, ck, SQ, k.shape[0], causal=True, device=DEVICE)
        ref = reference.attention(*(t.detach().transpose(0, 1)[None] for t in (q, k, v)), vis=vis)[0].transpose(0, 1)
        assert (got - ref).abs().max() < precise_atol(1e-12)
        if grad:  # the lane's node takes the packed tensors themselves: no unsqueeze or select nodes around it
            assert got.grad_fn.name() == "AttnFwdBackward" and got.grad_fn.next_functions[0][0].variable is q
            _same_grads(got, want, (q, k, v))
    assert len(lane_runs) == 3
    # on a GPU the cu_seqlens values are checked on the device, by a lane of their own (_validate._check_lane: the
    # check kernel and its asserts); CPU reads them on the host (2026-12-06, an H100: this expected CPU's list)
    planned = sorted(key[0] for key in _lanes.TABLE if key[0] != "attn_bwd")
    assert planned == (["attn_varlen", "cu_seqlens_check"] if on_device else ["attn_varlen"])


def test_varlen_backwards_the_lane_must_not_take(monkeypatch):
    """The packed lane's node, where its backward lane declines (saved-tensor hooks, create_graph), runs the op's
    backward on the (1, total, H, D) views: the op's gradients, and its refusal of a double backward. A dout with a
    strided last dim (out.sum()'s) takes the backward lane, copied first: the op's gradients, bit for bit."""
    q, k, v, cq, ck = _varlen_inputs(True)
    dout = randn(SQ, HQ, D, dtype=PRECISE_DTYPE)

    def fwd():
        return flashtx.flash_attn_varlen_func(q, k, v, cq, ck, SQ, SK, causal=True)

    def runs():
        yield torch.autograd.grad(fwd().sum(), (q, k, v))  # expanded ones: last stride 0
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t.clone(), lambda t: t):
            out = fwd()
        yield torch.autograd.grad(out, (q, k, v), dout)

    got = list(runs())
    monkeypatch.setattr(_attention_lane, "LANE", False)
    want = list(runs())
    for a, b in zip(got, want):
        for ga, gb in zip(a, b):
            assert torch.equal(ga, gb)
    monkeypatch.setattr(_attention_lane, "LANE", True)
    assert len([key for key in _lanes.TABLE if key[0] == "attn_bwd"]) == 1  # the sum's (its copy's strides)
    (dq,) = torch.autograd.grad(fwd().square().sum(), q, create_graph=True)
    with pytest.raises(NotImplementedError, match="no double backward"):
        dq.sum().backward()


def test_the_backward_lane_fires_the_ops_own_entry_and_never_the_ops_backward(monkeypatch):
    """With a key mask: the backward lane's entry is the very launch-cache entry the op's backward replays, and
    the op's backward is not called while the lane takes it."""
    q, k, v = _qkv(True)
    km = _key_mask()
    dout = randn(B, HQ, SQ, D, dtype=PRECISE_DTYPE)
    monkeypatch.setattr(_attention_lane, "LANE", False)
    want = torch.autograd.grad(flashtx.attention(q, k, v, enable_gqa=True, key_mask=km), (q, k, v), dout)
    entries = {id(e) for e in LAUNCHES.entries.values()}
    monkeypatch.setattr(_attention_lane, "LANE", True)
    op_backwards = count_calls(monkeypatch, _attention_lane, "_backward")
    for _ in range(2):
        got = torch.autograd.grad(flashtx.attention(q, k, v, enable_gqa=True, key_mask=km), (q, k, v), dout)
        for a, b in zip(got, want):
            assert torch.equal(a, b)
    (bwd,) = [lane for key, lane in _lanes.TABLE.items() if key[0] == "attn_bwd"]
    (fwd,) = [lane for key, lane in _lanes.TABLE.items() if key[0] == "attn_fwd_masks"]
    assert id(bwd) in entries and id(fwd.entry) in entries and op_backwards == []


def test_calls_the_masked_lane_leaves_to_the_op(lane_runs):
    """lse or probabilities returned, a strided last dim: the op runs them, no lane is made, and the results are
    right."""
    q, k, v = _qkv(True)
    km = _key_mask()
    for _ in range(2):
        out, lse = flashtx.attention(q, k, v, enable_gqa=True, key_mask=km, return_lse=True)
        x = randn(B, HQ, SQ, 2 * D, dtype=PRECISE_DTYPE)[..., ::2]
        strided = flashtx.attention(x, x, x, key_mask=torch.ones(B, SQ, dtype=torch.bool, device=DEVICE))
    assert lane_runs == [] and not any(_lanes.TABLE.values())
    qd, kd, vd = (t.detach() for t in (q, k, v))
    vis = reference.visibility(SQ, SK, batch=B, key_mask=km, device=DEVICE)
    ref, ref_lse = reference.attention(qd, kd, vd, vis=vis, return_lse=True)
    assert (out - ref).abs().max() < precise_atol(1e-12) and (lse - ref_lse).abs().max() < precise_atol(1e-12)
    assert (strided - reference.attention(x, x, x)).abs().max() < precise_atol(1e-12)


@pytest.mark.parametrize("shape", [(1, HQ, SQ, SK), (B, 1, 1, SK), (SQ, SK), "expanded"],
                         ids=lambda s: s if isinstance(s, str) else "x".join(map(str, s)))
def test_a_learned_bias_takes_the_lane_and_gets_the_ops_gradient(shape, lane_runs, monkeypatch):
    """An attn_mask that requires grad (a relative-position bias, a padding bias, one shared by batch and heads):
    three calls of one signature with fresh values take one lane, whose node (named as the op's) returns the
    bias's gradient too; outputs and every gradient equal the op's bit for bit, with its strides, and the bias's
    equals the float64 reference's."""
    for seed in range(3):
        q, k, v = _qkv(True)
        if shape == "expanded":  # a (1, H, 1, Sk) leaf seen as (B, H, Sq, Sk): stride 0 on batch and queries
            leaf = randn(1, HQ, 1, SK, dtype=PRECISE_DTYPE, requires_grad=True)
            bias = leaf.expand(B, HQ, SQ, SK)
        else:
            bias = leaf = randn(*shape, dtype=PRECISE_DTYPE, requires_grad=True)
        got, want = _both(monkeypatch, lambda: flashtx.attention(q, k, v, attn_mask=bias, enable_gqa=True), seed)
        assert torch.equal(got, want) and got.grad_fn.name() == want.grad_fn.name() == "AttnFwdBackward"
        _same_grads(got, want, (q, k, v, leaf))
    assert len(lane_runs) == 3 and len([key for key in _lanes.TABLE if key[0] == "attn_fwd_masks"]) == 1
    assert [bool(e) for key, e in _lanes.TABLE.items() if key[0] == "attn_bwd"] == [True]  # its backward's too
    qd, kd, vd = (t.detach() for t in (q, k, v))
    # a dout with a strided last dim: the lane's backward copies it (as the backend does) and fires its entry
    got = flashtx.attention(q, k, v, attn_mask=bias, enable_gqa=True)
    dout = torch.randn(*got.shape[:-1], 2 * got.shape[-1], dtype=got.dtype, device=DEVICE)[..., ::2]
    fired, fire = [], _lanes.fire
    with monkeypatch.context() as m:
        m.setattr(_lanes, "fire", lambda *a: fired.append(1) or fire(*a))
        strided = torch.autograd.grad(got, (q, k, v, bias), dout)
    assert fired == [1]
    assert all(torch.equal(a, b) for a, b in zip(strided, torch.autograd.grad(
        flashtx.attention(q, k, v, attn_mask=bias, enable_gqa=True), (q, k, v, bias), dout.contiguous())))
    br = bias.detach().requires_grad_()
    db = torch.autograd.grad(flashtx.attention(q, k, v, attn_mask=bias, enable_gqa=True).sum(), bias)[0]  # (a lane)
    assert (db - torch.autograd.grad(reference.attention(qd, kd, vd, bias=br).sum(), br)[0]).abs().max() < \
        precise_atol(1e-11)


def test_a_learned_bias_alone_requiring_grad_takes_the_lane(lane_runs, monkeypatch):
    """q, k, v without grad, the bias with it (a bias tuned on frozen features): the lane's node, the bias's
    gradient equal to the op's bit for bit, the q, k, v gradients never asked for."""
    q, k, v = _qkv(False)
    bias = randn(1, HQ, SQ, SK, dtype=PRECISE_DTYPE, requires_grad=True)
    got, want = _both(monkeypatch, lambda: flashtx.attention(q, k, v, attn_mask=bias, enable_gqa=True), 0)
    assert torch.equal(got, want) and got.grad_fn.name() == want.grad_fn.name() == "AttnFwdBackward"
    _same_grads(got, want, (bias,))
    assert len(lane_runs) == 1 and [bool(e) for key, e in _lanes.TABLE.items() if key[0] == "attn_bwd"] == [True]


def test_a_saved_mask_modified_in_place_is_refused_as_by_the_op():
    """The lane's node saves the option tensors as the op's does: changing cu_seqlens between forward and
    backward raises autograd's in-place error instead of computing gradients for other sequences."""
    q, k, v, cq, ck = _varlen_inputs(True)
    for lanes in (True, False):
        _attention_lane.LANE = lanes
        try:
            out = flashtx.flash_attn_varlen_func(q, k, v, cq, ck, SQ, SK)
            cq.add_(0)  # an in-place op: bumps the version counter
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                out.sum().backward()
        finally:
            _attention_lane.LANE = True


def test_masked_lane_outputs_are_written_in_full():
    """Allocations filled with NaN: every output and gradient element is written through the lanes."""
    q, k, v, cq, ck = _varlen_inputs(True)
    dout = randn(SQ, HQ, D, dtype=PRECISE_DTYPE)
    with poisoned_allocations():
        for _ in range(2):  # a miss, then a hit
            out = flashtx.flash_attn_varlen_func(q, k, v, cq, ck, SQ, SK, causal=True)
            grads = torch.autograd.grad(out, (q, k, v), dout)
    qr, kr, vr = (t.detach().transpose(0, 1)[None].requires_grad_() for t in (q, k, v))
    vis = reference.varlen_visibility(cq, ck, SQ, SK, causal=True, device=DEVICE)
    ref = reference.attention(qr, kr, vr, vis=vis)
    assert (out - ref[0].transpose(0, 1)).abs().max() < precise_atol(1e-12)
    for g, r in zip(grads, torch.autograd.grad(ref, (qr, kr, vr), dout.transpose(0, 1)[None])):
        assert (g - r[0].transpose(0, 1)).abs().max() < precise_atol(1e-11)
