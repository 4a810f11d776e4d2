"""`flashtx.flash_attn_with_kvcache`: flash-attn 2's decoding entry point, on flashtx's split-KV kernels."""
from __future__ import annotations

import itertools
import math
import numbers

import torch
from torch import Tensor

from . import _decode_lane, _decode_op, _lanes
from ._device_checks import triton_checks as _triton_checks
from ._library import call, device_assert
from ._validate import (_check_layout, _values_readable, check_alibi, check_flag, check_softcap, check_tensor,
                        check_window, has_internal_overlap, resolve_scale, views_overlap)
from .triton_kernels.limits import MAX_GRID_YZ, MAX_SEQ

LN2 = math.log(2.0)
_INDEX_DTYPES = (torch.int32, torch.int64)
_STRIDED = torch.strided


def _check_index(name: str, t, shape: tuple, q: Tensor, doc: str = "") -> Tensor | None:
    """t: None, or an int32/int64 tensor of `shape` (-1: any size) on q's device; doc names the dims."""
    if t is None:
        return None

    def want() -> str:  # messages only: a string built on every call would cost time (and break a trace)
        return doc + " = " + str(shape).replace("-1", "any") if doc else str(shape)

    if not isinstance(t, Tensor) or t.dtype not in _INDEX_DTYPES:
        got = f"dtype {t.dtype}" if isinstance(t, Tensor) else type(t).__name__
        raise TypeError(f"{name} must be an int32 (or int64) tensor of shape {want()}; got {got}")
    if t.layout is not _STRIDED or t.is_nested:
        _check_layout(name, t)
    if t.shape != shape and (t.dim() != len(shape) or any(n != w and w != -1 for n, w in zip(t.shape, shape))):
        raise ValueError(f"{name} must have shape {want()}; got {tuple(t.shape)}")
    if t.device != q.device:
        raise ValueError(f"{name} must be on q's device {q.device}; got {t.device}")
    return t.contiguous()  # the kernels index it flat: a strided view would be read past its values


def _check_like(name: str, t, dims: int, q: Tensor, shape_doc: str) -> None:
    if type(t) is Tensor and t is not q and t.dtype == q.dtype and t.dim() == dims and t.device == q.device and \
            t.layout is _STRIDED and not t.is_nested and \
            (torch.compiler.is_compiling() or not t.is_neg()):  # (check_tensor's rule: Dynamo cannot trace is_neg)
        return  # the common case (q itself passed check_tensor first)
    check_tensor(name, t)
    if t.dim() != dims:
        raise ValueError(f"{name} must be {dims}-D {shape_doc}; got shape {tuple(t.shape)}")
    if t.dtype != q.dtype:
        raise TypeError(f"{name} must have q's dtype {q.dtype}; got {t.dtype}")
    if t.device != q.device:
        raise ValueError(f"{name} must be on q's device {q.device}; got {t.device}")


def _check_values(ok: Tensor, readable: bool, message, name: str, where: str = "flash_attn_with_kvcache") -> None:
    """Raise ValueError(message(ok)) where `ok` (a bool tensor) has a False; on a GPU or while tracing,
    a device-side assert (torch._assert_async) naming flashtx.<where> and `name` instead of a host sync."""
    if readable:
        if not bool(ok.all()):
            raise ValueError(message(ok))
    else:
        device_assert(ok.all(), f"flashtx.{where}: {name} out of range")


def _check_writable_caches(k_cache: Tensor, v_cache: Tensor, paged: bool) -> None:
    """Appending writes every (row, position, head) slot once: refuse caches whose slots share memory (an expanded
    view), as torch refuses in-place writes there (what they share with each other or with q, k, v:
    append_overlap)."""
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if has_internal_overlap(t):
            dims = ("pages" if paged else "batch", "page rows" if paged else "positions", "heads", "head dim")
            dup = ", ".join(d for d, n, st in zip(dims, t.shape, t.stride()) if n > 1 and st == 0)
            why = (f"stride 0 along {dup} (an expanded view" if dup else "strides that revisit memory (an as_strided "
                   "view") + f", shape {tuple(t.shape)}, strides {t.stride()})"
            raise ValueError(f"{name} has {why}: appending k, v would write one memory slot for several; pass a "
                             "cache with its own memory per slot")


