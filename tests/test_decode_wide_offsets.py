"""Element offsets past 2**31 in the KV-cache decode kernels (flash_attn_with_kvcache, and flashtx.attention's
small-query route to them): caches, new k/v and q whose strides put an element past int32 (a (B, Hkv, S, D)
buffer viewed as (B, S, Hkv, D), a D-major cache, rows or heads of a slice of a big buffer). The kernels form those
offsets in int64; in int32 they wrapped and read and wrote outside the tensors (a segfault in the interpreter). The
buffer is 6 GiB of address space, of which the few elements written are touched. And CUDA's grid limit on dims y
and z: a ValueError naming the argument, before anything is launched."""
import math
import warnings

import pytest
import torch
from conftest import DEVICE, ON_GPU
from test_decode import loop_reference
from test_wide_offsets import _strided

import flashtx
from flashtx import _small_q
from flashtx.triton_kernels import launch
from flashtx.triton_kernels.limits import MAX_GRID_YZ, within_limits

F16 = torch.float16
ATOL = 3e-3  # float16 outputs against float64 (test_decode's TOL)
DMAJOR = 150994944  # a D-major cache's head-dim stride: column 15 is at 15 x 150994944 > 2**31


def _rand(*shape, gen):
    return torch.randn(*shape, generator=gen).to(F16).to(DEVICE)


def _tables(gen, rows=64, r2=8):
    ang = torch.rand(rows, r2, generator=gen, dtype=torch.float64) * 2 * math.pi
    return ang.cos().float().to(DEVICE), ang.sin().float().to(DEVICE)


def _close(got, want, atol=ATOL):
    assert (got.double().cpu() - want.double()).abs().max().item() <= atol


def _run(q, kc, vc, k=None, v=None, *, lens, cos=None, sin=None):
    """flash_attn_with_kvcache (causal, NeoX RoPE when tables are given), checked against test_decode's float64 loop
    reference on the values before the call: the output, and the whole caches after the append."""
    kc0, vc0 = kc.cpu().clone(), vc.cpu().clone()  # (dense copies of the views' elements)
    cpu = lambda t: t.cpu() if t is not None else None  # noqa: E731
    want, _, kc_want, vc_want = loop_reference(q.cpu(), kc0, vc0, cpu(k), cpu(v), lens=lens, cos=cpu(cos),
                                               sin=cpu(sin), interleaved=False, causal=True)
    with torch.no_grad():
        out = flashtx.flash_attn_with_kvcache(q, kc, vc, k=k, v=v, rotary_cos=cos, rotary_sin=sin,
                                             cache_seqlens=torch.tensor(lens, dtype=torch.int32, device=DEVICE),
                                             causal=True, rotary_interleaved=False, backend="triton")
    _close(out, want)
    _close(kc, kc_want)
    _close(vc, vc_want)


@pytest.fixture(scope="module")
def buf():
    return torch.empty(3 * 2**30 + 64, dtype=F16, device=DEVICE)  # 6 GiB of address space, untouched


def test_append_into_cache_heads_past_int32(buf):
    """A cache whose kv heads are 2**30 apart (as a (B, Hkv, S, D) buffer viewed as (B, S, Hkv, D)): head 2 starts
    at 2**31, where the append wrote through head x stride in int32."""
    gen = torch.Generator().manual_seed(0)
    B, S, Hkv, D, st = 2, 64, 3, 16, 2**30
    shape, strides = (B, S, Hkv, D), (2 * S * D, D, st, 1)
    kc, vc = _strided(buf, shape, strides, 0, gen), _strided(buf, shape, strides, S * D, gen)
    q = _rand(B, 1, 2 * Hkv, D, gen=gen)
    k, v = _rand(B, 1, Hkv, D, gen=gen), _rand(B, 1, Hkv, D, gen=gen)
    _run(q, kc, vc, k, v, lens=[5, 17])


