"""bench/tune.py's sweep, ranking, table and cache writing on CPU with a fake timer and a fake clock
(nothing is timed on a GPU here; every number below is invented)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root, for `import bench`

from bench import tune  # noqa: E402
from flashtx.triton_kernels import autotune  # noqa: E402
from flashtx.triton_kernels.configs import Target  # noqa: E402

H100 = Target(90, 232_448)


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def fake_timer(clock, per_call_s=1.0):
    """128-row Q tiles with 64-row K/V tiles win everywhere; 2.0 ms otherwise; one candidate fails."""
    def time_fn(g, cfg, seqlen):
        clock.t += per_call_s
        if (cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages) == (64, 32, 4, 3):
            raise RuntimeError("OutOfResources (fake)")
        fast = cfg.block_n == 64 and cfg.block_m in (128, 32)
        return (1.0 if fast else 2.0) * seqlen / 4096
    return time_fn


def test_sweep_plan_table_and_ranking():
    clock = FakeClock()
    out = tune.sweep(H100, fake_timer(clock), budget_s=1e9, clock=clock, log=lambda *a: None)
    assert not out["skipped"]
    res = out["results"]
    # every group timed at N = 4k (each candidate), then default + top 2 at 1k and 16k
    assert {(r["kernel"], r["d"], r["causal"], r["dtype"]) for r in res} == \
        {(g.kernel, g.d, g.causal, g.dtype) for g in tune.groups()}
    assert {r["seqlen"] for r in res} == {1024, 4096, 16384}
    assert any("error" in r and "OutOfResources" in r["error"] for r in res)
    ranked = tune.rank(res)
    assert set(ranked) == {(k, d, c) for k in tune.KERNELS for d in tune.HEADDIMS for c in (False, True)}
    text = tune.table(out, "FAKE-GPU", "0.0")
    assert "| attn_fwd | 128 | yes | bfloat16 | 4096 |" in text
    assert "# attn_bwd_dq, head dim 64, causal" in text and 'TileConfig(' in text and "FAKE-GPU" in text
    assert "# attn_bwd_dq, head dim 64, full (configs.FULL)" in text
    winner = ranked[("attn_fwd", 128, True)][0]
    assert winner[0][1] == 64 and winner[1] <= 1.0


def test_budget_stops_the_sweep_and_says_what_was_not_timed():
    clock = FakeClock()
    out = tune.sweep(H100, fake_timer(clock, per_call_s=5.0), budget_s=60, clock=clock, log=lambda *a: None)
    assert out["skipped"] and len(out["results"]) <= 60 / 5 + 1
    assert "Not timed (budget)" in tune.table(out, "FAKE-GPU", "0.0")
    # bf16, D = 128, causal first: those groups are the ones timed
    assert {(r["dtype"], r["d"], r["causal"]) for r in out["results"]} == {("bfloat16", 128, True)}


def test_write_cache_stores_the_runtime_keys(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHTX_CACHE_DIR", str(tmp_path))
    autotune.reset_memory()
    clock = FakeClock()
    out = tune.sweep(H100, fake_timer(clock), budget_s=1e9, quick=True, clock=clock, log=lambda *a: None)
    keys = tune.write_cache(out, H100, "FAKE-GPU", "0.0")
    assert len(keys) == len(tune.KERNELS) * len(tune.HEADDIMS) * 2  # causal and full apart
    data = json.loads((tmp_path / "autotune.json").read_text())
    assert sorted(data["entries"]) == sorted(keys)
    key = autotune.make_key(gpu="FAKE-GPU", arch=90, triton_version="0.0", kernel="attn_fwd",
                            dtype=autotune.DTYPE_ANY_16, block_dqk=128, block_dv=128, causal=True, modified=False)
    autotune.reset_memory()
    assert autotune.cached(key).block_n == 64
    autotune.reset_memory()


def test_main_without_a_gpu_says_so(capsys):
    assert tune.main([]) == 0
    assert "no CUDA GPU here" in capsys.readouterr().out


def test_a_focused_sweep_times_only_the_kernels_and_lengths_asked_for():
    """--kernels attn_fwd --seqlens 2048,1024,16384: every forward candidate at 2k, then the default and the
    best two at 1k and 16k; no backward kernel is timed."""
    clock = FakeClock()
    out = tune.sweep(H100, fake_timer(clock), budget_s=1e9, clock=clock, log=lambda *a: None,
                     kernels=("attn_fwd",), seqlens=(2048, 1024, 16384))
    res = out["results"]
    assert {r["kernel"] for r in res} == {"attn_fwd"}
    assert {r["seqlen"] for r in res} == {1024, 2048, 16384}
    for g in tune.groups(kernels=("attn_fwd",)):
        at_2k = [r for r in res if (r["d"], r["causal"], r["dtype"], r["seqlen"]) == (g.d, g.causal, g.dtype, 2048)]
        at_16k = [r for r in res if (r["d"], r["causal"], r["dtype"], r["seqlen"]) == (g.d, g.causal, g.dtype, 16384)]
        assert len(at_2k) == len(autotune.candidates("attn_fwd", g.d, g.d, 2, H100, tma=True))
        assert 1 <= len(at_16k) <= 3 and any(r["default"] for r in at_16k)


def test_cli_refuses_unknown_kernels_and_bad_seqlens(capsys):
    import pytest
    for argv, what in ((["--kernels", "attn_fwd,attn_bwd"], "--kernels"), (["--seqlens", "2048,x"], "--seqlens"),
                       (["--seqlens", "0"], "--seqlens"), (["--seqlens", "4096,64"], "--seqlens")):
        with pytest.raises(SystemExit):
            tune.main(argv)
        assert what in capsys.readouterr().err


def test_tma_candidates_are_timed_after_every_other_candidate():
    """On sm_90 the TMA candidates (never yet run on a GPU) come after steps 1 and 2, so a fault in one cannot
    cost the plain candidates' rows; they are ranked with the rest."""
    clock = FakeClock()
    out = tune.sweep(H100, fake_timer(clock), budget_s=1e9, clock=clock, log=lambda *a: None, quick=True)
    res = out["results"]
    is_tma = [r["ident"][4] for r in res]
    first = is_tma.index(True)
    assert any(is_tma) and not any(is_tma[:first]) and all(is_tma[first:])
    assert {r["seqlen"] for r in res[first:]} == {4096}
    n_tma = sum(len([c for c in autotune.candidates(g.kernel, g.d, g.d, 2, H100, tma=True) if c.tma])
                for g in tune.groups(quick=True))
    assert len(res) - first == n_tma
    assert any(ident[4] for ranked in tune.rank(res).values() for ident, _, _ in ranked)
    # not on sm_86
    out86 = tune.sweep(Target(86, 101_376), fake_timer(FakeClock()), budget_s=1e9, clock=FakeClock(),
                       log=lambda *a: None, quick=True)
    assert not any(r["ident"][4] for r in out86["results"])


