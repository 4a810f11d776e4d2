"""On a GPU, a bad index value stops the program with a device-side assert before a kernel follows it, and good
values pass: flash_attn_varlen_func's cu_seqlens (one check kernel for both tensors, triton_kernels/varlen_check.py)
and flash_attn_with_kvcache's cache_seqlens (triton_kernels/decode_check.py). A device-side assert ends the process's
CUDA context, so each case runs in a process of its own. On CPU the same branch runs in Triton's interpreter with the
values forced unreadable (tests/test_varlen_device_check.py, tests/test_decode_device_check.py), where the assert
raises at once; this file is their GPU half and needs a GPU."""
import subprocess
import sys
import textwrap

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a GPU (the CPU half: test_varlen_device_check.py, test_decode_device_check.py)")

VARLEN = """
    import torch, flashtx
    cu = torch.tensor({cu}, dtype=torch.int32, device="cuda")
    q = torch.randn(10 if {cu}[-1] > 2 else 1, 2, 64, device="cuda", dtype=torch.float16)
    out = flashtx.flash_attn_varlen_func(q, q, q, cu, cu, {max_seqlen}, {max_seqlen}, causal=True)
    torch.cuda.synchronize()
    print("finite", bool(out.isfinite().all()))
"""

DECODE = """
    import torch, flashtx
    q = torch.randn(2, 1, 4, 64, device="cuda", dtype=torch.float16)
    kc, vc = (torch.randn(2, 64, 2, 64, device="cuda", dtype=torch.float16) for _ in range(2))
    k, v = (torch.randn(2, 1, 2, 64, device="cuda", dtype=torch.float16) for _ in range(2))
    lens = torch.tensor({lens}, dtype=torch.int32, device="cuda")
    out = flashtx.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=lens, causal=True)
    torch.cuda.synchronize()
    print("finite", bool(out.isfinite().all()))
"""


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("code,good,bad", [
    (VARLEN, dict(cu=[0, 4, 10], max_seqlen=6), dict(cu=[0, 4, 20], max_seqlen=6)),  # ends past total_q
    (VARLEN, dict(cu=[0, 4, 10], max_seqlen=6), dict(cu=[0, 7, 3], max_seqlen=7)),  # decreases
    (VARLEN, dict(cu=[0, 4, 10], max_seqlen=6), dict(cu=[0, 4, 10], max_seqlen=5)),  # longer than max_seqlen
    # ints of 1 (nseq, max_seqlen) reach the check kernel as constexprs (Triton's specialisation)
    (VARLEN, dict(cu=[0, 1], max_seqlen=1), dict(cu=[0, 2], max_seqlen=1)),
    (DECODE, dict(lens=[3, 40]), dict(lens=[3, 64])),  # 64 + the new token past the cache's 64 positions
    (DECODE, dict(lens=[3, 40]), dict(lens=[-1, 40])),
], ids=["varlen-end", "varlen-decrease", "varlen-max-seqlen", "varlen-ones", "decode-past-cache",
        "decode-negative"])
def test_a_bad_index_stops_the_program_and_a_good_one_passes(code, good, bad):
    ok = _run(code.format(**good))
    assert ok.returncode == 0 and "finite True" in ok.stdout, ok.stderr[-2000:]
    stopped = _run(code.format(**bad))
    assert stopped.returncode != 0 and "finite" not in stopped.stdout, (stopped.stdout, stopped.stderr[-2000:])
    assert "device-side assert" in stopped.stderr or "Assertion" in stopped.stderr, stopped.stderr[-2000:]
