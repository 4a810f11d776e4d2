"""Trace flashtx under torch.compile as a GPU run would, on a machine without one (for the tests).

On a GPU, torch.compile(fullgraph=True) traces the functional layer with Dynamo, then AOTAutograd
and Inductor trace the body of each flashtx op (a torch.library.triton_op) and record its
`wrap_triton` launches as kernel nodes. Triton's interpreter cannot take part in that trace, so
the CPU test suite keeps the ops opaque; this module instead runs the GPU path itself with three
stand-ins, in a process where TRITON_INTERPRET is off:

- the dispatch takes the Triton backend for CPU tensors (as it does for CUDA tensors),
- config selection sees an RTX 3090 (sm_86) instead of the interpreter's tiles, and patch_sdpa
  checks CPU calls as it checks CUDA ones,
- Triton's driver reports an sm_86 target, so torch can lower the kernels to TTIR (no GPU needed).

Nothing is executed: the compiled graphs are captured, and stand-in outputs of the right
metadata let the backward be traced too. Prints JSON: for each case, the Triton kernels in each
captured graph (forward, then backward) and its scatter ops (what functionalization adds when a kernel
writes through a view of a tensor: a copy of the whole base), or the error (a graph break raises under
fullgraph=True).

    python -m flashtx.testing_gpu_trace [--dynamic] [--tma] [CASE ...]
    python -m flashtx.testing_gpu_trace --growing   # a compiled decode loop over growing K/V: graphs compiled
    python -m flashtx.testing_gpu_trace --packed    # a compiled training step over packed batches of changing sizes
    python -m flashtx.testing_gpu_trace --varying   # query / row counts that change every step (speculative
                                                    # decoding): graphs compiled
    python -m flashtx.testing_gpu_trace --export    # torch.export with a dynamic sequence Dim

--tma: the attention kernels' configs are TMA tiles (streamed tiles read through tensor descriptors, as
sm_90's tuning candidates), so the trace covers the descriptor-making kernels.
"""
from __future__ import annotations

import itertools
import json
import os
import sys

from flashtx._env import triton_interpret

if triton_interpret():
    sys.exit("run without TRITON_INTERPRET: this traces the GPU path, not the interpreter's")


def _install_standins() -> None:
    import triton
    from triton.backends.compiler import GPUTarget

    from flashtx import _env
    from flashtx.triton_kernels import configs, launch

    class Sm86Driver:  # torch's TTIR analysis asks the active driver for its target, nothing more
        def get_current_target(self):
            return GPUTarget("cuda", 86, 32)

    triton.runtime.driver.set_active(Sm86Driver())
    _env.INTERPRET = True  # dispatch: CPU tensors take the Triton backend, as CUDA tensors do
    from flashtx import sdpa_patch
    sdpa_patch._GPU = "cpu"  # patch_sdpa's per-kind check runs for CPU calls, as it does for CUDA ones
    sm86 = configs.KNOWN_TARGETS[86]
    for mod in list(sys.modules.values()):  # every launcher's imported target_for
        if getattr(mod, "__name__", "").startswith("flashtx.triton_kernels") and hasattr(mod, "target_for"):
            mod.target_for = lambda t: sm86
    launch.target_for = lambda t: sm86


def _standin(gm):
    """A compiled function for graph gm that runs nothing: outputs of the right metadata (sizes of a dynamic-shape
    trace at its example inputs')."""
    import torch
    from functorch.compile import make_boxed_func

    outs = next(n for n in gm.graph.nodes if n.op == "output").args[0]

    def concrete(sizes):
        return [_hint(s) if isinstance(s, torch.SymInt) else s for s in sizes]

    def standin(*a):
        res = []
        for o in outs:
            val = getattr(o, "meta", {}).get("val") if o is not None else None
            if isinstance(val, torch.Tensor):
                res.append(torch.empty_strided(concrete(val.shape), concrete(val.stride()), dtype=val.dtype))
            else:  # a size saved for the backward (dynamic shapes), or nothing
                res.append(_hint(val) if isinstance(val, (torch.SymInt, torch.SymBool)) else
                           val if isinstance(val, int) else None)  # (a SymBool: torch 2.11 saves size checks)
        return res
    return make_boxed_func(standin)


