"""Hugging Face transformers: ``attn_implementation="ftx"``, and fused RoPE/SwiGLU for LLaMA-family models.

    >>> from flashtx.integrations.transformers import register, apply_flashtx
    >>> register()                                    # once; then any model that takes attn_implementation:
    >>> model = AutoModelForCausalLM.from_config(cfg, attn_implementation="ftx")   # "ftx", see NAME
    >>> apply_flashtx(model)                          # Llama/Mistral/Qwen2: also fused RoPE and SwiGLU MLP

How masks reach flashtx (``flashtx_mask``, registered with transformers' AttentionMaskInterface):

- causal attention whose queries are the last positions of the keys (training, prefill, and
  decoding with a DynamicCache): no (Sq, Sk) mask is built. The attention function gets None
  (no padding, Sq == Sk or Sq == 1) or the (B, Sk) bool padding mask, and runs flashtx.attention
  with ``key_mask`` and bottom-right causal alignment (``window_size=(-1, Sk - Sq)``).
- anything else (sliding windows, packed sequences, static caches, custom mask functions,
  bidirectional masks, and callers that edit the mask they get, ``allow_is_causal_skip=False``:
  Falcon with ALiBi, Doge): transformers' own ``sdpa_mask`` builds it, and the 4-D boolean mask (or
  None) is passed to flashtx.attention as ``attn_mask`` with SDPA's semantics. So is a 4-D mask
  a caller passes to the model.

``softcap`` (Gemma 2) is applied in the kernel, as in transformers' eager attention; T5's
``position_bias`` is added to the scores as an additive (learned) mask.
Not supported (clear errors): attention sinks (``s_aux``/``sinks``),
``output_attentions`` (flashtx never forms the attention weights; a warning, and weights None, which
transformers 5 leaves out of the model's ``attentions``: an empty tuple, as with 'sdpa'), and model
families whose modeling code computes attention itself instead of calling transformers'
AttentionInterface (Bloom, MPT: the mask function refuses them; GPT-Neo: transformers itself raises a
KeyError for any registered name).
"""
from __future__ import annotations

import sys
import warnings

import torch
import torch.nn.modules.module as _module_globals

from ..functional import attention, flash_attn_varlen_func
from ..rotary import apply_rotary_pos_emb as _fused_rotary_pos_emb
from .._validate import check_flag
from ..nn.swiglu import forward_hooked
from ..swiglu import swiglu

__all__ = ["NAME", "ROPE_FAMILIES", "register", "apply_flashtx", "restore_rope", "remove_fused_mlp",
           "flashtx_attention_forward", "flashtx_mask", "apply_rotary_pos_emb"]

# The name models use: attn_implementation="ftx". Not "flashtx": transformers treats every name that
# contains "flash" as a flash-attn kernel (it tries to import or download it, and takes
# flash-attn-only code paths), so the registered name must not contain "flash".
NAME = "ftx"
ROPE_FAMILIES = ("llama", "mistral", "qwen2")  # model_type values apply_flashtx knows
_patched_rope: dict = {}  # modeling module -> its original apply_rotary_pos_emb


