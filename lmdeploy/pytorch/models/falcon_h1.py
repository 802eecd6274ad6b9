"""TII Falcon-H1 (``transformers`` model type ``falcon_h1``): every layer runs a Mamba-2 mixer and
grouped-query attention side by side on the same normed input, then a SwiGLU MLP, with µP-style
multipliers on each branch::

    h = embed(ids) * embedding_multiplier
    layer i:  n = RMSNorm(h)
              h = h + mamba(n) * ssm_out_multiplier + attn(n * attention_in_multiplier) * attention_out_multiplier
              h = h + mlp(RMSNorm(h))
      mamba(n) = Mamba-2 with in_proj(n * ssm_in_multiplier) scaled per section by ssm_multipliers
                 (z | x | B | C | dt), and the gate  y * silu(z)  (no norm) unless mamba_rms_norm
      attn(n)  = GQA with K scaled by key_multiplier, RoPE on whole heads, softmax scale head_dim ** -0.5
      mlp(n)   = down(silu(gate(n) * m_gate) * up(n)) * m_down        (m_gate, m_down) = mlp_multipliers
    logits = lm_head(RMSNorm(h)) * lm_head_multiplier

Cache layout. A layer caches both K/V per token (attention) and a per-sequence Mamba-2 state, so
:meth:`FalconH1ForCausalLM.cache_specs` declares two cache entries per layer: entry ``2 i`` is
layer ``i``'s :class:`~..cache_specs.FullAttentionSpec` (its K/V in the paged block rows) and entry
``2 i + 1`` its Mamba-2 :class:`~..cache_specs.StateSpec` (conv + SSM state in the state rows). The
cache engine, the Store layout and the Store byte simulator read entries, not layers, so a KV
block row holds every layer's K/V and a state row every layer's Mamba-2 state with no special
case; the attention of layer ``i`` addresses ``kv_caches[2 i]`` and its mixer
``state_caches[2 i + 1]``.

Weight names are the published checkpoints' (``tiiuae/Falcon-H1-*``), which are also
``transformers``': ``model.embed_tokens``, ``model.layers.{i}.mamba.{in_proj, conv1d, dt_bias,
A_log, D, norm, out_proj}`` (``norm`` only with ``mamba_rms_norm``),
``self_attn.{q,k,v,o}_proj``, ``feed_forward.{gate,up,down}_proj``, ``input_layernorm``,
``pre_ff_layernorm``, ``model.final_layernorm``, ``lm_head``.
"""
from __future__ import annotations


import torch
import torch.nn.functional as F

from ..cache_specs import FullAttentionSpec, LayerCacheSpec
from ..kernels import get_kernel
from ..model_inputs import StepContext
from .base import CausalLM
from .blocks.attention import fused_attention_decode
from .blocks.decoder import DecoderLayer, DecoderStack
from .blocks.gated_delta_net import attention_head_dim
from .blocks.gqa import GQAProjections
from .blocks.mamba2 import Mamba2Mixer, mamba2_split, mamba2_state_spec
from .blocks.mamba2_hybrid import ATTENTION_BLOCK, FEED_FORWARD_BLOCK, MAMBA_FIELDS, check_mamba_config, mamba_dims
from .config_audit import CHECKED, COMMON_FIELDS, IMPLEMENTED, INERT
from .layers import Linear, RotaryEmbedding, SwiGLUMLP, apply_rotary, attention
from .parallel_plan import Block, ParallelPlan

__all__ = ['FalconH1ForCausalLM', 'check_config', 'attention_cache_index', 'mamba_cache_index']


def attention_cache_index(layer: int) -> int:
    """Index of layer ``layer``'s K/V entry in the cache specs (``StepContext.kv_caches``)."""
    return 2 * layer


def mamba_cache_index(layer: int) -> int:
    """Index of layer ``layer``'s Mamba-2 state entry in the cache specs (``StepContext.state_caches``)."""
    return 2 * layer + 1


def _d_ssm(config) -> int:
    """``transformers``' Mamba inner width: ``mamba_d_ssm``, else ``mamba_expand * hidden_size``."""
    d_ssm = getattr(config, 'mamba_d_ssm', None)
    return int(config.mamba_expand * config.hidden_size) if d_ssm is None else d_ssm


