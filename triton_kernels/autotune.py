"""Autotuning of the attention tile configs on the GPU at hand (issue 13, item 2). Off by default.

    FLASHTX_AUTOTUNE=1 python train.py         # or, in code: flashtx.triton_kernels.autotune.autotune()
    python -m bench.tune                       # the offline sweep: a table ready to paste into configs.py

When on, the first launch of each kernel for a new key times every candidate config that fits the
GPU's shared memory (CANDIDATES below, plus configs.py's own choice) on synthetic inputs of the
launch's head dims, keeps the fastest, and stores it in a JSON cache, so later runs on the same GPU
pay nothing: `$FLASHTX_CACHE_DIR/autotune.json`, default `~/.cache/flashtx/autotune.json`. The key
is the GPU name, its arch, the Triton version, the kernel, the dtype, the head dims, causal and
whether score modifiers (mask, softcap, ALiBi, dropout) are on. configs.select_config consults
`lookup` through a hook at its top only while autotuning is on; when off (the default) the hook is
None and nothing extra runs, so compile time is what it was.

select_config is not told the dtype (its signature stays as it is), so the hook's key has dtype "16-bit"
(fp16 and bf16, one element size) or "float32". Causal and non-causal launches are keyed apart (causal True /
False), as configs.py's tables are (configs.FULL): their best tiles differ (H100, 2026-12-06: dK/dV at D = 128 is
fastest at 32x64 w4 causal and 64x128 w8 full, each 11% slower on the other), so each key is timed on its own
kind of input. `bench.tune` measures each (dtype, causal, N) on its own.

The backward kernels are tuned from inside the first backward that launches them (each candidate's timed
pass records its own forward with grad on). One key is tuned at a time (a lock: threads that miss the same
key tune it once). While a forced()/tune_now() block runs, in any thread, nothing else is tuned and other
launches take select_config's choice (they cannot wait: on a GPU the tuner's own backward launches come from
autograd's device thread); a forced candidate applies only to launches of the widths it is timed for. A key
whose candidates all fail is warned about once and keeps select_config's choice for the rest of the process.

A cache file that cannot be read or does not have the expected form is ignored with a warning, once per
process (and rewritten on the next store); so is an entry of the wrong types, and one whose config is not
among candidates() for its launch (that key is tuned afresh). A store re-reads and merges the file under an
inter-process lock (flock on autotune.json.lock) and replaces it atomically; a cache that cannot be written is
warned about once and its results kept for the process. Under torch.compile tracing only the cache is read:
tuning then would time fake tensors; tune eagerly first (one eager step, or `python -m bench.tune --write-cache`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import statistics
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Callable, Iterable

from . import configs
from .autotune_timing import time_candidate  # noqa: F401  (tune_now's; bench.tune and tests use it here)
from .configs import TileConfig

CACHE_VERSION = 1
ENV = "FLASHTX_AUTOTUNE"
DTYPE_ANY_16 = "16-bit"

# Candidates per kernel, element size and head-dim bucket, beyond configs.py's own (always tried
# first, so tuning never picks something worse than the default without having timed it). They are
# the tiles FlashAttention-2's Triton tutorial and Triton's fused-attention tutorial use, and their
# neighbours; shared memory is checked per GPU with configs.estimate_shared_memory before timing,
# and a candidate that fails to compile or launch (registers, OutOfResources) is skipped. The dK/dV lists open
# with FlexAttention's sm_90 tiles, which spill there, and end with the 8-warp tiles sm_90's table shipped before
# an H100 timed them 1.7-1.9x slower (2026-12-06), so a sweep keeps comparing against them.
_T = TileConfig
CANDIDATES: dict[str, dict[int, dict[int, list[TileConfig]]]] = {
    "attn_fwd": {
        2: {64: [_T(128, 64, 4, 3), _T(128, 128, 8, 3), _T(128, 32, 4, 4), _T(64, 64, 4, 4), _T(128, 64, 8, 4),
                 _T(64, 32, 4, 3)],
            128: [_T(128, 64, 8, 3), _T(128, 128, 8, 2), _T(64, 64, 4, 3), _T(128, 64, 4, 3), _T(64, 32, 4, 3),
                  _T(128, 32, 8, 3)]},
        4: {64: [_T(64, 64, 4, 2), _T(32, 32, 4, 2)], 128: [_T(32, 32, 4, 1), _T(32, 16, 4, 2)]},
    },
    "attn_bwd_dkdv": {
        2: {64: [_T(64, 64, 4, 3), _T(32, 128, 8, 2), _T(32, 64, 4, 3), _T(64, 128, 8, 2), _T(16, 64, 4, 3),
                 _T(32, 128, 4, 3), _T(64, 64, 8, 3)],
            128: [_T(64, 128, 8, 3), _T(32, 128, 8, 2), _T(64, 128, 8, 2), _T(16, 128, 8, 2), _T(32, 64, 4, 3),
                  _T(64, 64, 8, 2), _T(16, 64, 4, 2), _T(32, 64, 8, 3)]},
        4: {64: [_T(16, 64, 4, 2), _T(32, 64, 8, 1)], 128: [_T(16, 32, 4, 1), _T(32, 32, 8, 1)]},
    },
    "attn_bwd_dq": {
        2: {64: [_T(128, 64, 8, 2), _T(64, 64, 4, 3), _T(128, 32, 4, 3), _T(64, 32, 4, 2), _T(128, 128, 8, 2)],
            128: [_T(128, 64, 8, 2), _T(128, 32, 8, 2), _T(64, 64, 4, 2), _T(64, 64, 8, 3), _T(128, 128, 8, 1),
                  _T(32, 64, 4, 2)]},
        4: {64: [_T(32, 32, 4, 2), _T(64, 64, 8, 1)], 128: [_T(32, 16, 4, 1), _T(16, 16, 4, 1)]},
    },
}
TUNED_KERNELS = tuple(CANDIDATES)
# sm_90 and later can also time tiles that read the streamed operands through tensor descriptors (TMA, issue 13's
# Hopper path). The forward's are the tiles of Triton's fused-attention tutorial, which reads K/V through
# descriptors on Hopper, and the sm_90 table's own. No table entry uses TMA until a GPU run has timed it faster
# (bench.tune).
# The backward's are FlexAttention's sm_90 tiles (the table's until it was compile-swept) and one neighbour each,
# streaming Q/dO (dK/dV) or K/V (dQ) that way.
# Triton 3.6's ptxas crashes (error -11) on three 2-stage TMA tiles the compile check tried (forward 128x128 w8 at
# D = 128, dQ 128x64 w8 at D = 64 and 128), which Triton 3.9 compiles: they are not candidates.
TMA_CANDIDATES: dict[str, dict[int, dict[int, list[TileConfig]]]] = {
    "attn_fwd": {
        2: {64: [_T(128, 64, 4, 3, tma=True), _T(128, 128, 8, 3, tma=True), _T(128, 64, 8, 4, tma=True)],
            128: [_T(128, 64, 8, 3, tma=True), _T(64, 64, 4, 3, tma=True), _T(128, 64, 4, 3, tma=True)]},
    },
    "attn_bwd_dkdv": {
        2: {64: [_T(64, 64, 4, 3, tma=True), _T(32, 128, 8, 2, tma=True)],
            128: [_T(64, 128, 8, 3, tma=True), _T(32, 128, 8, 2, tma=True)]},
    },
    "attn_bwd_dq": {
        2: {64: [_T(64, 64, 4, 3, tma=True), _T(128, 64, 8, 3, tma=True)],
            128: [_T(128, 64, 8, 3, tma=True), _T(64, 64, 4, 3, tma=True)]},
    },
}
TMA_MIN_ARCH = 90
# Whether a user's autotuning (FLASHTX_AUTOTUNE=1 / flashtx.autotune()) times the TMA candidates by default. Off
# until a GPU run has passed tests/test_attention_tma.py on sm_90: a descriptor kernel that faults there (an illegal
# address) would leave the user's CUDA context unusable. `python -m bench.tune` times them (after every other
# candidate, so such a fault costs only their rows), and a TMA winner it caches (--write-cache) is used.
TMA_BY_DEFAULT = False


def _warn(message: str) -> None:
    """A UserWarning at the user's line (flashtx._env.warn; imported here, on the warning path only)."""
    from .._env import warn

    warn(message)


