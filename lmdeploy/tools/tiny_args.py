"""The ``make-tiny-model`` arguments, their checks and the architecture names, without importing
torch (``lmdeploy --help`` builds this parser: :mod:`lmdeploy.cli.tiny_model`; the checkpoint
writer, :mod:`lmdeploy.tools.make_tiny_model`, is imported only when the command runs)."""
from __future__ import annotations

import argparse
import os

__all__ = ['ARCHS', 'DEFAULT_ARCH', 'VL_ARCHS', 'MTP_ARCHS', 'NEXTN_ARCHS', 'DTYPE_NAMES', 'add_arguments', 'check_args']

ARCHS = ('qwen3', 'qwen3_next', 'qwen3_5', 'qwen3_5_moe', 'qwen3_5_moe_text', 'kimi_linear', 'glm5_next', 'nemotron_h',
         'granitemoehybrid', 'granitemoe_swa', 'lfm2', 'lfm2_moe', 'bamba', 'mamba2', 'falcon_h1', 'mamba',
         'falcon_mamba', 'jamba', 'bailing_hybrid', 'minimax', 'olmo_hybrid', 'zamba2', 'lara_mini',
         'lfm3', 'inkling_text')
DEFAULT_ARCH = 'qwen3_next'     # the quick start's and the tests' usual arch
VL_ARCHS = ('qwen3_5', 'qwen3_5_moe')                          # vision-language checkpoints
MTP_ARCHS = ('qwen3_next', 'qwen3_5_moe', 'qwen3_5_moe_text')  # published with an mtp.* head
NEXTN_ARCHS = ('glm5_next',)    # the NextN layer model.layers.{num_hidden_layers}.*, written with mtp=True only
DTYPE_NAMES = ('float32', 'bfloat16', 'float16')       # stored weight dtypes (torch names)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the arguments of `make-tiny-model` (OUT_DIR and its flags) to `parser`."""
    parser.add_argument('out_dir', metavar='OUT_DIR', help='directory to write the checkpoint into')
    parser.add_argument('--arch', choices=ARCHS, default=DEFAULT_ARCH,
                        help=f'model architecture (default: {DEFAULT_ARCH})')
    parser.add_argument('--seed', type=int, default=0,
                        help='weight seed; the tokenizer does not depend on it (default: 0)')
    parser.add_argument('--dtype', choices=DTYPE_NAMES, default='float32',
                        help='stored weight dtype (default: float32)')
    parser.add_argument('--mtp', action=argparse.BooleanOptionalAction, default=None,
                        help=f'also write the multi-token-prediction head: mtp.* (default: on for '
                        f'{", ".join(MTP_ARCHS)}) or the NextN layer ({", ".join(NEXTN_ARCHS)}: off by default); '
                        'other architectures have none')
    parser.add_argument('--fp8', action='store_true',
                        help='store the matrices FP8 (e4m3) block-quantized with 128x128 inverse scales, as the '
                        'official FP8 checkpoints (default: off)')
    parser.add_argument('--force', action='store_true',
                        help='write into OUT_DIR even if it is not empty, replacing the checkpoint files '
                        '(default: refuse a non-empty directory)')


def check_args(args: argparse.Namespace) -> None:
    """Refuse parsed `args` that cannot make a checkpoint, before torch is imported.

    Raises ValueError when `out_dir` exists and is not a directory, or is not empty unless
    `args.force`, or for `--mtp` with an architecture outside `MTP_ARCHS` and `NEXTN_ARCHS`.
    """
    mtp = getattr(args, 'mtp', None)
    if mtp and args.arch not in MTP_ARCHS + NEXTN_ARCHS:
        raise ValueError(f'--mtp: only {", ".join(MTP_ARCHS + NEXTN_ARCHS)} checkpoints have an MTP head, '
                         f'not --arch {args.arch}')
    if os.path.exists(args.out_dir) and not os.path.isdir(args.out_dir):
        raise ValueError(f'out_dir {args.out_dir!r} exists and is not a directory')
    if os.path.isdir(args.out_dir) and os.listdir(args.out_dir) and not getattr(args, 'force', False):
        raise ValueError(f'out_dir {args.out_dir!r} is not empty; pass --force to overwrite its checkpoint files')
