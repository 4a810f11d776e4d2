"""triton_kernels/autotune.py on CPU, with a fake timing function (no GPU is timed here).

Checked: off by default (no hook, select_config unchanged); the fastest candidate wins and is
cached on disk under FLASHTX_CACHE_DIR; the cache round-trips and is used instead of re-tuning;
corrupt or malformed cache files are ignored with a warning; candidates respect the target's
shared memory; a candidate that fails is skipped; forced() restores what it changed, and holds for
launches on other threads (autograd's device thread on a GPU); a key that cannot be tuned is not retried;
the backward kernels tune from inside a backward (real passes in the interpreter, sm_86's plan).
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


def _ident(cfg):
    return (cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages, cfg.tma)


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


@pytest.mark.parametrize("first", ["import flashtx", "from flashtx.triton_kernels import launch",
                                   "from flashtx.triton_kernels import configs"])
def test_env_turns_it_on_in_a_fresh_process(tmp_path, first):
    """Whichever module is imported first (launch imports configs, which turns the tuner on while launch is still
    being imported: 2026-12-04's fresh-clone CI failed on that order, reached through flashtx's own imports)."""
    env = {**os.environ, "FLASHTX_AUTOTUNE": "1", "FLASHTX_CACHE_DIR": str(tmp_path)}
    code = (f"{first}\nfrom flashtx.triton_kernels import configs, autotune\n"
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
    assert "|sm_90|triton " in key and "|attn_fwd|16-bit|d128/128|causal=True|modified=False" in key
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
    assert n >= 2 and {c[2] for c in calls} == {True}  # a causal launch's key: timed causal only
    assert got.block_n == 64 and got.reason.startswith("autotuned")
    again = configs.select_config("attn_fwd", 64, 64, 2, H100)
    assert _ident(again) == _ident(got) and len(calls) == n  # cached: no re-tuning
    full = configs.select_config("attn_fwd", 64, 64, 2, H100, causal=False)  # its own key, timed without the mask
    n_full = len(calls)
    assert n_full > n and {c[2] for c in calls[n:]} == {False} and full.reason.startswith("autotuned")
    autotune.reset_memory()
    assert _ident(configs.select_config("attn_fwd", 64, 64, 2, H100)) == _ident(got) and len(calls) == n_full
    assert _ident(configs.select_config("attn_fwd", 64, 64, 2, H100, causal=False)) == _ident(full)  # from disk
    assert len(calls) == n_full
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
    assert _ident(autotune.cached("a")) == (64, 32, 4, 2, False) and autotune.cached("b") is None


def test_modified_candidates_fit_with_an_fp32_mask_tile_beyond_the_default():
    """A modified key's tuned tile serves launches with an attn_mask at any length: at key counts that are not multiples
    of 16 Triton stages the mask tile in shared memory, so candidates beyond configs.py's (which the compile check
    builds at such a length) must fit with an fp32 one; plain keys are not pruned so."""
    pruned_somewhere = plain_keeps_them = False
    for kernel in autotune.TUNED_KERNELS:
        for target in (H100, RTX3090, configs.KNOWN_TARGETS[80]):
            for d in (64, 128):
                default = configs._select(kernel, d, d, 2, target, True, False, True)
                mod = autotune.candidates(kernel, d, d, 2, target, modified=True, tma=True)
                plain = autotune.candidates(kernel, d, d, 2, target, modified=False, tma=True)
                assert _ident(mod[0]) == _ident(default)
                for c in mod[1:]:
                    assert configs.estimate_shared_memory(kernel, c, d, d, 2, target, 10) <= target.max_shared
                dropped = {_ident(c) for c in plain} - {_ident(c) for c in mod}
                pruned_somewhere |= bool(dropped)
                for c in plain:  # (plain keys: the estimate without a mask tile; no fp32 mask tile can come)
                    assert configs.estimate_shared_memory(kernel, c, d, d, 2, target) <= target.max_shared
                    plain_keeps_them |= configs.estimate_shared_memory(kernel, c, d, d, 2, target, 10) > \
                        target.max_shared
    assert pruned_somewhere, "the mask tile's term never pruned a candidate: the test shows nothing"
    assert plain_keeps_them, "plain keys must not be pruned with the mask tile's term"


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
    assert _ident(best) == (32, 32, 4, 1, False)
    assert timings["128x64 w8 s3"].startswith("failed: RuntimeError") and timings["64x32 w4 s2"] == 1.5


def test_forced_restores_the_hook():
    assert configs._autotune_hook is None
    cfg = TileConfig(16, 16, 4, 1, "forced")
    with autotune.forced("attn_bwd_dq", cfg):
        assert configs.select_config("attn_bwd_dq", 64, 64, 2, H100) is cfg
    assert configs._autotune_hook is None
    assert configs.select_config("attn_bwd_dq", 64, 64, 2, H100) is not cfg


def test_forced_holds_for_launches_on_other_threads(cache_dir, monkeypatch):
    """On a GPU the autograd engine runs a backward on its own device thread: while the tuner forces one
    kernel, the other kernels of the pass it times (launched on that thread) keep their config and tune nothing."""
    import threading

    tuned = []
    monkeypatch.setattr(autotune, "tune_now", lambda key, *a, **kw: tuned.append(key))
    autotune.autotune()
    got = []
    with autotune.forced("attn_bwd_dkdv", TileConfig(16, 16, 4, 1, "forced")):
        t = threading.Thread(target=lambda: got.append(configs.select_config("attn_bwd_dq", 64, 64, 2, H100)))
        t.start()
        t.join()
    assert not tuned, "a launch on another thread started tuning while the tuner was timing"
    assert _ident(got[0]) == _ident(configs._select("attn_bwd_dq", 64, 64, 2, H100, False))


def test_a_launch_planned_inside_a_dispatch_mode_tunes_nothing(cache_dir, monkeypatch):
    """torch.compile's AOTAutograd runs an op's body under fake, proxy and functional dispatch modes; torch 2.11
    leaves torch.compiler.is_compiling() False there, so every kernel of a compiled attention started tuning on
    fake tensors. A launch planned inside a dispatch mode keeps the default and leaves the key to a later eager
    launch (not marked failed)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    tuned = []
    monkeypatch.setattr(autotune, "tune_now", lambda key, *a, **kw: tuned.append(key))
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: False)  # as torch 2.11 answers there
    autotune.autotune()
    default = configs._select("attn_fwd", 64, 64, 2, H100, False)
    failed = set(autotune._failed)
    with FakeTensorMode():
        assert _ident(configs.select_config("attn_fwd", 64, 64, 2, H100)) == _ident(default)
    assert not tuned and autotune._failed == failed
    configs.select_config("attn_fwd", 64, 64, 2, H100)
    assert len(tuned) == 1


