"""The autotune cache file under odd contents and conditions (triton_kernels/autotune.py, CPU, fake timers).

Checked: an entry that overflows or a file nested too deep is ignored (the rest kept) with one warning per
process; a cached config is used only if the tuner would have timed it for that launch (exact JSON types, a
candidate for that GPU, kernel and head dims), else the key is tuned afresh; a cache that cannot be written keeps
the tuned config for the process with one warning and no temporary file left; processes storing at once lose
nothing; a relative or `~` FLASHTX_CACHE_DIR names one absolute file for the whole process.
"""
from __future__ import annotations

import json
import multiprocessing
import os
import warnings
from pathlib import Path

import pytest
import torch

from test_autotune import H100, RTX3090

import flashtx.triton_kernels.attention_bwd_launch  # noqa: F401  (gpu_target stands in imported modules' target)
import flashtx.triton_kernels.attention_fwd  # noqa: F401
from flashtx.triton_kernels import autotune, configs
from flashtx.triton_kernels.configs import TileConfig


def _ident(cfg):
    return autotune.ident_of(cfg)


def _entry(cfg: TileConfig, **override):
    c = {"block_m": cfg.block_m, "block_n": cfg.block_n, "num_warps": cfg.num_warps, "num_stages": cfg.num_stages,
         "tma": cfg.tma}
    c.update(override)
    return {"config": c}


def _write_cache(path, entries: dict) -> None:
    path.write_text(json.dumps({"version": autotune.CACHE_VERSION, "entries": entries}))


def _fake_timer(monkeypatch, winner=None, fail=False):
    """time_candidate stood in: `winner` is fastest; every call is recorded."""
    calls = []

    def fake(kernel, cfg, **kw):
        calls.append(_ident(cfg))
        if fail:
            raise RuntimeError("cannot run here")
        return 1.0 if winner is not None and _ident(cfg) == _ident(winner) else 2.0
    monkeypatch.setattr(autotune, "time_candidate", fake)
    return calls


def _messages(record, pattern):
    return [str(w.message) for w in record if pattern in str(w.message)]


# ------------------------------------------------------------------------------ 1: overflow, nesting
@pytest.mark.parametrize("bad", ["1e999", "Infinity"])
def test_an_entry_that_overflows_is_dropped_and_the_others_kept(cache_dir, monkeypatch, bad):
    cands = autotune.candidates("attn_fwd", 128, 128, 2, H100)
    good_key = autotune.runtime_key("attn_fwd", 128, 128, 2, H100, False)
    bad_key = autotune.runtime_key("attn_fwd", 64, 64, 2, H100, False)
    text = json.dumps({"version": 1, "entries": {good_key: _entry(cands[1]), bad_key: _entry(cands[1], block_m=7)}})
    (cache_dir / "autotune.json").write_text(text.replace('"block_m": 7', f'"block_m": {bad}'))
    with pytest.warns(UserWarning, match="malformed entry"):
        assert list(autotune.load_cache()) == [good_key]
    calls = _fake_timer(monkeypatch)
    autotune.autotune()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(5):
            assert _ident(configs.select_config("attn_fwd", 128, 128, 2, H100)) == _ident(cands[1])
    assert not calls  # the good entry is used: nothing tuned
    assert len(record) == 1 and "malformed entry" in str(record[0].message), [str(w.message) for w in record]


