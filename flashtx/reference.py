"""Eager PyTorch references for every flashtx op.

These are the ground truth the tests compare the kernels against (run in float64), and the
`reference` backend that serves CPU tensors and inputs no kernel supports. They are written for
clarity, not memory: attention here materialises the (Sq, Sk) score matrix.
"""
from __future__ import annotations

import math

import torch

LN2 = math.log(2.0)


def causal_visibility(Sq: int, Sk: int, bottom_right: bool, device=None) -> torch.Tensor:
    """(Sq, Sk) bool: query i may attend to key j.

    Top-left alignment (SDPA's `is_causal`): j <= i. Bottom-right (flash-attn's `causal` when
    Sq != Sk): j <= i + Sk - Sq, so the last query sees every key.
    """
    i = torch.arange(Sq, device=device)[:, None]
    j = torch.arange(Sk, device=device)[None, :]
    shift = (Sk - Sq) if bottom_right else 0
    return j <= i + shift


def visibility(Sq: int, Sk: int, *, batch: int = 1, causal: bool = False, bottom_right: bool = False,
               window=(-1, -1), key_mask=None, query_mask=None, q_lens=None, kv_lens=None,
               device=None) -> torch.Tensor:
    """(B, Sq, Sk) bool: may query i of batch b attend to key j. The explicit N x N ground truth.

    Lengths (B,) int are clamped to [0, S]; rows/keys past them are padding. With
    bottom_right, the diagonal is aligned per sequence: align = kv_len - q_len (else 0). Then
    j <= i + align + right (causal: right = 0; window right -1 = no bound) and
    j >= i + align - left (window left -1 = no bound). key_mask (B, Sk) / query_mask (B, Sq):
    True = real token.
    """
    i = torch.arange(Sq, device=device)[None, :, None]
    j = torch.arange(Sk, device=device)[None, None, :]
    def lens(t, s):  # (B|1, 1, 1) valid lengths
        if t is None:
            return torch.full((1, 1, 1), s, device=device)
        return t.to(device).long().clamp(0, s)[:, None, None]

    ql, kl = lens(q_lens, Sq), lens(kv_lens, Sk)
    vis = (i < ql) & (j < kl)
    align = (kl - ql) if bottom_right else 0
    left, right = (int(x) for x in window)
    if causal:
        right = 0
    if right >= 0:
        vis = vis & (j <= i + align + right)
    if left >= 0:
        vis = vis & (j >= i + align - left)
    if key_mask is not None:
        vis = vis & key_mask.to(device, torch.bool)[:, None, :]
    if query_mask is not None:
        vis = vis & query_mask.to(device, torch.bool)[:, :, None]
    return vis.expand(max(batch, vis.shape[0]), Sq, Sk)


