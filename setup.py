"""Install lmdeploy: ``pip install -e .`` (add ``[store]`` for the Mooncake Store tier, ``[fleet]`` for
the router of ``lmdeploy serve fleet``)."""
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
    # csrc holds the native CPU kernels' C source, compiled when an engine starts; it is listed
    # as a (data-only) package of its own, which setuptools requires of an importable folder
    # (otherwise a 40-line BuildBackendWarning on every install)
    packages=find_packages(include=['lmdeploy', 'lmdeploy.*']) + ['lmdeploy.pytorch.kernels.csrc'],
    package_data={'lmdeploy.pytorch.kernels.csrc': ['*.c', '*.h']},
    include_package_data=True,
    # the root folder as the packages' folder: `pip install -e .` then puts the checkout on
    # sys.path with a .pth file (as `setup.py develop` did) instead of setuptools' import hook,
    # which prints an "Editable installation" warning on every install
    package_dir={'': '.'},
    python_requires='>=3.10',
    install_requires=_reqs('runtime.txt'),
    extras_require={
        'test': _reqs('test.txt'),
        'store': _reqs('store.txt') if os.path.exists(os.path.join(os.path.dirname(__file__), 'requirements',
                                                                    'store.txt')) else [],
        'cuda': _reqs('cuda.txt'),
        'fleet': _reqs('fleet.txt'),
    },
    entry_points={'console_scripts': ['lmdeploy=lmdeploy.cli.entrypoint:main']},
)
