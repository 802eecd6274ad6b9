"""Install lmdeploy: ``pip install -e .`` (add ``[store]`` for the Mooncake Store tier)."""
import os

from setuptools import find_packages, setup


def _reqs(name):
    path = os.path.join(os.path.dirname(__file__), 'requirements', name)
    with open(path) as f:
        return [line.split('#')[0].strip() for line in f if line.split('#')[0].strip()]


setup(
    name='lmdeploy',
    version='0.1.0',
    description='PyTorch inference engine for hybrid-attention LLMs with recurrent-state prefix caching '
                'and a Mooncake Store tier',
    packages=find_packages(include=['lmdeploy', 'lmdeploy.*']),
    # the native CPU kernels are compiled from their C source when an engine starts
    package_data={'lmdeploy.pytorch.kernels': ['csrc/*.c', 'csrc/*.h']},
    include_package_data=True,
    python_requires='>=3.10',
    install_requires=_reqs('runtime.txt'),
    extras_require={
        'test': _reqs('test.txt'),
        'store': _reqs('store.txt') if os.path.exists(os.path.join(os.path.dirname(__file__), 'requirements',
                                                                    'store.txt')) else [],
        'cuda': _reqs('cuda.txt'),
    },
    entry_points={'console_scripts': ['lmdeploy=lmdeploy.cli.entrypoint:main']},
)
