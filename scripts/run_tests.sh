#!/usr/bin/env bash
# Run the test suite (the README's second command; .ci/run calls it too).
#
#   bash scripts/run_tests.sh                               # every test under tests/
#   bash scripts/run_tests.sh tests/test_block_trie.py      # just these files / node ids
#   bash scripts/run_tests.sh -k restore                    # pytest options apply to tests/
#
# Uses python3 when it already has the project's dependencies (as in CI, after .ci/run's
# installs); otherwise installs them into the quick start's virtual environment
# (LMDEPLOY_VENV, default .venv; LMDEPLOY_TORCH_INDEX picks torch's pip index) first, so the
# command also works on a fresh machine.
# pytest exits non-zero on failures and with 5 when no test ran; both fail this script.
set -euo pipefail
cd "$(dirname "$0")/.."
export MC_TCP_BIND_ADDRESS=127.0.0.1      # every Mooncake process stays on loopback

# Piping `ldconfig -p` into `grep -q` fails now and then under pipefail (grep exits early, ldconfig gets
# SIGPIPE); matching the captured output has no pipe.
have_libibverbs() { [[ "$(ldconfig -p 2>/dev/null || true)" == *libibverbs.so.1* ]]; }

NEEDED='import torch, transformers, fastapi, openai, pytest, hypothesis, triton, mooncake.store'
PY=python3
if ! python3 -c "$NEEDED" 2>/dev/null; then
    VENV=${LMDEPLOY_VENV:-$(pwd)/.venv}
    echo "==> installing the test environment into $VENV" >&2
    if ! have_libibverbs; then
        SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
        $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq libibverbs1 >/dev/null
    fi
    [ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
    TORCH_ARGS=(torch==2.13.0)
    [ -z "${LMDEPLOY_TORCH_INDEX:-}" ] || TORCH_ARGS+=(--index-url "$LMDEPLOY_TORCH_INDEX")
    t0=$SECONDS
    echo "    torch 2.13.0 ..." >&2
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check "${TORCH_ARGS[@]}"
    echo "    lmdeploy[test,store] (editable) ... ($((SECONDS - t0)) s so far)" >&2
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check -e ".[test,store]"
    echo "    installed in $((SECONDS - t0)) s" >&2
    PY="$VENV/bin/python"
    export PATH="$VENV/bin:$PATH"         # mooncake_master / mooncake_client of the venv
fi

# Paths or node ids among the arguments replace the default `tests`; options alone apply to it.
TARGETS=(tests)
for arg in "$@"; do
    case "$arg" in
        -*) ;;
        *) if [ -e "${arg%%::*}" ]; then TARGETS=(); break; fi ;;
    esac
done
exec "$PY" -m pytest -q -p no:cacheprovider --durations=15 "${TARGETS[@]}" "$@"
