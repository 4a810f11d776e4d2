"""RotaryEmbedding: fp32 cos/sin tables grown on demand, with linear, dynamic-NTK and Llama 3 scaling."""
from __future__ import annotations

import math
import numbers
import warnings

import torch
from torch import Tensor, nn

from .._library import device_assert
from .._validate import check_flag, check_tensor
from ..rotary import _check_int, apply_rotary, apply_rotary_qk
from ..triton_kernels.limits import MAX_SEQ

SCALING_TYPES = ("linear", "dynamic", "llama3")
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _parse_scaling(scaling, max_seq_len: int, dim: int) -> dict | None:
    """Normalise a transformers-style rope_scaling dict ("type" or "rope_type" names the rule)."""
    if scaling is None:
        return None
    if not isinstance(scaling, dict):
        raise TypeError(f"scaling must be None or a dict like {{'type': 'linear', 'factor': 2.0}}; "
                        f"got {type(scaling).__name__}")
    partial = scaling.get("partial_rotary_factor")
    if partial is not None and (partial != 1.0 or isinstance(partial, bool)):
        # transformers 5's rope_parameters carry it: the rotary dim is int(head_dim * partial_rotary_factor). This
        # module's dim IS the rotary dim (it never sees the head dim at construction), so the fraction cannot be
        # applied here; ignoring it rotated every column of the head
        raise ValueError(f"scaling's partial_rotary_factor is {partial!r}, but RotaryEmbedding's dim is the rotary dim "
                         f"itself (the head dim is unknown here): pass dim=int(head_dim * {partial!r}) and drop "
                         f"partial_rotary_factor from the dict (or set it to 1.0); the columns past dim pass through, "
                         f"as in transformers")
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind is None and "factor" in scaling:  # a factor with no rule: applying none would drop it silently
        raise ValueError(f"scaling has a factor but no 'type' (or 'rope_type') naming its rule, one of {SCALING_TYPES} "
                         f"(or 'default' for none); got {scaling}")
    if kind in (None, "default"):
        return None
    if kind not in SCALING_TYPES:
        raise ValueError(f"scaling type must be one of {SCALING_TYPES} (or 'default'); got {kind!r}")
    out = {"type": kind, "factor": _positive("scaling factor", scaling.get("factor"))}
    if kind == "llama3":
        missing = [k for k in _LLAMA3_KEYS if k not in scaling]
        if missing:
            raise ValueError(f"llama3 scaling needs {_LLAMA3_KEYS}; missing {missing}")
        out.update({k: _positive(f"llama3 scaling's {k}", scaling[k]) for k in _LLAMA3_KEYS})
        if out["high_freq_factor"] <= out["low_freq_factor"]:
            raise ValueError(f"llama3 scaling needs high_freq_factor > low_freq_factor; got {scaling}")
    elif kind == "dynamic":
        # The NTK rule raises the base to dim / (dim - 2): undefined at dim 2, where the one frequency is
        # base ** 0 = 1 whatever the base, so the scaling could only be a silent no-op. transformers fails there
        # too (a ZeroDivisionError when the embedding is built): refuse it at construction, naming the cause.
        if dim <= 2:
            raise ValueError(f"dynamic (NTK) scaling needs dim (the rotary dim) > 2, as it raises the base to "
                             f"dim / (dim - 2); got dim={dim} (use 'linear' scaling, or none, for dim 2)")
        # The original length is max_seq_len (transformers' max_position_embeddings). transformers' dynamic rule
        # ignores an original_max_position_embeddings entry (4.56 accepts the key unused, 5.x warns that it is
        # unrecognized: _compute_dynamic_ntk_parameters and dynamic_rope_update read max_position_embeddings), so
        # the same dict gives the same frequencies here; a differing entry is named in a warning.
        old = scaling.get("original_max_position_embeddings", max_seq_len)
        if old != max_seq_len:
            warnings.warn(f"dynamic scaling ignores original_max_position_embeddings ({old!r}), as transformers "
                          f"does: the original length is max_seq_len ({max_seq_len}); pass max_seq_len={old!r} "
                          f"for that length", stacklevel=3)
        out["original_max_position_embeddings"] = max_seq_len  # (the key flashtx.nn.attention reads)
    return out