def enabled() -> bool:
    return configs_hook() is not None


def configs_hook():
    return getattr(configs, "_autotune_hook", None)


def autotune(enable: bool = True) -> None:
    """Turn autotuning on (or off): the first launch of each kernel per key tunes it on this GPU once,
    and the result is cached on disk. Same as FLASHTX_AUTOTUNE=1 at import."""
    configs._autotune_hook = _hook if enable else None
    launch = sys.modules.get(__package__ + ".launch")  # not imported here: configs imports this module early
    cache = getattr(launch, "LAUNCHES", None)  # None too while launch itself is being imported (it imports configs,
    # which turns the tuner on under FLASHTX_AUTOTUNE=1): nothing is planned yet then
    if cache is not None:
        cache.clear()  # launches planned before now chose their configs without the tuner


# ------------------------------------------------------------------------------------------ cache
_paths: dict[tuple[str, str], Path] = {}  # (FLASHTX_CACHE_DIR or the default, its ~-expansion) -> absolute file


def cache_path() -> Path:
    """$FLASHTX_CACHE_DIR/autotune.json (default ~/.cache/flashtx/), `~` expanded and made absolute the first time
    a value is seen: a process that changes directory keeps reading and writing the same file."""
    raw = os.environ.get("FLASHTX_CACHE_DIR") or os.path.join("~", ".cache", "flashtx")
    expanded = os.path.expanduser(raw)
    path = _paths.get((raw, expanded))
    if path is None:
        path = _paths.setdefault((raw, expanded), Path(os.path.abspath(expanded)) / "autotune.json")
    return path


