"""flashtx's optional CUDA C++ extension (csrc/): decode attention and fused RoPE + KV-cache append.

    >>> from flashtx import cuda_ext
    >>> cuda_ext.available(), cuda_ext.unavailable_reason()
    >>> cuda_ext.build()                        # JIT build (ninja), cached under TORCH_EXTENSIONS_DIR
    >>> out = cuda_ext.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cos, sin, cache_seqlens=lens,
    ...                                        block_table=bt, causal=True)

Two torch.library ops, `torch.ops.flashtx_cuda.decode_attention` and `.rotary_append`, from a
plain TORCH_LIBRARY binding (csrc/binding.cpp) loaded with torch.ops.load_library; their fake
implementations are registered here, so torch.compile traces them. Ways to get the library:
  - AOT: `FLASHTX_BUILD_CUDA=1 pip install --no-build-isolation -e .` builds flashtx/_flashtx_cuda*.so;
  - JIT: `flashtx.cuda_ext.build()`, or automatically on first use with FLASHTX_CUDA_EXT=1 (a
    source checkout: csrc/ is not installed);
  - neither: flashtx runs pure-Python/Triton as always; available() is False with a reason.

Off by default: timed on an H100 (2026-12-06, 9d4ae90; both kernels changed since, untimed), their decode took 3.2x
the Triton kernel's time, so no automatic choice takes them (not_supported_reasons(..., automatic=True) always says
so). They are flashtx's backend
"cuda" of the decode ops (registered in flashtx._dispatch after "triton"):
`flashtx.flash_attn_with_kvcache(..., backend="cuda")` takes them when they can run those inputs
(BackendNotSupported with the reasons otherwise); backend=None never does while MEASURED_FASTER
is False. Or call the functions here directly.
"""
from __future__ import annotations

import importlib.util
import math
import os
import sys
import time
from pathlib import Path

import torch

from . import _cuda_build as _b
from . import _env
from .triton_kernels.targets import num_splits_heuristic  # flash-attn 2's, shared with the Triton decode kernels

__all__ = [
    # the ops (decode attention, fused RoPE + KV-cache append, and flash-attn's decoding signature over both)
    "decode_attention", "rotary_append", "flash_attn_with_kvcache",
    # getting and checking the extension
    "available", "unavailable_reason", "load", "build", "not_supported_reasons", "grid_reason",
    "choose_num_splits", "MEASURED_FASTER",
]

SCHEMAS = {  # must equal the m.def strings of csrc/binding.cpp (tests/test_cuda_ext.py checks)
    "decode_attention": "decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor cache_seqlens, "
                        "Tensor? block_table, Tensor? cache_batch_idx, float softmax_scale, bool causal, "
                        "int num_splits, bool check_values) -> (Tensor, Tensor)",
    "rotary_append": "rotary_append(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, "
                     "Tensor? cos, Tensor? sin, Tensor cache_seqlens, Tensor? block_table, Tensor? cache_batch_idx, "
                     "bool interleaved, bool q_causal, bool check_values) -> Tensor",
}
DEVICE_TYPES = ("cuda",)  # the tests add "cpu" to run the Python glue over stand-in ops
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
SUPPORTED_HEAD_DIMS = (64, 128)
MAX_SPLITS = 128  # the binding's limit on num_splits
MAX_GRID = 65535  # the binding's limit on B, Sq, Hq and the decode grid's y dim (Hkv x row chunks)
MAX_CAPACITY = 2**30  # the binding's limit on cache positions (the kernels' positions and key tiles are ints)
INT32_MAX = 2**31 - 1
MIN_CAPABILITY = (8, 0)  # cp.async and bf16: sm_80 and newer
MIN_KEYS_PER_SPLIT = 256  # the heuristic gives each split at least this many keys (unmeasured guess)
MEASURED_FASTER = False  # True only once bench/RESULTS.md records it beating the Triton kernels (then
# DecodeCUDA.call_key must also go into the automatic plan key: see _decode_op.select)
STALE_LOCK_S = 900  # a JIT lock file older than this was left by a killed build
ENV_AUTO = "FLASHTX_CUDA_EXT"  # =1: build/load on first use
NOT_MEASURED = ("not measured faster than the Triton kernel on a GPU (an H100, 2026-12-06, bench/RESULTS.md: its "
                "decode took 3.2x the Triton kernel's time at batch 8 over 8k keys, at 9d4ae90; both changed since, "
                "untimed): off in automatic dispatch (off by default); pass backend='cuda'")

