"""Attention tile tables (triton_kernels/configs.py): per architecture, every entry sourced and
selected on its own architecture, plain launches unaffected by modifier-specific entries.
No compiling here (tests/test_compile.py compiles every entry)."""
import pytest
import torch

from flashtx.triton_kernels import configs
from flashtx.triton_kernels.configs import KNOWN_TARGETS, TABLES, family, select_config

FAMILY_ARCH = {"sm80": 80, "sm86": 86, "sm90": 90}
KERNELS = ("attn_fwd", "attn_bwd_dkdv", "attn_bwd_dq", "attn_bwd_dq_dbias", "attn_scores")


def entries():
    for fam, kernels in TABLES.items():
        for kernel, by_elt in kernels.items():
            for elt, by_bucket in by_elt.items():
                for bucket, cfg in by_bucket.items():
                    yield fam, kernel, elt, bucket, cfg


def test_every_family_has_every_kernel_dtype_and_head_dim():
    for fam in FAMILY_ARCH:
        for kernel in KERNELS:
            for elt in (2, 4):
                # forward and backward also have 192: head dims split in two pieces (launch.head_split), e.g. 128 + 64
                buckets = {64, 128, 256} if kernel == "attn_scores" else {64, 128, 192, 256}
                assert set(TABLES[fam][kernel][elt]) == buckets, (fam, kernel, elt)


def variant_entries(table):
    for fam, kernels in table.items():
        for kernel, by_elt in kernels.items():
            for elt, by_bucket in by_elt.items():
                for bucket, cfg in by_bucket.items():
                    yield fam, kernel, elt, bucket, cfg


@pytest.mark.parametrize("fam,kernel,elt,bucket,cfg", list(entries()),
                         ids=lambda x: "" if hasattr(x, "block_m") else str(x))
def test_each_entry_names_its_source_and_is_what_its_architecture_selects(fam, kernel, elt, bucket, cfg):
    """A plain launch (no score modifier, no visibility mask) gets its architecture's table entry; so does a
    modified or masked one unless MODIFIED / MASKED has an entry for it."""
    assert cfg.reason, "every entry names its source"
    archs = [a for a in KNOWN_TARGETS if family(a) == fam]
    for arch in archs:
        for modified in (False, True):
            for masked in (False, True):
                override = ((modified and _entry(configs.MODIFIED, fam, kernel, elt, bucket))
                            or (masked and _entry(configs.MASKED, fam, kernel, elt, bucket)))
                want = override or cfg
                got = select_config(kernel, bucket, bucket, elt, KNOWN_TARGETS[arch], modified, masked)
                assert got == want, (arch, modified, masked)


@pytest.mark.parametrize("fam,kernel,elt,bucket,cfg", list(variant_entries(configs.FULL)),
                         ids=lambda x: "" if hasattr(x, "block_m") else str(x))
def test_a_full_attention_entry_serves_plain_full_launches_only(fam, kernel, elt, bucket, cfg):
    """configs.FULL's tile goes to a launch with no causal mask, visibility mask or score modifier (an encoder's);
    a causal, masked or modified launch keeps its own (the tables' tile, or MASKED's / MODIFIED's)."""
    for arch in (a for a in KNOWN_TARGETS if family(a) == fam):
        target = KNOWN_TARGETS[arch]
        assert select_config(kernel, bucket, bucket, elt, target, causal=False) == cfg
        assert select_config(kernel, bucket, bucket, elt, target) == TABLES[fam][kernel][elt][bucket] != cfg
        for modified, masked in ((True, False), (False, True), (True, True)):
            assert select_config(kernel, bucket, bucket, elt, target, modified, masked, causal=False) == \
                select_config(kernel, bucket, bucket, elt, target, modified, masked), (modified, masked)


