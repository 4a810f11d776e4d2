"""Input checks with messages that name the argument, what it got and what is allowed."""
from __future__ import annotations

import collections.abc as _abc
import math
import numbers

import torch
from torch.nn.attention.bias import CausalBias

from . import _lanes, _library
from ._library import device_assert
from ._overlap import has_internal_overlap, views_overlap  # noqa: F401 (the validators' names for them)
from .triton_kernels.limits import INT32_MAX, MAX_SEQ, undecided

ALLOWED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_ALLOWED = "float16, bfloat16, float32 (float64 for tests)"


def check_tensor(name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor; got {type(t).__name__}")
    _check_layout(name, t)
    if t.dtype not in ALLOWED_DTYPES:
        raise TypeError(f"{name} has dtype {t.dtype}; allowed: {_ALLOWED}")


_STRIDED = torch.strided
_TENSOR = torch.Tensor
_COMPILING = torch.compiler.is_compiling


def _check_layout(name: str, t) -> None:
    if t.layout is not _STRIDED:
        raise TypeError(f"{name} has layout {t.layout}; allowed: torch.strided (a dense tensor: call .to_dense())")
    if t.is_nested:
        raise TypeError(f"{name} is a nested tensor; allowed: a dense tensor (for sequences of different lengths, "
                        "pad or pack them; in attention: key_mask / kv_lens, or flash_attn_varlen_func)")
    if not _COMPILING() and t.is_neg():  # (the kernels read stored values: a wrong sign, which PyTorch's own ops
        # resolve first. Dynamo cannot trace is_neg, a graph break: traced calls are not checked)
        _refuse_negated(name)


def _refuse_negated(name: str):
    raise ValueError(f"{name} is a lazily negated view (its negative bit is set, e.g. z.conj().imag); "
                     f"pass {name}.resolve_neg()")


def refuse_negated_qkv(q, k, v) -> None:
    """check_tensor's negative-bit rule for q, k, v, which the attention shells check in ints and bools only."""
    if not _COMPILING() and (q.is_neg() or k.is_neg() or v.is_neg()):
        _refuse_negated("q" if q.is_neg() else "k" if k.is_neg() else "v")


def _qkv_ok(q, k, v, allow_gqa: bool, heads: int = 1) -> bool:
    """True when check_qkv passes: its common case, decided with ints and bools before any message is built.
    heads: the heads dim, 1 for (B, H, S, D) tensors, 2 for (B, S, H, D) ones (check_qkv's views of them).
    One K/V head serves every query head without allow_gqa too: SDPA broadcasts it so."""
    if q.is_nested or k.is_nested or v.is_nested:  # (whose shape cannot be read)
        return False
    qs, ks, vs = q.shape, k.shape, v.shape
    h, s = heads, 3 - heads
    return (q.layout is _STRIDED and k.layout is _STRIDED and v.layout is _STRIDED
            and q.device == k.device == v.device and q.dtype == k.dtype == v.dtype and ks[0] == qs[0] == vs[0]
            and ks[h] == vs[h] and ks[s] == vs[s] and ks[3] == qs[3] and qs[3] > 0 and vs[3] > 0
            and (qs[h] == ks[h] or ks[h] == 1 or (allow_gqa and ks[h] > 0 and qs[h] % ks[h] == 0)))


def packed_qkv_ok(q, k, v) -> bool:
    """True when varlen's packed (total, H, D) q, k, v pass check_tensor, the 3-D rule and check_qkv's rule on their
    (1, total, H, D) views (GQA allowed): the common case, decided with ints and bools (no views, no messages)."""
    if not (type(q) is _TENSOR and type(k) is _TENSOR and type(v) is _TENSOR and q.dim() == 3 and k.dim() == 3
            and v.dim() == 3 and q.dtype in ALLOWED_DTYPES) or q.is_nested or k.is_nested or v.is_nested:
        return False
    if not _COMPILING() and (q.is_neg() or k.is_neg() or v.is_neg()):
        return False
    qs, ks, vs = q.shape, k.shape, v.shape  # (total, H, D); the totals of q and k may differ
    return (q.layout is _STRIDED and k.layout is _STRIDED and v.layout is _STRIDED
            and q.device == k.device == v.device and q.dtype == k.dtype == v.dtype
            and ks[0] == vs[0] and ks[1] == vs[1] and ks[2] == qs[2] and qs[2] > 0 and vs[2] > 0
            and (qs[1] == ks[1] or (ks[1] > 0 and qs[1] % ks[1] == 0)))


def check_qkv(names: tuple[str, str, str], q, k, v, layout: str, *, allow_gqa: bool, gqa_hint: str = "",
              shown: tuple | None = None) -> None:
    """Check (B, H, S, D) views of q, k, v; `layout` names the user's layout for messages.

    names: the user-facing argument names; layout: e.g. "(B, H, S, D)"; shown: the user's own tensors, whose
    shapes the messages print (default: q, k, v).
    """
    if _qkv_ok(q, k, v, allow_gqa):
        return
    nq, nk, nv = names  # q, k, v passed check_tensor already (but maybe not its layout check)
    for n, t in zip(names, (q, k, v)):
        _check_layout(n, t)
    if not (q.device == k.device == v.device):
        raise ValueError(f"{nq}, {nk}, {nv} must be on one device; got {q.device}, {k.device}, {v.device}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"{nq}, {nk}, {nv} must have one dtype; got {q.dtype}, {k.dtype}, {v.dtype}")

    def shapes():  # for messages only
        sq, sk, sv = shown if shown is not None else (q, k, v)
        return f"{nq} {tuple(sq.shape)}, {nk} {tuple(sk.shape)}, {nv} {tuple(sv.shape)}"

    B, Hq, Sq, D = q.shape
    if k.shape[0] != B or v.shape[0] != B:
        raise ValueError(f"batch sizes differ: {shapes()}, layout {layout}")
    if k.shape[1] != v.shape[1]:
        raise ValueError(f"{nk} and {nv} must have the same number of heads: {shapes()}, layout {layout}")
    if k.shape[2] != v.shape[2]:
        raise ValueError(f"{nk} and {nv} must have the same sequence length: {shapes()}, layout {layout}")
    if k.shape[3] != D:
        raise ValueError(f"{nq} and {nk} must have the same head dim: {shapes()}, layout {layout}")
    Hkv = k.shape[1]
    if Hq != Hkv:
        if Hkv == 0 or Hq % Hkv != 0:
            raise ValueError(f"the number of {nq} heads ({Hq}) must be a multiple of the number of {nk}/{nv} "
                             f"heads ({Hkv}): {shapes()}, layout {layout}")
        if not allow_gqa and Hkv != 1:  # one K/V head broadcasts over the query heads, as in SDPA
            raise ValueError(f"{nq} has {Hq} heads but {nk}/{nv} have {Hkv}: {shapes()}, layout {layout}. "
                             f"{gqa_hint}")
    if D == 0 or v.shape[3] == 0:
        raise ValueError(f"head dims must be >= 1: {shapes()}")


def scale_ok(scale) -> bool:
    """Whether resolve_scale takes this (non-None) scale: a real number, 0 or of magnitude in [2**-100, 2**100]."""
    return (not isinstance(scale, bool) and isinstance(scale, numbers.Real)
            and (scale == 0 or SCALAR_MIN <= abs(float(scale)) <= SCALAR_MAX))


def host_scale(scale):
    """scale with a 0-dim real tensor that records no gradient read on the host (a sync), as SDPA reads it;
    anything else as it is."""
    if isinstance(scale, torch.Tensor) and scale.dim() == 0 and scale.dtype != torch.bool and not scale.is_complex() \
            and not (scale.requires_grad and torch.is_grad_enabled()):
        return scale.item()
    return scale


def resolve_scale(name: str, scale, head_dim: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if scale_ok(scale):
        return float(scale)
    if isinstance(scale, torch.Tensor):
        if (value := host_scale(scale)) is not scale:
            return resolve_scale(name, value, head_dim)
        if scale.dim() == 0 and scale.requires_grad and torch.is_grad_enabled():  # (its gradient would be dropped;
            # SDPA raises too)
            raise TypeError(f"{name} is a tensor that requires grad; the kernels take a number and give it no "
                            f"gradient: pass {name}.detach() (or learn it through the inputs' scale)")
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"{name} must be None or a real number; got {type(scale).__name__}")
    raise ValueError(f"{name} must be 0 or have a magnitude in [2**-100, 2**100] (the kernels compute in "
                     f"float32, with headroom for the scores); got {float(scale)!r}")


# Float arguments reach the kernels as float32 (hi + lo halves for float64 runs): within these
# magnitudes both halves stay normal float32 numbers and scaled scores stay far from overflow.
SCALAR_MIN, SCALAR_MAX = 2.0 ** -100, 2.0 ** 100


_INT_DTYPES = (torch.int32, torch.int64)


def is_flag(v) -> bool:
    """Whether v is what torch's bool parameters take: a bool, or a SymBool (a traced comparison of sizes)."""
    return type(v) is bool or isinstance(v, torch.SymBool)


def is_int_dtype(dtype: torch.dtype) -> bool:
    """An integer dtype (not bool): what index-like tensor arguments may hold."""
    return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)


def grad_leaf(t) -> bool:
    """t is a leaf that requires grad (a parameter, an input) or a view of one, and autograd records the call: an
    in-place backward would write its gradient over its values. False while tracing (the compiled backward is out
    of place)."""
    if not torch.is_grad_enabled() or torch.compiler.is_compiling():
        return False
    base = t._base if t._base is not None else t
    return base.is_leaf and base.requires_grad


def check_flag(name: str, v) -> bool:
    """A bool argument, as torch's bool parameters take it: SDPA raises a TypeError for is_causal="no" (truthy)
    or 1, and so does this (a SymBool, a traced comparison of sizes, passes)."""
    if is_flag(v):
        return v
    t = type(v)
    kind = t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"  # numpy.bool
    raise TypeError(f"{name} must be a bool; got {kind} {v!r}")


def check_window(name: str, window) -> tuple[int, int]:
    """(left, right) ints >= -1, as flash-attn's window_size; a bound >= MAX_SEQ (2**29, longer than any
    sequence the kernels take) becomes -1, which it equals: the kernels add bounds to positions in int32.
    A (2,) integer tensor, or a pair of one-element ones, is read as its values (flash-attn's own tests pass
    window sizes so; a device tensor costs a host sync)."""
    if type(window) is tuple and len(window) == 2 and type(window[0]) is int and type(window[1]) is int:
        left, right = window  # the common form (transformers' and flash-attn's calls), in ints: no ABC checks
        if left >= -1 and right >= -1:
            return (-1 if left >= MAX_SEQ else left), (-1 if right >= MAX_SEQ else right)
    if isinstance(window, torch.Tensor):
        if not is_int_dtype(window.dtype) or window.shape != (2,):
            raise TypeError(f"{name} must be a pair (left, right) of ints >= -1; got a {window.dtype} tensor of "
                            f"shape {tuple(window.shape)}")
        window = window.tolist()
    elif isinstance(window, (_abc.Set, _abc.Mapping, _abc.Iterator)):  # (no fixed order, or read once)
        raise TypeError(f"{name} must be a pair (left, right) of ints >= -1, a sequence such as a tuple; got "
                        f"{type(window).__name__} {window!r}")
    try:
        left, right = window
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a pair (left, right) of ints >= -1; got {window!r}") from None
    left, right = _int_item(left), _int_item(right)
    for x in (left, right):
        if isinstance(x, bool) or not isinstance(x, numbers.Integral) or x < -1:
            raise ValueError(f"{name} must be a pair (left, right) of ints >= -1 (-1 = unbounded); got {window!r}")
    return (-1 if left >= MAX_SEQ else int(left)), (-1 if right >= MAX_SEQ else int(right))


def _int_item(x):
    """A one-element integer tensor as its Python int; anything else as it is (check_window judges it)."""
    if isinstance(x, torch.Tensor) and x.numel() == 1 and is_int_dtype(x.dtype):
        return x.item()
    return x


def check_seq_mask(name: str, m, batch: int, seqlen: int, q) -> torch.Tensor | None:
    """A (batch, seqlen) bool mask (True = real token) on q's device, or None."""
    if m is None:
        return None
    if not isinstance(m, torch.Tensor):
        raise TypeError(f"{name} must be None or a bool tensor of shape ({batch}, {seqlen}); got {type(m).__name__}")
    _check_layout(name, m)
    if m.dtype != torch.bool:
        raise TypeError(f"{name} must be a bool tensor (True = real token) of shape ({batch}, {seqlen}); "
                        f"got dtype {m.dtype}")
    if tuple(m.shape) != (batch, seqlen):
        raise ValueError(f"{name} must have shape (B, S) = ({batch}, {seqlen}) (True = real token); "
                         f"got shape {tuple(m.shape)}")
    if m.device != q.device:
        raise ValueError(f"{name} must be on the inputs' device {q.device}; got {m.device}")
    if (seqlen - 1) * abs(m.stride(1)) > INT32_MAX:  # the kernels index a row's entries in int32
        return m.contiguous()
    return m


def check_lens(name: str, t, batch: int, q) -> torch.Tensor | None:
    """A (batch,) int32/int64 tensor of lengths on q's device, or None (values are clamped to [0, S])."""
    if t is None:
        return None
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be None or an int32/int64 tensor of shape ({batch},); got {type(t).__name__}")
    _check_layout(name, t)
    if t.dtype not in _INT_DTYPES:
        raise TypeError(f"{name} must be an int32 or int64 tensor of shape ({batch},); got dtype {t.dtype}")
    if tuple(t.shape) != (batch,):
        raise ValueError(f"{name} must have shape (B,) = ({batch},); got shape {tuple(t.shape)}")
    if t.device != q.device:
        raise ValueError(f"{name} must be on the inputs' device {q.device}; got {t.device}")
    return t.contiguous()


def check_cu_seqlens(name: str, cu, q) -> torch.Tensor:
    """(nseq + 1,) int32 cumulative lengths on q's device (check_cu_seqlens_values checks the values)."""
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"{name} must be an int32 tensor of shape (nseq + 1,); got {type(cu).__name__}")
    _check_layout(name, cu)
    if cu.dtype != torch.int32:
        raise TypeError(f"{name} must be an int32 tensor (as flash-attn); got dtype {cu.dtype}")
    if cu.dim() != 1 or cu.shape[0] < 1:
        raise ValueError(f"{name} must have shape (nseq + 1,), cumulative lengths starting at 0; "
                         f"got shape {tuple(cu.shape)}")
    if cu.device != q.device:
        raise ValueError(f"{name} must be on the inputs' device {q.device}; got {cu.device}")
    return cu.contiguous()


