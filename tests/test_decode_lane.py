"""flashtx._decode_lane: a flash_attn_with_kvcache call planned once per call signature. It must compute exactly what
the general path (validation, the flashtx::kvcache_append / kvcache_attention ops) computes, outputs, lse and the
appended caches; check the index values every call (on the host for CPU tensors, by the check kernel on a GPU);
raise what the general path raises; and take only the calls it may."""
import pytest
import torch
from test_decode import loop_reference, make_cache, rand

import flashtx
import flashtx.decode as fd
from flashtx import _decode_lane, _dispatch, _lanes

from conftest import DEVICE, assert_close_to_reference, count_calls


# fresh plans per test; a fallback to the reference backend (a warning) fails: the lane is Triton's
pytestmark = [pytest.mark.usefixtures("fresh_plans"),
              pytest.mark.filterwarnings("error:.*using the reference implementation")]

DT = torch.float16  # a kernel dtype on a GPU and in the interpreter (whose bf16 is wrong, see conftest)


@pytest.fixture
def fires(monkeypatch):
    """How many launch entries the lane fired (the append and the attention count one each)."""
    return count_calls(monkeypatch, _lanes, "fire")


CASES = {  # name: keyword arguments of _call
    "contiguous, append": dict(),
    "paged, append + rotary, 3 splits": dict(page=16, rotary=True, num_splits=3),
    "interleaved rotary, not causal": dict(rotary=True, causal=False, interleaved=True),
    "no append, leftpad, alibi (H,)": dict(snew=0, leftpad=True, alibi=(4,)),
    "batch_idx, window, softcap, alibi (B, H), lse": dict(batch_idx=True, window=(5, 0), softcap=20.0,
                                                         alibi=(2, 4), lse=True),
    "GQA 4, two queries": dict(hq=8, sq=2, page=32),
    "rotary only, no append": dict(snew=0, rotary=True),
}


def _inputs(seed, *, page=None, rotary=False, snew=1, leftpad=False, batch_idx=False, alibi=None, hq=4, sq=1, **_):
    """A decoding step's arguments: fresh values (the caches from `seed`), lengths advancing with the seed."""
    torch.manual_seed(seed)
    B, Hkv, D, cap = 2, 2, 16, 64
    kc, vc, bt = make_cache(B, Hkv, D, cap, DT, page, extra_rows=1 if batch_idx else 0, seed=seed)
    a = dict(q=rand(B, sq, hq, D, dtype=DT), k_cache=kc, v_cache=vc, block_table=bt,
             cache_seqlens=torch.tensor([10 + seed, 30 - seed], dtype=torch.int32, device=DEVICE))
    if snew:
        a.update(k=rand(B, snew, Hkv, D, dtype=DT), v=rand(B, snew, Hkv, D, dtype=DT))
    if rotary:
        ang = torch.arange(cap, dtype=torch.float64)[:, None] * torch.rand(1, 4, dtype=torch.float64)
        a.update(rotary_cos=ang.cos().float().to(DEVICE), rotary_sin=ang.sin().float().to(DEVICE))
    if leftpad:
        a["cache_leftpad"] = torch.tensor([2, 0], dtype=torch.int32, device=DEVICE)
    if batch_idx:
        a["cache_batch_idx"] = torch.tensor([2, 0], dtype=torch.int32, device=DEVICE)
    if alibi:
        a["alibi_slopes"] = torch.rand(alibi, dtype=torch.float32, device=DEVICE)
    return a


def _call(a, *, causal=True, interleaved=False, window=(-1, -1), softcap=0.0, num_splits=0, lse=False, **_):
    with torch.no_grad():
        return flashtx.flash_attn_with_kvcache(**a, causal=causal, rotary_interleaved=interleaved, window_size=window,
                                               softcap=softcap, num_splits=num_splits, return_softmax_lse=lse)


def _clone(a):
    return {n: t.clone() if isinstance(t, torch.Tensor) else t for n, t in a.items()}


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_lane_computes_what_the_general_path_computes(case, fires, monkeypatch):
    """Three steps of one signature with fresh values each: the lane's outputs (and lse) and the caches it appended
    to equal the general path's bit for bit; the lane fired the append (when there is one) and the attention every
    step, and bumped the caches' version counters as the in-place op's call does."""
    kw = CASES[case]
    appends = bool(kw.get("snew", 1) or kw.get("rotary"))
    for seed in range(3):
        a = _inputs(seed, **kw)
        b = _clone(a)
        versions = a["k_cache"]._version, a["v_cache"]._version
        monkeypatch.setattr(_decode_lane, "LANE", True)
        got = _call(a, **kw)
        if kw.get("snew", 1):
            assert a["k_cache"]._version > versions[0] and a["v_cache"]._version > versions[1]
        monkeypatch.setattr(_decode_lane, "LANE", False)
        want = _call(b, **kw)
        got, want = (got, want) if kw.get("lse") else ((got,), (want,))
        assert all(torch.equal(x, y) for x, y in zip(got, want))
        assert torch.equal(a["k_cache"], b["k_cache"]) and torch.equal(a["v_cache"], b["v_cache"])
    assert len(fires) == 3 * (2 if appends else 1) and len(_lanes.TABLE) == 1 and all(_lanes.TABLE.values())


