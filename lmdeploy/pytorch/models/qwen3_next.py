"""Qwen3-Next (``transformers`` model type ``qwen3_next``): a hybrid decoder.

``config.layer_types`` picks each layer's token mixer; every layer then has an MLP::

    layer i:  x + mixer(RMSNorm(x))  ->  h + mlp(RMSNorm(h))
      mixer = Gated DeltaNet   ('linear_attention': state in a slot, LinearAttentionSpec)
            | gated attention  ('full_attention':   K/V in paged blocks, FullAttentionSpec)
      mlp   = sparse MoE + sigmoid-gated shared expert, or a dense SwiGLU for
              ``mlp_only_layers`` / layers off the ``decoder_sparse_step`` grid

All RMSNorms store ``w - 1`` (zero-centred) except the gated norm inside Gated DeltaNet.
Invariant of the linear-attention layers: a sequence with ``history_len == 0`` starts from a
zero state whatever its slot holds; after a forward the slot holds the state after exactly
``kv_seqlen`` tokens. Weight names follow the Hugging Face checkpoint (packed projections —
attention ``qkv_proj``, MLP ``gate_up_proj``, Gated DeltaNet ``in_proj`` — are filled from the
separate tensors); experts may arrive one tensor per expert (published checkpoints) or fused
(``transformers`` in-memory layout).
"""
from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from ..cache_specs import FullAttentionSpec, LayerCacheSpec, LinearAttentionSpec
from ..kernels import get_kernel
from ..kernels.moe import moe_experts_one_token, moe_experts_sorted
from ..model_inputs import StepContext
from .config_audit import COMMON_FIELDS, GATED_DELTANET_FIELDS, IMPLEMENTED, INERT
from .base import CausalLM
from .layers import Linear, PackedLinear, RMSNorm, RotaryEmbedding, SwiGLUMLP, WeightLoader
from .parallel_plan import ParallelPlan
from .qwen3 import Qwen3Attention

__all__ = ['Qwen3NextForCausalLM', 'GatedDeltaNet', 'SparseMoeBlock', 'check_config', 'load_expert_tensor']

LINEAR, FULL = 'linear_attention', 'full_attention'


def check_config(config) -> None:
    """Reject configs this implementation cannot run exactly.

    Raises:
        ValueError: naming the field (``layer_types``, ``linear_num_value_heads``,
            ``hidden_act``; rope fields: see :mod:`.rope`).
    """
    types = list(getattr(config, 'layer_types', None) or [])
    if len(types) != config.num_hidden_layers or any(t not in (LINEAR, FULL) for t in types):
        raise ValueError(f'layer_types must list {LINEAR!r} or {FULL!r} for each of the '
                         f'{config.num_hidden_layers} layers, got {types}')
    if config.linear_num_value_heads % config.linear_num_key_heads:
        raise ValueError(f'linear_num_value_heads ({config.linear_num_value_heads}) must be a multiple of '
                         f'linear_num_key_heads ({config.linear_num_key_heads})')
    if config.hidden_act != 'silu':
        raise ValueError(f"hidden_act must be 'silu', got {config.hidden_act!r}")


def has_dense_mlp(config) -> bool:
    """Some layer of a Qwen3-Next config has a dense MLP (no experts, ``mlp_only_layers``, or
    layers off ``decoder_sparse_step``)."""
    if config.num_experts == 0:
        return True
    return any(i in (config.mlp_only_layers or []) or (i + 1) % config.decoder_sparse_step
               for i in range(config.num_hidden_layers))


def _head_dim(config) -> int:
    return getattr(config, 'head_dim', None) or config.hidden_size // config.num_attention_heads


