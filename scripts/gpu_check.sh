#!/usr/bin/env bash
# Everything that needs a GPU, in one short run (meant to take under 5 minutes on one H200; the
# first run, one process after another, took 7: most of it Triton compiling and fla autotuning):
#   1. environment report (env.json, nvidia-smi.txt): python, torch + its CUDA, triton, fla-core, gcc
#   2. missing Python dependencies installed (torch is never touched: the machine's CUDA build is used)
#   3. every CUDA test (the test files that skip without CUDA; CUDA_TESTS below, in two processes),
#   4. and at the same time, in a third, the kernel suites (their registry checks for CUDA, the
#      Triton interpreter and sm_90 compile tests: CPU work)
#   5. then alone on the GPU, the kernel and decode-throughput benchmark (benchmark/benchmark_cuda.py,
#      a small model: the check that it runs, not the documented numbers)
# Results go to one folder: $OUT if set, else ./gpu_check_out (or --out DIR): a log and a JUnit XML
# per step (with the slowest tests; cuda_tests_1 and _2 are the two CUDA processes), bench_cuda.json,
# summary.json (each step's exit status and seconds). Exits non-zero when any step fails, when CUDA
# is not visible, or when a CUDA test was skipped on the CUDA machine.
#
#   bash scripts/gpu_check.sh                  # on the GPU machine, from a copy of the repository
#   bash scripts/gpu_check.sh --list           # the tests and benchmarks it runs (no GPU needed)
#   bash scripts/gpu_check.sh --dry-run        # print every command instead of running it
#   bash scripts/gpu_check.sh --only cuda_tests -k granite    # rerun what failed, nothing else
#
# Options: --out DIR, --python PY (default: $PYTHON, else python3), --no-install, --no-bench,
# --only STEPS (comma-separated of cuda_tests, kernel_tests, bench_cuda), -k EXPR (pytest's -k for
# the test steps; a process it selects nothing from passes), --budget SECONDS (default 420: the
# steps' time limits are cut to what is left of it), --list, --dry-run, -h.
# The project is not installed: PYTHONPATH points at this checkout. A machine without network needs
# its missing dependencies as wheels: PIP_FIND_LINKS=DIR PIP_NO_INDEX=1 bash scripts/gpu_check.sh.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)

# every test file that skips without CUDA (tests/test_gpu_check.py keeps this list complete)
CUDA_TESTS=(tests/test_cuda.py)
# ... run as two processes at once, split by these complementary -k expressions: the engine tests
# and the kernel tests, whose Triton compiling and fla autotuning (most of their time) then overlap
CUDA_SHARDS=("engine" "not engine")
# suites of the kernels the GPU runs: registry choices per device, Triton under the interpreter
# (tests/test_gpu_check.py: every test file that runs a Triton kernel interpreted is here)
KERNEL_TESTS=(tests/test_state_copy.py tests/test_varlen_kernels.py tests/test_gdn_kernels.py tests/test_kda_kernels.py
              tests/test_thread_safety.py tests/test_mamba2_accel_kernels.py tests/test_hf_reference.py
              tests/test_triton_compile.py tests/test_window_attention_triton.py tests/test_mamba1_kernels.py
              tests/test_lightning_attention.py
              tests/test_fp8.py::test_triton_fp8_gemm_matches_the_torch_fallback_under_interpreter)
# a small model and short runs: on a fresh machine most of its time is Triton compiling and tuning
# (--eager-mode: the decode part also times an eager_mode engine: CUDA graphs on against off)
BENCH=(benchmark/benchmark_cuda.py --device cuda --preset small --batches 1,8 --decode-tokens 32 --repeats 10
       --eager-mode)
STEPS=(cuda_tests kernel_tests bench_cuda)

OUT_DIR=${OUT:-$ROOT/gpu_check_out}
PY=${PYTHON:-python3}
INSTALL=1
DRY=0
BUDGET=420
K_EXPR=
ONLY=" ${STEPS[*]} "
NO_BENCH=0

