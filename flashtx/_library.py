"""How flashtx registers and calls its ops.

Registration: `triton_op` wraps `torch.library.triton_op`, so torch.compile sees the kernels. A
triton_op is a custom op whose body torch.compile traces (with `wrap_triton` launches, see
flashtx.triton_kernels.launch.run_kernel): Inductor then calls the Triton kernels from generated
code, designed for CUDA graphs to capture (not yet tried on a GPU). Dynamo itself never looks inside:
in its graph the op is one node, so what Dynamo traces is only the thin functional layer around it.

Triton's interpreter (CPU tests) cannot run on the fake tensors of a trace, so while it is on the
ops stay opaque under torch.compile, as `torch.library.custom_op`s are: the Dynamo graph is the
same, only Inductor's view inside the op differs.

Calls: `call(op, *args)` runs the registered op while torch.compile traces, and otherwise the same
body without the dispatcher's layers (custom-op autograd, redispatch, Dynamo-disable wrappers:
most of an eager call's Python time): through an autograd.Function built from the op's own
setup_context/backward when autograd must record the call, directly when it need not.
"""
from __future__ import annotations

import inspect

import torch
from torch._subclasses.functional_tensor import FunctionalTensorMode

from . import _env

_BODY: dict = {}  # op -> its Python body
_EAGER: dict = {}  # op -> autograd.Function over the body (ops with autograd)
_MUTATED: dict = {}  # op -> positions of the arguments it writes in place
_TENSORS: dict = {}  # op -> (positions of its Tensor arguments, positions of its Tensor-list arguments)


_BACKEND_ARG: dict = {}  # op -> position of its `backend` argument (None: it has none)
_JIT_TRACING = torch._C._get_tracing_state  # torch.jit.trace


def _refuse_jit_kernels(op, args) -> None:
    """Under torch.jit.trace: the reference backend (asked for, or CPU tensors without the interpreter) runs aten
    ops, which TorchScript records; a kernel launch would not be recorded, so that is refused by name."""
    i = _BACKEND_ARG.get(op)
    requested = args[i] if i is not None else ""
    if requested == "reference" or (not requested and args[0].device.type == "cpu" and not _env.INTERPRET):
        return
    raise RuntimeError(f"torch.jit.trace cannot trace flashtx's kernels (here {getattr(op, '_qualname', op)}): it "
                       "would record no launch. Use torch.export.export or torch.compile, which trace them, or "
                       "backend='reference'")


def _opaque(mode, op, types, args, kwargs):
    return mode.__torch_dispatch__(op, types, args, kwargs)


def triton_op(name: str, *, mutates_args=()):
    """Decorator: register `fn` as the triton_op `name` (its own fake impl too: the body runs on
    fake tensors, where launches record or skip). Returns the op."""
    def dec(fn):
        op = torch.library.triton_op(name, mutates_args=mutates_args)(fn)
        if _env.INTERPRET or not _env.HAS_TRITON:
            op.register_torch_dispatch(FunctionalTensorMode, _opaque)
        _BODY[op] = fn
        params = inspect.signature(fn).parameters
        names = list(params)
        _MUTATED[op] = tuple(names.index(a) for a in mutates_args)
        kinds = [str(p.annotation) for p in params.values()]  # annotations as written ("Optional[Tensor]")
        _TENSORS[op] = (tuple(i for i, a in enumerate(kinds) if "Tensor" in a and "list" not in a),
                        tuple(i for i, a in enumerate(kinds) if "Tensor" in a and "list" in a))
        _BACKEND_ARG[op] = names.index("backend") if "backend" in names else None
        return op
    return dec


def register_autograd(op, backward, setup_context) -> None:
    """op.register_autograd, plus the equivalent autograd.Function that `call` uses in eager mode."""
    op.register_autograd(backward, setup_context=setup_context)
    body = _BODY[op]

    def forward(ctx, *args):
        out = body(*args)
        setup_context(ctx, args, out)
        return out

    name = "".join(w.capitalize() for w in op._name.split("::")[-1].split("_"))  # attn_fwd -> AttnFwd(Backward)
    fn = type(name, (torch.autograd.Function,), {"forward": staticmethod(forward), "backward": staticmethod(backward)})
    _EAGER[op] = fn
    if _C_APPLY is not None and _unwrap_if_dead is not None:  # else `call` takes Function.apply
        _APPLY[op] = _C_APPLY.__get__(None, fn)


# autograd.Function.apply, outside functorch transforms and without setup_context, unwraps dead functorch
# wrappers from its arguments and calls the C++ apply of _FunctionBase: `call` does the same with the
# C++ apply bound once per op (and unwraps only the op's Tensor arguments, as Function.apply's generator
# reaches no further), which saves ~1.5 us of Python per call.
_C_APPLY = getattr(torch._C, "_FunctionBase", object).__dict__.get("apply")
_APPLY: dict = {}  # op -> its Function's C++ apply, bound to it
_unwrap_if_dead = getattr(getattr(torch._C, "_functorch", None), "unwrap_if_dead", None)


def _requires_grad(op, args) -> bool:
    tensors, lists = _TENSORS[op]
    for i in tensors:
        a = args[i]
        if a is not None and a.requires_grad:
            return True
    for i in lists:
        for t in args[i]:
            if t is not None and t.requires_grad:
                return True
    return False


