"""float64 gradcheck through the Triton kernels for the window, padding and varlen paths.

Interpreter-only (the Triton backend refuses float64 on a GPU), one input at a time (see
conftest.gradcheck_each_input).
"""
import pytest
import torch
from conftest import ON_GPU, gradcheck_each_input

import flashtx

pytestmark = pytest.mark.skipif(ON_GPU, reason="float64 Triton kernels run only in the interpreter")


def _x(*shape):
    return torch.randn(*shape, dtype=torch.float64, requires_grad=True)


CASES = {
    # flash layout (B, S, H, D), bottom-right
    "window-causal-gqa": (dict(sq=37, sk=45, hq=4, hkv=2, b=1), dict(causal=True, window_size=(9, -1))),
    "window-both-sides": (dict(sq=40, sk=33, b=1), dict(window_size=(5, 7))),
    "lens-causal-cross": (dict(sq=30, sk=41), dict(causal=True, q_lens=torch.tensor([30, 11]),
                                                   kv_lens=torch.tensor([25, 41]))),
    "masks-with-all-padding-row": (dict(sq=29, sk=35),
                                   dict(key_mask=torch.rand(2, 35) > 0.4, query_mask=torch.rand(2, 29) > 0.3)),
}
torch.manual_seed(0)
CASES["masks-with-all-padding-row"][1]["key_mask"][1] = False  # batch row 1 sees nothing: grads 0, no NaN


@pytest.mark.parametrize("name", list(CASES))
def test_gradcheck_masked_paths(name):
    shapes, kw = CASES[name]
    torch.manual_seed(21)
    b, hq, hkv = shapes.get("b", 2), shapes.get("hq", 2), shapes.get("hkv", 2)
    q, k, v = _x(b, shapes["sq"], hq, 16), _x(b, shapes["sk"], hkv, 16), _x(b, shapes["sk"], hkv, 16)

    def fn(q, k, v):
        return flashtx.flash_attn_func(q, k, v, backend="triton", **kw)

    assert gradcheck_each_input(fn, (q, k, v))


def test_gradcheck_sdpa_window_top_left_with_lse():
    torch.manual_seed(22)
    q, k, v = _x(1, 2, 31, 16), _x(1, 2, 43, 16), _x(1, 2, 43, 16)

    def fn(q, k, v):
        return flashtx.attention(q, k, v, is_causal=True, window_size=(6, -1), return_lse=True, backend="triton")

    assert gradcheck_each_input(fn, (q, k, v))


def test_gradcheck_varlen():
    torch.manual_seed(23)
    cu_q = torch.tensor([0, 17, 18, 40], dtype=torch.int32)
    cu_k = torch.tensor([0, 25, 31, 52], dtype=torch.int32)
    q, k, v = _x(40, 4, 16), _x(52, 2, 16), _x(52, 2, 16)

    def fn(q, k, v):
        return flashtx.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 22, 25, causal=True, window_size=(12, -1),
                                              backend="triton")

    assert gradcheck_each_input(fn, (q, k, v))