class _RotaryPosEmb:
    """What apply_flashtx puts in place of a modeling module's ``apply_rotary_pos_emb``: called as
    ``apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1)``.

    flashtx.apply_rotary_pos_emb (same signatures and shapes: transformers 5's ``(q, k, cos, sin,
    unsqueeze_dim=1)`` and 4.x's ``(q, k, cos, sin, position_ids=None, unsqueeze_dim=1)``; q (B, Hq,
    S, D), k (B, Hk, S, D), cos/sin (B, S, rotary_dim)), rotating q and k in place when autograd
    records nothing (generation, no_grad) and nothing else can hold them: the attention layers pass
    fresh projections and rebind the results, so no second copy of q and k is written. Out of place
    (new tensors, the projections' outputs untouched) when autograd records (training), under
    torch.compile, when a forward hook could have kept the projections' outputs (one on the calling
    attention module's q_proj/k_proj, or on a module inside them, or a global one), and when the
    caller is not such an attention module (its ``self`` has no q_proj and k_proj).

    An object, not a function, so that a pickled model loads while the patch is in place: transformers 5 (with the
    kernels package it requires) keeps a private copy of the modeling module's function in each attention layer
    and pickles it as ``type(module.apply_rotary_pos_emb)()`` (a function's type cannot be called so), then hands
    it its state (ignored here) and calls its ``forward``.
    """

    def __call__(self, q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
        inplace = None if _fresh_projections(q, k) else False  # (this frame is _fresh_projections' caller)
        return _fused_rotary_pos_emb(q, k, cos, sin, position_ids, unsqueeze_dim, inplace=inplace)

    forward = __call__  # (the kernels package calls its copies' forward)

    def __setstate__(self, state) -> None:
        pass  # a kernels wrapper's state: nothing this object keeps

    def __reduce__(self):
        return "apply_rotary_pos_emb"  # (by name: copies and pickles are the module's one object)

    def __repr__(self) -> str:
        return "flashtx.integrations.transformers.apply_rotary_pos_emb"


apply_rotary_pos_emb = _RotaryPosEmb()


_PROJECTIONS = ("q_proj", "k_proj", "q_norm", "k_norm")  # whose outputs q and k are (q_norm/k_norm where present)


def _fresh_projections(q, k) -> bool:
    """Whether in-place rotation may be tried: no autograd recording, not compiling, no global forward hook, and
    the caller (the attention forward that called apply_rotary_pos_emb, found as its frame's ``self``) has
    q_proj and k_proj with no forward hook on them or inside them (a hook may keep their outputs: activation
    caching, probing and steering tools). Anything else is refused (out of place): sound without a registry of
    models, since the RoPE patch reaches every model of the family."""
    if torch.compiler.is_compiling() or forward_hooked() or (torch.is_grad_enabled() and (
            getattr(q, "requires_grad", False) or getattr(k, "requires_grad", False))):
        return False  # (compiling or recording: out of place anyway; a global hook sees every output)
    caller = sys._getframe(2).f_locals.get("self")  # 0: here, 1: apply_rotary_pos_emb's __call__, 2: the attention
    # forward
    subs = getattr(caller, "_modules", None)
    if not isinstance(caller, torch.nn.Module) or subs.get("q_proj") is None or subs.get("k_proj") is None:
        return False
    for name in _PROJECTIONS:
        m = subs.get(name)
        if m is not None and (forward_hooked(*m.modules()) if m._modules else m._forward_hooks):
            return False  # its own hooks, or a submodule's (a plain Linear has none: no walk, ~3 us a layer)
    return True


def flashtx_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                              sliding_window=None, softcap=None, is_causal=None, **kwargs):
    """transformers' attention-function signature, computed by flashtx.attention.

    Args:
        module: the calling attention module (read: ``is_causal``).
        query: (B, Hq, Sq, D); key, value: (B, Hkv, Sk, D), Hq a multiple of Hkv (never expanded).
        attention_mask: None, a (B, Sk) bool padding mask from ``flashtx_mask`` (True = real
            token; causal then aligned bottom-right), or a 4-D (B or 1, H or 1, Sq, Sk) bool or
            additive float mask (SDPA semantics).
        dropout: attention-probability dropout (transformers passes 0 in eval mode).
        scaling: softmax scale (default 1/sqrt(D)).
        sliding_window: ignored, as by transformers' sdpa: windowed layers' masks carry the window.
        softcap: Gemma 2's logit softcap (None or 0: off).
        is_causal: overrides ``module.is_causal``.
        position_bias (keyword): T5-family relative position bias (1 or B, Hq, Sq, Sk), added to the
            scores before the mask, as their eager attention does; its gradient flows (a learned bias).
        cu_seq_lens_q, cu_seq_lens_k, max_length_q, max_length_k (keywords): packed sequences in a batch of
            one (DataCollatorWithFlattening(return_flash_attn_kwargs=True)), read as flash_attention_2 reads
            them where no attention_mask came (plain causal models): each sequence attends within itself,
            through flash_attn_varlen_func. A mask that came (sliding-window layers: flashtx_mask gives them
            a 4-D mask) is used as sdpa uses it, and the lengths are not read.

    Returns:
        (out (B, Sq, Hq, D) contiguous, None).
    """
    if kwargs.get("s_aux") is not None or kwargs.get("sinks") is not None:
        raise ValueError("attn_implementation='ftx' does not support attention sinks; use 'eager'")
    if kwargs.get("output_attentions", False):
        warnings.warn("attn_implementation='ftx' never forms the attention weights: they are returned as None (the "
                      "model's `attentions` output holds none of them; use attn_implementation='eager' for them)",
                      stacklevel=2)
    causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
    Sq, Sk = query.shape[2], key.shape[2]
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if attention_mask is None and cu_q is not None and cu_k is not None and kwargs.get("position_bias") is None:
        return _packed_forward(query, key, value, cu_q, cu_k, kwargs, causal, dropout, scaling, sliding_window,
                               softcap), None
    common = {"scale": scaling, "enable_gqa": True}
    if dropout:
        common["dropout_p"] = float(dropout)
    if softcap:  # scores -> softcap * tanh(scores / softcap) before the mask, as transformers' eager
        common["softcap"] = float(softcap)
    bias = kwargs.get("position_bias")  # T5's relative position bias: an additive float attn_mask
    if bias is not None:
        bias = bias[..., :Sk]  # (1 or B, Hq, Sq, Sk), as transformers' sdpa crops it
        if attention_mask is not None and attention_mask.dim() == 4:  # one additive mask, as transformers' sdpa
            mask = attention_mask[..., :Sk]
            attention_mask = (torch.where(mask, bias, torch.finfo(bias.dtype).min) if mask.dtype == torch.bool
                              else bias + mask)
            bias = None
        else:
            common["attn_mask"] = bias
    if attention_mask is None:
        # SDPA's reading of a missing mask: causal for Sq > 1, top-left; an empty static cache's
        # unused tail (Sk > Sq) is cut off, as transformers' sdpa_attention_forward does.
        causal = causal and bool(Sq > 1)  # (a traced size under torch.jit.trace: a Tensor)
        if causal and Sk > Sq:
            key, value = key[:, :, :Sq], value[:, :, :Sq]
            if bias is not None:
                common["attn_mask"] = bias[..., :Sq]
        # (B, Hq, Sq, D); with a bias, causal is top-left too (flashtx.attention's is_causal with attn_mask)
        out = attention(query, key, value, is_causal=causal, **common)
    elif attention_mask.dim() == 2:
        if tuple(attention_mask.shape) != (query.shape[0], Sk):
            raise ValueError(f"a 2-D attention_mask must be (B, Sk) = ({query.shape[0]}, {Sk}); "
                             f"got {tuple(attention_mask.shape)}")
        if causal and Sq > Sk:
            raise ValueError(f"causal attention with more queries ({Sq}) than keys ({Sk}) and a 2-D mask")
        window = (-1, Sk - Sq) if causal else (-1, -1)  # bottom-right causal: query i sees keys j <= i + Sk - Sq
        if attention_mask.dtype != torch.bool:
            attention_mask = attention_mask.to(torch.bool)
        out = attention(query, key, value, key_mask=attention_mask, window_size=window, **common)
    elif attention_mask.dim() == 4:
        out = attention(query, key, value, attn_mask=attention_mask[..., :Sk], **common)
    else:
        raise ValueError(f"attention_mask must be None, (B, Sk) or 4-D; got shape {tuple(attention_mask.shape)}")
    return out.transpose(1, 2).contiguous(), None