class GatedRMSNorm(nn.Module):
    """``w * RMSNorm(x) * silu(z)`` per head; ``w`` is stored as is (initialised to ones)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """``x, z [..., dim]`` → ``[..., dim]`` in ``x.dtype`` (the registry's ``gated_rms_norm``:
        one native pass for float32 on CPU, see :mod:`~lmdeploy.pytorch.kernels.norm`)."""
        return get_kernel('gated_rms_norm', x.device)(x, z, self.weight, self.eps)


class GatedDeltaNet(nn.Module):
    """Gated DeltaNet token mixer (Yang et al., "Gated Delta Networks", 2024) as in Qwen3-Next.

    ``in_proj_qkvz`` output is grouped per key head: for each of ``Hk`` key heads it holds
    ``[q (dk) | k (dk) | v (r*dv) | z (r*dv)]`` with ``r = Hv / Hk`` value heads per key head;
    ``in_proj_ba`` likewise holds ``[b (r) | a (r)]`` per key head. q, k, v then pass a depthwise
    causal conv (SiLU) over the channels ``[q all heads | k all heads | v all heads]``; the
    delta rule runs with ``g = -exp(A_log) * softplus(a + dt_bias)``, ``beta = sigmoid(b)`` and
    key head ``h // r`` serving value head ``h``; the output is ``out_proj(norm(o) * silu(z))``.

    Args:
        config: HF ``Qwen3NextConfig``.
        layer_idx: index into ``StepContext.state_caches``.
    """

    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_k_heads, self.num_v_heads = config.linear_num_key_heads, config.linear_num_value_heads
        self.head_k_dim, self.head_v_dim = config.linear_key_head_dim, config.linear_value_head_dim
        self.heads_per_key = self.num_v_heads // self.num_k_heads
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.kernel_size = config.linear_conv_kernel_dim
        hidden = config.hidden_size
        # one matmul for the checkpoint's in_proj_qkvz and in_proj_ba
        self.in_proj = PackedLinear(hidden, {'in_proj_qkvz': 2 * self.key_dim + 2 * self.value_dim,
                                             'in_proj_ba': 2 * self.num_v_heads})
        # Only a weight holder ([conv_dim, 1, K], the checkpoint shape); the conv kernel runs it.
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.kernel_size, groups=self.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.norm = GatedRMSNorm(self.head_v_dim, config.rms_norm_eps)
        self.out_proj = Linear(self.value_dim, hidden, bias=False)

    def _split_projections(self, hidden: torch.Tensor):
        """``[T, hidden]`` → mixed q|k|v ``[T, conv_dim]``, z ``[T, Hv, dv]``, b, a ``[T, Hv]``."""
        T, r = hidden.shape[0], self.heads_per_key
        qkvz, ba = self.in_proj.forward_split(hidden)
        qkvz = qkvz.reshape(T, self.num_k_heads, -1)
        q, k, v, z = qkvz.split([self.head_k_dim, self.head_k_dim, r * self.head_v_dim, r * self.head_v_dim], -1)
        b, a = ba.reshape(T, self.num_k_heads, 2 * r).split([r, r], -1)
        mixed = torch.cat((q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)), dim=-1)
        return (mixed, z.reshape(T, self.num_v_heads, self.head_v_dim), b.reshape(T, self.num_v_heads),
                a.reshape(T, self.num_v_heads))

    def forward(self, hidden: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """``[T, hidden]`` → ``[T, hidden]``; reads and rewrites each sequence's state slot."""
        T = hidden.shape[0]
        mixed, z, b, a = self._split_projections(hidden)
        beta = b.sigmoid()
        if a.dtype == self.A_log.dtype == self.dt_bias.dtype == torch.float32:
            g = -self.A_log.exp() * F.softplus(a + self.dt_bias)
        else:
            g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        conv_cache, recurrent_cache = ctx.state_caches[self.layer_idx]
        device = hidden.device
        # One call per kernel for all sequences; a fresh sequence (history 0) starts from zeros
        # inside the kernels, since its slot may hold another sequence's leftovers.
        y = get_kernel('causal_conv1d_varlen', device)(mixed, self.conv1d.weight.squeeze(1), None, conv_cache,
                                                         ctx.cu_seqlens, ctx.seq_ids, ctx.slots, ctx.has_history,
                                                         'silu', slot_span=ctx.slot_span)
        q, k, v = y.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(T, self.num_k_heads, self.head_k_dim)
        k = k.reshape(T, self.num_k_heads, self.head_k_dim)
        if self.heads_per_key > 1:
            q = q.repeat_interleave(self.heads_per_key, dim=1)
            k = k.repeat_interleave(self.heads_per_key, dim=1)
        v = v.reshape(T, self.num_v_heads, self.head_v_dim)
        out = get_kernel('gated_delta_rule_varlen', device)(q, k, v, g, beta, recurrent_cache, ctx.cu_seqlens,
                                                              ctx.slots, ctx.has_history, use_qk_l2norm=True,
                                                              slot_span=ctx.slot_span)
        return self.out_proj(self.norm(out, z).reshape(T, -1))


