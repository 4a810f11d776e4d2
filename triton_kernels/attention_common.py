"""Pieces shared by the attention kernels: per-sequence bounds, visibility masks, loop bounds, scalars.

Conventions used by every attention kernel:
- Tensors are addressed through (batch, head, seq, dim) strides, so (B, H, S, D) and (B, S, H, D)
  layouts both run without copies. Varlen (packed (total, H, D)) inputs arrive as batch-stride-0
  views; each sequence's first row comes from its cumulative lengths (`seq_bounds`).
- Per sequence b: `Sq_b`/`Sk_b` are the valid lengths (Sq/Sk, or q_lens[b]/kv_lens[b] clamped
  to [0, S], or cu_seqlens[b+1] - cu_seqlens[b]); `Sq_mem`/`Sk_mem` are the rows that may be
  loaded and stored (the padded length, or the sequence's own length when packed).
- Query row i sees key column j iff i < Sq_b, j < Sk_b and
    j <= i + causal_shift   when CAUSAL (any right bound: causal, or a window's right size),
    j >= i + window_shift   when WINDOW (a window's left size),
    key_mask[b, j]          when KEY_MASK,
  where causal_shift = align + right, window_shift = align - left, align = Sk_b - Sq_b for
  bottom-right alignment (flash-attn) and 0 for top-left (SDPA); right is 0 for causal.
  A query_mask only zeroes rows at the end of the forward (QUERY_MASK): a row that sees no key
  has m2 = -inf, and the backward turns that into P = 0 for the whole row.
- Scores live in the log2 domain: s2 = (q . k) * scale * log2(e), so the softmax uses exp2. The
  forward stores two per-row statistics: m2, the row max of s2, and l2 = log2(sum_j exp2(s2 - m2));
  P = exp2(s2 - m2) * exp2(-l2) everywhere P is recomputed (one rounding inside exp2, as the
  forward's exp2(s2 - m) / l; exp2((s2 - m2) - l2) would add a second). Not one lse2 = m2 + l2: with |m2| huge
  (a row of -1e9 biases) fp32 cannot hold l2 next to m2, and P would sum to Sk. Rows that see no
  key have m2 = -inf, l2 = 0 (the backward turns that into P = 0). Natural lse = (m2 + l2) * ln 2.
- Score modifiers (`score_mods`), in flash-attn's order on the scaled scores s (natural units):
  s = softcap * tanh(s / softcap) (SOFTCAP), s -= slope * |i + Sk_b - Sq_b - j| (ALIBI),
  s += attn_mask (MASK_KIND 2, additive) or s = -inf where attn_mask is False (MASK_KIND 1); then
  the visibility masks. EVERY_TILE (a key mask or an attn_mask) sends every tile down the masked
  path, which also copes with rows whose scores are all -inf.
- Dropout (DROPOUT) keeps P[b, h, i, j] iff a Philox-4x32 draw keyed by seed at counter
  (i * Sk_b + j as two 32-bit words, b * Hq + h) (sequence-local i, j; reference.dropout_keep computes the same
  draws in torch) is >= dropout_p; forward and backward draw the same numbers, so the mask is never stored.
  Kept entries are scaled by 1 / (1 - dropout_p).
- Float scalars arrive as float32 hi/lo pairs (hi + lo = value to ~48 bits) and are summed in the
  accumulator dtype, so float64 runs keep float64 accuracy.
"""
import triton
import triton.language as tl


@triton.jit
def scalar_in(hi, lo, DTYPE: tl.constexpr):
    """Rebuild a float argument in DTYPE from its float32 hi/lo halves."""
    return tl.cast(hi, DTYPE) + tl.cast(lo, DTYPE)