def _values_readable(t: torch.Tensor) -> bool:
    """True when t's values can be read on the host for free: an eager CPU tensor (not fake, not traced)."""
    if t.device.type != "cpu" or torch.compiler.is_compiling():
        return False
    if type(t) is torch.Tensor:  # a plain tensor is never fake: no import on the common path
        return True
    from torch._subclasses.fake_tensor import is_fake
    return not is_fake(t)


def check_cu_seqlens_values(name: str, cu: torch.Tensor, total: int, total_name: str, max_seqlen,
                            max_name: str | None, exact: bool = True) -> None:
    """cu (nseq + 1,) starts at 0, never decreases, ends at `total` (at most `total` when not exact: rows
    gathered for a paged cache), and no sequence is longer than max_seqlen (when max_name is given). A wrong
    value would make the kernels read or write out of bounds, or leave rows unwritten.

    CPU tensors are checked here, with an error naming the first bad entry. On a GPU the check
    runs on the device without a host sync (check_cu_seqlens_on_device): a bad value stops the
    program with a device-side assert (as PyTorch's own indexing does), before any kernel of this
    call can run on it.
    """
    if cu.device.type == "meta":
        return
    if not _values_readable(cu):
        check_cu_seqlens_on_device([(name, cu, total, total_name, max_seqlen, max_name, exact)])
        return
    lens = cu[1:].long() - cu[:-1]  # (nseq,) in int64: int32 differences of far-apart entries would wrap
    allowed = (f"cumulative sequence lengths starting at 0, non-decreasing, ending at {'' if exact else 'most '}"
               f"{total_name} = {total}")
    if int(cu[0]) != 0:
        raise ValueError(f"{name}[0] must be 0 ({allowed}); got {int(cu[0])}")
    if lens.numel() and int(lens.min()) < 0:
        i = int((lens < 0).nonzero()[0])
        raise ValueError(f"{name} must be non-decreasing ({allowed}); got {name}[{i}] = {int(cu[i])} > "
                         f"{name}[{i + 1}] = {int(cu[i + 1])}")
    if (int(cu[-1]) != total) if exact else (int(cu[-1]) > total):
        raise ValueError(f"{name}[-1] must {'equal' if exact else 'be at most'} {total_name} = {total} ({allowed}); "
                         f"got {int(cu[-1])}")
    if max_name is not None and lens.numel():
        longest = int(lens.max())
        m = int(max_seqlen) if not isinstance(max_seqlen, torch.Tensor) or _values_readable(max_seqlen) else None
        if m is None:
            device_assert(lens.max() <= max_seqlen, f"flashtx: {max_name} is less than the longest sequence")
        elif longest > m:
            i = int(lens.argmax())
            raise ValueError(f"{max_name} = {m} is less than the longest sequence in {name} (sequence {i}: "
                             f"{longest} rows); it must be at least {longest}")


