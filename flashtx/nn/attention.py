"""MultiheadAttention over flashtx's attention ops, with GQA/MQA, RoPE, padding masks and a KV cache.

Layout: activations are batch-first (B, S, E). Heads are split as views of one fused projection
(no copies), attention runs on (B, H, S, D) views, and no layer holds an (S, S) tensor: padding is
passed as (B, S) key masks and cache lengths as (B,) tensors, never as materialised masks.

Training with RoPE rotates q and k in place in the projection's output (flashtx.nn._qkv_rotary, as flash-attn's
MHA), so attention saves views of the one projection, not rotated copies beside it.

KV caches (incremental decoding, flashtx.nn.kv_cache): `KVCache` preallocates (B, max_len, Hkv, D)
buffers, `PagedKVCache` a page pool with a block table. Each call writes the new tokens'
keys/values in place at positions [length, length + S) and attends over the first length + S
positions with **bottom-right** causal alignment: new query i (absolute position length + i)
sees keys j <= length + i. Steps of up to DECODE_MAX_S tokens (decoding, speculative decoding)
go through flashtx.flash_attn_with_kvcache (split-KV kernels, RoPE and the append fused); longer
chunks (prefill) and calls that need gradients through flashtx.flash_attn_func with kv_lens; a
PagedKVCache always through flash_attn_with_kvcache (inference only: run it under torch.no_grad()).
Calls with gradients write a KVCache out of place, as transformers' DynamicCache: the cache then
holds their graph, and later calls build on it (one backward over all of them; for a backward
per call, reset() the cache or fill it under no_grad). A call without gradients writes the cache in
place, so after one, a backward through an earlier call's graph raises autograd's "modified by an
inplace operation": run that backward first.

Padding with a cache: each call's key_mask describes its new tokens. Left padding (a sequence's
padding before its first real token) is kept as flash-attn's cache_leftpad (the cache's
``leftpad``), so padded decoding runs on flash_attn_with_kvcache too, equal to the uncached forward
over the same padded tokens. A KVCache whose mask has holes (padding after a real token) keeps
flash_attn_func over its stored mask, in eager mode; a PagedKVCache instead drops trailing
padding (each sequence advances by its own count: ragged prompts, continuous batching) and
refuses holes. See flashtx.nn.kv_cache. A cross-attention cache keeps each memory's real range
[leftpad, end) (left or right padding) and attends through flash_attn_with_kvcache without an
append (steps of up to DECODE_MAX_S queries; a memory mask with holes keeps flashtx.attention).

Lengths are tensors, so a decode step has static shapes: torch.compile traces it with no graph
break and does not recompile as the cache grows (a key_mask given to a traced step is checked by a
device-side assert instead of being read).

RoPE positions in a cache are the cache indices. With dynamic-NTK scaling the frequencies depend
on the length in use: a cached call of S tokens at length L rotates its q and k with the
frequencies of L + S (what the uncached forward computes over those L + S tokens), computed from
the length tensor in the graph (no host read). Keys already in the cache keep the frequencies
they were written with, as in transformers: beyond the original context the cached result
therefore differs from a full forward over the whole sequence (which re-rotates every key).
"""
from __future__ import annotations

import numbers

import torch
from torch import Tensor, nn

from ..decode import kvcache_step
from ..functional import attention, flash_attn_func
from .. import _dispatch
from .._validate import check_flag
from ..rotary import apply_rotary_qk
from ..triton_kernels.limits import MAX_SEQ, exporting
from ._qkv_rotary import backward_hooked, eligible, rotate_qk_
from ._cache_state import _check_mask, _check_pos_int, _host_readable, _static
from .kv_cache import KVCache, PagedKVCache
from .rotary import RotaryEmbedding
from .swiglu import forward_hooked

def _buffers(cache) -> tuple[Tensor, Tensor]:
    """The key and value buffers a cache's kernels read: a KVCache's (B, max_len, Hkv, D), a PagedKVCache's
    (pages, page_size, Hkv, D)."""
    return (cache.k, cache.v) if isinstance(cache, PagedKVCache) else (cache._k, cache._v)


