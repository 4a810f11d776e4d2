"""Decoding calls planned once per signature (flashtx._small_q_lane): a key's second call makes the lane, later
calls fire it with their own tensors and get the general path's result bit for bit (the same kernels), in every
shell and mask form transformers' generation passes; the calls it must not take go to the general path."""
import pytest
import torch
from conftest import DEVICE, KERNEL_DTYPES, PRECISE_DTYPE, dtype_id, poisoned_allocations, precise_atol, randn

import flashtx
from flashtx import _dispatch, _lanes, _small_q, _small_q_lane, reference


def _lanes_made():
    return [lane for key, lane in _lanes.TABLE.items() if key[0] == "small_q" and lane]


def _inputs(dtype, B=2, Hq=4, Hkv=2, Sq=1, Sk=37, D=32, bshd_views=True):
    """(B, H, S, D) q, k, v; bshd_views: views of (B, S, H, D) tensors, as transformers makes them."""
    q, k, v = randn(B, Sq, Hq, D, dtype=dtype), randn(B, Sk, Hkv, D, dtype=dtype), randn(B, Sk, Hkv, D, dtype=dtype)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    return (q, k, v) if bshd_views else tuple(t.contiguous() for t in (q, k, v))


def _key_mask(B, Sk):
    m = torch.rand(B, Sk, device=DEVICE) > 0.3
    m[:, -1] = True
    return m


FORMS = {  # transformers' decoding calls through attn_implementation="ftx", and the other shells
    "plain": lambda q, k, v: flashtx.attention(q, k, v, enable_gqa=True),
    "key-mask": lambda q, k, v: flashtx.attention(  # left padding: a key mask, bottom-right causal as a window
        q, k, v, key_mask=_key_mask(q.shape[0], k.shape[2]), window_size=(-1, k.shape[2] - q.shape[2]),
        enable_gqa=True),
    "attn-mask": lambda q, k, v: flashtx.attention(  # a static cache: a bool (B, 1, Sq, max_len) mask
        q, k, v, attn_mask=_key_mask(q.shape[0], k.shape[2])[:, None, None].expand(-1, 1, q.shape[2], -1),
        enable_gqa=True),
    "lse-softcap-scale": lambda q, k, v: flashtx.attention(q, k, v, enable_gqa=True, return_lse=True, softcap=4.0,
                                                           scale=0.3),
    "flash": lambda q, k, v: flashtx.flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                     causal=True, window_size=(20, 0)),
    "flash-key-mask": lambda q, k, v: flashtx.flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                              causal=True, key_mask=_key_mask(q.shape[0], k.shape[2])),
    "patched-sdpa": lambda q, k, v: _patched(q, k, v),
    "patched-sdpa-mask": lambda q, k, v: _patched(  # transformers' "sdpa" steps with padding
        q, k, v, attn_mask=_key_mask(q.shape[0], k.shape[2])[:, None, None]),
}


def _patched(q, k, v, **kw):
    with flashtx.patch_sdpa():
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kw)


def _run(form, seed, dtype, lane: bool, monkeypatch, **shape):
    torch.manual_seed(seed)
    q, k, v = _inputs(dtype, **shape)
    with monkeypatch.context() as m, torch.no_grad():
        m.setattr(_small_q_lane, "LANE", lane)
        return FORMS[form](q, k, v)


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("form", list(FORMS))
def test_a_lane_gives_the_general_paths_result_with_each_calls_own_tensors(fresh_plans, routes, monkeypatch, form,
                                                                           dtype):
    """Two calls make the lane; the next ones (fresh values, poisoned allocations) fire it, and each equals the
    general path's result on the same inputs exactly, lse included."""
    shape = dict(Sq=3, Sk=70) if form.startswith("flash") else {}
    for seed in range(2):
        _run(form, seed, dtype, True, monkeypatch, **shape)
    assert len(_lanes_made()) == 1, _lanes.TABLE.keys()
    routes.clear()
    for seed in (5, 6):
        with poisoned_allocations():
            got = _run(form, seed, dtype, True, monkeypatch, **shape)
        made = len(_lanes_made())
        want = _run(form, seed, dtype, False, monkeypatch, **shape)
        assert made == 1
        got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
        for g, w in zip(got, want):
            assert g.shape == w.shape and g.stride() == w.stride() and g.dtype == w.dtype
            assert torch.equal(g, w), (g - w).abs().max()
    assert routes == ["lane", "decode"] * 2, routes  # the lane, then the general path (LANE off), for each seed


