"""launch.LaunchCache: a repeated attention call replays its planned launches with only its tensors
rebound. A replay must launch exactly what planning would for the same tensors, rebind by role when
inputs are one object (self-attention), and fall back to planning where it cannot replay."""
import gc
import weakref

import pytest
import torch
from triton.compiler.compiler import CompiledKernel

import flashtx
from flashtx import reference
from flashtx.triton_kernels import attention_bwd, attention_bwd_launch, attention_fwd, autotune, launch
from flashtx.triton_kernels.mask_spec import MaskSpec

from conftest import DEVICE, PRECISE_DTYPE, poisoned_allocations, precise_atol, randn, same_launch_args


@pytest.fixture(autouse=True)
def fresh_cache():
    launch.LAUNCHES.clear()
    yield
    launch.LAUNCHES.clear()


def _record():
    calls = []
    return calls, launch.stub_launches(lambda kernel, grid, args: calls.append((kernel, grid, dict(args))))


def _specs(B, Sq, Sk, H):
    keep_k = torch.rand(B, Sk, device=DEVICE) > 0.3
    keep_q = torch.rand(B, Sq, device=DEVICE) > 0.2
    bias = randn(1, H, Sq, Sk, dtype=PRECISE_DTYPE)
    return {
        "plain": MaskSpec(),
        "bool masks": MaskSpec(key_mask=keep_k, query_mask=keep_q),
        "window+lens": MaskSpec(window=(5, 0), q_lens=torch.tensor([Sq, Sq - 3], device=DEVICE),
                                kv_lens=torch.tensor([Sk - 1, Sk], device=DEVICE)),
        "bias+softcap+dropout": MaskSpec(attn_mask=bias, softcap=5.0, dropout_p=0.2,
                                         rng=torch.tensor([7], dtype=torch.int64, device=DEVICE)),
    }


@pytest.mark.parametrize("case", ["plain", "bool masks", "window+lens", "bias+softcap+dropout"])
def test_a_replay_launches_what_planning_would(case):
    """The second call (a cache hit) launches exactly the plan built afresh for its own tensors."""
    B, H, Hkv, Sq, Sk, D = 2, 4, 2, 19, 23, 16
    spec = _specs(B, Sq, Sk, H)[case]
    q, do = randn(B, H, Sq, D, dtype=PRECISE_DTYPE), randn(B, H, Sq, D, dtype=PRECISE_DTYPE)
    k, v = randn(B, Hkv, Sk, D, dtype=PRECISE_DTYPE), randn(B, Hkv, Sk, D, dtype=PRECISE_DTYPE)
    fwd = dict(scale=0.3, causal=True, bottom_right=False, spec=spec)
    out, m2, l2 = attention_fwd.attention_forward(q, k, v, **fwd)  # a miss: planned and stored
    attention_bwd.attention_backward(do, q, k, v, out, m2, l2, gqa_split=False, **fwd)
    assert len(launch.LAUNCHES.entries) == 2
    calls, rec = _record()
    with rec:
        out, m2, l2 = attention_fwd.attention_forward(q, k, v, **fwd)  # hits
        dq, dk, dv = attention_bwd.attention_backward(do, q, k, v, out, m2, l2, gqa_split=False, **fwd)
    assert len(launch.LAUNCHES.entries) == 2 and len(calls) == 4
    want = [attention_fwd.plan_forward(q, k, v, out, m2, l2, **fwd)]
    want += attention_bwd.plan_backward(do, q, k, v, out, m2, l2, calls[1][2]["DELTA"], dq, dk, dv, **fwd)
    for (kernel, grid, args), w in zip(calls, want):
        assert kernel is w.kernel and grid == w.grid
        assert same_launch_args(args, w.args), [n for n in args if not same_launch_args({n: args[n]}, {n: w.args[n]})]


