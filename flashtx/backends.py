"""The attention backends, registered in flashtx._dispatch's one registry (in preference order).

Each answers `not_supported_reasons(inputs)` for an `AttentionInputs` (built only when a plan is
resolved, never per call): an empty list means it can run them. See flashtx._dispatch for how a
backend is chosen and cached.

CPU tensors go to `reference` unless Triton's interpreter is on (FLASHTX_INTERPRET=1 or
TRITON_INTERPRET=1), in which case they run through the real Triton kernels: that is how the
tests check the kernels on machines without a GPU.
"""
from __future__ import annotations

import dataclasses

import torch

from . import _dispatch, _env, reference
from ._dispatch import BackendNotSupported  # noqa: F401  (public: flashtx.BackendNotSupported)
from .triton_kernels.limits import INT32_MAX, MAX_GRID_YZ, bhsd
from .triton_kernels.limits import mask_span as _mask_span
from .triton_kernels.limits import seq_span, span_too_wide
from .triton_kernels.mask_spec import NO_MASKS, MaskSpec

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
MAX_HEAD_DIM = 256  # the largest head dim the Triton configs cover (configs.head_dim_bucket)


# The kernels' mask description, from a module that does not import triton (so the reference
# backend works without it); flashtx calls it AttentionMasks.
AttentionMasks = MaskSpec


@dataclasses.dataclass(frozen=True)
class AttentionInputs(_dispatch.OpInputs):
    """Attention inputs as the kernels see them: (B, H, S, D) views, any strides.

    needs_grad: 0 (inference), 1 (the backward must run too) or 2 (and the bias's gradient).
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    causal: bool = False
    bottom_right: bool = False
    masks: AttentionMasks = NO_MASKS
    needs_grad: int = 0


class Backend:
    name = "?"

    def not_supported_reasons(self, inp: AttentionInputs) -> list[str]:
        raise NotImplementedError

    def forward(self, q, k, v, out, *, scale, causal, bottom_right, masks=NO_MASKS, bshd=False):
        """Write attention of (q, k, v) into `out`; return (m2, l2) (B, H, Sq): the row max of the
        scores and log2 of the row sum of exp2(s2 - m2), log2 units (flashtx._attention_op). bshd: q, k,
        v and out are (B, S, H, D) tensors, not (B, H, S, D) views."""
        raise NotImplementedError

    def backward(self, do, q, k, v, out, m2, l2, dl2, dq, dk, dv, *, scale, causal, bottom_right, masks=NO_MASKS,
                 dbias=None, bshd=False):
        """Write the gradients of (q, k, v) into (dq, dk, dv), and of masks.attn_mask into dbias if given.
        dl2: the cotangent of the lse (log2 units) or None. bshd: as forward's (do and the gradients too)."""
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