def _hint(s):
    """A traced size's (SymInt) or size condition's (SymBool) value at the example inputs; one read on the device
    (unbacked: no value when tracing) takes 64 per unknown (nothing runs: only shapes flow between the stand-ins)."""
    import torch
    cast = bool if isinstance(s, torch.SymBool) else int
    if s.node.hint is not None:
        return cast(s.node.hint)
    e = s.node.expr
    return cast(e.xreplace({x: _known_values(s).get(x, 64) for x in e.free_symbols}))


def _known_values(s) -> dict:
    env = s.node.shape_env  # backed symbols' values at the example inputs (var_to_val before torch 2.12)
    return env.backed_var_to_val if hasattr(env, "backed_var_to_val") else env.var_to_val


def _capture(fn, args, backward: bool, dynamic: bool = False) -> dict:
    import torch
    import torch._dynamo
    from torch._dynamo.backends.common import aot_autograd
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

    graphs = []

    def compiler(gm, example_inputs):
        graphs.append(gm)
        return _standin(gm)

    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, dynamic=dynamic or None,
                             backend=aot_autograd(fw_compiler=compiler, bw_compiler=compiler))
    out = compiled(*args)
    if backward:
        out.backward()
    kernels, scatters, written, tma, bool_views, mask_strides = [], [], {}, set(), 0, []
    for gm in graphs:
        names, copied = [], []
        for n in gm.graph.nodes:
            if "triton_kernel_wrapper" in str(n.target) or "TritonKernelWrapper" in type(n.target).__name__:
                k = kernel_side_table.get_kernel(n.kwargs["kernel_idx"])
                names.append(_kernel_name(k))
                # the arguments torch's analysis of the kernel's TTIR takes as written (functionalised: cloned)
                written.setdefault(names[-1], set()).update(n.kwargs.get("tensors_to_clone", ()))
                const = {**n.kwargs.get("kwargs", {}),
                         **kernel_side_table.get_constant_args(n.kwargs["constant_args_idx"])}
                if const.get("TMA") is True:
                    tma.add(names[-1])  # reads through tensor descriptors
                bad = _mask_strides({**n.kwargs.get("kwargs", {}), **const})
                if bad:
                    mask_strides.append(f"{names[-1]}: {bad}")
            elif "scatter" in str(n.target):  # a kernel that wrote through a view: copied back over its base
                copied.append(str(n.target))
            elif n.target is torch.ops.aten.view.dtype and getattr(_val(n.args[0]), "dtype", None) is torch.bool:
                bool_views += 1  # Inductor of torch 2.11 cannot lower it (2026-12-06, an H100: a LoweringException)
        kernels.append(names)
        scatters.append(copied)
    return {"kernels": kernels, "scatters": scatters,  # fullgraph=True: a graph break would have raised
            "written": {k: sorted(v) for k, v in written.items()}, "tma": sorted(tma), "bool_views": bool_views,
            "mask_strides": mask_strides}


def _mask_strides(kw: dict) -> str:
    """'' when a launch's attention mask (MB) strides are those of the tensor it passes (0 on size-1 dims), else
    what differs. A static trace's strides only (symbolic ones are skipped)."""
    val = _val(kw.get("MB"))
    names = ("stride_mb", "stride_mh", "stride_mm", "stride_mn")
    if val is None or val.dim() != 4 or not all(isinstance(kw.get(k), int) for k in names):
        return ""
    want = tuple(0 if n == 1 else st for n, st in zip(val.shape, val.stride()))
    got = tuple(kw[k] for k in names)
    try:
        return "" if tuple(int(w) for w in want) == got else f"mask strides {got}, the tensor's {want}"
    except TypeError:  # symbolic sizes (--dynamic)
        return ""


def _val(node):
    """A graph node's example value (None for a constant or a node without one)."""
    return getattr(node, "meta", {}).get("val")


