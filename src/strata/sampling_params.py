"""Per-request sampling parameters, with vLLM's field names, defaults and validation rules."""

from __future__ import annotations

import copy
import enum
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from numbers import Integral, Real
from typing import Any

# Temperatures below this are treated as greedy decoding, as in vLLM.
SAMPLING_EPS = 1e-5

# torch.Generator.manual_seed accepts any value representable as int64 or uint64.
_MIN_SEED = -(2**63)
_MAX_SEED = 2**64 - 1

# The kinds of StructuredOutputsParams, exactly one of which a request sets.
_STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")

# What names a compiled grammar: (kind, spec text, JSON whitespace: None default, "" none, else a regex).
GrammarKey = tuple[str, str, str | None]

# vLLM's (and OpenAI's) range for one logit bias.
_MAX_LOGIT_BIAS = 100.0


class SamplingParamsError(ValueError):
    """A sampling parameter has a value outside its allowed range."""


class SamplingParamsTypeError(SamplingParamsError, TypeError):
    """A sampling parameter has the wrong type (still a ValueError, so one `except` catches both)."""


class SamplingType(enum.IntEnum):
    """How the sampler picks a request's next token."""

    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


def _type_name(value: object) -> str:
    return type(value).__name__


def _check_int(name: str, value: Any) -> int:
    # bool is an int subclass, but `max_tokens=True` is always a caller bug.
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise SamplingParamsTypeError(f"{name} must be an int, got {_type_name(value)} {value!r}")
    return int(value)


def _check_float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, Real):
        raise SamplingParamsTypeError(f"{name} must be a float, got {_type_name(value)} {value!r}")
    result = float(value)
    if not math.isfinite(result):
        raise SamplingParamsError(f"{name} must be a finite number, got {value!r}")
    return result


def _check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise SamplingParamsTypeError(f"{name} must be a bool, got {_type_name(value)} {value!r}")
    return value


def _check_logprobs(name: str, value: Any) -> int | None:
    if value is None:
        return None
    result = _check_int(name, value)
    if result < -1:
        raise SamplingParamsError(f"{name} must be None, -1 (whole vocabulary) or an int >= 0, got {result}")
    return result


