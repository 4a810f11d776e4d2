"""flashtx.nn.RotaryEmbedding: fp32 tables against the formulas (including transformers' dynamic-NTK
and Llama 3 rules, written out), growth on demand, and forward against apply_rotary(_qk)."""
import math
import warnings

import pytest
import torch
from conftest import DEVICE, randn

import flashtx
from flashtx.nn import RotaryEmbedding


def plain_tables(inv_freq, positions):
    ang = torch.outer(positions.double(), inv_freq.double())
    return ang.cos().float(), ang.sin().float()


def test_rotary_embedding_tables_and_growth():
    rope = flashtx.nn.RotaryEmbedding(12, base=500.0, max_seq_len=8)
    inv = 500.0 ** (-torch.arange(0, 12, 2, dtype=torch.float64) / 12)
    assert rope.inv_freq.dtype == torch.float32 and torch.equal(rope.inv_freq, inv.float())
    cos, sin = rope.cos_sin(5)
    assert cos.shape == (5, 6) and cos.dtype == torch.float32
    ref_c, ref_s = plain_tables(rope.inv_freq, torch.arange(50))
    assert torch.equal(cos, ref_c[:5]) and torch.equal(sin, ref_s[:5])
    first = cos.data_ptr()
    assert rope.cos_sin(8)[0].data_ptr() == first, "within max_seq_len the cache is reused"
    cos50, sin50 = rope.cos_sin(50)  # grows on demand
    assert torch.equal(cos50, ref_c) and torch.equal(sin50, ref_s)
    assert rope.cos_sin(0)[0].shape == (0, 6)
    rope.half()  # casting the module (e.g. model.half()) leaves the fp32 tables exact
    c200 = rope.cos_sin(200)[0]  # grows: rebuilt after the cast
    assert c200.dtype == torch.float32 and torch.equal(c200, plain_tables(inv.float(), torch.arange(200))[0])


def test_rotary_embedding_linear_scaling():
    rope = flashtx.nn.RotaryEmbedding(8, scaling={"type": "linear", "factor": 4.0})
    ref_c, ref_s = plain_tables(rope.inv_freq, torch.arange(20) / 4.0)
    cos, sin = rope.cos_sin(20)
    assert torch.equal(cos, ref_c) and torch.equal(sin, ref_s)


