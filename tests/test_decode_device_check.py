"""flash_attn_with_kvcache's index check as a GPU runs it (values not readable on the host): one
Triton kernel (triton_kernels/decode_check.py) writes a flag that one torch._assert_async checks,
before the append and attention kernels. On CPU the assert raises at once, so these tests force the
device path (flashtx.decode._values_readable -> False, as tests/test_attention_masks.py does for
_validate) and run the kernel in the interpreter: valid inputs compute the same as the host path,
each kind of bad index raises and writes nothing, and kernel and host agree on random indices.
Also: the decode launches are replayed from the launch cache exactly as planned."""
import pytest
import torch
from conftest import DEVICE, poisoned_allocations, same_launch_args
from test_decode import make_cache, rand

import flashtx
import flashtx.decode as fd
from flashtx.triton_kernels import decode as tk_decode
from flashtx.triton_kernels import launch

MESSAGE = "flashtx.flash_attn_with_kvcache: index out of range"
# The GPU's branch forced on CPU: the assert raises at once there. On a GPU a device-side assert ends the CUDA context
# instead, so the GPU half runs in processes of its own (tests/test_device_asserts_gpu.py).
pytestmark = pytest.mark.skipif(DEVICE != "cpu", reason="forces the GPU branch on CPU; on a GPU: "
                                                        "test_device_asserts_gpu.py")


@pytest.fixture
def device_path(monkeypatch, cuda_assert_rule):
    monkeypatch.setattr(fd, "_values_readable", lambda t: False)


def _args(page=16, B=2, lens=(3, 40), cap=64):
    kc, vc, bt = make_cache(B, 2, 16, cap, torch.float64, page, extra_rows=2 if page is None else 0)
    ang = torch.arange(cap)[:, None].double() * torch.rand(1, 4, dtype=torch.float64)
    return dict(q=rand(B, 1, 4, 16, dtype=torch.float64), k_cache=kc, v_cache=vc,
                k=rand(B, 1, 2, 16, dtype=torch.float64), v=rand(B, 1, 2, 16, dtype=torch.float64), block_table=bt,
                cache_seqlens=torch.tensor(lens, dtype=torch.int32, device=DEVICE), causal=True,
                rotary_cos=ang.cos().float().to(DEVICE), rotary_sin=ang.sin().float().to(DEVICE))


def _run(a):
    with torch.no_grad():
        return flashtx.flash_attn_with_kvcache(**a, return_softmax_lse=True)


def _clone(a):
    return {n: t.clone() if isinstance(t, torch.Tensor) else t for n, t in a.items()}


@pytest.mark.parametrize("page", [None, 16])
def test_valid_inputs_pass_with_the_host_paths_results(page, monkeypatch, cuda_assert_rule):
    a = _args(page)
    if page is None:
        a.update(cache_batch_idx=torch.tensor([3, 0], dtype=torch.int32, device=DEVICE))
    a.update(cache_leftpad=torch.tensor([1, 40], dtype=torch.int32, device=DEVICE))  # leftpad == end - 1 for b = 1
    if page is not None:
        a["block_table"][0, 1:] = 10_000  # pages past sequence 0's length: never read, never checked
    host = _clone(a)
    want = _run(host)
    monkeypatch.setattr(fd, "_values_readable", lambda t: False)
    got = _run(a)
    for w, g in zip(want, got):
        assert torch.equal(w, g)
    assert torch.equal(a["k_cache"], host["k_cache"]) and torch.equal(a["v_cache"], host["v_cache"])


def test_the_check_is_launched_first_and_is_the_only_extra_device_op(device_path):
    """One check kernel before the append and attention kernels, and no torch ops of the old check."""
    a = _args(16)
    a.update(cache_leftpad=torch.zeros(2, dtype=torch.int32, device=DEVICE))
    kernels = []

    def record(kernel, grid, args):
        kernels.append(kernel.fn.__name__)
        if kernel.fn.__name__ == "_decode_check":
            args["FLAG"].fill_(1)

    with launch.stub_launches(record), torch.no_grad():
        flashtx.flash_attn_with_kvcache(**a)
    assert kernels == ["_decode_check", "_kv_append", "_decode_fwd"], kernels


