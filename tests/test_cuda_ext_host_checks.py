"""flashtx.cuda_ext's host side, without a GPU: the argument checks the fakes run (one case per check, each
refused by name), the split count a decode call picks (occupancy, key blocks, the paged capacity, the rows a
block takes), and the direct API's glue (flash-attn's defaults, the append before the attention, alignment
refusals), with the extension's ops stood in by the float64 references (conftest's `standin`)."""
import pytest
import torch

import flashtx
from flashtx import _cuda_ext_api, cuda_ext
from flashtx._dispatch import BackendNotSupported
from flashtx.cuda_ext_reference import decode_attention_ref, rotary_append_ref
from conftest import StandinOps

F16 = torch.float16


def _case(d=64, batch=2, sq=1, hq=8, hkv=2, cap=64):
    q = torch.randn(batch, sq, hq, d, dtype=F16)
    kc = torch.randn(batch, cap, hkv, d, dtype=F16)
    return q, kc, kc.clone(), torch.full((batch,), 5, dtype=torch.int32)


@pytest.mark.parametrize("case, exc, words", [
    ("head_dim_256", ValueError, ["head dim must be 64 or 128", "(2, 1, 8, 256)"]),
    ("q_last_dim", ValueError, ["q must be contiguous in its last dim (stride 1)"]),
    ("cache_shapes", ValueError, ["k_cache and v_cache must have the same shape", "(2, 64, 2, 64) and (2, 32, 2, 64)"]),
    ("cache_head_dim", ValueError, ["the caches' head dim must be q's (64)", "(2, 64, 2, 128)"]),
    ("no_positions", ValueError, ["the caches must not be empty", "(2, 0, 2, 64)"]),
    ("block_table_empty", ValueError, ["block_table must be (B, max_blocks) = (2, >0)", "(2, 0)"]),
    ("batch_idx_dtype", TypeError, ["cache_batch_idx must be int32", "torch.int64"]),
    ("batch_idx_shape", ValueError, ["cache_batch_idx must have shape (B,) = (2,)", "(3,)"]),
    ("cache_device", ValueError, ["k_cache must be on cpu like q", "meta"]),
    ("long_q", ValueError, ["B, Sq and Hq must be <= 65535", "(1, 65536, 1, 64)"]),
    ("no_splits", ValueError, ["num_splits must be in [1, 128]", "got 0"]),
])
def test_every_decode_check_refuses_by_name(case, exc, words):
    q, kc, vc, lens = _case()
    bt = idx = None
    splits = 1
    if case == "head_dim_256":
        q = torch.randn(2, 1, 8, 256, dtype=F16)
    elif case == "q_last_dim":
        q = torch.randn(2, 1, 8, 128, dtype=F16)[..., ::2]
    elif case == "cache_shapes":
        vc = vc[:, :32]
    elif case == "cache_head_dim":
        kc = vc = torch.randn(2, 64, 2, 128, dtype=F16)
    elif case == "no_positions":
        kc = vc = torch.randn(2, 0, 2, 64, dtype=F16)
    elif case == "block_table_empty":
        bt = torch.zeros(2, 0, dtype=torch.int32)
    elif case == "batch_idx_dtype":
        idx = torch.zeros(2, dtype=torch.int64)
    elif case == "batch_idx_shape":
        idx = torch.zeros(3, dtype=torch.int32)
    elif case == "cache_device":
        kc, vc = kc.to("meta"), vc.to("meta")
    elif case == "long_q":
        q = torch.empty(1, 65536, 1, 64, dtype=F16, device="meta")
        kc = vc = torch.empty(1, 16, 1, 64, dtype=F16, device="meta")
        lens = torch.empty(1, dtype=torch.int32, device="meta")
    elif case == "no_splits":
        splits = 0
    with pytest.raises(exc) as info:
        cuda_ext.check_decode_args(q, kc, vc, lens, bt, idx, splits)
    assert str(info.value).startswith("flashtx.cuda_ext.decode_attention: "), str(info.value)
    for w in words:
        assert w in str(info.value), str(info.value)
    if case == "long_q":
        assert cuda_ext.grid_reason(q[:, :65535], kc) is None  # the limit itself is taken