def test_rotary_embedding_dynamic_ntk_like_transformers():
    dim, base, orig, factor = 8, 10000.0, 16, 2.0
    rope = flashtx.nn.RotaryEmbedding(dim, base, max_seq_len=orig, scaling={"rope_type": "dynamic", "factor": factor})
    short = rope.cos_sin(10)[0].clone()
    ref_c, _ = plain_tables(rope.inv_freq, torch.arange(10))
    assert torch.equal(short, ref_c), "no scaling up to the original length"
    L = 40  # transformers' _compute_dynamic_ntk_parameters at seq_len = L
    ntk_base = base * ((factor * L / orig) - (factor - 1)) ** (dim / (dim - 2))
    inv = 1.0 / (ntk_base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    ref_c, ref_s = plain_tables(inv.float(), torch.arange(L))
    cos, sin = rope.cos_sin(L)
    torch.testing.assert_close(cos, ref_c, rtol=0, atol=1e-6)
    torch.testing.assert_close(sin, ref_s, rtol=0, atol=1e-6)
    assert torch.equal(rope.cos_sin(30)[0], cos[:30]), "a shorter (still long) sequence keeps the grown frequencies"
    # transformers' dynamic_rope_update resets only below the original length: at it, the grown ones stay
    assert torch.equal(rope.cos_sin(orig)[0], cos[:orig]), "exactly the original length: still the grown frequencies"
    assert torch.equal(rope.cos_sin(orig + 1)[0], cos[:orig + 1]), "and past it again: the same (no regrowth)"
    assert torch.equal(rope.cos_sin(10)[0], short), "below the original length: reset, as transformers"
    assert torch.equal(rope.cos_sin(orig)[0][:10], short), "and at it after a reset: unscaled"


def test_rotary_embedding_reads_rope_theta_from_transformers_rope_parameters():
    """transformers 5's config.rope_parameters carries rope_theta: it is the base (it was ignored: base 10000)."""
    params = {"rope_type": "linear", "factor": 2.0, "rope_theta": 500000.0}
    rope = flashtx.nn.RotaryEmbedding(8, scaling=params)
    assert rope.base == 500000.0
    assert torch.equal(rope.cos_sin(12)[0], flashtx.nn.RotaryEmbedding(8, 500000.0, scaling=params).cos_sin(12)[0])
    ref_c, _ = plain_tables(rope.inv_freq, torch.arange(12) / 2.0)
    assert torch.equal(rope.cos_sin(12)[0], ref_c)
    assert flashtx.nn.RotaryEmbedding(8, scaling={"rope_type": "default", "rope_theta": 1e6}).base == 1e6
    assert flashtx.nn.RotaryEmbedding(8).base == 10000.0
    with pytest.raises(ValueError, match=r"base \(10000.0\) and scaling's rope_theta \(500000.0\) disagree"):
        flashtx.nn.RotaryEmbedding(8, 10000.0, scaling=params)
    with pytest.raises(ValueError, match=r"scaling's rope_theta must be a finite number > 1; got 'x'"):
        flashtx.nn.RotaryEmbedding(8, scaling={"rope_type": "default", "rope_theta": "x"})


def test_rotary_embedding_llama3_like_transformers():
    sc = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}
    dim, base = 32, 500000.0
    rope = flashtx.nn.RotaryEmbedding(dim, base, scaling=sc)
    # transformers' _compute_llama3_parameters, written out (in float64 here)
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    low_wl, high_wl = 64 / 1.0, 64 / 4.0
    wavelen = 2 * torch.pi / inv_freq
    inv_l = torch.where(wavelen > low_wl, inv_freq / 8.0, inv_freq)
    smooth = (64 / wavelen - 1.0) / (4.0 - 1.0)
    smoothed = (1 - smooth) * inv_l / 8.0 + smooth * inv_l
    medium = ~(wavelen < high_wl) * ~(wavelen > low_wl)
    expected = torch.where(medium, smoothed, inv_l)
    assert medium.any() and (wavelen > low_wl).any() and (wavelen < high_wl).any(), "all three bands covered"
    torch.testing.assert_close(rope.inv_freq, expected.float(), rtol=0, atol=0)


def test_rotary_embedding_forward():
    rope = flashtx.nn.RotaryEmbedding(8, max_seq_len=4, device=DEVICE)  # cos_sin() tables on DEVICE
    q, k = randn(2, 6, 3, 10, dtype=torch.float64), randn(2, 6, 1, 10, dtype=torch.float64)
    cos, sin = rope.cos_sin(16)
    qo, ko = rope(q, k, seqlen_offsets=10, inplace=False)  # needs 16 positions: grows past max_seq_len
    eq, ek = flashtx.apply_rotary_qk(q, k, cos, sin, seqlen_offsets=10)
    assert torch.equal(qo, eq) and torch.equal(ko, ek)
    pos = torch.tensor([[0, 3, 9, 1, 1, 2], [5, 5, 5, 5, 5, 20]], device=DEVICE)
    assert torch.equal(rope(q, position_ids=pos, inplace=False),
                       flashtx.apply_rotary(q, *rope.cos_sin(21), position_ids=pos))
    qb = q.transpose(1, 2)
    offs = torch.tensor([2, 7], device=DEVICE)
    assert torch.equal(rope(qb.clone(), layout="bhsd", seqlen_offsets=offs).transpose(1, 2),
                       flashtx.apply_rotary(q, *rope.cos_sin(13), seqlen_offsets=offs))
    gptj = flashtx.nn.RotaryEmbedding(8, interleaved=True, device=DEVICE)
    assert torch.equal(gptj(q.clone()), flashtx.apply_rotary(q, *gptj.cos_sin(6), interleaved=True))
    cu = torch.tensor([0, 4, 12], dtype=torch.int32, device=DEVICE)
    xv = randn(12, 2, 8, dtype=torch.float64)
    assert torch.equal(rope(xv.clone(), cu_seqlens=cu), flashtx.apply_rotary(xv, *rope.cos_sin(8), cu_seqlens=cu))


