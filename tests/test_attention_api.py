"""The attention API: validation errors, empty inputs, dispatch and fallback, torch.compile."""
import re

import pytest
import torch
from conftest import DEVICE, ON_GPU, PRECISE_DTYPE, precise_atol, randn, to_dtype

import flashtx
from flashtx import _dispatch, backends


def qkv(b=2, hq=4, hkv=4, sq=8, sk=8, d=16, dv=None, dtype=torch.float32, device=DEVICE):
    return (randn(b, hq, sq, d, dtype=dtype, device=device), randn(b, hkv, sk, d, dtype=dtype, device=device),
            randn(b, hkv, sk, dv or d, dtype=dtype, device=device))


# (id, callable producing the call, expected exception, regex the message must match)
ERROR_CASES = [
    ("not-a-tensor", lambda: flashtx.attention([1.0], *qkv()[1:]), TypeError, r"query must be a torch\.Tensor"),
    ("integer-dtype", lambda: flashtx.attention(torch.ones(1, 1, 4, 8, dtype=torch.int64, device=DEVICE),
                                                *qkv(1, 1, 1, 4, 4, 8)[1:]),
     TypeError, r"query has dtype torch\.int64; allowed: float16, bfloat16, float32"),
    ("flash-integer-key", lambda: flashtx.flash_attn_func(randn(1, 4, 2, 8), torch.ones(1, 4, 2, 8, dtype=torch.int32,
                                                                                       device=DEVICE),
                                                          randn(1, 4, 2, 8)),
     TypeError, r"k has dtype torch\.int32; allowed"),
    ("integer-value", lambda: flashtx.attention(*qkv()[:2], torch.ones(2, 4, 8, 16, dtype=torch.int32, device=DEVICE)),
     TypeError, r"value has dtype torch\.int32; allowed"),
    ("mixed-dtypes", lambda: flashtx.attention(qkv()[0].half(), *qkv()[1:]), TypeError,
     r"query, key, value must have one dtype; got torch\.float16, torch\.float32"),
    ("wrong-rank", lambda: flashtx.attention(qkv()[0][0], *qkv()[1:]), ValueError,
     r"same rank.*\(4, 8, 16\), \(2, 4, 8, 16\)"),
    ("rank-1", lambda: flashtx.attention(*(randn(8) for _ in range(3))), ValueError, r"at least 2"),
    ("flash-wrong-rank", lambda: flashtx.flash_attn_func(randn(8, 4, 16), randn(8, 4, 16), randn(8, 4, 16)),
     ValueError, r"q must be 4-D \(B, S, H, D\); got shape \(8, 4, 16\)"),
    ("mismatched-batch", lambda: flashtx.attention(qkv(b=2)[0], *qkv(b=3)[1:]), ValueError,
     r"leading \(batch\) dims"),
    ("flash-mismatched-batch", lambda: flashtx.flash_attn_func(randn(2, 8, 4, 16), randn(3, 8, 4, 16),
                                                               randn(3, 8, 4, 16)), ValueError, r"batch sizes differ"),
    ("head-dims-differ", lambda: flashtx.attention(qkv(d=16)[0], *qkv(d=32)[1:]), ValueError,
     r"query and key must have the same head dim"),
    ("kv-seq-differ", lambda: flashtx.attention(qkv()[0], qkv(sk=8)[1], qkv(sk=9)[2]), ValueError,
     r"key and value must have the same sequence length"),
    ("gqa-not-divisible", lambda: flashtx.attention(qkv(hq=6)[0], *qkv(hkv=4)[1:], enable_gqa=True), ValueError,
     r"number of query heads \(6\) must be a multiple of the number of key/value heads \(4\)"),
    ("gqa-without-flag", lambda: flashtx.attention(qkv(hq=8)[0], *qkv(hkv=2)[1:]), ValueError,
     r"enable_gqa=True"),
    ("flash-gqa-not-divisible", lambda: flashtx.flash_attn_func(randn(1, 8, 6, 16), randn(1, 8, 4, 16),
                                                                randn(1, 8, 4, 16)), ValueError, r"multiple"),
    ("scale-type", lambda: flashtx.attention(*qkv(), scale="0.1"), TypeError, r"scale must be None or a real"),
    ("scale-nan", lambda: flashtx.attention(*qkv(), scale=float("nan")), ValueError,
     r"scale must be 0 or have a magnitude in \[2\*\*-100, 2\*\*100\].*got nan"),
    # beyond float32's range the kernels' scale overflowed (NaN) or lost precision (issue 17.5)
    ("scale-huge", lambda: flashtx.attention(*qkv(), scale=1e39), ValueError, r"scale must be 0 or .*got 1e\+39"),
    ("scale-tiny", lambda: flashtx.flash_attn_func(*(t.transpose(1, 2) for t in qkv()), softmax_scale=1e-41),
     ValueError, r"softmax_scale must be 0 or .*got 1e-41"),
    ("softcap-huge", lambda: flashtx.attention(*qkv(), softcap=1e39), ValueError,
     r"softcap must be 0 \(off\) or a float in \[2\*\*-100, 2\*\*100\]; got 1e\+39"),
    ("bad-backend", lambda: flashtx.attention(*qkv(), backend="cudnn"), ValueError,
     r"backend must be None or one of \['reference', 'triton'\]; got 'cudnn'"),
    ("attn-mask-shape", lambda: flashtx.attention(*qkv(), attn_mask=torch.ones(3, 8, 8, dtype=torch.bool,
                                                                               device=DEVICE)),
     ValueError, r"attn_mask of shape \(3, 8, 8\) cannot broadcast to the attention scores' shape \(2, 4, 8, 8\).*"
                 r"query \(2, 4, 8, 16\) and key \(2, 4, 8, 16\)"),
    ("attn-mask-too-many-dims", lambda: flashtx.attention(*qkv(), attn_mask=torch.ones(1, 2, 4, 8, 8, device=DEVICE)),
     ValueError, r"attn_mask of shape \(1, 2, 4, 8, 8\) cannot broadcast"),
    ("attn-mask-dtype", lambda: flashtx.attention(*qkv(), attn_mask=torch.ones(8, 8, dtype=torch.int32,
                                                                               device=DEVICE)), TypeError,
     r"attn_mask must be a bool tensor \(True = attend\) or a float tensor.*got dtype torch.int32"),
    ("attn-mask-type", lambda: flashtx.attention(*qkv(), attn_mask=[[True]]), TypeError,
     r"attn_mask must be None or a bool/float tensor broadcastable to \(2, 4, 8, 8\); got list"),
    ("attn-bias-shape", lambda: flashtx.flash_attn_func(*(t.transpose(1, 2) for t in qkv()),
                                                        attn_bias=torch.zeros(2, 8, 4, 8, device=DEVICE)),
     ValueError, r"attn_bias of shape \(2, 8, 4, 8\) cannot broadcast to the attention scores' shape "
                 r"\(2, 4, 8, 8\)"),
    ("dropout-range", lambda: flashtx.attention(*qkv(), dropout_p=1.5), ValueError,
     r"dropout_p must be a float in \[0, 1\] \(or a 0-dim tensor of one\); got 1.5"),
    ("dropout-one-flash", lambda: flashtx.flash_attn_func(*(t.transpose(1, 2) for t in qkv()), dropout_p=1.0),
     ValueError, r"dropout_p must be a float in \[0, 1\); got 1.0"),  # flash-attn's range
    ("dropout-negative", lambda: flashtx.flash_attn_func(*(t.transpose(1, 2) for t in qkv()), dropout_p=-0.1),
     ValueError, r"dropout_p must be a float in \[0, 1\); got -0.1"),
    ("window", lambda: flashtx.flash_attn_func(*(t.transpose(1, 2) for t in qkv()), window_size=(4, -2)),
     ValueError, r"window_size must be a pair \(left, right\) of ints >= -1.*got \(4, -2\)"),
    ("softcap", lambda: flashtx.flash_attn_func(*(t.transpose(1, 2) for t in qkv()), softcap=-1.0),
     ValueError, r"softcap must be 0 \(off\) or a float in \[2\*\*-100, 2\*\*100\]; got -1.0"),
    ("alibi-dtype", lambda: flashtx.flash_attn_func(*(t.transpose(1, 2) for t in qkv()),
                                                    alibi_slopes=torch.ones(4, dtype=torch.float64, device=DEVICE)),
     TypeError, r"alibi_slopes must be float32 .*got torch.float64"),
    ("sparse-query", lambda: flashtx.attention(qkv()[0].to_sparse(), *qkv()[1:]), TypeError,
     r"query has layout torch.sparse_coo; allowed: torch.strided"),
    ("flash-sparse-k", lambda: flashtx.flash_attn_func(*(t.to_sparse() if i == 1 else t for i, t in enumerate(qkv()))),
     TypeError, r"k has layout torch.sparse_coo; allowed: torch.strided"),
    # truthy non-bools ran causal; SDPA raises a TypeError (audit of 2026-12-02, F9)
    ("is-causal-str", lambda: flashtx.attention(*qkv(), is_causal="no"), TypeError,
     r"is_causal must be a bool; got str 'no'"),
    ("is-causal-int", lambda: flashtx.attention(*qkv(), is_causal=1), TypeError, r"is_causal must be a bool; got int"),
    ("causal-none", lambda: flashtx.flash_attn_func(*(t.transpose(1, 2) for t in qkv()), causal=None), TypeError,
     r"causal must be a bool; got NoneType"),
    ("kvcache-causal", lambda: flashtx.flash_attn_with_kvcache(*(t.transpose(1, 2) for t in qkv()), causal="yes"),
     TypeError, r"causal must be a bool; got str"),
    ("alibi-shape", lambda: flashtx.attention(*qkv(), alibi_slopes=torch.ones(3, device=DEVICE)),
     ValueError, r"alibi_slopes must have shape \(nheads,\) = \(4,\) or \(batch, nheads\) = \(2, 4\); got \(3,\)"),
]


