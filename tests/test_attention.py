"""Attention kernels against the float64 reference: forward, lse and all three gradients.

Runs the real Triton kernels (Triton's interpreter on CPU without a GPU; CUDA with one) and holds
them to the tolerance rule in conftest.assert_close_to_reference.
"""
import dataclasses
import zlib

import pytest
import torch
from conftest import (DEVICE, KERNEL_DTYPES, assert_close_to_reference, dtype_id, poisoned_allocations, randn,
                      to64, to_dtype)

import flashtx
from flashtx import reference


@dataclasses.dataclass(frozen=True)
class Case:
    sq: int
    sk: int
    d: int
    hq: int = 2
    hkv: int = 2
    causal: bool = False
    shell: str = "sdpa"  # "sdpa": flashtx.attention, (B, H, S, D), causal top-left
    #                      "flash": flashtx.flash_attn_func, (B, S, H, D), causal bottom-right
    layout: str = "contiguous"  # or "strided": q/k/v are non-contiguous views into larger buffers
    dv: int | None = None
    b: int = 2

    @property
    def id(self):
        c = ("causal-" + ("tl" if self.shell == "sdpa" else "br")) if self.causal else "full"
        dv = f"-dv{self.dv}" if self.dv else ""
        return (f"{self.shell}-q{self.sq}-k{self.sk}-d{self.d}{dv}-h{self.hq}x{self.hkv}-{c}-{self.layout}")


CASES = [
    Case(113, 113, 64),
    Case(1, 1, 16, causal=True),
    Case(1, 1, 16, causal=True, shell="flash"),
    Case(17, 300, 40, hq=4, hkv=2, causal=True),
    Case(300, 17, 80, hq=4, hkv=1, causal=True, shell="flash"),  # MQA; first 283 rows see no key
    Case(256, 256, 128, causal=True, shell="flash", layout="strided"),
    Case(113, 256, 96, hq=4, hkv=2, causal=True, shell="flash"),
    Case(17, 113, 192, layout="strided"),
    Case(256, 113, 64, causal=True),  # top-left with Sq > Sk
    Case(113, 113, 192, dv=128, causal=True),  # value head dim != query head dim (MLA-style)
    Case(1, 300, 64, hq=8, hkv=2, causal=True, shell="flash", b=1),  # decode step, GQA 4
    Case(300, 300, 256, causal=True, b=1, hq=1, hkv=1),
    Case(113, 17, 112, hq=2, hkv=1, causal=True, shell="flash", b=1),  # D=112; rows 0..95 see no key
    Case(17, 256, 160, hq=4, hkv=4, layout="strided", b=1),  # D=160
]


def make_qkv(case: Case, dtype):
    """q, k, v in the shell's layout; 'strided' makes them views into a packed buffer."""
    dv = case.dv or case.d
    if case.shell == "sdpa":
        shapes = [(case.b, case.hq, case.sq, case.d), (case.b, case.hkv, case.sk, case.d),
                  (case.b, case.hkv, case.sk, dv)]
    else:
        shapes = [(case.b, case.sq, case.hq, case.d), (case.b, case.sk, case.hkv, case.d),
                  (case.b, case.sk, case.hkv, dv)]
    if case.layout == "contiguous":
        return [randn(*s, dtype=dtype, requires_grad=True) for s in shapes]
    out = []
    for s in shapes:  # a view with padding in the last dim and the two middle dims swapped in memory
        buf = randn(s[0], s[2], s[1], s[3] + 8, dtype=dtype)
        out.append(buf[..., 3:3 + s[3]].transpose(1, 2).detach().requires_grad_(True))
        assert not out[-1].is_contiguous()
    return out


def run_shell(case: Case, q, k, v, **kw):
    if case.shell == "sdpa":
        return flashtx.attention(q, k, v, is_causal=case.causal, enable_gqa=case.hq != case.hkv, **kw)
    return flashtx.flash_attn_func(q, k, v, causal=case.causal, **kw)


