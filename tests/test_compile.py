"""Compile check: every kernel config flashtx can launch compiles for sm_80, sm_86 and sm_90
without a GPU, fits that target's shared memory (sm_86: 101,376 bytes a block), and needs no more
shared memory than its launch estimated (configs.estimate_shared_memory, which config selection prunes with; a launch
that reads an attn_mask tile at a length or mask stride that is not a multiple of 16 adds the tile, and those launches
are also compiled at 113 tokens, where Triton compiles another variant). Spills are reported in
the table, not failed (configs.py: only a GPU can weigh them); every attention table entry is compiled
on its own architecture.

The check compiles, so it runs in a subprocess without TRITON_INTERPRET (which conftest sets).
"""
import json
import os
import subprocess
import sys

import pytest

ARCHS = (80, 86, 90)
# the module fixture runs once: its tests share one xdist worker (pytest -n auto --dist loadgroup)
pytestmark = pytest.mark.xdist_group("compile-check")


def _compile_check(tmp_path_factory, *args, timeout: int, archs=ARCHS):
    out = tmp_path_factory.mktemp("compile") / "results.json"
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "FLASHTX_INTERPRET")}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9 warns when unset; 1 is its default
    proc = subprocess.run([sys.executable, "-m", "flashtx.triton_kernels.compile_check", "--json", str(out),
                           *[a for arch in archs for a in ("--arch", str(arch))], *args],
                          capture_output=True, text=True, env=env, timeout=timeout)
    print(proc.stdout)  # the table: kernel, config, target, shared memory, estimate, limit, registers, spills
    assert out.exists(), f"compile check did not run:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc, json.loads(out.read_text())


@pytest.fixture(scope="module")
def compile_results(tmp_path_factory):
    return _compile_check(tmp_path_factory, timeout=3000)  # (cold Triton cache, 2 cores: ~25 min)


@pytest.fixture(scope="module")
def odd_length_results(tmp_path_factory):
    """The launches that read an attn_mask tile, planned at 113 keys (and queries): Triton compiles another variant of
    each kernel where the key count and the mask's row stride are not multiples of 16, and stages the mask tile in
    shared memory there (configs.estimate_shared_memory's mask_elt). Found 2026-12-07 by checking every attention
    plan at 113: only these plans' shared memory differs from 128's (spills differ more widely: reported)."""
    return _compile_check(tmp_path_factory, "--seqlen", "113", "--mask-tiles", timeout=2400)  # (cold: ~12 min)


@pytest.fixture(scope="module")
def ones_results(tmp_path_factory):
    """Each kernel's flags with every runtime int argument 1 (compile_check.ones_plans), for sm_80: Triton compiles
    such an argument as a constant, so the paged decode kernel's `(ROWS - 1).to(...)` failed to compile on a GPU for
    a pool of one page (review, 2026-12-07), a call the interpreter runs."""
    return _compile_check(tmp_path_factory, "--ones", timeout=1200, archs=(80,))  # (cold: ~1 min)


def test_every_kernel_compiles_with_runtime_ints_of_one(ones_results):
    from flashtx.triton_kernels import compile_check
    from flashtx.triton_kernels.configs import KNOWN_TARGETS

    proc, results = ones_results
    bad = [f"{r['label']}: {r['error']}" for r in results if not r["ok"]]
    assert not bad and proc.returncode == 0, "\n".join(bad)
    kernels = {compile_check.kernel_name(launch) for _, launch in compile_check.launch_plans(KNOWN_TARGETS[80])}
    assert len(kernels) >= 10 and len(results) >= len(kernels)  # every kernel function, each flag at least once
    assert any("paged" in r["label"] and r["label"].startswith("decode D=") for r in results)


def test_every_config_compiles_and_fits(compile_results, capsys):
    proc, results = compile_results
    with capsys.disabled():
        print("\n" + proc.stdout)
    bad = [r for r in results if not r["ok"]]
    assert not bad, "configs that fail the compile check:\n" + "\n".join(
        f"{r['label']} sm_{r['arch']} {r['config']}: shared={r['shared']} limit={r['limit']} "
        f"estimate={r['estimate']} spill={r['spill_bytes']} {r['error']}" for r in bad)
    assert proc.returncode == 0


