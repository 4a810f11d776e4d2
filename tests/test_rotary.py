"""Fused RoPE: kernels (in Triton's interpreter on CPU) against independent eager formulas.

The references here are written out independently of flashtx.reference: rotate_half for the
NeoX/LLaMA style and complex multiplication for the interleaved (GPT-J) style, in float64. The
same-dtype baseline for the tolerance rule is the real-arithmetic formula in the input dtype.
"""
import pytest
import torch
from conftest import (DEVICE, KERNEL_DTYPES, PRECISE_DTYPE, assert_close_to_reference, dtype_id, poisoned_allocations,
                      precise_atol, randn)

import flashtx
from flashtx import BackendNotSupported
from flashtx import reference
from flashtx._rotary_op import rotary_inplace_op, rotary_op, rotary_qk_op
from flashtx.triton_kernels import launch as launch_mod
from flashtx.triton_kernels import rotary as rotary_kernels


# ------------------------------------------------------------------------------- eager formulas
def tables(seqlen_ro, r2, dtype=torch.float32, batch=None):
    """Random angles -> (cos, sin), (seqlen_ro, r2) or (batch, seqlen_ro, r2)."""
    shape = (seqlen_ro, r2) if batch is None else (batch, seqlen_ro, r2)
    ang = torch.rand(*shape, dtype=torch.float64, device=DEVICE) * 6.3
    return ang.cos().to(dtype), ang.sin().to(dtype)


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def gather(table, pos):
    """table (seqlen_ro, r2) or (B, seqlen_ro, r2), pos (B, S) -> (B, S, 1, r2)."""
    if table.dim() == 2:
        return table[pos][:, :, None, :]
    return torch.stack([table[b, pos[b]] for b in range(pos.shape[0])])[:, :, None, :]


def eager_half(x, cos, sin, pos):
    """NeoX/LLaMA rotary on x (B, S, H, D) in x's dtype: x * cos + rotate_half(x) * sin."""
    r = 2 * cos.shape[-1]
    c, s = gather(cos, pos).to(x.dtype), gather(sin, pos).to(x.dtype)
    c, s = torch.cat((c, c), -1), torch.cat((s, s), -1)
    xr = x[..., :r]
    return torch.cat((xr * c + rotate_half(xr) * s, x[..., r:]), dim=-1)


def eager_interleaved_real(x, cos, sin, pos):
    """GPT-J rotary in x's dtype with real arithmetic (the same-dtype baseline)."""
    r = 2 * cos.shape[-1]
    c, s = gather(cos, pos).to(x.dtype), gather(sin, pos).to(x.dtype)
    x1, x2 = x[..., 0:r:2], x[..., 1:r:2]
    rot = torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2)
    return torch.cat((rot, x[..., r:]), dim=-1)


