"""What completions and chat share: model-name checks, prompt and parameter validation, the generation
loop with its metrics, streaming deltas, and server-sent events."""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import BaseModel
from starlette.requests import Request as HTTPRequest

from strata import __version__
from strata.engine.detokenizer import IncrementalDetokenizer, TokenPiece, TokenTexts
from strata.engine.engine_client import EngineClient
from strata.engine.engine_loop import EngineDeadError
from strata.engine.prompts import PromptError, PromptType
from strata.entrypoints.openai.metrics import ServerMetrics
from strata.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatMessageParam,
    OpenAIError,
    PromptLogprob,
    SamplingRequest,
    TokenizeRequest,
)
from strata.entrypoints.openai.server_config import ServerConfig
from strata.outputs import CompletionOutput, RequestOutput
from strata.sampling_params import SamplingParams, SamplingParamsError

SYSTEM_FINGERPRINT = f"strata-{__version__}"
# JSON has no -inf; OpenAI-compatible servers report impossible tokens with this floor instead.
LOGPROB_FLOOR = -9999.0

# A text longer than this many characters per context token is first tokenized only in part, to refuse it
# early if even its start is too long; a cut through the text changes the tokens near the cut only.
_HEAD_CHARS_PER_TOKEN = 16
_CUT_SLACK_TOKENS = 64

T = TypeVar("T")


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def clamp_logprob(value: float) -> float:
    return max(value, LOGPROB_FLOOR)


def _chat_template_parameters(tokenizer: Any) -> frozenset[str]:
    """The named parameters of the tokenizer's `apply_chat_template`: request fields, so
    `chat_template_kwargs` (variables for the template) may not set them."""
    parameters = inspect.signature(tokenizer.apply_chat_template).parameters.values()
    return frozenset(p.name for p in parameters if p.kind is not inspect.Parameter.VAR_KEYWORD)


def _json_object(text: str) -> dict[str, Any] | str:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return text
    return value if isinstance(value, dict) else text


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
            # A cancelled task is only done once its cleanup (aborting the engine requests) has run.
            work_task.cancel()
            await asyncio.gather(work_task, return_exceptions=True)
    if work_task.cancelled():
        raise OpenAIError(499, "the client disconnected")
    return work_task.result()


