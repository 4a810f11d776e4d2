"""Build facts of flashtx's optional CUDA extension (csrc/), shared by the three ways to get it:
setup.py (AOT, FLASHTX_BUILD_CUDA=1), flashtx.cuda_ext.build() (JIT) and the compile check.

Standard library only: setup.py loads this file by path, without importing torch or flashtx.

    python -m flashtx._cuda_build            # compile check: registers, smem, spills per kernel and arch
    python -m flashtx._cuda_build --write    # ... and rewrite csrc/RESOURCES.md from it

The compile check builds every .cu file for sm_80, sm_86 and sm_90 in one nvcc call per file
(-fatbin, one -gencode per arch; the files in parallel) with ptxas's spill warnings as errors,
and checks each kernel's static shared memory against the arch's per-block limit and the 48 KB a
kernel may use without opting in to more.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the source checkout (csrc/ is not installed)
CSRC = ROOT / "csrc"
CUDA_SOURCES = ("csrc/decode_attention.cu", "csrc/rotary_append.cu")
BINDING = "csrc/binding.cpp"
SOURCES = (*CUDA_SOURCES, BINDING)  # relative to ROOT: the one list all three ways build
EXT_NAME = "flashtx_cuda"  # TORCH_LIBRARY namespace, and the JIT build's name
AOT_MODULE = "flashtx._flashtx_cuda"  # what setup.py builds (a torch library, loaded by path)

ARCHS = (80, 86, 90)
SMEM_LIMITS = {80: 166_912, 86: 101_376, 90: 232_448}  # bytes of shared memory a block may use
STATIC_SMEM_LIMIT = 48 * 1024  # static __shared__ beyond this needs dynamic smem + an opt-in
NVCC_FLAGS = ("-O3", "-std=c++20", "-lineinfo")
CXX_FLAGS = ("-O3", "-std=c++20")
# what torch.utils.cpp_extension adds to every nvcc call: the compile check builds the same code
TORCH_NVCC_FLAGS = ("-D__CUDA_NO_HALF_OPERATORS__", "-D__CUDA_NO_HALF_CONVERSIONS__",
                    "-D__CUDA_NO_BFLOAT16_CONVERSIONS__", "-D__CUDA_NO_HALF2_OPERATORS__", "--expt-relaxed-constexpr")
SPILL_GATE = ("--resource-usage", "-Xptxas=--warn-on-spills,--warn-on-local-memory-usage,-Werror")
RESOURCES_MD = CSRC / "RESOURCES.md"


def gencode_flags(archs=ARCHS, ptx: bool = False) -> list[str]:
    """-gencode flags for SASS of each arch; with ptx, PTX of the newest too (runs on later GPUs)."""
    flags = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]
    if ptx:
        flags.append(f"-gencode=arch=compute_{max(archs)},code=compute_{max(archs)}")
    return flags


def parse_archs(text: str, name: str = "FLASHTX_CUDA_ARCHS") -> list[int]:
    """Compute capabilities from a list such as "80;86;90", "8.0 9.0", "sm_80,sm_90" or TORCH_CUDA_ARCH_LIST's
    "8.0;9.0+PTX" (PTX of the newest arch is always added); ValueError naming `name` for anything else."""
    archs = []
    for item in re.split(r"[,;\s]+", text.strip()):
        if not item:
            continue
        m = re.fullmatch(r"(?:sm_|compute_)?(?:(\d+)\.(\d)|(\d{2,3}))(?:\+ptx)?", item.lower())
        if m is None:
            raise ValueError(f"{name}={text!r}: {item!r} is not a compute capability; use e.g. \"80;86;90\", "
                             "\"8.0;9.0\" or \"sm_80,sm_90\" (arch-specific targets such as 90a are not built)")
        arch = int(m.group(3)) if m.group(3) else 10 * int(m.group(1)) + int(m.group(2))
        if arch < 80:
            raise ValueError(f"{name}={text!r}: sm_{arch} is below sm_80, which the kernels need (bf16, cp.async)")
        archs.append(arch)
    return sorted(set(archs))


def resolve_cuda_home(nvcc: str) -> str | None:
    """$CUDA_HOME when it holds the nvcc in use, else the install nvcc really uses (cuda_home)."""
    home = os.environ.get("CUDA_HOME")
    if home and os.path.realpath(os.path.join(home, "bin", "nvcc")) == os.path.realpath(nvcc):
        return home
    return cuda_home(nvcc)


def find_nvcc() -> str | None:
    """nvcc from $CUDA_HOME/bin, else PATH, else /usr/local/cuda/bin; None when there is none."""
    candidates = []
    if os.environ.get("CUDA_HOME"):
        candidates.append(os.path.join(os.environ["CUDA_HOME"], "bin", "nvcc"))
    candidates += [shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"]
    for c in candidates:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    return None


def cuda_home(nvcc: str | None = None) -> str | None:
    """The CUDA install that nvcc really uses (its TOP), not the folder above its path.

    torch guesses CUDA_HOME from where `nvcc` is, so a wrapper script like /usr/local/bin/nvcc
    makes it /usr/local, and the build then misses cuda_runtime_api.h. `nvcc -dryrun` prints the
    real top folder ("#$ TOP=...")."""
    nvcc = nvcc or find_nvcc()
    if nvcc is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "x.cu")
        Path(src).write_text("int main() { return 0; }\n")
        try:
            out = subprocess.run([nvcc, "-dryrun", "-c", src, "-o", os.path.join(tmp, "x.o")],
                                 capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.SubprocessError):
            return None
    for line in (out.stdout + out.stderr).splitlines():
        m = re.match(r"^#\$ TOP=(.*)$", line.strip())
        if m:
            return os.path.realpath(m.group(1).strip())
    guess = Path(nvcc).resolve().parents[1]
    return str(guess) if (guess / "include" / "cuda_runtime_api.h").exists() else None


def cuda_include_dir(home: str) -> str | None:
    """The folder holding cuda_runtime_api.h under a CUDA install (include/ or targets/*/include)."""
    for cand in [Path(home) / "include", *sorted(Path(home).glob("targets/*/include"))]:
        if (cand / "cuda_runtime_api.h").exists():
            return str(cand)
    return None


def nvcc_version(nvcc: str) -> str:
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60).stdout
    m = re.search(r"V(\d+\.\d+\.\d+)", out)
    return m.group(1) if m else "unknown"


