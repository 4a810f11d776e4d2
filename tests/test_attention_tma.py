"""The sm_90 forward that reads K/V through tensor descriptors (TMA; autotune.TMA_CANDIDATES), with sm_90's plan
and a TMA tile forced, against the float64 reference under the tolerance rule: in Triton's interpreter on CPU,
natively on a GPU of sm_90 or later (bench/device_check.sh runs this file there); the inputs it must refuse
(misaligned, odd row strides, split head dims) and the launch cache's replay of a TMA plan; the scratch
allocator a descriptor-making launch needs; tuning and compile-check coverage (the compile check compiles the
plans for sm_90)."""
import contextlib
import threading

import pytest
import torch
from conftest import DEVICE, ON_GPU

import flashtx
from flashtx.testing import tolerance_check
from flashtx.triton_kernels import attention_bwd_launch, attention_fwd, autotune, configs
from flashtx.triton_kernels import launch as launch_mod
from flashtx.triton_kernels.configs import KNOWN_TARGETS, TileConfig
from flashtx.triton_kernels.launch import LAUNCHES, ensure_scratch_allocator, stub_launches

needs_sm90 = pytest.mark.skipif(ON_GPU and torch.cuda.get_device_capability()[0] < 9,
                                reason="tensor descriptors are read through TMA on sm_90 and later")

TMA_TILE = TileConfig(64, 32, 4, 3, "test: a small TMA tile", tma=True)


@pytest.fixture
def tma_flags(monkeypatch):
    """The TMA argument of every forward plan made (plan_forward wrapped); backward plans' dK/dV and dQ
    launches go to tma_flags.bwd as pairs."""
    flags = _Flags()
    plan, plan_bwd = attention_fwd.plan_forward, attention_bwd_launch.plan_backward

    def spy(*a, **kw):
        launch = plan(*a, **kw)
        flags.append(launch.args["TMA"])
        return launch

    def spy_bwd(*a, **kw):
        launches = plan_bwd(*a, **kw)
        flags.bwd.append((launches[1].args["TMA"], launches[2].args["TMA"]))
        return launches
    monkeypatch.setattr(attention_fwd, "plan_forward", spy)
    monkeypatch.setattr(attention_bwd_launch, "plan_backward", spy_bwd)
    return flags


class _Flags(list):
    def __init__(self):
        super().__init__()
        self.bwd = []


def forced_tma(kernels, tile=TMA_TILE):
    """autotune.forced for each of `kernels` at once."""
    stack = contextlib.ExitStack()
    for kernel in kernels:
        stack.enter_context(autotune.forced(kernel, tile))
    return stack


CASES = {  # name: (flash_attn_func keywords, Sq, Sk, Hq, Hkv)
    "full-cross": (dict(causal=False), 70, 150, 2, 2),
    "causal-gqa": (dict(causal=True), 150, 150, 4, 2),
    "causal-bottom-right": (dict(causal=True), 40, 129, 2, 1),
    "window-softcap": (dict(causal=True, window_size=(33, 0), softcap=5.0), 100, 100, 2, 2),
}


@needs_sm90
@pytest.mark.parametrize("gpu_target", [90], indirect=True, ids=lambda a: f"sm_{a}")
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("passes", ["fwd", "bwd"])
def test_tma_attention_and_its_gradients_match_the_reference(gpu_target, case, passes, tma_flags):
    """fwd: the forward reads K/V through descriptors; bwd: dK/dV reads Q/dO and dQ reads K/V so."""
    kwargs, Sq, Sk, Hq, Hkv = CASES[case]
    gen = torch.Generator().manual_seed(len(case) * 7 + Sq)
    d = 64
    q = torch.randn(2, Sq, Hq, d, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(2, Sk, Hkv, d, generator=gen, dtype=torch.float64) for _ in range(2))
    dout = torch.randn(2, Sq, Hq, d, generator=gen, dtype=torch.float64)

    def padded(t, dtype):  # (B, S, H, D) with padded heads: a stride of 72 elements (144 bytes, a multiple of 16)
        return torch.zeros(*t.shape[:3], d + 8, dtype=dtype, device=DEVICE)[..., :d].copy_(t)

    def run(dtype, backend):
        ins = [padded(t, dtype).requires_grad_() for t in (q, k, v)]
        out = flashtx.flash_attn_func(*ins, backend=backend, **kwargs)
        return [out, *torch.autograd.grad(out, ins, dout.to(DEVICE, dtype))]

    with forced_tma(["attn_fwd"] if passes == "fwd" else ["attn_bwd_dkdv", "attn_bwd_dq"]):
        got = run(torch.float16, "triton")
    if passes == "fwd":
        assert tma_flags and all(tma_flags), "the forward must have read K/V through descriptors"
    else:
        assert tma_flags.bwd and all(a and b for a, b in tma_flags.bwd), tma_flags.bwd
    ref64, eager = run(torch.float64, "reference"), run(torch.float16, "reference")
    for i, name in enumerate(("out", "dq", "dk", "dv")):
        err, bound = tolerance_check(got[i], ref64[i], eager[i], grad=i > 0)
        assert err <= bound, f"{case} {name}: error {err:.3g} > {bound:.3g}"


