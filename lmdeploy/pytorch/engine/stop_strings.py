"""Incremental detokenization with stop strings, shared by the engine and the pipeline.

The engine feeds each sampled token of a request with stop strings to its
:class:`Detokenizer` in the step that sampled it, so a reply ends on the token that completes
a stop string: no forward runs past the match (the token itself is sampled, never computed).
The pipeline runs its own instance over the same ids to produce the text deltas; both find the
same cut because the search does not depend on how the ids are chunked::

    output ids     t0   t1    t2     t3   t4
    text           "Th" "e e" "nd." "\\n"  ...
    stop "end"          ^^^^^^^^^ completed by t2: the sequence finishes after t2
    cut                  |  text[:cut] = "The "
    kept_tokens    1 token (t0) lies wholly before the cut: the prefix a next turn, which
                   re-sends the visible reply, shares with this one (its turn-end checkpoint
                   goes at or below it)
"""
from __future__ import annotations

import bisect

__all__ = ['Detokenizer']


class Detokenizer:
    """Turns a growing list of output ids into text deltas, holding back text that may be the
    start of a stop string or an incomplete UTF-8 character.

    Incremental: each call decodes only the tokens since the last stable point plus the tokens
    of the previous delta as context (so a token whose text depends on its neighbours decodes
    as in the full string), and searches for stop strings only in the new tail — O(delta)
    per call instead of re-decoding the whole output.

    Args:
        tokenizer: a Hugging Face tokenizer (``decode(ids, skip_special_tokens=True)``).
        stop_words: stop strings (empty ones are ignored).

    Attributes:
        stopped: a stop string was found; ``text`` then ends before it.
        text: the decoded text so far (cut before the stop string once ``stopped``).
    """

    def __init__(self, tokenizer, stop_words: list[str]):
        self.tokenizer = tokenizer
        self.stop_words = [w for w in stop_words if w]
        self.hold = max((len(w) for w in self.stop_words), default=1) - 1
        self.ids: list[int] = []
        self.text = ''              # decoded text of ids[:read_offset]
        self.prefix_offset = 0      # ids[prefix_offset:read_offset]: context re-decoded each call
        self.read_offset = 0
        self.emitted = 0            # characters of self.text already returned
        self.stopped = False
        # stable points: after _mark_ids[k] ids the text had _mark_chars[k] characters
        self._mark_ids, self._mark_chars = [0], [0]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, ids: list[int], final: bool) -> str:
        """Append ids; return the new text that is safe to emit (``final``: the output ended,
        emit everything, an incomplete character included)."""
        self.ids.extend(ids)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) > len(prefix) and (final or not full.endswith('\ufffd')):
            before = len(self.text)
            self.text += full[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            self._mark_ids.append(len(self.ids))
            self._mark_chars.append(len(self.text))
            cut = self._find(self.text, before)
            if cut is not None:
                self.text, final, self.stopped = self.text[:cut], True, True
        elif self.stop_words and not final and len(full) > len(prefix):
            # the newest token ends inside a character: the text before that character may
            # already complete a stop string, and the engine must not compute another token
            cut = self._find(self.text + full[len(prefix):].rstrip('\ufffd'), len(self.text))
            if cut is not None:
                self.text, final, self.stopped = (self.text + full[len(prefix):])[:cut], True, True
        end = len(self.text)
        if not final:
            end = max(self.emitted, end - self.hold)
        delta = self.text[self.emitted:end]
        self.emitted = end
        return delta

    def _find(self, text: str, before: int) -> int | None:
        """Where ``text`` is cut, searching only past ``before - hold`` (``text[:before]`` was
        searched already), or None: the stop string completed first ends the text (as if
        generated one character at a time; ties: the longer one, which starts first), whatever
        the list order or the token boundaries."""
        start = max(0, before - self.hold)
        hits = [(pos + len(word), pos) for word in self.stop_words if (pos := text.find(word, start)) != -1]
        return min(hits)[1] if hits else None

    def feed(self, token: int) -> bool:
        """Append one sampled token (the engine's call); True once a stop string is complete
        (then and later: the caller finishes the sequence)."""
        if not self.stopped:
            self.add([token], final=False)
        return self.stopped

    @property
    def kept_tokens(self) -> int:
        """Leading ids whose whole text lies before the cut (all ids while not ``stopped``):
        the ids a reply re-sent as its visible text shares with this output."""
        if not self.stopped:
            return len(self.ids)
        k = bisect.bisect_right(self._mark_chars, len(self.text)) - 1
        return self._mark_ids[k]
