"""The Triton kernels' shape limits (CUDA grid y/z, int32 offsets) hold per call, not per plan.

The backend plan is cached by dtype, head dims and features (not shapes), and the limits are checked
once per call signature by the launchers (triton_kernels/limits.py): a call past a limit, after the
same kind of call planned Triton, must still go to the reference with the reasons (automatic), or
raise them (backend="triton"); never launch a grid the GPU refuses.
"""
import warnings

import pytest
import torch

import flashtx
from flashtx import reference
from flashtx._dispatch import clear_plans
from flashtx.triton_kernels import launch
from flashtx.triton_kernels.limits import INT32_MAX, MAX_GRID_YZ, MAX_SEQ, LimitExceeded, check_limits, within_limits

from conftest import DEVICE, ON_GPU, randn


class _Shape:
    """Just the shape and strides within_limits reads (a real tensor this large would not fit in memory)."""

    def __init__(self, shape, strides):
        self.shape, self._strides = torch.Size(shape), strides

    def stride(self, i=None):
        return self._strides if i is None else self._strides[i]


def test_within_limits_reads_grid_and_offsets():
    ok = _Shape((2, 4, 128, 64), (32768, 8192, 64, 1))
    assert within_limits(ok, ok, ok, None, None)
    assert not within_limits(_Shape((MAX_GRID_YZ + 1, 1, 1, 64), (64, 64, 64, 1)), ok, ok, None, None)
    assert not within_limits(_Shape((1, MAX_GRID_YZ + 1, 1, 64), (64, 64, 64, 1)), ok, ok, None, None)
    wide = _Shape((1, 1, 2**16, 64), (0, 0, 2**15 + 1, 1))  # 2**16 rows x stride 2**15 + 1 > int32
    assert 2**16 * (2**15 + 1) > INT32_MAX
    assert not within_limits(ok, wide, ok, None, None) and not within_limits(ok, ok, wide, None, None)
    assert not within_limits(wide, ok, ok, None, None)
    assert within_limits(ok, ok, ok, None, torch.zeros(MAX_GRID_YZ + 1, dtype=torch.int32))  # nseq = 65535
    assert not within_limits(ok, ok, ok, None, torch.zeros(MAX_GRID_YZ + 2, dtype=torch.int32))
    with pytest.raises(LimitExceeded, match="limits"):
        check_limits(wide, ok, ok, None, None)


@pytest.mark.parametrize("grad", [False, True], ids=["no-grad", "grad"])
@pytest.mark.parametrize("backend", [None, "reference", "triton"])
def test_sequences_past_max_seq_are_refused(grad, backend):
    """Window bounds >= MAX_SEQ mean unbounded (check_window), which holds only for sequences of at most MAX_SEQ
    positions: longer ones (a stride-0 view costs no memory) are refused by every backend (the reference too, where
    the mapped bound would be wrong) and route (no grad: the small-query decode kernels), by the Triton kernels'
    limits, and by flash_attn_with_kvcache."""
    q = randn(1, 1, 2, 16, requires_grad=grad)
    long = torch.randn(1, 1, 1, 16, device=DEVICE).expand(1, 1, MAX_SEQ + 1, 16)  # (B, H, S, D), stride 0
    assert not within_limits(q, long, long, None, None) and within_limits(q, long[:, :, :MAX_SEQ], q, None, None)
    with pytest.raises(ValueError, match=f"sequences of at most {MAX_SEQ} tokens .*got 2 queries and {MAX_SEQ + 1}"):
        flashtx.attention(q, long, long, backend=backend, window_size=(2**40, -1))
    with pytest.raises(ValueError, match=f"got {MAX_SEQ + 1} queries and 2 keys"):
        flashtx.flash_attn_func(long.transpose(1, 2), q.transpose(1, 2), q.transpose(1, 2), backend=backend)
    cache = long.transpose(1, 2)  # (B, S, H, D)
    with pytest.raises(ValueError, match=f"the kernels take at most {MAX_SEQ}"):
        flashtx.flash_attn_with_kvcache(q.detach().transpose(1, 2), cache, cache, cache_seqlens=3)


