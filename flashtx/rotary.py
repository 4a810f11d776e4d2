"""Fused rotary position embeddings (RoPE): validation and the public functions.

Four layers, as for attention: the Triton kernel and its launcher (flashtx.triton_kernels.rotary,
no autograd), the registered ops with their autograd (flashtx._rotary_op: `flashtx::rotary`,
`flashtx::rotary_qk` and the in-place `flashtx::rotary_`), the public functions here
(`apply_rotary`, `apply_rotary_qk`, `apply_rotary_pos_emb`), and the module
(flashtx.nn.RotaryEmbedding).

Layouts (the `layout` argument):

==========  ======================  ==========================================================
layout      x                       notes
==========  ======================  ==========================================================
"bshd"      (B, S, H, D)            default, as flash-attn's ``apply_rotary_emb``
"bhsd"      (B, H, S, D)            as Hugging Face / SDPA; strides only, no copy
varlen      (total, H, D)           pass cu_seqlens (nseq + 1,); layout must stay "bshd"
==========  ======================  ==========================================================

cos/sin are (seqlen_ro, rotary_dim / 2) tables indexed by position (flash-attn's convention), or
(B, seqlen_ro, rotary_dim / 2) per-batch tables. They are read in fp32 (fp64 for fp64 x) whatever
their dtype, and receive no gradient. Positions are `index + seqlen_offsets` or `position_ids`.

Dispatch goes through flashtx._dispatch: the backend is resolved once per (device, dtype, cos
dtype) and kept; nothing here formats a message unless it raises or warns.
"""
from __future__ import annotations

import numbers
from typing import Optional

import torch
from torch import Tensor

from . import _dispatch, _rotary_lane
from ._library import call, device_assert
from ._rotary_op import ROTARY_BACKENDS, RotaryInputs, rotary_inplace_op, rotary_op, rotary_qk_op  # noqa: F401
from .triton_kernels.limits import least, surely, undecided
from ._validate import (_values_readable, check_cu_seqlens_values, check_flag, check_tensor, grad_leaf,
                        has_internal_overlap, is_flag, views_overlap)

_dispatch.STANDINS["rotary"] = lambda device, dtype, cos_dtype: RotaryInputs(
    torch.empty(0, 0, 0, 0, device=device, dtype=dtype), torch.empty(0, 0, 0, device=device, dtype=cos_dtype))

_INT_DTYPES = (torch.int32, torch.int64)
LAYOUTS = ("bshd", "bhsd")


# ----------------------------------------------------------------------------------- in place
def _refuse_overlap(q: Tensor, k: Optional[Tensor], compiling: bool = False) -> None:
    """Refuse in-place rotations whose elements share memory. compiling: the overlap of q and k is not tested
    (it reads pointers, which torch.compile cannot trace); the caller then rotates out of place and copies back,
    which is defined whatever q and k share (one tensor passed as both is refused as in eager mode)."""
    for n, t in (("x" if k is None else "q", q), ("k", k)):
        if t is not None and has_internal_overlap(t):
            raise ValueError(f"inplace=True cannot rotate {n} in place: some of its elements may share memory (a "
                             "stride-0 dim, e.g. from expand(), or strides that do not nest, from as_strided); "
                             f"strides {t.stride()} for shape {tuple(t.shape)}; pass inplace=False or {n}.contiguous()")
    if k is not None and (q is k if compiling else views_overlap(q, k)):
        raise ValueError("inplace=True needs q and k in separate memory, but they share elements (the same tensor, or "
                         "overlapping slices of one); pass inplace=False")


def _records_grad(q: Tensor, k: Optional[Tensor]) -> bool:
    return torch.is_grad_enabled() and (q.requires_grad or (k is not None and k.requires_grad))


def _inplace_allowed(q: Tensor, k: Optional[Tensor]) -> bool:
    """inplace=None: rotate in place when autograd records nothing (inference, no_grad) and the memory
    allows it (and torch would: not an inference tensor outside inference mode); under torch.compile the
    functional op is used (its overlap test reads pointers)."""
    if torch.compiler.is_compiling() or _records_grad(q, k) or _rotary_lane.inference_outside(q, k):
        return False
    if has_internal_overlap(q) or (k is not None and (has_internal_overlap(k) or views_overlap(q, k))):
        return False
    return True