def test_a_file_nested_too_deep_is_ignored_with_one_warning_per_process(cache_dir, monkeypatch):
    (cache_dir / "autotune.json").write_text('{"version": 1, "entries": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.warns(UserWarning, match="ignoring the cache"):
        assert autotune.load_cache() == {}
    calls = _fake_timer(monkeypatch, fail=True)  # nothing tunes, so the file is never rewritten
    autotune.autotune()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(3):
            for d in (64, 128):
                configs.select_config("attn_bwd_dq", d, d, 2, H100)
    assert len(_messages(record, "ignoring the cache")) == 1, [str(w.message) for w in record]
    assert not _messages(record, "not tuned")
    assert len(_messages(record, "could be timed")) == 2 and calls  # each key tried once, then its default


# ------------------------------------------------------------------------ 2: only the tuner's configs
_BAD = {
    "block_m 3": dict(block_m=3),
    "1x1 tile": dict(block_m=1, block_n=1),
    "num_warps 3": dict(num_warps=3),
    "num_warps 1000": dict(num_warps=1000),
    "1024x1024 s8": dict(block_m=1024, block_n=1024, num_stages=8),
    "block_m str": "str",
    "block_m float": "float",
    "num_warps bool": dict(num_warps=True),
    "tma 'false'": dict(tma="false"),
}


@pytest.mark.parametrize("bad", list(_BAD) + ["tma on sm_86"])
def test_a_cached_config_the_tuner_would_not_time_is_ignored_and_retuned(cache_dir, monkeypatch, bad):
    target = RTX3090 if bad == "tma on sm_86" else H100
    cands = autotune.candidates("attn_fwd", 128, 128, 2, target)
    base, winner = cands[1], cands[2]
    if bad == "tma on sm_86":
        entry = _entry(next(c for c in autotune.candidates("attn_fwd", 128, 128, 2, H100, tma=True) if c.tma))
    elif _BAD[bad] in ("str", "float"):
        entry = _entry(base, block_m={"str": str, "float": float}[_BAD[bad]](base.block_m))
    else:
        entry = _entry(base, **_BAD[bad])
    key = autotune.runtime_key("attn_fwd", 128, 128, 2, target, False)
    _write_cache(cache_dir / "autotune.json", {key: entry})
    calls = _fake_timer(monkeypatch, winner)
    autotune.autotune()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        got = configs.select_config("attn_fwd", 128, 128, 2, target)
        again = configs.select_config("attn_fwd", 128, 128, 2, target)
    assert _ident(got) == _ident(winner) and got.reason.startswith("autotuned: "), got  # tuned afresh
    assert _ident(again) == _ident(got) and len(calls) == len(cands)  # once (the causal key: causal timings)
    ignored = [m for m in (str(w.message) for w in record) if "ignoring" in m]
    assert len(ignored) == 1, [str(w.message) for w in record]
    autotune.reset_memory()  # the file now holds the tuned config
    assert _ident(autotune.cached(key)) == _ident(winner)


def test_a_foreign_cached_config_is_warned_about_once_and_the_default_kept(cache_dir, monkeypatch):
    key = autotune.runtime_key("attn_bwd_dq", 64, 64, 2, H100, False)
    _write_cache(cache_dir / "autotune.json", {key: _entry(TileConfig(16, 16, 4, 1))})
    _fake_timer(monkeypatch, fail=True)
    autotune.autotune()
    default = configs._select("attn_bwd_dq", 64, 64, 2, H100, False)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(3):
            assert _ident(configs.select_config("attn_bwd_dq", 64, 64, 2, H100)) == _ident(default)
    assert len(_messages(record, "ignoring the cached config 16x16 w4 s1")) == 1, [str(w.message) for w in record]


# ------------------------------------------------------------------------------ 3: unwritable cache
@pytest.mark.parametrize("how", ["dir is a file", "autotune.json is a dir", "read-only"])
def test_an_unwritable_cache_keeps_the_tuned_config_for_the_process(tmp_path, monkeypatch, how):
    cache = tmp_path / "cache"
    cache.mkdir()
    if how == "dir is a file":
        cache = tmp_path / "a-file"
        cache.write_text("x")
    elif how == "autotune.json is a dir":
        (cache / "autotune.json").mkdir()
    else:  # as on a read-only mount (root writes through chmod)
        real = os.replace

        def refuse(src, dst):
            if str(dst).endswith("autotune.json"):
                raise OSError(30, "Read-only file system", str(src))
            return real(src, dst)
        monkeypatch.setattr(os, "replace", refuse)
    monkeypatch.setenv("FLASHTX_CACHE_DIR", str(cache))
    autotune.reset_memory()
    try:
        cands = autotune.candidates("attn_fwd", 128, 128, 2, H100)
        calls = _fake_timer(monkeypatch, cands[2])
        autotune.autotune()
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            got = configs.select_config("attn_fwd", 128, 128, 2, H100)
            n = len(calls)
            again = configs.select_config("attn_fwd", 128, 128, 2, H100)
            assert len(calls) == n  # kept in memory: not retuned
            other = configs.select_config("attn_bwd_dq", 128, 128, 2, H100)  # a second store that fails
        assert _ident(got) == _ident(cands[2]) and got.reason.startswith("autotuned: ")
        assert _ident(again) == _ident(got) and other.reason.startswith("autotuned: ")
        assert not _messages(record, "not tuned")
        cannot = _messages(record, "cannot write the cache")
        assert len(cannot) == 1 and str(cache / "autotune.json") in cannot[0] and "FLASHTX_CACHE_DIR" in cannot[0]
        if cache.is_dir():
            assert not [p for p in os.listdir(cache) if p.endswith(".tmp")]
    finally:
        autotune.autotune(False)
        autotune.reset_memory()


# ------------------------------------------------------------------------------ 4: concurrent stores
def _store_many(path: str, worker: int, n: int, start) -> None:
    start.wait(10)
    for i in range(n):
        autotune.store(f"worker{worker}|key{i}", TileConfig(64, 64, 4, 2), path=Path(path))


@pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(), reason="needs fork (fast workers)")
def test_processes_storing_at_once_lose_nothing(tmp_path):
    ctx = multiprocessing.get_context("fork")  # the workers inherit the imports: no 4 s torch import each
    path, workers, n = tmp_path / "autotune.json", 3, 30
    start = ctx.Event()
    procs = [ctx.Process(target=_store_many, args=(str(path), w, n, start)) for w in range(workers)]
    for p in procs:
        p.start()
    start.set()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0] * workers
    assert len(json.loads(path.read_text())["entries"]) == workers * n
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