def append_overlap(q, k, v, k_cache, v_cache) -> tuple[str, str] | None:
    """The names of the first two tensors of an appending call that share memory: k_cache and v_cache, or a new
    tensor (k, v, q: the kernels read them while the append writes the caches) and a cache; None if none do.
    Reads addresses: not traceable (a compiled step checks identity only)."""
    sk, sv = k_cache.untyped_storage().data_ptr(), v_cache.untyped_storage().data_ptr()
    if sk == sv and (k_cache is v_cache or views_overlap(k_cache, v_cache)):
        return "k_cache", "v_cache"
    for name, t in (("k", k), ("v", v), ("q", q)):
        p = t.untyped_storage().data_ptr()
        if p == sk and views_overlap(t, k_cache):
            return name, "k_cache"
        if p == sv and views_overlap(t, v_cache):
            return name, "v_cache"
    return None


def _overlap_message(a: str, b: str) -> str:
    if a == "k_cache":
        return ("k_cache and v_cache share memory: appending v would overwrite k; pass separate buffers (or "
                "non-overlapping slices of one)")
    return (f"{a} shares memory with {b}: the append writes {b} while the kernels read {a}, so {a} could be "
            f"overwritten first; pass {a} in memory of its own (e.g. {a}.clone())")


def _first_bad(ok: Tensor) -> int:
    return int((~ok).nonzero()[0][0])


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False,
                            *, backend=None):
    """Drop-in for flash-attn 2's ``flash_attn_with_kvcache``: attention of a few new query tokens
    over a KV cache, appending the new keys/values in place first. Inference only.

    Args:
        q: (B, Sq, Hq, D): Sq = 1 for decoding, a few tokens for speculative decoding (any Sq runs;
            long prefills are expected to be faster through flashtx.flash_attn_func: unmeasured; decoding
            was timed once, on an H100 at 9d4ae90, bench/RESULTS.md, and its kernels changed since).
            float16, bfloat16, float32
            (float64 in Triton's interpreter).
        k_cache, v_cache: (B_cache, S_cache, Hkv, D|Dv) contiguous caches, or with block_table
            paged pools (num_pages, page_size, Hkv, D|Dv), page_size a multiple of 16. q's dtype
            and device; any strides (e.g. (B, Hkv, S, D) buffers viewed as (B, S, Hkv, D)).
            Hq must be a multiple of Hkv (GQA/MQA; K/V are never expanded). Under torch.compile,
            pass the caches themselves, not views (a transpose, one layer of a stacked cache): a
            mutated view of a graph input is cloned and copied back whole on every call; for
            mode="reduce-overhead" mark them with torch._dynamo.mark_static_address, as
            flashtx.nn's caches are: CUDA graphs skip a step that mutates a non-static input.
        k, v: optional (B, Snew, Hkv, D|Dv) new keys/values, written in place into the cache at
            positions cache_seqlens[b] .. cache_seqlens[b] + Snew - 1 before attending.
        rotary_cos, rotary_sin: optional (seqlen_ro, rotary_dim / 2) tables (rotary_dim <= D, read
            in fp32): k is rotated at its cache positions before being written, q at positions
            cache_seqlens[b] + i when causal or windowed, else all at cache_seqlens[b] (flash-attn's
            rule). Every position used must be < seqlen_ro. Without k, v only q is rotated (flash-attn
            refuses rotary tables without new keys).
        rotary_interleaved: True (the default, flash-attn's) rotates GPT-J's pairs (x[2i], x[2i+1]);
            False, NeoX/LLaMA's halves (x[i], x[i + rotary_dim / 2]), the default of flashtx's other
            RoPE functions and of flashtx.nn.
        cache_seqlens: (B,) int32 (int64 accepted) or an int: tokens already in each sequence's
            cache (before the append); None = the whole cache is in use (then k, v must be None).
        cache_batch_idx: (B,) int32: sequence b uses cache row cache_batch_idx[b] (contiguous
            caches only; distinct rows when appending: a repeat is refused on CPU, and on a GPU for
            batches of up to 256). Default b (then B_cache >= B: rows past B are left alone).
        cache_leftpad: (B,) int32: sequence b's keys start at cache index cache_leftpad[b] (left
            padding); positions (RoPE, causal, ALiBi) stay cache indices, as flash-attn's.
        block_table: (B, max_pages_per_seq) int32 page indices for a paged cache: position j of
            sequence b is row j % page_size of page block_table[b, j // page_size]. Only the pages
            the call touches are read (and checked): those of the appended positions and of the keys
            some query may see. Entries past a sequence's length, before cache_leftpad or behind a
            sliding window may hold anything (pages a serving engine freed), as with flash-attn.
            Sequences may share pages they only read (a common prefix), but no two may append into
            the same page row (refused for CPU tensors; on a GPU the caller must ensure it, as with
            flash-attn). When appending, caches whose slots share
            memory (stride 0: an expanded view) or that share memory with each other are refused.
        softmax_scale: default 1 / sqrt(D).
        causal, window_size: aligned bottom-right: query i sits at position L_b - Sq + i, where
            L_b = cache_seqlens[b] + Snew, and sees keys j <= that + right (causal: right = 0) and
            j >= that - left; window -1 = unbounded.
        softcap: > 0: s -> softcap * tanh(s / softcap). alibi_slopes: (Hq,) or (B, Hq) float32:
            -slope * |L_b - Sq + i - j| added to the scores.
        num_splits: key-range splits per sequence (each a program; partials merged by their
            log-sum-exp); 0 = a heuristic from the GPU's SM count (flash-attn's), 1 = none.
        return_softmax_lse: also return lse (B, Hq, Sq), float32 (float64 for float64 q), natural log.
        backend: None (automatic), "triton", "reference" or "cuda" (the optional CUDA extension,
            flashtx.cuda_ext; never chosen automatically: on an H100 at 9d4ae90 its decode took 3.2x the
            Triton kernel's time, bench/RESULTS.md; both kernels changed since, untimed). Keyword-only.

    Returns:
        out (B, Sq, Hq, Dv) in q's dtype [, lse]. Rows that see no key give 0 and lse -inf.

    Indices are checked (a ValueError naming the argument) on CPU; on a GPU without a host sync,
    by a device-side assert. Not differentiable: inputs that require grad are refused. The Triton
    kernels' CUDA grid takes a batch, and kv heads x query tiles, of at most 65535 (a ValueError).

    Example:
        >>> out = flashtx.flash_attn_with_kvcache(q, k_cache, v_cache, k=k, v=v, cache_seqlens=lens,
        ...                                       rotary_cos=cos, rotary_sin=sin, causal=True)
        >>> lens += 1   # the caller owns the lengths, as with flash-attn
    """
    return kvcache_step(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                        cache_leftpad, block_table, softmax_scale, causal, window_size, softcap, rotary_interleaved,
                        alibi_slopes, num_splits, return_softmax_lse, backend, False)


