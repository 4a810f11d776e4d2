"""The sm_80, sm_86 and sm_90 16-bit tiles, including the specialisation entries (configs.MASKED for
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
