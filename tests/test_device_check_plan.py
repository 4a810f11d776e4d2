"""bench/device_check.sh's time plan, without a GPU and in seconds: the script runs with a stub PYTHON that
sleeps for each step about what it takes on a cold H200 (install 20 s, the GPU tests 130 s, 20 s under their
limit, the background prewarm 150 s, ...) times DEVICE_CHECK_TIME_SCALE, which shrinks the budget and every limit
and reserve alike.

It checks what the 2026-12 audit found broken: the default steps leave out the opt-in bisect and tma; the
timed quick benchmarks get their whole limit after the GPU tests and the prewarm, and the models and report
steps still run; a prewarm that does not stop on SIGINT is killed before it can cut into the bench step; every
step's verdict, the commit and the benchmarks' environment land in bench.json's machine_info.flashtx_run (also
when the benchmarks wrote nothing); a previous run's outputs are removed at the start.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.xdist_group("device-check-plan")  # the module fixture runs the scenarios once: one worker

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "device_check.sh"
PLAN = {"install": 60, "tests_gpu": 150, "bench": 190, "models": 80, "report": 20, "hostprof": 60}

# A stand-in for python: sleeps SIM_<STEP> plan seconds x SIM_SCALE, logs each start, end and SIGINT to SIM_LOG,
# ends on SIGINT (130) unless SIM_IGNORE_INT names the step (a hung process: only SIGKILL ends it), and on SIGTERM
# (143); the bench
# step writes a one-result JSON (unless SIM_BENCH_NOJSON=1), the report step a report.md. `-c` and `-` run the
# real python (the script's JSON merges), except the version banner and the xdist probe.
STUB = r"""#!/usr/bin/env bash
a="$*"
case "$1" in
  -c) case "$2" in
        *"import sys, torch, triton"*) echo "python stub | torch stub | GPU NONE"; exit 0;;
        "import xdist") exit 0;;
      esac; exec "$SIM_REAL_PY" "$@";;
  -) exec "$SIM_REAL_PY" "$@";;
esac
key=other d=5
case "$a" in
  *"pip install"*) key=install d=${SIM_INSTALL:-20};;
  *"pytest bench --quick -n 4"*) key=prewarm d=${SIM_PREWARM:-150};;
  *"test_models.py -n 3"*) key=prewarm_models d=${SIM_PREWARM:-150};;
  *"pytest tests/test_cuda_ext_gpu.py"*) key=cuda_ext d=${SIM_CUDA_EXT:-40}; echo "cuda ext tests (stub) ran";;
  *"pytest tests"*) key=tests_gpu d=${SIM_TESTS:-130};;
  *"test_attention_split"*|*"test_attention_tma"*) key=bisect d=40;;
  *"pytest bench --benchmark-only"*) key=bench d=${SIM_BENCH:-400}
     j=${a#*--benchmark-json }; j=${j%% *}
     [ "${SIM_BENCH_NOJSON:-}" = 1 ] || echo '{"machine_info": {"flashtx_bench": {"gpu": "stub"}},
       "benchmarks": [{"name": "stub", "extra_info": {}}]}' > "$j";;
  *"test_models.py --benchmark-only"*) key=models d=${SIM_MODELS:-60};;
  *bench.report*) key=report d=2; o=${a#*--out }; o=${o%% *}; echo "# stub report" > "$o/report.md";;
  *host_profile*) key=hostprof d=30;;
  *bench.tune*) key=tune d=${SIM_TUNE:-5};;
esac
s=$(awk "BEGIN{print $d * $SIM_SCALE}")
echo "$(date +%s%3N) START $key" >> "$SIM_LOG"
# The handlers are functions, parsed here once: a trap string is parsed when the signal comes, and a second signal
# during that parse (the tests_gpu wrapper sends SIGTERM to the run's group and to its pid, maybe twice) left
# bash with "unexpected EOF while looking for matching `)'" and the stub running on (CI, 2026-12-06). Each
# handler first ignores both signals, so it runs once.
on_sig() { trap '' INT TERM; kill $SL 2>/dev/null; echo "$(date +%s%3N) $1 $key" >> "$SIM_LOG"; exit "$2"; }
if [[ ",${SIM_IGNORE_INT:-}," == *",$key,"* ]]; then
  trap '' INT
else
  trap 'on_sig INT 130' INT
