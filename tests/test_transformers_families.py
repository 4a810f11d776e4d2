"""attn_implementation="ftx" beyond the LLaMA family: T5's relative position bias (added to the scores, its gradient
flowing), against the float64 reference; families whose modeling code computes attention itself (Bloom, MPT) are
refused by name instead of getting masks meant for flashtx."""
import copy
import os

import pytest
import torch
from conftest import DEVICE, assert_close_to_reference

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")  # CI installs it through the test extra

import flashtx.integrations.transformers as ftx  # noqa: E402


def _eager_with_bias(q, k, v, bias, mask, causal, scale):
    """T5's eager attention in float64: scores * scale + position_bias (+ mask), top-left causal when asked."""
    s = (q @ k.transpose(-1, -2)) * scale + bias
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril().logical_not(),
                          float("-inf"))
    return (s.softmax(-1) @ v).transpose(1, 2)


@pytest.mark.parametrize("mask_kind", ["none-causal", "none-static-tail", "2d", "4d-bool", "4d-float", "none-full"])
def test_position_bias_is_added_to_the_scores_with_every_mask_kind(mask_kind):
    """flashtx_attention_forward(position_bias=...) equals scores + bias (+ mask) -> softmax in float64, and the
    bias gets its gradient, whichever form the mask takes (transformers' sdpa folds them the same way)."""
    torch.manual_seed(0)
    B, H, Sq, Sk, D = 2, 3, 5, 5, 8
    if mask_kind == "none-static-tail":  # an empty static cache's unused tail: cut off with the bias's columns
        Sk = 9
    q, k, v = (torch.randn(B, H, s, D, dtype=torch.float64, device=DEVICE) for s in (Sq, Sk, Sk))
    bias = torch.randn(1, H, Sq, Sk, dtype=torch.float64, device=DEVICE, requires_grad=True)
    module, causal, mask, ref_mask = torch.nn.Module(), True, None, None
    if mask_kind == "none-full":
        causal = False
    if mask_kind == "2d":  # flashtx_mask's (B, Sk) padding mask: bottom-right causal (Sq == Sk here: top-left too)
        mask = torch.ones(B, Sk, dtype=torch.bool, device=DEVICE)
        mask[0, 1:3] = False  # (key 0 stays: every causal row sees a key)
        ref_mask = mask[:, None, None, :]
    if mask_kind.startswith("4d"):
        vis = torch.rand(B, 1, Sq, Sk, device=DEVICE) > 0.3
        vis[..., 0] = True
        causal = False  # a 4-D mask carries everything
        mask = vis if mask_kind == "4d-bool" else torch.zeros(vis.shape, dtype=torch.float64,
                                                               device=DEVICE).masked_fill(~vis, -1e4)
        ref_mask = mask
    module.is_causal = causal
    out, _ = ftx.flashtx_attention_forward(module, q, k, v, mask, scaling=0.5, position_bias=bias)
    kk, vv, bb = k, v, bias
    if mask_kind == "none-static-tail":
        kk, vv, bb = k[:, :, :Sq], v[:, :, :Sq], bias[..., :Sq]
    want = _eager_with_bias(q, kk, vv, bb, ref_mask, causal and mask_kind != "2d", 0.5)
    if mask_kind == "2d":  # causal over a (B, Sk) padding mask
        want = _eager_with_bias(q, kk, vv, bb, ref_mask & torch.ones(Sq, Sk, dtype=torch.bool, device=DEVICE).tril(),
                                False, 0.5)
    torch.testing.assert_close(out, want, atol=1e-12, rtol=0)
    g = torch.randn_like(out)
    (db,) = torch.autograd.grad(out, bias, g)
    (db_want,) = torch.autograd.grad(want, bias, g)
    torch.testing.assert_close(db, db_want, atol=1e-12, rtol=0)