@pytest.mark.parametrize("make_call,exc,pattern", [c[1:] for c in ERROR_CASES], ids=[c[0] for c in ERROR_CASES])
def test_bad_input_gets_a_clear_error(make_call, exc, pattern):
    with pytest.raises(exc, match=pattern):
        make_call()


def test_one_key_value_head_broadcasts_without_enable_gqa():
    """SDPA broadcasts K/V with one head over every query head, enable_gqa or not: so does flashtx.attention (the
    same kernels as the MQA call, bit for bit), through its general path and a plain call's lane alike."""
    q, k, v = (randn(2, h, 7, 16, requires_grad=True) for h in (4, 1, 1))
    for kw in (dict(is_causal=True), dict(attn_mask=torch.rand(7, 7, device=DEVICE) > 0.3)):
        want = flashtx.attention(q, k, v, enable_gqa=True, **kw)
        got = flashtx.attention(q, k, v, **kw)
        torch.testing.assert_close(got, want, atol=0, rtol=0)
        g = torch.randn_like(got)
        for a, b in zip(torch.autograd.grad(got, (q, k, v), g), torch.autograd.grad(want, (q, k, v), g)):
            torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_mixed_devices_error():
    q, k, v = qkv(device="cpu")
    meta = torch.empty(k.shape, device="meta")
    with pytest.raises(ValueError, match=r"must be on one device; got cpu, meta, cpu"):
        flashtx.attention(q, meta, v)


