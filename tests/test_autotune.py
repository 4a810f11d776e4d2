"""triton_kernels/autotune.py on CPU, with a fake timing function (no GPU is timed here).

Checked: off by default (no hook, select_config unchanged); the fastest candidate wins and is
cached on disk under FLASHTX_CACHE_DIR; the cache round-trips and is used instead of re-tuning;
corrupt or malformed cache files are ignored with a warning; candidates respect the target's
shared memory; a candidate that fails is skipped; forced() restores what it changed.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flashtx.triton_kernels import autotune, configs
from flashtx.triton_kernels.configs import Target, TileConfig

H100 = Target(90, 232_448)
RTX3090 = Target(86, 101_376)
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHTX_CACHE_DIR", str(tmp_path))
    autotune.reset_memory()
    yield tmp_path
    autotune.autotune(False)
    autotune.reset_memory()


def _ident(cfg):
    return (cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages)


def test_off_by_default_in_a_fresh_process():
    env = {k: v for k, v in os.environ.items() if k != "FLASHTX_AUTOTUNE"}
    code = ("import flashtx, sys\n"
            "from flashtx.triton_kernels import configs\n"
            "assert configs._autotune_hook is None\n"
            "from flashtx.triton_kernels import autotune\n"  # importing it (e.g. a re-export) does not turn it on
            "assert configs._autotune_hook is None and not autotune.enabled()\n"
            "print('off')")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "off", out.stderr[-2000:]


def test_env_turns_it_on_in_a_fresh_process(tmp_path):
    env = {**os.environ, "FLASHTX_AUTOTUNE": "1", "FLASHTX_CACHE_DIR": str(tmp_path)}
    code = ("from flashtx.triton_kernels import configs, autotune\n"
            "assert configs._autotune_hook is autotune._hook\nprint('on')")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "on", out.stderr[-2000:]


def test_best_candidate_wins_and_is_cached(cache_dir):
    cands = autotune.candidates("attn_fwd", 128, 128, 2, H100)
    assert len(cands) >= 3 and _ident(cands[0]) == _ident(configs._select("attn_fwd", 128, 128, 2, H100, False))
    winner = cands[2]
    fake = {_ident(c): 1.0 + i for i, c in enumerate(cands)}
    fake[_ident(winner)] = 0.5
    key = autotune.runtime_key("attn_fwd", 128, 128, 2, H100, False)
    best = autotune.tune_now(key, "attn_fwd", 128, 128, 2, H100, False, time_fn=lambda c: fake[_ident(c)])
    assert _ident(best) == _ident(winner) and "0.500 ms" in best.reason
    data = json.loads((cache_dir / "autotune.json").read_text())
    assert data["version"] == autotune.CACHE_VERSION and list(data["entries"]) == [key]
    assert "|sm_90|triton " in key and "|attn_fwd|16-bit|d128/128|causal=any|modified=False" in key
    autotune.reset_memory()  # round trip through the file
    assert _ident(autotune.cached(key)) == _ident(winner)


def test_hook_tunes_once_per_key_then_uses_the_cache(cache_dir, monkeypatch):
    calls = []

    def fake_time(kernel, cfg, **kw):
        calls.append((kernel, _ident(cfg), kw["causal"]))
        return 2.0 if cfg.block_n == 64 else 3.0  # any 64-wide K/V tile wins
    monkeypatch.setattr(autotune, "time_candidate", fake_time)
    default = configs.select_config("attn_fwd", 64, 64, 2, H100)
    assert configs._autotune_hook is None  # off: nothing timed
    assert not calls
    autotune.autotune()
    got = configs.select_config("attn_fwd", 64, 64, 2, H100)
    n = len(calls)
    assert n >= 2 and {c[2] for c in calls} == {False, True}  # both causal and not, for the "any" key
    assert got.block_n == 64 and got.reason.startswith("autotuned")
    again = configs.select_config("attn_fwd", 64, 64, 2, H100)
    assert _ident(again) == _ident(got) and len(calls) == n  # cached: no re-tuning
    autotune.reset_memory()
    assert _ident(configs.select_config("attn_fwd", 64, 64, 2, H100)) == _ident(got) and len(calls) == n  # from disk
    assert _ident(configs.select_config("attn_fwd", 64, 64, 2, configs.INTERPRETER_TARGET)) != _ident(got)
    autotune.autotune(False)
    assert _ident(configs.select_config("attn_fwd", 64, 64, 2, H100)) == _ident(default)


@pytest.mark.parametrize("content", ["{not json", "[1, 2]", json.dumps({"version": 999, "entries": {}}),
                                     json.dumps({"version": 1, "entries": "x"})])
def test_corrupt_cache_is_ignored_with_a_warning(cache_dir, content, monkeypatch):
    (cache_dir / "autotune.json").write_text(content)
    with pytest.warns(UserWarning, match="ignoring the cache"):
        assert autotune.load_cache() == {}
    monkeypatch.setattr(autotune, "time_candidate", lambda kernel, cfg, **kw: float(cfg.block_m))
    autotune.autotune()
    with pytest.warns(UserWarning, match="ignoring the cache"):
        cfg = configs.select_config("attn_bwd_dq", 128, 128, 2, H100)
    assert cfg.reason.startswith("autotuned")  # tuned afresh, and the file rewritten in the right form
    autotune.reset_memory()
    assert json.loads((cache_dir / "autotune.json").read_text())["version"] == autotune.CACHE_VERSION


def test_malformed_entry_is_ignored_with_a_warning(cache_dir):
    good = {"config": {"block_m": 64, "block_n": 32, "num_warps": 4, "num_stages": 2}}
    bad = {"config": {"block_m": "x"}}
    (cache_dir / "autotune.json").write_text(json.dumps({"version": 1, "entries": {"a": good, "b": bad, "c": 3}}))
    with pytest.warns(UserWarning, match="malformed entry"):
        entries = autotune.load_cache()
    assert list(entries) == ["a"]
    assert _ident(autotune.cached("a")) == (64, 32, 4, 2) and autotune.cached("b") is None


def test_candidates_fit_shared_memory_and_failures_are_skipped():
    for kernel in autotune.TUNED_KERNELS:
        for target in (H100, RTX3090):
            for d in (64, 128):
                cands = autotune.candidates(kernel, d, d, 2, target)
                assert cands, (kernel, target, d)
                assert len({_ident(c) for c in cands}) == len(cands)
                for c in cands:
                    assert configs.estimate_shared_memory(kernel, c, d, d, 2, target) <= target.max_shared
    assert len(autotune.candidates("attn_bwd_dkdv", 128, 128, 2, RTX3090)) < \
        len(autotune.candidates("attn_bwd_dkdv", 128, 128, 2, H100))

    cands = [TileConfig(64, 32, 4, 2), TileConfig(128, 64, 8, 3), TileConfig(32, 32, 4, 1)]

    def time_fn(cfg):
        if cfg.block_m == 128:
            raise RuntimeError("OutOfResources: shared memory")
        return {64: 1.5, 32: 1.0}[cfg.block_m]
    best, timings = autotune.best_of(cands, time_fn)
    assert _ident(best) == (32, 32, 4, 1)
    assert timings["128x64 w8 s3"].startswith("failed: RuntimeError") and timings["64x32 w4 s2"] == 1.5


def test_forced_restores_the_hook():
    assert configs._autotune_hook is None
    cfg = TileConfig(16, 16, 4, 1, "forced")
    with autotune.forced("attn_bwd_dq", cfg):
        assert configs.select_config("attn_bwd_dq", 64, 64, 2, H100) is cfg
    assert configs._autotune_hook is None
    assert configs.select_config("attn_bwd_dq", 64, 64, 2, H100) is not cfg
