"""The kernels over empty inputs, launched as a compiled graph launches them when the size is read on the device.

Under torch.compile an unpad_input total is an unbacked size: the launchers cannot take their empty-input early outs
(triton_kernels.limits.surely says False), so a batch whose total is 0 at run time launches the kernels over an
empty grid, or programs that find no row. Here `surely` is patched to False, as it is then, and the kernels run
(the interpreter on CPU, the GPU's own plan on CUDA): the results must be what the early outs give.
"""
import pytest
import torch
from conftest import DEVICE, PRECISE_DTYPE, randn

from flashtx.triton_kernels import attention_bwd_launch, attention_fwd, rotary, swiglu
from flashtx.triton_kernels.mask_spec import MaskSpec

D = 16


@pytest.fixture(autouse=True)
def no_early_outs(monkeypatch):
    for mod in (attention_fwd, attention_bwd_launch, rotary, swiglu):
        monkeypatch.setattr(mod, "surely", lambda cond: False)


def cu(*lens):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)


def forward_backward(q, k, v, spec, causal, bshd=False):
    """(out, m2, l2, dq, dk, dv), the gradients written over NaN (an unwritten element stays NaN)."""
    out, m2, l2 = attention_fwd.attention_forward(q, k, v, scale=D ** -0.5, causal=causal, bottom_right=spec.varlen,
                                                  spec=spec, bshd=bshd)
    grads = tuple(torch.full_like(t, float("nan")) for t in (q, k, v))
    dq, dk, dv = attention_bwd_launch.attention_backward(randn(*out.shape, dtype=out.dtype), q, k, v, out, m2, l2,
                                                         scale=D ** -0.5, causal=causal, bottom_right=spec.varlen,
                                                         spec=spec, grads=grads, bshd=bshd)
    return out, m2, l2, dq, dk, dv


def zero(t):
    return bool((t == 0).all())


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("bshd", [False, True], ids=["bhsd", "bshd"])
def test_varlen_without_queries_gives_zero_key_gradients(causal, bshd):
    """total_q = 0, total_k = 5 (GQA 2/1): dK and dV exactly zero, every element written."""
    spec = MaskSpec(cu_seqlens_q=cu(0, 0), cu_seqlens_k=cu(2, 3), max_seqlen_q=0, max_seqlen_k=3)
    shape = (lambda h, n: (1, n, h, D)) if bshd else (lambda h, n: (1, h, n, D))
    q, k, v = (randn(*shape(h, n), dtype=PRECISE_DTYPE) for h, n in ((2, 0), (1, 5), (1, 5)))
    *_, dk, dv = forward_backward(q, k, v, spec, causal, bshd)
    assert zero(dk) and zero(dv)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_varlen_without_keys_gives_zero_rows(causal):
    """total_q = 4, total_k = 0: out and dQ exactly zero, lse -inf (m2 -inf, l2 0), as rows that see no key."""
    spec = MaskSpec(cu_seqlens_q=cu(1, 3), cu_seqlens_k=cu(0, 0), max_seqlen_q=3, max_seqlen_k=0)
    q, k, v = (randn(1, h, n, D, dtype=PRECISE_DTYPE) for h, n in ((2, 4), (1, 0), (1, 0)))
    out, m2, l2, dq, _, _ = forward_backward(q, k, v, spec, causal)
    assert zero(out) and zero(dq) and zero(l2) and bool((m2 == float("-inf")).all())


def test_dense_empty_sequences():
    """Sq = 0 (keys but no queries): zero dK, dV. Sk = 0: zero out, dQ and -inf lse."""
    q, k, v = (randn(2, h, n, D, dtype=PRECISE_DTYPE) for h, n in ((2, 0), (1, 5), (1, 5)))
    *_, dk, dv = forward_backward(q, k, v, MaskSpec(), False)
    assert zero(dk) and zero(dv)
    q, k, v = (randn(2, h, n, D, dtype=PRECISE_DTYPE) for h, n in ((2, 4), (1, 0), (1, 0)))
    out, m2, l2, dq, _, _ = forward_backward(q, k, v, MaskSpec(), True)
    assert zero(out) and zero(dq) and zero(l2) and bool((m2 == float("-inf")).all())


def test_rope_and_swiglu_over_no_rows():
    """Varlen RoPE over a total of 0 and SwiGLU (forward, backward, packed backward) over 0 rows run cleanly."""
    cos = torch.rand(64, 8, dtype=PRECISE_DTYPE, device=DEVICE)
    q = randn(0, 4, 16, dtype=PRECISE_DTYPE)
    qo = torch.empty_like(q)
    rotary.rotary_launch(q, qo, None, None, cos, cos, None, 0, None, cu(0, 0), 0, False, False, False)
    g, u, do = (randn(0, 32, dtype=PRECISE_DTYPE) for _ in range(3))
    swiglu.swiglu_forward(g, u, torch.empty_like(g))
    swiglu.swiglu_backward(do, g, u, torch.empty_like(g), torch.empty_like(u))
    x = randn(0, 64, dtype=PRECISE_DTYPE)
    swiglu.swiglu_backward_packed(do, x, x)