def test_self_attention_inputs_rebind_by_role():
    """Planned with q is k is v, replayed with three different tensors of that signature (and back)."""
    x = randn(1, 2, 17, 16, dtype=PRECISE_DTYPE)
    q, k, v = (randn(1, 2, 17, 16, dtype=PRECISE_DTYPE) for _ in range(3))
    flashtx.attention(x, x, x, is_causal=True, backend="triton")
    got = flashtx.attention(q, k, v, is_causal=True, backend="triton")
    want = flashtx.reference.attention(q, k, v, causal=True)
    assert (got - want).abs().max() < precise_atol(1e-12)
    got = flashtx.attention(x, x, x, is_causal=True, backend="triton")
    assert (got - flashtx.reference.attention(x, x, x, causal=True)).abs().max() < precise_atol(1e-12)


def test_replayed_calls_compute_with_their_own_tensors():
    """Fresh data each call through the public op, forward and backward, against the reference."""
    for seed in range(3):
        torch.manual_seed(seed)
        q, k, v = (randn(2, 3, 21, 16, dtype=PRECISE_DTYPE, requires_grad=True) for _ in range(3))
        keep = torch.rand(2, 21, device=DEVICE) > 0.3
        keep[:, 0] = True
        out = flashtx.attention(q, k, v, is_causal=True, key_mask=keep, backend="triton")
        grads = torch.autograd.grad(out.square().sum(), (q, k, v))
        ref = flashtx.attention(q, k, v, is_causal=True, key_mask=keep, backend="reference")
        ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
        assert (out - ref).abs().max() < precise_atol(1e-12)
        for g, r in zip(grads, ref_grads):
            assert (g - r).abs().max() < precise_atol(1e-11)
    assert len(launch.LAUNCHES.entries) == 2  # one forward and one backward signature


@pytest.mark.parametrize("layout", ["dense", "packed-qkv"])
def test_flash_layout_replays_bind_the_callers_tensors(layout, monkeypatch):
    """flash_attn_func passes its (B, S, H, D) tensors to the op as they are (Ints.bshd): the launchers plan
    on (B, H, S, D) views of them once per signature, and every replay binds the caller's tensors
    themselves (the same memory), with fresh data each call, forward and backward; autograd records the
    op alone (no transposes)."""
    from flashtx import reference
    from flashtx.triton_kernels import attention_bwd_launch

    plans = []
    for mod, name in ((attention_fwd, "plan_forward"), (attention_bwd_launch, "plan_backward")):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _real=real, _n=name, **kw: plans.append(_n) or _real(*a, **kw))
    for seed in range(3):
        torch.manual_seed(seed)
        if layout == "dense":
            q, k, v = (randn(2, 21, h, 16, dtype=PRECISE_DTYPE, requires_grad=True) for h in (4, 2, 2))
            leaves = (q, k, v)
        else:  # slices of one (B, S, 3, H, D) tensor: not dense, strides of the packed projection
            qkv = randn(2, 21, 3, 2, 16, dtype=PRECISE_DTYPE, requires_grad=True)
            q, k, v = qkv.unbind(2)
            leaves = (qkv,)
        out = flashtx.flash_attn_func(q, k, v, causal=True, backend="triton")
        assert out.grad_fn.name() == "AttnFwdBackward"  # the op's node, no TransposeBackward around it
        grads = torch.autograd.grad(out.square().sum(), leaves)
        qr, kr, vr = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v))
        ref = reference.attention(qr, kr, vr, causal=True, bottom_right=True).transpose(1, 2)
        ref_grads = torch.autograd.grad(ref.square().sum(), (qr, kr, vr))
        assert (out - ref).abs().max() < precise_atol(1e-12)
        got = grads if layout == "dense" else grads[0].unbind(2)
        for g, r in zip(got, ref_grads):
            assert (g - r.transpose(1, 2)).abs().max() < precise_atol(1e-11)
    assert plans == ["plan_forward", "plan_backward"]  # planned once, replayed twice
    assert len(launch.LAUNCHES.entries) == 2


