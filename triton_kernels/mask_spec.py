"""MaskSpec: everything beyond the (B, H, S, D) shapes that shapes the attention scores.

Which keys each query sees (window, padding masks, lengths, varlen, a boolean attn_mask), what
is added to the scores (an additive attn_mask / bias, ALiBi), how they are transformed (softcap)
and dropout on the probabilities.

Shared by the attention launchers and by flashtx's op layer (as flashtx.backends.AttentionMasks).
It imports no triton, so flashtx's reference backend can use it where triton is absent.
"""
from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class MaskSpec:
    """All fields optional.

    window: (left, right) as flash-attn, -1 = unbounded; causal sets right to 0.
    key_mask (B, Sk) / query_mask (B, Sq): bool, True = real token (any strides).
    q_lens / kv_lens (B,): int, right padding; clamped to [0, S] in the kernels.
    cu_seqlens_q / cu_seqlens_k (nseq + 1,) int32 with max_seqlen_q / max_seqlen_k: varlen; then
    the kernels get (1, H, total, D) views of the packed (total, H, D) tensors.
    attn_mask: 4-D (Bm, Hm, Sqm, Skm), each dim 1 (broadcast) or the full B, Hq, Sq, Sk; bool
    (True = attend) or floating (added to the scaled scores, -inf allowed). Not with varlen.
    softcap: > 0 turns the scaled scores s into softcap * tanh(s / softcap) (before bias/masks).
    alibi_slopes: (1 or B, Hq) float32; adds -slope * |i + Sk_b - Sq_b - j| (bottom-right).
    dropout_p in [0, 1) with rng: a (1,) int64 seed tensor on the inputs' device.
    """

    window: tuple = (-1, -1)
    key_mask: torch.Tensor | None = None
    query_mask: torch.Tensor | None = None
    q_lens: torch.Tensor | None = None
    kv_lens: torch.Tensor | None = None
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    attn_mask: torch.Tensor | None = None
    softcap: float = 0.0
    alibi_slopes: torch.Tensor | None = None
    dropout_p: float = 0.0
    rng: torch.Tensor | None = None

    @property
    def varlen(self) -> bool:
        return self.cu_seqlens_q is not None

    @property
    def masks_visibility(self) -> bool:
        """Whether anything beyond plain causal decides which keys a query sees (not a bool attn_mask)."""
        return not (tuple(self.window) == (-1, -1) and self.key_mask is None and self.query_mask is None
                    and self.q_lens is None and self.kv_lens is None and not self.varlen)

    @property
    def is_empty(self) -> bool:
        return (not self.masks_visibility and self.attn_mask is None and not self.softcap
                and self.alibi_slopes is None and not self.dropout_p)

    @property
    def modifies_scores(self) -> bool:
        """attn_mask, softcap, ALiBi or dropout: the kernels pick leaner tiles for them (configs)."""
        return self.attn_mask is not None or bool(self.softcap) or self.alibi_slopes is not None or self.dropout

    @property
    def dropout(self) -> bool:
        return self.dropout_p > 0.0

    def launch_key(self) -> tuple:
        """(non-tensor fields, tensor fields): what a launch cache (launch.LaunchCache) keys on. No tensor fields at
        all (a window or a softcap alone) give () for the tensors: the launchers' plain roles, as without a spec."""
        if self is NO_MASKS:
            return _EMPTY_KEY
        tensors = (self.key_mask, self.query_mask, self.q_lens, self.kv_lens, self.cu_seqlens_q, self.cu_seqlens_k,
                   self.attn_mask, self.alibi_slopes, self.rng)
        return ((tuple(self.window), self.max_seqlen_q, self.max_seqlen_k, self.softcap, self.dropout_p),
                () if all(t is None for t in tensors) else tensors)

    def describe(self) -> str:
        parts = [f"window_size={tuple(self.window)}"] if tuple(self.window) != (-1, -1) else []
        parts += [n for n in ("key_mask", "query_mask", "q_lens", "kv_lens") if getattr(self, n) is not None]
        if self.varlen:
            parts.append(f"varlen ({self.cu_seqlens_q.shape[0] - 1} sequences)")
        if self.attn_mask is not None:
            kind = "bool" if self.attn_mask.dtype == torch.bool else str(self.attn_mask.dtype)
            parts.append(f"attn_mask {tuple(self.attn_mask.shape)} {kind}")
        if self.softcap:
            parts.append(f"softcap={self.softcap}")
        if self.alibi_slopes is not None:
            parts.append(f"alibi_slopes {tuple(self.alibi_slopes.shape)}")
        if self.dropout_p:
            parts.append(f"dropout_p={self.dropout_p}")
        return ", ".join(parts)


NO_MASKS = MaskSpec()
_EMPTY_KEY = ((), ())
