"""Zamba2 (``transformers`` model type ``zamba2``, Zyphra): a Mamba-2 stack in which every
``hybrid`` layer first runs one of ``num_mem_blocks`` shared attention blocks, reused across
depths, with a LoRA-style adapter of its own per use (Glorioso et al., "The Zamba2 Suite",
2024, arXiv:2411.15242). transformers ties the repeated blocks only when
``tie_word_embeddings`` (the published configs); otherwise every hybrid layer has its own copy
of the block's weights, and so does the engine (:func:`block_copies`)::

    e = embed(ids);  h = e
    layer i ('linear_attention'):  h = h + mamba2(RMSNorm(h))
    layer i ('hybrid', its u-th hybrid layer, block b = u mod num_mem_blocks when tied, else u):
        a = attn_b(RMSNorm_2H([h | e]), adapter u)      attention over 2·hidden_size channels
        t = linear_i(mlp_b(RMSNorm(a), adapter u))      shared MLP, gate_up + adapter u
        h = h + mamba2(RMSNorm(h + t))
    logits = lm_head(RMSNorm(h))

    attn_b: q/k/v = W x + (B_u A_u x when use_shared_attention_adapter), head_dim
            2·hidden_size / num_attention_heads, scale (head_dim / 2) ** -0.5, RoPE when
            use_mem_rope; K/V of each hybrid layer in its own paged cache entry
    mlp_b:  down(act(g) * u), [g | u] = gate_up_proj x + B_u A_u x (always adapted)

Each Mamba-2 layer, a hybrid layer's too, is an MLP-less :class:`~.blocks.decoder.DecoderLayer`
(:func:`mamba_layer`) and the body a :class:`~.blocks.decoder.DecoderStack` whose layers also
receive ``e``; a shared block has no residual of its own, so it is a plain module.

Caches (one entry per index, ``L = num_hidden_layers``): entries ``0..L-1`` the Mamba-2 state
of layer ``i`` (conv ``[d_inner + 2·G·Dn, d_conv-1]``, float32 SSM ``[H, P, Dn]``), entries
``L + u`` the paged K/V of the ``u``-th hybrid layer.

``dt`` and transformers (5.25): the mixer's ``time_step_limit`` is ``(time_step_min, inf)``
and transformers applies it in its chunked scan, which runs whenever a forward holds more than
one token of a sequence (the prompt), but not in its one-token decode step. The reference is
therefore: a **prompt** token's ``dt`` is clamped to ``>= time_step_min``, a **generated**
token's (fed back by a decode step) is not. The engine reproduces exactly that per token
(:attr:`~lmdeploy.pytorch.model_inputs.StepContext.prompt_token_mask`), whatever the chunking,
prefix-cache restores or speculative verification; a generated token that later turns into a
prompt token of the next turn is clamped when that turn recomputes it. A checkpoint taken
after decode steps would hold the unclamped state (as transformers' own cache does after
``generate``) and its restore would differ from recomputing the turn, so the class declares
``decode_state_equals_prefill = False`` and the engine ignores ``decode_save_last`` (turn-end
checkpoints) for Zamba2; checkpoints at prefill save points are exact.

Weight names are transformers' / the published checkpoints' (Zyphra/Zamba2-*): the shared
block of a hybrid layer under ``model.layers.{i}.shared_transformer.*`` (stored once per block
or repeated at every use: both load), ``model.layers.{i}.linear``,
``model.layers.{i}.mamba_decoder.*`` and ``model.layers.{i}.mamba.*``; ``q_proj`` / ``k_proj``
/ ``v_proj`` fill one packed matmul.

Tensor parallelism (:attr:`Zamba2ForCausalLM.parallel_plan`): every Mamba-2 mixer by head and
group (:func:`~.blocks.mamba2.mamba2_split`); a shared block's attention by head and its MLP by
intermediate rows, each adapter's down matrix ``A`` replicated and its up matrix ``B`` split by the
rows of the projection it adds to (:func:`~.blocks.lora.lora_split`, whose docstring says why).
A hybrid layer reaches the shared block it runs as ``shared_transformer`` (a reference, the
checkpoint's name for it), which is where the plan finds the block's row-parallel projections.
The prompt-only ``dt`` clamp reads the step's ``prompt_lens``, which every rank receives.
"""
from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from ..cache_specs import FullAttentionSpec, LayerCacheSpec
from ..model_inputs import StepContext
from .base import CausalLM
from .blocks.attention import attention_head_dim
from .blocks.decoder import DecoderLayer, DecoderStack
from .blocks.gqa import gqa_split
from .blocks.lora import lora_split
from .blocks.mamba2 import Mamba2Dims, Mamba2Mixer, mamba2_split, mamba2_state_spec
from .config_audit import CHECKED, COMMON_FIELDS, IMPLEMENTED, INERT, check_layer_types
from .layers import Linear, PackedLinear, RMSNorm, RotaryEmbedding, apply_rotary, attention, mlp_split
from .parallel_plan import Block, ParallelPlan