_PLAIN = (torch.Tensor, torch.nn.Parameter)
_FUNCTORCH = torch._C._are_functorch_transforms_active
_FORWARD_AD = torch.autograd.forward_ad  # (its _current_level: -1 outside a dual_level)


_SDPA_OPS = frozenset(("flashtx::attn_fwd", "flashtx::attn_bwd", "flashtx::attn_probs", "flashtx::kvcache_attention"))


def _refuse_transforms(op, args) -> None:
    """Raise for a call under a torch.func transform (vmap, grad, jacrev, ...), or with a forward-mode AD tangent:
    the kernels read raw storage and the ops have no batching rule or jvp formula. Without this, a transform failed
    deep inside torch, and a tangent was silently dropped (a wrong answer)."""
    name = op._qualname if hasattr(op, "_qualname") else repr(op)
    if _FUNCTORCH():
        raise NotImplementedError(f"{name}: torch.func transforms (vmap, grad, jacrev, ...) are not supported; call it "
                                  f"outside the transform, or use torch.autograd (backward) for gradients")
    # (an op that no differentiable call reaches, e.g. the cache append, has no derivative of either kind)
    differentiable = op in _EAGER or name in _SDPA_OPS  # (attention's small-query route runs kvcache_attention)
    instead = "use backward-mode autograd" if differentiable else "it is not differentiable: pass plain tensors"
    if torch.compiler.is_compiling():  # a traced tensor shows no tangent, and the compiled op's would be dropped
        raise NotImplementedError(f"{name}: forward-mode AD is not supported (a dual level is open while "
                                  f"torch.compile traces it; it has no jvp formula); {instead}")
    tensors, lists = _TENSORS[op]
    ts = [args[i] for i in tensors] + [t for i in lists for t in args[i]]
    if any(t is not None and _FORWARD_AD.unpack_dual(t).tangent is not None for t in ts):
        sdpa = " (under flashtx.patch_sdpa, such an SDPA call goes to torch's SDPA)" if name in _SDPA_OPS else ""
        raise NotImplementedError(f"{name}: forward-mode AD (a dual tensor's tangent) is not supported: it has no jvp "
                                  f"formula; {instead}{sdpa}")


_cuda_get_device = getattr(torch._C, "_cuda_getDevice", None)  # absent from CPU-only builds (no CUDA tensor there)


def _other_device(t) -> int | None:
    """t's CUDA device index when it is not the current device, else None. Triton launches on the current
    device and its current stream, so a call on tensors elsewhere (a model split over GPUs, e.g. transformers'
    device_map="auto") must first switch to their device, as a native op's device guard does."""
    if t.is_cuda:
        i = t.get_device()
        if i != _cuda_get_device():
            return i
    return None


# CUDA's torch._assert_async takes a message of at most 254 bytes ("Message length must be smaller than 255",
# torch 2.11, seen on an H100 on 2026-12-06: decode calls with device-resident cache_seqlens and leftpad, batch_idx,
# a block_table or rotary raised it); CPU's has no limit, so a CPU run never saw it. Every flashtx device-side
# assert goes through device_assert.
ASSERT_MESSAGE_BYTES = 254


def device_assert(cond, message: str) -> None:
    """torch._assert_async(cond, message) with `message` cut to ASSERT_MESSAGE_BYTES (what CUDA's assert takes): a
    device-side assert with no host sync, for conditions only the device can read. cond: a bool or integer tensor
    of one element (nonzero: holds)."""
    raw = message.encode()
    if len(raw) > ASSERT_MESSAGE_BYTES:  # (traced by Dynamo on a constant string: nothing left in the graph)
        message = raw[:ASSERT_MESSAGE_BYTES - 3].decode(errors="ignore") + "..."
    torch._assert_async(cond, message)


def call(op, *args):
    """Run `op` on positional `args` (the first one a tensor): the registered op whenever anything
    traces or intercepts it (torch.compile, AOTAutograd or make_fx and their dispatch modes, tensor
    subclasses) and wherever autograd must record an op without an eager twin (a double backward,
    which it then refuses); otherwise its body, through its autograd.Function when a tensor
    argument requires grad, on the first argument's device (made current for the call if it is not)."""
    if _FUNCTORCH() or _FORWARD_AD._current_level >= 0:  # (traced too: a compiled jvp gave zero tangents)
        _refuse_transforms(op, args)
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack():
        return op(*args)  # traced: the compiled graph places each kernel itself
    if _JIT_TRACING():
        _refuse_jit_kernels(op, args)
    other = _other_device(args[0])
    if other is not None:
        with torch.cuda.device(other):
            return call(op, *args)
    if type(args[0]) not in _PLAIN:  # a tensor subclass: the registered op (its own dispatch)
        return op(*args)
    if torch.is_grad_enabled() and _requires_grad(op, args):
        apply = _APPLY.get(op)
        if apply is not None and not torch._C._are_functorch_transforms_active():
            args = list(args)
            for i in _TENSORS[op][0]:
                if args[i] is not None:
                    args[i] = _unwrap_if_dead(args[i])
            return apply(*args)
        eager = _EAGER.get(op)
        return eager.apply(*args) if eager is not None else op(*args)
    out = _BODY[op](*args)
    for i in _MUTATED[op]:  # in-place writes bump version counters, as the registered op's would
        if args[i] is not None:
            torch.autograd.graph.increment_version(args[i])
    return out