def _rotate_inplace(q, k, cos, sin, index, spec, backend: str, track: bool) -> None:
    """Rotate q (and k), in the caller's layout, in place. Without autograd: the in-place op (one launch,
    no copy). With autograd, and under torch.compile (which cannot test whether q, k and the tables overlap): the
    functional op, written back with copy_, which autograd records
    (torch.library gives mutating ops no autograd formula); the rotated values are what backward
    keeps, not x. So too for q or k that shares memory with the tables."""
    compiling = torch.compiler.is_compiling()  # (overlaps, of q and k or with the tables, cannot be tested then)
    _refuse_overlap(q, k, compiling)
    if not compiling and _rotary_lane.inference_outside(q, k):
        raise RuntimeError("inplace=True: an in-place update to an inference tensor outside InferenceMode is not "
                           "allowed (torch refuses it too); rotate under torch.inference_mode(), or pass "
                           "inplace=False")
    if not track and not compiling and not _rotary_lane.shares_tables(q, k, cos, sin):
        call(rotary_inplace_op, q, k, cos, sin, index, spec, backend)
        return
    for t in (q, k):  # refuse before mutating anything (autograd would refuse after q is rotated)
        if t is not None and grad_leaf(t):
            raise RuntimeError("inplace=True on a leaf tensor that requires grad (or a view of one): autograd "
                               "cannot record it; rotate a non-leaf (e.g. a projection's output) or use inplace=False")
    if k is None:
        q.copy_(call(rotary_op, q, cos, sin, index, spec, backend))
    else:
        qo, ko = call(rotary_qk_op, q, k, cos, sin, index, spec, backend)
        q.copy_(qo)
        k.copy_(ko)


# ----------------------------------------------------------------------------------- validation
def _check_inplace(inplace) -> None:
    if inplace is not None and not is_flag(inplace):
        raise TypeError(f"inplace must be None or a bool; got {type(inplace).__name__} {inplace!r}")


def _check_int(name: str, v, minimum: int = 0) -> int:
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise TypeError(f"{name} must be an int; got {type(v).__name__}")
    if v < minimum:
        raise ValueError(f"{name} must be >= {minimum}; got {v}")
    return int(v)


def _check_index_tensor(name: str, t, shape_ok, expected, device) -> None:
    """shape_ok: a predicate on t's shape, checked once t is known to be a tensor; expected: the shape it wants
    (a str, or a function making it: only an error formats sizes, which under torch.compile are symbolic and
    would be pinned by an f-string, compiling a graph per size)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor; got {type(t).__name__}")
    if t.dtype not in _INT_DTYPES:
        raise TypeError(f"{name} has dtype {t.dtype}; allowed: torch.int32, torch.int64")
    if not shape_ok(tuple(t.shape)):
        raise ValueError(f"{name} must have shape {expected() if callable(expected) else expected}; got "
                         f"{tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but the activations are on {device}")


def _dims(name: str, x, layout: str, varlen: bool) -> tuple:
    """x's (B, S, H, D) (varlen: (1, total, H, D)) for `layout`, checked; no views are made: the ops
    read x's strides in its own layout."""
    check_tensor(name, x)
    if layout != "bshd" and layout != "bhsd":
        raise ValueError(f"layout must be one of {LAYOUTS}; got {layout!r}")
    shape = x.shape
    if varlen:
        if layout != "bshd":
            raise ValueError(f"with cu_seqlens, {name} is packed (total, H, D) and layout must be 'bshd'; "
                             f"got layout={layout!r}")
        if len(shape) != 3:
            raise ValueError(f"with cu_seqlens, {name} must be 3-D (total, H, D); got shape {tuple(shape)}")
        return 1, shape[0], shape[1], shape[2]
    if len(shape) != 4:
        want = "(B, S, H, D)" if layout == "bshd" else "(B, H, S, D)"
        raise ValueError(f"{name} must be 4-D {want} for layout={layout!r}; got shape {tuple(shape)}")
    if layout == "bshd":
        return shape
    return shape[0], shape[2], shape[1], shape[3]


