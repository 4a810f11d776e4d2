"""tile_sweep (the compile sweep behind configs.py's COMPILE_SWEEP entries): its grid, ranking and
parsing, and one real compile for sm_86 in a subprocess (the sweep compiles; conftest interprets)."""
import json
import os
import subprocess
import sys

import pytest

from flashtx.triton_kernels import tile_sweep
from flashtx.triton_kernels.configs import KNOWN_TARGETS, TileConfig, estimate_shared_memory


@pytest.mark.parametrize("label,kernel", [
    ("attn_fwd D=64 float16 causal=True", "attn_fwd"),
    ("attn_bwd_dkdv+gqa-split D=128 float16 causal", "attn_bwd_dkdv"),
    ("attn_bwd_dq+dbias D=64 float16 2x1x1x128", "attn_bwd_dq_dbias"),
    ("attn_bwd_dq D=192/128 float16 causal=True", "attn_bwd_dq"),
])
def test_labels_map_to_their_config_kernel(label, kernel):
    assert tile_sweep.kernel_of(label) == kernel


@pytest.mark.parametrize("arch", [80, 86, 90])
def test_the_grid_holds_only_tiles_that_fit(arch):
    target = KNOWN_TARGETS[arch]
    for label in ("attn_fwd D=128 float16 causal=True", "attn_bwd_dkdv D=64 bfloat16 all-options",
                  "attn_bwd_dq D=128 float32 causal=True"):
        grid = tile_sweep.grid(label, target)
        assert grid, label
        d, elt = int(label.split()[1][2:]), 4 if "float32" in label else 2
        for cfg in grid:
            assert estimate_shared_memory(tile_sweep.kernel_of(label), cfg, d, d, elt, target) <= target.max_shared
            assert elt == 4 or min(cfg.block_m, cfg.block_n) >= 32, cfg  # 16-row tiles only for fp32


def test_parse_config_round_trips_and_names_the_bad_text():
    assert tile_sweep.parse_config("128x64w4s3") == TileConfig(128, 64, 4, 3, "tile_sweep")
    with pytest.raises(ValueError, match=r"--configs: expected MxNwWsS .* got '128x64'"):
        tile_sweep.parse_config("128x64")


def test_ranked_puts_spill_free_first_then_the_most_work():
    rows = [dict(block_m=128, block_n=128, num_stages=2, num_warps=4, spill=64),
            dict(block_m=64, block_n=64, num_stages=2, num_warps=4, spill=0),
            dict(block_m=128, block_n=64, num_stages=3, num_warps=8, spill=0),
            dict(block_m=128, block_n=64, num_stages=2, num_warps=8, spill=0),
            dict(block_m=32, block_n=32, num_stages=1, num_warps=4, spill=-1)]  # failed to compile: dropped
    order = [(r["block_m"], r["block_n"], r["num_stages"]) for r in tile_sweep.ranked(rows)]
    assert order == [(128, 64, 3), (128, 64, 2), (64, 64, 2), (128, 128, 2)]


def test_one_candidate_compiles_for_sm86_with_its_resources():
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "FLASHTX_INTERPRET")}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    code = ("import json; from flashtx.triton_kernels.tile_sweep import _one; "
            "print(json.dumps(_one(86, 'attn_fwd D=64 float16 causal=True', 64, 32, 4, 2)))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    row = json.loads(proc.stdout.strip().splitlines()[-1])
    assert row["config"] == "M64 N32 w4 s2" and not row.get("error"), row
    assert 0 < row["shared"] <= KNOWN_TARGETS[86].max_shared and 0 < row["registers"] <= 255 and row["spill"] >= 0
    assert row["mma"] == "mma", row  # sm_86's tensor cores: mma.sync, never wgmma


def test_mma_kind_names_the_tensor_core_instructions():
    from flashtx.triton_kernels.compile_check import mma_kind

    wgmma = "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {%r1}, %rd2, %rd3;"
    sync = "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%f1}, {%r1}, {%r2}, {%f2};"
    assert mma_kind(wgmma) == "wgmma" and mma_kind(sync) == "mma"
    assert mma_kind(wgmma + "\n" + sync) == "wgmma+mma" and mma_kind("fma.rn.f32 %f1, %f2, %f3, %f4;") == "-"


def test_ptx_digest_sees_code_not_debug_info():
    from flashtx.triton_kernels.compile_check import Result, compare, ptx_digest

    code = ["\tld.global.v4.b32 {%r1, %r2, %r3, %r4}, [%rd1];", "$L__BB0_2:", "\tadd.s32 %r5, %r1, %r2;",
            "\tbra.uni $L__BB0_2;"]
    plain = "\n".join(code[:1] + [".loc 1 40 12", "$L__tmp3:"] + code[1:] + [".section\t.debug_info", "{ 1 }"])
    # another source layout: other line numbers, another file, one more inlined call's labels, other debug data
    moved = "\n".join(['.file 2 "/x/helpers.py"', "$L__tmp0:", "$L__tmp1:"] + code[:2] + [".loc 2 7 3", "// c"]
                      + code[2:] + [".section\t.debug_abbrev", "{ 9 }"])
    assert ptx_digest(plain) == ptx_digest(moved)
    for i, changed in ((0, "\tld.global.v2.b32 {%r1, %r2}, [%rd1];"), (2, "\tadd.s32 %r5, %r1, %r3;"),
                       (3, "\tbra.uni $L__BB0_3;")):  # a narrower load, another register, another branch target
        assert ptx_digest("\n".join(code[:i] + [changed] + code[i + 1:])) != ptx_digest(plain), changed

    def res(label, digest):
        return Result(label, 90, 1, 2, 3, 0, "-", ptx_digest=digest)

    old = [{"label": "a", "arch": 90, "ptx_digest": "d1"}, {"label": "b", "arch": 90, "ptx_digest": "d2"}]
    assert compare([res("a", "d1"), res("b", "d3"), res("c", "d4")], old) == ["changed   sm_90 b", "new       sm_90 c"]
    assert compare([res("a", "d1")], old) == []
