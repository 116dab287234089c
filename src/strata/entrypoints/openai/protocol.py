"""Request and response bodies of the OpenAI API, field for field, plus vLLM's sampling extensions.

Requests are strict: a field Strata does not know is a 400 naming it (never silently ignored), and types
are not coerced (`true` is not a number, `"yes"` is not a boolean). Every string must be valid Unicode
(no lone surrogates, which no tokenizer can encode). Responses are built from these models so their shape
cannot drift from OpenAI's schema.
"""

from __future__ import annotations

import re
import time
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from strata.sampling_params import SamplingParams, SamplingParamsError, StructuredOutputsParams

# OpenAI's own limits: at most 128 choices per request and 20 top logprobs per token.
MAX_N = 128
MAX_TOP_LOGPROBS = 20


def _valid_unicode(value: str) -> str:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"holds a lone surrogate (U+{ord(value[exc.start]):04X}) at character {exc.start}, which is not "
            "valid Unicode text"
        ) from None
    return value


# A string of a request: JSON's "\ud800" escapes can smuggle in lone surrogates, which are not text.
Text = Annotated[str, AfterValidator(_valid_unicode)]


class RequestModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        """OpenAI takes null for any optional field as "use the default", and clients send such nulls."""
        if isinstance(data, dict):
            return {key: value for key, value in data.items() if value is not None}
        return data


class StreamOptions(RequestModel):
    include_usage: bool = False
    # vLLM's extension: usage in every chunk, not only in a final one.
    continuous_usage_stats: bool = False


