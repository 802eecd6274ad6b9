"""What one turn's Store objects serve a *fresh* engine (empty local cache) for the requests
that follow it, under each save policy: the bytes the turn put, side by side with the prompt
tokens the Store restores for each follow-up workload (docs/en/advance/prefix_caching.md,
"Turn-end checkpoints and shareability")::

    turn        |====== prompt n ======|---- reply ----|
    continue    |====== prompt n ======|---- reply ----|== new ==|    shares n + reply
    regenerate  |====== prompt n ======|                              shares n
    edit        |====== prompt n ======|-- kept --|== edited ==|      shares n + edit_at

The turn-end state (``decode_save_last``) sits inside the reply: it serves only the exact
continuation. The prompt's own save point serves the other two; the former rule
(``+turn-end-replacing``), which put the turn end *instead of* that save point, left them
nothing to restore. This table is what chose the current rule (both are put).

Usage: ``python benchmark/simulate_store_writes.py --follow-ups`` (or ``--follow-ups
--turns 16448 --reply 512``; sizes and geometry as for the rest of the simulator).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmark.store_sim import Policy, Request, simulate_policy  # noqa: E402
from lmdeploy.pytorch.paging.prefill_plan import is_reusable  # noqa: E402

WORKLOADS = ('continue', 'regenerate', 'edit')
COMPARED = ('last-only', 'last-only+turn-end-replacing', 'last-only+turn-end')


@dataclass(frozen=True)
class FollowUps:
    """One policy: the turn's Store bytes and boundaries, and each workload's Store hit (tokens)."""

    policy: str
    total_bytes: int
    stored_states: tuple[int, ...]
    hits: dict[str, int]


def follow_up_inputs(n: int, reply: int, new_tokens: int, edit_at: int) -> dict[str, tuple[int, int]]:
    """``{workload: (input tokens, tokens shared with the turn)}`` for a turn of ``n`` prompt
    tokens and a ``reply``-token reply (see the module docstring).

    Raises:
        ValueError: ``edit_at`` outside ``[0, reply)`` or ``new_tokens`` < 1.
    """
    if not 0 <= edit_at < reply or new_tokens < 1:
        raise ValueError(f'follow-ups need 0 <= edit_at < reply and new_tokens >= 1, got edit_at={edit_at}, '
                         f'reply={reply}, new_tokens={new_tokens}')
    return {'continue': (n + reply + new_tokens, n + reply), 'regenerate': (n, n),
            'edit': (n + reply + new_tokens, n + edit_at)}


def follow_ups(n: int, reply: int, state_bytes: int, kv_block_bytes: int, *, chunk_size: int, block_size: int,
               alignment: int, new_tokens: int = 256, edit_at: int | None = None,
               policies: Sequence[str] = COMPARED, token_lookahead: int = 0,
               recompute_blocks: int = 0) -> list[FollowUps]:
    """Store bytes of one turn and the Store hit of each follow-up workload in a fresh engine,
    per policy.

    A boundary b restores a follow-up of m input tokens sharing s tokens when the turn put its
    state (the Store holds the KV blocks below every stored state), ``b + r·B <= s`` and b is
    reusable for m (the restore alignment is B with ``decode_save_last``, else A).

    Args:
        n, reply: the turn's prompt and reply tokens.
        edit_at: reply tokens an edit keeps (default: half the reply).
        Others as :func:`benchmark.simulate_store_writes.simulate`.
    """
    edit_at = reply // 2 if edit_at is None else edit_at
    inputs = follow_up_inputs(n, reply, new_tokens, edit_at)
    B, r = block_size, recompute_blocks
    out = []
    for name in policies:
        policy = Policy.parse(name)
        (turn, ) = simulate_policy([Request(n, reply)], policy, state_bytes, kv_block_bytes, chunk_size, B,
                                    alignment, token_lookahead, r).turns
        states = tuple(sorted(b for b in turn.save_points + [turn.turn_end_point]
                              if b is not None and b != turn.local_only))
        align = B if policy.decode_save_last else alignment
        hits = {w: max((b for b in states if b + r * B <= shared and is_reusable(b, m, B, align, token_lookahead, r)),
                       default=0) for w, (m, shared) in inputs.items()}
        out.append(FollowUps(policy.name, turn.total_bytes, states, hits))
    return out


def print_follow_ups(rows: list[FollowUps], unit: str = 'bytes') -> None:
    """The side-by-side table: one row per policy."""
    print(f'{"policy":32} {"Store " + unit:>14} {"states at":>18} ' + ' '.join(f'{w + " hit":>14}' for w in WORKLOADS))
    for row in rows:
        print(f'{row.policy:32} {row.total_bytes:>14} {",".join(map(str, row.stored_states)):>18} '
              + ' '.join(f'{row.hits[w]:>14}' for w in WORKLOADS))
