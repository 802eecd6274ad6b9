"""The prefill chunk grid and the shared head's checkpoint, end to end on the tiny Qwen3-Next.

- Bitwise: the chunk grid depends on the prompt alone, so in bfloat16 greedy output is the same
  token for token with prefix caching off, on (default and last-only) and restored. Geometry
  B = 16, A = 64, P = 100: P is not a multiple of A, so before the grid caching off ended forwards
  at 100, 200, ... and caching on at multiples of 64, and the prompts below (found by a scan of
  random prompts) changed their greedy output in bf16.
- Shared head: two agent sessions with the same long system prompt and different first user
  messages; with ``prefill_save_last_only`` the second restores the head's last aligned boundary.
"""
from __future__ import annotations

import pytest

from engine_utils import make_engine, random_prompt
from lmdeploy import GenerationConfig, PytorchEngineConfig
from lmdeploy.pytorch.paging.prefill_plan import prefill_grid, shared_head_boundary
from lmdeploy.serve.pipeline import Pipeline

B, A, P = 16, 64, 100
GEN = GenerationConfig(max_new_tokens=16, ignore_eos=True)
# (tokens, seed): the first two changed their bf16 greedy output with caching on before the grid
PROMPTS = [(224, 102), (241, 103), (150, 100)]


@pytest.fixture(scope='module')
def bf16_engines(tiny_qwen3_next):
    geometry = dict(dtype='bfloat16', block_size=B, prefill_save_alignment=A, max_prefill_token_num=P,
                    num_checkpoint_slots=16)
    return {'off': make_engine(tiny_qwen3_next, enable_prefix_caching=False, **geometry),
            'default': make_engine(tiny_qwen3_next, enable_prefix_caching=True, **geometry),
            'last-only': make_engine(tiny_qwen3_next, enable_prefix_caching=True, prefill_save_last_only=True,
                                     **geometry)}


@pytest.mark.parametrize('n, seed', PROMPTS)
def test_bf16_greedy_output_is_bitwise_the_same_off_on_and_restored(bf16_engines, n, seed):
    ids = random_prompt(n, seed)
    off = bf16_engines['off'].generate(ids, GEN)
    grid = prefill_grid(n, 0, P, B, A)
    assert off.stats.plans[0].chunk_ends == grid
    for name in ('default', 'last-only'):
        eng = bf16_engines[name]
        first = eng.generate(ids, GEN)
        again = eng.generate(ids, GEN)                      # restores the deepest save point, a grid end
        assert first.stats.plans[0].chunk_ends == grid
        assert again.num_cached_tokens in grid and again.num_cached_tokens == (n - 1) // A * A
        assert again.stats.plans[0].chunk_ends == [e for e in grid if e > again.num_cached_tokens]
        assert first.output_ids == off.output_ids, name
        assert again.output_ids == off.output_ids, name


# ---------------------------------------------------------------- the shared head
WORDS = ('read edit grep glob bash write test patch file path line tool call agent task plan diff commit '
         'branch review module function class error output input token cache prefix session').split()


def _system_prompt(num_words: int) -> str:
    """A long, Claude Code-like system prompt (instructions and tool descriptions) of plain words."""
    return ' '.join(WORDS[(i * 7 + i // 5) % len(WORDS)] for i in range(num_words))


def test_second_agent_session_restores_the_shared_head_with_last_only(tiny_qwen3_next):
    system = _system_prompt(900)
    # first user messages long enough that the first session's only last-only checkpoint (b*)
    # lies past the point where the sessions diverge
    sessions = [[{'role': 'system', 'content': system}, {'role': 'user', 'content': task * 4}]
                for task in ('Fix the failing parser test and explain the patch. ',
                             'Summarize the cache module for a new contributor, then list open questions. ')]
    geometry = dict(device_type='cpu', dtype='float32', block_size=B, prefill_save_alignment=A,
                    max_prefill_token_num=512, num_gpu_blocks=512, num_checkpoint_slots=16)
    gen = GenerationConfig(max_new_tokens=6, ignore_eos=True)
    with Pipeline(tiny_qwen3_next, PytorchEngineConfig(enable_prefix_caching=False, **geometry)) as off:
        reference = [off(s, gen).token_ids for s in sessions]
    with Pipeline(tiny_qwen3_next, PytorchEngineConfig(enable_prefix_caching=True, prefill_save_last_only=True,
                                                       **geometry)) as pipe:
        ids = [pipe.encode(s) for s in sessions]
        head = pipe.shared_head(sessions[1], ids[1])
        # the rendered system message, up to where the user message starts
        rendered = pipe.tokenize(pipe.render(sessions[0][:1]).split('<|im_start|>assistant')[0])
        assert head == len(rendered) == pipe.shared_head(sessions[0], ids[0]) > 1200
        assert ids[0][:head] == ids[1][:head]
        boundary = shared_head_boundary(head, len(ids[1]), B, A)
        assert boundary == head // A * A and boundary >= 0.95 * head
        diverge = next(i for i, (a, b) in enumerate(zip(*ids)) if a != b)
        assert (len(ids[0]) - 1) // A * A > diverge       # without the head: nothing to restore
        first = pipe(sessions[0], gen)
        second = pipe(sessions[1], gen)
        assert first.cached_tokens == 0
        assert second.cached_tokens == boundary
        assert [first.token_ids, second.token_ids] == reference
        # one head checkpoint (the first session's); the second restored it rather than saving it again
        assert pipe.stats()['shared_head_checkpoints_saved'] == 1


def test_raw_prompts_and_requests_without_a_system_message_have_no_head(tiny_qwen3_next):
    with Pipeline(tiny_qwen3_next, PytorchEngineConfig(device_type='cpu', num_gpu_blocks=64)) as pipe:
        messages = [{'role': 'user', 'content': 'hello there'}]
        assert pipe.shared_head(messages, pipe.encode(messages)) is None
        assert pipe.shared_head('a raw prompt', pipe.encode('a raw prompt')) is None
        only_system = [{'role': 'system', 'content': 'be brief'}]
        assert pipe.shared_head(only_system, pipe.encode(only_system)) is None     # nothing follows it
        dev = [{'role': 'developer', 'content': 'be brief'}, {'role': 'user', 'content': 'hi'}]
        head = pipe.shared_head(dev, pipe.encode(dev))
        assert head == len(pipe.tokenize('<|im_start|>system\nbe brief<|im_end|>\n'))
        with pytest.raises(ValueError, match='shared_head_tokens'):
            pipe.engine.requests.check([5, 6, 7], shared_head_tokens=-1)
