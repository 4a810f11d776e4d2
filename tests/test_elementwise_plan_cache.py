"""The launch caches of the elementwise kernels (RoPE, SwiGLU) and the eager backend cache: a cached
plan equals the one built from scratch, for every target and row count, and the caches hold no
entry per token count."""
import torch

from conftest import DEVICE

from flashtx import _dispatch
from flashtx.triton_kernels import configs, launch
from flashtx.triton_kernels import swiglu as swiglu_kernels

TARGETS = [configs.INTERPRETER_TARGET, *configs.KNOWN_TARGETS.values()]


def test_pow2_bucket_is_min_of_cap_and_next_power_of_two():
    for cap in (1, 2, 4, 16, 2048):
        for n in range(-1, 3000):
            assert launch.pow2_bucket(n, cap) == min(cap, 1 << (max(n, 1) - 1).bit_length()), (n, cap)


def test_swiglu_cached_plan_matches_config_for_every_row_count():
    for target in TARGETS:
        for hidden in (1, 3, 16, 40, 256, 5000, 11008, 14336):
            for dtype in (torch.float16, torch.float32, torch.float64):
                for backward in (False, True):
                    for rows in (0, 1, 2, 3, 5, 8, 9, 100, 4096, 1 << 20):
                        st = swiglu_kernels._static(hidden, rows, dtype, backward, target)
                        cfg = configs.swiglu_config(hidden, rows, target)
                        assert st.cfg == cfg, (target, hidden, rows)
                        assert st.consts == dict(BLOCK_M=cfg.block_rows, BLOCK_H=cfg.block_cols, BACKWARD=backward,
                                                 FAST_EXP=dtype != torch.float64, ACC=launch.ACC_DTYPE[dtype])
                        assert st.n_h_tiles == -(-hidden // cfg.block_cols)


def test_swiglu_launch_args_do_not_depend_on_call_history():
    """The same call planned on a cold and on a warm cache gives the same launch."""
    g, u = torch.randn(5, 40), torch.randn(5, 40)
    out = torch.empty(5, 40)
    swiglu_kernels._STATIC.clear()
    cold = swiglu_kernels.plan_swiglu(g, u, out, target=configs.KNOWN_TARGETS[90])
    for rows in (1, 2, 3, 64, 5):  # warm it with other row counts and dtypes
        swiglu_kernels.plan_swiglu(g[:rows].double(), u[:rows].double(), out[:rows].double(),
                                   target=configs.KNOWN_TARGETS[90])
    warm = swiglu_kernels.plan_swiglu(g, u, out, target=configs.KNOWN_TARGETS[90])
    assert (cold.grid, cold.args, cold.config) == (warm.grid, warm.args, warm.config)
    assert len(swiglu_kernels._STATIC) == 2  # one entry per (hidden, dtype, direction, target), none per row count


def test_backend_by_device_answers_as_plan_kinds_and_is_cleared_with_the_plans():
    """plan_device keys on everything plan_kinds reads (requested backend, device, kinds): answers that
    differ by any of them stay apart however the cache was warmed."""
    import warnings

    dev = torch.device(DEVICE)
    cases = [("swiglu", None, (torch.float32,)), ("swiglu", "reference", (torch.float32,)),
             ("swiglu", None, (torch.float64,)), ("rotary", None, (torch.float32, torch.float32)),
             ("rotary", None, (torch.float32, torch.bfloat16)), ("rotary", "reference", (torch.float32, torch.float32))]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the bfloat16-table fallback warns on CPU
        for order in (cases, cases[::-1]):
            _dispatch.clear_plans()
            assert not _dispatch._BY_DEVICE
            got = {c: _dispatch.plan_device(c[0], c[1], dev, *c[2]) for c in order}
            _dispatch.clear_plans()
            want = {c: _dispatch.plan_kinds(c[0], c[1], dev.type, dev.index, *c[2]) for c in order}
            assert got == want
    assert want[cases[1]] == "reference" and want[cases[5]] == "reference"