@triton.jit
def seq_bounds(b, Sq, Sk, lq, lk, cq0, cq1, ck0, ck1, bottom_right, right, left,
               LENS: tl.constexpr, VARLEN: tl.constexpr):
    """Sequence b's (q_start, k_start, Sq_b, Sk_b, Sq_mem, Sk_mem, causal_shift, window_shift).

    lq, lk: Q_LENS[b], KV_LENS[b] (read only when LENS); cq0, cq1, ck0, ck1: CU_Q[b], CU_Q[b + 1], CU_K[b],
    CU_K[b + 1] (only when VARLEN). The kernels load them themselves, before the call: torch.compile's
    analysis of a traced kernel counts a pointer passed to a helper whose result addresses a store as written,
    which makes cu_seqlens a mutated input (a copy in every forward; a failed partition in training).
    q_start/k_start: row offsets of the sequence (0 unless VARLEN); see the module docstring.
    """
    q_start = b * 0  # int32 scalars, as the loads give
    k_start = b * 0
    Sq_b = Sq
    Sk_b = Sk
    Sq_mem = Sq
    Sk_mem = Sk
    if LENS:  # right padding: per-batch lengths, clamped to the padded length
        # clamp in the loaded dtype, then cast: an int64 2**32 + 3 is 'all rows', not 3
        Sq_b = tl.minimum(tl.maximum(lq, 0), Sq).to(tl.int32)
        Sk_b = tl.minimum(tl.maximum(lk, 0), Sk).to(tl.int32)
    if VARLEN:  # packed: sequence b is rows [cu[b], cu[b+1]) of the (total, H, D) tensors
        q_start = cq0.to(tl.int32)
        k_start = ck0.to(tl.int32)
        Sq_b = cq1.to(tl.int32) - q_start
        Sk_b = ck1.to(tl.int32) - k_start
        Sq_mem = Sq_b
        Sk_mem = Sk_b
    align = (Sk_b - Sq_b) * bottom_right
    return q_start, k_start, Sq_b, Sk_b, Sq_mem, Sk_mem, align + right, align - left


@triton.jit
def visible(q_idx, k_idx, Sq_b, Sk_b, causal_shift, window_shift, key_ok,
            CAUSAL: tl.constexpr, WINDOW: tl.constexpr, KEY_MASK: tl.constexpr):
    """Boolean tile: may query row q_idx attend to key k_idx (broadcast 2-D indices).

    key_ok: the key mask broadcast like k_idx (read only when KEY_MASK).
    """
    vis = (q_idx < Sq_b) & (k_idx < Sk_b)
    if CAUSAL:
        vis = vis & (k_idx <= q_idx + causal_shift)
    if WINDOW:
        vis = vis & (k_idx >= q_idx + window_shift)
    if KEY_MASK:
        vis = vis & key_ok
    return vis


