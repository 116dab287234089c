"""Per-request sampling parameters, with vLLM's field names, defaults and validation rules."""

from __future__ import annotations

import copy
import enum
import math
from dataclasses import dataclass
from numbers import Integral, Real
from typing import Any

# Temperatures below this are treated as greedy decoding, as in vLLM.
SAMPLING_EPS = 1e-5

# torch.Generator.manual_seed accepts any value representable as int64 or uint64.
_MIN_SEED = -(2**63)
_MAX_SEED = 2**64 - 1


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
        if not isinstance(stop_token_ids, list | tuple):
            raise SamplingParamsTypeError(
                f"stop_token_ids must be None or a list of int, got "
                f"{_type_name(stop_token_ids)} {stop_token_ids!r}"
            )
        result = [_check_int("stop_token_ids", token_id) for token_id in stop_token_ids]
        for token_id in result:
            if token_id < 0:
                raise SamplingParamsError(f"stop_token_ids must contain ints >= 0, got {token_id}")
        return result

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

    def bans_stop_tokens(self, num_output_tokens: int) -> bool:
        """Before `min_tokens` outputs, EOS and `stop_token_ids` may not be sampled."""
        return num_output_tokens < self.min_tokens

    def clone(self) -> SamplingParams:
        """Deep copy, so per-request tweaks (e.g. resolving max_tokens) never leak into a shared object."""
        return copy.deepcopy(self)
