"""Backends and dispatch, in the style of xformers' operator selection.

Each backend answers `not_supported_reasons(inputs)`: an empty list means it can run them. With
`backend=None`, flashtx takes the first fast backend that fits (cuda, then triton); when none
does, it falls back to `reference` with a one-time warning that lists every backend and why. A
backend asked for by name raises `BackendNotSupported` with its reasons instead.

CPU tensors go to `reference` unless Triton's interpreter is on (FLASHTX_INTERPRET=1 or
TRITON_INTERPRET=1), in which case they run through the real Triton kernels: that is how the
tests check the kernels on machines without a GPU.
"""
from __future__ import annotations

import dataclasses
import warnings

import torch

from . import _env, reference
from .triton_kernels.mask_spec import NO_MASKS, MaskSpec

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
MAX_HEAD_DIM = 256  # the largest head dim the Triton configs cover (configs.head_dim_bucket)
INT32_MAX = 2**31 - 1  # kernels index within a (batch, head) slice with int32 offsets
MAX_GRID_YZ = 65535  # CUDA's limit on grid dims y and z, where the kernels put heads and batch


class BackendNotSupported(NotImplementedError):
    """Raised when the requested backend cannot run the given inputs; the message says why."""


# The kernels' mask description, from a module that does not import triton (so the reference
# backend works without it); flashtx calls it AttentionMasks.
AttentionMasks = MaskSpec


@dataclasses.dataclass(frozen=True)
class AttentionInputs:
    """Attention inputs as the kernels see them: (B, H, S, D) views, any strides."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    causal: bool = False
    bottom_right: bool = False
    masks: AttentionMasks = NO_MASKS

    @property
    def device(self) -> torch.device:
        return self.q.device

    @property
    def dtype(self) -> torch.dtype:
        return self.q.dtype


class Backend:
    name = "?"

    def not_supported_reasons(self, inp: AttentionInputs) -> list[str]:
        raise NotImplementedError

    def forward(self, q, k, v, out, *, scale, causal, bottom_right, masks=NO_MASKS):
        """Write attention of (q, k, v) into `out`; return (m2, l2), each (B, H, Sq): the row max of the
        scores in log2 units and log2 of the row sum of exp2(s2 - m2) (m2 = -inf, l2 = 0 where no key)."""
        raise NotImplementedError

    def backward(self, do, q, k, v, out, m2, l2, dlse2, dq, dk, dv, *, scale, causal, bottom_right,
                 masks=NO_MASKS, dbias=None):
        """Write the gradients of (q, k, v) into (dq, dk, dv), and of masks.attn_mask into dbias if given."""
        raise NotImplementedError

    def probs(self, q, k, v, m2, l2, *, scale, causal, bottom_right, masks=NO_MASKS):
        """The probabilities of the forward that returned (m2, l2) (dropped entries negated)."""
        raise NotImplementedError


def triton_device_reasons(device: torch.device, dtype: torch.dtype) -> list[str]:
    """Why flashtx's Triton kernels cannot run on this device and dtype (shared by every op)."""
    if not _env.HAS_TRITON:
        return [_env.TRITON_IMPORT_ERROR]
    reasons = []
    dev = device.type
    if dev == "cpu":
        if _env.INTERPRETER_NUMPY_PROBLEM:
            reasons.append(_env.INTERPRETER_NUMPY_PROBLEM)
        if not _env.INTERPRET:
            why = ("FLASHTX_INTERPRET was set after triton had been imported; set it before"
                   if _env.INTERPRET_TOO_LATE else "set FLASHTX_INTERPRET=1 to run them in Triton's interpreter")
            reasons.append(f"CPU tensors need Triton's interpreter ({why})")
    elif dev == "cuda":
        if _env.INTERPRET:
            reasons.append("Triton's interpreter is on (TRITON_INTERPRET=1); it runs CPU tensors only")
        else:
            major, minor = torch.cuda.get_device_capability(device)
            if major < 8:
                reasons.append(f"needs compute capability >= 8.0 (Ampere); this GPU is sm_{major}{minor}")
    else:
        reasons.append(f"device type {dev!r} is not supported (cuda, or cpu in the interpreter)")
    if dtype not in SUPPORTED_DTYPES:
        reasons.append(f"dtype {dtype} is not supported (float16, bfloat16, float32)")
    elif dtype == torch.float64 and dev != "cpu":
        reasons.append("float64 runs only in Triton's interpreter (for gradchecks); use float32 on a GPU")
    elif dtype == torch.bfloat16 and dev == "cpu":
        reasons.append("bfloat16 is miscomputed by Triton's interpreter (triton-lang/triton#11584); "
                       "bfloat16 runs on GPUs only")
    return reasons


