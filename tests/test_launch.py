"""run_kernel's GPU branch, with a stand-in kernel (the CPU suite otherwise runs the interpreter's):
eager launches are plain `kernel[grid](...)` calls, never torch.library.wrap_triton's higher-order op
(about 1 ms an eager launch), and traced launches (a dispatch mode active) go through wrap_triton so
Inductor records the kernel."""
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from flashtx.triton_kernels import launch


class StandIn:
    """Records how it was launched; wrap_triton is replaced by a recorder too."""

    def __init__(self):
        self.plain, self.wrapped = [], []

    def __getitem__(self, grid):
        return lambda **kw: self.plain.append((grid, kw))


def test_eager_launch_is_plain_and_traced_launch_is_wrapped(monkeypatch):
    kernel = StandIn()

    def wrap_triton(k):
        assert k is kernel
        return type("W", (), {"__getitem__": lambda self, grid: lambda **kw: kernel.wrapped.append((grid, kw))})()

    monkeypatch.setattr(torch.library, "wrap_triton", wrap_triton)
    monkeypatch.setattr(launch, "_INTERPRET", False)  # the GPU branch
    x = torch.ones(3)
    launch.run_kernel(kernel, (2, 1, 1), {"X": x, "N": 3}, {"num_warps": 4})
    assert kernel.plain == [((2, 1, 1), {"X": x, "N": 3, "num_warps": 4, "enable_fp_fusion": True})]
    assert kernel.wrapped == []
    with FakeTensorMode():
        fake = torch.empty(3)
        launch.run_kernel(kernel, (2, 1, 1), {"X": fake, "N": 3}, {"num_warps": 4})
    assert len(kernel.plain) == 1 and len(kernel.wrapped) == 1
    assert kernel.wrapped[0][1] == {"X": fake, "N": 3, "num_warps": 4, **launch._traced_options()}


def test_fp_fusion_is_asked_for_where_the_compiler_can_take_it(monkeypatch):
    """FP fusion is on in every eager launch (Triton 3.10 turns its default off). A traced launch passes it only
    where Inductor compiles a user kernel's backend options (it filters launch kwargs per target); an older
    Inductor would take it for a kernel argument."""
    assert launch.BACKEND_OPTIONS == {"enable_fp_fusion": True}
    try:
        from torch._inductor.runtime.triton_helpers import try_filter_backend_options_for_target  # noqa: F401
        takes = True
    except ImportError:
        takes = False
    monkeypatch.setattr(launch, "_TRACED_OPTIONS", None)
    assert launch._traced_options() == (launch.BACKEND_OPTIONS if takes else {})


