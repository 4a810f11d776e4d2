"""flashtx.nn.RotaryEmbedding's table cache across modes and devices, and its arguments' errors: a rebuild for
torch.inference_mode (or another device) keeps the longest length seen (dynamic NTK's frequencies follow it, as
transformers' max_seq_len_cached) and does not double plain tables; max_seqlen is a bound, as apply_rotary's; bad
arguments are named by apply_rotary's checks, never an IndexError or an empty table."""
import pytest
import torch
from conftest import DEVICE, randn

import flashtx
from flashtx.nn import RotaryEmbedding


def test_dynamic_ntk_keeps_the_longest_length_across_inference_mode():
    """cos_sin(40) under inference_mode, then cos_sin(30) outside it: the tables of L = 40, as without the mode
    switch and as transformers (the rebuild took L = 30: cos off by 0.22)."""
    kw = dict(dim=8, max_seq_len=16, scaling={"rope_type": "dynamic", "factor": 2.0})
    switched, plain = RotaryEmbedding(**kw), RotaryEmbedding(**kw)
    with torch.inference_mode():
        switched.cos_sin(40)
    plain.cos_sin(40)
    for a, b in zip(switched.cos_sin(30), plain.cos_sin(30)):
        assert not a.is_inference()
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_plain_tables_do_not_double_on_a_device_rebuild():
    """A module used on two devices alternately (layers split over GPUs; "meta" stands in here) rebuilds its
    tables each switch: their length stays (it doubled each time: 2**12 x after 12 switches)."""
    rope = RotaryEmbedding(8, max_seq_len=16)
    for _ in range(6):
        assert rope.cos_sin(10, "meta")[0].device.type == "meta"
        assert rope.cos_sin(10)[0].device == rope.inv_freq.device
    assert rope._cache[1] == 16
    rope.cos_sin(17)  # growth still doubles (amortised)
    assert rope._cache[1] == 32


def test_max_seqlen_is_a_bound():
    """Packed input with a loose max_seqlen: tables as long as the data needs (10**9 raised, naming positions)."""
    rope = RotaryEmbedding(8, max_seq_len=16)
    q = randn(10, 2, 8, dtype=torch.float64)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32, device=DEVICE)
    want = rope(q, cu_seqlens=cu, max_seqlen=6)
    torch.testing.assert_close(rope(q, cu_seqlens=cu, max_seqlen=10**9), want, atol=0, rtol=0)
    assert rope._cache[1] == 16


@pytest.mark.parametrize("q_shape, kw, match", [
    ((4, 8), dict(layout="bhsd"), "must be 4-D"),
    ((2, 8), dict(), "must be 4-D"),
    ((10, 2, 8), dict(cu_seqlens=[0, 0]), "cu_seqlens"),
    ((10, 2, 8), dict(cu_seqlens=[[0, 10]]), "cu_seqlens"),
    ((10, 2, 8), dict(cu_seqlens=[0, -2, 10]), "cu_seqlens"),
])
def test_bad_arguments_named(q_shape, kw, match):
    rope = RotaryEmbedding(8)
    if "cu_seqlens" in kw:
        kw["cu_seqlens"] = torch.tensor(kw["cu_seqlens"], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match=match):
        rope(randn(*q_shape), **kw)


def test_apply_rotary_negative_lengths_name_cu_seqlens():
    """Without max_seqlen, negative lengths named max_seqlen (derived from them), which the caller never passed."""
    x = randn(6, 2, 8)
    cos = sin = randn(8, 4)
    with pytest.raises(ValueError, match=r"cu_seqlens\["):
        flashtx.apply_rotary(x, cos, sin, cu_seqlens=torch.tensor([0, -2, 6], dtype=torch.int32, device=DEVICE))


@pytest.mark.parametrize("name", ["position_ids", "seqlen_offsets"])
def test_index_tensor_on_another_device(name):
    """Named before a value is read from it (that raised torch's meta-tensor error)."""
    rope = RotaryEmbedding(8)
    t = torch.zeros(2, 3, dtype=torch.int64, device="meta") if name == "position_ids" else \
        torch.zeros(2, dtype=torch.int64, device="meta")
    with pytest.raises(ValueError, match=f"{name} is on meta but the activations are on"):
        rope(randn(2, 3, 2, 8), **{name: t})