def kvcache_step(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
                 block_table, softmax_scale, causal, window_size, softcap, rotary_interleaved, alibi_slopes, num_splits,
                 return_softmax_lse, backend, ranges_known: bool):
    """flash_attn_with_kvcache's work, its arguments in order (all positional), and ranges_known: True where the
    caller has proven every index value the kernels follow in range (flashtx.nn's own caches, whose lengths, leftpad
    and block table only flashtx wrote since it checked them on the host: KVCache.ranges_known), so the per-call
    index check (_check_ranges: the check kernel and a device-side assert on a GPU) is skipped. Every argument
    check still runs."""
    done = _decode_lane.step(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                             cache_leftpad, block_table, softmax_scale, causal, window_size, softcap,
                             rotary_interleaved, alibi_slopes, num_splits, return_softmax_lse, backend, ranges_known)
    if done is not None:  # a repeated plain call: one lookup (flashtx._decode_lane)
        return done
    rotary_interleaved = check_flag("rotary_interleaved", rotary_interleaved)
    return_softmax_lse = check_flag("return_softmax_lse", return_softmax_lse)
    (q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad, block_table,
     Snew, capacity, causal, window, softcap, alibi, scale, q_moves) = _prepare(
        q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad, block_table,
        softmax_scale, causal, window_size, softcap, alibi_slopes, num_splits)
    if not ranges_known:
        _check_ranges(q, k_cache, cache_seqlens, cache_batch_idx, cache_leftpad, block_table, rotary_cos, Snew,
                      capacity, q_moves, window[0])
    name = _backend(q, k_cache, v_cache, k, rotary_cos, cache_leftpad, alibi, window, softcap, capacity, backend)
    if name == "triton" and (q.shape[0] > MAX_GRID_YZ or q.shape[1] * q.shape[2] > MAX_GRID_YZ):
        # (kv heads x query tiles <= Hq x Sq) the kernels' grid limits, before the append writes the caches
        _decode_op._TRITON.kernels.check_launch_grid(q, k_cache, v_cache, block_table, int(num_splits))
    if Snew or rotary_cos is not None:
        q_rot = call(_decode_op.kvcache_append, q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                     cache_batch_idx, block_table, bool(rotary_interleaved), not q_moves, name)
        if rotary_cos is not None:
            q = q_rot
    # the keys end at cache_seqlens + Snew: the kernels add Snew themselves (no device op here)
    out, lse2 = call(_decode_op.kvcache_attention, q, k_cache, v_cache, cache_seqlens, cache_leftpad, cache_batch_idx,
                     block_table, alibi, None, scale, causal, window[0], window[1], softcap, int(num_splits), Snew,
                     name, False)
    if return_softmax_lse:
        return out, lse2 * LN2
    return out