BAD = {
    "seqlens past the cache with the append": lambda a: a["cache_seqlens"].fill_(64),  # 64 + 1 > 4 pages of 16
    "negative seqlens": lambda a: a["cache_seqlens"].__setitem__(0, -1),
    "leftpad past the end": lambda a: a.update(cache_leftpad=torch.tensor([0, 42], dtype=torch.int32, device=DEVICE)),
    "negative leftpad": lambda a: a.update(cache_leftpad=torch.tensor([-1, 0], dtype=torch.int32, device=DEVICE)),
    "used page out of range": lambda a: a["block_table"].__setitem__((1, 2), a["k_cache"].shape[0]),
    "used page negative": lambda a: a["block_table"].__setitem__((0, 0), -1),
    "appended page out of range": lambda a: (a["cache_seqlens"].__setitem__(0, 16),
                                             a["block_table"].__setitem__((0, 1), 999)),  # token 16: page 1
    "rotary positions past the table": lambda a: a.update(rotary_cos=a["rotary_cos"][:40], rotary_sin=a["rotary_sin"][:40]),
}


@pytest.mark.parametrize("bad", list(BAD))
def test_each_bad_index_raises_and_writes_nothing(device_path, bad):
    a = _args(16)
    BAD[bad](a)
    kc0, vc0 = a["k_cache"].clone(), a["v_cache"].clone()
    with pytest.raises(RuntimeError, match=MESSAGE):
        _run(a)
    assert torch.equal(a["k_cache"], kc0) and torch.equal(a["v_cache"], vc0), "a refused call must not write"


def test_contiguous_cache_batch_idx_and_the_message(device_path):
    a = _args(None)
    a.update(cache_batch_idx=torch.tensor([0, 4], dtype=torch.int32, device=DEVICE))  # 4 rows: 0..3
    kc0 = a["k_cache"].clone()
    with pytest.raises(RuntimeError, match=MESSAGE) as info:
        _run(a)
    assert torch.equal(a["k_cache"], kc0)
    msg = str(info.value)
    for name in ("cache_seqlens", "cache_batch_idx", "rotary_cos", "run on CPU for the entry"):
        assert name in msg, (name, msg)
    assert "block_table" not in msg and "cache_leftpad" not in msg  # only the arguments checked
    a["cache_batch_idx"][1] = -1
    with pytest.raises(RuntimeError, match=MESSAGE):
        _run(a)


@pytest.mark.parametrize("checker", ["triton", "torch ops"])
def test_a_repeated_cache_row_is_refused_when_appending(device_path, monkeypatch, checker):
    """Two sequences appending into one cache row would race on a GPU: the device check refuses a repeated
    cache_batch_idx when k, v are appended (the check kernel, or the torch-ops check without Triton), and
    lets it pass when nothing is appended (reading one row twice is fine)."""
    if checker == "torch ops":
        monkeypatch.setattr(fd, "_triton_checks", lambda *a: False)
    a = _args(None)
    a.update(cache_batch_idx=torch.tensor([2, 2], dtype=torch.int32, device=DEVICE))
    kc0 = a["k_cache"].clone()
    with pytest.raises(RuntimeError, match=MESSAGE if checker == "triton" else "cache_batch_idx"):
        _run(a)
    assert torch.equal(a["k_cache"], kc0)
    a.update(k=None, v=None)
    _run(a)


def test_an_unused_out_of_range_page_passes(device_path):
    a = _args(16, lens=(3, 40))
    a["block_table"][0, 1:] = -7  # sequence 0 ends at 4 (page 0): its other entries are never read
    a["block_table"][1, 3] = 999  # sequence 1 ends at 41 (pages 0-2)
    host = _clone(a)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(fd, "_values_readable", lambda t: True)
        want = _run(host)
    got = _run(a)
    assert all(torch.equal(w, g) for w, g in zip(want, got))
    assert torch.equal(a["k_cache"], host["k_cache"])


def test_the_flag_is_always_written(device_path):
    """An allocation that happens to read as 'ok' (poisoned: -1) must not let a bad call through."""
    a = _args(16)
    a["cache_seqlens"][1] = 100
    with poisoned_allocations(), pytest.raises(RuntimeError, match=MESSAGE):
        _run(a)


