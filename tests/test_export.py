"""torch.export and torch.jit.trace (an audit of flashtx under PyTorch's deployment machinery).

Export traces the registered ops (as torch.compile does); these tests export with dynamic sizes, strict
(Dynamo) and non-strict (torch's default: the Python runs on fake tensors), and run the exported program at
other sizes against eager. What cannot be exported fails with an error that says why, before anything is
written: a KV cache's host-side state, torch.jit.trace.
"""
import copy
import json
import os
import subprocess
import sys
import warnings

import pytest
import torch
from conftest import DEVICE, randn
from torch.export import Dim, export

import flashtx
from flashtx.nn import MultiheadAttention, RotaryEmbedding, TransformerBlock
from flashtx.triton_kernels.limits import exporting

STRICT = [False, True]


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # export's deprecation and fake-tensor notices
        yield


class Call(torch.nn.Module):
    """fn(q, k, v) as a module (export matches dynamic_shapes to forward's parameters)."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, q, k, v):
        return self.fn(q, k, v)


class CachedStep(torch.nn.Module):
    def __init__(self, layer, cache):
        super().__init__()
        self.layer, self.cache = layer, cache

    def forward(self, x):
        return self.layer(x, cache=self.cache)


@pytest.mark.parametrize("strict", STRICT, ids=["nonstrict", "strict"])
def test_a_kv_cache_step_is_refused_and_the_cache_is_untouched(strict):
    """Non-strict export ran the step on the live cache (its length and a row written) and baked the rest in as
    constants: the exported steps were wrong by ~0.05, silently."""
    layer = MultiheadAttention(32, 2, 1, causal=True, rotary=RotaryEmbedding(16)).to(DEVICE).eval()
    cache = layer.new_cache(2, 32)
    with torch.no_grad():
        layer(randn(2, 5, 32), cache=cache)
    k, length = cache.k.clone(), cache.length.clone()
    with pytest.raises(Exception, match="torch.export cannot export a step with a KVCache"):
        export(CachedStep(layer, cache), (randn(2, 1, 32),), strict=strict)
    assert torch.equal(cache.length, length) and torch.equal(cache.k, k)


class KVStep(torch.nn.Module):
    """What the refusal recommends: flash_attn_with_kvcache on buffers, cache_seqlens an input."""

    def __init__(self, b, length, hkv, d):
        super().__init__()
        self.register_buffer("kc", torch.zeros(b, length, hkv, d, device=DEVICE))
        self.register_buffer("vc", torch.zeros(b, length, hkv, d, device=DEVICE))

    def forward(self, q, k, v, seqlens):
        return flashtx.flash_attn_with_kvcache(q, self.kc, self.vc, k, v, cache_seqlens=seqlens, causal=True)


@pytest.mark.parametrize("strict", STRICT, ids=["nonstrict", "strict"])
def test_flash_attn_with_kvcache_on_buffers_exports_its_writes(strict):
    B, L, Hkv, D = 2, 16, 1, 16
    steps = [(randn(B, 1, 2, D), randn(B, 1, Hkv, D), randn(B, 1, Hkv, D)) for _ in range(3)]
    seqlens = [torch.full((B,), i, dtype=torch.int32, device=DEVICE) for i in range(3)]
    ref = KVStep(B, L, Hkv, D)
    with torch.no_grad():
        want = [ref(*t, n) for t, n in zip(steps, seqlens)]
    ep = export(KVStep(B, L, Hkv, D), (*steps[0], seqlens[0]), strict=strict)
    assert set(ep.run_decompositions().graph_signature.buffers_to_mutate.values()) == {"kc", "vc"}
    m = ep.module()
    with torch.no_grad():
        got = [m(*t, n) for t, n in zip(steps, seqlens)]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=0, rtol=0)  # the same kernels: each step sees the earlier writes


@pytest.mark.parametrize("strict", STRICT, ids=["nonstrict", "strict"])
def test_rotary_attention_exports_with_a_dynamic_sequence(strict):
    """Non-strict export passes RotaryEmbedding.cos_sin a SymInt, which it refused as not an int."""
    torch.manual_seed(0)
    m = MultiheadAttention(32, 2, 1, causal=True, rotary=RotaryEmbedding(16)).to(DEVICE).eval()
    ep = export(m, (randn(2, 8, 32),), dynamic_shapes=({1: Dim("s", min=2, max=512)},), strict=strict)
    x = randn(2, 13, 32)
    with torch.no_grad():
        torch.testing.assert_close(ep.module()(x), m(x), atol=0, rtol=0)


def test_in_place_rope_size_test_guards_no_exported_length():
    """The training-only in-place RoPE compared the projection's size with 2**20 before asking whether anything
    traces: an export's dynamic length was cut where B*S*(Hq + 2 Hkv)*D reaches 2**20 (here S = 1024)."""
    blk = TransformerBlock(256, 4, 2, rotary=RotaryEmbedding(64), hidden_dim=512).to(DEVICE)  # 512 per token
    export(blk, (randn(2, 10, 256),), dynamic_shapes=({1: Dim("s", min=2, max=2048)},), strict=True)


