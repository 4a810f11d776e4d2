"""Environment facts flashtx needs before anything imports triton.

`FLASHTX_INTERPRET=1` (or `TRITON_INTERPRET=1`) makes CPU tensors run through the real Triton
kernels in Triton's interpreter. Triton reads the switch when it is first imported, so this
module sets TRITON_INTERPRET before importing triton, and records when that was too late.
"""
from __future__ import annotations

import importlib.util
import os
import sys


# On/off values: Triton's own (its getenv_bool takes exactly these, in any case, for TRITON_INTERPRET), and off.
ON, OFF = ("1", "true", "yes", "y", "on"), ("", "0", "false", "no", "n", "off")


def flag(name: str) -> bool:
    """An on/off FLASHTX_* switch from the environment; a value that is neither warns (naming the variable and
    the values allowed) and counts as off. Read once, where the switch is decided: never on a hot path."""
    raw = os.environ.get(name, "")
    value = raw.strip().lower()
    if value in ON:
        return True
    if value not in OFF:
        import warnings

        warnings.warn(f"{name}={raw!r} is not an on/off value: it is taken as off (on: {', '.join(ON)}; off: "
                      f"{', '.join(v for v in OFF if v)} or unset)", stacklevel=2)
    return False


def triton_interpret() -> bool:
    """TRITON_INTERPRET as Triton reads it (so flashtx and Triton agree whether kernels are interpreted)."""
    return os.environ.get("TRITON_INTERPRET", "").lower() in ON


INTERPRET_REQUESTED = flag("FLASHTX_INTERPRET") or triton_interpret()
_TRITON_PREIMPORTED = "triton" in sys.modules
INTERPRET_TOO_LATE = INTERPRET_REQUESTED and _TRITON_PREIMPORTED and not triton_interpret()
if INTERPRET_REQUESTED and not _TRITON_PREIMPORTED:
    os.environ["TRITON_INTERPRET"] = "1"

def _triton_import_error() -> str | None:
    try:
        if importlib.util.find_spec("triton") is None:
            return "triton is not installed (pip install triton; Linux only)"
        import triton  # noqa: F401
    except Exception as exc:  # a broken triton install must not break the reference backend
        return f"importing triton failed: {type(exc).__name__}: {exc}"
    return None


TRITON_IMPORT_ERROR = _triton_import_error()

HAS_TRITON = TRITON_IMPORT_ERROR is None
INTERPRET = INTERPRET_REQUESTED and not INTERPRET_TOO_LATE and HAS_TRITON
if INTERPRET:  # device function calls without re-patching triton.language each time (what kernels compute is unchanged)
    from ._interpreter import speed_up_device_calls

    speed_up_device_calls()


def interpreter_off_reason() -> str | None:
    """Why Triton's interpreter is not in use (None when it is)."""
    if INTERPRET:
        return None
    if not HAS_TRITON:
        return TRITON_IMPORT_ERROR
    if INTERPRET_TOO_LATE:
        return "FLASHTX_INTERPRET=1 came after triton was imported (set it before, or set TRITON_INTERPRET=1)"
    return "FLASHTX_INTERPRET is not set"


def interpreter_numpy_problem() -> str | None:
    """Triton 3.6's interpreter turns 1-element arrays into loop bounds with int(), which numpy
    >= 2.4 refuses ("only 0-dimensional arrays can be converted"); later Triton squeezes first."""
    if not INTERPRET:
        return None
    try:
        import inspect

        import numpy
        import triton
        from triton.runtime import interpreter

        src = inspect.getsource(interpreter._patch_lang_tensor)
        np_version = tuple(int(x) for x in numpy.__version__.split(".")[:2])
    except Exception:  # a layout we don't know: let the kernels speak for themselves
        return None
    if "int(self.handle.data)" in src and np_version >= (2, 4):
        return (f"Triton {triton.__version__}'s interpreter needs numpy < 2.4 (found {numpy.__version__}); "
                "pip install 'numpy<2.4', or a newer triton")
    return None


INTERPRETER_NUMPY_PROBLEM = interpreter_numpy_problem()


def _package_dirs() -> tuple[str, ...]:
    import torch

    here = os.path.dirname(os.path.abspath(__file__))
    kernels = os.path.join(os.path.dirname(here), "triton_kernels")  # the source tree's (editable install)
    dirs = {here, kernels, os.path.join(here, "triton_kernels"), os.path.dirname(os.path.abspath(torch.__file__))}
    return tuple(d + os.sep for d in sorted(dirs))


def warn(message: str, category: type[Warning] = UserWarning) -> None:
    """warnings.warn attributed to the user's line: the first caller outside flashtx and torch (its
    dispatcher, autograd and nn.Module frames), whatever path (op, lane, launcher) got here."""
    import warnings

    skip = _package_dirs()
    frame, level = sys._getframe(1), 2
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(skip):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level if frame is not None else 2)
