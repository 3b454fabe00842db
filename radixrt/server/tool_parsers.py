"""Tool calls read out of a model's text, whole or streamed, in the syntaxes of radixrt.server.tools.

    hermes        <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>, repeated; text before is content
    llama3_json   {"name": ..., "parameters": {...}}, "; " between calls, optionally after <|python_tag|>
    json          [{"name": ..., "parameters": {...}}, ...]

A reply holding no well-formed call is all content: the model's text is never lost to a parser.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, NamedTuple, Sequence

HERMES_BEGIN, HERMES_END = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"


class ToolCall(NamedTuple):
    """A parsed call: the function's name and its arguments as JSON text (OpenAI's `arguments`)."""

    name: str
    arguments: str


def parse_calls(syntax: str, text: str) -> tuple[str | None, list[ToolCall]]:
    """The model's text as (content, calls) in `syntax`; text that holds no well-formed call is all content."""
    if syntax == "hermes":
        return _parse_hermes(text)
    stripped = text.strip()
    if syntax == "llama3_json":
        body = stripped[len(PYTHON_TAG):] if stripped.startswith(PYTHON_TAG) else stripped
        calls = _json_calls(body, "; ")
    else:
        calls = _json_calls(stripped, None)
    return (None, calls) if calls else (text, [])


def _parse_hermes(text: str) -> tuple[str | None, list[ToolCall]]:
    start = text.find(HERMES_BEGIN)
    if start < 0:
        return text, []
    calls: list[ToolCall] = []
    for match in re.finditer(re.escape(HERMES_BEGIN) + r"(.*?)(" + re.escape(HERMES_END) + r"|$)", text[start:],
                             re.DOTALL):
        call = _call_from(match.group(1).strip())
        if call is None and calls and not match.group(2):
            break  # a last call cut short (the token limit): the whole calls before it stand
        if call is None:
            return text, []  # a malformed call: the text goes back as it was
        calls.append(call)
    content = text[:start]
    return (content if content.strip() else None), calls


def _json_calls(text: str, separator: str | None) -> list[ToolCall]:
    """Calls written as JSON: one object, objects joined by `separator`, or a list of objects."""
    if not text.startswith(("{", "[")):
        return []
    decoder = json.JSONDecoder()
    values: list[Any] = []
    rest = text
    try:
        while rest:
            value, end = decoder.raw_decode(rest)
            values.extend(value if isinstance(value, list) else [value])
            rest = rest[end:].lstrip()
            if rest and (separator is None or not rest.startswith(separator.strip())):
                return []  # more text after the calls: not a reply made of calls
            rest = rest[len(separator.strip()) :].lstrip() if rest and separator else rest
    except json.JSONDecodeError:
        return []
    calls = [_call_from_value(v) for v in values]
    return [c for c in calls if c is not None] if all(c is not None for c in calls) else []


def _call_from(text: str) -> ToolCall | None:
    try:
        return _call_from_value(json.loads(text))
    except json.JSONDecodeError:
        return None


def _call_from_value(value: Any) -> ToolCall | None:
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as JSON text already
        return ToolCall(value["name"], arguments)
    return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def message_tool_calls(calls: Sequence[ToolCall]) -> list[dict[str, Any]]:
    """OpenAI's `message.tool_calls` of parsed calls."""
    return [{"id": new_call_id(), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in calls]


@dataclass
class StreamedCalls:
    """One streamed choice's text split into content deltas and tool-call deltas, as OpenAI sends them.

    Content is passed on as it comes, except text that may begin a call, which is held until it
    does or cannot; a call is sent once whole: a delta with its index, id, type and name
    (arguments ""), then one with its arguments.
    """

    syntax: str
    text: str = ""  # everything received
    sent_content: int = 0  # characters of `text` sent as content
    calls_sent: int = 0
    in_calls: bool = False  # the text reached the first call: no more content

    def feed(self, piece: str, final: bool) -> tuple[str, list[dict[str, Any]]]:
        """(content delta, tool-call deltas) after `piece`; `final` flushes what was held."""
        self.text += piece
        content = ""
        if not self.in_calls:
            start = self._call_start()
            if start is None:
                safe = len(self.text) if final else self._safe_end()
                content, self.sent_content = self.text[self.sent_content : safe], max(safe, self.sent_content)
                return content, []
            content = self.text[self.sent_content : start]
            self.sent_content, self.in_calls = start, True
        held = self.text[self.sent_content :]
        if not final:  # only the calls whose end was seen (JSON calls end with the reply)
            end = held.rfind(HERMES_END) if self.syntax == "hermes" else -1
            held = held[: end + len(HERMES_END)] if end >= 0 else ""
        _, calls = parse_calls(self.syntax, held) if held else (None, [])
        whole = calls
        deltas: list[dict[str, Any]] = []
        if final and not calls:  # the held text never became a call: it was content after all
            return content + self.text[self.sent_content :], []
        for index in range(self.calls_sent, len(whole)):
            call = whole[index]
            deltas.append({"index": index, "id": new_call_id(), "type": "function",
                           "function": {"name": call.name, "arguments": ""}})
            deltas.append({"index": index, "function": {"arguments": call.arguments}})
        self.calls_sent = max(self.calls_sent, len(whole))
        return content, deltas

    def _call_start(self) -> int | None:
        if self.syntax == "hermes":
            found = self.text.find(HERMES_BEGIN, self.sent_content)
            return None if found < 0 else found
        stripped = self.text.lstrip()
        if stripped.startswith((PYTHON_TAG, "{", "[")) and self.sent_content == 0:
            return 0
        return None

    def _safe_end(self) -> int:
        """Content may be sent up to here: what follows could still begin a call."""
        if self.syntax == "hermes":
            for cut in range(len(HERMES_BEGIN) - 1, 0, -1):
                if self.text.endswith(HERMES_BEGIN[:cut]):
                    return len(self.text) - cut
            return len(self.text)
        # JSON syntaxes: a reply is a call only when it starts as one, so hold only leading space.
        return len(self.text) if self.text.strip() else self.sent_content