@pytest.mark.parametrize("rotary", [False, True], ids=["copy", "rotary"])
def test_append_into_dmajor_cache_past_int32(buf, rotary):
    """A D-major cache (a (B, Hkv, D, S) buffer viewed as (B, S, Hkv, D)): the append's column offsets (the rotated
    columns and the copied ones) pass 2**31."""
    gen = torch.Generator().manual_seed(1)
    B, S, Hkv, D = 2, 64, 2, 16
    shape, strides = (B, S, Hkv, D), (Hkv * S, 1, S, DMAJOR)
    kc, vc = _strided(buf, shape, strides, 0, gen), _strided(buf, shape, strides, B * Hkv * S, gen)
    q = _rand(B, 2, 2 * Hkv, D, gen=gen)
    k, v = _rand(B, 2, Hkv, D, gen=gen), _rand(B, 2, Hkv, D, gen=gen)
    cos, sin = _tables(gen) if rotary else (None, None)  # rotary_dim = D: every column rotated
    _run(q, kc, vc, k, v, lens=[3, 40], cos=cos, sin=sin)


def test_read_dmajor_cache_past_int32(buf):
    """Attention over D-major K and V caches: the forward's K/V column offsets pass 2**31."""
    gen = torch.Generator().manual_seed(2)
    B, S, Hkv, D = 2, 64, 2, 16
    shape, strides = (B, S, Hkv, D), (Hkv * S, 1, S, DMAJOR)
    kc, vc = _strided(buf, shape, strides, 0, gen), _strided(buf, shape, strides, B * Hkv * S, gen)
    _run(_rand(B, 3, 2 * Hkv, D, gen=gen), kc, vc, lens=[9, 50])


@pytest.mark.parametrize("dim", ["rows", "columns"])
def test_query_strides_past_int32(buf, dim):
    """q whose query rows are 2**30 apart (row 2 at 2**31), or D-major: the forward's q offsets pass 2**31."""
    gen = torch.Generator().manual_seed(3)
    B, Sq, Hq, D = 2, 3, 2, 16
    strides = (Hq * D, 2**30, D, 1) if dim == "rows" else (Sq * Hq, Hq, 1, DMAJOR)
    q = _strided(buf, (B, Sq, Hq, D), strides, 0, gen)
    kc, vc = _rand(B, 32, 1, D, gen=gen), _rand(B, 32, 1, D, gen=gen)
    _run(q, kc, vc, lens=[7, 20])


@pytest.mark.parametrize("dim", ["token", "head"])
@pytest.mark.parametrize("tensor", ["kv", "q"])
def test_append_reads_new_tokens_past_int32(buf, tensor, dim):
    """New k and v (copied into the cache), or q (rotated by the append kernel), whose tokens or heads are 2**30
    apart: token or head 2 is at 2**31."""
    gen = torch.Generator().manual_seed(4)
    B, T, H, D = 2, 3, 3, 16
    strides = (128, 2**30, D, 1) if dim == "token" else (128, D, 2**30, 1)  # 48 elements a batch row, 128 apart
    kc, vc = _rand(B, 32, H, D, gen=gen), _rand(B, 32, H, D, gen=gen)
    if tensor == "kv":
        k, v = _strided(buf, (B, T, H, D), strides, 0, gen), _strided(buf, (B, T, H, D), strides, 64, gen)
        _run(_rand(B, 1, H, D, gen=gen), kc, vc, k, v, lens=[4, 11])
    else:
        q = _strided(buf, (B, T, H, D), strides, 0, gen)
        cos, sin = _tables(gen, r2=4)  # rotary_dim = D / 2
        _run(q, kc, vc, _rand(B, T, H, D, gen=gen), _rand(B, T, H, D, gen=gen), lens=[4, 11], cos=cos, sin=sin)