def _kernel_name(k) -> str:
    return getattr(k, "__name__", None) or getattr(getattr(k, "fn", None), "__name__", "?")


# plain; padded: transformers' padded batches, a key mask and the bottom-right causal mask as a top-left window
# (-1, Sk - Sq); top-left-window: a fixed top-left bound (20, -1), which the decode kernels' would move with Sk
GROWING = ("plain", "padded", "top-left-window")


def growing_cache(dynamic, case: str = "plain") -> dict:
    """A compiled decode loop whose K/V grow by one token a step (transformers' DynamicCache), torch.compile's
    dynamic=`dynamic` (None: automatic), with the arguments of `case` (GROWING): how many graphs it compiled over 8
    steps, and each graph's kernels."""
    import torch
    import torch._dynamo
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

    import flashtx

    graphs = []

    def compiler(gm, example_inputs):
        graphs.append([_kernel_name(kernel_side_table.get_kernel(n.kwargs["kernel_idx"]))
                       for n in gm.graph.nodes if "triton_kernel_wrapper" in str(n.target)])
        outs = next(n for n in gm.graph.nodes if n.op == "output").args[0]

        def standin(*a):  # nothing runs here: outputs of the right metadata
            vals = [getattr(o, "meta", {}).get("val") for o in outs]
            return [torch.empty([int(s.node.hint) if isinstance(s, torch.SymInt) else s for s in v.shape],
                                dtype=v.dtype) if isinstance(v, torch.Tensor) else None for v in vals]
        return make_boxed_func(standin)

    torch._dynamo.reset()
    def attend(q, k, v, key_mask):  # (B, H, S, D); the window from the shapes, as transformers computes it
        if case == "plain":
            return flashtx.attention(q, k, v, enable_gqa=True)
        if case == "padded":
            return flashtx.attention(q, k, v, enable_gqa=True, window_size=(-1, k.shape[2] - q.shape[2]),
                                     key_mask=key_mask)
        return flashtx.attention(q, k, v, enable_gqa=True, window_size=(20, -1))

    step = torch.compile(attend, fullgraph=True, dynamic=dynamic, backend=aot_autograd(fw_compiler=compiler))
    q = torch.randn(2, 8, 1, 64, dtype=torch.float16)
    with torch.no_grad():
        for sk in range(100, 108):
            k, v = (torch.randn(2, 2, sk, 64, dtype=torch.float16) for _ in range(2))
            step(q, k, v, torch.ones(2, sk, dtype=torch.bool))
    return {"graphs": graphs}


# speculative decoding's query counts (and decode batches' row counts), one per step: none may cost a graph of its own
VARYING = ("kvcache", "attention", "rope-swiglu")
VARYING_COUNTS = (1, 1, 2, 3, 4, 5, 6, 7, 8, 3)


