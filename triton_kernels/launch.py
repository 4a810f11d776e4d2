"""Launch plans: what a launcher would run, so the compile check can compile exactly that.

A launcher builds a list of `Launch`es from real tensors and a `Target`, then runs them. The
compile check builds the same plans for sm_80/86/90 from CPU tensors and compiles each one with
Triton's own argument specialisation, without a GPU.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import struct

import torch
import triton.language as tl

from .configs import INTERPRETER_TARGET, Target, TileConfig, cuda_target, interpreter_active
from .precision import TORCH_ACC_DTYPE, dot_precision  # noqa: F401 (the launchers import them from here)
from .limits import exporting, unbacked
from .launch_host import (HostStep, Scratch, _HostEntry, _HostReplay, _ScratchReplay,  # noqa: F401
                          _scratch_index, _where)

# Accumulator dtype per input dtype: fp32 for the half types and fp32, fp64 for fp64 (tests).
ACC_DTYPE = {
    torch.float16: tl.float32,
    torch.bfloat16: tl.float32,
    torch.float32: tl.float32,
    torch.float64: tl.float64,
}

LOG2E = 1.0 / math.log(2.0)


@dataclasses.dataclass
class Launch:
    kernel: object  # a triton.JITFunction
    grid: tuple
    args: dict  # every kernel argument by name, constexprs included
    config: TileConfig | None = None
    shared_estimate: int | None = None  # configs.estimate_shared_memory's for this launch (its mask tile counted)
    # tensor arguments the kernel reads through device-side tensor descriptors (TMA): the plan relies on their
    # 16-byte alignment (a cached plan replays only for inputs so aligned: LaunchCache), and the launch needs
    # Triton's scratch allocator (ensure_scratch_allocator)
    descriptors: tuple = ()

    def run(self):
        run_kernel(self.kernel, self.grid, self.args, self.config.launch_kwargs if self.config is not None else {},
                   bool(self.descriptors))


_INTERPRET = interpreter_active()  # read once: Triton itself reads the switch only at import
_STUB = None  # see stub_launches

# Triton compiler options every flashtx launch asks for, rather than inheriting Triton's default.
# enable_fp_fusion: a * b + c as one FMA. Triton enables it by default up to 3.9, but 3.9 warns that
# 3.10 turns the default off (TRITON_DEFAULT_FP_FUSION). flashtx's tiles were timed and its
# tolerances checked with fusion on (FlashAttention's CUDA is compiled with --fmad=true too), so a
# launch asks for it: one user-visible knob less, and no silent slowdown on a newer Triton.
# TRITON_FORCE_DISABLE_FP_FUSION still wins (Triton's own override). The interpreter drops the option;
# compile_check.compile_launch passes it, so CI compiles what a launch runs.
BACKEND_OPTIONS = {"enable_fp_fusion": True}
_TRACED_OPTIONS = None  # see _traced_options


def _traced_options() -> dict:
    """BACKEND_OPTIONS for a wrap_triton launch, where the installed torch compiles them: Inductor hands a
    user kernel's backend options to triton.compile only since it filters launch kwargs per target
    (try_filter_backend_options_for_target); an older one would take enable_fp_fusion for a kernel
    argument. There Triton's default applies (on, up to Triton 3.9)."""
    global _TRACED_OPTIONS
    if _TRACED_OPTIONS is None:
        try:
            from torch._inductor.runtime.triton_helpers import try_filter_backend_options_for_target  # noqa: F401
        except ImportError:
            _TRACED_OPTIONS = {}
        else:
            _TRACED_OPTIONS = BACKEND_OPTIONS
    return _TRACED_OPTIONS


