"""OpenAI tool calls: the offered functions, `tool_choice`, the model's template and tool-call syntax.

Pure functions over plain data, but for `TemplateTools`, which renders the template once; `app.py`
does the I/O and `tool_parsers` reads calls out of the model's text.

    tools + tool_choice ─► Functions (validated: 400 naming tools[i]... or tool_choice)
      none       the tools are not rendered; the model answers in prose
      auto       rendered through the chat template; the reply is parsed in the model's syntax
      required   rendered, and the output constrained (an `ebnf` in llguidance's Lark syntax,
      named        JSON parts as `%json{schema}`) to one call or more (one: the named function,
                   or parallel_tool_calls false) in the model's syntax, so it always parses

Syntaxes (`--tool-call-parser`, or read from the chat template when it names none):

    hermes, qwen25   <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>   (repeated)
    llama3_json      {"name": ..., "parameters": {...}}   (optionally after <|python_tag|>; "; " between calls)
    json             [{"name": ..., "parameters": {...}}, ...]  (a template that renders tools in a
                     syntax radixrt does not know: required or named only, never auto)
"""

from __future__ import annotations

import json
from typing import Any, Mapping, NamedTuple, Sequence

from radixrt.sampling.grammar import JSON_FORMAT
from radixrt.server.constraints import check_definition
from radixrt.server.tool_parsers import HERMES_BEGIN, HERMES_END, PYTHON_TAG

TOOL_CALL_PARSERS = ("hermes", "qwen25", "llama3_json")
TOOL_CHOICES = ('"none"', '"auto"', '"required"', '{"type": "function", "function": {"name": ...}}')


class Function(NamedTuple):
    """One offered function: its name and the JSON Schema of its arguments."""

    name: str
    parameters: dict[str, Any]


class ToolChoice(NamedTuple):
    """What `tool_choice` asks: a mode, and the function's name when one is named."""

    mode: str  # none | auto | required | named
    name: str | None = None


def parse_functions(tools: Any) -> list[Function]:
    """The functions of a `tools` list; ValueError naming the first bad field."""
    if not isinstance(tools, list) or not tools:
        raise ValueError("tools must be a non-empty list of {\"type\": \"function\", \"function\": {...}}")
    functions: list[Function] = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, Mapping) or tool.get("type") != "function":
            raise ValueError(f"{where}.type must be \"function\" (the only tool type radixrt runs), "
                             f"got {tool.get('type') if isinstance(tool, Mapping) else tool!r}")
        spec = tool.get("function")
        if not isinstance(spec, Mapping):
            raise ValueError(f"{where}.function must be an object {{\"name\", \"description\", \"parameters\"}}")
        name = check_definition(f"{where}.function", spec)
        if any(f.name == name for f in functions):
            raise ValueError(f"{where}.function.name: {name!r} is offered twice")
        parameters = spec.get("parameters")
        functions.append(Function(name, _check_schema(f"{where}.function.parameters", parameters)))
    return functions


def _check_schema(where: str, schema: Any) -> dict[str, Any]:
    """A function's parameters: a JSON Schema object (absent: any object); ValueError naming `where`."""
    if schema is None:
        return {"type": "object"}
    if not isinstance(schema, Mapping):
        raise ValueError(f"{where} must be a JSON Schema object, got {type(schema).__name__}")
    if schema.get("type", "object") != "object":
        raise ValueError(f"{where}.type must be \"object\" (arguments are an object), got {schema.get('type')!r}")
    properties = schema.get("properties", {})
    if not isinstance(properties, Mapping) or not all(isinstance(p, Mapping) for p in properties.values()):
        raise ValueError(f"{where}.properties must be an object of JSON Schemas")
    required = schema.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise ValueError(f"{where}.required must be a list of property names")
    try:
        json.dumps(schema)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{where} must be JSON-serialisable: {error}") from None
    return dict(schema)


def parse_tool_choice(value: Any, functions: Sequence[Function] | None) -> ToolChoice:
    """`tool_choice` (default: auto with tools, none without); ValueError naming it."""
    if value is None:
        return ToolChoice("auto" if functions else "none")
    if isinstance(value, str):
        if value not in ("none", "auto", "required"):
            raise ValueError(f"tool_choice must be one of {', '.join(TOOL_CHOICES)}; got {value!r}")
        if value != "none" and not functions:
            raise ValueError(f"tool_choice: {value!r} needs tools")
        return ToolChoice(value)
    spec = value.get("function") if isinstance(value, Mapping) and value.get("type") == "function" else None
    name = spec.get("name") if isinstance(spec, Mapping) else None
    if not isinstance(name, str):
        raise ValueError(f"tool_choice must be one of {', '.join(TOOL_CHOICES)}; got {value!r}")
    offered = [f.name for f in functions or ()]
    if name not in offered:
        raise ValueError(f"tool_choice: function {name!r} is not in tools "
                         f"(offered: {', '.join(offered) or 'none'})")
    return ToolChoice("named", name)