@pytest.mark.skipif(ON_GPU, reason="CPU: the interpreter's Triton backend; a GPU run has the same path")
def test_batch_past_the_grid_limit_goes_to_the_reference_after_a_cached_triton_plan():
    clear_plans()
    small = [torch.randn(2, 1, 3, 16, device=DEVICE, requires_grad=True) for _ in range(3)]
    launches = []
    with launch.stub_launches(lambda kernel, grid, args: launches.append(grid)):
        flashtx.attention(*small, is_causal=True).sum().backward()  # plans `triton`: float32, D = 16, causal, grad
    assert len(launches) == 4, "the small call should take the Triton backend (forward, 3 backward kernels)"
    B = MAX_GRID_YZ + 1
    q, k, v = (torch.randn(B, 1, 2, 16, device=DEVICE, requires_grad=True) for _ in range(3))
    launches.clear()
    with launch.stub_launches(lambda kernel, grid, args: launches.append(grid)):
        with pytest.warns(UserWarning, match="grid y/z limit"):
            out = flashtx.attention(q, k, v, is_causal=True)
        out.backward(torch.ones_like(out))
    assert launches == []  # neither the forward nor the backward launched a kernel
    ref = reference.attention(q.detach().double(), k.detach().double(), v.detach().double(), causal=True)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    assert q.grad is not None and torch.isfinite(q.grad).all()
    with pytest.raises(flashtx.BackendNotSupported, match="grid y/z limit"):
        flashtx.attention(q.detach(), k.detach(), v.detach(), backend="triton")
    launches.clear()
    with warnings.catch_warnings(), launch.stub_launches(lambda kernel, grid, args: launches.append(grid)):
        warnings.simplefilter("error")
        flashtx.attention(*small, is_causal=True).sum().backward()  # the small signature still runs Triton
    assert len(launches) == 4


@pytest.mark.skipif(ON_GPU, reason="CPU: the interpreter's Triton backend; a GPU run has the same path")
def test_a_first_call_past_a_limit_does_not_send_later_small_calls_to_the_reference():
    """The plan of a call past a limit is that call's alone: caching its `reference` would run every later
    call of the same kind (dtype, head dims, features) on the O(N^2) reference."""
    clear_plans()
    big = [torch.randn(MAX_GRID_YZ + 1, 1, 2, 16, device=DEVICE) for _ in range(3)]
    small = [torch.randn(2, 1, 3, 16, device=DEVICE) for _ in range(3)]
    launches = []
    with launch.stub_launches(lambda kernel, grid, args: launches.append(grid)):
        with pytest.warns(UserWarning, match="grid y/z limit"):
            flashtx.attention(*big, is_causal=True)
        assert launches == []
        flashtx.attention(*small, is_causal=True)
    assert len(launches) == 1  # the small call runs the Triton kernel


def test_the_int32_limit_reads_the_stride_the_kernels_see():
    """A last dim with a stride other than 1 is copied contiguous before the kernels run: dispatch's
    reasons and the launchers' check both count its sequence span as S x D, so they agree."""
    from flashtx.backends import AttentionInputs, TritonBackend
    from flashtx.triton_kernels.limits import seq_span

    S = 2**24  # an expanded view: no memory; S x D = 2**31 elements once copied
    q = torch.randn(1, 1, 1, 1, dtype=torch.float16).expand(1, 1, S, 128)
    k, v = torch.randn(1, 1, 4, 128, dtype=torch.float16), torch.randn(1, 1, 4, 8, dtype=torch.float16)
    assert q.stride()[2:] == (0, 0) and seq_span(q) == S * 128 > INT32_MAX and seq_span(k) == 4 * 128
    assert not within_limits(q, k, v, None, None)
    reasons = TritonBackend().not_supported_reasons(AttentionInputs(q, k, v))
    assert any("query's sequence span" in r and "overflows int32" in r for r in reasons), reasons
    with pytest.raises(LimitExceeded):
        check_limits(q, k, v, None, None)


@pytest.mark.skipif(ON_GPU, reason="CPU: the interpreter's Triton backend; a GPU run has the same path")
def test_flash_layout_copies_of_a_strided_last_dim_keep_the_span_dispatch_counted(monkeypatch):
    """flash_attn_func's (B, S, H, D) tensors with a last stride other than 1 are copied (B, H, S, D)
    contiguous, so their sequence span is S x D as dispatch counted it, not S x their row stride: with the int32
    limit shrunk between the two (and above the span of the (B, S, H, D) output, S x H x D), the call runs on
    Triton instead of being refused."""
    from flashtx import backends
    from flashtx.triton_kernels import limits

    monkeypatch.setattr(limits, "INT32_MAX", 600)
    monkeypatch.setattr(backends, "INT32_MAX", 600)
    clear_plans()
    # S x D = 128; the output's S x H x D = 512; the inputs as given, S x their row stride 128 = 1024
    q, k, v = (randn(1, 8, 4, 32, dtype=torch.float64)[..., ::2] for _ in range(3))
    launches = []
    with warnings.catch_warnings(), launch.stub_launches(lambda kernel, grid, args: launches.append(grid)):
        warnings.simplefilter("error")
        flashtx.flash_attn_func(q, k, v, causal=True, backend="triton")
    assert len(launches) == 1
    clear_plans()
    out = flashtx.flash_attn_func(q, k, v, causal=True, backend="triton")
    ref = reference.attention(*(t.transpose(1, 2) for t in (q, k, v)), causal=True, bottom_right=True)
    torch.testing.assert_close(out, ref.transpose(1, 2), atol=1e-12, rtol=1e-12)