def test_kernel_and_host_agree_on_random_indices(cuda_assert_rule):
    """fd._check_ranges on the device path (check kernel) raises exactly when the host path does,
    for random lengths, left pads, batch rows, tables, windows (the pages checked), rotary tables and query
    counts (int32/int64)."""
    g, g_win = torch.Generator().manual_seed(3), torch.Generator().manual_seed(4)

    def ri(lo, hi, *shape, dtype=torch.int32):
        return torch.randint(lo, hi, shape, generator=g).to(dtype)

    q4 = torch.zeros(1, 1, 1, 1)
    outcomes = []
    for trial in range(60):
        B = int(ri(1, 5))
        dtype = (torch.int32, torch.int64)[trial % 2]
        paged = trial % 3 != 0
        page, pages, rows = 16, int(ri(1, 5)), int(ri(1, 9))
        capacity = pages * page if paged else int(ri(8, 40))
        Snew, Sq = int(ri(0, 3)), int(ri(1, 4))
        lens = ri(-2, capacity + 2, B, dtype=dtype)
        leftpad = ri(-1, capacity + 3, B, dtype=dtype) if trial % 4 == 1 else None
        bidx = ri(-1, rows + 1, B, dtype=dtype) if not paged and trial % 2 else None
        bt = ri(-1, rows + 1, B, pages, dtype=dtype) if paged else None
        cos = torch.zeros(int(ri(1, capacity + 4)), 2) if trial % 5 else None
        win_left = int(torch.randint(-1, 20, (), generator=g_win)) if trial % 3 else -1  # (its own draws)
        kc = torch.zeros(rows, page if paged else capacity, 1, 1)
        q = q4.expand(B, Sq, 1, 1)
        results = []
        for mode in ("host", "op", "lane's entry"):  # the device's branch through the op, or a decoding lane's replay
            readable = mode == "host"
            entry = None
            if mode == "lane's entry":
                fresh = [t.clone() if t is not None else None for t in (lens, bidx, leftpad, bt)]  # (same signature)
                launch.LAUNCHES.clear()  # (or the op's call above made the entry, for these very tensors)
                entry = fd._check_entry(q, kc, fresh[0], fresh[1], fresh[2], fresh[3], cos, Snew, capacity,
                                        trial % 2 == 0, win_left)
                assert type(entry) is list
            with pytest.MonkeyPatch.context() as m:
                m.setattr(fd, "_values_readable", lambda t: readable)
                try:
                    fd._check_ranges(q, kc, lens, bidx, leftpad, bt, cos, Snew, capacity, trial % 2 == 0, win_left,
                                     entry)
                    results.append(True)
                except (ValueError, RuntimeError) as e:
                    assert isinstance(e, ValueError if readable else RuntimeError)
                    results.append(False)
        assert results[0] == results[1] == results[2], (trial, lens, leftpad, bidx, bt,
                                                        cos is not None and cos.shape, Snew, Sq, win_left)
        outcomes.append(results[0])
    assert 10 <= sum(outcomes) <= 50, sum(outcomes)  # both outcomes well represented


def test_without_the_triton_check_torch_ops_check_instead(device_path, monkeypatch):
    """Where Triton cannot run (no triton, an old GPU), the torch-ops check still refuses."""
    monkeypatch.setattr(fd, "_triton_checks", lambda *a: False)
    a = _args(16)
    a["block_table"][1, 0] = -1
    with pytest.raises(RuntimeError, match="block_table out of range"):
        _run(a)


# --------------------------------------------------------------------------------- launch cache
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("append", ["none", "k", "k+rotary"])
def test_decode_replays_launch_what_planning_would(device_path, splits, append):
    """Second call with fresh tensors of the same signature: the check, append and attention (and the
    combine, with the split partials it allocated) launch exactly the plans built for those tensors."""
    launch.LAUNCHES.clear()
    a = _args(16)
    if append == "none":
        a.update(k=None, v=None)
    if append != "k+rotary":
        a.update(rotary_cos=None, rotary_sin=None)
    a.update(cache_leftpad=torch.zeros(2, dtype=torch.int32, device=DEVICE), num_splits=splits)

    def call(args, rec=None):
        with launch.stub_launches(rec or (lambda kernel, grid, x: kernel.fn.__name__ == "_decode_check"
                                          and x["FLAG"].fill_(1))), torch.no_grad():
            flashtx.flash_attn_with_kvcache(**args)

    call(a)
    n = len(launch.LAUNCHES.entries)
    b = _clone(a)  # fresh tensors, same signature
    calls = []

    def rec(kernel, grid, x):
        calls.append((kernel, grid, dict(x)))
        if kernel.fn.__name__ == "_decode_check":
            x["FLAG"].fill_(1)
    call(b, rec)
    assert len(launch.LAUNCHES.entries) == n == 3 - (append == "none")
    from flashtx.triton_kernels.decode_check import plan_check
    bt, lens, lp = b["block_table"], b["cache_seqlens"], b["cache_leftpad"]
    snew = 0 if b["k"] is None else 1
    want = [plan_check(calls[0][2]["FLAG"], lens, lp, None, bt, snew=snew, capacity=64, rows=b["k_cache"].shape[0],
                       page=16, cos_rows=-1 if b["rotary_cos"] is None else 64, q_extra=0)]
    q = b["q"]
    if append != "none":
        q_out = calls[1][2]["QO"] if append == "k+rotary" else None
        want.append(tk_decode.plan_append(q, q_out, b["k"], b["v"], b["k_cache"], b["v_cache"], b["rotary_cos"],
                                          b["rotary_sin"], lens, None, bt, interleaved=True, q_same_pos=False))
        q = q_out if q_out is not None else q
    dec = calls[len(want)][2]
    out, lse = (calls[-1][2]["O"], calls[-1][2]["LSE"])
    partials = (dec["O"], dec["LSE"]) if splits > 1 else None
    want += tk_decode.plan_decode(q, b["k_cache"], b["v_cache"], out, lse, lens, lp, None, bt, None, scale=0.25,
                                  causal=True, num_splits=splits, snew=snew, partials=partials)
    assert len(calls) == len(want)
    for (kernel, grid, args), w in zip(calls, want):
        assert kernel is w.kernel and grid == w.grid + (1,) * (3 - len(w.grid))  # (a replay's grid has 3 dims)
        assert same_launch_args(args, w.args), [k for k in args if not same_launch_args({k: args[k]}, {k: w.args[k]})]


