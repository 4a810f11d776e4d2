"""An encoder-decoder translator ("Attention Is All You Need") built from flashtx.nn, trained on
examples/data/tiny_parallel.tsv (42 short English -> Spanish sentence pairs, word-level).

    python examples/translate.py                                  # 300 steps (GPU when available)
    python examples/translate.py --steps 200 --min-accuracy 0.8   # a short run (CI)

The model: word embeddings plus sinusoidal positional encodings; an encoder of non-causal
TransformerBlocks whose self-attention masks the source padding (key_mask, True = real token); a
decoder of causal TransformerBlocks with cross-attention to the encoder output (cross=True,
memory_mask = the source's key mask), its own padding masked too; LayerNorm, SwiGLU MLPs. Batches
mix sentences of different lengths, so both sides are padded (on the right).

Greedy decoding starts from <sos> and stops when every sentence has produced <eos> (or after
--max-len tokens). It uses the flashtx.nn KV cache: one BlockCache per decoder block, whose
self-attention cache grows by one token a step (bottom-right causal) and whose cross-attention
cache projects the encoder output once, with its padding mask, and reuses it. Every decoding step
runs on flashtx.flash_attn_with_kvcache, flash-attn's decode API: the self-attention appends the
new token's key/value in place and attends over the cache; the cross-attention attends, without
an append, over each sentence's real encoder states (the source is right-padded: cache_seqlens
is each source's length). Training and the encoder use the training kernels (flashtx.attention).

At the end it checks, and exits non-zero if any check fails:
  * exact-match accuracy of greedy translations of all training pairs >= --min-accuracy;
  * decoding with the KV cache gives the logits of recomputing the whole decoded prefix without it
    (within --atol);
  * padding changes nothing: the teacher-forced logits of the padded batch of all pairs equal
    those of each pair run alone, unpadded (within --atol).
"""
from __future__ import annotations

import argparse
import math
import re
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from flashtx.nn import TransformerBlock

DATA = Path(__file__).resolve().parent / "data" / "tiny_parallel.tsv"
PAD, SOS, EOS = "<pad>", "<sos>", "<eos>"


def tokenize(sentence: str) -> list[str]:
    """Lower-case words and punctuation marks ("¿qué hora es?" -> ¿ qué hora es ?)."""
    return re.findall(r"\w+|[^\w\s]", sentence.lower())


def detokenize(words: list[str]) -> str:
    return re.sub(r"¿ ", "¿", re.sub(r" ([.,?!])", r"\1", " ".join(words)))


class Vocab:
    """Word <-> id; ids 0, 1, 2 are <pad>, <sos>, <eos>."""

    def __init__(self, sentences: list[list[str]]):
        self.itos = [PAD, SOS, EOS] + sorted({w for s in sentences for w in s})
        self.stoi = {w: i for i, w in enumerate(self.itos)}

    def __len__(self):
        return len(self.itos)

    def encode(self, words: list[str]) -> list[int]:
        return [self.stoi[w] for w in words]

    def decode(self, ids) -> list[str]:
        return [self.itos[i] for i in ids]


PAD_ID, SOS_ID, EOS_ID = 0, 1, 2


def load_pairs(path: Path = DATA) -> list[tuple[list[str], list[str]]]:
    pairs = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip() and not line.startswith("#"):
            src, tgt = line.split("\t")
            pairs.append((tokenize(src), tokenize(tgt)))
    return pairs


