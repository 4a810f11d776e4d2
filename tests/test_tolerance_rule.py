"""flashtx.testing.tolerance_check, the rule every kernel test and `python -m flashtx` applies: the kernel's error
against float64 may be 2x (outputs) or 3x (gradients) the same-dtype eager error plus a few ulps. The bound rests
on the eager baseline, so a baseline that is not a rounding of the reference is refused, never trusted."""
import pytest
import torch

from flashtx import testing


def _case(dtype=torch.float16, n=4096, seed=0):
    g = torch.Generator().manual_seed(seed)
    ref64 = torch.randn(n, generator=g, dtype=torch.float64)
    return ref64, ref64.to(dtype)  # the eager baseline: the reference rounded to the dtype


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_a_rounded_result_passes_and_a_wrong_one_fails(dtype):
    ref64, eager = _case(dtype)
    err, bound = testing.tolerance_check(eager.clone(), ref64, eager)
    assert err <= bound
    wrong = eager.clone()
    wrong[7] += 0.05 * ref64.abs().max().item()  # one entry off by 5% of the magnitude
    err, bound = testing.tolerance_check(wrong, ref64, eager)
    assert err > bound


@pytest.mark.parametrize("baseline", ["nan", "off"])
def test_a_broken_baseline_is_refused(baseline):
    ref64, eager = _case()
    broken = eager.clone()
    if baseline == "nan":
        broken[3] = float("nan")
    else:  # a wrong eager formula: every entry doubled (rounding never moves a result by 100%)
        broken = (2 * eager).to(eager.dtype)
    wrong = broken.clone()  # a kernel with the same bug would pass against it
    with pytest.raises(ValueError, match="baseline"):
        testing.tolerance_check(wrong, ref64, broken)


def test_the_cap_leaves_room_for_rounding_of_cancelling_sums():
    """A result that cancels to ~0 is judged at the magnitude passed as `scale` (the terms that cancel): an eager
    error of a few ulps of that scale is rounding, not a broken baseline."""
    ref64 = torch.full((8,), 1e-6, dtype=torch.float64)
    eager = (ref64 + 4 * torch.finfo(torch.float16).eps).to(torch.float16)  # rounding at scale 1
    err, bound = testing.tolerance_check(eager, ref64, eager, scale=1.0)
    assert err <= bound
