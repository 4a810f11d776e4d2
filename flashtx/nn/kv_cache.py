"""KV caches for incremental decoding: `KVCache` (contiguous buffers) and `PagedKVCache` (a page pool).

Both are read by flashtx.flash_attn_with_kvcache (split-KV Triton kernels) in MultiheadAttention.

Layouts. `KVCache` keeps (B, max_len, Hkv, D) buffers, flash-attn's layout, which the decode kernels
write and read as they are: under torch.compile a mutated view of a buffer (a transpose) is cloned and
copied back whole on every step, a buffer itself is written in place. ``cache.k`` / ``cache.v`` are
their (B, Hkv, max_len, D) views (SDPA's layout; strides, no copy). `PagedKVCache` keeps
flash-attn's paged layout, pools (num_pages, page_size, Hkv, D) plus a (B, max_pages_per_seq)
int32 block table, with pages handed out and taken back per sequence on the host.

Padding (a call's ``key_mask``, True = real token) is kept per sequence as flash-attn's
``cache_leftpad``: a sequence's leading padding is stored and hidden (its keys start at
``leftpad[b]``); positions stay cache indices, as in the uncached forward over the same padded
tokens. A `PagedKVCache` also takes trailing padding: those tokens are not kept (each sequence
advances by its own count, continuous batching). A `KVCache` mask with holes (padding after a
sequence's first real token) falls back to flash_attn_func over the stored mask (eager only).
"""
from __future__ import annotations

import numbers

import torch
from torch import Tensor

from .._library import device_assert
from ._cache_state import (_check_mask, _check_ok, _check_pos_int, _host_readable, _left_padded, _mask_runs,
                           _same_as, _Sealed, _stamp, _static)


