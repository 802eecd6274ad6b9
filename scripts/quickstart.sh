#!/usr/bin/env bash
# Quick start: the main job on a fresh machine, no GPU and no download of model weights.
#
#  1. installs what is needed (libibverbs1 for Mooncake, a virtual environment, the CPU build
#     of torch, this project with its Store extra, the openai client);
#  2. makes a tiny hybrid Qwen3-Next model with the project's maker;
#  3. starts `lmdeploy serve api_server` with prefix caching, last-only checkpoints and an
#     embedded Mooncake Store (master + segment on 127.0.0.1);
#  4. drives a 5-turn agent conversation through the OpenAI API and prints, per turn, TTFT,
#     prompt tokens, cached tokens and Store bytes written;
#  5. stops everything it started.
#
# Environment: LMDEPLOY_VENV (default .venv), LMDEPLOY_PORT (default: a free port),
# LMDEPLOY_SKIP_INSTALL=1 to use the current python3 as is.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
VENV=${LMDEPLOY_VENV:-$ROOT/.venv}
export MC_TCP_BIND_ADDRESS=127.0.0.1      # every Mooncake process stays on loopback

step() { printf '\n==> %s\n' "$*"; }

if [ "${LMDEPLOY_SKIP_INSTALL:-0}" != 1 ]; then
    step "system packages (libibverbs1 for the Mooncake transfer engine)"
    if ! ldconfig -p 2>/dev/null | grep -q libibverbs.so.1; then
        SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
        $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq libibverbs1 >/dev/null
    fi
    step "virtual environment in $VENV (torch CPU build, lmdeploy[store], openai)"
    [ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check torch==2.13.0
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check -e ".[store]" openai
    PY="$VENV/bin/python"; LMDEPLOY="$VENV/bin/lmdeploy"
else
    PY=python3; LMDEPLOY="python3 -m lmdeploy.cli.entrypoint"
fi

WORK=$(mktemp -d /tmp/lmdeploy-quickstart.XXXXXX)
SERVER_PID=""
cleanup() {
    if [ -n "$SERVER_PID" ] && kill -0 "$SERVER_PID" 2>/dev/null; then
        kill "$SERVER_PID" 2>/dev/null || true
        for _ in $(seq 50); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 0.2; done
        kill -9 "$SERVER_PID" 2>/dev/null || true
    fi
    rm -rf "$WORK"
}
trap cleanup EXIT INT TERM

step "tiny hybrid model (Qwen3-Next layout, random weights, trained BPE tokenizer)"
$LMDEPLOY make-tiny-model "$WORK/model" --arch qwen3_next

PORT=${LMDEPLOY_PORT:-$("$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}
step "api_server on 127.0.0.1:$PORT with --enable-prefix-caching --prefill-save-last-only --mooncake-master local"
# Small geometry so a CPU shows checkpoints within a few hundred tokens: 16-token blocks,
# checkpoints every 64 tokens, 256-token prefill chunks (production defaults: 64 / 1024 / 8192).
$LMDEPLOY serve api_server "$WORK/model" --server-name 127.0.0.1 --server-port "$PORT" \
    --enable-prefix-caching --prefill-save-last-only --mooncake-master local \
    --block-size 16 --prefill-save-alignment 64 --max-prefill-token-num 256 \
    --log-level WARNING > "$WORK/server.log" 2>&1 &
SERVER_PID=$!

step "5-turn agent conversation through the OpenAI API"
if ! "$PY" scripts/quickstart_client.py --base-url "http://127.0.0.1:$PORT" --turns 5 --server-pid "$SERVER_PID"; then
    echo "quick start failed; server log:" >&2
    tail -n 50 "$WORK/server.log" >&2
    exit 1
fi
step "done: stopping the server and the embedded Store"