def make_key(*, gpu: str, arch: int, triton_version: str, kernel: str, dtype: str, block_dqk: int, block_dv: int,
             causal, modified: bool, kernels: str | None = None) -> str:
    """A cache key; `kernels` (default: this install's kernels_hash()) ties a timing to the kernels' source, so a
    changed kernel is tuned afresh rather than served an old winner."""
    kernels = kernels_hash() if kernels is None else kernels
    return (f"{gpu}|sm_{arch}|triton {triton_version}|kernels {kernels}|{kernel}|{dtype}|d{block_dqk}/{block_dv}|"
            f"causal={causal}|modified={bool(modified)}")


_KERNEL_SOURCES = ("attention_fwd.py", "attention_bwd.py", "attention_common.py")
_kernels_hash: list[str] = []


def kernels_hash() -> str:
    """8 hex digits of a hash of the attention kernels' source files (read once)."""
    if not _kernels_hash:
        import hashlib
        h = hashlib.sha256()
        for name in _KERNEL_SOURCES:
            h.update((Path(__file__).parent / name).read_bytes())
        _kernels_hash.append(h.hexdigest()[:8])
    return _kernels_hash[0]


_lock = threading.Lock()
_memory: dict[str, dict] | None = None  # the cache file's entries, loaded once, plus this process's stores
_warned: set[tuple] = set()  # cache problems already warned about by cached()/store() (reset_memory clears)
_checked: dict[tuple, bool] = {}  # (the hook's arguments, key, ident) -> whether the cached config is a candidate
_CONFIG_INTS = ("block_m", "block_n", "num_warps", "num_stages")


def _warn_once(what: tuple, message: str) -> None:
    if what not in _warned:
        _warned.add(what)
        _warn(message)


def _config_from(entry) -> TileConfig | None:
    """The entry's config, or None unless it has the JSON types store() writes: positive ints (not bools,
    floats or strings) and, if present, a real bool tma."""
    c = entry.get("config") if isinstance(entry, dict) else None
    if not isinstance(c, dict):
        return None
    ints = [c.get(name) for name in _CONFIG_INTS]
    tma = c.get("tma", False)
    if not all(type(v) is int and v > 0 for v in ints) or type(tma) is not bool:
        return None
    reason = c.get("reason")
    return TileConfig(*ints, reason if isinstance(reason, str) else "autotuned", tma)


