"""Compile every launchable kernel config for GPUs that are not here, and check it fits.

    python -m flashtx.triton_kernels.compile_check            # sm_80, sm_86, sm_90
    python -m flashtx.triton_kernels.compile_check --arch 86
    python -m flashtx.triton_kernels.compile_check --only attn_ --json new.json --compare old.json  # a refactor
    python -m flashtx.triton_kernels.compile_check --only attn_ --seqlen 113  # the attention kernels' odd variant
    python -m flashtx.triton_kernels.compile_check --seqlen 113 --mask-tiles  # CI's odd pass (tests/test_compile.py)
    python -m flashtx.triton_kernels.compile_check --ones --arch 80  # runtime ints of 1, compiled as constants

For each module of flashtx.triton_kernels that defines `compile_plans(target)`, and each target,
it builds the launches the launchers would make on that GPU, specialises their arguments the
way `JITFunction.run` does (unit strides, 16-byte alignment), compiles them to cubin with
Triton's bundled ptxas (no driver needed), and reports shared memory (against the target's
per-block limit), registers, spills and the share of global-memory bytes moved by 16-byte accesses
(vector_shares). Exits non-zero if any config fails to compile, exceeds
shared memory, or needs more than its launch estimated (configs.estimate_shared_memory, which config selection
uses, plus an attn_mask tile's term: --seqlen). Spills are reported, not failed:
only a GPU run can say whether a spilling tile is slower than a smaller one (configs.py).
Each result carries a digest of its PTX without debug info (ptx_digest): `--compare` an earlier run's
JSON to see which plans a source change really changed (an extracted helper should change none).
Check registers and spills on an empty TRITON_CACHE_DIR: a reused cached compile once hid an 8-byte spill.
Needs TRITON_INTERPRET unset (it compiles; it does not interpret).
"""
from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import hashlib
import importlib
import json
import os
import pkgutil
import re
import subprocess
import sys
import tempfile

from .configs import KNOWN_TARGETS, Target, TileConfig, interpreter_active
from .launch import BACKEND_OPTIONS


@dataclasses.dataclass
class Result:
    label: str
    arch: int
    shared: int
    limit: int
    registers: int
    spill_bytes: int
    config: str
    estimate: int | None = None  # the launch's shared-memory estimate (configs.estimate_shared_memory), if it has one
    error: str = ""
    # share of the bytes of the PTX's global load / store instructions that are 16-byte (vector) accesses: a
    # bandwidth-bound kernel whose loads compile to 2- or 4-byte accesses reaches a fraction of the memory
    # bandwidth (static instruction counts, not executed bytes; None without any such instruction)
    ld16: float | None = None
    st16: float | None = None
    mma: str = ""  # the tensor-core instructions the PTX issues (mma_kind)
    ptx_digest: str = ""  # ptx_digest: equal digests are the same code
    seqlen: int = 128  # the attention plans' sequence length (attention_common.PLAN_SEQLEN)

    @property
    def ok(self) -> bool:
        return (not self.error and self.shared <= self.limit
                and (self.estimate is None or self.estimate >= self.shared))

    @property
    def status(self) -> str:
        if self.error:
            return "ERROR " + self.error
        if self.shared > self.limit:
            return "SHARED>LIMIT"
        if self.estimate is not None and self.estimate < self.shared:
            return "ESTIMATE<SHARED (selection or tuning could launch a config that does not fit)"
        if self.spill_bytes:
            return f"ok, spills {self.spill_bytes} bytes"
        return "ok"


def _plan_modules():
    from . import __name__ as pkg_name, __path__ as pkg_path

    mods = []
    for info in sorted(pkgutil.iter_modules(pkg_path), key=lambda i: i.name):
        if info.name == "compile_check":
            continue
        mod = importlib.import_module(f"{pkg_name}.{info.name}")
        if hasattr(mod, "compile_plans"):
            mods.append(mod)
    return mods