def varying_counts(dynamic, case: str = "kvcache") -> dict:
    """A compiled step whose query (or row) count changes every step as VARYING_COUNTS, without grad: speculative
    decoding through flash_attn_with_kvcache, flashtx.attention over K/V grown by the count (the small-query
    kernels), or RoPE and SwiGLU over that many tokens; torch.compile's dynamic=`dynamic` (None: automatic): the
    graphs it compiled, each a list of its kernels. (Until 2026-12-06 the decode tiles int()-ed the count, and
    RoPE's and SwiGLU's guarded one bucket per power of two: a graph per count, then fullgraph's recompile limit.)"""
    import torch
    import torch._dynamo
    from torch._dynamo.backends.common import aot_autograd
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

    import flashtx

    graphs = []

    def compiler(gm, example_inputs):
        graphs.append([_kernel_name(kernel_side_table.get_kernel(n.kwargs["kernel_idx"]))
                       for n in gm.graph.nodes if "triton_kernel_wrapper" in str(n.target)])
        return _standin(gm)

    torch._dynamo.reset()
    h = lambda *shape: torch.randn(*shape, dtype=torch.float16)  # noqa: E731
    kc, vc, cos = h(2, 256, 2, 64), h(2, 256, 2, 64), torch.rand(256, 32)

    def kvcache(q, k, v, seqlens):  # (B, n, H, D) new tokens appended at seqlens, attending causally
        return flashtx.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=seqlens, causal=True)

    def rope_swiglu(q, k, x):
        return (*flashtx.apply_rotary_qk(q, k, cos, cos), flashtx.swiglu_packed(x))

    fn = {"kvcache": kvcache, "rope-swiglu": rope_swiglu,
          "attention": lambda q, k, v: flashtx.attention(q, k, v, enable_gqa=True)}[case]
    step = torch.compile(fn, fullgraph=True, dynamic=dynamic, backend=aot_autograd(fw_compiler=compiler))
    t = 20
    with torch.no_grad():
        for n in VARYING_COUNTS:
            if case == "kvcache":
                step(h(2, n, 8, 64), h(2, n, 2, 64), h(2, n, 2, 64), torch.full((2,), t, dtype=torch.int32))
            elif case == "attention":
                step(h(2, 8, n, 64), h(2, 2, t + n, 64), h(2, 2, t + n, 64))
            else:
                step(h(1, n, 4, 64), h(1, n, 2, 64), h(n, 1024))
            t += n
    return {"graphs": graphs}


PACKED = ("attention", "rope")  # flash_attn_varlen_func's training step; varlen RoPE's


def packed_batches(dynamic, case: str = "attention") -> dict:
    """A compiled training step over packed (varlen) batches whose total tokens, sequence count and max_seqlen
    change every step (as a packing data loader's do), torch.compile's dynamic=`dynamic` (None: automatic), for
    `case` (PACKED): the forward and backward graphs it compiled over 6 steps, each a list of its kernels."""
    import torch
    import torch._dynamo
    from torch._dynamo.backends.common import aot_autograd
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

    import flashtx

    graphs = {"forward": [], "backward": []}

    def compiler(kind):
        def compile_(gm, example_inputs):
            graphs[kind].append([_kernel_name(kernel_side_table.get_kernel(n.kwargs["kernel_idx"]))
                                 for n in gm.graph.nodes if "triton_kernel_wrapper" in str(n.target)])
            return _standin(gm)
        return compile_

    torch._dynamo.reset()

    def train(q, k, v, cos, cu, max_seqlen):  # q, k, v (total, H, D); cu (nseq + 1,)
        if case == "rope":
            return flashtx.apply_rotary(q, cos, cos, cu_seqlens=cu, max_seqlen=max_seqlen)
        return flashtx.flash_attn_varlen_func(q, k, v, cu, cu, max_seqlen, max_seqlen, causal=True)

    step = torch.compile(train, fullgraph=True, dynamic=dynamic,
                         backend=aot_autograd(fw_compiler=compiler("forward"), bw_compiler=compiler("backward")))
    cos = torch.rand(512, 16)
    for lens in ((100, 37), (90, 60, 11), (200,), (33, 44, 55, 66), (120, 7), (70, 70, 70)):
        cu = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32)
        q, k, v = (torch.randn(cu[-1].item(), 4, 32, dtype=torch.float16, requires_grad=True) for _ in range(3))
        step(q, k, v, cos, cu, max(lens))  # (the backward graph is compiled with the forward's, unrun here)
    return graphs


def _hf_llama():
    """A two-layer fp16 LlamaForCausalLM on flashtx (attention, RoPE, SwiGLU); None without transformers."""
    try:
        import transformers
    except ImportError:
        return None
    import torch

    from flashtx.integrations import transformers as ftx

    ftx.register()
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   pad_token_id=0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=ftx.NAME).to(torch.float16)
    return ftx.apply_flashtx(model)


