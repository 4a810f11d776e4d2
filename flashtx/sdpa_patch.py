"""Route ``torch.nn.functional.scaled_dot_product_attention`` through flashtx.attention.

    >>> with flashtx.patch_sdpa():          # or flashtx.sdpa_patch.enable() / disable()
    ...     y = model(x)                    # every F.scaled_dot_product_attention call inside

The patch replaces the attribute ``scaled_dot_product_attention`` of the module
``torch.nn.functional`` (so ``F.scaled_dot_product_attention`` and
``torch.nn.functional.scaled_dot_product_attention`` both resolve to flashtx's, and so does the
call inside ``nn.MultiheadAttention``). Code that bound the function to another name *before* the
patch (``from torch.nn.functional import scaled_dot_product_attention``) keeps torch's. Disabling
puts back the very object that was replaced.

Each call is checked explicitly (types, shapes, masks, devices; see ``unsupported_reason``);
anything flashtx does not support goes to the original SDPA, with a one-time warning per reason
that names it. Nothing is decided by catching exceptions on the call path.
"""
from __future__ import annotations

import contextlib
import numbers
import operator
import warnings

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import CausalBias

from . import _attention_lane, _dispatch, _small_q_lane, functional
from ._validate import _qkv_ok, host_scale, is_flag, resolve_scale, scale_ok
from .backends import BACKENDS, AttentionInputs
from .triton_kernels.mask_spec import MaskSpec

_NO_WINDOW = (-1, -1)

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_ORIGINAL = F.scaled_dot_product_attention  # torch's, as found when flashtx was imported
_saved = None  # what enable() replaced (restored exactly by disable())
_warned: set[str] = set()
FALLBACK_WARNING = "flashtx.patch_sdpa: this call goes to torch's"  # how the warning of a handed-back call opens
_TORCH_ERROR = " (torch reports the error)"  # reasons for calls torch itself rejects: no warning
# a call flashtx refuses itself: torch 2.11's SDPA divides by the K/V head count (SIGFPE kills the process)
_NO_KV_HEADS = "key/value have no heads (flashtx reports the error)"


def _heads(t: torch.Tensor) -> int:
    return t.shape[-3] if t.dim() >= 3 else 1


_COMPILING = torch.compiler.is_compiling
_FUNCTORCH = torch._C._are_functorch_transforms_active
_FORWARD_AD = torch.autograd.forward_ad  # (its _current_level: -1 outside a dual_level)


def _transformed() -> bool:
    """A torch.func transform, or a forward-mode AD level, is active: torch's SDPA supports them, flashtx's ops do
    not (its kernels read raw storage; no batching rule or jvp formula). Never while compiling (Dynamo would not
    trace the query; a compiled region sees the registered ops)."""
    return not _COMPILING() and (_FUNCTORCH() or _FORWARD_AD._current_level >= 0)


def _plain(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa) -> bool:
    """The common call, checked in ints and bools: plain 4-D tensors of one allowed dtype and device that
    flashtx.attention's checks pass, no attn_mask, no dropout, a bool is_causal, no empty sequence."""
    return (attn_mask is None and type(is_causal) is bool and type(query) is torch.Tensor and type(key) is torch.Tensor
            and type(value) is torch.Tensor and not (query.is_nested or key.is_nested or value.is_nested)
            and query.dim() == 4 and key.dim() == 4 and value.dim() == 4 and query.dtype in _DTYPES
            and (dropout_p == 0.0 if type(dropout_p) is float or type(dropout_p) is int else False)
            and type(enable_gqa) is bool and _qkv_ok(query, key, value, enable_gqa) and query.shape[2] > 0
            and key.shape[2] > 0 and not _transformed()
            and (_COMPILING() or not (query.is_neg() or key.is_neg() or value.is_neg())))


def _plain_reason(query, key, value) -> str | None:
    """unsupported_reason of a _plain call: None on CPU; on a GPU, whether a kernel config serves it."""
    kind = query.device.type
    if kind == _GPU:  # first: flashtx.testing_gpu_trace stands CPU calls in for CUDA ones
        needs_grad = torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad)
        # operator.index: a head dim that is symbolic under torch.compile (dynamic shapes) is specialized (a guard)
        return _fast_reason(kind, query.device.index, query.dtype, operator.index(query.shape[3]),
                            operator.index(value.shape[3]), False, int(needs_grad))
    return None if kind == "cpu" else "query, key, value must be on one CUDA or CPU device"


