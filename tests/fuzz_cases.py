"""Helpers shared by the fuzz tests (tests/test_fuzz_attention.py, tests/test_fuzz_ops.py): the comparison
at float64 precision, non-contiguous input layouts, and input snapshots."""
import torch
from conftest import DEVICE, ON_GPU, PRECISE_DTYPE, precise_atol

F64 = torch.float64

# relative to max(1, |reference|): float64 kernels in the interpreter; float32 copies on a GPU
TOL = precise_atol(1e-10) * (1 if not ON_GPU else 5)
SEQS = [1, 2, 3, 5, 16, 17, 31, 33, 64, 65, 129]
DIMS = [1, 3, 8, 12, 16, 17, 24, 40, 64, 72, 80, 96, 100, 128, 160, 192, 200, 256]


# --------------------------------------------------------------------------------------------- helpers
def check(name, actual, ref, tol=TOL):
    assert actual is not None and ref is not None, f"{name}: missing"
    assert tuple(actual.shape) == tuple(ref.shape), f"{name}: shape {tuple(actual.shape)} != {tuple(ref.shape)}"
    a, r = actual.detach().double(), ref.detach().double()
    assert torch.equal(torch.isnan(a), torch.isnan(r)), f"{name}: NaN pattern differs"
    assert torch.equal(torch.isinf(a), torch.isinf(r)) and torch.equal(a[torch.isinf(a)], r[torch.isinf(r)]), \
        f"{name}: infinities differ"
    fin = torch.isfinite(r)
    if not fin.any():
        return
    err = float((a[fin] - r[fin]).abs().max())
    mag = float(r[fin].abs().max())
    assert err <= tol * max(1.0, mag), f"{name}: max error {err:.3e} (reference magnitude {mag:.3e})"


def layout_view(shape, kind, rng, gen):
    """(leaf, view): a float64 leaf requiring grad and a view of it shaped `shape` in the given memory layout."""
    shape = tuple(shape)
    if kind == "perm":
        perm = list(range(len(shape)))
        rng.shuffle(perm)
        leaf = torch.randn([shape[i] for i in perm], dtype=F64, generator=gen)
        view = lambda t: t.permute(*[perm.index(i) for i in range(len(shape))])  # noqa: E731
    elif kind == "slice":
        big = [s + rng.randint(0, 2) for s in shape]
        starts = [rng.randint(0, b - s) for s, b in zip(shape, big)]
        leaf = torch.randn(big, dtype=F64, generator=gen)
        view = lambda t: t[tuple(slice(a, a + s) for a, s in zip(starts, shape))]  # noqa: E731
    elif kind == "step":
        leaf = torch.randn([2 * s for s in shape], dtype=F64, generator=gen)
        steps = [rng.choice([1, 2]) for _ in shape]
        view = lambda t: t[tuple(slice(0, s * st, st) for s, st in zip(shape, steps))]  # noqa: E731
    elif kind == "expand" and any(s > 1 for s in shape[:-1]):
        d = rng.choice([i for i, s in enumerate(shape[:-1]) if s > 1])
        leaf = torch.randn([1 if i == d else s for i, s in enumerate(shape)], dtype=F64, generator=gen)
        view = lambda t: t.expand(*shape)  # noqa: E731
    else:
        leaf = torch.randn(shape, dtype=F64, generator=gen)
        view = lambda t: t  # noqa: E731
    leaf = leaf.to(DEVICE, PRECISE_DTYPE).requires_grad_(True)
    return leaf, view(leaf)


def snapshot(ts):
    return [(t, t.detach().clone()) for t in ts if isinstance(t, torch.Tensor)]


def assert_unchanged(snap):
    for t, before in snap:
        assert torch.equal(t.detach(), before), f"an input of shape {tuple(t.shape)} was modified"


def grads(loss, inputs):
    return torch.autograd.grad(loss, inputs, allow_unused=True, retain_graph=True)


def zeros_if_none(gs, like):
    return [torch.zeros_like(t) if g is None else g for g, t in zip(gs, like)]
