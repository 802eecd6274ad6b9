"""Nemotron-H served exactly like transformers: logits <= 1e-4 in fp32 at every prompt position
(5-700 tokens, cold and in 32-token chunks whose ends are not multiples of the SSD chunk of 48),
greedy tokens equal cold, chunked and after a local prefix-cache restore, a 4-turn chat identical
with the prefix cache off / on / last-only / turn-end, a 64-token checkpoint shared by two
conversations (no large state-block floor), a new engine's Store restore and Store bytes equal
to the simulator, TP2 = TP1, transformers-named checkpoints of other shapes, random geometries
(including a time_step_min that no longer clamps dt), the layer cache specs, the config audit
and the refusal of a time_step_limit transformers applies in prefill only."""
import inspect
import itertools
import json
import math
import os
import re
import shutil

import pytest
import torch
from hypothesis import given, settings, strategies as st

from engine_utils import TOL, check_checkpoint_matches_transformers, make_engine, random_prompt
from family_harness import (FamilyConformance, check_a_new_engine_restores_from_a_file_store,
                            check_continuous_batching_equals_each_request_alone, check_store_put_bytes_against_mooncake,
                            tiny_fixture)
from lmdeploy import GenerationConfig
from lmdeploy.pytorch.cache_specs import (FullAttentionSpec, PagedSpec, StateSpec, kv_bytes_per_block,
                                          state_bytes_per_slot)
from lmdeploy.pytorch.models import get_model_class
from lmdeploy.pytorch.models.config_audit import CHECKED, FIELDS, check_config

MAMBA, ATTN, MLP, MOE = 'linear_attention', 'full_attention', 'mlp', 'moe'


tiny = tiny_fixture('nemotron_h')


class TestNemotronHConformance(FamilyConformance):
    """Prompt logits, greedy tokens and a 4-turn chat against transformers (family_harness)."""


def test_continuous_batching_equals_each_request_alone(tiny):
    """Requests added while others run (mixed prefill + decode forwards: batched SSD decode steps
    beside chunked scans) decode what each decodes alone."""
    check_continuous_batching_equals_each_request_alone(tiny[0])


def test_a_64_token_checkpoint_serves_a_shared_system_prompt(tiny):
    """Two conversations share a 100-token system prompt; with A = B = 64 the first one saves a
    Mamba-2 state checkpoint at 64 and the second restores exactly those 64 tokens, giving the
    output an engine without caching gives."""
    path, _ = tiny
    system = random_prompt(100, seed=640)
    first, second = system + random_prompt(20, seed=641), system + random_prompt(30, seed=642)
    gen = GenerationConfig(max_new_tokens=5, ignore_eos=True)
    eng = make_engine(path, block_size=64, prefill_save_alignment=64, enable_prefix_caching=True,
                      num_checkpoint_slots=4)
    a = eng.generate(first, gen)
    b = eng.generate(second, gen)
    assert a.stats.save_points == [64] and a.num_cached_tokens == 0
    assert b.num_cached_tokens == 64
    assert b.output_ids == make_engine(path, block_size=64).generate(second, gen).output_ids


def _hf_nemotron(config, seed):
    from transformers import NemotronHForCausalLM

    from lmdeploy.tools.make_tiny_model import _randomize
    torch_state = torch.random.get_rng_state()
    hf = NemotronHForCausalLM(config).float().eval()
    torch.random.set_rng_state(torch_state)
    _randomize(hf, seed)
    with torch.no_grad():
        for name, buf in hf.named_buffers():
            if name.endswith('e_score_correction_bias'):
                buf.copy_(0.1 * torch.randn(buf.shape, generator=torch.Generator().manual_seed(seed)))
    return hf


