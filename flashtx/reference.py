"""Eager PyTorch references for every flashtx op.

These are the ground truth the tests compare the kernels against (run in float64), and the
`reference` backend that serves CPU tensors and inputs no kernel supports. They are written for
clarity, not memory: attention here materialises the (Sq, Sk) score matrix.
"""
from __future__ import annotations

import contextlib
import math

import torch

LN2 = math.log(2.0)
LOG2E = 1.0 / LN2
# The backends clamp additive attn_mask values to [BIAS_FLOOR, -BIAS_FLOOR] (infinities and NaN kept), as the
# kernels do (triton_kernels.attention_common.BIAS_FLOOR/BIAS_CEIL): bias * log2(e) stays finite in fp32.
BIAS_FLOOR = -2.0 ** 125


def exact(device: torch.device):
    """A context where autocast leaves this module's matmuls in the dtype they ask for (the accumulator's, as the
    kernels compute): the backends' calls run in it, so an eager call under torch.autocast (whose inputs the public
    functions already cast) computes as its compiled form does (a custom op's body sees no autocast there). A no-op
    where autocast is off (~0.1 us)."""
    if not torch._C._is_any_autocast_enabled() or device.type not in ("cuda", "cpu"):
        return contextlib.nullcontext()
    return torch.autocast(device.type, enabled=False)


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
    vis = _windowed((i < ql) & (j < kl), i, j, (kl - ql) if bottom_right else 0, causal, window)
    if key_mask is not None:
        vis = vis & key_mask.to(device, torch.bool)[:, None, :]
    if query_mask is not None:
        vis = vis & query_mask.to(device, torch.bool)[:, :, None]
    return vis.expand(max(batch, vis.shape[0]), Sq, Sk)


def _windowed(vis, i, j, align, causal: bool, window):
    """vis & the keys query i sees through `window` (left, right; -1 unbounded) and `causal` (right 0), with query i
    aligned to key i + align."""
    left, right = (int(x) for x in window)
    if causal:
        right = 0
    if right >= 0:
        vis = vis & (j <= i + align + right)
    if left >= 0:
        vis = vis & (j >= i + align - left)
    return vis


def _varlen_rows(cu: torch.Tensor, total: int, device):
    """Per packed row r < total: (its sequence b (nseq for rows in none), its index within it, that sequence's
    length), from tensor ops alone (no host read of cu: under torch.compile the reference backend's op body is
    traced into the graph, where reading the offsets made unbacked sizes that fullgraph refused)."""
    cu = cu.to(device=device, dtype=torch.long)
    r = torch.arange(total, device=device)
    seq = torch.searchsorted(cu[1:], r, right=True)  # (total,) the first b with cu[b + 1] > r
    nseq = cu.shape[0] - 1
    b = seq.clamp(max=max(nseq - 1, 0))
    start, length = cu[b], cu[b + 1] - cu[b]
    seq = torch.where((r >= cu[0]) & (seq < nseq), seq, nseq)  # (rows before the first or past the last: none)
    return seq, r - start, length


def _varlen_pairs(cu_seqlens_q, cu_seqlens_k, total_q: int, total_k: int, device):
    """(same, i, j, align) over (total_q, total_k) row pairs: whether both rows are of one sequence, the query's and
    the key's index within it ((total_q, 1), (1, total_k)), and that sequence's kv length - q length."""
    sq, i, lq = _varlen_rows(cu_seqlens_q, total_q, device)
    sk, j, lk = _varlen_rows(cu_seqlens_k, total_k, device)
    same = (sq[:, None] == sk[None, :]) & (sq[:, None] < cu_seqlens_q.shape[0] - 1)
    return same, i[:, None], j[None, :], lk[None, :] - lq[:, None]


