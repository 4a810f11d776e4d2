"""Launch plans: what a launcher would run, so the compile check can compile exactly that.

A launcher builds a list of `Launch`es from real tensors and a `Target`, then runs them. The
compile check builds the same plans for sm_80/86/90 from CPU tensors and compiles each one with
Triton's own argument specialisation, without a GPU.
"""
from __future__ import annotations

import dataclasses
import math

import torch
import triton.language as tl

from .configs import INTERPRETER_TARGET, Target, TileConfig, cuda_target, interpreter_active

# Accumulator dtype per input dtype: fp32 for the half types and fp32, fp64 for fp64 (tests).
ACC_DTYPE = {
    torch.float16: tl.float32,
    torch.bfloat16: tl.float32,
    torch.float32: tl.float32,
    torch.float64: tl.float64,
}
TORCH_ACC_DTYPE = {torch.float16: torch.float32, torch.bfloat16: torch.float32,
                   torch.float32: torch.float32, torch.float64: torch.float64}

LOG2E = 1.0 / math.log(2.0)


@dataclasses.dataclass
class Launch:
    kernel: object  # a triton.JITFunction
    grid: tuple
    args: dict  # every kernel argument by name, constexprs included
    config: TileConfig | None = None
    shared_estimate: int | None = None  # what config selection assumed (configs.estimate_shared_memory)

    def run(self):
        kw = self.config.launch_kwargs if self.config is not None else {}
        self.kernel[self.grid](**self.args, **kw)


def target_for(t: torch.Tensor) -> Target:
    """The Target whose configs a launch on `t` uses."""
    if t.device.type == "cuda" and not interpreter_active():
        return cuda_target(t.device.index if t.device.index is not None else torch.cuda.current_device())
    return INTERPRETER_TARGET


def split_f32(x: float) -> tuple[float, float]:
    """x as float32 hi + lo, so kernels can rebuild it to ~48 bits (see scalar_in)."""
    hi = float(torch.tensor(x, dtype=torch.float32))
    lo = float(torch.tensor(x - hi, dtype=torch.float32))
    return hi, lo


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot input precision: fp32 inputs follow torch's TF32 switch, like torch.matmul does."""
    if dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return "ieee"


def head_block(d: int) -> int:
    """Register tile width for a head dim: next power of two, at least 16 (tl.dot's minimum)."""
    return max(16, 1 << (d - 1).bit_length())


def strides4(t: torch.Tensor) -> tuple[int, int, int, int]:
    assert t.dim() == 4
    return tuple(t.stride())