def reference_in_shell(case: Case, q, k, v):
    """flashtx.reference.attention applied in the shell's layout and alignment."""
    if case.shell == "sdpa":
        return reference.attention(q, k, v, causal=case.causal, bottom_right=False)
    out = reference.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=case.causal,
                              bottom_right=True)
    return out.transpose(1, 2)


def cancelling(case: Case, q, k, v, do) -> dict:
    """{"dq": (rows, magnitude), "dk": (keys, magnitude)}: the query rows (a (Sq,) bool) whose dq, and the keys (a
    (Sk,) bool) whose dk, are ~0 through cancellation, and the magnitude of the cancelling terms there, for their
    ulp floor (check_grad). q, k, v, do: float64, in the shell's layout.

    With dS = P * (dP - delta), dP = dO V^T and delta_i = dO_i . O_i: a query row that sees exactly one key j has
    P_ij = 1 and O_i = V_j, so dS_ij = dO_i.V_j - dO_i.O_i = 0 exactly, and its dq row (scale * dS K) is the
    difference of two dot products, each rounded at |dO_i| . |V_j| (the sum of the terms' magnitudes): the kernel
    computes them in another order than the eager baseline (which often gets an exact 0), with P = exp2(s2 - m2 - l2)
    and O rounded to the dtype, so its dq there is rounding noise of size ulp(|dO_i| . |V_j|) * |K_j| * scale, while
    the reference is 0 (Sq = Sk = 1: all of dq; fp32 errs 2-4e-7 there against a 5e-10 floor at dq's own
    magnitude). The same holds for dk of a key that only such rows see (|Q_i| in place of |K_j|). dv = P^T dO has
    no such difference, and rows that see several keys give dq (and keys seen by them dk) of the size of their
    terms: those keep the floor at the gradient's own magnitude."""
    q, k, v, do = (t.detach() for t in (q, k, v, do))
    if case.shell == "flash":  # to (B, H, S, D)
        q, k, v, do = (t.transpose(1, 2) for t in (q, k, v, do))
    k, v = (t.repeat_interleave(case.hq // case.hkv, dim=1) for t in (k, v))
    if case.causal:
        vis = reference.causal_visibility(case.sq, case.sk, bottom_right=case.shell == "flash", device=q.device)
    else:
        vis = torch.ones(case.sq, case.sk, dtype=torch.bool, device=q.device)
    rows = vis.sum(-1) == 1  # (Sq,) rows that see exactly one key
    keys = vis.any(0) & ~(vis & ~rows[:, None]).any(0)  # (Sk,) keys seen, and only by such rows
    sm_scale = case.d ** -0.5
    dp_terms = (do.abs() @ v.abs().transpose(-1, -2)).masked_fill(~(vis & rows[:, None]), 0.0)  # (B, H, Sq, Sk)
    dq_mag = sm_scale * float((dp_terms * k.abs().amax(-1)[..., None, :]).max())
    dk_mag = sm_scale * float((dp_terms * q.abs().amax(-1)[..., None]).max())
    return {"dq": (rows, dq_mag), "dk": (keys, dk_mag)}


def check_grad(name, g, r, e, seq_dim: int, cancel=None) -> None:
    """assert_close_to_reference for a gradient, with its floor at its own magnitude; cancel = (a bool over dim
    seq_dim, magnitude): those positions are checked on their own, with the floor at that magnitude (see
    cancelling)."""
    assert g.shape == r.shape
    if cancel is None or not cancel[0].any():
        assert_close_to_reference(name, g, r, e, grad=True)
        return
    sel, magnitude = cancel

    def part(t, m):
        return t.index_select(seq_dim, m.nonzero().squeeze(1).to(t.device))

    assert_close_to_reference(f"{name} where it cancels", part(g, sel), part(r, sel), part(e, sel), grad=True,
                              scale=magnitude)
    if not sel.all():
        assert_close_to_reference(name, part(g, ~sel), part(r, ~sel), part(e, ~sel), grad=True)


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_forward_backward_match_reference(case, dtype):
    # A seed per case, the same in every process (str hash() is salted per process: a failure could not be
    # replayed). fp32 note: S is recomputed in the backward with another summation order than the forward's
    # (tile shapes, operand order), so P = exp2(s_bwd - m2_fwd) / l errs by ~sqrt(D) ulps of |q.k| * scale; where
    # one P ~ 1 dominates a dV entry (a row that sees 1-2 keys) that reaches ~10 ulps of dV in about 1 draw of
    # 1,500 here (flash-q113-k17-d112-h2x1 fp32), past the rule's 4-ulp floor. Inherent to recomputing P.
    torch.manual_seed(zlib.crc32(case.id.encode()))
    q, k, v = make_qkv(case, dtype)
    with poisoned_allocations():
        out = run_shell(case, q, k, v, backend="triton")
        do = randn(*out.shape, dtype=dtype)
        grads = torch.autograd.grad(out, (q, k, v), do)

    q64, k64, v64 = to64(q, k, v)
    ref = reference_in_shell(case, q64, k64, v64)
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), do.to(torch.float64))
    qe, ke, ve = to_dtype(dtype, q, k, v)
    eager = reference_in_shell(case, qe, ke, ve)
    eager_grads = torch.autograd.grad(eager, (qe, ke, ve), do)

    assert out.dtype == dtype and out.shape == ref.shape
    assert_close_to_reference("out", out, ref, eager)
    # Each gradient's ulp floor is taken at its own magnitude; only where a gradient is ~0 through cancellation (dq of
    # rows that see one key, dk of keys only those rows see) is it checked apart, at the magnitude of the cancelling
    # terms (see cancelling).
    cancel = cancelling(case, q64, k64, v64, do.to(torch.float64))
    seq_dim = 2 if case.shell == "sdpa" else 1
    for name, g, r, e in zip(("dq", "dk", "dv"), grads, ref_grads, eager_grads):
        check_grad(name, g, r, e, seq_dim, cancel.get(name))


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_lse_and_its_gradient(dtype, causal):
    """return_lse gives the natural-log lse in fp32 (fp64 for fp64), and gradients flow through it."""
    torch.manual_seed(1)
    q = randn(1, 4, 113, 64, dtype=dtype, requires_grad=True)
    k = randn(1, 2, 77, 64, dtype=dtype, requires_grad=True)
    v = randn(1, 2, 77, 64, dtype=dtype, requires_grad=True)
    with poisoned_allocations():
        out, lse = flashtx.attention(q, k, v, is_causal=causal, enable_gqa=True, return_lse=True, backend="triton")
        w = randn(*lse.shape, dtype=lse.dtype)
        loss = (out.float() * 0.5).sum() + (lse * w).sum()
        grads = torch.autograd.grad(loss, (q, k, v))
    assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert lse.shape == (1, 4, 113)

    def ref_loss(q, k, v):
        o, l = reference.attention(q, k, v, causal=causal, return_lse=True)
        return o, l, (o * 0.5).sum() + (l * w.to(l.dtype)).sum()

    q64, k64, v64 = to64(q, k, v)
    ref_out, ref_lse, rl = ref_loss(q64, k64, v64)
    ref_grads = torch.autograd.grad(rl, (q64, k64, v64))
    qe, ke, ve = to_dtype(dtype, q, k, v)
    e_out, _, el = ref_loss(qe, ke, ve)
    e_grads = torch.autograd.grad(el, (qe, ke, ve))
    # lse's eager baseline is the reference in lse's own dtype (float32 for 16-bit inputs: the kernel computes and
    # returns it in float32) on copies of the inputs in that dtype. An fp16 eager lse cast up errs by fp16's
    # rounding, ~1,800x the kernel's fp32 error: a kernel lse rounded through fp16 would pass against it.
    ql, kl, vl = to_dtype(lse.dtype, q, k, v)
    _, e_lse = reference.attention(ql, kl, vl, causal=causal, return_lse=True)
    assert e_lse.dtype == lse.dtype
    assert_close_to_reference("out", out, ref_out, e_out)
    assert_close_to_reference("lse", lse, ref_lse, e_lse)
    for name, g, r, e in zip(("dq", "dk", "dv"), grads, ref_grads, e_grads):
        assert_close_to_reference(name, g, r, e, grad=True)


