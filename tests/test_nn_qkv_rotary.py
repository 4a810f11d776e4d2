"""Training flashtx.nn.MultiheadAttention with RoPE rotates q and k in place in the projection's output
(flashtx/nn/_qkv_rotary.py): the same outputs and gradients as the out-of-place rotation (bitwise in the
interpreter: the same kernels), attention saving views of the one projection (not rotated copies beside it), and the
out-of-place rotation wherever the in-place node must not run (a forward hook, no grad)."""
import warnings

import pytest
import torch
from conftest import PRECISE_DTYPE, randn

from flashtx.nn import MultiheadAttention, RotaryEmbedding, _qkv_rotary

E = 64


@pytest.fixture(autouse=True)
def small_projections(monkeypatch):
    """The in-place node for the tests' small projections (it starts at _qkv_rotary.MIN_NUMEL elements): the branch a
    GPU takes at training sizes, on interpreter-sized inputs."""
    monkeypatch.setattr(_qkv_rotary, "MIN_NUMEL", 0)


def _layer(heads, kv_heads, rotary, bias, dtype):
    torch.manual_seed(0)
    return MultiheadAttention(E, heads, num_kv_heads=kv_heads, rotary=rotary, causal=True, bias=bias).to(dtype)


def _run(m, x, g, out_of_place: bool):
    """out and the gradients of x and every parameter; out_of_place: a forward hook on the projection, which sends
    the layer to the out-of-place rotation (a hook may keep the output)."""
    hook = m.qkv.register_forward_hook(lambda *a: None) if out_of_place else None
    try:
        out = m(x)
        grads = torch.autograd.grad(out, [x, *m.parameters()], g)
    finally:
        if hook is not None:
            hook.remove()
    return out, grads


CASES = {
    "mha-bias": (4, 4, lambda: RotaryEmbedding(16), True),
    "gqa-no-bias": (4, 2, lambda: RotaryEmbedding(16), False),  # a Linear without bias returns no view
    "mqa-partial-interleaved": (4, 1, lambda: RotaryEmbedding(8, interleaved=True), True),
    "dynamic-ntk": (4, 2, lambda: RotaryEmbedding(16, max_seq_len=8, scaling={"rope_type": "dynamic",
                                                                               "factor": 2.0}), True),
}


@pytest.mark.parametrize("dtype", [PRECISE_DTYPE, torch.float32], ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_in_place_rope_equals_the_out_of_place_rotation(case, dtype):
    heads, kv_heads, rotary, bias = CASES[case]
    m = _layer(heads, kv_heads, rotary(), bias, dtype)
    x = randn(2, 13, E, dtype=dtype, requires_grad=True)
    g = randn(2, 13, E, dtype=dtype)
    out, grads = _run(m, x, g, out_of_place=False)
    want, want_grads = _run(m, x, g, out_of_place=True)
    assert torch.equal(out, want)
    for a, b in zip(grads, want_grads):
        assert torch.equal(a, b)


def _saved_bytes(m, x) -> tuple:
    """(bytes of the distinct storages autograd saves for out = m(x), the RoPE tables aside; the autograd node names
    of the graph)."""
    storages = {}

    tables = {t.untyped_storage().data_ptr() for t in m.rotary.cos_sin(1)}  # (cos and sin: shared, not activations)

    def pack(t):
        if t.untyped_storage().data_ptr() not in tables:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = m(x)
    names, stack, seen = set(), [out.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(node.name())
        stack.extend(n for n, _ in node.next_functions)
    return sum(storages.values()), names


def test_attention_saves_the_rotated_projection_not_copies():
    """The rotated q and k are views of the projection the graph keeps anyway (through v): the saved storages shrink
    by the out-of-place rotation's q and k copies, (Hq + Hkv) x B x S x D elements."""
    B, S, heads, kv_heads, D = 2, 13, 4, 2, E // 4
    m = _layer(heads, kv_heads, RotaryEmbedding(16), True, torch.float32)
    x = randn(B, S, E, requires_grad=True)
    in_place, names = _saved_bytes(m, x)
    assert any("RotateQK" in n for n in names)
    hook = m.qkv.register_forward_hook(lambda *a: None)
    out_of_place, names = _saved_bytes(m, x)
    hook.remove()
    assert not any("RotateQK" in n for n in names)
    assert out_of_place - in_place == (heads + kv_heads) * B * S * D * 4


def test_no_grad_calls_rotate_as_before_and_frozen_inputs_still_take_the_node():
    m = _layer(4, 2, RotaryEmbedding(16), True, torch.float32)
    x = randn(2, 5, E, requires_grad=True)
    with torch.no_grad():
        want = m(x)
    out = m(x)
    torch.testing.assert_close(out.detach(), want, atol=0, rtol=0)
    _, names = _saved_bytes(m, randn(2, 5, E))  # nothing requires grad but the parameters: still training
    assert any("RotateQK" in n for n in names)


def test_small_projections_rotate_out_of_place(monkeypatch):
    monkeypatch.setattr(_qkv_rotary, "MIN_NUMEL", 10**9)
    m = _layer(4, 2, RotaryEmbedding(16), True, torch.float32)
    _, names = _saved_bytes(m, randn(2, 5, E, requires_grad=True))
    assert not any("RotateQK" in n for n in names)


@pytest.mark.parametrize("kind", ["full", "full-global", "legacy", "pre"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_backward_hooks_on_the_projection_fire_with_the_gradient(kind, bias):
    """A backward hook on qkv (full, global, the legacy kind, a pre-hook) sees the projection's output gradient
    (fuzz, 2026-12-07: the in-place node rotated the base of the view register_full_backward_hook returns, so the hook
    never fired): the layer rotates out of place then; gradients as without the hook."""
    m = _layer(4, 2, RotaryEmbedding(16), bias, PRECISE_DTYPE)
    x = randn(2, 13, E, dtype=PRECISE_DTYPE, requires_grad=True)
    g = randn(2, 13, E, dtype=PRECISE_DTYPE)
    want, want_grads = _run(m, x, g, out_of_place=True)
    seen = []
    if kind == "full":
        handle = m.qkv.register_full_backward_hook(lambda mod, gin, gout: seen.append(gout[0]))
    elif kind == "full-global":
        handle = torch.nn.modules.module.register_module_full_backward_hook(
            lambda mod, gin, gout: seen.append(gout[0]) if mod is m.qkv else None)
    elif kind == "legacy":
        handle = m.qkv.register_backward_hook(lambda mod, gin, gout: seen.append(gout[0]))
    else:
        handle = m.qkv.register_full_backward_pre_hook(lambda mod, gout: seen.append(gout[0]))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # (the legacy kind's deprecation, at backward)
            out, grads = _run(m, x, g, out_of_place=False)
    finally:
        handle.remove()
    assert len(seen) == 1 and seen[0].shape[-1] == m.qkv.out_features
    assert torch.equal(out, want)
    for a, b in zip(grads, want_grads):
        assert torch.equal(a, b)
