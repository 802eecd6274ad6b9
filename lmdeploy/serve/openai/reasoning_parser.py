"""Reasoning parsers: split a thinking model's reply into ``reasoning_content`` and ``content``.

Format ``think`` (Qwen3, DeepSeek-R1 and other templates with ``<think>`` blocks)::

    <think>
    reasoning ...
    </think>

    answer ...

The reply is reasoning up to ``</think>`` when it starts with ``<think>`` (after optional
whitespace) or when the prompt already ended inside an open ``<think>`` (``started=True``, as
templates that write ``<think>\\n`` into the generation prompt do). A reply cut off before
``</think>`` is all reasoning; a reply that does not start thinking is all content. The
whitespace right after ``</think>`` is dropped; reasoning is stripped of the newlines around it.

Invariant: :class:`ReasoningStream` fed any cutting of a text into deltas emits deltas that
concatenate to exactly what :meth:`ThinkReasoningParser.parse` returns for the whole text.
"""
from __future__ import annotations

__all__ = ['ThinkReasoningParser', 'ReasoningStream', 'ThinkGuard', 'REASONING_PARSERS', 'get_reasoning_parser']


class ThinkReasoningParser:
    """``<think> ... </think>`` reasoning blocks."""
    name = 'think'
    start_tag = '<think>'
    end_tag = '</think>'

    def parse(self, text: str, started: bool = False) -> tuple[str | None, str | None]:
        """``(reasoning_content, content)`` of a whole reply; each None when empty.

        Args:
            text: the generated text.
            started: the prompt ended inside an open ``<think>`` block.
        """
        stream = ReasoningStream(self, started)
        r1, c1 = stream.feed(text)
        r2, c2 = stream.finish()
        return (r1 + r2) or None, (c1 + c2) or None

    def stream(self, started: bool = False) -> ReasoningStream:
        """A new incremental parser for one reply."""
        return ReasoningStream(self, started)


REASONING_PARSERS = {'think': ThinkReasoningParser}


def get_reasoning_parser(name: str) -> ThinkReasoningParser:
    """A reasoning parser by registry name.

    Raises:
        ValueError: unknown name (the message lists the known ones).
    """
    if name not in REASONING_PARSERS:
        raise ValueError(f'unknown reasoning parser {name!r}; known: {sorted(REASONING_PARSERS)}')
    return REASONING_PARSERS[name]()


class ReasoningStream:
    """Incremental ``<think>`` splitter: :meth:`feed` returns ``(reasoning delta, content delta)``.

    States: ``start`` (not yet known whether the reply thinks: leading whitespace and a
    partial ``<think>`` are held), ``reasoning`` (a partial ``</think>`` and trailing newlines
    are held), ``after`` (whitespace right after ``</think>`` is skipped), ``content``.
    """

    def __init__(self, parser: ThinkReasoningParser, started: bool = False):
        self.p = parser
        self.state = 'reasoning_open' if started else 'start'
        self.buf = ''

    def feed(self, delta: str) -> tuple[str, str]:
        """Next text delta in; ``(reasoning delta, content delta)`` out."""
        self.buf += delta
        reasoning = content = ''
        while True:
            if self.state == 'start':
                lead = self.buf.lstrip()
                if lead.startswith(self.p.start_tag):
                    self.buf = lead[len(self.p.start_tag):]
                    self.state = 'reasoning_open'
                    continue
                if self.p.start_tag.startswith(lead):      # undecided (also: only whitespace so far)
                    return reasoning, content
                self.state = 'content'
                continue
            if self.state == 'reasoning_open':             # newlines right after <think>
                lead = self.buf.lstrip('\n')
                if not lead:
                    self.buf = ''
                    return reasoning, content
                self.buf, self.state = lead, 'reasoning'
                continue
            if self.state == 'reasoning':
                end = self.buf.find(self.p.end_tag)
                if end != -1:
                    reasoning += self.buf[:end].rstrip('\n')
                    self.buf = self.buf[end + len(self.p.end_tag):]
                    self.state = 'after'
                    continue
                keep = _hold(self.buf, self.p.end_tag)
                out = self.buf[:len(self.buf) - keep]
                reasoning += out
                self.buf = self.buf[len(out):]
                return reasoning, content
            if self.state == 'after':
                lead = self.buf.lstrip()
                if not lead:
                    self.buf = ''
                    return reasoning, content
                self.buf, self.state = lead, 'content'
                continue
            content += self.buf
            self.buf = ''
            return reasoning, content

    def finish(self) -> tuple[str, str]:
        """End of the reply: flush what was held."""
        buf, self.buf = self.buf, ''
        if self.state == 'start':
            return '', buf
        if self.state == 'reasoning':
            return buf.rstrip('\n'), ''
        return '', ''


def _hold(text: str, tag: str) -> int:
    """Characters to hold back at the end of reasoning text: trailing newlines (dropped if
    ``</think>`` follows) plus a partial ``tag``."""
    k = 0
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            k = n
            break
    body = text[:len(text) - k]
    return k + (len(body) - len(body.rstrip('\n')))


class ThinkGuard:
    """Finds a reply's leading reasoning block when it is *not* split out (``--reasoning-parser
    none``, ``separate_reasoning: false``), so that the tool-call parser never reads it: a call
    drafted while thinking is reasoning, not a call to run.

    :meth:`feed` returns ``(block text, rest)``: the block (``<think>`` through ``</think>``, or
    from the start when the prompt ended inside an open block) exactly as generated, and the text
    after it; both concatenate back to the reply. A reply that does not start (after whitespace)
    with ``<think>`` has no block. Any cutting into deltas gives the same split.

    Args:
        started: the prompt ended inside an open ``<think>`` block.
    """
    start_tag, end_tag = ThinkReasoningParser.start_tag, ThinkReasoningParser.end_tag

    def __init__(self, started: bool = False):
        self.state = 'inside' if started else 'start'
        self.buf = ''

    def feed(self, delta: str) -> tuple[str, str]:
        """Next text delta in; ``(block text delta, rest delta)`` out."""
        self.buf += delta
        block = ''
        while True:
            if self.state == 'start':
                lead = self.buf.lstrip()
                if lead.startswith(self.start_tag):
                    self.state = 'inside'
                    continue
                if self.start_tag.startswith(lead):      # undecided
                    return block, ''
                self.state = 'after'
                continue
            if self.state == 'inside':
                end = self.buf.find(self.end_tag)
                if end != -1:
                    end += len(self.end_tag)
                    block += self.buf[:end]
                    self.buf, self.state = self.buf[end:], 'after'
                    continue
                keep = _hold(self.buf, self.end_tag)
                block += self.buf[:len(self.buf) - keep]
                self.buf = self.buf[len(self.buf) - keep:]
                return block, ''
            rest, self.buf = self.buf, ''
            return block, rest

    def finish(self) -> tuple[str, str]:
        """End of the reply: flush what was held."""
        buf, self.buf = self.buf, ''
        return (buf, '') if self.state == 'inside' else ('', buf)
