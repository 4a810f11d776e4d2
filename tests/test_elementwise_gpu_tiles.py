"""The sm_86 and sm_90 tiles of the elementwise kernels, fused RoPE (apply_rotary_qk) and fused SwiGLU (swiglu,
swiglu_packed), run in Triton's interpreter with the GPU's own plan (conftest's gpu_target): fp16 forward and
backward against float64 formulas under the tolerance rule, with poisoned allocations (an output element a tile
leaves unwritten is NaN) and every access bounds-checked (conftest). On a CPU configs.rotary_config /
swiglu_config give the interpreter's small tiles, so no other CPU test runs these.

The shapes give the GPU tiles partial last tiles: SwiGLU's hidden 5000 takes 1024-column tiles (the last one
904 columns wide) of 4 rows over 3 rows; RoPE's head dim 128 with 6 query / 2 key heads over 5 positions takes
(4 positions x 8 heads x 64 pairs) q tiles (the second position tile 1 row, the head tile 6 of 8) and a partial
rotary dim of 80 (40 of BLOCK_R2 = 64 pairs, then 48 pass-through columns). The tiles are large (2048 pairs,
4096 elements) and the interpreter runs every lane, so the row counts stay small.

fp16 only: the interpreter computes bf16 wrongly (triton-lang/triton#11584), so the Triton backend refuses bf16 on
a CPU (conftest.KERNEL_DTYPES); a GPU runs the bf16 tiles natively in the rest of the suite."""
import pytest
import torch
import torch.nn.functional as F
from conftest import ON_GPU, assert_close_to_reference, poisoned_allocations

import flashtx
from flashtx.triton_kernels import configs
from flashtx.triton_kernels import rotary as rotary_kernels  # noqa: F401  imported before gpu_target stands in
from flashtx.triton_kernels import swiglu as swiglu_kernels  # noqa: F401  their target_for

pytestmark = pytest.mark.skipif(ON_GPU, reason="runs a GPU's tiles in Triton's interpreter (a GPU runs them natively)")

DTYPE = torch.float16
ARCHS = [86, 90]


def _randn(gen, *shape, scale=1.0):
    return torch.randn(*shape, generator=gen, dtype=torch.float64) * scale


# ------------------------------------------------------------------------------------------------- RoPE
ROPE_SHAPES = {  # name: (B, S, Hq, Hk, D, rotary_dim)
    "llama_d128": (1, 5, 6, 2, 128, 128),
    "partial_d128_r80": (1, 5, 6, 2, 128, 80),
}