def _resource_usage(cubin: bytes) -> tuple[int, int]:
    """(registers, local-memory bytes) of the cubin's kernel, from Triton's bundled cuobjdump."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True, check=True).stdout
    regs = re.search(r"REG:(\d+)", out)
    stack = re.search(r"STACK:(\d+)", out)
    local = re.search(r"LOCAL:(\d+)", out)
    spill = max(int(stack.group(1)) if stack else 0, int(local.group(1)) if local else 0)
    return (int(regs.group(1)) if regs else -1), spill


_GLOBAL_ACCESS = re.compile(r"\b(ld|st)\.global(?:\.[A-Za-z0-9_:]+)*?(?:\.v(\d))?\.[bufs](\d+)\b")


def vector_shares(ptx: str) -> tuple[float | None, float | None]:
    """(ld16, st16) of Result: the share of global load and store bytes moved by 16-byte instructions
    (ld.global.v4.b32, ld.global.v2.b64, ...; cp.async copies are not ld.global and are not counted)."""
    total = {"ld": 0, "st": 0}
    wide = {"ld": 0, "st": 0}
    for op, vec, bits in _GLOBAL_ACCESS.findall(ptx):
        width = int(bits) // 8 * (int(vec) if vec else 1)
        total[op] += width
        if width == 16:
            wide[op] += width
    return tuple(wide[op] / total[op] if total[op] else None for op in ("ld", "st"))


_DEBUG_LABEL = re.compile(r"\$L__tmp\d+")


def ptx_digest(ptx: str) -> str:
    """A digest of the PTX's code without its debug info: .loc/.file lines, comments, the $L__tmp labels that
    line info adds (an inlined device call adds some) and the debug sections. Moving or extracting source
    changes only those; any instruction, register or constant that differs changes the digest."""
    h = hashlib.sha1()
    for line in ptx.splitlines():
        s = line.strip()
        if not s or s.startswith((".loc", ".file", "//")) or (s.startswith("$L__tmp") and s.endswith(":")):
            continue
        if s.startswith(".section") and ".debug" in s:
            break  # the debug sections close the file
        h.update(_DEBUG_LABEL.sub("$L", s).encode() + b"\n")
    return h.hexdigest()[:16]


def compare(results: list, old: list[dict]) -> list[str]:
    """Lines naming the plans whose ptx_digest differs from `old` (an earlier --json) or that `old` lacks (plans are
    matched by label, arch and sequence length)."""
    before = {(r["label"], r["arch"], r.get("seqlen", 128)): r.get("ptx_digest", "") for r in old}
    lines = []
    for r in results:
        was = before.get((r.label, r.arch, r.seqlen))
        if was is None:
            lines.append(f"new       sm_{r.arch} {r.label}")
        elif was != r.ptx_digest or not was:
            lines.append(f"changed   sm_{r.arch} {r.label}")
    return lines


def mma_kind(ptx: str) -> str:
    """The tensor-core instructions a kernel's PTX issues: "wgmma" (Hopper's warpgroup MMA, sm_90a), "mma"
    (mma.sync, sm_80's, which Hopper runs at a fraction of wgmma's rate), both, or "-" (no dot). A dot tile
    too small for a warpgroup (64 rows per 4 warps) falls back to mma.sync on sm_90."""
    kinds = [name for name, pat in (("wgmma", "wgmma.mma_async"), ("mma", "mma.sync")) if pat in ptx]
    return "+".join(kinds) or "-"


def compile_launch(launch, target: Target):
    """Compile one Launch for `target` exactly as JITFunction.run would; return the CompiledKernel."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler import compile as triton_compile
    from triton.compiler.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    gpu = GPUTarget("cuda", target.arch, target.warp_size)
    backend = make_backend(gpu)
    kernel = launch.kernel
    kwargs = dict(launch.args)
    if launch.config is not None:
        kwargs.update(launch.config.launch_kwargs)
    kwargs.update(BACKEND_OPTIONS)  # as run_kernel launches it
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound_args, specialization, options = binder(**kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound_args, specialization, options)
    src = ASTSource(kernel, signature, constexprs, attrs)
    return triton_compile(src, target=gpu, options=options.__dict__)


