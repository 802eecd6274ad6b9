#!/usr/bin/env bash
# Codex CLI and Claude Code against our api_server: one non-interactive session each.
#
#   bash scripts/agent_clients.sh            # both clients
#   bash scripts/agent_clients.sh codex      # just one of them (codex | claude)
#
# Installs @openai/codex and @anthropic-ai/claude-code from npm into .agent-clients/ (once;
# AGENT_CLIENTS_PREFIX moves it), writes a tiny random Qwen3 with a Qwen3-style tools template,
# and starts the api_server on 127.0.0.1 through tests/scripted_server.py, whose sampler is
# forced to a scripted reply for the first model turn of each client (a shell tool call in that
# client's own tool: Codex's `exec_command`, Claude Code's `Bash`) and for the turn after the tool's
# result (a short answer), so the random model drives a real tool round trip. A recording proxy
# (scripts/record_proxy.py) sits between the clients and the server and writes every exchange
# (path, status, request body; the answer of a 4xx/5xx) to $OUT/requests.jsonl.
#
# Codex: a temporary CODEX_HOME whose config.toml names a custom model provider with
# wire_api = "responses" and base_url http://127.0.0.1:PORT/v1; `codex exec` runs the prompt.
# Claude Code: ANTHROPIC_BASE_URL=http://127.0.0.1:PORT, a dummy key, HOME in a temporary folder,
# `claude -p` with the Bash tool allowed.
#
# Prints each client's exit code and answer, the endpoints it hit with their status codes, and
# any 4xx/5xx; exits non-zero if a client failed or the server answered one with an error.
# Needs the npm registry (first run) and the project's venv (LMDEPLOY_PYTHON, default .venv).
# Not part of the test suite: it downloads ~300 MB and takes a minute or two.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
PY=${LMDEPLOY_PYTHON:-$ROOT/.venv/bin/python}
PREFIX=${AGENT_CLIENTS_PREFIX:-$ROOT/.agent-clients}
WHICH=${1:-all}
OUT=$(mktemp -d "${TMPDIR:-/tmp}/agent_clients.XXXXXX")
export MC_TCP_BIND_ADDRESS=127.0.0.1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}

if [ ! -x "$PREFIX/node_modules/.bin/codex" ] || [ ! -x "$PREFIX/node_modules/.bin/claude" ]; then
    echo "==> npm install @openai/codex @anthropic-ai/claude-code into $PREFIX" >&2
    mkdir -p "$PREFIX"
    npm install --prefix "$PREFIX" --no-fund --no-audit @openai/codex @anthropic-ai/claude-code >&2 || exit 1
fi
CODEX=$PREFIX/node_modules/.bin/codex
CLAUDE=$PREFIX/node_modules/.bin/claude
echo "codex: $("$CODEX" --version 2>&1 | tail -1); claude: $("$CLAUDE" --version 2>&1 | tail -1)"