def check_cu_seqlens_pair(a: tuple, b: tuple) -> None:
    """check_cu_seqlens_values for two tensors (each its arguments as a tuple: cu_seqlens_q's and cu_seqlens_k's),
    on a GPU in one check launch where both are on one device; one tensor checked once where both are the same
    tensor under the same conditions (self-attention's packed batch: one flag, one assert naming both)."""
    if a[1].device.type != "meta" and not _values_readable(a[1]) and not _values_readable(b[1]) and (
            a[1].device == b[1].device and a[1].shape == b[1].shape):
        name, cu, total, total_name, max_seqlen, max_name, exact = a
        # ints only (a tensor bound's == would read it; a traced total's would guard the graph on it)
        if cu is b[1] and not torch.compiler.is_compiling() and all(
                x is None or type(x) is int for x in (total, b[2], max_seqlen, b[4])) and (
                (total, max_seqlen, bool(exact), max_name is None) == (b[2], b[4], bool(b[6]), b[5] is None)):
            def one(x, y):  # (the packed forms name both alike)
                return x if x == y or x is None else f"{x} (= {y})"
            both = (one(name, b[0]), cu, total, one(total_name, b[3]), max_seqlen, one(max_name, b[5]), exact)
            check_cu_seqlens_on_device([both])
        else:
            check_cu_seqlens_on_device([a, b])
        return
    check_cu_seqlens_values(*a)
    check_cu_seqlens_values(*b)