def varlen_visibility(cu_seqlens_q, cu_seqlens_k, total_q: int, total_k: int, *, causal: bool = False,
                      window=(-1, -1), device=None) -> torch.Tensor:
    """(1, total_q, total_k) bool for packed sequences: block-diagonal, each block as `visibility`
    with bottom-right alignment per sequence (flash-attn's varlen semantics)."""
    vis, i, j, align = _varlen_pairs(cu_seqlens_q, cu_seqlens_k, total_q, total_k, device)
    return _windowed(vis, i, j, align, causal, window)[None]


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None,
              causal: bool = False, bottom_right: bool = False, return_lse: bool = False,
              vis: torch.Tensor | None = None, bias: torch.Tensor | None = None, softcap: float = 0.0,
              alibi: torch.Tensor | None = None, keep: torch.Tensor | None = None, dropout_p: float = 0.0):
    """Softmax attention on (B, H, S, D) tensors, computed in the inputs' dtype.

    q: (B, Hq, Sq, Dqk), k: (B, Hkv, Sk, Dqk), v: (B, Hkv, Sk, Dv) with Hq % Hkv == 0 (GQA/MQA:
    q head h uses kv head h // (Hq // Hkv)). vis: an optional (B or 1, Sq, Sk) bool visibility
    (see `visibility`); it replaces causal/bottom_right. The scores s = scale * q.k^T become, in
    order: softcap * tanh(s / softcap) (softcap > 0); s + alibi (an additive tensor broadcastable
    to (B, Hq, Sq, Sk), see `alibi_bias`); s + bias (float) or -inf where bias is False (bool), bias
    broadcastable to (B, Hq, Sq, Sk); -inf where not vis. Rows left with no finite score give
    output 0 and lse -inf. keep: a dropout mask broadcastable to (B, Hq, Sq, Sk): P * keep /
    (1 - dropout_p) multiplies V. Returns out (B, Hq, Sq, Dv), and with return_lse the natural-log
    lse (B, Hq, Sq). Differentiable by autograd (in q, k, v and a float bias).
    """
    Hq, Hkv = q.shape[1], k.shape[1]
    if Hq != Hkv:
        k = k.repeat_interleave(Hq // Hkv, dim=1)
        v = v.repeat_interleave(Hq // Hkv, dim=1)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s, _ = _scores(q, k, scale=scale, causal=causal, bottom_right=bottom_right, vis=vis, bias=bias,
                   softcap=softcap, alibi=alibi)
    if s.shape[-1] == 0:  # no keys: every row sees nothing (output 0, lse -inf), as the kernels give
        out = torch.matmul(s, v)  # (B, H, Sq, Dv), zeros
        return (out, s.new_full(s.shape[:-1], float("-inf"))) if return_lse else out
    empty = torch.isneginf(s).all(-1)  # (B, H, Sq) rows with no visible key
    # empty rows get finite dummies (zeroed below) so that autograd sees no NaN
    s = s.masked_fill(empty[..., None], 0.0)
    lse = torch.logsumexp(s, dim=-1, keepdim=True)  # (B, H, Sq, 1)
    p = torch.exp(s - lse)  # (B, H, Sq, Sk), exactly 0 on masked entries
    # Where every score of a row ties at a huge value (a -1e9 bias), lse = max + log(sum) rounds to the
    # max and exp(s - lse) would sum to Sk, not 1: such rows (log(sum) lost) use exp(s - max) / sum.
    m = s.amax(-1, keepdim=True).detach()
    e = torch.exp(s - m)
    l = e.sum(-1, keepdim=True)
    lost = (lse.detach() == m) & (l > 1)
    p = torch.where(lost, e / l, p).masked_fill(empty[..., None], 0.0)
    lse = lse.squeeze(-1).masked_fill(empty, float("-inf"))  # (B, H, Sq)
    if keep is not None:
        p = p * keep / (1.0 - dropout_p)
    out = torch.matmul(p, v)  # (B, H, Sq, Dv)
    return (out, lse) if return_lse else out


def _scores(q, k, *, scale, causal=False, bottom_right=False, vis=None, bias=None, softcap=0.0, alibi=None):
    """Scores (B, H, Sq, Sk) after softcap, ALiBi, bias and masks (-inf where invisible), for k already
    expanded to q's heads; and tanh(s / softcap) (None without softcap) for the backward."""
    s = torch.matmul(q, k.transpose(-2, -1)) * scale  # (B, H, Sq, Sk)
    t = None
    if softcap:
        t = torch.tanh(s / softcap)
        s = softcap * t
    if alibi is not None:
        s = s + alibi.to(s.dtype)
    if bias is not None:
        s = s.masked_fill(~bias, float("-inf")) if bias.dtype == torch.bool else s + bias.to(s.dtype)
    if vis is None and causal:
        vis = causal_visibility(q.shape[2], k.shape[2], bottom_right, q.device)[None]  # (1, Sq, Sk)
    if vis is not None:
        s = s.masked_fill(~vis[:, None], float("-inf"))  # vis (B|1, 1, Sq, Sk)
    return s, t


def alibi_bias(slopes: torch.Tensor, Sq: int, Sk: int, *, q_lens=None, kv_lens=None, device=None) -> torch.Tensor:
    """(B|1, H, Sq, Sk) additive ALiBi bias -slope[b, h] * |i + Sk_b - Sq_b - j|, aligned bottom-right
    per sequence as flash-attn's (Sk_b, Sq_b from the lengths when given). slopes: (H,) or (B, H)."""
    slopes = slopes.reshape(-1, slopes.shape[-1]).to(device)  # (B|1, H)
    i = torch.arange(Sq, device=device)[None, :, None]
    j = torch.arange(Sk, device=device)[None, None, :]
    ql = torch.full((1,), Sq, device=device) if q_lens is None else q_lens.to(device).long().clamp(0, Sq)
    kl = torch.full((1,), Sk, device=device) if kv_lens is None else kv_lens.to(device).long().clamp(0, Sk)
    dist = (i + (kl - ql)[:, None, None] - j).abs()  # (B|1, Sq, Sk)
    return -slopes.double()[:, :, None, None] * dist[:, None].double()


def varlen_alibi_bias(slopes, cu_seqlens_q, cu_seqlens_k, total_q: int, total_k: int, device=None):
    """(1, H, total_q, total_k) ALiBi bias for packed sequences (bottom-right within each sequence; 0 between
    sequences), from tensor ops alone (see _varlen_rows)."""
    slopes = slopes.reshape(-1, slopes.shape[-1]).to(device).double()  # (1|nseq, H)
    same, i, j, align = _varlen_pairs(cu_seqlens_q, cu_seqlens_k, total_q, total_k, device)
    dist = (i + align - j).abs().double()  # (total_q, total_k)
    if slopes.shape[0] > 1:  # per sequence: each query row's
        sq = _varlen_rows(cu_seqlens_q, total_q, device)[0]
        slopes = slopes[sq.clamp(max=slopes.shape[0] - 1)]  # (total_q, H)
    return torch.where(same, -slopes.t()[:, :, None] * dist, 0.0)[None]  # (1, H, total_q, total_k)


def _upcast(t: torch.Tensor) -> torch.Tensor:
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


def spec_visibility(spec, causal: bool, bottom_right: bool, q, k):
    """The visibility `spec` (a flashtx.backends.AttentionMasks) gives (B, H, S, D) views q, k
    (varlen: (1, H, total, D)); None when nothing is masked beyond plain causal."""
    if spec is None or not spec.masks_visibility:
        return None
    if spec.varlen:
        return varlen_visibility(spec.cu_seqlens_q, spec.cu_seqlens_k, q.shape[2], k.shape[2], causal=causal,
                                 window=spec.window, device=q.device)
    return visibility(q.shape[2], k.shape[2], batch=q.shape[0], causal=causal, bottom_right=bottom_right,
                      window=spec.window, key_mask=spec.key_mask, query_mask=spec.query_mask, q_lens=spec.q_lens,
                      kv_lens=spec.kv_lens, device=q.device)


_M32 = 0xFFFFFFFF


def _mul32(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(high, low) 32-bit words of a * b, for a 32-bit constant a and int64 b holding uint32 values
    (b split in 16-bit halves, so no product passes 2**63)."""
    u, t = a * (b >> 16), a * (b & 0xFFFF)  # a * b = u * 2**16 + t; u, t < 2**48
    return (u + (t >> 16)) >> 16, (((u & 0xFFFF) << 16) + t) & _M32


def philox4x32(seed: torch.Tensor, c0, c1, c2, c3, rounds: int = 10):
    """Triton's tl.philox(seed, c0, c1, c2, c3) for 32-bit counters (Philox-4x32-10, the key = seed's low
    and high words), in int64 torch ops on uint32 values; broadcasts like the counters. Returns (r0..r3)."""
    k0, k1 = seed & _M32, (seed >> 32) & _M32
    for _ in range(rounds):
        hi_b, lo_b = _mul32(0xCD9E8D57, c2)
        hi_a, lo_a = _mul32(0xD2511F53, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0, k1 = (k0 + 0x9E3779B9) & _M32, (k1 + 0xBB67AE85) & _M32
    return c0, c1, c2, c3


def dropout_keep(spec, shape, device) -> torch.Tensor:
    """The dropout mask (B, H, Sq, Sk) bool (varlen: (1, H, total_q, total_k)) of `spec` (its seed and
    dropout_p): the kernels' own draws (triton_kernels.attention_common.dropout_keep), computed on the
    device without a sync. P[b, h, i, j] is kept iff Philox at counter (low word of i * Sk_b + j,
    b * H + h, its high word, 0), with i, j sequence-local and Sk_b the sequence's key count, gives
    u = (r0 >> 8) / 2**24 >= dropout_p (as float32). Entries between two packed sequences are drawn
    too; they are invisible."""
    B, H, Sq, Sk = shape
    seed = spec.rng.reshape(-1)[:1].to(device=device, dtype=torch.int64)  # (1,)
    i = torch.arange(Sq, device=device)[:, None]  # (Sq, 1)
    j = torch.arange(Sk, device=device)[None, :]  # (1, Sk)
    h = torch.arange(H, device=device)[:, None, None]  # (H, 1, 1)
    if spec.varlen:  # one packed row of sequences: b is the sequence of query row i, i and j count from its start
        cu_q, cu_k = spec.cu_seqlens_q.to(device).long(), spec.cu_seqlens_k.to(device).long()
        b = (torch.searchsorted(cu_q, i, right=True) - 1).clamp(0, cu_q.numel() - 2)  # (Sq, 1)
        i, j, sk = i - cu_q[b], j - cu_k[b], cu_k[b + 1] - cu_k[b]  # (Sq, 1), (Sq, Sk), (Sq, 1)
        bh = (b * H + h)[None]  # (1, H, Sq, 1)
    else:
        b = torch.arange(B, device=device)
        sk = torch.full((B,), Sk, device=device) if spec.kv_lens is None else spec.kv_lens.to(device).long()
        sk = sk.clamp(0, Sk)[:, None, None, None]  # (B, 1, 1, 1): the kernels' Sk_b (kv_lens clamped, as seq_bounds)
        bh = b[:, None, None, None] * H + h  # (B, H, 1, 1)
    idx = i * sk + j  # (.., Sq, Sk) int64: i * Sk_b + j
    r0, _, _, _ = philox4x32(seed, idx & _M32, bh & _M32, (idx >> 32) & _M32, torch.zeros_like(seed))
    p32 = torch.tensor(float(spec.dropout_p), dtype=torch.float32).item()  # the kernels compare in float32
    return ((r0 >> 8).double() * 2.0 ** -24 >= p32).expand(shape)


def _spec_kwargs(spec, causal, bottom_right, q, k) -> dict:
    """reference.attention's vis/bias/softcap/alibi/keep arguments for a backend call."""
    kw = dict(causal=causal, bottom_right=bottom_right, vis=spec_visibility(spec, causal, bottom_right, q, k))
    if spec is None:
        return kw
    if spec.attn_mask is not None:
        m = spec.attn_mask
        if m.is_floating_point():  # clamped as the kernels do (infinities and NaN kept)
            fi = torch.finfo(m.dtype)
            m = torch.where(torch.isinf(m), m, m.clamp(min=max(BIAS_FLOOR, fi.min), max=min(-BIAS_FLOOR, fi.max)))
        kw["bias"] = m
    kw["softcap"] = float(spec.softcap)
    if spec.alibi_slopes is not None:
        if spec.varlen:
            kw["alibi"] = varlen_alibi_bias(spec.alibi_slopes, spec.cu_seqlens_q, spec.cu_seqlens_k, q.shape[2],
                                            k.shape[2], device=q.device)
        else:
            kw["alibi"] = alibi_bias(spec.alibi_slopes, q.shape[2], k.shape[2], q_lens=spec.q_lens,
                                     kv_lens=spec.kv_lens, device=q.device)
    if spec.dropout:
        kw["keep"] = dropout_keep(spec, (q.shape[0], q.shape[1], q.shape[2], k.shape[2]), q.device)
        kw["dropout_p"] = float(spec.dropout_p)
    return kw


def _expand_kv(q, k, v):
    """k, v repeated to q's heads (GQA/MQA), and the group size."""
    group = q.shape[1] // k.shape[1] if k.shape[1] else 1  # 0 heads: nothing to repeat
    if group != 1:  # (0 q heads over K/V heads: group 0, no head of k, v is used)
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    return k, v, group


def _scores2(q, ke, scale, kw):
    """The backends' scores in log2 units (B, H, Sq, Sk), -inf where invisible, and tanh(s / softcap)."""
    s, t = _scores(q, ke, scale=scale, **kw)
    return s * LOG2E, t


def attention_forward(q, k, v, *, scale: float, causal: bool, bottom_right: bool, spec=None):
    """Reference backend forward with the kernels' contract: returns (out, m2, l2).

    m2: the row max of the scores in log2 units, l2 = log2(sum exp2(s2 - m2)), both (B, H, Sq) in
    the accumulator dtype; rows that see no key have m2 = -inf, l2 = 0 and output 0. Computes in
    fp32 for half inputs (fp64 for fp64), output cast back to the input dtype.
    """
    dt = q.dtype
    q, k, v = (_upcast(t) for t in (q, k, v))
    kw = _spec_kwargs(spec, causal, bottom_right, q, k)
    keep, p_drop = kw.pop("keep", None), kw.pop("dropout_p", 0.0)
    ke, ve, _ = _expand_kv(q, k, v)
    s2, _ = _scores2(q, ke, scale, kw)  # (B, H, Sq, Sk)
    empty = torch.isneginf(s2).all(-1)  # (B, H, Sq)
    m2 = s2.amax(-1) if s2.shape[-1] else s2.new_full(s2.shape[:-1], float("-inf"))
    e = torch.exp2(s2 - torch.where(empty, float("inf"), m2)[..., None])  # 0 on empty rows
    l = e.sum(-1)
    l2 = torch.log2(torch.where(empty, 1.0, l))
    p = e / torch.where(empty, 1.0, l)[..., None]
    if keep is not None:
        p = p * keep / (1.0 - p_drop)
    return torch.matmul(p, ve).to(dt), m2, l2


def attention_backward(do, q, k, v, out, m2, l2, *, scale: float, causal: bool, bottom_right: bool, dlse2=None,
                       spec=None, dbias=None):
    """Reference backend backward from the saved (m2, l2) (the same recomputation the kernels do:
    P = exp2(s2 - m2) * exp2(-l2)); dlse2 is the cotangent of lse2 = m2 + l2.

    Returns (dq, dk, dv) in the inputs' dtype; with dbias (shaped like spec.attn_mask), also
    writes the float attn_mask's gradient into it, summed over its broadcast dims.
    """
    dt = q.dtype
    do, q, k, v, out = (_upcast(t) for t in (do, q, k, v, out))
    Hkv = k.shape[1]
    ke, ve, group = _expand_kv(q, k, v)  # (B, Hq, Sk, D)
    kw = _spec_kwargs(spec, causal, bottom_right, q, k)
    keep, p_drop = kw.pop("keep", None), kw.pop("dropout_p", 0.0)
    s2, t = _scores2(q, ke, scale, kw)  # (B, Hq, Sq, Sk)
    # rows that see no key (m2 = -inf) get P = 0
    ms = torch.where(torch.isneginf(m2), float("inf"), m2).to(s2.dtype)
    p = torch.exp2(s2 - ms[..., None]) * torch.exp2(-l2.to(s2.dtype))[..., None]
    delta = (do * out).sum(-1)  # (B, Hq, Sq)
    if dlse2 is not None:
        delta = delta - dlse2.to(delta.dtype) / LN2
    pd = p if keep is None else p * keep / (1.0 - p_drop)  # what multiplied V
    dv = torch.matmul(pd.transpose(-2, -1), do)  # (B, Hq, Sk, Dv)
    dp = torch.matmul(do, ve.transpose(-2, -1))
    if keep is not None:
        dp = dp * keep / (1.0 - p_drop)
    ds = p * (dp - delta[..., None])  # dL/d(scores)
    if dbias is not None:
        dbias.copy_(ds.sum_to_size(dbias.shape))
    if t is not None:
        ds = ds * (1.0 - t * t)
    dq = torch.matmul(ds, ke) * scale
    dk = torch.matmul(ds.transpose(-2, -1), q) * scale
    if group != 1:
        B, _, Sk = k.shape[:3]
        dk = dk.view(B, Hkv, group, Sk, dk.shape[-1]).sum(2)
        dv = dv.view(B, Hkv, group, Sk, dv.shape[-1]).sum(2)
    return dq.to(dt), dk.to(dt), dv.to(dt)


def attention_probs(q, k, v, m2, l2, *, scale: float, causal: bool, bottom_right: bool, spec=None):
    """Reference backend probabilities (B, H, Sq, Sk) (varlen (nseq, H, max_q, max_k)) in m2's dtype,
    dropped entries negated: the same contract as the kernels' attention_probs."""
    kw = _spec_kwargs(spec, causal, bottom_right, q, k)
    keep = kw.pop("keep", None)
    kw.pop("dropout_p", None)
    B, H, Sk = q.shape[0], q.shape[1], k.shape[2]
    eye = torch.eye(Sk, dtype=torch.float64, device=q.device).expand(B, k.shape[1], Sk, Sk)
    # P itself: attention with V = identity gives P @ I = P
    p = attention(q.double(), k.double(), eye, scale=scale, **kw).to(m2.dtype)  # (B, H, Sq, Sk)
    if keep is not None:
        p = torch.where(keep, p, -p)
    if spec is not None and spec.varlen:
        cq, ck = spec.cu_seqlens_q.tolist(), spec.cu_seqlens_k.tolist()
        res = p.new_zeros(len(cq) - 1, H, int(spec.max_seqlen_q), int(spec.max_seqlen_k))
        for b in range(len(cq) - 1):
            blk = p[0, :, cq[b]:cq[b + 1], ck[b]:ck[b + 1]]
            res[b, :, :blk.shape[1], :blk.shape[2]] = blk
        return res
    return p


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
