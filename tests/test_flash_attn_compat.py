"""flash-attn 2 calls as its own code and tests make them: window sizes as tensors, unpad_input's unused_mask,
and flash_attn_varlen_func over a paged cache (block_table), each against the unpaged / untensored call (the same
kernels on the same values: equal bit for bit) and the float64 reference; bad tables get errors naming them."""
import pytest
import torch
from conftest import DEVICE, PRECISE_DTYPE, poisoned_allocations, precise_atol, randn

import flashtx
from flashtx import reference

SAME = dict(atol=0.0, rtol=0.0)


def test_window_size_as_a_tensor_is_read_as_its_values():
    """flash-attn's tests pass window_size = torch.randint(0, seqlen_k, (2,)) to every entry point."""
    torch.manual_seed(0)
    q, k, v = randn(2, 9, 4, 16), randn(2, 13, 2, 16), randn(2, 13, 2, 16)
    want = flashtx.flash_attn_func(q, k, v, window_size=(3, 2))
    for w in (torch.tensor([3, 2]), torch.tensor([3, 2], dtype=torch.int32, device=DEVICE),
              (torch.tensor(3), torch.tensor([2])), (torch.tensor(-1), torch.tensor(-1))):
        if w[0].item() == -1:  # the default as tensors (the default check compared them elementwise and raised)
            torch.testing.assert_close(flashtx.flash_attn_func(q, k, v, window_size=w), flashtx.flash_attn_func(q, k, v),
                                       **SAME)
            continue
        torch.testing.assert_close(flashtx.flash_attn_func(q, k, v, window_size=w), want, **SAME)
    cu = torch.tensor([0, 9, 18], dtype=torch.int32, device=DEVICE)
    cuk = torch.tensor([0, 13, 26], dtype=torch.int32, device=DEVICE)
    flat = [t.reshape(-1, *t.shape[2:]) for t in (q, k, v)]
    torch.testing.assert_close(flashtx.flash_attn_varlen_func(*flat, cu, cuk, 9, 13, window_size=torch.tensor([3, 2])),
                               flashtx.flash_attn_varlen_func(*flat, cu, cuk, 9, 13, window_size=(3, 2)), **SAME)
    with torch.no_grad():
        kc, vc = torch.zeros_like(k), torch.zeros_like(v)
        args = dict(k=k[:, :4], v=v[:, :4], cache_seqlens=9)
        got = flashtx.flash_attn_with_kvcache(q[:, :4], kc, vc, window_size=torch.tensor([3, 2]), **args)
        kc.zero_(), vc.zero_()
        torch.testing.assert_close(got, flashtx.flash_attn_with_kvcache(q[:, :4], kc, vc, window_size=(3, 2), **args),
                                   **SAME)


@pytest.mark.parametrize("window,error,pattern", [
    (torch.tensor([1.0, 2.0]), TypeError, r"window_size must be a pair .*got a torch.float32 tensor of shape \(2,\)"),
    (torch.tensor([1, 2, 3]), TypeError, r"window_size must be a pair .*got a torch.int64 tensor of shape \(3,\)"),
    (torch.tensor([4, -2]), ValueError, r"window_size must be a pair \(left, right\) of ints >= -1"),
    ((torch.tensor(True), 1), ValueError, r"window_size must be a pair \(left, right\) of ints >= -1"),
    ((torch.tensor([2, 1]), 1), ValueError, r"window_size must be a pair \(left, right\) of ints >= -1"),
    ({5, 0}, TypeError, r"window_size must be a pair .*a sequence such as a tuple; got set"),  # its order: (0, 5)
    ({5: 0, 1: 2}, TypeError, r"window_size must be a pair .*a sequence such as a tuple; got dict"),
    (iter((5, 0)), TypeError, r"window_size must be a pair .*a sequence such as a tuple; got tuple_iterator"),
], ids=["float", "three", "below-minus-one", "bool", "nested", "set", "dict", "iterator"])
def test_bad_window_tensors_get_a_clear_error(window, error, pattern):
    q = randn(1, 4, 2, 16)
    with pytest.raises(error, match=pattern):
        flashtx.flash_attn_func(q, q, q, window_size=window)