def test_split_gqa_backward_replays_with_fresh_partials():
    """A split GQA dK/dV (fp32 per-q-head partials summed afterwards) replays from the cache: its
    partials are allocated per call by attention_backward, not by the plan."""
    q, do = randn(1, 4, 13, 16, dtype=PRECISE_DTYPE), randn(1, 4, 13, 16, dtype=PRECISE_DTYPE)
    k, v = randn(1, 1, 13, 16, dtype=PRECISE_DTYPE), randn(1, 1, 13, 16, dtype=PRECISE_DTYPE)
    out, m2, l2 = attention_fwd.attention_forward(q, k, v, scale=0.25, causal=True)
    grads = [attention_bwd.attention_backward(do, q, k, v, out, m2, l2, scale=0.25, causal=True, gqa_split=split)
             for split in (True, True, False)]
    assert len(launch.LAUNCHES.entries) == 3  # the forward, the split and the unsplit backward
    for a, b in zip(grads[0], grads[2]):
        assert (a - b).abs().max() < precise_atol(1e-12)
    assert all(torch.equal(a, b) for a, b in zip(grads[0], grads[1]))


def test_plans_with_a_scratch_buffer_and_a_host_step_are_replayed():
    """A bias gradient summed over the query dim goes through an fp32 buffer the plan allocates (a Scratch) and is
    reduced on the host (DbiasReduce, a HostStep): the cache entry replays both, the buffer allocated afresh and
    the reduce writing the call's own (NaN-poisoned) dbias, with the planned call's result."""
    B, H, S, D = 1, 2, 13, 16
    q, k, v, do = (randn(B, H, S, D, dtype=PRECISE_DTYPE) for _ in range(4))
    spec = MaskSpec(attn_mask=randn(B, H, 1, S, dtype=PRECISE_DTYPE))
    out, m2, l2 = attention_fwd.attention_forward(q, k, v, scale=0.25, causal=True, spec=spec)
    dbs = [torch.full((B, H, 1, S), float("nan"), dtype=PRECISE_DTYPE, device=DEVICE) for _ in range(3)]
    grads = [attention_bwd.attention_backward(do, q, k, v, out, m2, l2, scale=0.25, causal=True, spec=spec, dbias=db)
             for db in dbs]
    assert len(launch.LAUNCHES.entries) == 2  # the forward and the backward
    entry = next(e for (key, _), e in launch.LAUNCHES.entries.items() if key[0] == "attn_bwd")
    assert type(entry) is launch._HostEntry
    assert [type(r).__name__ for r in entry] == ["_ScratchReplay", "_Replay", "_Replay", "_Replay", "_HostReplay"]
    for g, db in zip(grads[1:], dbs[1:]):
        assert all(torch.equal(a, b) for a, b in zip(grads[0], g)) and torch.equal(dbs[0], db)
    assert not dbs[0].isnan().any()
    planned = torch.empty(3, 5, dtype=torch.float32).t()
    fresh = []
    launch._ScratchReplay(planned).fire(fresh)
    assert fresh[0] is not planned and (fresh[0].shape, fresh[0].stride(), fresh[0].dtype) == (
        planned.shape, planned.stride(), planned.dtype)
    planned_dbias = weakref.ref(dbs[0])
    del dbs[0], grads  # the entry keeps no tensor of the call it was planned on (the plan's fp32 buffer included)
    gc.collect()
    assert planned_dbias() is None and not any(type(t) is torch.Tensor for r in entry if type(r) is launch._HostReplay
                                                 for t in vars(r.step).values())
    dbs.insert(0, torch.empty(B, H, 1, S, dtype=PRECISE_DTYPE, device=DEVICE))
    assert launch.LAUNCHES.entry(*attention_bwd_launch._cache_args(
        do, q, k, v, out, m2, l2, *(torch.empty_like(t) for t in (q, k, v)), None, dbs[0], torch.empty_like(m2),
        (None, None), 1, 0.25, True, False, spec, False)) is None  # (a lane fires launches only)


def test_plans_with_other_host_steps_are_not_stored_and_still_run():
    """A step that is neither a Launch, a Scratch nor a HostStep: planned and run on every call."""
    q = randn(1, 2, 8, 16, dtype=PRECISE_DTYPE)
    runs = []

    class Step:
        def run(self):
            runs.append(1)

    for _ in range(2):
        launch.LAUNCHES.run(("test-host",), ("X",), (q,), lambda: [Step()])
    assert runs == [1, 1] and not any(key[0] == "test-host" for key, _ in launch.LAUNCHES.entries)


