"""python -m flashtx: the environment, the backends available, and a self-check of every op.

Without a GPU, the Triton kernels are checked in Triton's interpreter on CPU tensors (the
process re-executes itself with FLASHTX_INTERPRET=1, which must be set before triton loads).
Exits 1 if any check fails, or if a Triton check was skipped where Triton's kernels should run (a GPU, or the
interpreter).
"""
from __future__ import annotations

import argparse
import os
import platform
import sys

import torch


def _parse(argv) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m flashtx", description="the environment, the backends available, and a self-check of every op",
        epilog="Without a GPU it re-executes itself with FLASHTX_INTERPRET=1 (Triton's interpreter on CPU tensors; "
               "a few minutes). Exit status: 0 when every check passed, 1 when one failed or a Triton check that "
               "should run did not.")
    return parser.parse_args(argv)


def main(argv=()) -> int:
    """argv: the command line's arguments (python -m flashtx passes sys.argv[1:])."""
    _parse(list(argv))  # (-h exits here, before any re-execution or check)
    reexecuted = os.environ.pop("_FLASHTX_REEXEC", None) == "1"  # popped: nothing this process starts inherits it
    if not torch.cuda.is_available() and os.environ.get("FLASHTX_INTERPRET") != "1" and not reexecuted:
        env = dict(os.environ, FLASHTX_INTERPRET="1", _FLASHTX_REEXEC="1")
        # the interpreter's own options (-W, -X, ...) too, where Python records them (3.10+)
        argv = sys.orig_argv[1:] if "-m" in getattr(sys, "orig_argv", ()) else ["-m", "flashtx", *sys.argv[1:]]
        os.execve(sys.executable, [sys.executable, *argv], env)

    import flashtx
    from flashtx import _env, selfcheck
    from flashtx.backends import BACKENDS, AttentionInputs

    print(f"flashtx {flashtx.__version__}")
    triton_v = "not installed"
    if _env.HAS_TRITON:
        import triton

        triton_v = triton.__version__
    print(f"python {platform.python_version()}, torch {torch.__version__}, triton {triton_v}")
    if torch.cuda.is_available():
        device = "cuda"
        p = torch.cuda.get_device_properties(0)
        print(f"GPU: {p.name} (sm_{p.major}{p.minor}, {p.total_memory / 2**30:.0f} GiB), CUDA {torch.version.cuda}")
        dtypes = [torch.float16, torch.bfloat16, torch.float32]
    else:
        device = "cpu"
        mode = ("in Triton's interpreter (FLASHTX_INTERPRET=1)" if _env.INTERPRET
                else f"nowhere ({_env.interpreter_off_reason()})")
        print(f"GPU: none. Triton kernels run {mode}; CPU tensors otherwise use the reference backend.")
        dtypes = [torch.float16, torch.float32]

    print("\nBackends (for fp16 attention on this device):")
    probe = torch.empty(1, 2, 16, 64, device=device, dtype=torch.float16)
    for name, backend in BACKENDS.items():
        reasons = backend.not_supported_reasons(AttentionInputs(probe, probe, probe))
        print(f"  {name:<10} {'available' if not reasons else 'unavailable: ' + '; '.join(reasons)}")

    print("\nSelf-check against the float64 reference (error/bound: kernel error vs 2x (outputs) or 3x (grads)"
          " the same-dtype eager error + ulps):")
    torch.manual_seed(0)
    results = selfcheck.run_all(device, dtypes)
    ran = [r for r in results if not r.skipped]
    failed = [r for r in ran if not r.passed]
    print(f"\n{len(ran) - len(failed)} passed, {len(failed)} failed, {len(results) - len(ran)} skipped "
          f"(backend unavailable: the reasons above)")
    for r in failed:
        print(f"  FAILED: {str(r.dtype).replace('torch.', '')} {r.backend} {r.op}")
    if not ran:
        print("no check ran")
        return 1
    triton_here = device == "cuda" or _env.INTERPRET
    if triton_here and not any(r.backend == "triton" for r in ran):
        print("NO KERNEL CHECKED: every Triton check was skipped (see the reasons above), although Triton's kernels "
              "should run here; only the reference backend was compared with itself")
        return 1
    unchecked = [r for r in results if r.skipped and r.backend == "triton"] if triton_here else []
    for r in unchecked:  # a kernel that should run here refused its check: a failure, not a skip
        print(f"  NOT CHECKED: {str(r.dtype).replace('torch.', '')} triton {r.op}: {r.skipped}")
    return 1 if failed or unchecked else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
