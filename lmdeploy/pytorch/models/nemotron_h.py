"""Nemotron-H / Nemotron-3 (``transformers`` model type ``nemotron_h``): a stack of single-mixer
blocks, each Mamba-2, attention, a dense MLP or a mixture of experts.

``config.layers_block_type`` (built by ``transformers`` from the published
``hybrid_override_pattern``, ``M`` / ``*`` / ``-`` / ``E``) picks each block's mixer::

    block i:  x + mixer(RMSNorm(x))
      mixer = Mamba-2        ('linear_attention': conv + SSM state in a slot, .mamba2)
            | attention      ('full_attention': GQA over paged K/V, no positional encoding at all)
            | relu^2 MLP     ('mlp': down(relu(up(x))^2))
            | MoE            ('moe': sigmoid-routed relu^2 experts with a score-correction bias,
                              optional latent projections around them, plus one shared relu^2 MLP)

Every block declares a cache spec: Mamba-2 blocks a :class:`StateSpec`, attention blocks a
:class:`FullAttentionSpec`, MLP and MoE blocks an empty :class:`PagedSpec` (nothing cached).

Weight names: the published checkpoint's (``backbone.*``, ``backbone.embeddings``, one tensor
per expert ``mixer.experts.{e}.up_proj.weight``) and transformers' in-memory ones
(``model.*``, stacked ``mixer.experts.up_proj [E, I, H]``) both load.

``dt = softplus(dt + dt_bias)`` is not clamped: ``transformers`` (from 5.25) clamps it to
``time_step_limit`` in its chunked scan only, not in its one-token decode step, so only the
default ``(0, inf)``, which clamps nothing, is served (:func:`check_config`); ``time_step_min`` /
``time_step_max`` / ``time_step_floor`` initialise ``dt_bias`` and nothing else. (``transformers``
5.17-5.24 ignored ``time_step_limit`` and clamped at ``time_step_min`` in its chunked scan; the
engine follows the newer one.)
"""
from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from ..cache_specs import FullAttentionSpec, LayerCacheSpec, PagedSpec
from ..kernels import get_kernel
from ..model_inputs import StepContext
from .base import CausalLM
from .blocks.decoder import DecoderLayer, DecoderStack, mixer_ctx
from .blocks.gqa import RotaryGQA, gqa_split
from .blocks.mamba2 import Mamba2Dims, Mamba2Mixer, check_time_step_limit, mamba2_split, mamba2_state_spec
from .blocks.moe import group_limited_route
from .config_audit import CHECKED, COMMON_FIELDS, IMPLEMENTED, INERT
from .layers import Linear, RMSNorm, WeightLoader, mlp_split
from .parallel_plan import Block, ParallelPlan

__all__ = ['NemotronHForCausalLM', 'NemotronHAttention', 'NemotronHMoE', 'check_config', 'mamba2_dims']

MAMBA, ATTN, MLP, MOE = 'linear_attention', 'full_attention', 'mlp', 'moe'
BLOCK_TYPES = (MAMBA, ATTN, MLP, MOE)


def _block_types(config) -> list[str]:
    return list(getattr(config, 'layers_block_type', None) or [])


def check_config(config) -> None:
    """Refuse configs this implementation does not reproduce exactly.

    Raises:
        ValueError: naming the field: ``layers_block_type`` (a type other than the four),
            ``mamba_hidden_act`` (not ``'silu'``), ``mlp_hidden_act`` (not ``'relu2'``),
            ``n_groups`` (must divide ``mamba_num_heads``), ``n_group`` / ``topk_group``
            (expert groups of >= 2, ``topk_group`` in ``[1, n_group]``), ``time_step_limit``
            (the default ``(0, inf)`` only, see :func:`~.blocks.mamba2.check_time_step_limit`).
    """
    types = _block_types(config)
    if not types or any(t not in BLOCK_TYPES for t in types):
        raise ValueError(f'layers_block_type must list one of {BLOCK_TYPES} per layer (hybrid_override_pattern '
                         f'M / * / - / E), got {types}')
    if MAMBA in types:
        if config.mamba_hidden_act != 'silu':
            raise ValueError(f"mamba_hidden_act must be 'silu', got {config.mamba_hidden_act!r}")
        if config.n_groups <= 0 or config.mamba_num_heads % config.n_groups:
            raise ValueError(f'n_groups ({config.n_groups}) must divide mamba_num_heads ({config.mamba_num_heads})')
        check_time_step_limit(config.time_step_limit)
    if (MLP in types or MOE in types) and config.mlp_hidden_act != 'relu2':
        raise ValueError(f"mlp_hidden_act must be 'relu2', got {config.mlp_hidden_act!r}")
    if MOE in types:
        E, groups = config.n_routed_experts, config.n_group
        if groups <= 0 or E % groups or E // groups < 2 or not 1 <= config.topk_group <= groups:
            raise ValueError(f'n_group ({groups}) must divide n_routed_experts ({E}) into groups of >= 2 and '
                             f'topk_group ({config.topk_group}) be in [1, n_group]')