@pytest.mark.parametrize("case, exc, words", [
    ("cache_heads", ValueError, ["the caches' heads (2) must be k's (4)"]),
    ("rotary_dim_8", ValueError, ["must be a multiple of 16 in [16, 64] for torch.float16", "got 8"]),
    ("rotary_dim_80", ValueError, ["must be a multiple of 16 in [16, 64] for torch.float16", "got 80"]),
    ("tables_dtypes", ValueError, ["cos and sin must have the same shape and dtype", "torch.float32 and",
                                   "torch.float16"]),
])
def test_every_rotary_append_check_refuses_by_name(case, exc, words):
    q, kc, vc, lens = _case()
    k = v = torch.randn(2, 1, 2, 64, dtype=F16)
    cos = sin = torch.randn(64, 16)
    if case == "cache_heads":
        q = torch.randn(2, 1, 8, 64, dtype=F16)
        k = v = torch.randn(2, 1, 4, 64, dtype=F16)
    elif case == "rotary_dim_8":
        cos = sin = torch.randn(64, 4)
    elif case == "rotary_dim_80":
        cos = sin = torch.randn(64, 40)
    elif case == "tables_dtypes":
        sin = sin.half()
    with pytest.raises(exc) as info:
        cuda_ext.check_rotary_append_args(q, k, v, kc, vc, cos, sin, lens)
    assert str(info.value).startswith("flashtx.cuda_ext.rotary_append: "), str(info.value)
    for w in words:
        assert w in str(info.value), str(info.value)


# ---------------------------------------------------------------------------------------------
# The split count
# ---------------------------------------------------------------------------------------------

def test_the_split_count_at_its_edges():
    h = cuda_ext.num_splits_heuristic
    assert h(8, 10, 64, 128) == 1  # exactly 80% of the slots: one split (flash-attn's >= 0.8f * num_SMs)
    assert h(7, 10, 64, 128) > 1
    assert h(1, 132, 0, 128) == 1 and h(1, 132, 1, 128) == 1  # no key tile / one: nothing to split
    # no more splits than slots: 22 slots, 200 key tiles (22 is not eligible: 10 tiles each, as 21) -> best 20 (91%),
    # the fewest within 85% of it 17; counting past the slots, 44 would fill two waves and 19 be chosen
    assert h(1, 22, 200, 128) == 17
    # the driver's shared memory per block counts: 79,039 bytes hold one block of 38,496 + 1,024, not two
    assert cuda_ext.decode_ctas_per_sm(2, 128, 8, threads_per_sm=2048, regs_per_sm=65536, smem_per_sm=79039) == 1
    assert cuda_ext.decode_ctas_per_sm(2, 128, 8, threads_per_sm=2048, regs_per_sm=65536, smem_per_sm=79040) == 2
    # 300 positions are two blocks of 256 keys, not one: two splits for a lone sequence
    assert cuda_ext.choose_num_splits(1, 32, 8, 1, 300, 132, 4) == 2
    assert cuda_ext.choose_num_splits(1, 32, 8, 1, 256, 132, 4) == 1


def _recording_ops(monkeypatch) -> list:
    """The standin's ops, recording each call's flags: [(op, num_splits or (interleaved, q_causal)), ...]."""
    seen = []

    class Ops:
        @staticmethod
        def decode_attention(*a):
            seen.append(("decode", a[8]))
            return StandinOps.decode_attention(*a)

        @staticmethod
        def rotary_append(*a):
            seen.append(("append", (a[10], a[11])))
            return StandinOps.rotary_append(*a)

    monkeypatch.setattr(_cuda_ext_api, "_ops", lambda: Ops)
    return seen


