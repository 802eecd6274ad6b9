"""Keep a constrained reply's bytes well-formed UTF-8, which the grammar library alone does not.

xgrammar 0.2.9 decodes the bytes of byte-level tokens leniently: it takes the three-byte forms
of the UTF-16 surrogates (``ED A0..BF xx``) and overlong forms (``F0 8B B1 90`` for U+BC50,
``E0 80..9F xx``) as one character each. A model may then write them under the grammar's mask;
the detokenizer turns each such byte into U+FFFD, so a string the grammar bounded to
``maxLength`` characters comes out longer, and the text is not what the grammar admitted.

:class:`Utf8Guard` masks, on top of the grammar's mask, every token whose bytes would make the
reply ill-formed UTF-8 (RFC 3629, section 4: the well-formed byte sequences), given where the
reply's last character stands::

    state   a pending character: (continuation bytes still needed, range of the next one),
            or CLEAN between characters
    CLEAN   --C2..DF-->  (1, 80..BF)     --E0-->  (2, A0..BF)   --ED-->  (2, 80..9F)
            --E1..EC, EE..EF--> (2, 80..BF)        --F0-->  (3, 90..BF)
            --F1..F3--> (3, 80..BF)      --F4-->  (3, 80..8F)   (any other lead byte: refused)
    (n, lo..hi) --a byte in lo..hi--> (n - 1, 80..BF), CLEAN when n - 1 == 0

Per state it keeps which tokens may follow (computed once per tokenizer): between characters
the few tokens that are ill-formed on their own are masked (an index fill); inside a character
only the tokens that continue it are kept. If the grammar allows none of those (its lenient
decoding led somewhere only an ill-formed byte continues), the grammar's mask is left as it is,
so a guided reply never has every token masked.

Cost per guided step (CPU, one thread, a 152K vocabulary with 22K ill-formed tokens, more than a
real byte-level vocabulary has): about 0.1 ms; building the masks once: about 0.1 s.
"""
from __future__ import annotations

import torch

__all__ = ['Utf8Guard', 'CLEAN']

#: between characters: no continuation byte pending
CLEAN = (0, 0x80, 0xBF)


def _lead(byte: int):
    """The state after lead byte ``byte`` from :data:`CLEAN`, or None for a byte no
    well-formed character starts with."""
    if byte < 0x80:
        return CLEAN
    if 0xC2 <= byte <= 0xDF:
        return (1, 0x80, 0xBF)
    if byte == 0xE0:
        return (2, 0xA0, 0xBF)      # lower: overlong
    if byte == 0xED:
        return (2, 0x80, 0x9F)      # higher: a surrogate
    if 0xE1 <= byte <= 0xEF:
        return (2, 0x80, 0xBF)
    if byte == 0xF0:
        return (3, 0x90, 0xBF)      # lower: overlong
    if 0xF1 <= byte <= 0xF3:
        return (3, 0x80, 0xBF)
    if byte == 0xF4:
        return (3, 0x80, 0x8F)      # higher: past U+10FFFF
    return None


def step(state, data: bytes):
    """The state after ``data`` from ``state``, or None when ``data`` makes the bytes ill-formed."""
    for byte in data:
        need, lo, hi = state
        if need:
            if not lo <= byte <= hi:
                return None
            state = (need - 1, 0x80, 0xBF) if need > 1 else CLEAN
        else:
            state = _lead(byte)
            if state is None:
                return None
    return state


class Utf8Guard:
    """The per-state token masks of one vocabulary (module docstring).

    Args:
        token_bytes: each token's bytes (xgrammar's ``TokenizerInfo.decoded_vocab``).
        vocab_size: rows of the logits (tokens past ``token_bytes`` are left to the grammar).
    """

    def __init__(self, token_bytes: list[bytes], vocab_size: int):
        self._bytes = token_bytes
        ill_formed, keep = [], {}
        for token, data in enumerate(token_bytes[:vocab_size]):
            if data and max(data) >= 0x80 and step(CLEAN, data) is None:
                ill_formed.append(token)
            if data and 0x80 <= data[0] <= 0xBF:          # only these can continue a character
                for state in _PENDING:
                    if step(state, data) is not None:
                        keep.setdefault(state, []).append(token)
        #: int64 token ids ill-formed between characters
        self.ill_formed = torch.tensor(ill_formed, dtype=torch.int64)
        #: per pending state, int64 token ids that continue its character
        self.keep = {s: torch.tensor(keep.get(s, []), dtype=torch.int64) for s in _PENDING}

    def after(self, state, token: int):
        """The state after ``token`` (CLEAN again after a token the guard did not allow, as a
        fallback never lets the masks drift)."""
        data = self._bytes[token] if token < len(self._bytes) else b''
        return step(state, data) or CLEAN

    def restrict_(self, logits: torch.Tensor, state) -> torch.Tensor:
        """Also mask, in place, the tokens of the ``[vocab]`` float32 CPU ``logits`` (already
        masked by the grammar) that would make the bytes ill-formed after ``state``, unless
        that leaves no token; returns ``logits``."""
        if state == CLEAN:
            idx = self.ill_formed.to(logits.device)
            saved = logits.index_select(0, idx)
            logits.index_fill_(0, idx, float('-inf'))
            if logits.numel() and float(logits.max()) == float('-inf'):     # (max: a tenth of isfinite's cost)
                logits.index_copy_(0, idx, saved)
            return logits
        idx = self.keep[state].to(logits.device)
        kept = logits.index_select(0, idx)
        if kept.numel() and float(kept.max()) > float('-inf'):
            logits.fill_(float('-inf'))
            logits.index_copy_(0, idx, kept)
        return logits


# the states inside a character (every state but CLEAN that step() can reach)
_PENDING = ((1, 0x80, 0xBF), (2, 0xA0, 0xBF), (2, 0x80, 0x9F), (2, 0x80, 0xBF), (3, 0x90, 0xBF), (3, 0x80, 0xBF),
            (3, 0x80, 0x8F))
