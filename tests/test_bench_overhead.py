"""bench/overhead.py (host overhead, issue 12 item 3) runs on CPU and reports every row.

No timing is checked here: the numbers depend on the machine and its load, and a timed test would
fail from noise. `python -m bench.overhead` and `pytest bench --benchmark-only -k overhead` record
them; this only checks that the tool runs (launches stubbed, flashtx's Triton path through the
interpreter), prints one table row per call and writes them to its JSON.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root, for `import bench`

from bench import overhead  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU check; on a GPU run python -m bench.overhead")

EXPECTED_ROWS = ["attention fwd (no grad)", "attention fwd (with grad)", "attention bwd", "attention fwd+bwd",
                 "flash_attn_func fwd (no grad)", "patched SDPA fwd (no grad)", "rope q+k fwd", "rope q+k bwd",
                 "swiglu fwd", "swiglu bwd", "flash_attn_func window+softcap fwd+bwd", "attention key_mask fwd+bwd",
                 "attention learned bias fwd+bwd (its gradient summed over the batch)",
                 "varlen fwd+bwd, the GPU's cu_seqlens check", "decode step (append + attend)",
                 "attention decode step, transformers' padded form (no grad)", "decode step, the GPU's index check"]


def test_overhead_tool_reports_every_row(tmp_path, capsys):
    assert overhead.ROW_NAMES == EXPECTED_ROWS
    out = tmp_path / "overhead.json"
    assert overhead.main(["--repeats", "3", "--calls", "3", "--warmup", "2", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    for name in EXPECTED_ROWS:
        assert f"| {name} |" in text, name
    assert "Met " in text and f"of {len(EXPECTED_ROWS)} rows" in text
    data = json.loads(out.read_text())
    assert data["environment"]["device"] == "cpu" and "stub" in data["environment"]["mode"]
    assert data["environment"]["clock"] == "thread CPU time" and "| thread CPU time |" in text
    assert "| flashtx / baseline (<= 2x) |" in text  # the inverse direction of every other ratio, labelled
    rows = {r["row"]: r for r in data["rows"]}
    assert {r["clock"] for r in rows.values()} == {"thread CPU time"}  # CPU: the backward runs on the caller
    assert {r["ratio_basis"] for r in rows.values()} == {"launches stubbed"}  # no GPU: no launch to count
    assert list(rows) == EXPECTED_ROWS
    for r in rows.values():
        assert r["us_per_call"] > 0 and r["baseline_us_per_call"] > 0 and r["launches_per_call"] >= 1, r
        assert r["met"] == (r["met_ratio"] and r["met_target"] is not False)
    # the launches each call makes (what stub_launches replaced): fwd 1, bwd preprocess + dK/dV + dQ
    assert rows["attention fwd (no grad)"]["launches_per_call"] == 1
    assert rows["attention bwd"]["launches_per_call"] == 3 and rows["attention fwd+bwd"]["launches_per_call"] == 4
    assert rows["decode step (append + attend)"]["launches_per_call"] == 2  # append, attend (CPU: host-checked)
    # fwd, then preprocess + dK/dV + dQ, replayed with the bias gradient's buffer and reduce (a cached entry)
    assert rows["attention learned bias fwd+bwd (its gradient summed over the batch)"]["launches_per_call"] == 4
    assert rows["decode step, the GPU's index check"]["launches_per_call"] == 3  # + the check kernel first
    assert rows["flash_attn_func window+softcap fwd+bwd"]["launches_per_call"] == 4
    assert rows["attention key_mask fwd+bwd"]["launches_per_call"] == 4
    assert rows["attention decode step, transformers' padded form (no grad)"]["launches_per_call"] == 1
    assert rows["varlen fwd+bwd, the GPU's cu_seqlens check"]["launches_per_call"] == 5  # the check kernel first
    assert {r["target_us"] for r in rows.values()} == {25.0, 80.0, 15.0, None}
    # the no-op autograd floor, timed in the same rounds, for the rows that go through autograd
    floored = {"attention fwd (with grad)", "attention bwd", "attention fwd+bwd", "rope q+k bwd", "swiglu bwd"}
    assert {n for n, r in rows.items() if r["floor_us_per_call"] is not None} == floored
    assert all(rows[n]["floor_us_per_call"] > 0 for n in floored)
    # calls with a lane (and their backward), also timed with the lanes off (the ops' general path)
    laned = {"attention fwd (no grad)", "attention fwd (with grad)", "attention bwd", "attention fwd+bwd",
             "flash_attn_func fwd (no grad)", "patched SDPA fwd (no grad)", "rope q+k fwd", "rope q+k bwd",
             "swiglu fwd", "swiglu bwd", "flash_attn_func window+softcap fwd+bwd", "attention key_mask fwd+bwd",
             "attention learned bias fwd+bwd (its gradient summed over the batch)",
             "varlen fwd+bwd, the GPU's cu_seqlens check", "decode step (append + attend)",
             "attention decode step, transformers' padded form (no grad)", "decode step, the GPU's index check"}
    assert {n for n, r in rows.items() if r["general_path_us_per_call"] is not None} == laned
    assert all(rows[n]["general_path_us_per_call"] > 0 for n in laned)


def test_verdicts():
    r = overhead.Result("x", 25.0, "b", ours_us=30.0, base_us=20.0)
    assert r.met_target is False and r.met_ratio and not r.met
    r = overhead.Result("x", None, "b", ours_us=30.0, base_us=10.0)
    assert r.met_target is None and not r.met_ratio and not r.met
    r = overhead.Result("x", 25.0, "b", ours_us=20.0, base_us=10.0)
    assert r.met
    env = {"device": "cpu", "mode": "m", "cpu": "c", "dtype": "f", "torch": "t", "triton": "t", "flashtx": "f"}
    text = overhead.table([overhead.Result("x", 15.0, "b", 20.0, 20.0, floor_us=16.0)], env)
    assert "MISSED: 1.3x the target (the target is below the floor)" in text and "| 16.0 |" in text
    assert "MISSED: 1.2x the target" in overhead.table([overhead.Result("x", 25.0, "b", 30.0, 20.0)],
                                                       {"device": "cpu", "mode": "m", "cpu": "c", "dtype": "f",
                                                        "torch": "t", "triton": "t", "flashtx": "f"})


def _work_on_another_thread():
    """What autograd does with CUDA tensors: the backward runs on its per-device worker thread while the caller
    waits (a join here). About 3 ms of CPU work on the other thread, none on the caller's."""
    import threading

    def work():
        sum(i * i for i in range(100_000))
    t = threading.Thread(target=work)
    t.start()
    t.join()