def _check_one(arch: int, index: int, seqlen: int = 128, ones: bool = False) -> Result:
    target = KNOWN_TARGETS[arch]
    label, launch = _all_plans(target, seqlen, ones)[index]
    cfg = launch.config
    cfg_s = (f"M{cfg.block_m} N{cfg.block_n} w{cfg.num_warps} s{cfg.num_stages}" + (" tma" if cfg.tma else "")
             if isinstance(cfg, TileConfig) else (str(cfg.launch_kwargs) if cfg is not None else "-"))
    try:
        compiled = compile_launch(launch, target)
        regs, spill = _resource_usage(compiled.asm["cubin"])
        ld16, st16 = vector_shares(compiled.asm["ptx"])
        return Result(label, arch, int(compiled.metadata.shared), target.max_shared, regs, spill, cfg_s,
                      launch.shared_estimate, ld16=ld16, st16=st16, mma=mma_kind(compiled.asm["ptx"]),
                      ptx_digest=ptx_digest(compiled.asm["ptx"]), seqlen=seqlen)
    except Exception as exc:  # report, don't stop: the table shows every failure
        return Result(label, arch, -1, target.max_shared, -1, -1, cfg_s, launch.shared_estimate,
                      f"{type(exc).__name__}: {exc}"[:300], seqlen=seqlen)


_PLAN_CACHE: dict = {}


def launch_plans(target: Target, seqlen: int = 128) -> list:
    """(label, Launch) of every kernel config `target` can launch, split head dims included (off by default,
    but they stay compile-checked), the attention kernels' at sequence length `seqlen` (Triton compiles one
    variant for lengths that are multiples of 16 and another for the rest). Built afresh: tile_sweep calls it with
    a config forced."""
    from . import attention_common, launch

    plans = []
    was, launch.SPLIT_HEAD_DIMS = launch.SPLIT_HEAD_DIMS, True
    was_s, attention_common.PLAN_SEQLEN = attention_common.PLAN_SEQLEN, seqlen
    try:
        for mod in _plan_modules():
            plans += mod.compile_plans(target)
    finally:
        launch.SPLIT_HEAD_DIMS, attention_common.PLAN_SEQLEN = was, was_s
    return plans


def _all_plans(target: Target, seqlen: int = 128, ones: bool = False):
    if (target.arch, seqlen, ones) not in _PLAN_CACHE:
        _PLAN_CACHE[target.arch, seqlen, ones] = (ones_plans if ones else launch_plans)(target, seqlen)
    return _PLAN_CACHE[target.arch, seqlen, ones]


def kernel_name(launch) -> str:
    return getattr(getattr(launch.kernel, "fn", None), "__name__", str(launch.kernel))


def ones_plans(target: Target, seqlen: int = 128) -> list:
    """(label, Launch): for each kernel function, the plans that together set each of its bool constexpr flags True
    at least once (greedy, most flags first), with every runtime int argument (strides, lengths, counts) set to 1.
    Triton compiles an int argument equal to 1 as a constant (JITFunction.run's specialization), so an expression of
    such arguments becomes a Python int: `(ROWS - 1).to(tl.uint32)` compiled for every pool but one of a single page
    (a GPU-only failure: the interpreter passes numpy scalars). Values of 1 that a launch would never pass (a head
    dim of 1) only compile; nothing runs."""
    import dataclasses as dc

    by_kernel: dict = {}
    for label, launch in launch_plans(target, seqlen):
        by_kernel.setdefault(kernel_name(launch), []).append((label, launch))
    out = []
    for plans in by_kernel.values():
        constexpr = [{p.name for p in launch.kernel.params if p.is_constexpr} for _, launch in plans]
        flags = [{k for k, v in launch.args.items() if v is True} for _, launch in plans]
        order = sorted(range(len(plans)), key=lambda i: -len(flags[i]))
        covered: set = set()
        for n, i in enumerate(order):
            if n and flags[i] <= covered:  # (the first plan always: a kernel without bool flags gets one)
                continue
            covered |= flags[i]
            label, launch = plans[i]
            args = {k: (1 if type(v) is int and k not in constexpr[i] else v) for k, v in launch.args.items()}
            out.append((f"{label} ints=1", dc.replace(launch, args=args)))
    return out