class OpenAIServing:
    """Base of the completion and chat handlers."""

    def __init__(self, engine: EngineClient, config: ServerConfig, metrics: ServerMetrics) -> None:
        self.engine = engine
        self.config = config
        self.metrics = metrics
        self.token_texts = TokenTexts(engine.tokenizer) if engine.tokenizer is not None else None

    @property
    def model_names(self) -> list[str]:
        return self.config.model_names

    @property
    def model_name(self) -> str:
        return self.model_names[0]

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.model_names:
            raise OpenAIError(404, f"The model `{name}` does not exist.", "model", "model_not_found")

    def check_request(self, request: SamplingRequest, num_prompts: int = 1) -> None:
        """What every generation request must pass before any work: model, server state, field
        combinations, and the cap on its number of sequences."""
        self.check_model(request.model)
        if not self.engine.is_running:
            raise OpenAIError(503, "the server is shutting down", code="service_unavailable")
        if request.stream_options is not None and not request.stream:
            raise OpenAIError(400, "stream_options is only allowed when stream is true", "stream_options")
        if request.prompt_logprobs is not None and request.stream:
            raise OpenAIError(400, "prompt_logprobs is not supported with stream", "prompt_logprobs")
        unsupported = request.unsupported_fields()
        if unsupported:
            raise OpenAIError(400, f"{unsupported[0]} is not supported by this server", unsupported[0])
        limit = self.config.max_sequences_per_request
        if num_prompts * request.n > limit:
            raise OpenAIError(
                400,
                f"this request asks for {num_prompts * request.n} sequences ({num_prompts} prompts x "
                f"n={request.n}), but this server allows at most {limit} per request "
                "(strata serve --max-sequences-per-request); send fewer prompts or a smaller n",
                "n" if num_prompts == 1 else "prompt",
            )

    # -- tokenization, off the event loop --------------------------------------------------------------
    async def tokenize(
        self, prompt: str | list[int], request: SamplingRequest, param: str = "prompt"
    ) -> tuple[str | None, list[int]]:
        """(text or None, token ids) of a validated prompt, tokenized in the engine's tokenizer pool so a
        large prompt never holds up the event loop (and with it every other client)."""
        return await self.engine.run_tokenizer(
            self._tokenize_now, prompt, request.add_special_tokens, request.truncate_prompt_tokens, param
        )

    def _tokenize_now(
        self, prompt: str | list[int], add_special_tokens: bool, truncate: int | None, param: str
    ) -> tuple[str | None, list[int]]:
        try:
            if isinstance(prompt, str):
                ids = self._encode(prompt, add_special_tokens, bounded=truncate is None)
                # Once truncated, the text no longer matches the ids: echo decodes the ids instead.
                text = prompt if truncate is None or len(ids) <= truncate else None
                checked: PromptType = {
                    "prompt_token_ids": ids[-truncate:] if truncate else ids,
                    "prompt": text,
                }
            else:
                checked = prompt[-truncate:] if truncate else prompt
            return self.engine.tokenize_prompt(checked)
        except PromptError as exc:
            code = "context_length_exceeded" if "max_model_len" in str(exc) else None
            raise OpenAIError(400, str(exc), param, code) from exc

    async def encode_text(self, text: str, add_special_tokens: bool) -> list[int]:
        """`/tokenize` of a text: its token ids, even past the context, but refused from the tokens of its
        start when it is far past it."""

        def encode() -> list[int]:
            try:
                return self._encode(text, add_special_tokens, bounded=True)
            except PromptError as exc:
                raise OpenAIError(400, str(exc), "prompt", "context_length_exceeded") from exc

        return await self.engine.run_tokenizer(encode)

    async def decode_tokens(self, token_ids: list[int]) -> str:
        """`/detokenize`: checked and decoded in the tokenizer pool, as a list can hold millions of ids."""
        tokenizer, vocab_size = self.engine.tokenizer, self.engine.vocab_size
        assert tokenizer is not None

        def decode() -> str:
            if any(not 0 <= token < vocab_size for token in token_ids):
                raise OpenAIError(400, f"token ids must be in [0, {vocab_size})", "tokens")
            return tokenizer.decode(token_ids)

        return await self.engine.run_tokenizer(decode)

    def _encode(self, text: str, add_special_tokens: bool, bounded: bool) -> list[int]:
        """Token ids of `text`. A text far longer than the context is refused from the tokens of its start
        (`bounded`): tokenizing tens of megabytes would take minutes and gigabytes only to say no."""
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise PromptError("this server has no tokenizer: give prompts as token ids")
        limit = self.engine.max_model_len
        head_chars = _HEAD_CHARS_PER_TOKEN * limit
        if bounded and len(text) > head_chars:
            head = tokenizer.encode(text[:head_chars], add_special_tokens=add_special_tokens)
            # Tokens of a prefix and of the whole text differ only around the cut, by a few tokens.
            if len(head) >= limit + _CUT_SLACK_TOKENS:
                raise PromptError(
                    f"the prompt is more than {len(head) - _CUT_SLACK_TOKENS} tokens long (counted over its "
                    f"first {head_chars} of {len(text)} characters), but max_model_len={limit} leaves no "
                    "room to generate; shorten the prompt or set truncate_prompt_tokens"
                )
        return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))

    async def render_chat(
        self, request: ChatCompletionRequest | TokenizeRequest, messages: list[ChatMessageParam]
    ) -> tuple[str, list[int]]:
        """(text, token ids) of a conversation through the chat template (the request's, else the
        server's, else the tokenizer's), rendered in the tokenizer pool."""
        return await self.engine.run_tokenizer(self._render_chat_now, request, messages)

    def _render_chat_now(
        self, request: ChatCompletionRequest | TokenizeRequest, messages: list[ChatMessageParam]
    ) -> tuple[str, list[int]]:
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise OpenAIError(
                400, "this server has no tokenizer, so it cannot render chat messages", "messages"
            )
        template = (
            request.chat_template or self.config.chat_template or getattr(tokenizer, "chat_template", None)
        )
        if not template:
            raise OpenAIError(
                400,
                "this model has no chat template, so chat completions are unavailable; restart the server "
                "with --chat-template FILE (a Jinja template), send chat_template, or use /v1/completions",
                "messages",
            )
        if request.continue_final_message and request.add_generation_prompt:
            raise OpenAIError(
                400,
                "continue_final_message and add_generation_prompt cannot both be true: set "
                "add_generation_prompt to false to continue the last message",
                "continue_final_message",
            )
        extra = dict(request.chat_template_kwargs or {})
        reserved = sorted(set(extra) & _chat_template_parameters(tokenizer))
        if reserved:
            raise OpenAIError(
                400,
                f"chat_template_kwargs may not set {reserved[0]!r}: it is a request field",
                "chat_template_kwargs",
            )
        conversation = [self._template_message(message) for message in messages]
        tools = getattr(request, "tools", None)
        if tools and getattr(request, "tool_choice", None) != "none":
            extra["tools"] = [tool.model_dump(exclude_none=True) for tool in tools]
        try:
            text = tokenizer.apply_chat_template(
                conversation,
                chat_template=template,
                add_generation_prompt=request.add_generation_prompt,
                continue_final_message=request.continue_final_message,
                tokenize=False,
                **extra,
            )
        except Exception as exc:  # jinja errors, including raise_exception() in the template
            raise OpenAIError(400, f"the chat template failed on these messages: {exc}", "messages") from exc
        if not isinstance(text, str):
            raise OpenAIError(400, "the chat template did not render to text", "chat_template")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise OpenAIError(
                400, "the rendered chat holds a lone surrogate: it is not text", "messages"
            ) from None
        ids = list(tokenizer.encode(text, add_special_tokens=request.add_special_tokens is True))
        return text, ids

    @classmethod
    def _template_message(cls, message: ChatMessageParam) -> dict[str, Any]:
        """A message as chat templates take it: HF templates read a call's arguments as a mapping, so
        arguments sent back as JSON text are decoded (kept as text when they are not a JSON object)."""
        entry: dict[str, Any] = {"role": message.role, "content": cls._message_text(message)}
        if message.name is not None:
            entry["name"] = message.name
        if message.tool_call_id is not None:
            entry["tool_call_id"] = message.tool_call_id
        if message.tool_calls:
            entry["tool_calls"] = [
                {
                    "id": call.id,
                    "type": call.type,
                    "function": {
                        "name": call.function.name,
                        "arguments": _json_object(call.function.arguments),
                    },
                }
                for call in message.tool_calls
            ]
        return entry

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

    async def prepare(
        self,
        request: SamplingRequest,
        prompt: str | list[int],
        max_tokens: int | None,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
        param: str = "prompt",
        max_tokens_param: str = "max_tokens",
    ) -> PreparedPrompt:
        """Tokenise and validate one prompt with its sampling parameters (400 naming the field if bad)."""
        text, ids = await self.tokenize(prompt, request, param)
        return await self.prepare_tokens(
            request, text, ids, max_tokens, logprobs, prompt_logprobs, max_tokens_param
        )

    async def prepare_tokens(self, *args: Any, **kwargs: Any) -> PreparedPrompt:
        """`_prepare_tokens_now` in the tokenizer pool: an output constraint's grammar compiles there, off
        the event loop."""
        return await self.engine.run_tokenizer(functools.partial(self._prepare_tokens_now, *args, **kwargs))

    def _prepare_tokens_now(
        self,
        request: SamplingRequest,
        text: str | None,
        ids: list[int],
        max_tokens: int | None,
        logprobs: int | None,
        prompt_logprobs: int | None,
        max_tokens_param: str,
    ) -> PreparedPrompt:
        """Size and validate the sampling parameters of an already tokenized prompt."""
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
            params.check_token_ids(self.engine.vocab_size)
        except SamplingParamsError as exc:
            # The message starts with the field, possibly with a key: "logit_bias[5] must be ...".
            name = re.split(r"[ \[.]", str(exc), maxsplit=1)[0]
            field = max_tokens_param if name == "max_tokens" else name
            raise OpenAIError(400, str(exc).replace(name, field, 1), field) from exc
        return PreparedPrompt(text, ids, params)

    # -- logprob token strings ---------------------------------------------------------------------------
    def detokenizer(
        self, prompt_token_ids: list[int], skip_special_tokens: bool
    ) -> IncrementalDetokenizer | None:
        """A detokenizer built as the engine builds a sequence's (from the same prompt ids and
        `skip_special_tokens`), so the pieces it lists join up to the engine's text; with no prompt ids, it
        lists a prompt's own tokens."""
        if self.token_texts is None:
            return None
        return IncrementalDetokenizer(
            self.engine.tokenizer, prompt_token_ids, skip_special_tokens, self.token_texts
        )

    def candidate_text(self, token_id: int, as_ids: bool) -> str:
        """A top-logprob candidate's string: `token_id:N` on request, else its own text."""
        if as_ids or self.token_texts is None:
            return f"token_id:{token_id}"
        return self.token_texts.standalone(token_id)

    def pieces(
        self, decoder: IncrementalDetokenizer | None, token_ids: list[int], final: bool
    ) -> list[TokenPiece | None]:
        """The listed pieces of `token_ids` (None for skipped special tokens); without a tokenizer each
        token is listed by id, with no text."""
        if decoder is None:
            return [TokenPiece(token_id, "", b"") for token_id in token_ids]
        return decoder.add_tokens(token_ids, final)

    def prompt_logprobs(
        self, output: RequestOutput, num: int | None, as_ids: bool
    ) -> list[dict[int, PromptLogprob] | None] | None:
        """vLLM's `prompt_logprobs`: per prompt token, its own logprob and the `num` most likely."""
        if num is None or output.prompt_logprobs is None:
            return None
        result: list[dict[int, PromptLogprob] | None] = []
        for token_id, entry in zip(output.prompt_token_ids, output.prompt_logprobs, strict=True):
            if entry is None:
                result.append(None)
                continue
            result.append(
                {
                    tid: PromptLogprob(
                        logprob=clamp_logprob(lp.logprob),
                        rank=lp.rank,
                        decoded_token=self.candidate_text(tid, as_ids),
                    )
                    for tid, lp in entry.items()
                    if tid == token_id or (lp.rank is not None and lp.rank <= num)
                }
            )
        return result

    # -- generation -----------------------------------------------------------------------------------
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