def test_transformers_named_checkpoint_of_other_shapes_matches(tiny, tmp_path):
    """Other shapes (one Mamba group, no conv bias, in/out projection biases, latent MoE with MLP
    biases, 3 of 12 experts in 4 groups, no renormalisation, MHA) saved under transformers'
    in-memory names (``model.*``, stacked experts)."""
    from safetensors.torch import save_file
    from transformers import NemotronHConfig
    src, _ = tiny
    base = json.load(open(os.path.join(src, 'config.json')))
    config = NemotronHConfig(
        vocab_size=base['vocab_size'], hidden_size=48, layers_block_type=[ATTN, MAMBA, MOE, MAMBA, MLP],
        num_attention_heads=3, num_key_value_heads=3, head_dim=16, intermediate_size=40, mamba_num_heads=6,
        mamba_head_dim=4, n_groups=1, ssm_state_size=8, conv_kernel=3, chunk_size=16, use_conv_bias=False,
        use_bias=True, mlp_bias=True, moe_latent_size=24, n_routed_experts=12, num_experts_per_tok=3, n_group=4,
        topk_group=2, moe_intermediate_size=16, moe_shared_expert_intermediate_size=20, norm_topk_prob=False,
        routed_scaling_factor=1.7, time_step_min=1e-5, eos_token_id=base['eos_token_id'],
        pad_token_id=base['pad_token_id'], bos_token_id=None)
    hf = _hf_nemotron(config, 3)
    path = tmp_path / 'hf_names'
    shutil.copytree(src, path)
    sd = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert 'model.embeddings.weight' in sd and 'model.layers.2.mixer.experts.up_proj' in sd
    save_file(sd, str(path / 'model.safetensors'), metadata={'format': 'pt'})
    cfg = config.to_diff_dict()
    cfg['architectures'] = ['NemotronHForCausalLM']
    json.dump(cfg, open(path / 'config.json', 'w'))
    check_checkpoint_matches_transformers(str(path), hf)


def test_cache_specs_are_a_mamba2_state_kv_blocks_and_nothing_for_mlps(tiny):
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(tiny[0])
    specs = get_model_class('nemotron_h').cache_specs(config, torch.float32)
    assert [type(s) for s in specs] == [StateSpec, PagedSpec, FullAttentionSpec, StateSpec, PagedSpec]
    conv, ssm = specs[0].tensors()
    d_inner, gdn = config.mamba_num_heads * config.mamba_head_dim, config.n_groups * config.ssm_state_size
    assert conv.shape == (d_inner + 2 * gdn, config.conv_kernel - 1) and conv.dtype == torch.float32
    assert ssm.shape == (config.mamba_num_heads, config.mamba_head_dim, config.ssm_state_size)
    assert ssm.dtype == torch.float32 and specs[1].tensors() == () and specs[4].tensors() == ()
    assert state_bytes_per_slot(specs) == 2 * 4 * ((d_inner + 2 * gdn) * 3 + 8 * 8 * 16)
    assert kv_bytes_per_block(specs, 16) == 16 * 2 * 4 * config.num_key_value_heads * config.head_dim
    bf16 = get_model_class('nemotron_h').cache_specs(config, torch.bfloat16)[0].tensors()
    assert bf16[0].dtype == torch.bfloat16 and bf16[1].dtype == torch.float32    # the SSM state stays fp32


@pytest.mark.parametrize('change, field', [
    (dict(layers_block_type=['mamba'] * 5), 'layers_block_type'),
    (dict(mamba_hidden_act='gelu'), 'mamba_hidden_act'),
    (dict(mlp_hidden_act='silu'), 'mlp_hidden_act'),
    (dict(n_groups=3), 'n_groups'),
    (dict(n_group=3), 'n_group'),
    (dict(topk_group=5), 'topk_group'),
    (dict(time_step_limit=(0.01, 10.0)), 'time_step_limit'),
])
def test_refused_fields_name_themselves(tiny, change, field):
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(tiny[0])
    for k, v in change.items():
        setattr(config, k, v)
    with pytest.raises(ValueError, match=field):
        check_config(config)
    checked = {f for f, how in FIELDS['nemotron_h'].items() if how == CHECKED}
    assert checked <= {'layers_block_type', 'layer_types', 'mamba_hidden_act', 'mlp_hidden_act', 'n_groups',
                       'n_group', 'topk_group', 'time_step_limit', 'quantization_config'}


