"""Convert a benchmark model directory to GGUF with llama.cpp's own converter, for the llama.cpp
column of ``benchmark_throughput.py``.

llama.cpp's ``convert_hf_to_gguf.py`` identifies a byte-level BPE tokenizer's pre-tokenizer by
a hash of how it splits a fixed text, and refuses tokenizers it has no hash for, as it does the
small trained tokenizer of ``lmdeploy make-tiny-model``. This script runs that converter
unchanged except for that lookup, which it answers with ``qwen2`` (the Qwen split rules) when the
hash is unknown. The throughput benchmark feeds token ids, never text, so the choice does not
touch what it measures; the weights, the layer types and the model hyperparameters are
converted by llama.cpp's code as for any checkpoint.

Usage (``LLAMA_CPP`` is a llama.cpp source tree, e.g. ``vendor/llama.cpp`` of the
``llama-cpp-python`` source distribution)::

    python3 benchmark/make_gguf.py --llama-cpp $LLAMA_CPP --model MODEL_DIR --out model.f32.gguf

Raises:
    FileNotFoundError: ``--llama-cpp`` has no ``convert_hf_to_gguf.py`` or no ``conversion``
        package (trees older than 2026 kept the model classes in the script itself).
"""
from __future__ import annotations

import argparse
import os
import runpy
import sys


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--llama-cpp', required=True, help='llama.cpp source tree (holds convert_hf_to_gguf.py)')
    p.add_argument('--model', required=True, help='model directory (config.json, safetensors, tokenizer)')
    p.add_argument('--out', required=True, help='GGUF file to write')
    p.add_argument('--outtype', default='f32', help='converter --outtype (f32 for the float32 comparison)')
    args = p.parse_args(argv)
    root = os.path.abspath(args.llama_cpp)
    script = os.path.join(root, 'convert_hf_to_gguf.py')
    if not os.path.isfile(script):
        raise FileNotFoundError(f'--llama-cpp {args.llama_cpp!r} has no convert_hf_to_gguf.py')
    sys.path[:0] = [root, os.path.join(root, 'gguf-py')]
    try:
        from conversion.base import TextModel    # where recent llama.cpp trees keep the model classes
    except ImportError as err:
        raise FileNotFoundError(f'--llama-cpp {args.llama_cpp!r}: no importable conversion/base.py ({err}); '
                                'use a llama.cpp tree from 2026 or later') from err
    lookup = TextModel.get_vocab_base_pre

    def vocab_base_pre(self, tokenizer) -> str:
        try:
            return lookup(self, tokenizer)
        except NotImplementedError:     # a pre-tokenizer hash the converter does not know
            return 'qwen2'

    TextModel.get_vocab_base_pre = vocab_base_pre
    sys.argv = [script, args.model, '--outfile', args.out, '--outtype', args.outtype]
    runpy.run_path(script, run_name='__main__')


if __name__ == '__main__':
    main()
