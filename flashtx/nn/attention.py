"""MultiheadAttention over flashtx's attention ops, with GQA/MQA, RoPE, padding masks and a KV cache.

Layout: activations are batch-first (B, S, E). Heads are split as views of one fused projection
(no copies), attention runs on (B, H, S, D) views, and no layer holds an (S, S) tensor: padding is
passed as (B, S) key masks and cache lengths as (B,) tensors, never as materialised masks.

KV cache (incremental decoding): `KVCache` preallocates (B, Hkv, max_len, D) buffers; each call
writes the new tokens' keys/values in place at positions [length, length + S) and attends over
the first length + S positions with **bottom-right** causal alignment (flashtx.flash_attn_func
with kv_lens/q_lens): new query i (absolute position length + i) sees keys j <= length + i.
The length is a 0-dim tensor, so a decode step has static shapes: torch.compile traces it with
no graph break and does not recompile as the cache grows.
"""
from __future__ import annotations

import numbers

import torch
from torch import Tensor, nn

from ..functional import attention, flash_attn_func
from ..rotary import apply_rotary_qk
from .rotary import RotaryEmbedding


def _check_pos_int(name: str, v, minimum: int = 1) -> int:
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}; got {v!r}")
    return int(v)


def _check_mask(name: str, m, batch: int, seqlen: int, device) -> Tensor | None:
    """None, or a (batch, seqlen) bool tensor on `device` (True = real token)."""
    if m is None:
        return None
    if not isinstance(m, Tensor) or m.dtype != torch.bool:
        got = f"dtype {m.dtype}" if isinstance(m, Tensor) else type(m).__name__
        raise TypeError(f"{name} must be a bool tensor of shape ({batch}, {seqlen}) with True = real token; got {got}")
    if tuple(m.shape) != (batch, seqlen):
        raise ValueError(f"{name} must have shape (B, S) = ({batch}, {seqlen}) (True = real token); "
                         f"got shape {tuple(m.shape)}")
    if m.device != device:
        raise ValueError(f"{name} must be on the activations' device {device}; got {m.device}")
    return m


