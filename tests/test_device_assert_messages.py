"""Device-side asserts fit CUDA's torch._assert_async, which refuses a message of 255 bytes or more (torch 2.11;
an H100 run on 2026-12-06 saw decode calls with device-resident cache_seqlens and leftpad, batch_idx, a block table
or rotary tables raise it). CPU's takes any length, so CPU runs never saw it: every flashtx assert goes through
flashtx._library.device_assert, and every CPU test runs under the `cuda_assert_rule` stand-in (tests/conftest.py)."""
import itertools
import pathlib
import re

import pytest
import torch

import flashtx
import flashtx.triton_kernels
from flashtx import _library, decode

ROOT = pathlib.Path(flashtx.__file__).parent


def test_every_assert_goes_through_device_assert():
    kernels = pathlib.Path(flashtx.triton_kernels.__file__).parent  # installed as flashtx.triton_kernels
    files = sorted({*ROOT.rglob("*.py"), *kernels.rglob("*.py")} - {ROOT / "_library.py"})
    assert len(files) > 40 and any(p.is_relative_to(kernels) for p in files)
    direct = [f"{p}:{i}" for p in files for i, line in enumerate(p.read_text().splitlines(), 1)
              if re.search(r"_assert_async(\.msg)?\(|_functional_assert_async", line)]
    assert not direct, f"torch._assert_async called past flashtx._library.device_assert: {direct}"


def test_decode_messages_fit_unclipped():
    for flags in itertools.product((False, True), repeat=4):
        if flags[1] and flags[2]:
            continue  # cache_batch_idx with block_table is refused before any check
        msg = decode._ASSERT_MESSAGES[flags]
        assert len(msg.encode()) <= _library.ASSERT_MESSAGE_BYTES, (flags, len(msg.encode()))
        assert msg.startswith("flashtx.flash_attn_with_kvcache: index out of range")
        assert "cache_seqlens" in msg and ("cache_leftpad" in msg) == flags[0]
        assert ("cache_batch_idx" in msg) == flags[1] and ("block_table" in msg) == flags[2]


@pytest.mark.parametrize("length", [10, 254, 255, 400])
def test_device_assert_clips_to_what_cuda_takes(length, cuda_assert_rule):
    msg = ("é" + "x" * length)[:length]  # a two-byte character first: the cut counts bytes, not characters
    _library.device_assert(torch.tensor(True), msg)  # holds: nothing raised, the message within the limit
    with pytest.raises(RuntimeError) as err:
        _library.device_assert(torch.tensor(False), msg)
    got = str(err.value).splitlines()[0]
    assert "Message length" not in got
    raw = msg.encode()
    if len(raw) <= _library.ASSERT_MESSAGE_BYTES:
        assert msg in got
    else:
        assert raw[:200].decode(errors="ignore") in got and got.rstrip().endswith("...")