def test_not_consulted_while_tracing_or_when_disabled():
    q = randn(1, 2, 8, 16, dtype=PRECISE_DTYPE)
    assert launch._signature((q, None), 2) is not None
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode() as mode:
        assert launch._signature((mode.from_tensor(q),), 1) is None
    calls = []
    launch.LAUNCHES.enabled = False
    try:
        launch.LAUNCHES.run(("test",), ("X",), (q,), lambda: calls.append(1) or [])
        launch.LAUNCHES.run(("test",), ("X",), (q,), lambda: calls.append(1) or [])
    finally:
        launch.LAUNCHES.enabled = True
    assert calls == [1, 1] and not launch.LAUNCHES.entries


def test_the_autotuner_plans_afresh_while_it_forces_a_config():
    """Inside autotune.forced the cache is off (each timed candidate must launch its own tile), and
    turning autotuning on forgets launches planned without it."""
    q, k, v = (randn(1, 2, 8, 16, dtype=PRECISE_DTYPE) for _ in range(3))
    flashtx.attention(q, k, v, backend="triton")
    assert launch.LAUNCHES.entries
    with autotune.forced("attn_fwd", attention_fwd.select_config("attn_fwd", 16, 16, 8, launch.INTERPRETER_TARGET)):
        assert not launch.LAUNCHES.enabled
    assert launch.LAUNCHES.enabled
    was = autotune.enabled()
    autotune.autotune(True)
    try:
        assert not launch.LAUNCHES.entries
    finally:
        autotune.autotune(was)


class _Compiled:
    """Stands in for Triton's CompiledKernel: its own `compiled[grid](*args, stream=...)` (Triton's __getitem__, which
    hands the launcher grid[0], grid[1] and grid[2]), with the launcher recording a direct launch."""

    __getitem__ = CompiledKernel.__getitem__
    packed_metadata = function = None

    def __init__(self, log):
        self.log = log
        self.hooks = []  # (launch metadata, enter hook, exit hook) of each direct launch

    def _init_handles(self):
        pass

    def launch_metadata(self, grid, stream, *args):
        return "metadata"

    def run(self, grid_0, grid_1, grid_2, stream, function, packed_metadata, launch_metadata, enter, exit, *args):
        self.log.append(("direct", (grid_0, grid_1, grid_2), args, stream))
        self.hooks.append((launch_metadata, enter, exit))


class _Kernel:
    """Stands in for a JITFunction on a GPU: `kernel[grid](**kwargs)` records a launch through
    JITFunction.run and returns the compiled kernel, as Triton's does."""

    arg_names = ["X", "Y", "N", "BLOCK"]

    def __init__(self):
        self.log = []
        self.compiled = _Compiled(self.log)

    def __getitem__(self, grid):
        def run(**kw):
            self.log.append(("run", grid, kw, None))
            return self.compiled
        return run


class _Driver:
    device = 0

    def get_current_device(self):
        return self.device

    def get_current_stream(self, device):
        return 1000 + device


def _on_a_gpu(monkeypatch):
    """(driver, kernel) stand-ins, with launch.py taking its GPU branch (no interpreter, the stand-in driver)."""
    driver = _Driver()
    monkeypatch.setattr(launch, "_INTERPRET", False)
    monkeypatch.setattr(launch, "_driver", lambda: driver)
    return driver, _Kernel()