def _check_tables(cos, sin, x: Tensor, d: int, nb: int, name: str, empty: bool) -> None:
    """cos/sin are (seqlen_ro, R2) or (Bc, seqlen_ro, R2) with Bc in {1, nb}; checks rotary_dim against
    x's head dim d. empty: nothing is rotated (so no position is read and seqlen_ro may be 0)."""
    for n, t in (("cos", cos), ("sin", sin)):
        check_tensor(n, t)
        if t.device != x.device:
            raise ValueError(f"{n} is on {t.device} but {name} is on {x.device}")
        if t.requires_grad and torch.is_grad_enabled():
            raise NotImplementedError(f"{n} requires grad, but flashtx's rotary computes no gradient for cos/sin; "
                                      f"pass {n}.detach() (position tables are constants)")
    shape = cos.shape
    if shape != sin.shape:
        raise ValueError(f"cos and sin must have the same shape; got {tuple(shape)} and {tuple(sin.shape)}")
    dim = len(shape)
    if dim != 2 and dim != 3:
        raise ValueError(f"cos/sin must be (seqlen_ro, rotary_dim / 2) or (B, seqlen_ro, rotary_dim / 2); "
                         f"got shape {tuple(shape)}")
    if shape[-2] == 0 and not empty:
        raise ValueError(f"cos/sin must hold at least one position (seqlen_ro >= 1); got shape {tuple(shape)}")
    if dim == 3 and shape[0] != 1 and shape[0] != nb:
        raise ValueError(f"per-batch cos/sin must have batch size 1 or {nb}; got shape {tuple(shape)}")
    r2 = shape[-1]
    if r2 == 0 or 2 * r2 > d:
        raise ValueError(f"rotary_dim = 2 * cos.shape[-1] = {2 * r2} must be in [2, head dim {d}] of {name} "
                         f"{tuple(x.shape)} (cos/sin shape {tuple(shape)})")


def _positions(B, S, device, cos, seqlen_offsets, position_ids, cu_seqlens, max_seqlen, empty: bool):
    """Validated position arguments for x of (B, S, H, D) (varlen: (1, total, H, D)): (index =
    [offsets | None, position_ids | None, cu_seqlens | None], offset int, max_seqlen int (0 without
    cu_seqlens), clamped to the total). empty: nothing is rotated, so the table needs no positions."""
    varlen = cu_seqlens is not None
    if varlen:
        _check_index_tensor("cu_seqlens", cu_seqlens, lambda s: len(s) == 1 and s[0] >= 1, "(nseq + 1,)", device)
        cu_seqlens = cu_seqlens.contiguous()  # the kernel indexes it flat
        nb = cu_seqlens.numel() - 1
        if torch.compiler.is_compiling() and (max_seqlen is None or isinstance(max_seqlen, numbers.Integral)
                                               and undecided(max_seqlen < 0)):
            max_seqlen = S  # no value to read (or one read on the device): the total bounds the grid (as
            # flash_attn_varlen_func's tensor max_seqlen)
        elif max_seqlen is None:  # one device sync; pass max_seqlen to avoid it
            # (at least 0: negative lengths are cu_seqlens' error, named below)
            max_seqlen = max(int((cu_seqlens[1:] - cu_seqlens[:-1]).max()), 0) if nb > 0 else 0
        max_seqlen = _check_int("max_seqlen", max_seqlen)
        check_cu_seqlens_values("cu_seqlens", cu_seqlens, S, "total (x.shape[0])", max_seqlen, "max_seqlen")
        # an upper bound (flash-attn); no sequence is longer than the total, so clamping to it bounds the
        # kernel's grid (max_seqlen rows per sequence) by the data, and looser bounds share a launch-cache entry
        max_seqlen = seq = least(max_seqlen, S)
    else:
        if max_seqlen is not None:
            raise ValueError("max_seqlen is only meaningful with cu_seqlens (packed varlen input)")
        nb, seq = B, S
    offsets, offset = None, 0
    if isinstance(seqlen_offsets, torch.Tensor):
        _check_index_tensor("seqlen_offsets", seqlen_offsets, lambda s: s == (nb,),
                            lambda: f"({nb},) (one offset per sequence)", device)
        offsets = seqlen_offsets.contiguous()  # the kernel indexes it flat
    elif type(seqlen_offsets) is int and seqlen_offsets >= 0:  # the common case, as _check_int accepts it
        offset = seqlen_offsets
    else:
        offset = _check_int("seqlen_offsets", seqlen_offsets)
    seqlen_ro = cos.shape[-2]
    if position_ids is not None:
        if offsets is not None or offset != 0:
            raise ValueError("pass either seqlen_offsets or position_ids, not both (position_ids are absolute)")
        if varlen:
            _check_index_tensor("position_ids", position_ids, lambda s: s == (S,), lambda: f"({S},) for packed input",
                                device)
            position_ids = position_ids.unsqueeze(0)  # (1, total)
        else:
            _check_index_tensor("position_ids", position_ids,
                                lambda s: len(s) == 2 and (s[0] == 1 or s[0] == B) and s[1] == S,  # (== each, not
                                lambda: f"({B}, {S}) or (1, {S})", device)  # `in`: Dynamo's `in` misses symbolic sizes)
            position_ids = position_ids.expand(B, S)
    elif offsets is None and not empty and seq + offset > seqlen_ro:
        if not varlen:
            raise ValueError(f"cos/sin have {seqlen_ro} positions (shape {tuple(cos.shape)}) but positions up to "
                             f"{seq + offset - 1} are needed (sequence length {seq} + seqlen_offsets {offset})")
        _check_varlen_table(cu_seqlens, cos, offset)
    index = [offsets, position_ids, cu_seqlens]
    return index, offset, (max_seqlen if varlen else 0)


