"""What completions and chat share: model-name checks, prompt and parameter validation, the generation
loop with its metrics, streaming deltas, and server-sent events."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from pydantic import BaseModel
from starlette.requests import Request as HTTPRequest

from strata import __version__
from strata.engine.async_engine import AsyncLLMEngine, EngineDeadError
from strata.engine.llm_engine import PromptError, PromptType
from strata.entrypoints.openai.metrics import ServerMetrics
from strata.entrypoints.openai.protocol import (
    ChatMessageParam,
    OpenAIError,
    SamplingRequest,
)
from strata.outputs import CompletionOutput, Logprob, RequestOutput
from strata.sampling_params import SamplingParams, SamplingParamsError

SYSTEM_FINGERPRINT = f"strata-{__version__}"
# JSON has no -inf; OpenAI-compatible servers report impossible tokens with this floor instead.
LOGPROB_FLOOR = -9999.0

T = TypeVar("T")


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def clamp_logprob(value: float) -> float:
    return max(value, LOGPROB_FLOOR)


def token_text(logprob: Logprob, token_id: int) -> str:
    return logprob.decoded_token if logprob.decoded_token is not None else f"token_id:{token_id}"


def sse(payload: BaseModel) -> str:
    """One server-sent event (`data: ...` and a blank line), as OpenAI streams them."""
    return f"data: {payload.model_dump_json()}\n\n"


@dataclass
class PreparedPrompt:
    """A validated prompt: its text (when known), token ids, and the sampling params sized for it."""

    text: str | None
    token_ids: list[int]
    params: SamplingParams


class StreamState:
    """How much of one choice has been streamed: text characters, tokens, and whether it ended."""

    def __init__(self, holdback: int) -> None:
        self.holdback = holdback
        self.sent_chars = 0
        self.sent_tokens = 0
        self.finished = False

    def advance(self, completion: CompletionOutput) -> tuple[str, int, bool] | None:
        """(new text, first new token index, just finished), or None if nothing new may be sent yet.

        Until the choice finishes, the last `holdback` characters stay back, so a stop string (which the
        engine removes at the end) is never streamed partially.
        """
        if self.finished:
            return None
        done = completion.finish_reason is not None
        end = len(completion.text) if done else max(self.sent_chars, len(completion.text) - self.holdback)
        text = completion.text[self.sent_chars : end]
        first_token = self.sent_tokens
        if not text and len(completion.token_ids) == first_token and not done:
            return None
        self.sent_chars = end
        self.sent_tokens = len(completion.token_ids)
        self.finished = done
        return text, first_token, done


async def merge_async_iterators(iterators: Sequence[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Items of several async iterators as they come, tagged with the iterator's index.

    Closing the merged iterator early cancels and closes every source, so their requests are aborted.
    """
    pending = {asyncio.ensure_future(anext(it)): index for index, it in enumerate(iterators)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                index = pending.pop(task)
                try:
                    item = task.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(anext(iterators[index]))] = index
                yield index, item
    finally:
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for it in iterators:
            await it.aclose()  # type: ignore[attr-defined]


