"""``python -m lmdeploy ...``: the ``lmdeploy`` command, for an environment whose scripts folder
is not on PATH (or to be sure which interpreter, and so which installed copy, runs it)."""
import sys

from lmdeploy.cli.entrypoint import main

if __name__ == '__main__':
    sys.exit(main())
