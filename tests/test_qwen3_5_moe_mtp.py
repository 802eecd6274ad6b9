"""Qwen3.5-MoE MTP speculative decoding (the checkpoint's ``mtp.*`` head, an MoE full-attention
layer): greedy outputs equal plain decoding, single and 8 concurrent, prefix cache off / on /
last-only, for the text-only and the vision-language checkpoint (the suite of
tests/test_spec_decode_mtp.py run unchanged on them), and under TP2 equal to plain TP1."""
import pytest

from test_spec_decode_mtp import test_mtp_greedy_equals_plain_single_and_8_concurrent  # noqa: F401


@pytest.fixture(params=['qwen3_5_moe_text', 'qwen3_5_moe'])
def tiny_qwen3_next(request):
    """The imported tests' model fixture, here each Qwen3.5-MoE checkpoint."""
    return request.getfixturevalue(f'tiny_{request.param}')


def test_the_mtp_head_is_the_moe_layer(tiny_qwen3_next):
    from test_spec_decode_mtp import engine
    eng = engine(tiny_qwen3_next)
    layer = eng.mtp.layers[0]
    assert type(layer).__name__ == 'Qwen3_5MoeDecoderLayer' and layer.mlp.norm_topk_prob


@pytest.mark.parametrize('arch', ['qwen3_5_moe_text'])
def test_tp2_mtp_greedy_equals_plain_tp1(arch, request):
    from test_spec_decode_mtp import GEN, plain
    from test_tensor_parallel import PROMPTS, engine
    path = request.getfixturevalue(f'tiny_{arch}')
    expected = [plain(path, p) for p in PROMPTS]
    eng = engine(path, tp=2, speculative_config=dict(method='qwen3_next_mtp', num_speculative_tokens=2))
    try:
        seqs = [eng.add_request(p, GEN) for p in PROMPTS]
        while not all(s.is_finished for s in seqs):
            eng.step()
        assert [s.output_ids for s in seqs] == expected
        assert eng.stats()['spec_decode_draft_tokens'] > 0
    finally:
        eng.close()