@needs_sm90
@pytest.mark.parametrize("gpu_target", [90], indirect=True, ids=lambda a: f"sm_{a}")
def test_tma_varlen_and_lengths_read_each_sequence_alone(gpu_target, tma_flags):
    """Descriptors span one sequence's rows: with packed sequences the rows after it (the next sequence,
    here poisoned with inf in V past each sequence of the padded layout) never reach the output; forward and
    backward all through descriptors."""
    gen = torch.Generator().manual_seed(90)
    lens = [37, 0, 64, 101]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    total, H, d = int(cu[-1]), 2, 64
    q, k, v, dout = (torch.randn(total, H, d, generator=gen, dtype=torch.float64) for _ in range(4))
    cu = cu.to(DEVICE)

    def run(dtype, backend):
        ins = [t.to(DEVICE, dtype).requires_grad_() for t in (q, k, v)]
        out = flashtx.flash_attn_varlen_func(*ins, cu, cu, max(lens), max(lens), causal=True, backend=backend)
        return [out, *torch.autograd.grad(out, ins, dout.to(DEVICE, dtype))]

    with forced_tma(["attn_fwd", "attn_bwd_dkdv", "attn_bwd_dq"]):
        got = run(torch.float16, "triton")
    assert tma_flags and all(tma_flags) and tma_flags.bwd and all(a and b for a, b in tma_flags.bwd)
    ref64, eager = run(torch.float64, "reference"), run(torch.float16, "reference")
    for i, name in enumerate(("out", "dq", "dk", "dv")):
        err, bound = tolerance_check(got[i], ref64[i], eager[i], grad=i > 0)
        assert err <= bound, f"varlen {name}: error {err:.3g} > {bound:.3g}"

    # padded batch with key lengths: V rows past each length hold inf, which a read past the length would spread
    B, S = 3, 90
    kv_lens = torch.tensor([90, 17, 1], dtype=torch.int32, device=DEVICE)
    qp, kp, vp = (torch.randn(B, H, S, d, generator=gen, dtype=torch.float16).to(DEVICE) for _ in range(3))
    for b, n in enumerate(kv_lens.tolist()):
        vp[b, :, n:] = float("inf")
    tma_flags.clear()
    with autotune.forced("attn_fwd", TMA_TILE), torch.no_grad():
        out = flashtx.attention(qp, kp, vp, kv_lens=kv_lens, backend="triton")
    assert tma_flags and all(tma_flags)
    ref = flashtx.attention(qp.double(), kp.double(), vp.double().nan_to_num(posinf=0.0), kv_lens=kv_lens,
                            backend="reference")
    assert torch.isfinite(out).all()
    assert (out.double() - ref).abs().max() < 1e-2