async def until_disconnected(raw_request: HTTPRequest, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it (which aborts its requests) if the client disconnects first."""
    work_task = asyncio.ensure_future(work)

    async def wait_for_disconnect() -> None:
        while (await raw_request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(wait_for_disconnect())
    try:
        await asyncio.wait({work_task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not work_task.done():
            work_task.cancel()
    if work_task.cancelled():
        raise OpenAIError(499, "the client disconnected")
    return work_task.result()


class OpenAIServing:
    """Base of the completion and chat handlers."""

    def __init__(
        self,
        engine: AsyncLLMEngine,
        model_names: list[str],
        metrics: ServerMetrics,
        chat_template: str | None,
    ) -> None:
        self.engine = engine
        self.model_names = model_names
        self.metrics = metrics
        self.chat_template = chat_template

    @property
    def model_name(self) -> str:
        return self.model_names[0]

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.model_names:
            raise OpenAIError(404, f"The model `{name}` does not exist.", "model", "model_not_found")

    def check_request(self, request: SamplingRequest) -> None:
        """What every generation request must pass before any work: model, server state, field combinations."""
        self.check_model(request.model)
        if not self.engine.is_running:
            raise OpenAIError(503, "the server is shutting down", code="service_unavailable")
        if request.stream_options is not None and not request.stream:
            raise OpenAIError(400, "stream_options is only allowed when stream is true", "stream_options")
        unsupported = request.unsupported_fields()
        if unsupported:
            raise OpenAIError(400, f"{unsupported[0]} is not supported by this server", unsupported[0])

    def tokenize(self, prompt: PromptType, param: str) -> tuple[str | None, list[int]]:
        try:
            return self.engine.tokenize_prompt(prompt)
        except PromptError as exc:
            code = "context_length_exceeded" if "max_model_len" in str(exc) else None
            raise OpenAIError(400, str(exc), param, code) from exc

    def render_chat(self, messages: list[ChatMessageParam], add_generation_prompt: bool) -> list[int]:
        """Token ids of a conversation through the chat template (the server's, else the tokenizer's)."""
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise OpenAIError(
                400, "this server has no tokenizer, so it cannot render chat messages", "messages"
            )
        template = self.chat_template or getattr(tokenizer, "chat_template", None)
        if not template:
            raise OpenAIError(
                400,
                "this model has no chat template, so chat completions are unavailable; restart the server "
                "with --chat-template FILE (a Jinja template), or use /v1/completions",
                "messages",
            )
        conversation = [
            {"role": message.role, "content": self._message_text(message)} for message in messages
        ]
        try:
            ids = tokenizer.apply_chat_template(
                conversation,
                chat_template=template,
                add_generation_prompt=add_generation_prompt,
                tokenize=True,
                return_dict=False,
            )
        except Exception as exc:  # jinja errors, including raise_exception() in the template
            raise OpenAIError(400, f"the chat template failed on these messages: {exc}", "messages") from exc
        return list(ids)

    @staticmethod
    def _message_text(message: ChatMessageParam) -> str:
        if message.content is None or isinstance(message.content, str):
            return message.content or ""
        parts = []
        for part in message.content:
            if part.type != "text" or part.text is None:
                raise OpenAIError(
                    400, f"only text content parts are supported, got {part.type!r}", "messages"
                )
            parts.append(part.text)
        return "\n".join(parts)

    def prepare(
        self,
        request: SamplingRequest,
        prompt: PromptType,
        max_tokens: int | None,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
        param: str = "prompt",
        max_tokens_param: str = "max_tokens",
    ) -> PreparedPrompt:
        """Tokenise and validate one prompt with its sampling parameters (400 naming the field if bad)."""
        text, ids = self.tokenize(prompt, param)
        room = self.engine.max_model_len - len(ids)
        if max_tokens is not None and max_tokens > room:
            raise OpenAIError(
                400,
                f"This model's maximum context length is {self.engine.max_model_len} tokens. However, you "
                f"requested {len(ids) + max_tokens} tokens ({len(ids)} in the prompt, {max_tokens} in the "
                "completion). Please reduce the length of the prompt or completion.",
                max_tokens_param,
                "context_length_exceeded",
            )
        try:
            params = request.to_sampling_params(
                max_tokens if max_tokens is not None else room, logprobs, prompt_logprobs
            )
        except SamplingParamsError as exc:
            name = str(exc).split(" ", 1)[0]
            field = max_tokens_param if name == "max_tokens" else name
            raise OpenAIError(400, str(exc).replace(name, field, 1), field) from exc
        return PreparedPrompt(text, ids, params)

    async def generate(self, prompt: PreparedPrompt, request_id: str) -> AsyncIterator[RequestOutput]:
        """The engine's outputs for one prompt, observed for the latency and token metrics."""
        start = time.monotonic()
        last_time: float | None = None
        last: RequestOutput | None = None
        try:
            async for output in self.engine.generate(
                {"prompt_token_ids": prompt.token_ids, "prompt": prompt.text}, prompt.params, request_id
            ):
                now = time.monotonic()
                if last_time is None:
                    self.metrics.observe_first_token(now - start)
                else:
                    self.metrics.observe_inter_token(now - last_time)
                last_time, last = now, output
                yield output
        except EngineDeadError as exc:
            raise OpenAIError(503, str(exc), code="service_unavailable") from exc
        except ValueError as exc:  # the engine refused the request (validated here, so rarely seen)
            raise OpenAIError(400, str(exc)) from exc
        except Exception as exc:  # the engine step failed: end this request, keep serving others
            raise OpenAIError(500, f"the engine failed while running the request: {exc}") from exc
        finally:
            self.metrics.observe_finished(time.monotonic() - start, len(prompt.token_ids), last)

    async def generate_all(
        self, prompts: list[PreparedPrompt], request_id: str
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Run every prompt at once (they batch together); items are tagged with the prompt index."""
        streams = [self.generate(prompt, f"{request_id}-{index}") for index, prompt in enumerate(prompts)]
        async for item in merge_async_iterators(streams):
            yield item

    async def final_outputs(
        self, raw_request: HTTPRequest, prompts: list[PreparedPrompt], request_id: str
    ) -> list[RequestOutput]:
        """Each prompt's finished output; a disconnecting client aborts them all."""

        async def collect() -> list[RequestOutput]:
            finals: dict[int, RequestOutput] = {}
            async for index, output in self.generate_all(prompts, request_id):
                finals[index] = output
            return [finals[index] for index in range(len(prompts))]

        return await until_disconnected(raw_request, collect())

    @staticmethod
    def holdback(params: SamplingParams) -> int:
        """Characters a stream keeps back so no stop string is ever sent in part."""
        return max((len(stop) for stop in params.stop), default=1) - 1

    @staticmethod
    async def event_stream(events: AsyncIterator[str]) -> AsyncIterator[str]:
        """Wrap a stream's events: errors become an error event, and `[DONE]` always ends it."""
        try:
            async for event in events:
                yield event
        except OpenAIError as exc:
            yield sse(exc.response())
        yield "data: [DONE]\n\n"