@pytest.mark.parametrize("shape_q,shape_kv", [((0, 2, 8, 16), (0, 2, 8, 16)), ((2, 2, 0, 16), (2, 2, 8, 16)),
                                              ((2, 3, 2, 0, 16), (2, 3, 2, 8, 16)),
                                              ((2, 3, 0, 8, 16), (2, 3, 0, 8, 16)), ((2, 0, 8, 16), (2, 2, 8, 16))],
                         ids=["batch-0", "seqlen-q-0", "5d-seqlen-q-0", "5d-heads-0", "gqa-q-heads-0"])
@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_empty_inputs_return_empty_results(shape_q, shape_kv, backend):
    """Empty results, and zero K/V gradients, as SDPA (0 q heads over 2 K/V heads too: the reference backward summed
    a GQA group of 0 heads through view(..., -1), a RuntimeError)."""
    q = randn(*shape_q, requires_grad=True)
    k, v = randn(*shape_kv, requires_grad=True), randn(*shape_kv, requires_grad=True)
    out = flashtx.attention(q, k, v, is_causal=True, backend=backend, enable_gqa=True)
    assert out.shape == shape_q
    out.sum().backward()
    assert q.grad.shape == shape_q and (k.grad == 0).all() and (v.grad == 0).all()


@pytest.mark.parametrize("sq", [0, 5], ids=["seqlen-q-0", "seqlen-q-5"])
@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_no_keys_give_zero_output_as_sdpa(sq, backend):
    """Sk = 0: every row sees no key, so its output is 0 (as a fully masked row, and as SDPA returns)."""
    q = randn(2, 2, sq, 16, requires_grad=True)
    k, v = randn(2, 2, 0, 16, requires_grad=True), randn(2, 2, 0, 16, requires_grad=True)
    out = flashtx.attention(q, k, v, backend=backend)
    assert out.shape == (2, 2, sq, 16) and torch.equal(out, torch.zeros_like(out))
    assert torch.equal(out, torch.nn.functional.scaled_dot_product_attention(q, k, v))
    out.sum().backward()
    assert torch.equal(q.grad, torch.zeros_like(q)) and k.grad.shape == k.shape and v.grad.shape == v.shape


