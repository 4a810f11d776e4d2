"""cu_seqlens checked as a GPU checks them (values not readable on the host): one Triton kernel
(triton_kernels/varlen_check.py) writes a flag per tensor, each asserted on the device (torch._assert_async), before
flash_attn_varlen_func's or varlen RoPE's kernels run. On CPU the assert raises at once, so these tests force the
device path (flashtx._validate._values_readable -> False) and run the kernel in the interpreter: it agrees with the
host check on random valid and broken tensors, a varlen call launches it once for both tensors and nothing else
of the old torch-op chain, and each tensor's message names it."""
import pytest
import torch
from conftest import DEVICE
from torch.utils._python_dispatch import TorchDispatchMode

import flashtx
import flashtx._validate as validate
from flashtx import _device_checks
from flashtx.triton_kernels import launch

# The GPU's branch forced on CPU: the assert raises at once there. On a GPU a device-side assert ends the CUDA context
# instead, so the GPU half runs in processes of its own (tests/test_device_asserts_gpu.py).
pytestmark = pytest.mark.skipif(DEVICE != "cpu", reason="forces the GPU branch on CPU; on a GPU: "
                                                        "test_device_asserts_gpu.py")


@pytest.fixture
def device_path(monkeypatch, cuda_assert_rule):
    monkeypatch.setattr(validate, "_values_readable", lambda t: False)


def _verdict(cu, total, bound, exact, readable: bool, monkeypatch) -> bool:
    """Whether check_cu_seqlens_values passes cu, on the host or through the device path."""
    with monkeypatch.context() as m:
        m.setattr(validate, "_values_readable", lambda t: readable)
        try:
            validate.check_cu_seqlens_values("cu", cu, total, "total", bound, None if bound is None else "max",
                                             exact=exact)
        except (ValueError, RuntimeError) as e:
            assert isinstance(e, ValueError if readable else RuntimeError), e
            return False
    return True


def _broken(rng: torch.Generator, nseq: int, dtype) -> tuple:
    """(cu, total, true longest) from random lengths, then maybe one fault: a nonzero start, a decrease, a wrong
    end."""
    lens = torch.randint(0, 9, (nseq,), generator=rng)
    cu = torch.zeros(nseq + 1, dtype=torch.int64)
    cu[1:] = lens.cumsum(0)
    total = int(cu[-1])
    fault = int(torch.randint(0, 4, (1,), generator=rng))
    if fault == 1:
        cu[0] = 1
    elif fault == 2 and nseq:
        i = int(torch.randint(1, nseq + 1, (1,), generator=rng))
        cu[i] = cu[i - 1] - 1  # a decrease (and a wrong end when i == nseq)
    elif fault == 3:
        total += int(torch.randint(-1, 2, (1,), generator=rng)) or 1
    return cu.to(dtype).to(DEVICE), total, int(lens.max()) if nseq else 0


@pytest.mark.parametrize("nseq", [0, 1, 5, 37, 1500])  # 1500: six 256-entry blocks of the kernel's loop
def test_the_kernel_agrees_with_the_host_check(nseq, monkeypatch):
    rng = torch.Generator().manual_seed(nseq)
    cases = 0
    for trial in range(6 if nseq == 1500 else 24):
        cu, total, longest = _broken(rng, nseq, (torch.int32, torch.int64)[trial % 2])
        for bound in (None, longest, max(longest - 1, 0), torch.tensor(longest), torch.tensor(max(longest - 1, 0))):
            for exact in (True, False):
                host = _verdict(cu, total, bound, exact, True, monkeypatch)
                device = _verdict(cu, total, bound, exact, False, monkeypatch)
                assert host == device, (cu.tolist()[:12], total, bound, exact, host)
                cases += 1
    assert cases >= 60