def test_the_lane_is_the_only_work_of_a_hit(fresh_plans, monkeypatch):
    """A hit fires the lane's launches: no validation, no op call, no planning (they raise here)."""
    q, k, v = _inputs(PRECISE_DTYPE)
    with torch.no_grad():
        for _ in range(2):
            flashtx.attention(q, k, v, enable_gqa=True)
        want = reference.attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1))

        def boom(*a, **kw):
            raise AssertionError("the general path ran")

        for mod, name in ((flashtx.functional, "_run"), (_small_q, "call"), (_dispatch, "plan"),
                          (flashtx.functional, "check_attn_mask")):
            monkeypatch.setattr(mod, name, boom)
        got = flashtx.attention(q, k, v, enable_gqa=True)
    assert (got - want).abs().max() < precise_atol(1e-12)


def test_a_keys_first_call_makes_no_lane(fresh_plans, routes):
    """Keys that grow by a token a call, one layer deep, make no lane (each would be planned for nothing); a step
    of a model with layers makes one on its second layer, and its other layers fire it."""
    q = randn(2, 4, 1, 16, dtype=PRECISE_DTYPE)
    with torch.no_grad():
        for sk in range(20, 25):
            flashtx.attention(q, randn(2, 2, sk, 16, dtype=PRECISE_DTYPE), randn(2, 2, sk, 16, dtype=PRECISE_DTYPE),
                              enable_gqa=True)
        assert not _lanes_made()
        k, v = randn(2, 2, 30, 16, dtype=PRECISE_DTYPE), randn(2, 2, 30, 16, dtype=PRECISE_DTYPE)
        for layer in range(4):
            got = flashtx.attention(q, k, v, enable_gqa=True)
    assert len(_lanes_made()) == 1 and routes == ["decode"] * 7 + ["lane"] * 2
    want = reference.attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1))
    assert (got - want).abs().max() < precise_atol(1e-12)


SPLIT = dict(B=1, Hq=2, Hkv=1, Sk=300)  # one (batch, KV head): the keys are split across programs (a combine)


@pytest.mark.parametrize("lse", [False, True], ids=["out", "lse"])
def test_a_lane_over_split_keys(fresh_plans, routes, monkeypatch, lse):
    from flashtx.triton_kernels import decode

    counts = []
    real = decode.split_count
    monkeypatch.setattr(decode, "split_count", lambda *a, **kw: counts.append(real(*a, **kw)) or counts[-1])
    form = "lse-softcap-scale" if lse else "plain"
    for seed in range(2):
        _run(form, seed, PRECISE_DTYPE, True, monkeypatch, **SPLIT)
    assert counts and counts[-1] > 1, counts  # the lane was planned with split partials
    with poisoned_allocations():
        got = _run(form, 7, PRECISE_DTYPE, True, monkeypatch, **SPLIT)
    want = _run(form, 7, PRECISE_DTYPE, False, monkeypatch, **SPLIT)
    got, want = (got, want) if lse else ((got,), (want,))
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert routes == ["decode", "decode", "lane", "decode"], routes


CHANGES = {  # one argument of the lane's call changed: another key, the general path's result
    "scale": dict(scale=0.2),
    "window": dict(window_size=(5, -1)),
    "softcap": dict(softcap=2.0),
    "return_lse": dict(return_lse=True),
    "is_causal": dict(is_causal=True),  # (top-left with Sq < Sk: the training forward)
    "backend": dict(backend="reference"),
    "key_mask for attn_mask": "role",
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_changed_argument_is_another_key(fresh_plans, change):
    """Each scalar of the call, and the mask's role, is in the key: a lane made without it is not used for it."""
    B, Sk = 3, 37
    q, k, v = _inputs(PRECISE_DTYPE, B=B, Sq=B, Sk=Sk)  # Sq = B: a (B, Sk) mask reads as either role
    m = _key_mask(B, Sk)
    base = dict(attn_mask=m) if change == "key_mask for attn_mask" else {}
    new = dict(key_mask=m) if change == "key_mask for attn_mask" else CHANGES[change]
    with torch.no_grad():
        for _ in range(2):
            flashtx.attention(q, k, v, enable_gqa=True, **base)
        assert len(_lanes_made()) == 1
        got = flashtx.attention(q, k, v, enable_gqa=True, **new)
        was, _small_q_lane.LANE = _small_q_lane.LANE, False
        try:
            want = flashtx.attention(q, k, v, enable_gqa=True, **new)
        finally:
            _small_q_lane.LANE = was
    got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
    assert all(torch.equal(g, w) for g, w in zip(got, want)), change


def test_refusals_hold_once_a_lane_exists(fresh_plans, routes, monkeypatch):
    """After a lane is made: grad mode with an input that requires grad, SMALL_Q_DECODE off, a lower SMALL_Q_MAX,
    fp32's TF32 switch: each call takes the path it would have taken without the lane."""
    from flashtx.triton_kernels import precision

    q, k, v = _inputs(torch.float32, Sq=3)
    with torch.no_grad():
        for _ in range(2):
            flashtx.attention(q, k, v, enable_gqa=True)
    assert len(_lanes_made()) == 1
    routes.clear()
    leaf = q.detach().clone().requires_grad_(True)
    out = flashtx.attention(leaf, k, v, enable_gqa=True)
    assert out.requires_grad and routes == ["train"], routes
    want = reference.attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1))
    for name, value in (("SMALL_Q_DECODE", False), ("SMALL_Q_MAX", 2)):
        routes.clear()
        with monkeypatch.context() as m, torch.no_grad():
            m.setattr(_small_q, name, value)
            got = flashtx.attention(q, k, v, enable_gqa=True)
        assert routes == ["train"], (name, routes)
        assert (got - want).abs().max() < precise_atol(1e-5)
    routes.clear()
    tf32 = precision.allow_tf32()
    with monkeypatch.context() as m, torch.no_grad():
        m.setattr(precision, "allow_tf32", lambda: not tf32)
        flashtx.attention(q, k, v, enable_gqa=True)
    assert routes == ["decode"], routes  # another key: the general path (no lane yet for it)


