"""Fused SwiGLU, silu(gate) * up: one kernel for forward and backward (no autograd here).

Forward (BACKWARD=False):  out = silu(g) * u                 with silu(g) = g * sigmoid(g)
Backward (BACKWARD=True):  dg = do * u * s * (1 + g * (1 - s)),   du = do * silu(g),   s = sigmoid(g)

sigmoid is 1 / (1 + exp2(-g * log2(e))): one exp2 and a reciprocal (fp64, in the interpreter, uses exp).

The backward recomputes s from the saved g and u, so nothing but the inputs is kept for it. Its
outputs may alias g and u (in-place gradients): each program reads a tile before writing the same
tile, and no tile is read by another program.

Every tensor is a (M, H) view with any strides; the packed layout [gate | up] of a (M, 2H) tensor
is the pair of views x[:, :H] and x[:, H:]. Math is fp32 (fp64 for fp64 inputs).
"""
from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from .configs import Target, swiglu_config
from .launch import ACC_DTYPE, LAUNCHES, Launch, pow2_bucket, target_for
from .limits import INT32_MAX, surely



def _cdiv(a: int, b: int) -> int:
    """Host-side ceil division (triton.cdiv is a JIT function: calling it on the host is slow)."""
    return -(-a // b)


@triton.jit
def _swiglu_kernel(G, U, DO, OUT1, OUT2, M, H, n_h_tiles,
                   stride_gm, stride_gh, stride_um, stride_uh, stride_dom, stride_doh,
                   stride_o1m, stride_o1h, stride_o2m, stride_o2h,
                   BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, BACKWARD: tl.constexpr, FAST_EXP: tl.constexpr,
                   ACC: tl.constexpr, PACKED: tl.constexpr = False, WIDE: tl.constexpr = False):
    """PACKED: G is an (M, 2H) [gate | up] tensor and U its columns [H, 2H) (U's strides are G's); in the
    backward OUT1 is the (M, 2H) [dgate | dup] gradient and OUT2 its columns [H, 2H). Writing through
    one tensor, not through two column views of it, keeps torch.compile from copying the halves back
    (a kernel that mutates a view is functionalized into a clone and a slice_scatter of the whole base)."""
    # flat grid, column tiles fastest: consecutive programs stream consecutive memory
    pid = tl.program_id(0)
    pid_m = pid // n_h_tiles
    pid_h = pid - pid_m * n_h_tiles
    if WIDE:  # a column offset times its stride passes 2**31 (a permuted view, a slice of a big buffer): int64
        offs_m = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,)
        offs_h = pid_h.to(tl.int64) * BLOCK_H + tl.arange(0, BLOCK_H)  # (BLOCK_H,)
    else:
        offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)  # (BLOCK_M,)
        offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)  # (BLOCK_H,) int32: the plan checked (2H + BLOCK_H) x stride
    mask = (offs_m[:, None] < M) & (offs_h[None, :] < H)  # (BLOCK_M, BLOCK_H)
    u_base = U
    o2_base = OUT2
    offs_u = offs_h  # up's (and the second output's) columns
    if PACKED:  # the second half [H, 2H) of G / OUT1
        if WIDE:
            u_base = G
            o2_base = OUT1
            offs_u = offs_h + H
        else:
            u_base = G + H * stride_gh
            o2_base = OUT1 + H * stride_o1h
    g = tl.load(G + offs_m[:, None] * stride_gm + offs_h[None, :] * stride_gh, mask=mask, other=0.0).to(ACC)
    u = tl.load(u_base + offs_m[:, None] * stride_um + offs_u[None, :] * stride_uh, mask=mask, other=0.0).to(ACC)
    # sigmoid: exp2 (one MUFU.EX2) and a reciprocal; fp64 (interpreter tests) keeps exp, since the
    # log2(e) literal would be fp32 and cost fp64 its precision. exp2(+inf) = inf gives s = 0.
    if FAST_EXP:
        e = tl.exp2(g * -1.4426950408889634)
    else:
        e = tl.exp(-g)
    s = 1.0 / (1.0 + e)  # (BLOCK_M, BLOCK_H); 1.0 is exact in any dtype
    silu = g * s
    if BACKWARD:
        do = tl.load(DO + offs_m[:, None] * stride_dom + offs_h[None, :] * stride_doh, mask=mask, other=0.0).to(ACC)
        dg = do * u * (s + silu * (1.0 - s))  # = do * u * s * (1 + g * (1 - s))
        du = do * silu
        tl.store(OUT1 + offs_m[:, None] * stride_o1m + offs_h[None, :] * stride_o1h,
                 dg.to(OUT1.dtype.element_ty), mask=mask)
        tl.store(o2_base + offs_m[:, None] * stride_o2m + offs_u[None, :] * stride_o2h,
                 du.to(o2_base.dtype.element_ty), mask=mask)
    else:
        tl.store(OUT1 + offs_m[:, None] * stride_o1m + offs_h[None, :] * stride_o1h,
                 (silu * u).to(OUT1.dtype.element_ty), mask=mask)


