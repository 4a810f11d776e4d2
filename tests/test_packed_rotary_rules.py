"""The packed forms', RotaryEmbedding's and the in-place q/k rotation's rules a mutation round found untested:
refusals by name (kv of 0 heads, block_table on a packed form, bool scaling values, llama3's equal factors), the
packed forms' attn_bias, the in-place rotation's dense gradient copy, its projection base and global backward
pre-hooks. Each test failed under one surviving mutation."""
import pytest
import torch

import flashtx
from flashtx.nn import MultiheadAttention, RotaryEmbedding, _qkv_rotary

from conftest import DEVICE, PRECISE_DTYPE, precise_atol, randn

P = PRECISE_DTYPE
pytestmark = pytest.mark.usefixtures("fresh_plans")


def test_kv_of_no_heads_is_refused_by_name():
    with pytest.raises(ValueError, match=r"multiple of kv's heads \(0\)"):
        flashtx.flash_attn_kvpacked_func(randn(2, 8, 4, 16, dtype=P), randn(2, 8, 2, 0, 16, dtype=P))


def test_a_block_table_on_a_packed_form_points_to_the_unpacked_one():
    qkv, cu = randn(8, 3, 2, 16, dtype=P), torch.tensor([0, 8], dtype=torch.int32, device=DEVICE)
    with pytest.raises(TypeError, match="block_table is not an argument of the packed forms"):
        flashtx.flash_attn_varlen_qkvpacked_func(qkv, cu, 8, block_table=torch.zeros(1, 1, dtype=torch.int32,
                                                                                     device=DEVICE))


def test_the_packed_forms_take_attn_bias():
    qkv, bias = randn(1, 8, 3, 2, 16, dtype=P), randn(1, 2, 8, 8, dtype=P)
    got = flashtx.flash_attn_qkvpacked_func(qkv, attn_bias=bias)
    want = flashtx.flash_attn_func(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], attn_bias=bias)
    torch.testing.assert_close(got, want, atol=precise_atol(1e-12), rtol=0)


@pytest.mark.parametrize("scaling, words", [
    ({"rope_type": "default", "partial_rotary_factor": True}, "partial_rotary_factor"),
    ({"type": "linear", "factor": True}, "finite number > 0"),
    ({"type": "llama3", "factor": 8.0, "low_freq_factor": 2.0, "high_freq_factor": 2.0,
      "original_max_position_embeddings": 64}, "high_freq_factor > low_freq_factor"),
], ids=["partial-bool", "factor-bool", "llama3-equal-factors"])
def test_bad_rope_scaling_is_refused_by_name(scaling, words):
    with pytest.raises(ValueError, match=words):
        RotaryEmbedding(64, scaling=scaling, max_seq_len=16)


def test_the_in_place_rotation_takes_an_expanded_gradient():
    B, S, Hq, Hkv, D = 2, 8, 4, 2, 16
    N = (Hq + 2 * Hkv) * D
    cos, sin = RotaryEmbedding(D).cos_sin(S)

    def weight_grad(g):
        torch.manual_seed(0)
        lin = torch.nn.Linear(N, N).double()
        out = _qkv_rotary.rotate_qk_(lin(torch.randn(B, S, N, dtype=torch.float64)), (B, S, Hq + 2 * Hkv, D),
                                     (Hq, Hkv), cos, sin, False, None)
        out.backward(g)
        return lin.weight.grad

    dense = weight_grad(torch.ones(B, S, N, dtype=torch.float64))
    torch.testing.assert_close(weight_grad(torch.ones((), dtype=torch.float64).expand(B, S, N)), dense)


def test_a_view_of_part_of_a_tensor_is_not_a_projection_base():
    big = torch.randn(4, 8, 96, requires_grad=True) * 1.0  # a non-leaf, not a view
    assert _qkv_rotary.projection_base(big) is big
    assert _qkv_rotary.projection_base(big[:2]) is None  # contiguous, the same data pointer, half the elements


def test_a_global_backward_pre_hook_sees_the_projections_gradient(monkeypatch):
    monkeypatch.setattr(_qkv_rotary, "MIN_NUMEL", 0)  # the in-place node, for a small projection
    torch.manual_seed(0)
    m = MultiheadAttention(64, 4, num_kv_heads=2, rotary=RotaryEmbedding(16), causal=True).double()
    x = torch.randn(2, 13, 64, dtype=torch.float64, requires_grad=True)
    seen = []
    hook = torch.nn.modules.module.register_module_full_backward_pre_hook(
        lambda mod, gout: seen.append(gout[0]) if mod is m.qkv else None)
    try:
        m(x).sum().backward()
    finally:
        hook.remove()
    assert len(seen) == 1 and seen[0].shape[-1] == m.qkv.out_features
