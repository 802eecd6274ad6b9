#!/usr/bin/env bash
# Quick start: the main job on a fresh machine, no GPU and no download of model weights.
#
#  1. installs what is needed (libibverbs1 for Mooncake, a virtual environment, torch, this
#     project with its Store extra, the openai client), one timed line per step;
#  2. makes a tiny hybrid Qwen3-Next model with the project's maker (kept, see below);
#  3. starts a Mooncake Store (`lmdeploy serve store`: mooncake_master, a metadata server and
#     the segment owner holding the Store's memory, on 127.0.0.1) that outlives the servers;
#  4. starts `lmdeploy serve api_server` with prefix caching and last-only checkpoints on that
#     Store, drives a 5-turn agent conversation through the OpenAI API and prints, per turn,
#     TTFT, prompt tokens, cached tokens and Store bytes written; then stops that server;
#  5. starts a FRESH api_server (empty local cache) on the same Store, sends the conversation's
#     next turn and prints the tokens it restored from the Store;
#  6. stops everything it started, and prints the line that activates its environment.
#
# Environment: LMDEPLOY_VENV (default .venv), LMDEPLOY_QUICKSTART_DIR (model, conversation and
# logs; default .quickstart, kept), LMDEPLOY_PORT (default: a free port),
# LMDEPLOY_STORE_MASTER_PORT / LMDEPLOY_STORE_METADATA_PORT / LMDEPLOY_STORE_METRICS_PORT (the
# Store's ports, default: free ones), LMDEPLOY_TORCH_INDEX
# (pip index for torch, e.g. PyTorch's CPU-only index on a machine without a GPU),
# LMDEPLOY_SKIP_INSTALL=1 to use the current python3 as is.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
VENV=${LMDEPLOY_VENV:-$ROOT/.venv}
OUT=${LMDEPLOY_QUICKSTART_DIR:-$ROOT/.quickstart}
export MC_TCP_BIND_ADDRESS=127.0.0.1      # every Mooncake process stays on loopback

step() { printf '\n==> %s\n' "$*"; }
# Piping `ldconfig -p` into `grep -q` fails now and then under pipefail (grep exits early, ldconfig gets
# SIGPIPE); matching the captured output has no pipe.
have_libibverbs() { [[ "$(ldconfig -p 2>/dev/null || true)" == *libibverbs.so.1* ]]; }
pip_step() {  # pip_step "what" ARGS...: one line per install step, with its time
    local what=$1 t0=$SECONDS
    shift
    printf '    %-58s' "$what ..."
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check "$@"
    printf ' %4d s\n' $((SECONDS - t0))
}