# the model, the scripted replies, the server and the proxy -----------------------------------------
"$PY" -m lmdeploy.tools.make_tiny_model "$OUT/tiny" --arch qwen3 >/dev/null || exit 1
"$PY" - "$OUT" <<'EOF' || exit 1
import json, sys
sys.path.insert(0, 'tests')
from chat_templates import THINKING_TOOLS_TEMPLATE, with_template
out = sys.argv[1]
with_template(out + '/tiny', out + '/model', THINKING_TOOLS_TEMPLATE)
call = lambda name, args: '<tool_call>\n' + json.dumps({'name': name, 'arguments': args}) + '\n</tool_call>'
script = [
    {'contains': 'CODEX-CHECK', 'turn': 0, 'reply': 'Running it.\n' + call('exec_command', {'cmd': 'echo hi-from-codex'})},
    {'contains': 'CODEX-CHECK', 'turn': 1, 'reply': 'The command printed hi-from-codex.'},
    {'contains': 'CLAUDE-CHECK', 'turn': 0, 'reply': 'Running it.\n' + call('Bash', {
        'command': 'echo hi-from-claude', 'description': 'Print a greeting'})},
    {'contains': 'CLAUDE-CHECK', 'turn': 1, 'reply': 'The command printed hi-from-claude.'},
    {'reply': 'OK.'},           # anything else a client asks (titles, summaries): a short answer
]
json.dump(script, open(out + '/script.json', 'w'))
EOF
free_port() { "$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
SPORT=$(free_port); PORT=$(free_port)
LMDEPLOY_TEST_SCRIPT=$(cat "$OUT/script.json") PYTHONPATH=$ROOT "$PY" tests/scripted_server.py serve api_server \
    "$OUT/model" --model-name tiny --server-name 127.0.0.1 --server-port "$SPORT" --log-level INFO \
    --enable-prefix-caching --block-size 16 --session-len 131072 >"$OUT/server.log" 2>&1 &
SERVER=$!
"$PY" scripts/record_proxy.py "$PORT" "$SPORT" "$OUT/requests.jsonl" >"$OUT/proxy.log" 2>&1 &
PROXY=$!
cleanup() { kill "$PROXY" 2>/dev/null; kill "$SERVER" 2>/dev/null; wait "$SERVER" 2>/dev/null; }
trap cleanup EXIT
for _ in $(seq 600); do
    curl -sf "http://127.0.0.1:$PORT/health" >/dev/null 2>&1 && break
    kill -0 "$SERVER" 2>/dev/null || { cat "$OUT/server.log"; exit 1; }
    sleep 0.5
done
echo "server on 127.0.0.1:$SPORT (proxy :$PORT); logs in $OUT"
: > "$OUT/requests.jsonl"

status=0
work=$OUT/work; mkdir -p "$work"
# Codex CLI -----------------------------------------------------------------------------------------
if [ "$WHICH" = all ] || [ "$WHICH" = codex ]; then
    export CODEX_HOME=$OUT/codex-home; mkdir -p "$CODEX_HOME"
    cat >"$CODEX_HOME/config.toml" <<EOF
model = "tiny"
model_provider = "lmdeploy"
check_for_update_on_startup = false

[model_providers.lmdeploy]
name = "lmdeploy"
base_url = "http://127.0.0.1:$PORT/v1"
wire_api = "responses"
env_key = "LMDEPLOY_API_KEY"
request_max_retries = 0
stream_max_retries = 0
EOF
    (cd "$work" && LMDEPLOY_API_KEY=none timeout 300 "$CODEX" exec --skip-git-repo-check \
        --dangerously-bypass-approvals-and-sandbox "CODEX-CHECK: run echo hi-from-codex in the shell and report what it printed." \
        >"$OUT/codex.out" 2>"$OUT/codex.err" </dev/null)
    rc=$?
    echo "== codex exec: exit $rc"; tail -5 "$OUT/codex.out"
    [ $rc = 0 ] || { status=1; tail -20 "$OUT/codex.err"; }
    unset CODEX_HOME
fi
# Claude Code ---------------------------------------------------------------------------------------
if [ "$WHICH" = all ] || [ "$WHICH" = claude ]; then
    mkdir -p "$OUT/claude-home"
    (cd "$work" && HOME=$OUT/claude-home ANTHROPIC_BASE_URL=http://127.0.0.1:$PORT ANTHROPIC_API_KEY=sk-dummy \
        ANTHROPIC_MODEL=tiny ANTHROPIC_SMALL_FAST_MODEL=tiny ANTHROPIC_DEFAULT_HAIKU_MODEL=tiny \
        CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1 DISABLE_AUTOUPDATER=1 DISABLE_TELEMETRY=1 \
        timeout 300 "$CLAUDE" -p "CLAUDE-CHECK: run echo hi-from-claude in the shell and report what it printed." \
        --model tiny --allowedTools Bash \
        >"$OUT/claude.out" 2>"$OUT/claude.err" </dev/null)
    rc=$?
    echo "== claude -p: exit $rc"; tail -5 "$OUT/claude.out"
    [ $rc = 0 ] || { status=1; tail -20 "$OUT/claude.err"; }
fi

# what the server saw -------------------------------------------------------------------------------
"$PY" - "$OUT/requests.jsonl" <<'EOF' || status=1
import collections, json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
hits = collections.Counter((r['method'], r['path'].split('?')[0], r['status']) for r in rows)
print('== endpoints hit (method path status: count)')
for (m, p, s), n in sorted(hits.items()):
    print(f'   {m} {p} {s}: {n}')
print('== model requests in order (path status: the last usage reported)')
for r in rows:
    if r['path'].startswith(('/v1/responses', '/v1/messages', '/v1/chat')):
        print(f"   {r['path']} {r['status']}: {json.dumps(r['usage'][-1]) if r['usage'] else '-'}")
bad = [r for r in rows if r['status'] >= 400]
for r in bad:
    print('!! ', r['method'], r['path'], r['status'], r.get('answer', '')[:500])
sys.exit(1 if bad else 0)
EOF
grep -E '" [45][0-9][0-9]|Traceback' "$OUT/server.log" | head -20
exit $status
