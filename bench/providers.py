"""The implementations flashtx is compared with: one builder per provider, each raising
harness.Unavailable with the reason when it cannot run here.

A builder takes the case and returns `fn(q, k, v) -> out` for tensors in its own layout
(`LAYOUT[name]`: "bhsd" as SDPA, or "bshd" as flash-attn and xformers). Anything a model would
build once (causal masks, FlexAttention's BlockMask, compiled functions) is built by the
builder, outside the timed region.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import flashtx

from .harness import DEVICE, Unavailable


@dataclass(frozen=True)
class AttnCase:
    batch: int
    hq: int
    hkv: int
    seqlen: int
    d: int
    causal: bool
    dtype: torch.dtype

    @property
    def gqa(self) -> bool:
        return self.hq != self.hkv

    def info(self) -> dict:
        return {"op": "attention", "batch": self.batch, "heads": self.hq, "kv_heads": self.hkv,
                "seqlen": self.seqlen, "headdim": self.d, "causal": self.causal,
                "dtype": str(self.dtype).replace("torch.", ""),
                "shape": f"B={self.batch} Hq={self.hq} Hkv={self.hkv} S={self.seqlen} D={self.d}"}


DESCRIPTION = {
    "flashtx": "flashtx.attention (Triton)",
    "eager": "eager PyTorch: matmul, fp32 softmax, matmul (as Hugging Face's eager attention)",
    "sdpa-flash": "SDPA, FLASH_ATTENTION backend: FlashAttention-2 inside PyTorch",
    "sdpa-efficient": "SDPA, EFFICIENT_ATTENTION backend: xformers' memory-efficient kernel inside PyTorch",
    "sdpa-cudnn": "SDPA, CUDNN_ATTENTION backend: cuDNN's fused attention",
    "sdpa-math": "SDPA, MATH backend: PyTorch's composite reference",
    "flex": "FlexAttention, torch.compile'd (BlockMask for causal)",
    "xformers": "xformers.ops.memory_efficient_attention",
    "flash_attn": "flash_attn.flash_attn_func (FlashAttention-2/3 package)",
}
ATTENTION_PROVIDERS = list(DESCRIPTION)
LAYOUT = {name: ("bshd" if name in ("xformers", "flash_attn") else "bhsd") for name in ATTENTION_PROVIDERS}


def make_qkv(case: AttnCase, layout: str, requires_grad: bool):
    """Fresh random q, k, v (never zeros), contiguous in the provider's layout."""
    def t(h):
        shape = (case.batch, h, case.seqlen, case.d) if layout == "bhsd" else (case.batch, case.seqlen, h, case.d)
        return torch.randn(shape, device=DEVICE, dtype=case.dtype).requires_grad_(requires_grad)
    return t(case.hq), t(case.hkv), t(case.hkv)


def optional_import(module: str):
    try:
        return importlib.import_module(module)
    except Exception as exc:  # ImportError, or a wheel built for another torch failing to load
        raise Unavailable(f"`import {module}` failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")


def _xformers_cpp_loaded() -> bool:
    """Whether xformers' C++ library loaded (xformers._cpp_lib._build_metadata is None when it did not)."""
    return getattr(importlib.import_module("xformers._cpp_lib"), "_build_metadata", True) is not None


def xformers_ops_without_cpp():
    """xformers.ops, with its build check cleared when its C++ library did not load (a wheel built for another torch:
    the 0.0.35 wheel, for 2.10+cu128, on torch 2.11+cu130, 2026-12-06). Every CUDA op then refuses every input
    ("xFormers wasn't build with CUDA support"), though triton_splitKF is pure Triton: the decode bench measures it
    (an op that does need the C++ library still fails, by name; the attention bench skips xformers then: its
    PyTorch-backed ops would time PyTorch's own kernels). Returns (xformers.ops, note): the note says whether the
    check was cleared."""
    xops = optional_import("xformers.ops")
    common = importlib.import_module("xformers.ops.fmha.common")
    if not _xformers_cpp_loaded() and not getattr(common, "_built_with_cuda", True):
        common._built_with_cuda = True
        return xops, " (its C++ library did not load: the build check is cleared for its Triton / PyTorch-backed ops)"
    return xops, ""