def test_unsupported_head_dim_falls_back_with_one_warning_listing_every_backend():
    q, k, v = qkv(d=320, sq=5, sk=5, dtype=torch.float32)
    _dispatch.clear_plans()
    with pytest.warns(UserWarning) as record:
        out = flashtx.attention(q, k, v)
        flashtx.attention(q, k, v)  # the same reasons warn only once
    msgs = [str(w.message) for w in record if "flashtx" in str(w.message)]
    assert len(msgs) == 1
    assert "`triton`: " in msgs[0] and "head dim 320 is above 256" in msgs[0]
    assert "`reference`: supported" in msgs[0] and "`cuda`" not in msgs[0]  # no stub backend in dispatch
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    assert torch.allclose(out, ref, atol=1e-5)


def test_requested_backend_that_cannot_run_raises_with_reasons():
    q, k, v = qkv(d=320, sq=5, sk=5)
    with pytest.raises(flashtx.BackendNotSupported, match=r"(?s)backend=.triton. cannot run.*head dim 320 is above 256"):
        flashtx.attention(q, k, v, backend="triton")


@pytest.mark.skipif(ON_GPU, reason="interpreter-only rule: bf16 is miscomputed by Triton's interpreter")
def test_bf16_in_the_interpreter_is_refused_not_miscomputed():
    q, k, v = qkv(dtype=torch.bfloat16)
    with pytest.raises(flashtx.BackendNotSupported, match=r"bfloat16 is miscomputed by Triton's interpreter"):
        flashtx.attention(q, k, v, backend="triton")
    _dispatch.clear_plans()
    with pytest.warns(UserWarning, match="bfloat16"):
        out = flashtx.attention(q, k, v)
    ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float())
    assert (out.float() - ref).abs().max() < 2e-2


def test_automatic_dispatch_uses_triton_here():
    q, k, v = qkv()
    inp = backends.AttentionInputs(q, k, v)
    assert backends.select_backend(inp) == "triton"
    assert backends.BACKENDS["triton"].not_supported_reasons(inp) == []


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_reference_and_triton_backends_agree(backend):
    torch.manual_seed(5)
    q, k, v = qkv(b=1, hq=4, hkv=2, sq=37, sk=53, d=24, dtype=torch.float64)
    for t in (q, k, v):
        t.requires_grad_(True)
    # the Triton kernels take float64 in the interpreter only: on a GPU they get float32 copies
    ins = to_dtype(PRECISE_DTYPE, q, k, v) if backend == "triton" and PRECISE_DTYPE != q.dtype else (q, k, v)
    out = flashtx.attention(*ins, is_causal=True, enable_gqa=True, backend=backend)
    grads = torch.autograd.grad(out.sum(), ins)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    ref_grads = torch.autograd.grad(ref.sum(), (q, k, v))
    atol = precise_atol(1e-12)
    assert torch.allclose(out.double(), ref, atol=atol)
    for g, r in zip(grads, ref_grads):
        assert torch.allclose(g.double(), r, atol=atol)


