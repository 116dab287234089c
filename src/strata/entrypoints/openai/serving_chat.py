"""`POST /v1/chat/completions`: messages through the chat template, `n` choices, logprobs, tool calls,
streaming."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request as HTTPRequest
from starlette.responses import StreamingResponse

from strata.engine.detokenizer import IncrementalDetokenizer
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
)
from strata.entrypoints.openai.tool_calls import ToolCalling
from strata.outputs import CompletionOutput, Logprob, RequestOutput


class OpenAIServingChat(OpenAIServing):
    async def create(
        self, request: ChatCompletionRequest, raw_request: HTTPRequest
    ) -> ChatCompletionResponse | StreamingResponse:
        self.check_request(request)
        if request.top_logprobs is not None and not request.logprobs:
            raise OpenAIError(400, "top_logprobs needs logprobs to be true", "top_logprobs")
        tools = ToolCalling.for_request(request, self.config.tool_call_parser)
        _, rendered_ids = await self.render_chat(request, request.messages)
        _, ids = await self.tokenize(rendered_ids, request, "messages")
        # max_completion_tokens replaced max_tokens in OpenAI's API; both are accepted.
        use_new = request.max_completion_tokens is not None
        prepared = await self.prepare_tokens(
            request,
            None,
            ids,
            request.max_completion_tokens if use_new else request.max_tokens,
            (request.top_logprobs or 0) if request.logprobs else None,
            request.prompt_logprobs,
            max_tokens_param="max_completion_tokens" if use_new else "max_tokens",
        )
        request_id = random_id("chatcmpl")
        model = request.model or self.model_name
        echo = self._echo_text(request)
        if request.stream:
            events = self._stream(request, prepared, request_id, model, echo, tools)
            return StreamingResponse(self.event_stream(events), media_type="text/event-stream")
        [output] = await self.final_outputs(raw_request, [prepared], request_id)
        choices = [self._choice(request, prepared, completion, echo, tools) for completion in output.outputs]
        return ChatCompletionResponse(
            id=request_id,
            model=model,
            system_fingerprint=SYSTEM_FINGERPRINT,
            choices=choices,
            usage=self._usage(prepared, output),
            prompt_logprobs=self.prompt_logprobs(
                output, request.prompt_logprobs, request.return_tokens_as_token_ids
            ),
        )

    def _choice(
        self,
        request: ChatCompletionRequest,
        prepared: PreparedPrompt,
        completion: CompletionOutput,
        echo: str,
        tools: ToolCalling | None,
    ) -> ChatChoice:
        message = ChatMessage(content=echo + completion.text)
        finish_reason = completion.finish_reason
        if tools is not None:
            parsed = tools.parse(completion.text, final=True)
            content = echo + (parsed.content or "")
            calls = [call.tool_call() for call in parsed.calls]
            message = ChatMessage(content=content or None, tool_calls=calls)
            finish_reason = tools.finish_reason(parsed.calls, finish_reason)
        return ChatChoice(
            index=completion.index,
            message=message,
            logprobs=self._logprobs(request, self._decoder(request, prepared), completion, 0, final=True),
            finish_reason=finish_reason,
            stop_reason=completion.stop_reason,
        )

    @staticmethod
    def _echo_text(request: ChatCompletionRequest) -> str:
        """With `echo`, the reply starts with the last message's content when that message is the
        assistant's own (the one being continued), as in vLLM; otherwise there is nothing to echo."""
        last = request.messages[-1]
        if not request.echo or last.role != "assistant":
            return ""
        return OpenAIServing._message_text(last)

    def _decoder(
        self, request: ChatCompletionRequest, prepared: PreparedPrompt
    ) -> IncrementalDetokenizer | None:
        """What lists a choice's logprob tokens: the engine's detokenizer, built from what the engine gets."""
        if not request.logprobs:
            return None
        return self.detokenizer(prepared.token_ids, prepared.params.skip_special_tokens)

    @staticmethod
    def _usage(prepared: PreparedPrompt, output: RequestOutput) -> UsageInfo:
        return UsageInfo.of(len(prepared.token_ids), sum(len(c.token_ids) for c in output.outputs))

    async def _stream(
        self,
        request: ChatCompletionRequest,
        prepared: PreparedPrompt,
        request_id: str,
        model: str,
        echo: str,
        tools: ToolCalling | None,
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

        # The role comes first, in a chunk of its own, as OpenAI sends it; then the echoed text, if any.
        for index in range(request.n):
            yield chunk([ChatChunkChoice(index=index, delta={"role": "assistant", "content": ""})])
            if echo:
                yield chunk([ChatChunkChoice(index=index, delta={"content": echo})])
        states = [StreamState(self.holdback(prepared.params)) for _ in range(request.n)]
        decoders = [self._decoder(request, prepared) for _ in range(request.n)]
        tool_streams = [tools.streamer() if tools is not None else None for _ in range(request.n)]
        last: RequestOutput | None = None
        async for _, output in self.generate_all([prepared], request_id):
            last = output
            choices = []
            for completion in output.outputs:
                step = states[completion.index].advance(completion)
                if step is None:
                    continue
                text, first_token, done = step
                decoder = decoders[completion.index]
                finish_reason = completion.finish_reason if done else None
                delta: dict[str, Any] = {"content": text} if text else {}
                if (tool_stream := tool_streams[completion.index]) is not None:
                    delta = tool_stream.feed(text, final=done)
                    if done:
                        finish_reason = tool_stream.calling.finish_reason(tool_stream.calls, finish_reason)
                choices.append(
                    ChatChunkChoice(
                        index=completion.index,
                        delta=delta,
                        logprobs=self._logprobs(request, decoder, completion, first_token, final=done),
                        finish_reason=finish_reason,
                        stop_reason=completion.stop_reason if done else None,
                    )
                )
            if choices:
                yield chunk(choices, self._usage(prepared, output) if request.continuous_usage else None)
        if request.include_usage and last is not None:
            yield chunk([], self._usage(prepared, last))

    def _logprobs(
        self,
        request: ChatCompletionRequest,
        decoder: IncrementalDetokenizer | None,
        completion: CompletionOutput,
        first_token: int,
        final: bool,
    ) -> ChatLogprobs | None:
        """The logprobs of the tokens from `first_token` on; `decoder` moves past them."""
        if not request.logprobs or completion.logprobs is None:
            return None
        num_top = request.top_logprobs or 0
        as_ids = request.return_tokens_as_token_ids
        pieces = self.pieces(decoder, completion.token_ids[first_token:], final)
        content = []
        for piece, entry in zip(pieces, completion.logprobs[first_token:], strict=True):
            if piece is None:  # a special token the text leaves out
                continue
            token = f"token_id:{piece.token_id}" if as_ids else piece.display
            chosen = TopLogprob(
                token=token, logprob=clamp_logprob(entry[piece.token_id].logprob), bytes=list(piece.raw)
            )
            ranked = sorted(
                (lp.rank, tid) for tid, lp in entry.items() if lp.rank is not None and lp.rank <= num_top
            )
            top = [
                chosen if tid == piece.token_id else self._candidate(tid, entry[tid], as_ids)
                for _, tid in ranked
            ]
            content.append(ChatLogprobToken(**chosen.model_dump(), top_logprobs=top))
        return ChatLogprobs(content=content)

    def _candidate(self, token_id: int, logprob: Logprob, as_ids: bool) -> TopLogprob:
        raw = self.token_texts.token_bytes(token_id) if self.token_texts is not None else None
        return TopLogprob(
            token=self.candidate_text(token_id, as_ids),
            logprob=clamp_logprob(logprob.logprob),
            bytes=list(raw) if raw is not None else None,
        )
