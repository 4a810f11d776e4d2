"""The sm_80, sm_86 and sm_90 16-bit tiles, the plain ones (causal or not) and the specialisation entries (configs.MASKED for
windows, masks, lengths; configs.MODIFIED for score modifiers; the bias-gradient dQ's), run in Triton's
interpreter with the GPU's own plan: fp16 forward and backward against the float64 reference backend under
the tolerance rule, with every access bounds-checked (conftest). The interpreter's own tiles are smaller,
so no other CPU test runs these."""
import pytest
import torch
from conftest import ON_GPU

import flashtx
from flashtx.testing import tolerance_check
from flashtx.triton_kernels import configs

pytestmark = pytest.mark.skipif(ON_GPU, reason="runs a GPU's tiles in Triton's interpreter (a GPU runs them natively)")


CASES = {  # name: (flash_attn_func keywords, (modified, masked), a learned bias's shape or None)
    "plain": (dict(causal=False), (False, False), None),  # the tiles every training step runs
    "plain-causal": (dict(causal=True), (False, False), None),
    "masked": (dict(causal=True, window_size=(40, 0)), (False, True), None),
    "modified": (dict(causal=True, softcap=4.0), (True, False), None),
    "bias-grad": (dict(causal=False), (True, False), (1, 2, 70, 150)),  # the bias-gradient dQ's own tiles
}


def check_fp16_against_float64(q, k, v, dout, bias, kwargs: dict, label: str, bias_dtype=None) -> None:
    """flash_attn_func's fp16 output and gradients (the bias's too, passed as attn_bias: in q's dtype, or
    bias_dtype for the fp16 runs) on the Triton backend, against the float64 reference, under the tolerance rule (the
    fp16 reference's error sets the bound)."""
    def run(dtype, backend):
        ins = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        bdt = bias_dtype if bias_dtype is not None and dtype == torch.float16 else dtype
        extra = {} if bias is None else dict(attn_bias=bias.to(bdt).requires_grad_())
        out = flashtx.flash_attn_func(*ins, backend=backend, **kwargs, **extra)
        return [out, *torch.autograd.grad(out, ins + list(extra.values()), dout.to(dtype))]

    got = run(torch.float16, "triton")
    ref64 = run(torch.float64, "reference")
    eager = run(torch.float16, "reference")
    for i, name in enumerate(("out", "dq", "dk", "dv", "dbias")[:len(got)]):
        err, bound = tolerance_check(got[i], ref64[i], eager[i], grad=i > 0)
        assert err <= bound, f"{label} {name}: error {err:.3g} > {bound:.3g}"


@pytest.mark.parametrize("gpu_target", [80, 86, 90], indirect=True, ids=lambda a: f"sm_{a}")
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("case", sorted(CASES))
def test_specialisation_tiles_compute_attention_and_its_gradients(gpu_target, d, case):
    kwargs, (modified, masked), bias_shape = CASES[case]
    dq_kernel = "attn_bwd_dq" if bias_shape is None else "attn_bwd_dq_dbias"
    for kernel in ("attn_fwd", "attn_bwd_dkdv", dq_kernel):  # what the launches below take
        cfg = configs.select_config(kernel, d, d, 2, gpu_target, modified, masked)
        assert cfg.block_m >= 16 and cfg.block_n >= 32, cfg  # the GPU's tiles, not the interpreter's
    gen = torch.Generator().manual_seed(d + (1 if masked else 0))
    B, H, Sq, Sk = 1, 2, 70, 150
    q, k, v = (torch.randn(B, s, H, d + 8, generator=gen, dtype=torch.float64)[..., :d] for s in (Sq, Sk, Sk))
    dout = torch.randn(B, Sq, H, d, generator=gen, dtype=torch.float64)
    bias = None if bias_shape is None else torch.randn(*bias_shape, generator=gen, dtype=torch.float64)

    check_fp16_against_float64(q, k, v, dout, bias, kwargs, f"{case} D={d} sm_{gpu_target.arch}")


@pytest.mark.parametrize("gpu_target", [80, 86, 90], indirect=True, ids=lambda a: f"sm_{a}")
def test_an_fp32_learned_bias_on_fp16_queries_takes_the_fp32_bias_gradient_tile(gpu_target):
    """fp16 q with an fp32 learned bias (bf16/fp16 autocast with an fp32 bias parameter): the bias-gradient dQ runs
    the fp32 table's tile (attention_bwd_launch.plan_backward; the 16-bit one overflowed sm_90's shared memory with
    it), and output and every gradient, the bias's in fp32, stay within the tolerance rule."""
    d = 128
    gen = torch.Generator().manual_seed(gpu_target.arch)
    B, H, Sq, Sk = 1, 2, 40, 72
    q, k, v = (torch.randn(B, s, H, d, generator=gen, dtype=torch.float64) for s in (Sq, Sk, Sk))
    dout = torch.randn(B, Sq, H, d, generator=gen, dtype=torch.float64)
    bias = torch.randn(1, H, Sq, Sk, generator=gen, dtype=torch.float64)
    check_fp16_against_float64(q, k, v, dout, bias, dict(causal=False), f"fp32 bias sm_{gpu_target.arch}",
                               bias_dtype=torch.float32)