def test_each_store_writes_through_its_own_temporary_file(tmp_path, monkeypatch):
    """Unique per call, not per pid only: processes on two hosts sharing the cache may have one pid."""
    names, real = [], os.replace

    def record(src, dst):
        names.append(os.path.basename(src))
        return real(src, dst)
    monkeypatch.setattr(os, "replace", record)
    for i in range(2):
        autotune.store(f"k{i}", TileConfig(64, 64, 4, 2), path=tmp_path / "autotune.json")
    assert len(set(names)) == 2 and all(str(os.getpid()) in name for name in names), names


# ------------------------------------------------------------------------------ 5: where the file is
def test_a_relative_cache_dir_names_one_file_for_the_process(tmp_path, monkeypatch):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    rel = f"rel-cache-{tmp_path.name}"  # resolved once per process: a name no other test uses
    monkeypatch.setenv("FLASHTX_CACHE_DIR", rel)
    monkeypatch.chdir(a)
    autotune.reset_memory()
    try:
        autotune.store("k1", TileConfig(64, 64, 4, 2))
        monkeypatch.chdir(b)
        autotune.store("k2", TileConfig(64, 32, 4, 2))
        assert autotune.cache_path() == a / rel / "autotune.json"
        assert sorted(json.loads((a / rel / "autotune.json").read_text())["entries"]) == ["k1", "k2"]
        assert not (b / rel).exists()
    finally:
        autotune.reset_memory()


def test_a_tilde_cache_dir_is_expanded(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("FLASHTX_CACHE_DIR", "~/ftx-cache")
    monkeypatch.chdir(tmp_path)
    autotune.reset_memory()
    try:
        assert autotune.cache_path() == tmp_path / "home" / "ftx-cache" / "autotune.json"
        autotune.store("k", TileConfig(64, 64, 4, 2))
        assert (tmp_path / "home" / "ftx-cache" / "autotune.json").is_file() and not (tmp_path / "~").exists()
    finally:
        autotune.reset_memory()


def test_a_store_keeps_the_entries_already_loaded(tmp_path, monkeypatch):
    """Entries read from one cache file stay in use after a store into another (the directory changed)."""
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    _write_cache(first / "autotune.json", {"k1": _entry(TileConfig(64, 64, 4, 2))})
    monkeypatch.setenv("FLASHTX_CACHE_DIR", str(first))
    autotune.reset_memory()
    try:
        assert _ident(autotune.cached("k1")) == (64, 64, 4, 2, False)
        monkeypatch.setenv("FLASHTX_CACHE_DIR", str(second))
        autotune.store("k2", TileConfig(64, 32, 4, 2))
        assert _ident(autotune.cached("k1")) == (64, 64, 4, 2, False)
        assert _ident(autotune.cached("k2")) == (64, 32, 4, 2, False)
    finally:
        autotune.reset_memory()


def _tiny_tuning(monkeypatch):
    """Tuning on CPU as test_autotune's backward test does it (one small candidate a kernel, one real pass each in
    the interpreter, its "time" the tile area); returns the list each timed pass appends the forced tile to."""
    small = {kernel: {2: {64: [TileConfig(32, 32, 4, 1)]}} for kernel in autotune.TUNED_KERNELS}
    monkeypatch.setattr(autotune, "CANDIDATES", small)
    for name, value in (("RUNTIME_SEQLEN", 48), ("RUNTIME_TOKENS", 48), ("RUNTIME_HIDDEN", 64),
                        ("RUNTIME_DTYPE_16", "float16")):
        monkeypatch.setattr(autotune, name, value)
    timed = []

    def one_call(fn, warmup_ms, rep_ms):
        fn()
        cfg = next(iter(autotune._forced.values()))[0]
        timed.append(cfg)
        return float(cfg.block_m * cfg.block_n)
    monkeypatch.setattr(autotune, "bench", one_call)
    autotune.autotune()
    return timed


@pytest.mark.parametrize("gpu_target", [86], indirect=True, ids=lambda a: f"sm_{a}")
def test_tuning_leaves_the_rng_and_saved_tensor_hooks_alone(cache_dir, monkeypatch, gpu_target):
    """Tuning drew its inputs from the caller's RNG (a reentrant checkpoint's recompute then drew other dropout
    masks: wrong gradients) and ran under the caller's saved-tensor hooks (non-reentrant checkpointing raised
    CheckpointError on every run, the keys marked failed; offloading hooks copied the tuner's tensors). Now:
    a private generator, the RNG state restored, and no tuning while such hooks are active (nor a failure mark:
    a plain call later tunes)."""
    import torch

    import flashtx

    timed = _tiny_tuning(monkeypatch)
    q = torch.randn(1, 2, 40, 64).to(torch.float16).requires_grad_()
    packed = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(1) or t, lambda t: t):
        out = flashtx.attention(q, q, q, is_causal=True, backend="triton")
    assert not timed and not autotune._failed  # not tuned under the hooks, and not given up on
    assert len(packed) < 12  # only the user's own op saved tensors (the tuner's passes saved dozens)
    torch.autograd.grad(out.float().sum(), q)
    q = torch.randn(1, 2, 44, 64).to(torch.float16).requires_grad_()  # (a new signature: plans are memoised)
    state = torch.get_rng_state()
    flashtx.attention(q, q, q, is_causal=True, backend="triton")  # tunes the three kernels now
    tuned = {key.split("|")[4] for key in autotune.load_cache()}
    assert timed and tuned == {"attn_fwd", "attn_bwd_dkdv", "attn_bwd_dq"}, tuned
    assert torch.equal(torch.get_rng_state(), state)  # (each timed pass drew its inputs from a private generator)


