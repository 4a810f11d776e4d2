#!/usr/bin/env bash
# The one script for a lent GPU machine. Run from the repo root:
#     OUT=/some/dir bash bench/device_check.sh          # on the device tool, $OUT is set for you
# Planned for a 15-minute device lease on a COLD machine (2026-11-30: cold compiles overran every step
# of the old plan: `python -m flashtx` alone took 60 s). One call: run(command="DEVICE_CHECK_COMMIT=<sha>
# bash bench/device_check.sh", timeout_s=590); the steps share DEVICE_CHECK_BUDGET_S (default 540 s), each
# under `timeout` (SIGINT first, so pytest still writes its JSON and bench.tune its table), in order of priority:
#   install -> [carried wheels from .whl/: xformers, Liger-Kernel]
#   -> tests_gpu: the GPU-only tests and the torch.compile / graph-break tests (pytest -n 8), while
#      prewarm compiles the quick benchmarks' kernels and the model's compiled graphs in parallel
#      workers (BENCH_PREWARM=1 pytest ... -n 4 / -n 3 --benchmark-disable: nothing timed) into the caches;
#      the prewarm is stopped (SIGINT, then killed) before it can cut into the bench step's limit
#   -> bench: pytest bench --benchmark-only --quick (timed, serial, after prewarm ended; includes the
#      host-overhead rows and any quick benchmark another file adds, e.g. bench/test_decode.py): the
#      numbers issues are resolved on
#   -> models: the compiled GPT training step (bench/test_models.py), torch.compile(fullgraph=True);
#      a graph break is recorded as a FAILED fullgraph compile in the JSON and the report
#   -> report: python -m bench.report (markdown + PNGs)
#   -> hostprof (opt-in): python -m bench.host_profile (one call from idle per provider and pass, profiled)
#   -> tune: python -m bench.tune with what is left (at most 240 s)
#   opt-in (only when named in DEVICE_CHECK_STEPS): bisect and tma (before tests_gpu, on an idle GPU; the
#   features they concern are off by default), tests_rest, gpu_checks, flashtx (after the rest)
# The plan (seconds at DEVICE_CHECK_TIME_SCALE=1): each step runs at most its limit and never into its reserve,
# the limits of the wanted steps after it in the chain xformers(50) bisect(135) tma(60) tests_gpu(150)
# bench(190) models(80) report(20), plus 10 s for the end (bench.json's run record, the summary). For the
# default steps and a 540 s budget: report 20 (reserve 10), models 80 (30), bench 190 (110), tests_gpu 150
# (300), xformers 30 + 20 (450); install 60 within the first 70 s; hostprof (opt-in) 60 (10); tune what is left - 30
# (limit + 15). The prewarm's timeout sends SIGINT when 318 s are left (at the latest) and SIGKILL 10 s later;
# the wait for it kills what still runs at 305 s left, so bench starts with its full 190 s. With install 20 s and
# tests_gpu 150 s: bench runs from ~175 s to ~365 s, models to ~445 s, report to ~465 s at the latest.
# Output under $OUT (at most 8 files, at most $OUT/a/b deep), each written as its step runs: log.txt
# (everything, streamed), bench.json (after bench; models merged in; machine_info.flashtx_run: every step's
# verdict and seconds, the commit, the bench env), tune.json, gpu_checks.json (if asked),
# report/{report.md, attention.png, attention_gqa.png, rope_swiglu.png}. These are removed at the start (a
# previous run's would be appended to). A failing step is recorded and the next one still runs; the exit
# status is the first failing or skipped step's (0 when all passed).
#
# Knobs: DEVICE_CHECK_STEPS, a comma list of install,xformers,bisect,tma,tests_gpu,prewarm,bench,models,report,
# hostprof,tune,tests_rest,gpu_checks,flashtx (default: install,xformers,tests_gpu,prewarm,bench,models,report,
# tune; hostprof is opt-in: its 60 s go to the sweep); DEVICE_CHECK_BUDGET_S (540); DEVICE_CHECK_TIME_SCALE
# multiplies every limit and reserve and the budget (default 1; a decimal such as 4 or 0.01:
# tests/test_device_check_plan.py runs the plan in seconds);
# DEVICE_CHECK_BENCH_K, a pytest -k expression for the quick benchmarks and their prewarm: unset means
# "not d128" (the MHA D=128 cases, measured on 2026-11-30), so GQA, D=64, the variants, decode, RoPE/SwiGLU and
# the overhead rows fit the step's limit; set it empty (DEVICE_CHECK_BENCH_K=) to run every quick case;
# DEVICE_CHECK_COMMIT: the commit recorded in bench.json (pass it: the device's copy of .git may be stale;
# without it, `git rev-parse --short HEAD` plus " (dirty)" when the tree differs from it);
# DEVICE_CHECK_TUNE_ARGS, bench.tune's arguments (--kernels, --seqlens, --quick, --modified; unset: "--quick --kernels
# decode,attn_fwd --decode-budget-s 100", empty: the whole attention sweep); DEVICE_CHECK_WHEELS, the
# folder of carried wheels (default .whl: xformers, Liger-Kernel; every wheel there is installed).
# tests/test_bench_smoke.py runs the bench,models,report steps of this script with BENCH_SMOKE=1
# (bench/harness.py: CPU, tiny shapes, Triton's interpreter), so the script cannot rot unseen;
# tests/test_device_check_plan.py runs the whole plan with a python that sleeps.
set -uo pipefail  # not -e: every step's status is recorded, and later steps still run
export PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1
cd "$(dirname "$0")/.."