usage() { sed -n '2,/^set -uo/{/^#/p}' "$0" | sed 's/^# \{0,1\}//'; }
while [ $# -gt 0 ]; do
    case "$1" in
        --out) [ $# -ge 2 ] || { echo "gpu_check: --out needs a folder" >&2; exit 2; }; OUT_DIR=$2; shift 2 ;;
        --python) [ $# -ge 2 ] || { echo "gpu_check: --python needs an interpreter" >&2; exit 2; }; PY=$2; shift 2 ;;
        --budget)
            [[ $# -ge 2 && "$2" =~ ^[0-9]+$ ]] || { echo "gpu_check: --budget needs whole seconds" >&2; exit 2; }
            BUDGET=$2; shift 2 ;;
        --no-install) INSTALL=0; shift ;;
        --no-bench) NO_BENCH=1; shift ;;
        --only)
            [ $# -ge 2 ] || { echo "gpu_check: --only needs steps (${STEPS[*]})" >&2; exit 2; }
            ONLY=" "
            for s in ${2//,/ }; do
                [[ " ${STEPS[*]} " == *" $s "* ]] \
                    || { echo "gpu_check: --only: unknown step $s (${STEPS[*]})" >&2; exit 2; }
                ONLY+="$s "
            done
            shift 2 ;;
        -k)
            [ $# -ge 2 ] || { echo "gpu_check: -k needs a pytest expression" >&2; exit 2; }
            K_EXPR=$2; shift 2 ;;
        --dry-run) DRY=1; shift ;;
        --list)
            printf 'cuda-test %s\n' "${CUDA_TESTS[@]}"
            printf 'kernel-test %s\n' "${KERNEL_TESTS[@]}"
            echo "bench ${BENCH[*]}"
            exit 0 ;;
        -h|--help) usage; exit 0 ;;
        *) echo "gpu_check: unknown option $1 (see --help)" >&2; exit 2 ;;
    esac
done

mkdir -p "$OUT_DIR" || exit 2
OUT_DIR=$(cd "$OUT_DIR" && pwd)
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" MC_TCP_BIND_ADDRESS=127.0.0.1
LOG="$OUT_DIR/gpu_check.log"
: > "$LOG"
SUMMARY=()
FAILED=0

say() { echo "==> $*" | tee -a "$LOG" >&2; }

# wants STEP: the step is selected (--only, --no-bench)
wants() {
    [[ "$ONLY" == *" $1 "* ]] && { [ "$1" != bench_cuda ] || [ "$NO_BENCH" = 0 ]; }
}

declare -A PIDS=() T0=()
# start_step NAME LIMIT_SECONDS CMD...: start CMD in the background (output in NAME.log) within
# LIMIT, cut to the budget left; finish_step NAME waits for it and records it
start_step() {
    local name=$1 limit=$2; shift 2
    local left=$((BUDGET - SECONDS))
    [ "$limit" -le "$left" ] || limit=$left
    if [ "$DRY" = 1 ]; then
        echo "[$name] timeout $limit $*"
        return 0
    fi
    if [ "$limit" -le 10 ]; then
        say "$name: skipped, the ${BUDGET}s budget is spent"
        SUMMARY+=("\"$name\": {\"rc\": null, \"seconds\": 0, \"note\": \"budget spent\"}")
        FAILED=1
        return 1
    fi
    say "$name (limit ${limit}s): $*"
    T0[$name]=$SECONDS
    rm -f "$OUT_DIR/.$name.end"
    # the job notes when it ended: a step waited for after another one still gets its own seconds
    { timeout "$limit" "$@"; local rc=$?; echo "$SECONDS" > "$OUT_DIR/.$name.end"; exit "$rc"; } \
        > "$OUT_DIR/$name.log" 2>&1 &
    PIDS[$name]=$!
}

finish_step() {
    local name=$1 rc=0
    [ -n "${PIDS[$name]:-}" ] || return 0
    wait "${PIDS[$name]}" || rc=$?
    unset "PIDS[$name]"
    local end=$SECONDS
    [ -s "$OUT_DIR/.$name.end" ] && end=$(cat "$OUT_DIR/.$name.end") && rm -f "$OUT_DIR/.$name.end"
    tail -n 5 "$OUT_DIR/$name.log" | tee -a "$LOG" >&2
    if [ "$rc" = 5 ] && [ -n "$K_EXPR" ]; then    # pytest: -k selected no test of this step
        say "$name: no test matches -k '$K_EXPR'"
        rc=0
    fi
    SUMMARY+=("\"$name\": {\"rc\": $rc, \"seconds\": $((end - T0[$name]))}")
    [ "$rc" = 0 ] || { say "$name FAILED (exit $rc; 124 = time limit), see $OUT_DIR/$name.log"; FAILED=1; }
    return "$rc"
}

# step NAME LIMIT_SECONDS CMD...: run CMD in the foreground (start_step, then finish_step)
step() {
    start_step "$@" && finish_step "$1"
}

write_summary() {
    [ "$DRY" = 1 ] && return
    local IFS=,
    echo "{\"out\": \"$OUT_DIR\", \"failed\": $FAILED, \"seconds\": $SECONDS, \"steps\": {${SUMMARY[*]}}}" \
        > "$OUT_DIR/summary.json"
    say "summary: $OUT_DIR/summary.json (failed: $FAILED, ${SECONDS}s)"
}

# 1. environment -----------------------------------------------------------------------------
ENV_PY='
import importlib.util, json, platform, shutil, sys
info = {"python": sys.version.split()[0], "platform": platform.platform(), "gcc": shutil.which("gcc")}
try:
    import torch
    info.update(torch=torch.__version__, torch_cuda=torch.version.cuda, cuda_available=torch.cuda.is_available(),
                devices=[torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])
