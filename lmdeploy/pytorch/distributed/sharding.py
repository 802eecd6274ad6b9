"""How a model is split over the tensor-parallel ranks (Megatron-LM's scheme: Shoeybi et al.,
"Megatron-LM: Training Multi-Billion Parameter Language Models Using Model Parallelism", 2019).

What splits how is the model's own declaration: its class's ``parallel_plan``
(:class:`~lmdeploy.pytorch.models.parallel_plan.ParallelPlan`: gated query, Gated DeltaNet,
dense MLPs, checkpoint renames, rank-0-only tensors); this module applies any plan and never
branches on the model type.

Each rank builds the model from a *local config* (head and channel counts divided by the TP
size), so every layer, packed projection and cache spec of the engine's models comes out with
this rank's sizes without the models knowing about parallelism. A few modules are then swapped
for their parallel forms, and :meth:`TPLayout.shard` says which rows or columns of each
checkpoint tensor the rank reads::

    tensor (checkpoint name)                 split      on rank r (of N)
    embed_tokens, lm_head                    vocab      rows [r*V/N, (r+1)*V/N)  (V padded up)
    self_attn.q_proj                         column     query heads  r*H/N ...   (+ output gate rows)
    self_attn.k_proj / v_proj                column     KV heads r*KV/N ...; replicated when KV < N
    self_attn.o_proj                         row        input columns of its query heads, all-reduce
    mlp.gate_proj / up_proj (dense MLP)      column     intermediate rows
    mlp.down_proj (dense MLP)                row        intermediate columns, all-reduce
    linear_attn.in_proj_qkvz / in_proj_ba    column     rows of its key heads (grouped per key head)
    linear_attn.in_proj_qkv (Qwen3.5)        column     its q | k | v rows (three pieces, flat layout)
    linear_attn.in_proj_z / in_proj_b / _a   column     rows of its value heads (Qwen3.5)
    linear_attn.in_proj (Lara-4-Mini)        column     the four above fused: its q | k | v | z | b | a rows
    linear_attn.conv1d                       channel    its q | k | v channels (three pieces)
    linear_attn.dt_bias / A_log              head       its value heads
    linear_attn.out_proj                     row        its value channels, all-reduce
    everything else (norms, MoE)             replicated
    model.visual.* (Qwen3.5 vision tower)    rank 0 only (whole); other ranks neither build nor read it

Qwen3.5 (``qwen3_5`` with its ``text_config``, ``qwen3_5_text``) splits its text stack like
Qwen3-Next (gated ``q_proj``, dense MLPs split; Qwen3.5-MoE, ``qwen3_5_moe`` / ``qwen3_5_moe_text``,
has MoE in every layer, replicated, and an ``mtp.*`` head split as Qwen3-Next's); its checkpoint names under
``model.language_model.*`` are matched as ``model.*``. Its image embeddings are computed on rank 0
and broadcast with the step (:class:`~lmdeploy.pytorch.model_inputs.StepBatch`).

The Qwen3-Next MTP head (``mtp.*``, :mod:`lmdeploy.pytorch.spec_decode.mtp`) splits the same
way: its full-attention layer's ``mtp.layers.0.self_attn.*`` like the target's attention
(its KV cache holds this rank's KV heads), a dense MLP there like the target's; ``fc``, its
norms and its MoE are replicated. :meth:`TPLayout.apply_mtp` swaps its row-parallel modules.

A family whose layers are not these kinds gives its plan a ``custom`` split
(``ParallelPlan.custom(config, rank, size)``, e.g. Kimi-Linear's
:class:`~lmdeploy.pytorch.models.kimi_linear.KimiLinearTPPlan`, in its model file): the local
config, the slice of each checkpoint tensor, the ranges of its cache tensors' splits and its
row-parallel projections; :class:`TPLayout` then uses it instead of the table above (the
vocabulary split of the embedding and ``lm_head`` stays here).

MoE layers (router, experts, shared expert) are **replicated**: every rank runs the whole
block on the full hidden state, so no expert routing crosses ranks and the block needs no
communication. This costs expert memory on every rank; splitting experts is future work.

Gated DeltaNet heads split by *key* head: key head ``k`` serves value heads
``[k*r, (k+1)*r)`` (``r = Hv / Hk``), so a rank's value heads, its slice of the recurrent
state ``[Hv/N, dk, dv]`` and its conv channels follow from its key heads.
"""
from __future__ import annotations

