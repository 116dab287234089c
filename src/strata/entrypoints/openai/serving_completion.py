"""`POST /v1/completions`: one or many prompts (text or token ids), `n` choices each, echo and logprobs."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

from starlette.requests import Request as HTTPRequest
from starlette.responses import StreamingResponse

from strata.engine.detokenizer import IncrementalDetokenizer, TokenPiece
from strata.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    OpenAIError,
    UsageInfo,
)
from strata.entrypoints.openai.serving import (
    LOGPROB_FLOOR,
    SYSTEM_FINGERPRINT,
    OpenAIServing,
    PreparedPrompt,
    StreamState,
    clamp_logprob,
    random_id,
    sse,
)
from strata.outputs import CompletionOutput, Logprob, RequestOutput


@dataclass
class LogprobCursor:
    """Where one choice's logprobs stand: the engine's detokenizer, rebuilt (which carries a character still
    open at the end of the last chunk), and the text offset of the next token."""

    decoder: IncrementalDetokenizer | None
    text_offset: int = 0


class OpenAIServingCompletion(OpenAIServing):
    async def create(
        self, request: CompletionRequest, raw_request: HTTPRequest
    ) -> CompletionResponse | StreamingResponse:
        prompts = self._prompt_list(request.prompt)
        self.check_request(request, len(prompts))
        # With echo, the prompt's own logprobs are returned too (the first token has none).
        wanted = [
            k for k in (request.logprobs if request.echo else None, request.prompt_logprobs) if k is not None
        ]
        prompt_logprobs = max(wanted, default=None)
        prepared = [
            await self.prepare(request, prompt, request.max_tokens, request.logprobs, prompt_logprobs)
            for prompt in prompts
        ]
        request_id = random_id("cmpl")
        model = request.model or self.model_name
        if request.stream:
            events = self._stream(request, prepared, request_id, model)
            return StreamingResponse(self.event_stream(events), media_type="text/event-stream")
        finals = await self.final_outputs(raw_request, prepared, request_id)
        choices = []
        for prompt_index, output in enumerate(finals):
            prompt_logprobs_out = self.prompt_logprobs(
                output, request.prompt_logprobs, request.return_tokens_as_token_ids
            )
            for completion in output.outputs:
                choice = self._choice(
                    request,
                    prompt_index * request.n + completion.index,
                    output,
                    completion,
                    text=completion.text,
                    first_token=0,
                    cursor=self._cursor(prepared[prompt_index]),
                    echo=request.echo,
                    done=True,
                )
                choice.prompt_logprobs = prompt_logprobs_out
                choices.append(choice)
        return CompletionResponse(
            id=request_id,
            model=model,
            system_fingerprint=SYSTEM_FINGERPRINT,
            choices=choices,
            usage=self._usage(prepared, finals),
        )

    @staticmethod
    def _prompt_list(prompt: str | list[int] | list[str] | list[list[int]]) -> list[str | list[int]]:
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise OpenAIError(400, "prompt must not be empty", "prompt")
        if isinstance(prompt[0], int):
            return [prompt]  # type: ignore[list-item]
        return list(prompt)  # type: ignore[arg-type]

    def _cursor(self, prompt: PreparedPrompt) -> LogprobCursor:
        return LogprobCursor(self.detokenizer(prompt.token_ids, prompt.params.skip_special_tokens))

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
        cursors = {key: self._cursor(prepared[key[0]]) for key in states}
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
                choices.append(
                    self._choice(
                        request,
                        prompt_index * request.n + completion.index,
                        output,
                        completion,
                        text=text,
                        first_token=first_token,
                        cursor=cursors[key],
                        echo=echo_now,
                        done=done,
                    )
                )
            if choices:
                usage = None
                if request.continuous_usage:  # the whole request's usage so far
                    usage = self._usage(prepared, list(last_outputs.values()))
                yield sse(self._chunk(request_id, model, choices, usage))
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
        cursor: LogprobCursor,
        echo: bool,
        done: bool,
    ) -> CompletionChoice:
        """A choice with `text` and the tokens from `first_token` on (the prompt in front when echoing);
        `cursor` moves past the tokens listed."""
        logprobs = CompletionLogprobs() if request.logprobs is not None else None
        if echo:
            prompt_text = self._prompt_text(output)
            text = prompt_text + text
            if logprobs is not None:
                pieces = self._prompt_pieces(output.prompt_token_ids, prompt_text)
                entries = output.prompt_logprobs or [None] * len(pieces)
                self._add_logprobs(request, logprobs, cursor, pieces, entries)
        if logprobs is not None:
            pieces = self.pieces(cursor.decoder, completion.token_ids[first_token:], final=done)
            entries = list(completion.logprobs or [])[first_token:]
            self._add_logprobs(request, logprobs, cursor, pieces, entries)
        return CompletionChoice(
            index=index,
            text=text,
            logprobs=logprobs,
            finish_reason=completion.finish_reason if done else None,
            stop_reason=completion.stop_reason if done else None,
        )

    def _prompt_text(self, output: RequestOutput) -> str:
        if output.prompt is not None:
            return output.prompt
        return self.engine.tokenizer.decode(output.prompt_token_ids) if self.engine.tokenizer else ""

    def _prompt_pieces(self, token_ids: list[int], prompt_text: str) -> list[TokenPiece | None]:
        """The echoed prompt's pieces. A text prompt's special tokens (the `<s>` the tokenizer added) are
        not in its text, so they are left out; a prompt of token ids is echoed with them, so they stay."""
        pieces: list[TokenPiece | None] = []
        for skip_special_tokens in (True, False):
            pieces = self.pieces(self.detokenizer([], skip_special_tokens), token_ids, final=True)
            if "".join(piece.text for piece in pieces if piece is not None) == prompt_text:
                break
        return pieces

    def _add_logprobs(
        self,
        request: CompletionRequest,
        result: CompletionLogprobs,
        cursor: LogprobCursor,
        pieces: list[TokenPiece | None],
        entries: list[dict[int, Logprob] | None],
    ) -> None:
        """Append the listed tokens (a special token the text leaves out is skipped), each at its offset."""
        as_ids = request.return_tokens_as_token_ids
        num_top = request.logprobs or 0
        for piece, entry in zip(pieces, entries, strict=True):
            if piece is None:
                continue
            token = f"token_id:{piece.token_id}" if as_ids else piece.display
            if entry is None:  # the first prompt token: nothing predicted it
                result.token_logprobs.append(None)
                result.top_logprobs.append(None)
            else:
                result.token_logprobs.append(clamp_logprob(entry[piece.token_id].logprob))
                top: dict[str, float] = {}
                for tid, lp in entry.items():
                    if tid != piece.token_id and (lp.rank is None or lp.rank > num_top):
                        continue
                    key = token if tid == piece.token_id else self.candidate_text(tid, as_ids)
                    top[key] = max(top.get(key, LOGPROB_FLOOR), clamp_logprob(lp.logprob))
                result.top_logprobs.append(top)
            result.tokens.append(token)
            result.text_offset.append(cursor.text_offset)
            cursor.text_offset += len(piece.text)