# ---------------------------------------------------------------------------------------- builders
def _flashtx(case: AttnCase):
    def fn(q, k, v):
        try:
            return flashtx.attention(q, k, v, is_causal=case.causal, enable_gqa=case.gqa, backend="triton")
        except flashtx.BackendNotSupported as exc:  # e.g. a GPU older than sm_80
            raise Unavailable(str(exc)) from exc
    return fn


def eager_attention(q, k, v, causal_mask, scale, bias=None):
    """What a model writes (Hugging Face's eager path): K/V repeated for GQA, fp32 softmax; `bias` (broadcastable
    to the scores) added to the scaled scores, as Swin's relative-position bias."""
    g = q.shape[1] // k.shape[1]
    if g > 1:
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    s = torch.matmul(q, k.transpose(-2, -1)) * scale
    if bias is not None:
        s = s + bias
    if causal_mask is not None:
        s = s.masked_fill(causal_mask, float("-inf"))
    p = torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(p, v)


def _eager(case: AttnCase):
    mask = None
    if case.causal:  # built once, as a model caches it
        mask = torch.ones(case.seqlen, case.seqlen, dtype=torch.bool, device=DEVICE).triu(1)
    scale = case.d ** -0.5
    return lambda q, k, v: eager_attention(q, k, v, mask, scale)


def _sdpa(backend_name: str):
    def build(case: AttnCase):
        from torch.nn.attention import SDPBackend, sdpa_kernel
        backend = getattr(SDPBackend, backend_name)

        def fn(q, k, v):
            with sdpa_kernel([backend]):  # the backward kernel is fixed by the forward's choice
                return F.scaled_dot_product_attention(q, k, v, is_causal=case.causal, enable_gqa=case.gqa)
        return fn
    return build


_flex_compiled = None


def _flex(case: AttnCase):
    global _flex_compiled
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError as exc:
        raise Unavailable(f"torch {torch.__version__} has no FlexAttention: {exc}")
    if _flex_compiled is None:
        from torch import _dynamo  # (not `import torch._dynamo`: that made `torch` local, and the except above
        # raised UnboundLocalError instead of Unavailable)
        # one specialisation per shape: keep dynamo from falling back to eager after 8 of them
        _dynamo.config.recompile_limit = max(_dynamo.config.recompile_limit, 256)
        _dynamo.config.accumulated_recompile_limit = max(_dynamo.config.accumulated_recompile_limit, 4096)
        _flex_compiled = torch.compile(flex_attention, dynamic=False)
    block_mask = None
    if case.causal:
        block_mask = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, case.seqlen, case.seqlen,
                                       device=DEVICE)
    compiled = _flex_compiled
    return lambda q, k, v: compiled(q, k, v, block_mask=block_mask, enable_gqa=case.gqa)


# xformers' attention operators, tried in this order with an explicit op= (issue 13 item 7): on the
# 2026-11-30 H200 the wheel's own CUDA ops did not load (built for another torch) and the default
# dispatch found no operator, while these PyTorch-backed / Triton ones reported available
# (xformers.info: fa2F@2.5.7-pt, cutlassF-pt, triton_splitKF). Each is probed on a tiny input of the
# case's dtype, head dim, mask and GQA form before use; if none runs, the provider is skipped with
# every op's reason.
XFORMERS_OPS = (("flash", "fa2 (PyTorch-backed, fa2F/fa2B@pt)"), ("cutlass", "cutlass (PyTorch-backed, cutlassF/B-pt)"),
                ("triton_splitk", "triton_splitKF (forward only)"))