def mamba2_dims(config) -> Mamba2Dims:
    """The Mamba-2 mixer sizes of a ``NemotronHConfig`` (``dt`` unclamped: the default
    ``time_step_limit``, the only one :func:`check_config` accepts)."""
    return Mamba2Dims(hidden_size=config.hidden_size, num_heads=config.mamba_num_heads,
                      head_dim=config.mamba_head_dim, n_groups=config.n_groups, state_size=config.ssm_state_size,
                      conv_kernel=config.conv_kernel, chunk_size=config.chunk_size, conv_bias=config.use_conv_bias,
                      proj_bias=config.use_bias, dt_min=0.0, dt_max=float('inf'),
                      norm_eps=config.layer_norm_epsilon)


def _relu2(x: torch.Tensor) -> torch.Tensor:
    return torch.square(F.relu(x))


class Relu2MLP(nn.Module):
    """``down(relu(up(x))^2)`` (no gate), optionally with biases."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool):
        super().__init__()
        self.up_proj = Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, hidden]`` → ``[T, hidden]``."""
        return self.down_proj(_relu2(self.up_proj(x)))


class NemotronHAttention(RotaryGQA):
    """GQA self-attention without any positional encoding, over the paged K/V cache; q, k, v
    packed into one matmul (loaded from ``q_proj`` / ``k_proj`` / ``v_proj``), no biases (the
    reference does not read ``attention_bias``), softmax scale ``head_dim ** -0.5``.

    Args:
        config: ``NemotronHConfig`` (this rank's head counts under tensor parallelism).
        layer_idx: index into ``StepContext.kv_caches``.
    """

    def __init__(self, config, layer_idx: int):
        super().__init__(config, layer_idx, bias=False)

    def forward(self, hidden: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """``[T, hidden]`` → ``[T, hidden]``; writes the layer's K/V into the cache."""
        return super().forward(hidden, None, ctx)


class Relu2Experts(nn.Module):
    """Non-gated experts as stacked weights ``up_proj [E, I, D]`` and ``down_proj [E, D, I]``
    (transformers' in-memory layout, ``D`` the hidden or latent width)."""

    def __init__(self, num_experts: int, dim: int, intermediate_size: int):
        super().__init__()
        self.up_proj = nn.Parameter(torch.zeros(num_experts, intermediate_size, dim))
        self.down_proj = nn.Parameter(torch.zeros(num_experts, dim, intermediate_size))

    def forward(self, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """``x [T, D]``, chosen experts ``index [T, k]`` with float32 ``weights [T, k]`` → ``[T, D]``
        (the ``relu2_experts`` kernel: one native call for a float32 CPU decode step, on CUDA the
        gathered form for a decode-sized batch (nothing read on the host: a CUDA graph captures
        it), else one matmul pair per expert with rows, weighted and summed over each token's
        ``k`` choices in float32)."""
        return get_kernel('relu2_experts', x.device)(x, index, weights, self.up_proj, self.down_proj)


class NemotronHMoE(nn.Module):
    """Routed relu^2 experts plus one shared relu^2 MLP.

    Router (float32, DeepSeek-V3 style): ``s = sigmoid(x W^T)``; choose with
    ``s + e_score_correction_bias``: keep the ``topk_group`` expert groups with the largest sum of
    their two best scores, then the top ``k`` experts there; weight each chosen expert by its
    ``s``, renormalised when ``norm_topk_prob``, times ``routed_scaling_factor``. With
    ``moe_latent_size`` the experts run in a latent space: ``fc2(experts(fc1(x)))``.
    """

    def __init__(self, config):
        super().__init__()
        self.top_k, self.num_experts = config.num_experts_per_tok, config.n_routed_experts
        self.n_group, self.topk_group = config.n_group, config.topk_group
        self.norm_topk_prob, self.scaling = config.norm_topk_prob, config.routed_scaling_factor
        H, latent, bias = config.hidden_size, config.moe_latent_size, config.mlp_bias
        self.gate = nn.Module()
        self.gate.weight = nn.Parameter(torch.zeros(self.num_experts, H))
        self.gate.e_score_correction_bias = nn.Parameter(torch.zeros(self.num_experts), requires_grad=False)
        self.experts = Relu2Experts(self.num_experts, latent or H, config.moe_intermediate_size)
        self.shared_experts = Relu2MLP(H, config.moe_shared_expert_intermediate_size, bias)
        self.fc1_latent_proj = Linear(H, latent, bias=bias) if latent else None
        self.fc2_latent_proj = Linear(latent, H, bias=bias) if latent else None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [T, hidden]`` → ``(weights [T, k] float32, expert index [T, k])``."""
        return group_limited_route(x, self.gate.weight, self.gate.e_score_correction_bias, self.n_group,
                                   self.topk_group, self.top_k, self.norm_topk_prob, self.scaling)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, hidden]`` → ``[T, hidden]``."""
        weights, index = self.route(x)
        h = x if self.fc1_latent_proj is None else self.fc1_latent_proj(x)
        h = self.experts(h, index, weights)
        if self.fc2_latent_proj is not None:
            h = self.fc2_latent_proj(h)
        return h + self.shared_experts(x)


def mixer_only(mixer: nn.Module, normed: torch.Tensor, rotary, ctx: StepContext) -> torch.Tensor:
    """The :data:`~.blocks.decoder.MixerCall` of an MLP or MoE block (it needs neither positions
    nor the cache): ``mixer(x)``, ``[T, hidden]`` → ``[T, hidden]``."""
    return mixer(normed)


#: each block type's mixer: (factory (config, layer_idx) -> module, call)
MIXERS = {MAMBA: (lambda config, i: Mamba2Mixer(mamba2_dims(config), i), mixer_ctx),
          ATTN: (NemotronHAttention, mixer_ctx),
          MLP: (lambda config, i: Relu2MLP(config.hidden_size, config.intermediate_size, config.mlp_bias), mixer_only),
          MOE: (lambda config, i: NemotronHMoE(config), mixer_only)}


class NemotronHBlock(DecoderLayer):
    """``x + mixer(RMSNorm(x))`` with the mixer of ``layers_block_type[layer_idx]`` (:data:`MIXERS`),
    no second half: a :class:`DecoderLayer` without an MLP, its norm named ``norm``."""

    def __init__(self, config, layer_idx: int):
        make, call = MIXERS[_block_types(config)[layer_idx]]
        super().__init__(config.hidden_size, config.layer_norm_epsilon, make(config, layer_idx), None, call=call,
                         names=('mixer', 'mlp', 'norm', 'post_norm'))


class NemotronHModel(DecoderStack):
    """Embedding, blocks, final norm (``norm_f``); no positions."""

    def __init__(self, config):
        super().__init__(config, (NemotronHBlock(config, i) for i in range(len(_block_types(config)))),
                         norm=RMSNorm(config.hidden_size, config.layer_norm_epsilon),
                         names=('embed_tokens', 'layers', 'norm_f'))


_RENAMES = (('backbone.', 'model.'), ('model.embeddings.', 'model.embed_tokens.'))
_PER_EXPERT = re.compile(r'^(.*\.mixer\.experts)\.(\d+)\.(up_proj|down_proj)\.weight$')


def _rename(name: str) -> str | None:
    for prefix, repl in _RENAMES:
        if name.startswith(prefix):
            name = repl + name[len(prefix):]
    return None if name.startswith('mtp.') else name     # the MTP head is not served (transformers skips it too)


def _load_expert(loader: WeightLoader, name: str, tensor: torch.Tensor) -> bool:
    """Copy a per-expert tensor of the published layout into its row of the stacked experts."""
    m = _PER_EXPERT.match(name)
    if not m:
        return False
    target = f'{m.group(1)}.{m.group(3)}'
    param = loader.params.get(target)
    expert = int(m.group(2))
    if param is None or expert >= param.shape[0]:
        raise KeyError(f'checkpoint tensor {name!r} has no parameter in {type(loader.module).__name__}')
    loader.copy_part(target, param[expert], expert, param.shape[0], name, tensor)
    return True


class NemotronHForCausalLM(CausalLM):
    """Nemotron-H causal LM in the engine's layers; ``config`` a ``transformers``
    ``NemotronHConfig``, refused (ValueError) as :func:`check_config` says."""
    # Mamba-2, MoE, attention, Mamba-2, MLP (pattern 'ME*M-'); SSD chunks of 48
    tiny_config = dict(hidden_size=64, layers_block_type=['linear_attention', 'moe', 'full_attention',
                                                          'linear_attention', 'mlp'],
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128,
                       mamba_num_heads=8, mamba_head_dim=8, n_groups=2, ssm_state_size=16, conv_kernel=4,
                       chunk_size=48, use_conv_bias=True, mamba_hidden_act='silu', mlp_hidden_act='relu2',
                       n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                       moe_shared_expert_intermediate_size=64, n_group=2, topk_group=1, norm_topk_prob=True,
                       routed_scaling_factor=2.5, layer_norm_epsilon=1e-5, max_position_embeddings=32768,
                       tie_word_embeddings=False)
    # as the tiny checkpoints always had it (the file's bytes stay those the tests were written against)
    tiny_keeps_infinite_time_step_limit = True


    model_class = NemotronHModel
    # every config field transformers' modeling file reads, and what the engine does with it
    # (.config_audit); the attention has no rotary embedding, so no rope field is read
    config_fields = {
        **{k: v for k, v in COMMON_FIELDS.items()
           if k not in ('rope_parameters', 'max_position_embeddings', 'rms_norm_eps', 'hidden_act',
                        'attention_bias')},
        'layers_block_type': CHECKED,             # mamba / attention / mlp / moe per block
        'layer_norm_epsilon': IMPLEMENTED,
        'mamba_num_heads': IMPLEMENTED,
        'mamba_head_dim': IMPLEMENTED,
        'mamba_hidden_act': CHECKED,              # 'silu'
        'ssm_state_size': IMPLEMENTED,
        'n_groups': CHECKED,                      # divides mamba_num_heads
        'conv_kernel': IMPLEMENTED,
        'use_conv_bias': IMPLEMENTED,
        'use_bias': IMPLEMENTED,                  # in_proj / out_proj biases
        'chunk_size': IMPLEMENTED,                # the SSD chunk length (outputs do not depend on it)
        'time_step_limit': CHECKED,               # (0, inf) only: see check_config
        'time_step_min': INERT,                   # initialisation only (transformers >= 5.25)
        'time_step_max': INERT,                   # initialisation only
        'time_step_floor': INERT,                 # initialisation only
        'use_mamba_kernels': INERT,               # deprecated, no effect
        'rescale_prenorm_residual': INERT,        # initialisation only
        'num_logits_to_keep': INERT,              # generation bookkeeping
        'mlp_hidden_act': CHECKED,                # 'relu2'
        'mlp_bias': IMPLEMENTED,
        'n_routed_experts': IMPLEMENTED,
        'num_local_experts': IMPLEMENTED,         # alias of n_routed_experts
        'num_experts_per_tok': IMPLEMENTED,
        'moe_intermediate_size': IMPLEMENTED,
        'moe_shared_expert_intermediate_size': IMPLEMENTED,
        'moe_latent_size': IMPLEMENTED,           # None: experts in the hidden space
        'n_group': CHECKED,                       # divides n_routed_experts into groups of >= 2
        'topk_group': CHECKED,                    # in [1, n_group]
        'norm_topk_prob': IMPLEMENTED,
        'routed_scaling_factor': IMPLEMENTED,
    }
    rotary_class = None
    check_config = staticmethod(check_config)
    # Mamba-2 blocks by head and group (fewer groups than ranks: a group's B / C copied to the ranks of its
    # heads, its norm all-reduced), attention by head (fewer KV heads than ranks: size / kv ranks share one),
    # dense MLPs by intermediate row (up_proj rows, down_proj columns); MoE blocks replicated
    parallel_plan = ParallelPlan(
        layers=_block_types, renames=_RENAMES,
        blocks={MAMBA: (Block(mamba2_split(mamba2_dims, 'mamba_num_heads', 'n_groups', local_fields=True), 'mixer'),),
                ATTN: (Block(gqa_split(), 'mixer'),),
                MLP: (Block(mlp_split(up=('up_proj',)), 'mixer'),), MOE: ()})

    @staticmethod
    def layer_cache_specs(config, dtype: torch.dtype) -> list[LayerCacheSpec]:
        """Per block: Mamba-2 a state spec (:func:`~.blocks.mamba2.mamba2_state_spec`), attention a
        :class:`FullAttentionSpec`, MLP / MoE an empty :class:`PagedSpec` (nothing cached).

        Raises:
            ValueError: see :func:`check_config`.
        """
        head_dim = getattr(config, 'head_dim', None) or config.hidden_size // config.num_attention_heads
        out = []
        for kind in _block_types(config):
            if kind == MAMBA:
                out.append(mamba2_state_spec(mamba2_dims(config), dtype))
            elif kind == ATTN:
                out.append(FullAttentionSpec(config.num_key_value_heads, head_dim, dtype))
            else:
                out.append(PagedSpec(()))
        return out

    def rename_weight(self, name: str) -> str | None:
        """Published or transformers names (see the module docstring) → ours."""
        return _rename(name)

    def load_tensor(self, loader, name: str, tensor: torch.Tensor) -> bool:
        """Per-expert tensors into the stacked experts."""
        return _load_expert(loader, name, tensor)
