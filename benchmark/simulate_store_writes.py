"""Simulate Mooncake Store write volume and prefill recompute of the checkpoint save policies
(docs/en/advance/prefix_caching.md "Save policies", docs/en/advance/store.md "The byte formula").

Owns the byte accounting of Store puts per conversation; it runs no model. For every request
of a scenario it plans the prefill with :func:`plan_prefill` under each policy and charges

    bytes(request) = (state snapshots saved) * S + (KV blocks newly covered) * K_blk

where the newly covered blocks are the blocks below a saved boundary that no earlier save put
(the Store keys blocks by their prefix, so a block is put once however many requests share
it). A request starts from a cache hit ``c`` = the deepest earlier checkpoint whose tokens it
shares and that a restore can use (reusable for this input, and its ``r`` blocks past ``c``
cached); it then recomputes ``n - c`` prompt tokens, the figure that drives TTFT::

    turn 1   |== 8192 ==|== 16384 ==|== 24576 ==|== 32768 ==|64|     default: S at every |
    turn 2   |<------------- hit c = 32768 -------------->|=36864=|64|  + blocks 32768..36864

Policies (engine config fields): ``default``; ``last-only`` (``prefill_save_last_only``: one
save per turn, at b* = ``last_reusable(n)``); ``+turn-end`` (``decode_save_last``: when a
request finishes, one more checkpoint at ``te = floor_B(n + output - 1)``, the last block
boundary of its computed tokens, if a forward ended there (a prompt forward also ends at
``floor_B(n)``, so one does unless it is a save point or falls inside an image); restores then
accept any block boundary, not only multiples of A); ``+junction`` (``save_junction``: a request whose cached
full blocks reach ``m`` tokens, deeper than its hit ``c``, also saves at the largest reusable
boundary ``j`` with ``c < j <= m``, splitting the chunk that contains ``j``)::

    append-only, last-only + turn-end        branching, last-only + junction
    turn t   |====== b*|==|te  reply..|       sibling 1 |==== shared ====|== own ==b*|
    turn t+1 |<-- hit te -->|== new ==|       sibling 2 |==== shared ==j|   (save at j)
                                              sibling 3 |<--- hit j -->|== own ==|

Scenarios: :class:`Scenario` (an append-only conversation: turn t+1's input = turn t's input
+ its reply + new user text) and :class:`Branching` (N siblings that share a prefix and then
diverge, sent one after another; each finds every earlier sibling's blocks and checkpoints).

Sizes: explicit (``--state-bytes``/``--kv-block-bytes``), a ratio S/K_blk (sizes in
relative units), a preset, or an HF ``config.json`` of a hybrid (``qwen3_next``) model, sized
with the engine's own layer cache specs (``lmdeploy.pytorch.cache_specs``, the one definition of
S and K_blk that the engine and its Store tier use): per linear-attention layer the state is
``conv_dim·(kernel-1)·dtype_bytes`` conv state plus ``v_heads·k_head_dim·v_head_dim·4`` fp32
recurrent state (``conv_dim = 2·k_heads·k_head_dim + v_heads·v_head_dim``, heads divided by
tp); ``K_blk = full_layers·2·B·kv_heads_per_rank·head_dim·dtype_bytes`` per rank. With
``--tp N`` the bytes charged are the sums over ranks (each rank's owned heads; a replicated KV
head once), as a tensor-parallel engine's ``store_put_bytes`` counts them: its objects hold
every head (docs/en/advance/parallelism.md). The reduction does not depend on tp.

Reductions ``1 - bytes_last_only / bytes_default`` are printed *truncated* to 0.01%: the seed
table lists 32K+64 as 63.64% while the exact value is 63.6458%.

Usage: ``python benchmark/simulate_store_writes.py --preset seed-table``
(``--preset tiny|qwen3-next-80b|kimi-linear-48b|nemotron-3-nano-30b|granite-4.0-h-small|glm-5.3-flash [--tp N]``;
glm-5.3-flash: sizes from :mod:`benchmark.glm5_next_sizes`, the seed deployment TP8 / FP8 KV / MTP unless ``--tp``,
``--kv-dtype``, ``--no-mtp``; ``--config config.json``, ``--scale 1/16 --block-size 16``,
``--turns 32832,36928``, ``--json``; per-turn tables of more policies:
``--policies default,last-only,last-only+turn-end`` or ``--decode-save-last`` /
``--save-junction``; the branching scenario: ``--preset branching`` or ``--scenario branching``).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass, replace
from fractions import Fraction
from pathlib import Path
from typing import Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lmdeploy.pytorch.cache_specs import kv_bytes_per_block, state_bytes_per_slot  # noqa: E402
from lmdeploy.pytorch.paging.prefill_plan import PrefillPlan, is_reusable, plan_prefill, with_last_block_end  # noqa: E402

KTOK = 1024
DEFAULT_CHUNK, DEFAULT_BLOCK, DEFAULT_ALIGNMENT = 8192, 64, 1024
SEED_STATE_TO_BLOCK_RATIO = Fraction('717.5')
DTYPE_BYTES = {'float32': 4, 'float': 4, 'fp32': 4, 'float16': 2, 'half': 2, 'fp16': 2, 'bfloat16': 2,
               'bf16': 2, 'float8_e4m3fn': 1, 'float8_e5m2': 1, 'fp8': 1, 'int8': 1}
_TORCH_DTYPE = {4: 'float32', 2: 'bfloat16', 1: 'int8'}     # any dtype of that width sizes alike

TINY_CONFIG = dict(model_type='qwen3_next', num_hidden_layers=4, full_attention_interval=4,
                   linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                   linear_value_head_dim=16, linear_conv_kernel_dim=4, num_key_value_heads=2,
                   head_dim=16, dtype='float32')
QWEN3_NEXT_80B_CONFIG = dict(model_type='qwen3_next', num_hidden_layers=48, full_attention_interval=4,
                             linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                             linear_value_head_dim=128, linear_conv_kernel_dim=4, num_key_value_heads=2,
                             head_dim=256, dtype='bfloat16')

# the published Kimi-Linear-48B-A3B config.json's cache-shaping fields: 20 KDA layers (32 heads of
# 128, short convs of 4) and 7 MLA layers (latent 512 + rope 64 per token, one row for all heads)
KIMI_LINEAR_48B_CONFIG = dict(model_type='kimi_linear', num_hidden_layers=27, hidden_size=2304,
                              num_attention_heads=32, num_key_value_heads=32, kv_lora_rank=512, q_lora_rank=None,
                              qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, first_k_dense_replace=1,
                              linear_attn_config=dict(
                                  full_attn_layers=[4, 8, 12, 16, 20, 24, 27],
                                  kda_layers=[i for i in range(1, 28) if i not in (4, 8, 12, 16, 20, 24, 27)],
                                  num_heads=32, head_dim=128, short_conv_kernel_size=4),
                              dtype='bfloat16')

# NVIDIA-Nemotron-3-Nano-30B-A3B (nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16 config.json, as reproduced
# in public test fixtures of several repositories): 52 blocks 'MEMEM*EMEMEM*...' = 23 Mamba-2 (64 heads
# of 64, 8 groups, state 128, conv 4), 23 MoE (128 experts, top 6), 6 GQA attention (32 heads, 2 KV
# heads of 128, no RoPE); only the Mamba-2 and attention blocks cache anything
NEMOTRON_3_NANO_30B_CONFIG = dict(model_type='nemotron_h', hidden_size=2688, vocab_size=131072,
                                  hybrid_override_pattern='MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME',
                                  num_attention_heads=32, num_key_value_heads=2, head_dim=128,
                                  mamba_num_heads=64, mamba_head_dim=64, n_groups=8, ssm_state_size=128,
                                  conv_kernel=4, chunk_size=128, n_routed_experts=128, num_experts_per_tok=6,
                                  moe_intermediate_size=1856, moe_shared_expert_intermediate_size=3712,
                                  intermediate_size=1856, n_group=1, topk_group=1, routed_scaling_factor=2.5,
                                  dtype='bfloat16')

# ibm-granite/granite-4.0-h-small's cache-shaping fields: hidden 4096, 40 layers, 32 query / 8 KV
# heads, mamba_d_state 128, mamba_d_conv 4, mamba_expand 2, bf16 as quoted from its published
# config.json (huggingface.co/ibm-granite/granite-4.0-h-small/blob/main/config.json) in public
# notes; the 4 attention layers at 5, 15, 25, 35 (the family's 40-layer layout, as in
# granite-4.0-h-tiny's config), 128 Mamba heads of 64 and one B/C group are the family's values,
# not seen in that file here. S: 36 x (conv (8192 + 2 x 128) x 3 bf16 + SSM 128 x 64 x 128 float32).
GRANITE_4_0_H_SMALL_CONFIG = dict(model_type='granitemoehybrid', num_hidden_layers=40, hidden_size=4096,
                                  num_attention_heads=32, num_key_value_heads=8,
                                  layer_types=['attention' if i in (5, 15, 25, 35) else 'mamba' for i in range(40)],
                                  mamba_n_heads=128, mamba_d_head=64, mamba_n_groups=1, mamba_d_state=128,
                                  mamba_d_conv=4, mamba_expand=2, num_local_experts=72, num_experts_per_tok=10,
                                  intermediate_size=768, shared_intermediate_size=1536, vocab_size=100352,
                                  dtype='bfloat16')


@dataclass(frozen=True)
class Request:
    """One request of a scenario, as the simulator sees it.

    Attributes:
        num_tokens: n, tokens of its input.
        output_tokens: tokens of its reply (>= 1; the last one is sampled, never computed).
        common_prefix: for each earlier request, in order, how many leading tokens the two
            share (tokens).
    """

    num_tokens: int
    output_tokens: int
    common_prefix: tuple[int, ...] = ()


@dataclass(frozen=True)
class Scenario:
    """An append-only conversation: ``input_lengths[t]`` tokens are the input of turn t."""

    name: str
    input_lengths: tuple[int, ...]
    output_tokens: int = 16

    def scaled(self, factor: Fraction) -> 'Scenario':
        """The scenario with every token count multiplied by ``factor`` (exactly).

        Raises:
            ValueError (``scale``): a scaled input length is not a positive integer.
        """
        def one(x: int) -> int:
            y = Fraction(x) * factor
            if y.denominator != 1 or y < 1:
                raise ValueError(f'scale {factor} makes {x} tokens of {self.name!r} non-integral')
            return int(y)
        # the reply length is informational (already inside the next input): round it leniently
        return Scenario(self.name, tuple(one(n) for n in self.input_lengths),
                        max(1, math.floor(self.output_tokens * factor)))

    def requests(self) -> list[Request]:
        """The turns as requests: turn t shares with turn j < t its input and reply (as far as
        turn t's input reaches), ``min(n_j + output_tokens, n_t)`` tokens.

        Raises:
            ValueError (``input_lengths``): empty or decreasing turns, a turn < 1 token, or
            ``output_tokens`` < 1.
        """
        lengths = self.input_lengths
        if not lengths or any(b < a for a, b in zip(lengths, lengths[1:])) or lengths[0] < 1:
            raise ValueError(f'scenario input_lengths must be non-empty, positive and non-decreasing, got {lengths}')
        if self.output_tokens < 1:
            raise ValueError(f'scenario output_tokens must be >= 1, got {self.output_tokens}')
        return [Request(n, self.output_tokens, tuple(min(m + self.output_tokens, n) for m in lengths[:t]))
                for t, n in enumerate(lengths)]


@dataclass(frozen=True)
class Branching:
    """``siblings`` requests sent one after another; each is ``shared_tokens`` tokens common to
    all of them followed by ``suffix_tokens`` tokens of its own (they differ from the first one)."""

    name: str
    shared_tokens: int
    suffix_tokens: int
    siblings: int = 4
    output_tokens: int = 512

    @property
    def input_lengths(self) -> tuple[int, ...]:
        return (self.shared_tokens + self.suffix_tokens, ) * self.siblings

    def scaled(self, factor: Fraction) -> 'Branching':
        """The scenario with every token count multiplied by ``factor`` (exactly).

        Raises:
            ValueError (``scale``): a scaled token count is not an integer.
        """
        def one(x: int) -> int:
            y = Fraction(x) * factor
            if y.denominator != 1:
                raise ValueError(f'scale {factor} makes {x} tokens of {self.name!r} non-integral')
            return int(y)
        return Branching(self.name, one(self.shared_tokens), one(self.suffix_tokens), self.siblings,
                         max(1, math.floor(self.output_tokens * factor)))

    def requests(self) -> list[Request]:
        """The siblings as requests; any two share exactly ``shared_tokens`` tokens.

        Raises:
            ValueError (``branching``): ``shared_tokens`` < 0, ``suffix_tokens`` < 1,
            ``siblings`` < 1 or ``output_tokens`` < 1.
        """
        if self.shared_tokens < 0 or self.suffix_tokens < 1 or self.siblings < 1 or self.output_tokens < 1:
            raise ValueError(f'branching scenario needs shared_tokens >= 0, suffix_tokens >= 1, siblings >= 1 and '
                             f'output_tokens >= 1, got {self}')
        n = self.shared_tokens + self.suffix_tokens
        return [Request(n, self.output_tokens, (self.shared_tokens, ) * i) for i in range(self.siblings)]


def seed_scenarios() -> list[Scenario]:
    """The six seed-table scenarios (K = 1024 tokens)."""
    singles = [Scenario(f'{k}K+64', (k * KTOK + 64, ), 16) for k in (8, 16, 32, 64)]
    multi = [Scenario(f'32K+64 x5 turns, +{g}K/turn', tuple(32 * KTOK + 64 + t * g * KTOK for t in range(5)), 512)
             for g in (4, 16)]
    return singles + multi


def branching_scenario() -> Branching:
    """Four siblings sharing 20K + 320 tokens, each with a 2K suffix of its own, 512-token replies."""
    return Branching('4 siblings 20K+320 +2K', 20 * KTOK + 320, 2 * KTOK, 4, 512)


@dataclass(frozen=True)
class Policy:
    """A checkpoint save policy: the engine config fields it turns on."""

    last_only: bool = False           # prefill_save_last_only
    decode_save_last: bool = False    # turn-end checkpoint when a request finishes
    save_junction: bool = False       # one save at a branch point
    # the former turn-end rule, for comparison only (no engine config): the turn-end put replaced
    # the Store put of the last prefill save point, which then served no regenerate or edit
    replacing: bool = False

    @property
    def name(self) -> str:
        extras = (['turn-end-replacing' if self.replacing else 'turn-end'] * self.decode_save_last
                  + ['junction'] * self.save_junction)
        return '+'.join(['last-only' if self.last_only else 'default'] + extras)

    @classmethod
    def parse(cls, name: str) -> 'Policy':
        """``'default'``, ``'last-only'``, optionally followed by ``+turn-end`` (or the former
        rule, ``+turn-end-replacing``) and/or ``+junction``.

        Raises:
            ValueError (``policies``): an unknown name.
        """
        base, *extras = name.strip().split('+')
        turn_end = {'turn-end', 'turn-end-replacing'} & set(extras)
        if base not in ('default', 'last-only') or not set(extras) <= {'turn-end', 'turn-end-replacing', 'junction'} \
                or len(turn_end) > 1:
            raise ValueError(f'policies: unknown policy {name!r} '
                             f'(want default|last-only[+turn-end|+turn-end-replacing][+junction])')
        return cls(base == 'last-only', bool(turn_end), 'junction' in extras, 'turn-end-replacing' in extras)


DEFAULT, LAST_ONLY = Policy(), Policy(last_only=True)
TURN_END, JUNCTION = Policy(True, decode_save_last=True), Policy(True, save_junction=True)


@dataclass(frozen=True)
class TurnResult:
    """Store writes of one turn (request) under one policy. Bytes are per rank.

    ``save_points`` are the prefill save points taken (a junction included), ``turn_end_point``
    the turn-end checkpoint, ``junction`` the save point added at a branch point, ``local_only``
    the save point kept in the local cache only (the former ``+turn-end-replacing`` rule: the turn-end put replaced its Store put).
    """

    num_tokens: int
    cached_tokens: int
    chunk_ends: list[int]
    save_points: list[int]
    new_kv_blocks: int
    state_bytes: int
    kv_bytes: int
    turn_end_point: int | None = None
    junction: int | None = None
    local_only: int | None = None

    @property
    def total_bytes(self) -> int:
        return self.state_bytes + self.kv_bytes

    @property
    def num_saves(self) -> int:
        """State snapshots put to the Store (a save point kept ``local_only`` is not one)."""
        return len(self.save_points) + (self.turn_end_point is not None) - (self.local_only is not None)

    @property
    def recomputed_tokens(self) -> int:
        """Prompt tokens computed by the prefill, ``n - c`` (what drives TTFT)."""
        return self.num_tokens - self.cached_tokens


@dataclass(frozen=True)
class PolicyResult:
    """All turns of a scenario under one policy."""

    turns: list[TurnResult]

    @property
    def total_bytes(self) -> int:
        return sum(t.total_bytes for t in self.turns)

    @property
    def num_saves(self) -> int:
        return sum(t.num_saves for t in self.turns)


@dataclass(frozen=True)
class SimulationResult:
    """Both policies on one scenario; ``reduction`` = 1 - last_only bytes / default bytes (exact)."""

    scenario: Scenario
    default: PolicyResult
    last_only: PolicyResult

    @property
    def reduction(self) -> Fraction:
        if self.default.total_bytes == 0:
            return Fraction(0)
        return 1 - Fraction(self.last_only.total_bytes, self.default.total_bytes)


def _junction(n: int, cached: int, matched: int, block_size: int, alignment: int, token_lookahead: int,
              recompute_blocks: int) -> int | None:
    """The largest reusable boundary ``j`` of an ``n``-token input with ``cached < j <= matched``."""
    for b in range(matched // alignment * alignment, cached, -alignment):
        if is_reusable(b, n, block_size, alignment, token_lookahead, recompute_blocks):
            return b
    return None


def _simulate_policy(requests: Sequence[Request], policy: Policy, state_bytes: int, kv_block_bytes: int,
                     chunk_size: int, block_size: int, alignment: int, token_lookahead: int,
                     recompute_blocks: int) -> PolicyResult:
    B, r = block_size, recompute_blocks
    checkpoints: list[tuple[int, int, bool]] = []   # (request, boundary, is turn-end) of every save so far
    saved: set[tuple[int, int]] = set()             # Store state objects (prefix owner, boundary)
    stored: set[tuple[int, int]] = set()            # Store KV objects (prefix owner, block index)
    computed: list[int] = []                        # tokens each earlier request computed (its blocks stay cached)
    turns = []
    for i, req in enumerate(requests):
        n, common = req.num_tokens, req.common_prefix

        def owner(tokens: int) -> int:
            """The first request whose leading ``tokens`` tokens equal this one's: Store keys
            hash the prefix, so equal prefixes are one object."""
            return next((j for j in range(i) if common[j] >= tokens), i)

        # full blocks cached locally from earlier requests; one prompt token is always computed
        matched_blocks = min((n - 1) // B, max((min(common[j], computed[j]) // B for j in range(i)), default=0))

        def restorable(b: int, turn_end: bool) -> bool:
            # a turn-end boundary is a block boundary; aligned ones keep the rules with A
            return b // B + r <= matched_blocks and is_reusable(b, n, B, B if turn_end else alignment,
                                                                token_lookahead, r)

        cached = max((b for j, b, turn_end in checkpoints if b <= common[j] and restorable(b, turn_end)), default=0)
        plan = plan_prefill(n, cached, chunk_size, B, alignment, policy.last_only, token_lookahead, r)
        chunk_ends, save_points, junction = list(plan.chunk_ends), list(plan.save_points), None
        if policy.save_junction and matched_blocks * B > cached:
            j = _junction(n, cached, matched_blocks * B, B, alignment, token_lookahead, r)
            if j is not None and j not in save_points:
                junction = j        # the chunk containing j is split there: a forward ends at j
                chunk_ends, save_points = sorted(set(chunk_ends) | {j}), sorted(save_points + [j])
        done = n + req.output_tokens - 1        # the last sampled token is never computed
        turn_end = None
        if policy.decode_save_last:
            # as the engine plans it: a prompt forward also ends at floor_B(n) (with_last_block_end)
            chunk_ends = with_last_block_end(PrefillPlan(chunk_ends, save_points, cached, junction), B,
                                             token_lookahead).chunk_ends
            te = done // B * B
            # decode forwards end at every count in [n, done]; prompt forwards at the chunk ends
            if te >= n // B * B and (te >= n or te in chunk_ends) and te > max(save_points + [cached]):
                turn_end = te
        # every save point is put, the turn end too: the turn-end state serves only the exact
        # continuation, the prompt's own one a regenerate or an edited reply. (The former rule,
        # ``replacing``, kept the last prefill save point local only.)
        local_only = None
        if turn_end is not None and policy.replacing:
            local_only = max((b for b in save_points if b != junction), default=None)
        taken, new_blocks, puts = [], 0, 0
        for b in save_points + ([turn_end] if turn_end is not None else []):
            if b == local_only:
                taken.append(b)
                checkpoints.append((i, b, False))
                continue
            if (owner(b), b) in saved:
                continue            # the object exists: the save is skipped
            saved.add((owner(b), b))
            taken.append(b)
            puts += 1
            checkpoints.append((i, b, b == turn_end))
            for k in range(b // B):
                block = (owner((k + 1) * B), k)
                if block not in stored:
                    stored.add(block)
                    new_blocks += 1
        computed.append(done)
        turns.append(TurnResult(n, cached, chunk_ends, [b for b in taken if b != turn_end], new_blocks,
                                puts * state_bytes, new_blocks * kv_block_bytes,
                                turn_end if turn_end in taken else None, junction if junction in taken else None,
                                local_only))
    return PolicyResult(turns)


def _requests(scenario: Scenario | Branching | Sequence[int]) -> tuple[Scenario | Branching, list[Request]]:
    if not isinstance(scenario, (Scenario, Branching)):
        scenario = Scenario('custom', tuple(int(n) for n in scenario))
    return scenario, scenario.requests()


def _check_sizes(state_bytes: int, kv_block_bytes: int) -> None:
    if state_bytes < 0:
        raise ValueError(f'state_bytes must be >= 0, got {state_bytes}')
    if kv_block_bytes < 0:
        raise ValueError(f'kv_block_bytes must be >= 0, got {kv_block_bytes}')


def simulate(scenario: Scenario | Branching | Sequence[int], state_bytes: int, kv_block_bytes: int, *,
             chunk_size: int, block_size: int, alignment: int, token_lookahead: int = 0,
             recompute_blocks: int = 0) -> SimulationResult:
    """Store bytes and save points of every turn of ``scenario`` under the default and last-only policies.

    Args:
        scenario: a :class:`Scenario`, a :class:`Branching`, or the input lengths (tokens) of a
            conversation's turns, non-decreasing.
        state_bytes: S, bytes of one state snapshot (or relative units).
        kv_block_bytes: K_blk, bytes of one KV block over all full-attention layers.
        chunk_size, block_size, alignment, token_lookahead, recompute_blocks: P, B, A, ℓ, r.

    Raises:
        ValueError: a size is negative, turns shrink, or a planning argument is invalid.
    """
    scenario, requests = _requests(scenario)
    _check_sizes(state_bytes, kv_block_bytes)
    args = (state_bytes, kv_block_bytes, chunk_size, block_size, alignment, token_lookahead, recompute_blocks)
    return SimulationResult(scenario, _simulate_policy(requests, DEFAULT, *args),
                            _simulate_policy(requests, LAST_ONLY, *args))


def simulate_policies(scenario: Scenario | Branching | Sequence[int], state_bytes: int, kv_block_bytes: int, *,
                      policies: Sequence[Policy | str], chunk_size: int, block_size: int, alignment: int,
                      token_lookahead: int = 0, recompute_blocks: int = 0) -> dict[str, PolicyResult]:
    """Every turn of ``scenario`` under each of ``policies`` (:class:`Policy` or its name).

    Arguments as :func:`simulate`. Returns ``{policy name: PolicyResult}`` in the given order.

    Raises:
        ValueError: as :func:`simulate`, or an unknown policy name (``policies``).
    """
    scenario, requests = _requests(scenario)
    _check_sizes(state_bytes, kv_block_bytes)
    args = (state_bytes, kv_block_bytes, chunk_size, block_size, alignment, token_lookahead, recompute_blocks)
    chosen = [p if isinstance(p, Policy) else Policy.parse(p) for p in policies]
    return {p.name: _simulate_policy(requests, p, *args) for p in chosen}


@dataclass(frozen=True)
class StoreSizes:
    """Per-rank state and KV block sizes in bytes, and what one Store object of each holds.

    A tensor-parallel engine writes its objects in the full-head layout (every rank's slice
    assembled, docs/en/advance/parallelism.md), so the Store is charged ``store_state_bytes`` /
    ``store_kv_block_bytes``: the sums over ranks of the heads each owns (a KV head replicated
    on several ranks counts once), equal to the ``tp = 1`` sizes.
    """

    state_bytes: int
    kv_block_bytes: int
    tp: int = 1
    store_state_bytes: int | None = None      # None: state_bytes * tp
    store_kv_block_bytes: int | None = None   # None: kv_block_bytes * tp

    @property
    def charged(self) -> tuple[int, int]:
        """``(S, K_blk)`` the Store is charged per object."""
        return (self.state_bytes * self.tp if self.store_state_bytes is None else self.store_state_bytes,
                self.kv_block_bytes * self.tp if self.store_kv_block_bytes is None else self.store_kv_block_bytes)


def _dtype_bytes(name: str, field: str) -> int:
    key = str(name).removeprefix('torch.')
    if key not in DTYPE_BYTES:
        raise ValueError(f'{field}: unknown dtype {name!r}')
    return DTYPE_BYTES[key]


def _engine_config(config: dict):
    """The ``transformers`` config object of a ``config.json`` dict (its ``model_type``), as the
    engine loads it: a field the dict leaves out takes transformers' default."""
    from transformers import AutoConfig
    fields = dict(config)
    model_type = fields.pop('model_type', None)
    if model_type is None:
        raise ValueError("config is missing field 'model_type'")
    try:
        return AutoConfig.for_model(model_type, **fields)
    except ValueError as err:
        raise ValueError(f'config: model_type {model_type!r}: {err}') from None


def _with_dtypes(specs: list, model_dtype, kv_dtype, state_dtype) -> list:
    """``specs`` with every paged tensor stored in ``kv_dtype`` and every state tensor kept in
    the model dtype stored in ``state_dtype`` (float32 recurrent states stay float32)."""
    from dataclasses import replace

    from lmdeploy.pytorch.cache_specs import PagedSpec, StateSpec
    out = []
    for spec in specs:
        if spec.paged:
            out.append(PagedSpec(tuple(replace(t, dtype=kv_dtype) for t in spec.tensors())))
        else:
            out.append(StateSpec(tuple(replace(t, dtype=state_dtype) if t.dtype == model_dtype else t
                                       for t in spec.tensors())))
    return out


def sizes_from_config(config: dict, *, tp: int = 1, block_size: int = DEFAULT_BLOCK, kv_dtype: str | None = None,
                      state_dtype: str | None = None, mtp: bool = False) -> StoreSizes:
    """Per-rank state snapshot bytes S and KV block bytes K_blk of a hybrid HF config, from the
    engine model's own cache specs (the model registry's ``cache_specs`` of this rank's local
    config, :class:`~lmdeploy.pytorch.distributed.sharding.TPLayout`): the same specs and row
    layout the engine's cache and Store payloads use, so no layer geometry is re-derived here.

    With ``mtp`` (the engine runs ``qwen3_next_mtp`` speculative decoding) K_blk also holds the
    K/V rows of the ``num_nextn_predict_layers`` MTP layers (default 1); S is unchanged. Paged
    tensors use ``kv_dtype`` and state tensors ``state_dtype`` (default: the model dtype, else
    bfloat16); a float32 recurrent state stays float32.

    Raises:
        ValueError: no or an unknown ``model_type``, ``tp`` does not divide a head count (names
            the field), or a dtype is unknown.
    """
    if tp < 1:
        raise ValueError(f'tp must be >= 1, got {tp}')
    import torch

    from lmdeploy.pytorch.distributed.sharding import TPLayout
    from lmdeploy.pytorch.models import get_model_class
    from lmdeploy.pytorch.spec_decode.mtp import mtp_cache_spec
    cfg = _engine_config(config)
    text = cfg.get_text_config()
    name = str(getattr(text, 'dtype', None) or config.get('dtype') or config.get('torch_dtype') or 'bfloat16')
    model_t = getattr(torch, _TORCH_DTYPE[_dtype_bytes(name, 'dtype')])
    state_t = getattr(torch, _TORCH_DTYPE[_dtype_bytes(state_dtype or name, 'state_dtype')])
    kv_t = getattr(torch, _TORCH_DTYPE[_dtype_bytes(kv_dtype or name, 'kv_dtype')])
    cls = get_model_class(cfg.model_type)

    def specs(local) -> list:
        out = list(cls.cache_specs(local, model_t))
        if mtp:
            out += [mtp_cache_spec(local.get_text_config(), model_t)] * int(
                getattr(text, 'num_nextn_predict_layers', None) or 1)
        return _with_dtypes(out, model_t, kv_t, state_t)
    try:
        rank = specs(TPLayout(cfg, 0, tp).local_config() if tp > 1 else cfg)
    except ValueError as err:
        raise ValueError(f'tp={tp}: {err}') from None
    whole = specs(cfg)
    charged = (state_bytes_per_slot(whole), kv_bytes_per_block(whole, block_size)) if tp > 1 else (None, None)
    return StoreSizes(state_bytes_per_slot(rank), kv_bytes_per_block(rank, block_size), tp, *charged)


def truncate_percent(x: Fraction) -> str:
    """``x`` as a percentage truncated toward zero to two decimals, e.g. ``'63.64%'``."""
    hundredths = math.floor(abs(x) * 10000)
    sign = '-' if x < 0 else ''
    return f'{sign}{hundredths // 100}.{hundredths % 100:02d}%'


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--preset', choices=['seed-table', 'tiny', 'qwen3-next-80b', 'kimi-linear-48b',
                                        'nemotron-3-nano-30b', 'granite-4.0-h-small', 'glm-5.3-flash',
                                        'branching'],
                   help='sizes (branching: the seed sizes, the branching scenario and the junction policy; '
                   'glm-5.3-flash: the seed deployment, TP8, FP8 KV, MTP on, unless --tp/--kv-dtype/--no-mtp)')
    p.add_argument('--config', type=Path, help='HF config.json of a hybrid model')
    p.add_argument('--state-bytes', type=int)
    p.add_argument('--kv-block-bytes', type=int)
    p.add_argument('--state-to-block-ratio', type=Fraction, help='S / K_blk; sizes in relative units')
    p.add_argument('--tp', type=int, help='tensor-parallel ranks (default 1; glm-5.3-flash: 8)')
    p.add_argument('--kv-dtype')
    p.add_argument('--state-dtype')
    p.add_argument('--chunk-size', type=int, help='P (default 8192 * scale)')
    p.add_argument('--block-size', type=int, help='B (default 64 * scale)')
    p.add_argument('--alignment', type=int, help='A (default 1024 * scale)')
    p.add_argument('--token-lookahead', type=int, default=0)
    p.add_argument('--recompute-blocks', type=int, default=0)
    p.add_argument('--mtp', action=argparse.BooleanOptionalAction,
                   help='the engine runs qwen3_next_mtp speculative decoding: K_blk '
                   'includes the MTP layer\'s KV (--config/--preset sizes; on by default for glm-5.3-flash); pair '
                   'with --token-lookahead 1')
    p.add_argument('--scale', type=Fraction, default=Fraction(1), help='multiply scenario token counts, e.g. 1/16')
    p.add_argument('--turns', help='custom scenario: comma-separated input lengths of each turn')
    p.add_argument('--scenario', choices=['seed', 'branching'], help='seed: the six seed scenarios (default)')
    p.add_argument('--shared-tokens', type=int, help='branching: tokens all siblings share (default 20K+320)')
    p.add_argument('--suffix-tokens', type=int, help='branching: tokens of each sibling\'s own suffix (default 2K)')
    p.add_argument('--siblings', type=int, help='branching: number of siblings (default 4)')
    p.add_argument('--policies', help='comma-separated, e.g. default,last-only,last-only+turn-end,last-only+junction; '
                   'prints a per-turn table per scenario')
    p.add_argument('--decode-save-last', action='store_true', help='add the policy last-only+turn-end')
    p.add_argument('--save-junction', action='store_true', help='add the policy last-only+junction')
    p.add_argument('--json', action='store_true', help='print per-turn results as JSON')
    p.add_argument('--follow-ups', action='store_true', help='also print, for one turn (the first of --turns, '
                   'default 16K+64 * scale), its Store bytes and what a fresh engine restores for a continue, '
                   'a regenerate and an edit of it under last-only, +turn-end-replacing and +turn-end')
    p.add_argument('--reply', type=int, help='--follow-ups: reply tokens of the turn (default 512 * scale)')
    return p.parse_args(argv)


