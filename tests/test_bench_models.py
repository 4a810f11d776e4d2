"""CPU smoke test of bench/test_models.py: a tiny version of its nanoGPT-style model and the very
training step the benchmark times, for each provider's attention path, uncompiled, in float32.

flashtx runs through flashtx.patch_sdpa() as in the benchmark (on CPU: Triton's interpreter, set up
by conftest.py, or the reference backend). The three providers start from the same weights on the
same batch, so their losses and gradients must agree; each provider must reach the attention it
names (flashtx's, torch's SDPA, or the eager matmuls), and the AdamW step must move every weight.
A last test shows that the loss tolerance is tight enough to catch attention that ignores the
causal mask. No timing: nothing here measures speed.
"""
from __future__ import annotations

import math
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root, for `import bench`

import flashtx  # noqa: E402
from bench import test_models as tm  # noqa: E402
from conftest import spy_attention_calls  # noqa: E402

CFG = tm.GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=2, n_embd=32)
BATCH, SEQ = 2, 32
LOSS_TOL = 1e-5  # float32, the same math in a different order
GRAD_TOL = 1e-4  # max |g - g_sdpa| / max |g_sdpa| per parameter


@pytest.fixture
def counted(monkeypatch):
    """Counts calls that reach torch's SDPA unpatched (`sdpa`) and calls of flashtx's attention through the
    patch (`flashtx`: the op or a plain call's lane, conftest.spy_attention_calls), with the query shapes."""
    seen = {"sdpa": [], "flashtx": []}
    with flashtx.patch_sdpa():  # any one-time setup of the patch (a probe of flashtx.attention) before counting
        pass
    torch_sdpa = F.scaled_dot_product_attention

    def sdpa(q, *a, **kw):
        seen["sdpa"].append(tuple(q.shape))
        return torch_sdpa(q, *a, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", sdpa)
    spy_attention_calls(monkeypatch, lambda q: seen["flashtx"].append(tuple(q.shape)))
    return seen


def one_step(provider: str):
    """(loss, {name: grad}, {name: (before, after)}) of one benchmark training step."""
    model = tm.build_model(CFG, provider, "cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    grads = {}

    def capture(optimizer, args, kwargs):  # the gradients the step is about to use
        for group in optimizer.param_groups:
            for p in group["params"]:
                grads[names[id(p)]] = None if p.grad is None else p.grad.detach().clone()

    opt.register_step_pre_hook(capture)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    step = tm.make_train_step(model, opt, provider, amp_dtype=None)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # e.g. patch_sdpa handing a call back to torch's SDPA
        loss = step(tm.random_batch(CFG, BATCH, SEQ, "cpu"))
    moved = {n: (before[n], p.detach().clone()) for n, p in model.named_parameters()}
    assert all(p.grad is None for p in model.parameters()), "the step must set gradients to None"
    return loss, grads, moved


def test_tiny_model_train_step_agrees_across_providers(counted):
    tm.check_flashtx_takes(CFG, BATCH, SEQ, torch.float32, "cpu")
    results = {}
    for provider in tm.PROVIDERS:
        counted["sdpa"].clear(), counted["flashtx"].clear()
        results[provider] = one_step(provider)
        expected = {"flashtx": (0, CFG.n_layer), "sdpa": (CFG.n_layer, 0), "eager": (0, 0)}[provider]
        assert (len(counted["sdpa"]), len(counted["flashtx"])) == expected, (provider, counted)
        if provider == "flashtx":
            assert set(counted["flashtx"]) == {(BATCH, CFG.n_head, SEQ, CFG.n_embd // CFG.n_head)}
    assert F.scaled_dot_product_attention.__name__ == "sdpa"  # the patch was undone after the step

    ref_loss, ref_grads, _ = results["sdpa"]
    assert abs(ref_loss.item() - math.log(CFG.vocab_size)) < 0.5, ref_loss  # a fresh model: about ln(vocab)
    for provider, (loss, grads, moved) in results.items():
        assert torch.isfinite(loss), provider
        assert abs(loss.item() - ref_loss.item()) <= LOSS_TOL, (provider, loss.item(), ref_loss.item())
        assert grads.keys() == ref_grads.keys() and len(grads) == len(list(tm.GPT(CFG).parameters()))
        for name, g in grads.items():
            assert g is not None and torch.isfinite(g).all(), (provider, name)
            ref = ref_grads[name]
            assert ref.abs().max() > 0, name  # every parameter gets a gradient (the tied head included)
            rel = ((g - ref).abs().max() / ref.abs().max()).item()
            assert rel <= GRAD_TOL, (provider, name, rel)
        for name, (before, after) in moved.items():
            assert torch.isfinite(after).all() and not torch.equal(before, after), (provider, name)


def test_tolerances_catch_missing_causal_mask():
    """The checks above can fail: attention that sees the future gives a loss and gradients well
    outside LOSS_TOL and GRAD_TOL (a fresh model's loss is about ln(vocab) either way, so the
    gradients are the sharper check)."""
    batch = tm.random_batch(CFG, BATCH, SEQ, "cpu")
    losses, grads = [], []
    for causal in (True, False):
        model = tm.build_model(CFG, "eager", "cpu")
        if not causal:
            for m in model.modules():
                if isinstance(m, tm.CausalSelfAttention):
                    m.causal_mask = torch.zeros_like(m.causal_mask)
        loss = model(*batch)
        loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad for n, p in model.named_parameters()})
    assert abs(losses[0] - losses[1]) > 10 * LOSS_TOL, losses
    rel = max(((grads[1][n] - g).abs().max() / g.abs().max()).item() for n, g in grads[0].items())
    assert rel > 100 * GRAD_TOL, rel


def test_set_attention_rejects_unknown_provider():
    with pytest.raises(ValueError, match="provider must be one of"):
        tm.set_attention(tm.GPT(CFG), "flash")


@pytest.mark.parametrize("provider", ["sdpa", "eager"])
def test_tiny_model_traces_in_one_graph(provider):
    """The benchmark compiles with fullgraph=True: the model code itself must have no graph break
    (Dynamo only, backend="aot_eager", no Inductor; the flashtx path is traced in test_patch_sdpa.py)."""
    torch._dynamo.reset()
    model = tm.build_model(CFG, provider, "cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = tm.make_train_step(torch.compile(model, fullgraph=True, backend="aot_eager"), opt, provider, None)
    batch = tm.random_batch(CFG, BATCH, SEQ, "cpu")
    first, second = step(batch).item(), step(batch).item()
    assert abs(first - math.log(CFG.vocab_size)) < 0.5 and second < first, (first, second)
    torch._dynamo.reset()


def test_benchmark_records_tokens_per_s_from_idle_and_back_to_back(monkeypatch):
    """bench/test_models.py times the step back to back too (steady=True: it passed steady=False with the comment
    'tokens/s is steady', but tokens_per_s came from the from-idle median) and records both rates. The harness is
    replaced by a stand-in that returns fabricated times (10 ms from idle, 8 ms back to back): no model runs."""
    from types import SimpleNamespace

    from bench import harness

    seen = {}

    def run_case(benchmark, **kw):
        seen.update(kw)
        benchmark.extra_info.update(kw["info"], status="ok", median_ms=10.0, steady_ms=8.0)
        return benchmark.extra_info

    monkeypatch.setattr(harness, "run_case", run_case)
    bench = SimpleNamespace(group=None, extra_info={})
    tm.test_model_train(bench, "sdpa")
    assert seen["steady"] is True
    # SDPA's step and flashtx's are profiled kernel by kernel (where the gap between them lies); eager's is not
    assert seen["breakdown"] is True and seen["breakdown_top"] == tm.BREAKDOWN_TOP > harness.BREAKDOWN_TOP
    for provider, asked in (("flashtx", True), ("eager", False)):
        monkeypatch.setattr(harness, "build_or_skip", lambda *a, **k: None)  # (no flashtx probe, no model)
        tm.test_model_train(SimpleNamespace(group=None, extra_info={}), provider)
        assert seen["breakdown"] is asked, provider
    tokens = tm.B * tm.S
    assert bench.extra_info["tokens_per_s"] == pytest.approx(tokens / 0.010)
    assert bench.extra_info["tokens_per_s_steady"] == pytest.approx(tokens / 0.008)
    assert tm.tokens_per_s({"status": "OOM"}, tokens) == {}
    assert tm.tokens_per_s({"status": "ok", "median_ms": 10.0}, tokens) == {"tokens_per_s": tokens / 0.010}
