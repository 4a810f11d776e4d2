"""bench/tune_decode.py (python -m bench.tune --kernels decode) on CPU: the plan and its budget, the candidates'
shared-memory filter, the split multiples, the ranking and paste lines (a fake timer and a fake clock: every number
is invented), the tile-forcing context manager, and one forced call end to end in Triton's interpreter."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root, for `import bench`

from bench import tune, tune_decode as td  # noqa: E402
from flashtx.triton_kernels import configs, decode  # noqa: E402
from flashtx.triton_kernels.configs import KNOWN_TARGETS, DecodeConfig, Target, decode_config  # noqa: E402
from test_bench_tune import FakeClock  # noqa: E402  (the attention sweep's tests' clock)

H100 = KNOWN_TARGETS[90]
FAST = (64, 8, 3)  # the fake timer's fastest (block_n, warps, stages), at 2x the heuristic's splits


def fake_timer(clock, per_call_s=1.0):
    """ms = f(block_n, warps, stages, splits / heuristic's): FAST at 2x the heuristic's count wins everywhere."""
    def time_fn(d, tile, case, splits):
        clock.t += per_call_s
        h = td.heuristic_splits(tile, d, case, H100)
        miss = sum(a != b for a, b in zip((tile.block_n, tile.num_warps, tile.num_stages), FAST))
        return case[0] * case[1] / 1e6 * (1 + 0.1 * miss) * (1 + abs(splits / h - 2) / 8)
    return time_fn


def quiet(**kw):
    return dict(log=lambda *a: None, **kw)


def test_plan_order_every_tile_then_split_multiples_then_other_cases():
    clock = FakeClock()
    out = td.sweep(H100, fake_timer(clock), budget_s=1e9, clock=clock, **quiet())
    res = out["results"]
    assert not out["skipped"] and all("ms" in r for r in res)
    assert [r["d"] for r in res] == sorted((r["d"] for r in res), reverse=True)  # head dim 128, then 64
    for d in td.HEADDIMS:
        rows = [r for r in res if r["d"] == d]
        cands = td.candidates(d, H100)
        steps = [r["step"] for r in rows]
        assert steps == sorted(steps)
        s1 = [r for r in rows if r["step"] == 1]
        assert [tuple(r["tile"]) for r in s1] == [td.ident(c) for c in cands]  # the default first
        assert s1[0]["default"] and all((r["batch"], r["ctx"], r["multiple"]) == (8, 8192, 1) for r in s1)
        assert all(r["splits"] == r["heuristic_splits"] for r in s1)
        s2 = [r for r in rows if r["step"] == 2]
        best3 = [tuple(r["tile"]) for r in sorted(s1, key=lambda r: r["ms"])[:td.TOP_TILES]]
        assert {tuple(r["tile"]) for r in s2} == set(best3) and {r["multiple"] for r in s2} == {2, 4, 0.5}
        s3 = [r for r in rows if r["step"] == 3]
        assert [(r["batch"], r["ctx"]) for r in s3[::3]] == list(td.CASES[1:])
        for case in td.CASES[1:]:
            at = [r for r in s3 if (r["batch"], r["ctx"]) == case]
            assert at[0]["default"] and at[0]["multiple"] == 1 and len(at) == 1 + td.TOP_PAIRS
            assert tuple(at[1]["tile"]) == (FAST[0], 64, *FAST[1:]) and at[1]["multiple"] == 2
    text = td.table(out, "FAKE-GPU", "0.0")
    assert "### D=128 B=8 ctx=8192" in text and "| 128, 64, 4, 2 (default) | 4 (1x) |" in text


def test_budget_cuts_the_plan_and_says_what_was_not_timed():
    clock = FakeClock()
    out = td.sweep(H100, fake_timer(clock, per_call_s=5.0), budget_s=30, clock=clock, **quiet())
    res = out["results"]
    assert len(res) == 7 and out["skipped"]  # rows start until 30 s have passed
    assert {(r["d"], r["batch"], r["ctx"], r["step"]) for r in res} == {(128, 8, 8192, 1)}
    assert "Not timed (budget)" in td.table(out, "FAKE-GPU", "0.0")


def test_a_failing_tile_is_recorded_and_a_broken_gpu_or_sigint_stops_the_sweep():
    clock = FakeClock()
    timer = fake_timer(clock)

    def time_fn(d, tile, case, splits):
        if tile.num_stages == 4:
            raise RuntimeError("OutOfResources (fake)")
        return timer(d, tile, case, splits)
    out = td.sweep(H100, time_fn, budget_s=1e9, clock=clock, **quiet())
    assert any("OutOfResources" in r.get("error", "") for r in out["results"]) and not out["skipped"]
    assert "failed: RuntimeError: OutOfResources" in td.table(out, "FAKE-GPU", "0.0")
    out = td.sweep(H100, time_fn, budget_s=1e9, clock=clock, healthy=lambda: False, **quiet())
    assert "error" in out["results"][-1] and out["skipped"][0].startswith("stopped: the GPU failed after D=128")
    calls = []

    def interrupted(d, tile, case, splits):
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return timer(d, tile, case, splits)
    out = td.sweep(H100, interrupted, budget_s=1e9, clock=clock, **quiet())
    assert len(out["results"]) == 3 and out["skipped"] == ["interrupted (SIGINT): the rest was not timed"]


def test_progress_gets_every_row_and_copy_bandwidth_gives_percentages():
    clock, seen = FakeClock(), []
    copies = []

    def copy_fn(case, d):
        copies.append((case, d))
        return 2 * td.kv_bytes(case, d) / 2e9  # ms of a copy at 2 TB/s (read + write)
    out = td.sweep(H100, fake_timer(clock), budget_s=1e9, clock=clock, copy_fn=copy_fn,
                   progress=lambda o: seen.append(len(o["results"])), headdims=(128,), **quiet())
    assert seen == list(range(1, len(out["results"]) + 1))
    assert copies == [(c, 128) for c in td.CASES]  # once per case
    r = out["results"][0]
    assert r["gbps"] == pytest.approx(td.kv_bytes((8, 8192), 128) / (r["ms"] * 1e6))
    assert r["pct_copy"] == pytest.approx(100 * r["gbps"] / 2000)


def test_candidates_fit_the_targets_shared_memory_default_first():
    assert td.shared_memory(DecodeConfig(128, 64, 4, 2), 128, 128) == 128 * 256 * 2 + 64 * 128 * 2 + 8192
    assert td.shared_memory(DecodeConfig(128, 64, 4, 3), 128, 128) == 2 * 128 * 256 * 2 + 64 * 128 * 2 + 8192
    for d in (128, 64):
        full = td.candidates(d, H100)
        assert full[0] == decode_config(d, d, 2, H100) and len({td.ident(c) for c in full}) == len(full)
        assert all(td.shared_memory(c, d, d) <= H100.max_shared for c in full[1:])
        small = Target(86, 101_376, sm_count=82)  # sm_86
        cut = td.candidates(d, small)
        assert cut[0] == full[0] and 1 < len(cut) < len(full)
        assert all(td.shared_memory(c, d, d) <= small.max_shared for c in cut[1:])
        assert {td.ident(c) for c in full[1:] if td.shared_memory(c, d, d) <= small.max_shared} == \
            {td.ident(c) for c in cut[1:]}
    cands = td.candidates(128, H100)  # 256 keys: 2 stages fit (155,648 bytes by the estimate), 3 do not
    assert any(c.block_n == 256 and c.num_stages == 2 for c in cands)
    assert not any(c.block_n == 256 and c.num_stages > 2 for c in cands)
    assert len(td.candidates(64, H100)) == 18  # every (block_n, warps, stages) fits at head dim 64


def test_split_multiples_are_clamped_and_deduplicated():
    assert td.split_multiples(29, 64) == [(1, 29), (2, 58), (4, 64), (0.5, 14)]
    assert td.split_multiples(1, 64) == [(1, 1), (2, 2), (4, 4)]  # 0.5x: 1 again
    assert td.split_multiples(40, 50) == [(1, 40), (2, 50), (0.5, 20)]  # 4x: the 50 key tiles again
    assert td.split_multiples(100, 1000) == [(1, 100), (2, decode.MAX_SPLITS), (0.5, 50)]
    assert td.split_multiples(4, 1) == [(1, 1)]
    # the heuristic per tile: flash-attn 2's rule with decode_programs_per_sm programs an SM (2 at 4 warps, 1 at 8)
    assert td.heuristic_splits(DecodeConfig(128, 64, 4, 2), 128, (8, 8192), H100) == 4
    assert td.heuristic_splits(DecodeConfig(128, 64, 8, 2), 128, (1, 8192), H100) == \
        decode.num_splits_heuristic(8, 132, 64, decode.MAX_SPLITS)


def test_ranking_and_paste_lines_pick_the_fastest_tile():
    clock = FakeClock()
    out = td.sweep(H100, fake_timer(clock), budget_s=1e9, clock=clock, **quiet())
    ranked = td.rank(out["results"])
    for d in td.HEADDIMS:
        tile, mult, gm, cases = ranked[d][0]
        assert tile == (FAST[0], 64, *FAST[1:]) and mult == 2 and gm < 1 and cases == len(td.CASES)
    lines = td.paste_lines(out["results"], "FAKE-GPU", "0.0", date="2099-01-01")
    first = [next(x for x in lines if x.startswith(f"{d}: ")) for d in td.HEADDIMS]
    assert first[0].startswith('128: DecodeConfig(64, 64, 8, 3, "bench.tune on FAKE-GPU (2099-01-01, triton 0.0): ')
    assert first[1].startswith("64: DecodeConfig(64, 64, 8, 3, ")
    assert all("at 2x the split heuristic's count" in x and x.endswith('"),') for x in first)
    assert "# splits (D=128): 2x the heuristic's was fastest in 4 of 4 cases" in lines
    text = td.table(out, "FAKE-GPU", "0.0")
    assert first[0].split(" (2099")[0] in text and "Paste into triton_kernels/configs_bandwidth.py" in text


def test_forced_tile_changes_decode_config_and_restores_it():
    forced = DecodeConfig(64, 64, 8, 3, "forced")
    before = {d: decode_config(d, d, 2, H100) for d in (64, 128)}
    decode._SPLITS["sentinel"] = 3
    with td.forced_tile(forced, 128):
        assert decode_config(128, 128, 2, H100) is forced and decode_config(96, 96, 2, H100) is forced
        assert decode_config(64, 64, 2, H100) is before[64]  # other buckets untouched
        assert "sentinel" not in decode._SPLITS  # memoised split counts (and plans, launches, lanes) dropped
    assert decode_config(128, 128, 2, H100) is before[128]
    with pytest.raises(ValueError, match="boom"):
        with td.forced_tile(forced, 64):
            assert decode_config(64, 64, 2, H100) is forced
            raise ValueError("boom")
    assert {d: decode_config(d, d, 2, H100) for d in (64, 128)} == before
    assert configs._DECODE[2][64] is before[64]


@pytest.mark.parametrize("gpu_target", [90], indirect=True, ids=["sm_90"])
def test_a_forced_tile_runs_end_to_end_in_the_interpreter(gpu_target):
    """The GPU timer's call (decode_call over make_inputs) inside forced_tile, planned as on an H100 (gpu_target):
    the interpreter runs the forced tile itself (its 64-key tiles, at the split count asked for), and a plan made
    inside is forgotten after."""
    from flashtx.triton_kernels import decode

    forced = DecodeConfig(64, 64, 8, 3, "forced")
    inputs = td.make_inputs((1, 160), 64, "cpu", torch.float16, hq=4, hkv=2)
    q, kc, vc, lens = inputs
    seen = []
    real = decode.plan_decode

    def spy(*a, **kw):
        launches = real(*a, **kw)
        seen.append((launches[0].args["BLOCK_N"], launches[0].args["NUM_SPLITS"]))
        return launches
    with pytest.MonkeyPatch.context() as m:
        m.setattr(decode, "plan_decode", spy)
        with td.forced_tile(forced, 64):
            assert decode_config(64, 64, 2, gpu_target) is forced
            out = td.decode_call([inputs], 2)()  # (B, 1, Hq, D)
        assert seen == [(64, 2)], seen
        ref = torch.nn.functional.scaled_dot_product_attention(
            q.float().transpose(1, 2), kc.float().transpose(1, 2), vc.float().transpose(1, 2), enable_gqa=True)
        assert out.shape == q.shape
        torch.testing.assert_close(out.float(), ref.transpose(1, 2), atol=2e-3, rtol=0)
        assert decode_config(64, 64, 2, gpu_target) is not forced
        td.decode_call([inputs], 2)()  # planned afresh: the shipped tile
        assert seen[-1] == (decode_config(64, 64, 2, gpu_target).block_n, 2), seen


def test_cli_accepts_decode_and_keeps_the_default_kernels(capsys):
    assert tune.parse_args([]).kernels == tune.KERNELS == ("attn_fwd", "attn_bwd_dkdv", "attn_bwd_dq")
    assert tune.parse_args(["--kernels", "decode"]).kernels == ("decode",)
    assert tune.parse_args(["--kernels", "attn_fwd,decode"]).kernels == ("attn_fwd", "decode")
    for argv, what in ((["--kernels", "attn_fwd,decod"], "'decod' is unknown"),
                       (["--decode-budget-s", "0"], "--decode-budget-s: got 0.0")):
        with pytest.raises(SystemExit):
            tune.parse_args(argv)
        err = capsys.readouterr().err
        assert what in err and ("decode" in err)
    assert tune.main(["--kernels", "decode"]) == 0  # no GPU here: says so
    assert "no CUDA GPU here" in capsys.readouterr().out


def _fake_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "FAKE-GPU")
    empty = torch.empty  # (no CUDA here: main's probe tensor)
    monkeypatch.setattr(torch, "empty", lambda *a, **k: torch.zeros(1) if k.get("device") == "cuda" else empty(*a, **k))
    from flashtx.triton_kernels import launch
    monkeypatch.setattr(launch, "target_for", lambda t: H100)
    monkeypatch.setattr(td, "gpu_timers", lambda: (fake_timer(FakeClock()), lambda case, d: 1.0,
                                                   {"timer": "fake"}))


def test_main_writes_the_decode_rows_to_the_json(tmp_path, monkeypatch, capsys):
    _fake_gpu(monkeypatch)
    monkeypatch.setattr(tune, "gpu_time_fn", lambda: pytest.fail("the attention sweep ran"))
    path = tmp_path / "tune.json"
    assert tune.main(["--kernels", "decode", "--json", str(path), "--write-cache"]) == 0
    data = json.loads(path.read_text())
    assert data["gpu"] == "FAKE-GPU" and "torch" in data and "triton" in data and data["results"] == []
    assert data["decode"]["timer"] == "fake" and len(data["decode"]["results"]) > 20
    assert {r["d"] for r in data["decode"]["results"]} == set(td.HEADDIMS)
    text = capsys.readouterr().out
    assert "Decode sweep on FAKE-GPU" in text and "cached:" not in text  # --write-cache ignores decode


def test_main_runs_decode_first_then_the_attention_kernels(tmp_path, monkeypatch):
    _fake_gpu(monkeypatch)
    order = []
    monkeypatch.setattr(td, "sweep", lambda *a, **k: order.append("decode") or
                        {"results": [], "copy": [], "skipped": [], "elapsed_s": 0.0})
    monkeypatch.setattr(tune, "sweep", lambda *a, **k: order.append(("attn", k["kernels"])) or
                        {"results": [], "skipped": [], "elapsed_s": 0.0})
    path = tmp_path / "tune.json"
    assert tune.main(["--kernels", "attn_fwd,decode", "--json", str(path)]) == 0
    assert order == ["decode", ("attn", ("attn_fwd",))]
    assert "decode" in json.loads(path.read_text())