import copy
import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.linear import linear
from ..models import MODEL_REGISTRY, get_model_class
from ..models.layers import Linear
from .comm import all_gather_last, all_reduce

__all__ = ['TPLayout', 'Shard', 'RowParallelLinear', 'VocabParallelEmbedding', 'VocabParallelHead']


@dataclass(frozen=True)
class Shard:
    """The part of one checkpoint tensor a rank reads: ``ranges`` along ``dim``, concatenated."""
    dim: int
    ranges: tuple[tuple[int, int], ...]


class RowParallelLinear(Linear):
    """``y = all_reduce(x_local @ W_local^T) + b``: the input channels are split over ranks, each
    rank holds ``W[:, its columns]`` (FP8 with its scale columns when the loader keeps it FP8)
    and the full bias (added once, after the sum)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, in / N]`` → ``[T, out]`` (identical on every rank)."""
        y = all_reduce(self.product(x))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Embedding rows ``[start, stop)`` of the vocabulary; ids outside give zeros, the sum over
    ranks is the full lookup.

    Args:
        start, stop: this rank's vocabulary rows.
        dim: embedding width.
    """

    def __init__(self, start: int, stop: int, dim: int):
        super().__init__()
        self.start, self.stop = start, stop
        self.weight = nn.Parameter(torch.empty(stop - start, dim))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """int64 ``[T]`` → ``[T, dim]``."""
        mine = (ids >= self.start) & (ids < self.stop)
        local = torch.where(mine, ids - self.start, 0)
        out = F.embedding(local, self.weight) * mine[:, None].to(self.weight.dtype)
        return all_reduce(out)


class VocabParallelHead(nn.Module):
    """``lm_head`` over vocabulary rows ``[start, stop)``; the ranks' logits are gathered into
    the full ``[N, vocab]`` on every rank (each rank pads its part to ``width`` columns).

    Args:
        start, stop: this rank's vocabulary rows.
        width: padded columns per rank (``ceil(vocab / N)``).
        dim: hidden width.
        vocab: the full vocabulary size.
    """

    def __init__(self, start: int, stop: int, width: int, dim: int, vocab: int):
        super().__init__()
        self.start, self.stop, self.width, self.vocab = start, stop, width, vocab
        self.weight = nn.Parameter(torch.empty(stop - start, dim))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, dim]`` → ``[N, vocab]`` in the weight dtype."""
        local = linear(hidden, self.weight)
        if local.shape[-1] < self.width:
            local = F.pad(local, (0, self.width - local.shape[-1]))
        return all_gather_last(local)[..., :self.vocab]


def _split(total: int, rank: int, size: int, what: str) -> tuple[int, int]:
    if total % size:
        raise ValueError(f'{what} ({total}) must be divisible by tp ({size})')
    per = total // size
    return rank * per, (rank + 1) * per


# ``model.layers.*`` (the target; Qwen3.5's ``model.language_model.layers.*`` is renamed to it
# first) and ``mtp.layers.*`` (the MTP head's decoder layer)
_DENSE_MLP = re.compile(r'^(?:model|mtp)\.layers\.\d+\.mlp\.(gate_proj|up_proj|down_proj)\.(weight|bias)$')
_ATTN = re.compile(r'^(?:model|mtp)\.layers\.\d+\.self_attn\.(q_proj|k_proj|v_proj|o_proj)\.(weight|bias)$')
_GDN = re.compile(r'^model\.layers\.\d+\.linear_attn\.(in_proj_qkvz|in_proj_ba|in_proj_qkv|in_proj_z|in_proj_b|'
                  r'in_proj_a|in_proj|conv1d|dt_bias|A_log|out_proj)(\.weight)?$')