class KVCache:
    """Preallocated key/value buffers of one attention layer, filled in place while decoding.

    Attributes:
        k: (B, Hkv, max_len, D) and v: (B, Hkv, max_len, Dv) buffers, in the layer's dtype.
        key_mask: (B, max_len) bool, True = real token (padding given to the layer is stored False).
        length: 0-dim int64 tensor on the buffers' device: the number of positions filled.

    Create one per layer with ``MultiheadAttention.new_cache`` (or ``TransformerBlock.new_cache``);
    ``reset()`` empties it for a new batch. Positions are shared by the batch: with left padding,
    every sequence's first real token sits at its own position, which RoPE does not notice (it
    only sees relative positions) and the stored key mask hides the padding.
    """

    def __init__(self, batch_size: int, num_kv_heads: int, max_len: int, head_dim: int,
                 v_head_dim: int | None = None, *, dtype=torch.float32, device=None):
        batch_size = _check_pos_int("batch_size", batch_size)
        max_len = _check_pos_int("max_len", max_len)
        num_kv_heads, head_dim = _check_pos_int("num_kv_heads", num_kv_heads), _check_pos_int("head_dim", head_dim)
        v_head_dim = head_dim if v_head_dim is None else _check_pos_int("v_head_dim", v_head_dim)
        self.k = torch.zeros(batch_size, num_kv_heads, max_len, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros(batch_size, num_kv_heads, max_len, v_head_dim, dtype=dtype, device=device)
        self.key_mask = torch.ones(batch_size, max_len, dtype=torch.bool, device=device)
        self.length = torch.zeros((), dtype=torch.int64, device=device)
        self.padded = False  # whether key_mask holds any False (then attention reads it)
        self.filled = False  # cross-attention: whether the memory's keys/values are stored
        self._host_length: int | None = 0  # mirror of `length` for bounds checks without a sync

    @property
    def batch_size(self) -> int:
        return self.k.shape[0]

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    def __repr__(self) -> str:
        return (f"KVCache(batch_size={self.batch_size}, num_kv_heads={self.k.shape[1]}, max_len={self.max_len}, "
                f"head_dim={self.k.shape[3]}, dtype={self.k.dtype}, device={self.k.device})")

    def reset(self) -> "KVCache":
        """Empty the cache (keeps the buffers)."""
        self.length.zero_()
        self.key_mask.fill_(True)
        self.padded = self.filled = False
        self._host_length = 0
        return self

    def append(self, k: Tensor, v: Tensor, key_mask: Tensor | None = None) -> None:
        """Write k (B, Hkv, S, D), v (B, Hkv, S, Dv) and key_mask (B, S) at [length, length + S)."""
        B, S = self.batch_size, k.shape[2]
        for name, t, buf in (("k", k, self.k), ("v", v, self.v)):
            want = (buf.shape[0], buf.shape[1], S, buf.shape[3])
            if tuple(t.shape) != want or t.dtype != buf.dtype or t.device != buf.device:
                raise ValueError(f"KVCache.append: {name} must be {want} (B, Hkv, S, D), {buf.dtype} on {buf.device}; "
                                 f"got {tuple(t.shape)}, {t.dtype} on {t.device}")
        key_mask = _check_mask("key_mask", key_mask, B, S, self.k.device)
        if torch.compiler.is_compiling():
            self._host_length = None  # the traced graph advances `length` on the device; no mirror
        elif self._host_length is not None:
            if self._host_length + S > self.max_len:
                raise ValueError(f"KVCache is full: it holds {self._host_length} of max_len={self.max_len} positions "
                                 f"and {S} more were given; create it with a larger max_len")
            self._host_length += S
        idx = self.length + torch.arange(S, device=self.k.device)  # (S,) positions
        self.k.index_copy_(2, idx, k)
        self.v.index_copy_(2, idx, v)
        if key_mask is not None:
            self.key_mask.index_copy_(1, idx, key_mask)
            self.padded = True
        self.length.add_(S)


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

    Parameters: ``qkv`` (self) or ``q_proj`` + ``kv_proj`` (cross), and ``out_proj`` (Hq * D -> E).
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
        if isinstance(dropout, bool) or not isinstance(dropout, numbers.Real) or not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be a number in [0, 1); got {dropout!r}")
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

    def new_cache(self, batch_size: int, max_len: int, *, device=None, dtype=None) -> KVCache:
        """An empty KVCache for this layer: (batch_size, Hkv, max_len, D) buffers on the parameters'
        device and dtype unless given. For cross-attention max_len is the memory's length (or more)."""
        p = self.out_proj.weight
        return KVCache(batch_size, self.num_kv_heads, max_len, self.head_dim, dtype=dtype or p.dtype,
                       device=device or p.device)

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
                call (when ``cache.filled`` is False) and reused afterwards; it may be None then.
            key_mask: (B, Sk) bool, True = real key: x's padding (self) or memory's (cross).
                With a cache, the mask of this call's new tokens (it is stored with them).
            attn_mask: SDPA semantics (bool True = attend, or float added to the scores),
                broadcastable to (B, Hq, S, Sk); passed to flashtx.attention. Not with a cache.
            cache: a KVCache from ``new_cache`` for incremental decoding (self-attention must be
                causal; see the module docstring for the alignment).

        Returns:
            (B, S, E) in x's dtype.
        """
        if x.dim() != 3 or x.shape[-1] != self.embed_dim:
            raise ValueError(f"x must be (B, S, embed_dim) = (B, S, {self.embed_dim}); got shape {tuple(x.shape)}")
        B, S, _ = x.shape
        Hq, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        p = self.dropout if self.training else 0.0
        if cache is not None:
            if attn_mask is not None:
                raise ValueError("attn_mask cannot be combined with a KV cache (pass key_mask for padding)")
            if p > 0:
                raise ValueError(f"a KV cache is for inference, but the layer is in training mode with dropout={p}; "
                                 "call .eval() first")
            if not isinstance(cache, KVCache) or cache.batch_size != B:
                raise ValueError(f"cache must be a KVCache for batch size {B} (from new_cache); got {cache!r}")
        if self.cross:
            out = self._cross(x, memory, key_mask, attn_mask, cache, p)  # (B, Hq, S, D)
        else:
            if memory is not None:
                raise ValueError("memory is for cross-attention; this layer was built with cross=False")
            qkv = self.qkv(x).unflatten(-1, (Hq + 2 * Hkv, D))  # (B, S, Hq + 2 Hkv, D)
            q, k, v = qkv.split([Hq, Hkv, Hkv], dim=2)  # (B, S, H, D) views
            if cache is None:
                out = self._self(q, k, v, key_mask, attn_mask, p)
            else:
                out = self._self_cached(q, k, v, key_mask, cache)
        return self.out_proj(out.transpose(1, 2).reshape(B, S, Hq * D))

    def _self(self, q, k, v, key_mask, attn_mask, p) -> Tensor:
        """q, k, v: (B, S, H, D) -> (B, Hq, S, D)."""
        if self.rotary is not None:
            q, k = self.rotary(q, k, backend=self.backend)
        return attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=attn_mask, dropout_p=p,
                         is_causal=self.causal, enable_gqa=True, key_mask=key_mask, backend=self.backend)

    def _self_cached(self, q, k, v, key_mask, cache: KVCache) -> Tensor:
        """Append k, v at the cache's length, attend bottom-right over the filled part -> (B, Hq, S, D)."""
        if not self.causal:
            raise ValueError("a KV cache needs causal=True self-attention: earlier tokens cannot see later ones")
        B, S = q.shape[:2]
        if self.rotary is not None:
            cos, sin = self.rotary.cos_sin(cache.max_len, q.device)  # (max_len, dim/2) each
            offsets = cache.length.expand(B).contiguous()  # (B,) the new tokens' first position
            q, k = apply_rotary_qk(q, k, cos, sin, interleaved=self.rotary.interleaved, seqlen_offsets=offsets,
                                   backend=self.backend)
        cache.append(k.transpose(1, 2), v.transpose(1, 2), key_mask)
        kv_lens = cache.length.expand(B).contiguous()  # (B,) filled positions, including the new ones
        q_lens = torch.full((B,), S, dtype=torch.int64, device=q.device)
        out = flash_attn_func(q, cache.k.transpose(1, 2), cache.v.transpose(1, 2), causal=True,
                              key_mask=cache.key_mask if cache.padded else None, kv_lens=kv_lens, q_lens=q_lens,
                              backend=self.backend)  # (B, S, Hq, D), bottom-right per sequence
        return out.transpose(1, 2)

    def _cross(self, x, memory, key_mask, attn_mask, cache, p) -> Tensor:
        """Queries from x, keys/values from memory (or the cache) -> (B, Hq, S, D)."""
        B, S, _ = x.shape
        q = self.q_proj(x).unflatten(-1, (self.num_heads, self.head_dim)).transpose(1, 2)  # (B, Hq, S, D)
        if cache is None:
            if memory is None:
                raise ValueError("cross-attention needs memory (B, Sm, kdim)")
            k, v = self._kv(memory, B)
            return attention(q, k.transpose(1, 2), v.transpose(1, 2), attn_mask=attn_mask, dropout_p=p,
                             enable_gqa=True, key_mask=key_mask, backend=self.backend)
        if not cache.filled:
            if memory is None:
                raise ValueError("the cross-attention cache is empty: pass memory on the first call")
            k, v = self._kv(memory, B)
            cache.reset()
            cache.append(k.transpose(1, 2), v.transpose(1, 2), key_mask)
            cache.filled = True
        kv_lens = cache.length.expand(B).contiguous()  # (B,) the memory's length
        return attention(q, cache.k, cache.v, enable_gqa=True, key_mask=cache.key_mask if cache.padded else None,
                         kv_lens=kv_lens, backend=self.backend)