def check_config(config) -> None:
    """Refuse configs this implementation does not reproduce exactly.

    Raises:
        ValueError: naming the field: ``hidden_act`` (``'silu'`` only: the MLP and the Mamba-2
            conv both use it), the Mamba-2 geometry (``mamba_n_heads`` x ``mamba_d_head`` must be
            ``mamba_d_ssm``, ``mamba_n_groups`` must divide ``mamba_n_heads``),
            ``time_step_limit`` other than ``(0, inf)``, ``mlp_multipliers`` not two numbers,
            ``ssm_multipliers`` not five; the rope parameters are checked by :mod:`.rope`.
    """
    if config.hidden_act != 'silu':
        raise ValueError(f"hidden_act must be 'silu', got {config.hidden_act!r}")
    inner = _d_ssm(config)
    check_mamba_config(config, inner, 'mamba_d_ssm')
    if len(list(config.mlp_multipliers)) != 2:
        raise ValueError(f'mlp_multipliers must be [gate, down], got {config.mlp_multipliers}')
    if len(list(config.ssm_multipliers)) != 5:
        raise ValueError(f'ssm_multipliers must be five numbers (z, x, B, C, dt), got {config.ssm_multipliers}')


class FalconH1Mixer(Mamba2Mixer):
    """The Mamba-2 mixer with Falcon-H1's input multiplier, per-section ``in_proj`` multipliers
    (``ssm_multipliers`` over ``z | x | B | C | dt``), the optional grouped gated norm and the
    ``out_proj`` bias of ``projectors_bias``.

    Args:
        config: HF ``FalconH1Config`` (this rank's, under tensor parallelism).
        cache_index: the mixer's entry in ``StepContext.state_caches``.
    """

    def __init__(self, config, cache_index: int):
        d = mamba_dims(config)
        super().__init__(d, cache_index)
        self.in_multiplier = float(config.ssm_in_multiplier)
        gdn = d.n_groups * d.state_size
        # the per-column multipliers of in_proj's output (transformers' mup_vector) for this rank's
        # columns: each section has one multiplier, so the rank's columns repeat the pattern
        self.section_multipliers = tuple(zip((d.d_inner, d.d_inner, gdn, gdn, d.num_heads),
                                             (float(x) for x in config.ssm_multipliers)))
        # built on first use on the activations' device: the loader makes modules on the meta
        # device and materializes parameters only, so a buffer would hold garbage
        self._mup_vector: torch.Tensor | None = None
        self.rms_norm = bool(config.mamba_rms_norm)
        self.norm_before_gate = bool(config.mamba_norm_before_gate)
        if not self.rms_norm:
            del self.norm        # transformers' nn.Identity: the checkpoint has no norm weight
        self.out_proj = Linear(d.d_inner, d.hidden_size, bias=bool(config.projectors_bias))

    def forward(self, hidden: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """``[T, hidden]`` → ``[T, hidden]``; reads and rewrites each sequence's state slot."""
        d, T = self.dims, hidden.shape[0]
        H, P, G, Dn = d.num_heads, d.head_dim, d.n_groups, d.state_size
        proj = self.in_proj(hidden * self.in_multiplier) * self._multipliers(hidden)
        if self.rms_norm and not self.norm_before_gate:       # the shared mixer's norm; no clamp of dt
            y = self.fused_decode(proj, ctx, (0.0, float('inf')))
            if y is not None:
                return self.out_proj(y)
        z, xbc, dt = proj.split([d.d_inner, d.conv_dim, H], dim=-1)
        conv_cache, ssm_cache = ctx.state_caches[self.layer_idx]
        xbc = get_kernel('causal_conv1d_varlen', hidden.device)(
            xbc, self.conv1d.weight.squeeze(1), self.conv1d.bias, conv_cache, ctx.cu_seqlens, ctx.seq_ids,
            ctx.slots, ctx.has_history, 'silu', slot_span=ctx.slot_span)
        x, B, C = xbc.split([d.d_inner, G * Dn, G * Dn], dim=-1)
        dt = F.softplus(dt.float() + self.dt_bias.float())
        A = -torch.exp(self.A_log.float())
        y = get_kernel('mamba2_ssd_varlen', hidden.device)(
            x.view(T, H, P), dt, A, B.view(T, G, Dn), C.view(T, G, Dn), self.D, ssm_cache, ctx.cu_seqlens,
            ctx.slots, ctx.has_history, d.chunk_size, slot_span=ctx.slot_span).view(T, d.d_inner)
        if not self.rms_norm:
            y = y * F.silu(z)
        elif self.norm_before_gate:
            y = self._norm_then_gate(y, z)
        elif self.cross_rank_norm is not None:
            y = self.cross_rank_norm(y, z, self.norm.weight, d.norm_eps)
        else:
            y = get_kernel('grouped_gated_rms_norm', hidden.device)(y, z, self.norm.weight, d.d_inner // G,
                                                                      d.norm_eps)
        return self.out_proj(y.to(hidden.dtype))

    def _multipliers(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[d_inner + conv_dim + heads]`` in ``hidden``'s dtype and device: each ``in_proj``
        output column's ``ssm_multipliers`` entry."""
        v = self._mup_vector
        if v is None or v.device != hidden.device or v.dtype != hidden.dtype:
            v = torch.cat([torch.full((n,), m) for n, m in self.section_multipliers]).to(hidden.device, hidden.dtype)
            self._mup_vector = v
        return v

    def _norm_then_gate(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """``mamba_norm_before_gate``: ``weight * rmsnorm(y)`` over each group, then ``* silu(z)``,
        in float32 as ``transformers``' ``FalconH1RMSNormGated`` (``[T, d_inner]`` each)."""
        d, T = self.dims, y.shape[0]
        h = y.float().view(T, d.n_groups, -1)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + d.norm_eps)
        h = (self.norm.weight.view(d.n_groups, -1) * h).view(T, -1)
        return (h * F.silu(z.float())).to(y.dtype)


class FalconH1Attention(GQAProjections):
    """Grouped-query attention over the paged KV cache: K scaled by ``key_multiplier``, RoPE on
    whole heads, scale ``head_dim ** -0.5``.

    Args:
        config: HF ``FalconH1Config``.
        cache_index: the layer's entry in ``StepContext.kv_caches``.
    """

    def __init__(self, config, cache_index: int):
        super().__init__(config, cache_index)
        self.scale = self.head_dim ** -0.5
        self.key_multiplier = float(config.key_multiplier)

    def forward(self, hidden: torch.Tensor, rotary, ctx: StepContext) -> torch.Tensor:
        """``[T, hidden]`` → ``[T, hidden]``; ``rotary`` is ``(cos, sin)`` ``[T, head_dim]``;
        writes this layer's K/V into the cache."""
        fused = fused_attention_decode(self, hidden, ctx, rotary, k_scale=self.key_multiplier)
        if fused is not None:
            return self.o_proj(fused)
        T = hidden.shape[0]
        q, k, v = self.project(hidden)
        q = apply_rotary(q, *rotary)
        k = apply_rotary(k * self.key_multiplier, *rotary)
        return self.o_proj(attention(q, k, v, ctx, self.layer_idx, self.scale).reshape(T, -1))


class FalconH1MLP(SwiGLUMLP):
    """``down(silu(gate(x) * m_gate) * up(x)) * m_down`` (``mlp_multipliers``), gate and up packed
    into one matmul; biases when ``mlp_bias``."""

    def __init__(self, config):
        super().__init__(config.hidden_size, config.intermediate_size, bias=bool(config.mlp_bias))
        self.gate_multiplier, self.down_multiplier = (float(m) for m in config.mlp_multipliers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, hidden]`` → ``[T, hidden]``."""
        gate, up = self.gate_up_proj.forward_split(x)
        return self.down_proj(up * F.silu(gate * self.gate_multiplier)) * self.down_multiplier


class FalconH1DecoderLayer(DecoderLayer):
    """Pre-norm layer: Mamba-2 (the layer's mixer, ``mamba``) and attention (``self_attn``) in
    parallel on one norm, each with its multipliers, then the SwiGLU ``feed_forward``."""

    def __init__(self, config, layer_idx: int):
        super().__init__(config.hidden_size, config.rms_norm_eps,
                         FalconH1Mixer(config, mamba_cache_index(layer_idx)), FalconH1MLP(config),
                         names=('mamba', 'feed_forward', 'input_layernorm', 'pre_ff_layernorm'))
        self.self_attn = FalconH1Attention(config, attention_cache_index(layer_idx))
        self.attention_in_multiplier = float(config.attention_in_multiplier)
        self.attention_out_multiplier = float(config.attention_out_multiplier)
        self.ssm_out_multiplier = float(config.ssm_out_multiplier)

    def mix(self, hidden: torch.Tensor, rotary, ctx: StepContext) -> torch.Tensor:
        """``mamba(n) * ssm_out + attn(n * attention_in, rotary) * attention_out`` ``[T, hidden]``,
        ``n = input_layernorm(hidden)``."""
        normed = self.input_layernorm(hidden)
        mixed = self.mamba(normed, ctx) * self.ssm_out_multiplier
        return mixed + self.self_attn(normed * self.attention_in_multiplier, rotary, ctx) * self.attention_out_multiplier


class FalconH1Model(DecoderStack):
    """Embedding (times ``embedding_multiplier``), decoder layers, final norm
    (``final_layernorm``), the rotary table."""

    def __init__(self, config):
        super().__init__(config, (FalconH1DecoderLayer(config, i) for i in range(config.num_hidden_layers)),
                         rotary=RotaryEmbedding(config), names=('embed_tokens', 'layers', 'final_layernorm'))
        self.embedding_multiplier = float(config.embedding_multiplier)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings ``[T, hidden]`` times ``embedding_multiplier``."""
        return super().embed(input_ids) * self.embedding_multiplier


def _norm_before_gate_refusal(config, size: int) -> str:
    """Why a Mamba group may not span ranks in this config ('' when it may): the group norm
    applied before the gate (``mamba_rms_norm`` and ``mamba_norm_before_gate``) is not summed
    over ranks."""
    if config.mamba_rms_norm and config.mamba_norm_before_gate:
        return (f'mamba_norm_before_gate: a norm before the gate over a Mamba group that spans ranks '
                f'(mamba_n_groups {config.mamba_n_groups} < tp {size}) is not supported')
    return ''


class FalconH1ForCausalLM(CausalLM):
    """Falcon-H1 causal LM in the engine's layers; ``config`` a ``transformers``
    ``FalconH1Config``, refused (ValueError) as :func:`check_config` says."""
    # three layers, each Mamba-2 and attention side by side; SwiGLU MLPs. Every µP multiplier off 1 so each
    # is exercised; mamba_d_ssm (64) off mamba_expand x hidden (128); an SSD chunk of 24 so 32-token prefill
    # chunks end off its boundaries; 2 B/C groups so TP2 splits them
    tiny_config = dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                       intermediate_size=96, mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=2,
                       mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=24, mamba_rms_norm=True,
                       mamba_norm_before_gate=False, embedding_multiplier=2.5, lm_head_multiplier=0.6,
                       mlp_multipliers=[0.8, 1.3], key_multiplier=0.7, attention_in_multiplier=1.2,
                       attention_out_multiplier=0.9, ssm_multipliers=[0.9, 1.1, 0.8, 1.25, 0.7], ssm_in_multiplier=1.15,
                       ssm_out_multiplier=0.85, rope_parameters=dict(rope_type='default', rope_theta=10000.0),
                       max_position_embeddings=32768, tie_word_embeddings=False, rms_norm_eps=1e-6)
    tiny_top_level_rope_theta = True


    # every config field transformers reads, and what the engine does with it (.config_audit)
    config_fields = {
        **COMMON_FIELDS,
        'layer_types': IMPLEMENTED,               # always 'hybrid': every layer runs both mixers
        'mlp_bias': IMPLEMENTED,
        'projectors_bias': IMPLEMENTED,           # the Mamba out_proj bias
        **MAMBA_FIELDS,
        'mamba_d_ssm': IMPLEMENTED,               # the inner width (mamba_expand x hidden_size when None)
        'mamba_rms_norm': IMPLEMENTED,
        'mamba_norm_before_gate': CHECKED,        # refused under TP when a group spans ranks
        'embedding_multiplier': IMPLEMENTED,
        'lm_head_multiplier': IMPLEMENTED,
        'mlp_multipliers': CHECKED,               # [gate, down]
        'key_multiplier': IMPLEMENTED,
        'attention_in_multiplier': IMPLEMENTED,
        'attention_out_multiplier': IMPLEMENTED,
        'ssm_multipliers': CHECKED,               # [z, x, B, C, dt]
        'ssm_in_multiplier': IMPLEMENTED,
        'ssm_out_multiplier': IMPLEMENTED,
        'num_logits_to_keep': INERT,              # which positions generate() computes logits for
        'get_text_config': INERT,                 # a method (mask creation), not a field
    }
    check_config = staticmethod(check_config)
    # every layer both ways: attention and MLP by head / rows, Mamba-2 by head and group (with fewer groups
    # than ranks each rank of a group reads its B / C rows; a norm before the gate cannot span ranks)
    parallel_plan = ParallelPlan(
        layers=lambda config: [('hybrid',)] * config.num_hidden_layers,
        blocks={'hybrid': (ATTENTION_BLOCK, FEED_FORWARD_BLOCK,
                           Block(mamba2_split(mamba_dims, 'mamba_n_heads', 'mamba_n_groups',
                                              refuse_shared_groups=_norm_before_gate_refusal), 'mamba'))})

    model_class = FalconH1Model

    @staticmethod
    def layer_cache_specs(config, dtype: torch.dtype) -> list[LayerCacheSpec]:
        """Two entries per layer ``i`` (see the module docstring): ``2 i`` a
        :class:`FullAttentionSpec` (KV heads x head_dim per token) and ``2 i + 1`` the Mamba-2 state
        (:func:`~.mamba2.mamba2_state_spec`: conv ``[conv_dim, mamba_d_conv - 1]`` in ``dtype``,
        SSM ``[heads, d_head, d_state]`` float32).

        Raises:
            ValueError: see :func:`check_config`.
        """
        mamba = mamba2_state_spec(mamba_dims(config), dtype)
        full = FullAttentionSpec(config.num_key_value_heads, attention_head_dim(config), dtype)
        return [spec for _ in range(config.num_hidden_layers) for spec in (full, mamba)]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, hidden_size]`` → ``[N, vocab_size]`` float32 logits (times ``lm_head_multiplier``
        in the model dtype, as ``transformers``)."""
        return (self.lm_head(hidden) * float(self.config.lm_head_multiplier)).float()