def test_faults_past_the_first_block_are_seen(monkeypatch):
    """1500 sequences: the kernel loops over six 256-entry blocks; a decrease or the one over-long sequence in the
    last is still found."""
    lens = torch.full((1500,), 3, dtype=torch.int64)
    lens[1400] = 5  # the one sequence longer than 4
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)]).to(torch.int32).to(DEVICE)
    total = int(cu[-1])
    assert _verdict(cu, total, 5, True, False, monkeypatch)
    assert not _verdict(cu, total, 4, True, False, monkeypatch)
    assert not _verdict(cu, total, torch.tensor(4), True, False, monkeypatch)
    dec = cu.clone()
    dec[1400] = dec[1399] - 1
    assert not _verdict(dec, total, None, True, False, monkeypatch)


def _varlen(cu_q, cu_k, max_q=6, max_k=6):
    q, k, v = (torch.randn(10, 2, 16, dtype=torch.float64, device=DEVICE) for _ in range(3))
    return flashtx.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=True)


def _cu(*vals):
    return torch.tensor(vals, dtype=torch.int32, device=DEVICE)


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_a_varlen_call_launches_one_check_for_both_tensors(device_path):
    """One check kernel before the attention kernel, and none of the old check's torch ops (11 per tensor)."""
    kernels = []

    def record(kernel, grid, args):
        kernels.append(kernel.fn.__name__)
        if kernel.fn.__name__ == "_cu_seqlens_check":
            args["FLAG"].fill_(1)

    ops = _Ops()
    with launch.stub_launches(record), torch.no_grad(), ops:
        _varlen(_cu(0, 4, 10), _cu(0, 3, 10))
    assert kernels == ["_cu_seqlens_check", "_attn_fwd"], kernels
    assert ops.ops.count("aten._assert_async.msg") == 2, ops.ops
    assert not [o for o in ops.ops if o.split(".")[1] in ("sub", "eq", "ge", "le", "all", "max", "bitwise_and")], ops.ops


def test_valid_tensors_pass_with_the_host_paths_result(monkeypatch):
    cu_q, cu_k = _cu(0, 4, 10), _cu(0, 7, 10)
    torch.manual_seed(0)
    want = _varlen(cu_q, cu_k, 6, 7)
    monkeypatch.setattr(validate, "_values_readable", lambda t: False)
    torch.manual_seed(0)
    assert torch.equal(_varlen(cu_q, cu_k, 6, 7), want)


@pytest.mark.parametrize("triton_check", [True, False], ids=["kernel", "torch-ops"])
@pytest.mark.parametrize("which,cu_q,cu_k,max_q,max_k", [
    ("q", (0, 4, 20), (0, 4, 10), 6, 6),  # cu_seqlens_q ends past total_q
    ("q", (0, 7, 3), (0, 4, 10), 7, 6),  # decreases
    ("q", (0, 4, 10), (0, 4, 10), 5, 6),  # a sequence longer than max_seqlen_q
    ("k", (0, 4, 10), (1, 4, 10), 6, 6),  # starts at 1
    ("k", (0, 4, 10), (0, 4, 10), 6, torch.tensor(5)),  # longer than a tensor max_seqlen_k (read on the device)
])
def test_each_bad_tensor_is_named(device_path, monkeypatch, triton_check, which, cu_q, cu_k, max_q, max_k):
    if not triton_check:  # no Triton on the device (an old GPU): the same conditions as torch ops
        monkeypatch.setattr(_device_checks, "triton_checks", lambda *a: False)
    with pytest.raises(RuntimeError, match=f"flashtx: cu_seqlens_{which} must start at 0, never decrease and end at "
                                           f"total_{which}"):
        _varlen(_cu(*cu_q), _cu(*cu_k), max_q, max_k)


def test_the_same_tensor_for_q_and_k_is_checked_once_each(device_path):
    """Self-attention passes one cu_seqlens object as both: the launch cache binds it to both roles."""
    cu = _cu(0, 4, 10)
    for _ in range(2):  # the second call replays the first's launch
        _varlen(cu, cu)
    with pytest.raises(RuntimeError, match="cu_seqlens_q must start"):
        _varlen(_cu(0, 4, 11), _cu(0, 4, 11))
    with pytest.raises(RuntimeError, match="cu_seqlens_k must start"):  # the replay binds k's own tensor to CU_B
        _varlen(cu, _cu(0, 4, 11))