def _check_varlen_table(cu_seqlens: Tensor, cos: Tensor, offset: int) -> None:
    """max_seqlen is only an upper bound (as in flash-attn): check the table against the sequences'
    real lengths, on the host for CPU tensors, by a device-side assert (no sync) otherwise."""
    lens = cu_seqlens[1:] - cu_seqlens[:-1]  # (nseq,)
    if lens.numel() == 0 or cu_seqlens.device.type == "meta":
        return
    seqlen_ro = cos.shape[-2]
    if not _values_readable(cu_seqlens):
        device_assert(lens.max() + offset <= seqlen_ro,
                      f"flashtx: cos/sin have {seqlen_ro} positions, fewer than a sequence of cu_seqlens "
                      f"plus seqlen_offsets {offset} needs")
        return
    longest = int(lens.max())
    if longest + offset > seqlen_ro:
        i = int(lens.argmax())
        raise ValueError(f"cos/sin have {seqlen_ro} positions (shape {tuple(cos.shape)}) but positions up to "
                         f"{longest + offset - 1} are needed (sequence length {longest} of sequence {i} in "
                         f"cu_seqlens + seqlen_offsets {offset})")


def _prepare(name: str, x, k, cos, sin, seqlen_offsets, position_ids, cu_seqlens, max_seqlen, layout, interleaved,
             backend):
    """Validate everything for x (or q, k when k is given, with name "q"); returns (index, spec,
    backend name) for the ops, which take x, k, cos and sin as given (see flashtx._rotary_op)."""
    check_flag("interleaved", interleaved)
    varlen = cu_seqlens is not None
    B, S, H, D = _dims(name, x, layout, varlen)
    if k is not None:
        kd = _dims("k", k, layout, varlen)
        if k.device != x.device or k.dtype != x.dtype:
            raise TypeError(f"q and k must share dtype and device; got {x.dtype}/{x.device} and "
                            f"{k.dtype}/{k.device}")
        if kd[0] != B or kd[1] != S or kd[3] != D:
            raise ValueError(f"q {tuple(x.shape)} and k {tuple(k.shape)} must differ only in the number of heads "
                             f"(layout {layout!r})")
    nb = cu_seqlens.numel() - 1 if varlen and isinstance(cu_seqlens, torch.Tensor) else B
    # e.g. S = 0: empty outputs, no position read
    empty = surely(x.numel() == 0) and (k is None or surely(k.numel() == 0))
    _check_tables(cos, sin, x, D, nb, name, empty)
    index, offset, max_seqlen = _positions(B, S, x.device, cos, seqlen_offsets, position_ids, cu_seqlens,
                                           max_seqlen, empty)
    if backend is not None and not isinstance(backend, str):
        raise TypeError(f"backend must be None or a string; got {type(backend).__name__}")
    chosen = _dispatch.plan_device("rotary", backend, x.device, x.dtype, cos.dtype)
    spec = [offset, max_seqlen, 1 if interleaved else 0, 0, 1 if layout == "bhsd" else 0]
    return index, spec, chosen