def test_the_lane_checks_the_indices_every_call(fires):
    """After a lane exists, an out-of-range length or page still raises the general path's ValueError, and nothing
    is written."""
    kw = dict(page=16)
    _call(_inputs(0, **kw))
    for where, value, match in (("cache_seqlens", 64, r"cache_seqlens\[1\] = 64"),  # + 1 new token > 64 positions
                                ("block_table", 1000, r"block_table\[1, 2\] = 1000")):
        a = _inputs(1, **kw)
        if where == "cache_seqlens":
            a["cache_seqlens"][1] = value
        else:
            a["cache_seqlens"][1] = 40  # its third page is in use
            a["block_table"][1, 2] = value
        k0, v0 = a["k_cache"].clone(), a["v_cache"].clone()
        with pytest.raises(ValueError, match=match):
            _call(a)
        assert torch.equal(a["k_cache"], k0) and torch.equal(a["v_cache"], v0)
    assert len(fires) == 2 and len(_lanes.TABLE) == 1 and all(_lanes.TABLE.values())


@pytest.fixture
def device_path(monkeypatch):
    """The GPU's branch of the index check (values not readable on the host; the check kernel in the
    interpreter and torch._assert_async), as tests/test_decode_device_check.py forces it."""
    monkeypatch.setattr(fd, "_values_readable", lambda t: False)


@pytest.mark.skipif(DEVICE != "cpu", reason="forces the GPU branch on CPU (a bad length's device assert would end a "
                                             "GPU's CUDA context); on a GPU: test_device_asserts_gpu.py")
def test_on_the_gpu_branch_the_lane_launches_the_check_first(device_path, monkeypatch):
    """With the device check (the GPU's branch), a lane's call launches the check kernel before its own launches,
    every call: the first through the op (flashtx::kvcache_check, planning the lane), the others from the lane's
    own entry for it. A bad length stops the call before the append writes anything."""
    from flashtx import _decode_op
    from flashtx.triton_kernels import launch

    kernels, op_checks = [], []
    real_run, real_check = launch.run_kernel, _decode_op._TRITON.checks.decode_check
    monkeypatch.setattr(launch, "run_kernel", lambda kernel, *a: kernels.append(kernel.fn.__name__) or
                        real_run(kernel, *a))
    monkeypatch.setattr(_decode_op._TRITON.checks, "decode_check", lambda *a, **k: op_checks.append(1) or
                        real_check(*a, **k))
    for seed in range(3):
        _call(_inputs(seed, rotary=True))
    per_call = ["_decode_check", "_kv_append", "_decode_fwd"]
    assert kernels == per_call * 3, kernels
    assert len(op_checks) == 1 and len(_lanes.TABLE) == 1 and all(_lanes.TABLE.values())
    (lane,) = _lanes.TABLE.values()
    assert type(lane.check) is list and len(lane.check) == 1  # the replayed check
    a = _inputs(3, rotary=True)
    a["cache_seqlens"][0] = 70
    k0 = a["k_cache"].clone()
    with pytest.raises(RuntimeError, match="index out of range"):
        _call(a)
    assert torch.equal(a["k_cache"], k0) and kernels[-1] == "_decode_check" and len(op_checks) == 1


BAD = {  # name: (a change to a good call's arguments, error type, message)
    "shared caches": (lambda a: a.update(v_cache=a["k_cache"]), ValueError, "share memory"),
    # new tensors in the caches' memory: the append could overwrite them before the kernels read them
    "v views k_cache": (lambda a: a.update(v=a["k_cache"][:, 5:6]), ValueError, "v shares memory with k_cache"),
    "k views v_cache": (lambda a: a.update(k=a["v_cache"][:, 5:6]), ValueError, "k shares memory with v_cache"),
    "q views k_cache": (lambda a: a.update(q=a["k_cache"][:, 40:42].reshape(2, 1, 4, 16)), ValueError,
                        "q shares memory with k_cache"),
    "rotary_interleaved='no'": (lambda a: a.update(rotary_interleaved="no"), TypeError,
                                "rotary_interleaved must be a bool"),
    "return_softmax_lse=1": (lambda a: a.update(return_softmax_lse=1), TypeError, "return_softmax_lse must be a bool"),
    "grad": (lambda a: a["q"].requires_grad_(), RuntimeError, "inference-only"),
    "k dtype": (lambda a: a.update(k=a["k"].float() if DT != torch.float32 else a["k"].double()), TypeError,
                "must have q's dtype"),
    "window": (lambda a: a.update(window_size=(-2, 0)), ValueError, "window_size"),
    "cache dtype": (lambda a: a.update(k_cache=a["k_cache"].float() if DT != torch.float32 else a["k_cache"].double()),
                    TypeError, "k_cache must have q's dtype"),
    "cache device": (lambda a: a.update(v_cache=a["v_cache"].to("meta")), ValueError, "v_cache must be on q's device"),
    # values equal (and hashing alike) to a good call's of other types than documented
    "causal=1": (lambda a: a.update(causal=1), TypeError, "causal"),
    "num_splits=True": (lambda a: a.update(num_splits=True), ValueError, "num_splits must be an int"),
    "window (3, False)": (lambda a: a.update(window_size=(3, False)), (TypeError, ValueError), "window_size"),
    "alibi with grad": (lambda a: a.update(alibi_slopes=torch.rand(4, device=DEVICE, requires_grad=True)),
                        RuntimeError, "inference-only"),
    "cos with grad": (lambda a: a.update(rotary_cos=torch.rand(64, 4, device=DEVICE, requires_grad=True),
                                         rotary_sin=torch.rand(64, 4, device=DEVICE)), RuntimeError, "inference-only"),
    # the index values before the backend, as the general path (a first call of this signature)
    "lengths, then backend": (lambda a: a.update(backend="nonexistent", cache_seqlens=torch.tensor(
        [3, 70], dtype=torch.int32, device=DEVICE)), ValueError, r"cache_seqlens\[1\] = 70"),
}


