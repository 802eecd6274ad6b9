"""lmdeploy: a PyTorch inference engine for hybrid-attention LLMs with prefix caching of
recurrent-state checkpoints and a Mooncake Store tier.

Entry points: :func:`pipeline`, :class:`PytorchEngineConfig`,
:class:`GenerationConfig`, and the ``lmdeploy`` console script.
"""
from .messages import GenerationConfig, PytorchEngineConfig, Response

__version__ = '0.1.0'
__all__ = ['pipeline', 'PytorchEngineConfig', 'GenerationConfig', 'Response', '__version__']


_LOG_LEVELS = ('DEBUG', 'INFO', 'WARNING', 'ERROR', 'CRITICAL')


def pipeline(model_path: str, backend_config: PytorchEngineConfig | dict | None = None, *, log_level: str | None = None,
             **kwargs):
    """Build a :class:`lmdeploy.serve.pipeline.Pipeline` serving ``model_path`` (a local HF directory).

    Args:
        model_path: the model directory.
        backend_config: engine configuration, a :class:`PytorchEngineConfig` or a dict of its fields
            (default: the defaults).
        log_level: level of the ``lmdeploy`` logger (``'DEBUG'`` ... ``'CRITICAL'``); None
            leaves it as configured. When neither that logger nor the root logger has a handler
            yet (an application that has not configured logging), a stderr handler is added,
            so INFO and DEBUG lines are shown, not only warnings.

    Raises:
        ValueError: ``model_path`` is not a model directory, the model type is unsupported, an
            unknown ``log_level``, or a keyword argument this engine does not take (named).
    """
    if kwargs:
        raise ValueError(f'pipeline() does not take {sorted(kwargs)}; it takes model_path, backend_config '
                         f'(a PytorchEngineConfig) and log_level')
    if log_level is not None:
        if not isinstance(log_level, str) or log_level.upper() not in _LOG_LEVELS:
            raise ValueError(f'log_level must be one of {list(_LOG_LEVELS)}, got {log_level!r}')
        import logging
        logger = logging.getLogger('lmdeploy')
        logger.setLevel(log_level.upper())
        if not logger.handlers and not logging.getLogger().handlers:
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter('%(asctime)s %(levelname)s %(name)s: %(message)s'))
            logger.addHandler(handler)
    from .serve.pipeline import Pipeline
    return Pipeline(model_path, backend_config=backend_config)