def run_kernel(kernel, grid, args: dict, launch_kwargs: dict, scratch: bool = False):
    """Every flashtx kernel launch goes through here.

    On a GPU, while anything traces (torch.compile's fake tensors, AOTAutograd's functional
    tensors: a dispatch mode is active), it launches through torch.library.wrap_triton, so
    Inductor records the kernel inside the flashtx op (a torch.library.triton_op) and a compiled
    model calls it from generated code with no flashtx Python in between. In eager mode it is the
    plain launch: flashtx._library.call runs op bodies outside the op's own dispatch, where
    wrap_triton would send every launch through its higher-order op. Triton's interpreter cannot
    run on the fake tensors of a trace, so there (CPU tests) the ops stay opaque under
    torch.compile (flashtx._library) and a traced launch is skipped; real CPU tensors launch as
    usual. tests/test_launch.py checks the GPU branch with a stand-in kernel. Returns what an eager GPU
    launch returns (Triton's compiled kernel, which LaunchCache launches directly from then on), else None.
    scratch: the kernel makes tensor descriptors on the device (global scratch memory, from Triton's allocator;
    Inductor sets its own in compiled code).
    """
    if _STUB is not None:
        _STUB(kernel, grid, args)
    elif _INTERPRET:
        if not any(isinstance(a, torch.Tensor) and _is_traced(a) for a in args.values()):
            kernel[grid](**args, **launch_kwargs, **BACKEND_OPTIONS)
    elif torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack():
        from torch.library import wrap_triton  # a trace (fake/functional tensors): record the kernel

        wrap_triton(kernel)[grid](**args, **launch_kwargs, **_traced_options())
    else:  # eager: the plain launch (wrap_triton would route it through a higher-order op, ~1 ms)
        if scratch:
            ensure_scratch_allocator()
        return kernel[grid](**args, **launch_kwargs, **BACKEND_OPTIONS)
    return None