_CU_BOUND_MAX = 1 << 62  # an int bound past any length (the kernel compares in int64)


def _cu_message(name, total, total_name, max_name, exact) -> str:
    """The device assert's message. While torch.compile traces, the total is not formatted: a symbolic one (dynamic
    shapes) would specialise the graph on its value (a recompile per packed batch size)."""
    value = "" if torch.compiler.is_compiling() else f" = {total}"
    return (f"flashtx: {name} must start at 0, never decrease and end at {'' if exact else 'most '}{total_name}"
            f"{value}" + (f", with no sequence longer than {max_name}" if max_name else ""))


def check_cu_seqlens_on_device(specs: list) -> None:
    """check_cu_seqlens_values's check where the values are not readable on the host (a GPU, a trace): one check
    kernel for one or two tensors (flashtx::cu_seqlens_check) and a torch._assert_async of each flag, where
    Triton can run on the device; else the same conditions as torch ops. specs: check_cu_seqlens_values's
    arguments, per tensor, as tuples."""
    from . import _device_checks

    if _lanes.eager() and _check_lane(specs):
        return
    cu0 = specs[0][1]
    dev = cu0.device
    limits, ints = [], []
    for name, cu, total, total_name, max_seqlen, max_name, exact in specs:
        bound = -1 if max_name is None else max_seqlen
        if isinstance(bound, torch.Tensor):
            if _values_readable(bound):
                bound = int(bound)
            elif bound.device != dev:
                break  # a bound the kernel cannot read (a CPU tensor while tracing): the torch ops below
        limits.append(bound if isinstance(bound, torch.Tensor) else None)
        ints += _check_ints(total, exact, max_name, bound)
    else:
        if _device_checks.triton_checks(dev.type, dev.index):
            _device_checks.assert_cu_seqlens([s[1] for s in specs], limits, ints,
                                             [_cu_message(s[0], s[2], s[3], s[5], s[6]) for s in specs])
            return
    for name, cu, total, total_name, max_seqlen, max_name, exact in specs:
        lens = cu[1:].long() - cu[:-1]  # (nseq,) in int64 (int32 differences would wrap)
        ok = (cu[0] == 0) & ((cu[-1] == total) if exact else (cu[-1] <= total)) & (lens >= 0).all()
        if max_name is not None and lens.numel():
            ok = ok & (lens.max() <= max_seqlen)
        device_assert(ok, _cu_message(name, total, total_name, max_name, exact))


