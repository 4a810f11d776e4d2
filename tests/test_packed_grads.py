"""The packed forms' gradients written in place (flashtx/_packing.py): where the packed tensor is dense, the
attention backward writes dq, dk, dv (dk, dv) as slices of one buffer and that buffer is the packed gradient, with
no stack copy; everywhere else the slices' gradients are stacked, as unbind's backward does. Both against the
unpacked call's gradients (bitwise on CPU: the same kernels on the same values) and the float64 reference."""
import pytest
import torch
from conftest import DEVICE, PRECISE_DTYPE, poisoned_allocations, precise_atol, randn

import flashtx
from flashtx import _packing, reference

SAME = dict(atol=precise_atol(0.0), rtol=0)


@pytest.fixture(autouse=True)
def small_packs(monkeypatch):
    """The in-place path for the tests' small packed tensors (it starts at _packing.MIN_NUMEL elements): the branch a
    GPU takes at training sizes, on interpreter-sized inputs."""
    monkeypatch.setattr(_packing, "MIN_NUMEL", 0)
    monkeypatch.setattr("flashtx._attention_lane.MIN_NUMEL", 0)


class _Stacks(list):
    """The stack calls aten saw while `with` it was open (the profiler's record of every op: unbind's C++
    backward and the packed forms' fallback both assemble with aten::stack)."""

    def __enter__(self):
        self.clear()
        self._prof = torch.autograd.profiler.profile()
        self._prof.__enter__()
        return self

    def __exit__(self, *exc):
        self._prof.__exit__(*exc)
        self.extend(e.name for e in self._prof.function_events if e.name == "aten::stack")


@pytest.fixture
def stacks():
    return _Stacks()


def _unpacked_grads(call, tensors, g):
    """The gradients of the same call on detached copies of the slices: (the packed call's reference)."""
    copies = [t.detach().clone().requires_grad_(True) for t in tensors]
    return torch.autograd.grad(call(*copies), copies, g)


def _ref_bshd(q, k, v, causal):  # (B, S, H, D) in and out, float64, bottom-right
    qh, kh, vh = (t.transpose(1, 2).to(torch.float64) for t in (q, k, v))
    return reference.attention(qh, kh, vh, scale=q.shape[-1] ** -0.5, causal=causal, bottom_right=True).transpose(1, 2)


@pytest.mark.parametrize("dtype", [PRECISE_DTYPE, torch.float16])
def test_qkvpacked_gradient_is_the_buffer_the_backward_wrote(dtype, stacks):
    torch.manual_seed(0)
    B, S, H, D = 2, 37, 3, 16
    qkv = randn(B, S, 3, H, D, dtype=dtype, requires_grad=True)
    g = randn(B, S, H, D, dtype=dtype)
    with poisoned_allocations(), stacks:  # every element of the buffer must be written
        out = flashtx.flash_attn_qkvpacked_func(qkv, causal=True)
        (dqkv,) = torch.autograd.grad(out, qkv, g)
    assert stacks == [] and dqkv.shape == qkv.shape and dqkv.stride() == qkv.stride()
    grads = _unpacked_grads(lambda q, k, v: flashtx.flash_attn_func(q, k, v, causal=True), qkv.unbind(2), g)
    torch.testing.assert_close(dqkv, torch.stack(grads, 2), **SAME)
    if dtype is PRECISE_DTYPE:  # and the float64 reference's gradients
        parts = [t.detach().to(torch.float64).requires_grad_(True) for t in qkv.unbind(2)]
        want = torch.autograd.grad(_ref_bshd(*parts, True), parts, g.to(torch.float64))
        torch.testing.assert_close(dqkv, torch.stack(want, 2).to(dtype), atol=precise_atol(1e-11), rtol=0)