_STATIC: dict = {}  # (hidden, dtype, backward, target) -> _Static; see _static


class _Static:
    """What a launch takes from (hidden, dtype, backward, target) alone: the tile config, the
    constexprs and the column tiles. `small` holds the variants for row counts below the config's
    block_rows (swiglu_config shrinks the row tile to the next power of two of the rows)."""

    __slots__ = ("cfg", "consts", "n_h_tiles", "small")

    def __init__(self, hidden, dtype, backward: bool, cfg):
        self.cfg = cfg
        self.consts = dict(BLOCK_M=cfg.block_rows, BLOCK_H=cfg.block_cols, BACKWARD=backward,
                           FAST_EXP=dtype != torch.float64, ACC=ACC_DTYPE[dtype], PACKED=False)
        self.n_h_tiles = _cdiv(hidden, cfg.block_cols)
        self.small: dict = {}


def _static(hidden, rows, dtype, backward: bool, target: Target) -> _Static:
    """The cached _Static of a launch: the same config as swiglu_config(hidden, rows, target).

    The key holds no row count (a token count): swiglu_config only shrinks the row tile to the next
    power of two of small row counts, so rows pick one of a config's few shrunken variants
    (pow2_bucket); a symbolic row count (torch.compile's dynamic shapes) takes the full tile, so one graph
    serves every count. A symbolic hidden size (unhashable) is planned the same way, without the cache."""
    key = (hidden, dtype, backward, target)
    try:
        st = _STATIC.get(key)
        cached = True
    except TypeError:  # a SymInt in the key
        st, cached = None, False
    if st is None:
        st = _Static(hidden, dtype, backward, swiglu_config(hidden, 1 << 62, target))
        if cached:
            _STATIC[key] = st
    br = st.cfg.block_rows
    b = pow2_bucket(rows, br)
    if b == br:
        return st
    small = st.small.get(b)
    if small is None:
        small = st.small[b] = _Static(hidden, dtype, backward, swiglu_config(hidden, b, target))
    return small


def _args(st: _Static, g, u, out1, do, out2, shape=None) -> tuple[tuple, dict]:
    """(grid, kernel arguments) of one launch (see plan_swiglu); shape: (M, H) when g is not (M, H) (packed)."""
    M, H = shape if shape is not None else g.shape
    if do is None:
        do, out2 = g, out1  # placeholders, unused in the forward
    sg, su, sd, s1, s2 = g.stride(), u.stride(), do.stride(), out1.stride(), out2.stride()
    nht = st.n_h_tiles
    args = dict(st.consts)
    # int64 column offsets only where int32 would wrap (columns reach 2H + BLOCK_H: packed's second half)
    wide = (2 * H + st.cfg.block_cols) * max(abs(sg[1]), abs(su[1]), abs(sd[1]), abs(s1[1]), abs(s2[1])) > INT32_MAX
    args.update(G=g, U=u, DO=do, OUT1=out1, OUT2=out2, M=M, H=H, n_h_tiles=nht, WIDE=wide,
                stride_gm=sg[0], stride_gh=sg[1], stride_um=su[0], stride_uh=su[1], stride_dom=sd[0],
                stride_doh=sd[1], stride_o1m=s1[0], stride_o1h=s1[1], stride_o2m=s2[0], stride_o2h=s2[1])
    return (_cdiv(M, st.cfg.block_rows) * nht,), args


def plan_swiglu(g, u, out1, *, do=None, out2=None, target: Target | None = None) -> Launch:
    """Launch for the forward (out1 = silu(g) * u) or, when `do` is given, the backward
    (out1 = dgate, out2 = dup). Every tensor is an (M, H) view with any strides; out1/out2 may be
    g/u (in-place backward: each program reads its tile before writing that same tile)."""
    M, H = g.shape
    st = _static(H, M, g.dtype, do is not None, target if target is not None else target_for(g))
    grid, args = _args(st, g, u, out1, do, out2)
    return Launch(_swiglu_kernel, grid, args, st.cfg)


_ROLES = ("G", "U", "OUT1", "DO", "OUT2")


def _cache_args(g, u, out1, do, out2) -> tuple:
    """LaunchCache.run's / entry's arguments (key, roles, tensors, build) for plan_swiglu's launch."""
    def build():
        M, H = g.shape
        st = _static(H, M, g.dtype, do is not None, target_for(g))
        grid, args = _args(st, g, u, out1, do, out2)
        return [Launch(_swiglu_kernel, grid, args, st.cfg)]

    return ("swiglu", g.device), _ROLES, (g, u, out1, do, out2), build


def _launch(g, u, out1, do, out2) -> None:
    """plan_swiglu(...).run() with positional arguments: the per-call path, replayed from the launch cache
    for a repeated signature (so a GPU launches the compiled kernel directly, see launch.DIRECT_LAUNCH)."""
    LAUNCHES.run(*_cache_args(g, u, out1, do, out2))


