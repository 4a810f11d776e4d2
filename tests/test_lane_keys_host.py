"""Host logic a mutation round found untested: the launch cache's signature (dtype), alignment and races, the lanes'
refusals (forward-mode AD, dispatch modes), the small-q route's keys and top-left windows, paged varlen's unpaging
and checks, and the autotune cache's memory. Each test failed under one surviving mutation (the others were caught by
the modules' own test files)."""
import json

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from torch.nn.attention.bias import causal_lower_right

import flashtx
from flashtx import _small_q, _small_q_lane
from flashtx.triton_kernels import autotune, configs, launch
from flashtx.triton_kernels.configs import TileConfig

from conftest import DEVICE, ON_GPU, PRECISE_DTYPE, precise_randn

P = PRECISE_DTYPE
pytestmark = pytest.mark.usefixtures("fresh_plans")


@pytest.fixture(autouse=True)
def small_q_lane_on(monkeypatch):
    monkeypatch.setattr(_small_q_lane, "LANE", True)




def test_calls_differing_only_in_dtype_use_their_own_plan():
    """The launch cache's signature holds each tensor's dtype: a call that differs from a memoised one only there
    gets its own plan. (The interpreter reads the dtype from the tensors: only the accumulator's differs between
    float32 and float64 there. A GPU's compiled kernel is specialised on the pointers' dtype: float16 shows it.)"""
    other, atol = (torch.float16, 2e-3) if ON_GPU else (torch.float64, 1e-12)
    g, u = precise_randn(8, 64, dtype=torch.float32), precise_randn(8, 64, dtype=torch.float32)
    for _ in range(3):
        flashtx.swiglu(g, u)  # the float32 plan, memoised
    g2, u2 = g.to(other), u.to(other)  # the same shapes and strides
    want = (torch.nn.functional.silu(g2.double()) * u2.double()).to(other)
    torch.testing.assert_close(flashtx.swiglu(g2, u2), want, atol=atol, rtol=atol)


def test_a_tensor_8_bytes_off_16_byte_alignment_is_not_launched_directly(monkeypatch):
    """A GPU replay launches the compiled kernel directly only for tensors aligned as the planned ones (Triton
    specialises pointers on 16 bytes): one 8 bytes off must go through the kernel's run again (a stand-in kernel)."""
    log = []

    class Compiled:
        packed_metadata = function = None

        def run(self, *a):
            log.append("direct")

    class Kernel:
        arg_names = ["X", "Y", "N", "BLOCK"]

        def __getitem__(self, grid):
            return lambda **kw: (log.append("run"), Compiled())[1]

    class Driver:
        def get_current_device(self):
            return 0

        def get_current_stream(self, d):
            return 0

    monkeypatch.setattr(launch, "_INTERPRET", False)
    monkeypatch.setattr(launch, "_driver", lambda: Driver())
    monkeypatch.setattr(launch, "_no_launch_hooks", lambda: True)
    k = Kernel()

    def call(x, y):
        launch.LAUNCHES.run(("align8",), ("X", "Y"), (x, y),
                            lambda: [launch.Launch(k, (1, 1, 1), dict(X=x, Y=y, N=7, BLOCK=16))])
        return log[-1]

    x, y = torch.zeros(8), torch.zeros(8)
    call(x, y)
    assert call(x, y) == "direct"
    assert call(torch.zeros(10)[2:], y) == "run"  # 8 bytes off


def test_forward_ad_is_refused_once_a_lane_exists():
    g, u = precise_randn(8, 64), precise_randn(8, 64)
    with torch.no_grad():
        for _ in range(3):
            flashtx.swiglu(g, u)
    with fwAD.dual_level(), pytest.raises(NotImplementedError, match="forward-mode AD"):
        flashtx.swiglu(fwAD.make_dual(g, torch.randn_like(g)), u)


def test_a_dispatch_mode_sees_the_op_once_a_lane_exists():
    from torch.utils._python_dispatch import TorchDispatchMode
    class Log(TorchDispatchMode):
        ops = []
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))
    g, u = precise_randn(8, 64), precise_randn(8, 64)
    with torch.no_grad():
        for _ in range(3):
            flashtx.swiglu(g, u)
        with Log():
            flashtx.swiglu(g, u)
    assert "flashtx.swiglu.default" in Log.ops


@pytest.mark.parametrize("window", [(0, -1), (1, -1), (2, 1)])
def test_top_left_windows_on_the_decode_route(window):
    q, k, v = precise_randn(1, 2, 4, 16), precise_randn(1, 2, 37, 16), precise_randn(1, 2, 37, 16)
    with torch.no_grad():
        got = flashtx.attention(q, k, v, window_size=window)
        want = flashtx.attention(q, k, v, window_size=window, backend="reference")
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


@pytest.mark.skipif(ON_GPU, reason="the interpreter's rule: Triton refuses bf16 there (a GPU takes both dtypes)")
def test_triton_takes_is_answered_per_dtype():
    assert _small_q._triton_takes("cpu", None, torch.float16, 16, 16)
    assert not _small_q._triton_takes("cpu", None, torch.bfloat16, 16, 16)  # the interpreter refuses bf16