__all__ = ['Zamba2ForCausalLM', 'check_config', 'mamba_dims']

MAMBA, HYBRID = 'linear_attention', 'hybrid'
#: the gated norm inside the mixer: transformers fixes its eps, whatever rms_norm_eps says
MIXER_NORM_EPS = 1e-5
_ACTIVATIONS = {'gelu': F.gelu, 'silu': F.silu, 'gelu_pytorch_tanh': lambda x: F.gelu(x, approximate='tanh')}


def mamba_dims(config) -> Mamba2Dims:
    """The mixer's sizes: ``n_mamba_heads`` heads of ``mamba_headdim``, ``mamba_ngroups`` groups
    of ``mamba_d_state``, a ``mamba_d_conv`` conv that always has a bias, projection biases
    ``add_bias_linear``, ``dt >= time_step_min`` (prompt tokens only, see the module docstring);
    this rank's heads and groups in a tensor-parallel local config (``mamba_tp_size``, set by
    :func:`~.blocks.mamba2.mamba2_split`)."""
    full = Mamba2Dims(hidden_size=config.hidden_size, num_heads=config.n_mamba_heads, head_dim=config.mamba_headdim,
                      n_groups=config.mamba_ngroups, state_size=config.mamba_d_state, conv_kernel=config.mamba_d_conv,
                      chunk_size=config.chunk_size, conv_bias=True, proj_bias=bool(config.add_bias_linear),
                      dt_min=float(config.time_step_min), dt_max=float('inf'), norm_eps=MIXER_NORM_EPS)
    size = getattr(config, 'mamba_tp_size', 1)
    return full if size == 1 else full.local(size)


def layer_kinds(config) -> list[str]:
    """Each layer's kind, ``'linear_attention'`` (Mamba-2) or ``'hybrid'``.

    Raises:
        ValueError: ``layers_block_type`` is not one of those per layer.
    """
    return check_layer_types(config, (MAMBA, HYBRID), 'layers_block_type')


def block_copies(config) -> list[int]:
    """Per hybrid use ``u``, the index of the attention-block weights it runs: ``u mod
    num_mem_blocks`` when ``tie_word_embeddings`` (transformers ties the repeated blocks only
    then, as the published checkpoints are), else ``u`` (each hybrid layer its own copy, read from
    its own ``shared_transformer`` tensors). Copy ``c`` holds the adapters of the uses ``u`` with
    ``u mod num_mem_blocks == c mod num_mem_blocks``."""
    uses = layer_kinds(config).count(HYBRID)
    tied = bool(getattr(config, 'tie_word_embeddings', True))
    return [u % config.num_mem_blocks if tied else u for u in range(uses)]