def _packed_forward(query, key, value, cu_q, cu_k, kwargs, causal, dropout, scaling, sliding_window, softcap):
    """flashtx_attention_forward's packed sequences: query (1, Hq, total_q, D), key/value (1, Hkv, total_k, D) and
    their cumulative lengths -> (1, total_q, Hq, D), each sequence attending within itself (varlen)."""
    if query.shape[0] != 1:
        raise ValueError(f"cu_seq_lens_q/cu_seq_lens_k describe packed sequences in a batch of one; got query "
                         f"{tuple(query.shape)} (B, H, S, D)")
    def longest(cu, given):  # the keyword, else read from the lengths (one sync)
        return given if given is not None else int((cu[1:] - cu[:-1]).max()) if cu.numel() > 1 else 0

    max_q, max_k = longest(cu_q, kwargs.get("max_length_q")), longest(cu_k, kwargs.get("max_length_k"))
    window = (-1, -1)
    if sliding_window is not None and max_k > sliding_window:  # flash_attention_2's (sliding_window - 1) each way
        window = (sliding_window - 1, sliding_window - 1)
    out = flash_attn_varlen_func(query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1),
                                 cu_q.to(torch.int32), cu_k.to(torch.int32), max_q, max_k,
                                 dropout_p=float(dropout or 0.0), softmax_scale=scaling, causal=causal,
                                 window_size=window, softcap=float(softcap or 0.0))  # (total_q, Hq, D)
    return out[None]