def _check_cache_dtype(cache, q: Tensor) -> None:
    dtype = _buffers(cache)[0].dtype
    if dtype != q.dtype:
        raise ValueError(f"the KV cache holds {dtype} but this step's queries/keys are {q.dtype} (under "
                         f"torch.autocast the projections give the autocast dtype): create the cache with "
                         f"new_cache(..., dtype={q.dtype})")


def _autocasting(device_type: str) -> bool:
    """Whether torch.autocast is on for `device_type` (False for a type autocast does not know: meta)."""
    try:
        return torch.is_autocast_enabled(device_type)
    except RuntimeError:
        return False


def _cache_heads(cache) -> tuple[int, int, int]:
    """(Hkv, D, Dv) of a cache's buffers (both (..., Hkv, D), _buffers)."""
    k, v = _buffers(cache)
    return k.shape[2], k.shape[3], v.shape[3]


DECODE_MAX_S = 16  # cached calls of up to this many tokens use flash_attn_with_kvcache (see the module doc)


def dynamic_rope_tables(rotary: RotaryEmbedding, start: Tensor, S: int) -> tuple[Tensor, Tensor]:
    """(cos, sin), each (B, S, dim/2) fp32: positions start[b] + i rotated with the dynamic-NTK
    frequencies of length start[b] + S, exactly as RotaryEmbedding.cos_sin(start[b] + S) computes
    them (fl32 inverse frequencies, float64 angles) but from the tensor `start`, with no host read."""
    sc, dim = rotary.scaling, rotary.dim
    old, f = sc["original_max_position_embeddings"], sc["factor"]
    L = (start.to(torch.float64) + S)  # (B,)
    base = torch.where(L > old, rotary.base * (f * L / old - (f - 1)) ** (dim / (dim - 2)),
                       torch.full_like(L, rotary.base))
    expo = -torch.arange(0, dim, 2, dtype=torch.float64, device=start.device) / dim  # (dim/2,)
    inv = (base[:, None] ** expo[None, :]).float().double()  # (B, dim/2): fp32 frequencies, as the tables
    pos = start.to(torch.float64)[:, None] + torch.arange(S, dtype=torch.float64, device=start.device)  # (B, S)
    ang = pos[:, :, None] * inv[:, None, :]  # (B, S, dim/2)
    return ang.cos().float(), ang.sin().float()


