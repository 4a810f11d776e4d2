#!/usr/bin/env bash
# The one script for a lent GPU machine (issue 2 item 11, issue 3 item 6). Run from the repo root:
#     OUT=/some/dir bash bench/device_check.sh          # on the device tool, $OUT is set for you
# Steps, each under `timeout` and a shared budget (DEVICE_CHECK_BUDGET_S, default 480 s: 8 minutes,
# with the machine's start-up outside it; run it with timeout_s=540). In order of priority, the
# later steps get what is left, and the model benchmark often gets nothing on a cold machine:
#   install (pip -e, no deps) -> [xformers wheel from .whl/, if carried] -> python -m flashtx
#   -> pytest tests (GPU: fp16/bf16/fp32 CUDA tensors; the GPU-only files first) -> bench.gpu_checks
#   -> pytest bench --benchmark-only --quick (JSON) -> pytest bench/test_models.py (compiled GPT
#   training step, tokens/s; merged into the JSON) -> python -m bench.report (markdown + PNGs)
# Everything lands under $OUT (at most 8 files, 2 folders deep): log.txt, gpu_checks.json,
# bench.json, xformers_info.txt (if a wheel was carried), report/{report.md, attention.png,
# attention_gqa.png, rope_swiglu.png}. A failing step is recorded and the next one still runs;
# the exit status is the first failing step's (0 when all passed).
#
# Knobs (the defaults are the GPU run): DEVICE_CHECK_STEPS, a comma list of the steps to run, of
# install,xformers,flashtx,tests,gpu_checks,bench,models,report (default: all);
# DEVICE_CHECK_TIME_SCALE multiplies every step's limit and reserve and the budget (default 1).
# tests/test_bench_smoke.py runs the bench,models,report steps of this script with BENCH_SMOKE=1
# (bench/harness.py: CPU, tiny shapes, Triton's interpreter), so the script cannot rot unseen.
set -uo pipefail  # not -e: every step's status is recorded, and later steps still run
export PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1
cd "$(dirname "$0")/.."

OUT=${OUT:-$PWD/device_out}
mkdir -p "$OUT/report"
exec 3>&1 4>&2
exec > >(tee -a "$OUT/log.txt") 2>&1
TEE_PID=$!

SCALE=${DEVICE_CHECK_TIME_SCALE:-1}
BUDGET=$(( ${DEVICE_CHECK_BUDGET_S:-480} * SCALE ))
STEPS=${DEVICE_CHECK_STEPS:-install,xformers,flashtx,tests,gpu_checks,bench,models,report}
want() { [[ ",$STEPS," == *",$1,"* ]]; }
START=$(date +%s)
PY=${PYTHON:-python3}
SUMMARY=()
FIRST_RC=0

# step NAME LIMIT_S RESERVE_S CMD...: run CMD under `timeout`, at most LIMIT_S and never into the
# last RESERVE_S seconds of the budget (kept for the steps after it).
step() {
  local name=$1 limit=$(($2 * SCALE)) reserve=$(($3 * SCALE)); shift 3
  local left=$((BUDGET - ($(date +%s) - START) - reserve))
  ((limit > left)) && limit=$left
  if ((limit < 10)); then
    echo "=== SKIP $name: out of time (budget ${BUDGET}s)"
    SUMMARY+=("$name: skipped, out of time")
    ((FIRST_RC == 0)) && FIRST_RC=124
    return
  fi
  echo
  echo "=== $name (limit ${limit}s, $(( $(date +%s) - START ))s elapsed) ==="
  local t0=$(date +%s)
  timeout -s INT --kill-after=15 "$limit" "$@"  # SIGINT: pytest still writes its JSON
  local rc=$?
  local verdict="ok"
  ((rc == 124 || rc == 137)) && verdict="TIMED OUT after ${limit}s"
  ((rc != 0 && rc != 124 && rc != 137)) && verdict="FAILED rc=$rc"
  SUMMARY+=("$name: $verdict ($(( $(date +%s) - t0 ))s)")
  ((rc != 0 && FIRST_RC == 0)) && FIRST_RC=$rc
  return 0
}

echo "=== device_check $(date -u '+%Y-%m-%d %H:%M:%S UTC'), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')$(git diff --quiet 2>/dev/null || echo ' (+ uncommitted changes)')"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv 2>&1 || true
$PY -c "import sys, torch, triton; print('python', sys.version.split()[0], '| torch', torch.__version__, 'CUDA', torch.version.cuda, '| triton', triton.__version__, '| GPU', torch.cuda.get_device_name() if torch.cuda.is_available() else 'NONE')"

want install && step "install" 60 400 $PY -m pip install -q --no-deps --no-build-isolation -e .

# xformers (issue 3): carried as a wheel, see bench/README.md "xformers on the GPU machine".
if ! want xformers; then
  :