def test_the_planners_pass_causality():
    """plan_backward asks for the full-attention dK/dV tile without a causal mask (sm_90, head dim 128) and the
    causal one with it; the forward and dQ, which have no FULL entry, take the tables' either way."""
    from flashtx.triton_kernels.attention_bwd_launch import plan_backward

    target = KNOWN_TARGETS[90]
    q, k, v, o, do, dq, dk, dv = (torch.empty(1, 2, 256, 128, dtype=torch.bfloat16) for _ in range(8))
    m2, l2, delta = (torch.empty(1, 2, 256) for _ in range(3))
    for causal, want in ((False, configs.FULL["sm90"]["attn_bwd_dkdv"][2][128]),
                         (True, TABLES["sm90"]["attn_bwd_dkdv"][2][128])):
        _, dkdv, dq_launch = plan_backward(do, q, k, v, o, m2, l2, delta, dq, dk, dv, scale=0.1, causal=causal,
                                           bottom_right=False, target=target)
        assert dkdv.config == want and dq_launch.config == TABLES["sm90"]["attn_bwd_dq"][2][128], causal
        assert (dkdv.args["BLOCK_M"], dkdv.args["BLOCK_N"]) == (want.block_m, want.block_n)


def _entry(table, fam, kernel, elt, bucket):
    return table.get(fam, {}).get(kernel, {}).get(elt, {}).get(bucket)


@pytest.mark.parametrize("table", ["MODIFIED", "MASKED", "FULL"])
def test_specialisation_entries_name_their_source_and_fit_their_architecture(table):
    found = list(variant_entries(getattr(configs, table)))
    assert found or table != "MODIFIED", f"{table} has entries for sm_80/86 (compile-swept, spill-free)"
    for fam, kernel, elt, bucket, cfg in found:
        assert cfg.reason, (table, fam, kernel, elt, bucket)
        for arch in (a for a in KNOWN_TARGETS if family(a) == fam):
            target = KNOWN_TARGETS[arch]
            assert configs.estimate_shared_memory(kernel, cfg, bucket, bucket, elt, target) <= target.max_shared


def test_sm89_shares_sm86s_tables_and_sm90_is_hopper():
    assert family(89) == family(86) == "sm86" and family(80) == "sm80" and family(90) == "sm90"


def test_fp32_large_head_dims_have_backward_configs_on_sm90():
    """Coverage: float32 D=160-256 (bucket 256) no longer falls back to the reference on an H100/H200."""
    for kernel in KERNELS:
        assert select_config(kernel, 256, 256, 4, KNOWN_TARGETS[90]) is not None
        assert select_config(kernel, 256, 256, 4, KNOWN_TARGETS[86]) is not None


@pytest.mark.parametrize("table,flags", [("MODIFIED", (True, False)), ("MASKED", (False, True))])
def test_a_specialisation_entry_never_changes_the_plain_selection(monkeypatch, table, flags):
    small = configs.TileConfig(16, 16, 4, 1, "test: trimmed for one specialisation")
    for name in ("MODIFIED", "MASKED"):  # only the table under test has an sm_90 entry
        monkeypatch.setitem(getattr(configs, name), "sm90", {})
    monkeypatch.setitem(getattr(configs, table), "sm90", {"attn_fwd": {2: {128: small}}})
    configs._select.cache_clear()
    try:
        assert select_config("attn_fwd", 128, 128, 2, KNOWN_TARGETS[90], *flags) == small
        assert select_config("attn_fwd", 128, 128, 2, KNOWN_TARGETS[90], True, True) == small  # both: it applies
        assert select_config("attn_fwd", 128, 128, 2, KNOWN_TARGETS[90]) == TABLES["sm90"]["attn_fwd"][2][128]
    finally:
        configs._select.cache_clear()


def test_launchers_pass_the_specialisation_they_compile():
    """The forward planner asks for MASKED's tile under a window and MODIFIED's under softcap (sm_86's tables)."""
    import torch

    from flashtx.triton_kernels.attention_fwd import plan_forward
    from flashtx.triton_kernels.mask_spec import MaskSpec

    q = torch.empty(1, 2, 128, 64, dtype=torch.float16)
    m2 = torch.empty(1, 2, 128)
    target = KNOWN_TARGETS[86]
    for spec, table in ((MaskSpec(window=(32, 0)), configs.MASKED), (MaskSpec(softcap=5.0), configs.MODIFIED)):
        want = table["sm86"]["attn_fwd"][2][64]
        got = plan_forward(q, q, q, q, m2, m2, scale=0.125, causal=True, bottom_right=False, spec=spec,
                           target=target).config
        assert got == want, (spec.describe(), got, want)


