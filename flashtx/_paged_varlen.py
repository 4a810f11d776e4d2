"""flash_attn_varlen_func's `block_table`: keys and values read from a paged cache, as flash-attn >= 2.6 does.

The pages a call uses are gathered into packed (rows, Hkv, D) keys and values laid out as cu_seqlens_k says,
and the varlen kernels run on those: the same kernels, masks and checks as an unpaged call. That costs one
gather (B * min(max_pages * page_size, max_seqlen_k) rows: never an Sq x Sk tensor) and no host sync.
Decoding over a paged cache has its own kernels, which read the pages in place:
flashtx.flash_attn_with_kvcache(block_table=...).
"""
from __future__ import annotations

import torch

from ._validate import _check_layout, _values_readable, check_cu_seqlens_values, check_tensor
from .decode import _check_values


def unpage(k_cache, v_cache, block_table, cu_seqlens_k: torch.Tensor, q: torch.Tensor, max_seqlen_k=None):
    """(k, v) packed (B * bound, Hkv, D|Dv) from paged caches (num_blocks, page_block_size, Hkv, D|Dv): row
    cu_seqlens_k[b] + j holds position j of sequence b, i.e. row j % page_block_size of page
    block_table[b, j // page_block_size]. bound = the table's capacity (max_pages_per_seq * page_block_size),
    or max_seqlen_k when it is a smaller int (a table sized for long contexts, a batch of short ones: the gather
    follows the keys, not the table). Rows past cu_seqlens_k[-1] are filler (row 0 of page 0) that no sequence
    reads.

    block_table: (B, max_pages_per_seq) int32 (or int64) on q's device, B = cu_seqlens_k.shape[0] - 1; entries
    past a sequence's last page are never read. Checked: every sequence fits its table, and the pages in use
    are in [0, num_blocks): on CPU with a ValueError naming the entry, on a GPU by a device-side assert.
    cu_seqlens_k: already checked by check_cu_seqlens (dtype, shape, device); its values are checked against
    the returned rows by the caller."""
    for name, t in (("k", k_cache), ("v", v_cache)):
        check_tensor(name, t)
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D (num_blocks, page_block_size, Hkv, D) with block_table; got shape "
                             f"{tuple(t.shape)}")
        if t.device != q.device:
            raise ValueError(f"{name} must be on q's device {q.device}; got {t.device}")
    if k_cache.shape[:3] != v_cache.shape[:3]:
        raise ValueError(f"k and v must have the same (num_blocks, page_block_size, Hkv); got {tuple(k_cache.shape)} "
                         f"and {tuple(v_cache.shape)}")
    if q.dim() == 3:  # (what the packed call's checks find too, but with the caches' shapes, not the gathered rows')
        if k_cache.shape[3] != q.shape[2]:
            raise ValueError(f"k must have q's head dim {q.shape[2]}; got k {tuple(k_cache.shape)} (num_blocks, "
                             f"page_block_size, Hkv, D)")
        if k_cache.shape[2] == 0 or q.shape[1] % k_cache.shape[2]:
            raise ValueError(f"q's heads ({q.shape[1]}) must be a multiple of k's heads ({k_cache.shape[2]}); got q "
                             f"{tuple(q.shape)} and k {tuple(k_cache.shape)} (num_blocks, page_block_size, Hkv, D)")
    nseq = cu_seqlens_k.shape[0] - 1
    if not isinstance(block_table, torch.Tensor) or block_table.dtype not in (torch.int32, torch.int64):
        got = f"dtype {block_table.dtype}" if isinstance(block_table, torch.Tensor) else type(block_table).__name__
        raise TypeError(f"block_table must be None or an int32 (or int64) tensor of shape (nseq, max_pages_per_seq) "
                        f"= ({nseq}, any); got {got}")
    _check_layout("block_table", block_table)
    if block_table.dim() != 2 or block_table.shape[0] != nseq:
        raise ValueError(f"block_table must have shape (nseq, max_pages_per_seq) = ({nseq}, any) (nseq from "
                         f"cu_seqlens_k); got {tuple(block_table.shape)}")
    if block_table.device != q.device:
        raise ValueError(f"block_table must be on q's device {q.device}; got {block_table.device}")
    nb, page = k_cache.shape[:2]
    cap = block_table.shape[1] * page  # keys a sequence's table can hold
    bound = cap  # keys a sequence may have
    if type(max_seqlen_k) is int and 0 <= max_seqlen_k < cap:
        bound = max_seqlen_k
    rows = nseq * bound  # >= cu_seqlens_k[-1] once every sequence fits its bound (checked below)
    if _values_readable(cu_seqlens_k):  # its start and order first, so that a bad one is named as such (on CPU)
        check_cu_seqlens_values("cu_seqlens_k", cu_seqlens_k, int(cu_seqlens_k[-1]), "its last entry", None, None)
    if nseq == 0 or cap == 0 or nb == 0:
        if nseq:
            _check_values(cu_seqlens_k[-1:] == 0, _values_readable(cu_seqlens_k),
                          lambda ok: f"cu_seqlens_k: the sequences have keys but block_table "
                                     f"{tuple(block_table.shape)} and k {tuple(k_cache.shape)} hold none",
                          "block_table / cu_seqlens_k", "flash_attn_varlen_func")
        empty = (0, *k_cache.shape[2:]), (0, *v_cache.shape[2:])
        return k_cache.new_empty(empty[0]), v_cache.new_empty(empty[1])
    cu = cu_seqlens_k.long()
    lens = cu[1:] - cu[:-1]  # (nseq,)
    r = torch.arange(rows, device=q.device)  # (rows,) packed key rows
    seq = torch.searchsorted(cu[1:], r, right=True).clamp_(max=nseq - 1)  # the sequence of row r
    pos = r - cu[seq]  # position within it
    used = (r < cu[-1]) & (pos >= 0) & (pos < cap)  # (rows,) a real key that the table can hold
    pos = torch.where(used, pos, 0)
    pid = block_table.long()[seq, pos // page]  # (rows,) its page
    page_ok = (pid >= 0) & (pid < nb)
    ok = torch.cat([lens <= bound, page_ok | ~used])

    def message(ok: torch.Tensor) -> str:
        bad = int((~ok).nonzero()[0])
        if bad < nseq and bound < cap:
            return (f"max_seqlen_k = {bound} is less than the longest sequence in cu_seqlens_k (sequence {bad}: "
                    f"{int(lens[bad])} keys); it must be at least {int(lens.max())}")
        if bad < nseq:
            return (f"cu_seqlens_k: sequence {bad} has {int(lens[bad])} keys but its block_table row holds "
                    f"{block_table.shape[1]} page(s) of {page} rows = {cap}")
        b, j = int(seq[bad - nseq]), int(pos[bad - nseq])
        return (f"block_table[{b}, {j // page}] = {int(block_table[b, j // page])} is out of range: pages in use "
                f"must be in [0, {nb}) (num_blocks = k.shape[0])")

    _check_values(ok, _values_readable(cu_seqlens_k), message, "block_table / cu_seqlens_k", "flash_attn_varlen_func")
    flat = torch.where(used & page_ok, pid, 0) * page + pos % page  # (rows,) into the (nb * page) cache rows
    k = k_cache.reshape(nb * page, *k_cache.shape[2:])[flat]  # (rows, Hkv, D)
    v = v_cache.reshape(nb * page, *v_cache.shape[2:])[flat]  # (rows, Hkv, Dv)
    if torch.is_grad_enabled() and (k_cache.requires_grad or v_cache.requires_grad):
        # the varlen backward writes dK/dV rows of sequences only: the filler rows' gradients are never written
        # (whatever memory held), so cut them off before the gather's backward adds them to the cache's row 0
        keep = used[:, None, None]  # (rows, 1, 1)
        k, v = torch.where(keep, k, 0), torch.where(keep, v, 0)
    return k, v
