"""`POST /v1/completions`: one or many prompts (text or token ids), `n` choices each, echo and logprobs."""

from __future__ import annotations

from collections.abc import AsyncIterator

from starlette.requests import Request as HTTPRequest
from starlette.responses import StreamingResponse

from strata.engine.llm_engine import PromptType
from strata.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    OpenAIError,
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


class OpenAIServingCompletion(OpenAIServing):
    async def create(
        self, request: CompletionRequest, raw_request: HTTPRequest
    ) -> CompletionResponse | StreamingResponse:
        self.check_request(request)
        # With echo, the prompt's own logprobs are returned too (the first token has none).
        prompt_logprobs = request.logprobs if request.echo else None
        prepared = [
            self.prepare(request, prompt, request.max_tokens, request.logprobs, prompt_logprobs)
            for prompt in self._prompt_list(request.prompt)
        ]
        request_id = random_id("cmpl")
        model = request.model or self.model_name
        if request.stream:
            events = self._stream(request, prepared, request_id, model)
            return StreamingResponse(self.event_stream(events), media_type="text/event-stream")
        finals = await self.final_outputs(raw_request, prepared, request_id)
        choices = [
            self._choice(
                request,
                prompt_index * request.n + completion.index,
                output,
                completion,
                text=completion.text,
                first_token=0,
                text_offset=0,
                echo=request.echo,
                done=True,
            )[0]
            for prompt_index, output in enumerate(finals)
            for completion in output.outputs
        ]
        return CompletionResponse(
            id=request_id,
            model=model,
            system_fingerprint=SYSTEM_FINGERPRINT,
            choices=choices,
            usage=self._usage(prepared, finals),
        )

    @staticmethod
    def _prompt_list(prompt: str | list[int] | list[str] | list[list[int]]) -> list[PromptType]:
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise OpenAIError(400, "prompt must not be empty", "prompt")
        if isinstance(prompt[0], int):
            return [prompt]  # type: ignore[list-item]
        return list(prompt)  # type: ignore[arg-type]

    @staticmethod
    def _usage(prepared: list[PreparedPrompt], outputs: list[RequestOutput]) -> UsageInfo:
        return UsageInfo.of(
            sum(len(prompt.token_ids) for prompt in prepared),
            sum(len(c.token_ids) for output in outputs for c in output.outputs),
        )

    async def _stream(
        self, request: CompletionRequest, prepared: list[PreparedPrompt], request_id: str, model: str
    ) -> AsyncIterator[str]:
        states = {
            (prompt_index, index): StreamState(self.holdback(prompt.params))
            for prompt_index, prompt in enumerate(prepared)
            for index in range(request.n)
        }
        text_offsets = dict.fromkeys(states, 0)
        last_outputs: dict[int, RequestOutput] = {}
        async for prompt_index, output in self.generate_all(prepared, request_id):
            last_outputs[prompt_index] = output
            choices = []
            for completion in output.outputs:
                key = (prompt_index, completion.index)
                state = states[key]
                echo_now = request.echo and state.sent_chars == 0 and state.sent_tokens == 0
                step = state.advance(completion)
                if step is None:
                    continue
                text, first_token, done = step
                choice, text_offsets[key] = self._choice(
                    request,
                    prompt_index * request.n + completion.index,
                    output,
                    completion,
                    text=text,
                    first_token=first_token,
                    text_offset=text_offsets[key],
                    echo=echo_now,
                    done=done,
                )
                choices.append(choice)
            if choices:
                yield sse(self._chunk(request_id, model, choices))
        if request.include_usage:
            usage = self._usage(prepared, [last_outputs[i] for i in sorted(last_outputs)])
            yield sse(self._chunk(request_id, model, [], usage))

    @staticmethod
    def _chunk(
        request_id: str, model: str, choices: list[CompletionChoice], usage: UsageInfo | None = None
    ) -> CompletionResponse:
        return CompletionResponse(
            id=request_id, model=model, system_fingerprint=SYSTEM_FINGERPRINT, choices=choices, usage=usage
        )

    def _choice(
        self,
        request: CompletionRequest,
        index: int,
        output: RequestOutput,
        completion: CompletionOutput,
        *,
        text: str,
        first_token: int,
        text_offset: int,
        echo: bool,
        done: bool,
    ) -> tuple[CompletionChoice, int]:
        """A choice with `text` and the tokens from `first_token` on (the prompt in front when echoing),
        and the text offset where the next tokens' logprobs start."""
        token_ids = completion.token_ids[first_token:]
        entries: list[dict[int, Logprob] | None] = list(completion.logprobs or [])[first_token:]
        if echo:
            text = self._prompt_text(output) + text
            token_ids = output.prompt_token_ids + token_ids
            entries = list(output.prompt_logprobs or []) + entries
        logprobs = None
        if request.logprobs is not None:
            logprobs, text_offset = self._logprobs(token_ids, entries, text_offset)
        choice = CompletionChoice(
            index=index,
            text=text,
            logprobs=logprobs,
            finish_reason=completion.finish_reason if done else None,
            stop_reason=completion.stop_reason if done else None,
        )
        return choice, text_offset

    def _prompt_text(self, output: RequestOutput) -> str:
        if output.prompt is not None:
            return output.prompt
        return self.engine.tokenizer.decode(output.prompt_token_ids) if self.engine.tokenizer else ""

    def _logprobs(
        self, token_ids: list[int], entries: list[dict[int, Logprob] | None], text_offset: int
    ) -> tuple[CompletionLogprobs, int]:
        result = CompletionLogprobs()
        for token_id, entry in zip(token_ids, entries, strict=True):
            if entry is None:  # the first prompt token: nothing predicted it
                text = self.engine.tokenizer.decode([token_id]) if self.engine.tokenizer else ""
                result.token_logprobs.append(None)
                result.top_logprobs.append(None)
            else:
                text = token_text(entry[token_id], token_id)
                result.token_logprobs.append(clamp_logprob(entry[token_id].logprob))
                result.top_logprobs.append(
                    {token_text(lp, tid): clamp_logprob(lp.logprob) for tid, lp in entry.items()}
                )
            result.tokens.append(text)
            result.text_offset.append(text_offset)
            text_offset += len(text)
        return result, text_offset