@dataclass
class StructuredOutputsParams:
    """Constrains a request's output to a JSON schema, a regex, a list of choices or a grammar (vLLM's
    `StructuredOutputsParams`). Exactly one of `json`, `regex`, `choice`, `grammar` and `json_object` is
    given; the spec is checked by the grammar engine on construction, so an invalid schema, regex or grammar
    is a `SamplingParamsError` naming the problem.

    `json` is a JSON schema (a dict or its JSON text), `grammar` an EBNF (GBNF) or Lark grammar,
    `json_object=True` any JSON object. `disable_any_whitespace` allows no whitespace between JSON tokens;
    `whitespace_pattern` (a regex) replaces the default whitespace between them.
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        given = [name for name in _STRUCTURED_KINDS if self._is_set(name)]
        if len(given) != 1:
            raise SamplingParamsError(
                "structured_outputs must set exactly one of json, regex, choice, grammar or json_object, got "
                + (", ".join(given) if given else "none")
            )
        if self.json is not None:
            self.json = _check_json_schema(self.json)
        for name in ("regex", "grammar", "whitespace_pattern"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise SamplingParamsTypeError(
                    f"structured_outputs.{name} must be a non-empty str, got {_type_name(value)} {value!r}"
                )
        if self.choice is not None:
            self.choice = _check_str_list("structured_outputs.choice", self.choice)
        if self.json_object is not None:
            _check_bool("structured_outputs.json_object", self.json_object)
        _check_bool("structured_outputs.disable_any_whitespace", self.disable_any_whitespace)
        # Imported here: that module imports this one, and loads the grammar engine only when it is used.
        from strata.structured_output.grammar import grammar_text

        grammar_text(self.key)  # compiles to the engine's grammar format once, and raises if invalid

    def _is_set(self, name: str) -> bool:
        value = getattr(self, name)
        return value is not None and value is not False

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> StructuredOutputsParams:
        """Built from a request body's dict (the server's `structured_outputs`), unknown keys refused."""
        allowed = {f.name for f in fields(cls)}
        unknown = set(values) - allowed
        if unknown:
            raise SamplingParamsError(
                f"structured_outputs: unknown keys {sorted(unknown)}; allowed are {', '.join(sorted(allowed))}"
            )
        return cls(**values)

    @property
    def kind(self) -> str:
        """Which constraint this is: "json", "regex", "choice", "grammar" or "json_object"."""
        return next(name for name in _STRUCTURED_KINDS if self._is_set(name))

    @property
    def key(self) -> GrammarKey:
        """(kind, spec text, JSON whitespace) that names the compiled grammar: equal keys share one."""
        kind = self.kind
        spec: Any = getattr(self, kind)
        text = spec if isinstance(spec, str) else json.dumps(spec)  # insertion order kept: it orders output
        whitespace = "" if self.disable_any_whitespace else self.whitespace_pattern
        return kind, text, whitespace


def _check_json_schema(schema: Any) -> dict[str, Any] | str:
    """A dict, or JSON text holding an object (kept as given: the text is the cache key)."""
    if isinstance(schema, str):
        try:
            parsed = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise SamplingParamsError(f"structured_outputs.json is not valid JSON: {exc}") from exc
        if not isinstance(parsed, dict | bool):
            raise SamplingParamsError(
                f"structured_outputs.json must be a JSON schema object, got {_type_name(parsed)}"
            )
        return schema
    if not isinstance(schema, dict):
        raise SamplingParamsTypeError(
            f"structured_outputs.json must be a dict or a JSON string, got {_type_name(schema)} {schema!r}"
        )
    try:
        json.dumps(schema)
    except (TypeError, ValueError) as exc:
        raise SamplingParamsTypeError(f"structured_outputs.json must be JSON-serialisable: {exc}") from exc
    return schema


def _check_str_list(name: str, value: Any) -> list[str]:
    if not isinstance(value, list | tuple) or not value:
        raise SamplingParamsTypeError(
            f"{name} must be a non-empty list of str, got {_type_name(value)} {value!r}"
        )
    for item in value:
        if not isinstance(item, str) or not item:
            raise SamplingParamsTypeError(f"{name} must hold non-empty str, got {_type_name(item)} {item!r}")
    return list(value)


@dataclass
class SamplingParams:
    """Sampling parameters for one request; validated and normalised on construction.

    `stop` and `stop_token_ids` are always lists after construction, `top_k` is 0 when disabled
    (-1 is accepted as vLLM does), and greedy requests (temperature < 1e-5) have top_p/top_k/min_p
    reset to their disabled values because they cannot affect an argmax.
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsParams | None = None
    # token id -> added to its logit, in [-100, 100] (ids as ints or decimal strings, as JSON gives them).
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None

    def __post_init__(self) -> None:
        self.n = _check_int("n", self.n)
        if self.n < 1:
            raise SamplingParamsError(f"n must be >= 1, got {self.n}")

        for name in ("presence_penalty", "frequency_penalty"):
            value = _check_float(name, getattr(self, name))
            if not -2.0 <= value <= 2.0:
                raise SamplingParamsError(f"{name} must be in [-2, 2], got {value}")
            setattr(self, name, value)

        self.repetition_penalty = _check_float("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0.0:
            raise SamplingParamsError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")

        self.temperature = _check_float("temperature", self.temperature)
        if self.temperature < 0.0:
            raise SamplingParamsError(f"temperature must be >= 0, got {self.temperature}")

        self.top_p = _check_float("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingParamsError(f"top_p must be in (0, 1], got {self.top_p}")

        self.top_k = _check_int("top_k", self.top_k)
        if self.top_k < -1:
            raise SamplingParamsError(f"top_k must be -1 or 0 (disabled) or >= 1, got {self.top_k}")
        if self.top_k == -1:
            self.top_k = 0

        self.min_p = _check_float("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise SamplingParamsError(f"min_p must be in [0, 1], got {self.min_p}")

        if self.seed is not None:
            self.seed = _check_int("seed", self.seed)
            if not _MIN_SEED <= self.seed <= _MAX_SEED:
                raise SamplingParamsError(f"seed must be in [-2**63, 2**64 - 1], got {self.seed}")

        self.stop = self._normalise_stop(self.stop)
        self.stop_token_ids = self._normalise_stop_token_ids(self.stop_token_ids)

        if self.max_tokens is not None:
            self.max_tokens = _check_int("max_tokens", self.max_tokens)
            if self.max_tokens < 1:
                raise SamplingParamsError(f"max_tokens must be None or >= 1, got {self.max_tokens}")
        self.min_tokens = _check_int("min_tokens", self.min_tokens)
        if self.min_tokens < 0:
            raise SamplingParamsError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise SamplingParamsError(
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"
            )

        self.logprobs = _check_logprobs("logprobs", self.logprobs)
        self.prompt_logprobs = _check_logprobs("prompt_logprobs", self.prompt_logprobs)

        for name in (
            "ignore_eos",
            "detokenize",
            "skip_special_tokens",
            "spaces_between_special_tokens",
            "include_stop_str_in_output",
        ):
            _check_bool(name, getattr(self, name))

        if isinstance(self.structured_outputs, Mapping):
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
        elif self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputsParams
        ):
            raise SamplingParamsTypeError(
                "structured_outputs must be None, a StructuredOutputsParams or a dict, got "
                f"{_type_name(self.structured_outputs)} {self.structured_outputs!r}"
            )
        self.logit_bias = self._normalise_logit_bias(self.logit_bias)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = self._normalise_token_ids("allowed_token_ids", self.allowed_token_ids)
            if not self.allowed_token_ids:
                raise SamplingParamsError("allowed_token_ids must be None or a non-empty list of int")
        if self.bad_words is not None:
            self.bad_words = _check_str_list("bad_words", self.bad_words)

        if self.temperature < SAMPLING_EPS:
            # Greedy: these cannot change an argmax, and resetting them lets the sampler skip stages.
            self.top_p = 1.0
            self.top_k = 0
            self.min_p = 0.0

    @staticmethod
    def _normalise_stop(stop: Any) -> list[str]:
        if stop is None:
            return []
        items = [stop] if isinstance(stop, str) else stop
        if not isinstance(items, list | tuple):
            raise SamplingParamsTypeError(
                f"stop must be None, a str or a list of str, got {_type_name(stop)} {stop!r}"
            )
        for item in items:
            if not isinstance(item, str):
                raise SamplingParamsTypeError(f"stop must contain only str, got {_type_name(item)} {item!r}")
            if not item:
                raise SamplingParamsError("stop strings must be non-empty (length >= 1), got ''")
        return list(items)

    @staticmethod
    def _normalise_stop_token_ids(stop_token_ids: Any) -> list[int]:
        if stop_token_ids is None:
            return []
        return SamplingParams._normalise_token_ids("stop_token_ids", stop_token_ids)

    @staticmethod
    def _normalise_token_ids(name: str, token_ids: Any) -> list[int]:
        if not isinstance(token_ids, list | tuple):
            raise SamplingParamsTypeError(
                f"{name} must be None or a list of int, got {_type_name(token_ids)} {token_ids!r}"
            )
        result = [_check_int(name, token_id) for token_id in token_ids]
        for token_id in result:
            if token_id < 0:
                raise SamplingParamsError(f"{name} must contain ints >= 0, got {token_id}")
        return result

    @staticmethod
    def _normalise_logit_bias(logit_bias: Any) -> dict[int, float] | None:
        if logit_bias is None:
            return None
        if not isinstance(logit_bias, Mapping):
            raise SamplingParamsTypeError(
                f"logit_bias must be None or a dict of token id -> float, got {_type_name(logit_bias)} {logit_bias!r}"
            )
        result: dict[int, float] = {}
        for key, value in logit_bias.items():
            token_id = int(key) if isinstance(key, str) and key.isdecimal() else key
            token_id = _check_int("logit_bias token id", token_id)
            if token_id < 0:
                raise SamplingParamsError(f"logit_bias token ids must be >= 0, got {token_id}")
            bias = _check_float(f"logit_bias[{token_id}]", value)
            if not -_MAX_LOGIT_BIAS <= bias <= _MAX_LOGIT_BIAS:
                raise SamplingParamsError(f"logit_bias[{token_id}] must be in [-100, 100], got {bias}")
            result[token_id] = bias
        return result

    def check_token_ids(self, vocab_size: int) -> None:
        """allowed_token_ids and logit_bias name ids of the model's vocabulary (known only to the engine)."""
        for name, token_ids in (
            ("allowed_token_ids", self.allowed_token_ids or []),
            ("logit_bias", list(self.logit_bias or {})),
        ):
            outside = [t for t in token_ids if t >= vocab_size]
            if outside:
                raise SamplingParamsError(
                    f"{name} holds token ids outside the vocabulary [0, {vocab_size}): {outside[:5]}"
                )

    @property
    def sampling_type(self) -> SamplingType:
        """GREEDY below SAMPLING_EPS temperature, else RANDOM_SEED when seeded, else RANDOM."""
        if self.temperature < SAMPLING_EPS:
            return SamplingType.GREEDY
        if self.seed is not None:
            return SamplingType.RANDOM_SEED
        return SamplingType.RANDOM

    @property
    def is_greedy(self) -> bool:
        return self.sampling_type is SamplingType.GREEDY

    # What the sampler does to a row beyond picking its token; the sampler's metadata and its greedy
    # shortcut (`plain_greedy`) both decide from these, so the two cannot drift apart.
    @property
    def penalizes_repetition(self) -> bool:
        return self.repetition_penalty != 1.0

    @property
    def penalizes_output(self) -> bool:
        return self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    @property
    def constrains_tokens(self) -> bool:
        """Whether some tokens are masked or biased: structured outputs, allowed/bad tokens, logit_bias."""
        return (
            self.structured_outputs is not None
            or bool(self.logit_bias)
            or self.allowed_token_ids is not None
            or bool(self.bad_words)
        )

    def bans_stop_tokens(self, num_output_tokens: int) -> bool:
        """Before `min_tokens` outputs, EOS and `stop_token_ids` may not be sampled."""
        return num_output_tokens < self.min_tokens

    def clone(self) -> SamplingParams:
        """Deep copy, so per-request tweaks (e.g. resolving max_tokens) never leak into a shared object."""
        return copy.deepcopy(self)