def complex_interleaved(x, cos, sin, pos):
    """GPT-J rotary as complex multiplication (x[2j] + i x[2j+1]) * e^{i theta}; float64 only."""
    r = 2 * cos.shape[-1]
    xc = torch.view_as_complex(x[..., :r].reshape(*x.shape[:-1], r // 2, 2).contiguous())
    rot = torch.view_as_real(xc * torch.complex(gather(cos, pos).double(), gather(sin, pos).double()))
    return torch.cat((rot.flatten(-2), x[..., r:]), dim=-1)


def reference64(x, cos, sin, pos, interleaved):
    x = x.double()
    return complex_interleaved(x, cos, sin, pos) if interleaved else eager_half(x, cos.double(), sin.double(), pos)


def eager_same_dtype(x, cos, sin, pos, interleaved):
    return (eager_interleaved_real if interleaved else eager_half)(x, cos, sin, pos)


def default_pos(B, S, offset=0):
    off = offset[:, None] if isinstance(offset, torch.Tensor) else offset
    return (torch.arange(S, device=DEVICE)[None, :] + off).expand(B, S).long()


def to_layout(x_bshd, layout):
    """A leaf in the requested layout and a (B, S, H, D) view of it."""
    if layout == "bshd":
        leaf = x_bshd.clone().requires_grad_(True)
        return leaf, leaf, "bshd"
    if layout == "bhsd":
        leaf = x_bshd.transpose(1, 2).contiguous().requires_grad_(True)
        return leaf, leaf.transpose(1, 2), "bhsd"
    # strided: every other column of a wider tensor, so no stride is 1 or dense
    B, S, H, D = x_bshd.shape
    wide = torch.zeros(B, S, H + 1, 2 * D, dtype=x_bshd.dtype, device=DEVICE)
    wide[:, :, :H, ::2] = x_bshd
    wide.requires_grad_(True)
    return wide, wide[:, :, :H, ::2], "bshd"


def check_fwd_bwd(name, out, x_in, x_view_fn, cos, sin, pos, interleaved, dtype):
    """Compare out and d(out)/d(x) against float64 and same-dtype eager formulas."""
    x = x_view_fn()
    x64 = x.detach().double().requires_grad_(True)
    xe = x.detach().clone().requires_grad_(True)
    ref = reference64(x64, cos, sin, pos, interleaved)
    eager = eager_same_dtype(xe, cos, sin, pos, interleaved)
    assert_close_to_reference(name, out, ref, eager)
    g = randn(*out.shape, dtype=dtype)
    gx, = torch.autograd.grad(out, x_in, g)
    ref.backward(g.double())
    eager.backward(g)
    return gx, x64.grad, xe.grad


# ------------------------------------------------------------------------------- accuracy
SHAPES = {  # (B, S, H, D, rotary_dim)
    "full_d16": (2, 7, 3, 16, 16),
    "partial_d10_r6": (1, 5, 2, 10, 6),
    "decode_s1_d64": (3, 1, 4, 64, 64),
    "partial_d128_r64": (1, 13, 1, 128, 64),
    "d256": (1, 3, 2, 256, 256),
}


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
@pytest.mark.parametrize("layout", ["bshd", "bhsd", "strided"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=dtype_id)
def test_apply_rotary_matches_eager(dtype, interleaved, layout, shape):
    B, S, H, D, R = shape
    cos, sin = tables(S + 3, R // 2)
    leaf, view, lay = to_layout(randn(B, S, H, D, dtype=dtype), layout)
    with poisoned_allocations():
        out = flashtx.apply_rotary(view if lay == "bshd" else leaf, cos, sin, interleaved=interleaved, layout=lay)
    out_bshd = out if lay == "bshd" else out.transpose(1, 2)
    assert out.shape == (view if lay == "bshd" else leaf).shape
    pos = default_pos(B, S)
    gk, g64, ge = check_fwd_bwd("out", out_bshd, leaf, lambda: view, cos, sin, pos, interleaved, dtype)
    gk = gk if layout != "strided" else gk[:, :, :H, ::2]
    gk = gk.transpose(1, 2) if layout == "bhsd" else gk
    assert_close_to_reference("dx", gk, g64, ge, grad=True)


POSITION_KINDS = ["int_offset", "tensor_offsets", "position_ids", "position_ids_broadcast"]


@pytest.mark.parametrize("kind", POSITION_KINDS)
@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=dtype_id)
def test_positions(dtype, kind):
    B, S, H, D = 3, 6, 2, 12
    cos, sin = tables(20, 4)
    x = randn(B, S, H, D, dtype=dtype, requires_grad=True)
    if kind == "int_offset":
        kw, pos = dict(seqlen_offsets=5), default_pos(B, S, 5)
    elif kind == "tensor_offsets":
        offs = torch.tensor([0, 9, 14], dtype=torch.int32, device=DEVICE)
        kw, pos = dict(seqlen_offsets=offs), default_pos(B, S, offs.long())
    elif kind == "position_ids":
        pos = torch.randint(0, 20, (B, S), device=DEVICE)
        kw = dict(position_ids=pos)
    else:
        p1 = torch.randint(0, 20, (1, S), device=DEVICE)
        kw, pos = dict(position_ids=p1), p1.expand(B, S)
    with poisoned_allocations():
        out = flashtx.apply_rotary(x, cos, sin, **kw)
    gk, g64, ge = check_fwd_bwd("out", out, x, lambda: x, cos, sin, pos, False, dtype)
    assert_close_to_reference("dx", gk, g64, ge, grad=True)


def varlen_case(dtype, H=3, D=8, r2=3):
    lens = [3, 0, 7, 1, 5]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    x = randn(int(cu[-1]), H, D, dtype=dtype, requires_grad=True)  # (total, H, D)
    return lens, cu, x, r2


@pytest.mark.parametrize("kind", ["plain", "offsets", "position_ids"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=dtype_id)
def test_varlen(dtype, interleaved, kind):
    lens, cu, x, r2 = varlen_case(dtype)
    cos, sin = tables(16, r2)
    offs = torch.tensor([2, 0, 5, 8, 1], device=DEVICE)
    total = x.shape[0]
    pos_ids = torch.randint(0, 16, (total,), device=DEVICE)
    kw = {"plain": {}, "offsets": dict(seqlen_offsets=offs), "position_ids": dict(position_ids=pos_ids)}[kind]
    with poisoned_allocations():
        out = flashtx.apply_rotary(x, cos, sin, cu_seqlens=cu, max_seqlen=max(lens), interleaved=interleaved, **kw)
    g = randn(*out.shape, dtype=dtype)
    gx, = torch.autograd.grad(out, x, g)
    for b, n in enumerate(lens):  # each sequence against the padded formula
        if n == 0:
            continue
        rows = slice(int(cu[b]), int(cu[b + 1]))
        if kind == "position_ids":
            pos = pos_ids[rows][None]
        else:
            pos = default_pos(1, n, int(offs[b]) if kind == "offsets" else 0)
        xs = x[rows][None]
        ref = reference64(xs.detach(), cos, sin, pos, interleaved)
        eager = eager_same_dtype(xs.detach(), cos, sin, pos, interleaved)
        assert_close_to_reference(f"seq{b}", out[rows][None], ref, eager)
        # the backward of a rotation is the inverse rotation: check it through the float64 formula
        x64 = xs.detach().double().requires_grad_(True)
        reference64(x64, cos, sin, pos, interleaved).backward(g[rows][None].double())
        xe = xs.detach().clone().requires_grad_(True)
        eager_same_dtype(xe, cos, sin, pos, interleaved).backward(g[rows][None])
        assert_close_to_reference(f"dseq{b}", gx[rows][None], x64.grad, xe.grad, grad=True)


# ------------------------------------------------------------------------------- q and k, in place
def count_launches(monkeypatch):
    """Every kernel launch from here on (planned or replayed from the launch cache) appends its kernel."""
    calls = []
    real = launch_mod.run_kernel

    def run_kernel(kernel, grid, args, launch_kwargs, *rest):
        calls.append(kernel)
        return real(kernel, grid, args, launch_kwargs, *rest)

    monkeypatch.setattr(launch_mod, "run_kernel", run_kernel)
    return calls


@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=dtype_id)
def test_apply_rotary_qk_gqa_one_launch(dtype, layout, monkeypatch):
    B, S, Hq, Hk, D = 2, 9, 5, 1, 16
    cos, sin = tables(S, 8)
    q, k = randn(B, S, Hq, D, dtype=dtype), randn(B, S, Hk, D, dtype=dtype)
    if layout == "bhsd":
        q, k = q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous()
    q.requires_grad_(True), k.requires_grad_(True)
    calls = count_launches(monkeypatch)
    with poisoned_allocations():
        qo, ko = flashtx.apply_rotary_qk(q, k, cos, sin, layout=layout, seqlen_offsets=0)
    assert len(calls) == 1, "q and k must be rotated by one launch"
    qs = flashtx.apply_rotary(q, cos, sin, layout=layout)
    ks = flashtx.apply_rotary(k, cos, sin, layout=layout)
    assert torch.equal(qo, qs) and torch.equal(ko, ks)
    gq, gk = randn(*qo.shape, dtype=dtype), randn(*ko.shape, dtype=dtype)
    calls.clear()
    dq, dk = torch.autograd.grad((qo, ko), (q, k), (gq, gk))
    assert len(calls) == 1, "the backward of q and k must be one launch too"
    dqs, dks = torch.autograd.grad((qs, ks), (q, k), (gq, gk))
    assert torch.equal(dq, dqs) and torch.equal(dk, dks)


@pytest.mark.parametrize("which", ["apply_rotary", "apply_rotary_qk", "varlen"])
@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=dtype_id)
def test_inplace_matches_out_of_place(dtype, which):
    cos, sin = tables(12, 3)
    if which == "varlen":
        lens, cu, x, _ = varlen_case(dtype, D=10)
        kw = dict(cu_seqlens=cu, max_seqlen=max(lens))
        leaves = [x]
    else:
        kw = dict(seqlen_offsets=2, interleaved=True)
        leaves = [randn(2, 5, 3, 10, dtype=dtype, requires_grad=True), randn(2, 5, 1, 10, dtype=dtype,
                                                                               requires_grad=True)]
        leaves = leaves[:1] if which == "apply_rotary" else leaves

    def run(inplace):
        ins = [t * 1 for t in leaves]  # non-leaf copies: in-place is allowed on them
        if len(ins) == 2:
            outs = flashtx.apply_rotary_qk(*ins, cos, sin, inplace=inplace, **kw)
        else:
            outs = (flashtx.apply_rotary(ins[0], cos, sin, inplace=inplace, **kw),)
        if inplace:
            assert all(o is i for o, i in zip(outs, ins)), "in-place must return its inputs"
        gs = [torch.ones_like(o) * torch.arange(o.shape[-1], dtype=o.dtype, device=DEVICE) for o in outs]
        return [o.detach() for o in outs], torch.autograd.grad(outs, leaves, gs)

    outs, grads = run(False)
    outs_i, grads_i = run(True)
    for a, b in zip(outs + list(grads), outs_i + list(grads_i)):
        assert torch.equal(a, b)
    with torch.no_grad():  # the no-autograd path runs the mutating op directly
        y = leaves[0].detach().clone()
        if len(leaves) == 2:
            flashtx.apply_rotary_qk(y, leaves[1].detach().clone(), cos, sin, inplace=True, **kw)
        else:
            flashtx.apply_rotary(y, cos, sin, inplace=True, **kw)
    assert torch.equal(y, outs[0])


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=dtype_id)
def test_inplace_qk_views_of_packed_qkv(dtype):
    """q and k as views of one packed qkv projection, rotated in place: gradients reach qkv."""
    B, S, Hq, Hk, D = 2, 5, 4, 2, 8
    cos, sin = tables(S, 3)
    leaf = randn(B, S, Hq + 2 * Hk, D, dtype=dtype, requires_grad=True)
    g = randn(B, S, Hq + 2 * Hk, D, dtype=dtype)
    qkv = leaf * 1
    q, k = qkv[:, :, :Hq], qkv[:, :, Hq:Hq + Hk]
    flashtx.apply_rotary_qk(q, k, cos, sin, inplace=True)
    d_inplace, = torch.autograd.grad(qkv, leaf, g)
    qkv2 = leaf * 1
    qo, ko = flashtx.apply_rotary_qk(qkv2[:, :, :Hq], qkv2[:, :, Hq:Hq + Hk], cos, sin)
    full = torch.cat((qo, ko, qkv2[:, :, Hq + Hk:]), dim=2)
    assert torch.equal(qkv.detach(), full.detach())
    d_ref, = torch.autograd.grad(full, leaf, g)
    assert torch.equal(d_inplace, d_ref)


@pytest.mark.parametrize("inplace", [True, None], ids=["inplace", "auto"])
@pytest.mark.parametrize("qk", [False, True], ids=["x", "qk"])
def test_inplace_over_tables_that_share_memory_with_x(inplace, qk):
    """x (or k) and cos/sin slices of one buffer: the in-place kernel read table rows it had already rotated (a wrong
    answer, found by an audit, 2026-12-05); such a call now rotates out of place and writes back, equal to rotating
    copies. Twice: the second call takes the lane of the first's signature."""
    for _ in range(2):
        buf = randn(400, dtype=PRECISE_DTYPE)
        x, cos, sin = buf[:288].view(2, 6, 3, 8), buf[88:128].view(10, 4), buf[128:168].view(10, 4)  # inside x
        q, k = buf[:192].view(2, 6, 2, 8), buf[288:384].view(2, 6, 1, 8)
        if qk:  # k over the tables, q apart from them
            cos, sin = buf[300:340].view(10, 4), buf[340:380].view(10, 4)
        args = [t.clone() for t in ((q, k) if qk else (x,)) + (cos, sin)]
        with torch.no_grad():
            if qk:
                want = flashtx.apply_rotary_qk(*args)
                got = flashtx.apply_rotary_qk(q, k, cos, sin, inplace=inplace)
                assert got[0] is q and got[1] is k
                assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
            else:
                want = flashtx.apply_rotary(*args)
                got = flashtx.apply_rotary(x, cos, sin, inplace=inplace)
                assert got is x and torch.equal(got, want)


def test_compiled_inplace_over_tables_that_share_memory_with_x():
    """Under torch.compile the overlap cannot be tested: x alone rotates out of place and writes back too (with
    backend="eager" the traced in-place op ran the in-place kernel over the overlapping tables)."""
    torch._dynamo.reset()
    step = torch.compile(lambda x, c, s: flashtx.apply_rotary(x, c, s, inplace=True), backend="eager", fullgraph=True)
    buf = randn(400, dtype=PRECISE_DTYPE)
    x, cos, sin = buf[:288].view(2, 6, 3, 8), buf[88:128].view(10, 4), buf[128:168].view(10, 4)
    want = flashtx.apply_rotary(x.clone(), cos.clone(), sin.clone())
    with torch.no_grad():
        step(x, cos, sin)
    assert torch.equal(x, want)


def test_inplace_on_leaf_requiring_grad_raises():
    cos, sin = tables(4, 2)
    x = randn(1, 4, 1, 4, requires_grad=True)
    with pytest.raises(RuntimeError, match="leaf"):
        flashtx.apply_rotary(x, cos, sin, inplace=True)
    q = randn(1, 4, 2, 4, requires_grad=True) * 1  # a non-leaf: fine on its own
    k = randn(1, 4, 1, 4, requires_grad=True)  # a leaf: refused
    q0 = q.detach().clone()
    with pytest.raises(RuntimeError, match="leaf"):
        flashtx.apply_rotary_qk(q, k, cos, sin, inplace=True)
    assert torch.equal(q.detach(), q0), "nothing is rotated when in-place is refused"


# ------------------------------------------------------------------------------- gradcheck (float64)
GRADCHECK_CASES = {
    "half": dict(),
    "interleaved_partial": dict(interleaved=True, r2=2),
    "offsets": dict(seqlen_offsets=torch.tensor([1, 3])),
    "position_ids": dict(position_ids=torch.tensor([[4, 0, 2], [1, 1, 5]])),
    "bhsd": dict(layout="bhsd"),
}


@pytest.mark.parametrize("case", GRADCHECK_CASES.values(), ids=GRADCHECK_CASES.keys())
def test_gradcheck(case):
    case = dict(case)
    r2 = case.pop("r2", 3)
    cos, sin = tables(8, r2, torch.float64)
    x = randn(2, 3, 2, 7, dtype=torch.float64, requires_grad=True)
    if case.get("layout") == "bhsd":
        x = randn(2, 2, 3, 7, dtype=torch.float64, requires_grad=True)
    case = {k: (v.to(DEVICE) if isinstance(v, torch.Tensor) else v) for k, v in case.items()}
    assert torch.autograd.gradcheck(lambda t: flashtx.apply_rotary(t, cos, sin, **case), (x,), fast_mode=True)


def test_gradcheck_qk_varlen_and_inplace():
    cos, sin = tables(8, 2, torch.float64)
    q = randn(2, 4, 3, 5, dtype=torch.float64, requires_grad=True)
    k = randn(2, 4, 1, 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: flashtx.apply_rotary_qk(a, b, cos, sin, interleaved=True), (q, k),
                                    fast_mode=True)
    assert torch.autograd.gradcheck(lambda a, b: flashtx.apply_rotary_qk(a * 1, b * 1, cos, sin, inplace=True),
                                    (q, k), fast_mode=True)
    cu = torch.tensor([0, 2, 2, 7], dtype=torch.int64, device=DEVICE)
    x = randn(7, 2, 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: flashtx.apply_rotary(t, cos, sin, cu_seqlens=cu), (x,), fast_mode=True)


# ------------------------------------------------------------------------------- transformers' signature
def hf_apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """transformers.models.llama.modeling_llama.apply_rotary_pos_emb, written out."""
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed


def hf_cos_sin(position_ids, dim, dtype, base=10000.0):
    """LlamaRotaryEmbedding.forward: (B, S, dim) cos/sin with duplicated halves, in the activation dtype."""
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64, device=DEVICE).float() / dim))
    freqs = (inv_freq[None, :, None] @ position_ids[:, None, :].float()).transpose(1, 2)  # (B, S, dim/2)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