except Exception as err:
    info.update(torch=None, cuda_available=False, torch_error=repr(err))
for mod in ("triton", "fla", "transformers"):
    try:
        m = __import__(mod) if importlib.util.find_spec(mod) else None
        info[mod] = getattr(m, "__version__", "present") if m else None
    except Exception as err:
        info[mod] = "import failed: %r" % (err,)
print(json.dumps(info, indent=1))
sys.exit(0 if info.get("cuda_available") else 3)
'
if [ "$DRY" = 1 ]; then
    echo "[env] $PY -c <environment report> > $OUT_DIR/env.json"
else
    (nvidia-smi > "$OUT_DIR/nvidia-smi.txt" 2>&1) || true
    "$PY" -c "$ENV_PY" > "$OUT_DIR/env.json" 2>>"$LOG"
    env_rc=$?
    cat "$OUT_DIR/env.json" | tee -a "$LOG" >&2
    if [ "$env_rc" != 0 ]; then
        say "torch sees no CUDA device (or torch is missing): nothing to check here"
        SUMMARY+=("\"env\": {\"rc\": $env_rc, \"seconds\": $SECONDS}")
        FAILED=1
        write_summary
        exit 3
    fi
fi

# 2. dependencies (never torch) --------------------------------------------------------------
REQS="$OUT_DIR/requirements-without-torch.txt"
if [ "$DRY" = 0 ]; then
    cat requirements/runtime.txt requirements/test.txt | sed 's/#.*//' | grep -v -E '^\s*(torch)\b' \
        | grep -v -E '^\s*$' > "$REQS"
fi
MISSING_PY='
import importlib.metadata as md, re, sys
missing = []
for line in open(sys.argv[1]):
    name = re.split(r"[<>=!~\[; ]", line.strip(), maxsplit=1)[0]
    try:
        md.version(name)
    except md.PackageNotFoundError:
        missing.append(name)
print(" ".join(missing))
'
if [ "$INSTALL" = 1 ]; then
    if [ "$DRY" = 1 ]; then
        echo "[install] $PY -m pip install -r $REQS   (only when a requirement is missing)"
    else
        missing=$("$PY" -c "$MISSING_PY" "$REQS")
        if [ -n "$missing" ]; then
            step install 240 "$PY" -m pip install -r "$REQS" \
                || say "install failed (no network? see the header for PIP_FIND_LINKS); missing: $missing"
        else
            say "every requirement is installed"
        fi
    fi
fi

# 3-4. tests, the two steps at once (the kernel suites are mostly CPU work) ------------------------
PYTEST=("$PY" -m pytest -q -rs -p no:cacheprovider --durations=15)
SHARDS=()
if wants cuda_tests; then
    for i in "${!CUDA_SHARDS[@]}"; do
        name=cuda_tests_$((i + 1))
        k=${CUDA_SHARDS[$i]}
        [ -z "$K_EXPR" ] || k="($k) and ($K_EXPR)"
        rm -f "$OUT_DIR/$name.xml"
        start_step "$name" 270 "${PYTEST[@]}" -k "$k" --junitxml="$OUT_DIR/$name.xml" "${CUDA_TESTS[@]}" \
            && SHARDS+=("$name")
    done
fi
if wants kernel_tests; then
    step kernel_tests 200 "${PYTEST[@]}" ${K_EXPR:+-k "$K_EXPR"} --junitxml="$OUT_DIR/kernel_tests.xml" \
        "${KERNEL_TESTS[@]}"
fi
for name in "${SHARDS[@]}"; do
    finish_step "$name"
done
if [ "$DRY" = 0 ] && [ "${#SHARDS[@]}" -gt 0 ]; then
    skipped=$("$PY" -c "import os, sys, xml.etree.ElementTree as E
n = 0
for name in sys.argv[2:]:
    path = os.path.join(sys.argv[1], name + '.xml')
    if os.path.exists(path):
        r = E.parse(path).getroot()
        n += int((r if r.tag == 'testsuite' else r.find('testsuite')).get('skipped', '0'))
print(n)" "$OUT_DIR" "${SHARDS[@]}")
    skipped=${skipped:-0}
    if [ "$skipped" != 0 ]; then
        say "$skipped CUDA test(s) skipped on a CUDA machine (reasons in cuda_tests_*.log): counted as a failure"
        FAILED=1
    fi
fi

# 5. benchmarks, alone on the GPU ----------------------------------------------------------------
if wants bench_cuda; then
    step bench_cuda 150 "$PY" "${BENCH[@]}" --out "$OUT_DIR/bench_cuda.json"
fi

write_summary
exit "$FAILED"
