"""lmdeploy: a PyTorch inference engine for hybrid-attention LLMs with prefix caching of
recurrent-state checkpoints and a Mooncake Store tier.

Entry points: :func:`pipeline`, :class:`PytorchEngineConfig`,
:class:`GenerationConfig`, and the ``lmdeploy`` console script.
"""
from .messages import GenerationConfig, PytorchEngineConfig, Response

__version__ = '0.1.0'
__all__ = ['pipeline', 'PytorchEngineConfig', 'GenerationConfig', 'Response', '__version__']


def pipeline(model_path: str, backend_config: PytorchEngineConfig | None = None, **kwargs):
    """Build a :class:`lmdeploy.serve.pipeline.Pipeline` serving ``model_path`` (a local HF directory).

    Raises:
        ValueError: ``model_path`` is not a model directory, or the model type is unsupported.
    """
    from .serve.pipeline import Pipeline
    return Pipeline(model_path, backend_config=backend_config, **kwargs)