def test_only_the_default_time_step_limit_is_served(tiny):
    """``time_step_limit`` as a list (JSON) or a tuple: served when it is ``(0, inf)``, refused
    naming the field for every other pair."""
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(tiny[0])
    assert tuple(config.time_step_limit) == (0.0, math.inf)
    for limit in ([0.0, math.inf], (0.0, math.inf)):
        config.time_step_limit = limit
        check_config(config)
    for low, high in itertools.product((0.0, 1e-4, 0.001, -1.0), (math.inf, 0.1, 1e30)):
        for limit in ([low, high], (low, high)):
            if (low, high) == (0.0, math.inf):
                continue
            config.time_step_limit = limit
            with pytest.raises(ValueError, match=r'time_step_limit must be \(0\.0, inf\)'):
                check_config(config)


def test_transformers_clamps_dt_to_time_step_limit_in_prefill_only():
    """Why only the default limit is served: transformers' full forward (a chunked scan) clamps
    ``dt`` to ``time_step_limit``, its one-token decode step does not, so with a limit that binds
    the last token's logits differ between the two. Should transformers clamp in both, this fails
    and the limit can be implemented instead of refused."""
    from transformers import NemotronHConfig

    def full_minus_decoded(limit):
        config = NemotronHConfig(
            vocab_size=64, hidden_size=32, layers_block_type=[MAMBA, ATTN], num_attention_heads=2,
            num_key_value_heads=1, head_dim=8, intermediate_size=24, mamba_num_heads=4, mamba_head_dim=8,
            n_groups=2, ssm_state_size=8, conv_kernel=3, chunk_size=8, time_step_limit=limit, pad_token_id=0,
            bos_token_id=None, eos_token_id=1)
        hf = _hf_nemotron(config, 11)
        ids = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(11))
        with torch.no_grad():
            full = hf(input_ids=ids, use_cache=False).logits[0, -1]
            past = hf(input_ids=ids[:, :-1], use_cache=True).cache
            step = hf(input_ids=ids[:, -1:], cache=past, use_cache=True).logits[0, -1]
        return (full - step).abs().max().item()

    assert full_minus_decoded((0.0, math.inf)) <= TOL
    assert full_minus_decoded((0.5, math.inf)) > 100 * TOL


def test_audit_lists_every_field_transformers_reads_for_nemotron_h():
    import transformers.models.nemotron_h.modeling_nemotron_h as modeling
    source = inspect.getsource(modeling)
    read = (set(re.findall(r'config\.(\w+)', source))
            | set(re.findall(r'getattr\(\s*(?:self\.)?config,\s*["\'](\w+)', source))) - {'get_text_config'}
    assert read and not read - set(FIELDS['nemotron_h']), sorted(read - set(FIELDS['nemotron_h']))