@pytest.mark.parametrize("arch", ARCHS, ids=lambda a: f"sm_{a}")
def test_every_kernel_and_head_dim_is_covered(compile_results, arch):
    """The check covers forward and backward at head dims 64, 128 and 256 in fp16 and bf16."""
    _, results = compile_results
    labels = {r["label"] for r in results if r["arch"] == arch}
    for kernel in ("attn_fwd", "attn_bwd_dkdv", "attn_bwd_dq", "attn_bwd_preprocess"):
        for d in (64, 128, 256):
            for dtype in ("float16", "bfloat16"):
                assert any(l.startswith(f"{kernel} D={d} {dtype}") for l in labels), (kernel, d, dtype, arch)


@pytest.mark.parametrize("arch", ARCHS, ids=lambda a: f"sm_{a}")
def test_every_table_entry_of_the_architecture_is_compiled(compile_results, arch):
    """Each (kernel, dtype size, head-dim bucket) entry of the architecture's table was compiled with
    its own tile (the compile cases span every kernel at head dims 64/128/256 in fp16 and fp32)."""
    from flashtx.triton_kernels.configs import FULL, MASKED, MODIFIED, TABLES, family

    _, results = compile_results
    seen = {tuple(r["label"].split()[:3]) + (r["config"],) for r in results if r["arch"] == arch and r["ok"]}
    dtypes = {2: ("float16", "bfloat16"), 4: ("float32",)}
    for kernel in ("attn_fwd", "attn_bwd_dkdv", "attn_bwd_dq"):
        for elt, by_bucket in TABLES[family(arch)][kernel].items():
            for d, c in by_bucket.items():
                cfg = f"M{c.block_m} N{c.block_n} w{c.num_warps} s{c.num_stages}"
                assert any((kernel, f"D={d}", dt, cfg) in seen for dt in dtypes[elt]), (kernel, d, elt, cfg, arch)
    for table in (MASKED, MODIFIED, FULL):  # the specialisation tables' entries: the masked / all-options /
        # causal=False cases compile them
        for kernel, by_elt in table.get(family(arch), {}).items():
            for elt, by_bucket in by_elt.items():
                for d, c in by_bucket.items():
                    cfg = f"M{c.block_m} N{c.block_n} w{c.num_warps} s{c.num_stages}"
                    assert any((kernel, f"D={d}", dt, cfg) in seen for dt in dtypes[elt]), (kernel, d, cfg, arch)


def test_mask_tile_launches_fit_at_a_key_count_that_is_not_a_multiple_of_16(odd_length_results, capsys):
    proc, results = odd_length_results
    with capsys.disabled():
        print("\n" + proc.stdout)
    bad = [f"{r['label']} sm_{r['arch']} {r['config']}: shared={r['shared']} limit={r['limit']} "
           f"estimate={r['estimate']} {r['error']}" for r in results if not r["ok"]]
    assert not bad, "mask-tile launches at 113 keys that fail the compile check:\n" + "\n".join(bad)
    assert proc.returncode == 0 and {r["seqlen"] for r in results} == {113}
    for arch in ARCHS:  # forward, dK/dV, dQ (and the bias gradient's) at head dims 64/128/256 in fp16 and bf16
        labels = {r["label"] for r in results if r["arch"] == arch}
        for kernel in ("attn_fwd", "attn_bwd_dkdv", "attn_bwd_dq", "attn_bwd_dq+dbias"):
            for d in (64, 128, 256):
                for dtype in ("float16", "bfloat16"):
                    assert any(lab.startswith(f"{kernel} D={d} {dtype} ") for lab in labels), (kernel, d, dtype, arch)


def test_sm86_limit_is_the_rtx3090s():
    from flashtx.triton_kernels.configs import KNOWN_TARGETS

    assert KNOWN_TARGETS[86].max_shared == 101_376


