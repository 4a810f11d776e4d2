"""MaskSpec: which keys each query sees beyond the (B, H, S, D) shapes.

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

    @property
    def varlen(self) -> bool:
        return self.cu_seqlens_q is not None

    @property
    def is_empty(self) -> bool:
        return (tuple(self.window) == (-1, -1) and self.key_mask is None and self.query_mask is None
                and self.q_lens is None and self.kv_lens is None and not self.varlen)

    def describe(self) -> str:
        parts = [f"window_size={tuple(self.window)}"] if tuple(self.window) != (-1, -1) else []
        parts += [n for n in ("key_mask", "query_mask", "q_lens", "kv_lens") if getattr(self, n) is not None]
        if self.varlen:
            parts.append(f"varlen ({self.cu_seqlens_q.shape[0] - 1} sequences)")
        return ", ".join(parts)


NO_MASKS = MaskSpec()
