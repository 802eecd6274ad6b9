"""Tests of lmdeploy.tools.make_tiny_model: layout, loadability, determinism and non-degenerate weights."""

import argparse
import hashlib
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from lmdeploy.cli.tiny_model import add_parser
from lmdeploy.tools.make_tiny_model import make_tiny_model

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FILES = ('config.json', 'generation_config.json', 'model.safetensors', 'tokenizer.json', 'tokenizer_config.json')


@pytest.fixture(scope='module')
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp('tiny')
    return {arch: make_tiny_model(str(root / arch), arch=arch, seed=0) for arch in ('qwen3', 'qwen3_next')}


def _hashes(path):
    return {f: hashlib.sha256(open(os.path.join(path, f), 'rb').read()).hexdigest() for f in FILES}


def _load(path):
    from transformers import AutoModelForCausalLM
    model, info = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, output_loading_info=True)
    return model.eval(), info


def test_qwen3_config_fields(models):
    from transformers import AutoConfig
    cfg = AutoConfig.from_pretrained(models['qwen3'])
    assert type(cfg).__name__ == 'Qwen3Config'
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (64, 2, 4, 2)
    assert (cfg.head_dim, cfg.intermediate_size, cfg.max_position_embeddings) == (16, 128, 32768)
    assert cfg.rope_parameters['rope_theta'] == 10000
    assert cfg.tie_word_embeddings is False and cfg.rms_norm_eps == 1e-6
    assert cfg.vocab_size == 1024


def test_qwen3_next_config_fields(models):
    from transformers import AutoConfig
    cfg = AutoConfig.from_pretrained(models['qwen3_next'])
    assert type(cfg).__name__ == 'Qwen3NextConfig'
    assert cfg.layer_types == ['linear_attention'] * 3 + ['full_attention']
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (64, 4, 2, 16)
    assert cfg.rope_parameters['partial_rotary_factor'] == 0.25
    assert (cfg.linear_num_key_heads, cfg.linear_num_value_heads) == (2, 4)
    assert (cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim) == (16, 16, 4)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (4, 2, 32)
    assert (cfg.shared_expert_intermediate_size, cfg.decoder_sparse_step, cfg.mlp_only_layers) == (64, 1, [])
    assert cfg.norm_topk_prob is True and cfg.tie_word_embeddings is False
    assert cfg.max_position_embeddings == 32768


# qwen3_next: 106 model tensors + 29 of the mtp.* head (which transformers ignores on load)
@pytest.mark.parametrize('arch,cls_name,num_tensors', [('qwen3', 'Qwen3ForCausalLM', 25),
                                                        ('qwen3_next', 'Qwen3NextForCausalLM', 135)])
def test_loads_with_hf_class_and_no_missing_keys(models, arch, cls_name, num_tensors):
    model, info = _load(models[arch])
    assert type(model).__name__ == cls_name
    assert info['missing_keys'] == set() and info['unexpected_keys'] == set()
    assert info['mismatched_keys'] == set()
    assert len(load_file(os.path.join(models[arch], 'model.safetensors'))) == num_tensors


def test_special_token_ids_and_eos(models):
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig
    path = models['qwen3_next']
    tok = AutoTokenizer.from_pretrained(path)
    assert type(tok).__name__ in ('PreTrainedTokenizerFast', 'TokenizersBackend')
    assert tok.convert_tokens_to_ids(['<|endoftext|>', '<|im_start|>', '<|im_end|>']) == [0, 1, 2]
    assert (tok.eos_token, tok.eos_token_id, tok.pad_token, tok.pad_token_id) == ('<|im_end|>', 2, '<|endoftext|>', 0)
    assert AutoConfig.from_pretrained(path).eos_token_id == 2
    gen = GenerationConfig.from_pretrained(path)
    assert (gen.eos_token_id, gen.pad_token_id, gen.do_sample) == (2, 0, False)
    assert len(tok) == 1024
    assert tok('<|im_start|>user<|im_end|>')['input_ids'][0] == 1
    assert tok('<|im_start|>user<|im_end|>')['input_ids'][-1] == 2


def test_tokenizer_round_trips_text(models):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(models['qwen3'])
    text = 'The river town woke at 10:30, and café prices rose 7% -> {"ok": true} 🙂\n\tdone.'
    ids = tok(text)['input_ids']
    assert tok.decode(ids) == text
    # Trained merges (not a bare byte alphabet); pinned so a corpus or trainer change is noticed.
    ids = tok('The library kept maps and letters.')['input_ids']
    assert tok.convert_ids_to_tokens(ids) == [
        'The', 'Ġlibrary', 'Ġ', 'kep', 't', 'Ġm', 'aps', 'Ġand', 'Ġlet', 'ters', '.'
    ]