def test_kvpacked_gqa_and_varlen_forms_write_in_place(stacks):
    torch.manual_seed(1)
    q = randn(2, 9, 4, 16, dtype=PRECISE_DTYPE, requires_grad=True)
    kv = randn(2, 21, 2, 2, 16, dtype=PRECISE_DTYPE, requires_grad=True)  # GQA 4/2
    g = randn(2, 9, 4, 16, dtype=PRECISE_DTYPE)
    with stacks:
        dq, dkv = torch.autograd.grad(flashtx.flash_attn_kvpacked_func(q, kv, causal=True), (q, kv), g)
    assert stacks == []
    want = _unpacked_grads(lambda q, k, v: flashtx.flash_attn_func(q, k, v, causal=True), (q, *kv.unbind(2)), g)
    torch.testing.assert_close(dq, want[0], **SAME)
    torch.testing.assert_close(dkv, torch.stack(want[1:], 2), **SAME)
    cu = torch.tensor([0, 5, 16, 17], dtype=torch.int32, device=DEVICE)
    qkv = randn(17, 3, 2, 16, dtype=PRECISE_DTYPE, requires_grad=True)
    g = randn(17, 2, 16, dtype=PRECISE_DTYPE)
    with stacks:
        (dqkv,) = torch.autograd.grad(flashtx.flash_attn_varlen_qkvpacked_func(qkv, cu, 11, causal=True), qkv, g)
    assert stacks == []
    want = _unpacked_grads(lambda q, k, v: flashtx.flash_attn_varlen_func(q, k, v, cu, cu, 11, 11, causal=True),
                           qkv.unbind(1), g)
    torch.testing.assert_close(dqkv, torch.stack(want, 1), **SAME)
    q = randn(17, 4, 16, dtype=PRECISE_DTYPE, requires_grad=True)
    kv = randn(17, 2, 2, 16, dtype=PRECISE_DTYPE, requires_grad=True)
    g = randn(17, 4, 16, dtype=PRECISE_DTYPE)
    with stacks:
        dq, dkv = torch.autograd.grad(flashtx.flash_attn_varlen_kvpacked_func(q, kv, cu, cu, 11, 11), (q, kv), g)
    assert stacks == []
    want = _unpacked_grads(lambda q, k, v: flashtx.flash_attn_varlen_func(q, k, v, cu, cu, 11, 11),
                           (q, *kv.unbind(1)), g)
    torch.testing.assert_close(dq, want[0], **SAME)
    torch.testing.assert_close(dkv, torch.stack(want[1:], 1), **SAME)


def test_packing_is_part_of_the_backward_plan(fresh_plans):
    """Separate tensors with the packed slices' strides (slices of three padded tensors) after a packed call: the
    backward planned for one buffer's slices must not serve them (nor the reverse)."""
    torch.manual_seed(2)
    g = randn(2, 11, 2, 16, dtype=PRECISE_DTYPE)
    call = lambda q, k, v: flashtx.flash_attn_func(q, k, v, causal=True)  # noqa: E731
    for packed_first in (True, False):
        for packed in (packed_first, not packed_first):
            if packed:
                parts = randn(2, 11, 3, 2, 16, dtype=PRECISE_DTYPE, requires_grad=True).unbind(2)
            else:  # equal strides, three storages
                parts = [randn(2, 11, 3, 2, 16, dtype=PRECISE_DTYPE)[:, :, 0].requires_grad_(True) for _ in range(3)]
            grads = torch.autograd.grad(call(*parts), parts, g)
            want = _unpacked_grads(call, [p.contiguous() for p in parts], g)
            for got, ref in zip(grads, want):
                torch.testing.assert_close(got, ref, **SAME)
        _clear_plans()


def _clear_plans():
    from flashtx import _dispatch
    _dispatch.clear_plans()