def test_rows_without_keys_give_zero_output_and_gradient():
    """Bottom-right causal with Sq > Sk: the first Sq - Sk rows see no key (flash-attn semantics)."""
    torch.manual_seed(2)
    dtype = KERNEL_DTYPES[1]
    q = randn(1, 50, 2, 32, dtype=dtype, requires_grad=True)
    k = randn(1, 20, 2, 32, dtype=dtype, requires_grad=True)
    v = randn(1, 20, 2, 32, dtype=dtype, requires_grad=True)
    with poisoned_allocations():
        out = flashtx.flash_attn_func(q, k, v, causal=True, backend="triton")
        out.sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(q.grad).all()
    assert (out[:, :30] == 0).all() and (q.grad[:, :30] == 0).all()
    assert (out[:, 30:].abs().sum(-1) > 0).all()
    _, lse = flashtx.attention(q.detach().transpose(1, 2), k.detach().transpose(1, 2), v.detach().transpose(1, 2),
                               return_lse=True, backend="triton")
    assert torch.isfinite(lse).all()  # top-left alignment: every row sees key 0


def test_backward_is_bitwise_deterministic():
    torch.manual_seed(3)
    dtype = KERNEL_DTYPES[0]
    q = randn(2, 4, 130, 64, dtype=dtype, requires_grad=True)
    k = randn(2, 1, 97, 64, dtype=dtype, requires_grad=True)
    v = randn(2, 1, 97, 64, dtype=dtype, requires_grad=True)
    do = randn(2, 4, 130, 64, dtype=dtype)
    runs = []
    for _ in range(2):
        out = flashtx.attention(q, k, v, is_causal=True, enable_gqa=True, backend="triton")
        runs.append((out, *torch.autograd.grad(out, (q, k, v), do)))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_output_layout_follows_input_layout():
    """(B, S, H, D) inputs give a contiguous (B, S, H, D) output and gradients without copies."""
    dtype = KERNEL_DTYPES[0]
    q, k, v = (randn(2, 33, 3, 16, dtype=dtype, requires_grad=True) for _ in range(3))
    out = flashtx.flash_attn_func(q, k, v, backend="triton")
    assert out.shape == (2, 33, 3, 16) and out.is_contiguous()
    out.sum().backward()
    assert q.grad.is_contiguous() and k.grad.is_contiguous()