def test_a_refused_key_is_remembered(fresh_plans, monkeypatch):
    """A call the decode route refuses for what its key shows (top-left causal with Sq < Sk) is not sent with a
    request again: its key holds False, and later calls go straight to the general path."""
    q, k, v = _inputs(PRECISE_DTYPE)
    made = []
    real = _small_q_lane.make
    monkeypatch.setattr(_small_q_lane, "make", lambda *a: made.append(1) or real(*a))
    with torch.no_grad():
        for _ in range(3):
            got = flashtx.attention(q, k, v, enable_gqa=True, is_causal=True)
    assert [lane for key, lane in _lanes.TABLE.items() if key[0] == "small_q"] == [False] and not made
    want = reference.attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), causal=True)
    assert (got - want).abs().max() < precise_atol(1e-12)


def test_calls_the_lane_must_not_take(fresh_plans, routes):
    """Grad, ALiBi, a float mask, both masks, the reference backend, SMALL_Q_DECODE off: no lane, the general
    path's result."""
    q, k, v = _inputs(PRECISE_DTYPE)
    km = _key_mask(2, 37)
    leaf = q.detach().clone().requires_grad_(True)
    calls = [
        lambda: flashtx.attention(leaf, k, v, enable_gqa=True),  # autograd: the training forward
        lambda: flashtx.attention(q, k, v, enable_gqa=True, alibi_slopes=torch.rand(4, device=DEVICE)),
        lambda: flashtx.attention(q, k, v, enable_gqa=True, attn_mask=torch.zeros(2, 1, 1, 37, dtype=q.dtype,
                                                                                   device=DEVICE)),
        lambda: flashtx.attention(q, k, v, enable_gqa=True, key_mask=km, attn_mask=km[:, None, None]),
        lambda: flashtx.attention(q, k, v, enable_gqa=True, backend="reference"),
    ]
    for call in calls:
        for _ in range(3):
            call()
    assert not _lanes_made()  # (neither a lane nor a remembered refusal: no request was made)
    was, _small_q.SMALL_Q_DECODE = _small_q.SMALL_Q_DECODE, False
    try:
        with torch.no_grad():
            for _ in range(3):
                got = flashtx.attention(q, k, v, enable_gqa=True)
    finally:
        _small_q.SMALL_Q_DECODE = was
    assert not _lanes_made() and routes[-3:] == ["train"] * 3
    want = reference.attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1))
    assert (got - want).abs().max() < precise_atol(1e-12)


def test_bad_input_still_raises_once_a_lane_exists(fresh_plans):
    """A lane is keyed on the layouts it was planned for: a wrong mask shape, dtype or scale is another key, and
    the general path says what is wrong."""
    q, k, v = _inputs(PRECISE_DTYPE)
    km = _key_mask(2, 37)
    with torch.no_grad():
        for _ in range(3):
            flashtx.attention(q, k, v, enable_gqa=True, key_mask=km)
        assert len(_lanes_made()) == 1
        with pytest.raises(ValueError, match="key_mask"):
            flashtx.attention(q, k, v, enable_gqa=True, key_mask=km[:, :36])
        with pytest.raises(TypeError, match="key_mask"):
            flashtx.attention(q, k, v, enable_gqa=True, key_mask=km.to(torch.uint8))
        with pytest.raises(ValueError, match="scale"):
            flashtx.attention(q, k, v, enable_gqa=True, key_mask=km, scale=float("inf"))
        with pytest.raises(ValueError, match="window_size"):
            flashtx.attention(q, k, v, enable_gqa=True, key_mask=km, window_size=(-2, 0))


def test_lanes_are_dropped_with_the_plans(fresh_plans):
    q, k, v = _inputs(PRECISE_DTYPE)
    with torch.no_grad():
        for _ in range(2):
            flashtx.attention(q, k, v, enable_gqa=True)
    assert len(_lanes_made()) == 1
    _dispatch.clear_plans()
    assert not _lanes_made()