class MultiheadAttention(nn.Module):
    """Multi-head attention (self or cross) over flashtx.attention, batch-first.

    Args:
        embed_dim: E, the width of the queries' input x and of the output.
        num_heads: Hq, query heads.
        num_kv_heads: Hkv key/value heads (GQA; 1 = MQA); must divide num_heads. Default num_heads.
        head_dim: D; default embed_dim // num_heads (which must then divide exactly).
        bias: biases on the projections.
        dropout: attention-probability dropout, applied only in training mode
            (``dropout_p=self.dropout if self.training else 0.0`` to flashtx.attention).
        rotary: a ``flashtx.nn.RotaryEmbedding`` applied to q and k (self-attention only;
            rotary.dim <= head_dim), or None.
        causal: causal self-attention (top-left, query i sees keys j <= i; bottom-right with a cache).
        cross: cross-attention: q from x, k/v from ``memory`` (B, Sm, kdim) through a separate
            (kdim -> 2 * Hkv * D) projection. Otherwise one fused (E -> (Hq + 2 Hkv) * D) projection.
        kdim: the memory's width for cross-attention; default embed_dim.
        backend: passed to flashtx's ops (None = automatic, "triton", "reference").
        device, dtype: for the parameters.

    Parameters: ``qkv`` (self) or ``q_proj`` + ``kv_proj`` (cross), and ``out_proj`` (Hq * D -> E), initialised
    as nn.Linear's (torch.nn.MultiheadAttention's in_proj is xavier-uniform with zero biases instead).
    The fused rows are ordered [q heads | k heads | v heads] (and [k heads | v heads]).

    Example:
        >>> attn = flashtx.nn.MultiheadAttention(512, 8, num_kv_heads=2, causal=True,
        ...                                      rotary=flashtx.nn.RotaryEmbedding(64))
        >>> y = attn(x, key_mask=mask)                 # x: (B, S, 512), mask: (B, S) bool
        >>> cache = attn.new_cache(batch_size=B, max_len=256)
        >>> y = attn(prompt, cache=cache); y = attn(next_token, cache=cache)   # incremental
    """

    def __init__(self, embed_dim: int, num_heads: int, num_kv_heads: int | None = None, *, head_dim: int | None = None,
                 bias: bool = True, dropout: float = 0.0, rotary: RotaryEmbedding | None = None, causal: bool = False,
                 cross: bool = False, kdim: int | None = None, backend: str | None = None, device=None, dtype=None):
        super().__init__()
        embed_dim, num_heads = _check_pos_int("embed_dim", embed_dim), _check_pos_int("num_heads", num_heads)
        num_kv_heads = num_heads if num_kv_heads is None else _check_pos_int("num_kv_heads", num_kv_heads)
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        if head_dim is None:
            if embed_dim % num_heads:
                raise ValueError(f"embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads}), "
                                 "or pass head_dim")
            head_dim = embed_dim // num_heads
        head_dim = _check_pos_int("head_dim", head_dim)
        causal, cross = check_flag("causal", causal), check_flag("cross", cross)  # ("False" is truthy)
        if isinstance(dropout, bool) or not isinstance(dropout, numbers.Real) or not 0.0 <= dropout <= 1.0:
            raise ValueError(f"dropout must be a number in [0, 1] (as torch.nn.MultiheadAttention's); got {dropout!r}")
        if rotary is not None:
            if not isinstance(rotary, RotaryEmbedding):
                raise TypeError(f"rotary must be None or a flashtx.nn.RotaryEmbedding; got {type(rotary).__name__}")
            if cross:
                raise ValueError("rotary is for self-attention: in cross-attention the queries' and the memory's "
                                 "positions are not comparable")
            if rotary.dim > head_dim:
                raise ValueError(f"rotary.dim ({rotary.dim}) must be <= head_dim ({head_dim})")
        if cross and causal:
            raise ValueError("cross=True with causal=True: cross-attention sees the whole memory (use key masks)")
        if backend is not None and backend not in _dispatch.IMPLS["attention"]:  # (refused here, not at a first call)
            raise ValueError(f"backend must be None or one of {sorted(_dispatch.IMPLS['attention'])} (the "
                             f"attention backends: the layer's ops take the same name); got {backend!r}")
        self.embed_dim, self.num_heads, self.num_kv_heads, self.head_dim = embed_dim, num_heads, num_kv_heads, head_dim
        self.dropout, self.causal, self.cross, self.backend = float(dropout), bool(causal), bool(cross), backend
        self.rotary = rotary
        kw = dict(bias=bias, device=device, dtype=dtype)
        if self.cross:
            self.kdim = embed_dim if kdim is None else _check_pos_int("kdim", kdim)
            self.q_proj = nn.Linear(embed_dim, num_heads * head_dim, **kw)
            self.kv_proj = nn.Linear(self.kdim, 2 * num_kv_heads * head_dim, **kw)
        else:
            if kdim is not None:
                raise ValueError("kdim is only meaningful with cross=True")
            self.kdim = embed_dim
            self.qkv = nn.Linear(embed_dim, (num_heads + 2 * num_kv_heads) * head_dim, **kw)
        self.out_proj = nn.Linear(num_heads * head_dim, embed_dim, **kw)

    def extra_repr(self) -> str:
        return (f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}, causal={self.causal}, cross={self.cross}, dropout={self.dropout}")

    def new_cache(self, batch_size: int, max_len: int, *, device=None, dtype=None, paged: bool = False,
                  page_size: int = 16, num_pages: int | None = None) -> KVCache | PagedKVCache:
        """An empty cache for this layer on the parameters' device and dtype unless given: a KVCache of
        (batch_size, max_len, Hkv, D) buffers, or with paged=True a PagedKVCache of num_pages pages
        (default: enough for every sequence to reach max_len) of page_size tokens (a multiple of 16),
        at most max_len tokens a sequence (rounded up to whole pages: its ``max_len`` may be larger). For
        cross-attention max_len is the memory's length (or more)."""
        p = self.out_proj.weight
        kw = dict(dtype=p.dtype if dtype is None else dtype, device=p.device if device is None else device)
        paged = check_flag("paged", paged)  # ("False" is truthy)
        if num_pages is not None:
            _check_pos_int("num_pages", num_pages)
        if paged:
            if self.cross:
                raise ValueError("paged caches are for self-attention; cross-attention's memory uses a KVCache")
            per_seq = -(-_check_pos_int("max_len", max_len) // _check_pos_int("page_size", page_size))
            cache = PagedKVCache(batch_size, self.num_kv_heads, self.head_dim, page_size=page_size,
                                 num_pages=batch_size * per_seq if num_pages is None else num_pages,
                                 max_pages_per_seq=per_seq, **kw)
        else:
            cache = KVCache(batch_size, self.num_kv_heads, max_len, self.head_dim, **kw)
        sc = None if self.rotary is None else self.rotary.scaling
        if self.rotary is not None and not self.cross and (sc is None or sc["type"] != "dynamic"):
            with torch.inference_mode(False):  # (ordinary tensors: a traced step rebuilds inference ones)
                self.rotary.cos_sin(cache.max_len, cache.k.device)  # tables that cover the cache now: a compiled
                # step that grew them would change their length, and be traced again
        return cache

    def check_memory(self, memory, memory_mask, B: int, cache: KVCache) -> None:
        """Raise for a memory (B, Sm, kdim) and memory_mask (B, Sm) bool that an empty cross-attention `cache`
        cannot take (before anything is stored: TransformerBlock checks them before its self-attention appends)."""
        if memory is None:
            raise ValueError("cross-attention needs memory (B, Sm, kdim): the cross-attention cache is empty, pass "
                             "memory on the first call")
        if not isinstance(memory, Tensor) or memory.dim() != 3 or memory.shape[0] != B or memory.shape[2] != self.kdim:
            got = tuple(memory.shape) if isinstance(memory, Tensor) else type(memory).__name__
            raise ValueError(f"memory must be (B, Sm, kdim) = ({B}, Sm, {self.kdim}); got {got}")
        w = self.kv_proj.weight
        if memory.device != w.device:
            raise ValueError(f"memory must be on the layer's device {w.device}; got {memory.device}")
        if not memory.is_floating_point() or (memory.dtype != w.dtype and not _autocasting(memory.device.type)):
            raise ValueError(f"memory must be {w.dtype}, the layer's dtype (any float dtype under torch.autocast); "
                             f"got {memory.dtype}")
        Sm = memory.shape[1]
        if Sm > cache.max_len:
            raise ValueError(f"memory has {Sm} positions but the cross-attention cache holds {cache.max_len}: create "
                             f"it with new_cache(..., max_len>={Sm}) (a TransformerBlock's: memory_len>={Sm})")
        _check_mask("memory_mask", memory_mask, B, Sm, memory.device)

    def check_cache(self, cache, B: int) -> None:
        """Raise for a cache this layer cannot use for a batch of B: not a KVCache or PagedKVCache (for
        cross-attention, a KVCache) of B rows and this layer's KV heads and head dim."""
        Hkv, D = self.num_kv_heads, self.head_dim
        if not isinstance(cache, (KVCache, PagedKVCache)) or cache.batch_size != B:
            raise ValueError(f"cache must be a KVCache or PagedKVCache for batch size {B} (from new_cache); "
                             f"got {cache!r}")
        if isinstance(cache, PagedKVCache) and self.cross:
            raise ValueError("cross-attention caches its memory in a KVCache, not a PagedKVCache")
        got = _cache_heads(cache)
        if got != (Hkv, D, D):
            raise ValueError(f"cache holds {got[0]} KV heads of head_dim {got[1]} (values {got[2]}), but this "
                             f"layer has num_kv_heads={Hkv}, head_dim={D}: create the cache with this layer's "
                             f"new_cache; got {cache!r}")

    def _kv(self, memory: Tensor, B: int) -> tuple[Tensor, Tensor]:
        """memory (B, Sm, kdim) -> k, v (B, Sm, Hkv, D) views of one projection."""
        if memory.dim() != 3 or memory.shape[0] != B or memory.shape[2] != self.kdim:
            raise ValueError(f"memory must be (B, Sm, kdim) = ({B}, Sm, {self.kdim}); got {tuple(memory.shape)}")
        kv = self.kv_proj(memory).unflatten(-1, (2 * self.num_kv_heads, self.head_dim))  # (B, Sm, 2 Hkv, D)
        return kv.split(self.num_kv_heads, dim=2)

    def forward(self, x: Tensor, memory: Tensor | None = None, *, key_mask: Tensor | None = None,
                attn_mask: Tensor | None = None, cache: KVCache | None = None) -> Tensor:
        """Attend and project back.

        Args:
            x: (B, S, E) queries' input (and keys'/values' for self-attention).
            memory: (B, Sm, kdim), cross-attention only. With a cache it is projected on the first
                call (when ``cache.filled`` is False) and reused afterwards; it may be None then
                (a later memory or key_mask is not read: reset() the cache for a new memory).
            key_mask: (B, Sk) bool, True = real key: x's padding (self) or memory's (cross).
                With a cache, the mask of this call's new tokens (see the module docstring: left
                padding, or for a PagedKVCache also trailing padding, which is not kept).
            attn_mask: SDPA semantics (bool True = attend, the opposite of nn.MultiheadAttention's
                bool masks: pass ~mask; or float added to the scores), broadcastable to (B, Hq, S,
                Sk); passed to flashtx.attention. Not with a cache. A query whose keys are all
                masked attends to nothing: its attention output is 0 (flash-attn's rule; SDPA's since torch 2.5).
            cache: a KVCache or PagedKVCache from ``new_cache`` for incremental decoding
                (self-attention must be causal; see the module docstring for the alignment).

        Returns:
            (B, S, E) in x's dtype.
        """
        if x.dim() != 3 or x.shape[-1] != self.embed_dim:
            raise ValueError(f"x must be (B, S, embed_dim) = (B, S, {self.embed_dim}); got shape {tuple(x.shape)}")
        B, S, _ = x.shape
        Hq, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        p = self.dropout if self.training else 0.0
        if cache is not None:
            if exporting():  # (constant under strict export's trace: no graph break)
                raise RuntimeError(
                    "torch.export cannot export a step with a KVCache or PagedKVCache: a cache keeps host-side "
                    "state (lengths, padding, pages) and export would bake it into the program as constants (and "
                    "non-strict export would write this trace's keys into the live cache). Export a step that calls "
                    "flashtx.flash_attn_with_kvcache on cache tensors held as module buffers and cache_seqlens "
                    "passed as an input; torch.compile takes a cache as it is")
            if attn_mask is not None:
                raise ValueError("attn_mask cannot be combined with a KV cache (pass key_mask for padding)")
            if p > 0:
                raise ValueError(f"a KV cache is for inference, but the layer is in training mode with dropout={p}; "
                                 "call .eval() first")
            self.check_cache(cache, B)
        if self.cross:
            out = self._cross(x, memory, key_mask, attn_mask, cache, p)  # (B, Hq, S, D)
        else:
            if memory is not None:
                raise ValueError("memory is for cross-attention; this layer was built with cross=False")
            proj, rotated = self.qkv(x), False  # (B, S, (Hq + 2 Hkv) D)
            if cache is None and type(self.rotary) is RotaryEmbedding and eligible(proj) and S <= MAX_SEQ \
                    and not forward_hooked(self.qkv, self.rotary) and not backward_hooked(self.qkv):
                # training: rotated in place (_qkv_rotary)
                cos, sin = self.rotary.cos_sin(S, x.device)  # (S, dim / 2): RotaryEmbedding's for positions 0..S-1
                proj = rotate_qk_(proj, (B, S, Hq + 2 * Hkv, D), (Hq, Hkv), cos, sin, self.rotary.interleaved,
                                  self.backend)
                rotated = True
            qkv = proj.unflatten(-1, (Hq + 2 * Hkv, D))  # (B, S, Hq + 2 Hkv, D)
            q, k, v = qkv.split([Hq, Hkv, Hkv], dim=2)  # (B, S, H, D) views
            if cache is None:
                out = self._self(q, k, v, key_mask, attn_mask, p, rotated)
            else:
                out = self._self_cached(q, k, v, key_mask, cache)
        return self.out_proj(out.transpose(1, 2).reshape(B, S, Hq * D))

    def _self(self, q, k, v, key_mask, attn_mask, p, rotated: bool = False) -> Tensor:
        """q, k, v: (B, S, H, D) (q and k already rotated when `rotated`) -> (B, Hq, S, D)."""
        if self.rotary is not None and not rotated:  # in place (no grad) unless a forward hook may hold the qkv
            # output q, k view
            q, k = self.rotary(q, k, inplace=False if forward_hooked(self.qkv) else None, backend=self.backend)
        return attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=attn_mask, dropout_p=p,
                         is_causal=self.causal, enable_gqa=True, key_mask=key_mask, backend=self.backend)

    def _self_cached(self, q, k, v, key_mask, cache) -> Tensor:
        """Append k, v at the cache's length, attend bottom-right over the filled part -> (B, Hq, S, D). All or
        nothing in eager mode: a call that raises leaves the cache as it was (its lengths, leftpad, pages and
        mask), so a retried call sees no trace of it. A traced or captured step cannot be undone this way."""
        if not _host_readable():
            return self._cached_step(q, k, v, key_mask, cache, False)
        mark = cache._mark(key_mask is not None)
        try:
            return self._cached_step(q, k, v, key_mask, cache, mark[-1] is not None)  # (mark[-1]: sealed, intact)
        except BaseException:
            cache._undo(mark, q.shape[1])
            raise

    def _cached_step(self, q, k, v, key_mask, cache, known: bool) -> Tensor:
        """_self_cached's work: the cache's bookkeeping, then the attention; the lengths advance last. known: the
        cache's index state is sealed (cache.ranges_known(), read before this call's bookkeeping writes it): the
        decode kernels then run without the per-call index check, and the state is resealed after the call."""
        if not self.causal:
            raise ValueError("a KV cache needs causal=True self-attention: earlier tokens cannot see later ones")
        _check_cache_dtype(cache, q)
        B, S = q.shape[:2]
        paged = isinstance(cache, PagedKVCache)
        start = cache.seqlens if paged else cache.length.expand(B)  # (B,) the new tokens' first position
        rot, interleaved = None, False
        if self.rotary is not None:
            interleaved = self.rotary.interleaved
            sc = self.rotary.scaling
            if sc is not None and sc["type"] == "dynamic":  # frequencies of the length in use (module docstring)
                cos, sin = dynamic_rope_tables(self.rotary, start, S)  # (B, S, dim/2)
                q, k = apply_rotary_qk(q, k, cos, sin, interleaved=interleaved, backend=self.backend)
            else:
                rot = self.rotary.cos_sin(cache.max_len, q.device)  # (max_len, dim/2) each
        if paged:
            keep = cache._take(key_mask, S)  # allocates pages, moves leftpad; (B,) tokens kept or None
        else:
            _check_mask("key_mask", key_mask, B, S, q.device)  # before _claim counts the tokens
            cache._claim(S)
            cache._store_mask(key_mask, S)  # leftpad, or holes (then flash_attn_func below)
        grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad)
        if paged or (S <= DECODE_MAX_S and not cache.holes and not grad):
            kc, vc = _buffers(cache)  # the buffers themselves: mutated in place
            # (B, S, Hq, D); with ranges_known no index check: the lengths, leftpad and pages are flashtx's own
            out = kvcache_step(q, kc, vc, k, v, rot[0] if rot else None, rot[1] if rot else None,
                               start.to(torch.int32), None, cache.leftpad, cache.block_table if paged else None, None,
                               True, (-1, -1), 0.0, interleaved, None, 0, False, self.backend, known)
            if paged:
                cache.seqlens.add_(S if keep is None else keep)
            else:
                cache.length.add_(S)
            cache._seal(known)
            return out.transpose(1, 2)
        if rot is not None:
            q, k = apply_rotary_qk(q, k, *rot, interleaved=interleaved, seqlen_offsets=start.contiguous(),
                                   backend=self.backend)
        idx = cache.length + torch.arange(S, device=q.device)  # (S,) positions (KVCache.append, checked above)
        if grad:  # out of place, as transformers' DynamicCache: later calls build on this call's graph (one
            # backward over all of them; a backward per call needs reset() or a no_grad prefix)
            cache._k = _static(cache._k.index_copy(1, idx, k))  # (B, max_len, Hkv, D)
            cache._v = _static(cache._v.index_copy(1, idx, v))
        else:
            cache._k.index_copy_(1, idx, k)
            cache._v.index_copy_(1, idx, v)
        kv_lens = (cache.length + S).expand(B).contiguous()  # (B,) filled positions, including the new ones
        q_lens = torch.full((B,), S, dtype=torch.int64, device=q.device)
        out = flash_attn_func(q, cache._k, cache._v, causal=True,
                              key_mask=cache.key_mask if cache.padded else None, kv_lens=kv_lens, q_lens=q_lens,
                              backend=self.backend)  # (B, S, Hq, D), bottom-right per sequence
        cache.length.add_(S)
        cache._seal(known)
        return out.transpose(1, 2)

    def _cross(self, x, memory, key_mask, attn_mask, cache, p) -> Tensor:
        """Queries from x, keys/values from memory (or the cache) -> (B, Hq, S, D)."""
        B, S, _ = x.shape
        q = self.q_proj(x).unflatten(-1, (self.num_heads, self.head_dim)).transpose(1, 2)  # (B, Hq, S, D)
        if cache is not None:
            _check_cache_dtype(cache, q)
        if cache is None:
            if memory is None:
                raise ValueError("cross-attention needs memory (B, Sm, kdim)")
            k, v = self._kv(memory, B)
            return attention(q, k.transpose(1, 2), v.transpose(1, 2), attn_mask=attn_mask, dropout_p=p,
                             enable_gqa=True, key_mask=key_mask, backend=self.backend)
        if not cache.filled:
            self.check_memory(memory, key_mask, B, cache)
            k, v = self._kv(memory, B)
            cache.reset()
            cache.append(k.transpose(1, 2), v.transpose(1, 2))
            intact = cache._intact()
            cache._store_memory_mask(key_mask, k.shape[1])  # per-row [leftpad, end) of the real memory, or holes
            cache._seal(intact)
            cache.filled = True
        if S <= DECODE_MAX_S and not cache.holes and not (torch.is_grad_enabled() and q.requires_grad):
            ends = cache._ends if cache._ends is not None else cache.length.expand(B).to(torch.int32)
            out = kvcache_step(q.transpose(1, 2), cache._k, cache._v, None, None, None, None, ends, None,
                               cache.leftpad, None, None, False, (-1, -1), 0.0, True, None, 0, False, self.backend,
                               cache.ranges_known())  # (B, S, Hq, D), no append
            return out.transpose(1, 2)
        kv_lens = cache.length.expand(B).contiguous()  # (B,) the memory's length
        return attention(q, cache.k, cache.v, enable_gqa=True, key_mask=cache.key_mask if cache.padded else None,
                         kv_lens=kv_lens, backend=self.backend)
