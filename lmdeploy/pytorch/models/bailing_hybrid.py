"""Ling 3 (``transformers`` model type ``bailing_hybrid``): KDA recurrent layers interleaved with
gated MLA full-attention layers, a DeepSeek-style MoE (SwiGLU clipped per layer) after each.

``config.layer_types`` picks each layer's token mixer (by default the last layer of every
``layer_group_size`` is MLA), ``config.mlp_layer_types`` its MLP (dense for the first
``first_k_dense_replace``)::

    layer i:  x + mixer(RMSNorm(x))  ->  h + mlp(RMSNorm(h))
      mixer = Kimi Delta Attention ('linear_attention': full-rank f_proj / g_proj gates,
                                    conv + recurrent states in a slot)
            | MLA                  ('full_attention': interleaved rotary on the rope part, a
                                    sigmoid output gate per head; one latent row per token)
      mlp   = sigmoid-routed experts * routed_scaling_factor + shared experts ('sparse'),
              or a dense SwiGLU ('dense'); routed / shared SwiGLUs clip at the layer's
              expert_swiglu_limit_list / share_expert_swiglu_limit_list entry (0: no clip):
              min(silu(gate), L) * clamp(up, -L, L)

The checkpoint's NextN multi-token-prediction layers (``model.layers.{num_hidden_layers + i}``,
``num_nextn_predict_layers`` of them) are not loaded: speculative decoding with ``mtp`` is
refused for this family (``speculative_config.method`` names the families that have one).
Tensor parallelism splits KDA and MLA by head (``kda_split``, ``mla_split``).

Weight names: the published checkpoint's (``model.word_embeddings``, ``layers.{i}.attention.*``
with ``dense`` for the output projection, ``q_conv1d`` / ``k_conv1d`` / ``v_conv1d``, ``f_proj``
/ ``dt_bias`` / ``A_log`` directly under ``attention``, ``mlp.gate.expert_bias``, one tensor per
expert) and transformers' in-memory ones (``self_attn.conv1d`` stacked, ``self_attn.forget_gate.*``,
``mlp.experts.gate_up_proj``) both load.
"""
from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from ..cache_specs import CacheTensor, LayerCacheSpec, PagedSpec
from ..model_inputs import StepContext
from .base import CausalLM
from .blocks.kda import KimiDeltaAttention, kda_split, kda_state_spec
from .blocks.mla import LatentAttention, mla_split
from .blocks.moe import FusedExperts, GroupLimitedMoE, load_expert_tensor
from .config_audit import CHECKED, COMMON_FIELDS, IMPLEMENTED, INERT
from .layers import Linear, PackedLinear, RMSNorm, RotaryEmbedding
from .parallel_plan import Block, ParallelPlan

__all__ = ['BailingHybridForCausalLM', 'check_config']

LINEAR, FULL = 'linear_attention', 'full_attention'


def check_config(config) -> None:
    """Refuse configs this implementation does not reproduce exactly.

    Raises:
        ValueError: naming the field (``layer_types``, ``mlp_layer_types``, ``hidden_act``,
            ``n_group`` / ``topk_group``, ``expert_swiglu_limit_list`` /
            ``share_expert_swiglu_limit_list``).
    """
    n = config.num_hidden_layers
    types = list(getattr(config, 'layer_types', None) or [])
    if len(types) != n or any(t not in (LINEAR, FULL) for t in types):
        raise ValueError(f'layer_types must list {LINEAR!r} or {FULL!r} for each of the {n} layers, got {types}')
    mlp = list(getattr(config, 'mlp_layer_types', None) or [])
    if len(mlp) != n or any(t not in ('dense', 'sparse') for t in mlp):
        raise ValueError(f"mlp_layer_types must list 'dense' or 'sparse' for each of the {n} layers, got {mlp}")
    if config.hidden_act != 'silu':
        raise ValueError(f"hidden_act must be 'silu', got {config.hidden_act!r}")
    for field, limits in (('expert_swiglu_limit_list', config.swiglu_limits),
                          ('share_expert_swiglu_limit_list', config.swiglu_limits_shared)):
        if len(limits) != n or any(limit < 0 for limit in limits):
            raise ValueError(f'{field} must hold one limit >= 0 per layer ({n}), got {list(limits)}')
    if 'sparse' in mlp and (config.num_local_experts % config.n_group
                            or config.num_local_experts // config.n_group < 2
                            or not 1 <= config.topk_group <= config.n_group):
        raise ValueError(f'n_group ({config.n_group}) must divide num_local_experts ({config.num_local_experts}) '
                         f'into groups of >= 2 and topk_group ({config.topk_group}) be in [1, n_group]')