def test_fit_rows_cuts_a_q_tile_a_short_sequence_cannot_fill():
    """configs.fit_rows: a tile of more than 64 rows over at most 64 rows of a sequence becomes 64 rows, with the
    table's K/V rows, warps and stages; longer sequences, tiles of 64 rows or fewer and symbolic sizes keep the tile."""
    C = configs.TileConfig
    for rows in (1, 49, 64):
        got = configs.fit_rows(C(128, 64, 8, 3, "t"), rows)
        assert (got.block_m, got.block_n, got.num_warps, got.num_stages) == (64, 64, 8, 3) and "fit_rows" in got.reason
    for cfg, rows in ((C(128, 64, 8, 3, "t"), 65), (C(64, 128, 8, 2, "t"), 3), (C(16, 64, 4, 1, "t"), 1)):
        assert configs.fit_rows(cfg, rows) is cfg
    assert configs.fit_rows(C(128, 64, 8, 3, "t"), 0).block_m == 128  # (no rows: nothing to fit)
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    assert configs.fit_rows(C(128, 64, 8, 3, "t"), ShapeEnv().create_unbacked_symint()).block_m == 128


@pytest.mark.parametrize("arch", [80, 86, 90])
def test_a_short_sequence_plans_cut_tiles_and_a_long_one_the_tables(arch):
    """The forward and backward planners cut the GPU's 128-row tiles for a 49-token sequence (Swin's windows) and keep
    the tables' tiles at 128 tokens."""
    from flashtx.triton_kernels.attention_bwd_launch import plan_backward
    from flashtx.triton_kernels.attention_fwd import plan_forward

    target = KNOWN_TARGETS[arch]
    for S, cut in ((49, True), (128, False)):
        q = torch.empty(2, 3, S, 64, dtype=torch.float16)
        rows = torch.empty(2, 3, S)
        fwd = plan_forward(q, q, q, q, rows, rows, scale=0.125, causal=False, bottom_right=False, target=target)
        bwd = plan_backward(q, q, q, q, q, rows, rows, rows, q, q, q, scale=0.125, causal=False, bottom_right=False,
                            target=target)
        for launch, kernel in ((fwd, "attn_fwd"), (bwd[1], "attn_bwd_dkdv"), (bwd[2], "attn_bwd_dq")):
            table = select_config(kernel, 64, 64, 2, target, causal=False)
            assert launch.config == (configs.fit_rows(table, S) if cut else table), (S, kernel)
        assert (fwd.config.block_m == 64) is cut  # (every table's D = 64 forward tile is 128 rows)


def test_a_short_masked_sequence_cuts_the_dkdv_q_rows():
    """sm_80's masked dK/dV tile at head dim 64 streams 128 q rows (configs.MASKED): at 49 tokens its planner cuts
    them to 64, with the tile's 32 K/V rows, 8 warps and 3 stages; at 128 it keeps them."""
    from flashtx.triton_kernels.attention_bwd_launch import plan_backward
    from flashtx.triton_kernels.mask_spec import MaskSpec

    target = KNOWN_TARGETS[80]
    table = configs.MASKED["sm80"]["attn_bwd_dkdv"][2][64]
    assert (table.block_m, table.block_n, table.num_warps, table.num_stages) == (128, 32, 8, 3)
    for S, rows in ((49, 64), (128, 128)):
        q = torch.empty(1, 2, S, 64, dtype=torch.float16)
        m = torch.empty(1, 2, S)
        dkdv = plan_backward(q, q, q, q, q, m, m, m, q, q, q, scale=0.125, causal=True, bottom_right=False,
                             spec=MaskSpec(window=(16, 0)), target=target)[1]
        assert (dkdv.args["BLOCK_M"], dkdv.args["BLOCK_N"], dkdv.config.num_warps, dkdv.config.num_stages) == (
            rows, 32, 8, 3), S