@needs_sm90
@pytest.mark.parametrize("gpu_target", [90], indirect=True, ids=lambda a: f"sm_{a}")
def test_inputs_descriptors_cannot_read_take_the_pointer_loads(gpu_target, tma_flags):
    """A K/V whose address or row stride is not a multiple of 16 bytes is read by pointer loads, with the
    same result; so are split head dims."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, 2, 50, 64, generator=gen, dtype=torch.float16).to(DEVICE)
    flat = torch.randn(2 * 50 * 64 + 4, generator=gen, dtype=torch.float16).to(DEVICE)
    k_off = flat[4:].view(1, 2, 50, 64)  # 8 bytes off: misaligned
    k = k_off.clone()
    odd = torch.randn(1, 2, 50, 36, generator=gen, dtype=torch.float16).to(DEVICE)  # row stride 72 bytes
    with autotune.forced("attn_fwd", TMA_TILE), torch.no_grad():
        aligned = flashtx.attention(q, k, k, backend="triton")
        misaligned = flashtx.attention(q, k_off, k_off, backend="triton")
        flashtx.attention(odd, odd, odd, backend="triton")
    assert tma_flags == [True, False, False]
    torch.testing.assert_close(misaligned, aligned, rtol=0, atol=0)
    assert launch_mod.tma_ok(k) and not launch_mod.tma_ok(k_off) and not launch_mod.tma_ok(odd)
    assert not launch_mod.tma_ok(k.transpose(2, 3))  # no unit last stride

    split = torch.randn(1, 2, 50, 96, generator=gen, dtype=torch.float16).to(DEVICE)  # 96 = 64 + 32 when split
    tma_flags.clear()
    with pytest.MonkeyPatch.context() as mp, autotune.forced("attn_fwd", TMA_TILE), torch.no_grad():
        mp.setattr(launch_mod, "SPLIT_HEAD_DIMS", True)
        flashtx.attention(split, split, split, backend="triton")
    assert tma_flags == [False]


def test_launch_cache_replays_a_tma_plan_only_for_aligned_inputs(monkeypatch, tma_flags):
    """A memoised TMA plan (the autotune cache's config: plans are memoised) is not replayed for a K/V with
    the same shape and strides at an address that is not 16-byte aligned: that call is planned afresh."""
    monkeypatch.setattr(configs, "_autotune_hook", lambda kernel, *a: TMA_TILE if kernel == "attn_fwd" else None)
    monkeypatch.setattr(attention_fwd, "target_for", lambda t: KNOWN_TARGETS[90])
    LAUNCHES.clear()
    launched = []
    q = torch.randn(1, 2, 32, 64, dtype=torch.float16, device=DEVICE)
    flat = torch.randn(2 * 32 * 64 + 8, dtype=torch.float16, device=DEVICE)
    k_ok, k_off = flat[8:].view(1, 2, 32, 64), flat[4:4 + 2 * 32 * 64].view(1, 2, 32, 64)
    with stub_launches(lambda kernel, grid, args: launched.append(args.get("TMA"))), torch.no_grad():
        for k in (k_ok, k_ok, k_off, k_ok):
            flashtx.attention(q, k, k, backend="triton")
    LAUNCHES.clear()
    assert launched == [True, True, False, True]
    assert tma_flags == [True, False]  # planned twice: the first call, and the misaligned one


def test_the_backward_lane_replays_a_tma_plan_only_for_an_aligned_dout(monkeypatch, tma_flags):
    """The attention lane's backward (flashtx._attention_lane) fires a memoised TMA backward (dK/dV reads Q and dO
    through descriptors, dQ reads K and V) only for a dout at a 16-byte aligned address: a dout of the same shape
    and strides 8 bytes off goes to the op's backward, which plans that call afresh (dK/dV by pointer loads)."""
    from flashtx import _attention_lane, _lanes

    monkeypatch.setattr(configs, "_autotune_hook",
                        lambda kernel, *a: TMA_TILE if kernel in ("attn_bwd_dkdv", "attn_bwd_dq") else None)
    monkeypatch.setattr(attention_bwd_launch, "target_for", lambda t: KNOWN_TARGETS[90])
    LAUNCHES.clear()
    q, k, v = (torch.randn(1, 2, 32, 64, dtype=torch.float16, device=DEVICE, requires_grad=True) for _ in range(3))
    flat = torch.randn(2 * 32 * 64 + 8, dtype=torch.float16, device=DEVICE)
    d_ok, d_off = flat[8:].view(1, 2, 32, 64), flat[4:4 + 2 * 32 * 64].view(1, 2, 32, 64)
    launched = []
    op_backwards = []
    real = _attention_lane._backward
    monkeypatch.setattr(_attention_lane, "_backward", lambda *a: op_backwards.append(1) or real(*a))
    with stub_launches(lambda kernel, grid, args: launched.append(args.get("TMA"))):
        out = flashtx.attention(q, k, v, is_causal=True, backend="triton")
        for dout in (d_ok, d_ok, d_off, d_ok):
            torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    assert any(key[0] == "attn_bwd" for key in _lanes.TABLE)
    LAUNCHES.clear()
    assert launched[1:] == [None, True, True] * 2 + [None, False, True] + [None, True, True]  # [0]: the forward
    assert tma_flags.bwd == [(True, True), (False, True)]  # planned twice: the first backward, the misaligned one
    assert len(op_backwards) == 1


def test_scratch_allocator_is_installed_per_context_and_never_replaces_one():
    from triton.runtime import _allocation

    def fresh():  # what a new thread (autograd's device thread) sees
        seen = {}

        def body():
            seen["before"] = _allocation._allocator.get()
            ensure_scratch_allocator()
            seen["after"] = _allocation._allocator.get()
        t = threading.Thread(target=body)
        t.start()
        t.join()
        return seen

    seen = fresh()
    assert isinstance(seen["before"], _allocation.NullAllocator)
    assert not isinstance(seen["after"], _allocation.NullAllocator)

    def mine(size, align, stream):
        raise AssertionError("not called here")

    def body():
        _allocation._allocator.set(mine)
        ensure_scratch_allocator()
        assert _allocation._allocator.get() is mine
    t = threading.Thread(target=body)
    t.start()
    t.join()