def _xformers(case: AttnCase):
    xops = optional_import("xformers.ops")
    if not _xformers_cpp_loaded():
        raise Unavailable("xformers' C++ library did not load (built for another torch): its PyTorch-backed ops would "
                          "time PyTorch's own kernels, which the sdpa rows time (and the bench step's budget has no "
                          "room for them)")
    bias = xops.LowerTriangularMask() if case.causal else None

    def make(op):
        def fn(q, k, v):
            if case.gqa:  # xformers' documented GQA form: (B, S, G, H, D) with K/V expanded (stride 0)
                b, s, _, d = q.shape
                g = case.hkv
                q5 = q.view(b, s, g, case.hq // g, d)
                k5 = k.view(b, s, g, 1, d).expand(b, s, g, case.hq // g, d)
                v5 = v.view(b, s, g, 1, d).expand(b, s, g, case.hq // g, d)
                return xops.memory_efficient_attention(q5, k5, v5, attn_bias=bias, op=op).reshape(b, s, case.hq, d)
            return xops.memory_efficient_attention(q, k, v, attn_bias=bias, op=op)
        return fn

    reasons = []
    tiny = AttnCase(1, case.hq, case.hkv, 64, case.d, case.causal, case.dtype)
    for module, label in XFORMERS_OPS:
        try:
            mod = importlib.import_module(f"xformers.ops.fmha.{module}")
            fw, bw = getattr(mod, "FwOp"), getattr(mod, "BwOp", None)
            op = (fw, bw)  # (a bare FwOp is not an op tuple: xformers indexes op[0])
            fn = make(op)
            with torch.no_grad():
                fn(*make_qkv(tiny, "bshd", requires_grad=False))  # probe: raises if this op cannot run the case
        except Exception as exc:  # noqa: BLE001 - ImportError, NotImplementedError ("no operator"), CUDA errors
            reasons.append(f"{label}: {type(exc).__name__}: {' '.join(str(exc).split())[:160]}")
            continue
        fn.desc = f"xformers.ops.memory_efficient_attention(op={label})"
        fn.forward_only = bw is None
        fn.forward_only_reason = f"xformers op {label} has no backward"
        return fn
    raise Unavailable("no xformers op runs this case: " + " | ".join(reasons))


def _flash_attn(case: AttnCase):
    fa = optional_import("flash_attn")
    return lambda q, k, v: fa.flash_attn_func(q, k, v, causal=case.causal)


BUILDERS = {
    "flashtx": _flashtx, "eager": _eager,
    "sdpa-flash": _sdpa("FLASH_ATTENTION"), "sdpa-efficient": _sdpa("EFFICIENT_ATTENTION"),
    "sdpa-cudnn": _sdpa("CUDNN_ATTENTION"), "sdpa-math": _sdpa("MATH"),
    "flex": _flex, "xformers": _xformers, "flash_attn": _flash_attn,
}


# ------------------------------------------------------------------------- (prepare, step) per pass
def attention_case(provider: str, case: AttnCase, pass_: str):
    """(prepare, step) for harness.run_case: fwd times a forward without autograd; bwd times
    torch.autograd.grad over a forward built once (retain_graph, so no re-forward); fwd+bwd both."""
    fn = BUILDERS[provider](case)
    layout = LAYOUT[provider]
    if pass_ != "fwd" and getattr(fn, "forward_only", False):
        raise Unavailable(fn.forward_only_reason)

    if pass_ == "fwd":
        def prepare():
            return make_qkv(case, layout, requires_grad=False)

        def step(s):
            with torch.no_grad():
                return fn(*s)
    elif pass_ == "bwd":
        def prepare():
            qkv = make_qkv(case, layout, requires_grad=True)
            out = fn(*qkv)
            return out, qkv, torch.randn_like(out)

        def step(s):
            out, qkv, dout = s
            return torch.autograd.grad(out, qkv, dout, retain_graph=True)
    elif pass_ == "fwd+bwd":
        def prepare():
            qkv = make_qkv(case, layout, requires_grad=True)
            with torch.no_grad():  # dout in the layout of the provider's own output, as a model's loss gives it
                # (flashtx's and SDPA's are (B, S, H, D) in memory: a contiguous (B, H, S, D) dout cost a backward
                # that wants its output's layout a copy no model pays)
                dout = torch.randn_like(fn(*qkv))
            return qkv, dout

        def step(s):
            qkv, dout = s
            return torch.autograd.grad(fn(*qkv), qkv, dout)
    else:
        raise ValueError(f"pass must be fwd, bwd or fwd+bwd; got {pass_!r}")
    step.desc = getattr(fn, "desc", None)  # e.g. which xformers op ran
    return prepare, step