def cases() -> dict:
    """name -> (function, inputs, backward?)."""
    import torch

    import flashtx
    from flashtx.nn import RotaryEmbedding, TransformerBlock

    torch.manual_seed(0)

    def qkv(*shape, dtype=torch.float16):
        return [torch.randn(*shape, dtype=dtype, requires_grad=True) for _ in range(3)]

    def sdpa_causal(q, k, v):
        return flashtx.attention(q, k, v, is_causal=True).float().sum()

    def flash_gqa(q, k, v):
        return flashtx.flash_attn_func(q, k[:, :, :2], v[:, :, :2], causal=True).float().sum()

    def masks(q, k, v, key_mask, bias):
        return flashtx.attention(q, k, v, attn_mask=bias, key_mask=key_mask, window_size=(16, 0),
                                 softcap=30.0, is_causal=True).float().sum()

    def bool_mask(q, k, v, mask):  # a bool attn_mask (True = attend) that is a view: expanded or sliced
        return flashtx.attention(q, k, v, attn_mask=mask).float().sum()

    def patched(q, k, v):
        with flashtx.patch_sdpa():
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).float().sum()

    block = TransformerBlock(64, 4, 2, hidden_dim=96, rotary=RotaryEmbedding(16)).to(torch.float16)

    def block_step(x):
        return block(x).float().sum()

    def decode(q, k_new, v_new, k_cache, v_cache, seqlens, block_table=None):  # one generation step, appending
        return flashtx.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens,
                                               block_table=block_table, causal=True).float().sum()

    def attention_decode(q, k, v, key_mask=None):  # one query over a cache, no grad: the decode kernels
        with torch.no_grad():  # (flashtx._small_q); with a key mask, transformers' padded batch (window: causal)
            window = (-1, k.shape[2] - q.shape[2]) if key_mask is not None else (-1, -1)
            return flashtx.attention(q, k, v, enable_gqa=True, key_mask=key_mask, window_size=window).float().sum()

    def attention_decode_static(q, k, v, mask):  # a static cache's step: a (B, 1, 1, max_len) bool attn_mask
        with torch.no_grad():
            return flashtx.attention(q, k, v, attn_mask=mask, enable_gqa=True).float().sum()

    def varlen(q, k, v, cu):  # packed sequences (lengths 40 + 24) with a tensor cu_seqlens
        return flashtx.flash_attn_varlen_func(q, k, v, cu, cu, 40, 40, causal=True).float().sum()

    def dropout(q, k, v):  # the Philox seed drawn from torch's generator, the mask regenerated in the backward
        return flashtx.attention(q, k, v, dropout_p=0.1, is_causal=True).float().sum()

    def probs(q, k, v):
        out, lse, p = flashtx.flash_attn_func(q, k, v, dropout_p=0.1, causal=True, return_attn_probs=True)  # (p: None
        # without dropout, as flash-attn's)
        return out.float().sum() + lse.sum() + p.float().sum()

    cos, sin = (torch.randn(64, 8) for _ in range(2))

    def rope_varlen(x, cu):
        return flashtx.apply_rotary(x, cos, sin, cu_seqlens=cu, max_seqlen=40).float().sum()

    def swiglu_packed(x):
        return flashtx.swiglu_packed(x).float().sum()

    hf = _hf_llama()

    def hf_llama(ids, mask):  # attn_implementation="ftx" plus apply_flashtx's RoPE and SwiGLU, left padding
        return hf(input_ids=ids, attention_mask=mask, labels=ids).loss

    left_padded = torch.ones(2, 32, dtype=torch.long)
    left_padded[1, :5] = 0

    left_pad = torch.ones(2, 100, dtype=torch.bool)  # (B, Sk): sequence 1 left-padded by 9
    left_pad[1, :9] = False
    key_mask = torch.ones(2, 64, dtype=torch.bool)
    key_mask[1, 50:] = False
    bias = torch.randn(1, 4, 64, 64, dtype=torch.float16, requires_grad=True)
    return {
        "attention-causal": (sdpa_causal, qkv(2, 4, 64, 64), True),
        "flash-gqa": (flash_gqa, qkv(2, 64, 4, 64), True),
        "masks-bias-softcap": (masks, [*qkv(2, 4, 64, 64), key_mask, bias], True),
        "patch-sdpa": (patched, qkv(2, 4, 64, 64), True),
        # transformers' padding mask (B, 1, 1, Sk) expanded over the queries, and a slice of a longer mask: the
        # kernels' mask strides must be those of the bytes they are given (a bool mask is converted while tracing)
        "bool-mask-expanded": (bool_mask, [*qkv(2, 4, 64, 64), key_mask[:, None, None].expand(2, 1, 64, 64)], True),
        "bool-mask-sliced": (bool_mask, [*qkv(2, 4, 64, 64), (torch.rand(2, 4, 64, 80) < 0.9)[..., 8:72]], True),
        "transformer-block": (block_step, [torch.randn(2, 64, 64, dtype=torch.float16, requires_grad=True)], True),
        "decode": (decode, [torch.randn(2, 1, 8, 64, dtype=torch.float16),
                            *(torch.randn(2, 1, 2, 64, dtype=torch.float16) for _ in range(2)),
                            *(torch.randn(2, 256, 2, 64, dtype=torch.float16) for _ in range(2)),
                            torch.tensor([100, 37], dtype=torch.int32)], False),
        "decode-paged": (decode, [torch.randn(2, 1, 8, 64, dtype=torch.float16),
                                  *(torch.randn(2, 1, 2, 64, dtype=torch.float16) for _ in range(2)),
                                  *(torch.randn(8, 64, 2, 64, dtype=torch.float16) for _ in range(2)),
                                  torch.tensor([100, 37], dtype=torch.int32),
                                  torch.arange(8, dtype=torch.int32).view(2, 4)], False),  # pages of 64
        **({} if hf is None else {"hf-llama": (hf_llama, [torch.randint(3, 64, (2, 32)), left_padded], True)}),
        "attention-decode": (attention_decode, [torch.randn(2, 8, 1, 64, dtype=torch.float16),
                                                *(torch.randn(2, 2, 100, 64, dtype=torch.float16) for _ in range(2))],
                             False),
        "attention-decode-padded": (attention_decode, [torch.randn(2, 8, 1, 64, dtype=torch.float16),
                                                       *(torch.randn(2, 2, 100, 64, dtype=torch.float16)
                                                         for _ in range(2)), left_pad], False),
        "attention-decode-static": (attention_decode_static, [torch.randn(2, 8, 1, 64, dtype=torch.float16),
                                                              *(torch.randn(2, 2, 100, 64, dtype=torch.float16)
                                                                for _ in range(2)), left_pad[:, None, None]], False),
        # 4 queries with a mask row each (a static cache's step with 4 new tokens, a speculative tree), q laid out
        # (B, Sq, H, D) as transformers' views
        "attention-decode-tree": (attention_decode_static,
                                  [torch.randn(2, 4, 8, 64, dtype=torch.float16).transpose(1, 2),
                                   *(torch.randn(2, 2, 100, 64, dtype=torch.float16) for _ in range(2)),
                                   torch.rand(2, 1, 4, 100) < 0.8], False),
        "varlen": (varlen, [*qkv(64, 4, 64), torch.tensor([0, 40, 64], dtype=torch.int32)], True),
        "dropout": (dropout, qkv(2, 4, 64, 64), True),
        "attn-probs": (probs, qkv(2, 64, 4, 64), True),
        "rope-varlen": (rope_varlen, [torch.randn(64, 4, 16, dtype=torch.float16, requires_grad=True),
                                      torch.tensor([0, 40, 64], dtype=torch.int32)], True),
        "swiglu-packed": (swiglu_packed, [torch.randn(2, 64, 96, dtype=torch.float16, requires_grad=True)], True),
    }


