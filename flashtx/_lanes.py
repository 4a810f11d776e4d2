"""What the per-call-signature fast paths (flashtx._attention_lane, _rotary_lane, _swiglu_lane) share: when a call
may take one, and the table their plans live in.

A lane is a public call's whole plan (validation passed, backend chosen, launches memoised), kept per call
signature so that a repeated call costs one dict lookup before its launches fire. Lanes live in the launch cache's
`lanes` dict (flashtx.triton_kernels.launch.LaunchCache), so they are dropped whenever plans or launch entries are
(`_dispatch.clear_plans`, `LaunchCache.clear`, a tuner starting). Every key starts with what tells the lanes
apart (a tag string, or attention's dtype).
"""
from __future__ import annotations

import torch

TABLE: dict = {}  # key -> lane, or False (the general path's call); LaunchCache.lanes once triton is loaded

_COMPILING = torch.compiler.is_compiling
_DISPATCH_STACK = torch._C._len_torch_dispatch_stack
_FUNCTORCH = torch._C._are_functorch_transforms_active
_JIT_TRACING = torch._C._get_tracing_state
_FORWARD_AD = torch.autograd.forward_ad  # (its _current_level: -1 outside a dual_level)
_DISPATCH_MODE = torch._C._get_dispatch_mode
_TRACING_MODES = (torch._C._TorchDispatchModeKey.FAKE, torch._C._TorchDispatchModeKey.PROXY,
                  torch._C._TorchDispatchModeKey.FUNCTIONAL)
_TOP_SAVED_TENSOR_HOOKS = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)  # private


def eager() -> bool:
    """Whether a lane may take this call: nothing traces it (torch.compile sees the registered ops), no
    dispatch mode or functorch transform intercepts it, and no forward-mode AD level is open (a dual tensor's
    tangent: the general path refuses it)."""
    return not (_COMPILING() or _DISPATCH_STACK() or _FUNCTORCH() or _FORWARD_AD._current_level >= 0
                or _JIT_TRACING())


def traced() -> bool:
    """Whether torch.compile or export traces this call (a backward included: torch 2.11's is_compiling() is False
    while AOTAutograd traces one, under its fake, proxy and functional modes). Narrower than `not eager()`: other
    dispatch modes (FlopCounterMode, memory trackers) and forward AD run eagerly."""
    return _COMPILING() or any(_DISPATCH_MODE(k) is not None for k in _TRACING_MODES)


def no_saved_tensor_hooks() -> bool:
    """Whether saved tensors are kept as they are (False also where this torch cannot tell). Saved-tensor hooks
    (non-reentrant activation checkpointing, CPU offloading) bypass autograd's check that a saved tensor was not
    modified, hand every saver of a recomputed tensor the same storage, and may unpack a tensor other than the
    one saved (another layout): in-place backwards (flashtx._swiglu_op) and the attention lane's backward, planned
    for the saved tensors' strides, take their general paths then."""
    return _TOP_SAVED_TENSOR_HOOKS is not None and _TOP_SAVED_TENSOR_HOOKS(False) is None


def layouts(*ts) -> tuple:
    """(dtype, device, shape, strides) of each tensor (None for None): what a lane's backward compares its saved
    tensors against (a `.data` swap may change any of them, and a replay planned for others would read the wrong
    memory: on a GPU a direct launch of the kernel compiled for the planned dtype)."""
    return tuple(None if t is None else (t.dtype, t.device, t.shape, t.stride()) for t in ts)


def fire(entry, tensors) -> None:
    """Replay a launch-cache entry (its launches, in order) on `tensors`, given in the kernels' roles."""
    for replay in entry:
        replay.fire(tensors)


def remember(key, build):
    """build()'s lane for `key`: stored (a lane, or False: the general path takes these calls) and returned; None
    (not stored) where build() says the inputs alone send this call to the general path, and where the launch
    cache is off (a tuner forcing configs) or was dropped while build() ran (another thread: what it read may be
    stale)."""
    global TABLE
    from .triton_kernels.launch import LAUNCHES

    if not LAUNCHES.enabled:
        return None
    generation = LAUNCHES.generation
    TABLE = LAUNCHES.lanes  # forgotten with the launch entries (and so with the plans)
    lane = build()
    if lane is not None and not LAUNCHES.keep(TABLE, key, lane, generation):
        return None
    return lane