def test_rotary_embedding_in_place_by_default_where_autograd_allows():
    """inplace=None (the default): no autograd recording -> q and k are rotated in place and returned;
    recording -> new tensors, inputs untouched; q and k sharing memory -> out of place."""
    rope = flashtx.nn.RotaryEmbedding(8, device=DEVICE)
    q, k = randn(2, 5, 3, 8, dtype=torch.float64), randn(2, 5, 1, 8, dtype=torch.float64)
    expect = flashtx.apply_rotary_qk(q, k, *rope.cos_sin(5))
    q1, k1 = q.clone(), k.clone()
    qo, ko = rope(q1, k1)
    assert qo is q1 and ko is k1 and torch.equal(q1, expect[0]) and torch.equal(k1, expect[1])
    q2 = q.clone().requires_grad_(True)
    qo, ko = rope(q2, k.clone())
    assert qo is not q2 and torch.equal(q2.detach(), q) and torch.equal(qo.detach(), expect[0])
    with torch.no_grad():
        q3 = q.clone().requires_grad_(True)
        assert rope(q3) is q3
    both = torch.cat((q, q), 2)  # q and k the same memory: refused in place, so out of place
    qo, ko = rope(both[:, :, :3], both[:, :, 2:5])
    assert torch.equal(both, torch.cat((q, q), 2)) and torch.equal(qo, expect[0])


def test_rotary_embedding_empty_sequence():
    """S = 0 (an empty prompt): empty outputs and gradients, out of place and in place (the (0, dim/2)
    tables of cos_sin(0) raised "at least one position"); dim 2 without dynamic scaling still works."""
    rope = flashtx.nn.RotaryEmbedding(8, device=DEVICE)
    q, k = randn(2, 5, 3, 8, requires_grad=True), randn(2, 5, 1, 8, requires_grad=True)
    qo, ko = rope(q[:, :0], k[:, :0])
    assert qo.shape == (2, 0, 3, 8) and ko.shape == (2, 0, 1, 8)
    (qo.sum() + ko.sum()).backward()
    assert torch.equal(q.grad, torch.zeros_like(q)) and torch.equal(k.grad, torch.zeros_like(k))
    with torch.no_grad():
        x = randn(2, 3, 0, 8)
        assert rope(x, layout="bhsd", seqlen_offsets=4) is x
    two = flashtx.nn.RotaryEmbedding(2, max_seq_len=4, scaling={"type": "linear", "factor": 2.0}, device=DEVICE)
    x = randn(1, 9, 1, 2, dtype=torch.float64)
    assert torch.equal(two(x, inplace=False), flashtx.apply_rotary(x, *two.cos_sin(9)))