@pytest.mark.parametrize("variant", ["bhsd", "bshd_unsqueeze2", "legacy_2d_position_ids", "broadcast_batch"])
@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=dtype_id)
def test_apply_rotary_pos_emb_matches_transformers(dtype, variant):
    B, Hq, Hk, S, D = 2, 4, 2, 7, 16
    pos = torch.stack([torch.arange(S), torch.arange(3, S + 3)]).to(DEVICE)  # (B, S)
    q, k = randn(B, Hq, S, D, dtype=dtype, requires_grad=True), randn(B, Hk, S, D, dtype=dtype, requires_grad=True)
    cos, sin = hf_cos_sin(pos, D, dtype)  # (B, S, D)
    ud = 1
    if variant == "bshd_unsqueeze2":
        q, k, ud = q.detach().transpose(1, 2).requires_grad_(True), k.detach().transpose(1, 2).requires_grad_(True), 2
    args_k = (cos, sin, None)
    if variant == "legacy_2d_position_ids":  # older transformers: (max_len, D) tables gathered by position_ids
        table_c, table_s = hf_cos_sin(torch.arange(16, device=DEVICE)[None], D, dtype)
        args_k = (table_c[0], table_s[0], pos)
    if variant == "broadcast_batch":
        pos = pos[:1].expand(B, S)
        cos, sin = cos[:1], sin[:1]
        args_k = (cos, sin, None)
    with poisoned_allocations():
        qe, ke = flashtx.apply_rotary_pos_emb(q, k, *args_k, unsqueeze_dim=ud)
    cos_b, sin_b = (cos, sin) if variant != "broadcast_batch" else (cos.expand(B, S, D), sin.expand(B, S, D))
    for name, out, t in (("q_embed", qe, q), ("k_embed", ke, k)):
        t64 = t.detach().double().requires_grad_(True)
        te = t.detach().clone().requires_grad_(True)
        ref = hf_apply_rotary_pos_emb(t64, t64, cos_b.double(), sin_b.double(), unsqueeze_dim=ud)[0]
        eager = hf_apply_rotary_pos_emb(te, te, cos_b, sin_b, unsqueeze_dim=ud)[0]
        assert_close_to_reference(name, out, ref, eager)
        g = randn(*out.shape, dtype=dtype)
        gk, = torch.autograd.grad(out, t, g, retain_graph=True)
        ref.backward(g.double())
        eager.backward(g)
        assert_close_to_reference("d" + name, gk, t64.grad, te.grad, grad=True)


