"""flashtx: flash attention, fused RoPE and SwiGLU for PyTorch, written in Triton.

    >>> import flashtx
    >>> out = flashtx.attention(q, k, v, is_causal=True)      # like F.scaled_dot_product_attention
    >>> out = flashtx.flash_attn_func(q, k, v, causal=True)   # like flash_attn.flash_attn_func

Run ``python -m flashtx`` for the environment, the backends and a self-check of every op.
"""
from . import _env  # noqa: F401  (must run before anything imports triton)
from .backends import BACKENDS, BackendNotSupported
from .functional import attention, flash_attn_func, flash_attn_varlen_func, pad_input, unpad_input

__version__ = "0.1.0"

__all__ = ["attention", "flash_attn_func", "flash_attn_varlen_func", "unpad_input", "pad_input", "BACKENDS",
           "BackendNotSupported", "__version__"]

# flash-attn's packed-input forms (a fused QKV or KV projection's output)
from .packed import (flash_attn_kvpacked_func, flash_attn_qkvpacked_func, flash_attn_varlen_kvpacked_func,  # noqa: E402
                     flash_attn_varlen_qkvpacked_func)

__all__ += ["flash_attn_qkvpacked_func", "flash_attn_kvpacked_func", "flash_attn_varlen_qkvpacked_func",
            "flash_attn_varlen_kvpacked_func"]

# Fused RoPE and SwiGLU, and the layers built on them (flashtx.nn)
from . import nn  # noqa: E402
from .rotary import apply_rotary, apply_rotary_emb, apply_rotary_pos_emb, apply_rotary_qk  # noqa: E402
from .swiglu import swiglu, swiglu_packed  # noqa: E402

__all__ += ["apply_rotary", "apply_rotary_emb", "apply_rotary_qk", "apply_rotary_pos_emb", "swiglu", "swiglu_packed",
            "nn"]

# Drop-in paths for existing models: F.scaled_dot_product_attention -> flashtx (flashtx.sdpa_patch)
from . import sdpa_patch  # noqa: E402
from .sdpa_patch import patch_sdpa  # noqa: E402

__all__ += ["sdpa_patch", "patch_sdpa"]

# Decoding against a KV cache (contiguous or paged), flash-attn's API (flashtx.decode)
from .decode import flash_attn_with_kvcache  # noqa: E402

__all__ += ["flash_attn_with_kvcache"]

def autotune(enable: bool = True) -> None:
    """Tune the attention tile configs on this GPU (off by default; same as FLASHTX_AUTOTUNE=1).

    When on, the first launch of each attention kernel per key (GPU, Triton version, kernel,
    dtype size, head dims, score modifiers) times the candidate configs that fit the GPU on
    synthetic inputs of those head dims, keeps the fastest and caches it on disk
    ($FLASHTX_CACHE_DIR/autotune.json, default ~/.cache/flashtx/): later runs pay nothing.
    autotune(False) turns it off again (the shipped per-GPU configs; tuned results stay on disk).

    Example:
        >>> flashtx.autotune()  # then train as usual; `python -m bench.tune` sweeps offline
    """
    from .triton_kernels.autotune import autotune as _autotune

    _autotune(enable)


__all__ += ["autotune"]