def _positive(name: str, v) -> float:
    """A finite number > 0 as a float (a zero or infinite factor divides by zero or gives NaN frequencies)."""
    if isinstance(v, bool) or not isinstance(v, numbers.Real) or not 0 < v < math.inf:
        raise ValueError(f"{name} must be a finite number > 0; got {v!r}")
    return float(v)


def _llama3_inv_freq(inv_freq: Tensor, sc: dict) -> Tensor:
    """Llama 3.1's rule (as transformers' _compute_llama3_parameters): keep high frequencies, divide
    low ones by `factor`, interpolate smoothly in between. inv_freq: (dim/2,) float64."""
    factor, lo, hi, old = sc["factor"], sc["low_freq_factor"], sc["high_freq_factor"], \
        sc["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old / lo, old / hi
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def _stale(cached, key, seq_len: int, device) -> bool:
    """Whether the (key, length, cos, sin, built under inference mode) table cache must be rebuilt: another rule,
    too short, another device, or built under torch.inference_mode and now used outside it (inference tensors
    cannot be saved for backward; a traced step, where the mode cannot be read, rebuilds such tables)."""
    if cached is None or cached[0] != key or cached[1] < seq_len or cached[2].device != device:
        return True
    return cached[4] and (torch.compiler.is_compiling() or not torch.is_inference_mode_enabled())


def _inference() -> bool:
    """Whether tables built now are inference tensors (a traced step builds ordinary ones)."""
    return not torch.compiler.is_compiling() and torch.is_inference_mode_enabled()


class RotaryEmbedding(nn.Module):
    """Rotary position embedding with cached fp32 cos/sin tables, applied by the fused kernel.

    Args:
        dim: rotary dim (even); the tables are (seq_len, dim/2). dim < head dim gives partial
            rotary (the remaining columns pass through).
        base: theta base; inv_freq = base ** (-arange(0, dim, 2) / dim), kept as an fp32 buffer.
            Default: scaling's "rope_theta" when it has one (transformers 5's rope_parameters), else 10000.
        max_seq_len: initial table length (built with the module, on its device, except the meta
            device: then when it is materialised); tables grow on demand beyond it. For dynamic NTK it is
            also the original context length L0 (transformers' max_position_embeddings).
        scaling: None, or a transformers-style rope_scaling dict:
            {"type": "linear", "factor": f}: positions divided by f;
            {"type": "dynamic", "factor": f} (dim > 2): for lengths L > L0 = max_seq_len,
            base *= (f * L / L0 - (f - 1)) ** (dim / (dim - 2)), L the needed length: the last
            position + 1 (with cu_seqlens, of the longest packed sequence, never the max_seqlen
            bound). Recomputed when L grows past the longest seen, kept for shorter L >= L0, reset
            when L drops below L0, as transformers' dynamic_rope_update. An
            "original_max_position_embeddings" entry does not set L0 here, as in transformers
            (4.56 accepts it unused, 5.x warns it is unrecognized): a warning names it when it
            differs from max_seq_len (pass max_seq_len=that length instead);
            {"type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
            "original_max_position_embeddings"}: Llama 3.1's frequency rule.
            ("rope_type" works as the key too; a "rope_theta" entry is the base. A
            "partial_rotary_factor" other than 1 is refused: dim is the rotary dim, so pass
            dim=int(head_dim * partial_rotary_factor) and drop the entry.)
        interleaved: GPT-J pairs (x[2j], x[2j+1]) instead of NeoX/LLaMA halves.

    Angles are fl32(inv_freq) * position computed in float64 and rounded once to fp32.

    Example:
        >>> rope = flashtx.nn.RotaryEmbedding(128, base=500000.0, scaling={"type": "llama3", "factor": 8.0,
        ...     "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
        >>> q, k = rope(q, k, seqlen_offsets=cache_len)     # q, k: (B, S, H, 128)
        >>> cos, sin = rope.cos_sin(4096)                   # (4096, 64) fp32 each
    """

    def __init__(self, dim: int, base: float | None = None, max_seq_len: int = 2048, scaling: dict | None = None,
                 *, interleaved: bool = False, device=None):
        super().__init__()
        if isinstance(dim, bool) or not isinstance(dim, numbers.Integral) or dim < 2 or dim % 2:
            raise ValueError(f"dim (the rotary dim) must be an even int >= 2; got {dim!r}")
        theta = scaling.get("rope_theta") if isinstance(scaling, dict) else None
        base_name = "base"
        if base is None:
            base, base_name = (10000.0, "base") if theta is None else (theta, "scaling's rope_theta")
        elif theta is not None and theta != base:
            raise ValueError(f"base ({base!r}) and scaling's rope_theta ({theta!r}) disagree: pass one of them")
        if isinstance(base, bool) or not isinstance(base, numbers.Real) or not 1 < base < math.inf:
            raise ValueError(f"{base_name} must be a finite number > 1; got {base!r}")
        if isinstance(max_seq_len, bool) or not isinstance(max_seq_len, numbers.Integral) or \
                not 1 <= max_seq_len <= MAX_SEQ:
            raise ValueError(f"max_seq_len must be an int in [1, {MAX_SEQ}] (the longest tables built); "
                             f"got {max_seq_len!r}")
        self.dim, self.base, self.max_seq_len = int(dim), float(base), int(max_seq_len)
        self.scaling = _parse_scaling(scaling, self.max_seq_len, self.dim)
        self.interleaved = check_flag("interleaved", interleaved)  # ("False" is truthy)
        self.register_buffer("inv_freq", self._inv_freq(self.base, device), persistent=False)  # (dim/2,) fp32
        # what the tables use: immune to model.half() casting the buffer; computed on the CPU, not copied from the
        # buffer (a meta-device buffer has no values: `with torch.device("meta")` model construction)
        self._inv_freq32 = self._inv_freq(self.base, "cpu")
        self._cache: tuple | None = None  # (key, length, cos, sin, built under inference mode)
        if self.inv_freq.device.type != "meta":  # the tables now: a compiled first call then reads them (building
            self.cos_sin(self.max_seq_len)  # them in its graph would compile the step again on the next call)

    def _apply(self, fn, recurse=True):
        """Module.to() / cuda() / to_empty(): the tables follow inv_freq's device (staying float32, whatever
        dtype fn casts to); tables without values (the meta device) are built on arrival, and so is inv_freq's
        content (to_empty() leaves it uninitialised; no state_dict holds it)."""
        was_meta = self.inv_freq.device.type == "meta"
        out = super()._apply(fn, recurse)
        cached, dev = self._cache, self.inv_freq.device
        if was_meta and dev.type != "meta":
            self.reset_parameters()
            return out
        if dev.type == "meta":
            self._cache = None
        elif cached is None or cached[2].device.type == "meta":
            self._cache = None
            self.cos_sin(self.max_seq_len)
        elif cached[2].device != dev:
            self._cache = (*cached[:2], cached[2].to(dev), cached[3].to(dev), cached[4])
        return out

    def reset_parameters(self) -> None:
        """Recompute inv_freq in place and rebuild the tables (no learned parameters: a meta-device module's
        initialisation after ``to_empty()``, as FSDP calls it; to_empty() from the meta device already does this)."""
        if self.inv_freq.is_inference() and not torch.is_inference_mode_enabled():  # (made under inference mode)
            self.inv_freq = self._inv_freq32.to(self.inv_freq.device, self.inv_freq.dtype)  # (a buffer: reassigned)
        else:
            with torch.no_grad():
                self.inv_freq.copy_(self._inv_freq32)  # (to the buffer's device and dtype)
        self._cache = None
        if self.inv_freq.device.type != "meta":
            self.cos_sin(self.max_seq_len)

    def _inv_freq(self, base: float, device=None) -> Tensor:
        inv = base ** (-torch.arange(0, self.dim, 2, dtype=torch.float64, device=device) / self.dim)
        if self.scaling is not None and self.scaling["type"] == "llama3":
            inv = _llama3_inv_freq(inv, self.scaling)
        return inv.float()

    def extra_repr(self) -> str:
        return f"dim={self.dim}, base={self.base}, max_seq_len={self.max_seq_len}, scaling={self.scaling}, " \
               f"interleaved={self.interleaved}"

    def cos_sin(self, seq_len: int, device=None) -> tuple[Tensor, Tensor]:
        """(cos, sin), each (seq_len, dim/2) float32, for positions 0 .. seq_len - 1 (cached views), on `device`
        (default: inv_freq's, which follows module.to())."""
        if isinstance(seq_len, bool) or not isinstance(seq_len, (numbers.Integral, torch.SymInt)) \
                or not 0 <= seq_len <= MAX_SEQ:  # (a SymInt: a size that torch.export traces)
            raise ValueError(f"seq_len must be an int in [0, {MAX_SEQ}]; got {seq_len!r}")
        device = torch.device(device) if device is not None else self.inv_freq.device  # follows module.to()
        sc = self.scaling
        cached = self._cache
        # NTK past L0, and at L0 after it (transformers resets only below L0: dynamic_rope_update)
        if sc is not None and sc["type"] == "dynamic" and (seq_len > sc["original_max_position_embeddings"] or (
                seq_len == sc["original_max_position_embeddings"] and cached is not None and cached[0] == ("ntk",))):
            key = ("ntk",)  # frequencies depend on the longest length seen: rebuild when it grows
            if _stale(cached, key, seq_len, device):  # (rebuilt for a device or mode: at the longest seen still)
                length = max(seq_len, cached[1] if cached is not None and cached[0] == key else 0)
                self._cache = (key, length, *self._tables(length, self._ntk_inv_freq(length, device), device),
                               _inference())
        else:
            key = ("plain",)
            if _stale(cached, key, seq_len, device):  # doubled when it grows (amortised), kept for a device or mode
                held = cached[1] if cached is not None and cached[0] == key else 0
                length = max(seq_len, self.max_seq_len, min(2 * held if held < seq_len else held, MAX_SEQ))
                self._cache = (key, length, *self._tables(length, self._inv_freq32, device), _inference())
        cos, sin = self._cache[2:4]
        return cos[:seq_len], sin[:seq_len]

    def _ntk_inv_freq(self, seq_len: int, device) -> Tensor:
        sc = self.scaling
        old = sc["original_max_position_embeddings"]
        base = self.base * ((sc["factor"] * seq_len / old) - (sc["factor"] - 1)) ** (self.dim / (self.dim - 2))
        return self._inv_freq(base, device)

    def _tables(self, length: int, inv_freq: Tensor, device) -> tuple[Tensor, Tensor]:
        t = torch.arange(length, dtype=torch.float64, device=device)  # (L,)
        if self.scaling is not None and self.scaling["type"] == "linear":
            t = t / self.scaling["factor"]
        angles = torch.outer(t, inv_freq.to(device=device, dtype=torch.float64))  # (L, dim/2)
        return angles.cos().float(), angles.sin().float()

    def forward(self, q: Tensor, k: Tensor | None = None, *, seqlen_offsets=0, position_ids=None, cu_seqlens=None,
                max_seqlen=None, layout: str = "bshd", inplace: bool | None = None, backend=None):
        """Rotate q (and k, in the same launch) by their positions; see flashtx.apply_rotary.

        q: (B, S, Hq, D), k: (B, S, Hk, D) (layout="bhsd": (B, H, S, D); packed (total, H, D)
        with cu_seqlens). Returns q_rot, or (q_rot, k_rot). Tables grow to cover the positions;
        with tensor seqlen_offsets or position_ids that reads their max (one device sync), and so
        does cu_seqlens without max_seqlen or with dynamic scaling (whose frequencies follow the
        real lengths; max_seqlen, any bound above them, then only sizes the kernel's grid). Under
        torch.compile those values are not read: the tables cover max_seq_len positions (or what an
        earlier eager call grew them to), and a later position fails a device-side assert.

        inplace: None (default) rotates q and k in place (and returns them) when autograd records
        nothing (inference, no_grad) and their memory allows it, out of place otherwise (always
        under torch.compile); True always in place, False never (see flashtx.apply_rotary).
        backend: None (automatic), "triton" or "reference", as flashtx.apply_rotary's.
        """
        check_tensor("q", q)
        sc = self.scaling
        dynamic = sc is not None and sc["type"] == "dynamic"
        if torch.compiler.is_compiling() and (position_ids is not None or isinstance(seqlen_offsets, Tensor) or (
                cu_seqlens is not None and (max_seqlen is None or dynamic))):
            # the positions' values cannot be read while tracing: the tables as they are (max_seq_len positions at
            # least; a later position is out of range: NaN rows, as apply_rotary's)
            if dynamic:
                raise ValueError("RotaryEmbedding with dynamic NTK scaling follows the positions' values "
                                 "(position_ids, tensor seqlen_offsets or cu_seqlens), which torch.compile cannot "
                                 "read: call it outside the compiled region, or pass int seqlen_offsets")
            cached = self._cache
            needed = max(self.max_seq_len, cached[1] if cached is not None and cached[0] == ("plain",) else 0)
            last = None  # the last position, checked on the device (a NaN row otherwise)
            if position_ids is not None and position_ids.numel():
                last = position_ids.max()
            elif isinstance(seqlen_offsets, Tensor) and seqlen_offsets.numel() and cu_seqlens is None:
                last = seqlen_offsets.max() + (q.shape[1] if layout == "bshd" else q.shape[2]) - 1
            if last is not None:
                device_assert(last < needed, "flashtx.nn.RotaryEmbedding under torch.compile: a position past "
                              "the tables (max_seq_len, or what eager calls grew them to); raise max_seq_len")
        else:
            needed = self._needed_length(q, seqlen_offsets, position_ids, cu_seqlens, max_seqlen, layout, dynamic)
        cos, sin = self.cos_sin(max(needed, 1), q.device)  # (>= 1 row: apply_rotary names a bad argument itself)
        kw = dict(interleaved=self.interleaved, seqlen_offsets=seqlen_offsets, position_ids=position_ids,
                  cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, inplace=inplace, layout=layout, backend=backend)
        if k is None:
            return apply_rotary(q, cos, sin, **kw)
        return apply_rotary_qk(q, k, cos, sin, **kw)

    @staticmethod
    def _needed_length(q, seqlen_offsets, position_ids, cu_seqlens, max_seqlen, layout, exact: bool = False) -> int:
        """The table length the call's positions need (apply_rotary checks the arguments' shapes and values
        further; their types are checked here, where they are first read). exact (dynamic NTK, whose frequencies
        follow this length): with cu_seqlens, the real last position + 1 of the packed sequences, read from
        cu_seqlens (and per-sequence offsets) with one device sync, as transformers reads max(position_ids) + 1;
        max_seqlen is then only the kernel's grid bound. Otherwise max_seqlen (any bound) is used as given."""
        for name, t in (("position_ids", position_ids), ("cu_seqlens", cu_seqlens)):
            if t is not None and not isinstance(t, Tensor):
                raise TypeError(f"{name} must be None or an int tensor; got {type(t).__name__}")
        for name, t in (("position_ids", position_ids), ("cu_seqlens", cu_seqlens), ("seqlen_offsets", seqlen_offsets)):
            if isinstance(t, Tensor) and t.device != q.device:  # (before a value is read from it)
                raise ValueError(f"{name} is on {t.device} but the activations are on {q.device}")
        if position_ids is not None:
            # at least 1 row: negative ids are out of range (NaN rows), not a reason for an empty table
            need, what = (max(int(position_ids.max()) + 1, 1) if position_ids.numel() else 1), "position_ids"
        else:
            offsets = seqlen_offsets
            if cu_seqlens is None:  # (another rank or layout: apply_rotary's error)
                seq = (q.shape[1] if layout == "bshd" else q.shape[2]) if q.dim() == 4 else 0
            elif max_seqlen is not None and not exact:
                # any bound above the longest (no sync); no sequence is longer than the total, as apply_rotary clamps
                seq = min(_check_int("max_seqlen", max_seqlen), q.shape[0] if q.dim() else 0)
            else:
                if max_seqlen is not None:
                    _check_int("max_seqlen", max_seqlen)
                # (nseq,) the real lengths: one sync (a cu_seqlens of another shape is refused by apply_rotary)
                lens = cu_seqlens[1:] - cu_seqlens[:-1] if cu_seqlens.dim() == 1 else cu_seqlens.new_zeros(0)
                if exact and isinstance(offsets, Tensor) and lens.numel() and offsets.shape == lens.shape \
                        and offsets.device == lens.device:
                    # sequence i holds positions off[i] .. off[i] + len[i] - 1 (none when empty)
                    seq, offsets = int(torch.where(lens > 0, lens + offsets, 0).max()), 0
                else:
                    seq = int(lens.max()) if lens.numel() else 0
            if isinstance(offsets, Tensor):
                need = seq + (int(offsets.max()) if offsets.numel() else 0)
            else:
                need = seq + _check_int("seqlen_offsets", offsets)
            need, what = max(need, 0), "the sequence length plus seqlen_offsets"
        if need > MAX_SEQ:
            raise ValueError(f"{what} reach position {need - 1}; RotaryEmbedding builds tables of at most "
                             f"{MAX_SEQ} positions")
        return need