def _backend(q, k_cache, v_cache, k, rotary_cos, cache_leftpad, alibi, window, softcap, capacity, backend) -> str:
    """The decode backend's name for this call (flashtx._decode_op.select)."""
    def features() -> dict:  # what a backend whose reasons read the call (DecodeCUDA.call_key) is judged on
        return dict(k=k, rotary_cos=rotary_cos, cache_leftpad=cache_leftpad, alibi=alibi, window=window,
                    softcap=softcap, capacity=capacity)

    name = _decode_op.select(q, k_cache, v_cache, backend, None if backend is None else features())
    if backend is None and name in _decode_op.CALL_JUDGED:  # picked on kinds alone: judge this call's features
        name = _decode_op.select(q, k_cache, v_cache, None, features())
    return name


def _prepare(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
             block_table, softmax_scale, causal, window_size, softcap, alibi_slopes, num_splits) -> tuple:
    """flash_attn_with_kvcache's argument checks, but for the index values (_check_ranges): raises what a call
    with these arguments raises, or returns them as the kernels take them, with (Snew, capacity, causal (a bool),
    window (two ints), softcap (a float), alibi ((1 | B, Hq) or None), scale (a float), q_moves (q's positions
    advance per token: causal or windowed)) in their places."""
    _check_like("q", q, 4, q, "(B, Sq, Hq, D)")
    paged = block_table is not None
    layout = "(num_pages, page_size, Hkv, D)" if paged else "(B_cache, S_cache, Hkv, D)"
    _check_like("k_cache", k_cache, 4, q, layout)
    _check_like("v_cache", v_cache, 4, q, layout)
    B, Sq, Hq, D = q.shape
    if D == 0 or v_cache.shape[3] == 0:
        raise ValueError(f"q, k_cache and v_cache need a head dim >= 1; got {D} and {v_cache.shape[3]}")
    if k_cache.shape[:3] != v_cache.shape[:3] or k_cache.shape[3] != D:
        raise ValueError(f"k_cache must be {layout} with D = q's {D} and v_cache must match its first three dims; "
                         f"got k_cache {tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}")
    Hkv, Dv = k_cache.shape[2], v_cache.shape[3]
    if Hkv == 0:
        raise ValueError(f"k_cache and v_cache need at least 1 kv head (dim 2 of {layout}); got k_cache "
                         f"{tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}")
    if Hq % Hkv:
        raise ValueError(f"q's heads ({Hq}) must be a multiple of the cache's kv heads ({Hkv})")
    if (k is None) != (v is None):
        raise ValueError("pass k and v together (or neither)")
    Snew = 0
    if k is not None:
        _check_like("k", k, 4, q, "(B, Snew, Hkv, D)")
        _check_like("v", v, 4, q, "(B, Snew, Hkv, Dv)")
        Snew = k.shape[1]
        if k.shape != (B, Snew, Hkv, D) or v.shape != (B, Snew, Hkv, Dv):
            raise ValueError(f"k and v must be (B, Snew, Hkv, D) = ({B}, Snew, {Hkv}, {D}) and (..., {Dv}); "
                             f"got {tuple(k.shape)} and {tuple(v.shape)}")
    if paged:
        block_table = _check_index("block_table", block_table, (B, -1), q, "(B, max_pages_per_seq)")
        page = k_cache.shape[1]
        if page % 16 or page == 0:
            raise ValueError(f"the paged cache's page size (k_cache.shape[1]) must be a multiple of 16; got {page}")
        if cache_batch_idx is not None:
            raise ValueError("cache_batch_idx cannot be combined with block_table (the table already maps "
                             "sequences to pages)")
        capacity = block_table.shape[1] * page
    else:
        capacity = k_cache.shape[1]
        if cache_batch_idx is None and k_cache.shape[0] < B:  # (more rows: sequence b uses row b, as flash-attn)
            raise ValueError(f"k_cache has {k_cache.shape[0]} rows but q's batch is {B}: the cache needs at least B "
                             "rows (sequence b uses row b), unless cache_batch_idx picks the rows")
    if capacity > MAX_SEQ:
        raise ValueError(f"the cache holds {capacity} positions per sequence; the kernels take at most {MAX_SEQ}")
    if rotary_cos is not None or rotary_sin is not None:
        if rotary_cos is None or rotary_sin is None:
            raise ValueError("pass rotary_cos and rotary_sin together (or neither)")
        for n, t in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
            if not isinstance(t, Tensor) or not t.is_floating_point():
                got = f"dtype {t.dtype}" if isinstance(t, Tensor) else type(t).__name__
                raise TypeError(f"{n} must be a float tensor (seqlen_ro, rotary_dim / 2); got {got}")
            if t.dim() != 2:
                raise ValueError(f"{n} must be a float tensor (seqlen_ro, rotary_dim / 2); got shape "
                                 f"{tuple(t.shape)}")
            if t.device != q.device:
                raise ValueError(f"{n} must be on q's device {q.device}; got {t.device}")
            _check_layout(n, t)
        if rotary_cos.shape != rotary_sin.shape or not 0 < 2 * rotary_cos.shape[1] <= D:
            raise ValueError(f"rotary_cos and rotary_sin must both be (seqlen_ro, rotary_dim / 2) with rotary_dim "
                             f"<= D = {D}; got {tuple(rotary_cos.shape)} and {tuple(rotary_sin.shape)}")
        if rotary_cos.stride(1) != 1 or rotary_sin.stride(1) != 1:  # read with unit column stride: a column slice
            # of a wider table (flash-attn's cos[:, :rotary_dim // 2]) is read as it is, with its row stride
            rotary_cos, rotary_sin = rotary_cos.contiguous(), rotary_sin.contiguous()
    if type(num_splits) is not int and (isinstance(num_splits, bool) or not isinstance(num_splits, numbers.Integral)) \
            or num_splits < 0:
        raise ValueError(f"num_splits must be an int >= 0 (0 = heuristic); got {num_splits!r}")
    if type(cache_seqlens) is Tensor:  # the common case first
        cache_seqlens = _check_index("cache_seqlens", cache_seqlens, (B,), q)
    elif isinstance(cache_seqlens, numbers.Integral) and not isinstance(cache_seqlens, bool):
        if not 0 <= cache_seqlens <= capacity - Snew:
            raise ValueError(f"cache_seqlens = {cache_seqlens}: with the {Snew} new tokens it must stay within the "
                             f"cache's {capacity} positions (and be >= 0)")
        cache_seqlens = torch.full((B,), int(cache_seqlens), dtype=torch.int32, device=q.device)
    elif cache_seqlens is None:  # every cache full, as flash-attn (which also requires it with k, v)
        if Snew:
            raise ValueError(f"cache_seqlens is None (each cache full: {capacity} positions) but {Snew} new k/v "
                             "tokens were given to append; pass cache_seqlens (B,) int32, each sequence's length "
                             "before the new tokens")
        cache_seqlens = torch.full((B,), capacity, dtype=torch.int32, device=q.device)
    else:
        cache_seqlens = _check_index("cache_seqlens", cache_seqlens, (B,), q)
    cache_batch_idx = _check_index("cache_batch_idx", cache_batch_idx, (B,), q)
    cache_leftpad = _check_index("cache_leftpad", cache_leftpad, (B,), q)
    causal = check_flag("causal", causal)
    if type(window_size) is tuple and window_size == (-1, -1):  # the default, without the generic checks
        window = (-1, -1)
    else:
        window = check_window("window_size", window_size)
    softcap = 0.0 if type(softcap) is float and softcap == 0.0 else check_softcap("softcap", softcap)
    alibi = check_alibi("alibi_slopes", alibi_slopes, B, Hq, q, trains=False)  # (grad: refused as inference-only)
    scale = resolve_scale("softmax_scale", softmax_scale, D)
    if torch.is_grad_enabled() and any(isinstance(t, Tensor) and t.requires_grad
                                       for t in (q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, alibi_slopes)):
        raise RuntimeError("flash_attn_with_kvcache is inference-only (no autograd): call it under torch.no_grad() "
                           "or torch.inference_mode(), or pass detached tensors")
    if Snew:
        _check_writable_caches(k_cache, v_cache, block_table is not None)
        if torch.compiler.is_compiling():  # addresses are not traceable: a compiled step checks identity only
            pair = ("k_cache", "v_cache") if k_cache is v_cache else None
        else:
            pair = append_overlap(q, k, v, k_cache, v_cache)
        if pair is not None:
            raise ValueError(_overlap_message(*pair))
    causal = bool(causal)
    return (q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
            block_table, Snew, capacity, causal, window, float(softcap), alibi, scale, causal or window != (-1, -1))