def test_gpu_replays_launch_the_compiled_kernel_directly(monkeypatch):
    """On a GPU (stand-ins for the kernel, Triton's compiled kernel and its driver), a replay's first launch
    goes through the kernel (JITFunction.run) and later ones call the compiled kernel with the arguments in
    the kernel's parameter order, its own tensors rebound, on the current stream. A tensor whose 16-byte
    alignment changed (Triton specialises on it), another current device, DIRECT_LAUNCH = False and stubbed
    launches all go back through the kernel."""
    driver, kernel = _on_a_gpu(monkeypatch)

    def call(x, y):
        launch.LAUNCHES.run(("direct-test",), ("X", "Y"), (x, y),
                            lambda: [launch.Launch(kernel, (3, 1, 1), {"Y": y, "N": 7, "X": x, "BLOCK": 16})])
        return kernel.log[-1]

    x, y = torch.zeros(8), torch.zeros(8)
    assert call(x, y) == ("run", (3, 1, 1), {"X": x, "Y": y, "N": 7, "BLOCK": 16, **launch.BACKEND_OPTIONS}, None)
    x2, y2 = torch.zeros(8), torch.zeros(8)
    how, grid, args, stream = call(x2, y2)
    assert (how, grid, stream) == ("direct", (3, 1, 1), 1000) and args[0] is x2 and args[1] is y2 and args[2:] == (7, 16)
    shifted = torch.zeros(9)[1:]  # 4 bytes past an aligned start: Triton would pick another specialisation
    assert shifted.data_ptr() % 16 != 0
    assert call(shifted, y2)[0] == "run"
    assert call(x2, y2)[0] == "run"  # the recapture takes the misaligned one's alignment...
    assert call(x, y)[0] == "direct"  # ...and aligned tensors launch directly again after it
    driver.device = 1
    assert call(x, y)[0] == "run"
    driver.device = 0
    monkeypatch.setattr(launch, "DIRECT_LAUNCH", False)
    assert call(x, y)[0] == "run"
    monkeypatch.setattr(launch, "DIRECT_LAUNCH", True)
    n = len(kernel.log)
    with launch.stub_launches():
        call(x, y)
    assert len(kernel.log) == n  # the stub took it


def test_direct_launches_feed_triton_launch_hooks_only_when_some_are_set(monkeypatch):
    """Without launch hooks (Triton's knobs.runtime.launch_enter_hook / launch_exit_hook empty), a direct launch calls
    the compiled kernel's launcher with JITFunction.run's arguments but no launch metadata and None hooks (which the
    launcher skips); with a hook added to either chain, or set as a plain function, it goes through
    CompiledKernel[grid], whose runner builds the metadata and passes the hooks. The same arguments either way."""
    from triton import knobs

    driver, kernel = _on_a_gpu(monkeypatch)
    x, y = torch.zeros(8), torch.zeros(8)

    def call():
        launch.LAUNCHES.run(("hooks-test",), ("X", "Y"), (x, y),
                            lambda: [launch.Launch(kernel, (3, 1, 1), {"Y": y, "N": 7, "X": x, "BLOCK": 16})])
        return kernel.log[-1], kernel.compiled.hooks[-1] if kernel.compiled.hooks else None

    call()  # (the first launch: through the kernel)
    plain, hooks = call()
    assert plain[0] == "direct" and hooks == (None, None, None)
    rt = knobs.runtime
    seen = []
    for where in ("launch_enter_hook", "launch_exit_hook"):
        getattr(rt, where).add(seen.append)
        try:
            got, hooks = call()
        finally:
            getattr(rt, where).remove(seen.append)
        assert got == plain and hooks == ("metadata", rt.launch_enter_hook, rt.launch_exit_hook), where
    chain = rt.launch_enter_hook
    with monkeypatch.context() as m:
        m.setattr(rt, "launch_enter_hook", seen.append)  # the older form: a plain function
        got, hooks = call()
    assert got == plain and hooks == ("metadata", seen.append, rt.launch_exit_hook)
    assert rt.launch_enter_hook is chain and call()[1] == (None, None, None) and not seen


@pytest.mark.parametrize("grid", [(3,), (3, 2)], ids=["1d", "2d"])
def test_gpu_replays_of_a_short_grid_launch_three_dims(monkeypatch, grid):
    """SwiGLU's (n,) grid, RoPE's (n, nb), the KV append's and the index checks': JITFunction.run pads a grid to
    three dims, Triton's compiled kernel does not (it reads grid[2]), so every replay's direct launch of these
    raised IndexError on a GPU. A replay holds its grid padded: the same launch through either path."""
    driver, kernel = _on_a_gpu(monkeypatch)
    x, y = torch.zeros(8), torch.zeros(8)
    for _ in range(3):
        launch.LAUNCHES.run(("short-grid", grid), ("X", "Y"), (x, y),
                            lambda: [launch.Launch(kernel, grid, {"Y": y, "N": 7, "X": x, "BLOCK": 16})])
    padded = grid + (1,) * (3 - len(grid))
    assert [(how, g) for how, g, _, _ in kernel.log] == [("run", padded), ("direct", padded), ("direct", padded)]