def swiglu_entry(g, u, out1, do=None, out2=None):
    """The memoised launch (LaunchCache.entry) that swiglu_forward (do None) or swiglu_backward would replay for
    these (M, H) views, or None where they plan every call. flashtx._swiglu_lane keeps it per call signature and
    fires it itself, on tensors with the views' data pointers (the launch reads nothing else of them)."""
    return LAUNCHES.entry(*_cache_args(g, u, out1, do, out2))


def plan_swiglu_backward_packed(do, x, dx, *, target: Target | None = None) -> Launch:
    """Launch for dx = [dgate | dup] of x = [gate | up]: x, dx (M, 2H) (dx may be x: in place), do (M, H).
    The kernel reads and writes both halves through x and dx themselves (PACKED), never column views."""
    M, H = do.shape
    st = _static(H, M, x.dtype, True, target if target is not None else target_for(x))
    # U and OUT2 are x and dx themselves (their strides); PACKED offsets them by H columns, and never stores
    # through OUT2, so dx is the only tensor the kernel writes
    grid, args = _args(st, x, x, dx, do, dx, do.shape)
    args["PACKED"] = True
    return Launch(_swiglu_kernel, grid, args, st.cfg)


def _packed_cache_args(do, x, dx) -> tuple:
    return ("swiglu_packed", x.device), _ROLES, (x, x, dx, do, dx), lambda: [plan_swiglu_backward_packed(do, x, dx)]


def swiglu_backward_packed(do, x, dx) -> None:
    """dx = [dgate | dup] for x = [gate | up] (M, 2H) (dx may be x) and do (M, H); nothing for empty inputs."""
    if not surely(do.numel() == 0):  # (a traced count read on the device: launched, over an empty grid if 0)
        LAUNCHES.run(*_packed_cache_args(do, x, dx))


def swiglu_packed_entry(do, x, dx):
    """swiglu_backward_packed's memoised launch for these (M, 2H) / (M, H) views (see swiglu_entry)."""
    return LAUNCHES.entry(*_packed_cache_args(do, x, dx))


def swiglu_forward(g, u, out) -> None:
    """out = silu(g) * u on (M, H) views; launches nothing for empty inputs."""
    if not surely(g.numel() == 0):
        _launch(g, u, out, None, None)


def swiglu_backward(do, g, u, dg, du) -> None:
    """dg, du = gradients of silu(g) * u for the incoming do, all (M, H) views (dg/du may be g/u)."""
    if not surely(g.numel() == 0):
        _launch(g, u, dg, do, du)


def compile_plans(target: Target) -> list[tuple[str, Launch]]:
    """Forward and backward, fp16 and bf16, separate and packed [gate | up] inputs, at LLaMA-like
    hidden sizes (256; 11008 = LLaMA-7B, 256-column tiles; 14336 = LLaMA-3-8B and 28672 = LLaMA-3-70B,
    2048-column tiles; 5000, a width with a partial last tile), plus fp32 at 14336."""
    plans = []
    m = 64  # rows: enough for every width's full tile (16 x 256 at 256 and 11008 columns)
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        for h in ((256, 5000, 11008, 14336, 28672) if dtype != torch.float32 else (14336,)):
            g = torch.empty(m, h, dtype=dtype)
            u = torch.empty(m, h, dtype=dtype)
            x = torch.empty(m, 2 * h, dtype=dtype)  # packed [gate | up]
            gp, up = x[:, :h], x[:, h:]  # the forward reads the halves as views
            plans.append((f"swiglu_fwd_h{h}_{dtype}", plan_swiglu(g, u, torch.empty_like(g), target=target)))
            plans.append((f"swiglu_fwd_packed_h{h}_{dtype}",
                          plan_swiglu(gp, up, torch.empty(m, h, dtype=dtype), target=target)))
            plans.append((f"swiglu_bwd_h{h}_{dtype}",
                          plan_swiglu(g, u, torch.empty_like(g), do=torch.empty_like(g), out2=torch.empty_like(u),
                                      target=target)))
            plans.append((f"swiglu_bwd_packed_h{h}_{dtype}",
                          plan_swiglu_backward_packed(torch.empty(m, h, dtype=dtype), x, torch.empty_like(x),
                                                      target=target)))
            plans.append((f"swiglu_bwd_packed_inplace_h{h}_{dtype}",
                          plan_swiglu_backward_packed(torch.empty(m, h, dtype=dtype), x, x, target=target)))
    # the int64-offset variant (WIDE: strides too large for int32 columns), forward and packed backward
    for label, launch in plans[:2] + plans[3:4]:
        wide = dataclasses.replace(launch, args={**launch.args, "WIDE": True})
        plans.append((label.replace("swiglu_", "swiglu_wide_", 1), wide))
    return plans