def _check_ints(total, exact, max_name, bound) -> list:
    """A tensor's ints for flashtx::cu_seqlens_check: (total, exact, bounded, int bound: 0 for a tensor's)."""
    if max_name is None or isinstance(bound, torch.Tensor):
        bound = 0
    else:  # never int(): under torch.compile that would specialise the graph on a packed batch's value (min's
        bound = min(bound, _CU_BOUND_MAX)  # relation guard holds for every batch); torch.sym_min graph-breaks
        # on plain ints in torch 2.11
    return [total, int(bool(exact)), int(max_name is not None), bound]


def _check_lane(specs: list) -> bool:
    """check_cu_seqlens_on_device for a repeated eager call with int bounds (or none), planned once per call
    signature (flashtx._lanes: the check's launch-cache entry and its messages): allocate the flag, fire the
    launch, assert each flag, as the op's path does. False where that path must run (a tensor bound or subclass,
    no Triton check on the device, a launch the cache cannot replay)."""
    if _library._other_device(specs[0][1]) is not None:
        return False  # tensors of another GPU: the op's path launches with their device current (_library.call)
    key = ["cu_seqlens_check"]
    for name, cu, total, total_name, max_seqlen, max_name, exact in specs:
        if type(cu) is not torch.Tensor or (max_name is not None and type(max_seqlen) is not int):
            return False
        key.append((name, cu.dtype, cu.device, cu.shape, cu.stride(), total, total_name,
                    max_seqlen if max_name is not None else None, max_name, bool(exact)))
    key = tuple(key)
    lane = _lanes.TABLE.get(key)
    if lane is None:
        lane = _lanes.remember(key, lambda: _build_check_lane(specs))
    if not lane:
        return False
    entry, messages = lane
    cu_a = specs[0][1]
    flag = torch.empty(len(specs), dtype=torch.int32, device=cu_a.device)  # as flashtx::cu_seqlens_check's
    _lanes.fire(entry, (flag, cu_a, specs[1][1] if len(specs) == 2 else None, None, None))  # varlen_check._ROLES
    if len(specs) == 1:
        device_assert(flag, messages[0])
    else:
        device_assert(flag[0], messages[0])
        device_assert(flag[1], messages[1])
    return True


