"""Compiled steps on the GPU path, traced on a machine without one (for the tests): how many graphs a compiled
loop makes as its arguments change, whether calls that read values trace at all, and what Inductor still copies
after its reinplacing pass. The stand-ins are flashtx.testing_gpu_trace's (Triton dispatch for CPU tensors, sm_86
configs and TTIR target); nothing runs.

    python -m flashtx.testing_gpu_steps --graphs     # graphs compiled over changing arguments, per case and mode
    python -m flashtx.testing_gpu_steps --traces     # value-reading calls under fullgraph: error or kernels
    python -m flashtx.testing_gpu_steps --reinplace  # per kernel, the arguments Inductor still clones per call
    python -m flashtx.testing_gpu_steps --train-clones  # the same for training steps, forward and backward

Found by an audit (2026-12-04): an int RoPE offset and the decode check's int() of sizes compiled a graph per
decoding step (dynamic=True too), the split-KV heuristic one per batch size, position_ids' error messages pinned
the sequence length, flashtx.nn's KVCache (then (B, Hkv, L, D) buffers passed as transposed views) was cloned and
copied back whole every compiled step, and in-place q/k RoPE, nn.RotaryEmbedding with position_ids, varlen RoPE
without max_seqlen and a max_seqlen read with .item() failed under fullgraph; on 2026-12-05 so did unpad_input's
packed batch (its total read on the device: the launchers' empty-input early outs guarded on it), and a compiled
backward of packed SwiGLU with inplace_backward (flashtx.nn's default) had Inductor clone the saved projection output
for the in-place kernel to write.
"""
from __future__ import annotations

import json
import sys

from flashtx._env import triton_interpret

if triton_interpret():
    sys.exit("run without TRITON_INTERPRET: this traces the GPU path, not the interpreter's")


def _h(*shape, grad=False):
    import torch
    return torch.randn(*shape, dtype=torch.float16, requires_grad=grad)


def _graph_cases() -> dict:
    """name -> (function, argument sets): a compiled step over changing arguments (forward only)."""
    import torch

    import flashtx
    from flashtx.nn import RotaryEmbedding

    cos = torch.rand(512, 16)
    rot = RotaryEmbedding(32, max_seq_len=512)
    kc, vc = _h(16, 16, 2, 64), _h(16, 16, 2, 64)  # a fixed page pool: (pages, page, Hkv, D)
    rows_k, rows_v = _h(8, 256, 2, 64), _h(8, 256, 2, 64)  # a continuous batcher's cache rows
    return {
        # continuous batching: the step's batch changes, its sequences' rows picked by cache_batch_idx
        "kvcache-batch": (
            lambda q, k, v, n, bi: flashtx.flash_attn_with_kvcache(q, rows_k, rows_v, k, v, cache_seqlens=n,
                                                                   cache_batch_idx=bi, causal=True),
            [(_h(b, 1, 8, 64), _h(b, 1, 2, 64), _h(b, 1, 2, 64), torch.full((b,), 50, dtype=torch.int32),
              torch.arange(b, dtype=torch.int32)) for b in (3, 4, 5, 6, 7)]),  # (2 would equal Hkv: duck sizing)
        # decoding: the offset is the cache length, a new value each step
        "rope-int-offset": (lambda x, o: flashtx.apply_rotary(x, cos, cos, seqlen_offsets=o),
                            [(_h(2, 1, 4, 32), o) for o in range(100, 106)]),
        "rope-module-int-offset": (lambda q, k, o: rot(q, k, seqlen_offsets=o),
                                   [(_h(2, 1, 4, 32), _h(2, 1, 2, 32), o) for o in range(100, 106)]),
        "rope-position-ids": (lambda q, k, p: flashtx.apply_rotary_qk(q, k, cos, cos, position_ids=p),
                              [(_h(1, s, 4, 32), _h(1, s, 2, 32), torch.arange(s).unsqueeze(0))
                               for s in (48, 64, 80, 96)]),
        "rope-tensor-offsets": (lambda x, o: flashtx.apply_rotary(x, cos, cos, seqlen_offsets=o),
                                [(_h(b, 1, 4, 32), torch.full((b,), 7)) for b in (2, 3, 4, 5)]),
        # a paged decode step whose block table widens (pages per sequence) over a fixed pool
        "kvcache-paged-growing-table": (
            lambda q, k, v, n, bt: flashtx.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=n, block_table=bt,
                                                                   causal=True),
            [(_h(2, 1, 8, 64), _h(2, 1, 2, 64), _h(2, 1, 2, 64), torch.full((2,), 10, dtype=torch.int32),
              torch.arange(2 * p, dtype=torch.int32).view(2, p)) for p in (4, 5, 6, 7)]),
    }