def loads_mask_tile(launch) -> bool:
    """Whether a launch reads an attn_mask tile (an attention kernel's MASK_KIND): the plans whose shared memory
    depends on the key count's divisibility by 16 (configs.estimate_shared_memory's mask_elt)."""
    return bool(launch.args.get("MASK_KIND", 0))


def run(archs, jobs: int, only: str = "", seqlen: int = 128, mask_tiles: bool = False,
        ones: bool = False) -> list[Result]:
    texts = [t for t in only.split(",") if t] or [""]
    work = [(a, i, seqlen, ones) for a in archs
            for i, (label, launch) in enumerate(_all_plans(KNOWN_TARGETS[a], seqlen, ones))
            if any(t in label for t in texts) and (loads_mask_tile(launch) or not mask_tiles)]
    if jobs <= 1:
        return [_check_one(*w) for w in work]
    with concurrent.futures.ProcessPoolExecutor(jobs) as pool:
        return list(pool.map(_check_one, *zip(*work)))


def format_table(results: list[Result]) -> str:
    rows = [f"{'kernel':<48} {'config':<18} {'target':<7} {'shared':>8} {'estim.':>8} {'limit':>8} {'regs':>5} "
            f"{'spill':>6} {'16B ld/st':>9} {'mma':>9}  status"]
    share = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
    for r in results:
        est = "-" if r.estimate is None else str(r.estimate)
        rows.append(f"{r.label:<48} {r.config:<18} sm_{r.arch:<4} {r.shared:>8} {est:>8} {r.limit:>8} "
                    f"{r.registers:>5} {r.spill_bytes:>6} {share(r.ld16) + '/' + share(r.st16):>9} {r.mma or '-':>9}  "
                    f"{r.status}")
    return "\n".join(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", type=int, action="append", choices=sorted(KNOWN_TARGETS),
                    help="compute capability, e.g. 86 (repeatable; default 80, 86, 90)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--only", default="", help="check only kernels whose label contains this text (or one of these "
                                               "comma-separated texts)")
    ap.add_argument("--compare", help="an earlier --json: name the plans whose PTX (debug info aside) changed")
    ap.add_argument("--seqlen", type=int, default=128,
                    help="the attention plans' sequence length (default 128; 113 checks the variant Triton compiles "
                         "for lengths that are not multiples of 16)")
    ap.add_argument("--mask-tiles", action="store_true",
                    help="check only the launches that read an attn_mask tile (with --seqlen 113: CI's odd pass)")
    ap.add_argument("--ones", action="store_true",
                    help="instead: each kernel's flags, with every runtime int argument 1 (ones_plans; CI runs it "
                         "for sm_80)")
    args = ap.parse_args(argv)
    if interpreter_active():
        print("compile_check compiles kernels: run it with TRITON_INTERPRET unset", file=sys.stderr)
        return 2
    results = run(args.arch or [80, 86, 90], args.jobs, args.only, args.seqlen, args.mask_tiles, args.ones)
    print(f"attention plans at sequence length {args.seqlen}\n" + format_table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([dataclasses.asdict(r) | {"ok": r.ok} for r in results], f, indent=1)
    if args.compare:
        with open(args.compare) as f:
            changed = compare(results, json.load(f))
        print(f"\nagainst {args.compare}: {len(results) - len(changed)} of {len(results)} plans compile to the same "
              "PTX (debug info aside)" + "".join("\n  " + line for line in changed))
    bad = [r for r in results if not r.ok]
    spilling = sum(1 for r in results if r.ok and r.spill_bytes)
    print(f"\n{len(results) - len(bad)} of {len(results)} kernel configs compile and fit shared memory (and their "
          f"launches' estimates); {spilling} of them spill registers (reported, not failed)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