_state: dict = {"loaded": None, "error": None, "fakes": False}


# ---------------------------------------------------------------------------------------------
# Availability
# ---------------------------------------------------------------------------------------------

def build_env_reasons() -> list[str]:
    """Why the extension cannot be built here (empty when it can)."""
    reasons = []
    if torch.version.cuda is None:
        reasons.append(f"torch {torch.__version__} is a CPU-only build (the extension needs a CUDA build of torch)")
    if _b.find_nvcc() is None:
        reasons.append("nvcc not found (set CUDA_HOME or put nvcc on PATH)")
    missing = [s for s in _b.SOURCES if not (_b.ROOT / s).exists()]
    if missing:
        reasons.append(f"sources {missing} not found under {_b.ROOT} (JIT builds need a source checkout, "
                       "e.g. pip install -e .)")
    return reasons


def _ops_registered() -> bool:
    try:
        return hasattr(torch.ops.flashtx_cuda, "decode_attention")
    except (AttributeError, RuntimeError):
        return False


def aot_library() -> str | None:
    """Path of the library setup.py built (FLASHTX_BUILD_CUDA=1), or None."""
    try:
        spec = importlib.util.find_spec(_b.AOT_MODULE)
    except (ImportError, ValueError):
        return None
    return spec.origin if spec is not None and spec.origin and os.path.exists(spec.origin) else None


def load(build_if_missing: bool | None = None) -> bool:
    """Load the extension once: the AOT library if installed, else (with FLASHTX_CUDA_EXT=1 or
    build_if_missing) a JIT build. Returns whether the ops are registered; never raises."""
    if _state["loaded"]:
        return True
    if _ops_registered():
        _state["loaded"] = "already registered"
    else:
        path = aot_library()
        if path is not None:
            try:
                torch.ops.load_library(path)
                _state["loaded"] = f"AOT {path}"
            except (OSError, RuntimeError) as exc:
                _state["error"] = f"loading {path} failed: {exc}"
        # FLASHTX_CUDA_EXT=1 builds on first use where the extension can run (a CUDA device); build() or
        # build_if_missing=True build anywhere (e.g. to check that it compiles)
        want_build = (_env.flag(ENV_AUTO) and torch.cuda.is_available()) if build_if_missing is None \
            else build_if_missing
        if not _state["loaded"] and want_build and _state["error"] is None:
            try:
                build()
            except Exception as exc:  # reported by unavailable_reason()
                _state["error"] = f"JIT build failed: {type(exc).__name__}: {exc}"
    if _state["loaded"]:
        _register_fakes()
    return bool(_state["loaded"])


def unavailable_reason(build_if_missing: bool | None = None) -> str | None:
    """Why the extension cannot run here, or None when it can (see available()). build_if_missing
    as in load() (False: never start a JIT build, only look)."""
    if not load(build_if_missing):
        if _state["error"]:
            return _state["error"]
        env = build_env_reasons()
        how = ("FLASHTX_BUILD_CUDA=1 pip install --no-build-isolation -e . (AOT), or flashtx.cuda_ext.build() / "
               f"{ENV_AUTO}=1 (JIT)")
        if not env and not torch.cuda.is_available():
            env = ["no CUDA device is visible (it runs on one; build() compiles it anywhere)"]
        return "not built: " + ("; ".join(env) if env else f"build it with {how}")
    if not torch.cuda.is_available():
        return "no CUDA device is visible"
    return None


def available() -> bool:
    """True when the ops are loaded and a CUDA device is visible (unavailable_reason() says why not)."""
    return unavailable_reason() is None