def test_an_unknown_small_part_falls_back_to_entries_that_fit():
    tiny = configs.Target(87, 101_376)  # e.g. a Jetson part read from the driver: sm86's tables fit
    assert select_config("attn_bwd_dkdv", 128, 128, 2, tiny) == TABLES["sm86"]["attn_bwd_dkdv"][2][128]
    with pytest.raises(RuntimeError, match="no attn_fwd config fits"):
        select_config("attn_fwd", 256, 256, 4, configs.Target(90, 10_000))


def test_cuda_target_reads_the_device_properties(monkeypatch):
    """The Target of a CUDA device (a stand-in for torch.cuda.get_device_properties): its arch, the opt-in shared
    memory per block and the SM count; a torch without the opt-in field falls back to the arch's table value."""
    import types

    from flashtx.triton_kernels import configs as cfgs

    props = {0: types.SimpleNamespace(major=8, minor=6, shared_memory_per_block_optin=101_376, multi_processor_count=82),
             1: types.SimpleNamespace(major=9, minor=0, multi_processor_count=132)}  # no opt-in field
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props[i])
    try:
        cfgs.cuda_target.cache_clear()
        assert cfgs.cuda_target(0) == cfgs.Target(86, 101_376, sm_count=82)
        assert cfgs.cuda_target(1) == cfgs.Target(90, cfgs.KNOWN_TARGETS[90].max_shared, sm_count=132)
    finally:
        cfgs.cuda_target.cache_clear()