@pytest.mark.parametrize("bad", sorted(BAD))
def test_bad_calls_raise_the_general_paths_error_before_and_after_a_lane(bad):
    """Each bad call raises what the general path raises, on a first call and after good calls of the same
    signature have made a lane (shared caches are seen per call: they depend on addresses)."""
    change, error, match = BAD[bad]
    for _ in ("first call", "after a lane"):
        a = _inputs(0)
        change(a)
        a.setdefault("causal", True)
        with pytest.raises(error, match=match):
            with torch.enable_grad():
                flashtx.flash_attn_with_kvcache(**a)
        with torch.no_grad():
            for extra in (dict(), dict(window_size=(3, 0)), dict(num_splits=1), dict(alibi_slopes=torch.rand(
                    4, device=DEVICE)), dict(rotary_cos=torch.rand(64, 4, device=DEVICE),
                                         rotary_sin=torch.rand(64, 4, device=DEVICE))):
                flashtx.flash_attn_with_kvcache(**_inputs(0), causal=True, **extra)
    assert sum(map(bool, _lanes.TABLE.values())) == 5


def test_only_plain_calls_take_the_lane_and_lanes_go_with_the_plans(fires, monkeypatch):
    """An int cache_seqlens, a strided (copied) lengths tensor, scalars of other types than documented (equal
    values), the reference backend and a Parameter cache take the general path, each with the lane's result for the
    same values; clear_plans drops the lanes; fp32's TF32 switch keys a lane of its own."""
    a = _inputs(0, snew=0)
    a["cache_seqlens"].fill_(20)
    want = _call(_clone(a))
    assert len(fires) == 1
    lens = a["cache_seqlens"]
    variants = [dict(cache_seqlens=20), dict(cache_seqlens=torch.stack([lens, lens * 0 + 63], 1)[:, 0]),
                dict(softmax_scale=1), dict(window_size=[-1, -1]), dict(softcap=0), dict(backend="reference"),
                dict(k_cache=torch.nn.Parameter(a["k_cache"].clone(), requires_grad=False))]
    for change in variants:
        b = _clone(a)
        b.update(change)
        with torch.no_grad():
            out = flashtx.flash_attn_with_kvcache(**b, causal=True)
        if "softmax_scale" in change:
            with torch.no_grad():
                want1 = flashtx.flash_attn_with_kvcache(**_clone(a), causal=True, softmax_scale=1.0)
            assert torch.equal(out, want1)
        elif "backend" in change:  # the lane's (Triton) result under the tolerance rule, `out` the eager baseline,
            # against test_decode's float64 loop (independent of the reference backend under test here)
            ref64 = loop_reference(a["q"], a["k_cache"], a["v_cache"], None, None, lens=a["cache_seqlens"],
                                   block_table=a["block_table"], causal=True)[0]
            assert_close_to_reference("out", want, ref64, out)
        else:
            assert torch.equal(out, want)
    assert len(fires) == 2 and sum(map(bool, _lanes.TABLE.values())) == 2  # (the float scale's own lane)
    _call(_clone(a))
    assert len(fires) == 3
    _dispatch.clear_plans()
    assert len(_lanes.TABLE) == 0

    from flashtx.triton_kernels import precision

    a32 = {n: t.float() if isinstance(t, torch.Tensor) and t.is_floating_point() else t for n, t in a.items()}
    for tf32 in (False, True):
        monkeypatch.setattr(precision, "allow_tf32", lambda tf32=tf32: tf32)
        _call(_clone(a32))
    assert len(_lanes.TABLE) == 2