def unsupported_reason(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                       enable_gqa=False) -> str | None:
    """Why flashtx should not run this SDPA call (None = it runs it). Reasons name no shapes, so
    each is warned about once. Under autocast, of the inputs as autocast would cast them."""
    scale = host_scale(scale)
    if scale is not None and not scale_ok(scale):  # (first, as the call checks it)
        return _scale_reason(scale)
    if _causal_bias(attn_mask):
        return _causal_bias_reason(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa)
    if functional._AUTOCAST_ANY() and isinstance(query, torch.Tensor):
        query, key, value, attn_mask = functional._autocast(query.device.type, query, key, value, attn_mask)
    if _plain(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa):
        return _plain_reason(query, key, value)
    return _full_reason(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa)


def _full_reason(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa) -> str | None:
    """unsupported_reason, every check in turn (the _plain shortcut agrees with it: tests/test_patch_sdpa.py)."""
    if not (isinstance(query, torch.Tensor) and isinstance(key, torch.Tensor) and isinstance(value, torch.Tensor)):
        return "query, key and value must all be tensors"
    if not is_flag(is_causal):  # torch raises for "no", 1, None
        return "is_causal must be a bool" + _TORCH_ERROR
    if not is_flag(enable_gqa):
        return "enable_gqa must be a bool" + _TORCH_ERROR
    if _transformed():
        what = ("torch.func transforms (vmap, grad, jacrev, ...) are" if _FUNCTORCH() else
                "forward-mode AD (a dual_level) is")
        return what + " not supported by flashtx's kernels"
    if query.is_nested or key.is_nested or value.is_nested:
        return "nested (jagged) tensors are not supported"
    if not _COMPILING() and any(t.is_neg() for t in (query, key, value, attn_mask) if isinstance(t, torch.Tensor)):
        return "lazily negated views (negative bit set, e.g. z.conj().imag) are not supported"
    if not (query.layout is key.layout is value.layout is torch.strided):
        return "sparse layouts are not supported"
    if not (query.dtype == key.dtype == value.dtype) or query.dtype not in _DTYPES:
        return "query, key, value must share one of float16, bfloat16, float32, float64"
    if not (query.device == key.device == value.device) or query.device.type not in ("cuda", "cpu"):
        return "query, key, value must be on one CUDA or CPU device"
    if not (query.dim() == key.dim() == value.dim()) or query.dim() < 2:
        return "query, key, value must have the same rank (>= 2)"
    if key.shape[:-3] != query.shape[:-3] or value.shape[:-3] != query.shape[:-3]:
        return "broadcasting batch dims between query and key/value is not supported"
    if key.shape[:-1] != value.shape[:-1] or key.shape[-1] != query.shape[-1]:
        return "key/value shapes do not fit query" + _TORCH_ERROR
    hq, hkv = _heads(query), _heads(key)
    if hkv == 0 and hq != 0:  # before the empty-sequence check (no heads at all: an empty output, flashtx's)
        return _NO_KV_HEADS
    if query.shape[-2] == 0 or key.shape[-2] == 0 or query.shape[-1] == 0 or value.shape[-1] == 0:  # (not min():
        # traced sizes would be compared with each other, and export would tie a dynamic length to the head dim)
        return "empty sequence or head dim"
    if hq == 1 and hkv > 1:  # torch broadcasts one query head over the K/V heads; flashtx does not
        return "one query head broadcast over several key/value heads is not supported"
    if hq != hkv and hkv != 1 and not (enable_gqa and hq % hkv == 0):  # one K/V head broadcasts, as in torch
        return "query and key/value head counts differ without enable_gqa" + _TORCH_ERROR
    if not isinstance(dropout_p, (int, float)) or not 0.0 <= dropout_p < 1.0:
        return "dropout_p must be a number in [0, 1)"
    if attn_mask is not None:
        if is_causal:
            return "attn_mask with is_causal=True" + _TORCH_ERROR
        if not isinstance(attn_mask, torch.Tensor) or attn_mask.is_nested:
            return "attn_mask must be a tensor"
        if attn_mask.layout is not torch.strided:
            return "a sparse attn_mask is not supported"
        if attn_mask.dtype not in (torch.bool, torch.float32, query.dtype):
            return "attn_mask must be bool, float32 or the query's dtype" + _TORCH_ERROR
        if attn_mask.device != query.device:
            return "attn_mask must be on the query's device"
        try:
            full = torch.broadcast_shapes(attn_mask.shape, (*query.shape[:-2], query.shape[-2], key.shape[-2]))
        except RuntimeError:
            return "attn_mask does not broadcast to (..., Hq, Sq, Sk)" + _TORCH_ERROR
        if tuple(full) != (*query.shape[:-2], query.shape[-2], key.shape[-2]):
            return "attn_mask would broadcast the output's shape" + _TORCH_ERROR
    if query.device.type == _GPU:
        needs_grad = torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad)
        bias_grad = needs_grad and attn_mask is not None and attn_mask.requires_grad
        return _fast_reason(query.device.type, query.device.index, query.dtype, operator.index(query.shape[-1]),
                            operator.index(value.shape[-1]), attn_mask is not None and attn_mask.dtype != torch.bool,
                            2 if bias_grad else int(needs_grad))
    return None