def clipped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """``min(silu(gate), limit) * clamp(up, -limit, limit)``; ``limit = 0``: plain ``silu(gate) * up``
    (Ling 3 clips after the activation)."""
    if not limit:
        return F.silu(gate) * up
    return F.silu(gate).clamp(max=limit) * up.clamp(-limit, limit)


class ClippedSwiGLUMLP(nn.Module):
    """``down(clipped_swiglu(gate(x), up(x), limit))``, gate and up packed into one matmul
    (loaded from ``gate_proj`` / ``up_proj``)."""

    def __init__(self, hidden_size: int, intermediate_size: int, limit: float):
        super().__init__()
        self.limit = float(limit)
        self.gate_up_proj = PackedLinear(hidden_size, {'gate_proj': intermediate_size, 'up_proj': intermediate_size})
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, hidden]`` → ``[T, hidden]``."""
        gate, up = self.gate_up_proj.forward_split(x)
        return self.down_proj(clipped_swiglu(gate, up, self.limit))


class ClippedExperts(FusedExperts):
    """:class:`~.blocks.moe.FusedExperts` (same stacked weights and names) whose SwiGLU clips
    (:func:`clipped_swiglu`, ``limit > 0``); run expert by expert over the tokens routed to it."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, limit: float):
        super().__init__(num_experts, hidden_size, intermediate_size)
        self.limit = float(limit)

    def forward(self, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """``x [T, H]``, chosen experts ``index [T, k]`` (long) with ``weights [T, k]`` → ``[T, H]``."""
        out = torch.zeros_like(x)
        for e in index.unique().tolist():
            token, slot = (index == e).nonzero(as_tuple=True)
            gate, up = F.linear(x[token], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(clipped_swiglu(gate, up, self.limit), self.down_proj[e]) * weights[token, slot, None]
            out.index_add_(0, token, y.to(out.dtype))
        return out


class BailingMoE(GroupLimitedMoE):
    """:class:`~.blocks.moe.GroupLimitedMoE` with the layer's SwiGLU limits on the routed and the
    shared experts (a zero limit keeps the unclipped fused path)."""

    def __init__(self, config, layer_idx: int):
        super().__init__(config)
        routed, shared = config.swiglu_limits[layer_idx], config.swiglu_limits_shared[layer_idx]
        H, I = config.hidden_size, config.moe_intermediate_size
        if routed:
            self.experts = ClippedExperts(self.num_experts, H, I, routed)
        self.shared_experts = ClippedSwiGLUMLP(H, I * config.n_shared_experts, shared)


class BailingHybridDecoderLayer(nn.Module):
    """Pre-norm layer: KDA or gated MLA (``layer_types``), then MoE or dense MLP (``mlp_layer_types``)."""

    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.kind = config.layer_types[layer_idx]
        if self.kind == LINEAR:
            self.self_attn = KimiDeltaAttention(config, layer_idx, config.kda_lower_bound if config.kda_safe_gate
                                                else None, low_rank_gates=False)
        else:
            from transformers.modeling_rope_utils import yarn_apply_mscale
            qk = config.qk_nope_head_dim + config.qk_rope_head_dim
            scale = yarn_apply_mscale(config.rope_parameters, qk ** -0.5)     # YaRN's mscale_all_dim, if any
            self.self_attn = LatentAttention(config, layer_idx, rotary=True, output_gate=True, scale=scale)
        # transformers' dense MLP has no layer index, so it never clips
        self.mlp = BailingMoE(config, layer_idx) if config.mlp_layer_types[layer_idx] == 'sparse' \
            else ClippedSwiGLUMLP(config.hidden_size, config.intermediate_size, 0)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden: torch.Tensor, rotary, ctx: StepContext) -> torch.Tensor:
        """``[T, hidden]`` → ``[T, hidden]``; ``rotary`` is ``(cos, sin)`` ``[T, qk_rope_head_dim]``."""
        normed = self.input_layernorm(hidden)
        hidden = hidden + (self.self_attn(normed, ctx) if self.kind == LINEAR else self.self_attn(normed, ctx, rotary))
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class BailingHybridModel(nn.Module):
    """Embedding, decoder layers, final norm; the rotary table of the MLA layers."""

    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(BailingHybridDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # transformers' config sets head_dim = qk_rope_head_dim: the table covers the rope part
        self.rotary = RotaryEmbedding(config)

    def forward(self, ctx: StepContext) -> torch.Tensor:
        """Final hidden states ``[T, hidden]`` of the step's flat tokens."""
        hidden = self.embed_tokens(ctx.input_ids)
        rotary = self.rotary(ctx.positions, hidden.dtype)
        for layer in self.layers:
            hidden = layer(hidden, rotary, ctx)
        return self.norm(hidden)


_RENAMES = [
    (re.compile(r'^model\.word_embeddings\.'), 'model.embed_tokens.'),      # published -> ours
    (re.compile(r'\.attention\.'), '.self_attn.'),
    (re.compile(r'\.self_attn\.dense\.'), '.self_attn.o_proj.'),
    (re.compile(r'\.mlp\.gate\.expert_bias$'), '.mlp.gate.e_score_correction_bias'),
    (re.compile(r'\.self_attn\.forget_gate\.'), '.self_attn.'),             # transformers -> ours
]
_LAYER = re.compile(r'^model\.layers\.(\d+)\.')


def _our_name(name: str) -> str:
    """A published or transformers checkpoint name in ours (before the stacked conv is split)."""
    for pattern, repl in _RENAMES:
        name = pattern.sub(repl, name)
    return name


class BailingHybridForCausalLM(CausalLM):
    """Ling 3 causal LM in the engine's layers (no MTP head).

    Args:
        config: a ``transformers`` ``BailingHybridConfig``.

    Raises:
        ValueError: see :func:`check_config`.
    """
    # KDA, MLA, KDA, MLA; two dense MLPs, then grouped sigmoid-routed MoE; clipping on layer 2's
    # routed experts and layer 3's shared experts; YaRN-free default rope
    tiny_config = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=4,
                       layer_group_size=2, first_k_dense_replace=1, head_dim=16, intermediate_size=128,
                       moe_intermediate_size=32, num_local_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
                       n_shared_experts=1, routed_scaling_factor=2.5, kv_lora_rank=32, q_lora_rank=None,
                       qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, short_conv_kernel_size=4,
                       expert_swiglu_limit_list=[0, 0, 0.05, 0], share_expert_swiglu_limit_list=[0, 0, 0, 0.05],
                       num_mtp_layers=0, max_position_embeddings=32768, rope_theta=10000.0,
                       tie_word_embeddings=False, rms_norm_eps=1e-6)

    tiny_top_level_rope_theta = True

    @staticmethod
    def tiny_config_json(config_dict: dict) -> None:
        """The published spelling: ``head_dim`` is the KDA head size (transformers derives
        ``linear_head_dim`` from it and then sets ``head_dim = qk_rope_head_dim``); the derived
        ``linear_*`` and ``qk_head_dim`` fields are not written."""
        config_dict['head_dim'] = config_dict.pop('linear_head_dim')
        for derived in ('linear_num_heads', 'linear_conv_kernel_dim', 'qk_head_dim'):
            config_dict.pop(derived)

    model_class = BailingHybridModel
    # every config field transformers reads, and what the engine does with it (.config_audit)
    config_fields = {
        **COMMON_FIELDS,
        # MLA up-projects a K and V per query head whatever this says
        'num_key_value_heads': INERT,
        'mlp_layer_types': CHECKED,               # 'dense' / 'sparse' per layer
        'linear_conv_kernel_dim': IMPLEMENTED,    # short_conv_kernel_size
        'linear_head_dim': IMPLEMENTED,           # the config's head_dim before it becomes qk_rope_head_dim
        'linear_num_heads': IMPLEMENTED,          # num_attention_heads
        'kda_safe_gate': IMPLEMENTED,
        'kda_lower_bound': IMPLEMENTED,
        'kv_lora_rank': IMPLEMENTED,
        'q_lora_rank': IMPLEMENTED,               # None: one q_proj; else q_a_proj / norm / q_b_proj
        'qk_nope_head_dim': IMPLEMENTED,
        'qk_rope_head_dim': IMPLEMENTED,
        'v_head_dim': IMPLEMENTED,
        'moe_intermediate_size': IMPLEMENTED,
        'n_shared_experts': IMPLEMENTED,
        'num_local_experts': IMPLEMENTED,
        'num_experts_per_tok': IMPLEMENTED,
        'n_group': CHECKED,                       # divides num_local_experts into groups of >= 2
        'topk_group': CHECKED,                    # in [1, n_group]
        'norm_topk_prob': IMPLEMENTED,
        'routed_scaling_factor': IMPLEMENTED,
        'swiglu_limits': CHECKED,                 # expert_swiglu_limit_list: >= 0 per layer
        'swiglu_limits_shared': CHECKED,          # share_expert_swiglu_limit_list
        'limit_after_act': IMPLEMENTED,           # a constant True property: clip after silu
        'num_mtp_layers': INERT,                  # the NextN layers past num_hidden_layers are not loaded
    }
    check_config = staticmethod(check_config)
    # KDA by head (full-rank gates, A_log [H]), MLA by query head with its output gate and the
    # latent replicated; MoE and dense MLPs replicated. The published checkpoint spells the
    # mixer ``attention`` and its output projection ``dense``; the NextN layers past
    # num_hidden_layers have no kinds, so nothing of theirs splits (they are not loaded)
    parallel_plan = ParallelPlan(
        layers=lambda config: config.layer_types,
        blocks={LINEAR: (Block(kda_split(a_log_dim=0, full_rank_gates=True, o=('o_proj', 'dense')),
                               ('self_attn', 'attention')),),
                FULL: (Block(mla_split(output_gate=True, o=('o_proj', 'dense')), ('self_attn', 'attention')),)},
        renames=(('model.word_embeddings.', 'model.embed_tokens.'),))

    @staticmethod
    def layer_cache_specs(config, dtype: torch.dtype) -> list[LayerCacheSpec]:
        """Per layer: a KDA :class:`StateSpec` (``q_conv``, ``k_conv``, ``v_conv``
        ``[H, d, kernel - 1]`` in ``dtype``, ``recurrent [H, d, d]`` float32) or an MLA
        :class:`PagedSpec` (``latent [kv_lora_rank + qk_rope_head_dim]`` per token, the rope
        part stored rotated).

        Raises:
            ValueError: see :func:`check_config`.
        """
        kda = kda_state_spec(config, dtype)
        mla = PagedSpec((CacheTensor('latent', (config.kv_lora_rank + config.qk_rope_head_dim,), dtype, None),))
        return [kda if t == LINEAR else mla for t in config.layer_types]

    def rename_weight(self, name: str) -> str | None:
        """Published or transformers names (see the module docstring) → ours; None for the
        NextN MTP layers past ``num_hidden_layers``."""
        name = _our_name(name)
        m = _LAYER.match(name)
        if m and int(m.group(1)) >= self.config.num_hidden_layers:
            return None
        return name

    def load_tensor(self, loader, name: str, tensor: torch.Tensor) -> bool:
        """transformers' stacked q | k | v convs, ``A_log [H]`` (ours ``[1, 1, H, 1]``), the experts."""
        if name.endswith('.self_attn.conv1d.weight'):
            stem = name[:-len('conv1d.weight')]
            for part, piece in zip('qkv', tensor.chunk(3, dim=0)):
                loader.load(f'{stem}{part}_conv1d.weight', piece)
            return True
        if name.endswith('.self_attn.A_log'):
            loader.load(name, tensor.reshape(1, 1, -1, 1))
            return True
        return load_expert_tensor(loader, name, tensor)