def check_config(config) -> None:
    """Refuse a Zamba2 config this implementation does not reproduce exactly.

    Raises:
        ValueError: naming the field: ``layers_block_type``, ``hidden_act`` (``gelu``, ``silu``,
            ``gelu_pytorch_tanh``), ``mamba_ngroups`` (divides ``n_mamba_heads``),
            ``mamba_headdim`` (``n_mamba_heads · mamba_headdim = mamba_expand · hidden_size``),
            ``num_key_value_heads`` (divides ``num_attention_heads``; equal to it with
            ``use_shared_attention_adapter``, whose adapters are as wide as the queries),
            ``num_mem_blocks`` (positive), ``chunk_size`` (positive); the rope parameters
            (:mod:`.rope`) with ``use_mem_rope``.
    """
    layer_kinds(config)
    if config.hidden_act not in _ACTIVATIONS:
        raise ValueError(f'hidden_act must be one of {sorted(_ACTIVATIONS)}, got {config.hidden_act!r}')
    if config.mamba_ngroups <= 0 or config.n_mamba_heads % config.mamba_ngroups:
        raise ValueError(f'mamba_ngroups ({config.mamba_ngroups}) must divide n_mamba_heads ({config.n_mamba_heads})')
    if config.n_mamba_heads * config.mamba_headdim != int(config.mamba_expand * config.hidden_size):
        raise ValueError(f'mamba_headdim ({config.mamba_headdim}) x n_mamba_heads ({config.n_mamba_heads}) must equal '
                         f'mamba_expand x hidden_size ({int(config.mamba_expand * config.hidden_size)})')
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    if heads % kv or (config.use_shared_attention_adapter and kv != heads):
        raise ValueError(f'num_key_value_heads ({kv}) must divide num_attention_heads ({heads}), and equal it with '
                         'use_shared_attention_adapter')
    if config.num_mem_blocks <= 0:
        raise ValueError(f'num_mem_blocks must be positive, got {config.num_mem_blocks}')
    if config.chunk_size <= 0:
        raise ValueError(f'chunk_size must be positive, got {config.chunk_size}')
    if config.use_mem_rope:
        RotaryEmbedding(config)        # raises for rope parameters it cannot reproduce