# torch's SDPA takes any float scale: one flashtx refuses (_validate.scale_ok) goes to torch
_SCALE_REASON = "a scale outside flashtx's range (0, or a real number of magnitude in [2**-100, 2**100])"


def _scale_reason(scale) -> str:
    """The reason for a scale that scale_ok refuses."""
    if isinstance(scale, torch.Tensor):
        return "a scale tensor that requires grad or holds more than one number" + _TORCH_ERROR
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        return "a scale that is not a real number or a 0-dim tensor of one (a bool, say)"
    return _SCALE_REASON


def _causal_bias(attn_mask) -> bool:
    """Whether attn_mask is torch.nn.attention.bias's CausalBias: it computes SDPA in its own __torch_function__
    and holds no mask values."""
    return attn_mask is not None and type(attn_mask) is not torch.Tensor and isinstance(attn_mask, CausalBias)


def _causal_bias_reason(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa) -> str | None:
    """unsupported_reason of a _causal_bias call: flashtx runs a CausalBias as is_causal (either alignment,
    flashtx.attention translates it)."""
    if is_causal is not False:
        return "a CausalBias attn_mask with is_causal" + _TORCH_ERROR
    if functional._AUTOCAST_ANY() and isinstance(query, torch.Tensor):
        query, key, value = functional._autocast(query.device.type, query, key, value)
    if isinstance(query, torch.Tensor) and isinstance(key, torch.Tensor) and query.dim() >= 2 and key.dim() >= 2 and (
            (attn_mask.seq_len_q, attn_mask.seq_len_kv) != (query.shape[-2], key.shape[-2])):
        return "a CausalBias for other sequence lengths than the inputs'"
    return _full_reason(query, key, value, None, dropout_p, True, enable_gqa)


_GPU = "cuda"  # the device whose calls may lack a kernel config (flashtx.testing_gpu_trace stands in "cpu")
_FAST_REASONS = _dispatch.plan_table("sdpa_patch")  # (they follow the plans: cleared with them)


@torch.compiler.assume_constant_result  # torch.compile runs it while tracing and keeps the answer
def _fast_reason(device_type: str, index, dtype, d_qk: int, d_v: int, float_mask: bool,
                 needs_grad: int) -> str | None:
    """Why the Triton backend cannot run attention of these kinds on this GPU (None: it can),
    decided once per key from tiny stand-in inputs of the same kinds."""
    key = (device_type, index, dtype, d_qk, d_v, float_mask, needs_grad)
    if key not in _FAST_REASONS:
        dev = torch.device(device_type, index) if index is not None else torch.device(device_type)
        q, k = (torch.empty(1, 1, 1, d, dtype=dtype, device=dev) for d in (d_qk, d_qk))
        v = torch.empty(1, 1, 1, d_v, dtype=dtype, device=dev)
        masks = MaskSpec(attn_mask=torch.empty(1, 1, 1, 1, dtype=dtype, device=dev)) if float_mask else MaskSpec()
        reasons = BACKENDS["triton"].not_supported_reasons(AttentionInputs(q, k, v, masks=masks,
                                                                           needs_grad=needs_grad))
        _FAST_REASONS[key] = "no fast flashtx backend for these inputs: " + "; ".join(reasons) if reasons else None
    return _FAST_REASONS[key]


def _refuse_no_kv_heads(key, value) -> None:
    """Raise for a key or value with 0 heads: torch 2.11's SDPA divides by the head count (SIGFPE kills the
    process), so such a call must not reach it."""
    for name, t in (("key", key), ("value", value)):
        if isinstance(t, torch.Tensor) and not t.is_nested and t.dim() >= 3 and t.shape[-3] == 0:
            raise ValueError(f"flashtx.patch_sdpa: {name} must have at least one head (dim -3), got {name} "
                             f"{tuple(t.shape)}; torch's own scaled_dot_product_attention crashes the process on "
                             f"such a call in some versions, so flashtx refuses it")