@pytest.mark.parametrize("sq, hq, hkv, paged, want", [
    (1, 2, 1, True, 4),  # 64 pages of 16: the capacity (1,024 positions, 4 key blocks), not a page, sizes it
    (4, 4, 1, False, 11),  # 16 query rows a KV head: blocks of 32 rows, 3 of them an SM of 4: 12 slots
])
def test_the_heuristic_sizes_a_decode_call_by_its_capacity_and_rows(standin, monkeypatch, sq, hq, hkv, paged, want):
    """num_splits=0: the count of choose_num_splits over this GPU's slots (the standin's 4 SMs of sm_86), with
    the blocks an SM runs sized for the kernel's rows a block (rows_per_cta of the (Hq / Hkv) * Sq rows)."""
    seen = _recording_ops(monkeypatch)
    torch.manual_seed(0)
    q = torch.randn(1, sq, hq, 64, dtype=F16)
    if paged:
        kc = torch.randn(64, 16, hkv, 64, dtype=F16)
        bt = torch.randperm(64, dtype=torch.int32).reshape(1, 64)
        lens = torch.tensor([1000], dtype=torch.int32)
    else:
        kc, bt = torch.randn(1, 32768, hkv, 64, dtype=F16), None
        lens = torch.tensor([32000], dtype=torch.int32)
    vc = torch.randn_like(kc)
    out = cuda_ext.decode_attention(q, kc, vc, lens, block_table=bt)
    rows = cuda_ext.rows_per_cta((hq // hkv) * sq)
    per_sm = cuda_ext.decode_ctas_per_sm(2, 64, rows, 2048, 65536, 102400)
    assert seen == [("decode", want)]
    assert want == cuda_ext.choose_num_splits(1, hq, hkv, sq, 1024 if paged else 32768, 4, per_sm)
    ref, _ = decode_attention_ref(q, kc, vc, lens, bt)
    torch.testing.assert_close(out.double(), ref, atol=2e-3, rtol=2e-3)  # (the fp16 output: ~2 ulp)


def test_split_slots_size_blocks_by_the_kernels_rows(standin):
    """fp16 at head dim 64: 32-row blocks (31,616 B) fit 3 an SM of 102,400 B; 16-row ones would be 2."""
    assert _cuda_ext_api._split_slots(0, 2, 64, 16) == (4, 3)
    assert _cuda_ext_api._split_slots(0, 2, 64, 8) == (4, 2)


# ---------------------------------------------------------------------------------------------
# The direct API's glue
# ---------------------------------------------------------------------------------------------

def test_the_direct_api_takes_cuda_tensors_only(standin, monkeypatch):
    monkeypatch.setattr(cuda_ext, "DEVICE_TYPES", ("cuda",))
    q, kc, vc, lens = _case()
    with pytest.raises(ValueError, match="flashtx.cuda_ext.decode_attention: q must be a CUDA tensor; got device cpu"):
        cuda_ext.decode_attention(q, kc, vc, lens)


def test_rotary_tables_without_an_append_are_refused(standin):
    q, kc, vc, _ = _case()
    cos = torch.randn(64, 32)
    with pytest.raises(ValueError, match="rotary_cos/rotary_sin need the new k and v to append"):
        cuda_ext.flash_attn_with_kvcache(q, kc, vc, rotary_cos=cos, rotary_sin=cos, cache_seqlens=5)


@pytest.mark.parametrize("causal", [False, True])
def test_flash_attn_defaults_interleaved_rotary_and_rotates_q_as_flash_attn(standin, monkeypatch, causal):
    """rotary_interleaved defaults to True (flash-attn's default); q is rotated at each token's position when
    causal, at cache_seqlens for every token when not; the result is the reference's."""
    seen = _recording_ops(monkeypatch)
    torch.manual_seed(1)
    q, kc, vc, lens = _case(sq=2)
    k, v = torch.randn(2, 2, 2, 64, dtype=F16), torch.randn(2, 2, 2, 64, dtype=F16)
    cos, sin = torch.rand(64, 16), torch.rand(64, 16)
    kc0, vc0 = kc.clone(), vc.clone()
    out = cuda_ext.flash_attn_with_kvcache(q, kc, vc, k, v, cos, sin, cache_seqlens=lens, causal=causal)
    assert seen[0] == ("append", (True, causal))
    q_rot, kc_ref, vc_ref = rotary_append_ref(q, k, v, kc0, vc0, lens, cos, sin, True, causal)
    ref, _ = decode_attention_ref(q_rot.half(), kc_ref.half(), vc_ref.half(), lens + 2, causal=causal)
    torch.testing.assert_close(kc.double(), kc_ref.half().double(), atol=0, rtol=0)
    torch.testing.assert_close(out.double(), ref, atol=3e-3, rtol=2e-3)


def test_the_attentions_checks_run_before_the_append_writes(standin):
    q, kc, vc, lens = _case()
    k = v = torch.randn(2, 1, 2, 64, dtype=F16)
    kc0 = kc.clone()
    with pytest.raises(ValueError, match=r"num_splits must be in \[1, 128\]; got 129"):
        cuda_ext.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=lens, num_splits=129)
    assert torch.equal(kc, kc0)  # nothing appended


@pytest.mark.parametrize("which", ["k_cache", "v_cache"])
def test_the_backend_refuses_caches_off_16_byte_alignment(standin, which):
    """A cache view 8 bytes into its storage (strides whole vectors): the kernels' 16-byte vector writes would
    fault, so backend='cuda' refuses it by reason, whichever cache it is."""
    q, kc, vc, lens = _case()
    off = torch.zeros(kc.numel() + 4, dtype=F16)[4:].view(kc.shape)
    off.copy_(kc)
    kc, vc = (off, vc) if which == "k_cache" else (kc, off)
    with pytest.raises(BackendNotSupported, match="not 16-byte aligned"):
        flashtx.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, backend="cuda")


def test_the_backend_clamps_a_split_count_past_the_kernels_limit(standin, monkeypatch):
    seen = _recording_ops(monkeypatch)
    q, kc, vc, lens = _case()
    out = flashtx.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, num_splits=200, backend="cuda")
    assert ("decode", cuda_ext.MAX_SPLITS) in seen
    ref, _ = decode_attention_ref(q, kc, vc, lens)
    torch.testing.assert_close(out.double(), ref, atol=2e-3, rtol=2e-3)  # (the fp16 output: ~2 ulp)
