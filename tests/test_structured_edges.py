"""Output constraints at every edge: OpenAI's response_format and SGLang's extras, `/generate`,
`gen(regex=, json_schema=, dtype=)` and the CLI options.

The mapping is tested as pure functions and through the app over the tiny random-weight
Llama (a recording runtime shows what reaches `generate`), and every bad input as a 400 or a
ValueError naming its field. None of this needs the grammar core; the outputs held to their
constraint are in test_structured_outputs.py (tiny model) and test_structured_e2e.py (SmolLM2
behind `radixrt serve`, the real `openai` client).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from typing import Any

import pytest

from radixrt import gen
from radixrt.lang.ir import DTYPE_REGEX
from radixrt.server import constraints
from radixrt.server.app import _bad_request
from radixrt.server.constraints import ANY_OBJECT_SCHEMA, Constraint
from test_server import CHAT, call

SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
    "required": ["answer"],
    "additionalProperties": False,
}
SCHEMA_TEXT = json.dumps(SCHEMA)  # keys in the given order: properties are generated in it
JSON_SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "yes_no", "schema": SCHEMA, "strict": True}}
YES_NO = "(yes|no)"


# --- response_format and the extras, as pure functions --------------------------------
@pytest.mark.parametrize(
    "response_format, expected",
    [
        (None, None),
        ({"type": "text"}, None),
        ({"type": "json_object"}, ("json_schema", ANY_OBJECT_SCHEMA)),
        (JSON_SCHEMA_FORMAT, ("json_schema", SCHEMA_TEXT)),
        ({"type": "json_schema", "json_schema": {"name": "a-B_9", "schema": SCHEMA, "description": "d"}},
         ("json_schema", SCHEMA_TEXT)),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": None}},
         ("json_schema", SCHEMA_TEXT)),
        ({"type": "json_schema", "schema": SCHEMA}, ("json_schema", SCHEMA_TEXT)),  # SGLang's shorthand
    ],
)
def test_response_format_maps_to_a_sampling_params_field(response_format, expected):
    constraint = constraints.response_format_constraint(response_format)
    assert (None if constraint is None else (constraint.field, constraint.text)) == expected
    if constraint is not None:
        assert constraint.source == "response_format"
        assert json.loads(constraint.text) == (SCHEMA if expected[1] == SCHEMA_TEXT else {"type": "object"})


def test_schema_text_keeps_the_clients_property_order():
    person = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}}
    for constraint in (
        constraints.response_format_constraint({"type": "json_schema", "json_schema": {"name": "p", "schema": person}}),
        constraints.body_constraint(None, {"json_schema": person}),
    ):
        assert constraint is not None and constraint.text == json.dumps(person)
        assert constraint.text.index('"name"') < constraint.text.index('"age"')
    assert gen("p", json_schema=person).params.json_schema == json.dumps(person)


def test_structural_tag_format_is_passed_whole_as_sglang_does():
    tag = {"type": "structural_tag", "structures": [{"begin": "<f>", "schema": SCHEMA, "end": "</f>"}],
           "triggers": ["<f>"]}
    constraint = constraints.response_format_constraint(tag)
    assert constraint is not None and constraint.field == "structural_tag" and json.loads(constraint.text) == tag


@pytest.mark.parametrize(
    "response_format, message",
    [
        ("json_object", "response_format must be one of .*got str"),
        ({"type": "yaml"}, "response_format must be one of .*json_object.*got type 'yaml'"),
        ({}, "response_format must be one of .*got type None"),
        ({"type": "json_schema"}, "response_format.json_schema must be an object"),
        ({"type": "json_schema", "json_schema": {"name": "x"}}, "response_format.json_schema.schema must be"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": "{}"}},
         "response_format.json_schema.schema must be a JSON Schema object"),
        ({"type": "json_schema", "json_schema": {"schema": SCHEMA}}, "response_format.json_schema.name must be"),
        ({"type": "json_schema", "json_schema": {"name": "has space", "schema": SCHEMA}},
         "response_format.json_schema.name must be 1 to 64 letters"),
        ({"type": "json_schema", "json_schema": {"name": "x" * 65, "schema": SCHEMA}},
         "response_format.json_schema.name must be"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": "yes"}},
         "response_format.json_schema.strict must be"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "description": 3}},
         "response_format.json_schema.description must be"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "shema": {}}},
         "response_format.json_schema: takes name, schema, strict and description; got unknown shema"),
        ({"type": "json_object", "json_schema": {"name": "x", "schema": SCHEMA}},
         "response_format: type 'json_object' takes no field.* json_schema"),
        ({"type": "text", "schema": SCHEMA}, "response_format: type 'text' takes no field.* schema"),
        ({"type": "json_schema", "schema": "{}"}, "response_format: with the schema beside the type"),
        ({"type": "json_schema", "schema": SCHEMA, "name": "x"}, "response_format: with the schema beside the type"),
    ],
)
def test_bad_response_format_names_it_and_what_is_accepted(response_format, message):
    with pytest.raises(ValueError, match=message):
        constraints.response_format_constraint(response_format)


def test_extras_null_values_and_conflicts():
    none = {"regex": None, "json_schema": None, "ebnf": None}
    assert constraints.body_constraint(None, none) is None
    assert constraints.body_constraint({"type": "text"}, none) is None
    assert constraints.body_constraint(None, {**none, "regex": YES_NO}) == Constraint("regex", YES_NO, "regex")
    assert constraints.body_constraint({"type": "text"}, {"ebnf": 'root ::= "a"'}) == Constraint(
        "ebnf", 'root ::= "a"', "ebnf"
    )
    as_dict = constraints.body_constraint(None, {"json_schema": SCHEMA})
    assert as_dict is not None and json.loads(as_dict.text) == SCHEMA
    with pytest.raises(ValueError, match="^response_format: give one output constraint.*json_object and regex"):
        constraints.body_constraint({"type": "json_object"}, {"regex": YES_NO})
    with pytest.raises(ValueError, match="^regex: give one output constraint.*regex and ebnf"):
        constraints.body_constraint(None, {"regex": YES_NO, "ebnf": 'root ::= "a"'})


@pytest.mark.parametrize("name, instead", sorted(constraints.FOREIGN_FIELDS.items()))
def test_vllm_constraint_fields_are_refused_with_the_field_to_use(name, instead):
    with pytest.raises(ValueError, match=f"^{name}: vLLM's field.*use {re.escape(instead)}"):
        constraints.refuse_foreign_fields({name: "x"})
    constraints.refuse_foreign_fields({name: None})  # null is absent


def test_a_constraint_error_names_the_field_the_client_sent():
    from_format = Constraint("json_schema", "{}", "response_format")
    error = _bad_request(ValueError("json_schema is not a valid JSON Schema: x"), "messages", from_format)
    assert error.param == "response_format" and error.message.startswith("response_format: json_schema")
    direct = _bad_request(ValueError("regex: bad pattern"), "prompt", Constraint("regex", "(", "regex"))
    assert direct.param == "regex" and direct.message == "regex: bad pattern"
    assert _bad_request(ValueError("json_schema is not valid JSON: x"), "text").param == "json_schema"


# --- through the app ---------------------------------------------------------------------
from test_server import app, runtime  # noqa: F401  (module-scoped fixtures: one tiny runtime here)
@pytest.fixture
def sent(runtime, monkeypatch) -> list[dict[str, Any]]:
    """The sampling_params of every async_generate call the app makes (the calls still run)."""
    calls: list[dict[str, Any]] = []
    real = runtime.async_generate

    async def recording(*args: Any, **kwargs: Any) -> Any:
        calls.append(dict(kwargs.get("sampling_params") or {}))
        return await real(*args, **kwargs)

    monkeypatch.setattr(runtime, "async_generate", recording)
    return calls


def constraint_of(params: dict[str, Any]) -> tuple[str, Any] | None:
    given = [(name, params[name]) for name in ("regex", "json_schema", "ebnf", "structural_tag") if
             params.get(name) is not None]
    assert len(given) <= 1, params
    return given[0] if given else None


@pytest.mark.parametrize(
    "path, extra, expected",
    [
        ("/v1/chat/completions", {"response_format": {"type": "text"}}, None),
        ("/v1/chat/completions", {"response_format": None, "regex": None}, None),
        ("/v1/chat/completions", {"response_format": {"type": "json_object"}}, ("json_schema", ANY_OBJECT_SCHEMA)),
        ("/v1/chat/completions", {"response_format": JSON_SCHEMA_FORMAT}, ("json_schema", SCHEMA_TEXT)),
        ("/v1/chat/completions", {"regex": YES_NO}, ("regex", YES_NO)),
        ("/v1/chat/completions", {"ebnf": 'root ::= "yes" | "no"'}, ("ebnf", 'root ::= "yes" | "no"')),
        ("/v1/completions", {"response_format": JSON_SCHEMA_FORMAT}, ("json_schema", SCHEMA_TEXT)),
        ("/v1/completions", {"json_schema": SCHEMA_TEXT}, ("json_schema", SCHEMA_TEXT)),
        ("/v1/completions", {"json_schema": SCHEMA}, ("json_schema", SCHEMA_TEXT)),
        ("/v1/completions", {"regex": YES_NO, "response_format": {"type": "text"}}, ("regex", YES_NO)),
    ],
)
def test_openai_routes_send_the_constraint_to_the_runtime(app, sent, path, extra, expected):
    base = {**CHAT, "max_tokens": 12} if "chat" in path else {"prompt": "Is it?", "max_tokens": 12, "temperature": 0}
    response = call(app, "POST", path, {**base, **extra})
    assert response.status_code == 200, response.text
    assert [constraint_of(params) for params in sent] == [expected]


@pytest.mark.parametrize(
    "path, extra, param",
    [
        ("/v1/chat/completions", {"response_format": {"type": "xml"}}, "response_format"),
        ("/v1/chat/completions", {"response_format": "json"}, "response_format"),
        ("/v1/chat/completions", {"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "n"}}},
         "response_format.json_schema.schema"),
        ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "a b",
                                                                                          "schema": SCHEMA}}},
         "response_format.json_schema.name"),
        ("/v1/chat/completions", {"response_format": {"type": "json_object"}, "regex": YES_NO}, "response_format"),
        ("/v1/completions", {"response_format": JSON_SCHEMA_FORMAT, "json_schema": SCHEMA}, "response_format"),
        ("/v1/completions", {"regex": YES_NO, "ebnf": 'root ::= "a"'}, "regex"),
        ("/v1/completions", {"regex": ""}, "regex"),
        ("/v1/completions", {"json_schema": "{not json"}, "json_schema"),
        ("/v1/completions", {"json_schema": "[1, 2]"}, "json_schema"),
        ("/v1/completions", {"regex": 5}, "regex"),
        ("/v1/completions", {"guided_json": SCHEMA}, "guided_json"),
        ("/v1/chat/completions", {"guided_regex": YES_NO}, "guided_regex"),
        ("/v1/chat/completions", {"regex": YES_NO, "max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {"response_format": {"type": "json_object"}, "max_tokens": 0}, "max_tokens"),
    ],
)
def test_bad_constraints_are_a_400_naming_the_field(app, path, extra, param):
    base = CHAT if "chat" in path else {"prompt": "Is it?", "max_tokens": 4}
    response = call(app, "POST", path, {**base, **extra})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error


def test_generate_takes_sglang_constraints_and_nulls(app, sent):
    # SGLang's own client sends every constraint field on every call, null when unused.
    nulls = {"regex": None, "json_schema": None, "ebnf": None, "structural_tag": None}
    body = {"text": "Is it?", "sampling_params": {"max_new_tokens": 4, "temperature": 0, **nulls}}
    response = call(app, "POST", "/generate", body)
    assert response.status_code == 200, response.text
    cases = (("regex", YES_NO), ("json_schema", SCHEMA_TEXT), ("json_schema", SCHEMA), ("ebnf", 'root ::= "yes" | "no"'))
    for field, value in cases:
        params = {"max_new_tokens": 12, "temperature": 0, **nulls, field: value}
        response = call(app, "POST", "/generate", {"text": "Is it?", "sampling_params": params})
        assert response.status_code == 200, response.text
    assert [constraint_of(params) for params in sent] == [
        None, ("regex", YES_NO), ("json_schema", SCHEMA_TEXT), ("json_schema", SCHEMA_TEXT),
        ("ebnf", 'root ::= "yes" | "no"'),
    ]


@pytest.mark.parametrize(
    "params, param",
    [
        ({"regex": YES_NO, "json_schema": SCHEMA_TEXT}, "sampling_params"),
        ({"json_schema": "{not json"}, "json_schema"),
        ({"regex": ""}, "regex"),
        ({"regex": YES_NO, "max_new_tokens": 0}, "max_new_tokens"),
    ],
)
def test_generate_bad_constraints_are_a_400_naming_the_field(app, params, param):
    response = call(app, "POST", "/generate", {"text": "x", "sampling_params": {"max_new_tokens": 4, **params}})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.json()


# --- lang -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "dtype, good, bad",
    [
        (int, ["0", "42", "-7", "+13", "007"], ["", "1.5", "4 2", "x"]),
        ("int", ["42"], ["-"]),
        (float, ["3.14", "-0.5", ".5", "2.", "1e-3", "42"], ["", ".", "1e", "a"]),
        (bool, ["True", "False"], ["true", "1", ""]),
        (str, ['""', '"a b"', r'"say \"hi\""'], ['"open', "bare", '"a"b"']),
    ],
)
def test_gen_dtype_is_a_regex_python_reads(dtype, good, bad):
    params = gen("x", dtype=dtype).params
    assert params.constraint == ("regex", DTYPE_REGEX[dtype if isinstance(dtype, str) else dtype.__name__])
    pattern = params.regex
    for text in good:
        assert re.fullmatch(pattern, text), text
        if dtype in (int, "int"):
            int(text)
        elif dtype is float:
            float(text)
    for text in bad:
        assert not re.fullmatch(pattern, text), text


def test_gen_constraints_and_their_errors_are_named():
    assert gen("j", json_schema=SCHEMA).params.constraint == ("json_schema", SCHEMA_TEXT)
    assert gen("j", json_schema=SCHEMA_TEXT).params.constraint == ("json_schema", SCHEMA_TEXT)
    assert gen("r", regex=YES_NO).params.constraint == ("regex", YES_NO)
    assert gen("e", ebnf='root ::= "a"').params.constraint == ("ebnf", 'root ::= "a"')
    with pytest.raises(ValueError, match=r"gen\('d'\): dtype must be int, float, bool or str"):
        gen("d", dtype=list)
    with pytest.raises(ValueError, match=r"gen\('d'\): dtype must be"):
        gen("d", dtype="integer")
    with pytest.raises(ValueError, match=r"gen\('d'\): dtype and regex both constrain"):
        gen("d", dtype=int, regex="[0-9]")
    with pytest.raises(ValueError, match=r"gen\('two'\): give at most one output constraint.*regex, json_schema"):
        gen("two", regex="a", json_schema=SCHEMA)
    with pytest.raises(ValueError, match=r"gen\('j'\): json_schema is not valid JSON"):
        gen("j", json_schema="{oops")
    with pytest.raises(ValueError, match=r"gen\('z'\): regex constrains generated tokens: max_new_tokens"):
        gen("z", max_tokens=0, regex="a")


# --- CLI: bad options fail before anything loads --------------------------------------------
from test_cli import _WITHOUT_TORCH  # noqa: E402  (the CLI run in a process that reports torch)


def test_cli_constraint_options_fail_before_anything_loads(tmp_path):
    not_json = tmp_path / "schema.json"
    not_json.write_text('{"type": ')
    a_list = tmp_path / "list.json"
    a_list.write_text("[1, 2]")
    grammar = tmp_path / "g.ebnf"
    grammar.write_text('root ::= "a"')
    cases = [
        (["--json-schema", str(tmp_path / "missing.json")], r"argument --json-schema: cannot read .*missing\.json"),
        (["--json-schema", str(not_json)], r"argument --json-schema: .*schema\.json: json_schema is not valid JSON"),
        (["--json-schema", str(a_list)], r"argument --json-schema: .*list\.json: json_schema must be a JSON object"),
        (["--ebnf", str(tmp_path / "missing.ebnf")], r"argument --ebnf: cannot read"),
        (["--regex", ""], r"argument --regex: regex must be a non-empty string"),
        (["--regex", "a", "--ebnf", str(grammar)], r"argument --ebnf: not allowed with argument --regex"),
        (["--regex", "a", "--max-new-tokens", "0"], r"regex constrains generated tokens: max_new_tokens must be >= 1"),
    ]
    for options, message in cases:
        done = subprocess.run([sys.executable, "-c", _WITHOUT_TORCH, "--model", "/no/such/model", "generate", "hi",
                               *options], capture_output=True, text=True, timeout=60)
        assert done.returncode == 2, (options, done.stderr)
        assert done.stdout.strip() == "torch not imported"
        assert len(re.findall(message, done.stderr)) == 1, (options, done.stderr)