@settings(max_examples=6, deadline=None)
@given(data=st.data())
def test_random_configs_match_transformers_in_random_chunks_then_decode(data):
    """Model level, random geometry (block pattern, Mamba heads / groups / state / conv kernel /
    SSD chunk, latent MoE or not, a ``time_step_min`` of 0.05 that random dts fall under: it
    initialises only, transformers >= 5.25 clamps dt to ``time_step_limit`` = (0, inf)) and a
    random prefill chunking then 3 decode steps: logits <= 1e-4 of transformers' full forward,
    through NaN-poisoned scrambled blocks and slots."""
    from transformers import NemotronHConfig

    from model_harness import ModelHarness
    n_layers = data.draw(st.integers(1, 4))
    types = data.draw(st.lists(st.sampled_from([MAMBA, ATTN, MLP, MOE]), min_size=n_layers, max_size=n_layers))
    heads, groups = data.draw(st.sampled_from([(2, 1), (4, 2), (4, 4), (6, 3)]))
    config = NemotronHConfig(
        vocab_size=64, hidden_size=32, layers_block_type=types, num_attention_heads=2,
        num_key_value_heads=data.draw(st.sampled_from([1, 2])), head_dim=8, intermediate_size=24,
        mamba_num_heads=heads, mamba_head_dim=data.draw(st.sampled_from([4, 8])), n_groups=groups,
        ssm_state_size=data.draw(st.sampled_from([4, 8])), conv_kernel=data.draw(st.integers(2, 4)),
        chunk_size=data.draw(st.sampled_from([3, 8, 64])), time_step_min=data.draw(st.sampled_from([1e-5, 0.05])),
        use_conv_bias=data.draw(st.booleans()), moe_latent_size=data.draw(st.sampled_from([None, 16])),
        n_routed_experts=4, num_experts_per_tok=2, n_group=data.draw(st.sampled_from([1, 2])), topk_group=1,
        moe_intermediate_size=8, moe_shared_expert_intermediate_size=12, routed_scaling_factor=2.0,
        pad_token_id=0, bos_token_id=None, eos_token_id=1)
    seed = data.draw(st.integers(0, 1000))
    hf = _hf_nemotron(config, seed)
    ours = get_model_class('nemotron_h')(config).eval()
    ours.load_weights(hf.state_dict().items())
    n = data.draw(st.integers(5, 80))
    ids = torch.randint(0, 64, (n + 3,), generator=torch.Generator().manual_seed(seed)).tolist()
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([ids]), use_cache=False).logits[0].float()
    h = ModelHarness(ours, type(ours).cache_specs(config, torch.float32), num_blocks=32, block_size=8)
    seq = h.add_sequence()
    got = torch.cat([h.run_chunks(seq, ids[:n], data.draw(st.integers(1, 40)))]
                    + [h.step([(seq, [t])])[0] for t in ids[n:]])
    assert (got - ref).abs().max().item() <= TOL


def test_a_new_engine_restores_from_the_store(tiny, tmp_path):
    """Mamba-2 state checkpoints + attention KV blocks of a 300-token prompt, restored
    from a ``file:`` Store by a new engine (family_harness; in a fresh process:
    tests/test_store_fresh_process.py)."""
    check_a_new_engine_restores_from_a_file_store(tiny[0], tmp_path, seed=881_000, put_objects={'state': 4, 'kv': 16})


@pytest.mark.parametrize('last_only', [False, True], ids=['default', 'last_only'])
def test_store_put_bytes_equal_the_simulator_to_the_byte(tiny, mooncake_services, last_only):
    check_store_put_bytes_against_mooncake(tiny[0], mooncake_services, last_only, max_turns=2, seed=880_000)


def test_nemotron_3_nano_preset_sizes():
    """The published Nemotron-3-Nano-30B-A3B geometry (bf16): S = 23 Mamba-2 layers x (conv
    (4096 + 2 x 8 x 128) x 3 bf16 + SSM 64 x 64 x 128 float32); K_blk = 6 attention layers x
    64 tokens x K and V x 2 KV heads x 128 bf16."""
    from test_benchmark_store_bytes import sim
    sizes = sim.sizes_from_config(sim.NEMOTRON_3_NANO_30B_CONFIG, block_size=64)
    assert sizes == sim.StoreSizes(23 * (6144 * 3 * 2 + 64 * 64 * 128 * 4), 6 * 64 * 2 * 2 * 128 * 2)
    tp2 = sim.sizes_from_config(sim.NEMOTRON_3_NANO_30B_CONFIG, block_size=64, tp=2)
    assert tp2.charged == (sizes.state_bytes, sizes.kv_block_bytes) and tp2.state_bytes == sizes.state_bytes // 2


def test_tp2_logits_and_greedy_tokens_equal_tp1(tiny):
    """Mamba-2 split by head and group, attention by head, the dense MLP by row; MoE replicated."""
    from test_tensor_parallel import check_tp2_equals_tp1
    check_tp2_equals_tp1(tiny[0])


