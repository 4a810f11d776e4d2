"""Fused RoPE: bad input gets a clear error naming the argument; index tensors are read by value."""
import pytest
import torch
from conftest import DEVICE, randn
from test_rotary import tables

import flashtx
from flashtx.triton_kernels import launch


# ------------------------------------------------------------------------------- errors
def _x():
    return randn(2, 4, 3, 8)


ERRORS = {
    "x_not_tensor": (lambda c, s: flashtx.apply_rotary([1.0], c, s), TypeError, "x must be a torch.Tensor"),
    "x_int": (lambda c, s: flashtx.apply_rotary(torch.ones(2, 4, 3, 8, dtype=torch.int32, device=DEVICE), c, s),
              TypeError, "x has dtype torch.int32"),
    "x_3d": (lambda c, s: flashtx.apply_rotary(randn(4, 3, 8), c, s), ValueError, r"4-D \(B, S, H, D\)"),
    "bad_layout": (lambda c, s: flashtx.apply_rotary(_x(), c, s, layout="sbhd"), ValueError, "layout must be"),
    # flags as torch's bool parameters: a truthy string or int used to pick a mode silently
    "interleaved_str": (lambda c, s: flashtx.apply_rotary(_x(), c, s, interleaved="False"), TypeError,
                        "interleaved must be a bool"),
    "inplace_str": (lambda c, s: flashtx.apply_rotary(_x(), c, s, inplace="no"), TypeError,
                    "inplace must be None or a bool"),
    "qk_inplace_int": (lambda c, s: flashtx.apply_rotary_qk(_x(), _x(), c, s, inplace=1), TypeError,
                       "inplace must be None or a bool"),
    "varlen_interleaved_int": (lambda c, s: flashtx.apply_rotary(
        randn(8, 3, 8), c, s, interleaved=1, cu_seqlens=torch.tensor([0, 3, 8], dtype=torch.int32, device=DEVICE),
        max_seqlen=5), TypeError, "interleaved must be a bool"),
    "cos_sin_shapes": (lambda c, s: flashtx.apply_rotary(_x(), c, s[:, :2]), ValueError, "same shape"),
    "cos_1d": (lambda c, s: flashtx.apply_rotary(_x(), c[0], s[0]), ValueError, r"\(seqlen_ro, rotary_dim / 2\)"),
    "rotary_dim_too_big": (lambda c, s: flashtx.apply_rotary(randn(2, 4, 3, 6), c, s), ValueError,
                           r"rotary_dim = 2 \* cos.shape\[-1\] = 8"),
    "rotary_dim_zero": (lambda c, s: flashtx.apply_rotary(_x(), c[:, :0], s[:, :0]), ValueError, "rotary_dim"),
    "too_few_positions": (lambda c, s: flashtx.apply_rotary(_x(), c, s, seqlen_offsets=3), ValueError,
                          "cos/sin have 6 positions"),
    "per_batch_cos_batch": (lambda c, s: flashtx.apply_rotary(_x(), c.expand(3, 6, 4), s.expand(3, 6, 4)),
                            ValueError, "batch size 1 or 2"),
    "offsets_float": (lambda c, s: flashtx.apply_rotary(_x(), c, s, seqlen_offsets=1.5), TypeError,
                      "seqlen_offsets must be an int"),
    "offsets_negative": (lambda c, s: flashtx.apply_rotary(_x(), c, s, seqlen_offsets=-1), ValueError, ">= 0"),
    "offsets_tensor_shape": (lambda c, s: flashtx.apply_rotary(
        _x(), c, s, seqlen_offsets=torch.zeros(3, device=DEVICE).long()), ValueError,
        r"seqlen_offsets must have shape \(2,\)"),
    "offsets_tensor_dtype": (lambda c, s: flashtx.apply_rotary(
        _x(), c, s, seqlen_offsets=torch.zeros(2, device=DEVICE)), TypeError, "seqlen_offsets has dtype torch.float32"),
    "position_ids_shape": (lambda c, s: flashtx.apply_rotary(
        _x(), c, s, position_ids=torch.zeros(2, 5, device=DEVICE).long()), ValueError,
        r"position_ids must have shape \(2, 4\) or \(1, 4\)"),
    "position_ids_dtype": (lambda c, s: flashtx.apply_rotary(
        _x(), c, s, position_ids=torch.zeros(2, 4, device=DEVICE)), TypeError, "position_ids has dtype"),
    "offsets_and_position_ids": (lambda c, s: flashtx.apply_rotary(
        _x(), c, s, seqlen_offsets=1, position_ids=torch.zeros(2, 4, device=DEVICE).long()), ValueError, "not both"),
    "varlen_4d": (lambda c, s: flashtx.apply_rotary(_x(), c, s, cu_seqlens=torch.tensor([0, 4], device=DEVICE)),
                  ValueError, r"3-D \(total, H, D\)"),
    "varlen_layout": (lambda c, s: flashtx.apply_rotary(
        randn(4, 3, 8), c, s, cu_seqlens=torch.tensor([0, 4], device=DEVICE), layout="bhsd"), ValueError,
        "layout must be 'bshd'"),
    "cu_seqlens_dtype": (lambda c, s: flashtx.apply_rotary(
        randn(4, 3, 8), c, s, cu_seqlens=torch.tensor([0., 4.], device=DEVICE)), TypeError, "cu_seqlens has dtype"),
    "varlen_position_ids_shape": (lambda c, s: flashtx.apply_rotary(
        randn(4, 3, 8), c, s, cu_seqlens=torch.tensor([0, 4], device=DEVICE),
        position_ids=torch.zeros(1, 4, device=DEVICE).long()),
        ValueError, r"position_ids must have shape \(4,\)"),
    "cu_seqlens_list": (lambda c, s: flashtx.apply_rotary(randn(4, 3, 8), c, s, cu_seqlens=[0, 4]), TypeError,
                        "cu_seqlens must be a torch.Tensor"),
    "cu_seqlens_empty": (lambda c, s: flashtx.apply_rotary(
        randn(4, 3, 8), c, s, cu_seqlens=torch.zeros(0, device=DEVICE).int()), ValueError,
        r"cu_seqlens must have shape \(nseq \+ 1,\)"),
    "position_ids_list": (lambda c, s: flashtx.apply_rotary(_x(), c, s, position_ids=[[0, 1, 2, 3]]), TypeError,
                          "position_ids must be a torch.Tensor"),
    "offsets_other_device": (lambda c, s: flashtx.apply_rotary(_x(), c, s, seqlen_offsets=torch.zeros(
        2, dtype=torch.int64, device="meta")), ValueError, "seqlen_offsets is on meta"),
    "max_seqlen_without_cu": (lambda c, s: flashtx.apply_rotary(_x(), c, s, max_seqlen=4), ValueError,
                              "only meaningful with cu_seqlens"),
    "max_seqlen_negative": (lambda c, s: flashtx.apply_rotary(
        randn(4, 3, 8), c, s, cu_seqlens=torch.tensor([0, 4], device=DEVICE), max_seqlen=-1), ValueError,
        "max_seqlen must be >= 0"),
    "varlen_too_few_positions": (lambda c, s: flashtx.apply_rotary(
        randn(9, 3, 8), c, s, cu_seqlens=torch.tensor([0, 2, 9], device=DEVICE)), ValueError, "sequence length 7"),
    "cos_other_device": (lambda c, s: flashtx.apply_rotary(_x(), c.to("meta"), s.to("meta")), ValueError,
                         "cos is on meta"),
    "cos_requires_grad": (lambda c, s: flashtx.apply_rotary(_x(), c.requires_grad_(True), s), NotImplementedError,
                          r"cos.detach\(\)"),
    "backend_type": (lambda c, s: flashtx.apply_rotary(_x(), c, s, backend=1), TypeError, "backend must be"),
    "backend_unknown": (lambda c, s: flashtx.apply_rotary(_x(), c, s, backend="cuda"), ValueError,
                        "backend must be None or one of"),
    "qk_dtype": (lambda c, s: flashtx.apply_rotary_qk(_x(), _x().double(), c, s), TypeError,
                 "q and k must share dtype"),
    "qk_seqlen": (lambda c, s: flashtx.apply_rotary_qk(_x(), randn(2, 3, 3, 8), c, s), ValueError,
                  "differ only in the number of heads"),
    "hf_unsqueeze_dim": (lambda c, s: flashtx.apply_rotary_pos_emb(_x(), _x(), c, s, unsqueeze_dim=3), ValueError,
                         "unsqueeze_dim must be 1"),
    "hf_odd_rotary_dim": (lambda c, s: flashtx.apply_rotary_pos_emb(_x(), _x(), c[None, :4, :3], s[None, :4, :3],
                                                                    unsqueeze_dim=2), ValueError, "even rotary_dim"),
    "hf_seqlen": (lambda c, s: flashtx.apply_rotary_pos_emb(_x(), _x(), c[None], s[None], unsqueeze_dim=2),
                  ValueError, "cover the sequence length 4"),
    "hf_cos_sin_shapes": (lambda c, s: flashtx.apply_rotary_pos_emb(_x(), _x(), c[None, :4], s[None, :4, :2],
                                                                    unsqueeze_dim=2), ValueError, "same shape"),
    "hf_unsqueeze_dim_tensor": (lambda c, s: flashtx.apply_rotary_pos_emb(_x(), _x(), c, s, unsqueeze_dim=torch.tensor(
        2)), TypeError, "unsqueeze_dim must be an int"),
    # a 0-dim q with (B, S, rotary_dim) tables read q.shape[2] first (an IndexError)
    "hf_q_scalar": (lambda c, s: flashtx.apply_rotary_pos_emb(randn(()), _x(), c[None, :4], s[None, :4]), ValueError,
                    r"q must be .*; got shape \(\)"),
    # an empty table was read at row 0 (a crash); bad cu_seqlens read and wrote out of bounds
    "cos_no_positions": (lambda c, s: flashtx.apply_rotary(_x(), c[:0], s[:0], position_ids=torch.zeros(
        2, 4, dtype=torch.int64, device=DEVICE)), ValueError,
        r"at least one position \(seqlen_ro >= 1\); got shape \(0, 4\)"),
    # cu_seqlens values are checked on CPU tensors (on a GPU by a device-side assert): CPU inputs in both modes
    "cu_seqlens_past_end": (lambda c, s: flashtx.apply_rotary(torch.randn(10, 3, 8), c.cpu(), s.cpu(),
                                                              cu_seqlens=torch.tensor([0, 3, 8, 40])),
                            ValueError, r"cu_seqlens\[-1\] must equal total \(x.shape\[0\]\) = 10.*got 40"),
    "cu_seqlens_max_seqlen_small": (lambda c, s: flashtx.apply_rotary(
        torch.randn(6, 3, 8), c.cpu(), s.cpu(), cu_seqlens=torch.tensor([0, 1, 6]), max_seqlen=4), ValueError,
        r"max_seqlen = 4 is less than the longest sequence in cu_seqlens \(sequence 1: 5 rows\)"),
    # in place over shared memory rotated some elements twice
    "inplace_q_is_k": (lambda c, s: (lambda x: flashtx.apply_rotary_qk(x, x, c, s, inplace=True))(_x()), ValueError,
                       "inplace=True needs q and k in separate memory"),
    "inplace_overlapping_heads": (lambda c, s: (lambda x: flashtx.apply_rotary_qk(
        x[:, :, :2], x[:, :, 1:], c, s, inplace=True))(_x()), ValueError, "needs q and k in separate memory"),
    "inplace_expanded": (lambda c, s: flashtx.apply_rotary(randn(2, 4, 1, 8).expand(2, 4, 3, 8), c, s, inplace=True),
                         ValueError, r"cannot rotate x in place: .*stride-0 dim.*strides \(32, 8, 0, 1\)"),
    # nested tensors reached the fast path's key (torch's internal error on their shape)
    "x_nested": (lambda c, s: flashtx.apply_rotary(torch.nested.nested_tensor([randn(4, 2, 8), randn(4, 2, 8)]), c, s),
                 TypeError, "x is a nested tensor"),
    "k_nested": (lambda c, s: flashtx.apply_rotary_qk(randn(2, 4, 2, 8), torch.nested.nested_tensor(
        [randn(4, 2, 8), randn(4, 2, 8)]), c, s), TypeError, "k is a nested tensor"),
    "cos_nested": (lambda c, s: flashtx.apply_rotary(randn(2, 4, 2, 8), torch.nested.nested_tensor([c]), s),
                   TypeError, "cos is a nested tensor"),
    # heads that overlap with no 0 stride (head h's second half is head h + 1's first): rotated twice in place
    "inplace_as_strided": (lambda c, s: flashtx.apply_rotary(randn(80).as_strided((2, 4, 3, 8), (32, 8, 4, 1)), c, s,
                                                             inplace=True),
                           ValueError, r"cannot rotate x in place: .*do not nest.*strides \(32, 8, 4, 1\)"),
}


