"""The benchmark pipeline end to end without a GPU: the bench, models and report steps of
bench/device_check.sh (the script a lent GPU runs) under BENCH_SMOKE=1, which runs every quick
benchmark on CPU tensors at tiny shapes, flashtx through Triton's interpreter (bench/harness.py).

It checks what a GPU run depends on and a CPU can run: each quick case's builder and pass, the
providers that cannot run here skipped with a reason (never dropped silently), extra_info and its
FLOP/byte arithmetic, pytest-benchmark's JSON, the merge of the model benchmark into it,
bench.report's tables and PNG plots, and the script's steps, budget and summary. The times are
not looked at: a smoke run's times mean nothing (the JSON and the report say so).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the repo root, for `import bench`

from bench import overhead, report  # noqa: E402

# flashtx's quick cases: attention 3 passes x causal/full x N in {2k, 8k}; GQA 3 passes at 2k;
# 4 variants x (fwd, fwd+bwd); Swin's window attention with a learned bias (fwd+bwd); RoPE and SwiGLU x (fwd, bwd) x (4k, 16k tokens); two decode cases (attend, RoPE +
# append + attend); the model training step;
# bench/overhead.py's rows (each one once).
FLASHTX_CASES = {("attention", "mha"): 15, ("attention", "gqa"): 3, ("attention-variant", ""): 8,
                 ("attention-bias", ""): 1,
                 ("rope", ""): 4, ("swiglu", ""): 4, ("decode", ""): 2, ("model-train", ""): 1,
                 ("overhead", ""): len(overhead.ROWS)}
ATTENTION_PROVIDERS = ["flashtx", "eager", "sdpa-flash", "sdpa-efficient", "sdpa-cudnn", "sdpa-math", "flex",
                       "xformers", "flash_attn"]


pytestmark = [pytest.mark.skipif(
    __import__("torch").cuda.is_available(),
    reason="a GPU is here: bench/device_check.sh runs the real benchmarks; the smoke run is for machines without one"),
    pytest.mark.xdist_group("bench-smoke")]  # the module fixture runs once: one xdist worker (--dist loadgroup)


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """Run the script once: (returncode, log text, $OUT folder)."""
    out = tmp_path_factory.mktemp("device_out")
    # not an xdist worker's variables: pytest-benchmark would take the script's pytest runs for xdist workers
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")},
           "BENCH_SMOKE": "1", "OUT": str(out), "PYTHON": sys.executable,
           "DEVICE_CHECK_STEPS": "bench,models,report",
           "DEVICE_CHECK_BENCH_K": "",  # every quick case (unset: "not d128", the GPU run's default)
           "DEVICE_CHECK_TIME_SCALE": "4"}  # CI's 2 cores: the interpreter is slow, and limits must not bite
    for k in ("BENCH_DTYPE", "BENCH_BUDGET_S", "BENCH_STEADY", "DEVICE_CHECK_COMMIT", "DEVICE_CHECK_BUDGET_S"):
        env.pop(k, None)
    proc = subprocess.run(["bash", str(ROOT / "bench" / "device_check.sh")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=1800)
    return proc.returncode, proc.stdout + proc.stderr, out


def _records(out: Path) -> list[dict]:
    return [b["extra_info"] for b in json.loads((out / "bench.json").read_text())["benchmarks"]]


def test_script_runs_the_bench_steps_and_exits_0(smoke):
    rc, log, out = smoke
    assert rc == 0, log[-6000:]
    summary = log[log.index("=== summary"):]
    for step in ("pytest bench --quick: ok", "pytest bench/test_models.py: ok", "bench.report: ok"):
        assert step in summary, summary
    for skipped in ("install", "python -m flashtx", "pytest tests (GPU-only files)", "pytest tests (the rest, on GPU)",
                    "bench.gpu_checks"):
        assert f"=== {skipped} (" not in log  # not asked for
    assert (out / "log.txt").read_text().count("=== summary") == 1
    assert sorted(p.name for p in out.iterdir()) == ["bench.json", "log.txt", "report"]
    assert "fullgraph" in summary  # the models step's fullgraph outcome is in the summary


def test_the_run_record_is_in_bench_json(smoke):
    """machine_info.flashtx_run: each step's verdict and seconds, the commit, the benchmarks' environment."""
    _, _, out = smoke
    run = json.loads((out / "bench.json").read_text())["machine_info"]["flashtx_run"]
    assert [(s["name"], s["verdict"]) for s in run["steps"]] == [
        ("pytest bench --quick", "ok"), ("pytest bench/test_models.py", "ok"), ("bench.report", "ok")], run
    assert all(type(s["seconds"]) is int for s in run["steps"]) and run["commit"]
    assert run["bench_env"]["BENCH_SMOKE"] == "1" and run["bench_env"]["DEVICE_CHECK_BENCH_K"] == ""
    assert run["bench_env"]["BENCH_BUDGET_S"] == "0.12"


def test_steady_state_is_sized_by_the_budget(monkeypatch):
    """bench/harness.py's back-to-back phase: about BENCH_BUDGET_S in all from the per-call estimate, 3-20 calls a
    round and 3-5 rounds (5 x 20 always took 104 s of the 150 s bench step on the 2026-11-30 H200 run)."""
    from bench import harness

    monkeypatch.setattr(harness, "SMOKE", False)
    monkeypatch.setattr(harness, "STEADY_CALLS", 20)
    monkeypatch.setattr(harness, "STEADY_ROUNDS", 5)
    monkeypatch.setattr(harness, "STEADY_MIN_CALLS", 3)
    monkeypatch.setattr(harness, "STEADY_MIN_ROUNDS", 3)
    monkeypatch.setattr(harness, "BUDGET_S", 0.12)
    plan = {est: harness.steady_plan(est) for est in (0.05, 1.0, 4.0, 10.0, 50.0, 5000.0)}
    assert plan == {0.05: (5, 20), 1.0: (5, 20), 4.0: (5, 6), 10.0: (4, 3), 50.0: (3, 3), 5000.0: (3, 3)}, plan
    for est, (rounds, calls) in plan.items():
        if rounds * calls > 9:  # above the 3 x 3 floor: within the budget
            assert rounds * calls * est / 1e3 <= 0.12 + 1e-9, (est, rounds, calls)
    assert harness.steady_plan(None) == harness.steady_plan(0.0) == harness.steady_plan(float("nan")) == (5, 20)


def test_launch_bound_cases_get_their_kernel_time(monkeypatch):
    """bench/harness.py on a GPU (stood in: SMOKE off, a fake torch.profiler): a case whose back-to-back time was
    launch-bound also records kernel_ms, the summed device time of what one call launched (CUDA activity only,
    not the host's records), and its GB/s; one that kept the GPU busy is not profiled; a profiler that records
    no device activity or fails leaves kernel_error and no number."""
    import torch.profiler

    from bench import harness

    class Ev:
        def __init__(self, dev, us, name="_attn_bwd_dq"):
            self.device_type = torch.autograd.DeviceType.CUDA if dev else torch.autograd.DeviceType.CPU
            self.time_range = type("R", (), {"elapsed_us": lambda _self: us})()
            self.name = name

    recorded = {"events": [Ev(True, 30.0), Ev(True, 10.0, "_attn_bwd_preprocess"), Ev(False, 500.0)] * 3}  # 3 calls

    class FakeProfile:
        def __init__(self, activities):
            assert torch.profiler.ProfilerActivity.CUDA in activities

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def events(self):
            if isinstance(recorded["events"], Exception):
                raise recorded["events"]
            return recorded["events"]
    monkeypatch.setattr(torch.profiler, "profile", FakeProfile)
    monkeypatch.setattr(harness, "SMOKE", False)
    monkeypatch.setattr(harness, "synchronize", lambda: None)
    calls = []
    assert harness.measure_kernel(lambda st: calls.append(st), "s", 3) == {  # 40 us of device time a call
        "kernel_ms": 0.04, "kernel_method": harness.KERNEL_METHOD, "kernel_calls": 3,
        "kernel_breakdown_us": {"_attn_bwd_dq": 30.0, "_attn_bwd_preprocess": 10.0}}  # by kernel, longest first
    assert calls == ["s"] * 4  # one untimed call, then the 3 profiled
    recorded["events"] = [Ev(False, 500.0)]
    assert harness.measure_kernel(lambda st: None, "s", 3) == {"kernel_error": "the profiler recorded no CUDA activity"}
    recorded["events"] = RuntimeError("CUPTI_ERROR_NOT_INITIALIZED (test)")
    assert "CUPTI_ERROR_NOT_INITIALIZED" in harness.measure_kernel(lambda st: None, "s", 3)["kernel_error"]

    # record_steady (run_case's last step) queues a memory-bound case whose back to back was launch-bound; after the
    # test loop, measure_deferred_kernels prepares each afresh and profiles it, within its budget
    recorded["events"] = [Ev(True, 50.0)] * 2
    monkeypatch.setattr(harness, "gpu_name", lambda: "SYNTHETIC-GPU (test)")
    monkeypatch.setattr(harness, "free_memory", lambda: None)
    monkeypatch.setattr(harness, "_KERNEL_QUEUE", [])
    infos, prepared = [], []
    for host_bound, nbytes in ((True, 1e8), (False, 1e8), (True, None), (True, 1e8)):
        info = {}
        st = {"steady_ms": 0.2, "steady_host_bound": host_bound, "steady_calls": 2, "steady_rounds": 3}
        harness.record_steady(info, lambda s: None, "s", st, nbytes=nbytes, dtype=torch.bfloat16,
                              prepare=lambda: prepared.append(1) or "s")
        assert info["steady_ms"] == 0.2 and "kernel_ms" not in info, info  # nothing profiled while cases are timed
        infos.append(info)
    assert len(harness._KERNEL_QUEUE) == 2 and not prepared  # the launch-bound memory-bound ones, not yet prepared
    ticks = iter([0.0, 0.0, 5.0])  # the budget (1 s) is spent after the first case
    assert harness.measure_deferred_kernels(budget_s=1.0, clock=lambda: next(ticks)) == 1
    assert infos[0]["kernel_ms"] == 0.05 and abs(infos[0]["gbs_kernel"] - 2000.0) < 1e-6, infos[0]
    assert "kernel_ms" not in infos[1] and "kernel_ms" not in infos[2] and "kernel_error" not in infos[1]
    assert infos[3]["kernel_error"].startswith("not timed: BENCH_KERNEL_BUDGET_S") and prepared == [1]
    assert harness._KERNEL_QUEUE == []
    # the grad mode the case ran under comes back; a provider that now skips (build_or_skip) leaves the reason
    modes = []
    st = {"steady_ms": 0.2, "steady_host_bound": True, "steady_calls": 2, "steady_rounds": 3}
    with torch.no_grad():
        harness.record_steady(infos[1], lambda s: modes.append(torch.is_grad_enabled()), "s", st, nbytes=1e8,
                              prepare=lambda: "s")

    def refuses():
        pytest.skip("xformers: refuses now (test)")
    harness.record_steady(infos[2], lambda s: None, "s", st, nbytes=1e8, prepare=refuses)
    assert harness.measure_deferred_kernels(budget_s=1e9) == 1 and modes and not any(modes)
    assert infos[1]["kernel_ms"] == 0.05 and "refuses now (test)" in infos[2]["kernel_error"], infos[2]
    # a case that asks for its time by kernel (run_case(breakdown=True)) is queued though it kept the GPU busy and
    # has no bytes, and profiled after what the targets judge (queued before it here); past BREAKDOWN_TOP kernels
    # the rest is "other"
    order, asked, judged = [], {}, {}
    busy = dict(st, steady_host_bound=False)
    harness.record_steady(asked, lambda s: order.append("asked"), "s", busy, prepare=lambda: "s", breakdown=True)
    harness.record_steady({}, lambda s: order.append("not asked"), "s", busy, prepare=lambda: "s")
    harness.record_steady(judged, lambda s: order.append("judged"), "s", st, nbytes=1e8, prepare=lambda: "s")
    few = {}  # one that names its own number of kernels (bench/test_models.py's training steps)
    harness.record_steady(few, lambda s: order.append("few"), "s", busy, prepare=lambda: "s", breakdown=True,
                          breakdown_top=1)
    recorded["events"] = [Ev(True, 50.0), Ev(True, 20.0, "_attn_bwd_dkdv"), Ev(True, 5.0, "_attn_bwd_preprocess")] * 2
    monkeypatch.setattr(harness, "BREAKDOWN_TOP", 2)
    assert harness.measure_deferred_kernels(budget_s=1e9) == 3, order
    assert order == ["judged"] * 3 + ["asked"] * 3 + ["few"] * 3, order
    assert asked["kernel_breakdown_us"] == {"_attn_bwd_dq": 50.0, "_attn_bwd_dkdv": 20.0, "other": 5.0}, asked
    assert few["kernel_breakdown_us"] == {"_attn_bwd_dq": 50.0, "other": 25.0}, few
    assert asked["kernel_ms"] == 0.075 and "gbs_kernel" not in asked and "gbs_kernel" in judged


def test_a_broken_gpu_after_a_refusal_is_an_error_not_a_skip(monkeypatch):
    """A provider that refuses (Unavailable, or an error while setting up or warming up) is skipped with the
    reason, but only after a synchronize: a sticky CUDA error (an illegal address in a probe) raises there, so
    the case errors instead of reading as a quiet skip while every later case fails."""
    from bench import harness

    monkeypatch.setattr(harness, "SMOKE", True)  # no CUDA call but the synchronize below

    def refuse():
        raise harness.Unavailable("refuses (test)")

    def crash():
        raise RuntimeError("set-up failed (test)")
    for build in (refuse, crash):
        with pytest.raises(pytest.skip.Exception, match="test"):
            harness.build_or_skip("p", build)
    syncs = []

    def broken():
        syncs.append(1)
        raise RuntimeError("CUDA error: an illegal memory access was encountered (test)")
    monkeypatch.setattr(harness, "synchronize", broken)

    class Bench:
        extra_info: dict = {}

    def raises_the_cuda_error(call):
        try:
            call()
        except pytest.skip.Exception as exc:  # the defect: a quiet skip (not one of this test's outcomes)
            pytest.fail(f"skipped where the CUDA error should raise: {exc}")
        except RuntimeError as exc:
            return "illegal memory access" in str(exc)
        return False
    for build in (refuse, crash):
        assert raises_the_cuda_error(lambda: harness.build_or_skip("p", build))
    assert raises_the_cuda_error(lambda: harness.run_case(Bench(), prepare=refuse, step=lambda s: None,
                                                          info={"provider": "p"}))
    assert len(syncs) == 3


def test_flashtx_refusing_or_falling_back_fails_its_case(monkeypatch):
    """flashtx's own rows (fail_fast) fail where it refuses a case (Unavailable: a "-" in the tables and a green run
    before) and where patch_sdpa warns that it hands the call back to torch (the "flashtx" row would time SDPA);
    other providers still skip with the reason."""
    import warnings as _warnings

    from bench import harness

    monkeypatch.setattr(harness, "SMOKE", True)

    def refuse():
        raise harness.Unavailable("refuses (test)")
    with pytest.raises(harness.Unavailable, match="test"):
        harness.build_or_skip("flashtx", refuse, fail_fast=True)

    class Bench:
        extra_info: dict = {}
    with pytest.raises(harness.Unavailable, match="test"):
        harness.run_case(Bench(), prepare=refuse, step=lambda s: None, info={"provider": "flashtx"}, fail_fast=True)
    with pytest.raises(pytest.skip.Exception, match="test"):
        harness.run_case(Bench(), prepare=refuse, step=lambda s: None, info={"provider": "p"})
    monkeypatch.setattr(harness, "PREWARM", True)  # (nothing timed after the warm-up)

    def falls_back(_):
        _warnings.warn(f"{harness.FALLBACK_WARNING} scaled_dot_product_attention: a reason (test)")
    with pytest.raises(RuntimeError, match="flashtx's row would time torch's SDPA: .*a reason"):
        harness.run_case(Bench(), prepare=lambda: None, step=falls_back, info={"provider": "flashtx"}, fail_fast=True)
    with pytest.warns(UserWarning, match="a reason"):
        harness.run_case(Bench(), prepare=lambda: None, step=falls_back, info={"provider": "p"})


def test_the_decode_append_providers_time_the_same_step(monkeypatch, standin):
    """bench/test_decode.py's RoPE + append step: flashtx's fused path, the CUDA extension's (its ops stood in by
    the float64 references behind the binding's checks: conftest's `standin`) and sdpa-eager (RoPE, index_copy_,
    SDPA) give the same output on the same inputs (q and the new k rotated at position ctx - 1, k/v appended
    there, all ctx keys attended), also when the step repeats, as it does while timed: the comparison is like
    for like."""
    from bench import harness, test_decode

    monkeypatch.setattr(harness, "DEVICE", "cpu")
    monkeypatch.setattr(test_decode, "DEVICE", "cpu")
    outs = {}
    for provider in ("flashtx", "flashtx-cuda", "sdpa-eager"):
        torch.manual_seed(0)
        step = test_decode._build_append(provider, 2, 4, 2, 48, torch.float32)
        first, again = step(), step()
        outs[provider] = first if provider != "sdpa-eager" else first.transpose(1, 2)  # (B, 1, Hq, D)
        torch.testing.assert_close(again, first, rtol=0, atol=0)
    for provider in ("flashtx", "flashtx-cuda"):
        torch.testing.assert_close(outs[provider], outs["sdpa-eager"], rtol=1e-5, atol=1e-5)


def test_the_cuda_extension_decode_provider_loads_a_build_and_never_builds(monkeypatch, tmp_path):
    """bench/test_decode.py's flashtx-cuda: skipped with the reason while there is no build (or one is being made),
    else the existing JIT build is reloaded (build(): nothing to compile) and the case runs flash_attn_with_kvcache
    with backend="cuda". A first build (a minute) never starts inside the timed step."""
    from bench import harness, test_decode
    import flashtx
    from flashtx import cuda_ext

    monkeypatch.setattr(harness, "DEVICE", "cpu")
    monkeypatch.setattr(test_decode, "DEVICE", "cpu")
    monkeypatch.setattr(cuda_ext, "load", lambda build_if_missing=None: False)
    monkeypatch.setattr(cuda_ext, "build_directory", lambda *a: str(tmp_path))
    builds, calls = [], []
    monkeypatch.setattr(cuda_ext, "build", lambda **k: builds.append(k) or "lib")
    monkeypatch.setattr(cuda_ext, "unavailable_reason",
                        lambda build_if_missing=None: None if builds else "not built: (test)")
    monkeypatch.setattr(flashtx, "flash_attn_with_kvcache", lambda *a, **k: calls.append(k))

    def build():
        return test_decode._build("flashtx-cuda", 2, 4, 2, 64, torch.float16)
    with pytest.raises(harness.Unavailable, match="no JIT build in"):
        build()
    (tmp_path / "flashtx_cuda.so").write_text("stub")
    (tmp_path / "lock").write_text("")
    with pytest.raises(harness.Unavailable, match="busy"):
        build()
    assert not builds
    (tmp_path / "lock").unlink()
    build()()
    assert len(builds) == 1 and calls[0]["backend"] == "cuda" and calls[0]["causal"] is True


def test_every_flashtx_quick_case_ran(smoke):
    _, log, out = smoke
    data = json.loads((out / "bench.json").read_text())
    assert data["machine_info"]["flashtx_bench"]["smoke"] is True
    names = [b["name"] for b in data["benchmarks"]]
    assert len(names) == len(set(names)), "the models JSON was merged twice"
    ours = [r for r in _records(out) if r["provider"] == "flashtx"]
    assert all(r["status"] == "ok" for r in ours), [r for r in ours if r["status"] != "ok"]
    counts: dict = {}
    for r in ours:
        kind = ("gqa" if r["heads"] != r["kv_heads"] else "mha") if r["op"] == "attention" else ""
        counts[(r["op"], kind)] = counts.get((r["op"], kind), 0) + 1
    assert counts == FLASHTX_CASES


def test_no_provider_is_dropped_silently(smoke):
    """Each attention provider either has results or is skipped with its reason in the log."""
    _, log, out = smoke
    ran = {r["provider"] for r in _records(out) if r["op"] == "attention"}
    assert {"flashtx", "eager", "sdpa-math"} <= ran  # these run on any CPU
    for p in set(ATTENTION_PROVIDERS) - ran:
        assert re.search(rf"SKIPPED \[\d+\] \S+: {re.escape(p)}(:| cannot)", log), f"{p}: neither ran nor skipped"
    for op in ("rope", "swiglu"):
        assert {"flashtx", "eager", "copy"} <= {r["provider"] for r in _records(out) if r["op"] == op}
    decode_providers = {r["provider"] for r in _records(out) if r["op"] == "decode" and r["pass"] == "fwd"}
    assert {"flashtx", "flashtx-attention", "flashtx-train", "copy"} <= decode_providers, decode_providers
    append_providers = {r["provider"] for r in _records(out) if r["op"] == "decode" and r["pass"] == "append-rotary"}
    assert {"flashtx", "sdpa-eager", "copy"} <= append_providers, append_providers


def test_extra_info_fields_and_arithmetic(smoke):
    from bench import gpus, harness

    _, _, out = smoke
    for r in _records(out):
        if r["status"] != "ok":
            continue
        if r["op"] == "overhead":  # bench/test_overhead.py: its own fields (host time per call, launches stubbed)
            assert r["us_per_call"] > 0 and r["baseline_us_per_call"] > 0 and r["launches_per_call"] >= 1, r
            continue
        assert r["gpu"] == harness.SMOKE_NAME and r["timing"].startswith("host clock")
        if r["op"] != "model-train":  # steady state beside the latency from idle (issue 13 item 7)
            assert r["steady_ms"] > 0 and r["steady_method"].startswith("host clock") and r["latency_ms"] == \
                r["median_ms"], r
            assert ("tflops_steady" in r) == ("tflops" in r) and ("gbs_steady" in r) == ("gbs" in r), r
            assert r["steady_calls"] == 2 and r["steady_rounds"] == 1, r  # a smoke run's fixed plan
        assert 0 < r["min_ms"] <= r["median_ms"] and 2 <= r["rounds"] <= 3, r
        s = r["median_ms"] / 1e3
        if r["op"] == "attention":
            assert r["seqlen"] in (2048 // 64, 8192 // 64) and r["batch"] == 1, r  # the smoke shapes
            flops = gpus.attention_flops(r["batch"], r["heads"], r["seqlen"], r["seqlen"], r["headdim"],
                                         r["causal"], r["pass"])
            assert r["flops"] == flops and r["tflops"] == pytest.approx(flops / s / 1e12, rel=1e-12), r
        if r["op"] in ("rope", "swiglu"):
            assert r["gbs"] == pytest.approx(r["bytes"] / s / 1e9, rel=1e-12), r
        if r["op"] == "model-train":
            assert r["tokens_per_s"] == pytest.approx(r["tokens"] / s, rel=1e-12) and r["fullgraph"] is True, r


def test_report_tables_and_plots(smoke):
    _, log, out = smoke
    md = (out / "report" / "report.md").read_text()
    assert md.startswith("# flashtx benchmark report\n\n" + report.SMOKE_BANNER)
    for section in ("## Attention\n", "## Attention, GQA", "## Attention variants", "## RoPE and SwiGLU", "## Decoding",
                    "## Model training step", "## Host overhead", "## Targets"):
        assert section in md, section
    assert "- not evaluated: this is a smoke run" in md and "MET" not in md
    models = md[md.index("## Model training step"):].splitlines()[2:5]
    assert models[-1].startswith("| gpt-smoke-2L-32d-2h-v64 | float32 | 2 | 32 | 64 |"), models
    assert "flashtx / sdpa" in models[0] and "flashtx / eager" in models[0]
    assert "matplotlib is not importable" not in md, "install the test extra: it brings matplotlib for the plots"
    for png in ("attention.png", "attention_gqa.png", "rope_swiglu.png"):
        data = (out / "report" / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000, png
    assert md in log  # the script prints the report
