"""flashtx's RoPE against Hugging Face transformers on the points an audit (2026-12-04) found apart:
both apply_rotary_pos_emb signatures (4.x and 5.x), dynamic NTK with packed sequences and with an
original_max_position_embeddings entry, and partial_rotary_factor. The signature tests write transformers'
formula out (no transformers needed); the others build transformers' own rotary embeddings from local configs."""
import warnings

import pytest
import torch
from conftest import DEVICE, randn, rotate_half

import flashtx
import flashtx.integrations.transformers as ftx
from flashtx.nn import RotaryEmbedding

DROP_INS = {"flashtx": flashtx.apply_rotary_pos_emb, "integration": ftx.apply_rotary_pos_emb}


def hf5_apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    """transformers 5's modeling_llama.apply_rotary_pos_emb (no position_ids), written out."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def hf_cos_sin(S, dim, base=10000.0):
    """LlamaRotaryEmbedding's (1, S, dim) cos/sin (duplicated halves)."""
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64, device=DEVICE) / dim))
    freqs = torch.outer(torch.arange(S, dtype=torch.float64, device=DEVICE), inv)
    emb = torch.cat((freqs, freqs), -1)[None]
    return emb.cos().float(), emb.sin().float()


@pytest.mark.parametrize("name", DROP_INS)
def test_positional_fifth_int_is_transformers_5_unsqueeze_dim(name):
    """Audit t8: transformers 5's apply_rotary_pos_emb is (q, k, cos, sin, unsqueeze_dim=1); the drop-ins took a
    positional 5th argument as 4.x's position_ids and dropped it, so (B, S, H, D) q/k were rotated as (B, H, S,
    D): silently wrong when S == H. An int there is unsqueeze_dim; a tensor or None is still 4.x's position_ids
    (ignored with (B, S, dim) cos/sin, as transformers did)."""
    fn = DROP_INS[name]
    B, S, H, D = 1, 4, 4, 8  # S == H: no shape error to catch the wrong layout
    q, k = randn(B, S, H, D), randn(B, S, H, D)  # (B, S, H, D): unsqueeze_dim=2
    cos, sin = hf_cos_sin(S, D)
    want_q, want_k = hf5_apply_rotary_pos_emb(q, k, cos, sin, 2)
    with torch.no_grad():
        for args, kw in (((2,), {}), ((2,), {"unsqueeze_dim": 2}), ((), {"unsqueeze_dim": 2}),
                         ((None, 2), {}), ((torch.zeros(B, S, dtype=torch.long, device=DEVICE), 2), {})):
            got_q, got_k = fn(q.clone(), k.clone(), cos, sin, *args, **kw)
            torch.testing.assert_close(got_q, want_q, rtol=0, atol=1e-6, msg=f"{args} {kw}")
            torch.testing.assert_close(got_k, want_k, rtol=0, atol=1e-6, msg=f"{args} {kw}")
        qb, kb = q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous()  # (B, H, S, D): unsqueeze_dim=1
        want_b = hf5_apply_rotary_pos_emb(qb, kb, cos, sin, 1)[0]
        for args in ((1,), (None,), (None, 1), (True,)):  # a bool is not an int here (position_ids, ignored)
            torch.testing.assert_close(fn(qb.clone(), kb.clone(), cos, sin, *args)[0], want_b, rtol=0, atol=1e-6)
    with pytest.raises(TypeError, match=r"got unsqueeze_dim twice: 2 as the fifth argument .* and unsqueeze_dim=3"):
        fn(q, k, cos, sin, 2, unsqueeze_dim=3)
    with pytest.raises(ValueError, match=r"unsqueeze_dim must be 1 .* or 2 .*; got 3"):
        fn(q, k, cos, sin, 3)


def _hf_rotary(**cfg):
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers.LlamaConfig(), "rope_parameters"):
        pytest.skip("transformers 5's rope_parameters")
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    return transformers, LlamaRotaryEmbedding(transformers.LlamaConfig(**cfg))


def test_dynamic_ntk_packed_sequences_match_transformers_position_ids():
    """Audit t7: packed sequences with a loose max_seqlen rotate as transformers rotates them from their
    position_ids (its NTK length is max(position_ids) + 1, not a bound)."""
    D, H, L0 = 16, 2, 8
    sc = {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0}
    for lens in ([6, 4], [12, 3]):  # within L0, past it
        _, hf = _hf_rotary(hidden_size=D * H, num_attention_heads=H, head_dim=D, max_position_embeddings=L0,
                           rope_parameters=dict(sc))
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
        x = randn(sum(lens), H, D)
        pos = torch.cat([torch.arange(n) for n in lens])[None].to(DEVICE)
        cos, sin = hf.to(DEVICE)(x, pos)  # (1, total, D)
        want = hf5_apply_rotary_pos_emb(x.transpose(0, 1)[None], x.transpose(0, 1)[None], cos, sin)[0]
        for bound in (None, max(lens), 64):
            rope = RotaryEmbedding(D, max_seq_len=L0, scaling=dict(sc)).to(DEVICE)
            got = rope(x.clone(), cu_seqlens=cu, max_seqlen=bound)
            torch.testing.assert_close(got, want[0].transpose(0, 1), rtol=0, atol=2e-5, msg=f"{lens} {bound}")