if [ "${LMDEPLOY_SKIP_INSTALL:-0}" != 1 ]; then
    step "system packages (libibverbs1 for the Mooncake transfer engine)"
    if ! have_libibverbs; then
        SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
        $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq libibverbs1 >/dev/null
    fi
    echo "    libibverbs1 present"
    step "virtual environment $VENV (about 2 minutes the first time, seconds after)"
    [ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
    TORCH_ARGS=(torch==2.13.0)
    [ -z "${LMDEPLOY_TORCH_INDEX:-}" ] || TORCH_ARGS+=(--index-url "$LMDEPLOY_TORCH_INDEX")
    pip_step "pip (upgrade)" --upgrade pip
    pip_step "torch 2.13.0${LMDEPLOY_TORCH_INDEX:+ from $LMDEPLOY_TORCH_INDEX}" "${TORCH_ARGS[@]}"
    pip_step "lmdeploy[store] (editable) + openai" -e ".[store]" openai
    PY="$VENV/bin/python"; LMDEPLOY="$VENV/bin/lmdeploy"
else
    PY=python3; LMDEPLOY="python3 -m lmdeploy.cli.entrypoint"
fi

mkdir -p "$OUT"
SERVER_PID=""; STORE_PID=""
stop_pid() {  # SIGTERM, then SIGKILL after 10 s
    local pid=$1
    [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null || return 0
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.2; done
    kill -9 "$pid" 2>/dev/null || true
}
cleanup() { stop_pid "$SERVER_PID"; stop_pid "$STORE_PID"; }
trap cleanup EXIT INT TERM

step "tiny hybrid model (Qwen3-Next layout, random weights, trained BPE tokenizer)"
$LMDEPLOY make-tiny-model "$OUT/model" --arch qwen3_next --force

step "Mooncake Store on 127.0.0.1 (lmdeploy serve store), shared by the two servers below"
$LMDEPLOY serve store --segment-size $((256 << 20)) --log-dir "$OUT/store-logs" \
    --master-port "${LMDEPLOY_STORE_MASTER_PORT:-0}" --metadata-port "${LMDEPLOY_STORE_METADATA_PORT:-0}" \
    --metrics-port "${LMDEPLOY_STORE_METRICS_PORT:-0}" > "$OUT/store.log" 2>&1 &
STORE_PID=$!
for _ in $(seq 300); do
    grep -q '^metadata_server:' "$OUT/store.log" 2>/dev/null && break
    kill -0 "$STORE_PID" 2>/dev/null || { cat "$OUT/store.log" >&2; exit 1; }
    sleep 0.2
done
MASTER=$(sed -n 's/^mooncake_master: //p' "$OUT/store.log")
METADATA=$(sed -n 's/^metadata_server: //p' "$OUT/store.log")
[ -n "$MASTER" ] && [ -n "$METADATA" ] || { echo "the Store did not start:" >&2; cat "$OUT/store.log" >&2; exit 1; }
echo "    master $MASTER, metadata server $METADATA (service logs: $OUT/store-logs)"

# One secret for both servers: they accept only Store objects written under it.
"$PY" -c 'import secrets; print(secrets.token_hex(32))' > "$OUT/store.secret" && chmod 600 "$OUT/store.secret"
PORT=${LMDEPLOY_PORT:-$("$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}
# Small geometry so a CPU shows checkpoints within a few hundred tokens: 16-token blocks,
# checkpoints every 64 tokens, 256-token prefill chunks (production defaults: 64 / 1024 / 8192).
SERVER_FLAGS=(--server-name 127.0.0.1 --server-port "$PORT"
              --enable-prefix-caching --prefill-save-last-only
              --mooncake-master "$MASTER" --mooncake-metadata-server "$METADATA" --store-secret-file "$OUT/store.secret"
              --block-size 16 --prefill-save-alignment 64 --max-prefill-token-num 256 --log-level WARNING)

run_server() {  # run_server LOG: start an api_server in the background
    $LMDEPLOY serve api_server "$OUT/model" "${SERVER_FLAGS[@]}" > "$1" 2>&1 &
    SERVER_PID=$!
}
fail() { echo "quick start failed; server log $1:" >&2; tail -n 50 "$1" >&2; exit 1; }

step "server 1 on 127.0.0.1:$PORT: a 5-turn agent conversation through the OpenAI API"
run_server "$OUT/server1.log"
"$PY" scripts/quickstart_client.py --base-url "http://127.0.0.1:$PORT" --turns 5 --server-pid "$SERVER_PID" \
    --save-conversation "$OUT/conversation.json" || fail "$OUT/server1.log"
stop_pid "$SERVER_PID"; SERVER_PID=""

step "server 2, a fresh process with an empty local cache: the next turn restores the conversation from the Store"
run_server "$OUT/server2.log"
"$PY" scripts/quickstart_client.py --base-url "http://127.0.0.1:$PORT" --server-pid "$SERVER_PID" \
    --resume "$OUT/conversation.json" || fail "$OUT/server2.log"

step "done: stopping the server and the Store"
cleanup; SERVER_PID=""; STORE_PID=""
echo "kept in $OUT: the model (lmdeploy serve api_server $OUT/model ...), conversation.json and the logs"
if [ "${LMDEPLOY_SKIP_INSTALL:-0}" != 1 ]; then
    echo "to use this environment (lmdeploy on PATH, import lmdeploy) in your shell, run:"
    echo "source $VENV/bin/activate"
fi
