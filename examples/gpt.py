"""A character-level GPT built from flashtx.nn, trained on examples/data/tiny.txt (Shakespeare's sonnets).

    python examples/gpt.py                 # 300 steps (GPU when available), then generation
    python examples/gpt.py --steps 30      # a short run (CI)

It trains two copies of one model from the same initial weights on the same batches: the flashtx
model (TransformerBlock: fused QKV, RoPE, flash attention, SwiGLU) and an eager twin that computes
the same network with plain PyTorch math (softmax(QK^T)V written out). The loss curves must agree
step for step. Then it generates greedily with a KV cache (a paged one by default: each step is one
flashtx.flash_attn_with_kvcache call per layer, RoPE and the cache append fused) and without it
(recomputing the whole sequence each step): the tokens must be identical. Exits non-zero if either check fails.
"""
from __future__ import annotations

import argparse
import copy
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import flashtx
from flashtx.nn import RotaryEmbedding, TransformerBlock

DATA = Path(__file__).resolve().parent / "data" / "tiny.txt"


class GPT(nn.Module):
    """Token embedding -> n pre-norm causal TransformerBlocks (shared RoPE, GQA) -> RMSNorm -> LM head."""

    def __init__(self, vocab: int, dim: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2,
                 backend: str | None = None):
        super().__init__()
        rope = RotaryEmbedding(dim // heads)
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(TransformerBlock(dim, heads, kv_heads, rotary=rope, causal=True, backend=backend)
                                    for _ in range(layers))
        self.norm = flashtx.nn.RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx, caches=None):
        """idx (B, S) int64 -> logits (B, S, vocab); with caches (one BlockCache per block) only the new tokens."""
        x = self.emb(idx)
        for i, block in enumerate(self.blocks):
            x = block(x, cache=caches[i] if caches is not None else None)
        return self.head(self.norm(x))


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def eager_forward(model: GPT, idx):
    """The same network as GPT.forward, in plain PyTorch math, with the model's own parameters."""
    x = model.emb(idx)
    B, S, _ = x.shape
    for blk in model.blocks:
        a = blk.attn
        Hq, Hkv, D = a.num_heads, a.num_kv_heads, a.head_dim
        h = blk.attn_norm(x)
        q, k, v = (a.qkv(h).view(B, S, Hq + 2 * Hkv, D).split([Hq, Hkv, Hkv], dim=2))
        cos, sin = a.rotary.cos_sin(S)  # (S, D/2) fp32 angles
        cos, sin = (torch.cat((t, t), -1)[None, :, None].to(x.dtype) for t in (cos, sin))  # (1, S, 1, D)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        q, k, v = q.transpose(1, 2), k.repeat_interleave(Hq // Hkv, 2).transpose(1, 2), \
            v.repeat_interleave(Hq // Hkv, 2).transpose(1, 2)  # (B, Hq, S, D)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(D)  # (B, Hq, S, S): the eager way
        causal = torch.ones(S, S, dtype=torch.bool, device=x.device).tril()
        p = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        x = x + a.out_proj((p @ v).transpose(1, 2).reshape(B, S, Hq * D))
        gate, up = blk.mlp.w13(blk.mlp_norm(x)).chunk(2, dim=-1)
        x = x + blk.mlp.w2(F.silu(gate) * up)
    return model.head(model.norm(x))


@torch.no_grad()
def generate(model: GPT, prompt, steps: int, use_cache: bool, paged: bool = True):
    """Greedy continuation of prompt (B, P): with a KV cache (each step feeds one token; paged: a
    PagedKVCache of 16-token pages handed out as sequences grow, else contiguous buffers) or without
    it (each step reruns the whole sequence). Returns (B, P + steps)."""
    model.eval()
    idx = prompt
    if use_cache:
        caches = [b.new_cache(prompt.shape[0], max_len=prompt.shape[1] + steps, paged=paged, page_size=16)
                  for b in model.blocks]
        logits = model(idx, caches)
        for _ in range(steps):
            nxt = logits[:, -1].argmax(-1, keepdim=True)
            idx = torch.cat((idx, nxt), dim=1)
            logits = model(nxt, caches)
    else:
        for _ in range(steps):
            nxt = model(idx)[:, -1].argmax(-1, keepdim=True)
            idx = torch.cat((idx, nxt), dim=1)
    return idx


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300, help="training steps (default 300)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=64, help="training sequence length")
    ap.add_argument("--gen", type=int, default=120, help="characters to generate")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--backend", default=None, help="flashtx backend: None (automatic), triton, reference")
    ap.add_argument("--rtol", type=float, default=2e-3, help="allowed relative loss difference from the twin")
    ap.add_argument("--cache", choices=("paged", "contiguous"), default="paged", help="KV cache for generation")
    args = ap.parse_args(argv)

    text = DATA.read_text()
    chars = sorted(set(text))
    stoi = {c: i for i, c in enumerate(chars)}
    data = torch.tensor([stoi[c] for c in text], dtype=torch.long, device=args.device)
    torch.manual_seed(0)
    model = GPT(len(chars), backend=args.backend).to(args.device)
    twin = copy.deepcopy(model)  # same initial weights, eager math
    opts = [torch.optim.AdamW(m.parameters(), lr=3e-3) for m in (model, twin)]
    print(f"flashtx GPT: {sum(p.numel() for p in model.parameters())} parameters, vocab {len(chars)}, "
          f"{len(text)} characters, device {args.device}")

    losses, twin_losses, worst = [], [], 0.0
    t0 = time.time()
    for step in range(args.steps):
        starts = torch.randint(0, len(data) - args.seq - 1, (args.batch,), device=args.device)
        batch = torch.stack([data[s:s + args.seq + 1] for s in starts])  # (B, S + 1)
        x, y = batch[:, :-1], batch[:, 1:]
        for m, opt, fwd, log in ((model, opts[0], model, losses), (twin, opts[1], lambda i: eager_forward(twin, i),
                                                                    twin_losses)):
            loss = F.cross_entropy(fwd(x).flatten(0, 1), y.flatten())
            opt.zero_grad()
            loss.backward()
            opt.step()
            log.append(loss.item())
        worst = max(worst, abs(losses[-1] - twin_losses[-1]) / twin_losses[-1])
        if step % 50 == 0 or step == args.steps - 1:
            print(f"step {step:4d}  loss {losses[-1]:.4f}  eager twin {twin_losses[-1]:.4f}  "
                  f"({time.time() - t0:.1f} s)")
    print(f"largest relative loss difference from the eager twin: {worst:.2e} (allowed {args.rtol:.0e})")

    prompt = data[None, :16]
    with_cache = generate(model, prompt, args.gen, use_cache=True, paged=args.cache == "paged")
    without = generate(model, prompt, args.gen, use_cache=False)
    sample = "".join(chars[i] for i in with_cache[0].tolist())
    print(f"generated with the {args.cache} KV cache:\n{sample}")
    same = torch.equal(with_cache, without)
    print("generation without the cache gives " + ("the same tokens" if same else "DIFFERENT tokens"))
    ok = worst <= args.rtol and same
    return {"ok": ok, "losses": losses, "twin_losses": twin_losses, "worst": worst, "same_tokens": same,
            "tokens": with_cache[0].tolist()}


if __name__ == "__main__":
    sys.exit(0 if main()["ok"] else 1)
