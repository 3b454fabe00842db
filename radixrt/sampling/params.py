"""`SamplingParams`: how one request generates, in SGLang's names and defaults.

Users carry their `sampling_params` dicts over from SGLang unchanged. This
module is plain Python (no torch), so building and validating parameters is
cheap in any thread; `radixrt.sampling.sampler` turns them into tokens.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

# Temperatures below this sample greedily: dividing logits by them overflows
# float32 (SGLang uses the same cut-off).
GREEDY_TEMPERATURE = 1e-5


def _number(name: str, value: Any, accepted: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number {accepted}, got {value!r}")
    return float(value)


def _int(name: str, value: Any, accepted: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int {accepted}, got {value!r}")
    return value


def _bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")


def _normalise_stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    items = (value,) if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(s, str) and s for s in items):
        raise ValueError(f"stop must be a non-empty string or a list of non-empty strings, got {value!r}")
    return tuple(items)


def _normalise_stop_token_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if not isinstance(value, (list, tuple)) or not all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value
    ):
        raise ValueError(f"stop_token_ids must be a list of token ids (ints >= 0), got {value!r}")
    return tuple(value)


# The output constraints, SGLang's names; a request takes at most one (radixrt.sampling.grammar).
CONSTRAINT_FIELDS = ("regex", "json_schema", "ebnf", "structural_tag")


def _normalise_json_schema(value: Any) -> str | None:
    """A JSON Schema as canonical text: a dict is serialised, a string must parse to an object."""
    if value is None:
        return None
    if isinstance(value, Mapping):
        try:
            value = json.dumps(value)
        except (TypeError, ValueError) as error:
            raise ValueError(f"json_schema must be JSON-serialisable: {error}") from None
    elif not isinstance(value, str):
        raise ValueError(f"json_schema must be a JSON Schema as a dict or a JSON string, got {type(value).__name__}")
    try:
        parsed = json.loads(value)
    except ValueError as error:
        raise ValueError(f"json_schema is not valid JSON: {error}") from None
    if not isinstance(parsed, dict):
        raise ValueError(f"json_schema must be a JSON object (a schema), got {type(parsed).__name__}")
    if not parsed:
        raise ValueError('json_schema is empty: give a schema, e.g. {"type": "object"} for any JSON object')
    return value


@dataclass(frozen=True)
class SamplingParams:
    """How one request generates: SGLang's sampling parameters and defaults.

    Frozen, because one object is shared by the `n` samples of a request and
    by every `gen` of a program; use `dataclasses.replace` for a variant.
    `stop` and `stop_token_ids` are normalised to tuples (empty when None).
    Construction validates everything that needs no model; `validate(vocab_size)`
    adds the checks that do.
    """

    max_new_tokens: int | None = 128  # None: as many as the context and the KV pool leave
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()  # also accepts a string or a list; normalised to a tuple
    stop_token_ids: tuple[int, ...] = ()  # also accepts a list
    ignore_eos: bool = False
    n: int = 1
    return_logprob: bool = False
    top_logprobs_num: int = 0
    skip_special_tokens: bool = True
    # Output constraints (docs/structured.md): at most one of them.
    regex: str | None = None
    json_schema: str | None = None  # also accepts a dict; kept as JSON text
    ebnf: str | None = None
    structural_tag: str | None = None  # SGLang's structural tag, as JSON text (or a dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "json_schema", _normalise_json_schema(self.json_schema))
        if isinstance(self.structural_tag, Mapping):
            object.__setattr__(self, "structural_tag", json.dumps(self.structural_tag))
        object.__setattr__(self, "stop", _normalise_stop(self.stop))
        object.__setattr__(self, "stop_token_ids", _normalise_stop_token_ids(self.stop_token_ids))
        self.validate()

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ValueError naming the first field outside its accepted range."""
        if self.max_new_tokens is not None and _int("max_new_tokens", self.max_new_tokens, ">= 0 or None") < 0:
            raise ValueError(f"max_new_tokens must be >= 0 (0 scores the prompt only), got {self.max_new_tokens}")
        if _number("temperature", self.temperature, ">= 0") < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < _number("top_p", self.top_p, "in (0, 1]") <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        top_k = _int("top_k", self.top_k, "(-1 = off, or >= 1)")
        if top_k != -1 and top_k < 1:
            raise ValueError(f"top_k must be -1 (off) or >= 1, got {top_k}")
        if not 0 <= _number("min_p", self.min_p, "in [0, 1]") <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2 <= _number(name, getattr(self, name), "in [-2, 2]") <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if _number("repetition_penalty", self.repetition_penalty, "> 0") <= 0:
            raise ValueError(f"repetition_penalty must be > 0 (1 = off), got {self.repetition_penalty}")
        if self.seed is not None:
            _int("seed", self.seed, "or None")
        if _int("n", self.n, ">= 1") < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if not 0 <= _int("top_logprobs_num", self.top_logprobs_num, "in [0, 20]") <= 20:
            raise ValueError(f"top_logprobs_num must be in [0, 20], got {self.top_logprobs_num}")
        for name in ("ignore_eos", "return_logprob", "skip_special_tokens"):
            _bool(name, getattr(self, name))
        given = [name for name in CONSTRAINT_FIELDS if getattr(self, name) is not None]
        for name in given:
            if not isinstance(getattr(self, name), str) or not getattr(self, name).strip():
                raise ValueError(f"{name} must be a non-empty string, got {getattr(self, name)!r}")
        if len(given) > 1:
            raise ValueError(f"give at most one output constraint of {', '.join(CONSTRAINT_FIELDS)}; got {', '.join(given)}")
        if given and self.max_new_tokens == 0:
            raise ValueError(f"{given[0]} constrains generated tokens: max_new_tokens must be >= 1 with it, got 0")
        if vocab_size is not None:
            bad = [t for t in self.stop_token_ids if t >= vocab_size]
            if bad:
                raise ValueError(f"stop_token_ids must be in [0, {vocab_size}), got {bad}")

    @classmethod
    def from_any(cls, value: SamplingParams | Mapping[str, Any] | None) -> SamplingParams:
        """Accept what users pass as `sampling_params`: None (defaults), a dict, or an instance."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, Mapping):
            unknown = sorted(map(str, set(value) - _FIELD_NAMES))
            if unknown:
                raise ValueError(
                    f"unknown sampling parameter(s) {', '.join(unknown)}; accepted: {', '.join(sorted(_FIELD_NAMES))}"
                )
            return cls(**value)
        raise ValueError(f"sampling_params must be None, a dict or SamplingParams, got {type(value).__name__}")

    @property
    def token_limit(self) -> int:
        """`max_new_tokens` once resolved for a prompt (the runtime resolves None at submission)."""
        if self.max_new_tokens is None:
            raise ValueError("max_new_tokens is None: resolve it for the prompt first (InputProcessor does)")
        return self.max_new_tokens

    @property
    def constraint(self) -> tuple[str, str] | None:
        """(field name, text) of the request's output constraint, or None."""
        for name in CONSTRAINT_FIELDS:
            value = getattr(self, name)
            if value is not None:
                return name, value
        return None

    @property
    def is_greedy(self) -> bool:
        """True when sampling can only pick the top token (a temperature below GREEDY_TEMPERATURE,
        or top_k 1): the sampler then takes an argmax, with no softmax and no random draw."""
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1


_FIELD_NAMES = frozenset(f.name for f in fields(SamplingParams))
