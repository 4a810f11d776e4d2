"""Environment facts flashtx needs before anything imports triton.

`FLASHTX_INTERPRET=1` (or `TRITON_INTERPRET=1`) makes CPU tensors run through the real Triton
kernels in Triton's interpreter. Triton reads the switch when it is first imported, so this
module sets TRITON_INTERPRET before importing triton, and records when that was too late.
"""
from __future__ import annotations

import importlib.util
import os
import sys


def _truthy(name: str) -> bool:
    return os.environ.get(name, "0").strip().lower() not in ("", "0", "false", "no", "off")


INTERPRET_REQUESTED = _truthy("FLASHTX_INTERPRET") or _truthy("TRITON_INTERPRET")
_TRITON_PREIMPORTED = "triton" in sys.modules
INTERPRET_TOO_LATE = INTERPRET_REQUESTED and _TRITON_PREIMPORTED and not _truthy("TRITON_INTERPRET")
if INTERPRET_REQUESTED and not _TRITON_PREIMPORTED:
    os.environ["TRITON_INTERPRET"] = "1"

TRITON_IMPORT_ERROR: str | None = None
if importlib.util.find_spec("triton") is None:
    TRITON_IMPORT_ERROR = "triton is not installed (pip install triton; Linux only)"
else:
    try:
        import triton  # noqa: F401
    except Exception as exc:  # a broken triton install must not break the reference backend
        TRITON_IMPORT_ERROR = f"importing triton failed: {type(exc).__name__}: {exc}"

HAS_TRITON = TRITON_IMPORT_ERROR is None
INTERPRET = INTERPRET_REQUESTED and not INTERPRET_TOO_LATE and HAS_TRITON
