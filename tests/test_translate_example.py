"""examples/translate.py runs end to end in a shortened form: the encoder-decoder learns its training
pairs, KV-cache decoding matches recomputation and padding changes nothing; and each check can fail.

As in tests/test_examples.py the example runs in a subprocess without Triton's interpreter, so every
op takes flashtx's reference backend on CPU (the kernels are tested elsewhere); with a GPU it runs there."""
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "translate.py"


def run(*args):
    env = {k: v for k, v in os.environ.items() if k not in ("FLASHTX_INTERPRET", "TRITON_INTERPRET")}
    return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)


def check_lines(out):
    """{check name: passed} from the example's '  pass  ...' / '  FAIL  ...' lines."""
    lines = [line for line in out.splitlines() if line.startswith(("  pass  ", "  FAIL  "))]
    return {line[8:].split(":")[0].split(" on the")[0]: line.startswith("  pass  ") for line in lines}


def test_translate_example_learns_its_pairs_with_cache_and_padding_consistent():
    res = run(str(EXAMPLE), "--steps", "200", "--min-accuracy", "0.8")
    out = res.stdout
    assert res.returncode == 0, out + res.stderr
    assert "check passed" in out
    assert check_lines(out) == {"exact-match accuracy": True, "KV-cache decoding vs recomputation": True,
                                "padded batch vs each pair alone": True}, out
    acc = float(re.search(r"exact-match accuracy on the training pairs ([0-9.]+)", out).group(1))
    assert acc >= 0.8
    steps = [(int(m.group(1)), float(m.group(2)), float(m.group(3)))
             for m in re.finditer(r"^step +(\d+)  loss ([0-9.]+)  accuracy ([0-9.]+)", out, re.M)]
    assert steps[0][0] == 0 and steps[-1][0] == 199
    assert steps[0][2] == 0.0 and steps[-1][1] < steps[0][1] - 3.0  # from ~ln(vocab) to memorised
    assert "->" in out  # sample translations are printed


def test_translate_example_fails_below_the_required_accuracy():
    """One step cannot translate anything: --min-accuracy 0.99 is not met and the run exits 1 (while the
    cache and padding checks, which hold for any weights, pass)."""
    res = run(str(EXAMPLE), "--steps", "1", "--min-accuracy", "0.99")
    out = res.stdout
    assert res.returncode == 1, out + res.stderr
    assert "check FAILED" in out
    assert check_lines(out) == {"exact-match accuracy": False, "KV-cache decoding vs recomputation": True,
                                "padded batch vs each pair alone": True}, out


def test_translate_example_padding_check_catches_an_unmasked_memory():
    """The padding check can fail: with the decoder's cross-attention ignoring the source padding
    (memory_mask dropped), padded and unpadded logits differ and the run reports it."""
    script = f"""
import sys
sys.path.insert(0, {str(EXAMPLE.parent)!r})
import translate
from flashtx.nn import TransformerBlock
forward = TransformerBlock.forward
def no_memory_mask(self, x, memory=None, *, memory_mask=None, **kw):
    return forward(self, x, memory, memory_mask=None, **kw)
TransformerBlock.forward = no_memory_mask
sys.exit(0 if translate.main(["--steps", "5", "--min-accuracy", "0"])["ok"] else 1)
"""
    res = run("-c", script)
    out = res.stdout
    assert res.returncode == 1, out + res.stderr
    assert check_lines(out) == {"exact-match accuracy": True, "KV-cache decoding vs recomputation": True,
                                "padded batch vs each pair alone": False}, out


def test_translate_example_decodes_through_flash_attn_with_kvcache():
    """Greedy decoding (untrained weights, all pairs: right-padded sources) runs every decoder step's
    self- and cross-attention on flash_attn_with_kvcache, never the training kernels, and its cached
    logits still equal recomputation."""
    script = f"""
import sys
sys.path.insert(0, {str(EXAMPLE.parent)!r})
import torch
import translate
import flashtx.nn.attention as A

calls, decoding = [], [False]
kvcache = A.kvcache_step  # (flash_attn_with_kvcache's body: flashtx.nn passes it whether its caches' ranges are known)
def counted(q, k_cache, v_cache, k, v, *rest):
    calls.append(k is not None)  # True: self-attention (append), False: cross-attention
    return kvcache(q, k_cache, v_cache, k, v, *rest)
def refused(name, f):
    def g(*a, **kw):
        if decoding[0]:
            raise AssertionError(name + " called while decoding")
        return f(*a, **kw)
    return g
A.kvcache_step = counted
A.attention = refused("attention", A.attention)
A.flash_attn_func = refused("flash_attn_func", A.flash_attn_func)
encode = translate.Translator.encode
def encode_then_decode(self, *a):
    out = encode(self, *a)
    decoding[0] = True
    return out
translate.Translator.encode = encode_then_decode

pairs = translate.load_pairs()
sv, tv = translate.Vocab([s for s, _ in pairs]), translate.Vocab([t for _, t in pairs])
ids = [(sv.encode(s), tv.encode(t)) for s, t in pairs]
torch.manual_seed(0)
model = translate.Translator(len(sv), len(tv))
src, src_mask = translate.make_batch(ids, "cpu")[:2]
assert not bool(src_mask.all())  # padded sources
tokens, logits, memory = translate.greedy(model, src, src_mask, 6)
steps, layers = tokens.shape[1], len(model.decoder)
assert calls.count(True) == calls.count(False) == steps * layers, (calls, steps)
decoding[0] = False
translate.Translator.encode = encode
diff = translate.cache_check(model, src, src_mask, 6)
assert diff < 1e-4, diff
print("ok", steps, layers, diff)
"""
    res = run("-c", script)
    assert res.returncode == 0 and res.stdout.startswith("ok"), res.stdout + res.stderr


def test_translate_example_decodes_past_64_positions():
    """--max-len above the model's old 64 positional encodings: an untrained model decodes every position (it
    crashed at position 64 with an IndexError from an empty encoding slice)."""
    res = run(str(EXAMPLE), "--steps", "1", "--max-len", "70", "--min-accuracy", "0")
    assert res.returncode == 0, res.stdout + res.stderr
    assert check_lines(res.stdout)["KV-cache decoding vs recomputation"], res.stdout