class Zamba2Mixer(Mamba2Mixer):
    """The shared Mamba-2 mixer with Zamba2's step sizes: ``softplus(dt + dt_bias)``, clamped
    to ``>= time_step_min`` for prompt tokens only (transformers' chunked scan clamps, its decode
    step does not; see the module docstring)."""

    def step_sizes(self, dt: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """``dt [T, H]`` → float32 ``[T, H]``."""
        dt = F.softplus(dt.float() + self.dt_bias.float())
        return torch.where(ctx.prompt_token_mask[:, None], dt.clamp(min=self.dims.dt_min), dt)

    def decode_step_limits(self, ctx: StepContext) -> tuple[float, float] | None:
        """That rule as a clamp for the fused decode step: ``(time_step_min, inf)`` when every
        token of ``ctx`` is a prompt token, none when none is (a decode step of generated
        tokens), else None (the unfused path); the shared mixer's answer when ``step_sizes`` is
        not this class's."""
        if type(self).step_sizes is not _ZAMBA2_STEP_SIZES:
            return super().decode_step_limits(ctx)
        prompt = ctx.prompt_token_mask
        if bool(prompt.all()):
            return self.dims.dt_min, float('inf')
        return None if bool(prompt.any()) else (float('-inf'), float('inf'))


_ZAMBA2_STEP_SIZES = Zamba2Mixer.step_sizes


def mamba_layer(config, layer_idx: int) -> DecoderLayer:
    """A Mamba-2 layer, ``h + mamba(RMSNorm(h))`` (``h: [T, hidden]``): an MLP-less
    :class:`~.blocks.decoder.DecoderLayer` whose mixer is :class:`Zamba2Mixer` (``mamba``,
    ``input_layernorm``). A hybrid layer runs its own through ``mix`` to add the shared block's
    output to the mixer's input but not to the residual (:class:`Zamba2HybridLayer`)."""
    return DecoderLayer(config.hidden_size, config.rms_norm_eps, Zamba2Mixer(mamba_dims(config), layer_idx), None,
                        names=('mamba', 'mlp', 'input_layernorm', 'post_attention_layernorm'))


def _adapter(d_in: int, rank: int, d_out: int) -> nn.Sequential:
    """``B(A(x))``: ``A`` ``d_in → rank``, ``B`` ``rank → d_out``, no biases (names ``0`` / ``1``)."""
    return nn.Sequential(Linear(d_in, rank, bias=False), Linear(rank, d_out, bias=False))


def _adapters(config, uses: int, block_id: int, d_in: int, d_out: int) -> nn.ModuleList:
    """One adapter per hybrid use ``u`` of the model whose block is ``block_id``, an identity
    placeholder elsewhere (transformers' list layout, so the checkpoint's indices match)."""
    return nn.ModuleList(_adapter(d_in, config.adapter_rank, d_out) if u % config.num_mem_blocks == block_id
                         else nn.Identity() for u in range(uses))


class Zamba2Attention(nn.Module):
    """A shared block's attention over ``2·hidden_size`` input channels (see the module
    docstring); its K/V go to the cache entry of the hybrid layer that runs it. ``head_dim``
    is the config's (``2·hidden_size / num_attention_heads`` of the full model, also in a
    tensor-parallel rank's local config, whose head counts are the rank's)."""

    def __init__(self, config, block_id: int, uses: int):
        super().__init__()
        d_in = 2 * config.hidden_size
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = attention_head_dim(config)
        self.scale = (self.head_dim / 2) ** -0.5
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = PackedLinear(d_in, {'q_proj': q, 'k_proj': kv, 'v_proj': kv})
        self.o_proj = Linear(q, config.hidden_size, bias=False)
        self.adapted = bool(config.use_shared_attention_adapter)
        if self.adapted:
            for name, d_out in (('q', q), ('k', kv), ('v', kv)):
                setattr(self, f'linear_{name}_adapter_list', _adapters(config, uses, block_id, d_in, d_out))

    def forward(self, x: torch.Tensor, use: int, kv_idx: int, rotary, ctx: StepContext) -> torch.Tensor:
        """``[T, 2·hidden]`` → ``[T, hidden]`` for hybrid use ``use`` (its adapters), writing the
        K/V of cache entry ``kv_idx``; ``rotary``: ``(cos, sin)`` or None."""
        T = x.shape[0]
        q, k, v = self.qkv_proj.forward_split(x)
        if self.adapted:
            q = q + self.linear_q_adapter_list[use](x)
            k = k + self.linear_k_adapter_list[use](x)
            v = v + self.linear_v_adapter_list[use](x)
        q = q.reshape(T, self.num_heads, self.head_dim)
        k = k.reshape(T, self.num_kv_heads, self.head_dim)
        if rotary is not None:
            q, k = apply_rotary(q, *rotary), apply_rotary(k, *rotary)
        out = attention(q, k, v.reshape(T, self.num_kv_heads, self.head_dim), ctx, kv_idx, self.scale)
        return self.o_proj(out.reshape(T, -1))


class Zamba2MLP(nn.Module):
    """A shared block's MLP: ``down(act(g) * u)``, ``[g | u] = gate_up_proj x + adapter_use(x)``."""

    def __init__(self, config, block_id: int, uses: int):
        super().__init__()
        width, bias = config.intermediate_size, bool(config.add_bias_linear)
        self.gate_up_proj = Linear(config.hidden_size, 2 * width, bias=bias)
        self.down_proj = Linear(width, config.hidden_size, bias=bias)
        self.gate_up_proj_adapter_list = _adapters(config, uses, block_id, config.hidden_size, 2 * width)
        self.act = _ACTIVATIONS[config.hidden_act]

    def forward(self, x: torch.Tensor, use: int) -> torch.Tensor:
        """``[T, hidden]`` → ``[T, hidden]`` for hybrid use ``use``."""
        gate, up = (self.gate_up_proj(x) + self.gate_up_proj_adapter_list[use](x)).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


class Zamba2SharedBlock(nn.Module):
    """One of the ``num_mem_blocks`` shared attention blocks: RMSNorm over ``[h | e]``
    (``2·hidden_size``), attention, RMSNorm, MLP (no residuals: the hybrid layer adds the
    result into its Mamba-2 input)."""

    def __init__(self, config, block_id: int, uses: int):
        super().__init__()
        self.input_layernorm = RMSNorm(2 * config.hidden_size, config.rms_norm_eps)
        self.self_attn = Zamba2Attention(config, block_id, uses)
        self.pre_ff_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.feed_forward = Zamba2MLP(config, block_id, uses)

    def forward(self, hidden: torch.Tensor, embeds: torch.Tensor, use: int, kv_idx: int, rotary,
                ctx: StepContext) -> torch.Tensor:
        """``hidden``, ``embeds`` ``[T, hidden]`` → ``[T, hidden]``."""
        a = self.self_attn(self.input_layernorm(torch.cat((hidden, embeds), dim=-1)), use, kv_idx, rotary, ctx)
        return self.feed_forward(self.pre_ff_layernorm(a), use)


class Zamba2HybridLayer(nn.Module):
    """A hybrid layer: the shared block it runs, its own ``linear``, then its Mamba-2 layer
    (``mamba_decoder``, :func:`mamba_layer`) with the block's output added to the mixer's input
    only::

        t = linear(block_b(h, e, adapter u, KV entry kv_idx));   y = h + mamba(RMSNorm(h + t))

    Called as ``layer(hidden [T, hidden], (rotary, embeds [T, hidden]), ctx)``
    (:class:`Zamba2Model`); ``block_id`` / ``use`` / ``kv_idx`` say which shared block, adapter
    and KV cache entry it runs; ``shared_transformer`` is that block.

    Args:
        block: the shared block, held by reference (its parameters belong to ``model.blocks``,
            once, however many layers run it).
    """

    def __init__(self, config, layer_idx: int, use: int, block_id: int, block: Zamba2SharedBlock):
        super().__init__()
        self.use, self.block_id = use, block_id
        self.kv_idx = config.num_hidden_layers + use
        self.linear = Linear(config.hidden_size, config.hidden_size, bias=False)
        self.mamba_decoder = mamba_layer(config, layer_idx)
        # not a child module: registering it would repeat the block's parameters under every
        # layer that runs it; as a plain attribute the tensor-parallel layout still finds it at
        # the checkpoint's path (model.layers.{i}.shared_transformer.*)
        object.__setattr__(self, 'shared_transformer', block)

    def forward(self, hidden: torch.Tensor, step: tuple, ctx: StepContext) -> torch.Tensor:
        """``[T, hidden]`` → ``[T, hidden]``; ``step``: the rotary ``(cos, sin)`` (or None) and
        the step's embeddings ``[T, hidden]``."""
        rotary, embeds = step
        shared = self.shared_transformer(hidden, embeds, self.use, self.kv_idx, rotary, ctx)
        return hidden + self.mamba_decoder.mix(hidden + self.linear(shared), None, ctx)


class Zamba2Model(DecoderStack):
    """A :class:`~.blocks.decoder.DecoderStack` (``embed_tokens``, ``layers``,
    ``final_layernorm``, RoPE when ``use_mem_rope``) that also owns the shared blocks
    (``blocks``) and hands every layer the step's embeddings beside the rotary tables: layer
    ``i`` is :func:`mamba_layer` or a :class:`Zamba2HybridLayer`, called as
    ``layer(hidden, (rotary, embeds), ctx)``."""

    def __init__(self, config):
        copies = block_copies(config)
        blocks = nn.ModuleList(Zamba2SharedBlock(config, c % config.num_mem_blocks, len(copies))
                               for c in range(max(copies, default=-1) + 1))
        layers, use = [], 0
        for i, kind in enumerate(layer_kinds(config)):
            if kind == HYBRID:
                layers.append(Zamba2HybridLayer(config, i, use, copies[use], blocks[copies[use]]))
                use += 1
            else:
                layers.append(mamba_layer(config, i))
        super().__init__(config, layers, rotary=RotaryEmbedding(config) if config.use_mem_rope else None,
                         names=('embed_tokens', 'layers', 'final_layernorm'))
        self.blocks = blocks

    def forward(self, ctx: StepContext, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """Final hidden states ``[T, hidden]`` of the step's flat tokens (``ctx.input_ids [T]``)."""
        embeds = self.embed(ctx.input_ids) if inputs_embeds is None else inputs_embeds
        step = (self.rotary_tables(ctx, embeds.dtype), embeds)
        hidden = embeds
        for layer in self.layers:
            hidden = layer(hidden, step, ctx)
        return self.final_layernorm(hidden)


_SHARED = re.compile(r'^model\.layers\.(\d+)\.shared_transformer\.(.*)$')
_MAMBA_SPLIT = mamba2_split(mamba_dims, 'n_mamba_heads', 'mamba_ngroups')


def _attention_adapters(config) -> dict[str, list[str]]:
    """The up matrices (``.1``) of a shared block's q / k / v adapters, per use (absent uses of
    other blocks match no tensor); none without ``use_shared_attention_adapter``."""
    if not config.use_shared_attention_adapter:
        return {}
    uses = range(layer_kinds(config).count(HYBRID))
    return {f'{p}_proj': [f'linear_{p}_adapter_list.{u}.1' for u in uses] for p in 'qkv'}


def _mlp_adapters(config) -> dict[str, list[str]]:
    """The up matrices of a shared block's ``gate_up_proj`` adapters, per use."""
    return {'gate_up_proj': [f'gate_up_proj_adapter_list.{u}.1' for u in range(layer_kinds(config).count(HYBRID))]}


class Zamba2ForCausalLM(CausalLM):
    """Zamba2 causal LM in the engine's layers (any TP size that divides its heads and groups,
    see :attr:`parallel_plan`).

    Args:
        config: a ``transformers`` ``Zamba2Config``.

    Raises:
        ValueError: see :func:`check_config`.
    """

    # hybrid, mamba, hybrid, hybrid: two shared blocks (the third use is block 0 again,
    # with adapter 2), attention adapters, RoPE, 2 Mamba groups, a 16-token SSD chunk off the
    # prefill chunks; time_step_min 0.01 so the prompt-only clamp changes many tokens' dt
    tiny_config = dict(hidden_size=64, num_hidden_layers=4, layers_block_type=[HYBRID, MAMBA, HYBRID, HYBRID],
                       num_attention_heads=4, num_key_value_heads=4, intermediate_size=128, mamba_d_state=8,
                       mamba_d_conv=4, mamba_expand=2, mamba_ngroups=2, n_mamba_heads=4, chunk_size=24,
                       num_mem_blocks=2, use_shared_attention_adapter=True, adapter_rank=8, use_mem_rope=True,
                       rope_theta=10000.0, hidden_act='gelu', rms_norm_eps=1e-5, time_step_min=0.01,
                       max_position_embeddings=4096, tie_word_embeddings=True, add_bias_linear=False)

    model_class = Zamba2Model
    # decode steps leave dt unclamped (as transformers), a recomputed prefix clamps it
    decode_state_equals_prefill = False
    # every config field transformers reads, and what the engine does with it (.config_audit)
    config_fields = {
        **{k: v for k, v in COMMON_FIELDS.items() if k not in ('attention_bias', 'layer_types')},
        'num_key_value_heads': CHECKED,           # divides num_attention_heads (equals it with adapters)
        'hidden_act': CHECKED,                    # gelu / silu / gelu_pytorch_tanh
        'layer_types': CHECKED,                   # an alias of layers_block_type
        'layers_block_type': CHECKED,             # 'linear_attention' / 'hybrid'
        'hybrid_layer_ids': IMPLEMENTED,          # derived from layers_block_type
        'attention_hidden_size': IMPLEMENTED,     # derived: 2 * hidden_size
        'mamba_d_state': IMPLEMENTED,
        'mamba_d_conv': IMPLEMENTED,
        'mamba_expand': IMPLEMENTED,
        'mamba_headdim': CHECKED,                 # derived; heads x headdim = expand x hidden
        'mamba_ngroups': CHECKED,                 # divides n_mamba_heads
        'n_mamba_heads': IMPLEMENTED,
        'chunk_size': CHECKED,                    # positive; the outputs do not depend on it
        'add_bias_linear': IMPLEMENTED,
        'use_conv_bias': INERT,                   # transformers' conv always has a bias
        'time_step_min': IMPLEMENTED,             # dt's lower clamp, prompt tokens only
        'time_step_max': INERT,                   # dt_bias initialisation only
        'time_step_floor': INERT,
        'num_mem_blocks': CHECKED,                # positive
        'use_shared_attention_adapter': IMPLEMENTED,
        'adapter_rank': IMPLEMENTED,
        'use_mem_rope': IMPLEMENTED,
        'use_long_context': IMPLEMENTED,          # only raises max_position_embeddings, which rope reads
        'use_mamba_kernels': INERT,               # deprecated, no effect
        'num_logits_to_keep': INERT,              # which logits generate computes
    }
    check_config = staticmethod(check_config)
    # Mamba-2 by head and group (n_mamba_heads, mamba_ngroups; a group may span ranks); a hybrid
    # layer's shared block (checkpoint: its shared_transformer) by attention head and MLP row, the
    # per-use adapters' B split as the projection they add to, A replicated (blocks/lora.py)
    parallel_plan = ParallelPlan(
        layers=lambda config: layer_kinds(config),
        blocks={MAMBA: (Block(_MAMBA_SPLIT, 'mamba'),),
                HYBRID: (Block(_MAMBA_SPLIT, 'mamba_decoder.mamba'),
                         Block(lora_split(gqa_split(), _attention_adapters), 'shared_transformer.self_attn'),
                         Block(lora_split(mlp_split(up=('gate_up_proj',), fused=True), _mlp_adapters),
                               'shared_transformer.feed_forward'))})
    rotary_class = None       # check_config builds the rotary table itself, only with use_mem_rope

    @staticmethod
    def layer_cache_specs(config, dtype: torch.dtype) -> list[LayerCacheSpec]:
        """``num_hidden_layers`` Mamba-2 states (:func:`~.blocks.mamba2.mamba2_state_spec`: conv
        in ``dtype``, SSM float32), then one :class:`FullAttentionSpec` (KV heads ×
        ``2·hidden_size / num_attention_heads``) per hybrid layer."""
        mamba = mamba2_state_spec(mamba_dims(config), dtype)
        full = FullAttentionSpec(config.num_key_value_heads, attention_head_dim(config), dtype)
        return [mamba] * config.num_hidden_layers + [full] * layer_kinds(config).count(HYBRID)

    def __init__(self, config):
        super().__init__(config)
        text = config.get_text_config()
        hybrid = [i for i, kind in enumerate(layer_kinds(text)) if kind == HYBRID]
        self._block_of = dict(zip(hybrid, block_copies(text)))

    def rename_weight(self, name: str) -> str | None:
        """``model.layers.{i}.shared_transformer.*`` → ``model.blocks.{b}.*`` (``b`` the block copy
        of hybrid layer ``i``, :func:`block_copies`; a repeat of a tied block loads the same values
        again)."""
        m = _SHARED.match(name)
        if m is None:
            return name
        return f'model.blocks.{self._block_of[int(m.group(1))]}.{m.group(2)}'