class JsonSchemaFormat(RequestModel):
    """`response_format.json_schema`: the schema the output must match. Strata always enforces it, so
    `strict` is accepted either way."""

    name: Text | None = None
    description: Text | None = None
    json_schema: dict[Text, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(RequestModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


# vLLM's older per-field constraints -> the `StructuredOutputsParams` field each sets.
GUIDED_FIELDS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


class SamplingRequest(RequestModel):
    """Fields shared by completions and chat completions; `None` means the engine's default."""

    model: Text | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: Text | list[Text] | None = None
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
    user: Text | None = None
    # token id (a decimal string, as JSON keys are) -> bias added to its logit
    logit_bias: dict[Text, float] | None = None
    # vLLM's extensions
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    truncate_prompt_tokens: int | None = Field(default=None, ge=1)
    return_tokens_as_token_ids: bool = False
    add_special_tokens: bool = True
    allowed_token_ids: list[int] | None = None
    bad_words: list[Text] | None = None
    # Output constraints: OpenAI's response_format, vLLM's structured_outputs and guided_* (one at most).
    response_format: ResponseFormat | None = None
    structured_outputs: dict[Text, Any] | None = None
    guided_json: dict[Text, Any] | Text | None = None
    guided_regex: Text | None = None
    guided_choice: list[Text] | None = None
    guided_grammar: Text | None = None

    def unsupported_fields(self) -> list[str]:
        """Fields whose value would change the output but that the engine cannot honour yet."""
        return []

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats

    def output_constraint(self) -> tuple[str, dict[str, Any]] | None:
        """(request field, `StructuredOutputsParams` fields) of the request's output constraint, or None."""
        found: list[tuple[str, dict[str, Any]]] = []
        if self.response_format is not None and self.response_format.type != "text":
            # OpenAI's JSON modes come without free whitespace between tokens: a small model can otherwise
            # spend its whole budget on newlines and leave the JSON unfinished.
            schema = self.response_format.json_schema
            if self.response_format.type == "json_object":
                found.append(("response_format", {"json_object": True, "disable_any_whitespace": True}))
            elif schema is None or schema.json_schema is None:
                raise SamplingParamsError("response_format of type json_schema needs json_schema.schema")
            else:
                found.append(
                    ("response_format", {"json": schema.json_schema, "disable_any_whitespace": True})
                )
        if self.structured_outputs is not None:
            found.append(("structured_outputs", dict(self.structured_outputs)))
        found.extend(
            (name, {kind: value})
            for name, kind in GUIDED_FIELDS.items()
            if (value := getattr(self, name)) is not None
        )
        if len(found) > 1:
            names = ", ".join(name for name, _ in found)
            raise SamplingParamsError(f"{found[0][0]} is one of several output constraints ({names})")
        return found[0] if found else None

    def to_sampling_params(
        self, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None = None
    ) -> SamplingParams:
        """Build validated SamplingParams (raises SamplingParamsError naming the field). A constraint's
        grammar is compiled here, so callers run this off the event loop."""
        structured = None
        if (constraint := self.output_constraint()) is not None:
            field, spec = constraint
            try:
                structured = StructuredOutputsParams.from_dict(spec)
            except SamplingParamsError as exc:
                raise SamplingParamsError(f"{field} is invalid: {exc}") from exc
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
            logit_bias=self.logit_bias,
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words,
            structured_outputs=structured,
            **optional,
        )


class CompletionRequest(SamplingRequest):
    prompt: Text | list[int] | list[Text] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    suffix: Text | None = None
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
    type: Text
    text: Text | None = None


class FunctionCallParam(RequestModel):
    name: Text
    arguments: Text  # JSON text, as the model wrote it


class ToolCallParam(RequestModel):
    """A call the assistant made earlier in the conversation, sent back with the history."""

    id: Text
    type: Literal["function"] = "function"
    function: FunctionCallParam


class ChatMessageParam(RequestModel):
    role: Text
    content: Text | list[ContentPart] | None = None
    name: Text | None = None
    tool_calls: list[ToolCallParam] | None = None
    # A tool message answers the call with this id.
    tool_call_id: Text | None = None


def _function_name(name: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", name):
        raise ValueError(f"must be 1 to 64 letters, digits, underscores or dashes, got {name!r}")
    return name


class FunctionDefinition(RequestModel):
    name: Annotated[Text, AfterValidator(_function_name)]
    description: Text | None = None
    # The JSON schema of the arguments; none means a function without parameters.
    parameters: dict[Text, Any] | None = None
    # The arguments of a forced call always match `parameters`; `strict` is accepted either way.
    strict: bool | None = None


class ChatTool(RequestModel):
    type: Literal["function"]
    function: FunctionDefinition

    @property
    def parameters(self) -> dict[str, Any]:
        return self.function.parameters or {"type": "object", "properties": {}}


class NamedFunction(RequestModel):
    name: Text


class NamedToolChoice(RequestModel):
    type: Literal["function"]
    function: NamedFunction


class ChatTemplateFields(RequestModel):
    """How messages are rendered: the chat template and vLLM's per-request controls of it."""

    add_generation_prompt: bool = True
    # Leave the last (assistant) message open, so the model continues it; excludes add_generation_prompt.
    continue_final_message: bool = False
    chat_template: Text | None = None
    chat_template_kwargs: dict[Text, Any] | None = None
    # The template writes the special tokens it wants; the tokenizer adds none of its own by default.
    add_special_tokens: bool = False


class ChatCompletionRequest(ChatTemplateFields, SamplingRequest):
    messages: list[ChatMessageParam] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    # Put the last message's content in front of the reply when that message is the assistant's.
    echo: bool = False
    tools: list[ChatTool] | None = None
    # Default: "auto" with tools, "none" without.
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    def output_constraint(self) -> tuple[str, dict[str, Any]] | None:
        """A forced tool call (`required` or a named function) constrains the output like
        `response_format` does, and excludes it."""
        found = super().output_constraint()
        forced = self.forced_tool_calls()
        if forced is None:
            return found
        if found is not None:
            raise SamplingParamsError(
                f"tool_choice forces a tool call, so {found[0]} cannot also constrain the output"
            )
        return "tool_choice", {"json": forced, "disable_any_whitespace": True}

    def forced_tool_calls(self) -> dict[str, Any] | None:
        """The JSON schema the output must match when a call is forced: a named function's parameters
        (the output is its arguments), or for `required` a list of `{"name", "arguments"}` calls of the
        listed tools (one at most without `parallel_tool_calls`); None when nothing is forced."""
        tools = self.tools or []
        if isinstance(self.tool_choice, NamedToolChoice):
            name = self.tool_choice.function.name
            for tool in tools:
                if tool.function.name == name:
                    return tool.parameters
            raise SamplingParamsError(f"tool_choice names {name!r}, which is not in tools")
        if self.tool_choice != "required":
            return None
        calls = [
            {
                "type": "object",
                "properties": {"name": {"const": tool.function.name}, "arguments": tool.parameters},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for tool in tools
        ]
        schema: dict[str, Any] = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
        if not self.parallel_tool_calls:
            schema["maxItems"] = 1
        return schema


class TokenizeRequest(ChatTemplateFields):
    model: Text | None = None
    prompt: Text | None = None
    messages: list[ChatMessageParam] | None = None
    # Default: true for a prompt, false for messages (whose template writes its own special tokens).
    add_special_tokens: bool | None = None  # type: ignore[assignment]


class DetokenizeRequest(RequestModel):
    model: Text | None = None
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


class PromptLogprob(BaseModel):
    """vLLM's entry of `prompt_logprobs`, keyed by token id."""

    logprob: float
    rank: int | None
    decoded_token: str | None


PromptLogprobs = list[dict[int, PromptLogprob] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    prompt_logprobs: PromptLogprobs | None = None
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


class FunctionCall(BaseModel):
    name: str
    arguments: str


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    refusal: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


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
    prompt_logprobs: PromptLogprobs | None = None


class ChatChunkChoice(BaseModel):
    index: int
    # OpenAI sends {"role": "assistant", "content": ""} first, then {"content": ...} or {"tool_calls":
    # [...]}, and {} at the end.
    delta: dict[str, Any]
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
