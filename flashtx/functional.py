"""Public attention functions: an SDPA-compatible shell and a flash-attn-compatible shell.

Both are thin layers over one op (flashtx::attention_fwd / attention_bwd) and differ only in
layout and causal alignment:

======================  ======================  =====================================
function                layout                  causal/window alignment when Sq != Sk
======================  ======================  =====================================
attention               (..., H, S, D) (SDPA)   top-left: query i sees keys j <= i
flash_attn_func         (B, S, H, D)            bottom-right: i sees j <= i + Sk - Sq
flash_attn_varlen_func  packed (total, H, D)    bottom-right per sequence
======================  ======================  =====================================

Masks and lengths (keyword-only in both padded shells): `key_mask` (B, Sk) / `query_mask`
(B, Sq) bool with True = real token, `kv_lens` / `q_lens` (B,) int for right padding. With
bottom-right alignment the diagonal follows each sequence's lengths (Sk_b - Sq_b, from lens or
cu_seqlens), as flash-attn's varlen does; masks only hide tokens and never move the diagonal.

Scores and probabilities (both shells, as constexpr options of the same kernels): an arbitrary
bool/additive mask broadcast through strides (`attn_mask` / `attn_bias=`, with the learned
bias's gradient), `softcap`, `alibi_slopes` (bottom-right, as flash-attn), `dropout_p` (Philox,
regenerated in backward) and, in the flash shells, `return_attn_probs`.
"""
from __future__ import annotations

import math
import numbers

import torch

from . import _attention_lane, _sdpa_args, _small_q, _small_q_lane
from ._attention_op import BIAS_GRAD, GRAD, NO_GRAD, _all_none as _no_aux, attn_fwd, attn_probs
from ._library import call
from .triton_kernels.limits import MAX_SEQ, exporting
from ._validate import (ALLOWED_DTYPES, _qkv_ok, check_alibi, check_attn_mask, check_cu_seqlens,
                        check_cu_seqlens_pair, check_dropout, check_lens, check_max_seqlen, check_qkv,
                        check_flag, check_seq_mask, check_softcap, check_tensor, check_window, packed_qkv_ok,
                        refuse_negated_qkv, resolve_scale, _values_readable)

LN2 = math.log(2.0)
_NO_WINDOW = (-1, -1)


def _new_rng(device) -> torch.Tensor:
    """A (1,) int64 dropout seed drawn from torch's generator for `device` (torch.manual_seed repeats it)."""
    return torch.randint(0, 2**62, (1,), dtype=torch.int64, device=device)  # out of place: traceable


_AUTOCAST_ANY = torch._C._is_any_autocast_enabled  # ~0.1 us; torch.compile traces it (a constant per graph)


_CASTABLE = (torch.float16, torch.bfloat16, torch.float32)  # autocast leaves float64 alone


def _autocast(device_type: str, *ts):
    """ts with their fp16/bf16/fp32 tensors cast to the autocast dtype, as torch's autocast casts SDPA's inputs (it
    is on autocast's lower-precision list, CUDA and CPU): mixed or fp32 inputs under autocast run the half kernels.
    Call only when _AUTOCAST_ANY(); on other device types, or where autocast is off, ts pass unchanged."""
    if (device_type != "cuda" and device_type != "cpu") or not torch.is_autocast_enabled(device_type):
        return ts
    dt = torch.get_autocast_dtype(device_type)
    for t in ts:
        d = getattr(t, "dtype", dt)
        if d != dt and d in _CASTABLE:
            break
    else:
        return ts  # the usual case in mixed-precision training: already in the autocast dtype
    return tuple(t.to(dt) if isinstance(t, torch.Tensor) and t.dtype in _CASTABLE and t.dtype != dt else t
                 for t in ts)