def test_gpu_rounds_count_the_autograd_worker_thread(monkeypatch):
    """On a GPU the rounds are timed with the process's CPU time: the backward of CUDA tensors (flashtx's Python
    backward included) runs on autograd's worker thread, which time.thread_time_ns (the caller's thread) never
    saw. On CPU the caller's thread time stays: there the backward runs on the calling thread."""
    monkeypatch.setattr(overhead, "_sync", lambda dev: None)  # no CUDA here: pretend, without synchronizing
    solo = overhead.time_pair([lambda: sum(i * i for i in range(100_000))], "cpu", 3, 1, 0)[0]
    (gpu,) = overhead.time_pair([_work_on_another_thread], "cuda", 3, 1, 0)
    (cpu,) = overhead.time_pair([_work_on_another_thread], "cpu", 3, 1, 0)
    assert min(gpu) > 0.5 * min(solo), (gpu, solo)  # the other thread's work is counted
    assert min(cpu) < 0.25 * min(solo), (cpu, solo)  # the caller's thread only waited
    assert overhead.clock_for("cuda") == "process CPU time (all threads)" and overhead.clock_for("cpu") == \
        "thread CPU time"


def test_gpu_ratio_takes_the_time_with_launch():
    """On a GPU the baseline's time includes its CUDA launch, so the <= 2x verdict takes flashtx's time with its
    launches (launch_us), not the stubbed one: 10 us stubbed, 30 us launched, against a 10 us baseline is 3x."""
    r = overhead.Result("attention fwd (no grad)", 25.0, "SDPA", ours_us=10.0, base_us=10.0, launch_us=30.0)
    assert r.ratio == 3.0 and not r.met_ratio and not r.met and r.met_target  # the us target: the stubbed time
    r.clock = "process CPU time (all threads)"  # as measure_row sets it on a GPU
    d = r.as_dict()
    assert d["ratio_basis"] == "with launch" and d["ratio"] == 3.0 and d["clock"] == "process CPU time (all threads)"
    env = {"device": "cuda", "gpu": "g", "mode": "m", "cpu": "c", "dtype": "f", "torch": "t", "triton": "t",
           "flashtx": "f", "clock": "process CPU time (all threads)"}
    text = overhead.table([r], env)
    assert "| flashtx / baseline (<= 2x), with launch |" in text and "timed with process CPU time" in text
    assert "| 3.00x | 30.0 |" in text and "MISSED: 3.0x the baseline" in text
    assert "| process CPU time (all threads) |" in text
    stubbed = overhead.Result("x", 25.0, "SDPA", ours_us=10.0, base_us=10.0)  # CPU: no launch
    assert stubbed.ratio == 1.0 and stubbed.as_dict()["ratio_basis"] == "launches stubbed"
