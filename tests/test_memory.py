"""No N x N tensor on the fast path: while attention runs forward and backward through the Triton
backend, no torch op allocates more than a few O(N) tensors' worth (the profiler's per-op CPU
memory accounting sees every allocation torch makes, including inside matmul & co.)."""
import warnings

import torch
from conftest import ON_GPU, randn
from torch.profiler import ProfilerActivity, profile

import flashtx

S = 384  # S * S * 4 bytes = 590 KB, far above any O(N) tensor below (B * Hq * S * D * 4 = 49 KB)


def largest_op_allocation(fn) -> int:
    """Bytes allocated by the most allocating torch op (children included) while fn runs."""
    acts = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if ON_GPU else [ProfilerActivity.CPU]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with profile(activities=acts, profile_memory=True) as prof:
            fn()
    keys = ("device_memory_usage", "cuda_memory_usage") if ON_GPU else ("cpu_memory_usage",)
    return max(max((getattr(e, k, 0) or 0) for k in keys) for e in prof.events())


def qkv(requires_grad=False):
    return (randn(1, 2, S, 16, requires_grad=requires_grad), randn(1, 1, S, 16, requires_grad=requires_grad),
            randn(1, 1, S, 16, requires_grad=requires_grad))


def test_triton_attention_allocates_no_n_by_n_tensor():
    q, k, v = qkv(requires_grad=True)
    o_n = q.numel() * q.element_size()  # bytes of one (B, Hq, S, D) tensor

    def fwd_bwd():
        out = flashtx.attention(q, k, v, is_causal=True, enable_gqa=True, backend="triton")
        out.backward(torch.ones_like(out))

    peak = largest_op_allocation(fwd_bwd)
    assert 0 < peak <= 4 * o_n, f"an op allocated {peak} bytes; O(N) tensors here are {o_n} bytes"


def test_the_check_sees_the_reference_backends_n_by_n_scores():
    """The check above can fail: the reference backend's (S, S) score matrix is seen."""
    q, k, v = qkv()
    peak = largest_op_allocation(lambda: flashtx.attention(q, k, v, is_causal=True, enable_gqa=True,
                                                           backend="reference"))
    assert peak >= 2 * S * S * 4  # (B, Hq, S, S) fp32 scores


def test_mask_bias_and_dropout_paths_allocate_nothing_beyond_the_users_mask():
    """With a (B, 1, S, S) bool mask, a learned (1, H, S, S) bias (whose gradient is one tensor of
    its own size), key masks, softcap, ALiBi and dropout, no op allocates more than the bias
    gradient plus O(N): the masks are read through strides, never expanded to (B, H, S, S)
    (which would be 2x the bias here)."""
    q, k, v = (randn(2, 2, S, 16, requires_grad=True) for _ in range(3))
    bias = randn(1, 2, S, S, requires_grad=True)
    keep = torch.rand(2, 1, S, S, device=q.device) > 0.1
    key_mask = torch.rand(2, S, device=q.device) > 0.1
    bias_bytes = bias.numel() * bias.element_size()

    def fwd_bwd(mask):
        out = flashtx.attention(q, k, v, attn_mask=mask, is_causal=True, key_mask=key_mask, softcap=30.0,
                                alibi_slopes=torch.ones(2, device=q.device), dropout_p=0.1, backend="triton")
        out.backward(torch.ones_like(out))

    o_n = q.numel() * q.element_size()
    peak = largest_op_allocation(lambda: fwd_bwd(bias))
    # the backward op allocates its outputs: dq, dk, dv (O(N)) and the bias gradient
    assert 0 < peak <= bias_bytes + 4 * o_n, (f"an op allocated {peak} bytes; the bias gradient is {bias_bytes} "
                                              f"bytes and O(N) tensors {o_n}")
    peak = largest_op_allocation(lambda: fwd_bwd(keep))
    assert 0 < peak <= 4 * o_n, f"an op allocated {peak} bytes with a bool mask; O(N) tensors are {o_n} bytes"