@pytest.mark.parametrize("gpu_target", [80, 86, 90], indirect=True, ids=lambda a: f"sm_{a}")
@pytest.mark.parametrize("d,page", [(64, 16), (128, None)])
def test_decode_tiles_compute_attention_over_the_cache(gpu_target, d, page):
    """fp16 flash_attn_with_kvcache with the GPU's decode tiles and split count (from its SM count), paged
    and contiguous, ragged lengths (one empty sequence), GQA 4, against the float64 reference."""
    from flashtx.triton_kernels import decode as decode_kernels

    gen = torch.Generator().manual_seed(d + gpu_target.arch)
    B, Hq, Hkv, cap = 3, 8, 2, 608  # several key tiles of every GPU tile (128 keys)
    q = torch.randn(B, 1, Hq, d, generator=gen, dtype=torch.float64)
    if page:
        pages = B * (cap // page) + 6
        kc, vc = (torch.randn(pages, page, Hkv, d, generator=gen, dtype=torch.float64) for _ in range(2))
        bt = torch.randperm(pages, generator=gen)[:B * (cap // page)].view(B, cap // page).to(torch.int32)
    else:
        kc, vc = (torch.randn(B, cap, Hkv, d, generator=gen, dtype=torch.float64) for _ in range(2))
        bt = None
    lens = torch.tensor([0, 301, cap - 1], dtype=torch.int32)

    def run(dtype, backend):
        with torch.no_grad():
            return flashtx.flash_attn_with_kvcache(q.to(dtype), kc.to(dtype), vc.to(dtype), cache_seqlens=lens,
                                                   block_table=bt, causal=True, return_softmax_lse=True,
                                                   backend=backend)

    assert decode_kernels.split_count(q.half(), kc.half(), vc.half(), bt, 0, gpu_target) > 1  # split-KV + combine
    got = run(torch.float16, "triton")
    ref64, eager = run(torch.float64, "reference"), run(torch.float16, "reference")
    for i, name in enumerate(("out", "lse")):
        err, bound = tolerance_check(got[i], ref64[i], eager[i])
        assert err <= bound, f"decode D={d} page={page} sm_{gpu_target.arch} {name}: error {err:.3g} > {bound:.3g}"



SHORT = {  # name: ((B, H, Sq, Sk), flash_attn_func keywords, a learned bias's shape or None)
    "swin-window-bias": ((3, 2, 49, 49), dict(causal=False), (1, 2, 49, 49)),  # 7x7 windows, a relative-position bias
    "short-queries": ((2, 2, 20, 150), dict(causal=False), None),  # a Q-Former's queries over image tokens
    "short-causal": ((2, 2, 64, 64), dict(causal=True), None),
}


def _fitted(table, rows: int) -> tuple:
    """(block_m, block_n, warps) configs.fit_rows should give for a table's tile (its rule, restated)."""
    return (64 if rows <= 64 < table.block_m else table.block_m), table.block_n, table.num_warps


@pytest.mark.parametrize("gpu_target", [80, 86, 90], indirect=True, ids=lambda a: f"sm_{a}")
@pytest.mark.parametrize("d", [32, 128])
@pytest.mark.parametrize("case", sorted(SHORT))
def test_short_sequences_take_64_row_tiles_that_compute_attention(gpu_target, d, case):
    """At most 64 queries (configs.fit_rows): the GPU's q tiles of more rows cut to 64 in the forward, dK/dV and dQ
    (bias-gradient dQ too) plans; and those tiles compute attention and every gradient within the tolerance rule
    (fp16 against the float64 reference)."""
    from flashtx.triton_kernels import attention_bwd_launch, attention_fwd
    from flashtx.triton_kernels.launch import head_block
    from flashtx.triton_kernels.mask_spec import NO_MASKS, MaskSpec
    (B, H, Sq, Sk), kwargs, bias_shape = SHORT[case]
    causal = kwargs["causal"]
    gen = torch.Generator().manual_seed(Sq * d + gpu_target.arch)
    q, k, v = (torch.randn(B, s, H, d, generator=gen, dtype=torch.float64) for s in (Sq, Sk, Sk))
    dout = torch.randn(B, Sq, H, d, generator=gen, dtype=torch.float64)
    bias = None if bias_shape is None else torch.randn(*bias_shape, generator=gen, dtype=torch.float64)

    # the plans' tiles, for (B, H, S, D) views of fp16 tensors as the launchers see them
    qh, kh, vh, dh = (t.half().transpose(1, 2) for t in (q, k, v, dout))
    spec = NO_MASKS if bias is None else MaskSpec(attn_mask=bias.half())
    rows = torch.empty(B, H, Sq, dtype=torch.float32)
    fwd = attention_fwd.plan_forward(qh, kh, vh, torch.empty_like(qh), rows, rows, scale=d ** -0.5, causal=causal,
                                     bottom_right=False, spec=spec, target=gpu_target)
    bwd = attention_bwd_launch.plan_backward(
        dh, qh, kh, vh, torch.empty_like(qh), rows, rows, rows.clone(), *(torch.empty_like(t) for t in (qh, kh, vh)),
        scale=d ** -0.5, causal=causal, bottom_right=False, spec=spec, target=gpu_target,
        dbias=None if bias is None else torch.empty(bias_shape, dtype=torch.float16))
    dkdv = next(ln for ln in bwd if "DK" in getattr(ln, "args", {}))
    dq = next(ln for ln in bwd if "DQ" in getattr(ln, "args", {}))
    for launch, kernel in ((fwd, "attn_fwd"), (dkdv, "attn_bwd_dkdv"),
                           (dq, "attn_bwd_dq" if bias is None else "attn_bwd_dq_dbias")):
        table = configs.select_config(kernel, head_block(d), head_block(d), 2, gpu_target, spec.modifies_scores,
                                      spec.masks_visibility, causal)
        want = _fitted(table, Sq)
        assert (launch.args["BLOCK_M"], launch.args["BLOCK_N"], launch.config.num_warps) == want, (kernel, table)

    check_fp16_against_float64(q, k, v, dout, bias, kwargs, f"{case} D={d} sm_{gpu_target.arch}")


@pytest.mark.parametrize("gpu_target", [80, 86, 90], indirect=True, ids=lambda a: f"sm_{a}")
def test_short_packed_sequences_take_64_row_tiles(gpu_target):
    """Packed documents of at most 64 tokens (varlen: max_seqlen_q = 49) cut the 128-row q tiles to 64 rows (the
    per-sequence extent, not the packed total): the forward's, and on sm_80 the masked dK/dV's; causal, with an
    empty document; fp16 forward and gradients against the float64 reference."""
    from flashtx.triton_kernels import attention_bwd_launch, attention_fwd
    from flashtx.triton_kernels.mask_spec import MaskSpec
    lens = [5, 49, 0, 30]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    total, H, d = int(cu[-1]), 2, 64
    gen = torch.Generator().manual_seed(gpu_target.arch)
    q, k, v, dout = (torch.randn(total, H, d, generator=gen, dtype=torch.float64) for _ in range(4))
    view = q.half().transpose(0, 1)[None]  # (1, H, total, D), as the launcher sees packed rows
    spec = MaskSpec(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lens), max_seqlen_k=max(lens))
    rows = torch.empty(1, H, total, dtype=torch.float32)
    launch = attention_fwd.plan_forward(view, view, view, view, rows, rows, scale=d ** -0.5, causal=True,
                                        bottom_right=True, spec=spec, target=gpu_target)
    table = configs.select_config("attn_fwd", d, d, 2, gpu_target, False, True, True)
    assert table.block_m == 128 and launch.args["BLOCK_M"] == 64 and launch.grid[0] == 1
    bwd = attention_bwd_launch.plan_backward(view, view, view, view, view, rows, rows, rows.clone(), view, view, view,
                                             scale=d ** -0.5, causal=True, bottom_right=True, spec=spec,
                                             target=gpu_target)
    for launch, kernel in ((bwd[1], "attn_bwd_dkdv"), (bwd[2], "attn_bwd_dq")):
        table = configs.select_config(kernel, d, d, 2, gpu_target, False, True, True)
        assert launch.args["BLOCK_M"] == min(table.block_m, 64), kernel
    assert gpu_target.arch != 80 or configs.select_config("attn_bwd_dkdv", d, d, 2, gpu_target, False, True,
                                                          True).block_m == 128  # (sm_80: dK/dV's q rows cut too)

    def run(dtype, backend):
        ins = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        out = flashtx.flash_attn_varlen_func(*ins, cu, cu, max(lens), max(lens), causal=True, backend=backend)
        return [out, *torch.autograd.grad(out, ins, dout.to(dtype))]

    got, ref64, eager = run(torch.float16, "triton"), run(torch.float64, "reference"), run(torch.float16, "reference")
    for i, name in enumerate(("out", "dq", "dk", "dv")):
        err, bound = tolerance_check(got[i], ref64[i], eager[i], grad=i > 0)
        assert err <= bound, f"varlen sm_{gpu_target.arch} {name}: error {err:.3g} > {bound:.3g}"