# What nobody here has timed ships without register spills (configs.py): the fp16/bf16 forward, dK/dV and dQ
# kernels, plain (causal or not), with visibility masks (MASKED) and with every score modifier at once (MODIFIED),
# and the bias-gradient dQ in both of its bias layouts, at head dims 64, 128 and 256; on sm_90, whose plain forward
# tiles at head dims 64 and 128 were timed (bench.tune; masked launches use them too), only the modifier tiles of
# the forward there, and dK/dV's plain tiles at head dims 64 and 128, timed on an H100 (2026-12-06; bench/RESULTS.md).
# A GQA group's dK/dV ("gqa": GROUP > 1, its own specialisation) is in the set too.
NO_SPILL_SPECS = ("causal=False", "causal=True", "window+masks+lens", "varlen+window", "all-options", "gqa",
                  "gqa-full") + tuple(f"{tag}{spec}" for tag in ("short-", "short64-") for spec in (
                      "causal=False", "causal=True", "window+masks+lens", "softcap", "all-options"))
# short-, short64-: configs.fit_rows' cut q tiles, at 49 and 64 tokens


def _untimed_no_spill_case(label: str, arch: int) -> bool:
    tokens = label.split()
    if len(tokens) < 4:  # e.g. "attn_probs D=128 float32": not in the set
        return False
    kernel, dims, dtype, spec = tokens[:4]
    if dims not in ("D=64", "D=128", "D=256") or dtype not in ("float16", "bfloat16"):
        return False
    if kernel == "attn_bwd_dq+dbias":  # sm_90's at head dim 128: timed (a learned bias on an H100, 2026-12-06)
        return not (arch == 90 and dims == "D=128")
    timed = arch == 90 and dims != "D=256" and not spec.startswith("short") and (
        (kernel == "attn_fwd" and spec != "all-options")
        # dK/dV's plain tiles, timed by bench.tune on an H100 (2026-12-06); a GQA group's launch runs the same loop per
        # query head of the group (its spills match the plain one's: 120 and 56 bytes against 112 and 40)
        or (kernel == "attn_bwd_dkdv" and spec in ("causal=False", "causal=True", "gqa", "gqa-full")))
    return kernel in ("attn_fwd", "attn_bwd_dkdv", "attn_bwd_dq") and spec in NO_SPILL_SPECS and not timed


@pytest.mark.parametrize("arch", ARCHS, ids=lambda a: f"sm_{a}")
def test_untimed_tiles_do_not_spill(compile_results, arch):
    _, results = compile_results
    checked = [r for r in results if r["arch"] == arch and _untimed_no_spill_case(r["label"], arch)]
    # 3 kernels x 3 head dims x (fp16: 5 specs, bf16: 4) + the bias-gradient dQ: 3 head dims x 2 dtypes x 2 layouts
    # + GQA dK/dV at 3 head dims; sm_90's forward at head dims 64 and 128: all-options only (2 of 9), and its dK/dV
    # there: the masked and modified launches only (fp16: causal=False, causal=True and gqa timed; bf16: causal=True)
    assert len(checked) >= 3 * 3 * 9 + 12 + 3 - (2 * 7 + 2 * 3 + 2 + 4 if arch == 90 else 0), len(checked)
    assert sum(r["label"].split()[3] == "gqa" for r in checked) == (1 if arch == 90 else 3)
    spilling = [f"{r['label']} {r['config']}: {r['spill_bytes']} bytes" for r in checked if r["spill_bytes"]]
    assert not spilling, "untimed tiles that spill:\n" + "\n".join(spilling)


# Hopper's tensor cores are fed by wgmma (warpgroup MMA); mma.sync, sm_80's instruction, runs there at a fraction of
# wgmma's rate, and Triton falls back to it for a dot with fewer than 64 rows per warpgroup (e.g. dK/dV's
# S^T = K Q^T over 32 K/V rows). sm_90's 16-bit forward, dK/dV and dQ tiles at head dims 64 and 128, plain and with
# visibility masks, issue wgmma; so do the three with every score modifier at head dims 64 and 128, the forward at
# 256 (every spec) and dQ at 256 (plain and masked); sm_80/86 never do (the measure's control). Where a GPU times an
# mma.sync tile faster, the table takes it and this list names the exception. No spill-free wgmma tile was found for
# dK/dV at 256, and dQ at 256 with score modifiers (configs.py).
MMA_SPECS = ("causal=False", "causal=True", "window+masks+lens", "varlen+window")
MMA_MORE = {(k, d, "all-options") for k in ("attn_fwd", "attn_bwd_dkdv", "attn_bwd_dq") for d in ("D=64", "D=128")} | {
    ("attn_bwd_dq", "D=256", s) for s in MMA_SPECS} | {("attn_fwd", "D=256", s) for s in MMA_SPECS + ("all-options",)}