@pytest.mark.parametrize("case", ["strided", "probs", "accumulate", "twice"])
def test_the_fallbacks_stack_the_right_gradients(case, stacks):
    """A packed tensor that is not dense (a padded fused projection), a call the lanes do not serve (probabilities
    returned), gradients accumulated into .grad, and a packed tensor also used elsewhere: the packed gradient is
    still the right one."""
    torch.manual_seed(3)
    B, S, H, D = 2, 13, 2, 16
    g = randn(B, S, H, D, dtype=PRECISE_DTYPE)
    call = lambda q, k, v: flashtx.flash_attn_func(q, k, v, causal=True)  # noqa: E731
    if case == "strided":
        qkv = randn(B, S, 3 * H * D + 3, dtype=PRECISE_DTYPE)[..., :3 * H * D].view(B, S, 3, H, D)
    else:
        qkv = randn(B, S, 3, H, D, dtype=PRECISE_DTYPE)
    qkv.requires_grad_(True)
    want = torch.stack(_unpacked_grads(call, qkv.unbind(2), g), 2)
    if case == "probs":
        out = flashtx.flash_attn_qkvpacked_func(qkv, causal=True, return_attn_probs=True)[0]
    else:
        out = flashtx.flash_attn_qkvpacked_func(qkv, causal=True)
    if case == "accumulate":
        out.backward(g)
        flashtx.flash_attn_qkvpacked_func(qkv, causal=True).backward(g)
        torch.testing.assert_close(qkv.grad, 2 * want, **SAME)
        return
    if case == "twice":  # qkv feeds something else too: its gradient adds up
        (dqkv,) = torch.autograd.grad((out * g).sum() + (qkv * 3).sum(), qkv)
        torch.testing.assert_close(dqkv, want + 3, **SAME)
        return
    with stacks:
        (dqkv,) = torch.autograd.grad(out, qkv, g)
    torch.testing.assert_close(dqkv, want, **SAME)
    assert len(stacks) == (1 if case in ("strided", "probs") else 0)


def test_unpack_reassembles_only_exact_slices():
    """Unpack's backward takes the buffer only when the gradients are its slices and it holds nothing else."""
    t = torch.randn(2, 5, 3, 4, requires_grad=True)
    buf = torch.randn(2, 5, 3, 4)
    exact = buf.unbind(2)
    (grad,) = torch.autograd.grad(_packing.unbind(t, 2), t, exact)
    assert grad.data_ptr() == buf.data_ptr() and torch.equal(grad, buf)
    bigger = torch.randn(2, 5, 3, 4 + 1)[..., :4]  # slices of a buffer that holds more
    (grad,) = torch.autograd.grad(_packing.unbind(t, 2), t, bigger.unbind(2))
    assert torch.equal(grad, bigger) and grad.data_ptr() != bigger.data_ptr()
    swapped = (exact[1], exact[0], exact[2])  # not in order
    (grad,) = torch.autograd.grad(_packing.unbind(t, 2), t, swapped)
    assert torch.equal(grad, torch.stack(swapped, 2))
    other = torch.randn(3, 2, 5, 4)  # slices along another dim of a dense buffer: stacked, right values
    (grad,) = torch.autograd.grad(_packing.unbind(t, 2), t, other.unbind(0))
    assert torch.equal(grad, torch.stack(other.unbind(0), 2))
    q, k, v = _packing.unbind(t, 2)  # slices whose gradient is unused: zeros
    (grad,) = torch.autograd.grad((k * 2).sum(), t)
    assert torch.equal(grad, torch.stack([torch.zeros_like(q), torch.full_like(k, 2), torch.zeros_like(v)], 2))


def test_small_packed_tensors_take_unbind(monkeypatch):
    """Below MIN_NUMEL the packed forms take autograd's unbind (its C++ stack costs less than the in-place path's
    Python there), and the backward allocates the slices' gradients apart."""
    monkeypatch.setattr(_packing, "MIN_NUMEL", 10**9)
    monkeypatch.setattr("flashtx._attention_lane.MIN_NUMEL", 10**9)
    qkv = randn(2, 9, 3, 2, 16, dtype=PRECISE_DTYPE, requires_grad=True)
    out = flashtx.flash_attn_qkvpacked_func(qkv, causal=True)
    assert out.grad_fn is not None
    q, k, v = _packing.unbind(qkv, 2)
    assert q.grad_fn.name() == "UnbindBackward0"
    g = randn(*out.shape, dtype=out.dtype)
    (dqkv,) = torch.autograd.grad(out, qkv, g)
    want = _unpacked_grads(lambda q, k, v: flashtx.flash_attn_func(q, k, v, causal=True), qkv.unbind(2), g)
    torch.testing.assert_close(dqkv, torch.stack(want, 2), **SAME)
