"""The launch caches of the elementwise kernels (RoPE, SwiGLU) and the eager backend cache: a cached
plan equals the one built from scratch, for every target and row count, and the caches hold no
entry per token count."""
import torch

from conftest import DEVICE

from flashtx import _dispatch
from flashtx.triton_kernels import configs, launch
from flashtx.triton_kernels import rotary as rotary_kernels
from flashtx.triton_kernels import swiglu as swiglu_kernels

TARGETS = [configs.INTERPRETER_TARGET, *configs.KNOWN_TARGETS.values()]


def test_pow2_bucket_is_min_of_cap_and_next_power_of_two():
    for cap in (1, 2, 4, 16, 2048):
        for n in range(-1, 3000):
            assert launch.pow2_bucket(n, cap) == min(cap, 1 << (max(n, 1) - 1).bit_length()), (n, cap)


def test_swiglu_cached_plan_matches_config_for_every_row_count():
    for target in TARGETS:
        for hidden in (1, 3, 16, 40, 256, 5000, 11008, 14336):
            for dtype in (torch.float16, torch.float32, torch.float64):
                for backward in (False, True):
                    for rows in (0, 1, 2, 3, 5, 8, 9, 100, 4096, 1 << 20):
                        st = swiglu_kernels._static(hidden, rows, dtype, backward, target)
                        cfg = configs.swiglu_config(hidden, rows, target)
                        assert st.cfg == cfg, (target, hidden, rows)
                        assert st.consts == dict(BLOCK_M=cfg.block_rows, BLOCK_H=cfg.block_cols, BACKWARD=backward,
                                                 FAST_EXP=dtype != torch.float64, ACC=launch.ACC_DTYPE[dtype],
                                                 PACKED=False)
                        assert st.n_h_tiles == -(-hidden // cfg.block_cols)


def test_swiglu_launch_args_do_not_depend_on_call_history():
    """The same call planned on a cold and on a warm cache gives the same launch."""
    g, u = torch.randn(5, 40), torch.randn(5, 40)
    out = torch.empty(5, 40)
    swiglu_kernels._STATIC.clear()
    cold = swiglu_kernels.plan_swiglu(g, u, out, target=configs.KNOWN_TARGETS[90])
    for rows in (1, 2, 3, 64, 5):  # warm it with other row counts and dtypes
        swiglu_kernels.plan_swiglu(g[:rows].double(), u[:rows].double(), out[:rows].double(),
                                   target=configs.KNOWN_TARGETS[90])
    warm = swiglu_kernels.plan_swiglu(g, u, out, target=configs.KNOWN_TARGETS[90])
    assert (cold.grid, cold.args, cold.config) == (warm.grid, warm.args, warm.config)
    assert len(swiglu_kernels._STATIC) == 2  # one entry per (hidden, dtype, direction, target), none per row count


def test_backend_by_device_answers_as_plan_kinds_and_is_cleared_with_the_plans():
    """plan_device keys on everything plan_kinds reads (requested backend, device, kinds): answers that
    differ by any of them stay apart however the cache was warmed."""
    import warnings

    dev = torch.device(DEVICE)
    cases = [("swiglu", None, (torch.float32,)), ("swiglu", "reference", (torch.float32,)),
             ("swiglu", None, (torch.float64,)), ("rotary", None, (torch.float32, torch.float32)),
             ("rotary", None, (torch.float32, torch.bfloat16)), ("rotary", "reference", (torch.float32, torch.float32))]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the bfloat16-table fallback warns on CPU
        for order in (cases, cases[::-1]):
            _dispatch.clear_plans()
            assert not _dispatch._BY_DEVICE
            got = {c: _dispatch.plan_device(c[0], c[1], dev, *c[2]) for c in order}
            _dispatch.clear_plans()
            want = {c: _dispatch.plan_kinds(c[0], c[1], dev.type, dev.index, *c[2]) for c in order}
            assert got == want
    assert want[cases[1]] == "reference" and want[cases[5]] == "reference"


def test_clear_plans_forgets_every_cache_that_follows_the_plans():
    """What switches (launch.SPLIT_HEAD_DIMS, a stood-in target) change is forgotten with the plans: the patched
    SDPA's per-kind reasons and the decode split counts too, not only the backends, launches and lanes."""
    import flashtx
    from flashtx import sdpa_patch
    from flashtx.triton_kernels import decode as decode_kernels

    sdpa_patch._fast_reason("cpu", None, torch.float32, 16, 16, False, 0)
    q = torch.randn(1, 1, 2, 16, device=DEVICE)
    kc = torch.randn(1, 8, 2, 16, device=DEVICE)
    flashtx.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=torch.tensor([5], dtype=torch.int32, device=DEVICE))
    assert sdpa_patch._FAST_REASONS and decode_kernels._SPLITS
    _dispatch.clear_plans()
    assert not sdpa_patch._FAST_REASONS and not decode_kernels._SPLITS


