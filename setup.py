"""Build script. All metadata lives in pyproject.toml.

Plain `pip install -e .` is pure Python (flashtx's Triton kernels and reference backend). The
optional CUDA extension in csrc/ is built only when asked:

    FLASHTX_BUILD_CUDA=1 pip install --no-build-isolation -e .

(--no-build-isolation so the build uses the installed CUDA build of torch; needs nvcc and ninja.)
It becomes flashtx/_flashtx_cuda*.so, which flashtx.cuda_ext loads with torch.ops.load_library.
FLASHTX_CUDA_ARCHS="80;90" (or "8.0;9.0", "sm_80,sm_90") picks the archs (default sm_80, sm_86, sm_90 + PTX of sm_90).
"""
import importlib.util
import os
from pathlib import Path

from setuptools import setup

_BUILD = os.environ.get("FLASHTX_BUILD_CUDA", "").strip().lower()
if _BUILD not in ("", "0", "false", "no", "n", "off", "1", "true", "yes", "y", "on"):
    raise SystemExit(f"FLASHTX_BUILD_CUDA={os.environ['FLASHTX_BUILD_CUDA']!r}: set it to 1 to build the CUDA "
                     "extension, or to 0 (or unset it) not to")
if _BUILD in ("1", "true", "yes", "y", "on"):
    # flashtx/_cuda_build.py by path: the source list and flags shared with the JIT build and the
    # compile check, without importing flashtx (which imports torch and triton)
    here = Path(__file__).resolve().parent
    spec = importlib.util.spec_from_file_location("_flashtx_cuda_build", here / "flashtx" / "_cuda_build.py")
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    nvcc = build.find_nvcc()
    if nvcc is None:
        raise SystemExit("FLASHTX_BUILD_CUDA=1: nvcc not found (set CUDA_HOME or put nvcc on PATH)")
    home = build.resolve_cuda_home(nvcc)
    if home is None:
        raise SystemExit(f"FLASHTX_BUILD_CUDA=1: cannot find the CUDA install of {nvcc}; set CUDA_HOME")
    os.environ["CUDA_HOME"] = home  # before torch.utils.cpp_extension guesses it from a wrapper's path
    import torch
    from torch.utils import cpp_extension

    if torch.version.cuda is None:
        raise SystemExit(f"FLASHTX_BUILD_CUDA=1: torch {torch.__version__} is a CPU-only build; install a CUDA build "
                         "of torch, and build with --no-build-isolation so it is used")
    cpp_extension.CUDA_HOME = home
    try:
        archs = build.parse_archs(os.environ.get("FLASHTX_CUDA_ARCHS", ""))
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    ext = cpp_extension.CUDAExtension(
        build.AOT_MODULE, sources=list(build.SOURCES), include_dirs=[str(build.CSRC)],
        extra_compile_args={"cxx": list(build.CXX_FLAGS),
                            "nvcc": [*build.NVCC_FLAGS, *build.gencode_flags(archs or build.ARCHS, ptx=True)]})
    setup(ext_modules=[ext], cmdclass={"build_ext": cpp_extension.BuildExtension})
else:
    setup()