def _scratch(size: int, alignment: int, stream):
    """Triton's allocator for a launch's global scratch (device-side tensor descriptors, 128 bytes a program):
    the caching allocator's memory on the current device and stream (512-byte aligned)."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def ensure_scratch_allocator() -> None:
    """Install _scratch as Triton's allocator in this context (a contextvar: each thread, autograd's device
    thread included, starts without one) unless something (the user, Inductor) has set one."""
    from triton.runtime import _allocation

    if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        _allocation._allocator.set(_scratch)


class LaunchCache:
    """Launch lists memoised per call signature, so a repeated call skips planning (config selection,
    scalar splitting, the argument dicts) and only rebinds its tensors.

    `key` must hold every non-tensor input that decides the plan (scalars, flags, the device), and every
    identity between tensors that it branches on (rotary's in place: qo is q); the tensors' dtypes, shapes and
    strides are added here. `names` gives, for each of `tensors`, the kernel
    argument it is passed as (its role), so that inputs that are one object (self-attention's q is k)
    still rebind by role. An entry stores each launch's arguments without tensors, and the input (and
    dtype view, as a bool mask read as uint8) each tensor argument takes. Tensors the plan allocated are
    replayed fresh each call when the plan declares them (Scratch), and HostSteps rebound to the call's
    tensors. A plan that launches on a tensor it allocated without declaring it, or on an input it cannot
    tell by role, or has another kind of host step, is built every call. Never consulted while anything
    traces (fake tensors have symbolic shapes, and a compiled graph calls the kernels from generated code
    anyway) or on tensor subclasses.
    """

    MAX_ENTRIES = 512  # signatures kept before the cache starts over (a varlen stream has many shapes)

    def __init__(self):
        self.entries: dict = {}
        self.seen: dict = {}  # signatures run(..., twice=True) planned once (see run)
        self.enabled = True  # off while the autotuner forces configs (triton_kernels/autotune.py)
        # callers' own memos of entries (flashtx._lanes: the per-signature plans of attention, RoPE and SwiGLU), dropped
        # with them
        self.lanes: dict = {}
        self.generation = 0  # counts drop_lanes(): a memo made from entries read before one is not kept

    def clear(self) -> None:
        self.drop_lanes()
        self.entries.clear()
        self.seen.clear()

    def drop_lanes(self) -> None:
        self.generation += 1  # first: a lane being made now (another thread) sees it after it stores itself
        self.lanes.clear()

    def run(self, key: tuple, names: tuple, tensors: tuple, build, derived: int = 0, twice: bool = False) -> None:
        """Run the launches build() returns for `tensors` (tensors or None; names[i] is tensors[i]'s role).
        derived: how many of the last tensors the launcher allocated itself, with shapes, strides and dtypes
        that follow from the other tensors and `key` alone: they are left out of the signature. twice: memoise a
        signature on its second call only, for launchers whose signatures may change every call (the few-query
        decode route over keys that grow by a token a step, transformers' DynamicCache: memoising each cost
        more than planning it, ~100 us against ~45 with launches stubbed, and the full table dropped every lane
        with it every MAX_ENTRIES steps)."""
        sig = self.enabled and _signature(tensors, len(tensors) - derived)
        if not sig:  # off, tracing, or a tensor subclass: plan this call
            for step in build():
                step.run()
            return
        entry = self.entries.get((key, sig))
        if entry is None or (type(entry) is _AlignedEntry and not entry.holds(tensors)):
            entry = self._miss((key, sig), names, tensors, build, twice)
            if entry is None:  # not cacheable, or planned for aligned inputs that these are not: already run
                return
        if type(entry) is _HostEntry:  # its Scratch replays append their fresh tensors
            tensors = list(tensors)
        for replay in entry:
            replay.fire(tensors)

    def entry(self, key: tuple, names: tuple, tensors: tuple, build, derived: int = 0, host: bool = False):
        """The memoised launches run() would replay for `tensors` (planned now on a miss, not run), or None where
        run() would plan the call afresh (cache off, tracing, a tensor subclass, a plan that cannot be replayed).
        For a caller that keeps the entry itself (flashtx._attention_lane, _rotary_lane, _swiglu_lane) and fires
        each launch; an _AlignedEntry replays only for tensors it holds(). A _HostEntry (Scratch, HostSteps) only
        for a caller that says it fires one (host: with a list of the tensors, which its Scratch replays extend)."""
        sig = self.enabled and _signature(tensors, len(tensors) - derived)
        if not sig:
            return None
        sig = (key, sig)
        entry = self.entries.get(sig)
        if entry is None:
            generation = self.generation
            entry = _memo(build(), names, tensors)
            if entry is not None:
                self._store(sig, entry, generation)
        return None if type(entry) is _HostEntry and not host else entry

    def _miss(self, sig: tuple, names: tuple, tensors: tuple, build, twice: bool = False):
        """Plan a call whose signature has no usable entry: the new entry (stored, not yet run), or None after
        running the plan itself (not cacheable, an aligned entry that these tensors do not fit, or with `twice`
        the signature's first call)."""
        generation = self.generation
        steps = build()
        entry = None
        if sig not in self.entries:
            if twice and sig not in self.seen:
                self.keep(self.seen, sig, True, generation)  # (a full table starts over; no lane holds it)
            else:
                entry = _memo(steps, names, tensors)
        if entry is None:
            for step in steps:
                step.run()
            return None
        self._store(sig, entry, generation)
        return entry

    def _store(self, sig: tuple, entry, generation: int) -> None:
        self.keep(self.entries, sig, entry, generation)

    def keep(self, table: dict, key, value, generation: int) -> bool:
        """Store `value` (planned from what was current at `generation`) under `key` in `table` (self.entries, or
        self.lanes for flashtx._lanes), unless a tuner started or the cache was dropped while it was planned (in
        another thread, or in its build() itself): a plan made with an untuned default or another thread's forced
        candidate must not outlive the tuning (it is still used for the call that made it). Stored first, then
        checked again, so a drop between the check and the store cannot leave it in the fresh table. A full table
        starts over (a full launch table drops the lanes too: they hold its entries). Returns whether it is kept."""
        if generation != self.generation or not self.enabled:
            return False
        if len(table) >= self.MAX_ENTRIES:
            if table is self.entries:
                self.drop_lanes()
                generation = self.generation
            table.clear()
        table[key] = value
        if generation != self.generation or not self.enabled:
            table.pop(key, None)
            return False
        return True


# Eager GPU replays launch Triton's compiled kernel directly (its launcher, with JITFunction.run's arguments but no
# launch metadata and no hooks where none is set; CompiledKernel[grid](*args) where one is) instead of going through
# JITFunction.run again: that skips Triton's argument binding, specialisation and cache-key work, ~10-25 us a launch
# for kernels with tens of arguments (triton-lang/triton#3503; tritonbench's launch_latency: 12.5 us of
# JITFunction.run for 19 arguments against 3.4 us for the compiled kernel). A replay's non-tensor arguments are
# fixed, so Triton would pick the same compiled kernel, as long as each tensor keeps the 16-byte alignment it was
# specialised on: a change of alignment goes back through JITFunction.run. False: every replay goes through
# JITFunction.run.
DIRECT_LAUNCH = True
_ALIGN = 16  # Triton specialises pointer arguments on data_ptr() % 16 == 0


class _Replay:
    """One memoised launch: the kernel, grid and launch options, its non-tensor arguments (by name, and in
    the kernel's parameter order with placeholders for tensors), and where each input tensor goes (name,
    position, input index, dtype view or None). After its first eager GPU launch it also holds Triton's
    compiled kernel with the device and alignment bits it was launched for (see DIRECT_LAUNCH), as one tuple
    that fire() reads once: another thread may replace it meanwhile, never mix its parts with the old ones'."""

    __slots__ = ("kernel", "grid", "launch_kwargs", "template", "values", "slots", "positional", "direct", "scratch")

    def __init__(self, kernel, grid, launch_kwargs, template, values, slots, positional, scratch=False):
        # three dims: the compiled kernel's launcher reads grid[0], grid[1] and grid[2] (JITFunction.run pads a
        # shorter grid itself; CompiledKernel[grid] does not, in Triton 3.6 and 3.9)
        grid = tuple(grid) + (1,) * (3 - len(grid))
        self.kernel, self.grid, self.launch_kwargs = kernel, grid, launch_kwargs
        self.template, self.values, self.slots = template, values, slots
        self.positional = positional  # values are exactly the kernel's parameters, in order
        self.direct = None  # (compiled kernel, device, alignment bits)
        self.scratch = scratch  # Launch.descriptors: Triton's allocator is needed

    def fire(self, tensors: tuple) -> None:
        vals = self.values.copy()
        for _, pos, i, view in self.slots:
            t = tensors[i]
            vals[pos] = t if view is None else t.view(view)
        direct = DIRECT_LAUNCH and _STUB is None and not _INTERPRET
        known = self.direct  # read once (see the class docstring)
        if direct and known is not None:
            drv = _driver()
            device = drv.get_current_device()
            if device == known[1] and self._alignment(vals) == known[2]:
                if self.scratch:
                    ensure_scratch_allocator()
                compiled, stream = known[0], drv.get_current_stream(device)
                if _no_launch_hooks():  # JITFunction.run's call of the launcher, without metadata or hooks
                    grid = self.grid
                    compiled.run(grid[0], grid[1], grid[2], stream, compiled.function, compiled.packed_metadata,
                                 None, None, None, *vals)
                else:
                    compiled[self.grid](*vals, stream=stream)  # the hooks get their launch metadata
                return
        args = self.template.copy()
        for name, pos, _, _ in self.slots:
            args[name] = vals[pos]
        compiled = run_kernel(self.kernel, self.grid, args, self.launch_kwargs, self.scratch)
        if direct and self.positional and hasattr(compiled, "packed_metadata"):  # a CompiledKernel (eager GPU)
            self.direct = (compiled, _driver().get_current_device(), self._alignment(vals))

    def _alignment(self, vals: list) -> int:
        """Bit j set when the j-th tensor argument is 16-byte aligned (Triton's pointer specialisation)."""
        bits = 0
        for j, (_, pos, _, _) in enumerate(self.slots):
            if vals[pos].data_ptr() % _ALIGN == 0:
                bits |= 1 << j
        return bits


def _driver():
    """Triton's active driver (imported on first use: flashtx works without triton)."""
    global _DRIVER
    if _DRIVER is None:
        from triton.runtime import driver

        _DRIVER = driver
    return _DRIVER.active


_DRIVER = _RUNTIME_KNOBS = _HOOK_CHAIN = None


def _no_launch_hooks() -> bool:
    """Whether no Triton launch hook is set (knobs.runtime.launch_enter_hook / launch_exit_hook: empty HookChains,
    Triton 3.6 to 3.9). A direct launch then calls the compiled kernel's launcher with the arguments JITFunction.run
    passes it, but no launch metadata and None hooks, which the launcher skips: JITFunction.run and
    CompiledKernel[grid]'s runner build the metadata (a LazyDict) and pass both chains, which the launcher calls:
    ~2 us of Python a launch on a desktop CPU (measured with Triton 3.6's and 3.9's runner and a no-op launcher)."""
    global _RUNTIME_KNOBS, _HOOK_CHAIN
    if _RUNTIME_KNOBS is None:
        from triton import knobs

        # (a Triton without hook chains: a type no hook has, so every direct launch takes the runner)
        _RUNTIME_KNOBS, _HOOK_CHAIN = knobs.runtime, getattr(knobs, "HookChain", NotImplemented)
    rt = _RUNTIME_KNOBS
    enter, leave = rt.launch_enter_hook, rt.launch_exit_hook
    return type(enter) is _HOOK_CHAIN and type(leave) is _HOOK_CHAIN and not enter.calls and not leave.calls


LAUNCHES = LaunchCache()  # every launcher's: keys start with the launcher's name


def _signature(tensors: tuple, n: int) -> tuple | None:
    """(dtype, shape, strides) of each of the first n tensors (None for None) in eager calls on plain
    tensors; None while anything traces or for a fake tensor or a subclass."""
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack():
        return None
    sig = []
    for i in range(n):
        t = tensors[i]
        if t is None:
            sig.append(None)
        elif type(t) is torch.Tensor:
            sig.append((t.dtype, t.shape, t.stride()))
        else:
            return None
    return tuple(sig)


class _AlignedEntry(list):
    """A cache entry whose launches rely on some inputs' 16-byte alignment (Launch.descriptors): `need`, the
    indices of those inputs."""

    need: tuple = ()

    def holds(self, tensors: tuple) -> bool:
        return all(tensors[i].data_ptr() % _ALIGN == 0 for i in self.need)


def _memo(steps: list, names: tuple, tensors: tuple):
    """A _Replay per launch (and a _ScratchReplay / _HostReplay per Scratch / HostStep), or None when the plan
    cannot be replayed from `tensors` alone."""
    scratch = [step.tensor for step in steps if type(step) is Scratch]
    host = bool(scratch) or any(type(step) is not Launch for step in steps)
    entry, need = (_HostEntry() if host else []), set()
    for step in steps:
        if type(step) is Scratch:
            entry.append(_ScratchReplay(step.tensor))
            continue
        if isinstance(step, HostStep):
            slots = tuple((name, _where(getattr(step, name), tensors, scratch)) for name in step.TENSORS)
            if any(i is None for _, i in slots):
                return None
            kept = object.__new__(type(step))  # its other attributes; not the planned call's tensors (nor memory)
            kept.__dict__.update(step.__dict__, **dict.fromkeys(step.TENSORS))
            entry.append(_HostReplay(kept, slots))
            continue
        if type(step) is not Launch or (host and step.descriptors):  # (an entry is aligned or host, not both)
            return None
        order = tuple(getattr(step.kernel, "arg_names", ()))
        positional = bool(order) and set(order) == set(step.args)  # every parameter named: launchable by position
        template, values, slots = {}, [], []
        for pos, name in enumerate(order if positional else step.args):
            a = step.args[name]
            if not isinstance(a, torch.Tensor):
                values.append(a)
                template[name] = a
                continue
            values.append(None)  # rebound per call
            slot = _slot(name, a, names, tensors, scratch)
            if slot is None:
                return None
            slots.append((name, pos, *slot))
            if name in step.descriptors:
                need.add(slot[0])
        entry.append(_Replay(step.kernel, step.grid, step.config.launch_kwargs if step.config is not None else {},
                             template, values, tuple(slots), positional, bool(step.descriptors)))
    if need:
        entry = _AlignedEntry(entry)
        entry.need = tuple(sorted(need))
    return entry


def _same(a: torch.Tensor, t) -> tuple | None:
    """(view dtype or None) when kernel argument `a` is input `t` itself or a same-size dtype view of it."""
    if a is t:
        return (None,)
    if (t is not None and a.dtype != t.dtype and a.element_size() == t.element_size() and a.data_ptr() == t.data_ptr()
            and a.shape == t.shape and a.stride() == t.stride()):
        return (a.dtype,)
    return None


def _slot(name: str, a: torch.Tensor, names: tuple, tensors: tuple, scratch: list = ()):
    """The input kernel argument `name` takes: a Scratch tensor of the plan (its index after the inputs), by role
    when it has one, else the one input it is (a stand-in for an absent tensor), or the first of several inputs it
    is when they are one object; None when it is none of them, or several different ones."""
    j = _scratch_index(a, tensors, scratch)
    if j is not None:
        return (j, None)
    i = names.index(name) if name in names else len(tensors)
    if i < len(tensors):  # (a MaskSpec without tensors gives none of the mask roles)
        t = tensors[i]
        view = _same(a, t)
        if view is not None:
            return (i, *view)
        if t is not None and a.dtype == t.dtype and a.data_ptr() == t.data_ptr() and a._base is not None and (
                a._base is t or a._base is t._base):
            # a view the launcher made of its role's input (a (B, H, S, D) transpose of a (B, S, H, D)
            # tensor): the kernel reads the same memory through the strides the plan recorded, which follow
            # from the input's own (they are in the signature), so the input itself is bound
            return (i, None)
    found = [(i, *view) for i, t in enumerate(tensors) if (view := _same(a, t)) is not None]
    if len(found) > 1 and i < len(tensors) and tensors[i] is None and all(
            tensors[j] is tensors[found[0][0]] and v == found[0][1] for j, v in found):
        # a stand-in for an absent tensor, unread by the kernel, that is one input passed in several roles (rotary
        # in place without k: K is q is qo, an identity its launcher keys): the first of them
        return found[0]
    return found[0] if len(found) == 1 else None


def _is_traced(t: torch.Tensor) -> bool:
    """A tensor of a trace (fake, or functionalised by AOTAutograd), which has no data to launch on. A plain
    tensor subclass (an nn.Parameter, a user's class without __torch_dispatch__) has data: it launches, as on a GPU."""
    from torch._subclasses.fake_tensor import is_fake
    from torch._subclasses.functional_tensor import FunctionalTensor

    return is_fake(t) or isinstance(t, FunctionalTensor)


TMA_ALIGN = 16  # bytes: a tensor descriptor's base address and row strides (CUDA's cuTensorMap rule)


def tma_ok(t: torch.Tensor) -> bool:
    """Whether a kernel may read (B, H, S, D) view `t` through tensor descriptors of (S, D) rows: a unit
    last stride, and every stride that moves the base (those of dims longer than 1) and the row stride
    a multiple of 16 bytes, from a 16-byte aligned address. Traced tensors (torch.compile) have no
    address: their storage offset is judged, with the storage assumed aligned, as Inductor assumes (and
    copies graph inputs that are not)."""
    elt = t.element_size()
    if t.stride(3) != 1 or (t.stride(2) * elt) % TMA_ALIGN:
        return False
    if any((st * elt) % TMA_ALIGN for n, st in zip(t.shape[:2], t.stride()[:2]) if n > 1):
        return False
    if _is_traced(t):
        return (t.storage_offset() * elt) % TMA_ALIGN == 0
    return t.data_ptr() % TMA_ALIGN == 0


@contextlib.contextmanager
def stub_launches(fn=None):
    """Replace every kernel launch by `fn(kernel, grid, args)` (default: do nothing), e.g. to time
    the Python work from a public call down to the launch (bench/overhead.py). Process-wide: another thread's
    calls meanwhile launch nothing either (their outputs stay unwritten), so use it single-threaded."""
    global _STUB
    prev, _STUB = _STUB, fn if fn is not None else (lambda kernel, grid, args: None)
    try:
        yield
    finally:
        _STUB = prev


def target_for(t: torch.Tensor) -> Target:
    """The Target whose configs a launch on `t` uses."""
    if t.is_cuda and not _INTERPRET:  # is_cuda: no torch.device built per call
        return cuda_target(t.device.index if t.device.index is not None else torch.cuda.current_device())
    return INTERPRETER_TARGET


_F32 = struct.Struct("f")


def split_f32(x: float) -> tuple[float, float]:
    """x as float32 hi + lo, so kernels can rebuild it to ~48 bits (see scalar_in); float64 runs
    need lo, the rest use hi alone. x must be within float32's range (validation refuses others)."""
    hi = _F32.unpack(_F32.pack(x))[0]
    return hi, _F32.unpack(_F32.pack(x - hi))[0]


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for grids, in plain Python (triton.cdiv is a jit function: calling it on the host costs
    microseconds per launch)."""
    return -(-a // b)


def pow2_bucket(n, cap: int) -> int:
    """min(cap, the next power of two >= max(n, 1)) for a power of two `cap` and an int n. Launchers use it to
    shrink a per-row-count tile for few rows (decoding, tiny batches). A SymInt n (torch.compile's dynamic shapes,
    torch.export's Dims) gets cap, compared with nothing: a graph serves every size (any tile is correct), where a
    bucket's range guards compiled a graph per power of two of short lengths or decode batches, and RoPE's, SwiGLU's
    and decoding's buckets multiplied in one model's graph up to fullgraph's recompile limit."""
    if cap <= 1 or type(n) is not int or n > cap // 2:
        return cap
    b = cap // 2
    while b > 1 and n <= b // 2:
        b //= 2
    return b


def rows_tile(n, floor: int, cap: int) -> int:
    """A tile of rows (a power of two in [floor, cap]) for n rows: floor for n <= floor, else the next power of two
    >= n up to cap for an int n. A SymInt n past floor gets cap (one graph for every such count: speculative
    decoding's query counts vary by step), after one range guard (n <= floor); an unbacked or exported one gets cap
    unguarded."""
    if unbacked(n) or exporting():
        return cap
    if n <= floor:
        return floor
    return min(cap, 1 << (n - 1).bit_length()) if type(n) is int else cap


def head_block(d: int) -> int:
    """Register tile width for a head dim: next power of two, at least 16 (tl.dot's minimum). A SymInt
    (dynamic shapes) is specialised: the tile width is a compile-time constant of the kernel."""
    return max(16, 1 << (int(d) - 1).bit_length())


# A split head dim needs each piece to be a legal tl.dot K (>= 16) and must save at least this much of the
# padded width: 192 = 128 + 64, 96 = 64 + 32, 160 = 128 + 32, 80 = 64 + 16 save 25-37.5%.
MIN_HEAD_PIECE = 16
MIN_SPLIT_SAVING = 0.25
# Off by default: the first GPU run of the split kernels (2026-11-30, H200, bench/RESULTS.md) hit an illegal
# memory access in one case (MQA 4:1, head dims 96/160, strided inputs, with the automatic GQA dK/dV split),
# which Triton's interpreter does not reproduce (guarded buffers, sm_90 tiles). The split path stays compiled,
# compile-checked and interpreter-tested (tests/test_attention_split*.py turn it on) until a GPU run clears it.
# Read when a call signature is planned (the launch cache and the lanes replay the plan): after changing it, call
# flashtx._dispatch.clear_plans().
SPLIT_HEAD_DIMS = False


def head_split(d: int) -> tuple[int, int]:
    """Register tile widths (first, second) for a head dim: two power-of-two column pieces when that saves
    at least MIN_SPLIT_SAVING of the padded width head_block(d) (first = head_block(d) / 2, second the
    smallest power of two >= 16 that covers the rest, e.g. 192 -> (128, 64), 72 -> (64, 16)); else
    (head_block(d), 0), one piece. Depends on the head dim alone, so CPU (interpreter) and GPU runs take
    the same path. SPLIT_HEAD_DIMS = False (the default for now): always one piece."""
    full = head_block(d)
    if not SPLIT_HEAD_DIMS:
        return full, 0
    first = full // 2
    second = head_block(int(d) - first) if int(d) > first else 0
    if first >= MIN_HEAD_PIECE and second and first + second <= full * (1 - MIN_SPLIT_SAVING):
        return first, second
    return full, 0


def strides4(t: torch.Tensor) -> tuple[int, int, int, int]:
    assert t.dim() == 4
    return tuple(t.stride())