def select_backend_for(op: str, backends: dict, inp, requested: str | None, summary: str) -> str:
    """Generic dispatch: `backends` maps names to objects with not_supported_reasons(inp).

    Order of `backends` is preference order; "reference" must be present and accept everything.
    """
    if requested is not None:
        if requested not in backends:
            raise ValueError(f"backend must be None or one of {sorted(backends)}; got {requested!r}")
        reasons = backends[requested].not_supported_reasons(inp)
        if reasons:
            raise BackendNotSupported(
                f"{op}: backend={requested!r} cannot run {summary}:\n  " + "\n  ".join(reasons)
                + "\nAll backends:\n" + describe_reasons(backends, inp))
        return requested
    device = getattr(inp, "device")
    if device.type == "cpu" and not _env.INTERPRET:
        return "reference"  # documented: CPU tensors use the reference unless the interpreter is on
    for name, b in backends.items():
        if name != "reference" and not b.not_supported_reasons(inp):
            return name
    table = describe_reasons(backends, inp)
    key = (op, table)
    if key not in _warned:
        _warned.add(key)
        warnings.warn(f"flashtx.{op}: no fast backend can run {summary}; using the reference "
                      f"implementation. Backends:\n{table}", stacklevel=4)
    return "reference"


def describe_reasons(backends: dict, inp) -> str:
    lines = []
    for name, b in backends.items():
        reasons = b.not_supported_reasons(inp)
        lines.append(f"  `{name}`: " + ("supported" if not reasons else "; ".join(reasons)))
    return "\n".join(lines)


class ReferenceBackend(Backend):
    """Eager PyTorch (flashtx.reference): any device, any float dtype; O(N^2) memory."""

    name = "reference"

    def not_supported_reasons(self, inp):
        if inp.dtype not in SUPPORTED_DTYPES:
            return [f"dtype {inp.dtype} is not a floating type flashtx supports"]
        return []

    def forward(self, q, k, v, out, *, scale, causal, bottom_right, masks=NO_MASKS):
        o, m2, l2 = reference.attention_forward(q, k, v, scale=scale, causal=causal, bottom_right=bottom_right,
                                                spec=masks)
        out.copy_(o)
        return m2, l2

    def backward(self, do, q, k, v, out, m2, l2, dlse2, dq, dk, dv, *, scale, causal, bottom_right,
                 masks=NO_MASKS, dbias=None):
        grads = reference.attention_backward(do, q, k, v, out, m2, l2, scale=scale, causal=causal,
                                             bottom_right=bottom_right, dlse2=dlse2, spec=masks, dbias=dbias)
        for buf, g in zip((dq, dk, dv), grads):
            buf.copy_(g)

    def probs(self, q, k, v, m2, l2, *, scale, causal, bottom_right, masks=NO_MASKS):
        return reference.attention_probs(q, k, v, m2, l2, scale=scale, causal=causal, bottom_right=bottom_right,
                                         spec=masks)