def test_a_key_that_cannot_be_tuned_is_not_retried_on_every_launch(cache_dir, monkeypatch):
    calls = []

    def failing(kernel, cfg, **kw):
        calls.append(kernel)
        raise RuntimeError("cannot run here")
    monkeypatch.setattr(autotune, "time_candidate", failing)
    autotune.autotune()
    default = configs._select("attn_bwd_dq", 64, 64, 2, H100, False)
    with pytest.warns(UserWarning, match="no candidate .* could be timed"):
        assert _ident(configs.select_config("attn_bwd_dq", 64, 64, 2, H100)) == _ident(default)
    n = len(calls)
    assert n >= 2
    for _ in range(3):
        assert _ident(configs.select_config("attn_bwd_dq", 64, 64, 2, H100)) == _ident(default)
    assert len(calls) == n


@pytest.mark.parametrize("gpu_target", [86], indirect=True, ids=lambda a: f"sm_{a}")
def test_backward_kernels_tune_from_inside_a_backward(cache_dir, monkeypatch, gpu_target):
    """With autotuning on, the first backward tunes dK/dV and dQ from inside autograd's backward (grad mode
    off there): each candidate's timed pass really runs (the interpreter, with sm_86's plan), the winners
    are cached with a time each, the gradients are right, and the next step tunes nothing."""
    import torch

    import flashtx
    from flashtx import reference

    small = {kernel: {2: {64: [TileConfig(32, 32, 4, 1)]}} for kernel in autotune.TUNED_KERNELS}
    monkeypatch.setattr(autotune, "CANDIDATES", small)
    monkeypatch.setattr(autotune, "RUNTIME_SEQLEN", 48)
    monkeypatch.setattr(autotune, "RUNTIME_TOKENS", 48)
    monkeypatch.setattr(autotune, "RUNTIME_HIDDEN", 64)
    monkeypatch.setattr(autotune, "RUNTIME_DTYPE_16", "float16")  # the interpreter computes bf16 wrongly
    timed = []

    def one_call(fn, warmup_ms, rep_ms):  # the pass runs once; its "time" ranks the forced config
        fn()
        cfg = next(iter(autotune._forced.values()))[0]
        timed.append(_ident(cfg))
        return float(cfg.block_m * cfg.block_n)
    monkeypatch.setattr(autotune, "bench", one_call)
    autotune.autotune()

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 40, 64, generator=gen).to(torch.float16).requires_grad_() for _ in range(3))
    dout = torch.randn(1, 2, 40, 64, generator=gen).to(torch.float16)
    out = flashtx.attention(q, k, v, is_causal=True, backend="triton")
    grads = torch.autograd.grad(out, (q, k, v), dout)

    entries = json.loads((cache_dir / "autotune.json").read_text())["entries"]
    kernels = {key.split("|")[4]: e for key, e in entries.items()}
    assert set(kernels) == {"attn_fwd", "attn_bwd_dkdv", "attn_bwd_dq"}, list(entries)
    for name, e in kernels.items():
        assert e["timings"] and all(isinstance(ms, float) for ms in e["timings"].values()), (name, e["timings"])
        _config = autotune._config_from(e)
        assert _ident(_config) == (32, 32, 4, 1, False), (name, _config)  # the smallest tile won
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = reference.attention(q64, k64, v64, causal=True)
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), dout.double())
    assert (out.double() - ref).abs().max() < 2e-2
    for g, r in zip(grads, ref_grads):
        assert (g.double() - r).abs().max() < 5e-2

    n = len(timed)
    torch.autograd.grad(flashtx.attention(q, k, v, is_causal=True, backend="triton"), (q, k, v), dout)
    assert len(timed) == n  # tuned once per key


