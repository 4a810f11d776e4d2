"""Element offsets past 2**31 in the elementwise kernels: a tensor whose stride on the column (SwiGLU's H, RoPE's
head dim) is so large that column x stride passes int32 (a permuted view, a slice of a big buffer). The kernels
form those offsets in int64; in int32 they wrapped and read and wrote outside the tensors (a segfault in the
interpreter). The buffer is 6 GiB of address space, of which the few elements written are touched."""
import pytest
import torch
from conftest import DEVICE

import flashtx
from flashtx.triton_kernels import swiglu as swiglu_kernels

F16 = torch.float16


def _strided(buf, shape, strides, offset=0, gen=None):
    """A view of buf with those strides, its elements set to fresh random values (the rest of buf untouched)."""
    t = buf.as_strided(shape, strides, offset)
    t.copy_(torch.randn(shape, generator=gen).to(F16))
    return t


def _close(got, want, atol=2e-3):
    assert (got.double() - want.double()).abs().max().item() <= atol


@pytest.fixture(scope="module")
def buf():
    return torch.empty(3 * 2**30 + 64, dtype=F16, device=DEVICE)  # 6 GiB of address space, untouched


def test_swiglu_columns_past_int32(buf):
    gen = torch.Generator().manual_seed(0)
    st = 2**30  # column 2 of (2, 3) views is at 2**31
    g = _strided(buf, (2, 3), (1, st), 0, gen)
    u = _strided(buf, (2, 3), (1, st), 2, gen)
    gd, ud = g.double(), u.double()
    _close(flashtx.swiglu(g, u, backend="triton"), torch.nn.functional.silu(gd) * ud)
    do = torch.randn(2, 3, generator=gen).to(F16).to(DEVICE)
    dg = _strided(buf, (2, 3), (1, st), 4, gen)  # the gradients stored through the same wide strides
    du = _strided(buf, (2, 3), (1, st), 6, gen)
    swiglu_kernels.swiglu_backward(do, g, u, dg, du)
    s = torch.sigmoid(gd)
    _close(dg, do.double() * ud * s * (1 + gd * (1 - s)))
    _close(du, do.double() * gd * s)


def test_swiglu_packed_second_half_past_int32(buf):
    gen = torch.Generator().manual_seed(1)
    st = 2**30  # (2, 4) [gate | up]: up starts at column H = 2, 2 x 2**30 = 2**31
    x = _strided(buf, (2, 4), (1, st), 0, gen)
    xd = x.double()
    want = torch.nn.functional.silu(xd[:, :2]) * xd[:, 2:]
    _close(flashtx.swiglu_packed(x, backend="triton"), want)
    do = torch.randn(2, 2, generator=gen).to(F16).to(DEVICE)
    swiglu_kernels.swiglu_backward_packed(do, x, x)  # in place: dx over x, through the wide strides
    s = torch.sigmoid(xd[:, :2])
    _close(x[:, :2], do.double() * xd[:, 2:] * s * (1 + xd[:, :2] * (1 - s)))
    _close(x[:, 2:], do.double() * xd[:, :2] * s)


@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "interleaved"])
def test_rotary_head_dim_past_int32(buf, interleaved):
    gen = torch.Generator().manual_seed(2)
    D, st = 256, 2**23 + 2**16  # 255 x stride > 2**31
    x = _strided(buf, (1, 2, 1, D), (1, 1, 1, st), 0, gen)  # (B, S, H, D), D's stride huge
    cos, sin = (torch.randn(4, D // 2, generator=gen).to(DEVICE) for _ in range(2))
    want = flashtx.apply_rotary(x.double(), cos.double(), sin.double(), interleaved=interleaved, backend="reference")
    _close(flashtx.apply_rotary(x, cos, sin, interleaved=interleaved, backend="triton"), want, 5e-3)
    flashtx.apply_rotary(x, cos, sin, interleaved=interleaved, inplace=True, backend="triton")
    _close(x, want, 5e-3)
    part = _strided(buf, (1, 2, 1, D), (1, 1, 1, st), 4, gen)  # partial rotary: the rest copied through
    cos2, sin2 = cos[:, :32], sin[:, :32]
    want = flashtx.apply_rotary(part.double(), cos2.double(), sin2.double(), interleaved=interleaved,
                                backend="reference")
    _close(flashtx.apply_rotary(part, cos2, sin2, interleaved=interleaved, backend="triton"), want, 5e-3)
