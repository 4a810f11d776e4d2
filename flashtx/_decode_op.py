"""The KV-cache decoding ops, their backends and the eager reference.

Two `flashtx._library.triton_op`s, so that under torch.compile the cache write is an explicit
mutation and the attention a pure function of the written cache:

- `flashtx::kvcache_append` (mutates k_cache, v_cache): writes new k (rotated by the RoPE tables
  when given) and v at positions cache_seqlens[b] + t, and returns q rotated (an empty tensor when
  there are no tables: use q itself).
- `flashtx::kvcache_attention`: attention of q over each sequence's keys [cache_leftpad[b],
  cache_seqlens[b] + snew) of the (contiguous or paged) cache (snew: the tokens just appended; without
  cache_seqlens, the first snew positions: flashtx._small_q's attention over a whole K/V tensor), the
  keys where key_mask (B, Sq | 1, capacity) uint8 (a row per query, or one for all) is nonzero when given
  (contiguous caches; flashtx._small_q);
  returns (out, lse2) with lse2 in log2 units; out (B, Sq, Hq, Dv), or with heads_first its (B, Hq, Sq, Dv)
  transpose as a tensor of its own (SDPA's shape for flashtx._small_q: a transposed view of the op's output,
  returned from a compiled function, makes torch 2.15's AOT autograd compare its sizes with its base's, and
  guard the graph on the query count differing from the head count: a recompile where they meet).
- `flashtx::kvcache_check`: the index check on the device (triton_kernels/decode_check.py): a (1,)
  int32 flag, 1 when every index the other two would follow is in range, for torch._assert_async.

Layouts and alignment: see flashtx.triton_kernels.decode_kernels. Inference only: no autograd formula
is registered (flashtx.flash_attn_with_kvcache refuses inputs that require grad).
"""
from __future__ import annotations

import dataclasses
import functools
import operator
from typing import Optional

import torch
from torch import Tensor

from . import _dispatch, reference
from ._library import triton_op
from .backends import MAX_HEAD_DIM, triton_device_reasons
from .triton_kernels.precision import TORCH_ACC_DTYPE



@dataclasses.dataclass(frozen=True)
class DecodeInputs(_dispatch.OpInputs):
    q: Tensor
    k_cache: Tensor
    v_cache: Tensor
    call: Optional[dict] = None  # the call's other arguments, for backends that read them ("cuda")
    automatic: bool = True  # backend=None (False: asked for by name)


class DecodeTriton:
    """flashtx's Triton kernels (triton_kernels/decode_kernels.py, launched by triton_kernels/decode.py): CUDA
    tensors, or CPU in the interpreter."""

    name = "triton"

    def not_supported_reasons(self, inp: DecodeInputs) -> list[str]:
        reasons = triton_device_reasons(inp.device, inp.dtype)
        d = max(inp.q.shape[-1], inp.v_cache.shape[-1])
        if d > MAX_HEAD_DIM:
            reasons.append(f"head dim {d} is above {MAX_HEAD_DIM}")
        return reasons

    @functools.cached_property
    def kernels(self):  # imported once, on first use (never without triton)
        from .triton_kernels import decode

        return decode

    @functools.cached_property
    def checks(self):
        from .triton_kernels import decode_check

        return decode_check

    def append(self, q, q_out, k, v, k_cache, v_cache, cos, sin, seqlens, batch_idx, block_table, *,
               interleaved, q_same_pos):
        self.kernels.kv_append(q, q_out, k, v, k_cache, v_cache, cos, sin, seqlens, batch_idx, block_table,
                               interleaved=interleaved, q_same_pos=q_same_pos)

    def attention(self, q, k_cache, v_cache, out, lse2, seqlens, leftpad, batch_idx, block_table, alibi, **kw):
        self.kernels.decode_attention(q, k_cache, v_cache, out, lse2, seqlens, leftpad, batch_idx, block_table,
                                      alibi, **kw)


