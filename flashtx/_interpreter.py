"""Triton's interpreter, made cheaper for kernels built of device functions (CPU tests, `python -m flashtx`).

The interpreter runs a launch by patching triton.language's builtins (`_patch_lang`) for the whole launch and
restoring them after. It patches them again on every *device function call* too (`InterpretedFunction.__call__`),
and throws that second scope away: the builtins are patched already, so the call only re-sets the same
attributes, after walking every member of triton.language, its tensor class and its math module. That costs
~1.2 ms a call, and flashtx's kernels call device functions per tile (score modifiers, masks, the dK/dV tile
body): measured on the float64 gradchecks, 22% of their time (18 s of 80 s, 14,895 calls).

`speed_up_device_calls()` skips that re-patch when every triton.language module the function sees is patched
right now (probed on the modules themselves, so no bookkeeping can drift), and otherwise calls Triton's own
code. It changes what the interpreter does, never what a kernel computes or what compiles for a GPU; it is
installed only when the interpreter is on and only over the `__call__` it knows (Triton 3.6 through 3.9).
(Triton's standard-library device functions, tl.cdiv say, see `triton.language.core`, which a launch of a kernel
that sees `tl` does not patch: their first call takes Triton's path, which patches it and never restores it.
That is Triton's behaviour, kept; the calls after it are fast too.)
"""
from __future__ import annotations

import inspect

__all__ = ["speed_up_device_calls", "patched"]

# The statements of InterpretedFunction.__call__ this replaces; another body is left alone.
_KNOWN_BODY = ("_patch_lang(self.fn)", "fn = self.rewrite()", "return fn(*args, **kwargs)",
               "raise InterpreterError(repr(e)) from e")


def patched(lang) -> bool:
    """Whether the interpreter has patched this triton.language module now: its `_patch_lang_core` replaces
    the `static_range` class with a function, together with every builtin, and its scope's restore puts it back."""
    return inspect.isfunction(vars(lang).get("static_range"))


def speed_up_device_calls() -> bool:
    """Install the fast device call on Triton's interpreter (once); False where its layout is not the known one."""
    try:
        from triton.runtime import interpreter as ti
        import triton.language as tl

        cls = ti.InterpretedFunction
        if getattr(cls, "_flashtx_fast_calls", False):
            return True
        src = inspect.getsource(cls.__call__)
        if not all(s in src for s in _KNOWN_BODY) or not hasattr(ti, "InterpreterError"):
            return False
    except Exception:  # no triton, or an interpreter we don't know: keep Triton's
        return False
    original = cls.__call__
    lang_modules = (tl, tl.core)

    def device_call(self, *args, **kwargs):
        langs = self.__dict__.get("_flashtx_langs")  # the triton.language modules _patch_lang finds in its globals
        if langs is None:
            langs = tuple(v for v in self.fn.__globals__.values() if inspect.ismodule(v) and v in lang_modules)
            self._flashtx_langs = langs
        if not langs or not all(patched(lang) for lang in langs):
            return original(self, *args, **kwargs)
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise ti.InterpreterError(repr(e)) from e

    device_call.__doc__ = original.__doc__
    cls.__call__ = device_call
    cls._flashtx_fast_calls = True
    return True