def _assert_message(leftpad: bool, batch_idx: bool, paged: bool, rotary: bool) -> str:
    """The device-side assert's message: the conditions the check kernel evaluated, short enough for CUDA's assert
    (_library.ASSERT_MESSAGE_BYTES; cache_batch_idx and block_table never come together). The host path (CPU
    tensors) names the entry and its bounds."""
    conds = ["0 <= cache_seqlens <= capacity - Snew"]
    if leftpad:
        conds.append("0 <= cache_leftpad <= cache_seqlens + Snew")
    if batch_idx:
        conds.append("0 <= cache_batch_idx < k_cache rows, no row twice")
    if paged:
        conds.append("0 <= block_table < num_pages")
    if rotary:
        conds.append("positions < rotary_cos rows")
    return f"flashtx.flash_attn_with_kvcache: index out of range; need {'; '.join(conds)} (run on CPU for the entry)"


# (cache_leftpad?, cache_batch_idx?, block_table?, rotary?) -> message: built once (a constant under torch.compile)
_ASSERT_MESSAGES = {flags: _assert_message(*flags) for flags in itertools.product((False, True), repeat=4)}


def _check_ints(q, k_cache, block_table, cos, Snew: int, capacity: int, q_moves: bool, win_left: int) -> tuple:
    """The check kernel's integers for a call (flashtx::kvcache_check's, in its order): Snew, capacity, the cache's
    rows (or pages), the page size (1: contiguous), the RoPE tables' rows (-1: none), the queries' extra rotated
    positions and the key span (-1: no window)."""
    return (Snew, capacity, k_cache.shape[0], k_cache.shape[1] if block_table is not None else 1,
            cos.shape[0] if cos is not None else -1, q.shape[1] - 1 if q_moves and cos is not None else 0,
            q.shape[1] + win_left if win_left >= 0 else -1)  # (keys before end - key span are never read)


