#!/usr/bin/env bash
# Run the test suite (the README's second command; .ci/run calls it too).
#
#   bash scripts/run_tests.sh                               # every test under tests/
#   bash scripts/run_tests.sh tests/test_block_trie.py      # just these files / node ids
#   bash scripts/run_tests.sh -k restore                    # pytest options apply to tests/
#   LMDEPLOY_TEST_WORKERS=1 bash scripts/run_tests.sh       # the whole suite in one process
#
# The tests always run in the project's own virtual environment (LMDEPLOY_VENV, default .venv,
# made with `python3 -m venv`, so nothing of the system's site-packages is seen): only what the
# project's files install counts, as on a fresh machine. The environment is installed on the
# first call and again only when requirements/*.txt or setup.py change (a stamp file in the
# venv records their digest); later calls start the tests at once. LMDEPLOY_TORCH_INDEX picks
# torch's pip index.
# pytest exits non-zero on failures and with 5 when no test ran; both fail this script.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
export MC_TCP_BIND_ADDRESS=127.0.0.1      # every Mooncake process stays on loopback

# Piping `ldconfig -p` into `grep -q` fails now and then under pipefail (grep exits early, ldconfig gets
# SIGPIPE); matching the captured output has no pipe.
have_libibverbs() { [[ "$(ldconfig -p 2>/dev/null || true)" == *libibverbs.so.1* ]]; }

VENV=${LMDEPLOY_VENV:-$ROOT/.venv}
TORCH_SPEC=torch==2.13.0
# what the environment is made from: a change to any of these reinstalls it
DIGEST=$( (echo "$TORCH_SPEC ${LMDEPLOY_TORCH_INDEX:-}"; cat setup.py requirements/*.txt) | sha256sum | cut -d' ' -f1)
STAMP="$VENV/.lmdeploy-test-env"
if [ ! -x "$VENV/bin/python" ] || [ "$(cat "$STAMP" 2>/dev/null)" != "$DIGEST" ]; then
    echo "==> installing the test environment into $VENV (a few minutes the first time)" >&2
    if ! have_libibverbs; then
        SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
        $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq libibverbs1 >/dev/null
    fi
    [ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
    rm -f "$STAMP"
    TORCH_ARGS=("$TORCH_SPEC")
    [ -z "${LMDEPLOY_TORCH_INDEX:-}" ] || TORCH_ARGS+=(--index-url "$LMDEPLOY_TORCH_INDEX")
    t0=$SECONDS
    echo "    torch 2.13.0 ..." >&2
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check "${TORCH_ARGS[@]}"
    echo "    lmdeploy[test,store,fleet] (editable) ... ($((SECONDS - t0)) s so far)" >&2
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check -e ".[test,store,fleet]"
    echo "    installed in $((SECONDS - t0)) s" >&2
    echo "$DIGEST" > "$STAMP"
fi
PY="$VENV/bin/python"
export PATH="$VENV/bin:$PATH"             # lmdeploy, mooncake_master / mooncake_client of the venv

# Paths or node ids among the arguments replace the default `tests`; options alone apply to it.
TARGETS=(tests)
for arg in "$@"; do
    case "$arg" in
        -*) ;;
        *) if [ -e "${arg%%::*}" ]; then TARGETS=(); break; fi ;;
    esac
done

# Worker processes (pytest-xdist). The whole suite spreads its files over min(CPUs, 4) workers,
# a file at a time (--dist loadfile), so a module's server or engine fixture starts once: 20 min
# instead of 36 on a 2-core machine, each test still on one intra-op thread (tests/conftest.py).
# Paths or node ids run in this one process (unless LMDEPLOY_TEST_WORKERS is set), as does any run
# given its own -n, --dist, -p no:xdist, -m, -s, a debugger, a collect-only, a report file or a
# help option; LMDEPLOY_TEST_WORKERS=N sets the count (0 or 1: none).
# (nproc without OMP_NUM_THREADS, which it would otherwise report: the tests set it to 1.)
WORKERS=${LMDEPLOY_TEST_WORKERS:-}
if [ -z "$WORKERS" ]; then
    WORKERS=1
    if [ "${#TARGETS[@]}" -gt 0 ]; then WORKERS=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc); [ "$WORKERS" -le 4 ] || WORKERS=4; fi
fi
[[ "$WORKERS" =~ ^[0-9]+$ ]] || { echo "LMDEPLOY_TEST_WORKERS must be a count of processes, got '$WORKERS'" >&2; exit 2; }
prev=
for arg in "$@"; do
    case "$arg" in
        -n|-n[0-9]*|-nauto|-nlogical|--numprocesses*|--dist*|-pno:xdist|--pdb|--trace|--co|--collect-only|-m|-m?*|\
        -[a-zA-Z]*m*|-h|--help|--version|-V|--markers|--fixtures*|--setup-plan|--setup-only|--junit*|--report-log*|\
        --html*|-s|--capture*)
            WORKERS=1 ;;
        no:xdist) [ "$prev" != -p ] || WORKERS=1 ;;
    esac
    prev=$arg
done
PYTEST=("$PY" -m pytest -q -p no:cacheprovider --durations=15)
[ "$WORKERS" -gt 1 ] || exec "${PYTEST[@]}" "${TARGETS[@]}" "$@"

# The tests marked `timing` bound a wall-clock latency (a health probe under 100 ms while a big
# body is parsed, a shutdown within its grace): they run afterwards in this one process, with no
# other test beside them. Exit status: the first failure's; 5 (no test ran) only when neither run
# ran a test.
# An interrupt (2), an internal or usage error (3, 4), or a failure under -x / --maxfail ends the
# script before the second run.
set +e
"${PYTEST[@]}" -n "$WORKERS" --dist loadfile -m 'not timing' "${TARGETS[@]}" "$@"
rc=$?
case $rc in 0|5) ;; 1) [[ " $* " != *" -x "* && " $* " != *" --exitfirst "* && " $* " != *" --maxfail"* ]] || exit 1 ;;
    *) exit "$rc" ;; esac
"${PYTEST[@]}" -m timing "${TARGETS[@]}" "$@"
rc_timing=$?
set -e
if [ "$rc" = 5 ] && [ "$rc_timing" = 5 ]; then exit 5; fi
for code in "$rc" "$rc_timing"; do
    [ "$code" = 0 ] || [ "$code" = 5 ] || exit "$code"
done
exit 0