def _mask_geometry(kwargs) -> tuple | None:
    """(batch, q_length, kv_length, q_offset, kv_offset) as ints (SymInts where torch.compile or export traces
    sizes) from either mask signature (transformers >= 5: q_length/q_offset; 4.5x: cache_position), or None when
    they are tensors."""
    batch, kv_length, kv_offset = kwargs.get("batch_size"), kwargs.get("kv_length"), kwargs.get("kv_offset", 0)
    if "cache_position" in kwargs:
        pos = kwargs["cache_position"]
        q_length = pos.shape[0]
        q_offset = int(pos[0]) if q_length else 0  # one sync, once per forward
    else:
        q_length, q_offset = kwargs.get("q_length"), kwargs.get("q_offset", 0)
    vals = (batch, q_length, kv_length, q_offset, kv_offset)
    if any(isinstance(v, torch.Tensor) for v in vals) or any(v is None for v in vals):
        return None  # e.g. a static cache's tensor offset: leave it to sdpa_mask
    return tuple(v if isinstance(v, torch.SymInt) else int(v) for v in vals)  # (int() would pin a traced size)


_masking_utils = None  # transformers.masking_utils, bound by register(): flashtx_mask reads a plain global, as
# Dynamo (torch 2.11) cannot trace `from transformers import ...` (transformers is a _LazyModule: a graph break)


def _import_masking_utils():
    global _masking_utils
    from transformers import masking_utils

    _masking_utils = masking_utils
    return masking_utils


def flashtx_mask(**kwargs):
    """transformers' mask-interface signature: a compact mask when flashtx can take one, else sdpa_mask's.

    Returns None or a (B, kv_length) bool padding mask for plain causal masks whose queries are
    the last positions of the keys (q_offset - kv_offset == kv_length - q_length); otherwise
    whatever ``transformers.masking_utils.sdpa_mask`` returns for the same arguments (a 4-D bool
    (B, 1, Sq, Sk) mask, or None where SDPA's is_causal suffices). ``allow_is_causal_skip=False``
    (models that edit the mask they get: Falcon with ALiBi adds its bias, Doge its dynamic mask)
    always gets sdpa_mask's full 4-D mask.
    """
    mu = _masking_utils or _import_masking_utils()
    config = kwargs.get("config")
    if config is not None and not _calls_attention_interface(getattr(config, "model_type", None)):
        raise ValueError(f"attn_implementation={NAME!r} cannot serve model_type {config.model_type!r}: its modeling "
                         "code computes attention itself rather than through transformers' AttentionInterface, so "
                         "flashtx would only build its masks (wrongly, for that code); use attn_implementation='eager'")
    geometry = _mask_geometry(kwargs)
    padding = kwargs.get("attention_mask")
    simple = (kwargs.get("mask_function", mu.causal_mask_function) is mu.causal_mask_function and geometry is not None
              and kwargs.get("allow_is_causal_skip", True) is not False  # (False: the caller edits a 4-D mask)
              and (padding is None or (isinstance(padding, torch.Tensor) and padding.dim() == 2))
              and not (torch.compiler.is_compiling() and padding is not None))
    if simple:
        batch, q_length, kv_length, q_offset, kv_offset = geometry
        if q_offset - kv_offset == kv_length - q_length and kv_length >= q_length:
            if padding is not None:
                padding = padding.to(torch.bool)
                if padding.shape[-1] < kv_offset + kv_length:  # as transformers' prepare_padding_mask
                    padding = torch.nn.functional.pad(padding, (0, kv_offset + kv_length - padding.shape[-1]))
                padding = padding[:, kv_offset:kv_offset + kv_length]  # (B, kv_length)
                if q_length == kv_length and bool(padding.all()):  # (a host sync, once per prompt)
                    padding = None  # no padding: the kernels without a mask
                # a step over a cache keeps the mask as it is: correct either way, and a sync per generated token
                # would stall the host until the GPU catches up (no launch could be queued ahead of it)
            if padding is None and (q_length == 1 or q_length == kv_length):
                return None  # plain causal, SDPA's reading of None agrees with bottom-right here
            if padding is None:
                padding = torch.ones(batch, kv_length, dtype=torch.bool, device=kwargs.get("device", "cpu"))
            return padding.expand(batch, kv_length)
    return mu.sdpa_mask(**kwargs)


_INTERFACE_FAMILIES: dict = {}  # model_type -> whether its modeling code calls the attention interface


