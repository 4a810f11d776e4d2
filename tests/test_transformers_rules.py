"""The Hugging Face integration's rules a mutation round found untested: transformers' defaults (a module without
is_causal is causal), training dropout, one decoding query seeing every key, a causal 2-D mask aligned bottom-right,
more queries than keys refused, packed sequences of a non-causal module, position_bias kept off the packed path and
cropped with the mask to the keys, flashtx_mask's offsets and short padding, the in-place RoPE's hook rules, and
apply_flashtx applied twice. Each test failed under one surviving mutation."""
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")  # CI installs it through the test extra
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import flashtx.integrations.transformers as ftx  # noqa: E402

F = torch.nn.functional
pytestmark = pytest.mark.usefixtures("fresh_plans")


@pytest.fixture(autouse=True)
def restore():
    yield
    ftx.restore_rope()


class Causal(torch.nn.Module):
    is_causal = True


class Bidirectional(torch.nn.Module):
    is_causal = False


def _close(got, want):
    torch.testing.assert_close(got, want.transpose(1, 2), atol=1e-5, rtol=1e-5)


def _rand(*shape):
    return torch.randn(*shape)


def test_a_module_without_is_causal_is_causal():
    q, k, v = (_rand(1, 2, 4, 8) for _ in range(3))
    _close(ftx.flashtx_attention_forward(torch.nn.Module(), q, k, v, None)[0],
           F.scaled_dot_product_attention(q, k, v, is_causal=True))


def test_training_dropout_is_applied():
    q, k, v = (_rand(1, 2, 16, 8) for _ in range(3))
    a = ftx.flashtx_attention_forward(Bidirectional(), q, k, v, None, dropout=0.5)[0]
    b = ftx.flashtx_attention_forward(Bidirectional(), q, k, v, None, dropout=0.0)[0]
    assert (a - b).abs().max() > 0.1


def test_one_decoding_query_sees_every_key():
    q, k, v = _rand(1, 2, 1, 8), _rand(1, 2, 5, 8), _rand(1, 2, 5, 8)
    _close(ftx.flashtx_attention_forward(Causal(), q, k, v, None)[0], F.scaled_dot_product_attention(q, k, v))


def test_a_causal_padding_mask_is_aligned_bottom_right():
    q, k, v = _rand(1, 2, 2, 8), _rand(1, 2, 5, 8), _rand(1, 2, 5, 8)
    full = torch.ones(2, 5, dtype=torch.bool).tril(diagonal=3)
    _close(ftx.flashtx_attention_forward(Causal(), q, k, v, torch.ones(1, 5, dtype=torch.bool))[0],
           F.scaled_dot_product_attention(q, k, v, attn_mask=full))


def test_more_queries_than_keys_is_refused_when_causal():
    q, k, v = _rand(1, 2, 5, 8), _rand(1, 2, 3, 8), _rand(1, 2, 3, 8)
    with pytest.raises(ValueError, match="more queries"):
        ftx.flashtx_attention_forward(Causal(), q, k, v, torch.ones(1, 3, dtype=torch.bool))


def test_packed_sequences_of_a_bidirectional_module_see_their_whole_sequence():
    q, k, v = (_rand(1, 2, 6, 8) for _ in range(3))
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    out = ftx.flashtx_attention_forward(Bidirectional(), q, k, v, None, cu_seq_lens_q=cu, cu_seq_lens_k=cu)[0]
    _close(out, torch.cat([F.scaled_dot_product_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b])
                           for a, b in ((0, 2), (2, 6))], 2))


def test_a_position_bias_is_applied_with_packed_arguments_too():
    q, k, v = (_rand(1, 2, 4, 8) for _ in range(3))
    bias, cu = _rand(1, 2, 4, 4), torch.tensor([0, 4], dtype=torch.int32)
    out = ftx.flashtx_attention_forward(Bidirectional(), q, k, v, None, position_bias=bias, cu_seq_lens_q=cu,
                                        cu_seq_lens_k=cu)[0]
    _close(out, F.scaled_dot_product_attention(q, k, v, attn_mask=bias))


@pytest.mark.parametrize("what", ["position_bias", "mask"])
def test_a_wider_bias_or_mask_is_cropped_to_the_keys(what):
    q, k, v = (_rand(1, 2, 4, 8) for _ in range(3))
    if what == "mask":
        mask = torch.ones(1, 1, 4, 7, dtype=torch.bool)
        mask[..., 1] = False
        out = ftx.flashtx_attention_forward(Bidirectional(), q, k, v, mask)[0]
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[..., :4])
    else:
        bias = _rand(1, 2, 4, 6)
        out = ftx.flashtx_attention_forward(Bidirectional(), q, k, v, None, position_bias=bias)[0]
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=bias[..., :4])
    _close(out, want)


def test_flashtx_mask_with_a_kv_offset_is_sdpas_mask():
    from transformers import masking_utils as mu

    kw = dict(batch_size=1, q_length=2, kv_length=4, q_offset=2, kv_offset=2, device="cpu")
    got, want = ftx.flashtx_mask(**kw), mu.sdpa_mask(**kw)
    assert got is not None and torch.equal(got, want), (got, want)


def test_flashtx_mask_pads_a_short_padding_mask():
    pad = torch.tensor([[False, True, True, True]])
    got = ftx.flashtx_mask(batch_size=1, q_length=1, kv_length=5, q_offset=4, kv_offset=0, attention_mask=pad,
                           device="cpu")
    assert got.tolist() == [[False, True, True, True, False]]


class _Attn(torch.nn.Module):
    def __init__(self, k_proj=True, q_norm=False):
        super().__init__()
        self.q_proj = torch.nn.Linear(4, 4)
        if k_proj:
            self.k_proj = torch.nn.Linear(4, 4)
        if q_norm:
            self.q_norm = torch.nn.LayerNorm(4)

    def forward(self, q, k, cos, sin):
        return ftx.apply_rotary_pos_emb(q, k, cos, sin)


@pytest.mark.parametrize("case", ["no-k_proj", "hooked-q_norm"])
def test_rope_is_not_in_place_where_the_caller_may_hold_q_or_k(case):
    mod = _Attn(k_proj=case != "no-k_proj", q_norm=case == "hooked-q_norm")
    if case == "hooked-q_norm":
        mod.q_norm.register_forward_hook(lambda m, i, o: None)
    torch.manual_seed(0)
    q, k = _rand(1, 2, 8, 16), _rand(1, 2, 8, 16)
    q0, k0 = q.clone(), k.clone()
    ang = _rand(1, 8, 8)
    with torch.no_grad():
        mod(q, k, torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1))
    assert torch.equal(q, q0) and torch.equal(k, k0)


def test_apply_flashtx_twice_updates_fused_mlps_and_restores_transformers_rope():
    import transformers.models.llama.modeling_llama as ml

    orig = ml.apply_rotary_pos_emb
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    ftx.apply_flashtx(model, attention=False, inplace_backward=True)
    ftx.apply_flashtx(model, attention=False, inplace_backward=False)
    assert model.model.layers[0].mlp._flashtx_inplace_backward is False
    ftx.restore_rope()
    assert ml.apply_rotary_pos_emb is orig