def test_a_plan_made_while_a_tuner_starts_is_used_once_and_not_kept():
    """A call that planned with the cache on while a tuner started in another thread (LaunchCache.drop_lanes, as
    autotune._tuning_block does) runs its plan but does not store it: a plan made with an untuned default, or with
    the other thread's forced candidate, must not outlive the tuning. The next call plans and keeps its own."""
    calls, recording = _record()
    kernel = _Kernel()
    x = torch.zeros(8)

    def call(tuner_starts: bool):
        def build():
            if tuner_starts:
                launch.LAUNCHES.drop_lanes()
            return [launch.Launch(kernel, (1, 1, 1), {"X": x, "Y": x, "N": 7, "BLOCK": 16})]
        launch.LAUNCHES.run(("tuner-race",), ("X",), (x,), build)
        return launch.LAUNCHES.entry(("tuner-race",), ("X",), (x,), lambda: 1 / 0)  # stored, or planned now
    with recording:
        with pytest.raises(ZeroDivisionError):
            call(True)
        assert len(calls) == 1 and not launch.LAUNCHES.entries
        assert call(False) and len(calls) == 2 and len(launch.LAUNCHES.entries) == 1


def test_a_direct_launch_uses_the_compiled_kernel_it_checked(monkeypatch):
    """Another thread may recapture a replay's compiled kernel (for other alignment bits) between this thread's
    device and alignment check and its launch; here it does so while the scratch allocator is installed. The
    launch must use the kernel it checked, not the new one with the old one's check."""
    driver, kernel = _on_a_gpu(monkeypatch)
    x, y = torch.zeros(8), torch.zeros(8)

    def call():
        launch.LAUNCHES.run(("race-test",), ("X", "Y"), (x, y), lambda: [
            launch.Launch(kernel, (1, 1, 1), {"X": x, "Y": y, "N": 7, "BLOCK": 16}, descriptors=("X",))])
    call()  # planned, launched through the kernel: the replay keeps its compiled kernel
    (replay,) = next(iter(launch.LAUNCHES.entries.values()))
    other = []
    monkeypatch.setattr(launch, "ensure_scratch_allocator",
                        lambda: setattr(replay, "direct", (_Compiled(other), driver.device, 0)))  # "another thread"
    call()
    assert kernel.log[-1][0] == "direct" and other == []


def test_plans_pass_every_kernel_parameter_so_gpu_replays_can_launch_directly():
    """Direct launches pass arguments by position, so every memoised attention, decode, RoPE and SwiGLU launch
    must name each of its kernel's parameters (no defaults left to Triton's binder)."""
    import flashtx.decode  # noqa: F401

    B, H, S, D = 1, 2, 9, 16
    q, k, v = (randn(B, H, S, D, dtype=PRECISE_DTYPE, requires_grad=True) for _ in range(3))
    flashtx.attention(q, k, v, is_causal=True, backend="triton").sum().backward()
    kc, vc = torch.zeros(B, 32, H, D, dtype=PRECISE_DTYPE, device=DEVICE), torch.zeros(B, 32, H, D, dtype=PRECISE_DTYPE,
                                                                                    device=DEVICE)
    flashtx.flash_attn_with_kvcache(randn(B, 1, H, D, dtype=PRECISE_DTYPE), kc, vc, k=randn(B, 1, H, D, dtype=PRECISE_DTYPE),
                                    v=randn(B, 1, H, D, dtype=PRECISE_DTYPE),
                                    cache_seqlens=torch.tensor([5], dtype=torch.int32, device=DEVICE))
    x = randn(2, 6, 2, 16, dtype=PRECISE_DTYPE, requires_grad=True)
    cos, sin = torch.rand(6, 8, dtype=PRECISE_DTYPE, device=DEVICE), torch.rand(6, 8, dtype=PRECISE_DTYPE, device=DEVICE)
    (flashtx.apply_rotary(x, cos, sin) + flashtx.swiglu(x, x * 2)).sum().backward()
    replays = [r for entry in launch.LAUNCHES.entries.values() for r in entry]
    kernels = {r.kernel.__name__ for r in replays}
    assert {"_attn_fwd", "_attn_bwd_dkdv", "_attn_bwd_dq", "_rotary_kernel", "_swiglu_kernel"} <= kernels, kernels
    assert any("decode" in n for n in kernels), kernels
    assert all(r.positional for r in replays), [r.kernel.__name__ for r in replays if not r.positional]
    # and a three-dim grid: Triton's compiled kernel reads grid[0..2] (RoPE's and SwiGLU's grids are shorter)
    assert all(len(r.grid) == 3 for r in replays), [(r.kernel.__name__, r.grid) for r in replays]