def not_supported_reasons(q: torch.Tensor | None = None, k_cache: torch.Tensor | None = None, *,
                          automatic: bool = True) -> list[str]:
    """Why flashtx should not run (q, k_cache) through the extension; empty means it can.

    automatic=True (what dispatch would ask) also says "not measured faster" until the kernels
    have been timed against the Triton kernels on a GPU, so automatic choices never take them."""
    reasons = []
    off_device = any(t is not None and t.device.type not in DEVICE_TYPES for t in (q, k_cache))
    # an unused choice builds nothing: automatic dispatch before the kernels measured faster, or tensors it cannot run
    why = unavailable_reason(False if off_device or (automatic and not MEASURED_FASTER) else None)
    if why:
        reasons.append(why)
    for name, t in (("q", q), ("k_cache", k_cache)):
        if t is None:
            continue
        if t.device.type not in DEVICE_TYPES:
            reasons.append(f"{name} is on {t.device}; the extension runs CUDA tensors only")
        if t.dtype not in SUPPORTED_DTYPES:
            reasons.append(f"{name} dtype {t.dtype} is not supported (float16, bfloat16, float32)")
        if t.dim() >= 1 and t.shape[-1] not in SUPPORTED_HEAD_DIMS:
            reasons.append(f"{name} head dim {t.shape[-1]} is not supported (64 or 128)")
    if q is not None and q.is_cuda:
        cc = torch.cuda.get_device_capability(q.device)
        if cc < MIN_CAPABILITY:
            reasons.append(f"compute capability {cc[0]}.{cc[1]} < 8.0: the CUDA kernels need sm_80 or newer")
    if automatic and not MEASURED_FASTER:
        reasons.append(NOT_MEASURED)
    return reasons


# ---------------------------------------------------------------------------------------------
# JIT build
# ---------------------------------------------------------------------------------------------

