"""Kimi-Linear's MLA decode path (absorbed: the up-projections folded into the query and the
output) equals the prefill path (every cached latent row up-projected) and transformers: prompt
logits computed one token per forward, so that every position runs the decode path, are within
the fp32 tolerance of transformers'."""
import pytest
import torch
from types import SimpleNamespace

from engine_utils import TOL, engine_prompt_logits, hf_prompt_logits, load_hf, make_engine, random_prompt
from lmdeploy.pytorch.models.blocks.mla import causal_attention as _causal_attention
from lmdeploy.pytorch.models.kimi_linear import KimiMLA


@pytest.fixture(scope='module')
def tiny(tmp_path_factory):
    from lmdeploy.tools.make_tiny_model import make_tiny_model
    path = make_tiny_model(str(tmp_path_factory.mktemp('tiny_kimi_mla')), arch='kimi_linear', seed=1)
    return path, load_hf(path)


def test_absorbed_decode_equals_the_up_projected_form():
    cfg = SimpleNamespace(num_attention_heads=4, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
                          kv_lora_rank=32, q_lora_rank=None, hidden_size=24, attention_bias=False)
    torch.manual_seed(0)
    mla = KimiMLA(cfg, 0)
    H, L = 4, 37
    q = torch.randn(1, H, 24)
    latent = torch.randn(L, 32 + 8)
    kv = mla.kv_b_proj(latent[:, :32]).view(L, H, 28)
    k_nope, values = kv.split([16, 12], dim=-1)
    keys = torch.cat((k_nope, latent[:, None, 32:].expand(L, H, 8)), dim=-1)
    with torch.no_grad():
        ref = _causal_attention(q, keys, values, L - 1, mla.scale)
        got = mla._absorbed_decode(q, latent)
    assert got.shape == ref.shape == (1, H, 12)
    assert (got - ref).abs().max().item() <= 1e-5


def test_prompt_logits_one_token_per_forward_match_transformers(tiny):
    path, hf = tiny
    ids = random_prompt(40, seed=3)
    got, forwards = engine_prompt_logits(make_engine(path, max_prefill_token_num=1, block_size=16), ids)
    ref = hf_prompt_logits(hf, ids)
    assert forwards == 40
    assert (got - ref).abs().max().item() <= TOL
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