# ----------------------------------------------------------------------------------- public API
def apply_rotary(x, cos, sin, *, interleaved=False, seqlen_offsets=0, position_ids=None, cu_seqlens=None,
                 max_seqlen=None, inplace=False, layout="bshd", backend=None):
    """Rotary position embedding of x, fused (one read and one write of x), forward and backward.

    Args:
        x: (B, S, H, D) (layout="bshd", the default, as flash-attn's apply_rotary_emb), or
            (B, H, S, D) (layout="bhsd"), or packed (total, H, D) with cu_seqlens. float16,
            bfloat16, float32 (float64 for tests); any strides.
        cos, sin: (seqlen_ro, rotary_dim / 2), or per-batch (B, seqlen_ro, rotary_dim / 2); any
            float dtype, read in fp32. rotary_dim = 2 * cos.shape[-1] <= D; columns past it
            pass through unchanged (partial rotary). No gradient flows to them. seqlen_ro = 0
            only for an empty x (e.g. S = 0), which gives an empty result.
        interleaved: False rotates the pairs (x[j], x[j + rotary_dim/2]) (NeoX/LLaMA,
            rotate_half); True rotates (x[2j], x[2j+1]) (GPT-J).
        seqlen_offsets: int, or (B,) int tensor (per sequence; KV-cache decoding): token s of
            sequence b is at position s + offset[b]. Needs seqlen_ro >= S + offset for an int.
        position_ids: (B, S) or (1, S) int tensor of absolute positions (packed: (total,));
            excludes seqlen_offsets. Positions outside [0, seqlen_ro) give NaN (no device sync).
        cu_seqlens: (nseq + 1,) int32/int64 cumulative sequence lengths of packed x, with
            cu_seqlens[-1] == total; max_seqlen: longest sequence or any bound above it (clamped to
            total; computed, with a sync, if None).
        inplace: False (default): a new tensor. True: rotate x in place and return it; autograd
            still works unless x is a leaf that requires grad (when autograd records the call, the
            rotated values are computed out of place and written back with copy_, since
            torch.library gives mutating ops no autograd formula). None: in place when autograd
            records nothing (inference, no_grad) and x has no self-overlapping (stride-0) dim,
            out of place otherwise (and always under torch.compile).
        layout: "bshd" or "bhsd" (4-D x only), see above. backend: None, "triton" or "reference".

    Returns:
        Tensor shaped like x, in x's dtype (x itself when inplace).

    Example:
        >>> cos, sin = flashtx.nn.RotaryEmbedding(64).cos_sin(128)   # (128, 32) each
        >>> q = flashtx.apply_rotary(q, cos, sin)                      # q: (B, 128, H, 64)
    """
    if position_ids is None and cu_seqlens is None and max_seqlen is None:  # planned once per call signature
        done = _rotary_lane.rotate(x, None, cos, sin, seqlen_offsets, interleaved, layout, inplace, backend)
        if done is not None:
            return done[0]
    index, spec, name = _prepare("x", x, None, cos, sin, seqlen_offsets, position_ids, cu_seqlens, max_seqlen, layout,
                                 interleaved, backend)
    _check_inplace(inplace)
    if inplace is None:
        inplace = _inplace_allowed(x, None)
    if inplace:
        _rotate_inplace(x, None, cos, sin, index, spec, name, _records_grad(x, None))
        return x
    return call(rotary_op, x, cos, sin, index, spec, name)