def test_unpad_input_packs_unused_slots_and_counts_only_used_ones():
    """flash-attn's bert_padding.unpad_input(hidden, attention_mask, unused_mask): unused slots are packed and
    counted in cu_seqlens / max_seqlen, and the fifth value (seqused) counts attention_mask's tokens only."""
    x = randn(2, 5, 3)
    used = torch.tensor([[1, 1, 0, 0, 0], [0, 1, 1, 1, 0]], device=DEVICE)
    unused = torch.tensor([[0, 0, 1, 0, 0], [0, 0, 0, 0, 1]], dtype=torch.bool, device=DEVICE)
    packed, idx, cu, max_len, seqused = flashtx.unpad_input(x, used, unused)
    assert idx.tolist() == [0, 1, 2, 6, 7, 8, 9]
    assert cu.tolist() == [0, 3, 7] and cu.dtype == torch.int32 and max_len == 4
    assert seqused.tolist() == [2, 3] and seqused.dtype == torch.int32
    torch.testing.assert_close(packed, x.reshape(10, 3)[idx], **SAME)
    no_unused = flashtx.unpad_input(x, used)
    assert no_unused[2].tolist() == [0, 2, 5] and no_unused[4].tolist() == [2, 3]
    with pytest.raises(ValueError, match=r"unused_mask must be None or a \(B, S\) = \(2, 5\) tensor.*got \(5,\)"):
        flashtx.unpad_input(x, used, unused[0])


