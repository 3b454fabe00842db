"""The output constraint of an OpenAI body: `response_format`, or SGLang's extra fields.

Pure functions over plain data (docs/structured.md has the table):

    response_format {"type": "text"}                    no constraint
    response_format {"type": "json_object"}             json_schema {"type": "object"}
    response_format {"type": "json_schema",
                     "json_schema": {"name", "schema",
                                     "strict", "description"}}  json_schema = the schema
    response_format {"type": "json_schema",
                     "schema": {...}}                    json_schema = the schema (SGLang's shorthand)
    response_format {"type": "structural_tag", ...}     structural_tag = the whole object (SGLang's)
    regex / json_schema / ebnf (SGLang's extras)         that field, unchanged

A body gives at most one of them: two would leave the model a choice the
client did not make, so that is a 400 rather than a silent pick. vLLM's names
for the same things (`guided_json`, ...) are refused with the name to use
instead: ignoring them, as other unknown fields are, would return
unconstrained text to a client that asked for a constraint.
"""

from __future__ import annotations

import json
import re
from typing import Any, Mapping, NamedTuple

RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema", "structural_tag")
# OpenAI's rule for json_schema.name.
SCHEMA_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
# What any JSON object matches: json_object's schema, as SGLang sends it.
ANY_OBJECT_SCHEMA = '{"type": "object"}'
# SGLang's extra body fields, in the order they are checked.
EXTRA_FIELDS = ("regex", "json_schema", "ebnf")
# vLLM's names for constraints, and what radixrt takes instead.
FOREIGN_FIELDS = {
    "guided_json": "response_format (or json_schema)",
    "guided_regex": "regex",
    "guided_grammar": "ebnf",
    "guided_choice": "regex (an alternation such as 'yes|no')",
    "structured_outputs": "response_format, regex or ebnf",
}
_JSON_SCHEMA_KEYS = frozenset({"name", "schema", "strict", "description"})
_SHAPES = (
    '{"type": "text"}, {"type": "json_object"}, {"type": "json_schema", "json_schema": '
    '{"name": ..., "schema": {...}}} or SGLang\'s {"type": "structural_tag", ...}'
)


class Constraint(NamedTuple):
    """A body's output constraint: the `SamplingParams` field and text, and the body field it came from."""

    field: str  # regex, json_schema, ebnf or structural_tag
    text: str
    source: str  # response_format, regex, json_schema or ebnf


def response_format_constraint(value: Any) -> Constraint | None:
    """The constraint `response_format` asks for (None for absent or "text"); ValueError naming what is wrong."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise ValueError(f"response_format must be one of {_SHAPES}; got {type(value).__name__} {value!r}")
    kind = value.get("type")
    if kind not in RESPONSE_FORMAT_TYPES:
        raise ValueError(f"response_format must be one of {_SHAPES}; got type {kind!r}")
    if kind == "structural_tag":
        return Constraint("structural_tag", _json_text("response_format", value), "response_format")
    if kind == "json_schema" and "json_schema" not in value and "schema" in value:
        # SGLang also takes the schema beside the type, with no name: accepted as it does.
        if set(value) != {"type", "schema"} or not isinstance(value["schema"], Mapping):
            raise ValueError(f"response_format: with the schema beside the type, give only type and a schema "
                             f"object; accepted: {_SHAPES}")
        return Constraint("json_schema", _json_text("response_format.schema", value["schema"]), "response_format")
    extra = sorted(set(value) - {"type", "json_schema"})
    if extra or (kind != "json_schema" and "json_schema" in value):
        unexpected = extra or ["json_schema"]
        raise ValueError(f"response_format: type {kind!r} takes no field(s) {', '.join(unexpected)}; "
                         f"accepted: {_SHAPES}")
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint("json_schema", ANY_OBJECT_SCHEMA, "response_format")
    return Constraint("json_schema", _schema_text(value.get("json_schema")), "response_format")


def _schema_text(spec: Any) -> str:
    where = "response_format.json_schema"
    if not isinstance(spec, Mapping):
        raise ValueError(f'{where} must be an object {{"name": ..., "schema": {{...}}, "strict": ..., '
                         f'"description": ...}} with type json_schema, got {spec!r}')
    unknown = sorted(set(map(str, spec)) - _JSON_SCHEMA_KEYS)
    if unknown:
        raise ValueError(f"{where}: takes name, schema, strict and description; got unknown {', '.join(unknown)}")
    check_definition(where, spec)
    schema = spec.get("schema")
    if not isinstance(schema, Mapping):
        raise ValueError(f"{where}.schema must be a JSON Schema object, got {schema!r}")
    return _json_text(f"{where}.schema", schema)


def check_definition(where: str, spec: Mapping[str, Any]) -> str:
    """The `name` of an OpenAI schema or function definition, checked with its optional `strict`
    and `description`; ValueError naming `where`'s field."""
    name = spec.get("name")
    if not isinstance(name, str) or not SCHEMA_NAME.match(name):
        raise ValueError(f"{where}.name must be 1 to 64 letters, digits, '_' or '-' (OpenAI's rule), got {name!r}")
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise ValueError(f"{where}.strict must be true, false or null, got {spec['strict']!r}")
    if spec.get("description") is not None and not isinstance(spec["description"], str):
        raise ValueError(f"{where}.description must be a string, got {spec['description']!r}")
    return name


def _json_text(where: str, value: Mapping[str, Any]) -> str:
    """`value` as JSON text, keys in the client's order: a schema's properties are generated in
    the order they are listed, so sorting them would reorder the fields of every reply."""
    try:
        return json.dumps(value)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{where} must be JSON-serialisable: {error}") from None


def body_constraint(response_format: Any, extras: Mapping[str, Any]) -> Constraint | None:
    """The one constraint of a body: `response_format` and SGLang's `extras` (regex, json_schema, ebnf).

    None-valued extras count as absent (clients send `"regex": null`).
    """
    given = [
        Constraint(name, value if isinstance(value, str) else _json_text(name, value), name)
        for name in EXTRA_FIELDS
        if (value := extras.get(name)) is not None
    ]
    from_format = response_format_constraint(response_format)
    if from_format is not None:
        given.insert(0, from_format)
    if len(given) > 1:
        sources = [c.source if c.source != "response_format" else f"response_format {response_format['type']}"
                   for c in given]
        raise ValueError(f"{given[0].source}: give one output constraint of response_format, regex, json_schema "
                         f"or ebnf; got {' and '.join(sources)}")
    return given[0] if given else None


def refuse_foreign_fields(fields: Mapping[str, Any]) -> None:
    """ValueError for a vLLM constraint field in an OpenAI body, naming radixrt's field for it."""
    for name, instead in FOREIGN_FIELDS.items():
        if fields.get(name) is not None:
            raise ValueError(f"{name}: vLLM's field, which radixrt does not read; use {instead} "
                             "(docs/structured.md)")
