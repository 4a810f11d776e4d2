"""Head dims split in two power-of-two column pieces (launch.head_split: 192 = 128 + 64, 96 = 64 + 32,
160 = 128 + 32, 80 = 64 + 16) instead of padded to the next power of two, in the forward and backward
kernels (test_attention_split_bwd.py adds the backward's own cases).

The split depends on the head dim alone, so the interpreter runs (CPU) take the same split path as a
GPU: these cases check that it does, and hold the split kernels to the tolerance rule of
conftest.assert_close_to_reference against the float64 reference, forward and backward.
"""
import dataclasses

import pytest
import torch
import test_attention
import test_attention_masks
from conftest import DEVICE, KERNEL_DTYPES, assert_close_to_reference, dtype_id, randn, to64, to_dtype
from test_attention import Case
from test_attention_masks import MCase

from flashtx import reference
from flashtx.triton_kernels.attention_fwd import plan_forward
from flashtx.triton_kernels.launch import head_split

pytestmark = pytest.mark.usefixtures("split_head_dims")  # off by default for now (launch.SPLIT_HEAD_DIMS)


@pytest.mark.parametrize("d,pieces", [(192, (128, 64)), (96, (64, 32)), (160, (128, 32)), (80, (64, 16)),
                                      (72, (64, 16)), (48, (32, 16)), (144, (128, 16)), (176, (128, 64)),
                                      (64, (64, 0)), (112, (128, 0)), (128, (128, 0)), (200, (256, 0)),
                                      (256, (256, 0)), (24, (32, 0)), (16, (16, 0))])
def test_head_split_saves_a_quarter_or_pads(d, pieces):
    """Two pieces only when each is a legal tl.dot K (>= 16) and together they save >= 25% of the padding."""
    assert head_split(d) == pieces


@pytest.mark.parametrize("dqk,dv", [(192, 128), (96, 160), (160, 80), (128, 192)])
def test_launches_here_take_the_split_path(dqk, dv):
    """The launch these tests run (interpreter on CPU, or the GPU) carries the split constexprs."""
    q, k = (torch.empty(1, 2, 40, dqk, device=DEVICE) for _ in range(2))
    v, o = (torch.empty(1, 2, 40, dv, device=DEVICE) for _ in range(2))
    m2, l2 = (torch.empty(1, 2, 40, device=DEVICE) for _ in range(2))
    args = plan_forward(q, k, v, o, m2, l2, scale=1.0, causal=True, bottom_right=False).args
    assert (args["BLOCK_DQK"], args["BLOCK_DQK2"]) == head_split(dqk)
    assert (args["BLOCK_DV"], args["BLOCK_DV2"]) == head_split(dv)


CASES = [
    Case(113, 90, 192, hq=4, hkv=2, dv=128, causal=True, shell="flash"),  # MLA-style, GQA, bottom-right
    Case(70, 113, 96, hq=4, hkv=1, dv=160, layout="strided"),  # MQA; both dims split, differently
    Case(90, 90, 160, dv=80, causal=True, b=1),  # the V side split (64 + 16), Q/K's (128 + 32)
    Case(57, 70, 192, causal=True, b=1),  # Dv = Dqk = 192: both split 128 + 64
]


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_split_head_dims_match_reference(case, dtype):
    """test_attention's forward/backward check, at split head dims."""
    test_attention.test_forward_backward_match_reference(case, dtype)


MASK_CASES = [
    MCase("split-192-window-key-mask-lens-gqa", 100, 90, hq=4, hkv=2, causal=True, window=(45, -1),
          key_mask="random", query_mask="random", q_lens=(100, 70), kv_lens=(60, 90), d=192),
    MCase("split-96-sdpa-window-both", 80, 70, window=(12, 20), shell="sdpa", key_mask="left", d=96),
]


@pytest.mark.parametrize("case,dtype", [pytest.param(c, dt, id=f"{c.name}-{dtype_id(dt)}") for c in MASK_CASES
                                        for dt in KERNEL_DTYPES[:2]])
def test_split_head_dims_with_masks_match_reference(case, dtype):
    """test_attention_masks' forward/backward check (empty rows and keys exactly 0 included), at split head dims."""
    test_attention_masks.test_masked_forward_backward_match_reference(case, dtype)


@dataclasses.dataclass(frozen=True)
class Mods:
    softcap: float = 0.0
    alibi: bool = False
    bias: bool = False


@pytest.mark.parametrize("dtype", KERNEL_DTYPES[:2], ids=dtype_id)
@pytest.mark.parametrize("mods", [Mods(softcap=2.0, alibi=True), Mods(bias=True)], ids=["softcap+alibi", "attn_mask"])
def test_split_head_dims_with_score_modifiers_match_reference(mods, dtype):
    """Score modifiers act on s after both pieces' dots: softcap + ALiBi, and an additive attn_mask."""
    import flashtx

    torch.manual_seed(5)
    B, H, Sq, Sk = 2, 2, 45, 60
    q = randn(B, H, Sq, 192, dtype=dtype).mul(2.0).requires_grad_()
    k = randn(B, H, Sk, 192, dtype=dtype).mul(2.0).requires_grad_()
    v = randn(B, H, Sk, 128, dtype=dtype, requires_grad=True)
    slopes = torch.rand(H, device=DEVICE, dtype=torch.float32) if mods.alibi else None
    bias = randn(1, H, Sq, Sk, dtype=dtype) if mods.bias else None
    out = flashtx.attention(q, k, v, attn_mask=bias, is_causal=not mods.bias, softcap=mods.softcap,
                            alibi_slopes=slopes, backend="triton")
    alibi = reference.alibi_bias(slopes, Sq, Sk, device=DEVICE) if mods.alibi else None

    def ref_fn(q, k, v, dt):
        b = bias.to(dt) if bias is not None else None
        return reference.attention(q, k, v, causal=not mods.bias, bottom_right=False, softcap=mods.softcap,
                                   alibi=alibi.to(dt) if alibi is not None else None, bias=b)

    ref = ref_fn(*to64(q, k, v), torch.float64)
    eager = ref_fn(*to_dtype(dtype, q, k, v), dtype)
    assert_close_to_reference("out", out, ref, eager)