@pytest.mark.skipif(ON_GPU, reason="stands a GPU target in for the interpreter's")
def test_a_gpu_without_a_fitting_tile_goes_to_the_reference_or_raises(monkeypatch):
    """Dispatch asks the GPU's tile tables whether a config fits its shared memory (an unknown part with
    little of it): automatic dispatch warns and runs the reference, backend="triton" raises the reasons.
    The same code path as on CUDA, with the launch target stood in (a 20 KB part)."""
    import sys

    from flashtx.triton_kernels.configs import Target

    small = Target(90, 20_000, sm_count=8)
    for mod in list(sys.modules.values()):
        if getattr(mod, "__name__", "").startswith("flashtx") and hasattr(mod, "target_for"):
            monkeypatch.setattr(mod, "target_for", lambda t: small)
    clear_plans()
    try:
        q, k, v = (randn(1, 2, 33, 128, dtype=torch.float16, requires_grad=True) for _ in range(3))
        with pytest.raises(flashtx.BackendNotSupported, match="shared memory"):
            flashtx.attention(q, k, v, backend="triton")
        with pytest.warns(UserWarning, match="shared memory"):
            out = flashtx.attention(q, k, v, is_causal=True)
        torch.testing.assert_close(out, flashtx.attention(q, k, v, is_causal=True, backend="reference"), atol=0, rtol=0)
    finally:
        clear_plans()


def test_gpus_before_ampere_and_interpreter_clashes_are_refused(monkeypatch):
    """The CUDA branch of the device check, with the GPU's capability stood in: sm_75 is refused by name, sm_86
    is not; with the interpreter on, CUDA tensors are refused; float64 only runs in the interpreter."""
    from flashtx import _env
    from flashtx.backends import triton_device_reasons

    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(_env, "INTERPRET", False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    assert any("sm_75" in r and "8.0" in r for r in triton_device_reasons(cuda, torch.float16))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 6))
    assert triton_device_reasons(cuda, torch.bfloat16) == []
    assert any("float64" in r for r in triton_device_reasons(cuda, torch.float64))
    monkeypatch.setattr(_env, "INTERPRET", True)
    assert any("interpreter" in r for r in triton_device_reasons(cuda, torch.float16))


def test_the_triton_backends_shape_reasons_at_each_limit():
    """Each limit the Triton backend refuses by reason, at its edge: head dim 256 is taken and 257 refused (query
    /key or value), heads (the grid's y) past 65535, an attn_mask whose (batch, head) slice spans more than int32
    offsets. Expanded views: nothing this large is allocated."""
    from flashtx.backends import AttentionInputs, AttentionMasks, TritonBackend

    def reasons(q, k, v, **masks):
        return "\n".join(TritonBackend().not_supported_reasons(AttentionInputs(q, k, v, masks=AttentionMasks(**masks))))

    def t(*shape):
        return torch.zeros(1, 1, 1, 1, dtype=torch.float16, device=DEVICE).expand(*shape)

    assert "head dim" not in reasons(t(1, 2, 8, 256), t(1, 2, 8, 256), t(1, 2, 8, 256))
    assert "query/key head dim 257 is above 256" in reasons(t(1, 2, 8, 257), t(1, 2, 8, 257), t(1, 2, 8, 64))
    assert "value head dim 257 is above 256" in reasons(t(1, 2, 8, 64), t(1, 2, 8, 64), t(1, 2, 8, 257))
    heads = reasons(t(1, MAX_GRID_YZ + 1, 8, 64), t(1, MAX_GRID_YZ + 1, 8, 64), t(1, MAX_GRID_YZ + 1, 8, 64))
    assert f"batch 1 x heads {MAX_GRID_YZ + 1}: each must be <= {MAX_GRID_YZ}" in heads
    assert "heads" not in reasons(t(1, MAX_GRID_YZ, 8, 64), t(1, MAX_GRID_YZ, 8, 64), t(1, MAX_GRID_YZ, 8, 64))
    q = t(1, 2, 2, 64)
    wide = torch.empty_strided((1, 1, 2, 2), (0, 0, 2**30, 2**30), dtype=torch.bool, device="meta")  # (no memory)
    assert "attn_mask (1, 1, 2, 2): one (batch, head) slice spans more than int32 offsets" in reasons(
        q, q, q, attn_mask=wide)
    narrow = torch.empty_strided((1, 1, 2, 2), (0, 0, 2**30, 2**30 - 1), dtype=torch.bool, device="meta")  # 2**31 - 1
    assert "attn_mask" not in reasons(q, q, q, attn_mask=narrow)
