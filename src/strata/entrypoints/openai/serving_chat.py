"""`POST /v1/chat/completions`: messages through the chat template, `n` choices, logprobs, streaming."""

from __future__ import annotations

from collections.abc import AsyncIterator

from starlette.requests import Request as HTTPRequest
from starlette.responses import StreamingResponse

from strata.entrypoints.openai.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatLogprobToken,
    ChatMessage,
    OpenAIError,
    TopLogprob,
    UsageInfo,
)
from strata.entrypoints.openai.serving import (
    SYSTEM_FINGERPRINT,
    OpenAIServing,
    PreparedPrompt,
    StreamState,
    clamp_logprob,
    random_id,
    sse,
    token_text,
)
from strata.outputs import CompletionOutput, Logprob, RequestOutput


class OpenAIServingChat(OpenAIServing):
    async def create(
        self, request: ChatCompletionRequest, raw_request: HTTPRequest
    ) -> ChatCompletionResponse | StreamingResponse:
        self.check_request(request)
        if request.top_logprobs is not None and not request.logprobs:
            raise OpenAIError(400, "top_logprobs needs logprobs to be true", "top_logprobs")
        ids = self.render_chat(request.messages, request.add_generation_prompt)
        # max_completion_tokens replaced max_tokens in OpenAI's API; both are accepted.
        use_new = request.max_completion_tokens is not None
        prepared = self.prepare(
            request,
            {"prompt_token_ids": ids},
            request.max_completion_tokens if use_new else request.max_tokens,
            (request.top_logprobs or 0) if request.logprobs else None,
            param="messages",
            max_tokens_param="max_completion_tokens" if use_new else "max_tokens",
        )
        request_id = random_id("chatcmpl")
        model = request.model or self.model_name
        if request.stream:
            events = self._stream(request, prepared, request_id, model)
            return StreamingResponse(self.event_stream(events), media_type="text/event-stream")
        [output] = await self.final_outputs(raw_request, [prepared], request_id)
        choices = [
            ChatChoice(
                index=completion.index,
                message=ChatMessage(content=completion.text),
                logprobs=self._logprobs(request, completion, 0),
                finish_reason=completion.finish_reason,
                stop_reason=completion.stop_reason,
            )
            for completion in output.outputs
        ]
        return ChatCompletionResponse(
            id=request_id,
            model=model,
            system_fingerprint=SYSTEM_FINGERPRINT,
            choices=choices,
            usage=self._usage(prepared, output),
        )

    @staticmethod
    def _usage(prepared: PreparedPrompt, output: RequestOutput) -> UsageInfo:
        return UsageInfo.of(len(prepared.token_ids), sum(len(c.token_ids) for c in output.outputs))

    async def _stream(
        self, request: ChatCompletionRequest, prepared: PreparedPrompt, request_id: str, model: str
    ) -> AsyncIterator[str]:
        def chunk(choices: list[ChatChunkChoice], usage: UsageInfo | None = None) -> str:
            return sse(
                ChatCompletionChunk(
                    id=request_id,
                    model=model,
                    system_fingerprint=SYSTEM_FINGERPRINT,
                    choices=choices,
                    usage=usage,
                )
            )

        # The role comes first, in a chunk of its own, as OpenAI sends it.
        for index in range(request.n):
            yield chunk([ChatChunkChoice(index=index, delta={"role": "assistant", "content": ""})])
        states = [StreamState(self.holdback(prepared.params)) for _ in range(request.n)]
        last: RequestOutput | None = None
        async for _, output in self.generate_all([prepared], request_id):
            last = output
            choices = []
            for completion in output.outputs:
                step = states[completion.index].advance(completion)
                if step is None:
                    continue
                text, first_token, done = step
                choices.append(
                    ChatChunkChoice(
                        index=completion.index,
                        delta={"content": text} if text else {},
                        logprobs=self._logprobs(request, completion, first_token),
                        finish_reason=completion.finish_reason if done else None,
                        stop_reason=completion.stop_reason if done else None,
                    )
                )
            if choices:
                yield chunk(choices)
        if request.include_usage and last is not None:
            yield chunk([], self._usage(prepared, last))

    @staticmethod
    def _logprobs(
        request: ChatCompletionRequest, completion: CompletionOutput, first_token: int
    ) -> ChatLogprobs | None:
        if not request.logprobs or completion.logprobs is None:
            return None
        num_top = request.top_logprobs or 0

        def top(token_id: int, logprob: Logprob) -> TopLogprob:
            text = token_text(logprob, token_id)
            return TopLogprob(token=text, logprob=clamp_logprob(logprob.logprob), bytes=list(text.encode()))

        content = []
        for token_id, entry in zip(
            completion.token_ids[first_token:], completion.logprobs[first_token:], strict=True
        ):
            ranked = sorted(
                (lp.rank, tid) for tid, lp in entry.items() if lp.rank is not None and lp.rank <= num_top
            )
            chosen = top(token_id, entry[token_id])
            content.append(
                ChatLogprobToken(
                    **chosen.model_dump(), top_logprobs=[top(tid, entry[tid]) for _, tid in ranked]
                )
            )
        return ChatLogprobs(content=content)