elif ls .whl/xformers-*.whl >/dev/null 2>&1; then
  step "xformers install" 30 380 $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  step "xformers info" 30 370 bash -c "$PY -m xformers.info > '$OUT/xformers_info.txt' 2>&1; rc=\$?; head -60 '$OUT/xformers_info.txt'; exit \$rc"
else
  echo "(no .whl/xformers-*.whl carried: the xformers provider will be skipped)"
fi

# ~60 kernels compile cold here (3 dtypes x 4 attention cases x 4 kernels, RoPE, SwiGLU); later steps reuse
# Triton's cache
want flashtx && step "python -m flashtx" 90 330 $PY -m flashtx

XDIST=""
$PY -c "import xdist" 2>/dev/null && XDIST="-n 8"  # compile-bound: 8 workers share Triton's cache
# The GPU-only tests first; no -x (one failure must not hide the rest); the CPU-only files are left out:
# the compile check (no GPU needed, minutes), the bench smoke run (it skips itself on a GPU), the
# examples and the `python -m flashtx` subprocess test (the step above runs it).
GPU_ONLY="tests/test_attention_gpu_large.py tests/test_memory.py"
want tests && step "pytest tests (GPU-only files)" 50 290 $PY -m pytest $GPU_ONLY -q -p no:cacheprovider
want tests && step "pytest tests (the rest, on GPU)" 110 200 $PY -m pytest tests -q --maxfail=40 $XDIST \
  -p no:cacheprovider --ignore=tests/test_attention_gpu_large.py --ignore=tests/test_memory.py \
  --ignore=tests/test_compile.py --ignore=tests/test_bench_smoke.py --ignore=tests/test_examples.py \
  --ignore=tests/test_translate_example.py --ignore=tests/test_main.py

want gpu_checks && step "bench.gpu_checks" 80 160 $PY -m bench.gpu_checks --json "$OUT/gpu_checks.json"

export BENCH_BUDGET_S=${BENCH_BUDGET_S:-0.15}  # seconds of timed rounds per case (10..200 rounds)
want bench && step "pytest bench --quick" 150 20 $PY -m pytest bench --benchmark-only --quick -q -rs -p no:cacheprovider \
  --benchmark-json "$OUT/bench.json" --benchmark-columns=median,iqr,rounds --benchmark-sort=name

# issue 7's GPU section: a compiled training step of a GPT model (bench/test_models.py) on flashtx
# (patch_sdpa), SDPA and eager: tokens/s. Last, with what is left of the budget (3 compiles).
# Its results are merged into bench.json ($OUT may hold 8 files), then one report covers both.
MODELS_JSON=$(mktemp "${TMPDIR:-/tmp}/flashtx_models.XXXXXX.json")
want models && step "pytest bench/test_models.py" 150 15 $PY -m pytest bench/test_models.py --benchmark-only -q -rs -p no:cacheprovider \
  --benchmark-json "$MODELS_JSON" --benchmark-columns=median,rounds
if [ -s "$MODELS_JSON" ]; then
  $PY - "$OUT/bench.json" "$MODELS_JSON" <<'MERGE'
import json, os, sys
out, extra = sys.argv[1], json.load(open(sys.argv[2]))
data = json.load(open(out)) if os.path.exists(out) and os.path.getsize(out) else extra | {"benchmarks": []}
data["benchmarks"] += extra["benchmarks"]
json.dump(data, open(out, "w"))
for b in extra["benchmarks"]:
    ei = b.get("extra_info", {})
    print("  model", ei.get("provider"), ei.get("status"), ei.get("tokens_per_s"))
MERGE
fi
rm -f "$MODELS_JSON"

if ! want report; then
  :
elif [ -s "$OUT/bench.json" ]; then  # pytest-benchmark leaves an empty file when nothing ran
  step "bench.report" 20 0 bash -c "$PY -m bench.report '$OUT/bench.json' --out '$OUT/report' > /dev/null && cat '$OUT/report/report.md'"
else
  rm -f "$OUT/bench.json"
  SUMMARY+=("bench.report: not run, the benchmark steps wrote no results")
fi

echo
echo "=== summary ($(( $(date +%s) - START ))s of ${BUDGET}s) ==="
printf '  %s\n' "${SUMMARY[@]}"
[ -f "$OUT/gpu_checks.json" ] && $PY -c "import json; r = json.load(open('$OUT/gpu_checks.json')); print('  gpu_checks pass:', r.get('pass'), '| memory linear:', r.get('memory_linear'), '| ceilings:', r.get('ceilings'))"
[ -f "$OUT/report/report.md" ] && sed -n '/^## Targets/,/^Plots/p' "$OUT/report/report.md"
ls -la "$OUT" "$OUT/report"
exec 1>&3 2>&4 3>&- 4>&-  # close tee's input, and let it finish writing log.txt
wait "$TEE_PID" 2>/dev/null || sleep 1
exit $FIRST_RC