LAYOUTS = {  # (B, H, S, D) inputs of every memory order of (B, H, S), made from a (B, S, H, D)-shaped tensor
    "bhsd": lambda t: t.transpose(1, 2).contiguous(),  # transformers' q and k after its RoPE
    "bshd-views": lambda t: t.transpose(1, 2),  # nanoGPT's and transformers' projection views
    "hsbd": lambda t: t.permute(2, 1, 0, 3).contiguous().permute(2, 0, 1, 3),
}


@pytest.mark.parametrize("grad", [False, True], ids=["no-grad", "grad"])
@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_output_is_laid_out_as_sdpa_flash_lays_out_its_own(layout, backend, grad):
    """Whatever q's layout, out is a (B, Hq, Sq, Dv) view of a contiguous (B, Sq, Hq, Dv) tensor, as SDPA's flash
    kernel returns it: merging the heads (out.transpose(1, 2).reshape(B, Sq, -1), transformers' attention
    functions) copies nothing. Twice per case: the lanes replay a plan the first call made."""
    import flashtx.integrations.transformers as ftx

    for sq in (5, 1):  # 1: the decode route when nothing needs grad
        q, k, v = (LAYOUTS[layout](randn(2, s, h, 16)).requires_grad_(grad)
                   for s, h in ((sq, 4), (9, 2), (9, 2)))
        for _ in range(2):
            out = flashtx.attention(q, k, v, enable_gqa=True, backend=backend)
            assert out.shape == (2, 4, sq, 16) and out.transpose(1, 2).is_contiguous(), out.stride()
            want = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(),
                                                                    enable_gqa=True)
            assert torch.allclose(out.double(), want, atol=1e-5)
            if grad:
                gq, gk = torch.autograd.grad(out.sum(), (q, k))
                assert gq.stride() == q.stride() and gk.stride() == k.stride()  # gradients stay like their inputs
    seen = []

    def recording(*a, **kw):
        seen.append(real(*a, **kw))
        return seen[-1]

    q, k, v = (LAYOUTS[layout](randn(2, s, h, 16)) for s, h in ((5, 4), (9, 2), (9, 2)))  # Sq > 1: not contiguous
    real, ftx.attention = ftx.attention, recording  # either way when merged unless laid out (B, Sq, Hq, Dv)
    try:
        res, _ = ftx.flashtx_attention_forward(torch.nn.Module(), q, k, v, None, is_causal=True)
    finally:
        ftx.attention = real
    assert res.shape == (2, 5, 4, 16) and res.data_ptr() == seen[0].data_ptr()  # (B, Sq, Hq, Dv): no copy


def test_torch_compile_fullgraph_has_no_graph_breaks():
    """flashtx.attention is a custom op with a fake impl and autograd: dynamo traces through it."""
    import torch._dynamo

    def block(x, w):
        q, k, v = (x @ w).view(2, 9, 3, 2, 8).permute(2, 0, 3, 1, 4)  # 3 x (B, H, S, D)
        return flashtx.attention(q, k, v, is_causal=True).sum()

    x = randn(2, 9, 16, dtype=torch.float32)
    w = randn(16, 48, dtype=torch.float32, requires_grad=True)
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(block)(x, w)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    loss = compiled(x, w)
    (gw,) = torch.autograd.grad(loss, (w,))
    w2 = w.detach().clone().requires_grad_(True)
    eager = block(x, w2)
    (gw2,) = torch.autograd.grad(eager, (w2,))
    assert torch.allclose(loss, eager) and torch.allclose(gw, gw2)