@triton.jit
def kv_loop_bounds(m0, Sq_b, Sk_b, causal_shift, window_shift, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   CAUSAL: tl.constexpr, WINDOW: tl.constexpr, KEY_MASK: tl.constexpr):
    """Key range for the q tile starting at row m0, split for masking.

    Returns (lo, full_lo, full_hi, hi), multiples of BLOCK_N except hi: key tiles in
    [full_lo, full_hi) are visible to every valid row of the q tile and lie inside Sk_b, so they
    need no mask; the rest of [lo, hi) needs masking; keys outside [lo, hi) are invisible to the
    whole tile and are skipped (a window's tiles left of `lo`, causal ones right of `hi`).
    full_hi <= full_lo means the unmasked range is empty.
    """
    last = tl.minimum(m0 + BLOCK_M, Sq_b) - 1  # last valid row of the tile
    lo = 0
    full_lo = 0
    hi = Sk_b
    full = Sk_b
    if CAUSAL:
        hi = tl.minimum(Sk_b, tl.maximum(last + 1 + causal_shift, 0))  # the last row sees j <= last + shift
        full = tl.minimum(Sk_b, tl.maximum(m0 + 1 + causal_shift, 0))  # the first row sees j <= m0 + shift
    if WINDOW:
        lo = (tl.maximum(m0 + window_shift, 0) // BLOCK_N) * BLOCK_N  # the first row sees j >= m0 + shift
        full_lo = tl.cdiv(tl.maximum(last + window_shift, 0), BLOCK_N) * BLOCK_N  # the last row: j >= last + shift
    hi = tl.where(last < m0, lo, tl.maximum(hi, lo))  # a tile of padding rows visits nothing
    full_hi = tl.minimum((full // BLOCK_N) * BLOCK_N, hi)
    if KEY_MASK:
        full_hi = full_lo  # every tile needs the key mask
    return lo, full_lo, full_hi, hi


@triton.jit
def q_loop_bounds(n0, Sq_b, Sk_b, causal_shift, window_shift, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  CAUSAL: tl.constexpr, WINDOW: tl.constexpr, KEY_MASK: tl.constexpr):
    """Query range for the K/V tile starting at key n0, split for masking.

    Returns (lo, free_lo, free_hi, hi): q tiles in [lo, hi) see at least one key of the tile; of
    those, [free_lo, free_hi) see all of its keys and lie inside Sq_b (no mask), the rest need
    masking. All bounds are multiples of BLOCK_M; free_hi <= free_lo means the unmasked range is
    empty.
    """
    hi = tl.cdiv(Sq_b, BLOCK_M) * BLOCK_M
    free_hi = (Sq_b // BLOCK_M) * BLOCK_M
    lo = 0
    free_lo = 0
    if CAUSAL:
        first = tl.maximum(n0 - causal_shift, 0)  # first row that sees key n0
        lo = (first // BLOCK_M) * BLOCK_M
        all_vis = tl.maximum(n0 + BLOCK_N - 1 - causal_shift, lo)  # first row that sees the tile's last key
        free_lo = tl.cdiv(all_vis, BLOCK_M) * BLOCK_M
    if WINDOW:
        # row i sees key j >= i + window_shift: the tile's last key is seen by rows <= n0 + BLOCK_N - 1 - shift,
        # its first key by rows <= n0 - shift
        last_any = tl.minimum(Sq_b, tl.maximum(n0 + BLOCK_N - window_shift, 0))
        hi = tl.minimum(hi, tl.cdiv(last_any, BLOCK_M) * BLOCK_M)
        free_hi = tl.minimum(free_hi, (tl.maximum(n0 - window_shift + 1, 0) // BLOCK_M) * BLOCK_M)
    # A partial K/V tile (or a key mask) needs the column mask in every q tile: empty the unmasked range.
    free_hi = tl.where(n0 + BLOCK_N > Sk_b, free_lo, free_hi)
    if KEY_MASK:
        free_hi = free_lo
    hi = tl.where(n0 >= Sk_b, 0, hi)  # a tile of padding keys is seen by nobody
    lo = tl.minimum(lo, hi)
    return lo, free_lo, free_hi, hi


@triton.jit
def loop_part(part: tl.constexpr, lo, mid_lo, mid_hi, hi):
    """Tile range [start, end) of part 0, 1 or 2 of a loop split by kv_loop_bounds/q_loop_bounds:
    masked head [lo, min(mid_lo, hi)), unmasked middle [mid_lo, mid_hi), masked tail
    [max(mid_lo, mid_hi), hi). The caller masks parts 0 and 2 (`part != 1`)."""
    if part == 0:
        return lo, tl.minimum(mid_lo, hi)
    elif part == 1:
        return mid_lo, mid_hi
    else:
        return tl.maximum(mid_lo, mid_hi), hi


# Additive attn_mask values below this are raised to it (-inf stays -inf, NaN NaN), so that bias * log2(e)
# stays finite in fp32: a row of torch.finfo(torch.float32).min (Hugging Face's masks) ties at a
# huge finite score (uniform softmax, as fp32 SDPA) instead of becoming a fully masked row.
BIAS_FLOOR = tl.constexpr(-2.0 ** 125)
BIAS_CEIL = tl.constexpr(2.0 ** 125)  # and values above this lowered to it (+inf stays +inf)

# MASK_KIND: how the kernels read attn_mask (constexprs, so jit code may name them)
MASK_NONE = tl.constexpr(0)
MASK_BOOL = tl.constexpr(1)  # bool / uint8: -inf where 0
MASK_ADDITIVE = tl.constexpr(2)  # floating: added to the scores


@triton.jit
def tanh(x):
    """tanh to a few ulps from exp2/log2 (tl has no tanh that the interpreter also runs).

    tanh(x) = m / (m + 2) with m = expm1(2x), and expm1 by Kahan's trick (u - 1) * y / log(u),
    u = exp(y): accurate near 0, where 1 - 2 / (exp(2x) + 1) would lose all relative precision
    (that cost fp32 softcap 30x the eager error). |x| is clamped at 20, where tanh is 1 to
    float64 precision, so nothing overflows. NaN stays NaN (torch.tanh's): tl.minimum/maximum would drop it,
    turning a NaN score into -softcap and hiding a NaN input behind a finite output.
    """
    y = 2.0 * tl.clamp(x, -20.0, 20.0, propagate_nan=tl.PropagateNan.ALL)
    u = tl.exp2(y * 1.4426950408889634)  # exp(y)
    log_u = tl.where(u == 1.0, 1.0, tl.log2(u) * 0.6931471805599453)  # log(u); 1 where unused (no 0 / 0)
    m = tl.where(u == 1.0, y, (u - 1.0) * y / log_u)  # expm1(y)
    return m / (m + 2.0)


@triton.jit
def score_mods(s, q_idx, k_idx, in_bounds, mb_base, stride_mm, stride_mn, softcap2, slope2, alibi_shift, log2e,
               MASK_KIND: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr):
    """Apply softcap, ALiBi and attn_mask to a tile of scores s (log2 units, broadcast 2-D indices).

    softcap2 = softcap * log2(e) and slope2 = slope * log2(e) are in log2 units too; mb_base points
    at this (batch, head)'s attn_mask, read where in_bounds. Returns (s, t): t = tanh(s / softcap),
    whose 1 - t**2 the backward needs (t = s when not SOFTCAP; unused then).
    """
    t = s
    if SOFTCAP:
        t = tanh(s / softcap2)
        s = softcap2 * t
    if ALIBI:
        s = s - slope2 * tl.abs(q_idx + alibi_shift - k_idx).to(s.dtype)
    if MASK_KIND == MASK_BOOL:
        keep = tl.load(mb_base + q_idx * stride_mm + k_idx * stride_mn, mask=in_bounds, other=0)
        s = tl.where(keep != 0, s, float("-inf"))
    elif MASK_KIND == MASK_ADDITIVE:
        bias = tl.load(mb_base + q_idx * stride_mm + k_idx * stride_mn, mask=in_bounds, other=0.0).to(s.dtype)
        # clamped to +-2**125 (infinities kept, NaN propagated, as SDPA's) so bias * log2(e) cannot overflow:
        # finfo.min rows tie instead of becoming -inf, and a huge finite bias wins its row instead of giving NaN
        fin = tl.clamp(bias, BIAS_FLOOR, BIAS_CEIL, propagate_nan=tl.PropagateNan.ALL) * log2e
        s = s + tl.where((bias == float("-inf")) | (bias == float("inf")), bias, fin)
    return s, t


@triton.jit
def dropout_keep(seed, bh, q_idx, k_idx, Sk_b, p_drop, DROPOUT: tl.constexpr):
    """Boolean tile: is P[b, h, q_idx, k_idx] kept (broadcast 2-D sequence-local indices; bh = b * Hq + h).
    Philox keyed by seed at counter (low word of q_idx * Sk_b + k_idx, bh, its high word, 0): unique per
    entry, and independent of the call's padded bounds (varlen max_seqlen). DROPOUT == DROPOUT_WIDE when
    the host saw Sq * Sk > 2**32 (the high word can be nonzero: int64 indices, more registers); otherwise
    the high word is 0 and the index fits one uint32 word: both variants draw the same numbers."""
    if DROPOUT == 2:  # DROPOUT_WIDE
        idx = q_idx.to(tl.int64) * Sk_b + k_idx
        c0 = (idx & 0xFFFFFFFF).to(tl.uint32)
        c2 = (idx >> 32).to(tl.uint32)
    else:
        c0 = q_idx.to(tl.uint32) * Sk_b.to(tl.uint32) + k_idx.to(tl.uint32)
        c2 = c0 * 0
    zero = c0 * 0
    r0, r1, r2, r3 = tl.philox(seed, c0, zero + bh.to(tl.uint32), c2, zero)
    u = (r0 >> 8).to(tl.float32) * 5.960464477539063e-08  # top 24 bits / 2**24: uniform in [0, 1)
    return u >= p_drop


@triton.jit
def alibi_slope2(al_row, h, log2e, ALIBI: tl.constexpr, ACC: tl.constexpr):
    """q head h's ALiBi slope in log2 units (slope * log2e; al_row = AL + b * stride_alb: batch b's slopes),
    0 without ALiBi."""
    slope2 = log2e * 0.0
    if ALIBI:
        slope2 = tl.load(al_row + h).to(ACC) * log2e
    return slope2


@triton.jit
def modifier_scalars(b, h, AL, stride_alb, RNG, softcap_hi, softcap_lo, log2e_hi, log2e_lo,
                     ALIBI: tl.constexpr, DROPOUT: tl.constexpr, ACC: tl.constexpr):
    """(softcap2, log2e, slope2, seed) of a (batch, q head) program; unused ones are 0."""
    log2e = scalar_in(log2e_hi, log2e_lo, ACC)
    softcap2 = scalar_in(softcap_hi, softcap_lo, ACC)
    slope2 = alibi_slope2(AL + b.to(tl.int64) * stride_alb, h, log2e, ALIBI, ACC)
    seed = b.to(tl.int64) * 0
    if DROPOUT:
        seed = tl.load(RNG)
    return softcap2, log2e, slope2, seed


@triton.jit
def program_hb(BATCH_Y: tl.constexpr):
    """This program's (head, batch) grid indices (or groups of them): grid (tiles, heads, batch), or
    (tiles, batch, heads) under BATCH_Y (batch_y: an attn_mask shared by the batch is read by adjacent programs)."""
    if BATCH_Y:
        h = tl.program_id(2)
        b = tl.program_id(1)
    else:
        h = tl.program_id(1)
        b = tl.program_id(2)
    return h, b


# ------------------------------------------------------------------------------------------------
# Host side: the mask/length arguments every attention kernel takes.
# ------------------------------------------------------------------------------------------------
import torch  # noqa: E402

from .mask_spec import NO_MASKS, MaskSpec  # noqa: E402,F401  (re-exported for the launchers)


_STRIDE_NAMES = {p: tuple(f"stride_{p}{ax}" for ax in ("b", "h", "m" if p in ("q", "o", "do", "dq") else "n", "d"))
                 for p in ("q", "k", "v", "o", "do", "dq", "dk", "dv")}


def stride_args(prefix: str, t: torch.Tensor, spec: MaskSpec = NO_MASKS) -> dict:
    """Kernel stride arguments stride_{prefix}{b,h,m|n,d} of a (B, H, S, D) view (batch stride 0 for
    varlen's packed views). Query-side tensors (q, o, do, dq) name their sequence axis m, key-side n."""
    nb, nh, ns, nd = _STRIDE_NAMES[prefix]
    sb, sh, ss, sd = t.stride()
    return {nb: 0 if spec.cu_seqlens_q is not None else sb, nh: sh, ns: ss, nd: sd}


# The kernel arguments of MaskSpec.launch_key()'s tensors, in its order (launch.LaunchCache roles)
MASK_ROLES = ("KM", "QM", "Q_LENS", "KV_LENS", "CU_Q", "CU_K", "MB", "AL", "RNG")


def as_u8(m: torch.Tensor) -> torch.Tensor:
    """A bool mask as uint8 (Triton loads it as bytes; nonzero = True): a view in eager calls. While torch.compile
    or export traces it (a FakeTensor or FunctionalTensor, or Dynamo), a conversion instead: Inductor of torch 2.11
    cannot lower a bool tensor's view(dtype) (a LoweringException in torch.iinfo, seen on an H100 on 2026-12-06; the
    CPU suite keeps the ops opaque, so only the GPU path traces this)."""
    if m.dtype != torch.bool:
        return m
    if type(m) is torch.Tensor and not torch.compiler.is_compiling():
        return m.view(torch.uint8)
    # converted once per distinct entry: broadcast (stride-0) dims stay broadcast (a transformers (B, 1, Sq, Sk)
    # padding mask expanded over heads and queries is not copied out); callers read the strides of what this returns
    one = tuple(slice(0, 1) if n > 1 and st == 0 else slice(None) for n, st in zip(m.shape, m.stride()))
    return m[one].to(torch.uint8).expand(m.shape)


_STATIC: dict = {}  # what decides the constexprs and scalars of mask_args -> those arguments


def _static_args(spec: MaskSpec, causal: bool, bottom_right: bool) -> dict:
    """mask_args' constexprs and scalars, built once per combination of what decides them."""
    from .launch import LOG2E, split_f32

    m = spec.attn_mask
    kind = MASK_NONE.value if m is None else MASK_BOOL.value if m.dtype == torch.bool else MASK_ADDITIVE.value
    key = (tuple(spec.window), bool(causal), bool(bottom_right), spec.q_lens is not None or spec.kv_lens is not None,
           spec.cu_seqlens_q is not None, spec.key_mask is not None, spec.query_mask is not None, kind,
           float(spec.softcap), spec.alibi_slopes is not None, float(spec.dropout_p))
    args = _STATIC.get(key)
    if args is None:
        left, right = (int(x) for x in spec.window)
        has_right = bool(causal) or right >= 0
        cap_hi, cap_lo = split_f32(float(spec.softcap) * LOG2E)
        l2_hi, l2_lo = split_f32(LOG2E)
        p = float(spec.dropout_p)
        ds_hi, ds_lo = split_f32(1.0 / (1.0 - p))
        args = _STATIC[key] = dict(
            bottom_right=int(bool(bottom_right)), right=(0 if causal else right) if has_right else 0,
            left=max(left, 0), CAUSAL=has_right, WINDOW=left >= 0, LENS=key[3], VARLEN=key[4], KEY_MASK=key[5],
            QUERY_MASK=key[6], MASK_KIND=kind, EVERY_TILE=key[5] or m is not None,
            softcap_hi=cap_hi, softcap_lo=cap_lo, SOFTCAP=bool(spec.softcap), log2e_hi=l2_hi, log2e_lo=l2_lo,
            ALIBI=key[9], dropout_p=p, drop_scale_hi=ds_hi, drop_scale_lo=ds_lo, DROPOUT=int(p > 0.0))
    return args


DROPOUT_WIDE = 2  # the DROPOUT constexpr of calls with Sq * Sk > WIDE_COUNTER_PAST (dropout_keep); 1 otherwise
WIDE_COUNTER_PAST = 2**32  # i * Sk_b + j fits one uint32 counter word up to here


# The sequence length (Sq = Sk) and window the compile check's attention plans are built at. Triton specialises
# an int argument on its divisibility by 16, so a length like 113 (and a bias or key mask whose row stride it is)
# compiles another variant of each kernel than 128 does, with its own shared memory and registers:
# `compile_check --seqlen 113` checks that variant (compile_check.launch_plans(target, seqlen) sets this). The
# window's left size is half the length.
PLAN_SEQLEN = 128


def wide_dropout_plans(plans: list, tags=("D=64 float16", "D=128 float16")) -> list:
    """The compile check's DROPOUT_WIDE variants of (label, Launch) plans with dropout whose label holds one of
    `tags`, labelled "... dropout-wide" (a spec the untimed no-spill rule does not cover: these launches are
    for sequences past 65536 x 65536, where the extra counter word is worth its registers)."""
    import dataclasses

    return [(" ".join(label.split()[:3]) + " dropout-wide", dataclasses.replace(launch, args={**launch.args,
                                                                                       "DROPOUT": DROPOUT_WIDE}))
            for label, launch in plans if launch.args.get("DROPOUT") and any(t in label for t in tags)]


def mask_args(spec: MaskSpec, causal: bool, bottom_right: bool, q, k, lse) -> tuple[dict, int, int, int]:
    """Kernel arguments for `spec`, and the (batch, Sq, Sk) the grids span.

    q, k: the (B, H, S, D) views the kernels read (varlen: (1, H, total, D)); lse: a (B, H, Sq)
    per-row buffer such as m2 (varlen: (1, H, total)), whose strides every per-row buffer shares.
    Absent tensors are replaced by `lse` (never read). The constexprs and scalars come from a
    cache (_static_args); only tensors, strides and sizes are gathered per call.
    """
    args = dict(_static_args(spec, causal, bottom_right))
    dummy = lse
    B, Sq, Sk = q.shape[0], q.shape[2], k.shape[2]
    args["stride_lb"], args["stride_lh"] = lse.stride(0), lse.stride(1)
    if args["LENS"]:
        ql = spec.q_lens if spec.q_lens is not None else torch.full((B,), Sq, dtype=torch.int32, device=q.device)
        kl = spec.kv_lens if spec.kv_lens is not None else torch.full((B,), Sk, dtype=torch.int32, device=q.device)
        args["Q_LENS"], args["KV_LENS"] = ql, kl
    else:
        args["Q_LENS"] = args["KV_LENS"] = dummy
    if spec.cu_seqlens_q is not None:
        B = spec.cu_seqlens_q.shape[0] - 1
        args["CU_Q"], args["CU_K"], args["stride_lb"] = spec.cu_seqlens_q, spec.cu_seqlens_k, 0
        Sq, Sk = spec.max_seqlen_q, spec.max_seqlen_k  # ints (symbolic under torch.compile: never int()ed here, which
        # would specialise a compiled graph on a packed batch's longest sequence: a recompile per batch)
    else:
        args["CU_Q"] = args["CU_K"] = dummy
    if args["DROPOUT"] and Sq * Sk > WIDE_COUNTER_PAST:  # a sequence's i * Sk_b + j may need two counter words
        args["DROPOUT"] = DROPOUT_WIDE
    for name, sb, sn, t in (("KM", "stride_kmb", "stride_kmn", spec.key_mask),
                            ("QM", "stride_qmb", "stride_qmn", spec.query_mask)):
        if t is not None:
            t = as_u8(t)
            args[name], args[sb], args[sn] = t, t.stride(0), t.stride(1)
        else:
            args[name], args[sb], args[sn] = dummy, 0, 0
    m = spec.attn_mask
    if m is not None:
        args["MB"] = m = as_u8(m)  # (its strides: while tracing, a bool mask's bytes are a new tensor)
        args["stride_mb"], args["stride_mh"], args["stride_mm"], args["stride_mn"] = broadcast_strides(m)
    else:
        args["MB"], args["stride_mb"], args["stride_mh"], args["stride_mm"], args["stride_mn"] = dummy, 0, 0, 0, 0
    al = spec.alibi_slopes
    args["AL"] = al if al is not None else dummy
    args["stride_alb"] = 0 if al is None or al.shape[0] == 1 else al.stride(0)
    args["RNG"] = spec.rng if args["DROPOUT"] else dummy
    return args, B, Sq, Sk


def mask_elt(margs: dict, Sq, Sk, dtype) -> int:
    """What configs.estimate_shared_memory counts a (block_m, block_n) element for the attn_mask tile of mask_args'
    launch (Sq, Sk: what it returned; dtype: q's): 0 without a mask, or for a mask in q's dtype whose lengths and
    batch, head and row strides are multiples of 16 (0 broadcasts) with a contiguous last dim (the variant the compile
    check builds at 128 tokens, which stages none); else 2 * its element size + 2 (bool: 1), the most the compile
    check measured (2026-12-07, Triton 3.9: a bool, fp32 or fp64 mask with fp16 q stages 2, 6 and 14 bytes an element
    in sm_80/86's forward at head dim 64; an fp16 mask at 113 tokens up to 2)."""
    if margs["MASK_KIND"] == MASK_NONE.value:
        return 0
    m = margs["MB"]
    ints = (Sq, Sk, margs["stride_mb"], margs["stride_mh"], margs["stride_mm"])
    if m.dtype == dtype and margs["stride_mn"] == 1 and all(type(n) is int and n % 16 == 0 for n in ints):
        return 0
    return 2 * m.element_size() + 2


def batch_y(margs: dict, B) -> bool:
    """Whether a launch's grid is (tiles, batch, heads) rather than (tiles, heads, batch) (program_hb): when an
    attn_mask broadcasts over a batch of two or more. A GPU starts programs in grid order, x fastest; in the
    (tiles, heads, batch) order the programs reading one mask tile for different batches are tiles x heads apart,
    more than run at once (a (1, 16, 4k, 4k) T5 bias at batch 4: 512 apart, 1 MiB a q tile, read 4 times from
    DRAM by the forward and again by dK/dV); batch first puts them `tiles` apart, so one DRAM read serves the batch
    from L2. The programs of one (batch, head) stay adjacent either way (their K/V is shared); a GQA group's heads
    move `batch` times further apart. Untimed on a GPU: chosen from byte counts."""
    return margs["MASK_KIND"] != MASK_NONE.value and margs["stride_mb"] == 0 and not margs["VARLEN"] and B > 1


def broadcast_strides(t: torch.Tensor) -> tuple:
    """t's strides with 0 on its size-1 dims, so a (1, H, Sq, Sk) mask reads like (B, H, Sq, Sk)."""
    return tuple(0 if n == 1 else st for n, st in zip(t.shape, t.stride()))


def batch_stride(t: torch.Tensor, spec: MaskSpec) -> int:
    """Varlen views share every sequence's storage: batch stride 0 (else the view's own)."""
    return 0 if spec.varlen else t.stride(0)