@torch.compiler.assume_constant_result  # torch.compile runs it while tracing and keeps the answer
def _calls_attention_interface(model_type) -> bool:
    """Whether a model family's attention goes through transformers' AttentionInterface (so flashtx's attention
    function runs, not only its mask function). Families such as Bloom and MPT compute attention in their own
    modeling code and would get flashtx's compact masks. Read once per model_type from the modeling module:
    it imports ALL_ATTENTION_FUNCTIONS, or one of its classes declares _supports_attention_backend. A family
    whose module is not transformers' own (remote code) is assumed to (nothing to read)."""
    if model_type not in _INTERFACE_FAMILIES:
        import importlib

        name = str(model_type).replace("-", "_")
        try:
            module = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
        except Exception:  # not a transformers family (or no such module): nothing to read
            module = None
        _INTERFACE_FAMILIES[model_type] = module is None or hasattr(module, "ALL_ATTENTION_FUNCTIONS") or any(
            getattr(c, "_supports_attention_backend", False) is True for c in vars(module).values()
            if isinstance(c, type))
    return _INTERFACE_FAMILIES[model_type]


def register(name: str = NAME) -> None:
    """Register flashtx with transformers' AttentionInterface and AttentionMaskInterface under
    `name` ("ftx"), so ``attn_implementation="ftx"`` works in from_pretrained/from_config and
    ``model.set_attn_implementation("ftx")``. Idempotent. A name containing "flash" is refused:
    transformers would take it for a flash-attn kernel."""
    if not isinstance(name, str) or not name or "flash" in name or name in ("eager", "sdpa"):
        raise ValueError(f"name must be a non-empty string without 'flash' (transformers treats such names as "
                         f"flash-attn kernels) and not 'eager'/'sdpa'; got {name!r}")
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    _import_masking_utils()  # (for flashtx_mask, before anything traces it)
    AttentionInterface.register(name, flashtx_attention_forward)
    AttentionMaskInterface.register(name, flashtx_mask)


class _FusedMLPMixin:
    """forward of a LLaMA-style gated MLP with flashtx's fused SwiGLU; same parameters and names. The
    activation's backward writes its gradients over the projections' outputs (apply_flashtx's
    inplace_backward), as flashtx.nn.SwiGLU and Liger-Kernel's MLP do: out of place wherever a forward
    hook sees those outputs, and under saved-tensor hooks (flashtx.nn.SwiGLU's rule)."""

    _flashtx_inplace_backward = True

    def forward(self, x):
        act = self.act_fn
        if not _is_silu(act) or act._forward_hooks or act._forward_pre_hooks or _global_hooks():  # swapped, or
            return self._flashtx_original_class.forward(self, x)  # a hook would see act_fn: the model's own forward
        inplace = self._flashtx_inplace_backward and not forward_hooked(self.gate_proj, self.up_proj)
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x), inplace_backward=inplace))

    def __reduce_ex__(self, protocol):
        """Pickled as the model's own class (importable; the fused class is made at run time) and fused again
        on load: torch.save(model) works after apply_flashtx."""
        return _unpickle_fused, (self._flashtx_original_class, self.__dict__.copy())


def _unpickle_fused(original_cls, state):
    m = original_cls.__new__(original_cls)
    m.__setstate__(state)
    m.__class__ = _fused_mlp_class(original_cls)
    return m


_fused_classes: dict = {}


def _fused_mlp_class(cls):
    if cls not in _fused_classes:
        _fused_classes[cls] = type(f"Flashtx{cls.__name__}", (_FusedMLPMixin, cls), {"_flashtx_original_class": cls})
    return _fused_classes[cls]


def _is_silu(act) -> bool:
    """Exactly torch's SiLU or transformers' ACT2FN["silu"] (a subclass may override forward: not fused)."""
    t = type(act)
    return t is torch.nn.SiLU or (t.__name__ == "SiLUActivation" and t.__module__ == "transformers.activations")


def _global_hooks() -> bool:
    """Whether a global module forward (pre-)hook would see the act_fn call the fused forward skips."""
    return bool(_module_globals._global_forward_hooks or _module_globals._global_forward_pre_hooks)


def _is_gated_mlp(m) -> bool:
    return all(isinstance(getattr(m, n, None), torch.nn.Linear) for n in ("gate_proj", "up_proj", "down_proj"))


def _is_silu_mlp(m) -> bool:
    return _is_gated_mlp(m) and _is_silu(getattr(m, "act_fn", None))