@pytest.mark.parametrize("case", ERRORS.values(), ids=ERRORS.keys())
def test_errors(case):
    fn, exc, match = case
    cos, sin = tables(6, 4)
    with pytest.raises(exc, match=match):
        fn(cos, sin)



def test_strided_cu_seqlens_and_offsets_are_read_by_value():
    """cu_seqlens and tensor seqlen_offsets given as strided views (an outside review: the kernel read them
    flat, so in-place varlen RoPE wrote rows outside x): the same as contiguous copies, nothing else written."""
    torch.manual_seed(4)
    big = torch.zeros(40, 1, 4, device=DEVICE)
    x = big[20:27]
    x.copy_(torch.randn(7, 1, 4, device=DEVICE))
    want_x = x.clone()
    cos, sin = tables(8, 2)
    cu = torch.tensor([0, -10, 3, 0, 7], dtype=torch.int32, device=DEVICE)[::2]  # values [0, 3, 7]
    offsets = torch.tensor([1, 9, 4, 9], dtype=torch.int32, device=DEVICE)[::2]  # values [1, 4]
    flashtx.apply_rotary(want_x, cos, sin, cu_seqlens=cu.contiguous(), max_seqlen=4,
                         seqlen_offsets=offsets.contiguous(), inplace=True, backend="triton")
    flashtx.apply_rotary(x, cos, sin, cu_seqlens=cu, max_seqlen=4, seqlen_offsets=offsets, inplace=True,
                         backend="triton")
    assert torch.equal(x, want_x)
    assert torch.equal(big[:20], torch.zeros_like(big[:20])) and torch.equal(big[27:], torch.zeros_like(big[27:]))


@pytest.mark.parametrize("varlen", [False, True], ids=["batch", "varlen"])
def test_more_sequences_than_cuda_grid_allows_are_refused(varlen):
    """Batch entries (or packed sequences) go on grid axis 1, which CUDA caps at 65,535: more is refused with a
    clear error on every device (the interpreter would run it, a GPU would fail to launch), planned or repeated."""
    cos, sin = randn(4, 1), randn(4, 1)
    n = 65536
    for _ in range(2):
        with pytest.raises(ValueError, match="65536 (sequences|batch entries) exceed CUDA's grid limit of 65535"):
            if varlen:
                flashtx.apply_rotary(randn(n, 1, 2), cos, sin, max_seqlen=1,
                                     cu_seqlens=torch.arange(n + 1, dtype=torch.int32, device=DEVICE))
            else:
                flashtx.apply_rotary(randn(n, 1, 1, 2), cos, sin)
    grids = []
    with launch.stub_launches(lambda kernel, grid, args: grids.append(grid)):  # (the interpreter runs grids slowly)
        flashtx.apply_rotary(randn(n - 1, 1, 1, 2), cos, sin)
    assert [g[1] for g in grids] == [n - 1]  # one launch, at the limit