def _forward_graphs(fn, arg_sets, dynamic=None) -> tuple[list, list]:
    """Run fn compiled (fullgraph, forward graphs only, nothing executed) over arg_sets without grad: per compiled
    graph, its kernels and its count of device-side asserts."""
    import torch
    import torch._dynamo
    from torch._dynamo.backends.common import aot_autograd
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

    from .testing_gpu_trace import _kernel_name, _standin

    kernels, asserts = [], []

    def compiler(gm, example_inputs):
        kernels.append([_kernel_name(kernel_side_table.get_kernel(n.kwargs["kernel_idx"]))
                        for n in gm.graph.nodes if "triton_kernel_wrapper" in str(n.target)])
        asserts.append(sum("_assert_async" in str(n.target) for n in gm.graph.nodes))
        return _standin(gm)

    torch._dynamo.reset()
    step = torch.compile(fn, fullgraph=True, dynamic=dynamic, backend=aot_autograd(fw_compiler=compiler))
    with torch._dynamo.config.patch(capture_scalar_outputs=True, capture_dynamic_output_shape_ops=True), \
            torch.no_grad():
        for args in arg_sets:
            step(*args)
    return kernels, asserts


def graphs(dynamic, case: str) -> dict:
    """The forward graphs a compiled step of `case` makes over its argument sets (each a list of its kernels)."""
    fn, arg_sets = _graph_cases()[case]
    return {"graphs": _forward_graphs(fn, arg_sets, dynamic)[0]}