def _run(q, k, v, *, scale, causal, bottom_right, backend, return_lse, window=(-1, -1), key_mask=None,
         query_mask=None, q_lens=None, kv_lens=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=0,
         max_seqlen_k=0, bias=None, softcap=0.0, alibi_slopes=None, dropout_p=0.0, return_probs=False, bshd=False,
         lane=None):
    """q, k, v: validated (B, H, S, D) views (varlen: (1, H, total, D)), or with bshd (B, S, H, D) tensors
    (varlen: (1, total, H, D)); the rest validated too.

    Returns out (B, Hq, Sq, Dv) (bshd: (B, Sq, Hq, Dv)) [, lse (B, Hq, Sq)] [, probs (B, Hq, Sq, Sk)]. Plain
    ints, bools and lists only: this is what torch.compile traces around the op. lane: a shell's request for a
    decoding call's lane (flashtx._small_q_lane), made where flashtx._small_q takes the call.
    """
    refuse_negated_qkv(q, k, v)
    Sq, Sk = (q.shape[1], k.shape[1]) if bshd else (q.shape[2], k.shape[2])
    if Sq > MAX_SEQ or Sk > MAX_SEQ:  # every backend: window bounds >= MAX_SEQ were taken as unbounded
        raise ValueError(f"flashtx takes sequences of at most {MAX_SEQ} tokens (queries, keys, a varlen batch's "
                         f"total); got {Sq} queries and {Sk} keys")
    rng = _new_rng(q.device) if dropout_p > 0 else None
    needs_grad = NO_GRAD
    if torch.is_grad_enabled():
        if bias is not None and bias.requires_grad:
            needs_grad = BIAS_GRAD
        elif q.requires_grad or k.requires_grad or v.requires_grad:
            needs_grad = GRAD
    aux = [key_mask, query_mask, q_lens, kv_lens, cu_seqlens_q, cu_seqlens_k, alibi_slopes, rng]  # _attention_op.Aux
    ints = [int(causal), int(bottom_right), window[0], window[1], max_seqlen_q, max_seqlen_k, needs_grad,
            int(bshd)]  # _attention_op.Ints
    floats = [scale, softcap, dropout_p]  # _attention_op.Floats
    if (needs_grad == NO_GRAD and _small_q.SMALL_Q_DECODE and rng is None and not return_probs
            and query_mask is None and q_lens is None and kv_lens is None and cu_seqlens_q is None
            and not exporting()  # (an exported program serves every size the Dims allow:
            # no route decided by sizes; Dynamo shows strict export's symbolic sizes as ints)
            and Sk > Sq):  # decoding: see flashtx._small_q
        res = _small_q.attention(q, k, v, bias, aux, ints, floats, backend or "", return_lse, lane)
        if res is not None:
            return res
        if lane is not None:
            _small_q_lane.refuse(lane)  # the training forward's, for what the lane key decides
    if not (return_lse or return_probs) and (bias is not None or not _no_aux(aux)):
        out = _attention_lane.forward_op(q, k, v, bias, aux, ints, floats, backend or "")  # planned once per signature
        if out is not None:
            return out
    out, m2, l2 = call(attn_fwd, q, k, v, bias, aux, ints, floats, backend or "")
    if not (return_lse or return_probs):
        return out
    res = [out]
    if return_lse:
        res.append((m2 + l2) * LN2)  # natural log
    if return_probs:
        res.append(attn_probs(q.detach(), k.detach(), v.detach(), m2, l2.detach(),
                              None if bias is None else bias.detach(), aux, ints, floats, backend or ""))
    return tuple(res)


def _no_window(window) -> bool:
    """Whether `window` is the default (-1, -1), by identity or as a tuple of two ints (a tensor, an array or a
    tuple of tensors would compare elementwise: check_window takes those)."""
    return window is _NO_WINDOW or (type(window) is tuple and len(window) == 2 and type(window[0]) is int
                                    and type(window[1]) is int and window == _NO_WINDOW)


def _plain(mask, causal, extra_outputs, key_mask, query_mask, kv_lens, q_lens, alibi_slopes, dropout_p) -> bool:
    """Whether a padded shell's call has no tensor option and nothing but out to return (no mask or bias, a bool
    causal, no lse or probs, none of the keyword masks, lengths, ALiBi or dropout): flashtx._attention_lane's
    calls, with their window and softcap (scalars: _lane_window, _lane_softcap)."""
    return (mask is None and type(causal) is bool and not extra_outputs and key_mask is None and query_mask is None
            and kv_lens is None and q_lens is None and alibi_slopes is None and type(dropout_p) is float
            and dropout_p == 0.0)


def _decoding(mask, key_mask, causal, return_lse, query_mask, kv_lens, q_lens, alibi_slopes, dropout_p) -> bool:
    """Whether a shell's call may take a decoding lane (flashtx._small_q_lane): at most one mask, none of the
    other tensor options or dropout, a bool causal and return_lse."""
    return ((mask is None or key_mask is None) and type(causal) is bool and type(return_lse) is bool
            and query_mask is None and kv_lens is None and q_lens is None and alibi_slopes is None
            and type(dropout_p) is float and dropout_p == 0.0)


def _lane_window(window) -> tuple:
    """window_size validated as the general path validates it (check_window), the default without a call."""
    return _NO_WINDOW if _no_window(window) else check_window("window_size", window)


def _lane_softcap(softcap) -> float:
    """softcap validated as the general path validates it (check_softcap), 0.0 without a call."""
    return 0.0 if type(softcap) is float and softcap == 0.0 else check_softcap("softcap", softcap)


def _padding_masks(B, Sq, Sk, q, window_size, key_mask, query_mask, q_lens, kv_lens) -> dict:
    """Validated padding/window keywords of _run for batch B, sequence lengths Sq, Sk and query q (its
    device)."""
    if key_mask is None and query_mask is None and q_lens is None and kv_lens is None and (
            _no_window(window_size)):
        return {}
    q_lens, kv_lens = check_lens("q_lens", q_lens, B, q), check_lens("kv_lens", kv_lens, B, q)
    if (q_lens is None) != (kv_lens is None):  # the kernels read both: the missing one is full length, made here
        # (made in the launch plan, it tied the launch to no input, so the call was planned anew every time)
        given = q_lens if q_lens is not None else kv_lens
        full = torch.full((B,), Sq if q_lens is None else Sk, dtype=given.dtype, device=q.device)
        q_lens, kv_lens = (full, kv_lens) if q_lens is None else (q_lens, full)
    return dict(window=check_window("window_size", window_size),
                key_mask=check_seq_mask("key_mask", key_mask, B, Sk, q),
                query_mask=check_seq_mask("query_mask", query_mask, B, Sq, q), q_lens=q_lens, kv_lens=kv_lens)


