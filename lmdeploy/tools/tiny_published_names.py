"""transformers' in-memory tensor names → each family's published checkpoint layout, for the
tiny checkpoints of :mod:`.make_tiny_model` (so tests load the layout users download).

``PUBLISHED_NAMES`` maps a ``model_type`` to a function ``{name: tensor} -> {name: tensor}``;
families whose published names equal transformers' are absent.
"""
import re

import torch

def _kimi_published_names(tensors: dict) -> dict:
    """transformers' Kimi-Linear names → the published checkpoint's: the forget-gate tensors
    directly under `self_attn`, the stacked `conv1d` as `q_conv1d` / `k_conv1d` / `v_conv1d`, MoE
    layers under `block_sparse_moe` with per-expert `w1` (gate) / `w3` (up) / `w2` (down)."""
    out = {}
    for name, t in tensors.items():
        name = name.replace('.self_attn.forget_gate.', '.self_attn.')
        if name.endswith('.self_attn.conv1d.weight'):
            for part, piece in zip('qkv', t.chunk(3, dim=0)):
                out[name.replace('.conv1d.', f'.{part}_conv1d.')] = piece
            continue
        m = re.match(r'^(.*)\.mlp\.(experts\.\d+\.(gate|up|down)_proj\.weight|gate\..*|shared_experts\..*)$', name)
        if m:
            rest = m.group(2)
            for hf, pub in (('gate_proj.weight', 'w1.weight'), ('up_proj.weight', 'w3.weight'),
                            ('down_proj.weight', 'w2.weight')):
                if rest.startswith('experts.') and rest.endswith(hf):
                    rest = rest[:-len(hf)] + pub
            name = f'{m.group(1)}.block_sparse_moe.{rest}'
        out[name] = t
    return out


def _put_split_conv1d(out: dict, name: str, t, parent: str) -> None:
    """``out[name] = t``, except that the stacked q | k | v short conv ``{parent}conv1d.weight``
    (transformers' layout, ``[3 C, 1, K]``) goes in as the published ``q_conv1d`` / ``k_conv1d`` /
    ``v_conv1d`` (``[C, 1, K]`` each)."""
    if name.endswith(f'{parent}conv1d.weight'):
        for part, piece in zip('qkv', t.chunk(3, dim=0)):
            out[name.replace('.conv1d.', f'.{part}_conv1d.')] = piece
    else:
        out[name] = t


def glm5_next_published_names(tensors: dict) -> dict:
    """transformers' GLM-5.3-Flash names → the published layout (transformers' conversion
    mapping reversed): forget-gate tensors directly under `self_attn`, the stacked `conv1d` as
    `q_conv1d` / `k_conv1d` / `v_conv1d`, `attn_hc.fn` as `hc_attn_fn` (and base, scale, ffn)."""
    out = {}
    for name, t in tensors.items():
        name = name.replace('.self_attn.forget_gate.', '.self_attn.')
        _put_split_conv1d(out, re.sub(r'\.(attn|ffn)_hc\.(fn|base|scale)$', r'.hc_\1_\2', name), t, '.self_attn.')
    return out


def _nemotron_published_names(tensors: dict) -> dict:
    """transformers' Nemotron-H names → the published checkpoint's: `backbone.*` for `model.*`,
    the stacked experts `mixer.experts.{up,down}_proj [E, ...]` one tensor per expert
    (`mixer.experts.{e}.up_proj.weight`)."""
    out = {}
    for name, t in tensors.items():
        if name.startswith('model.'):
            name = 'backbone.' + name[len('model.'):]
        if re.search(r'\.mixer\.experts\.(up|down)_proj$', name):
            for e in range(t.shape[0]):
                out[f'{name.rsplit(".", 1)[0]}.{e}.{name.rsplit(".", 1)[1]}.weight'] = t[e]
            continue
        out[name] = t
    return out


def _granite_published_names(tensors: dict) -> dict:
    """transformers' Granite-4.0-H names → the published checkpoint's: stacked experts as
    `block_sparse_moe.input_linear.weight` [E, 2I, H] / `output_linear.weight` [E, H, I], the router
    as `block_sparse_moe.router.layer.weight`."""
    out = {}
    for name, t in tensors.items():
        name = re.sub(r'\.block_sparse_moe\.experts\.gate_up_proj$', '.block_sparse_moe.input_linear.weight', name)
        name = re.sub(r'\.block_sparse_moe\.experts\.down_proj$', '.block_sparse_moe.output_linear.weight', name)
        out[re.sub(r'\.block_sparse_moe\.router\.weight$', '.block_sparse_moe.router.layer.weight', name)] = t
    return out


def _lfm2_moe_published_names(tensors: dict) -> dict:
    """transformers' LFM2-MoE names → the published checkpoint's: the stacked experts
    `feed_forward.experts.gate_up_proj` [E, 2I, H] / `down_proj` [E, H, I] one tensor per expert,
    `feed_forward.experts.{e}.w1.weight` (gate), `w3` (up), `w2` (down)."""
    out = {}
    for name, t in tensors.items():
        if name.endswith('.feed_forward.experts.gate_up_proj'):
            prefix = name[:-len('gate_up_proj')]
            for e, (gate, up) in enumerate(zip(*t.chunk(2, dim=1))):
                out[f'{prefix}{e}.w1.weight'], out[f'{prefix}{e}.w3.weight'] = gate, up
        elif name.endswith('.feed_forward.experts.down_proj'):
            prefix = name[:-len('down_proj')]
            for e in range(t.shape[0]):
                out[f'{prefix}{e}.w2.weight'] = t[e]
        else:
            out[name] = t
    return out


