"""Tool calls in chat completions: how a request's `tool_choice` shapes the output, and how the generated
text becomes OpenAI `tool_calls`, whole or streamed as deltas.

Three ways a choice can call tools:
- `auto`: the model writes freely; the server's `--tool-call-parser` finds the calls in its text
  (`hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks; `json`: the whole reply is
  one such object or a list of them). Text outside the calls is the message's content.
- `required`: the output is constrained to a JSON list of such objects, each naming one of the tools and
  matching its parameters' schema, so the arguments always parse (whatever the parser).
- a named function: the output is constrained to that function's parameters; all of it is the arguments.

Parsers work on the text generated so far, so streaming and whole replies give the same calls: a stream
sends content up to where a call may begin and each call once its text is complete (a named function's
arguments go out as they are generated).
"""

from __future__ import annotations

import json
import re
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from strata.entrypoints.openai.protocol import ChatCompletionRequest, FunctionCall, OpenAIError, ToolCall


@dataclass
class ParsedCall:
    """A call found in the text: its function's name and its arguments as JSON text."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def as_message(self) -> dict[str, Any]:
        return self.tool_call().model_dump()

    def tool_call(self) -> ToolCall:
        return ToolCall(id=self.id, function=FunctionCall(name=self.name, arguments=self.arguments))


@dataclass
class ParsedText:
    """What is known of a reply from its text so far: the content that may be shown (None: none) and the
    calls whose text is complete."""

    content: str | None
    calls: list[ParsedCall]


def _call_from_json(value: Any) -> ParsedCall | None:
    """A call from a decoded `{"name": ..., "arguments"|"parameters": {...}}`, else None."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as JSON text already
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict) or not _is_text(value["name"]):
        return None
    text = json.dumps(arguments, ensure_ascii=False)
    # JSON's "\ud800" escapes decode to lone surrogates, which are not text: those stay escaped.
    return ParsedCall(value["name"], text if _is_text(text) else json.dumps(arguments))


def _is_text(value: str) -> bool:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


_DECODER = json.JSONDecoder()


def _json_calls(text: str, final: bool) -> list[ParsedCall] | None:
    """The complete calls of a reply that is a JSON call object or a list of them; None when the text is
    not (or, before `final`, cannot become) such a reply."""
    stripped = text.strip()
    if not stripped:
        return None if final else []
    if stripped[0] == "{":
        try:
            value, end = _DECODER.raw_decode(stripped)
        except json.JSONDecodeError:
            return None if final else []
        call = _call_from_json(value)
        return [call] if call is not None and end == len(stripped) else None
    if stripped[0] != "[":
        return None
    # A list: its elements one by one, so a stream can send each call as soon as it is complete.
    calls: list[ParsedCall] = []
    position = 1
    while True:
        position = _skip_space(stripped, position)
        if position < len(stripped) and stripped[position] == "]" and not calls:
            return None  # an empty list calls nothing: it is plain content
        try:
            value, position = _DECODER.raw_decode(stripped, position)
        except json.JSONDecodeError:
            return None if final else calls
        call = _call_from_json(value)
        if call is None:
            return None
        calls.append(call)
        position = _skip_space(stripped, position)
        if position == len(stripped):
            return None if final else calls
        if stripped[position] == "]":
            return calls if position == len(stripped) - 1 else None
        if stripped[position] != ",":
            return None
        position += 1


def _skip_space(text: str, position: int) -> int:
    while position < len(text) and text[position].isspace():
        position += 1
    return position


def _content(text: str) -> str | None:
    """Content without the whitespace around it; a stream holds trailing whitespace back, as a call may
    follow it."""
    return text.strip() or None


class ToolCallParser(ABC):
    """Finds a model's tool calls in its text; selected with `strata serve --tool-call-parser NAME`."""

    name: str

    @abstractmethod
    def parse(self, text: str, final: bool) -> ParsedText:
        """The reply as known from `text`. Before `final`, `content` must stop where a call may begin, and
        what it returns must be a prefix of what it returns once the text grows."""


