"""The public functions of flashtx.cuda_ext (import them from there): thin wrappers over the
torch.ops.flashtx_cuda ops that check arguments in Python, fill defaults and pick num_splits."""
from __future__ import annotations

import functools

import torch

from . import cuda_ext as _ext


def _ops():
    """The extension's ops (one place, so that CPU tests can stand the float64 references in)."""
    return torch.ops.flashtx_cuda


def _require(op: str, q: torch.Tensor) -> None:
    if not _ext.load():
        raise RuntimeError(f"flashtx.cuda_ext.{op}: the CUDA extension is not available: {_ext.unavailable_reason()}")
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"flashtx.cuda_ext.{op}: q must be a tensor; got {type(q).__name__}")
    if q.device.type not in _ext.DEVICE_TYPES:
        raise ValueError(f"flashtx.cuda_ext.{op}: q must be a CUDA tensor; got device {q.device}")


def _check_tensors(op: str, q: torch.Tensor, required: dict, optional: dict) -> None:
    """Tensors where tensors go (None only for the optional ones), and the optional ones on q's device: the
    binding reads them there (cuda_ext's shape checks compare the caches', k's and v's devices with q's;
    cache_seqlens is moved by _lens)."""
    for name, t in (*required.items(), *optional.items()):
        if not isinstance(t, torch.Tensor) and not (t is None and name in optional):
            raise TypeError(f"flashtx.cuda_ext.{op}: {name} must be a tensor{' or None' if name in optional else ''}; "
                            f"got {type(t).__name__}")
    for name, t in optional.items():
        if t is not None and t.device != q.device:
            raise ValueError(f"flashtx.cuda_ext.{op}: {name} must be on {q.device} like q; got {t.device}")


@functools.lru_cache(maxsize=None)
def _sm_resources(index: int) -> tuple[int, int, int, int]:
    """(SMs, threads, registers, shared memory bytes a multiprocessor) of CUDA device `index`."""
    props = torch.cuda.get_device_properties(index)
    # (regs_per_multiprocessor: recent CUDA builds of torch have it; 64 K 32-bit registers on every sm_80+ GPU)
    return (props.multi_processor_count, props.max_threads_per_multi_processor,
            getattr(props, "regs_per_multiprocessor", 65536), props.shared_memory_per_multiprocessor)


def _split_slots(index: int, elt: int, d: int, group_rows: int) -> tuple[int, int]:
    """(SMs, decode blocks each runs at once) for choose_num_splits."""
    sms, threads, regs, smem = _sm_resources(index)
    return sms, _ext.decode_ctas_per_sm(elt, d, _ext.rows_per_cta(group_rows), threads, regs, smem)


def _lens(op: str, cache_seqlens, batch: int, device, check_values: bool = False) -> torch.Tensor:
    """cache_seqlens as a (B,) int32 tensor on device (an int is broadcast; int64 is converted: with check_values
    its values are first checked to fit int32, as the binding then checks them against the capacity)."""
    if isinstance(cache_seqlens, int):
        if not 0 <= cache_seqlens <= _ext.INT32_MAX:
            raise ValueError(f"flashtx.cuda_ext.{op}: cache_seqlens must lie in [0, 2**31 - 1]; got {cache_seqlens}")
        return torch.full((batch,), cache_seqlens, dtype=torch.int32, device=device)
    if not isinstance(cache_seqlens, torch.Tensor) or cache_seqlens.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"flashtx.cuda_ext.{op}: cache_seqlens must be an int or an int32/int64 tensor; got "
                        f"{getattr(cache_seqlens, 'dtype', type(cache_seqlens).__name__)}")
    if check_values and cache_seqlens.dtype == torch.int64 and cache_seqlens.numel():
        lo, hi = int(cache_seqlens.min()), int(cache_seqlens.max())
        if lo < 0 or hi > _ext.INT32_MAX:
            raise ValueError(f"flashtx.cuda_ext.{op}: cache_seqlens must lie in [0, 2**31 - 1] (int32 positions); "
                             f"got values in [{lo}, {hi}]")
    return cache_seqlens.to(device=device, dtype=torch.int32).contiguous()