PROBS_WITHOUT_DROPOUT = False  # return_attn_probs' probabilities without dropout too (tests; flash-attn gives None)


def _with_probs(mods: dict) -> bool:
    """Whether a call with return_attn_probs and these _score_mods returns the probabilities (flash-attn's rule)."""
    return PROBS_WITHOUT_DROPOUT or mods.get("dropout_p", 0.0) > 0.0


def _score_mods(batch, heads, q, *, dropout_p=0.0, softcap=0.0, alibi_slopes=None) -> dict:
    """Validated score-modifier keywords of _run (batch and query heads for ALiBi's slopes)."""
    if alibi_slopes is None and type(dropout_p) is float and dropout_p == 0.0 and type(softcap) is float and (
            softcap == 0.0):
        return {}
    return dict(dropout_p=check_dropout("dropout_p", dropout_p), softcap=check_softcap("softcap", softcap),
                alibi_slopes=check_alibi("alibi_slopes", alibi_slopes, batch, heads, q))


def attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False,
              *, backend=None, return_lse=False, window_size=_NO_WINDOW, key_mask=None, query_mask=None,
              kv_lens=None, q_lens=None, softcap=0.0, alibi_slopes=None):
    """Drop-in for ``torch.nn.functional.scaled_dot_product_attention``, with O(N) memory.

    Args:
        query: (..., Hq, Sq, D); key: (..., Hkv, Sk, D); value: (..., Hkv, Sk, Dv). The leading
            dims (usually one batch dim) must match. float16, bfloat16 or float32 (float64 for
            tests); any strides. Dv may differ from D.
        attn_mask: as SDPA: bool (True = attend) or float (added to the scaled scores; -inf
            allowed), any shape broadcastable to (..., Hq, Sq, Sk). Read in tiles through its
            strides (stride 0 on broadcast dims), never expanded. A float mask that requires grad
            (a learned bias) gets its gradient, summed over its broadcast dims, deterministically.
            May be combined with is_causal and every keyword below. torch.nn.attention.bias's
            causal_upper_left / causal_lower_right (CausalBias) run as is_causal, aligned top-left or
            bottom-right (the window then aligned so too).
        dropout_p: dropout on the attention probabilities, applied whenever > 0 (as SDPA: pass 0
            in eval). The mask comes from Philox in the kernel, seeded from torch's generator.
            In [0, 1]: 1 drops every probability (out 0), and a 0-dim tensor is read on the host, as SDPA.
        is_causal: causal mask aligned top-left, as in SDPA: query i sees keys j <= i. With
            Sq > Sk every row still sees key 0; with Sq < Sk the last keys are never seen.
        scale: softmax scale; default 1/sqrt(D). A 0-dim tensor is read on the host, as SDPA.
        enable_gqa: allow Hq to be a multiple of Hkv (GQA/MQA). Q head h uses K/V head
            h // (Hq // Hkv); K/V are never expanded. Without it Hq must equal Hkv unless Hkv == 1,
            which broadcasts over the query heads, as in SDPA.
        backend: None (automatic), "triton" or "reference" (flashtx.BACKENDS; the optional CUDA extension
            serves flash_attn_with_kvcache only).
        return_lse: also return the log-sum-exp of each row's scaled scores.
        window_size: (left, right) sliding window, -1 = unbounded: query i sees keys
            i - left <= j <= i + right (top-left aligned, like is_causal; is_causal sets right = 0).
        key_mask: (B, Sk) bool, True = real key (the polarity of SDPA's bool attn_mask and Hugging
            Face's attention_mask; nn.MultiheadAttention's key_padding_mask is the opposite).
            B is the product of the leading dims (1 for 3-D/2-D inputs).
        query_mask: (B, Sq) bool, True = real query; padding rows give 0 output and 0 gradient.
        kv_lens, q_lens: (B,) int32/int64 valid lengths (right padding; clamped to [0, S]).
            Rows/keys past them are padding: 0 output, 0 gradient. Causal stays top-left.
        softcap: > 0 caps the scaled scores: s -> softcap * tanh(s / softcap) (Gemma 2), before
            attn_mask and ALiBi are added.
        alibi_slopes: (Hq,) or (B, Hq) float32: adds -slope * |i + Sk - Sq - j| to the scores,
            aligned bottom-right as flash-attn's (per sequence with lengths).

    Returns:
        out (..., Hq, Sq, Dv) in query's dtype (under torch.autocast the autocast dtype: fp16/bf16/fp32
        inputs are cast as autocast casts SDPA's); rows that see no key (all masked, or all -inf
        bias, as SDPA since torch 2.5; or Sk = 0) are 0 with lse -inf; with
        return_lse, (out, lse) with lse (..., Hq, Sq) in float32 (float64 for float64 inputs), natural
        log. Differentiable in query, key, value, a float attn_mask (and through lse). out is laid out
        (..., Sq, Hq, Dv) in memory whatever query's layout (unless Sq * Hq * Dv passes 2**31 - 1), as SDPA's
        flash kernel returns it: merging the heads (out.transpose(1, 2).reshape(B, Sq, -1)) copies nothing.

    Decoding: without autograd, up to 16 queries over more keys, with no query mask, lengths, dropout or bias
    (a bool attn_mask the same for every head aside), run the split-KV decode kernels of
    flash_attn_with_kvcache (flashtx._small_q says when), the same result.

    Example:
        >>> out = flashtx.attention(q, k, v, is_causal=True)  # q, k, v: (B, H, S, D)
    """
    bottom_right = False
    if attn_mask is not None and type(attn_mask) is not torch.Tensor:  # (CausalBias: is_causal, either alignment)
        attn_mask, is_causal, bottom_right = _sdpa_args.causal_bias(attn_mask, is_causal, query, key)
    if _AUTOCAST_ANY() and isinstance(query, torch.Tensor):
        query, key, value, attn_mask = _autocast(query.device.type, query, key, value, attn_mask)
    lane = None
    if (type(query) is torch.Tensor and type(key) is torch.Tensor and type(value) is torch.Tensor
            and query.dim() == 4 and key.dim() == 4 and value.dim() == 4 and query.dtype in ALLOWED_DTYPES
            and (backend is None or type(backend) is str) and type(enable_gqa) is bool
            and _qkv_ok(query, key, value, enable_gqa)):
        q, k, v = query, key, value  # the common case (plain 4-D tensors that check_qkv passes), in ints and bools
        if _decoding(attn_mask, key_mask, is_causal, return_lse, query_mask, kv_lens, q_lens, alibi_slopes,
                     dropout_p) and _small_q_lane.decoding(q.shape[2], k.shape[2]):
            mask, role = (attn_mask, "attn_mask") if key_mask is None else (key_mask, "key_mask")
            res, lane = _small_q_lane.lookup(q, k, v, mask, role, resolve_scale("scale", scale, q.shape[3]),
                                             is_causal, bottom_right, False, _lane_window(window_size),
                                             _lane_softcap(softcap), backend, return_lse)
            if res is not None:  # a decoding step, planned once per signature (lane: the general path plans it)
                return res
        if lane is None and _plain(attn_mask, is_causal, return_lse, key_mask, query_mask, kv_lens, q_lens,
                                   alibi_slopes, dropout_p):
            out = _attention_lane.forward(q, k, v, resolve_scale("scale", scale, q.shape[3]), is_causal,
                                          bottom_right, False, backend, _lane_window(window_size),
                                          _lane_softcap(softcap))  # the plain call, planned once per signature
            if out is not None:
                return out
    else:
        q, k, v = _sdpa_args.checked_4d(query, key, value, backend, enable_gqa)
    scale = resolve_scale("scale", scale, q.shape[-1])
    bias = None if attn_mask is None else check_attn_mask(
        "attn_mask", attn_mask, tuple(query.shape[:-3]), q.shape[1], q.shape[2], k.shape[2], q,
        lambda: f"query {tuple(query.shape)} and key {tuple(key.shape)}")
    drop_all = False
    if type(dropout_p) is not float or not 0.0 <= dropout_p < 1.0:  # SDPA's forms (a 0-dim tensor, p = 1), errors
        dropout_p, drop_all = _sdpa_args.dropout_p(dropout_p)
    res = _run(q, k, v, scale=scale, causal=check_flag("is_causal", is_causal), bottom_right=bottom_right,
               backend=backend,
               return_lse=check_flag("return_lse", return_lse), bias=bias, lane=lane,
               **_padding_masks(q.shape[0], q.shape[2], k.shape[2], q, window_size, key_mask, query_mask, q_lens,
                                kv_lens),
               **_score_mods(q.shape[0], q.shape[1], q, dropout_p=dropout_p, softcap=softcap,
                             alibi_slopes=alibi_slopes))
    if drop_all:  # every probability dropped: out 0 (and its gradients), lse as without dropout
        res = (res[0] * 0.0, res[1]) if return_lse else res * 0.0
    if query.dim() == 4:
        return res
    lead_shape = query.shape[:-2]  # (..., Hq)
    if return_lse:
        out, lse = res
        return out.reshape(*lead_shape, *out.shape[2:]), lse.reshape(*lead_shape, lse.shape[2])
    return res.reshape(*lead_shape, *res.shape[2:])


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=_NO_WINDOW, softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False, *, backend=None,
                    key_mask=None, query_mask=None, kv_lens=None, q_lens=None, attn_bias=None):
    """Drop-in for flash-attn 2's ``flash_attn_func``.

    Args:
        q: (B, Sq, Hq, D); k: (B, Sk, Hkv, D); v: (B, Sk, Hkv, Dv), Hq a multiple of Hkv
            (GQA/MQA without expanding K/V). float16, bfloat16 or float32; any strides.
        dropout_p: dropout on the probabilities, applied whenever > 0 (flash-attn's rule: pass 0
            in eval). Philox in the kernel, seeded from torch's generator; regenerated in backward.
        softmax_scale: default 1/sqrt(D).
        causal: causal mask aligned bottom-right, as flash-attn >= 2.1: query i sees keys
            j <= i + Sk - Sq. When Sq > Sk, the first Sq - Sk rows see no key: their output is 0, as
            in flash-attn, and their lse -inf (flash-attn 2 writes +inf; -inf merges by lse correctly).
        window_size: (left, right) sliding window as flash-attn, -1 = unbounded: query i sees
            keys i + Sk - Sq - left <= j <= i + Sk - Sq + right; causal sets right = 0. Key tiles
            outside the window are skipped, so the cost scales with the window.
        softcap: > 0: scores s -> softcap * tanh(s / softcap), as flash-attn's.
        alibi_slopes: (Hq,) or (B, Hq) float32: adds -slope * |i + Sk - Sq - j| (bottom-right).
        deterministic: accepted; flashtx's backward is always deterministic (no atomics).
        return_attn_probs: also return (softmax_lse (B, Hq, Sq) natural log, probs), as flash-attn:
            probs only with dropout_p > 0 (else None: the usual way to get the lse costs no O(Sq * Sk)
            tensor), (B, Hq, Sq, Sk) float32 (float64 for float64 inputs), P with the entries dropout
            dropped negated, for tests and small sizes; not differentiable.
        backend: as in flashtx.attention.
        key_mask, query_mask: (B, Sk) / (B, Sq) bool, True = real token (keyword-only).
        kv_lens, q_lens: (B,) int valid lengths, right padding (keyword-only). The causal/window
            diagonal is aligned per sequence: i + kv_lens[b] - q_lens[b], as flash-attn's varlen.
        attn_bias: (keyword-only) bool (True = attend) or float additive mask broadcastable to
            (B, Hq, Sq, Sk) (note: heads before the sequence dims), as flashtx.attention's
            attn_mask, including the gradient of a float bias that requires grad.

    Returns:
        out (B, Sq, Hq, Dv) contiguous, in q's dtype (under torch.autocast the autocast dtype, as attention's);
        with return_attn_probs, (out, softmax_lse, probs).

    Decoding: as flashtx.attention's, up to 16 queries over more keys without autograd run the split-KV decode
    kernels.

    Example:
        >>> out = flashtx.flash_attn_func(q, k, v, causal=True)  # q, k, v: (B, S, H, D)
    """
    if deterministic is not False and deterministic is not True:
        check_flag("deterministic", deterministic)  # (read nowhere else: the backward is always deterministic)
    if _AUTOCAST_ANY() and isinstance(q, torch.Tensor):
        q, k, v, attn_bias = _autocast(q.device.type, q, k, v, attn_bias)
    if not (type(q) is torch.Tensor and type(k) is torch.Tensor and type(v) is torch.Tensor  # the common case
            and q.dim() == 4 and k.dim() == 4 and v.dim() == 4 and q.dtype in ALLOWED_DTYPES
            and k.dtype in ALLOWED_DTYPES and v.dtype in ALLOWED_DTYPES):
        for n, t in (("q", q), ("k", k), ("v", v)):
            check_tensor(n, t)
            if t.dim() != 4:
                raise ValueError(f"{n} must be 4-D (B, S, H, D); got shape {tuple(t.shape)}")
    if not _qkv_ok(q, k, v, True, heads=2):  # (B, S, H, D): the op reads them as they are (bshd), no views
        for n, t in (("q", q), ("k", k), ("v", v)):
            check_tensor(n, t)
        check_qkv(("q", "k", "v"), q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), "(B, S, H, D)",
                  allow_gqa=True, shown=(q, k, v))  # raises, naming what is wrong
    B, Sq, Hq, D = q.shape
    Sk = k.shape[1]
    scale = resolve_scale("softmax_scale", softmax_scale, D)
    lane = None
    if (backend is None or type(backend) is str) and return_attn_probs is False and _decoding(
            attn_bias, key_mask, causal, False, query_mask, kv_lens, q_lens, alibi_slopes, dropout_p) and \
            _small_q_lane.decoding(Sq, Sk):
        mask, role = (attn_bias, "attn_bias") if key_mask is None else (key_mask, "key_mask")
        out, lane = _small_q_lane.lookup(q, k, v, mask, role, scale, causal, True, True, _lane_window(window_size),
                                         _lane_softcap(softcap), backend, False)
        if out is not None:  # a decoding step, planned once per signature (as attention's)
            return out
    if lane is None and (backend is None or type(backend) is str) and _plain(
            attn_bias, causal, return_attn_probs, key_mask, query_mask, kv_lens, q_lens, alibi_slopes, dropout_p):
        out = _attention_lane.forward(q, k, v, scale, causal, True, True, backend, _lane_window(window_size),
                                      _lane_softcap(softcap))  # planned once per signature
        if out is not None:
            return out
    bias = None if attn_bias is None else check_attn_mask(
        "attn_bias", attn_bias, (B,), Hq, Sq, Sk, q, lambda: f"q {tuple(q.shape)} and k {tuple(k.shape)}")
    lse = return_attn_probs is not None and check_flag("return_attn_probs", return_attn_probs)  # (None: False)
    mods = _score_mods(B, Hq, q, dropout_p=dropout_p, softcap=softcap, alibi_slopes=alibi_slopes)
    probs = lse and _with_probs(mods)
    res = _run(q, k, v, scale=scale, causal=check_flag("causal", causal), bottom_right=True, backend=backend,
               return_lse=lse, return_probs=probs, bias=bias, bshd=True, lane=lane,
               **_padding_masks(B, Sq, Sk, q, window_size, key_mask, query_mask, q_lens, kv_lens), **mods)
    return (*res, None) if lse and not probs else res  # out (B, Sq, Hq, Dv) [, lse (B, Hq, Sq), probs | None]


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None, *, backend=None):
    """Drop-in for flash-attn 2's ``flash_attn_varlen_func``: packed variable-length sequences.

    Args:
        q: (total_q, Hq, D); k: (total_k, Hkv, D); v: (total_k, Hkv, Dv): the sequences of the
            batch concatenated, no padding. Hq a multiple of Hkv.
        cu_seqlens_q, cu_seqlens_k: (nseq + 1,) int32 cumulative lengths, starting at 0 and ending
            at total (sequence b is rows [cu[b], cu[b+1])).
        max_seqlen_q, max_seqlen_k: the longest sequence (or more), an int or a 0-dim integer
            tensor. The grid spans min(int, total) rows per sequence; a tensor is only checked
            (never read on the host, so torch.compile traces through) and the grid spans the total.
        cu_seqlens and max_seqlen are checked: on CPU with a ValueError naming the bad entry; on
            a GPU without a host sync, by a device-side assert (torch._assert_async) that stops
            the program, as PyTorch's indexing does, rather than read out of bounds.
        causal, window_size: as flash_attn_func, aligned bottom-right per sequence.
        dropout_p, softcap, alibi_slopes ((Hq,) or (nseq, Hq)), softmax_scale, deterministic,
            backend: as flash_attn_func, per sequence (with block_table, the gather's backward sums the
            gradients of pages that sequences share with atomics on CUDA: not bit-reproducible).
        return_attn_probs: also return (softmax_lse (Hq, total_q), probs), as flash-attn: probs only
            with dropout_p > 0 (else None), (nseq, Hq, max_seqlen_q, max_seqlen_k), for tests (tensor
            max_seqlens are then read: a host sync).
        block_table: None, or (nseq, max_pages_per_seq) int32 for keys and values in a paged cache, as
            flash-attn >= 2.6: k, v are then (num_blocks, page_block_size, Hkv, D|Dv) and position j of
            sequence b (cu_seqlens_k[b+1] - cu_seqlens_k[b] keys) is row j % page_block_size of page
            block_table[b, j // page_block_size]; any page size. The pages in use are gathered into
            packed rows first (flashtx._paged_varlen: one gather of nseq * min(max_pages_per_seq *
            page_block_size, max_seqlen_k) rows, no host sync), then the call runs as an unpaged one.
            Differentiable in the caches too (their gradients land in the pages used).

    Returns:
        out (total_q, Hq, Dv) in q's dtype (under torch.autocast the autocast dtype, as attention's).

    Example:
        >>> out = flashtx.flash_attn_varlen_func(q, k, v, cu, cu, max_len, max_len, causal=True)
    """
    if deterministic is not False and deterministic is not True:
        check_flag("deterministic", deterministic)
    return _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
                   window_size, softcap, alibi_slopes, return_attn_probs, block_table, backend, _VARLEN_NAMES)


