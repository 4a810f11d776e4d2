"""How flashtx registers its ops: `torch.library.triton_op`, so torch.compile sees the kernels.

A triton_op is a custom op whose body torch.compile traces (with `wrap_triton` launches, see
flashtx.triton_kernels.launch.run_kernel): Inductor then calls the Triton kernels from generated
code, and CUDA graphs capture them. Dynamo itself never looks inside: in its graph the op is one
node, so what Dynamo traces is only the thin functional layer around it.

Triton's interpreter (CPU tests) cannot run on the fake tensors of a trace, so while it is on the
ops stay opaque under torch.compile, as `torch.library.custom_op`s are: the Dynamo graph is the
same, only Inductor's view inside the op differs.
"""
from __future__ import annotations

import torch
from torch._subclasses.functional_tensor import FunctionalTensorMode

from . import _env


def _opaque(mode, op, types, args, kwargs):
    return mode.__torch_dispatch__(op, types, args, kwargs)


def triton_op(name: str, *, mutates_args=()):
    """Decorator: register `fn` as the triton_op `name` (its own fake impl too: the body runs on
    fake tensors, where launches record or skip)."""
    def dec(fn):
        op = torch.library.triton_op(name, mutates_args=mutates_args)(fn)
        if _env.INTERPRET or not _env.HAS_TRITON:
            op.register_torch_dispatch(FunctionalTensorMode, _opaque)
        return op
    return dec