# ---------------------------------------------------------------------------------------------
# Compile check
# ---------------------------------------------------------------------------------------------

def parse_resource_usage(text: str, source: str = "") -> list[dict]:
    """Per-kernel, per-arch records from ptxas's --resource-usage output.

    Each: {kernel (mangled), arch, registers, smem, stack, spill_stores, spill_loads, source}."""
    records, cur = [], None
    for line in text.splitlines():
        m = re.search(r"Compiling entry function '([^']+)' for 'sm_(\d+)'", line)
        if m:
            cur = {"kernel": m.group(1), "arch": int(m.group(2)), "registers": None, "smem": 0, "stack": 0,
                   "spill_stores": 0, "spill_loads": 0, "source": source}
            records.append(cur)
            continue
        if cur is None:
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m:
            cur["stack"], cur["spill_stores"], cur["spill_loads"] = (int(g) for g in m.groups())
            continue
        m = re.search(r"Used (\d+) registers", line)
        if m:
            cur["registers"] = int(m.group(1))
            s = re.search(r"(\d+) bytes smem", line)
            cur["smem"] = int(s.group(1)) if s else 0
    return records


def demangle(names: list[str]) -> dict[str, str]:
    """Mangled -> short readable kernel names (template arguments kept, parameters dropped)."""
    tool = shutil.which("c++filt")
    out = names
    if tool and names:
        proc = subprocess.run([tool], input="\n".join(names), capture_output=True, text=True)
        if proc.returncode == 0 and len(proc.stdout.splitlines()) == len(names):
            out = proc.stdout.splitlines()
    short = []
    for n in out:
        n = re.sub(r"^void ", "", n)
        n = re.sub(r"\((ftx_\w+|[^()]*)\)$", "", n)  # drop the parameter list
        short.append(n.replace("ftx::", "").replace("__nv_bfloat16", "bf16").replace("__half", "half"))
    return dict(zip(names, short))


def problems(rec: dict) -> list[str]:
    """Why a kernel record fails the gate (empty when it passes)."""
    out = []
    if rec["registers"] is None:
        out.append("no register count")
    if rec["spill_stores"] or rec["spill_loads"]:
        out.append(f"spills ({rec['spill_stores']} B stores, {rec['spill_loads']} B loads)")
    if rec["stack"]:
        out.append(f"{rec['stack']} B stack frame (local memory)")
    limit = min(SMEM_LIMITS[rec["arch"]], STATIC_SMEM_LIMIT)
    if rec["smem"] > limit:
        out.append(f"{rec['smem']} B smem > {limit} B")
    return out


