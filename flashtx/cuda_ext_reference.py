"""Eager float64 references for flashtx.cuda_ext's ops (decode attention over a KV cache, RoPE +
cache append), written from their definitions for tests; any device, slow, loops over the batch."""
from __future__ import annotations

import torch


def cache_rows(cache: torch.Tensor, b: int, n: int, block_table=None, cache_batch_idx=None) -> torch.Tensor:
    """Positions [0, n) of batch row b of a contiguous (B_cache, S, H, D) or paged
    (num_blocks, page_size, H, D) cache, as (n, H, D)."""
    if block_table is None:
        row = int(cache_batch_idx[b]) if cache_batch_idx is not None else b
        return cache[row, :n]
    page = cache.shape[1]
    pos = torch.arange(n, device=cache.device)
    pages = block_table[b].to(cache.device).long()[pos // page]  # (n,)
    return cache[pages, pos % page]


def decode_attention_ref(q, k_cache, v_cache, cache_seqlens, block_table=None, cache_batch_idx=None,
                         softmax_scale=None, causal=False, dtype=torch.float64):
    """(out (B, Sq, Hq, D), lse (B, Hq, Sq)) computed in `dtype` (float64: the ground truth; the inputs'
    dtype: the same-dtype eager baseline of the tolerance rule) for q (B, Sq, Hq, D) over keys
    [0, cache_seqlens[b]) of each row; causal is bottom-right. A row with no key: out 0, lse -inf."""
    batch, sq, hq, d = q.shape
    hkv = k_cache.shape[2]
    scale = d ** -0.5 if softmax_scale is None else softmax_scale
    out = torch.zeros(batch, sq, hq, d, dtype=dtype, device=q.device)
    lse = torch.full((batch, hq, sq), float("-inf"), dtype=dtype, device=q.device)
    for b in range(batch):
        n = int(cache_seqlens[b])
        k = cache_rows(k_cache, b, n, block_table, cache_batch_idx).to(dtype).repeat_interleave(hq // hkv, dim=1)
        v = cache_rows(v_cache, b, n, block_table, cache_batch_idx).to(dtype).repeat_interleave(hq // hkv, dim=1)
        s = torch.einsum("ihd,jhd->hij", q[b].to(dtype), k) * scale  # (Hq, Sq, n)
        if causal:
            i = torch.arange(sq, device=q.device)[:, None]
            j = torch.arange(n, device=q.device)[None, :]
            s = s.masked_fill(j > n - sq + i, float("-inf"))
        row_lse = torch.logsumexp(s, dim=-1)  # (Hq, Sq); -inf where no key
        p = torch.exp(s - row_lse[..., None]).nan_to_num(0.0)
        out[b] = torch.einsum("hij,jhd->ihd", p, v)
        lse[b] = row_lse
    return out, lse


def rotate(x, cos, sin, positions, interleaved=False):
    """x (N, H, D) rotated at integer positions (N,) by cos/sin (S_rot, rotary_dim / 2), in
    float64; columns past rotary_dim unchanged."""
    x = x.double().clone()
    rd = 2 * cos.shape[1]
    c = cos.double()[positions][:, None, :]  # (N, 1, rd/2)
    s = sin.double()[positions][:, None, :]
    if interleaved:
        x1, x2 = x[..., 0:rd:2].clone(), x[..., 1:rd:2].clone()
        x[..., 0:rd:2], x[..., 1:rd:2] = x1 * c - x2 * s, x2 * c + x1 * s
    else:
        x1, x2 = x[..., : rd // 2].clone(), x[..., rd // 2: rd].clone()
        x[..., : rd // 2], x[..., rd // 2: rd] = x1 * c - x2 * s, x2 * c + x1 * s
    return x


def rotary_append_ref(q, k, v, k_cache, v_cache, cache_seqlens, cos=None, sin=None, interleaved=False,
                      q_causal=True, block_table=None, cache_batch_idx=None):
    """(q_rot float64 (B, Sq, Hq, D), k_cache', v_cache' float64 copies) after rotating q and k
    and writing k, v at positions cache_seqlens[b] + i (positions past the capacity are dropped)."""
    batch, sq = q.shape[:2]
    q_rot = q.double().clone()
    kc, vc = k_cache.double().clone(), v_cache.double().clone()
    paged = block_table is not None
    page = k_cache.shape[1]
    cap = block_table.shape[1] * page if paged else page
    for b in range(batch):
        base = int(cache_seqlens[b])
        pos = base + torch.arange(sq, device=q.device)
        kb = k[b].double()
        if cos is not None:
            q_rot[b] = rotate(q[b], cos, sin, pos if q_causal else torch.full_like(pos, base), interleaved)
            kb = rotate(k[b], cos, sin, pos, interleaved)
        for i in range(sq):
            p = base + i
            if not 0 <= p < cap:
                continue
            if paged:
                row, slot = int(block_table[b, p // page]), p % page
            else:
                row, slot = (int(cache_batch_idx[b]) if cache_batch_idx is not None else b), p
            kc[row, slot] = kb[i]
            vc[row, slot] = v[b, i].double()
    return q_rot, kc, vc