def test_a_broken_gpu_stops_the_sweep_and_keeps_what_was_timed():
    """After a candidate raises, healthy() is asked; False (a sticky CUDA error) stops the sweep at once, with
    the rows timed so far and a 'stopped' line naming the candidate."""
    clock = FakeClock()
    timer = fake_timer(clock)
    calls = []

    def time_fn(g, cfg, seqlen):
        calls.append(cfg)
        if cfg.tma:
            raise RuntimeError("CUDA error: an illegal memory access was encountered (fake)")
        return timer(g, cfg, seqlen)
    asked = []
    out = tune.sweep(H100, time_fn, budget_s=1e9, clock=clock, log=lambda *a: None, quick=True,
                     healthy=lambda: asked.append(1) or not calls[-1].tma)
    res = out["results"]
    assert res[-1]["error"].startswith("RuntimeError: CUDA error") and res[-1]["ident"][4]
    assert sum(r["ident"][4] for r in res) == 1 and len(calls) == len(res)
    assert any(s.startswith("stopped: the GPU failed after attn_fwd D=128 causal bfloat16 N=4096")
               for s in out["skipped"])
    assert len(asked) == sum("error" in r for r in res)  # the fake OutOfResources rows asked and went on
    assert {r["seqlen"] for r in res} == {1024, 4096, 16384}  # steps 1 and 2 were complete
    assert "stopped: the GPU failed" in tune.table(out, "FAKE-GPU", "0.0")


def _tma_wins_timer(clock, at=(4096, 1024, 16384)):
    """fake_timer, but every TMA tile takes 0.5 ms at the lengths in `at` (3.0 elsewhere)."""
    plain = fake_timer(clock)

    def time_fn(g, cfg, seqlen):
        if cfg.tma:
            clock.t += 1.0
            return (0.5 if seqlen in at else 3.0) * seqlen / 4096
        return plain(g, cfg, seqlen)
    return time_fn


def test_a_faster_tma_tile_is_timed_at_every_length_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHTX_CACHE_DIR", str(tmp_path))
    autotune.reset_memory()
    clock = FakeClock()
    out = tune.sweep(H100, _tma_wins_timer(clock), budget_s=1e9, clock=clock, log=lambda *a: None, quick=True,
                     kernels=("attn_fwd",))
    tma_rows = [r for r in out["results"] if r["ident"][4]]
    assert {r["seqlen"] for r in tma_rows} == {1024, 4096, 16384}
    tune.write_cache(out, H100, "FAKE-GPU", "0.0")
    key = autotune.make_key(gpu="FAKE-GPU", arch=90, triton_version="0.0", kernel="attn_fwd",
                            dtype=autotune.DTYPE_ANY_16, block_dqk=128, block_dv=128, causal=True, modified=False)
    autotune.reset_memory()
    assert autotune.cached(key).tma
    autotune.reset_memory()