def apply_rotary_emb(x, cos, sin, interleaved=False, inplace=False, seqlen_offsets=0, cu_seqlens=None,
                     max_seqlen=None):
    """Drop-in for flash-attn's ``flash_attn.layers.rotary.apply_rotary_emb``: its signature, positional order
    and defaults (out of place, NeoX halves), computed by apply_rotary.

    x: (B, S, H, D), or packed (total, H, D) with cu_seqlens / max_seqlen; cos, sin: (seqlen_ro, rotary_dim / 2);
    seqlen_offsets: int or (B,) int tensor. Returns x rotated (x itself when inplace), as apply_rotary.
    max_seqlen is ignored without cu_seqlens, as flash-attn's (apply_rotary refuses it there).

    Example:
        >>> q = flashtx.apply_rotary_emb(q, cos, sin, False, False, cache_len)   # flash-attn's positional call
    """
    return apply_rotary(x, cos, sin, interleaved=interleaved, inplace=inplace, seqlen_offsets=seqlen_offsets,
                        cu_seqlens=cu_seqlens, max_seqlen=None if cu_seqlens is None else max_seqlen)


def apply_rotary_qk(q, k, cos, sin, *, interleaved=False, seqlen_offsets=0, position_ids=None, cu_seqlens=None,
                    max_seqlen=None, inplace=False, layout="bshd", backend=None):
    """Rotate q and k in one kernel launch; they may have different head counts (GQA/MQA).

    q: (B, S, Hq, D) and k: (B, S, Hk, D) (or (B, H, S, D) with layout="bhsd", or packed
    (total, H, D) with cu_seqlens), same dtype, device, B, S and D. Every other argument is as in
    apply_rotary and applies to both (inplace=True/None also needs q and k in separate memory;
    None falls back to out of place when they share some; under torch.compile, which cannot read
    pointers, only one tensor passed as both is refused, and q and k are rotated out of place and
    copied back). Returns (q_rot, k_rot), or (q, k) rotated in place.

    Example:
        >>> q, k = flashtx.apply_rotary_qk(q, k, cos, sin, seqlen_offsets=cache_len)
    """
    if k is None:
        check_tensor("k", k)  # (apply_rotary rotates one tensor)
    if position_ids is None and cu_seqlens is None and max_seqlen is None:  # planned once per call signature
        done = _rotary_lane.rotate(q, k, cos, sin, seqlen_offsets, interleaved, layout, inplace, backend)
        if done is not None:
            return done
    index, spec, name = _prepare("q", q, k, cos, sin, seqlen_offsets, position_ids, cu_seqlens, max_seqlen, layout,
                                 interleaved, backend)
    _check_inplace(inplace)
    if inplace is None:
        inplace = _inplace_allowed(q, k)
    if inplace:
        _rotate_inplace(q, k, cos, sin, index, spec, name, _records_grad(q, k))
        return q, k
    return call(rotary_qk_op, q, k, cos, sin, index, spec, name)


def apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1, *, inplace=False):
    """Drop-in for Hugging Face transformers' ``modeling_llama.apply_rotary_pos_emb``, fused.

    Both of transformers' signatures work: 5.x's ``(q, k, cos, sin, unsqueeze_dim=1)`` and 4.x's
    ``(q, k, cos, sin, position_ids=None, unsqueeze_dim=1)``. A positional fifth argument that is
    an int (not a bool) is 5.x's unsqueeze_dim; a tensor or None there is 4.x's position_ids.

    Args:
        q: (B, Hq, S, D), k: (B, Hk, S, D) with unsqueeze_dim=1 (the default), or
            (B, S, H, D) with unsqueeze_dim=2.
        cos, sin: (B, S, rotary_dim) or (1, S, rotary_dim) as transformers' rotary embeddings
            return them: full width, with duplicated halves (cat(freqs, freqs)), any float dtype.
            Only the first half is read. rotary_dim < D rotates the first rotary_dim columns
            and passes the rest through (as Phi-3's variant). Older transformers passed
            (max_len, rotary_dim) tables plus position_ids (B, S): that form works too.
        position_ids: 4.x's argument: used only with 2-D cos/sin (ignored otherwise, as in
            transformers). An int here is taken as unsqueeze_dim (5.x's fifth argument); passing
            unsqueeze_dim as well, with a value other than that int and the default 1, is a TypeError
            (an explicit unsqueeze_dim=1 cannot be told from the default: the int wins).
        unsqueeze_dim: 1 or 2 (or -3 / -2, as transformers' cos.unsqueeze takes them), as above.
        inplace: False (default, the drop-in's semantics): new tensors. None: rotate q and k in
            place when autograd records nothing (as flashtx.integrations.transformers does in
            inference); True: always in place (see apply_rotary).

    Returns:
        (q_embed, k_embed) shaped like q and k (q and k themselves when rotated in place).
        Differentiable in q and k.

    Example:
        >>> cos, sin = rotary_emb(v, position_ids)                       # transformers, (B, S, D)
        >>> q, k = flashtx.apply_rotary_pos_emb(q, k, cos, sin)          # q, k: (B, H, S, D)
        >>> q, k = flashtx.apply_rotary_pos_emb(q, k, cos, sin, 2)       # 5.x's positional unsqueeze_dim
    """
    if position_ids is not None and not isinstance(position_ids, Tensor) and not isinstance(position_ids, bool) \
            and isinstance(position_ids, numbers.Integral):  # 5.x's (q, k, cos, sin, unsqueeze_dim)
        if unsqueeze_dim != 1 and unsqueeze_dim != position_ids:
            raise TypeError(f"apply_rotary_pos_emb got unsqueeze_dim twice: {position_ids!r} as the fifth argument "
                            f"(transformers 5's position) and unsqueeze_dim={unsqueeze_dim!r}")
        position_ids, unsqueeze_dim = None, position_ids
    if not isinstance(unsqueeze_dim, numbers.Integral):  # (a tensor compared equal to 1 or 2 below)
        raise TypeError(f"unsqueeze_dim must be an int (1, 2, -3 or -2); got {type(unsqueeze_dim).__name__} "
                        f"{unsqueeze_dim!r}")
    if unsqueeze_dim in (-3, -2) and type(unsqueeze_dim) is int:  # as transformers' cos.unsqueeze(unsqueeze_dim)
        unsqueeze_dim += 4
    if unsqueeze_dim not in (1, 2):
        raise ValueError(f"unsqueeze_dim must be 1 (or -3: (B, H, S, D) q/k) or 2 (or -2: (B, S, H, D)); "
                         f"got {unsqueeze_dim!r}")
    layout = "bhsd" if unsqueeze_dim == 1 else "bshd"
    for n, t in (("q", q), ("k", k), ("cos", cos), ("sin", sin)):
        check_tensor(n, t)
    if cos.dim() not in (2, 3) or cos.shape[-1] % 2:
        raise ValueError(f"cos/sin must be (B, S, rotary_dim) or (max_len, rotary_dim) with an even rotary_dim; "
                         f"got shape {tuple(cos.shape)}")
    if cos.shape != sin.shape:
        raise ValueError(f"cos and sin must have the same shape; got {tuple(cos.shape)} and {tuple(sin.shape)}")
    if q.dim() == 4:  # (checks apply_rotary_qk makes too, naming the tables the caller passed, not their halves)
        if cos.dim() == 3 and cos.shape[0] != 1 and cos.shape[0] != q.shape[0]:  # (not `in`: symbolic sizes)
            raise ValueError(f"cos/sin (B, S, rotary_dim) must have batch size 1 or q's {q.shape[0]}; got shape "
                             f"{tuple(cos.shape)}")
        if cos.shape[-1] > q.shape[-1]:
            raise ValueError(f"cos/sin's rotary_dim = cos.shape[-1] = {cos.shape[-1]} must be at most the head dim "
                             f"{q.shape[-1]} of q {tuple(q.shape)}")
    half = cos.shape[-1] // 2
    cos_h, sin_h = cos[..., :half], sin[..., :half]  # views: the halves are duplicates
    if cos.dim() == 3:
        seq = q.shape[2 if unsqueeze_dim == 1 else 1] if q.dim() == 4 else None  # (apply_rotary_qk names other ranks)
        if seq is not None and cos.shape[1] != seq:
            raise ValueError(f"cos/sin {tuple(cos.shape)} must cover the sequence length {seq} of q "
                             f"{tuple(q.shape)} exactly (B, S, rotary_dim)")
        position_ids = None
    return apply_rotary_qk(q, k, cos_h, sin_h, position_ids=position_ids, layout=layout, inplace=inplace)