def _per_mode(study, names) -> dict:
    """study(dynamic, case) for each case in names, with automatic (None) and dynamic (True) shapes; an exception
    is reported as the case's error."""
    out = {}
    for case in names:
        for mode, dyn in (("automatic", None), ("dynamic", True)):
            try:
                out[f"{case}/{mode}"] = study(dyn, case)
            except Exception as exc:
                out[f"{case}/{mode}"] = {"error": f"{type(exc).__name__}: {exc}"[:3000]}
    return out


def exports() -> dict:
    """torch.export (strict) with a dynamic sequence Dim in [2, 4096] of RoPE, SwiGLU, flash_attn_func and a
    TransformerBlock (max_seq_len 4096) on the GPU path (the ops' bodies plan on fake tensors, as a GPU export
    does), from a short and a long example: for each, the flashtx ops in the exported graph, or the error (a tile
    chosen by length guarded the Dim to one bucket)."""
    import torch
    from torch.export import Dim, export

    import flashtx

    h = lambda *s: torch.randn(*s, dtype=torch.float16)  # noqa: E731
    cos = torch.rand(4096, 32)

    class Call(torch.nn.Module):
        def __init__(self, fn):
            super().__init__()
            self.fn = fn

        def forward(self, *args):
            return self.fn(*args)

    blk = flashtx.nn.TransformerBlock(256, 4, 2, rotary=flashtx.nn.RotaryEmbedding(64, max_seq_len=4096),
                                      hidden_dim=512).half().eval()
    studies = {"rope": (Call(lambda q, k: flashtx.apply_rotary_qk(q, k, cos, cos)),
                        lambda s: (h(2, s, 4, 64), h(2, s, 2, 64))),
               "swiglu": (Call(flashtx.swiglu_packed), lambda s: (h(2, s, 1024),)),
               "flash_attn_func": (Call(lambda q, k, v: flashtx.flash_attn_func(q, k, v, causal=True)),
                                   lambda s: (h(2, s, 4, 64), h(2, s, 2, 64), h(2, s, 2, 64))),
               "transformer-block": (blk, lambda s: (h(2, s, 256),))}
    out = {}
    for name, (module, make) in studies.items():
        for s in (8, 200):
            args = make(s)
            dims = {"args": tuple({1: Dim("s", min=2, max=4096)} for _ in args)} if isinstance(module, Call) \
                else tuple({1: Dim("s", min=2, max=4096)} for _ in args)
            try:
                with torch.no_grad():
                    ep = export(module, args, dynamic_shapes=dims, strict=True)
                out[f"{name}/S={s}"] = {"ops": sorted({str(n.target) for n in ep.graph.nodes
                                                       if "flashtx" in str(n.target)})}
            except Exception as exc:
                out[f"{name}/S={s}"] = {"error": f"{type(exc).__name__}: {exc}"[:3000]}
    return out