def test_modified_keys_are_timed_with_a_modifier_and_masked_launches_keep_their_tables(cache_dir, monkeypatch):
    """A key with score modifiers was timed on the plain kernel (a tile that spills with modifiers could win);
    masked launches (windows, masks, lengths, varlen) took the tuned plain tile over the MASKED table's."""
    import flashtx

    seen = []
    monkeypatch.setattr(flashtx, "attention", lambda *a, **kw: seen.append(kw.get("softcap")) or a[0])
    monkeypatch.setattr(autotune, "bench", lambda fn, *a: (fn(), 1.0)[1])
    for modified in (False, True):
        autotune.time_candidate("attn_fwd", TileConfig(32, 32, 4, 1), d=64, causal=True, dtype=torch.float16,
                                seqlen=16, tokens=16, hidden=64, device="cpu", modified=modified)
    assert seen == [0.0, 30.0]
    key = autotune.runtime_key("attn_fwd", 64, 64, 2, RTX3090, False)
    autotune.store(key, TileConfig(128, 64, 4, 3, "test"))
    assert autotune._hook("attn_fwd", 64, 64, 2, RTX3090, False, False) is not None
    assert autotune._hook("attn_fwd", 64, 64, 2, RTX3090, False, True) is None  # masked: select_config's own
    assert autotune._hook("attn_fwd", 64, 64, 8, RTX3090, False, False) is None  # float64: never tuned


def test_keys_name_the_launch_gpu_and_the_kernels_source(monkeypatch):
    """The key named the current GPU (cuda:0) for a launch on another one, and nothing tied a timing to the
    kernels it timed: cuda_target's index picks the GPU, and a hash of the kernels' source is in the key."""
    import dataclasses

    import torch

    names = {None: "GPU-CURRENT", 1: "GPU-ONE"}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=None: names[i])
    on_one = dataclasses.replace(H100, device=1)
    assert on_one == H100 and hash(on_one) == hash(H100)  # (selection is the same for two GPUs of one model)
    assert autotune.gpu_identity(on_one)[0] == "GPU-ONE" and autotune.gpu_identity(H100)[0] == "GPU-CURRENT"
    key = autotune.runtime_key("attn_fwd", 64, 64, 2, on_one, False)
    assert key.startswith("GPU-ONE|sm_90|") and f"|kernels {autotune.kernels_hash()}|attn_fwd|" in key
    assert len(autotune.kernels_hash()) == 8