@pytest.mark.parametrize("strict", STRICT, ids=["nonstrict", "strict"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("sq,sk", [(3, 8), (32, 8), (32, 40)])
def test_attention_exports_with_independent_dynamic_query_and_key_lengths(sq, sk, causal, strict):
    """The few-query decode route compared Sq with 16 and Sk with Sq: no example shape exported both
    dynamic."""
    m = Call(lambda q, k, v: flashtx.attention(q, k, v, is_causal=causal))
    dims = ({2: Dim("sq", min=2, max=64)}, {2: Dim("sk", min=2, max=512)}, {2: Dim("sk", min=2, max=512)})
    ep = export(m, (randn(2, 2, sq, 16), randn(2, 2, sk, 16), randn(2, 2, sk, 16)), dynamic_shapes=dims,
                strict=strict)
    for a, b in ((2, 9), (5, 3), (20, 20)):
        q, k, v = randn(2, 2, a, 16), randn(2, 2, b, 16), randn(2, 2, b, 16)
        torch.testing.assert_close(ep.module()(q, k, v), m(q, k, v), atol=2e-6, rtol=1e-5)


def test_unbounded_dims_get_exports_own_constraint_error():
    """flashtx's int32 limits bound a traced length: with an unbounded Dim export says so and suggests a bound
    (the span compared as S * 64 > 2**31 - 1 failed on torch's internal assertion over s <= 2147483647/64)."""
    m = Call(lambda q, k, v: flashtx.attention(q, k, v, is_causal=True))
    args = (randn(2, 4, 10, 16), randn(2, 4, 10, 16), randn(2, 4, 10, 16))
    with pytest.raises(torch._dynamo.exc.UserError, match="Constraints violated"):
        export(m, args, dynamic_shapes=({2: Dim("s")},) * 3)


def test_patched_sdpa_exports_with_a_dynamic_sequence():
    """The patch's early-out took min() over lengths and head dims: export tied the length to the head dim."""
    m = Call(lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))
    args = (randn(2, 2, 100, 64), randn(2, 2, 100, 64), randn(2, 2, 100, 64))
    with flashtx.patch_sdpa():
        ep = export(m, args, dynamic_shapes=({2: Dim("s", min=2, max=1024)},) * 3, strict=False)
    assert any("flashtx" in str(n.target) for n in ep.graph.nodes)
    q, k, v = randn(2, 2, 33, 64), randn(2, 2, 33, 64), randn(2, 2, 33, 64)
    torch.testing.assert_close(ep.module()(q, k, v), flashtx.attention(q, k, v, is_causal=True), atol=0, rtol=0)


def _traceable(op, backend):
    cos, sin = RotaryEmbedding(16).cos_sin(16, DEVICE)
    return {"attention": lambda t: flashtx.attention(t, t, t, is_causal=True, backend=backend),
            "rotary": lambda t: flashtx.apply_rotary(t, cos[:t.shape[1]], sin[:t.shape[1]], backend=backend),
            "swiglu": lambda t: flashtx.swiglu(t, t * 2, backend=backend)}[op]


@pytest.mark.parametrize("op", ["attention", "rotary", "swiglu"])
def test_jit_trace_of_the_kernels_is_refused_by_name(op):
    """torch.jit.trace would record no Triton launch (the interpreter failed on its traced sizes instead)."""
    with torch.no_grad(), pytest.raises(RuntimeError, match="torch.jit.trace cannot trace flashtx's kernels"):
        torch.jit.trace(_traceable(op, "triton"), (randn(2, 6, 2, 16),), check_trace=False)


@pytest.mark.parametrize("op", ["attention", "rotary", "swiglu"])
def test_jit_trace_of_the_reference_backend_still_traces(op):
    """The reference backend is aten ops, which TorchScript records (CPU users of torch.jit.trace: ONNX's
    legacy exporter, graph viewers, FLOP counters): the trace reruns at another size."""
    fn = _traceable(op, "reference")
    with torch.no_grad():
        traced = torch.jit.trace(fn, (randn(2, 6, 2, 16),), check_trace=False)
        x = randn(3, 9, 2, 16)
        torch.testing.assert_close(traced(x), fn(x), atol=0, rtol=0)


def test_transformers_model_exports_with_dynamic_batch_and_sequence():
    """attn_implementation="ftx" took int() of the mask function's traced sizes, pinning them."""
    transformers = pytest.importorskip("transformers")
    from flashtx.integrations.transformers import register

    register()
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2)
    m = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="ftx").to(DEVICE).eval()
    ref = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="sdpa")  # (from_config
    ref = ref.to(DEVICE).eval()  # sets the config's attention: m's would become sdpa's)
    ref.load_state_dict(m.state_dict())

    class Logits(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, ids, mask):
            return self.model(input_ids=ids, attention_mask=mask, use_cache=False).logits

    def batch(b, s, pad):
        ids = torch.randint(0, 64, (b, s), device=DEVICE)
        mask = torch.ones(b, s, dtype=torch.long, device=DEVICE)
        mask[0, :pad] = 0
        return ids, mask

    wrapped = Logits(m)
    with torch.no_grad():
        ep = export(wrapped, batch(2, 10, 0), dynamic_shapes=({0: Dim("b", min=1, max=16),
                                                               1: Dim("s", min=2, max=128)},) * 2)
        assert any("flashtx" in str(n.target) for n in ep.graph.nodes)
        for b, s, pad in ((3, 17, 0), (3, 17, 4), (1, 5, 2)):
            ids, mask = batch(b, s, pad)
            keep = mask.bool()
            torch.testing.assert_close(ep.module()(ids, mask)[keep], Logits(ref)(ids, mask)[keep],
                                       atol=2e-5, rtol=1e-5)