def test_flash_attn_shell_defaults_match_flash_attn_semantics():
    """Default scale 1/sqrt(D), bottom-right causal; deterministic=True is accepted."""
    torch.manual_seed(6)
    q, k, v = (randn(1, s, 2, 16, dtype=torch.float64) for s in (5, 9, 9))
    out = flashtx.flash_attn_func(q, k, v, causal=True, deterministic=True)
    i = torch.arange(5, device=DEVICE)[:, None]
    j = torch.arange(9, device=DEVICE)[None, :]
    mask = j <= i + 4  # bottom-right: last query sees every key
    ref = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                           attn_mask=mask)
    assert torch.allclose(out, ref.transpose(1, 2), atol=1e-12 if DEVICE == "cpu" else 1e-5)


def test_public_functions_have_docstrings_with_shapes():
    for fn in (flashtx.attention, flashtx.flash_attn_func):
        doc = fn.__doc__ or ""
        assert re.search(r"\(B, S, H, D\)|\(\.\.\., H", doc) and "causal" in doc and "Example" in doc


def test_no_top_level_triton_kernels_module_is_installed(tmp_path):
    """triton_kernels/ is installed as flashtx.triton_kernels only (Triton ships its own top-level one)."""
    import os
    import subprocess
    import sys

    code = ("import importlib.util as u, flashtx.triton_kernels as t; s = u.find_spec('triton_kernels'); "
            "print(t.__file__); print(s.origin if s else None)")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    lines = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                           check=True).stdout.splitlines()
    ours = os.path.dirname(lines[0])
    assert lines[1] == "None" or not lines[1].startswith(ours), lines


def test_custom_ops_opcheck():
    """torch.library.opcheck: schema, fake impl, and autograd under AOTDispatcher (what torch.compile
    uses) agree with eager, for the forward (with a learned bias) and the backward op."""
    from flashtx._attention_op import attn_bwd, attn_fwd

    torch.manual_seed(21)
    q, k, v = (randn(1, 2, 9, 16, requires_grad=True) for _ in range(3))
    bias = randn(1, 2, 9, 9, requires_grad=True)
    aux, ints, floats = [None] * 8, [1, 0, -1, -1, 0, 0, 2, 0], [0.25, 0.0, 0.0]
    torch.library.opcheck(attn_fwd, (q, k, v, bias, aux, ints, floats, ""))
    out, m2, l2 = attn_fwd(q, k, v, bias, aux, ints, floats, "")
    d = [t.detach() for t in (q, k, v, out, m2, l2)]
    torch.library.opcheck(attn_bwd, (randn(*out.shape), *d, None, bias.detach(), aux, ints, floats, "", True))
    # (B, S, H, D) tensors (Ints.bshd, flash_attn_func's layout): out and the gradients come back in it
    qs, ks, vs = (t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v))
    ints = [1, 1, -1, -1, 0, 0, 2, 1]
    torch.library.opcheck(attn_fwd, (qs, ks, vs, bias, aux, ints, floats, ""))
    out, m2, l2 = attn_fwd(qs, ks, vs, bias, aux, ints, floats, "")
    assert out.shape == qs.shape and out.is_contiguous()
    d = [t.detach() for t in (qs, ks, vs, out, m2, l2)]
    torch.library.opcheck(attn_bwd, (randn(*out.shape), *d, None, bias.detach(), aux, ints, floats, "", True))


def test_tensor_subclass_inputs_compute_what_plain_tensors_do():
    """A tensor subclass without __torch_dispatch__ (a user's marker class) has data: every kernel launches on
    it and the results equal the plain tensors' (in the interpreter such launches used to be skipped as if
    traced, returning uninitialised memory)."""
    class Marked(torch.Tensor):
        pass

    q, k, v = (randn(1, 2, 9, 16) for _ in range(3))
    g, u = randn(5, 24), randn(5, 24)
    qm = q.clone().as_subclass(Marked).requires_grad_()
    qp = q.clone().requires_grad_()
    out_m, out_p = flashtx.attention(qm, k, v, is_causal=True), flashtx.attention(qp, k, v, is_causal=True)
    assert torch.equal(out_m.as_subclass(torch.Tensor), out_p)
    (gm,), (gp,) = torch.autograd.grad(out_m.sum(), qm), torch.autograd.grad(out_p.sum(), qp)
    assert torch.equal(gm.as_subclass(torch.Tensor), gp)
    assert torch.equal(flashtx.swiglu(g.as_subclass(Marked), u).as_subclass(torch.Tensor), flashtx.swiglu(g, u))