def test_chat_template_renders_chatml(models):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(models['qwen3_next'])
    msgs = [{'role': 'system', 'content': 'Be brief.'}, {'role': 'user', 'content': 'Hi'},
            {'role': 'assistant', 'content': 'Hello.'}, {'role': 'tool', 'content': '42'},
            {'role': 'user', 'content': [{'type': 'text', 'text': 'Again'}]}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == ('<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n'
                    '<|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>tool\n42<|im_end|>\n'
                    '<|im_start|>user\nAgain<|im_end|>\n<|im_start|>assistant\n')
    no_prompt = tok.apply_chat_template(msgs[:2], tokenize=False, add_generation_prompt=False)
    assert no_prompt == '<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n'
    ids = tok.apply_chat_template(msgs[:2], add_generation_prompt=True, return_dict=True)['input_ids']
    assert ids[-4:] == tok('<|im_start|>assistant\n')['input_ids'] == [1, 590, 515, 201]
    with pytest.raises(Exception, match='unsupported chat role: robot'):
        tok.apply_chat_template([{'role': 'robot', 'content': 'x'}], tokenize=False)


def test_chat_template_renders_tools_and_tool_calls(models):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(models['qwen3'])
    tools = [{'type': 'function', 'function': {'name': 'add', 'parameters': {}}}]
    msgs = [{'role': 'user', 'content': 'Add'},
            {'role': 'assistant', 'content': None,
             'tool_calls': [{'type': 'function', 'function': {'name': 'add', 'arguments': {'a': 1}}}]}]
    text = tok.apply_chat_template(msgs, tools=tools, tokenize=False)
    assert text == ('<|im_start|>system\nYou may call these tools:\n'
                    '{"type": "function", "function": {"name": "add", "parameters": {}}}\n<|im_end|>\n'
                    '<|im_start|>user\nAdd<|im_end|>\n<|im_start|>assistant\n<tool_call>\n'
                    '{"name": "add", "arguments": {"a": 1}}\n</tool_call><|im_end|>\n')


CALL_LS = '<tool_call>\n{"name": "ls", "arguments": {"path": "."}}\n</tool_call>'
CALL_READ = '<tool_call>\n{"name": "read_file", "arguments": {"path": "a.txt", "lines": [1, 2]}}\n</tool_call>'


@pytest.mark.parametrize('reply', [CALL_LS, 'Let me look.\n' + CALL_LS, CALL_LS + '\n' + CALL_READ,
                                   'Two files.\n' + CALL_LS + '\n' + CALL_READ],
                         ids=['call', 'content_then_call', 'two_calls', 'content_then_two_calls'])
@pytest.mark.parametrize('as_string', [True, False], ids=['json_string_args', 'mapping_args'])
def test_chat_template_rerenders_a_generated_tool_call_reply_token_for_token(models, reply, as_string):
    """The reply appended to the history as the server returns it (content outside the calls,
    tool_calls with arguments as a JSON string, or as a mapping) renders to exactly the tokens
    the model generated, so the next turn's prompt extends prompt + reply (prefix-cache reuse)."""
    import json

    from transformers import AutoTokenizer

    from lmdeploy.serve.openai.tool_parser import get_tool_parser
    tok = AutoTokenizer.from_pretrained(models['qwen3'])
    tools = [{'type': 'function', 'function': {'name': n, 'parameters': {'type': 'object'}}}
             for n in ('ls', 'read_file')]
    history = [{'role': 'system', 'content': 'Be brief.'}, {'role': 'user', 'content': 'What is in a.txt?'}]
    prompt = tok.apply_chat_template(history, tools=tools, add_generation_prompt=True, return_dict=True)['input_ids']
    generated = tok.encode(reply, add_special_tokens=False) + [tok.eos_token_id]
    parsed = get_tool_parser('hermes').parse(reply)
    calls = [c.to_openai() for c in parsed.calls]
    if not as_string:
        calls = [dict(c, function=dict(c['function'], arguments=json.loads(c['function']['arguments']))) for c in calls]
    turn = history + [{'role': 'assistant', 'content': parsed.content, 'tool_calls': calls}] + [
        {'role': 'tool', 'tool_call_id': c['id'], 'content': 'ok'} for c in calls]
    following = tok.apply_chat_template(turn, tools=tools, add_generation_prompt=True, return_dict=True)['input_ids']
    assert following[:len(prompt) + len(generated)] == prompt + generated, tok.decode(following[len(prompt):])


def test_same_seed_gives_byte_identical_files(models, tmp_path):
    again = make_tiny_model(str(tmp_path / 'again'), arch='qwen3_next', seed=0)
    assert _hashes(again) == _hashes(models['qwen3_next'])


def test_different_seed_changes_every_weight_but_not_tokenizer(models, tmp_path):
    other = make_tiny_model(str(tmp_path / 'seed1'), arch='qwen3_next', seed=1)
    a, b = _hashes(models['qwen3_next']), _hashes(other)
    assert a['tokenizer.json'] == b['tokenizer.json'] and a['config.json'] == b['config.json']
    assert a['model.safetensors'] != b['model.safetensors']
    wa = load_file(os.path.join(models['qwen3_next'], 'model.safetensors'))
    wb = load_file(os.path.join(other, 'model.safetensors'))
    assert sorted(wa) == sorted(wb)
    assert [k for k in wa if torch.equal(wa[k], wb[k])] == []


def test_layer_weights_do_not_depend_on_layer_count(models, tmp_path):
    deeper = make_tiny_model(str(tmp_path / 'deep'), arch='qwen3_next', num_hidden_layers=8)
    w4 = load_file(os.path.join(models['qwen3_next'], 'model.safetensors'))
    w8 = load_file(os.path.join(deeper, 'model.safetensors'))
    assert len(w8) == len(w4) + 3 * 26 + 25  # 3 linear-attention layers + 1 full-attention layer
    assert all(torch.equal(w4[k], w8[k]) for k in w4)
    from transformers import AutoConfig
    assert AutoConfig.from_pretrained(deeper).layer_types == (['linear_attention'] * 3 + ['full_attention']) * 2


def test_experts_stored_per_expert_with_gate_rows_first(models):
    path = models['qwen3_next']
    weights = load_file(os.path.join(path, 'model.safetensors'))
    assert weights['model.layers.0.mlp.experts.3.gate_proj.weight'].shape == (32, 64)
    assert weights['model.layers.0.mlp.experts.3.down_proj.weight'].shape == (64, 32)
    model, _ = _load(path)
    experts = model.model.layers[0].mlp.experts
    assert torch.equal(experts.gate_up_proj[3, :32], weights['model.layers.0.mlp.experts.3.gate_proj.weight'])
    assert torch.equal(experts.gate_up_proj[3, 32:], weights['model.layers.0.mlp.experts.3.up_proj.weight'])
    assert torch.equal(experts.down_proj[3], weights['model.layers.0.mlp.experts.3.down_proj.weight'])


def test_norms_near_neutral_and_delta_net_params_in_range(models):
    w = load_file(os.path.join(models['qwen3_next'], 'model.safetensors'))
    # Qwen3-Next RMSNorm computes x * (1 + w): neutral is 0. The gated norm computes x * w: neutral is 1.
    assert w['model.norm.weight'].abs().max() < 0.3 and w['model.norm.weight'].abs().max() > 0
    assert (w['model.layers.0.linear_attn.norm.weight'] - 1).abs().max() < 0.3
    A = w['model.layers.1.linear_attn.A_log'].exp()
    assert A.min() >= 1 and A.max() <= 16
    dt = torch.nn.functional.softplus(w['model.layers.1.linear_attn.dt_bias'])
    assert dt.min() >= 1e-3 * 0.999 and dt.max() <= 1e-1 * 1.001
    q3 = load_file(os.path.join(models['qwen3'], 'model.safetensors'))
    assert (q3['model.layers.0.self_attn.q_norm.weight'] - 1).abs().max() < 0.3
    assert 0.08 < q3['model.layers.0.mlp.up_proj.weight'].std() < 0.12


@pytest.mark.parametrize('arch', ['qwen3', 'qwen3_next'])
def test_greedy_decoding_is_varied_and_untied(models, arch):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(models[arch])
    model, _ = _load(models[arch])
    ids = tok.apply_chat_template([{'role': 'user', 'content': 'What is the capital of France?'}],
                                  add_generation_prompt=True, return_tensors='pt', return_dict=True)['input_ids']
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=32, min_new_tokens=32, do_sample=False)
        top2 = model(ids).logits[0].topk(2, dim=-1).values
    assert out.shape[1] - ids.shape[1] == 32
    assert len(set(out[0, ids.shape[1]:].tolist())) >= 5
    assert (top2[:, 0] - top2[:, 1]).median() > 1e-2


