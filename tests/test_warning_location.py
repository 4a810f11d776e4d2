"""Fallback warnings name the user's line, whichever path raised them: the op, a lane's planning, the
launcher's limit check, an nn.Module, the SDPA patch, RoPE/SwiGLU dispatch, the autotune cache."""
import json
import os
import warnings

import pytest
import torch
from conftest import DEVICE, ON_GPU, randn

import flashtx
from flashtx.triton_kernels import autotune
from flashtx.triton_kernels.limits import MAX_GRID_YZ

pytestmark = pytest.mark.usefixtures("fresh_plans")
HERE = os.path.abspath(__file__)


def _flashtx_warnings(fn):
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        fn()
    got = [w for w in record if "flashtx" in str(w.message)]
    assert got, "the call should have warned"
    return got


def _qkv(d=320, b=1, s=5, grad=False):
    return [randn(b, 2, s, d, requires_grad=grad) for _ in range(3)]


def _bshd(d=320):
    return [randn(1, 5, 2, d) for _ in range(3)]


CASES = {
    # the plain lane plans the call (head dim 320: no fast backend), forward and backward
    "attention": lambda: flashtx.attention(*_qkv()),
    "attention-grad": lambda: flashtx.attention(*_qkv(grad=True), is_causal=True).sum().backward(),
    # the option-tensor lane
    "attention-key-mask": lambda: flashtx.attention(*_qkv(), attn_mask=torch.ones(1, 1, 1, 5, dtype=torch.bool,
                                                                                 device=DEVICE)),
    "flash_attn_func": lambda: flashtx.flash_attn_func(*_bshd(), causal=True),
    "varlen": lambda: flashtx.flash_attn_varlen_func(
        *(randn(7, 2, 320) for _ in range(3)), torch.tensor([0, 3, 7], dtype=torch.int32, device=DEVICE),
        torch.tensor([0, 3, 7], dtype=torch.int32, device=DEVICE), 4, 4),
    # a launcher limit found after a cached Triton plan (_attention_op._replan)
    "grid-limit": lambda: (flashtx.attention(*_qkv(d=16, b=2)),
                           flashtx.attention(*_qkv(d=16, b=MAX_GRID_YZ + 1, s=2))),
    "nn.MultiheadAttention": lambda: flashtx.nn.MultiheadAttention(640, 2).to(DEVICE)(randn(1, 5, 640)),
    "patched-sdpa": lambda: _patched(*_qkv()),
}


def _patched(q, k, v):
    with flashtx.patch_sdpa():
        return torch.nn.functional.scaled_dot_product_attention(q, k, v)


@pytest.mark.parametrize("case", list(CASES))
def test_fallback_warnings_name_the_callers_line(case):
    for w in _flashtx_warnings(CASES[case]):
        assert os.path.abspath(w.filename) == HERE, (w.filename, str(w.message)[:200])


def test_patch_fallback_warning_names_the_callers_line_on_the_gpu_branch(monkeypatch):
    """The patch's own fallback to torch (CUDA inputs no kernel config serves). On CPU "patched-sdpa" above reaches
    flashtx.attention, whose warning it sees; here the GPU's branch runs, sdpa_patch._GPU stood in by "cpu" (as
    flashtx.testing_gpu_trace does)."""
    from flashtx import sdpa_patch

    if not ON_GPU:
        monkeypatch.setattr(sdpa_patch, "_GPU", "cpu")
    monkeypatch.setattr(sdpa_patch, "_warned", set())
    got = _flashtx_warnings(lambda: _patched(*_qkv()))
    assert any(sdpa_patch.FALLBACK_WARNING in str(w.message) for w in got), [str(w.message) for w in got]
    for w in got:
        assert os.path.abspath(w.filename) == HERE, (w.filename, str(w.message)[:200])


@pytest.mark.skipif(ON_GPU, reason="the interpreter refuses bfloat16 (Triton's interpreter miscomputes it); "
                                   "a GPU runs it, so nothing warns there")
@pytest.mark.parametrize("op", ["rope", "swiglu"])
def test_rope_and_swiglu_fallback_warnings_name_the_callers_line(op):
    x = randn(1, 4, 2, 16).bfloat16()
    if op == "rope":
        cos, sin = randn(4, 8).bfloat16(), randn(4, 8).bfloat16()
        call = lambda: flashtx.apply_rotary(x, cos, sin)  # noqa: E731
    else:
        call = lambda: flashtx.swiglu(x, x.clone())  # noqa: E731
    for w in _flashtx_warnings(call):
        assert os.path.abspath(w.filename) == HERE, (w.filename, str(w.message)[:200])


def test_autotune_cache_warning_names_the_callers_line(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHTX_CACHE_DIR", str(tmp_path))
    (tmp_path / "autotune.json").write_text(json.dumps({"version": 999}))
    for w in _flashtx_warnings(autotune.load_cache):
        assert os.path.abspath(w.filename) == HERE


def test_a_warning_from_inside_flashtx_with_no_user_frame_still_warns():
    from flashtx import _env

    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        _env.warn("flashtx: test")
    assert [str(w.message) for w in record] == ["flashtx: test"]
    assert os.path.abspath(record[0].filename) == HERE
