"""SwiGLU: the LLaMA MLP, W2(silu(x W1) * (x W3)), with W1|W3 packed into one linear and the fused activation."""
from __future__ import annotations

import numbers

import torch
from torch import Tensor, nn
from torch.nn.modules.module import _global_forward_hooks

from .._validate import check_flag
from ..swiglu import swiglu, swiglu_packed

# Parameter names of the three projections in each supported checkpoint style.
STYLES = {
    "meta": ("w1", "w3", "w2"),  # Meta's LLaMA reference code (gate, up, down)
    "hf": ("gate_proj", "up_proj", "down_proj"),  # Hugging Face transformers' LlamaMLP
}


def forward_hooked(*modules: nn.Module) -> bool:
    """Whether a forward hook (the modules' own or a global one) sees these modules' outputs: it may keep them,
    so an in-place backward must not overwrite them with gradients (captum-style attributions, statistics)."""
    return bool(_global_forward_hooks) or any(m._forward_hooks for m in modules)


class SwiGLU(nn.Module):
    """LLaMA-style gated MLP: ``w2(silu(w1(x)) * w3(x))``.

    Args:
        dim: model width (input and output features).
        hidden_dim: intermediate width H.
        bias: linear biases (False in LLaMA).
        packed: hold W1 and W3 as one (2H, dim) linear `w13` (rows [W1; W3]), so x is read once
            and the fused activation takes the packed (…, 2H) output; otherwise separate `w1`,
            `w3`. `w2` is the down projection either way.
        inplace_backward: the activation's backward writes its gradient over the projection
            output (on by default, as in Liger-Kernel's MLP: no buffer is allocated for it). It runs
            out of place by itself wherever something else could read that output: a forward hook
            on the projection (or a global one), saved-tensor hooks (non-reentrant activation
            checkpointing, offloading) and torch.compile (a compiled backward may not write its
            saved inputs: Inductor would copy them for it). A second
            backward through the same graph (retain_graph) raises; pass False for that.
        device, dtype: for the parameters.

    Checkpoints: ``load_state_dict`` accepts this module's own keys, Meta's ``w1/w2/w3`` and
    transformers' ``gate_proj/up_proj/down_proj`` (packing or splitting W1|W3 as needed), and
    ``state_dict_as("meta" | "hf")`` exports to those styles.

    Example:
        >>> mlp = flashtx.nn.SwiGLU(4096, 11008).to("cuda", torch.bfloat16)
        >>> mlp.load_state_dict(hf_layer.mlp.state_dict())      # gate_proj/up_proj/down_proj
        >>> y = mlp(x)                                           # x: (B, S, 4096)
    """

    def __init__(self, dim: int, hidden_dim: int, bias: bool = False, packed: bool = True, *,
                 inplace_backward: bool = True, device=None, dtype=None):
        super().__init__()
        for n, v in (("dim", dim), ("hidden_dim", hidden_dim)):
            if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1:
                raise ValueError(f"{n} must be an int >= 1; got {v!r}")
        self.dim, self.hidden_dim, self.packed = int(dim), int(hidden_dim), check_flag("packed", packed)
        self.inplace_backward = check_flag("inplace_backward", inplace_backward)  # ("False" is truthy)
        kw = dict(bias=bias, device=device, dtype=dtype)
        if self.packed:
            self.w13 = nn.Linear(dim, 2 * hidden_dim, **kw)  # rows [W1; W3]
        else:
            self.w1 = nn.Linear(dim, hidden_dim, **kw)
            self.w3 = nn.Linear(dim, hidden_dim, **kw)
        self.w2 = nn.Linear(hidden_dim, dim, **kw)
        self.register_load_state_dict_pre_hook(_convert_on_load)

    def extra_repr(self) -> str:
        return f"packed={self.packed}, inplace_backward={self.inplace_backward}"

    def forward(self, x: Tensor) -> Tensor:
        """x: (..., dim) -> (..., dim)."""
        if self.packed:
            inplace = self.inplace_backward and not forward_hooked(self.w13)
            h = swiglu_packed(self.w13(x), inplace_backward=inplace)  # (..., H)
        else:
            inplace = self.inplace_backward and not forward_hooked(self.w1, self.w3)
            h = swiglu(self.w1(x), self.w3(x), inplace_backward=inplace)
        return self.w2(h)

    def _gate_up(self) -> dict[str, Tensor | None]:
        if self.packed:
            w1, w3 = self.w13.weight.detach().chunk(2, dim=0)
            b1, b3 = self.w13.bias.detach().chunk(2, dim=0) if self.w13.bias is not None else (None, None)
        else:
            w1, w3 = self.w1.weight.detach(), self.w3.weight.detach()
            b1 = self.w1.bias.detach() if self.w1.bias is not None else None
            b3 = self.w3.bias.detach() if self.w3.bias is not None else None
        b2 = self.w2.bias.detach() if self.w2.bias is not None else None
        return {"gate.weight": w1, "gate.bias": b1, "up.weight": w3, "up.bias": b3,
                "down.weight": self.w2.weight.detach(), "down.bias": b2}

    def state_dict_as(self, style: str = "hf", prefix: str = "") -> dict[str, Tensor]:
        """The weights as separate projections: style "meta" (w1, w3, w2) or "hf" (gate_proj,
        up_proj, down_proj). Returns new (contiguous) tensors keyed `prefix + name + ".weight"`."""
        if style not in STYLES:
            raise ValueError(f"style must be one of {sorted(STYLES)}; got {style!r}")
        names = dict(zip(("gate", "up", "down"), STYLES[style]))
        out = {}
        for key, t in self._gate_up().items():
            part, kind = key.split(".")
            if t is not None:
                out[f"{prefix}{names[part]}.{kind}"] = t.clone().contiguous()
        return out


def _convert_on_load(module: SwiGLU, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                     error_msgs):
    """load_state_dict pre-hook: rename meta/hf keys to this module's and pack or split W1|W3."""
    for style in STYLES.values():
        gate, up, down = style
        if gate == "w1":  # Meta's names are this module's own when unpacked
            if not module.packed or f"{prefix}w1.weight" not in state_dict:
                continue
        for kind in ("weight", "bias"):
            k_g, k_u, k_d = (f"{prefix}{n}.{kind}" for n in (gate, up, down))
            if k_d in state_dict and down != "w2":
                state_dict[f"{prefix}w2.{kind}"] = state_dict.pop(k_d)
            if k_g in state_dict and k_u in state_dict:
                g, u = state_dict.pop(k_g), state_dict.pop(k_u)
                if module.packed:
                    state_dict[f"{prefix}w13.{kind}"] = torch.cat((g, u), dim=0)
                else:
                    state_dict[f"{prefix}w1.{kind}"], state_dict[f"{prefix}w3.{kind}"] = g, u
    if not module.packed:
        for kind in ("weight", "bias"):
            k = f"{prefix}w13.{kind}"
            if k in state_dict:
                state_dict[f"{prefix}w1.{kind}"], state_dict[f"{prefix}w3.{kind}"] = state_dict.pop(k).chunk(2, dim=0)
