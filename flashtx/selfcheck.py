"""Self-check of every op through every available backend, against the float64 reference.

Used by ``python -m flashtx``. Each check draws fresh random inputs, runs forward and backward
through one backend, and applies the tolerance rule of flashtx.testing to every output and
gradient. A backend that cannot run the inputs is reported as skipped, with its reasons. The plain
calls are here; varlen, packed QKV, dropout, lse, decoding, RoPE on q and k, and packed SwiGLU are in
flashtx.selfcheck_ops.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from . import reference, testing
from .backends import BACKENDS, AttentionInputs, AttentionMasks


@dataclasses.dataclass
class CheckResult:
    op: str
    dtype: torch.dtype
    backend: str
    errors: dict  # name -> (error, bound)
    skipped: str = ""

    @property
    def passed(self) -> bool:
        return not self.skipped and all(e <= b for e, b in self.errors.values())


def _grads(fn, inputs, dout):
    out = fn(*inputs)
    return out, torch.autograd.grad(out, inputs, dout)


def _compare(op, dtype, backend, fn_kernel, fn_ref, make_inputs, out_dtype=None) -> CheckResult:
    """Run fn_kernel in dtype and fn_ref in dtype and float64; apply the tolerance rule. The output must have
    the reference's shape and out_dtype (default: dtype), each gradient its input's shape and dtype."""
    base = make_inputs()
    ins = [t.detach().to(dtype).requires_grad_(True) for t in base]
    out = fn_kernel(*ins)
    dout = torch.randn_like(out, dtype=torch.float64).to(out.dtype)
    grads = torch.autograd.grad(out, ins, dout)
    ins64 = [t.detach().to(torch.float64).requires_grad_(True) for t in base]
    ref, ref_grads = _grads(fn_ref, ins64, dout.to(torch.float64))
    ins_e = [t.detach().to(dtype).requires_grad_(True) for t in base]
    eager, eager_grads = _grads(fn_ref, ins_e, dout.to(out_dtype or dtype))
    errors = {}
    if out.dtype != (out_dtype or dtype) or out.shape != ref.shape:  # (the rule would broadcast a wrong shape)
        errors[f"out is {tuple(out.shape)} {out.dtype}"] = (float("inf"), 0.0)
    errors["out"] = testing.tolerance_check(out, ref, eager)
    scale = max(float(g.abs().max()) for g in ref_grads)
    for i, (g, r, e) in enumerate(zip(grads, ref_grads, eager_grads)):
        if g.dtype != dtype or g.shape != r.shape:
            errors[f"grad{i} is {tuple(g.shape)} {g.dtype}"] = (float("inf"), 0.0)
        errors[f"grad{i}"] = testing.tolerance_check(g, r, e, grad=True, scale=scale)
    return CheckResult(op, dtype, backend, errors)


def attention_checks(device, dtype) -> list[tuple]:
    """(name, runner(backend) -> CheckResult, reasons(backend), backend names) for each attention check."""
    def make():
        return (torch.randn(2, 4, 77, 64, device=device, dtype=torch.float64),
                torch.randn(2, 2, 93, 64, device=device, dtype=torch.float64),
                torch.randn(2, 2, 93, 64, device=device, dtype=torch.float64))

    def sdpa(backend):
        from .functional import attention

        return _compare(SDPA_NAME, dtype, backend,
                        lambda q, k, v: attention(q, k, v, is_causal=True, enable_gqa=True, backend=backend),
                        lambda q, k, v: reference.attention(q, k, v, causal=True), make)

    def flash(backend):
        from .functional import flash_attn_func

        def run(q, k, v):
            return flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True,
                                   backend=backend).transpose(1, 2)

        return _compare(FLASH_NAME, dtype, backend, run,
                        lambda q, k, v: reference.attention(q, k, v, causal=True, bottom_right=True), make)

    def padded(backend):
        from .functional import flash_attn_func

        kv_lens = torch.tensor([93, 50], device=device)
        key_mask = torch.arange(93, device=device)[None] >= torch.tensor([0, 7], device=device)[:, None]  # left pad
        vis = reference.visibility(77, 93, batch=2, causal=True, bottom_right=True, window=(40, -1),
                                   key_mask=key_mask, kv_lens=kv_lens, device=device)

        def run(q, k, v):
            return flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True,
                                   window_size=(40, -1), key_mask=key_mask, kv_lens=kv_lens,
                                   backend=backend).transpose(1, 2)

        return _compare(PADDED_NAME, dtype, backend, run, lambda q, k, v: reference.attention(q, k, v, vis=vis), make)

    slopes = torch.linspace(0.05, 0.4, 4, device=device)  # (H,) float32

    def make_biased():
        return make() + (torch.randn(1, 4, 77, 93, device=device, dtype=torch.float64),)

    def biased(backend):
        from .functional import attention

        def ref(q, k, v, bias):
            alibi = reference.alibi_bias(slopes, 77, 93, device=device)
            return reference.attention(q, k, v, causal=True, bias=bias, softcap=20.0, alibi=alibi)

        return _compare(BIAS_NAME, dtype, backend,
                        lambda q, k, v, bias: attention(q, k, v, attn_mask=bias, is_causal=True, enable_gqa=True,
                                                        softcap=20.0, alibi_slopes=slopes, backend=backend),
                        ref, make_biased)

    def reasons(backend):
        q = torch.empty(2, 4, 77, 64, device=device, dtype=dtype)
        kv = torch.empty(2, 2, 93, 64, device=device, dtype=dtype)
        return BACKENDS[backend].not_supported_reasons(AttentionInputs(q, kv, kv, True))

    def bias_reasons(backend):
        q = torch.empty(2, 4, 77, 64, device=device, dtype=dtype)
        kv = torch.empty(2, 2, 93, 64, device=device, dtype=dtype)
        masks = AttentionMasks(attn_mask=torch.empty(1, 4, 77, 93, device=device, dtype=dtype), softcap=20.0,
                               alibi_slopes=slopes[None])
        return BACKENDS[backend].not_supported_reasons(AttentionInputs(q, kv, kv, True, masks=masks))

    return [(SDPA_NAME, sdpa, reasons, tuple(BACKENDS)), (FLASH_NAME, flash, reasons, tuple(BACKENDS)),
            (PADDED_NAME, padded, reasons, tuple(BACKENDS)), (BIAS_NAME, biased, bias_reasons, tuple(BACKENDS))]


SDPA_NAME = "attention (SDPA shell, GQA, causal top-left)"
FLASH_NAME = "flash_attn_func (GQA, causal bottom-right)"
PADDED_NAME = "flash_attn_func (GQA, causal window, key_mask + kv_lens)"
BIAS_NAME = "attention (learned bias (1, H, Sq, Sk) with its gradient, softcap, ALiBi, causal)"

def rotary_checks(device, dtype):
    """apply_rotary (half rotation, partial: rotary_dim 48 of 64) against x*cos + rotate_half(x)*sin."""
    from .rotary import ROTARY_BACKENDS, RotaryInputs, apply_rotary

    name = "apply_rotary (NeoX half rotation, partial rotary_dim 48/64)"
    S, R2 = 77, 24
    theta = torch.arange(S, device=device, dtype=torch.float64)[:, None] * 10000.0 ** (
        -torch.arange(R2, device=device, dtype=torch.float64) / R2)
    cos, sin = theta.cos().float(), theta.sin().float()  # (S, R2) tables, as a model keeps them

    def eager(x):  # the formula users write: (B, S, H, D), computed in x's dtype
        c = torch.cat((cos, cos), -1).to(x.dtype)[None, :, None, :]
        s_ = torch.cat((sin, sin), -1).to(x.dtype)[None, :, None, :]
        xr, rest = x[..., : 2 * R2], x[..., 2 * R2:]
        return torch.cat((xr * c + reference.rotate_half(xr) * s_, rest), -1)

    def make():
        return (torch.randn(2, S, 4, 64, device=device, dtype=torch.float64),)

    def run(backend):
        return _compare(name, dtype, backend, lambda x: apply_rotary(x, cos, sin, backend=backend), eager, make)

    def reasons(backend):
        x = torch.empty(2, S, 4, 64, device=device, dtype=dtype)
        return ROTARY_BACKENDS[backend].not_supported_reasons(RotaryInputs(x, cos[None]))

    return [(name, run, reasons, tuple(ROTARY_BACKENDS))]


def swiglu_checks(device, dtype):
    """swiglu(gate, up) against silu(gate) * up."""
    from .swiglu import SWIGLU_BACKENDS, SwigluInputs, swiglu

    name = "swiglu (silu(gate) * up)"

    def make():
        return tuple(torch.randn(2, 77, 344, device=device, dtype=torch.float64) for _ in range(2))

    def run(backend):
        return _compare(name, dtype, backend, lambda g, u: swiglu(g, u, backend=backend),
                        lambda g, u: torch.nn.functional.silu(g) * u, make)

    def reasons(backend):
        g = torch.empty(2, 77, 344, device=device, dtype=dtype)
        return SWIGLU_BACKENDS[backend].not_supported_reasons(SwigluInputs(g))

    return [(name, run, reasons, tuple(SWIGLU_BACKENDS))]


# Each entry: a function (device, dtype) -> [(name, runner(backend), reasons_fn(backend), backend names)].
CHECKS: list[Callable] = [attention_checks, rotary_checks, swiglu_checks]


def run_all(device, dtypes, report=print) -> list[CheckResult]:
    results = []
    for dtype in dtypes:
        for make_checks in CHECKS:
            for name, runner, reasons_fn, backend_names in make_checks(device, dtype):
                for backend in backend_names:
                    why = reasons_fn(backend)
                    if why:
                        res = CheckResult(name, dtype, backend, {}, "; ".join(why))
                    else:
                        try:
                            res = runner(backend)
                        except Exception as exc:  # a crash is a failure, reported like one
                            res = CheckResult(f"{name} CRASHED: {type(exc).__name__}: {exc}", dtype, backend,
                                              {"crash": (float("inf"), 0.0)})
                    results.append(res)
                    report(format_result(res))
    return results


def format_result(r: CheckResult) -> str:
    dt = str(r.dtype).replace("torch.", "")
    if r.skipped:
        return f"  SKIP  {dt:<8} {r.backend:<9} {r.op}: {r.skipped}"
    errs = "  ".join(f"{k} {e:.1e}/{b:.1e}" + ("" if e <= b else " (OVER)") for k, (e, b) in r.errors.items())
    return f"  {'PASS' if r.passed else 'FAIL'}  {dt:<8} {r.backend:<9} {r.op}\n        error/bound: {errs}"


def _more_checks():
    from .selfcheck_ops import attention_variant_checks, decode_checks, elementwise_checks

    return [attention_variant_checks, decode_checks, elementwise_checks]


CHECKS += _more_checks()