def _masked_decoding(query, key, value, attn_mask, scale):
    """flashtx.attention's lane result for a _plain call (but for its bool attn_mask, is_causal False) that decodes
    (transformers' sdpa steps with padding or a static cache), or None: no lane (yet), and the patch's own path
    follows (attention, which makes the lane). A lane's key holds the mask's layout, which attention's checks passed
    when it was made; the patch's reasons for such a mask agree with them."""
    if not (_small_q_lane.decoding(query.shape[2], key.shape[2]) and _plain_reason(query, key, value) is None):
        return None
    return _small_q_lane.lookup(query, key, value, attn_mask, "attn_mask", resolve_scale("scale", scale,
                                                                                         query.shape[3]),
                                False, False, False, _NO_WINDOW, 0.0, None, False)[0]


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                 enable_gqa=False):
    """torch's ``scaled_dot_product_attention`` signature and semantics, computed by
    ``flashtx.attention`` when it supports the call, by the original SDPA otherwise."""
    if _causal_bias(attn_mask):  # (before autocast, which would cast it)
        scale = host_scale(scale)
        reason = unsupported_reason(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
        if reason is None:
            return functional.attention(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, scale=scale,
                                        enable_gqa=bool(enable_gqa))
        return _fallback(reason, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    if functional._AUTOCAST_ANY() and isinstance(query, torch.Tensor):  # as autocast casts SDPA's inputs
        query, key, value, attn_mask = functional._autocast(query.device.type, query, key, value, attn_mask)
    if scale is not None and type(scale) is not float:
        scale = host_scale(scale)
    if scale is not None and not scale_ok(scale):
        reason = _scale_reason(scale)
    elif attn_mask is not None and is_causal is False and type(attn_mask) is torch.Tensor and \
            attn_mask.dtype is torch.bool and _plain(query, key, value, None, dropout_p, False, enable_gqa):
        out = _masked_decoding(query, key, value, attn_mask, scale)
        if out is not None:
            return out
        reason = _full_reason(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa)
    elif _plain(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa):
        reason = _plain_reason(query, key, value)
        if reason is None:  # flashtx.attention's own paths for this call, its checks already made here
            scale = resolve_scale("scale", scale, query.shape[3])
            lane = None
            if _small_q_lane.decoding(query.shape[2], key.shape[2]):  # flashtx.attention's lane for this call
                out, lane = _small_q_lane.lookup(query, key, value, None, "attn_mask", scale, is_causal, False,
                                                 False, _NO_WINDOW, 0.0, None, False)
                if out is not None:
                    return out
            if lane is None:
                out = _attention_lane.forward(query, key, value, scale, is_causal, False, False)
                if out is not None:
                    return out
            return functional._run(query, key, value, scale=scale, causal=is_causal, bottom_right=False, backend=None,
                                   return_lse=False, lane=lane)
    else:  # (unsupported_reason's other checks, already made above)
        reason = _full_reason(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa)
    if reason is not None:
        return _fallback(reason, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    kw = {}
    if attn_mask is not None:
        kw["attn_mask"] = attn_mask
    if dropout_p > 0:
        kw["dropout_p"] = dropout_p
    return functional.attention(query, key, value, is_causal=is_causal, scale=scale,
                                enable_gqa=bool(enable_gqa), **kw)


scaled_dot_product_attention.__wrapped__ = _ORIGINAL


def _fallback(reason: str, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    """The call handed to torch's SDPA, with a one-time warning for the reason (none where torch raises)."""
    _refuse_no_kv_heads(key, value)  # (whatever the reason: a scale one too)
    if reason not in _warned and not reason.endswith(_TORCH_ERROR):  # torch's own error says it all
        _warned.add(reason)
        warnings.warn(f"{FALLBACK_WARNING} scaled_dot_product_attention: {reason}", stacklevel=3)
    return _ORIGINAL(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                     scale=scale, enable_gqa=enable_gqa)


def is_enabled() -> bool:
    """Whether torch.nn.functional.scaled_dot_product_attention is flashtx's now."""
    return F.scaled_dot_product_attention is scaled_dot_product_attention


def enable() -> None:
    """Route torch.nn.functional.scaled_dot_product_attention through flashtx (idempotent)."""
    global _saved
    if is_enabled():
        return
    _saved = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = scaled_dot_product_attention


def disable() -> None:
    """Put back exactly the function enable() replaced (idempotent)."""
    global _saved
    if not is_enabled():
        if _saved is not None and F.scaled_dot_product_attention is not _saved:
            raise RuntimeError("torch.nn.functional.scaled_dot_product_attention was replaced by something else "
                               "after flashtx.sdpa_patch.enable(); undo that first")
        _saved = None
        return
    F.scaled_dot_product_attention = _saved
    _saved = None


@contextlib.contextmanager
def patch_sdpa():
    """Context manager: flashtx serves F.scaled_dot_product_attention inside the block; on exit the
    previous state (patched or not) comes back. Nests, and composes with enable()/disable(). The patch is
    process-wide (it replaces the function in torch.nn.functional): other threads see it inside the block,
    and blocks in several threads unpatch when the first that patched exits; with threads, call enable() once.

    Example:
        >>> with flashtx.patch_sdpa():
        ...     logits = gpt(idx)       # a nanoGPT-style model, unchanged
    """
    was = is_enabled()
    enable()
    try:
        yield
    finally:
        if not was:
            disable()