def pad(seqs: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad id lists -> ids (B, S) int64 and key mask (B, S) bool (True = real token)."""
    S = max(len(s) for s in seqs)
    ids = torch.tensor([s + [PAD_ID] * (S - len(s)) for s in seqs], dtype=torch.long, device=device)
    return ids, ids != PAD_ID


def make_batch(pairs_ids, device):
    """[(src ids, tgt ids)] -> src, src_mask, decoder input (<sos> + tgt), its mask, labels (tgt + <eos>)."""
    src, src_mask = pad([s for s, _ in pairs_ids], device)
    tgt_in, tgt_mask = pad([[SOS_ID] + t for _, t in pairs_ids], device)
    labels, _ = pad([t + [EOS_ID] for _, t in pairs_ids], device)  # PAD where tgt_in is padding
    return src, src_mask, tgt_in, tgt_mask, labels


def sinusoids(max_len: int, dim: int) -> torch.Tensor:
    """The paper's positional encodings: PE[p, 2i] = sin(p / 10000^(2i/dim)), PE[p, 2i+1] = cos(...)."""
    pos = torch.arange(max_len, dtype=torch.float32)[:, None]
    freq = torch.exp(torch.arange(0, dim, 2, dtype=torch.float32) * (-math.log(10000.0) / dim))
    pe = torch.zeros(max_len, dim)
    pe[:, 0::2], pe[:, 1::2] = torch.sin(pos * freq), torch.cos(pos * freq)
    return pe


class Translator(nn.Module):
    """Encoder (non-causal blocks, source key mask) -> decoder (causal blocks + cross-attention) -> logits."""

    def __init__(self, src_vocab: int, tgt_vocab: int, dim: int = 64, layers: int = 2, heads: int = 4,
                 max_len: int = 64, backend: str | None = None):
        super().__init__()
        self.dim = dim
        self.src_emb, self.tgt_emb = nn.Embedding(src_vocab, dim), nn.Embedding(tgt_vocab, dim)
        self.register_buffer("pe", sinusoids(max_len, dim), persistent=False)
        kw = dict(norm="layer", backend=backend)
        self.encoder = nn.ModuleList(TransformerBlock(dim, heads, causal=False, **kw) for _ in range(layers))
        self.decoder = nn.ModuleList(TransformerBlock(dim, heads, causal=True, cross=True, **kw)
                                     for _ in range(layers))
        self.enc_norm, self.dec_norm = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.head = nn.Linear(dim, tgt_vocab)

    def embed(self, emb: nn.Embedding, ids, start: int = 0):
        """ids (B, S) -> (B, S, dim): scaled embeddings + the encodings of positions start .. start + S - 1."""
        return emb(ids) * math.sqrt(self.dim) + self.pe[start:start + ids.shape[1]]

    def encode(self, src, src_mask):
        """src (B, Ss), src_mask (B, Ss) bool -> memory (B, Ss, dim)."""
        x = self.embed(self.src_emb, src)
        for block in self.encoder:
            x = block(x, key_mask=src_mask)
        return self.enc_norm(x)

    def decode(self, tgt, memory, src_mask, tgt_mask=None, caches=None, start: int = 0):
        """tgt (B, St) -> logits (B, St, vocab). With caches (one BlockCache per decoder block) tgt holds
        only the new tokens, at positions start ...; memory and src_mask are read on the first call."""
        x = self.embed(self.tgt_emb, tgt, start)
        for i, block in enumerate(self.decoder):
            x = block(x, memory, key_mask=tgt_mask, memory_mask=src_mask,
                      cache=caches[i] if caches is not None else None)
        return self.head(self.dec_norm(x))

    def forward(self, src, src_mask, tgt_in, tgt_mask):
        return self.decode(tgt_in, self.encode(src, src_mask), src_mask, tgt_mask)


@torch.no_grad()
def greedy(model: Translator, src, src_mask, max_len: int):
    """Greedy decoding with the KV cache, from <sos> until every row has produced <eos> (or max_len
    tokens). Returns the tokens (B, T) (without <sos>; rows continue past their <eos>), the logits
    of each step (B, T, vocab), and the encoder output."""
    model.eval()
    B = src.shape[0]
    memory = model.encode(src, src_mask)
    caches = [b.new_cache(B, max_len=max_len, memory_len=src.shape[1]) for b in model.decoder]
    tok = torch.full((B, 1), SOS_ID, dtype=torch.long, device=src.device)
    tokens, logits = [], []
    done = torch.zeros(B, dtype=torch.bool, device=src.device)
    for t in range(max_len):
        step = model.decode(tok, memory, src_mask, caches=caches, start=t)  # (B, 1, vocab)
        tok = step.argmax(-1)  # (B, 1)
        tokens.append(tok)
        logits.append(step)
        done |= tok[:, 0] == EOS_ID
        if bool(done.all()):
            break
    return torch.cat(tokens, 1), torch.cat(logits, 1), memory


def cut_at_eos(ids: list[int]) -> list[int]:
    return ids[:ids.index(EOS_ID)] if EOS_ID in ids else ids


def evaluate(model, batch, tgt_lists, max_len):
    """Greedy-translate the batch; exact-match accuracy against tgt_lists and the predictions."""
    src, src_mask = batch[:2]
    tokens, _, _ = greedy(model, src, src_mask, max_len)
    preds = [cut_at_eos(row) for row in tokens.tolist()]
    return sum(p == t for p, t in zip(preds, tgt_lists)) / len(tgt_lists), preds


@torch.no_grad()
def cache_check(model, src, src_mask, max_len) -> float:
    """Largest |logit difference| between cached greedy decoding and recomputing the decoded prefix."""
    tokens, step_logits, memory = greedy(model, src, src_mask, max_len)
    prefix = torch.cat((torch.full_like(tokens[:, :1], SOS_ID), tokens[:, :-1]), 1)
    full = model.decode(prefix, memory, src_mask)  # no cache: the whole prefix at once
    return (full - step_logits).abs().max().item()


@torch.no_grad()
def padding_check(model, pairs_ids, device) -> float:
    """Largest |logit difference| at real target positions between the padded batch of all pairs
    and each pair alone (no padding)."""
    model.eval()
    src, src_mask, tgt_in, tgt_mask, _ = make_batch(pairs_ids, device)
    batched = model(src, src_mask, tgt_in, tgt_mask)
    worst = 0.0
    for i, pair in enumerate(pairs_ids):
        s, sm, ti, tm, _ = make_batch([pair], device)
        alone = model(s, sm, ti, tm)[0]  # (T_i, vocab)
        worst = max(worst, (batched[i, :alone.shape[0]] - alone).abs().max().item())
    return worst


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300, help="training steps (default 300)")
    ap.add_argument("--batch", type=int, default=16, help="pairs per training batch")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--min-accuracy", type=float, default=0.95,
                    help="required exact-match accuracy on the training pairs (default 0.95)")
    ap.add_argument("--atol", type=float, default=1e-3,
                    help="allowed logit difference for the cache and padding checks")
    ap.add_argument("--eval-every", type=int, default=50, help="print loss and accuracy every N steps")
    ap.add_argument("--max-len", type=int, default=24, help="most tokens to decode")
    ap.add_argument("--samples", type=int, default=5, help="sample translations to print")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--backend", default=None, help="flashtx backend: None (automatic), triton, reference")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads (default 1: the model is tiny, and several threads on a busy machine "
                         "wait on each other far longer than they compute)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.max_len < 1:
        ap.error(f"--max-len must be >= 1; got {args.max_len}")
    if args.device == "cpu":
        torch.set_num_threads(args.threads)

    pairs = load_pairs()
    src_vocab, tgt_vocab = Vocab([s for s, _ in pairs]), Vocab([t for _, t in pairs])
    pairs_ids = [(src_vocab.encode(s), tgt_vocab.encode(t)) for s, t in pairs]
    tgt_lists = [t for _, t in pairs_ids]
    everything = make_batch(pairs_ids, args.device)  # all pairs, padded on both sides

    torch.manual_seed(args.seed)
    model = Translator(len(src_vocab), len(tgt_vocab), max_len=max(64, args.max_len, everything[0].shape[1]),
                       backend=args.backend).to(args.device)  # (positional encodings for every position decoded)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 50))  # short warm-up
    lengths = sorted({len(s) for s, _ in pairs}), sorted({len(t) for _, t in pairs})
    print(f"flashtx translator: {sum(p.numel() for p in model.parameters())} parameters, {len(pairs)} pairs, "
          f"vocab {len(src_vocab)} -> {len(tgt_vocab)} words, source lengths {lengths[0][0]}-{lengths[0][-1]}, "
          f"target lengths {lengths[1][0]}-{lengths[1][-1]}, device {args.device}")

    gen = torch.Generator().manual_seed(args.seed)
    t0, acc = time.time(), 0.0
    for step in range(args.steps):
        model.train()
        pick = torch.randperm(len(pairs_ids), generator=gen)[:args.batch].tolist()
        src, src_mask, tgt_in, tgt_mask, labels = make_batch([pairs_ids[i] for i in pick], args.device)
        logits = model(src, src_mask, tgt_in, tgt_mask)
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=PAD_ID)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if step % args.eval_every == 0 or step == args.steps - 1:
            acc, _ = evaluate(model, everything, tgt_lists, args.max_len)
            print(f"step {step:4d}  loss {loss.item():.4f}  accuracy {acc:.3f}  ({time.time() - t0:.1f} s)")
    train_s = time.time() - t0

    acc, preds = evaluate(model, everything, tgt_lists, args.max_len)
    for i in range(0, len(pairs), max(1, len(pairs) // max(1, args.samples)))[:args.samples]:
        mark = "ok" if preds[i] == tgt_lists[i] else "WRONG, want: " + detokenize(pairs[i][1])
        print(f"  {detokenize(pairs[i][0])}  ->  {detokenize(tgt_vocab.decode(preds[i]))}   [{mark}]")
    cache_diff = cache_check(model, *everything[:2], args.max_len)
    pad_diff = padding_check(model, pairs_ids, args.device)
    checks = {
        f"exact-match accuracy on the training pairs {acc:.3f} (required >= {args.min_accuracy})":
            acc >= args.min_accuracy,
        f"KV-cache decoding vs recomputation: max |logit diff| {cache_diff:.1e} (allowed {args.atol:.0e})":
            cache_diff <= args.atol,
        f"padded batch vs each pair alone: max |logit diff| {pad_diff:.1e} (allowed {args.atol:.0e})":
            pad_diff <= args.atol,
    }
    for line, passed in checks.items():
        print(("  pass  " if passed else "  FAIL  ") + line)
    ok = all(checks.values())
    print(f"check {'passed' if ok else 'FAILED'} (training took {train_s:.1f} s)")
    return {"ok": ok, "accuracy": acc, "cache_diff": cache_diff, "pad_diff": pad_diff, "train_s": train_s}


if __name__ == "__main__":
    sys.exit(0 if main()["ok"] else 1)