# the argument names varlen errors use: cu_seqlens q/k, max_seqlen q/k, total q/k (flash_attn_varlen_func's)
_VARLEN_NAMES = ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "total_q (q.shape[0])",
                 "total_k (k.shape[0])")


def _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
            window_size, softcap, alibi_slopes, return_attn_probs, block_table, backend, names: tuple):
    """flash_attn_varlen_func's body; names: _VARLEN_NAMES, or a packed form's own argument names."""
    n_cuq, n_cuk, n_msq, n_msk, n_tq, n_tk = names

    if _AUTOCAST_ANY() and isinstance(q, torch.Tensor):
        q, k, v = _autocast(q.device.type, q, k, v)
    if block_table is not None:  # keys and values from a paged cache: gathered into packed rows
        from ._paged_varlen import unpage
        check_tensor("q", q)
        k, v = unpage(k, v, block_table, check_cu_seqlens(n_cuk, cu_seqlens_k, q), q, max_seqlen_k)
    if not packed_qkv_ok(q, k, v):  # (the common case in ints and bools; else the checks that name what is wrong)
        for n, t in (("q", q), ("k", k), ("v", v)):
            check_tensor(n, t)
            if t.dim() != 3:
                raise ValueError(f"{n} must be 3-D (total, H, D) for varlen; got shape {tuple(t.shape)}")
        check_qkv(("q", "k", "v"), *(t.transpose(0, 1)[None] for t in (q, k, v)), "(total, H, D)",
                  allow_gqa=True, shown=(q, k, v))  # raises, naming what is wrong
    cuq = check_cu_seqlens(n_cuq, cu_seqlens_q, q)
    # (self-attention passes one tensor twice: checked once)
    cuk = cuq if cu_seqlens_k is cu_seqlens_q else check_cu_seqlens(n_cuk, cu_seqlens_k, q)
    if cuq.shape != cuk.shape:
        raise ValueError(f"{n_cuq} and {n_cuk} must describe the same number of sequences; got shapes "
                         f"{tuple(cuq.shape)} and {tuple(cuk.shape)}")
    # an int >= 0 as it is, eagerly (check_max_seqlen's common case); anything else, and any traced int (a value read
    # on the device cannot be compared on the host), checked there
    eager = not torch.compiler.is_compiling()
    msq = max_seqlen_q if eager and type(max_seqlen_q) is int and max_seqlen_q >= 0 else check_max_seqlen(
        n_msq, max_seqlen_q, q.device)
    msk = max_seqlen_k if eager and type(max_seqlen_k) is int and max_seqlen_k >= 0 else check_max_seqlen(
        n_msk, max_seqlen_k, q.device)
    # an int bound past the total bounds nothing more (no sequence is longer than the total): clamped first, so
    # looser bounds share a launch-cache entry of the check (and of the kernels, below)
    msq = msq if isinstance(msq, torch.Tensor) else min(msq, q.shape[0])
    msk = msk if isinstance(msk, torch.Tensor) else min(msk, k.shape[0])
    check_cu_seqlens_pair((n_cuq, cuq, q.shape[0], n_tq, msq, n_msq, True),
                          (n_cuk, cuk, k.shape[0], n_tk if block_table is None else
                           "the rows block_table can hold", msk, n_msk, block_table is None))
    lse = return_attn_probs is not None and check_flag("return_attn_probs", return_attn_probs)  # (None: False)
    # The kernels' grids span max_seqlen rows per sequence: bounded by the total (a larger bound only adds
    # empty programs); a 0-dim tensor max_seqlen (checked above, on the device) uses the total, so no
    # host sync and nothing data-dependent for torch.compile.
    grid_q = q.shape[0] if isinstance(msq, torch.Tensor) else msq
    grid_k = k.shape[0] if isinstance(msk, torch.Tensor) else msk
    scale = resolve_scale("softmax_scale", softmax_scale, q.shape[-1])
    if (not lse and alibi_slopes is None and type(dropout_p) is float and dropout_p == 0.0
            and type(causal) is bool and (backend is None or type(backend) is str)):
        out = _attention_lane.varlen(q, k, v, cuq, cuk, grid_q, grid_k, scale, causal, _lane_window(window_size),
                                     _lane_softcap(softcap), backend)  # planned once per signature
        if out is not None:
            return out
    mods = _score_mods(cuq.shape[0] - 1, q.shape[1], q, dropout_p=dropout_p, softcap=softcap,
                       alibi_slopes=alibi_slopes)
    probs = lse and _with_probs(mods)
    if probs:  # probs are (nseq, Hq, max_seqlen_q, max_seqlen_k), as flash-attn's: a tensor is read
        grid_q, grid_k = min(int(msq), q.shape[0]), min(int(msk), k.shape[0])
    q4, k4, v4 = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)  # (1, total, H, D): the op reads them as bshd
    res = _run(q4, k4, v4, scale=scale, causal=check_flag("causal", causal), bottom_right=True, backend=backend,
               return_lse=lse, return_probs=probs,
               window=check_window("window_size", window_size), cu_seqlens_q=cuq, cu_seqlens_k=cuk,
               max_seqlen_q=grid_q, max_seqlen_k=grid_k, bshd=True, **mods)
    # squeeze, not [0]: select's backward writes the gradient into a zero-filled (1, total, H, D) copy
    if lse:  # (total_q, Hq, Dv), (Hq, total_q), (nseq, Hq, Mq, Mk) or None (flash_attn_func's rule)
        return res[0].squeeze(0), res[1].squeeze(0), res[2] if probs else None
    return res.squeeze(0)  # (total_q, Hq, Dv)


