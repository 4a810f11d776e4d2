"""Datasheet peaks of the GPUs the benchmarks report a percentage of peak for, and the formulas.

Peaks are *dense* (no structured sparsity) tensor-core rates for fp16/bf16 inputs with fp32
accumulation, which is what attention kernels use, and the memory bandwidth of the datasheet.
A GPU not in the table gets absolute numbers only (no "% of peak"): a guessed peak is worse
than none. Datasheets are leads, not ceilings: the report also shows measured copy bandwidth.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Peak:
    name: str            # canonical product name
    tflops_16: float     # dense fp16/bf16 tensor TFLOP/s with fp32 accumulate
    gbs: float           # memory bandwidth, GB/s (1e9 bytes/s)
    source: str          # document the numbers were read from


_GA102 = "NVIDIA Ampere GA102 GPU Architecture whitepaper (V2.0), Appendix A, GeForce RTX 3090"
_A100 = "NVIDIA A100 Tensor Core GPU datasheet (312 TFLOP/s dense fp16/bf16; 624 with sparsity)"
_H100 = "NVIDIA H100 Tensor Core GPU datasheet (table lists fp16/bf16 *with sparsity*; dense is half)"
_H200 = "NVIDIA H200 Tensor Core GPU datasheet (table lists fp16/bf16 *with sparsity*; dense is half)"

# (substring of torch.cuda.get_device_name(), lower case) -> peak; the first match wins, so the
# more specific names come first. "RTX 3090 Ti" (80 TFLOP/s, 1008 GB/s) is excluded on purpose.
PEAKS: list[tuple[str, Peak]] = [
    ("rtx 3090", Peak("GeForce RTX 3090", 71.0, 936.0,
                      _GA102 + ": 'Peak FP16 Tensor TFLOPS with FP32 Accumulate 71/142' (dense/sparse), "
                               "BF16 the same, 936 GB/s")),
    ("a100-sxm4-80gb", Peak("A100 80GB SXM", 312.0, 2039.0, _A100 + ", 2,039 GB/s")),
    ("a100 80gb pcie", Peak("A100 80GB PCIe", 312.0, 1935.0, _A100 + ", 1,935 GB/s")),
    ("a100", Peak("A100 40GB", 312.0, 1555.0, _A100 + ", 40GB: 1,555 GB/s")),
    ("h100 nvl", Peak("H100 NVL", 835.5, 3900.0, _H100 + ": 1,671 sparse, 3.9 TB/s")),
    ("h100 pcie", Peak("H100 PCIe", 756.0, 2000.0, _H100 + ": 1,513 sparse, 2 TB/s")),
    ("h100", Peak("H100 SXM", 989.5, 3350.0, _H100 + ": 1,979 sparse, 3.35 TB/s")),
    ("h200 nvl", Peak("H200 NVL", 835.5, 4800.0, _H200 + ": 1,671 sparse, 4.8 TB/s")),
    ("h200", Peak("H200 SXM", 989.5, 4800.0, _H200 + ": 1,979 sparse, 4.8 TB/s")),
]


def lookup(device_name: str) -> Peak | None:
    """The peak for a torch device name, or None for a GPU not in the table."""
    n = device_name.lower()
    if "3090 ti" in n:
        return None
    for key, peak in PEAKS:
        if key in n:
            return peak
    return None


# ----------------------------------------------------------------------------- FLOP and byte counts
def visible_pairs(sq: int, sk: int, causal: bool, *, bottom_right: bool = False, window: int | None = None) -> float:
    """(query, key) pairs attention computes, per batch and head. Without causal or window: Sq*Sk. Causal: query i
    sees keys j <= i + o, o = 0 top-left (flashtx.attention, SDPA's is_causal) or Sk - Sq bottom-right (flash-attn);
    `window` (flash-attn's window_size=(window, 0) with causal) also hides j < i + o - window. Counted exactly, query
    by query, except that a pair on the causal diagonal (j == i + o) counts as half: the triangle's area,
    FlashAttention's convention, so Sq == Sk gives N**2/2 (not N*(N+1)/2) as it always has."""
    if not causal and window is None:
        return float(sq) * sk
    o = (sk - sq) if bottom_right else 0
    w = sk + sq if window is None else window  # no window: a bound no row reaches

    def count(i: int) -> int:  # keys query i sees: max(0, i + o - w) .. min(sk - 1, i + o)
        return max(0, min(sk - 1, i + o) - max(0, i + o - w) + 1)

    # count(i) is linear between these rows (where a bound starts to clamp, or the row starts/stops seeing keys)
    edges = sorted({0, sq, *(x for x in (-o, sk - o, w - o + 1, sk + w - o) if 0 < x < sq)})
    total = sum((b - a) * (count(a) + count(b - 1)) / 2 for a, b in zip(edges, edges[1:]))
    diagonal_rows = max(0, min(sq, sk - o) - max(0, -o))  # rows whose key i + o exists
    return total - diagonal_rows / 2


def attention_flops(batch: int, heads: int, sq: int, sk: int, d: int, causal: bool, pass_: str, *,
                    dv: int | None = None, bottom_right: bool = False, window: int | None = None) -> float:
    """FlashAttention's convention: forward 2*P*(D + Dv) per batch and head (S = QK^T and O = PV) over the P
    visible (query, key) pairs of visible_pairs (Sq*Sk, or Sq*Sk/2 causal when Sq == Sk); backward recomputes S
    and does dV, dP, dQ, dK: 2*P*(3*D + 2*Dv), 2.5x the forward when Dv == D; fwd+bwd the sum (3.5x).
    H counts query heads."""
    dv = d if dv is None else dv
    pairs = float(batch) * heads * visible_pairs(sq, sk, causal, bottom_right=bottom_right, window=window)
    fwd, bwd = 2.0 * pairs * (d + dv), 2.0 * pairs * (3 * d + 2 * dv)
    return {"fwd": fwd, "bwd": bwd, "fwd+bwd": fwd + bwd}[pass_]


def rope_bytes(q_numel: int, k_numel: int, elem: int, pass_: str) -> float:
    """Fewest bytes: read q and k, write both (backward: read dq', dk', write dq, dk). The cos/sin
    tables (a few MB at most) are not counted."""
    one = 2.0 * (q_numel + k_numel) * elem
    return one * {"fwd": 1, "bwd": 1, "fwd+bwd": 2}[pass_]


def swiglu_bytes(numel: int, elem: int, pass_: str) -> float:
    """Fewest bytes for silu(gate) * up with gate, up, out of `numel` elements each: forward reads
    2 and writes 1; backward reads dout, gate, up and writes dgate, dup (5)."""
    return float(numel * elem * {"fwd": 3, "bwd": 5, "fwd+bwd": 8}[pass_])