def _build_check_lane(specs: list):
    """_check_lane's (launch entry, messages) for these specs, or False (stored: the op's path takes them)."""
    from . import _device_checks

    dev = specs[0][1].device
    if not _device_checks.triton_checks(dev.type, dev.index):
        return False
    from .triton_kernels.varlen_check import check_entry

    ints = []
    for name, cu, total, total_name, max_seqlen, max_name, exact in specs:
        ints += _check_ints(total, exact, max_name, -1 if max_name is None else max_seqlen)
    flag = torch.empty(len(specs), dtype=torch.int32, device=dev)
    entry = check_entry(flag, [s[1] for s in specs], [None] * len(specs), ints[0::4], ints[1::4], ints[2::4],
                        ints[3::4])
    if entry is None:
        return False
    return entry, [_cu_message(s[0], s[2], s[3], s[5], s[6]) for s in specs]


def check_max_seqlen(name: str, m, device: torch.device):
    """An int >= 0 or a 0-dim integer tensor on `device` or the CPU (checked on the device, never read on the
    host)."""
    if isinstance(m, torch.Tensor):
        if m.dim() != 0 or not is_int_dtype(m.dtype):
            raise TypeError(f"{name} must be an int or a 0-dim integer tensor; got a {m.dtype} tensor of shape "
                            f"{tuple(m.shape)}")
        if m.device != device and m.device.type != "cpu":
            raise ValueError(f"{name} must be on the inputs' device {device} (or the CPU); got {m.device}")
        return m
    if torch.compiler.is_compiling() and isinstance(m, numbers.Integral) and undecided(m < 0):
        # traced from a value read on the device (unpad_input's max_seqlen under torch.compile): the host cannot
        # compare it, so it bounds as a 0-dim tensor does (checked on the device, the grid spans the total)
        return torch.scalar_tensor(m, dtype=torch.int64, device=device)
    if isinstance(m, bool) or not isinstance(m, numbers.Integral) or m < 0:
        raise ValueError(f"{name} must be an int >= 0 or a 0-dim integer tensor; got {m!r}")
    return int(m)