class FusedExperts(nn.Module):
    """SwiGLU experts as stacked weights: ``gate_up_proj [E, 2I, H]`` (gate rows first) and
    ``down_proj [E, H, I]``, the ``transformers`` in-memory layout."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Parameter(torch.zeros(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.zeros(num_experts, hidden_size, intermediate_size))

    def forward(self, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """``x [T, H]``, chosen experts ``index [T, k]`` with ``weights [T, k]`` → ``[T, H]``, by
        the registry's ``moe_experts`` (:mod:`~lmdeploy.pytorch.kernels.moe`: the whole layer
        natively for float32 decode steps on CPU, grouped matmuls on CUDA)."""
        return get_kernel('moe_experts', x.device)(x, index, weights, self.gate_up_proj, self.down_proj)

    def forward_one_token(self, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """:meth:`forward` for ``x [1, H]`` by :func:`~lmdeploy.pytorch.kernels.moe.moe_experts_one_token`."""
        return moe_experts_one_token(x, index, weights, self.gate_up_proj, self.down_proj)

    def forward_sorted(self, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """:meth:`forward` for any ``T`` by :func:`~lmdeploy.pytorch.kernels.moe.moe_experts_sorted`."""
        return moe_experts_sorted(x, index, weights, self.gate_up_proj, self.down_proj)


class SparseMoeBlock(nn.Module):
    """Top-k softmax-routed experts plus a shared expert scaled by ``sigmoid(shared_expert_gate(x))``.

    Router (Qwen-MoE style): ``p = softmax(gate(x))`` in float32, keep the top ``k``,
    renormalise them to sum 1 when ``norm_topk_prob``.

    Args:
        config: reads ``hidden_size``, ``num_experts``, ``num_experts_per_tok``,
            ``moe_intermediate_size``, ``shared_expert_intermediate_size`` and, unless
            ``norm_topk_prob`` is given, ``config.norm_topk_prob``.
        norm_topk_prob: overrides the config (Qwen3.5-MoE's router always renormalises and its
            config has no such field).
    """

    def __init__(self, config, norm_topk_prob: bool | None = None):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob if norm_topk_prob is None else norm_topk_prob
        self.gate = Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = FusedExperts(config.num_experts, config.hidden_size, config.moe_intermediate_size)
        self.shared_expert = SwiGLUMLP(config.hidden_size, config.shared_expert_intermediate_size)
        self.shared_expert_gate = Linear(config.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, hidden]`` → ``[T, hidden]``."""
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, index = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        routed = self.experts(x, index, weights.to(x.dtype))
        return routed + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)


class Qwen3NextDecoderLayer(nn.Module):
    """Pre-norm layer: token mixer chosen by ``layer_types[layer_idx]``, then MoE or dense MLP."""

    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.layer_type = config.layer_types[layer_idx]
        if self.layer_type == LINEAR:
            self.linear_attn = GatedDeltaNet(config, layer_idx)
        else:
            self.self_attn = Qwen3Attention(config, layer_idx, output_gate=True, zero_centered_norm=True)
        sparse = (layer_idx not in (config.mlp_only_layers or []) and config.num_experts > 0
                  and (layer_idx + 1) % config.decoder_sparse_step == 0)
        self.mlp = SparseMoeBlock(config) if sparse else SwiGLUMLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, zero_centered=True)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, zero_centered=True)

    def forward(self, hidden, cos, sin, ctx: StepContext) -> torch.Tensor:
        """``[T, hidden]`` → ``[T, hidden]``: Gated DeltaNet (state in ``ctx``'s slots) or gated
        attention (KV in ``ctx``'s blocks), then the MLP / MoE, each with a residual."""
        normed = self.input_layernorm(hidden)
        if self.layer_type == LINEAR:
            hidden = hidden + self.linear_attn(normed, ctx)
        else:
            hidden = hidden + self.self_attn(normed, cos, sin, ctx)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class Qwen3NextModel(nn.Module):
    """Embedding, decoder layers, final zero-centred norm; rotary on a leading fraction of each head."""

    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Qwen3NextDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, zero_centered=True)
        self.rotary = RotaryEmbedding(config)

    def forward(self, ctx: StepContext) -> torch.Tensor:
        """Final hidden states ``[T, hidden]`` of the step's ``T`` flat tokens (``ctx.input_ids``)."""
        hidden = self.embed_tokens(ctx.input_ids)
        cos, sin = self.rotary(ctx.positions, hidden.dtype)
        for layer in self.layers:
            hidden = layer(hidden, cos, sin, ctx)
        return self.norm(hidden)