def _trace_cases() -> dict:
    """name -> (function, arguments): calls that read values (or pointers) in eager mode."""
    import torch

    import flashtx
    from flashtx.nn import RotaryEmbedding

    cos = torch.rand(256, 16)
    rot = RotaryEmbedding(32, max_seq_len=256)
    cu = torch.tensor([0, 40, 64], dtype=torch.int32)

    def qk_inplace(qkv):
        q, k = qkv[:, :, :4], qkv[:, :, 4:6]  # views of one fused projection
        return flashtx.apply_rotary_qk(q, k, cos, cos, inplace=True)

    def varlen_item(q, k, v, cu):  # a packing loader's bound, read on the device
        mx = int((cu[1:] - cu[:-1]).max().item())
        return flashtx.flash_attn_varlen_func(q, k, v, cu, cu, mx, mx, causal=True)

    def unpad_train(x, key_mask, w):  # flash-attn's padded-batch recipe: unpad; RoPE, attention, SwiGLU; pad back
        B, S, E = x.shape
        h, idx, cu_b, mx, _ = flashtx.unpad_input(x, key_mask)  # h (total, E): total read on the device (unbacked)
        q = (h @ w).view(-1, 4, E // 4)  # (total, H, D)
        q = flashtx.apply_rotary(q, cos, cos, cu_seqlens=cu_b, max_seqlen=mx)
        o = flashtx.flash_attn_varlen_func(q, q, q, cu_b, cu_b, mx, mx, causal=True)
        h = flashtx.swiglu_packed(o.reshape(-1, E))  # (total, E / 2): an MLP on the packed tokens
        return flashtx.pad_input(h, idx, B, S).float().sum()

    def unpad_rope_host_bound(x, key_mask):  # the padded length as RoPE's max_seqlen (a host int, no sync)
        h, _, cu_b, _, _ = flashtx.unpad_input(x, key_mask)
        return flashtx.apply_rotary(h.view(-1, 4, 32), cos, cos, cu_seqlens=cu_b, max_seqlen=x.shape[1])

    key_mask = torch.arange(64).expand(2, 64) < torch.tensor([[64], [40]])  # (B, S) True = real token
    return {
        "rope-qk-inplace": (qk_inplace, [_h(2, 16, 8, 32)]),
        "rope-module-position-ids": (lambda q, k, p: rot(q, k, position_ids=p),
                                     [_h(2, 16, 4, 32), _h(2, 16, 2, 32), torch.arange(16).expand(2, 16)]),
        "rope-module-tensor-offsets": (lambda q, k, o: rot(q, k, seqlen_offsets=o),
                                       [_h(2, 16, 4, 32), _h(2, 16, 2, 32), torch.tensor([3, 9])]),
        "rope-varlen-no-max-seqlen": (lambda x, cu: flashtx.apply_rotary(x, cos, cos, cu_seqlens=cu),
                                      [_h(64, 4, 32), cu]),
        "varlen-max-seqlen-item": (varlen_item, [_h(64, 4, 64), _h(64, 4, 64), _h(64, 4, 64), cu]),
        "unpad-rope-host-max-seqlen": (unpad_rope_host_bound, [_h(2, 64, 128), key_mask]),
        "unpad-varlen-pad-train": (unpad_train, [_h(2, 64, 128, grad=True), key_mask, _h(128, 128, grad=True)]),
    }


def traces(case: str) -> dict:
    """The kernels of the forward graph of `case` under fullgraph (an error is reported by the caller), and how many
    device-side asserts it holds."""
    fn, args = _trace_cases()[case]
    if case.endswith("-train"):  # forward and backward graphs
        import torch._dynamo

        from .testing_gpu_trace import _capture
        with torch._dynamo.config.patch(capture_scalar_outputs=True, capture_dynamic_output_shape_ops=True):
            return {"kernels": _capture(fn, args, backward=True)["kernels"]}
    kernels, asserts = _forward_graphs(fn, [args])
    return {"kernels": kernels, "asserts": asserts}


def reinplace(case: str) -> dict:
    """Per kernel of `case`'s graph after Inductor's reinplacing pass: the arguments it still clones (a copy of the
    argument, and of it back into a mutated input, on every call); and the graph's inputs it mutates that are not
    static addresses (CUDA-graph trees, mode="reduce-overhead", skip a graph that mutates any)."""
    import torch
    import torch._dynamo
    import torch._inductor.fx_passes.post_grad as post_grad
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

    from flashtx.nn import RotaryEmbedding, TransformerBlock

    from .testing_gpu_trace import _kernel_name

    class Stop(Exception):
        pass

    seen, unstatic = {}, []
    real = post_grad.decompose_triton_kernel_wrapper_functional

    def spy(graph):  # the graph right after reinplacing: functional kernel nodes still name their clones
        meta = torch._guards.TracingContext.get().fw_metadata
        unstatic.extend(i for i, info in enumerate(meta.input_info)
                        if info.mutates_data and i not in meta.static_input_indices)
        for n in graph.nodes:
            if n.target is torch.ops.higher_order.triton_kernel_wrapper_functional:
                name = _kernel_name(kernel_side_table.get_kernel(n.kwargs["kernel_idx"]))
                seen.setdefault(name, []).extend(n.kwargs.get("tensors_to_clone", ()))
        raise Stop

    torch.manual_seed(0)
    block = TransformerBlock(64, 4, 2, hidden_dim=96, rotary=RotaryEmbedding(16)).to(torch.float16).eval()
    cache = block.new_cache(2, 64, paged=case == "nn-paged-decode")
    if case == "nn-paged-decode":
        cache.self_attn.allocate_all(64)
    x = _h(2, 1, 64)
    post_grad.decompose_triton_kernel_wrapper_functional = spy
    torch._dynamo.reset()
    try:
        with torch.no_grad():
            torch.compile(lambda x: block(x, cache=cache), fullgraph=True, backend="inductor")(x)
    except Exception as exc:  # Stop, through Dynamo's wrapping
        if "Stop" not in f"{type(exc).__name__} {exc!r}":
            raise
    finally:
        post_grad.decompose_triton_kernel_wrapper_functional = real
    return {"cloned": {k: sorted(set(v)) for k, v in seen.items()}, "mutated_not_static": unstatic}


def _train_cases() -> dict:
    """name -> (step, arguments): a training step (forward, a loss, backward) through flashtx.nn modules."""
    import torch

    from flashtx.nn import RotaryEmbedding, SwiGLU, TransformerBlock

    torch.manual_seed(0)
    block = TransformerBlock(128, 4, 2, hidden_dim=192, rotary=RotaryEmbedding(32)).to(torch.float16)  # (its
    # RoPE tables are built with it, before the stand-ins: nothing runs then)
    split = SwiGLU(128, 192, packed=False).to(torch.float16)
    x = _h(2, 64, 128, grad=True)
    return {"nn-block-train": (lambda x: block(x).float().sum(), (x,)),  # packed SwiGLU (w13), RoPE, attention
            "nn-swiglu-split-train": (lambda x: split(x).float().sum(), (x,))}


def train_clones(case: str) -> dict:
    """Per graph of `case`'s compiled training step (forward, then backward): its kernels, each with the arguments
    Inductor's reinplacing pass still clones (a copy per step; a backward that writes over its saved inputs has
    them cloned, since a graph may not mutate them)."""
    import inspect

    import torch
    import torch._dynamo
    from torch._dynamo.backends.common import aot_autograd
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table
    from torch._inductor.fx_passes.reinplace import reinplace_inplaceable_ops
    from torch._inductor.fx_utils import FakeTensorUpdater

    from .testing_gpu_trace import _kernel_name, _standin

    graphs = []

    def compiler(gm, example_inputs):
        updater = FakeTensorUpdater(gm if "gm" in inspect.signature(FakeTensorUpdater).parameters else gm.graph)
        reinplace_inplaceable_ops(updater, gm.graph)  # as Inductor's post-grad passes run it (torch 2.11: a graph)
        graphs.append([[_kernel_name(kernel_side_table.get_kernel(n.kwargs["kernel_idx"])),
                        sorted(n.kwargs.get("tensors_to_clone", ()))] for n in gm.graph.nodes
                       if n.target is torch.ops.higher_order.triton_kernel_wrapper_functional])
        return _standin(gm)

    step, args = _train_cases()[case]
    torch._dynamo.reset()
    torch.compile(step, fullgraph=True, backend=aot_autograd(fw_compiler=compiler, bw_compiler=compiler))(
        *args).backward()
    return {"graphs": graphs}


def main(argv: list[str]) -> int:
    import flashtx  # noqa: F401  (imports the kernels before the stand-ins patch their modules)
    import flashtx.triton_kernels.attention_bwd  # noqa: F401
    import flashtx.triton_kernels.attention_fwd  # noqa: F401

    from .testing_gpu_trace import _install_standins, _per_mode

    _install_standins()
    if "--graphs" in argv:
        out = _per_mode(graphs, list(_graph_cases()))
    else:
        names, study = ((list(_trace_cases()), traces) if "--traces" in argv else
                        (list(_train_cases()), train_clones) if "--train-clones" in argv else
                        (["nn-decode", "nn-paged-decode"], reinplace))
        out = {}
        for name in names:
            try:
                out[name] = study(name)
            except Exception as exc:
                out[name] = {"error": f"{type(exc).__name__}: {exc}"[:3000]}
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
