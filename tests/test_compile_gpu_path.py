"""torch.compile as on a GPU: the Dynamo graph has no break, and AOTAutograd/Inductor see the Triton
kernels inside every flashtx op (triton_op + wrap_triton), forward and backward.

The CPU suite keeps the ops opaque (Triton's interpreter cannot run in a trace), so this runs the
GPU path in a subprocess with stand-ins for the device (flashtx.testing_gpu_trace): the Triton
dispatch, sm_86 tile configs and an sm_86 TTIR target. On 29be9ff (custom ops, dispatch traced by
Dynamo) no kernel was visible and the CUDA dispatch graph-broke.
"""
import json
import os
import subprocess
import sys

import pytest

FWD = ["_attn_fwd"]
# every kernel's output arguments (what its stores may write)
OUTPUTS = {"O", "M2", "L2", "DELTA", "DK", "DV", "DQ", "DB", "QO", "KO", "OUT1", "OUT2", "FLAG", "KC", "VC", "LSE"}
BWD = ["_attn_bwd_preprocess", "_attn_bwd_dkdv", "_attn_bwd_dq"]
# the module fixture runs once: its tests share one xdist worker (pytest -n auto --dist loadgroup)
pytestmark = pytest.mark.xdist_group("gpu-trace")


def _trace(*flags) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "FLASHTX_INTERPRET")}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run([sys.executable, "-m", "flashtx.testing_gpu_trace", *flags], capture_output=True, text=True,
                          env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


@pytest.fixture(scope="module")
def traced():
    return _trace()


@pytest.fixture(scope="module")
def traced_dynamic():
    return _trace("--dynamic")


@pytest.mark.parametrize("case,fwd,bwd", [
    ("attention-causal", FWD, BWD),
    ("flash-gqa", FWD, BWD),
    ("masks-bias-softcap", FWD, BWD),  # the learned bias's gradient comes from the dQ kernel
    ("bool-mask-expanded", FWD, BWD),  # a bool attn_mask that is an expanded view (transformers' padding mask)
    ("bool-mask-sliced", FWD, BWD),  # and a slice of a longer one
    ("patch-sdpa", FWD, BWD),
    # RoPE (q and k in one launch, its backward the same kernel conjugated) and SwiGLU, around attention
    ("transformer-block", FWD + ["_rotary_kernel", "_swiglu_kernel"], BWD + ["_rotary_kernel", "_swiglu_kernel"]),
    # flash_attn_with_kvcache: the index check (its flag asserted on the device), append in place, then attend
    ("decode", ["_decode_check", "_kv_append", "_decode_fwd"], None),
    ("decode-paged", ["_decode_check", "_kv_append", "_decode_fwd"], None),
    # flashtx.attention with one query and no grad (generation through attn_implementation="ftx"): decode kernels
    ("attention-decode", ["_decode_fwd"], None),
    ("attention-decode-padded", ["_decode_fwd"], None),  # a key mask and a window (transformers' padded batch)
    ("attention-decode-static", ["_decode_fwd"], None),  # a (B, 1, 1, Sk) bool attn_mask (a static cache's step)
    ("attention-decode-tree", ["_decode_fwd"], None),  # a (B, 1, Sq, Sk) bool attn_mask: a row per query
    # packed sequences: cu_seqlens must not look written (2026-12-01: the partition failed); their values checked by
    # one kernel (its flags asserted on the device), not a chain of torch ops
    ("varlen", ["_cu_seqlens_check"] + FWD, BWD),
    ("dropout", FWD, BWD),
    ("attn-probs", FWD, BWD),  # the probabilities themselves come from an opaque custom op (O(N^2), for tests)
    ("rope-varlen", ["_cu_seqlens_check", "_rotary_kernel"], ["_rotary_kernel"]),
    ("swiglu-packed", ["_swiglu_kernel"], ["_swiglu_kernel"]),
    # a transformers LlamaForCausalLM (attn_implementation="ftx" + apply_flashtx), left-padded, loss backward
    ("hf-llama", FWD + ["_rotary_kernel", "_swiglu_kernel"], BWD + ["_rotary_kernel", "_swiglu_kernel"]),
])
def test_compiled_graphs_hold_the_kernels(traced, case, fwd, bwd):
    if case == "hf-llama":
        pytest.importorskip("transformers")
    res = traced[case]
    assert "error" not in res, res.get("error")
    graphs = res["kernels"]
    assert set(fwd) <= set(graphs[0])
    if bwd is not None:
        assert set(bwd) <= set(graphs[1])
    # no kernel writes through a view: functionalization would copy the whole base back after it (on
    # 677295a, swiglu_packed's backward wrote the two column halves of dx: two slice_scatters of dx)
    assert res["scatters"] == [[] for _ in graphs], res["scatters"]
    # no view(dtype) of a bool tensor (a mask passed as bytes): Inductor of torch 2.11 cannot lower it (2026-12-06,
    # an H100: test_compiled_training_matches_eager's key_mask); the eager calls keep the zero-copy view
    assert res["bool_views"] == 0
    # each launch reads its mask with the strides of the tensor it is given (2026-12-06: while tracing, a bool mask
    # became a contiguous copy read with the view's strides: wrong rows, or reads past it)
    assert res["mask_strides"] == [], res["mask_strides"]
    # torch's analysis of each kernel's TTIR finds only its outputs written: an input it takes as written (cu_seqlens,
    # lengths, a block table: read through a helper whose result addresses a store) is cloned and copied back in
    # every call, and in a backward kernel it fails AOTAutograd's partition ("was invalid, but is output")
    wrong = {k: sorted(set(w) - OUTPUTS) for k, w in res["written"].items() if set(w) - OUTPUTS}
    assert not wrong, wrong
    assert res["tma"] == [], res["tma"]  # no shipped sm_86 tile reads through descriptors


def test_decoding_through_attention_compiles_to_the_decode_kernels_only(traced):
    """Not the training forward as well (flashtx._small_q decides in the traced Python, on static sizes)."""
    for case in ("attention-decode", "attention-decode-padded", "attention-decode-static", "attention-decode-tree"):
        assert "_attn_fwd" not in traced[case]["kernels"][0], traced[case]["kernels"]


def test_a_compiled_decode_loop_over_growing_kv_compiles_once():
    """transformers' DynamicCache under torch.compile: K/V one token longer each step. Nothing on the decode path
    may guard on the key length (until 2026-12-02 the launcher's int(snew) and its split heuristic did: a new graph
    every step, and fullgraph's recompile limit after eight): automatic dynamic shapes compile twice (static,
    then dynamic), dynamic=True once, each graph with the decode kernels only. So for transformers' padded
    batches, whose top-left window (-1, Sk - Sq) is the bottom-right (-1, 0). A fixed top-left bound would move
    with Sk in the decode kernels' bottom-right terms (and their launcher pinned it: a graph per step until
    2026-12-02), so a symbolic Sk runs the training forward there, whose bounds do not move."""
    res = _trace("--growing")
    assert len(res) == 6, sorted(res)
    for name, out in res.items():
        case, mode = name.split("/")
        assert "error" not in out, (name, out.get("error"))
        graphs = out["graphs"]
        assert 1 <= len(graphs) <= (2 if mode == "automatic" else 1), (name, graphs)
        if case == "top-left-window":  # the static first step (automatic) may still take the decode kernels
            assert "_attn_fwd" in graphs[-1] and "_decode_fwd" not in graphs[-1], (name, graphs)
        else:
            assert all("_decode_fwd" in g and "_attn_fwd" not in g for g in graphs), (name, graphs)


def test_query_and_row_counts_that_change_every_step_cost_a_bounded_number_of_graphs():
    """Speculative decoding: each step's query count differs (1, 2, 3, ... 8). Until 2026-12-06 the decode tiles
    int()-ed it (a graph per count, then fullgraph's recompile limit after eight, with dynamic=True too) and RoPE's
    and SwiGLU's row tiles guarded a bucket per power of two (a graph per bucket: 4 here, and the buckets of one
    model's ops multiplied). Now the count is symbolic past one range guard of the decode tile (query x head rows
    <= 16, or more): at most 3 graphs (a static first one, then 2; SDPA's: 2-3), and RoPE + SwiGLU 2, as eager."""
    res = _trace("--varying")
    assert sorted(res) == sorted(f"{c}/{m}" for c in ("kvcache", "attention", "rope-swiglu")
                                 for m in ("automatic", "dynamic")), sorted(res)
    for name, out in res.items():
        assert "error" not in out, (name, out.get("error"))
        case, mode = name.split("/")
        graphs = out["graphs"]
        most = {"rope-swiglu": 2, "kvcache": 3, "attention": 4 if mode == "automatic" else 3}[case]
        assert 1 <= len(graphs) <= most, (name, graphs)
        want = {"kvcache": "_kv_append", "attention": "_decode_fwd", "rope-swiglu": "_swiglu_kernel"}[case]
        assert all(want in g for g in graphs), (name, graphs)


def test_a_compiled_step_over_packed_batches_compiles_once():
    """Packed (varlen) training: a packing loader's batches change total tokens, sequence count and max_seqlen every
    step. Nothing on the varlen path may specialise a graph on them (until 2026-12-04 the launchers' int(max_seqlen)
    did, and the cu_seqlens check's message formatted the total: a graph per batch, then fullgraph's recompile
    limit): automatic dynamic shapes compile the forward twice (static, then dynamic), dynamic=True once, for
    flash_attn_varlen_func and varlen RoPE, each graph with the cu_seqlens check and the op's kernel."""
    res = _trace("--packed")
    assert sorted(res) == ["attention/automatic", "attention/dynamic", "rope/automatic", "rope/dynamic"]
    for name, out in res.items():
        assert "error" not in out, (name, out.get("error"))
        case, mode = name.split("/")
        forward = out["forward"]
        assert 1 <= len(forward) <= (2 if mode == "automatic" else 1), (name, forward)
        kernel = "_attn_fwd" if case == "attention" else "_rotary_kernel"
        assert all(g == ["_cu_seqlens_check", kernel] for g in forward), (name, forward)


def test_every_case_traces_with_dynamic_shapes(traced_dynamic):
    """torch.compile(dynamic=True): every size symbolic, head dims included (a dynamic head dim reaching a
    constant-result dispatch call graph-broke the patched SDPA and the decode step until 2026-12-01)."""
    errors = {case: res["error"][:500] for case, res in traced_dynamic.items() if "error" in res}
    assert not errors, errors
    assert len(traced_dynamic) >= 12


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_tma_kernels_trace_with_only_their_outputs_written(dynamic):
    """The attention kernels with TMA tiles (streamed tiles through device-side tensor descriptors, sm_90's
    tuning candidates): the kernels are in the graphs, and torch's TTIR analysis takes only their outputs as
    written (an input taken as written would be cloned every call)."""
    res = _trace("--tma", *(["--dynamic"] if dynamic else []), "attention-causal", "flash-gqa", "varlen")
    for case, out in res.items():
        assert "error" not in out, (case, out.get("error"))
        assert "_attn_fwd" in out["kernels"][0] and set(BWD) <= set(out["kernels"][1])
        assert sorted(out["written"]["_attn_fwd"]) == ["L2", "M2", "O"], (case, out["written"])
        assert out["written"]["_attn_bwd_dkdv"] == ["DK", "DV"] and out["written"]["_attn_bwd_dq"] == ["DQ"], case
        assert out["tma"] == ["_attn_bwd_dkdv", "_attn_bwd_dq", "_attn_fwd"], case  # the descriptor kernels
    assert len(res) == 3


def _steps(flag) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "FLASHTX_INTERPRET")}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run([sys.executable, "-m", "flashtx.testing_gpu_steps", flag], capture_output=True, text=True,
                          env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def test_compiled_steps_do_not_compile_a_graph_per_value():
    """A decoding step's RoPE offset (an int, the cache length), position_ids over changing lengths, per-sequence
    offsets over changing batches, and a paged step whose block table widens: automatic shapes compile twice at most
    (static, then dynamic), dynamic=True once. Until 2026-12-04 an int() of the offset, f-string error messages and
    the decode check's int() of sizes made a graph per step, dynamic=True too; until 2026-12-05 the RoPE module
    compiled twice with dynamic=True (its tables were built by its first call, inside the first graph)."""
    res = _steps("--graphs")
    for name, out in res.items():
        assert "error" not in out, (name, out.get("error"))
        case, mode = name.split("/")
        most = 2 if mode == "automatic" else 1
        assert 1 <= len(out["graphs"]) <= most, (name, out["graphs"])


def test_value_reading_calls_trace_under_fullgraph():
    """In-place q/k RoPE (its overlap test reads pointers), nn.RotaryEmbedding with position_ids or tensor offsets
    (eager sizes its tables from their max), varlen RoPE without max_seqlen (eager reads it from cu_seqlens) and a
    max_seqlen read with .item() (an unbacked size): each traces in one graph with its kernels; the RoPE module, whose
    tables are not grown there, asserts on the device that the positions fall in them. A training step over
    unpad_input's packed batch (its total an unbacked size: RoPE, attention and SwiGLU on the packed tokens) traces
    forward and backward, and so does RoPE bounded by a host int over that total: until 2026-12-05 the launchers'
    empty-input early outs, row-count tile choices and min(max_seqlen, total) guarded on it."""
    res = _steps("--traces")
    want = {"rope-qk-inplace": ["_rotary_kernel"], "rope-module-position-ids": ["_rotary_kernel"],
            "rope-module-tensor-offsets": ["_rotary_kernel"],
            "rope-varlen-no-max-seqlen": ["_cu_seqlens_check", "_rotary_kernel"],
            "varlen-max-seqlen-item": ["_cu_seqlens_check", "_attn_fwd"],
            "unpad-rope-host-max-seqlen": ["_cu_seqlens_check", "_rotary_kernel"],
            "unpad-varlen-pad-train": (["_cu_seqlens_check", "_rotary_kernel", "_cu_seqlens_check", "_attn_fwd",
                                        "_swiglu_kernel"],
                                       ["_cu_seqlens_check", "_cu_seqlens_check", "_swiglu_kernel",
                                        "_attn_bwd_preprocess", "_attn_bwd_dkdv", "_attn_bwd_dq", "_rotary_kernel"])}
    assert sorted(res) == sorted(want)
    def checks_once(graph):  # (torch 2.11 merges the backward's two cu_seqlens checks, of RoPE's and attention's)
        return [k for i, k in enumerate(graph) if k != "_cu_seqlens_check" or k not in graph[:i]]

    for case, kernels in want.items():
        assert "error" not in res[case], (case, res[case].get("error"))
        fwd, *bwd = kernels if isinstance(kernels, tuple) else [kernels]
        got_fwd, *got_bwd = res[case]["kernels"]
        assert got_fwd == fwd and [checks_once(g) for g in got_bwd] == [checks_once(g) for g in bwd], \
            (case, res[case]["kernels"])
    for case in ("rope-module-position-ids", "rope-module-tensor-offsets"):  # positions past the tables: asserted
        assert res[case]["asserts"] == [1], (case, res[case]["asserts"])


def test_compiled_nn_decoding_writes_the_caches_in_place():
    """flashtx.nn's decode step under Inductor: after its reinplacing pass no kernel argument is cloned, so the KV
    caches are appended in place (until 2026-12-04 KVCache's (B, Hkv, L, D) buffers went to the decode op as
    transposed views, which Inductor cloned and copied back whole on every step). Every input the step mutates (the
    K/V buffers, the lengths) is a static address, so mode="reduce-overhead" can capture it in a CUDA graph (until
    2026-12-05 none was: CUDA-graph trees skip a graph that mutates a non-static input)."""
    res = _steps("--reinplace")
    for case in ("nn-decode", "nn-paged-decode"):
        out = res[case]
        assert "error" not in out, (case, out.get("error"))
        assert "_kv_append" in out["cloned"] and not any(out["cloned"].values()), (case, out["cloned"])
        assert out["mutated_not_static"] == [], (case, out)


def test_compiled_training_steps_clone_no_kernel_argument():
    """A compiled training step through flashtx.nn (a TransformerBlock: RoPE, attention, packed SwiGLU; and a split
    SwiGLU), forward and backward, after Inductor's reinplacing pass: every kernel writes its own buffers, none is
    cloned. Until 2026-12-05 packed SwiGLU's in-place backward (flashtx.nn's default) wrote over its saved input,
    which a compiled backward may not mutate, so Inductor cloned the (tokens, 2H) projection output every step."""
    res = _steps("--train-clones")
    want = {"nn-block-train": (["_rotary_kernel", "_attn_fwd", "_swiglu_kernel"],
                               ["_swiglu_kernel", "_attn_bwd_preprocess", "_attn_bwd_dkdv", "_attn_bwd_dq",
                                "_rotary_kernel"]),
            "nn-swiglu-split-train": (["_swiglu_kernel"], ["_swiglu_kernel"])}
    assert sorted(res) == sorted(want)
    for case, (fwd, bwd) in want.items():
        out = res[case]
        assert "error" not in out, (case, out.get("error"))
        assert [[name for name, _ in g] for g in out["graphs"]] == [fwd, bwd], (case, out["graphs"])
        assert not any(cloned for g in out["graphs"] for _, cloned in g), (case, out["graphs"])