def _text_config(config):
    """The config of the text stack: ``text_config`` of a vision-language config, else ``config``."""
    return getattr(config, 'text_config', None) or config


class TPLayout:
    """Rank ``rank``'s share of a model with config ``config`` under TP ``size``.

    Args:
        config: the full model's ``transformers`` config (for ``qwen3_5`` the composite config;
            head and channel counts are read from its ``text_config``).
        rank: this rank.
        size: the TP size.

    Attributes:
        q_heads, kv_heads: this rank's query / KV heads ``(first, stop)``.
        intermediate: its dense-MLP intermediate rows ``(first, stop)``; ``(0, 0)`` = unsplit.
        vocab: its vocabulary rows ``(first, stop)``; ``vocab_width`` the padded rows per rank.
        k_heads, v_heads: its Gated DeltaNet key / value heads (hybrid models only).

    The split itself is the model's: its class's ``parallel_plan``
    (:class:`~lmdeploy.pytorch.models.parallel_plan.ParallelPlan`), found through the model registry.

    Raises:
        ValueError: a head or channel count the TP size does not divide (names the field); a
            model whose class declares no parallel plan (names ``tp``, the model type and the
            model types that split).
    """

    def __init__(self, config, rank: int, size: int):
        self.config, self.rank, self.size = config, rank, size
        self.model_type = config.model_type
        try:
            cls = get_model_class(self.model_type)
        except ValueError:      # not a registered model type
            cls = None
        self.plan = None if cls is None else cls.parallel_plan
        if self.plan is None:
            split = [t for t in MODEL_REGISTRY if get_model_class(t).parallel_plan is not None]
            raise ValueError(f'tp ({size}): tensor parallelism supports model_type '
                             f'{", ".join(split)}, not {self.model_type!r}; use tp=1')
        cls.check_config(config)             # a plan reads only fields the model's checks accept
        self.custom = None
        if self.plan.custom is not None:     # the model file splits its own layers
            self.custom = self.plan.custom(config, rank, size)
            self.text, self.intermediate = _text_config(config), (0, 0)
            vocab = self.text.vocab_size
            self.vocab_width = -(-vocab // size)
            self.vocab = (min(vocab, rank * self.vocab_width), min(vocab, (rank + 1) * self.vocab_width))
            return
        text = self.text = _text_config(config)
        self.head_dim = getattr(text, 'head_dim', None) or text.hidden_size // text.num_attention_heads
        self.q_heads = _split(text.num_attention_heads, rank, size, 'num_attention_heads')
        kv = text.num_key_value_heads
        if kv >= size:
            self.kv_heads = _split(kv, rank, size, 'num_key_value_heads')
        elif size % kv:
            raise ValueError(f'num_key_value_heads ({kv}) must divide tp ({size}) when it is smaller')
        else:
            first = rank * kv // size        # KV heads replicated: size/kv ranks share one
            self.kv_heads = (first, first + 1)
        self.gated_q = self.plan.gated_q    # q_proj also emits the output gate
        self.intermediate = (_split(text.intermediate_size, rank, size, 'intermediate_size')
                             if self.plan.dense_mlp(text) else (0, 0))
        vocab = text.vocab_size
        self.vocab_width = -(-vocab // size)
        self.vocab = (min(vocab, rank * self.vocab_width), min(vocab, (rank + 1) * self.vocab_width))
        if self.plan.gated_delta_net:
            self.k_heads = _split(text.linear_num_key_heads, rank, size, 'linear_num_key_heads')
            if text.linear_num_value_heads % text.linear_num_key_heads:
                raise ValueError(f'linear_num_value_heads ({text.linear_num_value_heads}) must be a multiple of '
                                 f'linear_num_key_heads ({text.linear_num_key_heads})')
            r = text.linear_num_value_heads // text.linear_num_key_heads
            self.v_heads = (self.k_heads[0] * r, self.k_heads[1] * r)

    def local_config(self):
        """A copy of the config with this rank's head and channel counts (``head_dim`` explicit);
        for ``qwen3_5`` the counts are changed in the copy's ``text_config``."""
        if self.custom is not None:
            return self.custom.local_config()
        c = copy.deepcopy(self.config)
        t = _text_config(c)
        t.head_dim = self.head_dim
        t.num_attention_heads = self.q_heads[1] - self.q_heads[0]
        t.num_key_value_heads = self.kv_heads[1] - self.kv_heads[0]
        if self.intermediate[1]:
            t.intermediate_size = self.intermediate[1] - self.intermediate[0]
        if self.plan.gated_delta_net:
            t.linear_num_key_heads = self.k_heads[1] - self.k_heads[0]
            t.linear_num_value_heads = self.v_heads[1] - self.v_heads[0]
        return c

    def reads(self, name: str) -> bool:
        """Whether this rank reads checkpoint tensor ``name`` at all (the plan's ``skipped``
        prefixes: never; its ``rank0_only`` ones, e.g. a vision tower: rank 0 only)."""
        if name.startswith(self.plan.skipped):
            return False
        if name.startswith(self.plan.rank0_only):
            return self.rank == 0
        return True

    def conv_ranges(self) -> tuple[tuple[int, int], ...]:
        """This rank's Gated DeltaNet conv channels (q | k | v pieces), as in its conv1d rows."""
        return self._gdn_shard('conv1d').ranges

    def cache_ranges(self, split: str) -> tuple[tuple[int, int], ...]:
        """This rank's ranges of a cached tensor's split axis (``CacheTensor.tp_split``), in the
        order the rank's tensor holds them: ``'kv_heads'``, ``'v_heads'`` (one range each) or
        ``'conv_channels'`` (the q | k | v pieces).

        Raises:
            ValueError: an unknown split name.
        """
        if self.custom is not None:
            return self.custom.cache_ranges(split)
        if split == 'kv_heads':
            return (self.kv_heads,)
        if split == 'v_heads':
            return (self.v_heads,)
        if split == 'conv_channels':
            return self.conv_ranges()
        raise ValueError(f"CacheTensor.tp_split: unknown split {split!r} (kv_heads, v_heads, conv_channels)")

    def apply(self, model: nn.Module) -> nn.Module:
        """Swap in the parallel modules (on the model's current device, e.g. meta); returns ``model``."""
        c = self.text
        model.model.embed_tokens = VocabParallelEmbedding(*self.vocab, c.hidden_size)
        model.lm_head = VocabParallelHead(*self.vocab, self.vocab_width, c.hidden_size, c.vocab_size)
        self._swap_row_parallel(model.model.layers)
        attach = getattr(self.custom, 'attach_collectives', None)
        if attach is not None:      # layers that talk across ranks besides the row-parallel sum
            attach(model, all_reduce)
        if self.rank != 0:
            for name in self.plan.rank0_modules:     # e.g. a vision tower: its output is broadcast
                setattr(model, name, None)
        return model

    def apply_mtp(self, mtp: nn.Module) -> nn.Module:
        """Swap the row-parallel modules of an MTP head built from :meth:`local_config` (its
        attention's ``o_proj``; a dense MLP's ``down_proj`` when :attr:`intermediate` is split);
        ``fc``, norms and MoE stay replicated. Returns ``mtp``."""
        self._swap_row_parallel(mtp.layers)
        return mtp

    def _swap_row_parallel(self, layers) -> None:
        """Replace each layer's output projections (attention, Gated DeltaNet, a split dense MLP)
        with :class:`RowParallelLinear` of the same shape."""
        parts = [('self_attn', 'o_proj'), ('linear_attn', 'out_proj')]
        if self.custom is not None:
            parts = list(self.custom.row_parallel)
        if self.intermediate[1]:
            parts.append(('mlp', 'down_proj'))
        for layer in layers:
            for owner, name in parts:
                parent = getattr(layer, owner, None)
                old = getattr(parent, name, None) if parent is not None else None
                if isinstance(old, nn.Linear):
                    setattr(parent, name, RowParallelLinear(old.in_features, old.out_features,
                                                            bias=old.bias is not None))

    def shard(self, name: str) -> Shard | None:
        """Which part of checkpoint tensor ``name`` this rank reads; None = the whole tensor."""
        for prefix, replacement in self.plan.renames:
            if name.startswith(prefix):
                name = replacement + name[len(prefix):]
        if name in ('model.embed_tokens.weight', 'lm_head.weight'):
            return Shard(0, (self.vocab,))
        if self.custom is not None:
            part = self.custom.shard(name)
            return None if part is None else Shard(*part)
        m = _ATTN.match(name)
        if m:
            proj, kind = m.groups()
            d = self.head_dim
            if proj == 'q_proj':
                rows = d * (2 if self.gated_q else 1)
                return Shard(0, ((self.q_heads[0] * rows, self.q_heads[1] * rows),))
            if proj in ('k_proj', 'v_proj'):
                return Shard(0, ((self.kv_heads[0] * d, self.kv_heads[1] * d),))
            return Shard(1, ((self.q_heads[0] * d, self.q_heads[1] * d),)) if kind == 'weight' else None
        m = _DENSE_MLP.match(name)
        if m and self.intermediate[1]:      # unsplit (all-MoE target): a dense MTP MLP is replicated
            proj, kind = m.groups()
            if proj == 'down_proj':
                return Shard(1, (self.intermediate,)) if kind == 'weight' else None
            return Shard(0, (self.intermediate,))
        m = _GDN.match(name)
        if m:
            return self._gdn_shard(m.group(1))
        return None

    def _gdn_shard(self, part: str) -> Shard:
        """Rows (columns for ``out_proj``) of Gated DeltaNet tensor ``part`` this rank reads.

        Qwen3-Next groups ``in_proj_qkvz`` / ``in_proj_ba`` per key head (one contiguous range);
        Qwen3.5's flat ``in_proj_qkv`` is ``[q all | k all | v all]`` like the conv channels
        (three ranges), ``in_proj_z`` ``[Hv * dv]`` and ``in_proj_b`` / ``in_proj_a`` ``[Hv]``
        follow the value heads."""
        c = self.text
        dk, dv = c.linear_key_head_dim, c.linear_value_head_dim
        r = c.linear_num_value_heads // c.linear_num_key_heads
        (k0, k1), (v0, v1) = self.k_heads, self.v_heads
        if part == 'in_proj_qkvz':
            per = 2 * dk + 2 * r * dv
            return Shard(0, ((k0 * per, k1 * per),))
        if part == 'in_proj_ba':
            return Shard(0, ((k0 * 2 * r, k1 * 2 * r),))
        if part in ('conv1d', 'in_proj_qkv'):
            key_dim = c.linear_num_key_heads * dk
            return Shard(0, ((k0 * dk, k1 * dk), (key_dim + k0 * dk, key_dim + k1 * dk),
                             (2 * key_dim + v0 * dv, 2 * key_dim + v1 * dv)))
        if part == 'in_proj_z':
            return Shard(0, ((v0 * dv, v1 * dv),))
        if part in ('dt_bias', 'A_log', 'in_proj_b', 'in_proj_a'):
            return Shard(0, ((v0, v1),))
        if part == 'in_proj':       # the four flat ones fused, rows [q|k|v|z|b|a] (Lara-4-Mini's published layout)
            conv_dim, hv = 2 * c.linear_num_key_heads * dk + c.linear_num_value_heads * dv, c.linear_num_value_heads
            z0, b0 = conv_dim, conv_dim + hv * dv
            return Shard(0, self._gdn_shard('in_proj_qkv').ranges + ((z0 + v0 * dv, z0 + v1 * dv), (b0 + v0, b0 + v1),
                                                                    (b0 + hv + v0, b0 + hv + v1)))
        return Shard(1, ((v0 * dv, v1 * dv),))      # out_proj