def test_rope_at_a_new_int_offset_each_step_replays_one_entry():
    """Decoding rotates at seqlen_offsets = the cache length, a new int each step: every step replays one
    launch-cache entry per direction (the tables narrowed to [offset, offset + S)), not an entry per step
    (which would fill the cache and evict attention's entries), nor a plan per call; values and gradients
    are those of the reference at positions s + offset. A varlen call at an int offset keys no entry."""
    cos, sin = torch.rand(40, 8, dtype=PRECISE_DTYPE, device=DEVICE), torch.rand(40, 8, dtype=PRECISE_DTYPE,
                                                                                   device=DEVICE)
    zeros = torch.zeros(6, dtype=torch.long, device=DEVICE)

    def want(x, positions, conjugate=False):  # x: (N, H, D) tokens at `positions`
        return reference.rotary_tokens(x, cos[None], sin[None], zeros[:x.shape[0]], positions, conjugate=conjugate)

    for step in range(1, 7):
        x = randn(2, 1, 3, 16, dtype=PRECISE_DTYPE, requires_grad=True)
        got = flashtx.apply_rotary(x, cos, sin, seqlen_offsets=step)
        got.backward(torch.ones_like(got))
        if step == 1:
            signatures = set(launch.LAUNCHES.entries)
            assert len(signatures) == 2, signatures  # the forward and the conjugate backward
        assert set(launch.LAUNCHES.entries) == signatures  # replayed, nothing added
        pos = zeros[:2] + step
        assert (got.reshape(2, 3, 16) - want(x.detach().reshape(2, 3, 16), pos)).abs().max() < precise_atol(1e-12)
        grad = want(torch.ones(2, 3, 16, dtype=PRECISE_DTYPE, device=DEVICE), pos, conjugate=True)
        assert (x.grad.reshape(2, 3, 16) - grad).abs().max() < precise_atol(1e-12)
    x = randn(5, 3, 16, dtype=PRECISE_DTYPE)
    cu = torch.tensor([0, 2, 5], dtype=torch.int32, device=DEVICE)
    for step in range(1, 4):
        got = flashtx.apply_rotary(x, cos, sin, seqlen_offsets=step, cu_seqlens=cu, max_seqlen=3)
        assert set(launch.LAUNCHES.entries) == signatures
        pos = torch.tensor([0, 1, 0, 1, 2], device=DEVICE) + step
        assert (got - want(x, pos)).abs().max() < precise_atol(1e-12)


def test_rope_in_place_without_k_replays_one_entry(monkeypatch):
    """In place without k, rotary's launch passes q in for the absent k (K is q is qo): that stand-in binds to q's
    role (the first of the inputs it is), so the call replays one entry instead of planning every time (the
    launcher's path: flashtx._rotary_lane off)."""
    from flashtx import _rotary_lane

    monkeypatch.setattr(_rotary_lane, "LANE", False)
    cos, sin = torch.rand(8, 4, dtype=PRECISE_DTYPE, device=DEVICE), torch.rand(8, 4, dtype=PRECISE_DTYPE,
                                                                                 device=DEVICE)
    for seed in range(3):
        x = randn(1, 8, 2, 16, dtype=PRECISE_DTYPE)
        want = flashtx.apply_rotary(x, cos, sin, backend="reference")
        with torch.no_grad():
            flashtx.apply_rotary(x, cos, sin, inplace=True)
        assert (x - want).abs().max() < precise_atol(1e-12)
        assert len(launch.LAUNCHES.entries) == 1


