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
    assert kernel.plain == [((2, 1, 1), {"X": x, "N": 3, "num_warps": 4})] and kernel.wrapped == []
    with FakeTensorMode():
        fake = torch.empty(3)
        launch.run_kernel(kernel, (2, 1, 1), {"X": fake, "N": 3}, {"num_warps": 4})
    assert len(kernel.plain) == 1 and len(kernel.wrapped) == 1


def test_a_call_on_another_gpus_tensors_launches_with_that_device_current(monkeypatch):
    """Triton launches on the current device and stream: an op called on tensors of another GPU (a model
    split over GPUs) launches every kernel, forward and backward, with their device made current. Stand-ins:
    the tensors' "device" (CPU tensors) and torch.cuda.device (records what was made current)."""
    import flashtx
    from flashtx import _library

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
    assert len(launched) >= 15 and set(launched) == {1}, launched
    assert current[0] == 0  # restored