def _rope(x, cos, sin, pos, interleaved):
    """x (B, S, H, D) rotated in x's dtype at positions pos (B, S) by (L, r/2) tables (cast to x's dtype); the
    columns past r = 2 * cos.shape[-1] pass through. NeoX halves (x[j], x[j + r/2]) or GPT-J pairs (x[2j],
    x[2j+1]), written out with real arithmetic."""
    r = 2 * cos.shape[-1]
    c, s = (t.to(x.dtype)[pos][:, :, None, :] for t in (cos, sin))  # (B, S, 1, r/2)
    if interleaved:
        x1, x2 = x[..., 0:r:2], x[..., 1:r:2]
        rot = torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2)
    else:
        x1, x2 = x[..., :r // 2], x[..., r // 2:r]
        rot = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    return torch.cat((rot, x[..., r:]), dim=-1)


@pytest.mark.parametrize("gpu_target", ARCHS, indirect=True, ids=lambda a: f"sm_{a}")
@pytest.mark.parametrize("shape", ROPE_SHAPES.values(), ids=ROPE_SHAPES.keys())
@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
@pytest.mark.parametrize("positions", ["offsets", "position_ids"])
def test_rotary_gpu_tiles(gpu_target, shape, interleaved, positions):
    """apply_rotary_qk (GQA: q and k in one launch with their own tiles), through the per-signature lane (a
    seqlen offset) and the general op (position_ids), forward and backward."""
    B, S, Hq, Hk, D, r = shape
    for heads in (Hq, Hk):
        cfg = configs.rotary_config(r // 2, heads, S, gpu_target)
        assert cfg.block_rows * cfg.block_cols >= 8 and cfg != configs.ROTARY_INTERPRETER, cfg  # the GPU's tiles
    gen = torch.Generator().manual_seed(D + r + 2 * interleaved + (positions == "position_ids"))
    L = 16
    ang = torch.rand(L, r // 2, generator=gen, dtype=torch.float64) * 6.3
    cos, sin = ang.cos().float(), ang.sin().float()  # the kernel reads them in fp32
    q64, k64 = _randn(gen, B, S, Hq, D), _randn(gen, B, S, Hk, D)
    if positions == "offsets":
        offset = 3
        pos = (torch.arange(S) + offset)[None].expand(B, S)
        kw = dict(seqlen_offsets=offset)
    else:
        pos = torch.randperm(L, generator=gen)[:S][None].expand(B, S).contiguous()
        kw = dict(position_ids=pos)
    dq_out, dk_out = _randn(gen, B, S, Hq, D).to(DTYPE), _randn(gen, B, S, Hk, D).to(DTYPE)

    q, k = (t.to(DTYPE).requires_grad_() for t in (q64, k64))
    with poisoned_allocations():
        qo, ko = flashtx.apply_rotary_qk(q, k, cos, sin, interleaved=interleaved, backend="triton", **kw)
        dq, dk = torch.autograd.grad((qo, ko), (q, k), (dq_out, dk_out))

    qr, kr = (t.detach().double().requires_grad_() for t in (q, k))  # the fp16 values, in float64
    ref = [_rope(t, cos.double(), sin.double(), pos, interleaved) for t in (qr, kr)]
    ref_grads = torch.autograd.grad(ref, (qr, kr), (dq_out.double(), dk_out.double()))
    qe, ke = (t.detach().clone().requires_grad_() for t in (q, k))
    eager = [_rope(t, cos, sin, pos, interleaved) for t in (qe, ke)]
    eager_grads = torch.autograd.grad(eager, (qe, ke), (dq_out, dk_out))
    for name, got, want, base in (("q", qo, ref[0], eager[0]), ("k", ko, ref[1], eager[1])):
        assert got.dtype == DTYPE
        assert_close_to_reference(name, got, want, base)
    for name, got, want, base in zip(("dq", "dk"), (dq, dk), ref_grads, eager_grads):
        assert_close_to_reference(name, got, want, base, grad=True)


# ----------------------------------------------------------------------------------------------- SwiGLU
SWIGLU_ROWS, SWIGLU_HIDDEN = 3, 5000  # not a multiple of any column tile: 1024-column tiles, the last 904 wide


def _cancelling(dout, up64) -> float:
    """dgate = dout * up * s * (1 + gate * (1 - s)) cancels to ~0 near gate = -1.28: the magnitude of its terms for
    the ulp floor (as tests/test_swiglu.py)."""
    return float((dout.double() * up64.detach()).abs().max())


@pytest.mark.parametrize("gpu_target", ARCHS, indirect=True, ids=lambda a: f"sm_{a}")
@pytest.mark.parametrize("packed", [False, True], ids=["gate_up", "packed"])
def test_swiglu_gpu_tiles(gpu_target, packed):
    """swiglu(gate, up) and swiglu_packed([gate | up]), forward and backward."""
    M, H = SWIGLU_ROWS, SWIGLU_HIDDEN
    cfg = configs.swiglu_config(H, M, gpu_target)
    assert cfg != configs.SWIGLU_INTERPRETER and H % cfg.block_cols and cfg.block_rows > M, cfg  # partial tiles
    gen = torch.Generator().manual_seed(H + packed)
    x64 = _randn(gen, M, 2 * H, scale=2.0)
    dout = _randn(gen, M, H).to(DTYPE)

    x = x64.to(DTYPE).requires_grad_()
    with poisoned_allocations():
        if packed:
            out = flashtx.swiglu_packed(x, backend="triton")
        else:
            gate, up = x[:, :H].detach().requires_grad_(), x[:, H:].detach().requires_grad_()
            out = flashtx.swiglu(gate, up, backend="triton")
        grads = torch.autograd.grad(out, (x,) if packed else (gate, up), dout)
    grads = grads[0].split(H, dim=1) if packed else grads

    xr = x.detach().double().requires_grad_()  # the fp16 values, in float64
    ref = F.silu(xr[:, :H]) * xr[:, H:]
    dx64, = torch.autograd.grad(ref, xr, dout.double())
    xe = x.detach().clone().requires_grad_()
    eager = F.silu(xe[:, :H]) * xe[:, H:]
    dxe, = torch.autograd.grad(eager, xe, dout)
    assert out.dtype == DTYPE and out.shape == (M, H)
    assert_close_to_reference("out", out, ref, eager)
    assert_close_to_reference("dgate", grads[0], dx64[:, :H], dxe[:, :H], grad=True,
                              scale=_cancelling(dout, xr[:, H:]))
    assert_close_to_reference("dup", grads[1], dx64[:, H:], dxe[:, H:], grad=True)
