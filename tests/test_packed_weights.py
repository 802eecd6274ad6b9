"""Packed projections (qkv, gate/up, Gated DeltaNet in_proj) load from the checkpoint's separate
tensors into exact rows, and a missing or misshapen part is an error naming it."""
import pytest
import torch

from lmdeploy.pytorch.models.layers import PackedLinear, WeightLoader, load_weights
from lmdeploy.pytorch.models.qwen3 import Qwen3ForCausalLM


def _config():
    from transformers import Qwen3Config
    return Qwen3Config(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=8, intermediate_size=48, tie_word_embeddings=True)


def _checkpoint(config, seed=0):
    from transformers import Qwen3ForCausalLM as HF
    torch.manual_seed(seed)
    hf = HF(config)
    gen = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v.shape, generator=gen) for k, v in hf.state_dict().items() if k != 'lm_head.weight'}


def test_separate_checkpoint_tensors_fill_packed_rows():
    config = _config()
    state = _checkpoint(config)
    model = Qwen3ForCausalLM(config)
    model.load_weights(state.items())
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    q, k, v = (state[f'model.layers.0.self_attn.{n}_proj.weight'] for n in 'qkv')
    assert torch.equal(attn.qkv_proj.weight, torch.cat([q, k, v]))
    assert [t.shape[-1] for t in attn.qkv_proj.forward_split(torch.zeros(1, 32))] == [32, 16, 16]
    gate, up = state['model.layers.0.mlp.gate_proj.weight'], state['model.layers.0.mlp.up_proj.weight']
    assert torch.equal(mlp.gate_up_proj.weight, torch.cat([gate, up]))
    assert torch.equal(model.lm_head.weight, state['model.embed_tokens.weight'])   # tied


def test_own_packed_state_dict_round_trips():
    config = _config()
    model = Qwen3ForCausalLM(config)
    model.load_weights(_checkpoint(config).items())
    other = Qwen3ForCausalLM(config)
    other.load_weights(model.state_dict().items())
    for name, p in model.state_dict().items():
        assert torch.equal(other.state_dict()[name], p), name


def test_missing_shard_names_the_packed_parameter():
    config = _config()
    state = _checkpoint(config)
    del state['model.layers.0.self_attn.k_proj.weight']
    with pytest.raises(ValueError, match=r'model\.layers\.0\.self_attn\.qkv_proj\.weight'):
        Qwen3ForCausalLM(config).load_weights(state.items())


def test_misshapen_shard_and_unknown_tensor_are_errors_naming_them():
    config = _config()
    state = _checkpoint(config)
    state['model.layers.0.mlp.up_proj.weight'] = torch.zeros(47, 32)
    with pytest.raises(ValueError, match=r'mlp\.up_proj\.weight.*\(47, 32\).*\(48, 32\)'):
        Qwen3ForCausalLM(config).load_weights(state.items())
    with pytest.raises(KeyError, match='w_proj'):
        Qwen3ForCausalLM(config).load_weights([('model.layers.0.self_attn.w_proj.weight', torch.zeros(1))])


def test_packed_linear_with_bias_loads_each_shard():
    module = torch.nn.Module()
    module.proj = PackedLinear(4, {'a': 2, 'b': 3}, bias=True)
    loader = WeightLoader(module)
    parts = {'a.weight': torch.ones(2, 4), 'b.weight': 2 * torch.ones(3, 4), 'a.bias': torch.ones(2),
             'b.bias': 2 * torch.ones(3)}
    for name, t in parts.items():
        loader.load(name, t)
    loader.finish()
    assert module.proj.bias.tolist() == [1, 1, 2, 2, 2]
    with pytest.raises(ValueError, match=r'proj\.bias'):
        load_weights(module, [(n, t) for n, t in parts.items() if n != 'b.bias'])