_FLOAT_MASK_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_attn_mask(name: str, m, lead: tuple, H: int, Sq: int, Sk: int, q, shapes) -> torch.Tensor | None:
    """attn_mask broadcastable to (*lead, H, Sq, Sk), as a 4-D view (B, H, Sq, Sk) whose dims are
    each 1 (broadcast, read with stride 0) or full. Bool (True = attend) or floating (additive).

    shapes(): the user's argument shapes, for messages. A view whenever possible: only several
    leading (batch) dims that mix broadcast and full sizes are expanded, over those dims only.
    """
    if m is None:
        return None
    target = (*lead, H, Sq, Sk)
    if not isinstance(m, torch.Tensor):
        raise TypeError(f"{name} must be None or a bool/float tensor broadcastable to {target}; "
                        f"got {type(m).__name__}")
    refuse_causal_bias(name, m)
    _check_layout(name, m)
    if m.dtype != torch.bool and m.dtype not in _FLOAT_MASK_DTYPES:
        raise TypeError(f"{name} must be a bool tensor (True = attend) or a float tensor (added to the scores); "
                        f"got dtype {m.dtype}")
    if m.device != q.device:
        raise ValueError(f"{name} must be on the inputs' device {q.device}; got {m.device}")
    # (== each, not `a in (1, b)`: Dynamo answers a tuple's `in` by identity for symbolic sizes, refusing equal ones)
    ok = m.dim() <= len(target) and all(a == 1 or a == b for a, b in zip(reversed(m.shape), reversed(target)))
    if not ok:
        raise ValueError(f"{name} of shape {tuple(m.shape)} cannot broadcast to the attention scores' shape "
                         f"{target} (..., heads, query length, key length) of {shapes()}; each of its dims must "
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


def refuse_causal_bias(name: str, m) -> None:
    """Raise for torch.nn.attention.bias's CausalBias, which computes SDPA in its own __torch_function__ and holds
    no mask values (the kernels would read uninitialised storage). flashtx.attention translates it before this."""
    if type(m) is not torch.Tensor and isinstance(m, CausalBias):
        raise TypeError(f"{name} is a torch.nn.attention.bias.CausalBias, which holds no mask values; pass causal="
                        f"True (flash-attn's functions align it bottom-right, as causal_lower_right), or give the "
                        f"CausalBias to flashtx.attention")


def check_softcap(name: str, x) -> float:
    if (isinstance(x, bool) or not isinstance(x, numbers.Real)
            or not (x == 0 or SCALAR_MIN <= float(x) <= SCALAR_MAX)):
        raise ValueError(f"{name} must be 0 (off) or a float in [2**-100, 2**100]; got {x!r}")
    return float(x)


def check_dropout(name: str, p) -> float:
    if isinstance(p, bool) or not isinstance(p, numbers.Real) or not (0.0 <= float(p) < 1.0):
        raise ValueError(f"{name} must be a float in [0, 1); got {p!r}")
    return float(p)


_warned_alibi: list = []  # check_alibi's one warning given


def check_alibi(name: str, slopes, B: int, H: int, q, trains: bool = True) -> torch.Tensor | None:
    """ALiBi slopes (H,) or (B, H) float32 (as flash-attn) -> a contiguous (1 or B, H) tensor. trains: warn once
    for slopes that require grad where autograd records (they get no gradient: flash-attn drops it silently; not
    an error: an eval loop without no_grad over learned slopes is fine); False for inference-only callers, which
    refuse such inputs themselves."""
    if slopes is None:
        return None
    if not isinstance(slopes, torch.Tensor):
        raise TypeError(f"{name} must be None or a float32 tensor of shape ({H},) or ({B}, {H}); "
                        f"got {type(slopes).__name__}")
    _check_layout(name, slopes)
    if slopes.dtype != torch.float32:
        raise TypeError(f"{name} must be float32 (as flash-attn's), shape ({H},) or ({B}, {H}); got {slopes.dtype}")
    if not (slopes.dim() == 1 and slopes.shape[0] == H or slopes.dim() == 2 and slopes.shape[0] == B
            and slopes.shape[1] == H):  # (== each: symbolic sizes, as above)
        raise ValueError(f"{name} must have shape (nheads,) = ({H},) or (batch, nheads) = ({B}, {H}); "
                         f"got {tuple(slopes.shape)}")
    if slopes.device != q.device:
        raise ValueError(f"{name} must be on the inputs' device {q.device}; got {slopes.device}")
    if trains and slopes.requires_grad and torch.is_grad_enabled() and not _warned_alibi:
        _warned_alibi.append(True)  # (once a process)
        from ._env import warn

        warn(f"flashtx: {name} requires grad, but the kernels compute no gradient for the slopes (as flash-attn's): "
             f"they get none; pass {name}.detach() to silence this, or learn the bias as a float attn_mask")
    return slopes.reshape(-1, H).contiguous()


def refuse_double_backward(op, what: str, instead: str) -> None:
    """Give a backward custom op an autograd formula that refuses clearly: differentiating it
    (double backward, e.g. create_graph=True for a gradient penalty) is not implemented, and
    torch's own message would tell the user to register a formula."""
    def setup_context(ctx, inputs, output):
        pass

    def backward(ctx, *grads):
        raise NotImplementedError(f"flashtx: {what} has no double backward (a gradient of its gradients, e.g. "
                                  f"autograd.grad(..., create_graph=True) then backward); for that part use {instead}")

    op.register_autograd(backward, setup_context=setup_context)