def test_gpu_path_exports_a_dynamic_length():
    """On a GPU the ops' bodies plan while export traces them (stand-ins: flashtx.testing_gpu_trace): RoPE's and
    SwiGLU's row-count tiles (pow2_bucket) guarded a dynamic length to one power-of-two bucket, so no Dim in
    [2, 4096] exported RoPE, SwiGLU or a TransformerBlock. Under export the tile is the largest, for every length."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "FLASHTX_INTERPRET")}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run([sys.executable, "-m", "flashtx.testing_gpu_trace", "--export"], capture_output=True,
                          text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout)
    want = {"rope": ["flashtx.rotary_qk.default"], "swiglu": ["flashtx.swiglu_packed.default"],
            "flash_attn_func": ["flashtx.attn_fwd.default"],
            "transformer-block": ["flashtx.attn_fwd.default", "flashtx.rotary_qk.default",
                                  "flashtx.swiglu_packed.default"]}
    for name, ops in want.items():
        for s in (8, 200):
            got = results[f"{name}/S={s}"]
            assert got.get("ops") == ops, (name, s, got.get("error", got)[:600] if "error" in got else got)


class _Branch(torch.nn.Module):
    def forward(self, x):
        return x + 1 if exporting() else x - 1


@pytest.mark.parametrize("how", ["eager", "compile", "nonstrict", "strict"])
def test_exporting_is_true_only_under_export(how):
    """limits.exporting(): False in eager and under torch.compile, True under strict and non-strict export. torch
    2.11's Dynamo folds torch.compiler.is_exporting() to True in every trace (pytorch/pytorch#176347), so there a
    compiled few-query call took the training forward, a compiled flashtx.nn cache step raised export's refusal
    and RoPE/SwiGLU took their largest row tile."""
    x = torch.zeros(2)
    if how == "eager":
        out = _Branch()(x)
    elif how == "compile":
        torch._dynamo.reset()
        out = torch.compile(_Branch(), fullgraph=True, backend="eager")(x)
    else:
        out = export(_Branch(), (x,), strict=how == "strict").module()(x)
    assert torch.equal(out, x + (1 if how in ("nonstrict", "strict") else -1))


def test_flashtx_asks_export_through_limits_exporting():
    """No flashtx module calls torch.compiler.is_exporting() itself (see the test above: the suite's torch may not
    show why), only triton_kernels/limits.py's exporting()."""
    import flashtx.triton_kernels as kernels
    from flashtx.triton_kernels import limits

    callers, seen = [], 0
    for root in (os.path.dirname(flashtx.__file__), os.path.dirname(kernels.__file__)):  # (installed apart)
        for d, _, files in os.walk(root):
            for path in (os.path.join(d, f) for f in files if f.endswith(".py")):
                seen += 1
                with open(path) as fh:
                    if "is_exporting(" in fh.read() and not os.path.samefile(path, limits.__file__):
                        callers.append(path)
    assert seen > 50 and callers == [], callers