def test_autocast_casts_the_inputs_as_it_casts_sdpas():
    """Under torch.autocast (SDPA is on its lower-precision list) fp32 or mixed-dtype q/k/v run in the autocast
    dtype and give its output, as torch's SDPA does; gradients reach the fp32 leaves in fp32. flash_attn_func and
    the patched SDPA (which then runs flashtx, not torch's fallback) alike. (A transformers LLaMA under autocast
    promotes q and k to fp32 for RoPE while v stays half: that used to raise 'must have one dtype'.)"""
    import torch.nn.functional as F

    torch.manual_seed(0)
    q, k, v = (randn(1, 2, 9, 16, requires_grad=True) for _ in range(3))
    with torch.autocast(DEVICE, dtype=torch.float16):
        want = F.scaled_dot_product_attention(q, k, v.half(), is_causal=True)
        got = flashtx.attention(q, k, v.half(), is_causal=True)
        flash = flashtx.flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True)
        fell_back = []
        real = flashtx.sdpa_patch._ORIGINAL
        with flashtx.patch_sdpa(), pytest.MonkeyPatch.context() as m:
            m.setattr(flashtx.sdpa_patch, "_ORIGINAL", lambda *a, **kw: fell_back.append(1) or real(*a, **kw))
            patched = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert want.dtype == got.dtype == flash.dtype == patched.dtype == torch.float16 and fell_back == []
    for out in (got, flash.transpose(1, 2), patched):
        torch.testing.assert_close(out.float(), want.float(), atol=2e-3, rtol=2e-3)
    grads = torch.autograd.grad(got.float().sum(), (q, k, v))
    assert all(g.dtype == torch.float32 and torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("backend", ["reference", None], ids=["reference", "auto"])
def test_autocast_computes_as_the_explicit_cast_eager_and_compiled(backend):
    """Under torch.autocast a call computes exactly as on inputs cast to the autocast dtype, eagerly and compiled
    (fuzz, 2026-12-07: eagerly the reference backend's fp32 matmuls ran under the caller's autocast, in bf16, so eager
    and compiled differed by 1-2 bf16 ulps); the forward and the gradients, and flash_attn_with_kvcache's
    reference."""
    torch.manual_seed(0)
    dt = torch.bfloat16 if DEVICE == "cpu" else torch.float16
    q, k, v = (randn(2, 2, 7, 16, requires_grad=True) for _ in range(3))
    qe, ke, ve = (t.detach().to(dt).requires_grad_() for t in (q, k, v))

    def f(q, k, v):
        return flashtx.attention(q, k, v, is_causal=True, backend=backend)

    want = f(qe, ke, ve)
    want_grads = torch.autograd.grad(want.float().sum(), (qe, ke, ve))
    with torch.autocast(DEVICE, dtype=dt):
        got = f(q, k, v)
        compiled = torch.compile(f, backend="aot_eager", fullgraph=True)(q, k, v)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    torch.testing.assert_close(compiled, want, atol=0, rtol=0)
    for g, w in zip(torch.autograd.grad(got.float().sum(), (q, k, v)), want_grads):
        torch.testing.assert_close(g, w.float(), atol=0, rtol=0)
    kc, vc, qd = randn(2, 9, 2, 16), randn(2, 9, 2, 16), randn(2, 1, 2, 16)
    lens = torch.full((2,), 9, dtype=torch.int32, device=DEVICE)
    want_d = flashtx.flash_attn_with_kvcache(qd.to(dt), kc.to(dt), vc.to(dt), cache_seqlens=lens, backend="reference")
    with torch.autocast(DEVICE, dtype=dt):
        got_d = flashtx.flash_attn_with_kvcache(qd.to(dt), kc.to(dt), vc.to(dt), cache_seqlens=lens,
                                               backend="reference")
    torch.testing.assert_close(got_d, want_d, atol=0, rtol=0)


def test_autocast_leaves_float64_and_other_devices_alone():
    """As torch's autocast: float64 inputs are not cast, and tensors on a device autocast does not know (meta)
    pass through (the check used to raise 'unknown device type for autocast')."""
    q = randn(1, 2, 5, 16, dtype=torch.float64)
    with torch.autocast(DEVICE, dtype=torch.float16):
        assert flashtx.attention(q, q, q, backend="reference").dtype == torch.float64
        m = torch.empty(1, 2, 5, 16, device="meta")
        assert flashtx.functional._autocast("meta", m, m, m, None)[0] is m


@pytest.mark.parametrize("packed", [False, True], ids=["bhsd", "varlen"])
def test_outputs_too_wide_for_the_sdpa_layout_are_laid_out_as_q(packed, monkeypatch, fresh_plans):
    """Where (B, Sq, Hq, Dv) memory would span more than int32 offsets along the sequence (Sq * Hq * Dv > 2**31 - 1)
    while q's own layout does not, the output is laid out as q, so the call stays on the Triton kernels (it fell to
    the O(N^2) reference with a warning). INT32_MAX is lowered so a small call crosses it; the lanes and the op
    (ALiBi: the general path) agree; and the layouts the lanes replay stay right on the second call."""
    import warnings

    from flashtx import _attention_lane, _attention_op
    from flashtx.triton_kernels import limits

    low = 16 * 4 * 16 - 1  # Sq * Hq * Dv of the calls below, minus 1; q's own span (Sq * D) fits
    for mod in (_attention_op, _attention_lane, limits):
        monkeypatch.setattr(mod, "INT32_MAX", low)
    ref = backends.BACKENDS["reference"]
    calls = []
    monkeypatch.setattr(ref, "forward", lambda *a, **kw: calls.append(1) or type(ref).forward(ref, *a, **kw))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for alibi in (None, torch.rand(4, dtype=torch.float32, device=DEVICE)):
            for _ in range(2):
                if packed:  # (total, H, D) laid out (H, total, D)
                    q, k, v = (randn(4, 16, 16).transpose(0, 1) for _ in range(3))
                    cu = torch.tensor([0, 7, 16], dtype=torch.int32, device=DEVICE)
                    out = flashtx.flash_attn_varlen_func(q, k, v, cu, cu, 9, 9, alibi_slopes=alibi)
                    assert out.stride() == (16, 256, 1), out.stride()
                else:  # (B, H, S, D) contiguous
                    q, k, v = (randn(1, 4, 16, 16) for _ in range(3))
                    out = flashtx.attention(q, k, v, alibi_slopes=alibi)
                    assert out.stride() == q.stride(), out.stride()
    assert not calls and not [w for w in seen if "flashtx" in str(w.message)]  # no fallback, no warning


def test_varlen_output_is_contiguous_whatever_q_layout(fresh_plans):
    """flash_attn_varlen_func's out is (total, Hq, Dv) contiguous on the lane and on the op's path (ALiBi) alike,
    as the op lays it out (the lane copied q's memory order), and equals the reference."""
    cu = torch.tensor([0, 7, 16], dtype=torch.int32, device=DEVICE)
    q, k, v = (randn(4, 16, 16).transpose(0, 1) for _ in range(3))  # (total, H, D) laid out (H, total, D)
    for alibi in (None, torch.rand(4, dtype=torch.float32, device=DEVICE)):
        outs = [flashtx.flash_attn_varlen_func(q, k, v, cu, cu, 9, 9, alibi_slopes=alibi) for _ in range(2)]
        want = flashtx.flash_attn_varlen_func(q, k, v, cu, cu, 9, 9, alibi_slopes=alibi, backend="reference")
        for out in outs:
            assert out.is_contiguous(), out.stride()
            torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
