"""Request bodies of the HTTP API: OpenAI's and SGLang's names, validated at the edge.

Field ranges are checked here so that a 400 names the field the client sent
(`max_tokens`, not the engine's `max_new_tokens`). OpenAI's fields these
models do not declare arrive as extras, which `radixrt.server.openai_fields` accepts
as no-ops or refuses by name; a field in neither OpenAI's API nor SGLang's is
a 400 (an OpenAI body with a field ignored would answer a request the client
did not send).
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from radixrt.runtime.inputs import CHAT_ROLES



class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")

    def unknown_fields(self) -> list[str]:
        return sorted(self.model_extra or {})


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingFields(_Body):
    """What OpenAI's chat and completion bodies share, plus SGLang's and vLLM's extras."""

    model: str | None = None
    n: int = Field(1, ge=1, le=128)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    user: str | None = None
    # SGLang / vLLM extras
    top_k: int = Field(-1, ge=-1)
    min_p: float = Field(0.0, ge=0, le=1)
    repetition_penalty: float = Field(1.0, gt=0)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    stop_token_ids: list[int] | None = None
    cache_salt: str | None = None
    rid: str | None = Field(None, min_length=1)
    # Output constraints (radixrt.server.constraints checks them): OpenAI's response_format, or
    # SGLang's extras; at most one. response_format is checked there, not here, so a 400 says
    # every shape it accepts.
    response_format: Any = None
    regex: str | None = None
    json_schema: str | dict[str, Any] | None = None
    ebnf: str | None = None
    # OpenAI's: token id (as a string) -> bias added to its logit, -100 to 100.
    logit_bias: dict[str, float] | None = None

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys_are_token_ids(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (value or {}).items():
            if not key.strip().isdigit():
                raise ValueError(f"logit_bias keys must be token ids (digits), got {key!r}")
            if not -100 <= bias <= 100:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias} for token {key}")
        return value

    @field_validator("top_k")
    @classmethod
    def _top_k_is_off_or_positive(cls, value: int) -> int:
        if value == 0:
            raise ValueError("top_k must be -1 (off) or >= 1")
        return value

    @field_validator("stop")
    @classmethod
    def _stops_are_non_empty(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else value or []
        if not all(stops) or len(stops) > 16:
            raise ValueError("stop must be a non-empty string or a list of at most 16 non-empty strings")
        return value


class TextPart(BaseModel):
    type: str
    text: str | None = None


class ChatMessage(_Body):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool result: the call it answers


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=0)
    max_completion_tokens: int | None = Field(None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    # Checked in radixrt.server.tools, so a 400 names the exact tools[i]... field.
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None

    def chat_messages(self) -> list[dict[str, Any]]:
        """The messages as the chat template takes them; ValueError names the first bad one.

        An assistant message may carry `tool_calls` (its `arguments` JSON text becomes an object,
        as chat templates write it) with no content; a `tool` message answers one by `tool_call_id`.
        """
        messages = []
        for i, message in enumerate(self.messages):
            role = "system" if message.role == "developer" else message.role  # OpenAI's newer name for it
            if role not in CHAT_ROLES:
                raise ValueError(f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)} or developer, "
                                 f"got {message.role!r}")
            content = message.content
            if isinstance(content, list):
                for j, part in enumerate(content):
                    if part.type != "text" or part.text is None:
                        raise ValueError(f"messages[{i}].content[{j}] must be a text part, got type {part.type!r}")
                content = "".join(part.text or "" for part in content)
            # OpenAI's other message fields: null (as clients echo a reply back) or an assistant's
            # earlier `refusal` text ask for nothing; audio and the deprecated function_call would.
            unknown = sorted(name for name, value in (message.model_extra or {}).items()
                             if value is not None and name != "refusal")
            if unknown:
                raise ValueError(f"messages[{i}]: field(s) {', '.join(unknown)} not served; a message takes role, "
                                 "content, name, tool_calls (assistant) and tool_call_id (tool)")
            entry: dict[str, Any] = {"role": role, "content": content}
            if message.tool_calls:
                if role != "assistant":
                    raise ValueError(f"messages[{i}].tool_calls: only an assistant message carries tool calls")
                entry["tool_calls"] = [_template_call(i, j, call) for j, call in enumerate(message.tool_calls)]
            elif content is None:
                raise ValueError(f"messages[{i}].content is missing")
            if role == "tool":
                if message.tool_call_id is None:
                    raise ValueError(f"messages[{i}].tool_call_id is missing: a tool message answers a call")
                entry["tool_call_id"] = message.tool_call_id
            if message.name is not None:
                entry["name"] = message.name
            messages.append(entry)
        return messages


def _template_call(i: int, j: int, call: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI tool call as chat templates read it: `function.arguments` an object, not JSON text."""
    where = f"messages[{i}].tool_calls[{j}]"
    function = call.get("function")
    if call.get("type", "function") != "function" or not isinstance(function, dict):
        raise ValueError(f"{where} must be {{\"id\", \"type\": \"function\", \"function\": {{\"name\", \"arguments\"}}}}")
    if not isinstance(function.get("name"), str):
        raise ValueError(f"{where}.function.name must be a string")
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as error:
            raise ValueError(f"{where}.function.arguments must be JSON text: {error}") from None
    return {"id": call.get("id"), "type": "function", "function": {"name": function["name"], "arguments": arguments}}


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    best_of: int | None = Field(None, ge=1)

    @field_validator("prompt")
    @classmethod
    def _prompt_is_not_empty(cls, value: Any) -> Any:
        if not value or (isinstance(value, list) and any(not p for p in value if isinstance(p, (str, list)))):
            raise ValueError("prompt must be a non-empty string, token list, or list of them")
        return value


class GenerateRequest(_Body):
    """SGLang's native `/generate` body: the fields radixrt acts on. The route sorts every other
    field of SGLang's `GenerateReqInput` (radixrt.server.sglang_fields): a no-op, refused unless
    its value asks for nothing, or not SGLang's (a 400). A list gives one value per prompt."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    stream: bool = False
    rid: str | list[str] | None = None
    return_logprob: bool | list[bool] | None = None
    logprob_start_len: int | list[int] | None = None  # -1 (SGLang's default): the output only
    top_logprobs_num: int | list[int] | None = None
    token_ids_logprob: list[int] | list[list[int]] | None = None
    return_text_in_logprobs: bool = False
    cache_salt: str | None = None
    extra_key: str | None = None  # SGLang's cache-isolation key: joins cache_salt


class ExplainRequest(_Body):
    """`/cache/explain`: one prompt, in any form `/generate` or chat takes."""

    text: str | None = None
    input_ids: list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    cache_salt: str | None = None


class AbortRequest(_Body):
    rid: str = Field(min_length=1)
