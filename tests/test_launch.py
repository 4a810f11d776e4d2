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
