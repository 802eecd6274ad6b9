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


def glm5_next_published_names(tensors: dict) -> dict:
    """transformers' GLM-5.3-Flash names → the published layout (transformers' conversion
    mapping reversed): forget-gate tensors directly under `self_attn`, the stacked `conv1d` as
    `q_conv1d` / `k_conv1d` / `v_conv1d`, `attn_hc.fn` as `hc_attn_fn` (and base, scale, ffn)."""
    out = {}
    for name, t in tensors.items():
        name = name.replace('.self_attn.forget_gate.', '.self_attn.')
        name = re.sub(r'\.(attn|ffn)_hc\.(fn|base|scale)$', r'.hc_\1_\2', name)
        if name.endswith('.self_attn.conv1d.weight'):
            for part, piece in zip('qkv', t.chunk(3, dim=0)):
                out[name.replace('.conv1d.', f'.{part}_conv1d.')] = piece
            continue
        out[name] = t
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
    'kimi_linear': _kimi_published_names,
    'glm5_next': glm5_next_published_names,
    'nemotron_h': _nemotron_published_names,
    'granitemoehybrid': _granite_published_names,
    'lfm2_moe': _lfm2_moe_published_names,
    'lara_mini': _lara_mini_published_names,
    'lfm3': _lfm3_published_names,
}
