#!/usr/bin/env bash
# Run the test suite (the README's second command; .ci/run calls it too).
#
# Uses python3 when it already has the project's dependencies (as in CI, after .ci/run's
# installs); otherwise installs them into the quick start's virtual environment
# (LMDEPLOY_VENV, default .venv) first, so the command also works on a fresh machine.
# pytest exits non-zero on failures and with 5 when no test ran; both fail this script.
set -euo pipefail
cd "$(dirname "$0")/.."
export MC_TCP_BIND_ADDRESS=127.0.0.1      # every Mooncake process stays on loopback

NEEDED='import torch, transformers, fastapi, openai, pytest, hypothesis, triton, mooncake.store'
PY=python3
if ! python3 -c "$NEEDED" 2>/dev/null; then
    VENV=${LMDEPLOY_VENV:-$(pwd)/.venv}
    echo "==> installing the test environment into $VENV" >&2
    if ! ldconfig -p 2>/dev/null | grep -q libibverbs.so.1; then
        SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
        $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq libibverbs1 >/dev/null
    fi
    [ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check torch==2.13.0
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check -e ".[test,store]"
    PY="$VENV/bin/python"
    export PATH="$VENV/bin:$PATH"         # mooncake_master / mooncake_client of the venv
fi
exec "$PY" -m pytest -q -p no:cacheprovider --durations=15 tests "$@"