def test_apply_rotary_pos_emb_partial_like_phi3():
    """cos narrower than the head: rotate the first rotary_dim columns, pass the rest (Phi-3)."""
    B, H, S, D, rd = 1, 2, 5, 12, 8
    q, k = randn(B, H, S, D, dtype=torch.float64), randn(B, H, S, D, dtype=torch.float64)
    cos, sin = hf_cos_sin(torch.arange(S, device=DEVICE)[None], rd, torch.float64)
    qe, ke = flashtx.apply_rotary_pos_emb(q, k, cos, sin)
    rq, rk = hf_apply_rotary_pos_emb(q[..., :rd], k[..., :rd], cos, sin)
    torch.testing.assert_close(qe, torch.cat((rq, q[..., rd:]), -1), rtol=0, atol=1e-14)
    torch.testing.assert_close(ke, torch.cat((rk, k[..., rd:]), -1), rtol=0, atol=1e-14)


# ------------------------------------------------------------------------------- edge cases, dispatch
@pytest.mark.parametrize("shape", [(0, 4, 2, 8), (2, 0, 2, 8), (2, 4, 0, 8), (1, 1, 1, 2)],
                         ids=["B0", "S0", "H0", "one_row"])
def test_empty_and_single(shape):
    cos, sin = tables(4, 1)
    x = randn(*shape, dtype=torch.float32, requires_grad=True)
    out = flashtx.apply_rotary(x, cos, sin)
    assert out.shape == x.shape
    out.sum().backward()
    assert x.grad.shape == x.shape
    if x.numel():
        pos = default_pos(shape[0], shape[1])
        torch.testing.assert_close(out.double(), reference64(x.detach(), cos, sin, pos, False))


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_varlen_max_seqlen_is_an_upper_bound(backend):
    """Issue 17 item 6: max_seqlen=40 with a 16-row table and sequences of length <= 5 raised a
    ValueError; max_seqlen bounds the lengths (as in flash-attn), the table is checked against the
    real ones."""
    lens = [5, 3, 0, 4]
    cu = torch.tensor([0, 5, 8, 8, 12], dtype=torch.int32, device=DEVICE)
    cos, sin = tables(16, 3)
    x = randn(12, 2, 8, dtype=PRECISE_DTYPE)  # (total, H, D)
    out = flashtx.apply_rotary(x, cos, sin, cu_seqlens=cu, max_seqlen=40, seqlen_offsets=11, backend=backend)
    exact = flashtx.apply_rotary(x, cos, sin, cu_seqlens=cu, max_seqlen=max(lens), seqlen_offsets=11, backend=backend)
    torch.testing.assert_close(out, exact, rtol=0, atol=0)
    for b, n in enumerate(lens):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        ref = reference64(x[rows][None], cos, sin, default_pos(1, n, 11), False)
        torch.testing.assert_close(out[rows][None].double(), ref, rtol=0, atol=precise_atol(1e-13))
    # a table too short for the real lengths is still refused, naming the sequence
    if DEVICE == "cpu":
        with pytest.raises(ValueError, match=r"cos/sin have 16 positions .*sequence length 5 of sequence 0"):
            flashtx.apply_rotary(x, cos, sin, cu_seqlens=cu, max_seqlen=40, seqlen_offsets=12, backend=backend)


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_empty_sequence_takes_empty_tables(backend):
    """S = 0 reads no position, so the (0, R2) tables RotaryEmbedding.cos_sin(0) gives are accepted (they
    raised "at least one position"): empty outputs and gradients, as every flashtx op; x with rows still
    needs a position."""
    cos, sin = tables(0, 4)
    q, k = randn(2, 0, 3, 8, requires_grad=True), randn(2, 0, 1, 8, requires_grad=True)
    out = flashtx.apply_rotary(q, cos, sin, backend=backend)
    qo, ko = flashtx.apply_rotary_qk(q, k, cos, sin, seqlen_offsets=3, backend=backend)
    assert out.shape == q.shape and qo.shape == q.shape and ko.shape == k.shape
    (out.sum() + qo.sum() + ko.sum()).backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape
    bhsd = randn(2, 3, 0, 8)
    assert flashtx.apply_rotary(bhsd, cos, sin, layout="bhsd", inplace=True, backend=backend) is bhsd
    cu = torch.zeros(3, dtype=torch.int32, device=DEVICE)  # two empty sequences
    assert flashtx.apply_rotary(randn(0, 3, 8), cos, sin, cu_seqlens=cu, backend=backend).shape == (0, 3, 8)
    hf = torch.empty(2, 0, 8, device=DEVICE)  # transformers' (B, S, rotary_dim) tables at S = 0
    qh, kh = flashtx.apply_rotary_pos_emb(randn(2, 3, 0, 8), randn(2, 1, 0, 8), hf, hf)
    assert qh.shape == (2, 3, 0, 8) and kh.shape == (2, 1, 0, 8)
    no_position = r"at least one position \(seqlen_ro >= 1\); got shape \(0, 4\)"
    with pytest.raises(ValueError, match=no_position):
        flashtx.apply_rotary(randn(2, 1, 3, 8), cos, sin, backend=backend)
    with pytest.raises(ValueError, match=no_position):  # no q heads, but k has rows
        flashtx.apply_rotary_qk(randn(2, 1, 0, 8), randn(2, 1, 1, 8), cos, sin, backend=backend)