def unpad_input(hidden_states, attention_mask, unused_mask=None):
    """flash-attn's ``bert_padding.unpad_input``: padded (B, S, ...) -> packed (total, ...).

    attention_mask: (B, S) bool or int, nonzero = real token (any position: left padding too).
    unused_mask: None or (B, S) bool or int, nonzero = a slot that is allocated but unused: packed too
        (as flash-attn's), and counted in cu_seqlens and max_seqlen but not in seqused.
    Returns (packed (total, ...), indices (total,) int64 into the flattened (B * S) positions,
    cu_seqlens (B + 1,) int32, max_seqlen int (one device sync), seqused (B,) int32: the tokens
    attention_mask selects). Differentiable in hidden_states. Under torch.compile(fullgraph=True) the total and
    max_seqlen are read on the device: set torch._dynamo.config.capture_dynamic_output_shape_ops and
    capture_scalar_outputs, and flashtx's RoPE, varlen attention and SwiGLU trace over them.
    """
    if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() < 2:
        got = tuple(hidden_states.shape) if isinstance(hidden_states, torch.Tensor) else type(hidden_states).__name__
        raise ValueError(f"hidden_states must be a (B, S, ...) tensor; got {got}")
    B, S = hidden_states.shape[:2]
    if not isinstance(attention_mask, torch.Tensor) or tuple(attention_mask.shape) != (B, S):
        got = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else type(attention_mask).__name__
        raise ValueError(f"attention_mask must be a (B, S) = ({B}, {S}) tensor (nonzero = real token); got {got}")
    if attention_mask.device != hidden_states.device:
        raise ValueError(f"attention_mask must be on hidden_states' device {hidden_states.device}; got "
                         f"{attention_mask.device}")
    real = attention_mask != 0  # (B, S) bool: counts and positions agree for any mask dtype
    seqused = real.sum(dim=-1, dtype=torch.int32)  # (B,)
    seqlens = seqused
    if unused_mask is not None:
        if not isinstance(unused_mask, torch.Tensor) or tuple(unused_mask.shape) != (B, S):
            got = tuple(unused_mask.shape) if isinstance(unused_mask, torch.Tensor) else type(unused_mask).__name__
            raise ValueError(f"unused_mask must be None or a (B, S) = ({B}, {S}) tensor (nonzero = allocated but "
                             f"unused); got {got}")
        if unused_mask.device != hidden_states.device:
            raise ValueError(f"unused_mask must be on hidden_states' device {hidden_states.device}; got "
                             f"{unused_mask.device}")
        real = real | (unused_mask != 0)  # (B, S)
        seqlens = real.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(real.flatten(), as_tuple=False).flatten()
    max_seqlen = int(seqlens.max().item()) if seqlens.numel() else 0
    cu_seqlens = torch.nn.functional.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    flat = hidden_states.reshape(-1, *hidden_states.shape[2:])  # (B * S, ...)
    return flat[indices], indices, cu_seqlens, max_seqlen, seqused


