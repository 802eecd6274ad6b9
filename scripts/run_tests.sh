#!/usr/bin/env bash
# Run the test suite (the README's second command; .ci/run calls it too).
# pytest exits non-zero on failures and with 5 when no test ran; both fail this script.
set -euo pipefail
cd "$(dirname "$0")/.."
export MC_TCP_BIND_ADDRESS=127.0.0.1
exec python3 -m pytest -q -p no:cacheprovider --durations=15 tests "$@"