def _check_entry(q, k_cache, seqlens, batch_idx, leftpad, block_table, cos, Snew: int, capacity: int,
                 q_moves: bool, win_left: int = -1):
    """The check kernel's memoised launch for these tensors (decode_check.decode_check_entry), which
    _check_ranges(..., entry) replays on the device's branch, or None where that branch plans each call (no
    Triton checks on this device, a launch the cache cannot replay). For flashtx._decode_lane (a non-empty
    batch)."""
    dev = seqlens.device
    if not _triton_checks(dev.type, dev.index):
        return None
    ints = _check_ints(q, k_cache, block_table, cos, Snew, capacity, q_moves, win_left)
    entry = _decode_op._TRITON.checks.decode_check_entry(
        torch.empty(1, dtype=torch.int32, device=dev), seqlens, leftpad, batch_idx, block_table,
        **dict(zip(("snew", "capacity", "rows", "page", "cos_rows", "q_extra", "key_span"), ints)))
    return entry if type(entry) is list else None


def _check_ranges(q, k_cache, seqlens, batch_idx, leftpad, block_table, cos, Snew: int, capacity: int,
                  q_moves: bool, win_left: int = -1, entry=None) -> None:
    """Every index the kernels will follow stays inside its tensor: on CPU read on the host (a ValueError
    naming the first bad entry); otherwise on the device without a sync, by the check kernel
    (flashtx::kvcache_check) and one torch._assert_async of its flag, launched before the append and
    attention kernels (an assert stops every later kernel of the stream). win_left: the window's left side
    (-1: none). The block_table entries checked are those of the pages the kernels touch: the appended
    positions and the keys some query may see (decode_check.py); a serving engine may free the others.
    entry: _check_entry's for these tensors (a decoding lane's), replayed on the device's branch instead of the
    op's call (the same kernel and arguments, without the op's planning: ~5 us of Python a step)."""
    readable = _values_readable(seqlens)
    dev = seqlens.device
    if not readable and _triton_checks(dev.type, dev.index):
        if entry is not None:
            flag = torch.empty(1, dtype=torch.int32, device=dev)  # (the kernel writes it whole)
            _lanes.fire(entry, (flag, seqlens, leftpad, batch_idx, block_table))
        else:
            flag = call(_decode_op.kvcache_check, seqlens, leftpad, batch_idx, block_table,
                        *_check_ints(q, k_cache, block_table, cos, Snew, capacity, q_moves, win_left))
        device_assert(flag, _ASSERT_MESSAGES[leftpad is not None, batch_idx is not None, block_table is not None,
                                             cos is not None])
        return
    key_span = _check_ints(q, k_cache, block_table, cos, Snew, capacity, q_moves, win_left)[6]
    lens = seqlens.long()
    end = lens + Snew
    _check_values((lens >= 0) & (end <= capacity), readable,
                  lambda ok: f"cache_seqlens[{_first_bad(ok)}] = {int(lens[_first_bad(ok)])}: with the {Snew} new "
                             f"tokens it must stay within the cache's {capacity} positions (and be >= 0)",
                  "cache_seqlens")
    if leftpad is not None:
        lp = leftpad.long()
        _check_values((lp >= 0) & (lp <= end), readable,
                      lambda ok: f"cache_leftpad[{_first_bad(ok)}] = {int(lp[_first_bad(ok)])} must be in [0, "
                                 f"{int(end[_first_bad(ok)])}] (cache_seqlens[{_first_bad(ok)}] + the {Snew} new "
                                 f"tokens)", "cache_leftpad")
    if batch_idx is not None:
        bi = batch_idx.long()
        _check_values((bi >= 0) & (bi < k_cache.shape[0]), readable,
                      lambda ok: f"cache_batch_idx[{_first_bad(ok)}] = {int(bi[_first_bad(ok)])} is out of range "
                                 f"for a cache of {k_cache.shape[0]} rows", "cache_batch_idx")
        if Snew and bi.numel() > 1:  # sorted neighbours differ: no row twice (no sync, unlike unique())
            srt = bi.sort().values
            _check_values(srt[1:] != srt[:-1], readable, lambda ok: "cache_batch_idx must not repeat a row when k, "
                          "v are appended (two sequences would write the same cache row)", "cache_batch_idx")
    if block_table is not None:
        page = k_cache.shape[1]
        first = leftpad.long() if leftpad is not None else torch.zeros_like(lens)  # the first key a query may see
        if key_span >= 0:
            first = torch.maximum(first, end - key_span)
        if Snew:
            first = torch.minimum(first, lens)  # the first appended position
        cols = torch.arange(block_table.shape[1], device=q.device)[None, :]
        used = (cols * page < end[:, None]) & ((cols + 1) * page > first[:, None])  # (B, pages) the pages touched
        bt = block_table.long()
        ok = ~used | ((bt >= 0) & (bt < k_cache.shape[0]))
        _check_values(ok, readable, lambda ok: (
            f"block_table[{_first_bad(ok.all(1))}, {int((~ok[_first_bad(ok.all(1))]).nonzero()[0])}] = "
            f"{int(bt[_first_bad(ok.all(1))][(~ok[_first_bad(ok.all(1))]).nonzero()[0]])} is not a page index in "
            f"[0, {k_cache.shape[0]}) (num_pages = k_cache.shape[0])"), "block_table")
        if Snew and readable:  # host-only (CPU tensors): the GPU's caller must ensure it
            pos = lens[:, None] + torch.arange(Snew, device=lens.device)[None, :]  # (B, Snew) appended positions
            slot = bt.gather(1, pos // page) * page + pos % page  # their physical rows in the page pool
            if slot.unique().numel() != slot.numel():
                raise ValueError("block_table: two new tokens would be appended to the same page row (a page that "
                                 "two sequences share, or that one sequence lists twice, must not receive new "
                                 "tokens); give each sequence its own pages for its new tokens")
    if cos is not None:
        top = torch.maximum(end - 1, lens + (q.shape[1] - 1 if q_moves else 0))  # the last position rotated
        _check_values(top < cos.shape[0], readable,
                      lambda ok: f"rotary_cos/rotary_sin have {cos.shape[0]} positions but sequence "
                                 f"{_first_bad(ok)} needs position {int(top[_first_bad(ok)])}", "rotary_cos")