RE_ERRORS = {
    "odd_dim": (dict(dim=7), ValueError, "even int"),
    "bad_base": (dict(dim=8, base=1.0), ValueError, "base must be a finite number > 1"),
    "inf_base": (dict(dim=8, base=math.inf), ValueError, "base must be a finite number > 1; got inf"),
    "bad_max_seq_len": (dict(dim=8, max_seq_len=0), ValueError, r"max_seq_len must be an int in \[1, 536870912\]"),
    "huge_max_seq_len": (dict(dim=8, max_seq_len=2**40), ValueError, "max_seq_len must be an int in .*; got 1099"),
    "scaling_not_dict": (dict(dim=8, scaling="linear"), TypeError, "scaling must be None or a dict"),
    "scaling_unknown": (dict(dim=8, scaling={"type": "yarn", "factor": 2.0}), ValueError, "scaling type must be"),
    "scaling_factor": (dict(dim=8, scaling={"type": "linear", "factor": 0}), ValueError,
                       "scaling factor must be a finite number > 0; got 0"),
    "scaling_factor_inf": (dict(dim=8, scaling={"type": "linear", "factor": math.inf}), ValueError, "got inf"),
    "scaling_factor_nan": (dict(dim=8, scaling={"type": "dynamic", "factor": math.nan}), ValueError, "got nan"),
    # these divided by zero (ZeroDivisionError) or gave NaN frequencies (audit of 2026-12-02, F7)
    "llama3_zero_low": (dict(dim=8, scaling={"type": "llama3", "factor": 8.0, "low_freq_factor": 0,
                                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8}),
                        ValueError, "llama3 scaling's low_freq_factor must be a finite number > 0; got 0"),
    "llama3_zero_len": (dict(dim=8, scaling={"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                             "high_freq_factor": 4.0, "original_max_position_embeddings": 0}),
                        ValueError, "original_max_position_embeddings must be a finite number > 0; got 0"),
    "llama3_nan_high": (dict(dim=8, scaling={"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                             "high_freq_factor": math.nan, "original_max_position_embeddings": 8}),
                        ValueError, "high_freq_factor must be a finite number > 0; got nan"),
    "llama3_missing": (dict(dim=8, scaling={"type": "llama3", "factor": 8.0}), ValueError, "missing"),
    "llama3_bands": (dict(dim=8, scaling={"type": "llama3", "factor": 8.0, "low_freq_factor": 4.0,
                                          "high_freq_factor": 1.0, "original_max_position_embeddings": 8}),
                     ValueError, "high_freq_factor > low_freq_factor"),
    # the NTK base ** (dim / (dim - 2)) divided by zero in cos_sin past the original length
    "dynamic_dim_2": (dict(dim=2, max_seq_len=4, scaling={"rope_type": "dynamic", "factor": 2.0}), ValueError,
                      r"dynamic \(NTK\) scaling needs dim \(the rotary dim\) > 2, .*; got dim=2"),
}


@pytest.mark.parametrize("case", RE_ERRORS.values(), ids=RE_ERRORS.keys())
def test_rotary_embedding_errors(case):
    kw, exc, match = case
    with pytest.raises(exc, match=match):
        flashtx.nn.RotaryEmbedding(**kw)


def test_rotary_embedding_call_errors():
    rope = flashtx.nn.RotaryEmbedding(8)
    with pytest.raises(ValueError, match=r"seq_len must be an int in \[0, 536870912\]; got -1"):
        rope.cos_sin(-1)
    with pytest.raises(ValueError, match=r"seq_len must be an int in \[0, 536870912\]; got 1099511627776"):
        rope.cos_sin(2**40)  # (an allocator error before)
    with pytest.raises(TypeError, match="q must be a torch.Tensor"):
        rope("q")
    with pytest.raises(ValueError, match=r"rotary_dim = 2 \* cos.shape\[-1\] = 8"):
        rope(randn(1, 3, 2, 6))  # head dim smaller than the rotary dim
    # audit of 2026-12-02 (F5, F6): lists gave AttributeErrors, a negative offset named seq_len, and one huge
    # position id allocated a table of that many rows (8 TB for 2**40)
    q = randn(1, 3, 2, 8)
    with pytest.raises(TypeError, match="position_ids must be None or an int tensor; got list"):
        rope(q, position_ids=[[0, 1, 2]])
    with pytest.raises(TypeError, match="cu_seqlens must be None or an int tensor; got list"):
        rope(q[0], cu_seqlens=[0, 3])
    with pytest.raises(ValueError, match="seqlen_offsets must be >= 0; got -5"):
        rope(q, seqlen_offsets=-5)
    with pytest.raises(TypeError, match="seqlen_offsets must be an int; got list"):
        rope(q, seqlen_offsets=[1])
    with pytest.raises(ValueError, match=r"position_ids reach position 1099511627776; RotaryEmbedding builds tables "
                                         r"of at most 536870912 positions"):
        rope(q, position_ids=torch.tensor([[0, 1, 2**40]], device=DEVICE))
    with pytest.raises(ValueError, match=r"the sequence length plus seqlen_offsets reach position 536870914"):
        rope(q, seqlen_offsets=2**29)
    assert rope._cache is None or rope._cache[1] <= 2048  # nothing was built for them
    # an integral float entry (as some configs hold it) equal to max_seq_len: no warning; the length is the int
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sc = flashtx.nn.RotaryEmbedding(8, max_seq_len=16, scaling={"type": "dynamic", "factor": 2.0,
                                                                    "original_max_position_embeddings": 16.0}).scaling
    assert sc["original_max_position_embeddings"] == 16 and type(sc["original_max_position_embeddings"]) is int


def test_tables_built_under_inference_mode_do_not_break_training():
    """An eval pass under torch.inference_mode caches inference-tensor tables; the next training step rebuilds
    them (inference tensors cannot be saved for backward) instead of failing."""
    rope = RotaryEmbedding(8)
    with torch.inference_mode():
        rope(randn(1, 4, 2, 8))
    q = randn(1, 4, 2, 8, requires_grad=True)
    (g,) = torch.autograd.grad(rope(q).sum(), (q,))
    assert g.shape == q.shape and torch.isfinite(g).all()


def test_built_on_the_meta_device():
    """`with torch.device("meta")` construction (meta init, FSDP): the tables' frequencies do not come from the
    (valueless) meta buffer, so after to_empty the module rotates as one built on the device."""
    from flashtx.nn import TransformerBlock

    with torch.device("meta"):
        meta = RotaryEmbedding(8)
        TransformerBlock(32, 4, 2, rotary=RotaryEmbedding(8))
    meta = meta.to_empty(device=DEVICE)
    x = randn(1, 5, 2, 8)
    torch.testing.assert_close(meta(x.clone(), inplace=False), RotaryEmbedding(8).to(DEVICE)(x.clone(), inplace=False))


def test_tables_built_under_inference_mode_are_rebuilt_in_a_compiled_training_step():
    """As above, under torch.compile (which cannot read the inference mode: the flag is stored with the tables)."""
    rope = RotaryEmbedding(8)
    with torch.inference_mode():
        rope(randn(1, 4, 2, 8))
    step = torch.compile(lambda q: rope(q, inplace=False).sum(), backend="aot_eager", fullgraph=True)
    q = randn(1, 4, 2, 8, requires_grad=True)
    (g,) = torch.autograd.grad(step(q), (q,))
    assert g.shape == q.shape and torch.isfinite(g).all()


def ntk_tables(dim, base, orig, factor, L):
    """transformers' _compute_dynamic_ntk_parameters at seq_len = L (max(L, orig)), as fp32 frequencies."""
    ntk_base = base * ((factor * max(L, orig) / orig) - (factor - 1)) ** (dim / (dim - 2))
    inv = 1.0 / (ntk_base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    return plain_tables(inv.float(), torch.arange(L))


def test_dynamic_ntk_packed_length_is_the_real_longest_sequence_not_max_seqlen():
    """Audit t7: with cu_seqlens, max_seqlen is any bound above the longest sequence (it sizes the kernel's grid);
    the NTK length was taken from it, so the same tokens rotated differently with a looser bound, and the module
    kept the bound as its longest length. The length is the call's real last position + 1, as transformers reads
    max(position_ids) + 1."""
    D, L0, sc = 16, 8, {"rope_type": "dynamic", "factor": 4.0}
    cu = torch.tensor([0, 6, 10], dtype=torch.int32, device=DEVICE)  # lengths 6, 4: within L0, no scaling
    x = randn(10, 2, D)
    want = flashtx.apply_rotary(x, *RotaryEmbedding(D, max_seq_len=L0).to(DEVICE).cos_sin(6), cu_seqlens=cu)
    for bound in (None, 6, 10, 64):
        rope = RotaryEmbedding(D, max_seq_len=L0, scaling=sc).to(DEVICE)
        assert torch.equal(rope(x.clone(), cu_seqlens=cu, max_seqlen=bound), want), f"max_seqlen={bound}"
        assert rope._cache[0] == ("plain",), f"max_seqlen={bound}: no NTK tables for sequences within L0"
    # past L0: the frequencies of the longest sequence (12), whatever the bound, and kept (12 > L0) for a
    # shorter packed batch that is still past L0, as transformers' dynamic_rope_update keeps its longest length
    cu = torch.tensor([0, 12, 15], dtype=torch.int32, device=DEVICE)
    x = randn(15, 2, D)
    c12, s12 = ntk_tables(D, 10000.0, L0, 4.0, 12)
    rope = RotaryEmbedding(D, max_seq_len=L0, scaling=sc).to(DEVICE)
    got = rope(x.clone(), cu_seqlens=cu, max_seqlen=40)
    assert torch.equal(got, flashtx.apply_rotary(x, *RotaryEmbedding(D, max_seq_len=L0, scaling=sc).to(DEVICE)
                                                 .cos_sin(12), cu_seqlens=cu))
    torch.testing.assert_close(rope.cos_sin(12)[0].cpu(), c12, rtol=0, atol=1e-6)
    cu10 = torch.tensor([0, 10, 13], dtype=torch.int32, device=DEVICE)
    rope(x[:13].clone(), cu_seqlens=cu10, max_seqlen=40)
    torch.testing.assert_close(rope.cos_sin(10)[0].cpu(), c12[:10], rtol=0, atol=1e-6)
    # per-sequence offsets: sequence i holds positions off[i] .. off[i] + len[i] - 1, so the length is
    # max(3 + 10, 5 + 2) = 13, not the longest sequence plus the largest offset (15)
    cu = torch.tensor([0, 3, 8], dtype=torch.int32, device=DEVICE)
    offs = torch.tensor([10, 2], dtype=torch.int32, device=DEVICE)
    x = randn(8, 2, D)
    rope = RotaryEmbedding(D, max_seq_len=L0, scaling=sc).to(DEVICE)
    got = rope(x.clone(), cu_seqlens=cu, max_seqlen=64, seqlen_offsets=offs)
    ref = RotaryEmbedding(D, max_seq_len=L0, scaling=sc).to(DEVICE).cos_sin(13)
    assert torch.equal(got, flashtx.apply_rotary(x, *ref, cu_seqlens=cu, seqlen_offsets=offs))


def test_dynamic_ntk_ignores_original_max_position_embeddings_as_transformers():
    """Audit t2: transformers' dynamic rule reads max_position_embeddings only (4.56 accepts an
    original_max_position_embeddings entry unused, 5.x warns it is unrecognized); flashtx used the entry as the
    original length, so the same dict scaled from another length. Now max_seq_len is the length, and a differing
    entry is named in a warning."""
    dim, sc = 8, {"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 8}
    with pytest.warns(UserWarning, match=r"dynamic scaling ignores original_max_position_embeddings \(8\), as "
                                         r"transformers does: the original length is max_seq_len \(16\); pass "
                                         r"max_seq_len=8"):
        rope = RotaryEmbedding(dim, max_seq_len=16, scaling=sc)
    assert rope.scaling["original_max_position_embeddings"] == 16
    ref_c, _ = plain_tables(rope.inv_freq, torch.arange(12))
    assert torch.equal(rope.cos_sin(12)[0], ref_c), "12 <= max_seq_len 16: no scaling (8 scaled it)"
    torch.testing.assert_close(rope.cos_sin(40)[0], ntk_tables(dim, 10000.0, 16, 2.0, 40)[0], rtol=0, atol=1e-6)


@pytest.mark.parametrize("kind", ["default", "linear", "dynamic"])
def test_partial_rotary_factor_is_refused_by_name(kind):
    """Audit t9: transformers 5's rope_parameters carry partial_rotary_factor (GPT-NeoX, Phi: rotary dim =
    int(head_dim * factor)); it was silently ignored, so dim=head_dim rotated every column. The module's dim is
    the rotary dim and it never sees the head dim: a factor other than 1 is refused, saying what to pass."""
    params = {"rope_type": kind, "rope_theta": 10000.0, "partial_rotary_factor": 0.25}
    if kind != "default":
        params["factor"] = 2.0
    with pytest.raises(ValueError, match=r"scaling's partial_rotary_factor is 0.25, .*pass "
                                         r"dim=int\(head_dim \* 0.25\) and drop partial_rotary_factor from the "
                                         r"dict \(or set it to 1.0\)"):
        RotaryEmbedding(32, scaling=params)
    rope = RotaryEmbedding(8, max_seq_len=16, scaling={**params, "partial_rotary_factor": 1.0})  # as advised
    assert torch.equal(rope.cos_sin(4)[0], RotaryEmbedding(8, max_seq_len=16, scaling={
        k: v for k, v in params.items() if k != "partial_rotary_factor"}).cos_sin(4)[0])


def test_tables_are_built_at_construction_and_follow_the_module():
    """The max_seq_len tables exist once the module does (a compiled first call reads them instead of building them
    in its graph, which compiled the step again on the next call); module casts keep them float32; a module built
    on the meta device and materialised (to_empty) gets real tables, equal to a fresh module's."""
    fresh = RotaryEmbedding(16, max_seq_len=40, scaling={"type": "linear", "factor": 2.0})
    key, length, cos, sin, _ = fresh._cache
    assert key == ("plain",) and length == 40 and cos.dtype == sin.dtype == torch.float32
    torch.testing.assert_close(cos, plain_tables(fresh._inv_freq32, torch.arange(40) / 2.0)[0], rtol=0, atol=0)
    fresh.half()
    assert fresh._cache[2] is cos and fresh._cache[2].dtype == torch.float32  # a dtype cast leaves them alone
    with torch.device("meta"):
        lazy = RotaryEmbedding(16, max_seq_len=40, scaling={"type": "linear", "factor": 2.0})
    assert lazy._cache is None  # no values on the meta device
    lazy.to_empty(device="cpu")
    assert lazy._cache[2].device.type == "cpu"
    torch.testing.assert_close(lazy.cos_sin(40), fresh.cos_sin(40), rtol=0, atol=0)


def test_reset_parameters_refills_inv_freq_from_any_mode():
    """reset_parameters() (FSDP's materialisation call) refills inv_freq and rebuilds the tables, also for a module
    made under inference mode and reset outside it (an in-place copy into an inference tensor would raise)."""
    want = RotaryEmbedding(8).to(DEVICE)
    with torch.inference_mode():
        rope = RotaryEmbedding(8).to(DEVICE)
    for r in (rope, RotaryEmbedding(8).to(DEVICE)):
        if not r.inv_freq.is_inference():
            with torch.no_grad():
                r.inv_freq.fill_(float("nan"))  # (as to_empty leaves it: no values)
        r.reset_parameters()
        assert torch.equal(r.inv_freq, want.inv_freq)
        x = randn(1, 5, 2, 8)
        torch.testing.assert_close(r(x.clone(), inplace=False), want(x.clone(), inplace=False), rtol=0, atol=0)