def pad_input(hidden_states, indices, batch, seqlen):
    """flash-attn's ``bert_padding.pad_input``: packed (total, ...) -> padded (batch, seqlen, ...),
    zeros at padding positions. Inverse of unpad_input; differentiable in hidden_states.

    hidden_states (total, ...); indices (total,) int64 into the flattened (batch * seqlen) positions (unpad_input's),
    each in [0, batch * seqlen): on CPU a ValueError names one that is not; on a GPU, as torch's indexing (and
    flash-attn's pad_input), an index past the end is a device-side assert and a negative one counts from the end."""
    if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() < 1:
        got = tuple(hidden_states.shape) if isinstance(hidden_states, torch.Tensor) else type(hidden_states).__name__
        raise ValueError(f"hidden_states must be a (total, ...) tensor; got {got}")
    for name, n in (("batch", batch), ("seqlen", seqlen)):
        if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 0:
            raise ValueError(f"{name} must be an int >= 0; got {n!r}")
    total = hidden_states.shape[0]
    if not isinstance(indices, torch.Tensor) or indices.dtype not in (torch.int64, torch.int32) or \
            tuple(indices.shape) != (total,):
        got = f"{indices.dtype} of shape {tuple(indices.shape)}" if isinstance(indices, torch.Tensor) else \
            type(indices).__name__
        raise ValueError(f"indices must be a (total,) = ({total},) int64 tensor (unpad_input's); got {got}")
    if indices.device != hidden_states.device:
        raise ValueError(f"indices must be on hidden_states' device {hidden_states.device}; got {indices.device}")
    if total > batch * seqlen:
        raise ValueError(f"hidden_states holds {total} tokens, more than batch * seqlen = {batch} * {seqlen} positions")
    if _values_readable(indices) and indices.numel():  # (readable first: while tracing, total may be unbacked)
        lo, hi = int(indices.min()), int(indices.max())
        if lo < 0 or hi >= batch * seqlen:
            raise ValueError(f"indices must lie in [0, batch * seqlen = {batch * seqlen}) (unpad_input's positions); "
                             f"got values in [{lo}, {hi}]")
    out = hidden_states.new_zeros(batch * seqlen, *hidden_states.shape[1:])
    out = out.index_put((indices,), hidden_states)
    return out.reshape(batch, seqlen, *hidden_states.shape[1:])
