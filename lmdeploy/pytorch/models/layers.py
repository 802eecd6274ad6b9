"""Building blocks shared by the engine's models: norms, rotary embedding, MLP, attention,
packed projections and the weight loader that fills them.

All layers take the flat token axis first (``[T, ...]``) as produced by
:class:`~lmdeploy.pytorch.model_inputs.StepContext`; none of them keeps per-request state —
caches live in the cache engine and arrive through the context.

Projections that read the same input are packed into one :class:`PackedLinear` (one matmul
instead of two or three), while checkpoints keep their separate tensors; :class:`WeightLoader`
copies each checkpoint tensor into its rows::

    checkpoint  self_attn.q_proj.weight  self_attn.k_proj.weight  self_attn.v_proj.weight
    model       self_attn.qkv_proj.weight = [ q rows | k rows | v rows ]

:func:`mlp_split` is the tensor-parallel split of a dense MLP (gate / up rows, down columns).
"""
from __future__ import annotations

from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import find_kernel, get_kernel
from ..kernels.linear import linear
from ..model_inputs import StepContext
from .parallel_plan import Axis, BlockSplit, Piece, cols, rows
from .rope import RotaryEmbedding  # noqa: F401  (re-exported: models import it from here)

__all__ = ['RMSNorm', 'RotaryEmbedding', 'SwiGLUMLP', 'mlp_split', 'Linear', 'PackedLinear', 'WeightLoader', 'apply_rotary', 'attention',
           'apply_renames']


