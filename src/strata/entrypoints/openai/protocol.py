"""Request and response bodies of the OpenAI API, field for field, plus vLLM's sampling extensions.

Requests ignore unknown fields (clients such as LangChain send extras) but validate every field they
know; responses are built from these models so their shape cannot drift from OpenAI's schema.
"""

from __future__ import annotations

import time
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from strata.sampling_params import SamplingParams

# OpenAI's own limits: at most 128 choices per request and 20 top logprobs per token.
MAX_N = 128
MAX_TOP_LOGPROBS = 20


class RequestModel(BaseModel):
    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        """OpenAI takes null for any optional field as "use the default", and clients send such nulls."""
        if isinstance(data, dict):
            return {key: value for key, value in data.items() if value is not None}
        return data


class StreamOptions(RequestModel):
    include_usage: bool = False


class SamplingRequest(RequestModel):
    """Fields shared by completions and chat completions; `None` means the engine's default."""

    model: str | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None

    def unsupported_fields(self) -> list[str]:
        """OpenAI fields that would change the output but that the engine cannot honour yet."""
        return ["logit_bias"] if self.logit_bias else []

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def to_sampling_params(
        self, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None = None
    ) -> SamplingParams:
        """Build validated SamplingParams (raises SamplingParamsError naming the field)."""
        optional = {
            name: value
            for name in (
                "temperature",
                "top_p",
                "top_k",
                "min_p",
                "presence_penalty",
                "frequency_penalty",
                "repetition_penalty",
            )
            if (value := getattr(self, name)) is not None
        }
        return SamplingParams(
            n=self.n,
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            **optional,
        )


class CompletionRequest(SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    # Candidates generated per prompt, of which the n most likely are returned; as many as n is plain sampling.
    best_of: int | None = Field(default=None, ge=1, le=MAX_N)

    @field_validator("best_of")
    @classmethod
    def _best_of_covers_n(cls, best_of: int | None, info: ValidationInfo) -> int | None:
        n = info.data.get("n", 1)
        if best_of is not None and best_of < n:
            raise ValueError(f"best_of must be at least n ({n}), got {best_of}")
        return best_of

    def unsupported_fields(self) -> list[str]:
        unsupported = ["suffix"] if self.suffix else []
        if self.best_of is not None and self.best_of > self.n:
            unsupported.append("best_of")
        return [*super().unsupported_fields(), *unsupported]


class ContentPart(RequestModel):
    type: str
    text: str | None = None


class ChatMessageParam(RequestModel):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessageParam] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    add_generation_prompt: bool = True
    tools: list[dict[str, Any]] | None = None

    def unsupported_fields(self) -> list[str]:
        return [*super().unsupported_fields(), *(["tools"] if self.tools else [])]


class TokenizeRequest(RequestModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessageParam] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[int]


# -- responses ----------------------------------------------------------------------------------------
def now() -> int:
    return int(time.time())


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> UsageInfo:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        )


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    """A completion, or (with `usage` None until the last one) one chunk of a streamed completion."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    system_fingerprint: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatLogprobToken(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatLogprobToken] | None
    refusal: list[ChatLogprobToken] | None = None


class ChatMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    refusal: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now)
    model: str
    system_fingerprint: str
    choices: list[ChatChoice]
    usage: UsageInfo


class ChatChunkChoice(BaseModel):
    index: int
    # OpenAI sends {"role": "assistant", "content": ""} first, then {"content": ...}, and {} at the end.
    delta: dict[str, str]
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=now)
    model: str
    system_fingerprint: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "strata"
    root: str
    parent: str | None = None
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class OpenAIError(Exception):
    """Raised anywhere in request handling; the app turns it into an `ErrorResponse` with `status`."""

    _TYPES: ClassVar[dict[int, str]] = {503: "service_unavailable", 500: "server_error"}

    def __init__(
        self, status: int, message: str, param: str | None = None, code: int | str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def response(self) -> ErrorResponse:
        error_type = self._TYPES.get(self.status, "invalid_request_error")
        return ErrorResponse(
            error=ErrorInfo(message=self.message, type=error_type, param=self.param, code=self.code)
        )


def error_body(status: int, message: str, param: str | None = None, code: Any = None) -> dict[str, Any]:
    return OpenAIError(status, message, param, code).response().model_dump()