def test_t5_logits_and_gradients_match_the_reference():
    """A tiny T5 (relative position bias in every layer, padded encoder batch): logits and every gradient,
    the relative_attention_bias tables included, follow the tolerance rule against float64."""
    cfg = transformers.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_decoder_layers=2,
                                num_heads=4, relative_attention_num_buckets=8, dropout_rate=0.0, pad_token_id=0,
                                eos_token_id=1, decoder_start_token_id=0)
    torch.manual_seed(0)
    eager = transformers.T5ForConditionalGeneration(copy.deepcopy(cfg)).to(DEVICE)
    with torch.no_grad():  # trained-like position biases (the random init's are tiny)
        for name, p in eager.named_parameters():
            if "relative_attention_bias" in name:
                p.mul_(20)
    ref = copy.deepcopy(eager).double()
    ftx.register()
    fused = transformers.T5ForConditionalGeneration._from_config(copy.deepcopy(cfg), attn_implementation=ftx.NAME)
    fused = fused.to(DEVICE)
    fused.load_state_dict(eager.state_dict())
    torch.manual_seed(1)
    ids = torch.randint(3, 64, (2, 10), device=DEVICE)
    mask = torch.ones(2, 10, dtype=torch.long, device=DEVICE)
    mask[0, 6:] = 0
    labels = torch.randint(3, 64, (2, 7), device=DEVICE)

    def run(model):
        out = model(input_ids=ids, attention_mask=mask, labels=labels)
        out.loss.backward()
        return out.logits, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    (logits_e, grads_e), (logits_r, grads_r), (logits_f, grads_f) = run(eager), run(ref), run(fused)
    assert_close_to_reference("T5 logits", logits_f, logits_r, logits_e)
    assert set(grads_f) == set(grads_r) and any("relative_attention_bias" in n for n in grads_r)
    for name in grads_r:
        assert_close_to_reference(f"d {name}", grads_f[name], grads_r[name], grads_e[name], grad=True)


def test_families_that_compute_attention_themselves_are_refused_by_name():
    """Bloom's modeling code takes transformers' mask but computes attention itself: with flashtx's compact masks
    it gave wrong logits silently (no causal mask) or a size error. The mask function now refuses it by name."""
    ftx.register()
    cfg = transformers.BloomConfig(vocab_size=64, hidden_size=32, n_layer=1, n_head=4)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=ftx.NAME).to(DEVICE)
    ids = torch.randint(3, 64, (1, 6), device=DEVICE)
    with pytest.raises(ValueError, match=r"cannot serve model_type 'bloom': its modeling code computes attention "
                                         r"itself.*use attn_implementation='eager'"):
        model(input_ids=ids)
    assert ftx._calls_attention_interface("t5") and ftx._calls_attention_interface("llama")
    assert not ftx._calls_attention_interface("mpt")
    assert ftx._calls_attention_interface("not-a-transformers-family")  # remote code: nothing to read


def test_falcon_with_alibi_gets_the_full_mask_it_adds_alibi_to():
    """Falcon with alibi=True asks for a full mask (allow_is_causal_skip=False) and adds its ALiBi bias to it. A
    compact mask (None or (B, Sk) padding) lost the causal part: a one-row padded batch attended to future tokens
    (logits off by ~0.25), others raised. Logits equal transformers' sdpa's."""
    import warnings

    cfg = transformers.FalconConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                    alibi=True, new_decoder_architecture=False, multi_query=False)
    torch.manual_seed(0)
    sdpa = transformers.FalconForCausalLM._from_config(copy.deepcopy(cfg), attn_implementation="sdpa").to(DEVICE)
    ftx.register()
    try:
        fused = transformers.FalconForCausalLM._from_config(copy.deepcopy(cfg), attn_implementation=ftx.NAME)
    except (KeyError, ValueError) as e:  # transformers versions whose Falcon computes attention itself
        pytest.skip(f"this transformers' Falcon takes no registered attention: {e}")
    fused = fused.to(DEVICE)
    fused.load_state_dict(sdpa.state_dict())
    ids = torch.randint(3, 64, (2, 9), device=DEVICE)
    pad = torch.ones(2, 9, dtype=torch.long, device=DEVICE)
    pad[0, :3] = 0
    for kw in (dict(input_ids=ids[:1], attention_mask=pad[:1]), dict(input_ids=ids, attention_mask=pad),
               dict(input_ids=ids)):
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            want, got = sdpa.eval()(**kw).logits, fused.eval()(**kw).logits
        real = kw.get("attention_mask", torch.ones_like(kw["input_ids"])).bool()
        torch.testing.assert_close(got[real], want[real], atol=1e-5, rtol=1e-5)