@pytest.mark.parametrize("arch", ARCHS, ids=lambda a: f"sm_{a}")
def test_hopper_attention_tiles_issue_warpgroup_mma(compile_results, arch):
    _, results = compile_results
    ours = [r for r in results if r["arch"] == arch and r["ok"] and r["label"].startswith("attn_")]
    assert ours and all("mma" in r for r in ours), "the compile check reports no tensor-core instructions"
    if arch != 90:
        assert not [r["label"] for r in ours if "wgmma" in r["mma"]], "wgmma exists on sm_90 only"
        assert any(r["mma"] == "mma" for r in ours)
        return
    checked = [r for r in ours if r["label"].split()[0] in ("attn_fwd", "attn_bwd_dkdv", "attn_bwd_dq")
               and r["label"].split()[1] in ("D=64", "D=128") and r["label"].split()[2] in ("float16", "bfloat16")
               and r["label"].split()[3] in MMA_SPECS]
    assert len(checked) == 3 * 2 * 7, len(checked)  # 3 kernels x 2 head dims x (fp16: 4 specs, bf16: 3)
    more = [r for r in ours if len(r["label"].split()) > 3 and tuple(r["label"].split()[i] for i in (0, 1, 3))
            in MMA_MORE and r["label"].split()[2] in ("float16", "bfloat16")]
    assert len(more) == 2 * 2 * 3 + 4 + 3 + 5 + 4, len(more)  # all-options at 64, 128 (fp16, bf16); dQ, forward at 256
    short = [r for r in ours if len(r["label"].split()) > 3 and r["label"].split()[3].startswith("short")]
    for tag in ("short-", "short64-"):  # configs.fit_rows' cut q tiles (64 rows: one warp group's wgmma M), at 49 and
        # 64 tokens
        n = sum(r["label"].split()[3].startswith(tag) for r in short)
        assert n >= 3, (tag, n)
    fallback = [f"{r['label']} {r['config']}: {r['mma']}" for r in checked + more + short if r["mma"] != "wgmma"]
    assert not fallback, "sm_90 tiles without warpgroup MMA:\n" + "\n".join(fallback)


# RoPE and SwiGLU are bandwidth-bound: their tensors must move in 16-byte accesses (issue 14: vectorised loads in
# both RoPE layouts). Of the bytes of the PTX's global load and store instructions (static counts), at least these
# shares are 16-byte accesses; the rest are one-per-row loads (position ids, cos/sin rows, lengths), which the
# instruction count weighs far above their share of the traffic. Lowest seen (sm_80/86/90): Triton 3.6 0.73 / 0.80
# (RoPE with position ids, (B, H, S, D); the one-token in-place decode tile), 3.8 and 3.9 0.75 / 0.80; SwiGLU 1.0
# everywhere. SwiGLU's width-5000 plans (rows not a multiple of 16 elements apart, so Triton cannot prove 16-byte
# alignment: scalar accesses) are the control that shows the measure sees narrow accesses.
MIN_LD16, MIN_ST16 = 0.7, 0.8


@pytest.mark.parametrize("arch", ARCHS, ids=lambda a: f"sm_{a}")
def test_rope_and_swiglu_move_their_tensors_in_16_byte_accesses(compile_results, arch):
    _, results = compile_results
    ours = [r for r in results if r["arch"] == arch and r["ok"] and r["label"].startswith(("rotary_", "swiglu_"))]
    control = [r for r in ours if "_h5000_" in r["label"]]
    checked = [r for r in ours if "_h5000_" not in r["label"]]
    assert len(checked) >= 100 and control, (len(checked), len(control))
    narrow = [f"{r['label']}: {r['ld16']:.2f} of load bytes, {r['st16']:.2f} of store bytes in 16-byte accesses"
              for r in checked if r["ld16"] < MIN_LD16 or r["st16"] < MIN_ST16]
    assert not narrow, f"bandwidth kernels below {MIN_LD16} / {MIN_ST16}:\n" + "\n".join(narrow)
    assert all(r["ld16"] < 0.5 and r["st16"] < 0.5 for r in control), [(r["label"], r["ld16"]) for r in control]