def compile_one(nvcc: str, source: str, archs=ARCHS, out_dir: str | None = None) -> dict:
    """nvcc -fatbin of one .cu for all archs with the spill gate. {source, cmd, rc, output, records}."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(out_dir or tmp, Path(source).stem + ".fatbin")
        cmd = [nvcc, *NVCC_FLAGS, *TORCH_NVCC_FLAGS, "-fatbin", *gencode_flags(archs), *SPILL_GATE, "-I", str(CSRC),
               str(ROOT / source), "-o", out]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    text = proc.stdout + proc.stderr
    return {"source": source, "cmd": " ".join(cmd), "rc": proc.returncode, "output": text,
            "records": parse_resource_usage(text, source)}


def compile_check(nvcc: str | None = None, archs=ARCHS) -> list[dict]:
    """compile_one for every CUDA source, in parallel (they are independent)."""
    nvcc = nvcc or find_nvcc()
    if nvcc is None:
        raise RuntimeError("nvcc not found (set CUDA_HOME or put nvcc on PATH)")
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(len(CUDA_SOURCES), os.cpu_count() or 1))) as ex:
        return list(ex.map(lambda s: compile_one(nvcc, s, archs), CUDA_SOURCES))


def resources_markdown(results: list[dict], nvcc_ver: str) -> str:
    """csrc/RESOURCES.md: one row per kernel, registers / smem / spills per arch."""
    recs = [r for res in results for r in res["records"]]
    names = demangle(sorted({r["kernel"] for r in recs}))
    archs = sorted({r["arch"] for r in recs})
    by = {(r["kernel"], r["arch"]): r for r in recs}
    lines = [
        "# Resource usage of the CUDA kernels",
        "",
        "Generated by `python -m flashtx._cuda_build --write` (nvcc " + nvcc_ver + ", flags `"
        + " ".join(NVCC_FLAGS) + "` plus torch's half/bf16 defines); `tests/test_cuda_ext.py` checks that it is "
        "current.",
        "Each cell: registers / static shared memory (bytes) / spill bytes (stores+loads). Limits: "
        + ", ".join(f"sm_{a} {SMEM_LIMITS[a]:,} B a block" for a in archs)
        + f"; static shared memory at most {STATIC_SMEM_LIMIT:,} B. Block size 128 threads everywhere.",
        "",
        "| kernel | source | " + " | ".join(f"sm_{a}" for a in archs) + " |",
        "|---|---|" + "---|" * len(archs),
    ]
    src_of = {r["kernel"]: r["source"] for r in recs}
    for k in sorted(names, key=lambda k: (src_of[k], names[k])):
        src = src_of[k]
        cells = []
        for a in archs:
            r = by.get((k, a))
            spill = None if r is None else r["spill_stores"] + r["spill_loads"]
            cells.append("-" if r is None else f"{r['registers']} / {r['smem']:,} / {spill}")
        lines.append(f"| `{names[k]}` | {Path(src).name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def recorded_nvcc_version(text: str) -> str | None:
    m = re.search(r"\(nvcc (\S+), flags", text)
    return m.group(1) if m else None


def binding_syntax_cmd(torch_include: str, cuda_include: str, stand_in_dir: str, cxx: str = "g++") -> list[str]:
    """g++ -fsyntax-only of csrc/binding.cpp against torch's headers, warnings as errors.

    A CPU build of torch ships c10/cuda/*.h but not the generated c10/cuda/impl/cuda_cmake_macros.h;
    stand_in_dir holds a two-line stand-in for it, searched after torch's own include dir so a CUDA
    build's real header wins."""
    return [cxx, "-std=c++20", "-fsyntax-only", "-Wall", "-Wextra", "-Werror",
            "-isystem", torch_include, "-isystem", os.path.join(torch_include, "torch", "csrc", "api", "include"),
            "-isystem", stand_in_dir, "-isystem", cuda_include, "-I", str(CSRC), str(ROOT / BINDING)]


def write_stand_in(directory: str) -> str:
    """Write the stand-in c10/cuda/impl/cuda_cmake_macros.h under directory; return directory."""
    p = Path(directory) / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h"
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
    return directory


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--write", action="store_true", help="rewrite csrc/RESOURCES.md")
    args = ap.parse_args(argv)
    nvcc = find_nvcc()
    if nvcc is None:
        print("nvcc not found (set CUDA_HOME or put nvcc on PATH)", file=sys.stderr)
        return 2
    results = compile_check(nvcc)
    bad = 0
    for res in results:
        if res["rc"] != 0:
            bad += 1
            print(f"FAILED: {res['cmd']}\n{res['output'][-4000:]}", file=sys.stderr)
        for r in res["records"]:
            for why in problems(r):
                bad += 1
                print(f"FAILED: {r['kernel']} sm_{r['arch']}: {why}", file=sys.stderr)
    md = resources_markdown(results, nvcc_version(nvcc))
    print(md)
    if args.write:
        RESOURCES_MD.write_text(md)
        print(f"wrote {RESOURCES_MD}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