def detect_syntax(chat_template: str | None) -> str | None:
    """The tool-call syntax a chat template teaches its model, or None when it names none we know."""
    if not chat_template:
        return None
    if HERMES_BEGIN in chat_template:
        return "hermes"
    if PYTHON_TAG in chat_template or '"parameters": dictionary of argument name' in chat_template:
        return "llama3_json"
    return None


def syntax_of(parser: str | None) -> str:
    """The syntax a `--tool-call-parser` name stands for (qwen25 writes hermes' syntax)."""
    return "hermes" if parser in ("hermes", "qwen25") else parser or "json"


def call_grammar(syntax: str, functions: Sequence[Function], choice: ToolChoice, parallel: bool) -> str:
    """The constraint (llguidance Lark, for SamplingParams.ebnf) of `required` or a named function:
    one call (the named function, or parallel false) or more, in `syntax`."""
    offered = [f for f in functions if choice.mode != "named" or f.name == choice.name]
    many = parallel and choice.mode == "required"
    key = "arguments" if syntax == "hermes" else "parameters"
    rules = [f"f{i}: %json{json.dumps(_call_schema(f, key))}" for i, f in enumerate(offered)]
    one = " | ".join(f"f{i}" for i in range(len(offered)))
    if syntax == "hermes":
        call, separator = f'"{HERMES_BEGIN}\\n" ({one}) "\\n{HERMES_END}"', '"\\n"'
    elif syntax == "llama3_json":
        call, separator = f"({one})", '"; "'
    else:
        call, separator = f"({one})", '", "'
    body = f"call ({separator} call)*" if many else "call"
    start = f'"[" {body} "]"' if syntax == "json" else body
    return "\n".join([f"start: {start}", f"call: {call}", *rules])


def _call_schema(function: Function, key: str) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"const": function.name}, key: function.parameters},
        "required": ["name", key],
        "additionalProperties": False,
        "x-guidance": JSON_FORMAT,
    }


_PROBE_TOOL = {"type": "function", "function": {"name": "radixrt_probe", "description": "probe",
                                                "parameters": {"type": "object", "properties": {}}}}


class TemplateTools:
    """What the model's chat template does with tools, learnt once: whether it renders them at all,
    and the syntax its calls take (`parser`, `--tool-call-parser`, or read from the template).

    Thread-safe: the probe may run twice on a race, with the same answer.
    """

    def __init__(self, tokenizer: Any, parser: str | None = None):
        if parser is not None and parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"tool-call parser must be one of {', '.join(TOOL_CALL_PARSERS)}, got {parser!r}")
        self.tokenizer = tokenizer
        self.parser = parser
        self._renders: bool | None = None

    def renders_tools(self) -> bool:
        """Whether rendering a conversation with a tool differs from rendering it without."""
        if self._renders is None:
            conversation = [{"role": "user", "content": "hi"}]
            try:
                plain = self.tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
                with_tool = self.tokenizer.apply_chat_template(
                    conversation, tokenize=False, add_generation_prompt=True, tools=[_PROBE_TOOL]
                )
            except Exception:  # a template that cannot render this probe has no usable tool format
                self._renders = False
            else:
                self._renders = plain != with_tool
        return self._renders

    def call_tag_is_special(self, syntax: str) -> bool:
        """Whether the syntax's opening tag is one special token of the tokenizer, which decoding with
        skip_special_tokens would drop from the text the parser reads (some Hermes tokenizers)."""
        if syntax != "hermes":
            return False  # Llama's <|python_tag|> may go: its calls parse without it
        ids = list(self.tokenizer.encode(HERMES_BEGIN, add_special_tokens=False))
        return len(ids) == 1 and ids[0] in set(getattr(self.tokenizer, "all_special_ids", ()))

    def syntax(self, choice: ToolChoice) -> str:
        """The syntax to constrain and parse calls in; ValueError naming tools or tool_choice when the
        model cannot take tools, or `auto` needs a syntax radixrt does not know."""
        if not self.renders_tools():
            raise ValueError("tools: this model's chat template has no tool format (it renders no tools), so "
                             "the model cannot be offered functions; send no tools, or tool_choice \"none\"")
        if self.parser is not None:
            return syntax_of(self.parser)
        syntax = detect_syntax(getattr(self.tokenizer, "chat_template", None))
        if syntax is None and choice.mode == "auto":
            raise ValueError("tool_choice: \"auto\" needs the model's tool-call syntax, which radixrt does not "
                             "read from this chat template; start radixrt serve with --tool-call-parser "
                             f"({', '.join(TOOL_CALL_PARSERS)}), or send \"required\" or a named function")
        return syntax or "json"
