"""What `strata serve` was configured with, shared by the app, its guard and the request handlers."""

from __future__ import annotations

from dataclasses import dataclass, field

# The largest request body read: a bigger one is refused (413) as soon as its size is known or exceeded.
MAX_BODY_BYTES = 32 * 1024 * 1024
# One request's sequences (its prompts x n): past this it is a 400, so no single request can queue the
# thousands of sequences that would hold the engine for minutes.
DEFAULT_MAX_SEQUENCES_PER_REQUEST = 1024


@dataclass
class ServerConfig:
    model_path: str
    model_names: list[str]
    api_key: str | None = None
    chat_template: str | None = None
    max_sequences_per_request: int = DEFAULT_MAX_SEQUENCES_PER_REQUEST
    # How tool calls are found in free output (`tool_choice: "auto"`); None refuses "auto".
    tool_call_parser: str | None = None
    max_body_bytes: int = MAX_BODY_BYTES
    shutting_down: bool = field(default=False, init=False)
