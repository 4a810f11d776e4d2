"""torch.compile(fullgraph=True) of flashtx.nn models: no graph breaks (torch._dynamo.explain), the
fused ops stay whole custom ops in the graph, compiled training matches eager step for step, and a
KV-cache decode step traces once and is reused as the cache grows (static shapes)."""
import copy

import pytest
import torch
import torch._dynamo
from conftest import DEVICE
from torch import nn
from torch._dynamo.testing import CompileCounter

from flashtx.nn import RotaryEmbedding, TransformerBlock

E, H, HKV, VOCAB = 32, 4, 2, 50


class Stack(nn.Module):
    """A two-block decoder LM: embedding, blocks sharing one RotaryEmbedding, head, mean loss."""

    def __init__(self):
        super().__init__()
        rope = RotaryEmbedding(8)
        self.emb = nn.Embedding(VOCAB, E)
        self.blocks = nn.ModuleList(TransformerBlock(E, H, HKV, hidden_dim=48, rotary=rope)
                                    for _ in range(2))
        self.head = nn.Linear(E, VOCAB)

    def forward(self, idx, key_mask=None, cache=None):
        x = self.emb(idx)
        for i, b in enumerate(self.blocks):
            x = b(x, key_mask=key_mask, cache=cache[i] if cache is not None else None)
        return self.head(x)

    def loss(self, idx, key_mask):
        logits = self(idx[:, :-1], key_mask[:, :-1])
        targets = idx[:, 1:].masked_fill(~key_mask[:, 1:], -100)  # padding ignored
        return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)


def batch():
    torch.manual_seed(1)
    idx = torch.randint(0, VOCAB, (2, 9), device=DEVICE)
    key_mask = torch.ones(2, 9, dtype=torch.bool, device=DEVICE)
    key_mask[1, -3:] = False
    return idx, key_mask


def flashtx_ops(graphs) -> set:
    return {str(n.target) for g in graphs for n in g.graph.nodes
            if n.op == "call_function" and str(n.target).startswith("flashtx.")}


def test_training_step_has_no_graph_breaks():
    torch.manual_seed(0)
    model = Stack().to(DEVICE)
    idx, key_mask = batch()
    ex = torch._dynamo.explain(model.loss)(idx, key_mask)
    assert ex.graph_break_count == 0, ex.break_reasons
    assert ex.graph_count == 1
    ops = flashtx_ops(ex.graphs)
    assert {"flashtx.attn_fwd.default", "flashtx.rotary_qk.default", "flashtx.swiglu_packed.default"} <= ops


def test_compiled_training_matches_eager():
    torch.manual_seed(0)
    model = Stack().to(DEVICE)
    twin = copy.deepcopy(model)
    compiled = torch.compile(model.loss, fullgraph=True)
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (model, twin)]
    idx, key_mask = batch()
    for step in range(3):
        losses = []
        for fn, opt in ((compiled, opts[0]), (twin.loss, opts[1])):
            loss = fn(idx, key_mask)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        torch.testing.assert_close(losses[0], losses[1], rtol=1e-4, atol=1e-5, msg=f"loss at step {step}")
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5, msg=f"parameter {name} after 3 steps")


@pytest.mark.parametrize("padded", [False, True], ids=["nopad", "leftpad"])
def test_decode_step_traces_once_without_breaks(padded):
    torch.manual_seed(0)
    model = Stack().to(DEVICE).eval()
    idx = torch.randint(0, VOCAB, (2, 8), device=DEVICE)
    key_mask = torch.ones(2, 8, dtype=torch.bool, device=DEVICE)
    if padded:
        key_mask[0, :2] = False

    def decode(prompt_len, step_fn):
        cache = [b.new_cache(2, max_len=8) for b in model.blocks]
        outs = [model(idx[:, :prompt_len], key_mask[:, :prompt_len], cache)]
        for t in range(prompt_len, 8):
            outs.append(step_fn(idx[:, t:t + 1], key_mask[:, t:t + 1], cache))
        return torch.cat(outs, dim=1), cache

    with torch.no_grad():
        eager_out, _ = decode(3, model)
        cache = [b.new_cache(2, max_len=8) for b in model.blocks]
        model(idx[:, :3], key_mask[:, :3], cache)
        ex = torch._dynamo.explain(model)(idx[:, 3:4], key_mask[:, 3:4], cache)
        assert ex.graph_break_count == 0, ex.break_reasons
        counter = CompileCounter()
        compiled = torch.compile(model, fullgraph=True, backend=counter)
        compiled_out, cache = decode(3, compiled)
    assert counter.frame_count == 1  # five decode steps (cache lengths 4..8), one trace
    assert int(cache[0].self_attn.length) == 8
    torch.testing.assert_close(compiled_out, eager_out)