def test_a_call_on_another_gpus_tensors_launches_with_that_device_current(monkeypatch):
    """Triton launches on the current device and stream: an op called on tensors of another GPU (a model
    split over GPUs) launches every kernel, forward and backward, with their device made current. Stand-ins:
    the tensors' "device" (CPU tensors) and torch.cuda.device (records what was made current)."""
    import flashtx
    from flashtx import _library, _validate

    current = [0]

    class Device:  # torch.cuda.device(i) stand-in
        def __init__(self, i):
            self.i = i

        def __enter__(self):
            self.prev, current[0] = current[0], self.i

        def __exit__(self, *exc):
            current[0] = self.prev

    monkeypatch.setattr(_library, "_other_device", lambda t: None if current[0] == 1 else 1)  # tensors "on cuda:1"
    monkeypatch.setattr(torch.cuda, "device", Device)
    launched = []
    g, u = torch.randn(4, 32, requires_grad=True), torch.randn(4, 32, requires_grad=True)
    q, k = torch.randn(1, 8, 2, 16, requires_grad=True), torch.randn(1, 8, 2, 16, requires_grad=True)
    with launch.stub_launches(lambda kernel, grid, args: launched.append(current[0])):
        for _ in range(2):  # (a second call of a signature would take its lane: flashtx._swiglu_lane)
            with torch.no_grad():
                flashtx.swiglu(g, u, backend="triton")
            out = flashtx.swiglu(g, u, backend="triton")
            torch.autograd.grad(out, (g, u), torch.randn_like(out))
        a = flashtx.attention(q, k, k, backend="triton")
        torch.autograd.grad(a, (q, k), torch.randn_like(a))
        cos, sin = torch.rand(8, 8), torch.rand(8, 8)
        for _ in range(2):  # RoPE's second call of a signature takes its lane (flashtx._rotary_lane)
            with torch.no_grad():
                flashtx.apply_rotary_qk(q.clone(), k.clone(), cos, sin, inplace=True)
            r = flashtx.apply_rotary_qk(q, k, cos, sin)
            torch.autograd.grad(r, (q, k), [torch.randn_like(t) for t in r])
        # packed sequences: cu_seqlens checked on the device as on a GPU (its flags' asserts stood in for too)
        monkeypatch.setattr(_validate, "_values_readable", lambda t: False)
        monkeypatch.setattr(torch, "_assert_async", lambda *a, **kw: None)
        cu, x = torch.tensor([0, 3, 8], dtype=torch.int32), torch.randn(8, 2, 16, requires_grad=True)
        n = len(launched)
        for _ in range(3):  # the check's lane from the second call (_validate._check_lane)
            o = flashtx.flash_attn_varlen_func(x, x, x, cu, cu, 5, 5, causal=True, backend="triton")
            torch.autograd.grad(o, x, torch.randn_like(o))
            flashtx.apply_rotary(x.detach(), cos, sin, cu_seqlens=cu, max_seqlen=5)
        assert len(launched) >= n + 3 * 6
    assert len(launched) >= 33 and set(launched) == {1}, launched
    assert current[0] == 0  # restored


def test_traced_fp_fusion_survives_inductors_option_filter(monkeypatch):
    """Where a traced launch passes BACKEND_OPTIONS, Inductor's per-target filter keeps them as compiler options
    for sm_86 (what it writes into the compiled kernel's triton_meta["backend_options"])."""
    options = launch._traced_options()
    if not options:
        import pytest
        pytest.skip("this torch's Inductor does not take backend options from a user kernel's launch")
    from torch._inductor.runtime.triton_helpers import try_filter_backend_options_for_target
    from triton.backends.compiler import GPUTarget

    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9 warns while parsing the target's option names

    kept = try_filter_backend_options_for_target(GPUTarget("cuda", 86, 32), {**options, "num_warps": 4, "X": 1}, ("X",))
    assert kept == {**options, "num_warps": 4}


def test_compile_check_compiles_with_fp_fusion(tmp_path):
    """The compile check (what CI compiles for sm_80/86/90) builds a launch with run_kernel's options: FP fusion is on
    where Triton's default is off (TRITON_DEFAULT_FP_FUSION=0, as Triton 3.10 will have it)."""
    import os
    import subprocess
    import sys

    code = (
        "import torch\n"
        "from flashtx.triton_kernels.compile_check import compile_launch\n"
        "from flashtx.triton_kernels.configs import KNOWN_TARGETS\n"
        "from flashtx.triton_kernels.swiglu import plan_swiglu\n"
        "g = torch.empty(64, 256, dtype=torch.float16)\n"
        "t = KNOWN_TARGETS[86]\n"
        "k = compile_launch(plan_swiglu(g, g, torch.empty_like(g), target=t), t)\n"
        "print('fusion', k.metadata.enable_fp_fusion)\n")
    drop = ("TRITON_INTERPRET", "FLASHTX_INTERPRET", "TRITON_DEFAULT_FP_FUSION", "TRITON_FORCE_DISABLE_FP_FUSION")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # a cold compile: a cached one would skip the option's parsing
    env["TRITON_DEFAULT_FP_FUSION"] = "0"  # Triton 3.10's default, on any Triton (3.6 reads the variable too)
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "fusion True" in proc.stdout, proc.stdout