def test_write_cache_needs_every_length_and_a_clean_tma_run(tmp_path, monkeypatch):
    """A tile timed at one N only cannot be cached over tiles timed at three (it used to rank on less evidence);
    after a TMA candidate failed, or the sweep stopped on a broken GPU, no TMA tile is cached."""
    monkeypatch.setenv("FLASHTX_CACHE_DIR", str(tmp_path))
    key = autotune.make_key(gpu="FAKE-GPU", arch=90, triton_version="0.0", kernel="attn_fwd",
                            dtype=autotune.DTYPE_ANY_16, block_dqk=128, block_dv=128, causal=True, modified=False)

    def cached_after(out):
        autotune.reset_memory()
        (tmp_path / "autotune.json").unlink(missing_ok=True)
        tune.write_cache(out, H100, "FAKE-GPU", "0.0")
        autotune.reset_memory()
        got = autotune.cached(key)
        autotune.reset_memory()
        return got
    clock = FakeClock()
    out = tune.sweep(H100, _tma_wins_timer(clock), budget_s=1e9, clock=clock, log=lambda *a: None, quick=True,
                     kernels=("attn_fwd",))
    assert cached_after(out).tma
    one_length = {**out, "results": [r for r in out["results"] if not (r["ident"][4] and r["seqlen"] != 4096)]}
    assert not cached_after(one_length).tma  # faster at 4k, but timed there only
    failed = {**out, "results": out["results"] + [dict(next(r for r in out["results"] if r["ident"][4]),
                                                       ms=None, error="RuntimeError: fake")]}
    for r in failed["results"][-1:]:
        del r["ms"]
    assert not cached_after(failed).tma
    stopped = {**out, "skipped": ["stopped: the GPU failed after x (a sticky CUDA error); the rest was not timed"]}
    assert not cached_after(stopped).tma
    assert "**stopped: the GPU failed" in tune.table(stopped, "FAKE-GPU", "0.0")


def test_main_writes_the_json_as_it_goes(tmp_path, monkeypatch):
    """--json is rewritten after every timed row (a kernel that hangs the GPU ends the process with SIGKILL, and
    the rows timed before it must survive)."""
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "FAKE-GPU")
    monkeypatch.setattr(torch, "empty", lambda *a, **k: torch.zeros(1))
    from flashtx.triton_kernels import launch
    monkeypatch.setattr(launch, "target_for", lambda t: H100)
    path = tmp_path / "tune.json"
    seen = []

    def time_fn(g, cfg, seqlen):
        if path.exists():
            seen.append(len(json.loads(path.read_text())["results"]))
        if len(seen) == 5:
            raise SystemExit("killed (fake)")
        return 1.0
    monkeypatch.setattr(tune, "gpu_time_fn", lambda: time_fn)
    import pytest
    with pytest.raises(SystemExit):
        tune.main(["--json", str(path), "--kernels", "attn_fwd"])
    assert seen == [1, 2, 3, 4, 5] and len(json.loads(path.read_text())["results"]) == 5


def test_a_modified_sweep_times_the_modifier_tiles_and_caches_the_modifier_keys(tmp_path, monkeypatch):
    """--modified: every group runs with softcap, its default is configs.MODIFIED's tile (sm_90 dK/dV at 128: a
    spill-free, untimed 16x64 8 warps), no TMA candidate is timed, the table says so and the winners are cached under
    the modifier keys."""
    from flashtx.triton_kernels import configs

    monkeypatch.setenv("FLASHTX_CACHE_DIR", str(tmp_path))
    autotune.reset_memory()
    assert tune.parse_args(["--modified"]).modified and not tune.parse_args([]).modified
    seen = []
    clock = FakeClock()
    timer = fake_timer(clock)

    def time_fn(g, cfg, seqlen):
        seen.append(g.modified)
        return timer(g, cfg, seqlen)
    target = configs.KNOWN_TARGETS[90]
    out = tune.sweep(target, time_fn, budget_s=1e9, quick=True, clock=clock, log=lambda *a: None, modified=True)
    res = out["results"]
    assert seen and all(seen) and all(r["modified"] for r in res) and not any(r["ident"][4:] == [True] for r in res)
    default = next(r for r in res if r["default"] and r["kernel"] == "attn_bwd_dkdv" and r["d"] == 128)
    want = configs.MODIFIED["sm90"]["attn_bwd_dkdv"][2][128]
    assert default["ident"][:4] == [want.block_m, want.block_n, want.num_warps, want.num_stages]
    text = tune.table(out, "FAKE-GPU", "0.0")
    assert "softcap" in text and "MODIFIED, 16-bit tables" in text
    keys = tune.write_cache(out, target, "FAKE-GPU", "0.0")
    assert keys and all("modified=True" in k for k in keys)
    autotune.reset_memory()