def _read(path: Path, warn: Callable[[tuple, str], None]) -> dict[str, dict]:
    """The well-formed entries of the cache file at `path`; never raises (an unreadable file gives {})."""
    try:
        if not path.exists():
            return {}
        data = json.loads(path.read_text())
        version = data.get("version") if isinstance(data, dict) else None
        if type(version) is not int or version != CACHE_VERSION or not isinstance(data.get("entries"), dict):
            raise ValueError(f"not a flashtx autotune cache of version {CACHE_VERSION}")
    except Exception as exc:  # noqa: BLE001 - OSError, ValueError, RecursionError (deep nesting): all ignored
        warn(("file", path), f"flashtx autotune: ignoring the cache {path}: {type(exc).__name__}: "
                             f"{' '.join(str(exc).split())[:200]}")
        return {}
    good = {}
    for key, entry in data["entries"].items():
        if _config_from(entry) is not None:
            good[key] = entry
        else:
            warn(("entry", path, key), f"flashtx autotune: ignoring a malformed entry in {path}: {key!r}")
    return good


def load_cache(path: Path | None = None) -> dict[str, dict]:
    """The cache's well-formed entries; {} when the file is unreadable or malformed. Warns at each call about
    what it ignores (the tuner's own reads warn once per process)."""
    return _read(path or cache_path(), lambda what, message: _warn(message))


@contextlib.contextmanager
def _file_lock(path: Path, timeout_s: float = 30.0):
    """Holds an exclusive flock on `path`.lock (kept, never deleted) while the block runs, so that processes
    storing at once merge rather than overwrite each other's results. Without fcntl, where the lock file cannot be
    opened, or after timeout_s, the block runs unlocked (the replace is still atomic)."""
    try:
        import fcntl
        fd = os.open(path.with_name(path.name + ".lock"), os.O_RDWR | os.O_CREAT, 0o666)
    except (ImportError, OSError):
        fd = None
    try:
        deadline = time.monotonic() + timeout_s
        while fd is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.002)
            except OSError:  # no locks on this file system (ENOLCK)
                break
        yield
    finally:
        if fd is not None:
            os.close(fd)  # releases the lock


