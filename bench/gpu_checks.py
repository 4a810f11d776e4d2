"""GPU checks that the CPU test suite cannot do (issue 2, item 11). Needs a CUDA GPU.

    python -m bench.gpu_checks [--json FILE] [--sections ceilings,correctness,memory,speed]

1. ceilings: the measured copy bandwidth and bf16 matmul rate (METHOD.md: measure, don't trust datasheets).
2. correctness: flashtx attention forward and gradients in fp16 and bf16 at large shapes (up to
   N = 8k; GQA; odd N and D; cross-attention with bottom-right causal through flash_attn_func),
   against a float64 reference computed in query chunks (O(chunk * N) memory, exact manual
   backward). Rule as the test suite's: max error <= 2x (outputs) or 3x (gradients) the error of
   SDPA in the same dtype on the same inputs, plus 2 ulps of the largest reference value.
3. memory: peak extra memory of fwd+bwd at N = 4k, 8k, 16k (B = 1, H = 16, D = 128): flashtx must
   grow linearly (16k/4k <= 4.5x; 4.0x is exact O(N)); SDPA-MATH and eager shown for their N^2.
4. speed: TFLOP/s of flashtx vs SDPA (each backend) and eager, B*N = 16k tokens, H*D = 2048.
Exits 1 if a correctness or memory check fails.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import flashtx

from . import gpus, harness
from . import providers
from .providers import DESCRIPTION, AttnCase, attention_case

EPS = {torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}


# ------------------------------------------------------------------------------------- reference
def reference(q, k, v, dout, *, causal: bool, bottom_right: bool, scale: float, chunk: int | None = None):
    """float64 (out, dq, dk, dv) for (B, H, S, D) inputs, computed in query chunks (no row may
    see zero keys: Sq <= Sk for bottom-right causal)."""
    q, k, v, dout = (t.detach().double() for t in (q, k, v, dout))
    b, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    g = hq // hkv
    ke, ve = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)  # query head h reads kv head h // g
    out = torch.empty(b, hq, sq, v.shape[-1], dtype=torch.float64, device=q.device)
    dq, dke, dve = torch.empty_like(q), torch.zeros_like(ke), torch.zeros_like(ve)
    chunk = chunk or max(64, min(sq, 2**25 // max(1, b * hq * sk)))  # ~256 MB per (chunk, Sk) fp64 tensor
    cols = torch.arange(sk, device=q.device)[None, :]
    for i in range(0, sq, chunk):
        qc, doc = q[:, :, i:i + chunk], dout[:, :, i:i + chunk]
        s = torch.matmul(qc, ke.transpose(-1, -2)) * scale
        if causal:
            rows = torch.arange(i, i + qc.shape[2], device=q.device)[:, None]
            s.masked_fill_(cols > rows + (sk - sq if bottom_right else 0), float("-inf"))
        p = torch.softmax(s, dim=-1)
        o = torch.matmul(p, ve)
        out[:, :, i:i + chunk] = o
        dve += torch.matmul(p.transpose(-1, -2), doc)
        ds = p * (torch.matmul(doc, ve.transpose(-1, -2)) - (doc * o).sum(-1, keepdim=True))
        dq[:, :, i:i + chunk] = torch.matmul(ds, ke) * scale
        dke += torch.matmul(ds.transpose(-1, -2), qc) * scale
        del s, p, ds
    dk = dke.view(b, hkv, g, sk, d).sum(2)
    dv = dve.view(b, hkv, g, sk, v.shape[-1]).sum(2)
    return out, dq, dk, dv


def _run(fn, q, k, v, dout):
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out = fn(q, k, v)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


# (name, B, Hq, Hkv, Sq, Sk, D, causal, api): "sdpa" = flashtx.attention, "fa" = flashtx.flash_attn_func
CORRECTNESS_CASES = [
    ("N=8k D=128 causal", 1, 8, 8, 8192, 8192, 128, True, "sdpa"),
    ("N=8k D=64 full", 1, 8, 8, 8192, 8192, 64, False, "sdpa"),
    ("GQA 16/4 N=4k D=128 causal", 2, 16, 4, 4096, 4096, 128, True, "sdpa"),
    ("odd N=3001 D=96 causal", 1, 4, 4, 3001, 3001, 96, True, "sdpa"),
    ("cross Sq=1000 Sk=5000 D=128 causal (bottom-right)", 1, 8, 2, 1000, 5000, 128, True, "fa"),
]


def check_correctness(results: dict) -> bool:
    print("\n== correctness: flashtx vs float64 reference; bound = 2x/3x SDPA's error (same dtype) + 2 ulps ==")
    print(f"{'case':<50} {'dtype':<9} {'tensor':<4} {'flashtx err':>12} {'sdpa err':>10} {'bound':>10}  verdict")
    ok_all = True
    for name, b, hq, hkv, sq, sk, d, causal, api in CORRECTNESS_CASES:
        for dtype in (torch.float16, torch.bfloat16):
            q = torch.randn(b, hq, sq, d, device=providers.DEVICE, dtype=dtype)
            k = torch.randn(b, hkv, sk, d, device=providers.DEVICE, dtype=dtype)
            v = torch.randn(b, hkv, sk, d, device=providers.DEVICE, dtype=dtype)
            dout = torch.randn(b, hq, sq, d, device=providers.DEVICE, dtype=dtype)
            scale = d ** -0.5
            bottom_right = api == "fa"
            ref = reference(q, k, v, dout, causal=causal, bottom_right=bottom_right, scale=scale)
            if api == "fa":  # flash-attn layout (B, S, H, D): pass transposed views, no copies
                def ours(q_, k_, v_):
                    return flashtx.flash_attn_func(q_.transpose(1, 2), k_.transpose(1, 2), v_.transpose(1, 2),
                                                   causal=causal).transpose(1, 2)
                mask = torch.ones(sq, sk, dtype=torch.bool, device=providers.DEVICE).tril(sk - sq)

                def base(q_, k_, v_):
                    return F.scaled_dot_product_attention(q_, k_, v_, attn_mask=mask, enable_gqa=True)
            else:
                def ours(q_, k_, v_):
                    return flashtx.attention(q_, k_, v_, is_causal=causal, enable_gqa=hq != hkv)

                def base(q_, k_, v_):
                    return F.scaled_dot_product_attention(q_, k_, v_, is_causal=causal, enable_gqa=hq != hkv)
            got, want = _run(ours, q, k, v, dout), _run(base, q, k, v, dout)
            for label, g_, w_, r_, factor in zip(("out", "dq", "dk", "dv"), got, want, ref, (2, 3, 3, 3)):
                err = (g_.double() - r_).abs().max().item()
                err_base = (w_.double() - r_).abs().max().item()
                bound = factor * err_base + 2 * EPS[dtype] * r_.abs().max().item()
                ok = err <= bound  # NaN fails
                ok_all &= ok
                dt = str(dtype).replace("torch.", "")
                print(f"{name:<50} {dt:<9} {label:<4} {err:>12.3e} {err_base:>10.3e} {bound:>10.3e}  "
                      f"{'PASS' if ok else 'FAIL'}")
                results.setdefault("correctness", []).append(
                    {"case": name, "dtype": dt, "tensor": label, "err": err, "sdpa_err": err_base, "bound": bound,
                     "pass": ok})
            del q, k, v, dout, ref, got, want
            harness.free_memory()
    return ok_all


# ------------------------------------------------------------------------------------------ memory
MEM_SEQLENS = (4096, 8192, 16384)
MEM_PROVIDERS = ("flashtx", "sdpa-flash", "sdpa-efficient", "sdpa-math", "eager")


def check_memory(results: dict) -> bool:
    print("\n== peak extra memory of fwd+bwd (MB; outputs and gradients included), B=1 H=16 D=128 bf16 causal ==")
    print(f"{'N':>6} " + " ".join(f"{p:>15}" for p in MEM_PROVIDERS))
    table: dict = {}
    for n in MEM_SEQLENS:
        case = AttnCase(batch=1, hq=16, hkv=16, seqlen=n, d=128, causal=True, dtype=torch.bfloat16)
        row = []
        for p in MEM_PROVIDERS:
            state = None
            try:
                prepare, step = attention_case(p, case, "fwd+bwd")
                state = prepare()
                step(state)  # warm-up (compilation, workspaces)
                mb = harness.peak_memory_of(step, state)
                cell = f"{mb:.0f}"
            except harness.OOM_ERRORS:
                mb, cell = None, "OOM"
            except (RuntimeError, NotImplementedError, harness.Unavailable) as exc:
                mb, cell = None, "n/a"
                print(f"  ({p} at N={n}: {type(exc).__name__}: {str(exc).splitlines()[0][:120]})")
            del state
            harness.free_memory()
            table.setdefault(p, {})[n] = mb
            row.append(f"{cell:>15}")
        print(f"{n:>6} " + " ".join(row))
    results["memory_mb"] = table
    ours = table["flashtx"]
    lo, hi = ours.get(MEM_SEQLENS[0]), ours.get(MEM_SEQLENS[-1])
    ok = lo is not None and hi is not None and hi / lo <= 4.5
    growth = f"{hi / lo:.2f}x" if ok or (lo and hi) else "not measured"
    print(f"flashtx {MEM_SEQLENS[-1]}/{MEM_SEQLENS[0]}: {growth} for a 4x longer sequence "
          f"(O(N) is 4x, O(N^2) 16x): {'PASS' if ok else 'FAIL'}")
    for p in ("sdpa-math", "eager"):
        a, b_ = table[p].get(MEM_SEQLENS[0]), table[p].get(MEM_SEQLENS[-1])
        if a and b_:
            print(f"{p} {MEM_SEQLENS[-1]}/{MEM_SEQLENS[0]}: {b_ / a:.2f}x")
    results["memory_linear"] = ok
    return ok


# ------------------------------------------------------------------------------------------- speed
SPEED_PROVIDERS = ("flashtx", "sdpa-flash", "sdpa-efficient", "sdpa-cudnn", "sdpa-math", "eager")


def speed_table(results: dict) -> None:
    print("\n== speed, TFLOP/s (4*B*H*N*N*D per fwd, /2 causal, bwd 2.5x fwd), B*N = 16k, H*D = 2048, bf16 ==")
    for p in SPEED_PROVIDERS:
        print(f"   {p}: {DESCRIPTION[p]}")
    print(f"{'pass':<8} {'D':>4} {'causal':>6} {'N':>6} " + " ".join(f"{p:>15}" for p in SPEED_PROVIDERS)
          + "   flashtx vs sdpa-flash")
    rows = []
    for pass_ in ("fwd", "bwd", "fwd+bwd"):
        for causal in (False, True):
            for n in (4096,):  # the quick benchmark subset covers 2k and 8k
                d = 128
                case = AttnCase(batch=16384 // n, hq=2048 // d, hkv=2048 // d, seqlen=n, d=d, causal=causal,
                                dtype=torch.bfloat16)
                flops = gpus.attention_flops(case.batch, case.hq, n, n, d, causal, pass_)
                cells, tf = [], {}
                for p in SPEED_PROVIDERS:
                    state = None
                    try:
                        prepare, step = attention_case(p, case, pass_)
                        state = prepare()
                        for _ in range(harness.WARMUP):
                            step(state)
                        ms = statistics.median(harness.measure(step, state))
                        tf[p] = flops / (ms / 1e3) / 1e12
                        cells.append(f"{tf[p]:>15.1f}")
                    except harness.OOM_ERRORS:
                        cells.append(f"{'OOM':>15}")
                    except (RuntimeError, NotImplementedError, harness.Unavailable):
                        cells.append(f"{'n/a':>15}")
                    del state
                    harness.free_memory()
                r = (f"{tf['flashtx'] / tf['sdpa-flash']:.2f}x" if "flashtx" in tf and "sdpa-flash" in tf else "-")
                print(f"{pass_:<8} {d:>4} {str(causal):>6} {n:>6} " + " ".join(cells) + f"   {r:>8}")
                rows.append({"pass": pass_, "d": d, "causal": causal, "seqlen": n, "tflops": tf})
    results["speed_tflops"] = rows


# ---------------------------------------------------------------------------------------- ceilings
def ceilings(results: dict) -> None:
    """Copy bandwidth (bytes read + written) and a large bf16 matmul, on random data."""
    print("\n== measured ceilings (median of CUDA-event timings) ==")
    n = 2**30 // 2  # 1 GiB of bf16
    src, dst = torch.randn(n, device=providers.DEVICE, dtype=torch.bfloat16), torch.empty(n, device=providers.DEVICE, dtype=torch.bfloat16)
    for _ in range(3):
        dst.copy_(src)
    ms = statistics.median(harness.measure(lambda s: s[1].copy_(s[0]), (src, dst)))
    copy_gbs = 2 * n * 2 / (ms / 1e3) / 1e9
    del src, dst
    a, b = (torch.randn(8192, 8192, device=providers.DEVICE, dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    ms_mm = statistics.median(harness.measure(lambda s: s[0] @ s[1], (a, b)))
    mm_tflops = 2 * 8192**3 / (ms_mm / 1e3) / 1e12
    del a, b
    harness.free_memory()
    peak = gpus.lookup(harness.gpu_name())
    print(f"device-to-device copy: {copy_gbs:.0f} GB/s" + (f" ({100 * copy_gbs / peak.gbs:.0f}% of the datasheet's "
                                                           f"{peak.gbs:.0f})" if peak else ""))
    print(f"bf16 matmul 8192^3: {mm_tflops:.0f} TFLOP/s" + (f" ({100 * mm_tflops / peak.tflops_16:.0f}% of the "
                                                             f"datasheet's {peak.tflops_16:.0f})" if peak else ""))
    results["ceilings"] = {"copy_gbs": copy_gbs, "matmul_bf16_tflops": mm_tflops}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu_checks", description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None, help="also write the numbers to this JSON file")
    ap.add_argument("--sections", default="ceilings,correctness,memory,speed",
                    help="comma-separated subset of: ceilings, correctness, memory, speed")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.gpu_checks needs a CUDA GPU; torch.cuda.is_available() is False here.")
        return 2
    import triton
    harness.BUDGET_S = 0.1  # a short table: 10-100 rounds per cell
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    name = harness.gpu_name()
    props = torch.cuda.get_device_properties(0)
    results: dict = {"gpu": name, "capability": f"{props.major}.{props.minor}", "torch": torch.__version__,
                     "triton": triton.__version__, "flashtx": flashtx.__version__,
                     "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    print(f"GPU {name} (sm_{props.major}{props.minor}, {props.multi_processor_count} SMs, "
          f"{props.total_memory / 2**30:.0f} GiB), torch {torch.__version__}, triton {triton.__version__}, "
          f"flashtx {flashtx.__version__}, {results['date']}")
    runners = {"ceilings": lambda: ceilings(results) or True, "correctness": lambda: check_correctness(results),
               "memory": lambda: check_memory(results), "speed": lambda: speed_table(results) or True}
    unknown = [sec for sec in sections if sec not in runners]
    if unknown:
        print(f"unknown sections {unknown}; allowed: {list(runners)}")
        return 2
    ok = True
    t0 = time.time()
    try:
        for section in sections:
            t = time.time()
            results["pass"] = None  # until every section has run
            try:
                ok &= bool(runners[section]())
            except Exception as exc:  # record it and go on: one section's failure must not hide the others
                ok = False
                results.setdefault("errors", {})[section] = f"{type(exc).__name__}: {' '.join(str(exc).split())[:500]}"
                print(f"{section}: FAILED with {results['errors'][section]}")
                harness.free_memory()
            print(f"({section}: {time.time() - t:.0f} s)")
            _write(args.json, results)  # after every section: a timeout (SIGINT) keeps what was measured
        results["pass"] = ok
    finally:  # also on KeyboardInterrupt (the device script's timeout sends SIGINT)
        _write(args.json, results)
    print(f"\ngpu_checks: {'PASS' if ok else 'FAIL'} in {time.time() - t0:.0f} s")
    return 0 if ok else 1


def _json_safe(x):
    """NaN/inf as strings (strict JSON has neither); recursively through dicts and lists."""
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    return x


def _write(path, results: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(_json_safe(results), f, indent=1, allow_nan=False)


if __name__ == "__main__":
    sys.exit(main())