def _scaled_default(value: int | None, default: int, scale: Fraction, name: str) -> int:
    if value is not None:
        return value
    scaled = default * scale
    if scaled.denominator != 1 or scaled < 1:
        raise ValueError(f'{name}: {default} * scale {scale} is not an integer; pass --{name} explicitly')
    return int(scaled)


def _resolve_sizes(args: argparse.Namespace, block_size: int) -> tuple[StoreSizes, str]:
    sources = [args.preset is not None, args.config is not None, args.state_to_block_ratio is not None,
               args.state_bytes is not None or args.kv_block_bytes is not None]
    if sum(sources) != 1:
        raise ValueError('sizes: give exactly one of --preset, --config, --state-to-block-ratio, '
                         '--state-bytes/--kv-block-bytes')
    ratio = args.state_to_block_ratio
    if args.preset in ('seed-table', 'branching'):
        ratio = SEED_STATE_TO_BLOCK_RATIO
    if ratio is not None:
        return StoreSizes(ratio.numerator, ratio.denominator), 'units'
    if args.state_bytes is not None or args.kv_block_bytes is not None:
        if args.state_bytes is None or args.kv_block_bytes is None:
            raise ValueError('state_bytes: --state-bytes and --kv-block-bytes go together')
        return StoreSizes(args.state_bytes, args.kv_block_bytes), 'bytes'
    if args.preset == 'tiny':
        config = TINY_CONFIG
    elif args.preset == 'qwen3-next-80b':
        config = QWEN3_NEXT_80B_CONFIG
    elif args.preset == 'kimi-linear-48b':
        config = KIMI_LINEAR_48B_CONFIG
    elif args.preset == 'glm-5.3-flash':
        return _glm_5_3_flash_sizes(args, block_size), 'bytes'
    elif args.preset == 'nemotron-3-nano-30b':
        config = NEMOTRON_3_NANO_30B_CONFIG
    elif args.preset == 'granite-4.0-h-small':
        config = GRANITE_4_0_H_SMALL_CONFIG
    else:
        config = json.loads(args.config.read_text())
    return sizes_from_config(config, tp=args.tp or 1, block_size=block_size, kv_dtype=args.kv_dtype,
                             state_dtype=args.state_dtype, mtp=bool(args.mtp)), 'bytes'