@pytest.mark.parametrize("replay", [False, True], ids=["planned", "replayed"])
def test_one_tensor_for_q_and_k_under_one_bound_is_one_flag_and_one_assert(device_path, fresh_plans, replay):
    """Self-attention's packed batch (one cu_seqlens object, equal totals and int bounds): one flag, one device
    assert, a message naming both arguments; a different bound for k keeps two (each names its own)."""
    cu = _cu(0, 4, 10)
    if replay:
        _varlen(cu, cu)  # the check's lane from the second call
    ops = _Ops()
    with torch.no_grad(), ops:
        _varlen(cu, cu)
    assert ops.ops.count("aten._assert_async.msg") == 1, ops.ops
    ops = _Ops()
    with torch.no_grad(), ops:
        _varlen(cu, cu, 6, 7)
    assert ops.ops.count("aten._assert_async.msg") == 2, ops.ops
    bad = _cu(0, 4, 11)
    with pytest.raises(RuntimeError, match=r"cu_seqlens_q \(= cu_seqlens_k\) must start at 0, never decrease and end "
                                           r"at total_q \(q.shape\[0\]\) \(= total_k \(k.shape\[0\]\)\) = 10"):
        _varlen(bad, bad)


def test_varlen_rope_checks_on_the_device(device_path):
    x = torch.randn(10, 2, 8, dtype=torch.float64, device=DEVICE)
    cos = torch.rand(16, 4, dtype=torch.float64, device=DEVICE)
    kernels = []

    def record(kernel, grid, args):
        kernels.append(kernel.fn.__name__)
        if kernel.fn.__name__ == "_cu_seqlens_check":
            args["FLAG"].fill_(1)

    with launch.stub_launches(record):
        flashtx.apply_rotary(x, cos, cos, cu_seqlens=_cu(0, 4, 10), max_seqlen=6)
    assert kernels == ["_cu_seqlens_check", "_rotary_kernel"], kernels
    with pytest.raises(RuntimeError, match="flashtx: cu_seqlens must start at 0"):
        flashtx.apply_rotary(x, cos, cos, cu_seqlens=_cu(0, 4, 9), max_seqlen=6)


def test_a_repeated_check_is_planned_once_and_still_catches_bad_values(device_path, monkeypatch, fresh_plans):
    """The check of a repeated call signature (int bounds) is replayed from its plan (flashtx._validate._check_lane:
    the launch-cache entry and messages, one dict lookup): the op's path runs once, the first time; every later
    call still launches the check on its own tensors and asserts each flag, so bad values of either tensor are
    caught and named; a tensor bound goes through the op."""
    op_calls = []
    real = _device_checks.assert_cu_seqlens
    monkeypatch.setattr(_device_checks, "assert_cu_seqlens", lambda *a: op_calls.append(1) or real(*a))
    builds = []
    real_build = validate._build_check_lane
    monkeypatch.setattr(validate, "_build_check_lane", lambda specs: builds.append(1) or real_build(specs))
    for _ in range(3):
        _varlen(_cu(0, 4, 10), _cu(0, 3, 10), 6, 7)
    assert builds == [1] and op_calls == []  # planned once, never the op's path
    for which, cu_q, cu_k in (("q", (0, 7, 3), (0, 3, 10)), ("k", (0, 4, 10), (0, 8, 10)),
                              ("q", (0, 3, 10), (0, 3, 10))):  # decreases, too long for max 7, too long for max 6
        with pytest.raises(RuntimeError, match=f"cu_seqlens_{which} must start at 0"):
            _varlen(_cu(*cu_q), _cu(*cu_k), 6, 7)
    assert builds == [1] and op_calls == []
    _varlen(_cu(0, 4, 10), _cu(0, 3, 10), 6, torch.tensor(7))  # a tensor bound: the op's check
    assert op_calls == [1]
    with pytest.raises(RuntimeError, match="cu_seqlens_k must start at 0"):
        _varlen(_cu(0, 4, 10), _cu(0, 2, 10), 6, torch.tensor(7))