class KVCache(_Sealed):
    """Preallocated key/value buffers of one attention layer, filled in place while decoding.

    Attributes:
        k: (B, Hkv, max_len, D) and v: (B, Hkv, max_len, Dv), in the layer's dtype: views of the
            (B, max_len, Hkv, D) buffers the layer writes (module docstring).
        key_mask: (B, max_len) bool, True = real token (padding given to the layer is stored False).
        length: 0-dim int64 tensor on the buffers' device: the number of positions filled.
        leftpad: (B,) int32: each sequence's first real position (flash-attn's cache_leftpad).
        holes: True once a stored key mask is not left padding (see below).

    ``KVCache(batch_size, num_kv_heads, max_len, head_dim, v_head_dim=None, *, dtype, device)``: zeroed
    buffers for batch_size sequences of up to max_len positions, num_kv_heads heads of head_dim (values:
    v_head_dim, default head_dim). Create one per layer with ``MultiheadAttention.new_cache`` (or
    ``TransformerBlock.new_cache``), which takes these from the layer;
    ``reset()`` empties it for a new batch, ``crop(n)`` keeps its first n positions (speculative decoding's
    rollback). Positions are shared by the batch: with left padding,
    every sequence's first real token sits at its own position, which RoPE does not notice (it
    only sees relative positions) and ``leftpad`` hides the padding from flash_attn_with_kvcache.
    A key mask whose row has padding after a real token (right padding followed by more tokens,
    holes) cannot be a leftpad: in eager mode the cache then sets ``holes`` and the layer attends
    through flash_attn_func over the stored key_mask; in a traced or captured step (where the
    mask's values cannot be read) it is a device-side assert. Eager calls with a key_mask read it
    on the host (a sync on a GPU); calls with key_mask=None do not, except after a compiled or captured
    step (until reset()), when each eager call reads `length` for its bounds check.
    """

    def __init__(self, batch_size: int, num_kv_heads: int, max_len: int, head_dim: int,
                 v_head_dim: int | None = None, *, dtype=torch.float32, device=None):
        batch_size = _check_pos_int("batch_size", batch_size)
        max_len = _check_pos_int("max_len", max_len)
        num_kv_heads, head_dim = _check_pos_int("num_kv_heads", num_kv_heads), _check_pos_int("head_dim", head_dim)
        v_head_dim = head_dim if v_head_dim is None else _check_pos_int("v_head_dim", v_head_dim)
        # (B, max_len, Hkv, D) buffers: what the decode op mutates (module docstring)
        self._k = _static(torch.zeros(batch_size, max_len, num_kv_heads, head_dim, dtype=dtype, device=device))
        self._v = _static(torch.zeros(batch_size, max_len, num_kv_heads, v_head_dim, dtype=dtype, device=device))
        self.key_mask = _static(torch.ones(batch_size, max_len, dtype=torch.bool, device=device))
        self.length = _static(torch.zeros((), dtype=torch.int64, device=device))
        self.leftpad = _static(torch.zeros(batch_size, dtype=torch.int32, device=device))
        self.padded = False  # whether a key mask was stored (flash_attn_func then reads key_mask)
        self.holes = False  # whether the stored mask is more than left padding (then only flash_attn_func)
        self._ends: Tensor | None = None  # cross-attention: (B,) int32 end of each memory's real keys
        self.filled = False  # cross-attention: whether the memory's keys/values are stored
        self._host_length: int | None = 0  # mirror of `length` for bounds checks without a sync
        self._seal()

    def _state(self) -> tuple | None:
        return _stamp(self.length, self.leftpad, self._ends)

    def _mirrored(self) -> bool:
        return self._host_length is not None

    @property
    def k(self) -> Tensor:
        """The keys, (B, Hkv, max_len, D): a view of the (B, max_len, Hkv, D) buffer. Assigning a tensor of the
        same shape, dtype and device keeps its transpose as the buffer: the keys only (the lengths, masks and
        leftpad stay; to reorder the batch's sequences, e.g. for beam search, use reorder())."""
        return self._k.transpose(1, 2)

    @k.setter
    def k(self, value: Tensor) -> None:
        self._k = _static(_same_as("k", value, self.k).transpose(1, 2))

    @property
    def v(self) -> Tensor:
        """The values, (B, Hkv, max_len, Dv): a view of the (B, max_len, Hkv, Dv) buffer (assignable as k)."""
        return self._v.transpose(1, 2)

    @v.setter
    def v(self, value: Tensor) -> None:
        self._v = _static(_same_as("v", value, self.v).transpose(1, 2))

    def reorder(self, index) -> "KVCache":
        """Reorder the batch's sequences in place: row b becomes what row index[b] was (rows may repeat), its
        keys, values, key mask and padding together (transformers' reorder_cache, for beam search). index:
        (B,) ints (a list or an int tensor), each in [0, B). Eager, between steps (reads index on the host)."""
        B = self.batch_size
        if isinstance(index, Tensor):
            if index.dtype.is_floating_point or index.dtype.is_complex or index.dtype == torch.bool or \
                    index.dim() != 1:
                raise TypeError(f"KVCache.reorder: index must be ({B},) ints; got a tensor of dtype {index.dtype} "
                                f"and shape {tuple(index.shape)}")
            index = index.tolist()
        if not isinstance(index, (list, tuple)) or len(index) != B or any(
                isinstance(i, bool) or not isinstance(i, numbers.Integral) or not 0 <= i < B for i in index):
            raise ValueError(f"KVCache.reorder: index must be {B} ints in [0, {B}) (one source row per row); "
                             f"got {index!r}")
        intact = self._intact()
        idx = torch.tensor(index, dtype=torch.int64, device=self._k.device)
        for t in (self._k, self._v, self.key_mask, self.leftpad):  # in place: the buffers keep their addresses
            t.copy_(t.index_select(0, idx))
        if self._ends is not None:
            self._ends = self._ends.index_select(0, idx)
        self._seal(intact)
        return self

    @property
    def batch_size(self) -> int:
        """B, the number of sequences (rows)."""
        return self._k.shape[0]

    @property
    def max_len(self) -> int:
        """The most positions the cache holds."""
        return self._k.shape[1]

    def __repr__(self) -> str:
        return (f"KVCache(batch_size={self.batch_size}, num_kv_heads={self._k.shape[2]}, max_len={self.max_len}, "
                f"head_dim={self._k.shape[3]}, dtype={self._k.dtype}, device={self._k.device})")

    def reset(self) -> "KVCache":
        """Empty the cache (keeps the buffers; fresh ones if a call with gradients wrote them, dropping its graph:
        a later call with gradients must not build on a graph that was freed)."""
        if self._k.requires_grad or self._v.requires_grad:
            self._k = _static(torch.zeros_like(self._k))
            self._v = _static(torch.zeros_like(self._v))
        self.length.zero_()
        self.key_mask.fill_(True)
        self.leftpad.zero_()
        self.padded = self.filled = self.holes = False
        self._ends = None
        self._host_length = 0
        self._seal()  # every state tensor rewritten
        return self

    def crop(self, length: int) -> "KVCache":
        """Keep positions [0, length) and drop the rest, e.g. the draft tokens that speculative decoding
        rejected (transformers' DynamicCache.crop): the next call writes at `length`. A negative length
        drops that many positions from the end. Eager, between steps (with no host count, after a
        compiled or captured step, it reads `length`: a sync on a GPU); a self-attention cache only (a
        cross-attention memory is stored whole: reset() it)."""
        if isinstance(length, bool) or not isinstance(length, numbers.Integral):
            raise TypeError(f"KVCache.crop: length must be an int; got {type(length).__name__}")
        if self.filled:
            raise ValueError("KVCache.crop: this cache holds a cross-attention memory, which is stored whole; "
                             "reset() it instead")
        held = self._host_length if self._host_length is not None else int(self.length)
        new = held + int(length) if length < 0 else int(length)
        if not 0 <= new <= held:
            raise ValueError(f"KVCache.crop: length must be in [-{held}, {held}] (the cache holds {held} positions); "
                             f"got {length}")
        intact = self._intact()
        self.length.fill_(new)
        self.key_mask[:, new:] = True  # positions past `length` hold True, as since reset()
        self.leftpad.clamp_(max=new)  # a row whose real tokens were all dropped holds none again
        if self.holes:  # the holes may have been cropped away: the kept mask may be left padding again
            lead, ok = _left_padded(self.key_mask[:, :new])
            if bool(ok.all()):
                self.holes = False
                self.leftpad.copy_(lead)  # (a row of padding only: lead = new, no real token)
        if self._host_length is not None:
            self._host_length = new
        self._seal(intact)
        return self

    def _claim(self, S: int) -> None:
        """Check that S more positions fit, and count them: on the host mirror (no sync) while there is one;
        once a step was traced or captured in a CUDA graph (whose replays advance `length` on the device
        unseen), by a device-side assert in such steps and by reading `length` (a sync) in eager ones, until
        reset(). (The mirror stays None: a captured CUDA graph's replays advance `length` without running any
        Python, so a mirror restored by an eager call would go stale.)"""
        readable = _host_readable()
        if not readable:
            self._host_length = None
        if self._host_length is None and not readable:
            device_assert(self.length + S <= self.max_len,
                          "flashtx.nn.KVCache is full: more positions were given than max_len holds")
            return
        held = self._host_length if self._host_length is not None else int(self.length)
        if held + S > self.max_len:
            raise ValueError(f"KVCache is full: it holds {held} of max_len={self.max_len} positions and {S} more "
                             f"were given; create it with a larger max_len")
        if self._host_length is not None:
            self._host_length += S

    def append(self, k: Tensor, v: Tensor, key_mask: Tensor | None = None) -> None:
        """Write k (B, Hkv, S, D), v (B, Hkv, S, Dv) and key_mask (B, S) at [length, length + S)."""
        S = k.shape[2]
        for name, t, buf in (("k", k, self.k), ("v", v, self.v)):
            want = (buf.shape[0], buf.shape[1], S, buf.shape[3])
            if tuple(t.shape) != want or t.dtype != buf.dtype or t.device != buf.device:
                raise ValueError(f"KVCache.append: {name} must be {want} (B, Hkv, S, D), {buf.dtype} on {buf.device}; "
                                 f"got {tuple(t.shape)}, {t.dtype} on {t.device}")
        _check_mask("key_mask", key_mask, self.batch_size, S, self._k.device)  # before _claim counts the tokens
        intact = self._intact()
        self._claim(S)
        self._store_mask(key_mask, S)
        idx = self.length + torch.arange(S, device=self._k.device)  # (S,) positions
        self._k.index_copy_(1, idx, k.transpose(1, 2))
        self._v.index_copy_(1, idx, v.transpose(1, 2))
        self.length.add_(S)
        self._seal(intact)

    def _mark(self, masked: bool) -> tuple:
        """What a call's bookkeeping (_claim, _store_mask) changes, before it: for _undo if the call fails.
        Eager only (flashtx.nn.attention); the leftpad copy only when the call has a key mask."""
        return (self._host_length, self.padded, self.holes, self.leftpad.clone() if masked else None,
                self._sealed if self._intact() else None)

    def _undo(self, mark: tuple, S: int) -> None:
        """Put back what _mark saw, after a failed call of S tokens (`length` advances only on success):
        positions past `length` hold True again, as since reset() (those below max_len: a call refused for a full
        cache stored nothing). Resealed where the state was sealed and `length` was not written since."""
        self._host_length, self.padded, self.holes, leftpad, sealed = mark
        length_kept = self._unwritten(sealed, self.length)
        if leftpad is not None:
            self.leftpad.copy_(leftpad)
            held = self._host_length  # where the call stored its mask: [length, length + S), within max_len
            if held is not None:  # a slice: no device read (and meta tensors have no boolean indexing)
                self.key_mask[:, held:min(held + S, self.max_len)] = True
            else:
                pos = self.length + torch.arange(S, device=self._k.device)  # (S,)
                self.key_mask.index_fill_(1, pos[pos < self.max_len], True)  # (past `length`: True in any case)
        self._seal(length_kept)

    def _store_mask(self, key_mask: Tensor | None, S: int) -> None:
        """Store the key mask (B, S) of S tokens about to be written at [length, length + S) and
        advance leftpad (rows without a real token yet move it past their leading padding)."""
        key_mask = _check_mask("key_mask", key_mask, self.batch_size, S, self._k.device)
        if key_mask is None:
            return  # positions past `length` hold True since reset(): nothing to store
        self.key_mask.index_copy_(1, self.length + torch.arange(S, device=self._k.device), key_mask)
        self.padded = True
        if self.holes:
            return
        lead, ok = _left_padded(key_mask)
        fresh = self.leftpad.long() == self.length  # rows holding no real token yet
        ok = ok & (fresh | (lead == 0))
        readable = _host_readable()
        if readable and not bool(ok.all()):
            self.holes = True  # not left padding: flash_attn_func over key_mask from now on
            return
        if not readable:
            device_assert(ok.all(), "flashtx.nn.KVCache: in a traced or captured step a key_mask must "
                                    "continue left padding (no padding after a real token)")
        self.leftpad.copy_(torch.where(fresh, self.length + lead, self.leftpad.long()))

    def _store_memory_mask(self, key_mask: Tensor | None, Sm: int) -> None:
        """Cross-attention: after appending the memory, its per-row real range [leftpad, end) from a
        mask of the form pad* real* pad* (left and/or right padding); any other mask sets holes."""
        key_mask = _check_mask("memory_mask", key_mask, self.batch_size, Sm, self._k.device)
        if key_mask is None:
            return
        self.key_mask[:, :Sm] = key_mask
        self.padded = True
        lead, real, ar = _mask_runs(key_mask)
        lead = torch.where(real > 0, lead, 0)
        ok = (key_mask == ((ar[None, :] >= lead[:, None]) & (ar[None, :] < (lead + real)[:, None]))).all(1)
        readable = _host_readable()
        if readable and not bool(ok.all()):
            self.holes = True
            return
        if not readable:
            device_assert(ok.all(), "flashtx.nn.KVCache: in a traced step a memory mask must be "
                                    "padding before and/or after the real tokens")
        self.leftpad.copy_(lead)
        self._ends = (lead + real).to(torch.int32)


