"""``POST /v1/chat/completions``: one reply per choice, or an SSE stream of deltas."""
from __future__ import annotations

from fastapi import Request
from starlette.concurrency import run_in_threadpool

from .chat_output import ChatOutput, StreamedLogprobs, chat_logprobs
from .generation import Generation, SSEResponse, sse
from .prompt_logprobs import vllm_prompt_logprobs
from .protocol import ChatCompletionRequest, new_id, now

__all__ = ['ChatRoutes']


class ChatRoutes:
    """The chat endpoint, mixed into :class:`~.api_server.Server` (uses its request planning)."""

    async def chat(self, req: ChatCompletionRequest, request: Request):
        self.check_model(req.model)
        plan = await run_in_threadpool(self.plan_chat, req)
        gen = Generation(self, plan.jobs, req.n, [out.first_call_stop() for out in plan.outputs])
        rid, created = new_id('chatcmpl'), now()
        head = {'id': rid, 'object': 'chat.completion', 'created': created, 'model': self.model_name}
        top = req.top_logprobs or 0
        stops = req.stop_words()
        if req.stream:
            opts = req.stream_options
            return SSEResponse(self._chat_events(gen, plan.outputs, dict(head, object='chat.completion.chunk'),
                                                  bool(opts and opts.include_usage), req.logprobs, top,
                                                  req.prompt_logprobs, stops,
                                                  bool(opts and opts.continuous_usage_stats)))
        await gen.collect(request)
        choices = []
        for i, (c, out) in enumerate(zip(gen.choices, plan.outputs)):
            choices.append({'index': i, 'message': out.message(c.text),
                            'logprobs': chat_logprobs(self.texts, c.logprobs, top) if req.logprobs else None,
                            'finish_reason': out.finish_reason(c.finish_reason),
                            'matched_stop': gen.matched_stop(i, stops)})
        extra = {}
        if req.prompt_logprobs is not None:
            extra['prompt_logprobs'] = vllm_prompt_logprobs(self.texts, gen.choices[0].prompt_logprobs,
                                                            req.prompt_logprobs)
        return dict(head, choices=choices, usage=gen.usage(), **extra, **gen.kv_transfer_params())

    async def _chat_events(self, gen: Generation, outputs: list[ChatOutput], head: dict, include_usage: bool,
                           logprobs: bool, top: int, prompt_logprobs: int | None = None, stops: list[str] = (),
                           continuous_usage: bool = False):
        def chunk(choices, usage=None, **extra):
            body = dict(head, choices=choices, **extra)
            if continuous_usage:        # every chunk: the usage so far
                body['usage'] = usage or gen.usage()
            elif include_usage:
                body['usage'] = usage
            return sse(body)
        for i in range(len(gen.choices)):
            yield chunk([{'index': i, 'delta': {'role': 'assistant', 'content': ''}, 'logprobs': None,
                          'finish_reason': None}])
        aligned = [StreamedLogprobs(self.texts) for _ in gen.choices]     # entries in step with the text

        def events(i: int, r):     # one delta's SSE events
            out = outputs[i]
            text, lp = r.text, None
            if logprobs:    # the text up to a token boundary, with exactly its tokens' entries
                text, ready, _ = aligned[i].feed(r.logprobs, r.text, bool(r.finish_reason))
                lp = chat_logprobs(self.texts, ready, top) if ready else None
            delta = out.feed(text) if text else {}
            reason = None
            if r.finish_reason:
                delta = ChatOutput.merge_deltas(delta, out.finish())
                reason = out.finish_reason(r.finish_reason)
            if lp and not delta:        # entries whose text is not out yet: an empty content
                delta = {'content': ''}
            extra = {}
            if prompt_logprobs is not None and r.prompt_logprobs is not None and i == 0:
                extra['prompt_logprobs'] = vllm_prompt_logprobs(self.texts, r.prompt_logprobs, prompt_logprobs)
            if delta or reason or lp or extra:
                choice = {'index': i, 'delta': delta, 'logprobs': lp, 'finish_reason': reason}
                if reason:
                    choice['matched_stop'] = gen.matched_stop(i, stops)
                yield chunk([choice], **extra)

        async for event in gen.sse_deltas(events):
            yield event
        if include_usage:
            yield chunk([], gen.usage())
        yield sse('[DONE]')