def _bailing_published_names(tensors: dict) -> dict:
    """transformers' Ling 3 names → the published checkpoint's (transformers' conversion mapping
    reversed): `model.word_embeddings`, `attention` for `self_attn` with `dense` for `o_proj`, the
    forget-gate tensors directly under it, the stacked `conv1d` as `q_conv1d` / `k_conv1d` /
    `v_conv1d`, the router's correction bias as `expert_bias`."""
    out = {}
    for name, t in tensors.items():
        name = name.replace('model.embed_tokens.', 'model.word_embeddings.')
        name = name.replace('.self_attn.forget_gate.', '.self_attn.').replace('.self_attn.', '.attention.')
        name = name.replace('.attention.o_proj.', '.attention.dense.')
        _put_split_conv1d(out, name.replace('.mlp.gate.e_score_correction_bias', '.mlp.gate.expert_bias'), t,
                          '.attention.')
    return out


def _minimax_published_names(tensors: dict) -> dict:
    """transformers' MiniMax names → the published checkpoint's (Mixtral's layout): the MoE under
    `block_sparse_moe`, per-expert `w1` (gate) / `w3` (up) / `w2` (down); no lightning decay tables
    (transformers' buffers, computed from the config)."""
    out = {}
    for name, t in tensors.items():
        if re.search(r'\.self_attn\.(slope_rate|query_decay|key_decay|diagonal_decay)$', name):
            continue
        name = name.replace('.mlp.', '.block_sparse_moe.')
        for hf, pub in (('gate_proj', 'w1'), ('up_proj', 'w3'), ('down_proj', 'w2')):
            name = re.sub(rf'(\.experts\.\d+)\.{hf}\.weight$', rf'\1.{pub}.weight', name)
        out[name] = t
    return out


def _olmo_hybrid_published_names(tensors: dict) -> dict:
    """transformers' OLMo Hybrid names → the published checkpoint's (transformers' conversion
    mapping reversed): a Gated DeltaNet layer's norms `attention_layer_norm` /
    `feedforward_layer_norm`, its stacked `conv1d` as `q_conv1d` / `k_conv1d` / `v_conv1d` (split
    at the q / k / v projection widths)."""
    out = {}
    linear = {m.group(1) for m in (re.match(r'^(.*\.)linear_attn\.', n) for n in tensors) if m}
    for name, t in tensors.items():
        layer = next((p for p in linear if name.startswith(p)), None)
        if layer is not None and name.endswith('.linear_attn.conv1d.weight'):
            widths = [tensors[f'{layer}linear_attn.{p}_proj.weight'].shape[0] for p in 'qkv']
            for part, piece in zip('qkv', t.split(widths, dim=0)):
                out[name.replace('.conv1d.', f'.{part}_conv1d.')] = piece
            continue
        if layer is not None:
            name = name.replace('.input_layernorm.', '.attention_layer_norm.')
            name = name.replace('.post_attention_layernorm.', '.feedforward_layer_norm.')
        out[name] = t
    return out


def _zamba2_published_names(tensors: dict) -> dict:
    """transformers' Zamba2 state dict → the published checkpoint's: a shared attention block
    stored once, under its first hybrid layer (`model.layers.{i}.shared_transformer.*`), not
    again at each later layer that reuses it (those tensors share its storage)."""
    def layer(name: str) -> int:
        m = re.match(r'^model\.layers\.(\d+)\.', name)
        return int(m.group(1)) if m else -1

    out, seen = {}, set()
    for name in sorted(tensors, key=lambda n: (layer(n), n)):
        t = tensors[name]
        if '.shared_transformer.' in name:
            if t.data_ptr() in seen:
                continue
            seen.add(t.data_ptr())
        out[name] = t
    return out


def _lara_mini_published_names(tensors: dict) -> dict:
    """transformers' Lara-4-Mini names → the published checkpoint's: the Gated DeltaNet input
    projections fused into one `linear_attn.in_proj.weight` (rows `[q|k|v|z|b|a]`), the gated norm
    as `linear_attn.out_norm` (transformers' conversion mapping reversed)."""
    out, parts = {}, ('in_proj_qkv', 'in_proj_z', 'in_proj_b', 'in_proj_a')
    for name, t in tensors.items():
        if any(name.endswith(f'.linear_attn.{p}.weight') for p in parts[1:]):
            continue
        if name.endswith('.linear_attn.in_proj_qkv.weight'):
            stem = name[:-len('in_proj_qkv.weight')]
            out[stem + 'in_proj.weight'] = torch.cat([tensors[f'{stem}{p}.weight'] for p in parts])
            continue
        out[name.replace('.linear_attn.norm.', '.linear_attn.out_norm.')] = t
    return out


def _lfm3_published_names(tensors: dict) -> dict:
    """transformers' LFM3 names → the published checkpoint's: the attention output gate
    `self_attn.g_proj` as `self_attn.gate_proj`."""
    return {name.replace('.self_attn.g_proj.', '.self_attn.gate_proj.'): t for name, t in tensors.items()}


PUBLISHED_NAMES = {
    'minimax': _minimax_published_names,
    'bailing_hybrid': _bailing_published_names,
    'kimi_linear': _kimi_published_names,
    'glm5_next': glm5_next_published_names,
    'nemotron_h': _nemotron_published_names,
    'granitemoehybrid': _granite_published_names,
    'lfm2_moe': _lfm2_moe_published_names,
    'olmo_hybrid': _olmo_hybrid_published_names,
    'zamba2': _zamba2_published_names,
    'lara_mini': _lara_mini_published_names,
    'lfm3': _lfm3_published_names,
}