def main(argv: list[str]) -> int:
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    import flashtx  # noqa: F401  (imports the kernels before the stand-ins patch their modules)
    import flashtx.triton_kernels.attention_bwd  # noqa: F401
    import flashtx.triton_kernels.attention_fwd  # noqa: F401

    _install_standins()
    dynamic = "--dynamic" in argv  # every size symbolic (torch.compile(dynamic=True)), head dims included
    if "--tma" in argv:  # as the autotune cache would give a TMA tile for every attention kernel
        from flashtx.triton_kernels import configs
        tile = configs.TileConfig(64, 64, 4, 3, "testing_gpu_trace --tma", tma=True)
        tma_kernels = ("attn_fwd", "attn_bwd_dkdv", "attn_bwd_dq")
        configs._autotune_hook = lambda kernel, *a: tile if kernel in tma_kernels else None
    if "--export" in argv:
        print(json.dumps(exports(), indent=1))
        return 0
    for flag, study, names in (("--growing", growing_cache, GROWING), ("--packed", packed_batches, PACKED),
                               ("--varying", varying_counts, VARYING)):
        if flag in argv:  # the study for automatic and dynamic shapes, each case
            print(json.dumps(_per_mode(study, names), indent=1))
            return 0
    argv = [a for a in argv if a not in ("--dynamic", "--tma")]
    results = {}
    for name, (fn, args, backward) in cases().items():
        if argv and name not in argv:
            continue
        try:
            results[name] = _capture(fn, args, backward, dynamic)
        except Exception as exc:  # reported, and the test fails on it
            results[name] = {"error": f"{type(exc).__name__}: {exc}"[:3000]}
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