def _glm_5_3_flash_sizes(args: argparse.Namespace, block_size: int) -> StoreSizes:
    """The GLM-5.3-Flash preset (benchmark/glm5_next_sizes.py): the seed deployment's TP, KV
    dtype and MTP unless given."""
    import torch

    from benchmark.glm5_next_sizes import GLM_5_3_FLASH_CONFIG, GLM_5_3_FLASH_DEPLOYMENT, glm5_next_sizes
    deploy = GLM_5_3_FLASH_DEPLOYMENT
    tp = args.tp or deploy['tp']
    kv = getattr(torch, _TORCH_DTYPE[_dtype_bytes(args.kv_dtype or deploy['kv_dtype'], 'kv_dtype')])
    state = getattr(torch, _TORCH_DTYPE[_dtype_bytes(args.state_dtype or 'bfloat16', 'state_dtype')])
    mtp = deploy['mtp'] if args.mtp is None else args.mtp
    s, k, s_all, k_all = glm5_next_sizes(GLM_5_3_FLASH_CONFIG, tp=tp, block_size=block_size, kv_dtype=kv,
                                         state_dtype=state, mtp=mtp)
    return StoreSizes(s, k, tp, s_all, k_all)


def _policies(args: argparse.Namespace) -> list[Policy]:
    names = args.policies.split(',') if args.policies else ['default', 'last-only']
    if args.preset == 'branching' and not args.policies:
        names.append(JUNCTION.name)
    names += [TURN_END.name] * args.decode_save_last + [JUNCTION.name] * args.save_junction
    policies = []
    for name in names:
        policy = Policy.parse(name)
        if policy not in policies:
            policies.append(policy)
    return policies