def test_varlen_max_seqlen_beyond_the_total_is_clamped():
    """max_seqlen is an upper bound: the grid is sized by the total instead (it was sized by max_seqlen:
    10 tokens at max_seqlen 10**4 took seconds in the interpreter, 10**7 hung, and a GPU would pass CUDA's
    grid limit), in the kernel layer too, and looser bounds share a launch-cache entry; same values."""
    cu = torch.tensor([0, 3, 3, 10], dtype=torch.int32, device=DEVICE)
    cos, sin = tables(16, 3)
    x, k = randn(10, 2, 8, dtype=PRECISE_DTYPE), randn(10, 1, 8, dtype=PRECISE_DTYPE)  # (total, H, D)
    grids = []
    with launch_mod.stub_launches(lambda kernel, grid, args: grids.append(grid)):
        for m in (2**40, 10):  # 10: the total
            flashtx.apply_rotary_qk(x, k, cos, sin, cu_seqlens=cu, max_seqlen=m, backend="triton")
    assert len(grids) == 2 and grids[0] == grids[1], grids
    plan = rotary_kernels.plan_rotary(x, torch.empty_like(x), None, None, cos, sin, cu_seqlens=cu, max_seqlen=2**40)
    assert plan.grid == rotary_kernels.plan_rotary(x, torch.empty_like(x), None, None, cos, sin, cu_seqlens=cu,
                                                   max_seqlen=10).grid
    launch_mod.LAUNCHES.clear()
    with launch_mod.stub_launches():
        for m in (2**40, 10**9, 10):  # the kernel layer's own entry point, past the front end's clamp
            rotary_kernels.rotary(x, torch.empty_like(x), cos=cos, sin=sin, cu_seqlens=cu, max_seqlen=m)
    assert len(launch_mod.LAUNCHES.entries) == 1
    launch_mod.LAUNCHES.clear()
    qo, ko = flashtx.apply_rotary_qk(x, k, cos, sin, cu_seqlens=cu, max_seqlen=10**7, seqlen_offsets=2,
                                     backend="triton")
    rows = torch.arange(10, device=DEVICE)
    pos = rows - cu.long()[torch.searchsorted(cu[1:].long(), rows, right=True)] + 2  # (total,) positions
    zero = torch.zeros_like(rows)
    for got, t in ((qo, x), (ko, k)):
        want = reference.rotary_tokens(t.double(), cos[None], sin[None], zero, pos)
        torch.testing.assert_close(got.double(), want, rtol=0, atol=precise_atol(1e-13))

