"""`SamplingParams`: how one request generates, in SGLang's names and defaults.

Users carry their `sampling_params` dicts over from SGLang unchanged. This
module is plain Python (no torch), so building and validating parameters is
cheap in any thread; `radixrt.sampling.sampler` turns them into tokens.
"""

from __future__ import annotations

import json
import math
import re
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


def _normalise_stop_regex(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    items = (value,) if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(s, str) and s for s in items):
        raise ValueError(f"stop_regex must be a non-empty regular expression or a list of them, got {value!r}")
    for pattern in items:
        try:
            compiled = re.compile(pattern)
        except re.error as error:
            raise ValueError(f"stop_regex: {pattern!r} is not a valid Python regular expression: {error}") from None
        if compiled.match(""):
            raise ValueError(f"stop_regex: {pattern!r} matches the empty text, so it would end every request at once")
    return tuple(items)


# OpenAI's range for a logit bias; SGLang takes the same dicts.
LOGIT_BIAS_RANGE = 100.0


def _normalise_logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    """{token id (int, or its decimal string as JSON keys are): bias} as sorted (id, bias) pairs."""
    if value is None:
        return ()
    if isinstance(value, tuple) and all(isinstance(p, tuple) and len(p) == 2 for p in value):
        value = dict(value)
    if not isinstance(value, Mapping):
        raise ValueError(f"logit_bias must be a dict of token id -> bias, got {type(value).__name__}")
    pairs: dict[int, float] = {}
    for key, bias in value.items():
        token_id = key if isinstance(key, int) and not isinstance(key, bool) else None
        if isinstance(key, str) and key.strip().isdigit():
            token_id = int(key)
        if token_id is None or token_id < 0:
            raise ValueError(f"logit_bias: keys must be token ids (ints >= 0, or their decimal strings), got {key!r}")
        bias = _number("logit_bias", bias, f"in [-{LOGIT_BIAS_RANGE:g}, {LOGIT_BIAS_RANGE:g}] (token {token_id})")
        if not -LOGIT_BIAS_RANGE <= bias <= LOGIT_BIAS_RANGE:
            raise ValueError(f"logit_bias: values must be in [-{LOGIT_BIAS_RANGE:g}, {LOGIT_BIAS_RANGE:g}], "
                             f"got {bias} for token {token_id}")
        pairs[token_id] = bias
    return tuple(sorted(pairs.items()))