def _positions(block_table, batch_idx, B: int, pos: Tensor, page: int, device):
    """(first index, second index) of logical positions pos (B, N) in a (pages|rows, S, H, D) cache."""
    if block_table is not None:
        pages = block_table.long().gather(1, (pos // page).clamp(0, block_table.shape[1] - 1))  # (B, N)
        return pages, pos % page
    rows = batch_idx.long() if batch_idx is not None else torch.arange(B, device=device)
    return rows[:, None].expand_as(pos), pos


class DecodeReference:
    """Eager PyTorch, vectorised (no host reads, so it traces too); any device and float dtype.
    Gathers each sequence's whole capacity: O(B x capacity) memory, for tests and fallbacks."""

    name = "reference"

    def not_supported_reasons(self, inp: DecodeInputs) -> list[str]:
        return []

    def append(self, q, q_out, k, v, k_cache, v_cache, cos, sin, seqlens, batch_idx, block_table, *,
               interleaved, q_same_pos):
        B, Sq, Hq, D = q.shape
        dev = q.device
        base = seqlens.long()[:, None]  # (B, 1)
        page = k_cache.shape[1]
        if cos is not None and Sq:
            qpos = base + (0 if q_same_pos else torch.arange(Sq, device=dev)[None, :])  # (B, Sq)
            tables = torch.zeros(B * Sq, dtype=torch.long, device=dev)
            rot = reference.rotary_tokens(q.reshape(B * Sq, Hq, D), cos[None], sin[None], tables,
                                          qpos.expand(B, Sq).reshape(-1), interleaved=interleaved)
            q_out.copy_(rot.view(B, Sq, Hq, D))
        if k is None or k.shape[1] == 0:
            return
        Snew, Hkv = k.shape[1], k.shape[2]
        pos = base + torch.arange(Snew, device=dev)[None, :]  # (B, Snew)
        if cos is not None:
            tables = torch.zeros(B * Snew, dtype=torch.long, device=dev)
            k = reference.rotary_tokens(k.reshape(B * Snew, Hkv, D), cos[None], sin[None], tables, pos.reshape(-1),
                                        interleaved=interleaved).view(B, Snew, Hkv, D)
        i0, i1 = _positions(block_table, batch_idx, B, pos, page, dev)
        k_cache.index_put_((i0, i1), k)
        v_cache.index_put_((i0, i1), v)

    def attention(self, q, k_cache, v_cache, out, lse2, seqlens, leftpad, batch_idx, block_table, alibi, *,
                  scale, causal, window=(-1, -1), softcap=0.0, num_splits=0, snew=0, key_mask=None):
        B, Sq, Hq, D = q.shape
        dev = q.device
        page = k_cache.shape[1]
        cap = block_table.shape[1] * page if block_table is not None else k_cache.shape[1]
        j = torch.arange(cap, device=dev)
        i0, i1 = _positions(block_table, batch_idx, B, j[None, :].expand(B, cap), page, dev)
        if block_table is not None:
            i0 = i0.clamp(0, k_cache.shape[0] - 1)  # unused table entries may hold anything
        acc = TORCH_ACC_DTYPE[q.dtype]
        k = k_cache[i0, i1].to(acc).transpose(1, 2)  # (B, Hkv, cap, D)
        v = v_cache[i0, i1].to(acc).transpose(1, 2)
        qh = q.to(acc).transpose(1, 2)  # (B, Hq, Sq, D)
        end = (seqlens.long()[:, None, None] if seqlens is not None else torch.zeros(
            B, 1, 1, dtype=torch.long, device=dev)) + snew  # (B, 1, 1)
        start = leftpad.long()[:, None, None] if leftpad is not None else torch.zeros_like(end)
        qpos = end - Sq + torch.arange(Sq, device=dev)[None, :, None]  # (B, Sq, 1) bottom-right
        jj = j[None, None, :]
        vis = (jj >= start) & (jj < end)  # (B, Sq, cap)
        if key_mask is not None:  # (B, Sq | 1, cap), nonzero = visible
            vis = vis & (key_mask != 0)
        left, right = (int(x) for x in window)
        if causal:
            right = 0
        if right >= 0:
            vis = vis & (jj <= qpos + right)
        if left >= 0:
            vis = vis & (jj >= qpos - left)
        bias = None
        if alibi is not None:
            bias = -alibi.to(acc).reshape(-1, Hq)[:, :, None, None] * (qpos - jj).abs()[:, None].to(acc)
        with reference.exact(dev):
            o, lse = reference.attention(qh, k, v, scale=scale, vis=vis, softcap=softcap, alibi=bias,
                                         return_lse=True)
        out.copy_(o.transpose(1, 2))
        lse2.copy_(lse / reference.LN2)


_TRITON = DecodeTriton()
for _op in ("kvcache_append", "kvcache_attention"):
    _dispatch.register(_op, "triton", _TRITON)
    _dispatch.register(_op, "reference", DecodeReference())
from . import cuda_ext  # noqa: E402,F401  registers the CUDA extension as "cuda", explicit only until measured
IMPLS = _dispatch.IMPLS["kvcache_attention"]
CALL_JUDGED = frozenset(n for n, impl in IMPLS.items() if hasattr(impl, "call_key"))  # see select


def select(q: Tensor, k_cache: Tensor, v_cache: Tensor, backend: str | None, call: dict | None = None) -> str:
    """The backend name for these inputs (cached per device, dtype and head dims, plus the call_key of
    a backend whose reasons read the call: the one requested, or with backend=None and `call` given,
    the automatic choice when it is one of CALL_JUDGED).

    backend=None picks on kinds alone without `call`; where that pick is in CALL_JUDGED, the caller asks
    again with the call's features (flash_attn_with_kvcache does), so a feature that backend lacks (softcap,
    ALiBi, ...) sends the call to the next backend that can run it."""
    judged = IMPLS.get(backend) if backend is not None else (IMPLS[_select_kinds(q, v_cache, None)]
                                                            if call is not None else None)
    if call is not None and hasattr(judged, "call_key"):  # a backend whose reasons read the call
        key = (q.device.type, q.dtype, q.shape[-1], v_cache.shape[-1]) + judged.call_key(q, k_cache, v_cache, call)
        return _dispatch.plan("kvcache_attention", key, backend,
                              lambda: DecodeInputs(q, k_cache, v_cache, call, automatic=backend is None),
                              lambda: f"q {tuple(q.shape)} {q.dtype} on {q.device}, k_cache {tuple(k_cache.shape)}")
    return _select_kinds(q, v_cache, backend)


def _select_kinds(q: Tensor, v_cache: Tensor, backend: str | None) -> str:
    """select's common case: the choice depends only on the device, dtype and head dims (a constant under
    compile)."""
    dev = q.device
    if not torch.compiler.is_compiling():  # eager: plan_kinds's own cache entry, read directly
        name = _dispatch._PLANS.get(("kvcache_attention", backend, (dev.type, dev.index, q.dtype, q.shape[-1],
                                                                    v_cache.shape[-1])))
        if name is not None:
            return name
    # operator.index, not int(): under torch.compile with dynamic shapes it specializes a symbolic head dim (a
    # guard), where int() keeps it symbolic and the constant-result call could not take it (a graph break)
    return _dispatch.plan_kinds("kvcache_attention", backend, dev.type, dev.index, q.dtype,
                                operator.index(q.shape[-1]), operator.index(v_cache.shape[-1]))


def _standin(device, dtype, d: int, dv: int) -> DecodeInputs:
    """Inputs of these kinds for plan_kinds (automatic: the "cuda" backend's reasons refuse them)."""
    q, kc = (torch.empty(1, 16, 1, d, device=device, dtype=dtype) for _ in range(2))
    return DecodeInputs(q, kc, torch.empty(1, 16, 1, dv, device=device, dtype=dtype))


_dispatch.STANDINS["kvcache_attention"] = _standin


@triton_op("flashtx::kvcache_append", mutates_args=("k_cache", "v_cache"))
def kvcache_append(q: Tensor, k_cache: Tensor, v_cache: Tensor, k: Optional[Tensor], v: Optional[Tensor],
                   rotary_cos: Optional[Tensor], rotary_sin: Optional[Tensor], cache_seqlens: Tensor,
                   cache_batch_idx: Optional[Tensor], block_table: Optional[Tensor], rotary_interleaved: bool,
                   q_same_position: bool, backend: str) -> Tensor:
    q_out = torch.empty_like(q) if rotary_cos is not None else q.new_empty(0)
    IMPLS[backend].append(q, q_out if rotary_cos is not None else None, k, v, k_cache, v_cache, rotary_cos,
                          rotary_sin, cache_seqlens, cache_batch_idx, block_table, interleaved=rotary_interleaved,
                          q_same_pos=q_same_position)
    return q_out


def empty_out(B: int, Sq: int, Hq: int, Dv: int, heads_first: bool, dtype, device) -> tuple[Tensor, Tensor]:
    """(what kvcache_attention returns, the (B, Sq, Hq, Dv) view its kernels write): one (B, Sq, Hq, Dv) allocation,
    or with heads_first (B, Hq, Sq, Dv) laid out (B, Sq, Hq, Dv), a tensor of its own (see the module docstring)."""
    if not heads_first:
        out = torch.empty((B, Sq, Hq, Dv), dtype=dtype, device=device)
        return out, out
    out_h = torch.empty_strided((B, Hq, Sq, Dv), (Sq * Hq * Dv, Dv, Hq * Dv, 1), dtype=dtype, device=device)
    return out_h, out_h.transpose(1, 2)


@triton_op("flashtx::kvcache_attention", mutates_args=())
def kvcache_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_seqlens: Optional[Tensor],
                      cache_leftpad: Optional[Tensor], cache_batch_idx: Optional[Tensor],
                      block_table: Optional[Tensor], alibi_slopes: Optional[Tensor], key_mask: Optional[Tensor],
                      scale: float, causal: bool, window_left: int, window_right: int, softcap: float, num_splits: int,
                      snew: int, backend: str, heads_first: bool) -> tuple[Tensor, Tensor]:
    B, Sq, Hq, _ = q.shape
    out_h, out = empty_out(B, Sq, Hq, v_cache.shape[-1], heads_first, q.dtype, q.device)
    lse2 = q.new_empty((B, Hq, Sq), dtype=TORCH_ACC_DTYPE[q.dtype])
    kw = {} if key_mask is None else {"key_mask": key_mask}
    IMPLS[backend].attention(q, k_cache, v_cache, out, lse2, cache_seqlens, cache_leftpad, cache_batch_idx,
                             block_table, alibi_slopes, scale=scale, causal=causal,
                             window=(window_left, window_right), softcap=softcap, num_splits=num_splits, snew=snew,
                             **kw)
    return out_h, lse2


@triton_op("flashtx::kvcache_check", mutates_args=())
def kvcache_check(cache_seqlens: Tensor, cache_leftpad: Optional[Tensor], cache_batch_idx: Optional[Tensor],
                  block_table: Optional[Tensor], snew: int, capacity: int, rows: int, page: int, cos_rows: int,
                  q_extra: int, key_span: int) -> Tensor:
    """(1,) int32: 1 when every index is in range (see triton_kernels/decode_check.py). Triton only."""
    flag = torch.empty(1, dtype=torch.int32, device=cache_seqlens.device)
    if cache_seqlens.shape[0] == 0:
        return flag.fill_(1)
    _TRITON.checks.decode_check(flag, cache_seqlens, cache_leftpad, cache_batch_idx, block_table, snew=snew,
                                capacity=capacity, rows=rows, page=page, cos_rows=cos_rows, q_extra=q_extra,
                                key_span=key_span)
    return flag
