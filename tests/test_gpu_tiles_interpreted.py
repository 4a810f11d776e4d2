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

    def run(dtype, backend):
        ins = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        extra = {} if bias is None else dict(attn_bias=bias.to(dtype).requires_grad_())
        out = flashtx.flash_attn_func(*ins, backend=backend, **kwargs, **extra)
        return [out, *torch.autograd.grad(out, ins + list(extra.values()), dout.to(dtype))]

    got = run(torch.float16, "triton")
    ref64 = run(torch.float64, "reference")
    eager = run(torch.float16, "reference")
    for i, name in enumerate(("out", "dq", "dk", "dv", "dbias")[:len(got)]):
        err, bound = tolerance_check(got[i], ref64[i], eager[i], grad=i > 0)
        assert err <= bound, f"{case} D={d} sm_{gpu_target.arch} {name}: error {err:.3g} > {bound:.3g}"


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