def _write(path: Path, entries: dict) -> None:
    """Write through a temporary file unique to this process and call, then rename it over `path` (atomic)."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{uuid.uuid4().hex[:12]}.tmp")
    try:
        tmp.write_text(json.dumps({"version": CACHE_VERSION, "entries": entries}, indent=1, sort_keys=True))
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def store(key: str, cfg: TileConfig, *, ms: float | None = None, timings: dict | None = None,
          path: Path | None = None) -> bool:
    """Add one result to the cache file (re-read, merged and atomically replaced under an inter-process lock)
    and, for the cache's own file, to this process's entries. A file that cannot be written is warned about once
    and the result kept for this process only. Returns whether the file was written."""
    global _memory
    own = cache_path()
    path = path or own
    entry = {"config": {"block_m": cfg.block_m, "block_n": cfg.block_n, "num_warps": cfg.num_warps,
                        "num_stages": cfg.num_stages, "tma": cfg.tma, "reason": cfg.reason or "autotuned"},
             "ms": ms, "timings": timings or {}}
    written, entries = False, {key: entry}
    with _lock:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with _file_lock(path):
                entries = {**_read(path, _warn_once), key: entry}
                _write(path, entries)
            written = True
        except OSError as exc:
            _warn_once(("write", path), f"flashtx autotune: cannot write the cache {path} ({type(exc).__name__}: "
                                        f"{exc}); tuned configs are kept for this process only: set "
                                        "FLASHTX_CACHE_DIR to a writable directory to keep them")
        if path == own:  # entries loaded earlier (or kept unwritten) stay, whatever the file holds now
            _memory = {**(_memory or {}), **entries}
    return written


def cached(key: str) -> TileConfig | None:
    global _memory
    if _memory is None:
        with _lock:
            if _memory is None:
                _memory = _read(cache_path(), _warn_once)
    entry = _memory.get(key)
    return _config_from(entry) if entry is not None else None


def _cached_for(key, kernel, block_dqk, block_dv, elt, target, modified, causal=True) -> TileConfig | None:
    """cached(key), if it is one of candidates() for the launch (checked once per key and config): a config the
    tuner would not have timed here (edited, or from another flashtx) is ignored with a warning, like a miss. A TMA
    candidate is accepted on sm_90 whatever TMA_BY_DEFAULT says: it was timed on this GPU (bench.tune --write-cache
    caches one only when it was timed at every length and no TMA tile failed)."""
    cfg = cached(key)
    if cfg is None:
        return None
    memo = (key, kernel, block_dqk, block_dv, elt, target, modified, causal, ident_of(cfg))
    ok = _checked.get(memo)
    if ok is None:
        ok = _checked[memo] = memo[-1] in {ident_of(c) for c in
                                           candidates(kernel, block_dqk, block_dv, elt, target, modified, tma=True,
                                                                      causal=causal)}
        if not ok:
            _warn(f"flashtx autotune: ignoring the cached config {describe(cfg)} for {key} in {cache_path()}: not "
                  "one of the candidates for this GPU, kernel and head dims; tuning afresh")
    return cfg if ok else None


def reset_memory() -> None:
    """Forget the loaded cache, the keys that failed to tune and the warnings given (tests, or after another
    process wrote it)."""
    global _memory
    _memory = None
    _failed.clear()
    _warned.clear()
    _checked.clear()


# ------------------------------------------------------------------------------------- candidates
def candidates(kernel: str, block_dqk: int, block_dv: int, elt: int, target,
               modified: bool = False, tma: bool | None = None, causal: bool = True) -> list[TileConfig]:
    """configs.py's choice first (for a causal launch, or with causal False a full one: configs.FULL), then this
    module's list (on sm_90 and later with `tma`, then the TMA candidates; None: TMA_BY_DEFAULT); only those whose
    estimated shared memory fits `target`; no duplicates (the reason is not part of the identity). A modified key's
    launches may load an attn_mask tile, which Triton stages in shared memory at key counts that are not multiples of
    16 or in another dtype than q's: the candidates beyond configs.py's (which the compile check builds so) must fit
    with an fp32 one (estimate_shared_memory's mask_elt 10), since a tuned tile serves every length and mask."""
    size, bucket = (2 if elt <= 2 else 4), configs.head_dim_bucket(max(block_dqk, block_dv))
    out: list[TileConfig] = []
    seen = set()
    try:
        default = [configs._select(kernel, block_dqk, block_dv, elt, target, modified, False, causal)]
    except (RuntimeError, KeyError):
        default = []
    with_tma = (TMA_BY_DEFAULT if tma is None else tma) and target.arch >= TMA_MIN_ARCH
    extra = TMA_CANDIDATES.get(kernel, {}).get(size, {}).get(bucket, []) if with_tma else []
    for i, cfg in enumerate(default + CANDIDATES.get(kernel, {}).get(size, {}).get(bucket, []) + extra):
        ident = ident_of(cfg)
        if ident in seen:
            continue
        mask = 10 if modified and i >= len(default) else 0  # (an fp32 mask: attention_common.mask_elt's 2 * 4 + 2)
        if configs.estimate_shared_memory(kernel, cfg, block_dqk, block_dv, elt, target, mask) > target.max_shared:
            continue
        seen.add(ident)
        out.append(cfg)
    return out


def best_of(cands: Iterable[TileConfig], time_fn: Callable[[TileConfig], float]) -> tuple[TileConfig | None, dict]:
    """Time each candidate (ms; an exception or a non-finite time skips it); the fastest and all timings."""
    timings: dict[str, float | str] = {}
    best, best_ms = None, float("inf")
    for cfg in cands:
        name = describe(cfg)
        try:
            ms = float(time_fn(cfg))
        except Exception as exc:  # noqa: BLE001 - a candidate that cannot compile or launch here is skipped
            timings[name] = f"failed: {type(exc).__name__}: {' '.join(str(exc).split())[:120]}"
            continue
        if not ms == ms or ms <= 0 or ms == float("inf"):
            timings[name] = "failed: no valid time"
            continue
        timings[name] = ms
        if ms < best_ms:
            best, best_ms = cfg, ms
    return best, timings


def describe(cfg: TileConfig) -> str:
    return f"{cfg.block_m}x{cfg.block_n} w{cfg.num_warps} s{cfg.num_stages}" + (" tma" if cfg.tma else "")


def ident_of(cfg: TileConfig) -> tuple:
    """What makes two configs the same launch (the reason is not part of it)."""
    return (cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages, cfg.tma)


# ------------------------------------------------------------------------------------ forcing, hook
_forced: dict[str, tuple[TileConfig, tuple | None]] = {}  # kernel -> (config, (block_dqk, block_dv, elt) or None)
_tune_lock = threading.Lock()  # one tuning at a time: two threads missing one key tune it once
# How many forced()/tune_now() blocks are running (_tuning_block), process-wide: while one is, the kernels it does
# not force keep the cache's (or select_config's) choice and nothing else is tuned. Process-wide, not per thread:
# on a GPU the autograd engine runs a backward on its own device thread, so a per-thread flag set by the tuner's
# thread would not be seen by the backward launches it times.
_active = 0
_active_lock = threading.Lock()
_failed: set[str] = set()  # keys whose tuning timed no candidate: not retried on every launch (reset_memory clears)


@contextlib.contextmanager
def _tuning_block():
    """One forced()/tune_now() block: counted process-wide (tuning()), and while any runs no launch plan is
    memoised (LAUNCHES.enabled follows the count: every call plans afresh, so no plan made with a candidate,
    or with an untuned default in another thread, outlives the tuning)."""
    from .launch import LAUNCHES

    global _active
    with _active_lock:
        _active += 1
        LAUNCHES.enabled = False
        LAUNCHES.drop_lanes()  # per-signature plans (flashtx._lanes) are neither used nor made meanwhile
    try:
        yield
    finally:
        with _active_lock:
            _active -= 1
            LAUNCHES.enabled = _active == 0


def tuning() -> bool:
    """Whether a forced() or tune_now() block is running (in any thread)."""
    return _active > 0


@contextlib.contextmanager
def forced(kernel: str, cfg: TileConfig, key: tuple | None = None):
    """Inside the block, select_config returns `cfg` for `kernel` (the tuner times candidates this
    way, through the public ops): for every launch of it, or with key = (block_dqk, block_dv, elt) only for
    launches of those register tile widths and element size (another thread's other shapes keep their
    configs). Needs the hook installed; installs it for the block if it is not."""
    prev_hook = configs_hook()
    if prev_hook is None:
        configs._autotune_hook = _hook
    prev = _forced.get(kernel)
    _forced[kernel] = (cfg, key)
    try:
        with _tuning_block():  # the other kernels of the pass keep select_config's (or the cache's) choice
            yield
    finally:
        if prev is None:
            _forced.pop(kernel, None)
        else:
            _forced[kernel] = prev
        if prev_hook is None:
            configs._autotune_hook = None


def _hook(kernel, block_dqk, block_dv, elt, target, modified, masked=False, causal=True):
    """configs.select_config's hook while autotuning is on: a forced, cached or freshly tuned config,
    or None for select_config's own choice (always for masked launches: the timings ran no visibility masks,
    and the MASKED tables hold tiles that spill less there)."""
    hit = _forced.get(kernel)
    if hit is not None and (hit[1] is None or hit[1] == (block_dqk, block_dv, elt)):
        return hit[0]
    if kernel not in TUNED_KERNELS or elt > 4 or masked:
        return None  # (float64: the tests' dtype, not tuned)
    key = None
    try:
        key = runtime_key(kernel, block_dqk, block_dv, elt, target, modified, causal)
        hit = _cached_for(key, kernel, block_dqk, block_dv, elt, target, modified, causal)
        if hit is not None:
            return hit
        if tuning() or _compiling() or _capturing() or _saved_tensor_hooks() or key in _failed:
            return None  # (not marked failed: a later plain eager launch tunes it)
        with _tune_lock:  # another thread may have tuned this key while this one waited
            hit = _cached_for(key, kernel, block_dqk, block_dv, elt, target, modified, causal)
            if hit is not None or key in _failed:
                return hit
            return tune_now(key, kernel, block_dqk, block_dv, elt, target, modified, causal=causal)
    except Exception as exc:  # noqa: BLE001 - tuning must never break a launch: fall back to the default
        if key is not None:
            _failed.add(key)
        _warn(f"flashtx autotune: {kernel} not tuned ({type(exc).__name__}: {exc}); using the default")
        return None


def _saved_tensor_hooks() -> bool:
    """Whether saved-tensor hooks are active (non-reentrant checkpointing, activation offloading): the timing runs'
    own forward and backward would go through them (a CheckpointError: the recompute saved other tensors; copies
    timed with the kernels)."""
    import torch
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)  # (private: None where absent)
    return top is not None and top(False) is not None