def _check_writes(q, k, v, k_cache, v_cache, paged: bool) -> None:
    """The front end's checks of an append's writes (flashtx.flash_attn_with_kvcache): caches whose slots share
    memory (an expanded view), and k_cache/v_cache or q/k/v sharing memory with a cache (the kernel's writes would
    race: which value lands depends on scheduling)."""
    from .decode import _check_writable_caches, _overlap_message, append_overlap

    _check_writable_caches(k_cache, v_cache, paged)
    pair = append_overlap(q, k, v, k_cache, v_cache)
    if pair is not None:
        raise ValueError("flashtx.cuda_ext.rotary_append: " + _overlap_message(*pair))


def decode_attention(q, k_cache, v_cache, cache_seqlens, *, block_table=None, cache_batch_idx=None,
                     softmax_scale=None, causal=False, num_splits=0, return_lse=False, check_values=False):
    """Attention of a few new queries over a contiguous or paged KV cache (split-KV, GQA-packed).

    flash-attn 2's flash_attn_with_kvcache without the append (see rotary_append and
    flash_attn_with_kvcache here for that).

    Args:
        q: (B, Sq, Hq, D) CUDA tensor, float16, bfloat16 or float32, D = 64 or 128, last dim
            contiguous; Sq small (1..4 is what the kernel is laid out for; B, Sq, Hq <= 65535, and the
            Hkv x ceil((Hq / Hkv) * Sq / rows) blocks of the grid too, rows 8 or 32: cuda_ext.grid_reason).
        k_cache, v_cache: (B_cache, S_cache, Hkv, D) contiguous caches, or with block_table paged
            (num_blocks, page_size, Hkv, D); q's dtype; Hq a multiple of Hkv (GQA/MQA).
        cache_seqlens: (B,) int32 (int64 is converted) or an int: batch row b attends to keys
            [0, cache_seqlens[b]).
        block_table: (B, max_blocks) int32: key position p of row b is in page
            block_table[b, p // page_size], slot p % page_size. Capacity max_blocks * page_size.
        cache_batch_idx: (B,) int32: the cache row of batch row b (contiguous caches only).
        softmax_scale: default D ** -0.5.
        causal: bottom-right aligned: query i sees keys j <= cache_seqlens[b] - Sq + i.
        num_splits: 0 chooses (choose_num_splits: flash-attn's heuristic over this GPU's resident blocks);
            1..128 forces.
        return_lse: also return the log-sum-exp (B, Hq, Sq) float32 (natural log).
        check_values: check cache_seqlens, block_table and cache_batch_idx values on the host (one
            device sync). Without it, out-of-range values are guarded in the kernel: keys of an
            invalid page or cache row are masked, lengths are clamped to [0, capacity].

    Returns:
        out (B, Sq, Hq, D) in q's dtype, and lse if return_lse. A row with no key to attend to
        (cache_seqlens[b] == 0, or causal with Sq > cache_seqlens[b]) gives out 0 and lse -inf.
    """
    _require("decode_attention", q)
    _check_tensors("decode_attention", q, dict(k_cache=k_cache, v_cache=v_cache),
                   dict(block_table=block_table, cache_batch_idx=cache_batch_idx))
    lens = _lens("decode_attention", cache_seqlens, q.shape[0], q.device, check_values)
    cap = _ext.check_decode_args(q, k_cache, v_cache, lens, block_table, cache_batch_idx, num_splits or 1)
    if softmax_scale is None:
        softmax_scale = q.shape[-1] ** -0.5
    if num_splits == 0:
        batch, sq, hq, _ = q.shape
        sms, per_sm = _split_slots(q.device.index or 0, q.element_size(), q.shape[3], (hq // k_cache.shape[2]) * sq)
        num_splits = _ext.choose_num_splits(batch, hq, k_cache.shape[2], sq, cap, sms, per_sm)
    out, lse = _ops().decode_attention(q, k_cache, v_cache, lens, block_table, cache_batch_idx,
                                                       float(softmax_scale), bool(causal), int(num_splits),
                                                       bool(check_values))
    return (out, lse) if return_lse else out


def rotary_append(q, k, v, k_cache, v_cache, cache_seqlens, *, cos=None, sin=None, interleaved=False,
                  q_causal=True, block_table=None, cache_batch_idx=None, check_values=False):
    """Rotate q and the new k by RoPE and write the new k and v into the KV cache, in one launch.

    vLLM's rotary_embedding + reshape_and_cache_flash; flash-attn's flash_attn_with_kvcache with
    k, v, rotary_cos, rotary_sin. k_cache and v_cache are written in place.

    Args:
        q: (B, Sq, Hq, D) CUDA tensor, float16, bfloat16 or float32, D = 64 or 128.
        k, v: (B, Sq, Hkv, D) new keys and values, q's dtype; token i of row b goes to cache
            position cache_seqlens[b] + i.
        k_cache, v_cache: as in decode_attention (contiguous, or paged with block_table).
        cache_seqlens: (B,) int32 or int: the lengths before the append (not updated here).
        cos, sin: (S_rot, rotary_dim / 2), float32 or q's dtype, contiguous, S_rot >= cache
            capacity; rotary_dim a multiple of 16 (fp16/bf16) or 8 (fp32), <= D; columns past it
            pass through. None: append without rotating (q is returned as a copy).
        interleaved: False rotates (x[j], x[j + rotary_dim/2]) (NeoX/LLaMA); True rotates
            (x[2j], x[2j+1]) (GPT-J).
        q_causal: True rotates query i at cache_seqlens[b] + i; False at cache_seqlens[b] for every
            i (flash-attn does this when not causal).
        check_values: check cache_seqlens + Sq <= capacity, block_table and cache_batch_idx values
            on the host (one sync). Without it, writes to out-of-range positions/pages are dropped.

    Caches whose slots share memory (an expanded view), k_cache and v_cache sharing memory, or q, k, v
    sharing memory with a cache are refused (ValueError), as flashtx.flash_attn_with_kvcache refuses them.

    Returns:
        q rotated, (B, Sq, Hq, D) contiguous, q's dtype.
    """
    _require("rotary_append", q)
    _check_tensors("rotary_append", q, dict(k=k, v=v, k_cache=k_cache, v_cache=v_cache),
                   dict(cos=cos, sin=sin, block_table=block_table, cache_batch_idx=cache_batch_idx))
    lens = _lens("rotary_append", cache_seqlens, q.shape[0], q.device, check_values)
    _ext.check_rotary_append_args(q, k, v, k_cache, v_cache, cos, sin, lens, block_table, cache_batch_idx)
    if not (torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack()):  # (addresses: eager only)
        _check_writes(q, k, v, k_cache, v_cache, block_table is not None)
    return _ops().rotary_append(q, k, v, k_cache, v_cache, cos, sin, lens, block_table,
                                                cache_batch_idx, bool(interleaved), bool(q_causal),
                                                bool(check_values))


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, block_table=None, softmax_scale=None,
                            causal=False, rotary_interleaved=True, num_splits=0, return_softmax_lse=False, *,
                            check_values=False):
    """flash-attn 2's flash_attn_with_kvcache through the extension: optional RoPE + append of k, v
    at cache_seqlens (rotary_append), then attention over cache_seqlens + Sq keys (decode_attention).

    Same arguments and defaults as flash-attn (rotary_interleaved=True), without window_size,
    softcap and alibi_slopes; k and v, if given, must have q's Sq. cache_seqlens None means the
    whole contiguous cache (a paged cache, or an append, needs it). Returns out (B, Sq, Hq, D)
    [, lse (B, Hq, Sq) float32]. k_cache and v_cache are updated in place; cache_seqlens is not.
    """
    op = "flash_attn_with_kvcache"
    if (k is None) != (v is None):
        raise ValueError(f"flashtx.cuda_ext.{op}: pass both k and v, or neither")
    if rotary_cos is not None and k is None:
        raise ValueError(f"flashtx.cuda_ext.{op}: rotary_cos/rotary_sin need the new k and v to append")
    _require(op, q)
    _check_tensors(op, q, dict(k_cache=k_cache, v_cache=v_cache),
                   dict(k=k, v=v, rotary_cos=rotary_cos, rotary_sin=rotary_sin, block_table=block_table,
                        cache_batch_idx=cache_batch_idx))
    if cache_seqlens is None:
        if block_table is not None or k is not None:
            raise ValueError(f"flashtx.cuda_ext.{op}: cache_seqlens is needed with a paged cache (block_table) "
                             "or new k, v to append")
        cache_seqlens = k_cache.shape[1]
    lens = _lens(op, cache_seqlens, q.shape[0], q.device, check_values)
    if k is not None:
        if k.dim() != 4 or k.shape[1] != q.shape[1]:
            raise ValueError(f"flashtx.cuda_ext.{op}: k must be (B, Sq, Hkv, D) with q's Sq = {q.shape[1]}; got "
                             f"{tuple(k.shape)}")
        _ext.check_decode_args(q, k_cache, v_cache, lens, block_table, cache_batch_idx, num_splits or 1)  # (the
        # attention's shape checks, the grid's included, before the append writes the caches)
        q_rot = rotary_append(q, k, v, k_cache, v_cache, lens, cos=rotary_cos, sin=rotary_sin,
                              interleaved=rotary_interleaved, q_causal=causal, block_table=block_table,
                              cache_batch_idx=cache_batch_idx, check_values=check_values)
        q = q_rot if rotary_cos is not None else q
        lens = lens + k.shape[1]
    return decode_attention(q, k_cache, v_cache, lens, block_table=block_table, cache_batch_idx=cache_batch_idx,
                            softmax_scale=softmax_scale, causal=causal, num_splits=num_splits,
                            return_lse=return_softmax_lse, check_values=check_values)


# ---------------------------------------------------------------------------------------------
# Backend "cuda" of flashtx's decode ops (flashtx._decode_op: kvcache_append, kvcache_attention)
# ---------------------------------------------------------------------------------------------

_LN2 = 0.6931471805599453


def _vec_ok(t: torch.Tensor) -> bool:
    """The binding's layout rule for a tensor it reads/writes with 16-byte vectors. Alignment from
    the storage offset (allocations are 16-byte aligned), not data_ptr(): fake tensors have none."""
    vec = 16 // t.element_size()
    return (t.stride(-1) == 1 and t.storage_offset() % vec == 0
            and all(t.stride(d) % vec == 0 or t.shape[d] == 1 for d in range(t.dim() - 1)))


def _int32(t):
    return None if t is None else t.to(torch.int32).contiguous()


def _vec(t):
    return t if _vec_ok(t) else t.contiguous()


class DecodeCUDA:
    """The extension as flashtx's decode backend "cuda": flashtx.flash_attn_with_kvcache(...,
    backend="cuda"). Explicit only until MEASURED_FASTER; features the kernels lack (softcap,
    ALiBi, sliding windows, cache_leftpad, Dv != D, RoPE without an append or with Snew != Sq,
    rotary tables shorter than the cache) are refused in not_supported_reasons, never approximated.

    Its reasons depend on the call (DecodeInputs.call), not only on (device, dtype, head dims):
    call_key() is what _decode_op.select adds to the plan key for backend="cuda"."""

    name = "cuda"

    @staticmethod
    def call_key(q, k_cache, v_cache, call) -> tuple:
        """Everything of the call (beyond device, dtype and head dims) that the reasons read."""
        k, cos = call.get("k"), call.get("rotary_cos")
        return (k is None, None if k is None else k.shape[1] == q.shape[1],
                None if cos is None else (tuple(cos.shape), cos.dtype, cos.shape[0] >= call["capacity"]),
                call.get("cache_leftpad") is not None, call.get("alibi") is not None,
                tuple(call.get("window", (-1, -1))), float(call.get("softcap", 0.0)) > 0,
                _vec_ok(k_cache) and _vec_ok(v_cache), _ext.grid_reason(q, k_cache))

    def not_supported_reasons(self, inp) -> list[str]:
        automatic = getattr(inp, "automatic", True)
        q, kc, vc = inp.q, inp.k_cache, inp.v_cache
        reasons = _ext.not_supported_reasons(q, kc, automatic=automatic)
        if vc.shape[-1] != kc.shape[-1]:
            reasons.append(f"v head dim {vc.shape[-1]} differs from k's {kc.shape[-1]} (the kernels need Dv = D)")
        grid = _ext.grid_reason(q, kc) if q.dim() == 4 and kc.dim() == 4 else None
        if grid is not None:  # (refused here, before the append writes the caches; the binding says the same)
            reasons.append(grid)
        if kc.is_floating_point() and not (_vec_ok(kc) and _vec_ok(vc)):
            reasons.append("k_cache/v_cache strides are not multiples of 16 bytes (or the data is not 16-byte "
                           "aligned): the kernels write the cache in place with 16-byte vectors")
        call = getattr(inp, "call", None) or {}
        if float(call.get("softcap", 0.0)) > 0:
            reasons.append("softcap is not implemented by the CUDA kernels")
        if call.get("alibi") is not None:
            reasons.append("alibi_slopes are not implemented by the CUDA kernels")
        if tuple(call.get("window", (-1, -1))) != (-1, -1):
            reasons.append("window_size (sliding window) is not implemented by the CUDA kernels")
        if call.get("cache_leftpad") is not None:
            reasons.append("cache_leftpad is not implemented by the CUDA kernels")
        k, cos = call.get("k"), call.get("rotary_cos")
        if k is not None and k.shape[1] != q.shape[1]:
            reasons.append(f"appending Snew = {k.shape[1]} tokens with Sq = {q.shape[1]} queries: the CUDA append "
                           "kernel needs Snew = Sq")
        if cos is not None:
            if k is None:
                reasons.append("rotary_cos/rotary_sin without new k, v: the CUDA kernel rotates q only within an "
                               "append")
            rd, vec = 2 * cos.shape[1], 16 // q.element_size()
            if rd % (2 * vec):
                reasons.append(f"rotary_dim {rd} is not a multiple of {2 * vec} (the CUDA kernel's vector width "
                               f"for {q.dtype})")
            if cos.shape[0] < call["capacity"]:
                reasons.append(f"rotary_cos/rotary_sin have {cos.shape[0]} rows for a cache capacity of "
                               f"{call['capacity']}: the CUDA kernel needs one for every cache position")
        return reasons

    @staticmethod
    def _refuse_unimplemented(**features) -> None:
        # reached only if a plan key missed a feature: refuse rather than compute something else
        used = [n for n, on in features.items() if on]
        if used:
            from ._dispatch import BackendNotSupported

            raise BackendNotSupported(f"backend 'cuda' does not implement {', '.join(used)}")

    def append(self, q, q_out, k, v, k_cache, v_cache, cos, sin, seqlens, batch_idx, block_table, *,
               interleaved, q_same_pos):
        self._refuse_unimplemented(**{"RoPE without an append": k is None,
                                      "Snew != Sq": k is not None and k.shape[1] != q.shape[1]})
        if k.numel() == 0 and q.numel() == 0:  # nothing to write or rotate (B or Sq is 0; the binding would
            return  # refuse the empty cache of a B = 0 call, which the Triton backend takes)
        if cos is not None:
            if cos.dtype not in (torch.float32, q.dtype):
                cos, sin = cos.float(), sin.float()  # the Triton kernel reads the tables in fp32 too
            cos, sin = cos.contiguous(), sin.contiguous()
        q_rot = rotary_append(_vec(q), _vec(k), _vec(v), k_cache, v_cache, _int32(seqlens), cos=cos, sin=sin,
                              interleaved=interleaved, q_causal=not q_same_pos, block_table=_int32(block_table),
                              cache_batch_idx=_int32(batch_idx))
        if q_out is not None:
            q_out.copy_(q_rot)

    def attention(self, q, k_cache, v_cache, out, lse2, seqlens, leftpad, batch_idx, block_table, alibi, *,
                  scale, causal, window=(-1, -1), softcap=0.0, num_splits=0, snew=0, key_mask=None):
        self._refuse_unimplemented(cache_leftpad=leftpad is not None, alibi_slopes=alibi is not None,
                                   window_size=tuple(window) != (-1, -1), softcap=softcap > 0,
                                   key_mask=key_mask is not None)
        if q.numel() == 0:  # an empty output (B, Sq or Hq is 0): nothing to launch, as the Triton backend
            return
        if seqlens is None:  # the keys are the cache's first snew positions (kvcache_attention without lengths)
            seqlens = torch.zeros(q.shape[0], dtype=torch.int32, device=q.device)
        if snew:  # the keys end after the tokens just appended
            seqlens = seqlens + snew
        o, lse = decode_attention(_vec(q), k_cache, v_cache, _int32(seqlens), block_table=_int32(block_table),
                                  cache_batch_idx=_int32(batch_idx), softmax_scale=scale, causal=causal,
                                  num_splits=min(int(num_splits), _ext.MAX_SPLITS), return_lse=True)
        out.copy_(o)
        torch.mul(lse, 1.0 / _LN2, out=lse2)  # natural log -> flashtx's log2 units (-inf stays -inf)
