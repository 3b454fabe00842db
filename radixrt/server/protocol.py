"""Request bodies of the HTTP API: OpenAI's and SGLang's names, validated at the edge.

Field ranges are checked here so that a 400 names the field the client sent
(`max_tokens`, not the engine's `max_new_tokens`). Unknown fields are
ignored, as OpenAI does; the routes log them at debug level. vLLM's
constraint fields are the exception (radixrt.server.constraints): ignoring
one would return unconstrained text to a client that asked for a constraint.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

CHAT_ROLES = ("system", "user", "assistant", "tool")


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


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=0)
    max_completion_tokens: int | None = Field(None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)

    def chat_messages(self) -> list[dict[str, str]]:
        """The messages as the chat template takes them; ValueError names the first bad one."""
        messages = []
        for i, message in enumerate(self.messages):
            if message.role not in CHAT_ROLES:
                raise ValueError(f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, got {message.role!r}")
            content = message.content
            if isinstance(content, list):
                for j, part in enumerate(content):
                    if part.type != "text" or part.text is None:
                        raise ValueError(f"messages[{i}].content[{j}] must be a text part, got type {part.type!r}")
                content = "".join(part.text or "" for part in content)
            if content is None:
                raise ValueError(f"messages[{i}].content is missing")
            messages.append({"role": message.role, "content": content})
        return messages


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