def test_varlen_no_sequences():
    cos, sin = tables(4, 2)
    x = randn(0, 2, 4)
    out = flashtx.apply_rotary(x, cos, sin, cu_seqlens=torch.zeros(1, dtype=torch.int32, device=DEVICE))
    assert out.shape == (0, 2, 4)


def test_out_of_range_positions_give_nan_on_every_backend():
    cos, sin = tables(6, 2)
    x = randn(1, 3, 1, 4)
    pos = torch.tensor([[0, 6, -1]], device=DEVICE)
    for backend in ("triton", "reference"):
        out = flashtx.apply_rotary(x, cos, sin, position_ids=pos, backend=backend)
        assert torch.isfinite(out[0, 0]).all() and torch.isnan(out[0, 1:]).all(), backend
    x = randn(1, 3, 1, 8)  # partial rotation (rotary_dim 4 of 8): only the rotated columns, as the README says
    for backend in ("triton", "reference"):
        out = flashtx.apply_rotary(x, cos, sin, position_ids=pos, backend=backend)
        assert torch.isfinite(out[0, 0]).all() and torch.isnan(out[0, 1:, :, :4]).all(), backend
        assert torch.equal(out[0, 1:, :, 4:], x[0, 1:, :, 4:]), backend


def test_rotary_embedding_with_only_negative_position_ids_gives_nan():
    """RotaryEmbedding sized its table max(position_ids) + 1 = 0 rows here, and the kernel read row 0."""
    x = randn(1, 3, 1, 8)
    out = flashtx.nn.RotaryEmbedding(8)(x, position_ids=torch.tensor([[-5, -2, -1]], device=DEVICE))
    assert torch.isnan(out).all()