def test_two_threads_missing_one_key_tune_it_once_and_other_widths_keep_their_config(cache_dir, monkeypatch):
    """Concurrent first launches of one key (e.g. DataParallel replicas) time the candidates once; while a
    candidate is forced for one head dim, a launch of another head dim keeps its own config."""
    import threading
    import time

    timed = []

    def slow_time(kernel, cfg, **kw):
        timed.append(_ident(cfg))
        time.sleep(0.01)
        return float(cfg.block_m)
    monkeypatch.setattr(autotune, "time_candidate", slow_time)
    autotune.autotune()
    got = []
    threads = [threading.Thread(target=lambda: got.append(configs.select_config("attn_fwd", 64, 64, 2, H100)))
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    n_cands = len(autotune.candidates("attn_fwd", 64, 64, 2, H100))
    assert len(timed) == n_cands, (len(timed), n_cands)  # one tuning (of the causal key: one time per candidate)
    tuned = configs.select_config("attn_fwd", 64, 64, 2, H100)
    assert tuned.reason.startswith("autotuned") and len(got) == 4
    default = configs._select("attn_fwd", 64, 64, 2, H100, False)
    # a launch made while another thread tunes cannot wait for it (the tuner's own launches, on autograd's thread
    # in a backward, come through here too): it takes select_config's choice
    assert all(_ident(c) in (_ident(tuned), _ident(default)) for c in got)

    cfg = TileConfig(16, 16, 4, 1, "forced")
    with autotune.forced("attn_bwd_dq", cfg, (64, 64, 2)):
        assert configs.select_config("attn_bwd_dq", 64, 64, 2, H100) is cfg
        assert configs.select_config("attn_bwd_dq", 128, 128, 2, H100) is not cfg  # another width: not forced


def test_tuning_memoises_no_launch_plan_and_waits_out_a_graph_capture(cache_dir, monkeypatch):
    """While a key is tuned no launch plan is memoised (another thread's launch meanwhile would keep its untuned
    config for good); a launch inside a CUDA-graph capture (stood in) does not tune, and does not mark the key as
    failed: the next eager launch tunes it."""
    import torch

    from flashtx.triton_kernels import launch

    seen = []

    def fake_time(kernel, cfg, **kw):
        seen.append(launch.LAUNCHES.enabled)
        return float(cfg.block_m)
    monkeypatch.setattr(autotune, "time_candidate", fake_time)
    autotune.autotune()
    with monkeypatch.context() as m:
        m.setattr(torch.cuda, "is_available", lambda: True)
        m.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
        assert not configs.select_config("attn_fwd", 64, 64, 2, H100).reason.startswith("autotuned")
    assert not seen
    assert configs.select_config("attn_fwd", 64, 64, 2, H100).reason.startswith("autotuned")
    assert seen and not any(seen) and launch.LAUNCHES.enabled