def _scenarios(args: argparse.Namespace) -> list[Scenario | Branching]:
    if args.turns:
        return [Scenario('custom', tuple(int(x) for x in args.turns.split(',')))]
    if args.scenario == 'branching' or (args.preset == 'branching' and args.scenario is None):
        base = branching_scenario().scaled(args.scale)
        custom = dict(shared_tokens=args.shared_tokens, suffix_tokens=args.suffix_tokens, siblings=args.siblings)
        custom = {k: v for k, v in custom.items() if v is not None}
        if custom:
            base = replace(base, **custom)
            base = replace(base, name=f'{base.siblings} siblings {base.shared_tokens}+{base.suffix_tokens}')
        return [base]
    return [s.scaled(args.scale) for s in seed_scenarios()]


def extra_recomputed(scenario: Scenario, result: PolicyResult) -> list[int]:
    """Turns 2.. of an append-only conversation: tokens recomputed beyond the turn's new user
    tokens ``n_t - n_{t-1} - output_tokens`` (the earlier input and reply are not new)."""
    lengths = scenario.input_lengths
    return [t.recomputed_tokens - (n - m - scenario.output_tokens)
            for t, m, n in zip(result.turns[1:], lengths, lengths[1:])]


def _print_turns(scenario: Scenario | Branching, results: dict[str, PolicyResult], unit: str, block: int) -> None:
    names = list(results)
    label = 'sibling' if isinstance(scenario, Branching) else 'turn'
    print(f'\n{scenario.name} ({unit}); per {label}: cached tokens c, recomputed n - c, saves, Store {unit}')
    print((f'{label:>7} {"n":>7} | ' + ' | '.join(f'{name:^33}' for name in names)).rstrip())
    print(f'{"":>7} {"":>7} | ' + ' | '.join(f'{"c":>7} {"n-c":>6} {"saves":>5} {unit:>12}' for _ in names))
    for i, n in enumerate(scenario.input_lengths):
        cells = [results[name].turns[i] for name in names]
        print(f'{i + 1:>7} {n:>7} | ' + ' | '.join(
            f'{t.cached_tokens:>7} {t.recomputed_tokens:>6} {t.num_saves:>5} {t.total_bytes:>12}' for t in cells))
    print(f'{"total":>7} {sum(scenario.input_lengths):>7} | ' + ' | '.join(
        f'{"":>7} {sum(t.recomputed_tokens for t in r.turns):>6} {r.num_saves:>5} {r.total_bytes:>12}'
        for r in results.values()))
    default = results.get(DEFAULT.name)
    for name, r in results.items():
        policy = Policy.parse(name)
        vs = (f'{r.total_bytes} vs default {default.total_bytes} {unit} '
              f'({"fewer" if r.total_bytes < default.total_bytes else "not fewer"})') if default else ''
        if policy.decode_save_last and isinstance(scenario, Scenario) and len(r.turns) > 1:
            extra = extra_recomputed(scenario, r)
            print(f'check {name}: later turns recompute new tokens + {extra} (B = {block}: '
                  f'{"at most one block" if max(extra) <= block else "more than one block"}); bytes {vs}')
        if policy.save_junction and isinstance(scenario, Branching) and default:
            base = results.get(Policy(policy.last_only, policy.decode_save_last).name)
            hits, dhits = [t.cached_tokens for t in r.turns[1:]], [t.cached_tokens for t in default.turns[1:]]
            extra = [a.num_saves - b.num_saves for a, b in zip(r.turns, base.turns)] if base else []
            print(f'check {name}: sibling hits {hits} vs default {dhits} '
                  f'({"all >= default" if all(a >= b for a, b in zip(hits, dhits)) else "some below default"}); '
                  f'extra saves per sibling {extra}; bytes {vs}')