def _paged(k, cuk, page: int, pages_per_seq: int, num_blocks: int, shared_first_page: bool = False):
    """k (total_k, Hkv, D) split into a shuffled paged cache (num_blocks, page, Hkv, D) with its block_table
    (nseq, pages_per_seq) int32; table entries past a sequence's last page hold garbage (never read). With
    shared_first_page, sequence 1's first page is sequence 0's (a shared prefix: its keys must agree)."""
    nseq = cuk.shape[0] - 1
    cache = torch.full((num_blocks, page, *k.shape[1:]), float("nan"), dtype=k.dtype, device=k.device)
    table = torch.full((nseq, pages_per_seq), 10**6, dtype=torch.int32, device=k.device)
    free = torch.randperm(num_blocks).tolist()
    for b in range(nseq):
        s, e = int(cuk[b]), int(cuk[b + 1])
        for p in range(-(-(e - s) // page)):
            if shared_first_page and b == 1 and p == 0:
                table[1, 0] = table[0, 0]
                continue
            table[b, p] = free.pop()
            rows = k[s + p * page:min(e, s + (p + 1) * page)]
            cache[int(table[b, p]), :rows.shape[0]] = rows
    return cache, table


@pytest.mark.parametrize("page", [16, 5])
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_over_a_paged_cache_equals_the_packed_call(page, causal):
    """flash_attn_varlen_func(..., block_table=...) as flash-attn >= 2.6: k, v (num_blocks, page, Hkv, D), sequence
    b's key j at block_table[b, j // page], row j % page. Ragged lengths (one empty), GQA 4/2, pages shuffled."""
    torch.manual_seed(page)
    lq, lk = [3, 0, 7, 1], [5, 0, 19, 33]
    cuq = torch.tensor([0, 3, 3, 10, 11], dtype=torch.int32, device=DEVICE)
    cuk = torch.tensor([0, 5, 5, 24, 57], dtype=torch.int32, device=DEVICE)
    q, k, v = randn(sum(lq), 4, 16), randn(sum(lk), 2, 16), randn(sum(lk), 2, 24)
    pages = -(-max(lk) // page)
    kc, table = _paged(k, cuk, page, pages + 1, 4 * pages + 3)
    vc = _place(v, cuk, table, torch.full((4 * pages + 3, page, 2, 24), float("nan"), device=DEVICE))
    want = flashtx.flash_attn_varlen_func(q, k, v, cuq, cuk, max(lq), max(lk), causal=causal)
    got = flashtx.flash_attn_varlen_func(q, kc, vc, cuq, cuk, max(lq), max(lk), causal=causal, block_table=table)
    torch.testing.assert_close(got, want, **SAME)
    for b in range(4):  # and the float64 reference, per sequence (bottom-right causal)
        qs, ks, vs = (t[int(c[b]):int(c[b + 1])] for t, c in ((q, cuq), (k, cuk), (v, cuk)))
        if qs.shape[0] == 0:
            continue
        ref = reference.attention(*(t.transpose(0, 1)[None].to(PRECISE_DTYPE) for t in (qs, ks, vs)),
                                  scale=16 ** -0.5, causal=causal, bottom_right=True)[0].transpose(0, 1)
        torch.testing.assert_close(got[int(cuq[b]):int(cuq[b + 1])].to(PRECISE_DTYPE), ref,
                                   atol=precise_atol(2e-5), rtol=0)


def _place(x, cuk, table, cache):
    """cache with sequence b's rows of x at its block_table pages (the layout _paged builds)."""
    cache = cache.clone()
    page = cache.shape[1]
    for b in range(table.shape[0]):
        for j in range(int(cuk[b + 1] - cuk[b])):
            cache[int(table[b, j // page]), j % page] = x[int(cuk[b]) + j]
    return cache


def test_varlen_paged_shared_prefix_pages_and_gradients():
    """Two sequences may share a page (a cached prefix); gradients flow to the cache rows that were read."""
    torch.manual_seed(3)
    cuq = torch.tensor([0, 4, 9], dtype=torch.int32, device=DEVICE)
    cuk = torch.tensor([0, 20, 40], dtype=torch.int32, device=DEVICE)
    k, v = randn(40, 2, 16, dtype=PRECISE_DTYPE), randn(40, 2, 16, dtype=PRECISE_DTYPE)
    k[20:28], v[20:28] = k[:8], v[:8]  # sequence 1 starts with sequence 0's first page (page = 8)
    # 3 pages of 8 per sequence: 48 gathered rows for 40 keys (8 filler rows past the last key)
    kc, table = _paged(k, cuk, 8, 3, 8, shared_first_page=True)
    vc = _place(v, cuk, table, torch.zeros_like(kc))
    q = randn(9, 2, 16, dtype=PRECISE_DTYPE, requires_grad=True)
    kc.requires_grad_(True)
    got = flashtx.flash_attn_varlen_func(q, kc, vc, cuq, cuk, 5, 20, causal=True, block_table=table)
    k2 = k.clone().requires_grad_(True)
    want = flashtx.flash_attn_varlen_func(q, k2, v, cuq, cuk, 5, 20, causal=True)
    torch.testing.assert_close(got, want, **SAME)
    g = torch.randn_like(got)
    with poisoned_allocations():  # unwritten gradient rows (the filler past the last key) must not reach the cache
        (dkc,) = torch.autograd.grad(got, kc, g)
    (dk,) = torch.autograd.grad(want, k2, g)
    want_dkc = torch.zeros_like(dkc)
    for b in range(2):  # each key's gradient lands on its page row; the shared page sums both sequences'
        for j in range(20):
            want_dkc[int(table[b, j // 8]), j % 8] += dk[int(cuk[b]) + j]
    torch.testing.assert_close(dkc, want_dkc, atol=precise_atol(1e-12), rtol=0)


@pytest.mark.parametrize("case,error,pattern", [
    ("page-out-of-range", ValueError, r"block_table\[1, 1\] = 6 is out of range: pages in use must be in \[0, 6\)"),
    ("negative-page", ValueError, r"block_table\[0, 0\] = -1 is out of range"),
    ("too-long", ValueError, r"cu_seqlens_k: sequence 1 has 12 keys but its block_table row holds 2 page\(s\) of 4 rows = 8"),
    ("table-rows", ValueError, r"block_table must have shape \(nseq, max_pages_per_seq\) = \(2, any\).*got \(3, 3\)"),
    ("table-dtype", TypeError, r"block_table must be None or an int32 \(or int64\) tensor.*got dtype torch.float32"),
    ("cache-rank", ValueError, r"k must be 4-D \(num_blocks, page_block_size, Hkv, D\) with block_table"),
    ("cache-device", ValueError, r"v must be on q's device cpu; got meta"),
    ("cu-start", ValueError, r"cu_seqlens_k\[0\] must be 0"),
    ("cu-decreasing", ValueError, r"cu_seqlens_k must be non-decreasing"),
    ("max-seqlen-short", ValueError, r"max_seqlen_k = 5 is less than the longest sequence in cu_seqlens_k "
                                     r"\(sequence 1: 6 keys\); it must be at least 6"),
    # the caches named with the shapes passed (not the gathered rows')
    ("cache-heads", ValueError, r"q's heads \(2\) must be a multiple of k's heads \(3\); got q \(6, 2, 16\) and k "
                                r"\(6, 4, 3, 16\)"),
    ("cache-head-dim", ValueError, r"k must have q's head dim 16; got k \(6, 4, 2, 8\)"),
])
def test_bad_paged_varlen_calls_name_the_argument(case, error, pattern):
    q = randn(6, 2, 16)
    kc, vc = randn(6, 4, 2, 16), randn(6, 4, 2, 16)
    cuq = torch.tensor([0, 3, 6], dtype=torch.int32, device=DEVICE)
    cuk = torch.tensor([0, 5, 17 if case == "too-long" else 11], dtype=torch.int32, device=DEVICE)
    table = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32, device=DEVICE)
    if case == "page-out-of-range":
        table[1, 1] = 6
    if case == "negative-page":
        table[0, 0] = -1
    if case == "too-long":
        table = table[:, :2]
    if case == "table-rows":
        table = torch.zeros(3, 3, dtype=torch.int32, device=DEVICE)
    if case == "table-dtype":
        table = table.float()
    if case == "cache-rank":
        kc = kc.flatten(0, 1)
    if case == "cache-device":
        q, kc, vc, cuq, cuk, table = (t.cpu() for t in (q, kc, vc, cuq, cuk, table))
        vc = vc.to("meta")
    if case == "cu-start":
        cuk = torch.tensor([-3, 5, 11], dtype=torch.int32, device=DEVICE)
    if case == "cache-heads":
        kc, vc = randn(6, 4, 3, 16), randn(6, 4, 3, 16)
    if case == "cache-head-dim":
        kc = randn(6, 4, 2, 8)
    if case == "cu-decreasing":  # every sequence fits its table: the values' own check names the entry
        cuk = torch.tensor([0, 9, 5], dtype=torch.int32, device=DEVICE)
    with pytest.raises(error, match=pattern):
        flashtx.flash_attn_varlen_func(q, kc, vc, cuq, cuk, 3, 5 if case == "max-seqlen-short" else 12,
                                       block_table=table)


def test_paged_varlen_gathers_what_max_seqlen_k_bounds_not_the_whole_table():
    """A table sized for long contexts (64 pages of 4) and a batch of short sequences: the gather takes
    nseq * max_seqlen_k rows (not nseq * 256), and the call equals the packed one."""
    from flashtx._paged_varlen import unpage

    q, k, v = randn(6, 2, 16), randn(11, 2, 16), randn(11, 2, 16)
    cuq = torch.tensor([0, 3, 6], dtype=torch.int32, device=DEVICE)
    cuk = torch.tensor([0, 5, 11], dtype=torch.int32, device=DEVICE)
    kc, vc = k.new_zeros(128, 4, 2, 16), k.new_zeros(128, 4, 2, 16)
    table = torch.arange(128, device=DEVICE, dtype=torch.int32).flip(0).reshape(2, 64)  # pages in reverse order
    for b in range(2):
        for j in range(int(cuk[b + 1] - cuk[b])):
            kc[int(table[b, j // 4]), j % 4], vc[int(table[b, j // 4]), j % 4] = k[int(cuk[b]) + j], v[int(cuk[b]) + j]
    assert unpage(kc, vc, table, cuk, q, 6)[0].shape[0] == 2 * 6
    assert unpage(kc, vc, table, cuk, q, torch.tensor(6))[0].shape[0] == 2 * 256  # (a tensor bound is not read)
    got = flashtx.flash_attn_varlen_func(q, kc, vc, cuq, cuk, 3, 6, causal=True, block_table=table)
    want = flashtx.flash_attn_varlen_func(q, k, v, cuq, cuk, 3, 6, causal=True)
    torch.testing.assert_close(got, want, **SAME)


def _rotary_ref(x, cos, sin, pos, interleaved):
    """flash-attn's apply_rotary_emb_torch in float64: x (B, S, H, D) at positions pos (B, S)."""
    r2 = cos.shape[-1]
    c, s = cos.double()[pos][:, :, None], sin.double()[pos][:, :, None]  # (B, S, 1, r2)
    xr, rest = x.double()[..., :2 * r2], x.double()[..., 2 * r2:]
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        out = torch.stack([x1 * c - x2 * s, x1 * s + x2 * c], -1).flatten(-2)
    else:
        x1, x2 = xr[..., :r2], xr[..., r2:]
        out = torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], -1)
    return torch.cat([out, rest], -1)


@pytest.mark.parametrize("interleaved", [False, True])
def test_apply_rotary_emb_takes_flash_attns_positional_call(interleaved):
    """flash_attn.layers.rotary.apply_rotary_emb(x, cos, sin, interleaved, inplace, seqlen_offsets, cu_seqlens,
    max_seqlen): the same positional order and defaults, the same values as apply_rotary (bit for bit) and as
    flash-attn's torch formula (float64), partial rotary and per-sequence offsets included."""
    torch.manual_seed(4)
    x = randn(2, 7, 3, 40)
    angles = torch.rand(20, 12, device=DEVICE) * 6.28  # rotary_dim 24 of 40
    cos, sin = angles.cos(), angles.sin()
    offsets = torch.tensor([3, 11], dtype=torch.int32, device=DEVICE)
    got = flashtx.apply_rotary_emb(x, cos, sin, interleaved, False, offsets)
    torch.testing.assert_close(got, flashtx.apply_rotary(x, cos, sin, interleaved=interleaved, seqlen_offsets=offsets),
                               **SAME)
    pos = offsets.long()[:, None] + torch.arange(7, device=DEVICE)[None]
    torch.testing.assert_close(got.double(), _rotary_ref(x, cos, sin, pos, interleaved), atol=1e-5, rtol=0)
    assert torch.equal(flashtx.apply_rotary_emb(x, cos, sin), flashtx.apply_rotary(x, cos, sin))  # the defaults
    y = x.clone()
    assert flashtx.apply_rotary_emb(y, cos, sin, interleaved, True, 2) is y  # inplace, positionally
    torch.testing.assert_close(y, flashtx.apply_rotary(x, cos, sin, interleaved=interleaved, seqlen_offsets=2), **SAME)
    cu = torch.tensor([0, 3, 7], dtype=torch.int32, device=DEVICE)
    packed = x[0]  # (total = 7, H, D): sequences of 3 and 4 tokens
    got = flashtx.apply_rotary_emb(packed, cos, sin, interleaved, False, 1, cu, 4)
    want = torch.cat([flashtx.apply_rotary(packed[None, :3], cos, sin, interleaved=interleaved, seqlen_offsets=1)[0],
                      flashtx.apply_rotary(packed[None, 3:], cos, sin, interleaved=interleaved, seqlen_offsets=1)[0]])
    torch.testing.assert_close(got, want, **SAME)


def test_window_size_sequences_and_arrays_are_read_in_order():
    """Any sequence or 1-D array is a (left, right) pair (only unordered or read-once forms are refused)."""
    import numpy as np

    q = randn(1, 6, 2, 16)
    want = flashtx.flash_attn_func(q, q, q, window_size=(2, 0))
    for w in ([2, 0], np.array([2, 0]), range(2, -1, -2), torch.Size([2, 0])):
        torch.testing.assert_close(flashtx.flash_attn_func(q, q, q, window_size=w), want, **SAME)


def test_return_attn_probs_must_be_a_bool():
    """A truthy non-bool ("no") returned the (out, lse, probs) tuple; refused by name, as other flags are. None
    (a remote-code model's unset output_attentions) is False, as in flash-attn."""
    q = randn(1, 4, 2, 16)
    torch.testing.assert_close(flashtx.flash_attn_func(q, q, q, return_attn_probs=None), flashtx.flash_attn_func(q, q, q),
                               **SAME)
    with pytest.raises(TypeError, match="return_attn_probs must be a bool; got str 'no'"):
        flashtx.flash_attn_func(q, q, q, return_attn_probs="no")
    cu = torch.tensor([0, 4], dtype=torch.int32, device=DEVICE)
    with pytest.raises(TypeError, match="return_attn_probs must be a bool; got str 'no'"):
        flashtx.flash_attn_varlen_func(q[0], q[0], q[0], cu, cu, 4, 4, return_attn_probs="no")