@pytest.mark.parametrize("shape", [(2, 3, 40, 16), (3, 40, 16), (40, 16), (2, 2, 3, 40, 16)],
                         ids=["4d", "3d", "2d", "5d"])
def test_sdpa_shell_accepts_any_rank_like_sdpa(shape):
    dtype = torch.float32
    q, k, v = (randn(*shape, dtype=dtype) for _ in range(3))
    out = flashtx.attention(q, k, v, is_causal=True, backend="triton")
    ref = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True)
    assert out.shape == ref.shape
    # eager baseline: the reference in float32, every leading dim folded into the heads of one (1, H, S, D) batch
    eager = reference.attention(*(t.reshape(1, -1, *shape[-2:]) for t in (q, k, v)), causal=True).reshape(shape)
    assert_close_to_reference("out", out, ref, eager)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_matches_torch_sdpa_semantics(causal):
    """Same numbers as torch's SDPA (math backend) for GQA and top-left causal with Sq != Sk."""
    torch.manual_seed(4)
    q = randn(2, 8, 40, 32, dtype=torch.float64)
    k = randn(2, 2, 70, 32, dtype=torch.float64)
    v = randn(2, 2, 70, 24, dtype=torch.float64)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True, scale=0.3)
    if DEVICE == "cuda":
        q, k, v = q.float(), k.float(), v.float()
    out = flashtx.attention(q, k, v, is_causal=causal, enable_gqa=True, scale=0.3, backend="triton")
    assert torch.allclose(out.double(), ref, atol=1e-5 if DEVICE == "cuda" else 1e-12)