class TritonBackend(Backend):
    """flashtx's Triton kernels: CUDA tensors, or CPU tensors in Triton's interpreter."""

    name = "triton"

    def not_supported_reasons(self, inp):
        reasons = triton_device_reasons(inp.device, inp.dtype)
        if not _env.HAS_TRITON:
            return reasons
        d_qk, d_v = inp.q.shape[-1], inp.v.shape[-1]
        for what, d in (("query/key", d_qk), ("value", d_v)):
            if d > MAX_HEAD_DIM:
                reasons.append(f"{what} head dim {d} is above {MAX_HEAD_DIM}")
        if inp.masks.varlen and inp.masks.cu_seqlens_q.shape[0] - 1 > MAX_GRID_YZ:
            reasons.append(f"{inp.masks.cu_seqlens_q.shape[0] - 1} sequences: at most {MAX_GRID_YZ} "
                           "(CUDA grid z limit)")
        if inp.q.shape[0] > MAX_GRID_YZ or inp.q.shape[1] > MAX_GRID_YZ:
            reasons.append(f"batch {inp.q.shape[0]} x heads {inp.q.shape[1]}: each must be <= {MAX_GRID_YZ} "
                           "(CUDA grid y/z limit)")
        for name, t in (("query", inp.q), ("key", inp.k), ("value", inp.v)):
            if t.shape[2] * max(t.stride(2), 1) > INT32_MAX:
                reasons.append(f"{name}'s sequence span ({t.shape[2]} x stride {t.stride(2)}) overflows int32 offsets")
        m = inp.masks.attn_mask
        if m is not None and sum((n - 1) * abs(st) for n, st in zip(m.shape[2:], m.stride()[2:])) > INT32_MAX:
            reasons.append(f"attn_mask {tuple(m.shape)}: one (batch, head) slice spans more than int32 offsets")
        if not reasons and inp.device.type == "cuda":
            reasons += self._config_reasons(inp)
        return reasons

    @staticmethod
    def _config_reasons(inp):
        from .triton_kernels.configs import select_config
        from .triton_kernels.launch import head_block, target_for

        target = target_for(inp.q)
        bq, bv = head_block(inp.q.shape[-1]), head_block(inp.v.shape[-1])
        reasons = []
        kernels = ["attn_fwd", "attn_bwd_dkdv", "attn_bwd_dq"]
        if inp.masks.attn_mask is not None and inp.masks.attn_mask.is_floating_point():
            kernels.append("attn_scores")  # the bias gradient
        for kernel in kernels:
            try:
                select_config(kernel, bq, bv, inp.q.element_size(), target, inp.masks.modifies_scores)
            except RuntimeError as exc:
                reasons.append(str(exc))
        return reasons

    def forward(self, q, k, v, out, *, scale, causal, bottom_right, masks=NO_MASKS):
        from .triton_kernels.attention_fwd import attention_forward

        q, k, v = (_unit_last(t) for t in (q, k, v))
        _, m2, l2 = attention_forward(q, k, v, scale=scale, causal=causal, bottom_right=bottom_right,
                                      spec=masks, out=out)
        return m2, l2

    def backward(self, do, q, k, v, out, m2, l2, dlse2, dq, dk, dv, *, scale, causal, bottom_right,
                 masks=NO_MASKS, dbias=None):
        from .triton_kernels.attention_bwd import attention_backward

        do, q, k, v, out = (_unit_last(t) for t in (do, q, k, v, out))
        if dlse2 is not None:
            dlse2 = dlse2.contiguous()
        attention_backward(do, q, k, v, out, m2, l2, scale=scale, causal=causal, bottom_right=bottom_right,
                           dlse2=dlse2, spec=masks, grads=(dq, dk, dv), dbias=dbias)

    def probs(self, q, k, v, m2, l2, *, scale, causal, bottom_right, masks=NO_MASKS):
        from .triton_kernels.attention_scores import attention_probs

        q, k, v = (_unit_last(t) for t in (q, k, v))
        return attention_probs(q, k, v, m2, l2, scale=scale, causal=causal, bottom_right=bottom_right, spec=masks)


class CudaBackend(Backend):
    """The optional CUDA C++ extension (csrc/). It holds no attention kernel yet."""

    name = "cuda"

    def not_supported_reasons(self, inp):
        return ["flashtx's CUDA extension (csrc/) has no attention kernel in this release"]


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    """Kernels take any strides, but a strided last dim would defeat vectorised loads: copy then."""
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


BACKENDS: dict[str, Backend] = {b.name: b for b in (CudaBackend(), TritonBackend(), ReferenceBackend())}
_warned: set = set()


def _inputs_summary(inp: AttentionInputs) -> str:
    return (f"query {tuple(inp.q.shape)}, key {tuple(inp.k.shape)}, value {tuple(inp.v.shape)} "
            f"(B, H, S, D), dtype={inp.dtype}, device={inp.device}, causal={inp.causal}"
            + (f", {inp.masks.describe()}" if not inp.masks.is_empty else ""))


def select_backend(inp: AttentionInputs, requested: str | None = None) -> str:
    """Name of the attention backend that will run `inp` (see the module docstring)."""
    return select_backend_for("attention", BACKENDS, inp, requested, _inputs_summary(inp))