fi
# SIGTERM (the tests_gpu wrapper ends the extension's run with it) ends the sleep too: no orphan keeps the pipe open
trap 'on_sig TERM 143' TERM
sleep "$s" & SL=$!
while ! wait $SL; do kill -0 $SL 2>/dev/null || break; done
echo "$(date +%s%3N) END $key" >> "$SIM_LOG"
"""

SCENARIOS = {
    # the default steps with a cold H200's times; the benchmarks would run past their limit
    "default": dict(scale="0.1", env={"DEVICE_CHECK_COMMIT": "abc1234 (test)", "BENCH_DTYPE": "bf16"}),
    # installing takes 50 s, so the prewarm's deadline (not its own 200 s limit) bounds it, and it ignores SIGINT;
    # every quick case asked for (DEVICE_CHECK_BENCH_K empty); the benchmarks write no JSON
    # (at 0.25: the prewarm's kill comes 5 s x scale before the bench step's deadline, 0.5 s at 0.1 was too tight
    # for a loaded CI machine)
    "hung_prewarm": dict(scale="0.25", env={
        "DEVICE_CHECK_STEPS": "install,tests_gpu,prewarm,bench,models,report", "DEVICE_CHECK_BENCH_K": "",
        "SIM_INSTALL": "50", "SIM_PREWARM": "400", "SIM_IGNORE_INT": "prewarm,prewarm_models", "SIM_TESTS": "100",
        "SIM_BENCH": "10", "SIM_MODELS": "10", "SIM_BENCH_NOJSON": "1"}),
    # the CUDA extension's tests (beside the GPU tests) would outlast the step: they must end with it
    "slow_cuda_ext": dict(scale="0.1", env={"DEVICE_CHECK_STEPS": "install,tests_gpu,bench", "SIM_CUDA_EXT": "400",
                                            "SIM_BENCH": "10"}),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Both scenarios at once: {name: (returncode, log, $OUT, the stub's log lines, scale)}."""
    base = tmp_path_factory.mktemp("device_check_plan")
    stub = base / "python"
    stub.write_text(STUB)
    stub.chmod(0o755)
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith(("PYTEST_XDIST", "BENCH_", "DEVICE_CHECK_", "SIM_", "OUT"))}
    procs = {}
    for name, sc in SCENARIOS.items():
        out = base / name
        (out / "report").mkdir(parents=True)
        # a previous run's outputs, and a file that is not the script's
        (out / "bench.json").write_text(json.dumps({"benchmarks": [{"name": "old-run"}], "machine_info": {}}))
        for f in ("tune.json", "gpu_checks.json", "report/old.png", "keep.txt"):
            (out / f).write_text("old")
        (out / "log.txt").write_text("OLD LOG\n")
        env = {**clean, "OUT": str(out), "PYTHON": str(stub), "SIM_REAL_PY": sys.executable,
               "SIM_LOG": str(base / f"{name}.sim.log"), "SIM_SCALE": sc["scale"],
               "DEVICE_CHECK_TIME_SCALE": sc["scale"], "DEVICE_CHECK_WHEELS": str(base / "no-wheels"),
               **sc["env"]}  # no wheels: a developer's own .whl/ must not change the plan
        procs[name] = (subprocess.Popen(["bash", str(SCRIPT)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True), out)
    res = {}
    for name, (proc, out) in procs.items():
        log, _ = proc.communicate(timeout=120)
        sim = (base / f"{name}.sim.log").read_text().splitlines()
        res[name] = (proc.returncode, log, out, sim, float(SCENARIOS[name]["scale"]))
    return res


def _limit(s: float) -> str:
    """A limit as the script prints it: 1.5, 3, 0.2."""
    return f"{s:.3f}".rstrip("0").rstrip(".")


def _run_record(out: Path) -> dict:
    return json.loads((out / "bench.json").read_text())["machine_info"]["flashtx_run"]


def test_default_steps_leave_out_bisect_and_tma(runs):
    default = re.search(r"^STEPS=\$\{DEVICE_CHECK_STEPS:-([a-z_,]+)\}", SCRIPT.read_text(), re.M).group(1).split(",")
    assert "bisect" not in default and "tma" not in default, default
    assert {"install", "tests_gpu", "prewarm", "bench", "models", "report", "tune"} <= set(default)
    assert "hostprof" not in default  # (opt-in: its minute goes to the sweep)
    _, log, _, sim, _ = runs["default"]
    assert f"steps {','.join(default)}" in log.splitlines()[0]
    assert "=== bisect" not in log and "=== tma" not in log and not any(" bisect" in line for line in sim)


def test_bench_gets_its_whole_limit_and_models_and_report_run(runs):
    rc, log, out, sim, scale = runs["default"]
    skips = [line for line in log[:log.index("=== summary")].splitlines() if "SKIP" in line]
    assert all(line.startswith("=== SKIP bench.tune: out of time") for line in skips), log  # (what is left: maybe none)
    # the default -k leaves out the MHA D=128 cases measured on 2026-11-30
    assert f"=== pytest bench --quick -k not d128 (limit {_limit(PLAN['bench'] * scale)}s," in log, log
    assert f"=== pytest tests (GPU-only, compile and graph breaks) (limit {_limit(PLAN['tests_gpu'] * scale)}s," in log
    assert f"=== pytest bench/test_models.py (limit {_limit(PLAN['models'] * scale)}s," in log, log
    assert f"=== bench.report (limit {_limit(PLAN['report'] * scale)}s," in log, log
    # the order of priority, and the timed benchmarks alone on the machine: started after the prewarm ended
    keys = [line.split()[2].replace("prewarm_models", "prewarm") for line in sim if " START " in line]
    keys = keys[:-1] if keys[-1] == "tune" else keys  # tune takes what is left: none on a loaded machine
    # the CUDA extension's tests run beside the GPU tests, in the same step, and end before it does (the prewarm
    # starts at about the same time: left out of the adjacency)
    fg = [k for k in keys if k != "prewarm"]
    assert fg.count("cuda_ext") == 1 and abs(fg.index("cuda_ext") - fg.index("tests_gpu")) == 1, sim
    ext_end = next(int(line.split()[0]) for line in sim if " END cuda_ext" in line)
    assert ext_end <= next(int(line.split()[0]) for line in sim if " END tests_gpu" in line)
    assert "=== the CUDA extension tests beside it (tests/test_cuda_ext_gpu.py, rc=0):\ncuda ext tests (stub) ran" \
        in log
    keys.remove("cuda_ext")
    assert keys[:1] + sorted(keys[1:4]) + keys[4:] == ["install", "prewarm", "prewarm", "tests_gpu", "bench", "models",
                                                       "report"], sim
    end_prewarm = max(int(line.split()[0]) for line in sim if re.search(r" (END|INT) prewarm", line))
    start_bench = next(int(line.split()[0]) for line in sim if " START bench" in line)
    assert end_prewarm <= start_bench
    summary = log[log.index("=== summary"):]
    for line in ("install: ok", "pytest tests (GPU-only, compile and graph breaks): ok", "prewarm (background): ok",
                 f"pytest bench --quick -k not d128: TIMED OUT after {_limit(PLAN['bench'] * scale)}s",
                 "pytest bench/test_models.py: ok", "bench.report: ok", "bench.tune"):
        assert line in summary, summary
    assert rc == 124  # the first step that did not pass: the benchmarks ran out of time
    assert (out / "report" / "report.md").exists()


def test_a_hung_prewarm_is_killed_before_the_bench_step_needs_the_time(runs):
    rc, log, out, sim, scale = runs["hung_prewarm"]
    assert re.search(r"=== prewarm \(background\) ended, rc 137 137", log), log  # SIGINT ignored: SIGKILL ended it
    # started late (install took 50 s), so its deadline cut its limit below 200 s ...
    started = float(re.search(r"prewarm started in the background \(limit ([\d.]+)s", log).group(1))
    assert started < 200 * scale * 0.95, log
    # ... and the benchmarks still had their whole limit; DEVICE_CHECK_BENCH_K= (empty): no -k, every quick case
    assert f"=== pytest bench --quick (limit {_limit(PLAN['bench'] * scale)}s," in log, log
    assert f"=== pytest bench/test_models.py (limit {_limit(PLAN['models'] * scale)}s," in log, log
    assert not any(re.search(r" END prewarm", line) for line in sim)  # killed, never finished
    verdicts = {s["step"]: s["verdict"] for s in _run_record(out)["steps"]}
    assert verdicts == {"install": "ok", "tests_gpu": "ok", "prewarm": "timed out", "bench": "ok", "models": "ok",
                        "report": "skipped"}, verdicts
    assert "bench.report: not run, the benchmark steps wrote no results" in log
    assert rc == 0


def test_steps_commit_and_bench_env_land_in_bench_json(runs):
    _, log, out, _, scale = runs["default"]
    data = json.loads((out / "bench.json").read_text())
    assert data["machine_info"]["flashtx_bench"] == {"gpu": "stub"}  # pytest-benchmark's keys are kept
    assert [b["name"] for b in data["benchmarks"]] == ["stub"]  # not the previous run's
    run = data["machine_info"]["flashtx_run"]
    steps = run["steps"]
    assert [s["name"] for s in steps[:-1]] == [
        "install", "pytest tests (GPU-only, compile and graph breaks)", "prewarm (background)",
        "pytest bench --quick -k not d128", "pytest bench/test_models.py", "bench.report"], steps
    # written again at the end: every step, tune included (named with its default arguments when it ran)
    assert steps[-1]["name"] in ("bench.tune", "bench.tune --quick --kernels decode,attn_fwd --decode-budget-s 100")
    assert [s["verdict"] for s in steps[:-1]] == ["ok", "ok", "ok", "timed out", "ok", "ok"], steps
    assert steps[-1]["verdict"] in ("ok", "skipped"), steps  # tune: what is left, none on a loaded machine
    assert all(type(s["seconds"]) is int and s["seconds"] >= 0 for s in steps), steps
    assert run["commit"] == "abc1234 (test)"
    env = run["bench_env"]
    assert env["DEVICE_CHECK_BENCH_K"] == "not d128" and env["BENCH_DTYPE"] == "bf16"
    assert env["BENCH_BUDGET_S"] == "0.12" and "BENCH_STEADY" in env and env["BENCH_STEADY"] is None
    assert env["OVERHEAD_REPEATS"] == "20"  # the device script's default (room in the bench step)
    # the first record (before the report) held the steps up to the models step
    assert "bench.json: 1 results, flashtx_run: 5 steps, commit abc1234 (test)" in log


def test_a_run_whose_benchmarks_wrote_nothing_is_recorded_too(runs):
    _, _, out, _, _ = runs["hung_prewarm"]
    data = json.loads((out / "bench.json").read_text())
    assert data["benchmarks"] == []
    run = data["machine_info"]["flashtx_run"]
    assert run["bench_env"]["DEVICE_CHECK_BENCH_K"] == ""
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    if head.returncode == 0:  # no DEVICE_CHECK_COMMIT: git's HEAD, "(dirty)" when the tree differs
        assert run["commit"].split()[0] == head.stdout.strip(), run["commit"]
        assert run["commit"] in (head.stdout.strip(), head.stdout.strip() + " (dirty)")


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_a_previous_runs_outputs_are_removed(runs, name):
    _, _, out, _, _ = runs[name]
    assert not (out / "tune.json").exists() and not (out / "gpu_checks.json").exists()
    assert not (out / "report" / "old.png").exists()
    assert "OLD LOG" not in (out / "log.txt").read_text() and "=== summary" in (out / "log.txt").read_text()
    assert "old-run" not in (out / "bench.json").read_text()
    assert (out / "keep.txt").read_text() == "old"  # only the script's own outputs


def test_every_carried_wheel_is_installed_liger_alone_too(tmp_path):
    """A carried Liger wheel without xformers is installed (it was not: only an xformers wheel triggered the
    install), and the log says which provider will be skipped."""
    stub = tmp_path / "python"
    stub.write_text(STUB)
    stub.chmod(0o755)
    whl = tmp_path / "wheels"
    whl.mkdir()
    (whl / "liger_kernel-0.8.5-py3-none-any.whl").write_text("stub")
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith(("PYTEST_XDIST", "BENCH_", "DEVICE_CHECK_", "SIM_", "OUT"))}
    env = {**clean, "OUT": str(tmp_path / "out"), "PYTHON": str(stub), "SIM_REAL_PY": sys.executable,
           "SIM_LOG": str(tmp_path / "sim.log"), "SIM_SCALE": "0.01", "DEVICE_CHECK_TIME_SCALE": "0.1",
           "DEVICE_CHECK_STEPS": "xformers", "DEVICE_CHECK_WHEELS": str(whl), "DEVICE_CHECK_COMMIT": "abc (test)"}
    proc = subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=120)
    log = proc.stdout
    assert "=== carried wheels install (liger_kernel-0.8.5-py3-none-any.whl)" in log, log
    assert "xformers-*.whl carried: the xformers provider will be skipped" in log, log
    assert "liger rows will be skipped" not in log, log
    assert [line.split()[1:] for line in (tmp_path / "sim.log").read_text().splitlines()] == \
        [["START", "install"], ["END", "install"]]
    assert [s["verdict"] for s in _run_record(tmp_path / "out")["steps"]] == ["ok"], log


def test_the_cuda_extension_tests_end_with_their_step(runs):
    """They run in a background job, which ignores SIGINT: the step's wrapper ends them with SIGTERM when the step's
    time is up, prints their log, and the benchmarks start with them gone."""
    rc, log, out, sim, scale = runs["slow_cuda_ext"]
    assert "=== the CUDA extension tests beside it (tests/test_cuda_ext_gpu.py, rc=143):\ncuda ext tests (stub) ran" \
        in log, log
    assert not any(" END cuda_ext" in line for line in sim), sim  # ended by the signal, not by itself
    assert any(" TERM cuda_ext" in line for line in sim), sim
    assert f"pytest tests (GPU-only, compile and graph breaks): TIMED OUT after {_limit(PLAN['tests_gpu'] * scale)}s" \
        in log
    assert "=== pytest bench --quick" in log and rc == 124