def build_directory(name: str = _b.EXT_NAME) -> str:
    """Where the JIT build lives: $TORCH_EXTENSIONS_DIR/<name>, else torch's default root
    (~/.cache/torch_extensions/py<ver><abiflags>_<cu|rocm><ver>/<name>), as torch.utils.cpp_extension chooses."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is None:
        from torch.utils.cpp_extension import get_default_build_root

        hip, cuda = getattr(torch.version, "hip", None), torch.version.cuda
        acc = f"rocm{hip.replace('.', '')}" if hip else f"cu{cuda.replace('.', '')}" if cuda else "cpu"
        root = os.path.join(get_default_build_root(),
                            f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}_{acc}")
    return os.path.join(root, name)


def lock_problem(build_dir: str, *, stale_after_s: float = STALE_LOCK_S, now: float | None = None) -> str | None:
    """A message about build_dir/lock (torch's build lock), or None when there is none.

    A build that was killed leaves the lock behind and every later build waits on it forever."""
    lock = Path(build_dir) / "lock"
    try:
        age = (time.time() if now is None else now) - lock.stat().st_mtime
    except FileNotFoundError:
        return None
    if age > stale_after_s:
        return (f"stale lock file {lock} ({age:.0f} s old): a killed build left it, and builds would wait on it "
                f"forever. If no other build is running, delete it: rm {lock}")
    return (f"lock file {lock} ({age:.0f} s old): another process is building the extension. If none is, "
            f"delete it: rm {lock}")


def wait_for_lock(build_dir: str, *, wait_s: float = 600, poll_s: float = 2.0,
                  stale_after_s: float = STALE_LOCK_S) -> None:
    """Return when build_dir has no lock; raise RuntimeError naming the file to delete when the
    lock is stale or outlives wait_s."""
    t0 = time.time()
    said = False
    while True:
        msg = lock_problem(build_dir, stale_after_s=stale_after_s)
        if msg is None:
            return
        if msg.startswith("stale") or time.time() - t0 >= wait_s:
            raise RuntimeError(f"flashtx.cuda_ext.build: {msg}")
        if not said:
            print(f"flashtx.cuda_ext.build: waiting up to {wait_s:.0f} s: {msg}", file=sys.stderr, flush=True)
            said = True
        time.sleep(poll_s)


def _build_archs() -> list[int] | None:
    """None (torch reads TORCH_CUDA_ARCH_LIST) if that is set, as torch's own builds; else the visible GPU's
    arch; else ARCHS."""
    if os.environ.get("TORCH_CUDA_ARCH_LIST"):
        return None
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        if (major, minor) < MIN_CAPABILITY:  # (ptxas would fail on cp.async, after a minute of building)
            raise RuntimeError(f"cannot build flashtx's CUDA extension for this GPU: compute capability "
                               f"{major}.{minor} < 8.0 (the kernels need sm_80 or newer); pass archs=[80, ...] to "
                               "build for other GPUs")
        return [major * 10 + minor]
    return list(_b.ARCHS)


def build(*, verbose: bool = False, archs: list[int] | None = None, lock_wait_s: float = 600) -> str:
    """JIT-build and load the extension with torch.utils.cpp_extension.load (needs ninja).

    Cached in build_directory(): a rebuild with nothing changed takes ~2 s. Prints progress.
    archs: e.g. [90]; default TORCH_CUDA_ARCH_LIST if set (torch's rule), else the visible GPU, else
    sm_80/86/90.
    Returns the library path; raises RuntimeError saying why when it cannot build."""
    reasons = build_env_reasons()
    if reasons:
        raise RuntimeError("cannot build flashtx's CUDA extension: " + "; ".join(reasons))
    if _ops_registered():  # a second library cannot register the flashtx_cuda namespace again
        print(f"flashtx.cuda_ext: already loaded ({_state['loaded'] or 'registered'}); restart Python to load a "
              "rebuilt library", file=sys.stderr, flush=True)
        _state["loaded"] = _state["loaded"] or "already registered"
        _register_fakes()
        return str(_state["loaded"])
    from torch.utils import cpp_extension

    nvcc = _b.find_nvcc()
    home = _b.resolve_cuda_home(nvcc) if nvcc is not None else None
    if home is None:
        raise RuntimeError("cannot find the CUDA install nvcc uses (nvcc -dryrun gave no TOP); set CUDA_HOME")
    os.environ["CUDA_HOME"] = home
    cpp_extension.CUDA_HOME = home  # torch computed its guess at import (wrong for an nvcc wrapper script)
    if not cpp_extension.is_ninja_available():
        raise RuntimeError("cannot build flashtx's CUDA extension: ninja not found on PATH (pip install ninja, "
                           "and put that environment's bin/ on PATH)")
    build_dir = build_directory()
    os.makedirs(build_dir, exist_ok=True)
    wait_for_lock(build_dir, wait_s=lock_wait_s)
    archs = _build_archs() if archs is None else archs
    cuda_flags = [*_b.NVCC_FLAGS, *(_b.gencode_flags(archs, ptx=True) if archs else [])]
    print(f"flashtx.cuda_ext: building {_b.EXT_NAME} in {build_dir} "
          f"({'sm_' + ', sm_'.join(map(str, archs)) if archs else 'TORCH_CUDA_ARCH_LIST'}; "
          "about a minute the first time) ...", file=sys.stderr, flush=True)
    t0 = time.time()
    path = cpp_extension.load(name=_b.EXT_NAME, sources=[str(_b.ROOT / s) for s in _b.SOURCES],
                              extra_cflags=list(_b.CXX_FLAGS), extra_cuda_cflags=cuda_flags,
                              extra_include_paths=[str(_b.CSRC)], build_directory=build_dir,
                              verbose=verbose, is_python_module=False)
    print(f"flashtx.cuda_ext: built and loaded in {time.time() - t0:.1f} s", file=sys.stderr, flush=True)
    _state["loaded"], _state["error"] = f"JIT {path}", None
    _register_fakes()
    return str(path)


# ---------------------------------------------------------------------------------------------
# Host-side logic: split heuristic, argument checks, fake implementations
# ---------------------------------------------------------------------------------------------

def rows_per_cta(group_rows: int) -> int:
    """Mirror of ftx_decode_rows_per_cta (csrc/decode_attention.cu): 8 or 32 query rows a block."""
    return 8 if group_rows <= 8 else 32


def decode_ctas(batch: int, hq: int, hkv: int, sq: int) -> int:
    """Blocks per split of a decode launch: B * Hkv * row chunks of (Hq / Hkv) * Sq rows."""
    rows = (hq // hkv) * sq
    return batch * hkv * math.ceil(rows / rows_per_cta(rows))


DECODE_THREADS = 128  # decode_attention_kernel's block
DECODE_REGS_BOUND = 128  # registers a thread of it takes at most (csrc/RESOURCES.md, checked by tests/test_cuda_ext.py)
SMEM_RESERVED_PER_BLOCK = 1024  # shared memory the driver reserves per block on sm_80 and newer


def decode_smem_bytes(elt: int, d: int, rows: int) -> int:
    """Static shared memory of decode_attention_kernel<T, D, ROWS> (element size elt): a mirror of DecodeSmem
    (csrc/decode_attention.cu), double-buffered K/V where two buffers fit the static limit (_cuda_build's
    STATIC_SMEM_LIMIT, 48 KB), else one. Tests check it against what nvcc allocated (csrc/RESOURCES.md)."""
    bn, ldk = 8192 // (d * elt), d + 16 // elt  # keys a tile (8 KB of K), padded row

    def total(stages: int) -> int:
        return stages * (2 * bn * ldk * elt + 2 * bn * 4) + rows * d * elt + rows * bn * 4 + 3 * rows * 4
    return total(2) if total(2) <= _b.STATIC_SMEM_LIMIT else total(1)


def decode_ctas_per_sm(elt: int, d: int, rows: int, threads_per_sm: int, regs_per_sm: int, smem_per_sm: int) -> int:
    """Blocks of decode_attention_kernel an SM runs at once (its occupancy): by threads, registers (at
    DECODE_REGS_BOUND a thread) and shared memory (decode_smem_bytes plus the per-block reservation)."""
    by_threads = threads_per_sm // DECODE_THREADS
    by_regs = regs_per_sm // (DECODE_THREADS * DECODE_REGS_BOUND)
    by_smem = smem_per_sm // (decode_smem_bytes(elt, d, rows) + SMEM_RESERVED_PER_BLOCK)
    return max(1, min(by_threads, by_regs, by_smem))


def choose_num_splits(batch: int, hq: int, hkv: int, sq: int, capacity: int, num_sms: int, ctas_per_sm: int) -> int:
    """num_splits for a decode launch: flash-attn's heuristic over blocks of MIN_KEYS_PER_SPLIT keys of the cache
    capacity (an upper bound of every row's length; no device sync), with `ctas_per_sm` blocks running on each of
    `num_sms` SMs (decode_ctas_per_sm: 4 on an H100, 2 on an RTX 3090). flash-attn counts 2 (flash_api.cpp:
    multiProcessorCount * 2, for its 128-thread blocks of 64-128 KB); these blocks stream 16 KB K/V tiles (two in
    flight where double-buffered), and a latency-bound kernel needs every resident block busy: at batch 8 over 8k
    keys (GQA 32/8) 2 an SM gave 4 splits, 256 blocks for 528 places on an H100; 4 an SM gives 7, 448 blocks."""
    n_blocks = max(1, math.ceil(capacity / MIN_KEYS_PER_SPLIT))
    return num_splits_heuristic(decode_ctas(batch, hq, hkv, sq), ctas_per_sm * num_sms, n_blocks, MAX_SPLITS)


def _fail(op: str, msg: str, exc=ValueError):
    raise exc(f"flashtx.cuda_ext.{op}: {msg}")


def _check_int_vec(op, name, t, batch):
    if t.dtype != torch.int32:
        _fail(op, f"{name} must be int32; got {t.dtype}", TypeError)
    if tuple(t.shape) != (batch,):
        _fail(op, f"{name} must have shape (B,) = ({batch},); got {tuple(t.shape)}")


def _check_vec(op, name, t, q, ndim):
    if t.dim() != ndim:
        _fail(op, f"{name} must have {ndim} dims; got shape {tuple(t.shape)}")
    if t.dtype != q.dtype:
        _fail(op, f"{name} must have q's dtype {q.dtype}; got {t.dtype}", TypeError)
    if t.device != q.device:
        _fail(op, f"{name} must be on {q.device} like q; got {t.device}")
    if t.stride(-1) != 1:
        _fail(op, f"{name} must be contiguous in its last dim (stride 1); got strides {t.stride()}")


def check_cache_args(op, q, k_cache, v_cache, cache_seqlens, block_table, cache_batch_idx) -> int:
    """Shape/dtype checks of q (B, Sq, Hq, D) and the caches (no device sync); returns the capacity."""
    if q.dim() != 4:
        _fail(op, f"q must be (B, Sq, Hq, D); got shape {tuple(q.shape)}")
    if q.dtype not in SUPPORTED_DTYPES:
        _fail(op, f"q must be float16, bfloat16 or float32; got {q.dtype}", TypeError)
    batch, _, hq, d = q.shape
    if d not in SUPPORTED_HEAD_DIMS:
        _fail(op, f"head dim must be 64 or 128; got q of shape {tuple(q.shape)}")
    _check_vec(op, "q", q, q, 4)
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        _check_vec(op, name, t, q, 4)
    if k_cache.shape != v_cache.shape:
        _fail(op, f"k_cache and v_cache must have the same shape; got {tuple(k_cache.shape)} and "
                  f"{tuple(v_cache.shape)}")
    if k_cache.shape[3] != d:
        _fail(op, f"the caches' head dim must be q's ({d}); got {tuple(k_cache.shape)}")
    if k_cache.shape[0] == 0 or k_cache.shape[1] == 0 or k_cache.shape[2] == 0:
        _fail(op, f"the caches must not be empty (rows, positions and heads >= 1); got {tuple(k_cache.shape)}")
    _check_int_vec(op, "cache_seqlens", cache_seqlens, batch)
    capacity = k_cache.shape[1]
    if block_table is not None:
        if block_table.dtype != torch.int32:
            _fail(op, f"block_table must be int32; got {block_table.dtype}", TypeError)
        if block_table.dim() != 2 or block_table.shape[0] != batch or block_table.shape[1] == 0:
            _fail(op, f"block_table must be (B, max_blocks) = ({batch}, >0); got {tuple(block_table.shape)}")
        if cache_batch_idx is not None:
            _fail(op, "cache_batch_idx cannot be used with a paged cache (block_table); index the block_table "
                      "rows instead")
        capacity = block_table.shape[1] * k_cache.shape[1]
    elif cache_batch_idx is not None:
        _check_int_vec(op, "cache_batch_idx", cache_batch_idx, batch)
    elif k_cache.shape[0] < batch:
        _fail(op, f"k_cache has {k_cache.shape[0]} batch rows but q has B = {batch}; pass cache_batch_idx to "
                  "map batch rows to cache rows")
    if capacity > MAX_CAPACITY:
        _fail(op, f"the cache capacity ({capacity} positions) must be <= 2**30")
    return capacity


def grid_reason(q, k_cache) -> str | None:
    """Why the decode kernel's grid cannot cover q (B, Sq, Hq, D) over caches of Hkv heads, or None (the binding's
    checks: B, Sq, Hq <= 65535, and Hkv x row chunks of (Hq / Hkv) * Sq query rows <= 65535)."""
    batch, sq, hq = q.shape[:3]
    hkv = k_cache.shape[2]
    if max(batch, sq, hq) > MAX_GRID:
        return f"B, Sq and Hq must be <= {MAX_GRID} (the grid); got q of shape {tuple(q.shape)}"
    if hkv and hq % hkv == 0:
        rows = (hq // hkv) * sq
        chunks = -(-rows // rows_per_cta(rows))
        if hkv * chunks > MAX_GRID:
            return (f"Hkv x row chunks = {hkv} x {chunks} passes the grid's {MAX_GRID} (chunks of "
                    f"{rows_per_cta(rows)} of the (Hq / Hkv) * Sq = {rows} query rows per KV head)")
    return None


def check_decode_args(q, k_cache, v_cache, cache_seqlens, block_table=None, cache_batch_idx=None,
                      num_splits=1) -> int:
    """The decode op's shape checks, as the binding does them (also run by the fake); returns capacity."""
    cap = check_cache_args("decode_attention", q, k_cache, v_cache, cache_seqlens, block_table, cache_batch_idx)
    if q.shape[2] % k_cache.shape[2] != 0:
        _fail("decode_attention", f"q's heads ({q.shape[2]}) must be a multiple of the caches' heads "
                                  f"({k_cache.shape[2]})")
    if not 1 <= num_splits <= MAX_SPLITS:
        _fail("decode_attention", f"num_splits must be in [1, {MAX_SPLITS}]; got {num_splits}")
    why = grid_reason(q, k_cache)
    if why is not None:
        _fail("decode_attention", why)
    return cap


def check_rotary_append_args(q, k, v, k_cache, v_cache, cos, sin, cache_seqlens, block_table=None,
                             cache_batch_idx=None) -> int:
    """The rotary_append op's shape checks, as the binding does them; returns the rotary dim."""
    op = "rotary_append"
    cap = check_cache_args(op, q, k_cache, v_cache, cache_seqlens, block_table, cache_batch_idx)
    batch, sq, _, d = q.shape
    for name, t in (("k", k), ("v", v)):
        _check_vec(op, name, t, q, 4)
    if k.shape != v.shape or tuple(k.shape[:2]) != (batch, sq) or k.shape[3] != d:
        _fail(op, f"k and v must be (B, Sq, Hkv, D) with q's B, Sq, D = {batch}, {sq}, {d}; got {tuple(k.shape)} "
                  f"and {tuple(v.shape)}")
    if k_cache.shape[2] != k.shape[2]:
        _fail(op, f"the caches' heads ({k_cache.shape[2]}) must be k's ({k.shape[2]})")
    if (cos is None) != (sin is None):
        _fail(op, "pass both cos and sin, or neither")
    if (q.shape[2] + 2 * k.shape[2]) * d > INT32_MAX:
        _fail(op, f"(Hq + 2 Hkv) * D = ({q.shape[2]} + 2 * {k.shape[2]}) * {d} elements per token must fit int32")
    if cos is None:
        return 0
    for name, t in (("cos", cos), ("sin", sin)):
        if t.dtype not in (torch.float32, q.dtype):
            _fail(op, f"{name} must be float32 or q's dtype {q.dtype}; got {t.dtype}", TypeError)
        if t.dim() != 2:
            _fail(op, f"{name} must be (S_rot, rotary_dim / 2); got shape {tuple(t.shape)}")
    if cos.shape != sin.shape or cos.dtype != sin.dtype:
        _fail(op, f"cos and sin must have the same shape and dtype; got {tuple(cos.shape)} {cos.dtype} and "
                  f"{tuple(sin.shape)} {sin.dtype}")
    rd, vec = 2 * cos.shape[1], 16 // q.element_size()
    if not (0 < rd <= d and rd % (2 * vec) == 0):
        _fail(op, f"rotary_dim = 2 * cos.shape[1] must be a multiple of {2 * vec} in [{2 * vec}, {d}] for "
                  f"{q.dtype}; got {rd}")
    if cos.shape[0] < cap:
        _fail(op, f"cos/sin must cover every cache position: {cos.shape[0]} rows for a cache capacity of {cap}")
    if cos.shape[0] > INT32_MAX:
        _fail(op, f"cos/sin have {cos.shape[0]} rows; at most 2**31 - 1 (int positions)")
    return rd


def _decode_fake(q, k_cache, v_cache, cache_seqlens, block_table, cache_batch_idx, softmax_scale, causal,
                 num_splits, check_values):
    check_decode_args(q, k_cache, v_cache, cache_seqlens, block_table, cache_batch_idx, num_splits)
    batch, sq, hq, d = q.shape
    return q.new_empty((batch, sq, hq, d)), q.new_empty((batch, hq, sq), dtype=torch.float32)


def _rotary_append_fake(q, k, v, k_cache, v_cache, cos, sin, cache_seqlens, block_table, cache_batch_idx,
                        interleaved, q_causal, check_values):
    check_rotary_append_args(q, k, v, k_cache, v_cache, cos, sin, cache_seqlens, block_table, cache_batch_idx)
    return q.new_empty(q.shape)


def _register_fakes() -> None:
    if _state["fakes"]:
        return
    torch.library.register_fake(f"{_b.EXT_NAME}::decode_attention")(_decode_fake)
    torch.library.register_fake(f"{_b.EXT_NAME}::rotary_append")(_rotary_append_fake)
    _state["fakes"] = True


from ._cuda_ext_api import decode_attention, flash_attn_with_kvcache, rotary_append  # noqa: E402,F401
from ._cuda_ext_api import DecodeCUDA  # noqa: E402
from . import _dispatch  # noqa: E402

for _op in ("kvcache_append", "kvcache_attention"):  # after "triton" (flashtx._decode_op imports this module)
    _dispatch.register(_op, "cuda", DecodeCUDA())
