"""Swapping flashtx's fused RoPE and SwiGLU into an eager LLaMA-style decoder block leaves its
outputs and gradients unchanged within the tolerance rule.

The block is written out as transformers' LlamaDecoderLayer computes it: RMSNorm -> q/k/v
projections -> RoPE -> causal GQA attention (torch SDPA, math backend) -> o_proj -> residual ->
RMSNorm -> gated MLP -> residual. Only RoPE and the MLP are swapped; attention stays eager.
"""
import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICE, KERNEL_DTYPES, assert_close_to_reference, dtype_id, poisoned_allocations, randn
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashtx

DIM, N_HEADS, N_KV, HEAD_DIM, HIDDEN = 32, 4, 2, 8, 48


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def hf_apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


class RMSNorm(nn.Module):
    """LlamaRMSNorm: normalise in fp32, scale in the input dtype."""

    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim) + 0.1 * torch.randn(dim))
        self.eps = eps

    def forward(self, x):
        h = x.float() if x.dtype != torch.float64 else x
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class EagerMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_proj = nn.Linear(DIM, HIDDEN, bias=False)
        self.up_proj = nn.Linear(DIM, HIDDEN, bias=False)
        self.down_proj = nn.Linear(HIDDEN, DIM, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    """rope: "eager" (transformers' formula), "pos_emb" (flashtx.apply_rotary_pos_emb) or "module"
    (flashtx.nn.RotaryEmbedding on (B, S, H, D) q/k, in place)."""

    def __init__(self):
        super().__init__()
        self.input_layernorm = RMSNorm(DIM)
        self.q_proj = nn.Linear(DIM, N_HEADS * HEAD_DIM, bias=False)
        self.k_proj = nn.Linear(DIM, N_KV * HEAD_DIM, bias=False)
        self.v_proj = nn.Linear(DIM, N_KV * HEAD_DIM, bias=False)
        self.o_proj = nn.Linear(N_HEADS * HEAD_DIM, DIM, bias=False)
        self.post_attention_layernorm = RMSNorm(DIM)
        self.mlp = EagerMLP()
        self.rope = "eager"
        self.rotary_emb = flashtx.nn.RotaryEmbedding(HEAD_DIM, base=100.0)

    def forward(self, x, cos, sin):
        B, S, _ = x.shape
        h = self.input_layernorm(x)
        q = self.q_proj(h).view(B, S, N_HEADS, HEAD_DIM)
        k = self.k_proj(h).view(B, S, N_KV, HEAD_DIM)
        v = self.v_proj(h).view(B, S, N_KV, HEAD_DIM).transpose(1, 2)
        if self.rope == "module":
            q, k = self.rotary_emb(q, k, inplace=True)  # (B, S, H, D), rotated in place
            q, k = q.transpose(1, 2), k.transpose(1, 2)
        else:
            q, k = q.transpose(1, 2), k.transpose(1, 2)  # (B, H, S, D)
            fn = hf_apply_rotary_pos_emb if self.rope == "eager" else flashtx.apply_rotary_pos_emb
            q, k = fn(q, k, cos, sin)
        with sdpa_kernel(SDPBackend.MATH):
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)  # (B, H, S, D)
        x = x + self.o_proj(a.transpose(1, 2).reshape(B, S, -1))
        return x + self.mlp(self.post_attention_layernorm(x))


def hf_cos_sin(rope, B, S, dtype):
    """(B, S, head_dim) cos/sin as transformers builds them (duplicated halves, activation dtype),
    from flashtx's fp32 tables so that every variant uses the same angles."""
    c, s = rope.cos_sin(S)
    c, s = torch.cat((c, c), -1), torch.cat((s, s), -1)
    return c[None].expand(B, S, -1).to(dtype), s[None].expand(B, S, -1).to(dtype)


def grads_by_name(block):
    """Parameter gradients keyed by transformers' names (the fused MLP's w13 split into gate/up)."""
    out = {n: p.grad for n, p in block.named_parameters() if not n.startswith("mlp.")}
    mlp = block.mlp
    if isinstance(mlp, flashtx.nn.SwiGLU):
        gate, up = mlp.w13.weight.grad.chunk(2)
        out.update({"mlp.gate_proj.weight": gate, "mlp.up_proj.weight": up, "mlp.down_proj.weight": mlp.w2.weight.grad})
    else:
        out.update({f"mlp.{n}": p.grad for n, p in mlp.named_parameters()})
    return out


@pytest.mark.parametrize("rope", ["pos_emb", "module"])
@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=dtype_id)
def test_fused_ops_leave_llama_block_unchanged(dtype, rope):
    torch.manual_seed(0)
    B, S = 2, 9
    eager = Block().to(DEVICE, dtype)
    ref = copy.deepcopy(eager).to(torch.float64)
    fused = copy.deepcopy(eager)
    fused.rope = rope
    fused.mlp = flashtx.nn.SwiGLU(DIM, HIDDEN, inplace_backward=True).to(DEVICE, dtype)
    fused.mlp.load_state_dict(eager.mlp.state_dict())  # gate_proj/up_proj/down_proj -> w13, w2

    x = randn(B, S, DIM, dtype=dtype, requires_grad=True)
    x64, xe = x.detach().double().requires_grad_(True), x.detach().clone().requires_grad_(True)
    with poisoned_allocations():
        out = fused(x, *hf_cos_sin(fused.rotary_emb, B, S, dtype))
    out_ref = ref(x64, *hf_cos_sin(ref.rotary_emb, B, S, torch.float64))
    out_e = eager(xe, *hf_cos_sin(eager.rotary_emb, B, S, dtype))
    assert_close_to_reference("block output", out, out_ref, out_e)

    d = randn(B, S, DIM, dtype=dtype)
    out.backward(d)
    out_ref.backward(d.double())
    out_e.backward(d)
    assert_close_to_reference("dx", x.grad, x64.grad, xe.grad, grad=True)
    g_fused, g_ref, g_eager = grads_by_name(fused), grads_by_name(ref), grads_by_name(eager)
    assert set(g_fused) == set(g_ref)
    for name in g_ref:
        assert_close_to_reference(f"d {name}", g_fused[name], g_ref[name], g_eager[name], grad=True)
