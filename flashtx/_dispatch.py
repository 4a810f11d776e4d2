"""One backend registry for every op, and the plan cache in front of it.

Each op registers its implementations in preference order (`register`); each implementation
answers `not_supported_reasons(inputs) -> list[str]` (empty: it can run them). `plan` resolves
the backend for a key (everything the choice depends on: device, dtype, head dims, features) once
and keeps it in a plain dict, so a call costs one dict lookup. The inputs object and the
xformers-style reason lists are built only on a cache miss, and formatted only when raising or
warning.

`backend=None` takes the first fast backend that can run the inputs; CPU tensors use `reference`
unless Triton's interpreter is on (FLASHTX_INTERPRET=1 / TRITON_INTERPRET=1). When no fast
backend fits, `reference` runs with a one-time warning that lists every backend and why. A backend
asked for by name raises BackendNotSupported with the reasons instead.
"""
from __future__ import annotations

import sys

import torch

from . import _env


class BackendNotSupported(NotImplementedError):
    """Raised when the requested backend cannot run the given inputs; the message says why."""


class OpInputs:
    """Mixin of every op's inputs object: its device and dtype are those of its first tensor field,
    named by the class attribute `primary`."""

    __slots__ = ()
    primary = "q"

    @property
    def device(self) -> torch.device:
        return getattr(self, self.primary).device

    @property
    def dtype(self) -> torch.dtype:
        return getattr(self, self.primary).dtype


IMPLS: dict[str, dict[str, object]] = {}  # op -> {backend name -> implementation}, in preference order
_PLANS: dict[tuple, str] = {}
_BY_DEVICE: dict[tuple, str] = {}  # (op, requested, device, *kinds) -> plan_kinds' answer, see plan_device
_WARNED: set = set()


def register(op: str, name: str, impl) -> None:
    IMPLS.setdefault(op, {})[name] = impl


def describe_reasons(op: str, inputs) -> str:
    lines = []
    for name, impl in IMPLS[op].items():
        reasons = impl.not_supported_reasons(inputs)
        lines.append(f"  `{name}`: " + ("supported" if not reasons else "; ".join(reasons)))
    return "\n".join(lines)


def resolve(op: str, requested: str | None, inputs, summary) -> str:
    """The backend for `inputs` (no cache). summary() describes the inputs for messages."""
    impls = IMPLS[op]
    if requested:
        if requested not in impls:
            raise ValueError(f"backend must be None or one of {sorted(impls)}; got {requested!r}")
        reasons = impls[requested].not_supported_reasons(inputs)
        if reasons:
            raise BackendNotSupported(
                f"{op}: backend={requested!r} cannot run {summary()}:\n  " + "\n  ".join(reasons)
                + "\nAll backends:\n" + describe_reasons(op, inputs))
        return requested
    if inputs.device.type == "cpu" and not _env.INTERPRET:
        return "reference"  # documented: CPU tensors use the reference unless the interpreter is on
    for name, impl in impls.items():
        if name != "reference" and not impl.not_supported_reasons(inputs):
            return name
    table = describe_reasons(op, inputs)
    if (op, table) not in _WARNED:  # once per distinct set of reasons
        _WARNED.add((op, table))
        _env.warn(f"flashtx.{op}: no fast backend can run {summary()}; using the reference implementation. "
                  f"Backends:\n{table}")
    return "reference"


def plan(op: str, key: tuple, requested: str | None, make_inputs, summary) -> str:
    """resolve() once per (op, key, requested): `key` must hold everything the choice depends on;
    make_inputs() builds the inputs object only on a miss."""
    k = (op, requested, key)
    name = _PLANS.get(k)
    if name is None:
        name = _PLANS[k] = resolve(op, requested, make_inputs(), summary)
    return name


def plan_table(op: str) -> dict:
    """A plain dict an op may keep its own plans in (its hot path looks its backend up with one `get` on a
    key it builds itself, and calls resolve() on a miss); cleared with every other plan by clear_plans()."""
    return _TABLES.setdefault(op, {})


_TABLES: dict[str, dict] = {}


def clear_plans() -> None:
    """Forget every cached plan, lane, memoised launch and fallback warning (tests; after changing environment
    switches). Tile-config choices (configs._select, cuda_target) and the launchers' per-shape constants stay:
    they are keyed by all they depend on, so only an edit of the config tables at run time needs them cleared."""
    _PLANS.clear()
    for table in _TABLES.values():
        table.clear()
    _BY_DEVICE.clear()
    _WARNED.clear()
    launch = sys.modules.get("flashtx.triton_kernels.launch")  # loaded only with triton
    if launch is not None:
        launch.LAUNCHES.clear()
    decode = sys.modules.get("flashtx.triton_kernels.decode")
    if decode is not None:
        decode._SPLITS.clear()  # split counts, from the target's SM count


STANDINS: dict[str, object] = {}  # op -> fn(device, *kinds) -> an inputs object of those kinds (see plan_kinds)


@torch.compiler.assume_constant_result  # torch.compile runs it while tracing and keeps the answer
def plan_kinds(op: str, requested, device_type: str, device_index, *kinds) -> str:
    """plan() for ops whose backend depends only on the device and a few constants (dtypes, head
    dims: RoPE, SwiGLU, decoding), callable from code that torch.compile traces: Dynamo runs it at
    trace time and keeps the name as a constant, so a plan miss while tracing (a model compiled
    before any eager call) never traces dispatch itself (device queries, reason lists). A miss
    builds stand-in inputs of those kinds with STANDINS[op]."""
    device = torch.device(device_type, device_index) if device_index is not None else torch.device(device_type)
    return plan(op, (device_type, device_index, *kinds), requested, lambda: STANDINS[op](device, *kinds),
                lambda: f"{op} inputs of kind(s) {', '.join(map(str, kinds))} on {device}")


def plan_device(op: str, requested, device: torch.device, *kinds) -> str:
    """plan_kinds(op, requested, device.type, device.index, *kinds), looked up by the torch.device
    itself in eager mode (one dict lookup, no device attributes read). While torch.compile traces,
    plan_kinds is called as before (Dynamo runs it once and keeps the answer as a constant)."""
    if torch.compiler.is_compiling():
        return plan_kinds(op, requested, device.type, device.index, *kinds)
    k = (op, requested, device, *kinds)
    name = _BY_DEVICE.get(k)
    if name is None:
        name = _BY_DEVICE[k] = plan_kinds(op, requested, device.type, device.index, *kinds)
    return name
