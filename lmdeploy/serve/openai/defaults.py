"""Server defaults the command line shows in ``--help``, in a module that imports nothing, so
that ``lmdeploy serve api_server --help`` does not import the server (FastAPI, torch)."""

__all__ = ['DEFAULT_MAX_REQUEST_BYTES', 'DEFAULT_SHUTDOWN_TIMEOUT']

DEFAULT_MAX_REQUEST_BYTES = 16 << 20    # bytes; larger request bodies get 413
DEFAULT_SHUTDOWN_TIMEOUT = 10.0         # seconds in-flight requests may run after SIGTERM
