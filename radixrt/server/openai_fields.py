"""Every request field of the OpenAI routes, classified: honoured, a no-op, or refused by name.

A field the request models in `protocol.py` declare is honoured (HONOURED lists
which of OpenAI's those are). OpenAI's other fields arrive as extras and are
checked here: a value that asks for nothing (null, a default, a hint radixrt
needs not take) is accepted and does nothing; a value that asks for a
behaviour radixrt lacks is a 400 naming the field. A field in neither
OpenAI's API nor SGLang's is a 400 too: ignoring it would answer a request
the client did not send. tests/test_openai_tools.py walks the pinned
`openai` package's request types and fails on any field missing here.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, NamedTuple

from radixrt.server.constraints import FOREIGN_FIELDS


class NoOp(NamedTuple):
    """A field accepted when `asks_nothing(value)`; otherwise a 400 saying `refused`."""

    asks_nothing: Callable[[Any], bool]
    accepted: str  # the values accepted, for the message and docs/server.md
    refused: str  # what radixrt lacks, for the message


def _null(value: Any) -> bool:
    return value is None


def _any(value: Any) -> bool:
    return True


def _one_of(*values: Any) -> Callable[[Any], bool]:
    return lambda value: value is None or value in values


def _text_only(value: Any) -> bool:
    return value is None or (isinstance(value, list) and all(v == "text" for v in value))


# OpenAI's fields the request models declare and radixrt acts on.
HONOURED_COMMON = frozenset({
    "model", "n", "temperature", "top_p", "stop", "seed", "stream", "stream_options", "frequency_penalty",
    "presence_penalty", "logit_bias", "max_tokens", "logprobs",
})
HONOURED_CHAT = HONOURED_COMMON | {
    "messages", "max_completion_tokens", "top_logprobs", "response_format", "tools", "tool_choice",
    "parallel_tool_calls",
}
HONOURED_COMPLETION = HONOURED_COMMON | {"prompt", "echo", "best_of"}

NO_OPS_COMMON: dict[str, NoOp] = {
    "user": NoOp(_any, "any string", ""),
}
NO_OPS_CHAT: dict[str, NoOp] = {
    **NO_OPS_COMMON,
    "metadata": NoOp(_any, "any object (radixrt stores nothing)", ""),
    "safety_identifier": NoOp(_any, "any string", ""),
    "store": NoOp(_one_of(False), "false or null", "radixrt stores no completions"),
    "service_tier": NoOp(_one_of("auto", "default"), '"auto", "default" or null',
                         "radixrt has one service tier"),
    "prompt_cache_key": NoOp(_any, "any string (the radix cache matches prefixes without it; "
                                   "cache_salt separates caches)", ""),
    "prompt_cache_retention": NoOp(_one_of("in_memory"), '"in_memory" or null',
                                   "radixrt keeps cached prefixes in memory only, evicting the least recently used"),
    "prompt_cache_options": NoOp(_null, "null", "radixrt's cache has no options per request"),
    "prediction": NoOp(_null, "null", "radixrt has no predicted outputs"),
    "modalities": NoOp(_text_only, '["text"] or null', "radixrt generates text only"),
    "audio": NoOp(_null, "null", "radixrt generates text only"),
    "reasoning_effort": NoOp(_null, "null", "radixrt has no reasoning-effort control"),
    "verbosity": NoOp(_one_of("medium"), '"medium" or null', "radixrt has no verbosity control"),
    "web_search_options": NoOp(_null, "null", "radixrt has no web search"),
    "moderation": NoOp(_null, "null", "radixrt has no moderation"),
    "functions": NoOp(_null, "null", "the deprecated functions API is not served; use tools"),
    "function_call": NoOp(_null, "null", "the deprecated functions API is not served; use tool_choice"),
}
NO_OPS_COMPLETION: dict[str, NoOp] = {
    **NO_OPS_COMMON,
    "suffix": NoOp(_one_of(""), 'null or ""', "radixrt does not complete text before a suffix (insertion)"),
}


def check_extra_fields(extras: Mapping[str, Any], no_ops: Mapping[str, NoOp], route: str) -> None:
    """ValueError naming the first extra field that asks for something radixrt lacks, or that neither
    OpenAI's API nor SGLang's has. `extras`: what the request model did not declare."""
    for name, value in extras.items():
        rule = no_ops.get(name)
        if rule is not None:
            if not rule.asks_nothing(value):
                raise ValueError(f"{name}: {rule.refused}; accepted: {rule.accepted}, got {value!r}")
            continue
        if name in FOREIGN_FIELDS:
            continue  # vLLM's constraint fields: constraints.refuse_foreign_fields names the field to use
        raise ValueError(f"{name}: unknown field; {route} takes OpenAI's fields and SGLang's extras "
                         "(docs/server.md lists them)")