def apply_flashtx(model, *, attention: bool = True, rope: bool = True, mlp: bool = True,
                  inplace_backward: bool = True):
    """Make a transformers LLaMA-family model (Llama, Mistral, Qwen2) use flashtx's kernels.

    Args:
        model: a transformers PreTrainedModel (e.g. LlamaForCausalLM) whose config.model_type is
            one of ROPE_FAMILIES.
        attention: register flashtx and switch the model to ``attn_implementation="ftx"``.
        rope: replace the family's ``apply_rotary_pos_emb`` with flashtx.apply_rotary_pos_emb (fused,
            fp32 inside; in place when autograd records nothing and no forward hook sees q_proj/k_proj,
            see apply_rotary_pos_emb here). Like Liger-Kernel, this patches the modeling module, so it
            applies to every model of that family in the process; ``restore_rope()`` undoes it.
        mlp: give each gated MLP (gate_proj/up_proj/down_proj with SiLU) a forward that uses
            flashtx.swiglu. Parameters, their names and checkpoints are unchanged.
        inplace_backward: the fused MLPs' activation gradient is written over the projections'
            outputs (no buffer allocated; out of place wherever a forward hook sees those outputs or
            saved-tensor hooks are active, as in flashtx.nn.SwiGLU). False: out of place, e.g. for
            several backwards through one graph (retain_graph).

    Returns:
        the model (modified in place).
    """
    for name, flag in (("attention", attention), ("rope", rope), ("mlp", mlp), ("inplace_backward", inplace_backward)):
        check_flag(name, flag)
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in ROPE_FAMILIES:
        raise ValueError(f"apply_flashtx supports config.model_type in {ROPE_FAMILIES}; got {model_type!r}. "
                         "For other models use attn_implementation='ftx' alone (after register()).")
    # Everything is checked before anything changes: a refused call leaves the model as it was
    to_fuse, fused, modules, gated = [], [], set(), []
    for m in model.modules():
        if isinstance(m, _FusedMLPMixin):
            fused.append(m)
        elif _is_silu_mlp(m):
            to_fuse.append(m)
        elif _is_gated_mlp(m):
            gated.append(type(getattr(m, "act_fn", None)).__name__)
        if rope and hasattr(m, "q_proj") and hasattr(m, "k_proj"):
            modules.add(sys.modules[type(m).__module__])
    if mlp and not to_fuse and not fused:
        found = f"its gated MLPs' act_fn is {', '.join(sorted(set(gated)))}" if gated else \
            "no module has gate_proj/up_proj/down_proj"
        raise ValueError(f"apply_flashtx(mlp=True) found no gated SiLU MLP to fuse ({found}; fused: exactly "
                         "torch.nn.SiLU or transformers' SiLUActivation); pass mlp=False to apply the rest")
    for mod in modules:
        if not hasattr(mod, "apply_rotary_pos_emb"):
            raise ValueError(f"{mod.__name__} has no apply_rotary_pos_emb to replace; pass rope=False to apply the "
                             "rest")
    if attention:
        register()
        if hasattr(model, "set_attn_implementation"):
            model.set_attn_implementation(NAME)
        else:  # older transformers
            model.config._attn_implementation = NAME
    if mlp:
        for m in to_fuse:
            m.__class__ = _fused_mlp_class(type(m))
        for m in to_fuse + fused:
            m._flashtx_inplace_backward = inplace_backward
    for mod in modules:
        if mod not in _patched_rope:
            _patched_rope[mod] = mod.apply_rotary_pos_emb
            mod.apply_rotary_pos_emb = apply_rotary_pos_emb
    return model


def restore_rope() -> None:
    """Undo apply_flashtx's RoPE patch in every modeling module it touched. (A model torch.load-ed while the patch
    was in place keeps flashtx's RoPE, out of place and with the same values, in its layers' private copies that
    transformers' kernels wrappers rebuilt from the patched module.)"""
    for mod, fn in list(_patched_rope.items()):
        mod.apply_rotary_pos_emb = fn
        del _patched_rope[mod]


def remove_fused_mlp(model):
    """Undo apply_flashtx's MLP fusion in `model`: every MLP it gave flashtx's fused SwiGLU forward gets its
    original class (and so its own forward) back, and loses its inplace_backward setting. Parameters are
    untouched (the fusion never changed them); other models and the RoPE patch are not affected (see
    restore_rope()). A model without fused MLPs is returned unchanged.

    Returns:
        the model (modified in place).
    """
    for m in model.modules():
        if isinstance(m, _FusedMLPMixin):
            m.__class__ = m._flashtx_original_class
            m.__dict__.pop("_flashtx_inplace_backward", None)
    return model