class HermesToolParser(ToolCallParser):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (Hermes, Qwen 2.5/3, and many
    fine-tunes); an unclosed block at the end of a finished reply counts when its JSON is complete."""

    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    _BLOCK = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)

    def parse(self, text: str, final: bool) -> ParsedText:
        outside, calls, position = [], [], 0
        for block in self._BLOCK.finditer(text):
            call = _call_from_json(_loads(block.group(1)))
            if call is None:  # not a call after all: the block stays in the content
                continue
            outside.append(text[position : block.start()])
            calls.append(call)
            position = block.end()
        rest = text[position:]
        open_at = rest.find(self.OPEN)
        if open_at >= 0:
            call = _call_from_json(_loads(rest[open_at + len(self.OPEN) :])) if final else None
            if call is not None:
                calls.append(call)
                rest = rest[:open_at]
            elif not final:
                rest = rest[:open_at]
        elif not final:
            rest = rest[: len(rest) - _partial_marker(rest, self.OPEN)]
        outside.append(rest)
        return ParsedText(_content("".join(outside)), calls)


class JsonToolParser(ToolCallParser):
    """A reply that is one JSON call object or a list of them (Llama 3's JSON tool format, and what
    `required` constrains to); any other reply is content.

    Free text can turn out not to be calls after all (more text after the JSON), so its calls are known
    only once it is final; `incremental` (for output constrained to a list of calls) sends each list
    element as soon as it is complete, and a list cut short (at max_tokens) keeps its complete calls."""

    name = "json"

    def __init__(self, incremental: bool = False) -> None:
        self.incremental = incremental

    def parse(self, text: str, final: bool) -> ParsedText:
        calls = _json_calls(text, final and not self.incremental)
        if calls is None:
            return ParsedText(_content(text), [])
        return ParsedText(None, calls if final or self.incremental else [])


TOOL_CALL_PARSERS: dict[str, type[ToolCallParser]] = {p.name: p for p in (HermesToolParser, JsonToolParser)}


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def _partial_marker(text: str, marker: str) -> int:
    """How many characters at the end of `text` could be the start of `marker`."""
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0


# -- a request's tool calling -----------------------------------------------------------------------------
class ToolCalling:
    """One chat request's tool calling: each choice's text parsed into content and calls (a forced call's
    output constraint is the request's own, `ChatCompletionRequest.forced_tool_calls`)."""

    def __init__(self, request: ChatCompletionRequest, parser: ToolCallParser, named: str | None) -> None:
        self.request = request
        self.parser = parser
        self.named = named  # the forced function's name, whose arguments are the whole output

    @classmethod
    def for_request(cls, request: ChatCompletionRequest, parser_name: str | None) -> ToolCalling | None:
        """The request's tool calling, None when it calls none; a 400 for a choice it cannot honour."""
        choice = request.tool_choice
        if not request.tools:
            if choice is not None and choice != "none":
                raise OpenAIError(400, "tool_choice needs tools: this request lists none", "tool_choice")
            return None
        names = [tool.function.name for tool in request.tools]
        if len(set(names)) != len(names):
            raise OpenAIError(400, "tools holds two functions of the same name", "tools")
        choice = choice or "auto"
        if choice == "none":
            return None
        if choice == "auto":
            if parser_name is None:
                raise OpenAIError(
                    400,
                    'tool_choice "auto" needs a tool call parser: start the server with --tool-call-parser '
                    f'({" or ".join(TOOL_CALL_PARSERS)}), or ask for "required" or a named function',
                    "tool_choice",
                )
            return cls(request, TOOL_CALL_PARSERS[parser_name](), None)
        if choice == "required":
            return cls(request, JsonToolParser(incremental=True), None)
        if choice.function.name not in names:
            raise OpenAIError(
                400, f"tool_choice names {choice.function.name!r}, which is not in tools", "tool_choice"
            )
        return cls(request, JsonToolParser(), choice.function.name)

    def parse(self, text: str, final: bool) -> ParsedText:
        """Content and calls of a choice's text so far."""
        if self.named is not None:
            # The forced function's arguments are the whole output; they stream as they are generated.
            return ParsedText(None if final else "", [ParsedCall(self.named, text)])
        parsed = self.parser.parse(text, final)
        if not self.request.parallel_tool_calls:
            parsed.calls = parsed.calls[:1]
        return parsed

    def finish_reason(self, calls: list[ParsedCall], reason: str | None) -> str | None:
        """OpenAI's finish reason: `tool_calls` when the model chose to call (a forced function ends with
        `stop`, as OpenAI's does), the engine's own otherwise."""
        return "tool_calls" if calls and reason == "stop" and self.named is None else reason

    def streamer(self) -> ToolCallStream:
        return ToolCallStream(self)


class ToolCallStream:
    """One streamed choice: turns the growing text into content and `tool_calls` deltas."""

    def __init__(self, calling: ToolCalling) -> None:
        self.calling = calling
        self.text = ""
        self.sent_content = ""
        self.sent_calls: list[ParsedCall] = []
        self.sent_arguments = 0  # of a named function's arguments, which stream as they grow
        self.calls: list[ParsedCall] = []

    def feed(self, text: str, final: bool) -> dict[str, Any]:
        """The delta for `text` (the next part of the output): content and/or tool_calls, maybe empty."""
        self.text += text
        parsed = self.calling.parse(self.text, final)
        self.calls = parsed.calls
        delta: dict[str, Any] = {}
        content = parsed.content or ""
        if content.startswith(self.sent_content) and len(content) > len(self.sent_content):
            delta["content"] = content[len(self.sent_content) :]
            self.sent_content = content
        tool_deltas = self._call_deltas(parsed.calls)
        if tool_deltas:
            delta["tool_calls"] = tool_deltas
        return delta

    def _call_deltas(self, calls: list[ParsedCall]) -> list[dict[str, Any]]:
        if self.calling.named is not None:
            [call] = calls
            deltas = []
            if not self.sent_calls:
                self.sent_calls.append(call)
                deltas.append(
                    {"index": 0, **call.as_message(), "function": {"name": call.name, "arguments": ""}}
                )
            # The same call, id included, however the text grew.
            call.id = self.sent_calls[0].id
            if len(call.arguments) > self.sent_arguments:
                deltas.append({"index": 0, "function": {"arguments": call.arguments[self.sent_arguments :]}})
                self.sent_arguments = len(call.arguments)
            return deltas
        new = calls[len(self.sent_calls) :]
        # A re-parse makes new ids: the ids sent before are the calls' ids.
        for sent, call in zip(self.sent_calls, calls, strict=False):
            call.id = sent.id
        deltas = [{"index": len(self.sent_calls) + i, **call.as_message()} for i, call in enumerate(new)]
        self.sent_calls.extend(new)
        return deltas
