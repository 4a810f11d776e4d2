"""The value check of packed (varlen) batches on the device: one tiny kernel, one flag per cu_seqlens.

flash_attn_varlen_func and varlen RoPE follow cu_seqlens into their packed rows: a wrong value would make
the kernels read or write out of bounds, or leave rows unwritten. On CPU the values are read on the host
(flashtx._validate.check_cu_seqlens_values names the first bad entry). On a GPU (no host sync)
`_cu_seqlens_check` evaluates, for one tensor or a pair (cu_seqlens_q and cu_seqlens_k) in one program:

- cu[0] == 0, and cu[i + 1] >= cu[i] for every i;
- cu[-1] == total (or <= total: rows gathered for a paged cache);
- no sequence is longer than its max_seqlen (an int, or a 0-dim integer tensor on the device, read here),
  where one is given;

and writes FLAG[j] = 1 (all hold for tensor j) or 0, which a torch._assert_async per tensor then checks before
the attention or RoPE kernels run (a device-side assert stops every later kernel of the stream). The torch ops
this replaces were 11 launches per tensor (slice, sub, two eq, and, ge, all, max, le, and, assert).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .configs import INTERPRETER_TARGET, ElementwiseConfig
from .launch import LAUNCHES, Launch, target_for


@triton.jit
def _cu_ok(CU, N, TOTAL, LIMIT, LIMIT_T, EXACT: tl.constexpr, LIMITED: tl.constexpr, LIMIT_TENSOR: tl.constexpr,
           BLOCK: tl.constexpr):
    """Whether cu (N + 1 entries) starts at 0, never decreases, ends at (or within) TOTAL and, when LIMITED, has
    no sequence longer than LIMIT (or LIMIT_T[0] with LIMIT_TENSOR)."""
    last = tl.load(CU + N).to(tl.int64)
    ok = tl.load(CU).to(tl.int64) == 0
    if EXACT:
        ok = ok & (last == TOTAL)
    else:
        ok = ok & (last <= TOTAL)
    if LIMIT_TENSOR:
        limit = tl.load(LIMIT_T).to(tl.int64)
    else:
        limit = LIMIT  # (an int argument of 1 arrives as a constexpr: compared as it is, never converted)
    bad = tl.zeros([BLOCK], dtype=tl.int32)
    for i0 in range(0, N, BLOCK):
        offs = i0 + tl.arange(0, BLOCK)
        live = offs < N
        lens = tl.load(CU + offs + 1, mask=live, other=0).to(tl.int64) - tl.load(CU + offs, mask=live,
                                                                                 other=0).to(tl.int64)  # (BLOCK,)
        wrong = lens < 0
        if LIMITED:
            wrong = wrong | (lens > limit)
        bad += tl.where(live & wrong, 1, 0)
    return ok & (tl.sum(bad, 0) == 0)


@triton.jit
def _cu_seqlens_check(FLAG, CU_A, CU_B, LIMIT_TA, LIMIT_TB, N, TOTAL_A, TOTAL_B, LIMIT_A, LIMIT_B,
                      EXACT_A: tl.constexpr, EXACT_B: tl.constexpr, LIMITED_A: tl.constexpr, LIMITED_B: tl.constexpr,
                      TENSOR_A: tl.constexpr, TENSOR_B: tl.constexpr, PAIR: tl.constexpr, BLOCK: tl.constexpr):
    """One program: FLAG[0] for CU_A and, with PAIR, FLAG[1] for CU_B (the same N + 1 entries)."""
    tl.store(FLAG, _cu_ok(CU_A, N, TOTAL_A, LIMIT_A, LIMIT_TA, EXACT_A, LIMITED_A, TENSOR_A, BLOCK).to(tl.int32))
    if PAIR:
        tl.store(FLAG + 1, _cu_ok(CU_B, N, TOTAL_B, LIMIT_B, LIMIT_TB, EXACT_B, LIMITED_B, TENSOR_B,
                                  BLOCK).to(tl.int32))


# Sequences per loop step. Fixed, not sized to the batch: a block size computed from nseq would specialise a
# compiled graph on it (under torch.compile's dynamic shapes, a recompile per packed batch's sequence count).
_BLOCK = 256


def plan_check(flag, cus: list, limits: list, totals: list, exact: list, bounded: list, int_limits: list,
               target=None) -> Launch:
    """The check of one or two cu_seqlens tensors (cus, each (N + 1,) int32 or int64, contiguous, the same N)
    into flag (len(cus),) int32. Per tensor: its total, whether it must end exactly there, whether sequence
    lengths are bounded, and the bound: limits[j] (a 0-dim integer tensor on the device) or else int_limits[j]
    (an int). Sizes and ints may be symbolic (torch.compile's dynamic shapes): none is read here."""
    pair = len(cus) == 2
    a, b = cus[0], cus[-1]
    la, lb = limits[0], limits[-1]
    args = dict(FLAG=flag, CU_A=a, CU_B=b, LIMIT_TA=la if la is not None else a, LIMIT_TB=lb if lb is not None else b,
                N=a.shape[0] - 1, TOTAL_A=totals[0], TOTAL_B=totals[-1], LIMIT_A=int_limits[0],
                LIMIT_B=int_limits[-1], EXACT_A=bool(exact[0]), EXACT_B=bool(exact[-1]), LIMITED_A=bool(bounded[0]),
                LIMITED_B=bool(bounded[-1]), TENSOR_A=la is not None, TENSOR_B=lb is not None, PAIR=pair,
                BLOCK=_BLOCK)  # the unused LIMIT_T* point at the cu tensor: never read
    warps = 1 if (target or target_for(a)) is INTERPRETER_TARGET else 4
    return Launch(_cu_seqlens_check, (1,), args, ElementwiseConfig(_BLOCK, 1, warps, 1))


_ROLES = ("FLAG", "CU_A", "CU_B", "LIMIT_TA", "LIMIT_TB")  # the kernel argument of each launch-cache input


def cu_seqlens_check(flag, cus: list, limits: list, totals: list, exact: list, bounded: list, int_limits: list) -> None:
    """Launch the check (see plan_check)."""
    LAUNCHES.run(*_cache_args(flag, cus, limits, totals, exact, bounded, int_limits))


def check_entry(flag, cus: list, limits: list, totals: list, exact: list, bounded: list, int_limits: list):
    """The memoised launch (LaunchCache.entry) cu_seqlens_check would replay for these arguments, or None where it
    plans every call. flashtx._validate keeps it per call signature and fires it itself on (flag, cu_a, cu_b,
    limit_a, limit_b) (_ROLES' order; None for what a single tensor's check lacks)."""
    return LAUNCHES.entry(*_cache_args(flag, cus, limits, totals, exact, bounded, int_limits))


def _cache_args(flag, cus, limits, totals, exact, bounded, int_limits) -> tuple:
    """LaunchCache.run's / entry's arguments for a check: key, roles, tensors, build."""
    pair = len(cus) == 2
    return (("cu_seqlens_check", flag.device, tuple(totals), tuple(exact), tuple(bounded), tuple(int_limits), pair),
            _ROLES, (flag, cus[0], cus[1] if pair else None, limits[0], limits[1] if pair else None),
            lambda: [plan_check(flag, cus, limits, totals, exact, bounded, int_limits)])


def compile_plans(target) -> list:
    """The check for the compile check: one tensor with an int bound, a pair with tensor bounds (int32 and
    int64 bounds), short and long batches (one block and a loop of them), a paged (inexact) total."""
    plans = []
    for nseq, dtype, pair, tensor_limits in ((1, torch.int32, False, False), (3, torch.int32, True, True),
                                             (5000, torch.int32, True, False), (5000, torch.int64, True, True)):
        cus = [torch.zeros(nseq + 1, dtype=torch.int32) for _ in range(2 if pair else 1)]
        limits = [torch.zeros((), dtype=dtype) if tensor_limits else None for _ in cus]
        flag = torch.empty(len(cus), dtype=torch.int32)
        size = 1 if nseq == 1 else 4096  # one sequence of one token: N, totals and bounds of 1 (specialised by Triton)
        launch = plan_check(flag, cus, limits, [size] * len(cus), [True, not pair][:len(cus)], [True] * len(cus),
                            [min(size, 512)] * len(cus), target=target)
        name = (f"cu_seqlens_check nseq={nseq} {'pair' if pair else 'one'}"
                f"{f' {str(dtype)[6:]} tensor bounds' if tensor_limits else ' int bounds'}")
        plans.append((name, launch))
    return plans


__all__ = ["plan_check", "cu_seqlens_check", "check_entry", "compile_plans"]