def test_rope_in_place_and_out_of_place_calls_keep_separate_entries():
    """A partial rotary's pass-through columns are copied only out of place (the plan branches on qo is q): an
    in-place q+k call's entry replayed for an out-of-place call of the same signature left them unwritten
    (garbage in the output; they are poisoned here). The two calls key two entries, each with its own plan."""
    cos, sin = torch.rand(8, 8, dtype=PRECISE_DTYPE, device=DEVICE), torch.rand(8, 8, dtype=PRECISE_DTYPE,
                                                                                 device=DEVICE)  # rotary_dim 16 < 32
    q, k = randn(1, 8, 2, 32, dtype=PRECISE_DTYPE), randn(1, 8, 1, 32, dtype=PRECISE_DTYPE)
    want = flashtx.apply_rotary_qk(q, k, cos, sin, backend="reference")
    for first_in_place in (True, False):
        launch.LAUNCHES.clear()
        for inplace in (first_in_place, not first_in_place):
            if inplace:
                got = flashtx.apply_rotary_qk(q.clone(), k.clone(), cos, sin, inplace=True)
            else:
                with poisoned_allocations():
                    got = flashtx.apply_rotary_qk(q, k, cos, sin)
            for g, w in zip(got, want):
                assert (g - w).abs().max() < precise_atol(1e-12), (first_in_place, inplace)
        assert len(launch.LAUNCHES.entries) == 2


@pytest.mark.parametrize("given", ["kv_lens", "q_lens"])
def test_one_sided_lengths_replay_one_plan(given, monkeypatch, fresh_plans):
    """kv_lens without q_lens (or the reverse) is planned once per signature: the missing lengths are a full-length
    tensor made with the call's inputs (made inside the launch plan, they tied the launch to no input, so every
    call was planned anew). Each call computes with its own lengths, as with both given."""
    from flashtx.triton_kernels import attention_bwd_launch

    plans = []
    for mod, name in ((attention_fwd, "plan_forward"), (attention_bwd_launch, "plan_backward")):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _real=real, _n=name, **kw: plans.append(_n) or _real(*a, **kw))
    B, Sq, Sk = 2, 11, 17
    for lens in ([17, 5], [3, 9], [0, 17]):
        q = randn(B, Sq, 2, 16, dtype=PRECISE_DTYPE, requires_grad=True)
        k, v = (randn(B, Sk, 2, 16, dtype=PRECISE_DTYPE, requires_grad=True) for _ in range(2))
        n = torch.tensor(lens if given == "kv_lens" else [min(x, Sq) for x in lens], device=DEVICE)
        full = torch.full((B,), Sq if given == "kv_lens" else Sk, dtype=n.dtype, device=DEVICE)
        both = dict(kv_lens=n, q_lens=full) if given == "kv_lens" else dict(q_lens=n, kv_lens=full)
        out = flashtx.flash_attn_func(q, k, v, causal=True, backend="triton", **{given: n})
        grads = torch.autograd.grad(out.square().sum(), (q, k, v))
        want = flashtx.flash_attn_func(q, k, v, causal=True, backend="triton", **both)  # (the same entry)
        want_grads = torch.autograd.grad(want.square().sum(), (q, k, v))
        assert torch.equal(out, want) and all(torch.equal(g, w) for g, w in zip(grads, want_grads))
        ref = flashtx.flash_attn_func(q, k, v, causal=True, backend="reference", **both)
        ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
        assert (out - ref).abs().max() < precise_atol(1e-12)
        assert all((g - r).abs().max() < precise_atol(1e-11) for g, r in zip(grads, ref_grads))
    assert plans == ["plan_forward", "plan_backward"]  # planned once, replayed for every other call