def test_tma_tiles_are_tuning_candidates_on_sm90_only():
    h100, rtx3090 = KNOWN_TARGETS[90], KNOWN_TARGETS[86]
    for kernel in ("attn_fwd", "attn_bwd_dkdv", "attn_bwd_dq"):
        for d in (64, 128):
            on90 = autotune.candidates(kernel, d, d, 2, h100, tma=True)
            assert any(c.tma for c in on90) and not on90[0].tma, (kernel, d)  # the default stays first
            assert not any(c.tma for c in autotune.candidates(kernel, d, d, 2, rtx3090, tma=True))
            assert not any(c.tma for c in autotune.candidates(kernel, d, d, 4, h100, tma=True))  # fp32: none
            # a user's autotuning leaves them out until a GPU run has passed this file's tests on sm_90
            assert not autotune.TMA_BY_DEFAULT
            assert not any(c.tma for c in autotune.candidates(kernel, d, d, 2, h100))
            assert [autotune.ident_of(c) for c in autotune.candidates(kernel, d, d, 2, h100)] == \
                [autotune.ident_of(c) for c in on90 if not c.tma]
    # no shipped table entry uses TMA before a GPU run has timed it
    for fam in configs.TABLES.values():
        for per_kernel in fam.values():
            for per_size in per_kernel.values():
                assert not any(c.tma for c in per_size.values())
    assert autotune.describe(TMA_TILE).endswith(" tma")
    assert autotune.ident_of(TMA_TILE) != autotune.ident_of(TileConfig(64, 32, 4, 3))


def test_autotune_cache_keeps_the_tma_flag(tmp_path):
    path = tmp_path / "autotune.json"
    autotune.store("k-tma", TMA_TILE, ms=1.0, path=path)
    autotune.store("k-plain", TileConfig(64, 32, 4, 3), ms=1.0, path=path)
    entries = autotune.load_cache(path)
    assert autotune._config_from(entries["k-tma"]).tma
    assert not autotune._config_from(entries["k-plain"]).tma
    autotune.reset_memory()


@pytest.mark.parametrize("kernel,module,reads", [("attn_fwd", attention_fwd, ("K", "V")),
                                                  ("attn_bwd_dkdv", attention_bwd_launch, ("Q", "DO")),
                                                  ("attn_bwd_dq", attention_bwd_launch, ("K", "V"))])
def test_compile_check_covers_every_tma_candidate_on_sm90_only(kernel, module, reads):
    plans90 = [(label, launch) for label, launch in module.compile_plans(KNOWN_TARGETS[90])
               if label.startswith(f"{kernel}+tma")]
    cands = {c for cs in autotune.TMA_CANDIDATES[kernel][2].values() for c in cs}
    assert {launch.config for _, launch in plans90} == cands and len(plans90) > len(cands)
    assert all(launch.args["TMA"] and launch.descriptors == reads for _, launch in plans90)
    assert not [label for label, _ in module.compile_plans(KNOWN_TARGETS[86]) if "+tma" in label]


def test_a_tma_winner_is_cached_and_selected(tmp_path, monkeypatch):
    """With TMA_BY_DEFAULT on (once a GPU run has passed this file), the tuner times the TMA candidates beside
    the others on sm_90; a TMA winner is stored with its flag and select_config returns it (so the forward plans
    descriptors) from the cache, with TMA_BY_DEFAULT off too (bench.tune --write-cache stores such winners)."""
    monkeypatch.setenv("FLASHTX_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(autotune, "TMA_BY_DEFAULT", True)
    autotune.reset_memory()
    h100 = KNOWN_TARGETS[90]
    cands = autotune.candidates("attn_fwd", 128, 128, 2, h100)
    winner = next(c for c in cands if c.tma)
    key = autotune.runtime_key("attn_fwd", 128, 128, 2, h100, False)
    best = autotune.tune_now(key, "attn_fwd", 128, 128, 2, h100, False,
                             time_fn=lambda c: 0.5 if c is winner else 1.0)
    assert best.tma and autotune.ident_of(best) == autotune.ident_of(winner)
    autotune.reset_memory()  # from the file
    monkeypatch.setattr(autotune, "TMA_BY_DEFAULT", False)
    assert autotune.cached(key).tma
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(configs, "_autotune_hook", autotune._hook)
        assert configs.select_config("attn_fwd", 128, 128, 2, h100).tma
    autotune.reset_memory()