def _old_rotary_consts(q, qo, k, cos, seq, interleaved, conjugate, varlen, has_offsets, has_pos, target):
    """The constexprs and head tiles as plan_rotary built them per call before the cache."""
    r2, D, hq = cos.shape[-1], q.shape[-1], q.shape[2]
    hk = k.shape[2] if k is not None else 0
    cq, ck = configs.rotary_config(r2, hq, seq, target), configs.rotary_config(r2, max(hk, 1), seq, target)
    pow2 = rotary_kernels._pow2
    return dict(HQ=hq, HK=hk, R2=r2, D_REST=D - 2 * r2, BLOCK_SQ=cq.block_rows, BLOCK_HQ=cq.block_cols,
                BLOCK_SK=ck.block_rows, BLOCK_HK=ck.block_cols, BLOCK_R2=pow2(r2), BLOCK_REST=pow2(D - 2 * r2),
                INTERLEAVED=bool(interleaved), CONJUGATE=bool(conjugate), HAS_K=k is not None, VARLEN=varlen,
                HAS_OFFSETS=has_offsets, HAS_POS=has_pos, COPY_REST=qo is not q and D > 2 * r2,
                ACC=launch.ACC_DTYPE[q.dtype]), cq


def test_rotary_cached_plan_matches_config_for_every_sequence_length():
    rotary_kernels._STATIC.clear()
    for target in TARGETS:
        for hq, hk in ((32, 8), (5, 1), (4, 0)):
            for d, r2 in ((64, 32), (128, 32), (16, 8)):
                for seq in (1, 2, 3, 5, 16, 17, 64, 1000, 1 << 16):
                    q = torch.empty(2, seq, hq, d)
                    k = torch.empty(2, seq, hk, d) if hk else None
                    cos = torch.empty(seq, r2)
                    for interleaved, conjugate, inplace in ((False, False, False), (True, True, True)):
                        qo = q if inplace else torch.empty_like(q)
                        ko = (k if inplace else torch.empty_like(k)) if k is not None else None
                        plan = rotary_kernels.plan_rotary(q, qo, k, ko, cos, cos, interleaved=interleaved,
                                                          conjugate=conjugate, target=target)
                        want, cfg_q = _old_rotary_consts(q, qo, k, cos, seq, interleaved, conjugate, False, False,
                                                         False, target)
                        assert {n: plan.args[n] for n in want} == want, (target, hq, hk, d, seq)
                        assert plan.config == cfg_q
                        n_q = -(-seq // want["BLOCK_SQ"]) * -(-hq // want["BLOCK_HQ"])
                        n_k = -(-seq // want["BLOCK_SK"]) * -(-hk // want["BLOCK_HK"]) if hk else 0
                        assert plan.grid == (n_q + n_k, 2) and plan.args["n_q_progs"] == n_q
    # one entry per key, none per sequence length (the short-sequence variants hang off their entry)
    assert len(rotary_kernels._STATIC) <= len(TARGETS) * 3 * 3 * 2


def test_rotary_layouts_read_the_same_strides_as_views():
    """(B, H, S, D) with heads_first and packed (total, H, D) plan the launch their (B, S, H, D) and
    (1, total, H, D) views planned (what the functional layer passed before)."""
    target = configs.KNOWN_TARGETS[86]
    cos = torch.empty(1, 40, 8)
    bhsd_q, bhsd_k = torch.empty(3, 6, 11, 16)[:, :5], torch.empty(3, 2, 11, 16)
    a = rotary_kernels.plan_rotary(bhsd_q, torch.empty_like(bhsd_q), bhsd_k, bhsd_k, cos[0], cos[0],
                                   heads_first=True, offsets=torch.zeros(3, dtype=torch.int32), target=target)
    qv, kv = bhsd_q.transpose(1, 2), bhsd_k.transpose(1, 2)
    b = rotary_kernels.plan_rotary(qv, torch.empty_like(bhsd_q).transpose(1, 2), kv, kv, cos, cos,
                                   offsets=torch.zeros(3, dtype=torch.int32), target=target)
    tensors = ("Q", "K", "QO", "KO", "COS", "SIN", "OFFSETS", "POS", "CU_SEQLENS")
    assert a.grid == b.grid and a.config == b.config
    assert {n: v for n, v in a.args.items() if n not in tensors} == {n: v for n, v in b.args.items() if n not in tensors}
    packed = torch.empty(30, 4, 16)[:, :3]  # (total, H, D), strided heads
    cu = torch.tensor([0, 10, 30], dtype=torch.int32)
    a = rotary_kernels.plan_rotary(packed, packed, None, None, cos, cos, cu_seqlens=cu, max_seqlen=20, target=target)
    b = rotary_kernels.plan_rotary(packed[None], packed[None], None, None, cos, cos, cu_seqlens=cu, max_seqlen=20,
                                   target=target)
    assert a.grid == b.grid
    assert {n: v for n, v in a.args.items() if n not in tensors} == {n: v for n, v in b.args.items() if n not in tensors}


def _symbolic(value: int):
    """A backed SymInt of hint `value` and its ShapeEnv, as torch.compile makes for a dynamic length."""
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

    env, src = ShapeEnv(), ConstantSource("length")
    sym = env.create_symbol(value, source=src, dynamic_dim=DimDynamic.DYNAMIC)
    return env, env.create_symintnode(sym, hint=value, source=src)


def test_symbolic_lengths_take_the_full_tile_unguarded():
    """A dynamic sequence length / row count takes the full tile with no guard at all: one compiled graph for every
    length. Neither the int() specialisation that made torch.compile's GPU path recompile for every length, nor
    the range guards of a bucket per power of two (a graph per bucket of short lengths or decode batches, which
    multiplied across one model's ops: tests/test_compile_gpu_path.py's varying counts). Ints still shrink."""
    target = configs.KNOWN_TARGETS[86]
    env, seq = _symbolic(12)
    key = (8, 16, 4, 2, torch.float16, False, False, True, False, False, False, True, target)
    st = rotary_kernels._static(key, seq)
    assert st.block_sq == configs.rotary_config(8, 4, 1 << 62, target).block_rows > 12
    assert not env.replacements and not env.guards
    assert rotary_kernels._static(key, 5).block_sq == configs.rotary_config(8, 4, 5, target).block_rows < st.block_sq
    env, rows = _symbolic(3)
    st = swiglu_kernels._static(24, rows, torch.float16, False, target)
    assert st.cfg == configs.swiglu_config(24, 1 << 62, target) and not env.replacements and not env.guards
    assert swiglu_kernels._static(24, 3, torch.float16, False, target).cfg == configs.swiglu_config(24, 3, target)
    assert configs.swiglu_config(24, 3, target) != st.cfg
    env, seq = _symbolic(12)
    configs.rotary_config(8, 4, seq, target)  # what the launcher called per launch before: specialises
    assert env.replacements


def test_decode_row_tiles_guard_one_range_of_a_symbolic_count():
    """The decode kernels' query x head row tile: 16 for a symbolic count up to 16 (one range guard), the largest
    past it, never the count's own value (speculative decoding's query counts: a graph per count until
    2026-12-06); ints keep the exact power of two."""
    from flashtx.triton_kernels.launch import rows_tile

    env, rows = _symbolic(24)
    assert rows_tile(rows, 16, 64) == 64 and not env.replacements and len(env.guards) == 1
    env, rows = _symbolic(6)
    assert rows_tile(rows, 16, 64) == 16 and not env.replacements and len(env.guards) == 1
    assert [rows_tile(n, 16, 64) for n in (0, 1, 16, 17, 32, 33, 64, 65, 999)] == [16, 16, 16, 32, 32, 64, 64, 64, 64]
    assert [rows_tile(n, 1, 16) for n in (0, 1, 2, 3, 5, 9, 16, 17)] == [1, 1, 2, 4, 8, 16, 16, 16]


def test_rotary_autograd_graph_has_no_layout_views():
    """(B, H, S, D) and packed inputs reach the op as they are: its outputs come straight from the op's
    autograd node, whose inputs are the caller's tensors (no Transpose/Unsqueeze/Squeeze backward
    nodes around it; each was an autograd node to run per backward)."""
    import flashtx
    from flashtx.nn import RotaryEmbedding

    cos, sin = RotaryEmbedding(8).cos_sin(16, device=DEVICE)
    cases = [(torch.randn(2, 3, 5, 8, device=DEVICE), torch.randn(2, 1, 5, 8, device=DEVICE), {"layout": "bhsd"}),
             (torch.randn(7, 3, 8, device=DEVICE), torch.randn(7, 1, 8, device=DEVICE),
              {"cu_seqlens": torch.tensor([0, 3, 7], device=DEVICE), "max_seqlen": 4})]
    for q, k, kw in cases:
        q.requires_grad_(True), k.requires_grad_(True)
        qo, ko = flashtx.apply_rotary_qk(q, k, cos, sin, **kw)
        assert qo.grad_fn is ko.grad_fn and qo.stride() == q.stride() and ko.stride() == k.stride()
        inputs = [f for f, _ in qo.grad_fn.next_functions if f is not None]
        assert [type(f).__name__ for f in inputs] == ["AccumulateGrad", "AccumulateGrad"]
        assert inputs[0].variable is q and inputs[1].variable is k
        xo = flashtx.apply_rotary(q, cos, sin, **kw)
        assert [f.variable for f, _ in xo.grad_fn.next_functions if f is not None] == [q]