def varlen_visibility(cu_seqlens_q, cu_seqlens_k, total_q: int, total_k: int, *, causal: bool = False,
                      window=(-1, -1), device=None) -> torch.Tensor:
    """(1, total_q, total_k) bool for packed sequences: block-diagonal, each block as `visibility`
    with bottom-right alignment per sequence (flash-attn's varlen semantics)."""
    vis = torch.zeros(1, total_q, total_k, dtype=torch.bool, device=device)
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(len(cq) - 1):
        lq, lk = cq[b + 1] - cq[b], ck[b + 1] - ck[b]
        vis[0, cq[b]:cq[b + 1], ck[b]:ck[b + 1]] = visibility(lq, lk, causal=causal, bottom_right=True,
                                                              window=window, device=device)[0]
    return vis


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None,
              causal: bool = False, bottom_right: bool = False, return_lse: bool = False,
              vis: torch.Tensor | None = None):
    """Softmax attention on (B, H, S, D) tensors, computed in the inputs' dtype.

    q: (B, Hq, Sq, Dqk), k: (B, Hkv, Sk, Dqk), v: (B, Hkv, Sk, Dv) with Hq % Hkv == 0 (GQA/MQA:
    q head h uses kv head h // (Hq // Hkv)). vis: an optional (B or 1, Sq, Sk) bool visibility
    (see `visibility`); it replaces causal/bottom_right. Rows that see no key give output 0 and
    lse -inf. Returns out (B, Hq, Sq, Dv), and with return_lse the natural-log lse (B, Hq, Sq).
    Differentiable by autograd.
    """
    Hq, Hkv = q.shape[1], k.shape[1]
    if Hq != Hkv:
        k = k.repeat_interleave(Hq // Hkv, dim=1)
        v = v.repeat_interleave(Hq // Hkv, dim=1)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = torch.matmul(q, k.transpose(-2, -1)) * scale  # (B, H, Sq, Sk)
    if vis is None and causal:
        vis = causal_visibility(q.shape[2], k.shape[2], bottom_right, q.device)[None]  # (1, Sq, Sk)
    empty = None
    if vis is not None:
        vis = vis[:, None]  # (B|1, 1, Sq, Sk)
        empty = ~vis.any(-1)  # (B|1, 1, Sq) rows with no visible key
        # masked entries get -inf; empty rows get finite dummies (zeroed below) so autograd sees no NaN
        s = s.masked_fill(~vis & ~empty[..., None], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # (B, H, Sq)
    p = torch.exp(s - lse[..., None])  # (B, H, Sq, Sk), exactly 0 on masked entries
    if empty is not None and bool(empty.any()):
        p = p.masked_fill(empty[..., None], 0.0)
        lse = lse.masked_fill(empty, float("-inf"))
    out = torch.matmul(p, v)  # (B, H, Sq, Dv)
    return (out, lse) if return_lse else out


def _upcast(t: torch.Tensor) -> torch.Tensor:
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


def spec_visibility(spec, causal: bool, bottom_right: bool, q, k):
    """The visibility `spec` (a flashtx.backends.AttentionMasks) gives (B, H, S, D) views q, k
    (varlen: (1, H, total, D)); None when nothing is masked beyond plain causal."""
    if spec is None or spec.is_empty:
        return None
    if spec.varlen:
        return varlen_visibility(spec.cu_seqlens_q, spec.cu_seqlens_k, q.shape[2], k.shape[2], causal=causal,
                                 window=spec.window, device=q.device)
    return visibility(q.shape[2], k.shape[2], batch=q.shape[0], causal=causal, bottom_right=bottom_right,
                      window=spec.window, key_mask=spec.key_mask, query_mask=spec.query_mask, q_lens=spec.q_lens,
                      kv_lens=spec.kv_lens, device=q.device)


def attention_forward(q, k, v, *, scale: float, causal: bool, bottom_right: bool, spec=None):
    """Reference backend forward with the kernels' contract: returns (out, lse2), lse2 in log2 units.

    Computes in fp32 for half inputs (fp64 for fp64), output cast back to the input dtype.
    """
    out, lse = attention(_upcast(q), _upcast(k), _upcast(v), scale=scale, causal=causal,
                         bottom_right=bottom_right, return_lse=True,
                         vis=spec_visibility(spec, causal, bottom_right, q, k))
    return out.to(q.dtype), lse / LN2


def attention_backward(do, q, k, v, out, lse2, *, scale: float, causal: bool, bottom_right: bool, dlse2=None,
                       spec=None):
    """Reference backend backward from the saved lse (the same recomputation the kernels do)."""
    dt = q.dtype
    do, q, k, v, out = (_upcast(t) for t in (do, q, k, v, out))
    Hq, Hkv = q.shape[1], k.shape[1]
    group = Hq // Hkv
    ke = k.repeat_interleave(group, dim=1) if group > 1 else k  # (B, Hq, Sk, D)
    ve = v.repeat_interleave(group, dim=1) if group > 1 else v
    s = torch.matmul(q, ke.transpose(-2, -1)) * scale  # (B, Hq, Sq, Sk)
    lse = (lse2 * LN2).to(s.dtype)
    vis = spec_visibility(spec, causal, bottom_right, q, k)
    if vis is None and causal:
        vis = causal_visibility(q.shape[2], k.shape[2], bottom_right, q.device)[None]
    if vis is not None:
        s = s.masked_fill(~vis[:, None], float("-inf"))
    # rows that see no key (lse = -inf) get P = 0
    p = torch.exp(s - torch.where(torch.isinf(lse), float("inf"), lse)[..., None])
    delta = (do * out).sum(-1)  # (B, Hq, Sq)
    if dlse2 is not None:
        delta = delta - dlse2.to(delta.dtype) / LN2
    dv = torch.matmul(p.transpose(-2, -1), do)  # (B, Hq, Sk, Dv)
    dp = torch.matmul(do, ve.transpose(-2, -1))
    ds = p * (dp - delta[..., None])
    dq = torch.matmul(ds, ke) * scale
    dk = torch.matmul(ds.transpose(-2, -1), q) * scale
    if group > 1:
        B, _, Sk = k.shape[:3]
        dk = dk.view(B, Hkv, group, Sk, -1).sum(2)
        dv = dv.view(B, Hkv, group, Sk, -1).sum(2)
    return dq.to(dt), dk.to(dt), dv.to(dt)


# ==================================================================================================
# Rotary position embeddings (RoPE) and SwiGLU
# ==================================================================================================


def rotary_tokens(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, table_index: torch.Tensor,
                  positions: torch.Tensor, *, interleaved: bool = False, conjugate: bool = False) -> torch.Tensor:
    """Rotary embedding of a flat list of tokens, the ground truth for flashtx.apply_rotary.

    x: (N, H, D) tokens; cos, sin: (Bc, seqlen_ro, R2) tables, rotary_dim = 2 * R2 <= D;
    table_index: (N,) which of the Bc tables each token uses; positions: (N,) its position.
    Pairs are (x[j], x[j + R2]) (half / NeoX style) or (x[2j], x[2j + 1]) (interleaved / GPT-J),
    rotated by +theta (or -theta with conjugate, the backward); columns past rotary_dim are copied.
    Tokens at positions outside [0, seqlen_ro) become NaN. Computes in fp32 (fp64 for fp64 x) and
    returns x's dtype. Differentiable in x.
    """
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    r2 = cos.shape[-1]
    ok = (positions >= 0) & (positions < cos.shape[1])  # (N,)
    safe = torch.where(ok, positions, torch.zeros_like(positions)).long()
    idx = table_index.long()
    c = cos[idx, safe].to(acc)[:, None, :]  # (N, 1, R2)
    s = sin[idx, safe].to(acc)[:, None, :]
    c = torch.where(ok[:, None, None], c, torch.full_like(c, float("nan")))
    if conjugate:
        s = -s
    xr = x[..., : 2 * r2].to(acc)  # (N, H, 2 * R2)
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
    else:
        x1, x2 = xr[..., :r2], xr[..., r2:]
    o1, o2 = x1 * c - x2 * s, x1 * s + x2 * c  # (N, H, R2)
    rot = torch.stack((o1, o2), dim=-1).flatten(-2) if interleaved else torch.cat((o1, o2), dim=-1)
    return torch.cat((rot.to(x.dtype), x[..., 2 * r2:]), dim=-1)  # (N, H, D)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(..., D) -> (-x[D/2:], x[:D/2]): the NeoX/LLaMA helper, as in Hugging Face transformers."""
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, computed in fp32 (fp64 for fp64) and returned in gate's dtype."""
    acc = torch.float64 if gate.dtype == torch.float64 else torch.float32
    g, u = gate.to(acc), up.to(acc)
    return (torch.nn.functional.silu(g) * u).to(gate.dtype)


def swiglu_backward(dout: torch.Tensor, gate: torch.Tensor, up: torch.Tensor):
    """Gradients (dgate, dup) of silu(gate) * up, recomputing silu; fp32 math, input dtype out.

    d/dgate silu(g) = s * (1 + g * (1 - s)) with s = sigmoid(g).
    """
    acc = torch.float64 if gate.dtype == torch.float64 else torch.float32
    g, u, do = gate.to(acc), up.to(acc), dout.to(acc)
    s = torch.sigmoid(g)
    dg = do * u * s * (1 + g * (1 - s))
    du = do * g * s
    return dg.to(gate.dtype), du.to(up.dtype)