def _normalise_token_ids_logprob(value: Any) -> tuple[int, ...] | None:
    if value is None:
        return None
    if not isinstance(value, (list, tuple)) or not all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value
    ):
        raise ValueError(f"token_ids_logprob must be a list of token ids (ints >= 0), got {value!r}")
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
    # SGLang's further sampling parameters (docs/sampling.md).
    min_new_tokens: int = 0  # EOS and stop tokens are masked until this many tokens are out
    stop_regex: tuple[str, ...] = ()  # also accepts a string or a list; Python `re` over the output text
    no_stop_trim: bool = False  # keep the matched stop string / stop token's text in the output
    logit_bias: tuple[tuple[int, float], ...] = ()  # also accepts a dict {token id: bias}; sorted pairs
    sampling_seed: int | None = None  # SGLang's name for `seed`: moved into `seed` (None after construction)
    spaces_between_special_tokens: bool = True  # accepted; no effect (docs/sampling.md)
    stream_interval: int | None = None  # accepted; radixrt streams every token (docs/sampling.md)
    # Log-probability requests beside return_logprob / top_logprobs_num (radixrt.engine.logprobs).
    token_ids_logprob: tuple[int, ...] | None = None  # also accepts a list
    return_text_in_logprobs: bool = False
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
        object.__setattr__(self, "stop_regex", _normalise_stop_regex(self.stop_regex))
        object.__setattr__(self, "logit_bias", _normalise_logit_bias(self.logit_bias))
        object.__setattr__(self, "token_ids_logprob", _normalise_token_ids_logprob(self.token_ids_logprob))
        if self.sampling_seed is not None:
            _int("sampling_seed", self.sampling_seed, "or None")
            if self.seed is not None and self.seed != self.sampling_seed:
                raise ValueError(f"sampling_seed ({self.sampling_seed}) and seed ({self.seed}) name the same "
                                 "seed: give one, or equal values")
            # `seed` is the one the sampler reads; the alias is consumed so `replace(seed=)` stays free.
            object.__setattr__(self, "seed", self.sampling_seed)
            object.__setattr__(self, "sampling_seed", None)
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
        for name in ("ignore_eos", "return_logprob", "skip_special_tokens", "no_stop_trim",
                     "spaces_between_special_tokens", "return_text_in_logprobs"):
            _bool(name, getattr(self, name))
        if _int("min_new_tokens", self.min_new_tokens, ">= 0") < 0:
            raise ValueError(f"min_new_tokens must be >= 0, got {self.min_new_tokens}")
        if self.max_new_tokens is not None and self.min_new_tokens > self.max_new_tokens:
            raise ValueError(f"min_new_tokens must be <= max_new_tokens ({self.max_new_tokens}), "
                             f"got {self.min_new_tokens}")
        if self.stream_interval is not None and _int("stream_interval", self.stream_interval, ">= 1 or None") < 1:
            raise ValueError(f"stream_interval must be >= 1 or None, got {self.stream_interval}")
        given = [name for name in CONSTRAINT_FIELDS if getattr(self, name) is not None]
        for name in given:
            if not isinstance(getattr(self, name), str) or not getattr(self, name).strip():
                raise ValueError(f"{name} must be a non-empty string, got {getattr(self, name)!r}")
        if len(given) > 1:
            raise ValueError(f"give at most one output constraint of {', '.join(CONSTRAINT_FIELDS)}; got {', '.join(given)}")
        if given and self.max_new_tokens == 0:
            raise ValueError(f"{given[0]} constrains generated tokens: max_new_tokens must be >= 1 with it, got 0")
        if vocab_size is not None:
            for name, ids in (("stop_token_ids", self.stop_token_ids), ("token_ids_logprob", self.token_ids_logprob or ()),
                              ("logit_bias: keys", [t for t, _ in self.logit_bias])):
                bad = [t for t in ids if t >= vocab_size]
                if bad:
                    raise ValueError(f"{name} must be in [0, {vocab_size}), got {bad}")

    @classmethod
    def from_any(cls, value: SamplingParams | Mapping[str, Any] | None) -> SamplingParams:
        """Accept what users pass as `sampling_params`: None (defaults), a dict, or an instance."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, Mapping):
            for name, (default, why) in REFUSED_SAMPLING_FIELDS.items():
                if name in value and value[name] not in (None, default):
                    raise ValueError(f"{name}: {why}; only {default!r} (or null) is accepted, got {value[name]!r}")
            unknown = sorted(map(str, set(value) - _FIELD_NAMES - set(REFUSED_SAMPLING_FIELDS)))
            if unknown:
                raise ValueError(
                    f"unknown sampling parameter(s) {', '.join(unknown)}; accepted: {', '.join(sorted(_FIELD_NAMES))}"
                )
            # A null means the default (SGLang's client sends every field); max_new_tokens' null is
            # its own value: as many tokens as the context and the KV pool leave.
            given = {k: v for k, v in value.items()
                     if k in _FIELD_NAMES and (v is not None or k == "max_new_tokens")}  # fmt: skip
            return cls(**given)
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
    def decodes_in_runs(self) -> bool:
        """Whether a C decode run can sample this request: a logit bias and log-probabilities of
        chosen token ids are taken step by step (in `Sampler.sample`), not inside runs."""
        return not self.logit_bias and self.token_ids_logprob is None

    @property
    def is_greedy(self) -> bool:
        """True when sampling can only pick the top token (a temperature below GREEDY_TEMPERATURE,
        or top_k 1): the sampler then takes an argmax, with no softmax and no random draw."""
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1


_FIELD_NAMES = frozenset(f.name for f in fields(SamplingParams))

# SGLang sampling parameters radixrt accepts only at the value that asks for nothing:
# name -> (that value, why any other is refused).
REFUSED_SAMPLING_FIELDS: dict[str, tuple[Any, str]] = {
    "custom_params": (None, "radixrt runs no custom logit processor, so it takes no custom parameters"),
    "watermark": (None, "radixrt does not watermark its output"),
    "beam_width": (1, "radixrt has no beam search"),
    # SGLang's internal fields, which its normalize() fills; no client sends them.
    "stop_strs": (None, "SGLang-internal (send stop)"),
    "stop_regex_strs": (None, "SGLang-internal (send stop_regex)"),
    "stop_str_max_len": (0, "SGLang-internal"),
    "stop_regex_max_len": (0, "SGLang-internal"),
    "is_normalized": (False, "SGLang-internal"),
    "ebnf_full_assistant": (False, "SGLang-internal"),
}