def _capturing() -> bool:
    """Inside a CUDA-graph capture, where timing (syncs, allocations) cannot run: tune on a later eager launch."""
    try:
        import torch
        return bool(torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())
    except Exception:  # noqa: BLE001
        return False


def _compiling() -> bool:
    """Inside a trace, where timing cannot run real kernels: Dynamo's, or a dispatch mode's (fake tensors, the
    proxy and functional modes AOTAutograd runs an op's body under; torch 2.11 leaves is_compiling() False there,
    later torch holds it for the whole compile)."""
    try:
        import torch
        return bool(torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack())
    except Exception:  # noqa: BLE001
        return False


def gpu_identity(target) -> tuple[str, str]:
    import torch
    import triton
    index = getattr(target, "device", -1)  # (the launch's GPU, not the current one: cuda_target's index)
    name = torch.cuda.get_device_name(index if index >= 0 else None) if torch.cuda.is_available() \
        else f"sm_{target.arch}"
    return name, triton.__version__


def runtime_key(kernel, block_dqk, block_dv, elt, target, modified, causal=True) -> str:
    gpu, tv = gpu_identity(target)
    return make_key(gpu=gpu, arch=target.arch, triton_version=tv, kernel=kernel,
                    dtype=DTYPE_ANY_16 if elt <= 2 else "float32", block_dqk=block_dqk, block_dv=block_dv,
                    causal=bool(causal), modified=modified)


