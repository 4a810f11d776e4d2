"""Input checks with messages that name the argument, what it got and what is allowed."""
from __future__ import annotations

import math
import numbers

import torch

ALLOWED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_ALLOWED = "float16, bfloat16, float32 (float64 for tests)"


def check_tensor(name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor; got {type(t).__name__}")
    if t.dtype not in ALLOWED_DTYPES:
        raise TypeError(f"{name} has dtype {t.dtype}; allowed: {_ALLOWED}")


def check_qkv(names: tuple[str, str, str], q, k, v, layout: str, *, allow_gqa: bool, gqa_hint: str = "") -> None:
    """Check (B, H, S, D) views of q, k, v; `layout` names the user's layout for messages.

    names: the user-facing argument names; layout: e.g. "(B, H, S, D)".
    """
    nq, nk, nv = names
    for n, t in zip(names, (q, k, v)):
        check_tensor(n, t)
    if not (q.device == k.device == v.device):
        raise ValueError(f"{nq}, {nk}, {nv} must be on one device; got {q.device}, {k.device}, {v.device}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"{nq}, {nk}, {nv} must have one dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    shapes = f"{nq} {tuple(q.shape)}, {nk} {tuple(k.shape)}, {nv} {tuple(v.shape)}"
    B, Hq, Sq, D = q.shape
    if k.shape[0] != B or v.shape[0] != B:
        raise ValueError(f"batch sizes differ: {shapes}, layout {layout}")
    if k.shape[1] != v.shape[1]:
        raise ValueError(f"{nk} and {nv} must have the same number of heads: {shapes}, layout {layout}")
    if k.shape[2] != v.shape[2]:
        raise ValueError(f"{nk} and {nv} must have the same sequence length: {shapes}, layout {layout}")
    if k.shape[3] != D:
        raise ValueError(f"{nq} and {nk} must have the same head dim: {shapes}, layout {layout}")
    Hkv = k.shape[1]
    if Hq != Hkv:
        if Hkv == 0 or Hq % Hkv != 0:
            raise ValueError(f"the number of {nq} heads ({Hq}) must be a multiple of the number of {nk}/{nv} "
                             f"heads ({Hkv}): {shapes}, layout {layout}")
        if not allow_gqa:
            raise ValueError(f"{nq} has {Hq} heads but {nk}/{nv} have {Hkv}: {shapes}, layout {layout}. "
                             f"{gqa_hint}")
    if k.shape[2] == 0:
        raise ValueError(f"{nk} and {nv} have sequence length 0: attention over no keys is undefined; {shapes}")
    if D == 0 or v.shape[3] == 0:
        raise ValueError(f"head dims must be >= 1: {shapes}")


def resolve_scale(name: str, scale, head_dim: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"{name} must be None or a real number; got {type(scale).__name__}")
    scale = float(scale)
    if not math.isfinite(scale):
        raise ValueError(f"{name} must be finite; got {scale}")
    return scale


_INT_DTYPES = (torch.int32, torch.int64)


def check_window(name: str, window) -> tuple[int, int]:
    """(left, right) ints >= -1, as flash-attn's window_size."""
    try:
        left, right = window
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a pair (left, right) of ints >= -1; got {window!r}") from None
    for x in (left, right):
        if isinstance(x, bool) or not isinstance(x, numbers.Integral) or x < -1:
            raise ValueError(f"{name} must be a pair (left, right) of ints >= -1 (-1 = unbounded); got {window!r}")
    return int(left), int(right)


def check_seq_mask(name: str, m, batch: int, seqlen: int, q) -> torch.Tensor | None:
    """A (batch, seqlen) bool mask (True = real token) on q's device, or None."""
    if m is None:
        return None
    if not isinstance(m, torch.Tensor):
        raise TypeError(f"{name} must be None or a bool tensor of shape ({batch}, {seqlen}); got {type(m).__name__}")
    if m.dtype != torch.bool:
        raise TypeError(f"{name} must be a bool tensor (True = real token) of shape ({batch}, {seqlen}); "
                        f"got dtype {m.dtype}")
    if tuple(m.shape) != (batch, seqlen):
        raise ValueError(f"{name} must have shape (B, S) = ({batch}, {seqlen}) (True = real token); "
                         f"got shape {tuple(m.shape)}")
    if m.device != q.device:
        raise ValueError(f"{name} must be on the inputs' device {q.device}; got {m.device}")
    return m


def check_lens(name: str, t, batch: int, q) -> torch.Tensor | None:
    """A (batch,) int32/int64 tensor of lengths on q's device, or None (values are clamped to [0, S])."""
    if t is None:
        return None
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be None or an int32/int64 tensor of shape ({batch},); got {type(t).__name__}")
    if t.dtype not in _INT_DTYPES:
        raise TypeError(f"{name} must be an int32 or int64 tensor of shape ({batch},); got dtype {t.dtype}")
    if tuple(t.shape) != (batch,):
        raise ValueError(f"{name} must have shape (B,) = ({batch},); got shape {tuple(t.shape)}")
    if t.device != q.device:
        raise ValueError(f"{name} must be on the inputs' device {q.device}; got {t.device}")
    return t.contiguous()


def check_cu_seqlens(name: str, cu, q) -> torch.Tensor:
    """(nseq + 1,) int32 cumulative lengths starting at 0, on q's device (not synced to check values)."""
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"{name} must be an int32 tensor of shape (nseq + 1,); got {type(cu).__name__}")
    if cu.dtype != torch.int32:
        raise TypeError(f"{name} must be an int32 tensor (as flash-attn); got dtype {cu.dtype}")
    if cu.dim() != 1 or cu.shape[0] < 1:
        raise ValueError(f"{name} must have shape (nseq + 1,), cumulative lengths starting at 0; "
                         f"got shape {tuple(cu.shape)}")
    if cu.device != q.device:
        raise ValueError(f"{name} must be on the inputs' device {q.device}; got {cu.device}")
    return cu.contiguous()


def check_max_seqlen(name: str, m):
    """An int >= 0 or a 0-dim integer tensor (read at run time, so torch.compile can trace it)."""
    if isinstance(m, torch.Tensor):
        if m.dim() != 0 or m.is_floating_point() or m.is_complex() or m.dtype == torch.bool:
            raise TypeError(f"{name} must be an int or a 0-dim integer tensor; got a {m.dtype} tensor of shape "
                            f"{tuple(m.shape)}")
        return m
    if isinstance(m, bool) or not isinstance(m, numbers.Integral) or m < 0:
        raise ValueError(f"{name} must be an int >= 0 or a 0-dim integer tensor; got {m!r}")
    return int(m)


_FLOAT_MASK_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_attn_mask(name: str, m, lead: tuple, H: int, Sq: int, Sk: int, q, shapes: str) -> torch.Tensor | None:
    """attn_mask broadcastable to (*lead, H, Sq, Sk), as a 4-D view (B, H, Sq, Sk) whose dims are
    each 1 (broadcast, read with stride 0) or full. Bool (True = attend) or floating (additive).

    shapes: the user's argument shapes, for messages. A view whenever possible: only several
    leading (batch) dims that mix broadcast and full sizes are expanded, over those dims only.
    """
    if m is None:
        return None
    target = (*lead, H, Sq, Sk)
    if not isinstance(m, torch.Tensor):
        raise TypeError(f"{name} must be None or a bool/float tensor broadcastable to {target}; "
                        f"got {type(m).__name__}")
    if m.dtype != torch.bool and m.dtype not in _FLOAT_MASK_DTYPES:
        raise TypeError(f"{name} must be a bool tensor (True = attend) or a float tensor (added to the scores); "
                        f"got dtype {m.dtype}")
    if m.device != q.device:
        raise ValueError(f"{name} must be on the inputs' device {q.device}; got {m.device}")
    ok = m.dim() <= len(target) and all(a in (1, b) for a, b in zip(reversed(m.shape), reversed(target)))
    if not ok:
        raise ValueError(f"{name} of shape {tuple(m.shape)} cannot broadcast to the attention scores' shape "
                         f"{target} (..., heads, query length, key length) of {shapes}; each of its dims must "
                         f"be 1 or match")
    m = m[(None,) * (len(target) - m.dim())]  # (*lead, H|1, Sq|1, Sk|1)
    if len(lead) == 1:
        return m
    if len(lead) == 0:
        return m[None]
    B = math.prod(lead)
    mlead = m.shape[:len(lead)]
    if all(n == 1 for n in mlead):
        return m.reshape(1, *m.shape[len(lead):])
    return m.expand(*lead, *m.shape[len(lead):]).reshape(B, *m.shape[len(lead):])


def check_softcap(name: str, x) -> float:
    if isinstance(x, bool) or not isinstance(x, numbers.Real) or not math.isfinite(float(x)) or x < 0:
        raise ValueError(f"{name} must be a finite float >= 0 (0 = off); got {x!r}")
    return float(x)


def check_dropout(name: str, p) -> float:
    if isinstance(p, bool) or not isinstance(p, numbers.Real) or not (0.0 <= float(p) < 1.0):
        raise ValueError(f"{name} must be a float in [0, 1); got {p!r}")
    return float(p)


def check_alibi(name: str, slopes, B: int, H: int, q) -> torch.Tensor | None:
    """ALiBi slopes (H,) or (B, H) float32 (as flash-attn) -> a contiguous (1 or B, H) tensor."""
    if slopes is None:
        return None
    if not isinstance(slopes, torch.Tensor):
        raise TypeError(f"{name} must be None or a float32 tensor of shape ({H},) or ({B}, {H}); "
                        f"got {type(slopes).__name__}")
    if slopes.dtype != torch.float32:
        raise TypeError(f"{name} must be float32 (as flash-attn's), shape ({H},) or ({B}, {H}); got {slopes.dtype}")
    if tuple(slopes.shape) not in ((H,), (B, H)):
        raise ValueError(f"{name} must have shape (nheads,) = ({H},) or (batch, nheads) = ({B}, {H}); "
                         f"got {tuple(slopes.shape)}")
    if slopes.device != q.device:
        raise ValueError(f"{name} must be on the inputs' device {q.device}; got {slopes.device}")
    return slopes.reshape(-1, H).contiguous()