def test_small_q_route_keeps_the_attention_limits(buf, monkeypatch):
    """flashtx.attention's route of a few queries to the decode kernels takes a call only within the attention op's
    limits (triton_kernels.limits.within_limits): q's rows 2**30 apart span past int32."""
    gen = torch.Generator().manual_seed(5)
    Sq, D, Sk = 3, 16, 32
    q = _strided(buf, (1, 1, Sq, D), (0, 0, 2**30, 1), 0, gen)  # (B, H, S, D)
    k, v = _rand(1, 1, Sk, D, gen=gen), _rand(1, 1, Sk, D, gen=gen)
    real = _small_q.call

    def spy(op, *args):
        assert within_limits(q, k, v, None, None), "the small-query route took a call past the attention limits"
        return real(op, *args)

    monkeypatch.setattr(_small_q, "call", spy)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (a fallback to the reference warns)
        out = flashtx.attention(q, k, v)
    want = torch.nn.functional.scaled_dot_product_attention(q.cpu().double(), k.cpu().double(), v.cpu().double())
    _close(out, want)


@pytest.mark.skipif(ON_GPU, reason="stubbed launches: on a GPU the index check kernel would not run either")
@pytest.mark.parametrize("case", ["batch", "kv-heads", "combine-heads"])
def test_grid_past_the_cuda_limit_raises(case):
    """A batch past 65535 (grid z, and the append's y), kv heads x query tiles past it (the forward's y), or q heads
    past it with key splits (the combine's y): a ValueError naming the argument and the limit, through the lane and
    the general path (with an append: raised before the append launches), and the small-query route declines."""
    N, D, S = MAX_GRID_YZ + 1, 16, 64 if case == "combine-heads" else 16  # 64: 4 key tiles, for 4 splits
    B, Hq, Hkv, splits, match = {"batch": (N, 1, 1, 1, rf"q's batch \({N}\) is above {MAX_GRID_YZ}"),
                                 "kv-heads": (1, N, N, 1, rf"{N} kv heads x 1 query tiles .* above its limit "
                                                          rf"{MAX_GRID_YZ}"),
                                 "combine-heads": (1, N, 1, 4, rf"q's {N} heads are above {MAX_GRID_YZ}.*num_splits=1")
                                 }[case]
    q = torch.randn(1, 1, 1, D, dtype=F16).expand(B, 1, Hq, D)  # stride 0: no memory
    kc, vc = (torch.randn(1, S, 1, D, dtype=F16).expand(B, S, Hkv, D) for _ in range(2))
    launches = []
    with launch.stub_launches(lambda kernel, grid, args: launches.append(grid)), torch.no_grad():
        with pytest.raises(ValueError, match=match):  # a lane's first call
            flashtx.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=torch.full((B,), 8, dtype=torch.int32),
                                            num_splits=splits, backend="triton")
        kc, vc = torch.zeros(B, S, Hkv, D, dtype=F16), torch.zeros(B, S, Hkv, D, dtype=F16)  # writable
        kn = torch.randn(1, 1, 1, D, dtype=F16).expand(B, 1, Hkv, D)
        with pytest.raises(ValueError, match=match):  # the general path (an int cache_seqlens), appending
            flashtx.flash_attn_with_kvcache(q, kc, vc, k=kn, v=kn, cache_seqlens=8, num_splits=splits,
                                            backend="triton")
        assert launches == []  # nothing launched, the append neither
        if case == "combine-heads":  # one split: no combine, and the forward's grid fits
            flashtx.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=8, num_splits=1, backend="triton")
            assert launches == [(1, 2048, 1)]  # 65536 heads per kv head in the interpreter's 32-row tiles
    qb, kb = q.transpose(1, 2), kc.transpose(1, 2)  # (B, H, S, D)
    assert _small_q.attention(qb, kb, kb, None, [None] * 8, [0, 0, -1, -1, 0, 0, 0, 0], [D ** -0.5, 0.0, 0.0], "",
                              False) is None