class PagedKVCache(_Sealed):
    """A pool of K/V pages shared by the sequences of a batch, and each sequence's block table.

    Attributes:
        k: (num_pages, page_size, Hkv, D) and v: (num_pages, page_size, Hkv, Dv) page pools.
        block_table: (B, max_pages_per_seq) int32; entry [b, p] holds positions
            [p * page_size, (p + 1) * page_size) of sequence b; -1 = no page (never read).
        seqlens: (B,) int32: tokens in each sequence (each sequence has its own length).
        leftpad: (B,) int32: each sequence's first real position (its leading padding is hidden).

    ``PagedKVCache(batch_size, num_kv_heads, head_dim, *, num_pages, page_size=16, max_pages_per_seq=None,
    v_head_dim=None, dtype, device)``: a pool of num_pages zeroed pages of page_size tokens (a multiple of 16),
    num_kv_heads heads of head_dim (values: v_head_dim, default head_dim), for batch_size sequences of at most
    max_pages_per_seq pages each (default num_pages). ``MultiheadAttention.new_cache(..., paged=True)`` takes
    these from the layer. It has no reorder() (beam search): use a contiguous KVCache there.

    Pages are handed out on the host: `allocate(b, n)` makes sequence b able to hold n tokens,
    `free(b)` returns its pages and empties it (continuous batching: a finished sequence's slot is
    refilled), `crop(lengths)` drops each sequence's tokens past its length (speculative decoding's
    rollback). In eager mode MultiheadAttention allocates on demand; a step traced by torch.compile
    or captured in a CUDA graph cannot, so allocate the pages first (`allocate_all(max_len)`).
    Writing past a sequence's pages fails (ValueError on CPU, a device-side assert on a GPU).

    Per-sequence lengths (continuous batching): a call's ``key_mask`` (B, S) row b must read
    ``pad* real* pad*``. Sequence b appends at its own ``seqlens[b]``: leading padding (allowed
    while b holds no real token, e.g. a left-padded prompt) is stored and hidden by ``leftpad``,
    the real tokens are kept, trailing padding is dropped: ``seqlens[b]`` advances by the leading
    padding plus the real tokens, so a row of all False leaves sequence b as it was. Outputs at
    padding positions are unspecified. One call can thus prefill a new prompt of S tokens into a
    freed slot while the other rows take one token each (``[True] + [False] * (S - 1)``). A
    dropped token is still written past ``seqlens[b]`` (overwritten later), so the eager page
    allocation covers ``seqlens[b] + S``. Eager calls with a key_mask read it on the host (a sync
    on a GPU); a traced or captured step checks it with a device-side assert.

    Example:
        >>> cache = attn.new_cache(batch_size=8, max_len=4096, paged=True, page_size=64)
        >>> y = attn(prompt, cache=cache); y = attn(next_token, cache=cache)
        >>> cache.free(3)   # sequence 3 finished: its pages go back to the pool
        >>> mask = torch.zeros(8, P, dtype=torch.bool); mask[:, 0] = True; mask[3] = True
        >>> y = attn(x, key_mask=mask, cache=cache)   # x (8, P, E): a new prompt in slot 3, others +1
    """

    def __init__(self, batch_size: int, num_kv_heads: int, head_dim: int, *, num_pages: int, page_size: int = 16,
                 max_pages_per_seq: int | None = None, v_head_dim: int | None = None, dtype=torch.float32,
                 device=None):
        batch_size = _check_pos_int("batch_size", batch_size)
        num_kv_heads, head_dim = _check_pos_int("num_kv_heads", num_kv_heads), _check_pos_int("head_dim", head_dim)
        num_pages, page_size = _check_pos_int("num_pages", num_pages), _check_pos_int("page_size", page_size)
        if page_size % 16:
            raise ValueError(f"page_size must be a multiple of 16; got {page_size}")
        max_pages_per_seq = num_pages if max_pages_per_seq is None else _check_pos_int("max_pages_per_seq",
                                                                                       max_pages_per_seq)
        v_head_dim = head_dim if v_head_dim is None else _check_pos_int("v_head_dim", v_head_dim)
        self.k = _static(torch.zeros(num_pages, page_size, num_kv_heads, head_dim, dtype=dtype, device=device))
        self.v = _static(torch.zeros(num_pages, page_size, num_kv_heads, v_head_dim, dtype=dtype, device=device))
        self.block_table = _static(torch.full((batch_size, max_pages_per_seq), -1, dtype=torch.int32, device=device))
        self.seqlens = _static(torch.zeros(batch_size, dtype=torch.int32, device=device))
        self.leftpad = _static(torch.zeros(batch_size, dtype=torch.int32, device=device))
        self._free = list(range(num_pages - 1, -1, -1))  # a stack: page 0 is handed out first
        self._pages: list[list[int]] = [[] for _ in range(batch_size)]
        self._host_lens: list[int] | None = [0] * batch_size  # mirror of seqlens (None once traced)
        self._seal()

    def _state(self) -> tuple | None:
        return _stamp(self.seqlens, self.leftpad, self.block_table)

    def _mirrored(self) -> bool:
        return self._host_lens is not None

    @property
    def batch_size(self) -> int:
        """B, the number of sequences (block-table rows)."""
        return self.block_table.shape[0]

    @property
    def page_size(self) -> int:
        """Tokens per page (a multiple of 16)."""
        return self.k.shape[1]

    @property
    def max_len(self) -> int:
        """The most tokens one sequence can hold (its block table's width)."""
        return self.block_table.shape[1] * self.page_size

    @property
    def free_pages(self) -> int:
        """Pages in the pool not held by any sequence."""
        return len(self._free)

    def __repr__(self) -> str:
        return (f"PagedKVCache(batch_size={self.batch_size}, num_pages={self.k.shape[0]}, page_size={self.page_size}, "
                f"num_kv_heads={self.k.shape[2]}, head_dim={self.k.shape[3]}, free_pages={self.free_pages}, "
                f"dtype={self.k.dtype}, device={self.k.device})")

    def allocate(self, seq: int, num_tokens: int) -> None:
        """Give sequence `seq` pages for its first num_tokens positions (host-side; keeps existing ones)."""
        self._check_seq(seq)
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, numbers.Integral) or num_tokens < 0:
            raise ValueError(f"num_tokens must be an int >= 0; got {num_tokens!r}")
        need = -(-num_tokens // self.page_size)
        if need > self.block_table.shape[1]:
            raise ValueError(f"PagedKVCache: sequence {seq} would need {need} pages for {num_tokens} tokens, more than "
                             f"max_pages_per_seq={self.block_table.shape[1]}")
        have = self._pages[seq]
        if need - len(have) > len(self._free):
            raise ValueError(f"PagedKVCache is out of pages: sequence {seq} needs {need - len(have)} more, "
                             f"{len(self._free)} are free; free finished sequences or create more pages")
        new = [self._free.pop() for _ in range(need - len(have))]
        if new:
            intact = self._intact()
            self.block_table[seq, len(have):need] = torch.tensor(new, dtype=torch.int32)
            have += new
            self._seal(intact)

    def _check_seq(self, seq) -> None:
        if isinstance(seq, bool) or not isinstance(seq, numbers.Integral):
            raise TypeError(f"seq must be an int in [0, {self.batch_size}) (the batch index); got "
                            f"{type(seq).__name__} {seq!r}")
        if not 0 <= seq < self.batch_size:
            raise IndexError(f"seq must be an int in [0, {self.batch_size}) (the batch index); got {seq!r}")

    def allocate_all(self, num_tokens: int) -> "PagedKVCache":
        """allocate(b, num_tokens) for every sequence, e.g. before compiling or capturing a decode step."""
        for b in range(self.batch_size):
            self.allocate(b, num_tokens)
        return self

    def free(self, seq: int) -> None:
        """Return sequence `seq`'s pages to the pool and empty it."""
        self._check_seq(seq)
        intact = self._intact()
        self._free.extend(reversed(self._pages[seq]))
        self._pages[seq] = []
        self.block_table[seq].fill_(-1)
        self.seqlens[seq] = 0
        self.leftpad[seq] = 0
        if self._host_lens is not None:
            self._host_lens[seq] = 0
        self._seal(intact)

    def reset(self) -> "PagedKVCache":
        """Free every sequence."""
        for b in range(self.batch_size):
            self.free(b)
        self._host_lens = [0] * self.batch_size
        self._seal()  # every row of every state tensor rewritten
        return self

    def crop(self, lengths) -> "PagedKVCache":
        """Keep each sequence's first lengths[b] tokens and drop the rest, e.g. the draft tokens that speculative
        decoding rejected: sequence b's next token is written at lengths[b]. lengths: an int for every sequence
        (a negative int drops that many tokens from each), or B ints (a list, tuple or (B,) int tensor), each in
        [0, seqlens[b]]. Pages stay with their sequences (free() returns them). Eager, between steps (with no
        host count, after a compiled or captured step, it reads `seqlens`: a sync on a GPU)."""
        held = list(self._host_lens) if self._host_lens is not None else self.seqlens.tolist()
        B = self.batch_size
        if isinstance(lengths, numbers.Integral) and not isinstance(lengths, bool):
            new = [n + int(lengths) if lengths < 0 else int(lengths) for n in held]
        else:
            if isinstance(lengths, Tensor):
                if lengths.dtype.is_floating_point or lengths.dtype == torch.bool or lengths.dim() != 1:
                    raise TypeError(f"PagedKVCache.crop: lengths must be an int or ({B},) ints; got a tensor of "
                                    f"dtype {lengths.dtype} and shape {tuple(lengths.shape)}")
                lengths = lengths.tolist()
            if not isinstance(lengths, (list, tuple)) or len(lengths) != B or \
                    any(isinstance(n, bool) or not isinstance(n, numbers.Integral) for n in lengths):
                raise TypeError(f"PagedKVCache.crop: lengths must be an int or {B} ints (one per sequence); "
                                f"got {lengths!r}")
            new = [int(n) for n in lengths]
        for b, (n, h) in enumerate(zip(new, held)):
            if not 0 <= n <= h:
                raise ValueError(f"PagedKVCache.crop: sequence {b} holds {h} tokens, so it can keep 0 to {h}; "
                                 f"got {n}")
        intact = self._intact()
        new_t = torch.tensor(new, dtype=torch.int32, device=self.seqlens.device)
        self.seqlens.copy_(new_t)
        torch.minimum(self.leftpad, new_t, out=self.leftpad)  # a sequence whose real tokens were all dropped
        if self._host_lens is not None:
            self._host_lens = new
        self._seal(intact)
        return self

    def _claim(self, S: int, keep: list[int] | None = None) -> None:
        """Before writing S tokens to every sequence (of which sequence b keeps keep[b], default S):
        in eager mode allocate the pages they need."""
        if not _host_readable():
            self._host_lens = None  # the graph advances seqlens on the device; pages must be allocated already
            return
        # after a compiled or captured step (no host mirror, which stays None: a captured graph's replays advance
        # seqlens without running Python), eager calls read seqlens (a sync) and allocate as before
        lens = self._host_lens if self._host_lens is not None else self.seqlens.tolist()
        need = 0  # every sequence is checked before any is changed: a refusal leaves the cache as it was
        for b, n in enumerate(lens):
            if n + S > self.max_len:
                raise ValueError(f"PagedKVCache is full: sequence {b} holds {n} of max_len={self.max_len} positions "
                                 f"and {S} more were given")
            need += max(0, -(-(n + S) // self.page_size) - len(self._pages[b]))
        if need > len(self._free):
            raise ValueError(f"PagedKVCache is out of pages: the batch needs {need} more for {S} tokens each, "
                             f"{len(self._free)} are free; free finished sequences or create more pages")
        for b in range(self.batch_size):
            self.allocate(b, lens[b] + S)
            if self._host_lens is not None:
                self._host_lens[b] += S if keep is None else keep[b]

    def _mark(self, masked: bool) -> tuple:
        """What a call's bookkeeping (_take) changes, before it: for _undo if the call fails. Eager only
        (flashtx.nn.attention); the leftpad copy only when the call has a key mask."""
        lens = None if self._host_lens is None else list(self._host_lens)
        return (lens, [len(p) for p in self._pages], self.leftpad.clone() if masked else None,
                self._sealed if self._intact() else None)

    def _undo(self, mark: tuple, S: int) -> None:
        """Put back what _mark saw, after a failed call (`seqlens` advances only on success): the pages the
        call was given go back to the pool. Resealed where the state was sealed and `seqlens` was not written
        since."""
        lens, counts, leftpad, sealed = mark
        seqlens_kept = self._unwritten(sealed, self.seqlens)
        for b in reversed(range(len(counts))):  # last given, first back: the pool's order as before
            n = counts[b]
            extra = self._pages[b][n:]
            if extra:
                self._free.extend(reversed(extra))
                del self._pages[b][n:]
                self.block_table[b, n:n + len(extra)] = -1
        self._host_lens = lens
        if leftpad is not None:
            self.leftpad.copy_(leftpad)
        self._seal(seqlens_kept)

    def _take(self, key_mask: Tensor | None, S: int) -> Tensor | None:
        """Before a call of S tokens: allocate pages and move leftpad past new leading padding; returns
        the (B,) int32 count each sequence keeps (None: all S) to add to seqlens after the call."""
        key_mask = _check_mask("key_mask", key_mask, self.batch_size, S, self.k.device)
        if key_mask is None:
            self._claim(S)
            return None
        lead, real, ar = _mask_runs(key_mask)
        lead = torch.where(real > 0, lead, 0)  # a row of all padding keeps nothing
        fresh = self.leftpad == self.seqlens  # sequences holding no real token yet
        ok = (key_mask == ((ar[None, :] >= lead[:, None]) & (ar[None, :] < (lead + real)[:, None]))).all(1)
        readable = _host_readable()
        _check_ok(ok, readable, "PagedKVCache: key_mask row {} must read pad* real* pad* (padding before "
                                "and/or after the real tokens, never between them)")
        _check_ok(fresh | (lead == 0), readable, "PagedKVCache: key_mask row {} has leading padding, but "
                                                 "its sequence already holds real tokens (free() it first)")
        keep = (lead + real).to(torch.int32)
        self._claim(S, keep.tolist() if readable else None)
        self.leftpad.copy_(torch.where(fresh, self.seqlens + lead, self.leftpad))
        return keep
