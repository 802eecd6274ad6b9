"""``lmdeploy`` whose ``file:`` Store can be told to hang in a hand-off put: a prefill server to
kill in the middle of a hand-off (tests/test_pd_server.py).

While the file named by ``PD_BLOCK_HANDOFF`` exists, a put of a hand-off object touches the file
named by ``PD_HANDOFF_STARTED`` and then never returns (the process is killed there), so the
prefill server dies after computing the prompt, with its KV blocks put and its hand-off not.
Usage: ``python tests/pd_prefill_launcher.py serve api_server MODEL ...`` (the ``lmdeploy``
command line).
"""
from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lmdeploy.pytorch.store import file_backend  # noqa: E402

_put = file_backend.FileStore.put


def _put_or_hang(self, key, value, **kw):
    if '/handoff/' in key and os.path.exists(os.environ.get('PD_BLOCK_HANDOFF', '/nonexistent')):
        Path(os.environ['PD_HANDOFF_STARTED']).touch()
        threading.Event().wait()        # until the test kills this process
    return _put(self, key, value, **kw)


file_backend.FileStore.put = _put_or_hang

if __name__ == '__main__':
    from lmdeploy.cli.entrypoint import main
    sys.exit(main(sys.argv[1:]))
