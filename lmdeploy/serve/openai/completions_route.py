"""``POST /v1/completions``: continuations of text or token-id prompts, or an SSE stream."""
from __future__ import annotations

from fastapi import Request
from starlette.concurrency import run_in_threadpool

from .chat_output import StreamedLogprobs, TextOffsets, completion_logprobs
from .errors import APIError
from .generation import Generation, SSEResponse, sse
from .prompt_logprobs import echo_logprobs, merge_completion_logprobs, vllm_prompt_logprobs
from .protocol import MAX_CHOICES, CompletionRequest, new_id, now

__all__ = ['CompletionRoutes']


class CompletionRoutes:
    """The completions endpoint, mixed into :class:`~.api_server.Server`."""

    async def completions(self, req: CompletionRequest, request: Request):
        self.check_model(req.model)
        prompts = req.prompts()
        if not prompts:
            raise APIError(400, 'prompt: must not be empty', param='prompt', code='invalid_value')
        if len(prompts) * req.n > MAX_CHOICES:       # before any tokenization
            param = 'prompt' if len(prompts) > 1 else 'n'
            raise APIError(400, f'{param}: {len(prompts)} prompts x n={req.n} exceeds {MAX_CHOICES} choices',
                           param=param, code='invalid_value')

        def plan():
            ids = [self._encode(p, 'prompt') for p in prompts]
            # echo: each choice's text starts with its prompt's text (token ids decoded)
            echo = [p if isinstance(p, str) else self.pipe.tokenizer.decode(i) for p, i in zip(prompts, ids)] \
                if req.echo else None
            # echo with logprobs: the prompt's tokens get theirs too (as many alternatives)
            wanted = [k for k in (req.prompt_logprobs, req.logprobs if req.echo else None) if k is not None]
            return self._jobs(req, ids, req.max_tokens, 'prompt', req.logprobs, self._structured(req.response_format),
                              prompt_logprobs=max(wanted) if wanted else None), echo
        jobs, echo = await run_in_threadpool(plan)
        echoed = [echo[i // req.n] for i in range(len(jobs))] if echo else None
        gen = Generation(self, jobs, req.n)
        head = {'id': new_id('cmpl'), 'object': 'text_completion', 'created': now(), 'model': self.model_name}
        top = req.logprobs or 0
        stops = req.stop_words()
        if req.stream:
            opts = req.stream_options
            return SSEResponse(self._completion_events(gen, head, bool(opts and opts.include_usage),
                                                        req.logprobs is not None, top, echoed,
                                                        [job.token_ids for job in jobs], req.prompt_logprobs, stops,
                                                        bool(opts and opts.continuous_usage_stats)))
        await gen.collect(request)
        choices = []
        for i, c in enumerate(gen.choices):
            choice = {'index': i, 'text': (echoed[i] if echoed else '') + c.text, 'logprobs': None,
                      'finish_reason': c.finish_reason, 'matched_stop': gen.matched_stop(i, stops)}
            if req.logprobs is not None:
                offsets = TextOffsets(self.texts)
                head_lp = (echo_logprobs(self.texts, jobs[i].token_ids, c.prompt_logprobs, top, offsets)
                           if echoed else None)
                choice['logprobs'] = merge_completion_logprobs(head_lp, completion_logprobs(self.texts, c.logprobs,
                                                                                           top, offsets))
            if req.prompt_logprobs is not None:
                choice['prompt_logprobs'] = vllm_prompt_logprobs(self.texts, c.prompt_logprobs, req.prompt_logprobs)
            choices.append(choice)
        return dict(head, choices=choices, usage=gen.usage(), **gen.kv_transfer_params())

    async def _completion_events(self, gen: Generation, head: dict, include_usage: bool, logprobs: bool,
                                 top: int, echoed: list[str] | None = None, prompts: list | None = None,
                                 prompt_logprobs: int | None = None, stops: list[str] = (),
                                 continuous_usage: bool = False):
        aligned = [StreamedLogprobs(self.texts) for _ in gen.choices]     # entries in step with the text
        def usage() -> dict:        # a chunk's usage field: the usage so far on every chunk, or null
            return {'usage': gen.usage()} if continuous_usage else {'usage': None} if include_usage else {}
        # echo: the prompt first, as each choice's first text; with logprobs (which come with the
        # choice's first output) it waits for them
        pending_echo = dict(enumerate(echoed or []))
        if not logprobs:
            for i, text in pending_echo.items():
                yield sse(dict(head, choices=[{'index': i, 'text': text, 'logprobs': None, 'finish_reason': None}],
                                **usage()))
            pending_echo = {}

        def events(i: int, r):     # one delta's SSE events
            extra = {}
            if prompt_logprobs is not None and r.prompt_logprobs is not None:
                extra['prompt_logprobs'] = vllm_prompt_logprobs(self.texts, r.prompt_logprobs,
                                                                prompt_logprobs)
            if i in pending_echo:
                lp = echo_logprobs(self.texts, prompts[i], r.prompt_logprobs, top, aligned[i].offsets)
                aligned[i].sent = aligned[i].offsets.chars     # generated text starts after the echo
                choice = {'index': i, 'text': pending_echo.pop(i), 'logprobs': lp, 'finish_reason': None}
                yield sse(dict(head, choices=[dict(choice, **extra)], **usage()))
                extra = {}
            text, lp = r.text, None
            if logprobs:    # the text up to a token boundary, with exactly its tokens' entries
                text, ready, starts = aligned[i].feed(r.logprobs, r.text, bool(r.finish_reason))
                lp = completion_logprobs(self.texts, ready, top, starts=starts) if ready else None
            if text or r.finish_reason or lp or extra:
                choice = {'index': i, 'text': text, 'logprobs': lp, 'finish_reason': r.finish_reason,
                          **extra}
                if r.finish_reason:
                    choice['matched_stop'] = gen.matched_stop(i, stops)
                yield sse(dict(head, choices=[choice], **usage()))

        async for event in gen.sse_deltas(events):
            yield event
        if include_usage:
            yield sse(dict(head, choices=[], usage=gen.usage()))
        yield sse('[DONE]')