def test_tp_plan_slices_tile_every_split_tensor(tiny):
    """Over the ranks, each split tensor's ranges tile its axis exactly once; MoE tensors, norms
    and out_proj biases are read whole by every rank; a group count TP neither divides nor is a
    multiple of is refused (naming the field)."""
    from lmdeploy.pytorch.distributed.sharding import TPLayout
    from test_tensor_parallel import check_tp_slices_tile_every_split_tensor
    config, layouts, split = check_tp_slices_tile_every_split_tensor(tiny[0])
    assert split >= 20
    assert layouts[0].shard('backbone.layers.1.mixer.experts.0.up_proj.weight') is None
    config.mamba_num_heads, config.n_groups = 12, 3
    with pytest.raises(ValueError, match=r'n_groups \(3\) must be divisible by tp \(2\) or divide it'):
        TPLayout(config, 0, 2)


@pytest.fixture(scope='module')
def tiny_one_group(tmp_path_factory):
    """The tiny model with ``n_groups = 1`` (fewer Mamba-2 groups than TP ranks)."""
    from lmdeploy.tools.make_tiny_model import make_tiny_model
    return make_tiny_model(str(tmp_path_factory.mktemp('tiny_nemotron_h_g1')), arch='nemotron_h', seed=0, n_groups=1)


def test_one_group_tp2_equals_tp1_with_the_group_replicated_and_its_norm_all_reduced(tiny_one_group):
    """``n_groups = 1`` at TP2: the ranks share the group's B / C rows and conv channels (the only
    ranges both read) and all-reduce its norm; TP2 = TP1. Each rank's state holds its heads plus a
    copy of B / C; the Store (and the simulator) charges the single-process layout."""
    from safetensors import safe_open

    from test_store_engine import sim
    from test_tensor_parallel import check_tp2_equals_tp1, check_tp_slices_tile_every_split_tensor
    _, _, split, repeated = check_tp_slices_tile_every_split_tensor(tiny_one_group, shared=True)
    cfg = json.load(open(os.path.join(tiny_one_group, 'config.json')))
    with safe_open(os.path.join(tiny_one_group, 'model.safetensors'), framework='pt') as f:
        bc = [n for n in f.keys() if re.search(r'\.mixer\.(in_proj|conv1d)\.', n)]
    assert split > 0 and bc and repeated == 2 * len(bc)       # each: the B range and the C range

    def store_sizes(eng):
        one, two = (sim.sizes_from_config(cfg, tp=tp, block_size=eng.cache_engine.block_size) for tp in (1, 2))
        assert two.charged == (eng.cache_engine.state_bytes, eng.cache_engine.kv_block_bytes)
        assert two.charged[0] == one.state_bytes
        H, P, Dn, K = cfg['mamba_num_heads'], cfg['mamba_head_dim'], cfg['ssm_state_size'], cfg['conv_kernel']
        mamba = sum(1 for n in bc if n.endswith('in_proj.weight'))
        per_rank = mamba * 4 * ((H // 2 * P + 2 * Dn) * (K - 1) + H // 2 * P * Dn)     # float32
        assert two.state_bytes == per_rank and 2 * per_rank > one.state_bytes
    check_tp2_equals_tp1(tiny_one_group, then=store_sizes)


def test_api_server_flag_gives_the_second_conversation_64_cached_tokens(tiny):
    """The same through ``lmdeploy serve api_server --prefill-save-alignment 64``: two chats
    with one system message of about 100 tokens (103 with the template's role header); the second
    reports 64 cached prompt tokens."""
    from server_utils import ApiServer, http_json
    path, _ = tiny
    system = ' '.join(f'rule {i}: answer briefly and check the facts.' for i in range(6))
    with ApiServer(path, '--enable-prefix-caching', '--prefill-save-alignment', '64', '--block-size', '64',
                   '--dtype', 'float32', '--session-len', '2048') as server:
        usage = []
        for user in ('Hi.', 'Hello!'):     # prompts under 128 tokens: 64 is their one reusable boundary
            status, body = http_json(server.base_url + '/v1/chat/completions', {
                'model': os.path.basename(path), 'max_tokens': 4, 'temperature': 0,
                'messages': [{'role': 'system', 'content': system}, {'role': 'user', 'content': user}]})
            assert status == 200, body
            usage.append(body['usage'])
    assert all(100 < u['prompt_tokens'] < 128 for u in usage)
    assert [u['prompt_tokens_details']['cached_tokens'] for u in usage] == [0, 64]
