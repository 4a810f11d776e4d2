"""Build script. All metadata lives in pyproject.toml.

The optional CUDA extension in csrc/ is not built yet (see csrc/README.md); flashtx works
fully without it, through its Triton kernels and its reference backend.
"""
from setuptools import setup

setup()