def hybrid_cache_specs(config, dtype: torch.dtype) -> list[LayerCacheSpec]:
    """The cache spec of each layer of a Gated DeltaNet + full-attention stack (Qwen3-Next,
    Qwen3.5 text): conv ``[conv_dim, kernel-1]`` in ``dtype`` and float32 recurrent state
    ``[num_v_heads, k_head_dim, v_head_dim]`` per linear-attention layer, paged KV per
    full-attention layer. ``config`` is not checked here."""
    conv_dim = 2 * config.linear_num_key_heads * config.linear_key_head_dim + \
        config.linear_num_value_heads * config.linear_value_head_dim
    linear = LinearAttentionSpec(conv_shape=(conv_dim, config.linear_conv_kernel_dim - 1), conv_dtype=dtype,
                                 recurrent_shape=(config.linear_num_value_heads, config.linear_key_head_dim,
                                                  config.linear_value_head_dim))
    full = FullAttentionSpec(config.num_key_value_heads, _head_dim(config), dtype)
    return [linear if t == LINEAR else full for t in config.layer_types]


_PER_EXPERT = re.compile(r'^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$')


def load_expert_tensor(loader: WeightLoader, name: str, tensor: torch.Tensor) -> bool:
    """Copy a per-expert checkpoint tensor (``<prefix>.mlp.experts.{e}.{gate,up,down}_proj.weight``)
    into its slice of the fused :class:`FusedExperts` parameters; False for any other name.

    Raises:
        KeyError: no such experts parameter, or the expert index is out of range.
        ValueError: a shape mismatch.
    """
    match = _PER_EXPERT.match(name)
    if not match:
        return False
    params = loader.params
    prefix, expert, part = match.group(1), int(match.group(2)), match.group(3)
    target = f'{prefix}.down_proj' if part == 'down_proj' else f'{prefix}.gate_up_proj'
    if target not in params or expert >= params[target].shape[0]:
        raise KeyError(f'checkpoint tensor {name!r} has no parameter in {type(loader.module).__name__}')
    dst = params[target][expert]
    if part != 'down_proj':
        half = dst.shape[0] // 2
        dst = dst[:half] if part == 'gate_proj' else dst[half:]
    per_expert = 1 if part == 'down_proj' else 2
    loader.copy_part(target, dst, (expert, part), per_expert * params[target].shape[0], name, tensor)
    return True


class Qwen3NextForCausalLM(CausalLM):
    """Qwen3-Next causal LM in the engine's layers. Weights: drops ``mtp.*`` (the
    multi-token-prediction head, loaded by speculative decoding); experts may come fused
    (``mlp.experts.gate_up_proj`` / ``down_proj``) or per expert
    (``mlp.experts.{e}.{gate,up,down}_proj.weight``); ``lm_head`` is tied to the embedding when
    ``tie_word_embeddings`` and the checkpoint has none.

    Args:
        config: a ``transformers`` ``Qwen3NextConfig``.

    Raises:
        ValueError: see :func:`check_config`.
    """
    model_class = Qwen3NextModel
    # every config field transformers reads, and what the engine does with it (.config_audit)
    config_fields = {
        **COMMON_FIELDS,
        **GATED_DELTANET_FIELDS,
        'decoder_sparse_step': IMPLEMENTED,
        'mlp_only_layers': IMPLEMENTED,
        'num_experts': IMPLEMENTED,
        'num_experts_per_tok': IMPLEMENTED,
        'moe_intermediate_size': IMPLEMENTED,
        'shared_expert_intermediate_size': IMPLEMENTED,
        'norm_topk_prob': IMPLEMENTED,
        'output_router_logits': INERT,        # the training loss only
        'router_aux_loss_coef': INERT,
    }
    check_config = staticmethod(check_config)
    # gated q_proj, Gated DeltaNet by key head, dense MLPs split, MoE blocks replicated
    parallel_plan = ParallelPlan(gated_q=True, gated_delta_net=True, dense_mlp=has_dense_mlp)

    mtp_head = 'qwen3_next_mtp:Qwen3NextMTP'      # the checkpoint's mtp.* head (speculative decoding)

    @staticmethod
    def cache_specs(config, dtype: torch.dtype) -> list[LayerCacheSpec]:
        """Per layer: :class:`LinearAttentionSpec` for Gated DeltaNet, :class:`FullAttentionSpec` otherwise.

        Raises:
            ValueError: see :func:`check_config`.
        """
        check_config(config)
        return hybrid_cache_specs(config, dtype)

    def rename_weight(self, name: str) -> str | None:
        """Drops ``mtp.*``."""
        return None if name.startswith('mtp.') else name

    load_tensor = staticmethod(load_expert_tensor)