# Synthetic problem for tuning at run time: B*N = 16k tokens, H*D = 2048 (as bench/test_attention.py).
RUNTIME_SEQLEN, RUNTIME_TOKENS, RUNTIME_HIDDEN = 4096, 16384, 2048
RUNTIME_DTYPE_16 = "bfloat16"  # the 16-bit keys are timed in bf16 (fp16 runs the same tiles)


def tune_now(key, kernel, block_dqk, block_dv, elt, target, modified, *, causal=True,
             time_fn=None) -> TileConfig | None:
    """Time the candidates for one key (causal or full inputs, as the key says), store and return the fastest."""
    cands = candidates(kernel, block_dqk, block_dv, elt, target, modified, causal=causal)
    if not cands:
        _failed.add(key)
        return None
    with _tuning_block():  # another thread's launches meanwhile: select_config's choice, planned afresh
        if time_fn is None:
            import torch
            dtype = getattr(torch, RUNTIME_DTYPE_16) if elt == 2 else torch.float32

            index = getattr(target, "device", -1)  # time on the launch's GPU (cpu: Triton's interpreter, tests)
            device = (f"cuda:{index}" if index >= 0 else "cuda") if torch.cuda.is_available() else "cpu"

            def time_fn(cfg):
                return time_candidate(kernel, cfg, d=block_dqk, dv=block_dv, causal=bool(causal), dtype=dtype,
                                      seqlen=RUNTIME_SEQLEN, tokens=RUNTIME_TOKENS, hidden=RUNTIME_HIDDEN,
                                      device=device, modified=modified)
        best, timings = best_of(cands, time_fn)
    if best is None:  # say so once, and keep select_config's choice for this key from now on
        _failed.add(key)
        why = next(iter(timings.values()), "no candidate fits")
        _warn(f"flashtx autotune: no candidate for {key} could be timed (first: {why}); using the "
              "default from now on")
        return None
    best = dataclasses.replace(best, reason=f"autotuned: {timings[describe(best)]:.3f} ms")
    store(key, best, ms=timings[describe(best)], timings=timings)
    return best


def bench(fn, warmup_ms: float, rep_ms: float) -> float:
    """Median ms of fn (triton.testing.do_bench: CUDA events, L2 flushed between calls)."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")


def summarize(timings: dict) -> str:
    ok = {k: v for k, v in timings.items() if isinstance(v, float)}
    if not ok:
        return "no candidate ran"
    best = min(ok, key=ok.get)
    return f"{best}: {ok[best]:.3f} ms (median of candidates {statistics.median(ok.values()):.3f} ms)"


if configs.AUTOTUNE_REQUESTED:  # FLASHTX_AUTOTUNE=1
    autotune(True)
