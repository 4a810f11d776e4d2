"""Autograd usage of real training code: option tensors made under torch.inference_mode (a mask cached in an eval
pass) in a training step, swiglu's in-place backward where one input needs no gradient, learned ALiBi slopes
(refused: their gradient would be dropped), and the kv-packed form under autocast. Each through the general path
and a repeated call's lane (the first call plans, the second replays)."""
import pytest
import torch
from conftest import DEVICE, PRECISE_DTYPE, randn

import flashtx

pytestmark = pytest.mark.usefixtures("fresh_plans")


def _grads(out, *ts):
    dout = torch.ones_like(out)
    return torch.autograd.grad(out, ts, dout)


@pytest.mark.parametrize("kind", ["attn_mask", "key_mask", "kv_lens", "alibi_slopes"])
def test_inference_mode_options_in_a_training_step(kind):
    """Autograd cannot save an inference tensor: such option tensors are saved as clones (they raised 'Inference
    tensors cannot be saved for backward'; SDPA takes a bool mask made so). Same values as ordinary ones."""
    B, H, S, D = 2, 2, 9, 16
    q, k, v = (randn(B, H, S, D, dtype=PRECISE_DTYPE, requires_grad=True) for _ in range(3))

    def make():
        if kind == "attn_mask":
            return torch.ones(B, 1, S, S, dtype=torch.bool, device=DEVICE).tril()
        if kind == "key_mask":
            m = torch.ones(B, S, dtype=torch.bool, device=DEVICE)
            m[1, -3:] = False
            return m
        if kind == "kv_lens":
            return torch.tensor([S, S - 4], dtype=torch.int32, device=DEVICE)
        return torch.tensor([0.5, 0.25], dtype=torch.float32, device=DEVICE)

    with torch.inference_mode():
        frozen = make()
    assert frozen.is_inference()
    want_out = flashtx.attention(q, k, v, **{kind: make()})
    want = _grads(want_out, q, k, v)
    for _ in range(2):  # the general path, then the lane
        out = flashtx.attention(q, k, v, **{kind: frozen})
        torch.testing.assert_close(out, want_out, atol=0, rtol=0)
        for a, b in zip(_grads(out, q, k, v), want):
            torch.testing.assert_close(a, b, atol=0, rtol=0)


@pytest.mark.parametrize("frozen", ["gate", "up"])
def test_swiglu_inplace_backward_keeps_an_input_that_needs_no_gradient(frozen):
    """inplace_backward=True with one input not requiring grad (a frozen projection's output): that input keeps
    its values (the backward wrote a discarded gradient over it), the other's gradient is right."""
    for _ in range(2):  # the op's backward, then the lane's
        g, u = (randn(3, 7, 40, dtype=PRECISE_DTYPE) for _ in range(2))
        keep = (g if frozen == "gate" else u).clone()
        live = (u if frozen == "gate" else g).clone().requires_grad_(True)
        gate, up = (g, live * 1.0) if frozen == "gate" else (live * 1.0, u)  # the live one: a non-leaf
        out = flashtx.swiglu(gate, up, inplace_backward=True)
        out.backward(torch.ones_like(out))
        torch.testing.assert_close(g if frozen == "gate" else u, keep, atol=0, rtol=0)
        ref_live = live.detach().clone().requires_grad_(True)
        ref = (torch.nn.functional.silu(keep) * ref_live if frozen == "gate"
               else torch.nn.functional.silu(ref_live) * keep)
        ref.backward(torch.ones_like(ref))
        torch.testing.assert_close(live.grad, ref_live.grad, atol=1e-12, rtol=0)


def test_learned_alibi_slopes_warned(monkeypatch):
    """Slopes that require grad get none (as flash-attn's): said once (their gradient was dropped silently); not an
    error (an eval loop without no_grad over learned slopes runs)."""
    from flashtx import _validate

    monkeypatch.setattr(_validate, "_warned_alibi", [])
    q = randn(1, 5, 2, 16, requires_grad=True)
    slopes = torch.tensor([0.5, 0.25], device=DEVICE, requires_grad=True)
    with pytest.warns(UserWarning, match="alibi_slopes requires grad, but the kernels compute no gradient"):
        out = flashtx.flash_attn_func(q, q, q, alibi_slopes=slopes)
    out.sum().backward()
    assert slopes.grad is None and q.grad is not None
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # once a process; none without grad or for detached slopes
        flashtx.flash_attn_func(q, q, q, alibi_slopes=slopes)
        with torch.no_grad():
            flashtx.flash_attn_func(q, q, q, alibi_slopes=slopes)
        monkeypatch.setattr(_validate, "_warned_alibi", [])
        flashtx.flash_attn_func(q, q, q, alibi_slopes=slopes.detach()).sum().backward()


def test_kvpacked_under_autocast_casts_as_flash_attn_func():
    """fp32 q (learned queries) with an fp16 kv under autocast: cast as flash_attn_func casts (kv's dtype check
    raised first)."""
    q = randn(2, 3, 4, 16)
    kv = randn(2, 6, 2, 2, 16, dtype=torch.float16)
    with torch.autocast(DEVICE, dtype=torch.float16):
        out = flashtx.flash_attn_kvpacked_func(q, kv)
        want = flashtx.flash_attn_func(q, kv[:, :, 0], kv[:, :, 1])
    assert out.dtype == torch.float16
    torch.testing.assert_close(out, want, atol=0, rtol=0)