OUT=${OUT:-$PWD/device_out}
mkdir -p "$OUT/report"
# a previous run's outputs (the default OUT stays between runs: the models merge would append to its bench.json)
rm -f -- "$OUT/bench.json" "$OUT/tune.json" "$OUT/gpu_checks.json" "$OUT/log.txt" "$OUT"/report/*
exec 3>&1 4>&2
exec > >(tee -a "$OUT/log.txt") 2>&1
TEE_PID=$!

# Time is kept in milliseconds; SCALE_PM is DEVICE_CHECK_TIME_SCALE in thousandths.
SCALE=${DEVICE_CHECK_TIME_SCALE:-1}
if [[ ! $SCALE =~ ^[0-9]+(\.[0-9]+)?$ ]]; then
  echo "DEVICE_CHECK_TIME_SCALE=$SCALE is not a number: using 1"; SCALE=1
fi
SCALE_FRAC=000; [[ $SCALE == *.* ]] && SCALE_FRAC=${SCALE#*.}000
SCALE_PM=$(( 10#${SCALE%%.*} * 1000 + 10#${SCALE_FRAC:0:3} ))
((SCALE_PM > 0)) || SCALE_PM=1000
P() { echo $(( $1 * SCALE_PM )); }  # plan seconds -> scaled milliseconds
secs() {  # milliseconds -> seconds for `timeout` and the log: 150000 -> 150, 2800 -> 2.8
  local ms=$(( $1 < 0 ? 0 : $1 )) f
  f=$(printf '%03d' $(( ms % 1000 )))
  while [[ $f == *0 ]]; do f=${f%0}; done
  echo "$(( ms / 1000 ))${f:+.$f}"
}
now_ms() { date +%s%3N; }
BUDGET_S=${DEVICE_CHECK_BUDGET_S:-540}
BUDGET_MS=$(P "$BUDGET_S")
STEPS=${DEVICE_CHECK_STEPS:-install,xformers,tests_gpu,prewarm,bench,models,report,tune}
want() { [[ ",$STEPS," == *",$1,"* ]]; }
START_MS=$(now_ms)
PY=${PYTHON:-python3}
BENCH_K_EXPR=${DEVICE_CHECK_BENCH_K-not d128}  # unset: skip MHA D=128; empty: every quick case
SUMMARY=()
RUN_STEPS=()  # key TAB name TAB verdict TAB seconds: machine_info.flashtx_run.steps
FIRST_RC=0
left_ms() { echo $(( BUDGET_MS - ($(now_ms) - START_MS) )); }
elapsed() { secs $(( $(now_ms) - START_MS )); }

# The plan (seconds at scale 1). A step's reserve: END plus the limits of the wanted steps after it in CHAIN.
L_INSTALL=60 L_XFORMERS=30 L_XFORMERS_INFO=20 L_BISECT=45 L_TMA=60 L_TESTS=150 L_BENCH=190 L_MODELS=80 L_REPORT=20
L_HOSTPROF=60 L_PREWARM=200
END=10           # the run record in bench.json and the summary
MIN_STEP=10      # a step with less than this is skipped
KILL_AFTER=15    # SIGINT, then SIGKILL this much later (steps)
PREWARM_KILL_AFTER=10
CHAIN=(xformers:$((L_XFORMERS + L_XFORMERS_INFO)) bisect:$((3 * L_BISECT)) tma:$L_TMA tests_gpu:$L_TESTS
       bench:$L_BENCH models:$L_MODELS report:$L_REPORT)
reserve_after() {  # reserve_after KEY: scaled ms kept for the wanted steps after KEY
  local sum=$END seen=0 kv
  for kv in "${CHAIN[@]}"; do
    ((seen)) && want "${kv%%:*}" && sum=$(( sum + ${kv#*:} ))
    [[ ${kv%%:*} == "$1" ]] && seen=1
  done
  P "$sum"
}

record() {  # record KEY NAME VERDICT MS
  RUN_STEPS+=("$1"$'\t'"$2"$'\t'"$3"$'\t'"$(( ($4 + 500) / 1000 ))")
}
skip() {  # skip KEY NAME WHY [norc]: norc, the exit status does not say so (tune: it takes what is left)
  echo "=== SKIP $2: $3"
  SUMMARY+=("$2: skipped, $3")
  record "$1" "$2" skipped 0
  [ -z "${4:-}" ] && ((FIRST_RC == 0)) && FIRST_RC=124
  return 0
}

# step KEY NAME LIMIT_MS RESERVE_MS CMD...: run CMD under `timeout`, at most LIMIT_MS and never into the
# last RESERVE_MS of the budget (kept for the steps after it).
step() {
  local key=$1 name=$2 limit=$3 reserve=$4; shift 4
  local avail=$(( $(left_ms) - reserve ))
  ((limit > avail)) && limit=$avail
  if ((limit < $(P $MIN_STEP))); then
    skip "$key" "$name" "out of time (budget $(secs "$BUDGET_MS")s)"
    return 0
  fi
  echo
  echo "=== $name (limit $(secs "$limit")s, $(elapsed)s elapsed) ==="
  local t0 rc verdict
  t0=$(now_ms)
  timeout -s INT --kill-after="$(secs $(P $KILL_AFTER))" "$(secs "$limit")" "$@"  # SIGINT: pytest still writes its JSON
  rc=$?
  local dt=$(( $(now_ms) - t0 ))
  if ((rc == 0)); then
    verdict="ok"; record "$key" "$name" ok "$dt"
  elif ((rc == 124 || rc == 137)); then
    verdict="TIMED OUT after $(secs "$limit")s"; record "$key" "$name" "timed out" "$dt"
  else
    verdict="FAILED rc=$rc"; record "$key" "$name" failed "$dt"
  fi
  SUMMARY+=("$name: $verdict ($(( (dt + 500) / 1000 ))s)")
  ((rc != 0 && FIRST_RC == 0)) && FIRST_RC=$rc
  return 0
}

if [ -n "${DEVICE_CHECK_COMMIT:-}" ]; then
  COMMIT=$DEVICE_CHECK_COMMIT
else  # the device's copy of .git may be stale: the caller should pass DEVICE_CHECK_COMMIT
  COMMIT=$(git rev-parse --short HEAD 2>/dev/null) || COMMIT=""
  if [ -z "$COMMIT" ]; then COMMIT="?"
  elif [ -n "$(git status --porcelain 2>/dev/null | head -1)" ]; then COMMIT+=" (dirty)"
  fi
fi

# record_run: machine_info.flashtx_run in $OUT/bench.json (created with no benchmarks if missing): every step run
# or skipped so far (name, verdict, seconds), the commit, the benchmarks' environment. Other keys are kept.
record_run() {
  $PY - "$OUT/bench.json" "$COMMIT" "$BENCH_K_EXPR" "${RUN_STEPS[@]}" <<'RUN'
import json, os, sys
path, commit, bench_k, rows = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
data = {}
if os.path.exists(path) and os.path.getsize(path):
    try:
        data = json.load(open(path))
    except ValueError as exc:  # a half-written file: left as it is for a person to look at
        sys.exit(f"  bench.json is not JSON ({exc}): the run record is not written")
data.setdefault("benchmarks", [])
if not isinstance(data.get("machine_info"), dict):
    data["machine_info"] = {}
run = data["machine_info"].get("flashtx_run")
run = data["machine_info"]["flashtx_run"] = run if isinstance(run, dict) else {}
run["steps"] = [{"name": name, "verdict": verdict, "seconds": int(s), "step": key}
                for key, name, verdict, s in (r.split("\t") for r in rows)]
run["commit"] = commit
env = ("BENCH_SMOKE", "BENCH_DTYPE", "BENCH_BUDGET_S", "BENCH_STEADY", "OVERHEAD_REPEATS")
run["bench_env"] = {k: os.environ.get(k) for k in env} | {"DEVICE_CHECK_BENCH_K": bench_k}
with open(path + ".tmp", "w") as f:
    json.dump(data, f)
os.replace(path + ".tmp", path)
print(f"  bench.json: {len(data['benchmarks'])} results, flashtx_run: {len(run['steps'])} steps, commit {commit}")
RUN
}

echo "=== device_check $(date -u '+%Y-%m-%d %H:%M:%S UTC'), commit $COMMIT, budget $(secs "$BUDGET_MS")s, steps $STEPS"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv 2>&1 || true
$PY -c "import sys, torch, triton; print('python', sys.version.split()[0], '| torch', torch.__version__, 'CUDA', torch.version.cuda, '| triton', triton.__version__, '| GPU', torch.cuda.get_device_name() if torch.cuda.is_available() else 'NONE')"

# the install's reserve shrinks with a smaller budget: without the install nothing after it can import flashtx
# (2026-11-30, second run: DEVICE_CHECK_BUDGET_S=445 skipped it, and every step failed)
INSTALL_RESERVE=$(( BUDGET_MS - $(P 70) )); ((INSTALL_RESERVE > $(P 480))) && INSTALL_RESERVE=$(P 480)
want install && step install "install" "$(P $L_INSTALL)" "$INSTALL_RESERVE" \
  $PY -m pip install -q --no-deps --no-build-isolation -e .

# xformers and Liger-Kernel (issues 3, 13, 14): carried as wheels, see bench/README.md "xformers and Liger on the
# GPU machine". Every carried wheel is installed, xformers or not (a Liger wheel alone too).
WHL=${DEVICE_CHECK_WHEELS:-.whl}
if want xformers && ls "$WHL"/*.whl >/dev/null 2>&1; then
  step xformers "carried wheels install ($(cd "$WHL" && echo *.whl))" "$(P $L_XFORMERS)" "$(reserve_after xformers)" \
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHL"/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  if ls "$WHL"/xformers-*.whl >/dev/null 2>&1; then
    step xformers "xformers info" "$(P $L_XFORMERS_INFO)" "$(reserve_after xformers)" \
      bash -c "$PY -m xformers.info 2>&1 | grep -v '^build.env\|^source' | head -45"
  else
    echo "(no $WHL/xformers-*.whl carried: the xformers provider will be skipped)"
  fi
  ls "$WHL"/liger_kernel-*.whl >/dev/null 2>&1 || echo "(no $WHL/liger_kernel-*.whl carried: the liger rows will be skipped)"
elif want xformers; then
  echo "(no $WHL/*.whl carried: the xformers provider and the liger rows will be skipped)"
fi

# Bisect (issue 13, opt-in: DEVICE_CHECK_STEPS=install,bisect,...): the first GPU run of split head dims + the
# automatic GQA dK/dV split hit "an illegal memory access" (bench/RESULTS.md, second run of 2026-11-30); both are
# off by default since. One case, fp16, serial, CUDA_LAUNCH_BLOCKING=1 (the traceback names the kernel that
# faulted), each path on its own process: both on (the crash as seen), split head dims alone, the automatic GQA
# split alone (MQA cases, head dims padded).
BISECT=(env CUDA_LAUNCH_BLOCKING=1 $PY -m pytest -x -v -rf -n 0 -p no:cacheprovider)
if want bisect; then
  R=$(reserve_after bisect)
  step bisect "bisect: split head dims + automatic GQA split" "$(P $L_BISECT)" "$(( R + $(P $((2 * L_BISECT))) ))" \
    env FLASHTX_TEST_AUTO_GQA_SPLIT=1 "${BISECT[@]}" tests/test_attention_split.py -k "q70-k113 and float16"
  step bisect "bisect: split head dims alone" "$(P $L_BISECT)" "$(( R + $(P $L_BISECT) ))" \
    "${BISECT[@]}" tests/test_attention_split.py -k "q70-k113 and float16"
  step bisect "bisect: automatic GQA split alone" "$(P $L_BISECT)" "$R" env FLASHTX_TEST_AUTO_GQA_SPLIT=1 \
    "${BISECT[@]}" tests/test_attention.py tests/test_attention_gpu_large.py -k "h4x1 and float16 or large and float16"
fi
# the sm_90 forward through tensor descriptors (TMA tuning candidates, off by default; opt-in: tma)
want tma && step tma "tma: forward through tensor descriptors" "$(P $L_TMA)" "$(reserve_after tma)" \
  "${BISECT[@]}" tests/test_attention_tma.py

HAVE_XDIST=0
$PY -c "import xdist" 2>/dev/null && HAVE_XDIST=1
NCPU=$(nproc 2>/dev/null || echo 4)

# Prewarm (in the background while the GPU tests run): every quick benchmark and the model step,
# prepared and warmed up in parallel workers, timing nothing, so the Triton and Inductor on-disk caches
# are warm when the timed steps start. Its output goes to a temporary file, appended to the log after.
# Bounded: its `timeout` sends SIGINT when PREWARM_INT_LEFT is left (TAIL + 18 s), SIGKILL 10 s later, and the
# wait below kills whatever still runs at TAIL + 5 s; TAIL is what bench, models and report need (their limits
# and END), so waiting for it never takes from the bench step's limit.
TAIL=$(reserve_after tests_gpu)
PREWARM_INT_LEFT=$(( TAIL + $(P $((PREWARM_KILL_AFTER + 8))) ))
PREWARM_KILL_LEFT=$(( TAIL + $(P 5) ))
PREWARM_PIDS=()
PREWARM_LOG=$(mktemp "${TMPDIR:-/tmp}/flashtx_prewarm.XXXXXX")
if want prewarm && ((HAVE_XDIST)); then
  PREWARM_LIMIT=$(( $(left_ms) - PREWARM_INT_LEFT ))
  ((PREWARM_LIMIT > $(P $L_PREWARM))) && PREWARM_LIMIT=$(P $L_PREWARM)
  PREWARM_T0=$(now_ms)
  if ((PREWARM_LIMIT < $(P $MIN_STEP))); then
    skip prewarm "prewarm (background)" "out of time (budget $(secs "$BUDGET_MS")s)"
  else
    echo "=== prewarm started in the background (limit $(secs "$PREWARM_LIMIT")s, $(elapsed)s elapsed):" \
      "BENCH_PREWARM=1 pytest bench --quick -n 4, bench/test_models.py -n 3"
    # eager and SDPA-MATH compile nothing and need the most memory (tens of GB at 8k): left out, so the
    # concurrent test step cannot run out of GPU memory because of the prewarm
    PREWARM_K="not overhead and not eager and not sdpa-math"
    [ -n "$BENCH_K_EXPR" ] && PREWARM_K="($BENCH_K_EXPR) and $PREWARM_K"
    PREWARM_TO=(timeout -s INT --kill-after="$(secs $(P $PREWARM_KILL_AFTER))" "$(secs "$PREWARM_LIMIT")")
    BENCH_PREWARM=1 "${PREWARM_TO[@]}" $PY -m pytest bench --quick -n 4 --benchmark-disable \
      -q -p no:cacheprovider -k "$PREWARM_K" > "$PREWARM_LOG" 2>&1 &
    PREWARM_PIDS+=($!)
    want models && { BENCH_PREWARM=1 "${PREWARM_TO[@]}" $PY -m pytest bench/test_models.py \
      -n 3 --benchmark-disable -q -p no:cacheprovider >> "$PREWARM_LOG" 2>&1 & PREWARM_PIDS+=($!); }
  fi
fi

# The GPU-only tests and the compile / graph-break tests (what a CPU run cannot see), in parallel
# workers: they also compile most attention kernels into Triton's cache. Not test_compile.py (the
# CPU compile check, minutes, no GPU needed). lane_masks: the option-tensor and varlen lanes' direct launches
# (varlen's bind packed (total, H, D) tensors to launches planned on (1, total, H, D) views). wide_offsets: the
# int64-offset kernels (SwiGLU/RoPE WIDE, decode) and the span checks on real GPU memory (a few GB each).
# Beside them, in a second pytest of its own (its own --maxfail: kernels never yet run on a GPU must not stop the
# others at 40 failures), the CUDA extension's tests (tests/test_cuda_ext_gpu.py, issue 16): JIT-built once and
# checked against float64 references and the Triton path; its output follows the main run's in the log. The bench
# step's decode case then times the extension (provider flashtx-cuda) from that build.
if want tests_gpu; then
  XDIST=""
  ((HAVE_XDIST)) && XDIST="-n $(( NCPU < 8 ? NCPU : 8 )) --dist loadgroup"  # 8 here + 7 prewarm workers on 16 cores
  # -v: each result is streamed into log.txt as it happens (the second run of 2026-11-30 lost its failure list:
  # the step hit its limit, and the end-of-run summary never printed)
  # shellcheck disable=SC2206
  MAIN=($PY -m pytest tests -v -rf --maxfail=40 $XDIST \
    -p no:cacheprovider --ignore=tests/test_compile.py --ignore=tests/test_bench_smoke.py \
    --ignore=tests/test_device_check_plan.py --ignore=tests/test_cuda_ext_gpu.py \
    --ignore=tests/test_compile_gpu_path.py \
    -k "gpu_large or test_memory or compile or trace or graph or readme or device_asserts or lane_masks or wide_offsets \
       or one_page")
  EXT=($PY -m pytest tests/test_cuda_ext_gpu.py -v -rf --maxfail=20 -p no:cacheprovider)
  EXT_LOG=$(mktemp "${TMPDIR:-/tmp}/flashtx_cuda_ext.XXXXXX")
  # The step's SIGINT (timeout signals the process group) stops the main run as always; the extension's run, a
  # background job of a non-interactive shell, ignores SIGINT, so the wrapper ends it with SIGTERM (its -v lines
  # are in its log already) and still prints that log. It runs in a session of its own (setsid) and the SIGTERM
  # goes to that whole group: a JIT build's ninja/nvcc would outlive pytest and load the timed bench.
  # tests/test_compile_gpu_path.py is CPU work (stand-ins for the device, ~175 s in one worker): CI runs it
  step tests_gpu "pytest tests (GPU-only, compile and graph breaks)" "$(P $L_TESTS)" "$TAIL" \
    bash -c 'log=$1 n=$2; shift 2
      setsid "${@:1:n}" > "$log" 2>&1 & ext=$!
      trap "stop=1; kill -TERM -- -$ext $ext 2>/dev/null" INT TERM
      shift "$n"
      "$@"; rc=$?
      wait "$ext"; erc=$?
      if [ -n "${stop:-}" ]; then  # the trap cut that wait short (130), maybe twice: timeout signals the wrapper,
        # then its process group. Wait until the run has ended, then read its own status (143 after SIGTERM)
        while kill -0 "$ext" 2>/dev/null; do wait "$ext" 2>/dev/null; e=$?; ((e != 127)) && erc=$e; done
        wait "$ext" 2>/dev/null; e=$?; ((e != 127)) && erc=$e
      fi
      echo; echo "=== the CUDA extension tests beside it (tests/test_cuda_ext_gpu.py, rc=$erc):"; cat "$log"
      exit $(( rc ? rc : erc ))' _ "$EXT_LOG" "${#EXT[@]}" "${EXT[@]}" "${MAIN[@]}"
  rm -f "$EXT_LOG"
fi

if ((${#PREWARM_PIDS[@]})); then  # the timed steps must not share the machine with compiles
  killed=0
  while :; do
    alive=()
    for pid in "${PREWARM_PIDS[@]}"; do kill -0 "$pid" 2>/dev/null && alive+=("$pid"); done
    ((${#alive[@]})) || break
    if (( $(left_ms) <= PREWARM_KILL_LEFT )); then  # its timeout's SIGINT and SIGKILL did not end it: kill its groups
      for pid in "${alive[@]}"; do kill -KILL -- "-$pid" 2>/dev/null; kill -KILL "$pid" 2>/dev/null; done
      killed=1
      break
    fi
    sleep "$( ((SCALE_PM < 500)) && echo 0.02 || echo 0.2)"
  done
  rcs="" verdict=ok
  for pid in "${PREWARM_PIDS[@]}"; do
    wait "$pid"; rc=$?; rcs+=" $rc"
    if ((rc == 124 || rc == 137 || killed)); then verdict="timed out"
    elif ((rc != 0)) && [ "$verdict" = ok ]; then verdict=failed
    fi
  done
  dt=$(( $(now_ms) - PREWARM_T0 ))
  echo; echo "=== prewarm (background) ended, rc$rcs$( ((killed)) && echo ', killed'), after $(secs "$dt")s," \
    "$(elapsed)s elapsed; its tail:"
  tail -40 "$PREWARM_LOG"  # (a compile failure or a device fault's traceback, not only the counts)
  SUMMARY+=("prewarm (background): $verdict, rc$rcs ($(( (dt + 500) / 1000 ))s)")
  record prewarm "prewarm (background)" "$verdict" "$dt"
fi
rm -f "$PREWARM_LOG"

export BENCH_BUDGET_S=${BENCH_BUDGET_S:-0.12}  # seconds of timed rounds per case (10..200), and of back-to-back calls
# host-overhead rounds per row (bench/test_overhead.py: 40 by default; each round times 50 calls of the row's several
# forms, ~2-5 s a row on the H100 host): 20 leave the step room for RoPE/SwiGLU at 16k tokens (issue 14's targets)
export OVERHEAD_REPEATS=${OVERHEAD_REPEATS:-20}
BENCH_K=()
[ -n "$BENCH_K_EXPR" ] && BENCH_K=(-k "$BENCH_K_EXPR")
want bench && step bench "pytest bench --quick${BENCH_K_EXPR:+ -k $BENCH_K_EXPR}" "$(P $L_BENCH)" \
  "$(reserve_after bench)" $PY -m pytest bench --benchmark-only --quick -q -rs -p no:cacheprovider "${BENCH_K[@]}" \
  --benchmark-json "$OUT/bench.json" --benchmark-columns=median,iqr,rounds --benchmark-sort=name --durations=30
# (--durations: where the step's wall time goes, setup and compiles included: 139 of its then 150 s on 2026-12-06, of
# which the timed rounds were ~10 s, before the bias cases and the deferred kernel profiles were added; the models
# step took 20 s of its then 120 after the prewarm: 40 s moved from models to bench. The log is what the next run's
# plan is cut by)

# The compiled GPT training step (issue 12's GPU check: flashtx tokens/s >= 1.0x SDPA with fullgraph=True).
MODELS_JSON=$(mktemp "${TMPDIR:-/tmp}/flashtx_models.XXXXXX.json")
want models && step models "pytest bench/test_models.py" "$(P $L_MODELS)" "$(reserve_after models)" \
  $PY -m pytest bench/test_models.py --benchmark-only -q -rs -s \
  -p no:cacheprovider --benchmark-json "$MODELS_JSON" --benchmark-columns=median,rounds
if [ -s "$MODELS_JSON" ]; then
  $PY - "$OUT/bench.json" "$MODELS_JSON" <<'MERGE'
import json, os, sys
out, extra = sys.argv[1], json.load(open(sys.argv[2]))
data = json.load(open(out)) if os.path.exists(out) and os.path.getsize(out) else extra | {"benchmarks": []}
data["benchmarks"] += extra["benchmarks"]
json.dump(data, open(out, "w"))
for b in extra["benchmarks"]:
    ei = b.get("extra_info", {})
    print("  model", ei.get("provider"), ei.get("status"), ei.get("tokens_per_s"), "fullgraph:", ei.get("fullgraph_status"))
MERGE
fi
rm -f "$MODELS_JSON"

# The run record before the report (which shows it), written again at the end with every step.
record_run
if ! want report; then
  :
elif $PY -c "import json, sys; sys.exit(not json.load(open(sys.argv[1])).get('benchmarks'))" "$OUT/bench.json" \
    2>/dev/null; then
  step report "bench.report" "$(P $L_REPORT)" "$(reserve_after report)" \
    bash -c "$PY -m bench.report '$OUT/bench.json' --out '$OUT/report' > /dev/null && cat '$OUT/report/report.md'"
else
  SUMMARY+=("bench.report: not run, the benchmark steps wrote no results")
  record report "bench.report" skipped 0
fi

# One call from idle per (provider, pass), profiled: when each launch was issued and each kernel ran (the
# from-idle latency's host part; bench/host_profile.py). Its table goes to the log.
want hostprof && step hostprof "bench.host_profile" "$(P $L_HOSTPROF)" "$(P $END)" $PY -m bench.host_profile

# Autotuning sweep with what is left (keeps 30 s: its limit is 15 s over its budget, then END); its table is in the
# log, the timings in tune.json.
if want tune; then
  TUNE_MS=$(( $(left_ms) - $(P 30) ))
  ((TUNE_MS > $(P 240))) && TUNE_MS=$(P 240)
  if ((TUNE_MS >= $(P 30))); then
    # DEVICE_CHECK_TUNE_ARGS, e.g. "--kernels attn_bwd_dkdv,attn_bwd_dq --seqlens 4096,2048,16384": the backward,
    # never tuned (the 2026-11-30 sweep's backward times were void: bench/RESULTS.md), or "--kernels attn_fwd
    # --seqlens 4096,2048,16384" to time sm_90's TMA forward candidates beside the pointer tiles (and confirm the
    # N = 4k sweep's tiles at other lengths)
    # Unset: the decode kernel's sweep first (never timed; bench/tune_decode.py), then the forward's tiles, bf16.
    TUNE_ARGS=${DEVICE_CHECK_TUNE_ARGS-"--quick --kernels decode,attn_fwd --decode-budget-s 100"}
    # shellcheck disable=SC2086
    step tune "bench.tune${TUNE_ARGS:+ $TUNE_ARGS}" $(( TUNE_MS + $(P 15) )) 0 $PY -m bench.tune \
      --budget-s "$(secs "$TUNE_MS")" --json "$OUT/tune.json" ${TUNE_ARGS:-}
    rm -f "$OUT/tune.json.tmp"  # bench.tune's half-written rewrite, if it was killed mid-write ($OUT: 8 files at most)
  else
    skip tune "bench.tune" "out of time ($(secs "$TUNE_MS")s left for it)" norc
  fi
fi

if want tests_rest; then
  XDIST=""
  ((HAVE_XDIST)) && XDIST="-n $(( NCPU < 12 ? NCPU : 12 )) --dist loadgroup"
  # shellcheck disable=SC2086
  step tests_rest "pytest tests (the rest, on GPU)" "$(P 110)" 0 $PY -m pytest tests -q --maxfail=40 $XDIST \
    -p no:cacheprovider --ignore=tests/test_compile.py --ignore=tests/test_bench_smoke.py \
    --ignore=tests/test_device_check_plan.py --ignore=tests/test_examples.py \
    --ignore=tests/test_translate_example.py --ignore=tests/test_main.py \
    -k "not (gpu_large or test_memory or compile or trace or graph or readme)"
fi
want gpu_checks && step gpu_checks "bench.gpu_checks" "$(P 60)" 0 $PY -m bench.gpu_checks --json "$OUT/gpu_checks.json"
want flashtx && step flashtx "python -m flashtx" "$(P 60)" 0 $PY -m flashtx

echo
record_run  # every step, now
echo "=== summary ($(elapsed)s of $(secs "$BUDGET_MS")s) ==="
printf '  %s\n' "${SUMMARY[@]}"
[ -f "$OUT/gpu_checks.json" ] && $PY -c "import json; r = json.load(open('$OUT/gpu_checks.json')); print('  gpu_checks pass:', r.get('pass'), '| memory linear:', r.get('memory_linear'), '| ceilings:', r.get('ceilings'))"
[ -f "$OUT/bench.json" ] && $PY -c "
import json
for b in json.load(open('$OUT/bench.json'))['benchmarks']:
    ei = b.get('extra_info') or {}
    if ei.get('op') == 'model-train':
        print('  model step', ei.get('provider'), '| fullgraph:', ei.get('fullgraph_status'), '| tokens/s:', ei.get('tokens_per_s'))
"
[ -f "$OUT/report/report.md" ] && sed -n '/^## Targets/,/^Plots/p' "$OUT/report/report.md"
ls -la "$OUT" "$OUT/report"
exec 1>&3 2>&4 3>&- 4>&-  # close tee's input, and let it finish writing log.txt
wait "$TEE_PID" 2>/dev/null || sleep 1
exit $FIRST_RC