@pytest.mark.parametrize("arch", (80, 86, 90))
def test_elementwise_compile_plans_compile_the_full_tiles(arch):
    """The compile check compiles the tallest RoPE and SwiGLU tiles real shapes launch, not tiles clipped to the
    plans' own small shapes: every width's SwiGLU tile at many rows (16 x 256 at 256 and 11008 columns: plans
    of 8 rows compiled 8 x 256 only), every q and k RoPE tile at long sequences (32 positions x 2 heads at D=64),
    and the Hugging Face call."""
    from flashtx.triton_kernels import rotary, swiglu

    target = KNOWN_TARGETS[arch]
    sw = {(label, (l.config.block_rows, l.config.block_cols)) for label, l in swiglu.compile_plans(target)}
    for h in (256, 5000, 11008, 14336, 28672):
        full = configs.swiglu_config(h, 1 << 20, target)
        assert (f"swiglu_fwd_h{h}_torch.float16", (full.block_rows, full.block_cols)) in sw, (h, full)
    plans = dict(rotary.compile_plans(target))
    for d in (64, 128, 256):
        for hq, hk in ((32, 8), (8, 2)):
            launch = plans[f"rotary_qk_fwd_half_h{hq}x{hk}_d{d}_torch.float16"]
            for heads, prefix in ((hq, "q"), (hk, "k")):
                full = configs.rotary_config(d // 2, heads, 1 << 20, target)
                got = (launch.args[f"BLOCK_S{prefix.upper()}"], launch.args[f"BLOCK_H{prefix.upper()}"])
                assert got == (full.block_rows, full.block_cols), (d, hq, hk, prefix, got, full)
        assert f"rotary_hf_qk_bhsd_d{d}_torch.bfloat16" in plans


def test_the_interpreters_elementwise_tiles_split_every_width_into_several():
    """The interpreter keeps its tiny RoPE/SwiGLU tiles at test-sized widths (every mask of several tiles), and
    splits a wide head count or row into at most INTERPRETER_TILES power-of-two tiles, more than half that many
    (the interpreter runs programs one after another: 32 heads were 16 tiles)."""
    from flashtx.triton_kernels.targets import INTERPRETER_TARGET

    n = configs.INTERPRETER_TILES
    for make, base, widths in ((lambda w: configs.rotary_config(32, w, 1 << 20, INTERPRETER_TARGET),
                                configs.ROTARY_INTERPRETER, range(1, 70)),
                               (lambda w: configs.swiglu_config(w, 1 << 20, INTERPRETER_TARGET),
                                configs.SWIGLU_INTERPRETER, range(1, 300))):
        for w in widths:
            cfg = make(w)
            cols, tiles = cfg.block_cols, -(-w // cfg.block_cols)
            assert cfg.block_rows == base.block_rows and cols & (cols - 1) == 0, (w, cfg)
            if w <= n * base.block_cols:
                assert cfg == base, (w, cfg)  # test-sized widths: the tiny tiles
            else:
                assert cols > base.block_cols and n // 2 < tiles <= n, (w, cfg)
    assert configs.rotary_config(32, 32, 128, INTERPRETER_TARGET).block_cols == 8  # q of LLaMA: 4 head tiles
    assert configs.swiglu_config(224, 256, INTERPRETER_TARGET).block_cols == 64  # 64, 64, 64 and 32 columns


@pytest.mark.parametrize("batch,ctx,d,splits", [(8, 8192, 128, 4), (1, 8192, 128, 32), (64, 8192, 128, 1),
                                                (8, 8192, 64, 4), (8, 256, 128, 2), (4, 8192, 128, 7)])
def test_decode_splits_follow_flash_attn_2(batch, ctx, d, splits):
    """The decode split count is flash-attn 2's for the same grid (B x Hkv GQA-packed programs, Hq/Hkv = 32/8 as
    LLaMA-3-8B) on an H100: its heuristic over 2 programs an SM (flash_api.cpp's multiProcessorCount * 2) and the
    tile's key tiles (flash-attn's kBlockN, 128 at D = 128), skipping counts that leave splits without a tile (64
    tiles: 32 splits, not 29); e.g. 4 splits at B = 8 (256 programs, ~2 an SM), where counting one an SM gave 2;
    never more splits than key tiles. The counts are flash-attn's, worked out from its C++ by hand."""
    from flashtx.triton_kernels import decode

    target = KNOWN_TARGETS[90]
    cfg = configs.decode_config(d, d, 2, target)
    assert configs.decode_programs_per_sm(cfg, d, d, 2, target) == 2 and cfg.block_n == 128
    q = torch.empty(batch, 1, 32, d, dtype=torch.float16)
    cache = torch.empty(batch, ctx, 8, d, dtype=torch.float16)
    assert decode.split_count(q, cache, cache, None, 0, target) == splits


def test_decode_counts_the_programs_an_sms_shared_memory_holds():
    """An RTX 3090's SM holds one 16-bit decode program at head dim 128 (~80 KB by the estimate, of 101,376 bytes),
    so its split count counts 82 slots, not flash-attn's 164; an H100's holds two (the 4 warps' limit)."""
    from flashtx.triton_kernels import decode

    q = torch.empty(8, 1, 32, 128, dtype=torch.float16)
    cache = torch.empty(8, 8192, 8, 128, dtype=torch.float16)
    for arch, per_sm in ((86, 1), (80, 2), (90, 2)):
        target = KNOWN_TARGETS[arch]
        cfg = configs.decode_config(128, 128, 2, target)
        assert configs.decode_programs_per_sm(cfg, 128, 128, 2, target) == per_sm, arch
        assert decode.split_count(q, cache, cache, None, 0, target) == decode.num_splits_heuristic(
            64, per_sm * target.sm_count, 8192 // cfg.block_n, decode.MAX_SPLITS), arch


@pytest.mark.parametrize("S", [113, 128])
@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.float16, torch.float32])
def test_launch_estimates_count_the_attn_mask_tile(mask_dtype, S):
    """The forward, dK/dV, dQ and probabilities launches with an attn_mask estimate the (block_m, block_n) mask tile
    Triton stages at key counts (and mask strides) that are not multiples of 16 (compile_check --seqlen 113) or for a
    mask in another dtype than q's (2 bytes an element more than twice the mask's); with an fp16 mask at 128, the
    variant the compile check builds, and without a mask they do not."""
    from flashtx.triton_kernels.attention_bwd_launch import plan_backward
    from flashtx.triton_kernels.attention_common import MaskSpec
    from flashtx.triton_kernels.attention_fwd import plan_forward
    from flashtx.triton_kernels.attention_scores import plan_probs

    target = KNOWN_TARGETS[86]
    B, H, d = 1, 2, 64
    q, k, v, o, do, dq, dk, dv = (torch.empty(B, H, S, d, dtype=torch.float16) for _ in range(8))
    m2, l2, delta = (torch.empty(B, H, S, dtype=torch.float32) for _ in range(3))
    mask = torch.zeros(B, H, S, S, dtype=mask_dtype)
    staged = S % 16 or mask_dtype != torch.float16
    for spec, elt in ((MaskSpec(attn_mask=mask), 2 * mask.element_size() + 2 if staged else 0),
                      (MaskSpec(softcap=30.0), 0)):
        fwd = plan_forward(q, k, v, o, m2, l2, scale=0.125, causal=True, bottom_right=False, spec=spec, target=target)
        _, dkdv, dqk = plan_backward(do, q, k, v, o, m2, l2, delta, dq, dk, dv, scale=0.125, causal=True,
                                     bottom_right=False, spec=spec, target=target)
        probs = plan_probs(q, k, m2, l2, torch.empty(B, H, S, S), scale=0.125, causal=True, bottom_right=False,
                           spec=spec, target=target)
        for launch, kernel in ((fwd, "attn_fwd"), (dkdv, "attn_bwd_dkdv"), (dqk, "attn_bwd_dq"),
                               (probs, "attn_scores")):
            c = launch.config
            tiles = configs.estimate_shared_memory(kernel, c, d, d, 2, target)
            assert launch.shared_estimate == tiles + c.block_m * c.block_n * elt, (kernel, spec)


@pytest.mark.parametrize("arch", [80, 86, 90])
def test_a_learned_mask_wider_than_q_takes_the_fp32_bias_gradient_tile(arch):
    """fp16 q with an fp32 (or fp64) learned attn_mask: the bias-gradient dQ stages the mask like an fp32 launch, and
    sm_90's 16-bit tile at head dim 128 needed 262,144 bytes of 232,448 with it (compile check, "mask-float32"), so
    it takes the fp32 table's tile; a mask in q's dtype keeps the 16-bit one. Its launch estimate fits the GPU."""
    from flashtx.triton_kernels.attention_bwd_launch import plan_backward
    from flashtx.triton_kernels.attention_common import MaskSpec

    target = KNOWN_TARGETS[arch]
    B, H, S, d = 1, 2, 128, 128
    q, k, v, o, do, dq, dk, dv = (torch.empty(B, H, S, d, dtype=torch.float16) for _ in range(8))
    m2, l2, delta = (torch.empty(B, H, S, dtype=torch.float32) for _ in range(3))
    for mdt, elt in ((torch.float16, 2), (torch.float32, 4), (torch.float64, 4)):
        mask = torch.empty(1, H, S, S, dtype=mdt)
        launches = plan_backward(do, q, k, v, o, m2, l2, delta, dq, dk, dv, scale=d ** -0.5, causal=True,
                                 bottom_right=False, spec=MaskSpec(attn_mask=mask), dbias=torch.empty_like(mask),
                                 target=target)
        dqk = next(st for st in launches if getattr(getattr(st, "kernel", None), "__name__", "") == "_attn_bwd_dq")
        want = select_config("attn_bwd_dq_dbias", d, d, elt, target, True, False, True)
        assert (dqk.config.block_m, dqk.config.block_n, dqk.config.num_warps, dqk.config.num_stages) == (
            want.block_m, want.block_n, want.num_warps, want.num_stages), (mdt, dqk.config)
        assert dqk.shared_estimate <= target.max_shared, (mdt, dqk.shared_estimate)