@pytest.mark.parametrize("case, Snew, Sq, win_left, leftpad, bad_page, ok", [
    ("window: the pages before it are not read", 1, 1, 5, None, 0, True),
    ("window: its first key's page is read", 1, 1, 5, None, 2, False),  # keys 35..40 (page 2 holds 32..47)
    ("an append longer than the window writes pages before it", 20, 1, 5, None, 1, False),  # writes 21..40
    ("left padding: the pages before it are not read", 1, 1, -1, 33, 1, True),
    ("left padding past the old length: the appended pages are written", 10, 1, -1, 33, 1, False),  # writes 31..40
    ("left padding on a page boundary: the page before it is not read", 1, 1, -1, 32, 1, True),  # reads 32..40
    ("left padding one key before the boundary: that page is read", 1, 1, -1, 31, 1, False),
])
def test_the_pages_checked_are_those_the_kernels_touch(case, Snew, Sq, win_left, leftpad, bad_page, ok):
    """One sequence of 41 keys after the append (16-row pages): a -1 block_table entry is refused exactly where
    the append writes or a query may read its page, on the host and by the check kernel alike."""
    lens = torch.tensor([41 - Snew], dtype=torch.int32)
    lp = torch.tensor([leftpad], dtype=torch.int32) if leftpad is not None else None
    bt = torch.tensor([[0, 1, 2, 3]], dtype=torch.int32)
    bt[0, bad_page] = -1
    kc, q = torch.zeros(4, 16, 1, 1), torch.zeros(1, 1, 1, 1).expand(1, Sq, 1, 1)
    for readable in (True, False):
        with pytest.MonkeyPatch.context() as m:
            m.setattr(fd, "_values_readable", lambda t: readable)
            try:
                fd._check_ranges(q, kc, lens, None, lp, bt, None, Snew, 64, True, win_left)
                passed = True
            except (ValueError, RuntimeError):
                passed = False
        assert passed == ok, (case, readable)


@pytest.mark.parametrize("case, lens, leftpad, ok", [
    ("a cache filled exactly to its capacity", 63, None, True),  # 63 + 1 appended = 64 = capacity
    ("one key past the capacity", 64, None, False),
    ("left padding equal to the end (no key)", 3, 4, True),  # keys [4, 4): the sequence sees nothing
    ("left padding past the end", 3, 5, False),
])
def test_the_accepted_lengths_end_exactly_where_the_host_check_ends(case, lens, leftpad, ok):
    """The boundaries of the lengths and left padding (capacity 64, one key appended), on the host and by the check
    kernel alike: the random agreement test never lands on them."""
    lens = torch.tensor([lens], dtype=torch.int32)
    lp = torch.tensor([leftpad], dtype=torch.int32) if leftpad is not None else None
    kc, q = torch.zeros(2, 64, 1, 1), torch.zeros(1, 1, 1, 1)
    for readable in (True, False):
        with pytest.MonkeyPatch.context() as m:
            m.setattr(fd, "_values_readable", lambda t: readable)
            try:
                fd._check_ranges(q, kc, lens, None, lp, None, None, 1, 64, True, -1)
                passed = True
            except (ValueError, RuntimeError):
                passed = False
        assert passed == ok, (case, "host" if readable else "check kernel")