class RMSNorm(nn.Module):
    """Root-mean-square norm (Zhang & Sennrich, 2019), computed in float32.

    Args:
        dim: normalised channels.
        eps: added to the mean square.
        zero_centered: the weight is stored as ``w - 1`` (output ``x̂ * (1 + w)``), the
            Qwen3-Next convention; otherwise ``x̂ * w``.
    """

    def __init__(self, dim: int, eps: float = 1e-6, zero_centered: bool = False):
        super().__init__()
        self.eps = eps
        self.zero_centered = zero_centered
        self.weight = nn.Parameter(torch.zeros(dim) if zero_centered else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., dim]`` → ``[..., dim]`` in ``x.dtype`` (the registry's ``rms_norm``: one native
        pass for float32 on CPU, see :mod:`~lmdeploy.pytorch.kernels.norm`)."""
        return get_kernel('rms_norm', x.device)(x, self.weight, self.eps, self.zero_centered)

    def forward_add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``s = x + residual`` and ``self(s)``, both ``[..., dim]`` in ``x.dtype``: one call for
        float32 where the registry has ``add_rms_norm`` (CPU: one native pass), else the add and
        :meth:`forward`."""
        fused = find_kernel('add_rms_norm', x.device) if x.dtype == torch.float32 else None
        if fused is not None:
            return fused(x, residual, self.weight, self.eps, self.zero_centered)
        total = x + residual
        return total, self(total)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the leading ``cos.shape[-1]`` channels of ``x [T, heads, head_dim]``."""
    rot = cos.shape[-1]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    half = rot // 2
    rotated = torch.cat((-x_rot[..., half:], x_rot[..., :half]), dim=-1)
    out = x_rot * cos[:, None, :] + rotated * sin[:, None, :]
    return torch.cat((out, x_pass), dim=-1) if x_pass.shape[-1] else out


class Linear(nn.Linear):
    """:class:`torch.nn.Linear` whose product picks the faster GEMM orientation for the batch
    shape (:func:`~lmdeploy.pytorch.kernels.linear.linear`); same parameters and state dict.

    After :meth:`to_fp8` the weight is FP8 block-quantized (``weight`` float8_e4m3fn, float32
    ``weight_scale_inv``) and the product is the registry's ``fp8_block_linear``."""

    fp8_block: tuple[int, int] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., in_features]`` → ``[..., out_features]``."""
        return self.product(x, self.bias)

    def product(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ W^T (+ bias)``: ``[..., in_features]`` → ``[..., out_features]``, through the
        FP8 GEMM when the weight is FP8 (a row-parallel subclass adds its bias after the sum)."""
        if self.fp8_block is not None:
            return get_kernel('fp8_block_linear', x.device)(x, self.weight, self.weight_scale_inv, self.fp8_block, bias)
        return linear(x, self.weight, bias)

    def to_fp8(self, block: tuple[int, int]) -> None:
        """Hold the weight as float8_e4m3fn ``[N, K]`` with float32 inverse scales
        ``weight_scale_inv [ceil(N / bn), ceil(K / bk)]`` (both unfilled: the loader copies the
        checkpoint's in, see :mod:`.quantization`)."""
        n, k = self.weight.shape
        dev = self.weight.device
        self.weight = nn.Parameter(torch.empty(n, k, dtype=torch.float8_e4m3fn, device=dev), requires_grad=False)
        self.weight_scale_inv = nn.Parameter(torch.empty(-(-n // block[0]), -(-k // block[1]), dtype=torch.float32,
                                                         device=dev), requires_grad=False)
        self.fp8_block = tuple(block)


class PackedLinear(Linear):
    """Several linear projections of one input as one matmul, their weights stacked by rows.

    Args:
        in_features: input channels.
        shards: ``{checkpoint module name: output rows}`` in row order, e.g.
            ``{'gate_proj': I, 'up_proj': I}``; the checkpoint's ``<parent>.gate_proj.weight``
            fills rows ``[0, I)`` of ``<parent>.<this module>.weight``.
        bias: with a bias (packed the same way).
    """

    def __init__(self, in_features: int, shards: dict[str, int], bias: bool = False):
        super().__init__(in_features, sum(shards.values()), bias=bias)
        self.shard_sizes = list(shards.values())
        self.shard_rows: dict[str, slice] = {}
        start = 0
        for name, rows in shards.items():
            self.shard_rows[name] = slice(start, start + rows)
            start += rows

    def forward_split(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``[T, in]`` → one ``[T, rows]`` view per shard, in order."""
        return self(x).split(self.shard_sizes, dim=-1)


class SwiGLUMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))`` (Shazeer, "GLU Variants Improve Transformer", 2020), with
    gate and up packed into one matmul (``gate_up_proj``, loaded from ``gate_proj`` / ``up_proj``).

    Args:
        hidden_size: input and output channels.
        intermediate_size: the gate's and up's rows.
        bias: biases on all three projections (Bamba's and Falcon-H1's ``mlp_bias``).
        names: the checkpoint's names of ``(gate, up, down)``; ``down`` is also the output
            projection's attribute (LFM2's ``('w1', 'w3', 'w2')``).
    """

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False,
                 names: tuple[str, str, str] = ('gate_proj', 'up_proj', 'down_proj')):
        super().__init__()
        self.gate_up_proj = PackedLinear(hidden_size, {names[0]: intermediate_size, names[1]: intermediate_size},
                                         bias=bias)
        self._down = names[2]
        setattr(self, names[2], Linear(intermediate_size, hidden_size, bias=bias))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, hidden]`` → ``[T, hidden]``."""
        gate, up = self.gate_up_proj.forward_split(x)
        return getattr(self, self._down)(F.silu(gate) * up)


def mlp_split(*, field: str = 'intermediate_size', up: tuple[str, ...] = ('gate_proj', 'up_proj'),
              down: str = 'down_proj', fused: bool = False, down_module: str | None = None, width=None,
              local_field: str | None = None, axis: str = 'intermediate', config: tuple = ()):
    """The tensor-parallel split of a dense MLP (Megatron-style), as a split factory: the
    intermediate rows of the input projections (column-parallel, biases too), the columns of the
    output projection (row-parallel; its bias whole).

    Args:
        field: the config field of the width (intermediate units), named by errors and, unless
            ``local_field`` says otherwise, set to the rank's width in the local config.
        up: the input projections' names (e.g. ``gate_proj``, ``up_proj``; LFM2's ``w1``, ``w3``).
        down: the output projection's checkpoint name.
        fused: ``up`` is one tensor stacking the gate and up rows (``[gate; up]``, e.g.
            Granite's ``input_linear``): the rank reads its rows of each half.
        down_module: the output projection's module name when it differs from ``down``.
        width: ``config -> int`` when the width is not the field's value (LFM2's adjusted width).
        local_field: the config field the local config sets (default ``field``).
        axis: the axis name (distinct when a model has two MLP widths).
        config: further ``(field, value)`` set in the local config.

    Returns:
        ``(config, size) -> BlockSplit``.
    """

    def split(cfg, size: int) -> BlockSplit:
        n = getattr(cfg, field) if width is None else width(cfg)
        a = Axis(axis, n, field, local_field or field)
        ins = rows(up, Piece(axis), Piece(axis, 1, n)) if fused else rows(up, Piece(axis))
        return BlockSplit((a,), (ins, cols(f'{down}.weight', Piece(axis))), row_parallel=(down_module or down,),
                          config=config)

    return split


class WeightLoader:
    """Copies checkpoint tensors into a model's parameters and checks that all were filled.

    A name is resolved, in order, as: a parameter of that exact name; or
    ``<parent>.<shard>.<weight|bias>`` where ``<parent>.<packed>`` is a :class:`PackedLinear`
    with that shard (copied into the shard's rows). Models with other layouts (per-expert
    tensors) copy into parameter slices themselves through :meth:`copy_part`.

    Args:
        module: the model.

    Raises (from the methods):
        KeyError: a tensor has no matching parameter.
        ValueError: a shape mismatch, or parameters (or parts of them) left unfilled.
    """

    def __init__(self, module: nn.Module):
        self.module = module
        self.params = dict(module.named_parameters())
        self._packed: dict[str, tuple[str, slice, int]] = {}   # '<parent>.<shard>' -> (packed path, rows, shards)
        for path, sub in module.named_modules():
            if isinstance(sub, PackedLinear):
                parent = path.rsplit('.', 1)[0] + '.' if '.' in path else ''
                for shard, rows in sub.shard_rows.items():
                    self._packed[parent + shard] = (path, rows, len(sub.shard_rows))
        self._parts: dict[str, tuple[set, int]] = {}   # param -> (parts copied, parts needed)

    def load(self, name: str, tensor: torch.Tensor) -> None:
        """Copy one checkpoint tensor to where it belongs."""
        if name in self.params:
            self.copy_part(name, self.params[name], None, 1, name, tensor)
            return
        stem, _, suffix = name.rpartition('.')
        if stem in self._packed and suffix in ('weight', 'bias'):
            path, rows, num = self._packed[stem]
            target = f'{path}.{suffix}'
            if target in self.params:
                self.copy_part(target, self.params[target][rows], stem, num, name, tensor)
                return
        raise KeyError(f'checkpoint tensor {name!r} has no parameter in {type(self.module).__name__}')

    def copy_part(self, param: str, dst: torch.Tensor, part, num_parts: int, name: str, tensor: torch.Tensor) -> None:
        """Copy ``tensor`` (checkpoint name ``name``) into ``dst``, a view of parameter ``param``
        that is part ``part`` of ``num_parts``."""
        if tuple(dst.shape) != tuple(tensor.shape):
            raise ValueError(f'shape of {name}: checkpoint {tuple(tensor.shape)} vs model {tuple(dst.shape)}')
        with torch.no_grad():
            dst.copy_(tensor.to(dst.dtype))
        self._parts.setdefault(param, (set(), num_parts))[0].add(part)

    def finish(self, tie_word_embeddings: bool = False) -> None:
        """Tie ``lm_head`` to the embedding if asked and not loaded; raise if anything is unfilled."""
        if tie_word_embeddings and 'lm_head.weight' in self.params and 'lm_head.weight' not in self._parts:
            with torch.no_grad():
                self.params['lm_head.weight'].copy_(self.params['model.embed_tokens.weight'])
            self._parts['lm_head.weight'] = ({None}, 1)
        missing = []
        for param in self.params:
            done, needed = self._parts.get(param, (set(), 1))
            if len(done) < needed:
                missing.append(param)
        if missing:
            raise ValueError(f'checkpoint is missing {len(missing)} parameters (or parts of them), e.g. {missing[:5]}')


def load_weights(module: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], tie_word_embeddings: bool = False,
                 rename=None, special=None) -> None:
    """Load HF-named ``(name, tensor)`` pairs with a :class:`WeightLoader`.

    Args:
        module: the model.
        weights: checkpoint tensors.
        tie_word_embeddings: fill ``lm_head.weight`` from ``model.embed_tokens.weight`` when the
            checkpoint has none.
        rename: optional ``name -> name | None`` (``None`` drops the tensor).
        special: optional ``(loader, name, tensor) -> bool`` tried first on each (renamed)
            tensor; True means it copied the tensor itself (e.g. one expert of fused experts).

    Raises:
        KeyError: a tensor has no matching parameter.
        ValueError: a shape mismatch, or parameters the checkpoint did not provide.
    """
    loader = WeightLoader(module)
    for name, tensor in weights:
        if rename is not None:
            name = rename(name)
            if name is None:
                continue
        if special is None or not special(loader, name, tensor):
            loader.load(name, tensor)
    loader.finish(tie_word_embeddings)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: StepContext, layer_idx: int,
              scale: float) -> torch.Tensor:
    """Paged causal attention for layer ``layer_idx`` via the kernel registry.

    Shapes as in :func:`lmdeploy.pytorch.kernels.attention.paged_attention_torch`.
    """
    k_cache, v_cache = ctx.kv_caches[layer_idx]
    return get_kernel('paged_attention', q.device)(q, k, v, k_cache, v_cache, ctx, scale)


def apply_renames(name: str, renames) -> str:
    """A checkpoint tensor name after each ``(compiled pattern, replacement)`` of ``renames``, in
    order (``pattern.sub``): how a family maps published / ``transformers`` names onto its modules."""
    for pattern, repl in renames:
        name = pattern.sub(repl, name)
    return name