def test_bfloat16_dtype_is_stored_and_recorded(tmp_path):
    path = make_tiny_model(str(tmp_path / 'bf16'), arch='qwen3', dtype='bfloat16')
    weights = load_file(os.path.join(path, 'model.safetensors'))
    assert {t.dtype for t in weights.values()} == {torch.bfloat16}
    from transformers import AutoConfig
    assert str(AutoConfig.from_pretrained(path).dtype) in ('bfloat16', 'torch.bfloat16')


@pytest.mark.parametrize('kwargs,field', [(dict(arch='llama'), 'arch'), (dict(dtype='int8'), 'dtype'),
                                          (dict(hidden_sizes=8), 'hidden_sizes'), (dict(seed=-1), 'seed')])
def test_bad_input_raises_value_error_naming_field(tmp_path, kwargs, field):
    with pytest.raises(ValueError, match=field):
        make_tiny_model(str(tmp_path / 'bad'), **kwargs)
    assert not os.path.exists(tmp_path / 'bad')


def test_subcommand_helper_prints_path(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    args = parser.parse_args(['make-tiny-model', str(tmp_path / 'cli'), '--arch', 'qwen3', '--seed', '3'])
    assert args.func(args) == str(tmp_path / 'cli')
    assert capsys.readouterr().out == f'{tmp_path / "cli"}\n'
    assert sorted(os.listdir(tmp_path / 'cli')) == sorted(FILES)


def test_module_cli_prints_path_and_matches_in_process_files(models, tmp_path):
    out = tmp_path / 'mod'
    env = dict(os.environ, PYTHONPATH=REPO_ROOT)
    res = subprocess.run([sys.executable, '-m', 'lmdeploy.tools.make_tiny_model', str(out), '--arch', 'qwen3'],
                         cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=60, check=True)
    assert res.stdout == f'{out}\n'
    # A separate process must reproduce the same bytes (tokenizer training included).
    assert _hashes(str(out)) == _hashes(models['qwen3'])


def test_help_shows_every_default():
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    add_parser(sub)
    text = sub.choices['make-tiny-model'].format_help()
    for default in ('(default: qwen3_next)', '(default: 0)', '(default: float32)', '--force'):
        assert default in ' '.join(text.split()), (default, text)


def test_non_empty_directory_is_refused_without_force(tmp_path, capsys):
    from lmdeploy.cli.entrypoint import main
    out = tmp_path / 'busy'
    out.mkdir()
    (out / 'notes.txt').write_text('mine')
    with pytest.raises(SystemExit) as exc:
        main(['make-tiny-model', str(out), '--arch', 'qwen3'])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert 'not empty' in err and '--force' in err
    assert os.listdir(out) == ['notes.txt']
    assert main(['make-tiny-model', str(out), '--arch', 'qwen3', '--force']) == 0
    assert sorted(os.listdir(out)) == sorted(FILES + ('notes.txt',))
    empty = tmp_path / 'empty'
    empty.mkdir()
    assert main(['make-tiny-model', str(empty), '--arch', 'qwen3']) == 0


def test_every_registered_model_declares_its_tiny_checkpoint():
    """The tiny checkpoint is a capability of the model class: every registered class has a
    non-empty ``tiny_config``, every ``--arch`` is a registered model type, and each arch's config
    builds (no weights) as ``transformers``' class for that type, with the declared fields."""
    from transformers import CONFIG_MAPPING

    from lmdeploy.pytorch.models import MODEL_REGISTRY, get_model_class
    from lmdeploy.tools.make_tiny_model import build_config
    from lmdeploy.tools.tiny_args import ARCHS

    for model_type in MODEL_REGISTRY:
        cls = get_model_class(model_type)
        assert isinstance(cls.tiny_config, dict) and cls.tiny_config, model_type
    assert set(ARCHS) <= set(MODEL_REGISTRY)
    for arch in ARCHS:
        config = build_config(arch, vocab_size=256, eos_token_id=2, pad_token_id=0)
        assert type(config) is CONFIG_MAPPING[arch], arch
        text = config.get_text_config()
        assert (text.vocab_size, text.eos_token_id, text.pad_token_id) == (256, 2, 0), arch
        assert text.hidden_size == get_model_class(arch).tiny_config['hidden_size'] == 64, arch


def test_a_class_without_tiny_config_is_refused_naming_it(monkeypatch, tmp_path):
    from lmdeploy.pytorch.models import get_model_class
    monkeypatch.setattr(get_model_class('qwen3'), 'tiny_config', {})
    with pytest.raises(ValueError, match='Qwen3ForCausalLM declares no tiny_config'):
        make_tiny_model(str(tmp_path / 'none'), arch='qwen3')
    assert not os.path.exists(tmp_path / 'none')


def test_tiny_model_maker_names_no_model_type_or_class():
    """No per-family table or branch in the maker: none of its string literals is a model type or
    a ``transformers`` config / model class name (they come from the family's class and from
    ``transformers``' auto mappings)."""
    import ast
    import re

    import lmdeploy.tools.make_tiny_model as maker
    from lmdeploy.pytorch.models import MODEL_REGISTRY
    from lmdeploy.tools.tiny_args import ARCHS

    tree = ast.parse(open(maker.__file__, encoding='utf-8').read())
    literals = {node.value for node in ast.walk(tree) if isinstance(node, ast.Constant) and isinstance(node.value, str)}
    assert not literals & (set(MODEL_REGISTRY) | set(ARCHS))
    class_like = re.compile(r'^\w+(ForCausalLM|ForConditionalGeneration|Config)$')
    assert not [s for s in literals if class_like.match(s)]