def main(argv: Sequence[str] | None = None) -> list[SimulationResult]:
    """CLI entry: print the per-scenario table (or JSON) and return the results.

    With policies beyond default and last-only, or the branching scenario, also prints per
    turn (sibling) the cached and recomputed tokens, saves and Store bytes of each policy, and
    checks the turn-end and junction goals (see :func:`extra_recomputed`).
    """
    args = _parse_args(argv)
    chunk = _scaled_default(args.chunk_size, DEFAULT_CHUNK, args.scale, 'chunk-size')
    block = _scaled_default(args.block_size, DEFAULT_BLOCK, args.scale, 'block-size')
    align = _scaled_default(args.alignment, DEFAULT_ALIGNMENT, args.scale, 'alignment')
    sizes, unit = _resolve_sizes(args, block)
    scenarios = _scenarios(args)
    geometry = dict(chunk_size=chunk, block_size=block, alignment=align, token_lookahead=args.token_lookahead,
                    recompute_blocks=args.recompute_blocks)
    results = [simulate(s, *sizes.charged, **geometry) for s in scenarios]
    policies = _policies(args)
    detailed = policies != [DEFAULT, LAST_ONLY] or isinstance(scenarios[0], Branching)
    per_policy = [simulate_policies(s, *sizes.charged, policies=policies, **geometry)
                  for s in scenarios] if detailed else []
    if args.json:
        out = []
        for i, r in enumerate(results):
            row = dict(scenario=asdict(r.scenario), default=asdict(r.default), last_only=asdict(r.last_only),
                       reduction=float(r.reduction))
            if detailed:
                row['policies'] = {name: asdict(p) for name, p in per_policy[i].items()}
            out.append(row)
        print(json.dumps(out, indent=1))
        return results
    print(f'S = {sizes.state_bytes} {unit}, K_blk = {sizes.kv_block_bytes} {unit} per rank (tp={sizes.tp}; '
          f'charged over ranks: S = {sizes.charged[0]}, K_blk = {sizes.charged[1]}); '
          f'S/K_blk = {float(Fraction(sizes.state_bytes, max(1, sizes.kv_block_bytes))):g}; '
          f'P={chunk} B={block} A={align} lookahead={args.token_lookahead} recompute={args.recompute_blocks}')
    print(f'{"scenario":<30} {"saves":>5} {"saves":>5} {"default " + unit:>18} {"last-only " + unit:>18} '
          f'{"reduction":>9}')
    print(f'{"":<30} {"def":>5} {"last":>5}')
    for r in results:
        print(f'{r.scenario.name:<30} {r.default.num_saves:>5} {r.last_only.num_saves:>5} '
              f'{r.default.total_bytes:>18} {r.last_only.total_bytes:>18} {truncate_percent(r.reduction):>9}')
    print('reduction = 1 - last-only / default over the whole scenario (truncated to 0.01%, not rounded)')
    for s, res in zip(scenarios, per_policy):
        if isinstance(s, Branching) or len(s.input_lengths) > 1 or args.turns:
            _print_turns(s, res, unit, block)
    if args.follow_ups:
        from benchmark.store_follow_ups import follow_ups, print_follow_ups
        n = int(args.turns.split(',')[0]) if args.turns else _scaled_default(None, 16 * KTOK + 64, args.scale, 'turns')
        reply = args.reply or _scaled_default(None, 512, args.scale, 'reply')
        print(f'\none turn of {n} tokens and a {reply}-token reply; Store hits of a fresh engine (tokens):')
        print_follow_ups(follow_ups(n, reply, *sizes.charged, **geometry), unit)
    return results

if __name__ == '__main__':
    try:
        main()
    except ValueError as err:
        sys.exit(f'error: {err}')