@pytest.mark.parametrize("which", ["q", "v", "mask"])
def test_same_shapes_other_strides_are_another_lane_key(which):
    B, H, Sq, Sk, D = 2, 2, 2, 37, 16
    q, k, v = precise_randn(B, H, Sq, D), precise_randn(B, H, Sk, D), precise_randn(B, H, Sk, D)
    m = torch.rand(B, Sk, device=DEVICE) > 0.3
    m[:, -1] = True
    m = m[:, None, None, :].clone()
    with torch.no_grad():
        for _ in range(3):
            flashtx.attention(q, k, v, attn_mask=m)
        if which == "q":
            q = precise_randn(B, H, Sq, 2 * D)[..., :D]
        elif which == "v":
            v = precise_randn(B, Sk, H, D).transpose(1, 2)
        else:
            mt = torch.rand(Sk, B, device=DEVICE) > 0.3
            mt[-1] = True
            m = mt.t()[:, None, None, :]
        got = flashtx.attention(q, k, v, attn_mask=m)
        want = flashtx.attention(q, k, v, attn_mask=m, backend="reference")
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_bottom_right_lane_is_not_used_for_top_left_causal():
    q, k, v = precise_randn(1, 2, 2, 16), precise_randn(1, 2, 37, 16), precise_randn(1, 2, 37, 16)
    with torch.no_grad():
        for _ in range(3):
            flashtx.attention(q, k, v, attn_mask=causal_lower_right(2, 37))
        got = flashtx.attention(q, k, v, is_causal=True)
        want = flashtx.attention(q, k, v, is_causal=True, backend="reference")
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_an_empty_last_sequence_with_padding_table_entries():
    page, D = 4, 16
    cuq = torch.tensor([0, 2, 3], dtype=torch.int32, device=DEVICE)
    cuk = torch.tensor([0, 5, 5], dtype=torch.int32, device=DEVICE)  # the last sequence has no keys
    q, k, v = precise_randn(3, 2, D), precise_randn(5, 2, D), precise_randn(5, 2, D)
    kc, vc = torch.zeros(6, page, 2, D, dtype=P, device=DEVICE), torch.zeros(6, page, 2, D, dtype=P, device=DEVICE)
    table = torch.full((2, 2), 10**6, dtype=torch.int32, device=DEVICE)  # past a sequence's pages: never read
    table[0] = torch.tensor([3, 1])
    for j in range(5):
        kc[table[0, j // page], j % page], vc[table[0, j // page], j % page] = k[j], v[j]
    got = flashtx.flash_attn_varlen_func(q, kc, vc, cuq, cuk, 2, 5, block_table=table)
    torch.testing.assert_close(got, flashtx.flash_attn_varlen_func(q, k, v, cuq, cuk, 2, 5), atol=0, rtol=0)


@pytest.mark.parametrize("case", ["heads", "device"])
def test_paged_caches_and_table_are_checked_by_name(case):
    q = precise_randn(3, 4, 16)
    cuq = torch.tensor([0, 2, 3], dtype=torch.int32, device=DEVICE)
    cuk = torch.tensor([0, 5, 9], dtype=torch.int32, device=DEVICE)
    kc, vc = precise_randn(4, 4, 2, 16), precise_randn(4, 4, 1 if case == "heads" else 2, 16)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32, device="meta" if case == "device" else DEVICE)
    pattern = r"k and v must have the same \(num_blocks" if case == "heads" else "block_table must be on q's device"
    with pytest.raises(ValueError, match=pattern):
        flashtx.flash_attn_varlen_func(q, kc, vc, cuq, cuk, 2, 5, block_table=table)


def test_nested_forced_blocks_keep_the_launch_cache_off():
    tile = TileConfig(16, 16, 4, 1)
    with autotune.forced("attn_fwd", tile):
        with autotune.forced("attn_bwd_dq", tile):
            pass
        assert not launch.LAUNCHES.enabled
    assert launch.LAUNCHES.enabled


def test_cache_memory_rules(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHTX_CACHE_DIR", str(tmp_path / "own"))
    autotune.reset_memory()
    key = "gpu|sm_90|triton x|kernels y|attn_fwd|16-bit|d64/64|causal=True|modified=False"
    autotune.store(key, TileConfig(64, 64, 4, 3), path=tmp_path / "other.json")
    assert autotune.cached(key) is None                      # A15: another file is not this process's cache
    (tmp_path / "bad.json").write_text(json.dumps({"version": 1, "entries": {"k": {"config": dict(
        block_m=0, block_n=64, num_warps=4, num_stages=1)}}}))
    with pytest.warns(UserWarning, match="malformed entry"):
        assert autotune.load_cache(tmp_path / "bad.json") == {}  # A8
    target = configs.KNOWN_TARGETS[sorted(configs.KNOWN_TARGETS)[0]]
    k2 = autotune.runtime_key("attn_fwd", 64, 64, 2, target, False, True)
    autotune.store(k2, TileConfig(16, 16, 2, 1))              # not a candidate
    for _ in range(2):                                        # A12: reset_memory forgets the verdict and the warning
        with pytest.warns(UserWarning, match="not one of the candidates"):
            assert autotune._cached_for(k2, "attn_fwd", 64, 64, 2, target, False, True) is None
        autotune.reset_memory()


def test_keep_rechecks_after_its_store():
    cache = launch.LaunchCache()
    class Racing(dict):
        def __setitem__(self, k, v):
            super().__setitem__(k, v)
            cache.drop_lanes()  # another thread's clear, between the store and the re-check
    table = Racing()
    assert not cache.keep(table, "k", "v", cache.generation) and "k" not in table


def test_clear_forgets_the_seen_signatures():
    q, k, v = precise_randn(1, 2, 1, 16), precise_randn(1, 2, 37, 16), precise_randn(1, 2, 37, 16)
    with torch.no_grad():
        flashtx.attention(q, k, v)
    assert launch.LAUNCHES.seen
    launch.LAUNCHES.clear()
    assert not launch.LAUNCHES.seen
