"""TransformerBlock: pre-norm attention (+ optional cross-attention) and a SwiGLU MLP, each residual."""
from __future__ import annotations

import dataclasses
import numbers

from torch import Tensor, nn

from .._validate import check_flag
from .attention import MultiheadAttention, _buffers
from ._cache_state import _check_pos_int
from .kv_cache import KVCache, PagedKVCache
from .norm import RMSNorm
from .rotary import RotaryEmbedding
from .swiglu import SwiGLU

NORMS = ("rms", "layer")


def llama_hidden_dim(dim: int, multiple_of: int = 32) -> int:
    """LLaMA's SwiGLU MLP width (hidden size) for model width `dim`, as Meta's reference computes it.

    ``int(2 * 4 * dim / 3)`` (a SwiGLU MLP has three matrices, so 2/3 of the usual 4 * dim keeps the
    parameter count of a two-matrix MLP), rounded up to a multiple of `multiple_of`. LLaMA uses
    ``multiple_of=256``: ``llama_hidden_dim(4096, 256) == 11008`` (LLaMA-7B). The default 32 is what
    TransformerBlock uses when no ``hidden_dim`` is given. Meta's ``ffn_dim_multiplier`` (LLaMA 2 70B,
    LLaMA 3) is not applied: pass such a model's width as ``hidden_dim`` directly.

    Args:
        dim: the model (embedding) width.
        multiple_of: the width is rounded up to a multiple of this.

    Returns:
        the MLP's hidden width, an int.
    """
    h = int(2 * (4 * dim) / 3)
    return multiple_of * ((h + multiple_of - 1) // multiple_of)


@dataclasses.dataclass
class BlockCache:
    """A TransformerBlock's caches, from ``TransformerBlock.new_cache``: pass it as the block's ``cache``.

    self_attn: the self-attention's KVCache ((B, max_len, Hkv, D) key/value buffers) or PagedKVCache (a page pool
        with a block table), on the parameters' device and dtype unless new_cache was given others; it grows by
        each call's tokens.
    cross_attn: for a block with cross-attention, a KVCache of the projected memory (filled on the first call,
        read afterwards); None otherwise.
    """

    self_attn: KVCache | PagedKVCache
    cross_attn: KVCache | None = None

    def reset(self) -> "BlockCache":
        """Empty both caches for a new batch (a new memory for the cross-attention)."""
        self.self_attn.reset()
        if self.cross_attn is not None:
            self.cross_attn.reset()
        return self

    def reorder(self, index) -> "BlockCache":
        """KVCache.reorder of both caches (beam search): row b becomes what row index[b] was. Contiguous caches
        only (a PagedKVCache's sequences move by their block tables, which this does not rewrite)."""
        if not isinstance(self.self_attn, KVCache):
            raise TypeError("BlockCache.reorder: the self-attention cache is a PagedKVCache, which has no reorder; "
                            "use a contiguous cache (new_cache(..., paged=False)) for beam search")
        self.self_attn.reorder(index)
        if self.cross_attn is not None:
            self.cross_attn.reorder(index)
        return self


class TransformerBlock(nn.Module):
    """Pre-norm transformer block: ``x + attn(norm(x))`` [``+ cross(norm(.), memory)``] ``+ mlp(norm(.))``.

    Args:
        dim: model width E.
        num_heads, num_kv_heads, head_dim: as flashtx.nn.MultiheadAttention (GQA/MQA).
        hidden_dim: the SwiGLU MLP's width; default LLaMA's (``llama_hidden_dim(dim)``).
        norm: "rms" (flashtx.nn.RMSNorm, LLaMA) or "layer" (nn.LayerNorm).
        norm_eps: the norms' eps.
        bias: biases in the attention and MLP projections, and in LayerNorm with norm="layer" (False,
            as LLaMA; GPT-2 style blocks pass True).
        dropout: attention-probability dropout (training only).
        resid_dropout: dropout on each sublayer's output before it is added back (training only).
        rotary: a flashtx.nn.RotaryEmbedding for the self-attention (may be shared by blocks).
        causal: causal self-attention (decoder) or not (encoder).
        cross: add a cross-attention sublayer (q from the block, k/v from ``memory``), as the
            decoder of an encoder-decoder model.
        kdim: the memory's width (default dim; cross blocks only).
        inplace_backward: the SwiGLU MLP's (see flashtx.nn.SwiGLU): its activation gradient overwrites
            the projection output (no buffer); pass False for a second backward through the same
            graph (retain_graph) or torch.autograd.gradcheck.
        backend, device, dtype: passed on to the layers.

    Shapes: x (B, S, dim) -> (B, S, dim); memory (B, Sm, kdim).
    """

    def __init__(self, dim: int, num_heads: int, num_kv_heads: int | None = None, *, head_dim: int | None = None,
                 hidden_dim: int | None = None, norm: str = "rms", norm_eps: float = 1e-6, bias: bool = False,
                 dropout: float = 0.0, resid_dropout: float = 0.0, rotary: RotaryEmbedding | None = None,
                 causal: bool = True, cross: bool = False, kdim: int | None = None, backend: str | None = None,
                 inplace_backward: bool = True, device=None, dtype=None):
        super().__init__()
        dim = _check_pos_int("dim", dim)
        if norm not in NORMS:
            raise ValueError(f"norm must be one of {NORMS}; got {norm!r}")
        if isinstance(norm_eps, bool) or not isinstance(norm_eps, numbers.Real) or not norm_eps >= 0:
            raise ValueError(f"norm_eps must be a number >= 0; got {norm_eps!r}")
        if kdim is not None and not cross:
            raise ValueError("kdim is only meaningful with cross=True")
        if isinstance(resid_dropout, bool) or not isinstance(resid_dropout, numbers.Real) \
                or not 0.0 <= resid_dropout < 1.0:
            raise ValueError(f"resid_dropout must be a number in [0, 1); got {resid_dropout!r}")
        hidden_dim = llama_hidden_dim(dim) if hidden_dim is None else hidden_dim
        kw = dict(device=device, dtype=dtype)

        def make_norm():
            if norm == "rms":
                return RMSNorm(dim, eps=norm_eps, **kw)
            return nn.LayerNorm(dim, eps=norm_eps, bias=bias, **kw)

        self.attn_norm = make_norm()
        cross = check_flag("cross", cross)  # ("False" is truthy)
        self.attn = MultiheadAttention(dim, num_heads, num_kv_heads, head_dim=head_dim, bias=bias, dropout=dropout,
                                       rotary=rotary, causal=causal, backend=backend, **kw)
        if cross:
            self.cross_norm = make_norm()
            self.cross_attn = MultiheadAttention(dim, num_heads, num_kv_heads, head_dim=head_dim, bias=bias,
                                                 dropout=dropout, cross=True, kdim=kdim, backend=backend, **kw)
        else:
            self.cross_norm = self.cross_attn = None
        self.mlp_norm = make_norm()
        self.mlp = SwiGLU(dim, hidden_dim, bias=bias, inplace_backward=inplace_backward, **kw)
        self.resid_dropout = nn.Dropout(resid_dropout)

    def new_cache(self, batch_size: int, max_len: int, memory_len: int | None = None, *, paged: bool = False,
                  page_size: int = 16, num_pages: int | None = None, **kw) -> BlockCache:
        """Empty caches for incremental decoding: max_len positions for the self-attention (paged=True:
        a PagedKVCache, see MultiheadAttention.new_cache) and, for a cross block, memory_len (the
        memory's length) for the cross-attention. kw: device, dtype."""
        cross = None
        if self.cross_attn is None and memory_len is not None:
            raise ValueError("memory_len is for cross blocks' caches; this block was built with cross=False")
        if self.cross_attn is not None:
            if memory_len is None:
                raise ValueError("a cross block's cache needs memory_len (the memory's sequence length)")
            cross = self.cross_attn.new_cache(batch_size, memory_len, **kw)
        return BlockCache(self.attn.new_cache(batch_size, max_len, paged=paged, page_size=page_size,
                                              num_pages=num_pages, **kw), cross)

    def forward(self, x: Tensor, memory: Tensor | None = None, *, key_mask: Tensor | None = None,
                memory_mask: Tensor | None = None, attn_mask: Tensor | None = None,
                cache: BlockCache | None = None) -> Tensor:
        """x: (B, S, dim) -> (B, S, dim).

        key_mask: (B, S) bool, True = real token of x (with a cache: of this call's tokens).
        memory, memory_mask: (B, Sm, kdim) and (B, Sm) bool, cross blocks only; with a cache they
            are read on the first call and reused after (memory may then be None).
        attn_mask: the self-attention's SDPA-style mask (see MultiheadAttention); not with a cache.
        cache: from ``new_cache``.
        """
        if cache is not None and not isinstance(cache, BlockCache):
            raise TypeError(f"cache must be a BlockCache from TransformerBlock.new_cache (it holds the self- and "
                            f"cross-attention caches); got {type(cache).__name__}")
        if cache is not None and (cache.cross_attn is None) != (self.cross_attn is None):
            raise ValueError(f"cache is a BlockCache {'without' if cache.cross_attn is None else 'with'} a "
                             f"cross-attention cache, but this block has {'a' if self.cross_attn else 'no'} "
                             f"cross-attention: make it with this block's new_cache")
        if self.cross_attn is None and (memory is not None or memory_mask is not None):
            raise ValueError("memory/memory_mask given to a TransformerBlock built with cross=False")
        if self.cross_attn is not None and memory is None and cache is None:
            raise ValueError("cross-attention needs memory (B, Sm, kdim)")
        if cache is not None and self.cross_attn is not None:
            # before the self-attention appends to its cache: a retry must not store the tokens twice
            self.cross_attn.check_cache(cache.cross_attn, x.shape[0])
            own, cross = _buffers(cache.self_attn)[0], _buffers(cache.cross_attn)[0]
            if (cross.dtype, cross.device) != (own.dtype, own.device):
                raise ValueError(f"cache.cross_attn holds {cross.dtype} on {cross.device} but cache.self_attn "
                                 f"{own.dtype} on {own.device}: both hold this block's activations (make them with "
                                 f"new_cache)")
            if not cache.cross_attn.filled:
                self.cross_attn.check_memory(memory, memory_mask, x.shape[0], cache.cross_attn)
        h = self.attn(self.attn_norm(x), key_mask=key_mask, attn_mask=attn_mask,
                      cache=cache.self_attn if cache is not None else None)
        x = x + self._resid(h)
        if self.cross_attn is not None:
            h = self.cross_attn(self.cross_norm(x), memory, key_mask=memory_mask,
                                cache=cache.cross_attn if cache is not None else None)
            x = x + self._resid(h)
        return x + self._resid(self.mlp(self.mlp_norm(x)))

    def _resid(self, h: Tensor) -> Tensor:
        """h through resid_dropout; skipped where it is the identity (p = 0, or eval), a few us of Python a call."""
        d = self.resid_dropout
        return h if type(d) is nn.Dropout and (d.p == 0 or not d.training) else d(h)