class ReferenceBackend(Backend):
    """Eager PyTorch (flashtx.reference): any device, any float dtype; O(N^2) memory."""

    name = "reference"

    def not_supported_reasons(self, inp):
        if inp.dtype not in SUPPORTED_DTYPES:
            return [f"dtype {inp.dtype} is not a floating type flashtx supports"]
        return []

    def forward(self, q, k, v, out, *, scale, causal, bottom_right, masks=NO_MASKS, bshd=False):
        if bshd:
            q, k, v, out = bhsd(True, q, k, v, out)
        with reference.exact(q.device):
            o, m2, l2 = reference.attention_forward(q, k, v, scale=scale, causal=causal, bottom_right=bottom_right,
                                                    spec=masks)
        out.copy_(o)
        return m2, l2

    def backward(self, do, q, k, v, out, m2, l2, dl2, dq, dk, dv, *, scale, causal, bottom_right,
                 masks=NO_MASKS, dbias=None, bshd=False):
        if bshd:
            do, q, k, v, out, dq, dk, dv = bhsd(True, do, q, k, v, out, dq, dk, dv)
        with reference.exact(q.device):
            grads = reference.attention_backward(do, q, k, v, out, m2, l2, scale=scale, causal=causal,
                                                 bottom_right=bottom_right, dlse2=dl2, spec=masks, dbias=dbias)
        for buf, g in zip((dq, dk, dv), grads):
            buf.copy_(g)

    def probs(self, q, k, v, m2, l2, *, scale, causal, bottom_right, masks=NO_MASKS):
        with reference.exact(q.device):
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
            if span_too_wide(t):  # the stride the kernels read (after _unit_last's copy), compared in ints
                reasons.append(f"{name}'s sequence span ({t.shape[2]} rows, {seq_span(t)} elements) overflows int32 "
                               "offsets")
        m = inp.masks.attn_mask
        if m is not None and _mask_span(m) > INT32_MAX:
            reasons.append(f"attn_mask {tuple(m.shape)}: one (batch, head) slice spans more than int32 offsets")
        if not reasons:  # the interpreter's target fits its own tiles; a GPU's may refuse (one branch for both)
            reasons += self._config_reasons(inp)
        return reasons

    @staticmethod
    def _config_reasons(inp):
        from .triton_kernels.configs import select_config
        from .triton_kernels.launch import head_split, target_for

        target = target_for(inp.q)
        dq, dv = inp.q.shape[-1], inp.v.shape[-1]
        reasons = []
        kernels = ["attn_fwd"] + (["attn_bwd_dkdv", "attn_bwd_dq"] if inp.needs_grad else [])
        if inp.needs_grad == 2:
            kernels[-1] = "attn_bwd_dq_dbias"  # the dQ kernel that also writes the bias gradient
        for kernel in kernels:
            # the register tile widths the launchers pass: forward and backward split head dims (head_split)
            bq, bv = sum(head_split(dq)), sum(head_split(dv))
            try:
                select_config(kernel, bq, bv, inp.q.element_size(), target, inp.masks.modifies_scores,
                              inp.masks.masks_visibility)
            except RuntimeError as exc:
                reasons.append(str(exc))
        return reasons

    def forward(self, q, k, v, out, *, scale, causal, bottom_right, masks=NO_MASKS, bshd=False):
        if q.stride(3) != 1 or k.stride(3) != 1 or v.stride(3) != 1:
            q, k, v = _unit_last(q, bshd), _unit_last(k, bshd), _unit_last(v, bshd)
        _, m2, l2 = _kernels().attention_forward(q, k, v, scale=scale, causal=causal, bottom_right=bottom_right,
                                                 spec=masks, out=out, bshd=bshd)
        return m2, l2

    def backward(self, do, q, k, v, out, m2, l2, dl2, dq, dk, dv, *, scale, causal, bottom_right,
                 masks=NO_MASKS, dbias=None, bshd=False):
        if do.stride(3) != 1 or q.stride(3) != 1 or k.stride(3) != 1 or v.stride(3) != 1 or out.stride(3) != 1:
            do, q, k, v, out = (_unit_last(t, bshd) for t in (do, q, k, v, out))
        s = 1 if bshd else 2
        if do.shape[s] * do.stride(s) > INT32_MAX:  # autograd hands over any strides: rows too far apart for int32
            do = do.transpose(1, 2).contiguous().transpose(1, 2) if bshd else do.contiguous()
        if dl2 is not None:
            dl2 = dl2.contiguous()
        _kernels().attention_backward(do, q, k, v, out, m2, l2, scale=scale, causal=causal, bottom_right=bottom_right,
                                      dlse2=dl2, spec=masks, grads=(dq, dk, dv), dbias=dbias, bshd=bshd)

    def probs(self, q, k, v, m2, l2, *, scale, causal, bottom_right, masks=NO_MASKS):
        q, k, v = (_unit_last(t) for t in (q, k, v))
        return _kernels().attention_probs(q, k, v, m2, l2, scale=scale, causal=causal, bottom_right=bottom_right,
                                          spec=masks)



class _Kernels:
    """The Triton launchers, imported on first use (flashtx works without triton); one attribute
    lookup per call afterwards, not an import statement."""

    def __init__(self):
        from .triton_kernels.attention_bwd import attention_backward
        from .triton_kernels.attention_fwd import attention_forward
        from .triton_kernels.attention_scores import attention_probs

        self.attention_forward, self.attention_backward = attention_forward, attention_backward
        self.attention_probs = attention_probs


_KERNELS: _Kernels | None = None


def _kernels() -> _Kernels:
    global _KERNELS
    if _KERNELS is None:
        _KERNELS = _Kernels()
    return _KERNELS


def _unit_last(t: torch.Tensor, bshd: bool = False) -> torch.Tensor:
    """Kernels take any strides, but a strided last dim would defeat vectorised loads: copy then, (B, H, S, D)
    contiguous (a (B, S, H, D) tensor through its view), so the sequence span is S x D, as dispatch's limits
    count it (limits.seq_span)."""
    if t.stride(-1) == 1 or t.shape[-1] == 1:
        return t
    return t.transpose(1, 2).contiguous().transpose(1, 2) if bshd else t.contiguous()


for _b in (TritonBackend(), ReferenceBackend()):
    _dispatch.register("attention", _b.name, _b)
BACKENDS: dict[str, Backend] = _dispatch.IMPLS["attention"]  # name -> backend, in preference order


def inputs_summary(inp: AttentionInputs) -> str:
    return (f"query {tuple(inp.q.shape)}, key {tuple(inp.k.shape)}, value {tuple(inp.v.shape)} "
            f"(B, H, S, D), dtype={inp.dtype}, device={inp.device}, causal={inp.causal}"
            + (f", {inp.masks.describe()}" if not inp.masks.is_empty else ""))


def select_backend(inp: AttentionInputs, requested: str | None = None) -> str:
    """Name of the attention backend that would run `inp` (uncached; see flashtx._dispatch)."""
    return _dispatch.resolve("attention", requested, inp, lambda: inputs_summary(inp))