def test_backends_agree_and_bf16_falls_back():
    cos, sin = tables(8, 4)
    x = randn(2, 8, 3, 8, dtype=PRECISE_DTYPE)  # float64 through the kernel in the interpreter, float32 on a GPU
    a = flashtx.apply_rotary(x, cos, sin, backend="triton", interleaved=True, seqlen_offsets=0)
    b = flashtx.apply_rotary(x, cos, sin, backend="reference", interleaved=True)
    torch.testing.assert_close(a, b, rtol=0, atol=precise_atol(1e-14))
    xb = x.to(torch.bfloat16)
    if DEVICE == "cpu":
        with pytest.raises(BackendNotSupported, match="bfloat16"):
            flashtx.apply_rotary(xb, cos, sin, backend="triton")
        with pytest.warns(UserWarning, match="reference"):
            flashtx.apply_rotary(xb[:1], cos, sin)
    out = flashtx.apply_rotary(xb, cos, sin)
    ref = reference64(xb, cos, sin, default_pos(2, 8), False)
    assert (out.double() - ref).abs().max() <= 2 * torch.finfo(torch.bfloat16).eps * ref.abs().max()


def test_custom_ops_opcheck():
    cos, sin = tables(6, 2)
    x = randn(2, 4, 3, 6, requires_grad=True)
    k = randn(2, 4, 1, 6, requires_grad=True)
    common = (cos[None], sin[None], [None, None, None], [1, 0, 0, 0], "triton")  # index, spec, backend
    torch.library.opcheck(rotary_op, (x, *common))
    torch.library.opcheck(rotary_qk_op, (x, k, *common))
    torch.library.opcheck(rotary_inplace_op, (x.detach().clone(), k.detach().clone(), *common))