def test_dynamic_original_max_position_embeddings_as_transformers():
    """Audit t2: the same dynamic rope_parameters, with an original_max_position_embeddings entry, give
    transformers' frequencies over a sequence of lengths (grow, keep, reset), with max_seq_len =
    max_position_embeddings."""
    hd, L0 = 32, 64
    rp = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0, "original_max_position_embeddings": 32}
    _, hf = _hf_rotary(hidden_size=hd * 4, num_attention_heads=4, head_dim=hd, max_position_embeddings=L0,
                       rope_parameters=dict(rp))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (it names the ignored entry: tested in test_rotary_embedding)
        fx = RotaryEmbedding(hd, max_seq_len=L0, scaling=dict(rp))
    for L in (32, 100, 80, 64, 50, 64, 70, 200, 64, 10):
        cos, sin = hf(torch.zeros(1), torch.arange(L)[None])
        c, s = fx.cos_sin(L)
        torch.testing.assert_close(c, cos[0, :, :hd // 2], rtol=0, atol=5e-5, msg=f"L={L}")
        torch.testing.assert_close(s, sin[0, :, :hd // 2], rtol=0, atol=5e-5, msg=f"L={L}")


def test_partial_rotary_factor_of_a_transformers_config_is_refused():
    """Audit t9: GPT-NeoX's rope_parameters (rotary_pct 0.25) were accepted and rotated the whole head; the error
    says to pass the rotary dim, which then gives transformers' tables."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPTNeoXConfig(hidden_size=64, num_attention_heads=2, rotary_pct=0.25)  # head_dim 32
    params = getattr(cfg, "rope_parameters", None)
    if not params or "partial_rotary_factor" not in params:
        pytest.skip("transformers 5's rope_parameters")
    from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXRotaryEmbedding

    with pytest.raises(ValueError, match=r"partial_rotary_factor is 0.25.*pass dim=int\(head_dim \* 0.25\)"):
        RotaryEmbedding(32, scaling=params)
    rope = RotaryEmbedding(int(32 * 0.25), scaling={**params, "partial_rotary_factor": 1.0})
    cos, _ = GPTNeoXRotaryEmbedding(cfg)(torch.zeros(1), torch.arange(6)[None])
    assert cos.shape[-1] == 8
    torch.testing.assert_close(rope.cos_sin(6)[0], cos[0, :, :4], rtol=0, atol=1e-6)


@pytest.mark.parametrize("name", DROP_INS)
@pytest.mark.parametrize("dim", [-3, -2])
def test_negative_unsqueeze_dim_as_transformers(name, dim):
    """transformers unsqueezes cos/sin at unsqueeze_dim: -3 is 1 ((B, H, S, D) q/k), -2 is 2 ((B, S, H, D))."""
    shape = (2, 3, 5, 8) if dim == -3 else (2, 5, 3, 8)  # (B, H, S, D) or (B, S, H, D)
    q, k = randn(*shape), randn(*shape)
    cos, sin = hf_cos_sin(5, 8)
    got = DROP_INS[name](q, k, cos, sin, unsqueeze_dim=dim)
    want = hf5_apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=dim)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match=r"unsqueeze_dim must be 1 \(or -3"):
        DROP_INS[name](q, k, cos, sin, unsqueeze_dim=-1)


def test_table_errors_name_the_tables_given():
    """The checks read the caller's full-width tables: an error names their shape, not the half it reads."""
    q, k = randn(2, 3, 5, 8), randn(2, 1, 5, 8)
    c = randn(3, 5, 8)
    with pytest.raises(ValueError, match=r"batch size 1 or q's 2; got shape \(3, 5, 8\)"):
        flashtx.apply_rotary_pos_emb(q, k, c, c)
    c = randn(2, 5, 12)
    with pytest.raises(ValueError, match=r"rotary_dim = cos.shape\[-1\] = 12 must be at most the head dim 8"):
        flashtx.apply_rotary_pos_emb(q, k, c, c)


def test_max_seqlen_without_cu_seqlens_is_ignored_as_flash_attn():
    x = randn(2, 5, 3, 8)
    cos, sin = (randn(16, 4) for _ in range(2))
    want = flashtx.apply_rotary_emb(x, cos, sin)
    torch.testing.assert_close(flashtx.apply_rotary_emb(x, cos, sin, False, False, 0, None, 5), want, atol=0, rtol=0)


@pytest.mark.parametrize("qk", [False, True])
def test_inference_tensors_outside_inference_mode_are_not_rotated_in_place(qk):
    """torch refuses in-place updates of inference tensors outside inference mode: inplace=True says so (nothing
    written), inplace=None (nn.RotaryEmbedding's default) rotates out of place; inside inference mode both are in
    place."""
    with torch.inference_mode():
        x, y = randn(2, 5, 3, 8), randn(2, 5, 3, 8)
    cos, sin = (randn(16, 4) for _ in range(2))
    x0, y0 = x.clone(), y.clone()

    def rotate(inplace):
        if qk:
            return flashtx.apply_rotary_qk(x, y, cos, sin, inplace=inplace)
        return flashtx.apply_rotary(x, cos, sin, inplace=inplace), None

    with pytest.raises(RuntimeError, match="inference tensor outside InferenceMode"):
        rotate(True)
    for _ in range(2):  # (the second: a lane's call)
        xr, yr = rotate(None)
        assert torch.equal(x, x0) and torch.equal(y, y0) and xr is not x
        torch.testing.assert_close(xr, flashtx.apply_rotary(x0, cos, sin), atol=0, rtol=0)
    with torch.inference_mode():
        for _ in range(2):
            assert rotate(True)[0] is x
