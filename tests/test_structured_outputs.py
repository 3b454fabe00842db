"""Outputs held to their constraint on every edge, over the tiny random-weight Llama.

These need the grammar core (radixrt.sampling, the engine's matchers): without it the tiny
model's text is unconstrained and they fail. The edges' mapping and validation alone are
in test_structured_edges.py; JSON from a real model with the real `openai` client is in
test_structured_e2e.py. A regex or grammar with few strings holds even a random model.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from typing import Any

import jsonschema
import pytest

from radixrt import function, gen
from radixrt.lang.ir import DTYPE_REGEX
from test_server import CHAT, app, call, events, runtime  # noqa: F401  (fixtures)
from test_structured_edges import JSON_SCHEMA_FORMAT, SCHEMA, YES_NO


def test_regex_and_grammar_outputs_match_on_every_route(app):
    grammar = 'root ::= "yes" | "no"'
    native = call(app, "POST", "/generate", {"text": "Is it?", "sampling_params": {
        "max_new_tokens": 16, "temperature": 0, "regex": YES_NO}}).json()
    assert re.fullmatch(YES_NO, native["text"]), native["text"]
    completion = call(app, "POST", "/v1/completions", {
        "prompt": ["Is it?", "Or not?"], "max_tokens": 16, "temperature": 0.9, "seed": 1, "n": 2, "regex": YES_NO,
    }).json()
    assert [bool(re.fullmatch(YES_NO, c["text"])) for c in completion["choices"]] == [True] * 4, completion
    chat = call(app, "POST", "/v1/chat/completions", {**CHAT, "max_tokens": 16, "ebnf": grammar}).json()
    assert re.fullmatch(YES_NO, chat["choices"][0]["message"]["content"]), chat
    streamed = events(call(app, "POST", "/v1/chat/completions", {**CHAT, "max_tokens": 16, "regex": YES_NO,
                                                                 "stream": True}))
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in streamed[:-1] if c["choices"])
    assert re.fullmatch(YES_NO, text), text


def test_schema_output_parses_and_validates(app):
    """A schema whose every string is an enum leaves a random model little room."""
    body = {**CHAT, "max_tokens": 128, "response_format": JSON_SCHEMA_FORMAT}
    reply = call(app, "POST", "/v1/chat/completions", body).json()
    content = reply["choices"][0]["message"]["content"]
    jsonschema.validate(json.loads(content), SCHEMA)


@pytest.mark.parametrize(
    "path, extra, param",
    [
        ("/generate", {"regex": "(ab"}, "regex"),
        ("/generate", {"ebnf": "root ::= undefined_rule"}, "ebnf"),
        ("/v1/completions", {"json_schema": '{"type": "no-such-type"}'}, "json_schema"),
        ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
            "name": "bad", "schema": {"type": "no-such-type"}}}}, "response_format"),
    ],
)
def test_a_constraint_the_library_rejects_is_a_400_naming_the_field(app, path, extra, param):
    """The core compiles the constraint before anything is queued."""
    if path == "/generate":
        body: dict[str, Any] = {"text": "x", "sampling_params": {"max_new_tokens": 4, **extra}}
    elif "chat" in path:
        body = {**CHAT, **extra}
    else:
        body = {"prompt": "x", "max_tokens": 4, **extra}
    response = call(app, "POST", path, body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.json()



# --- lang and CLI -------------------------------------------------------------------------
def test_program_gens_match_their_constraints(runtime):

    @function
    def constrained(s):
        s += "Is it? "
        s += gen("answer", max_tokens=16, temperature=0, regex=YES_NO)
        s += " How many? "
        s += gen("count", max_tokens=6, temperature=0, dtype=int)
        s += " Sure? "
        s += gen("sure", max_tokens=6, temperature=0, dtype=bool)

    state = constrained.run(runtime=runtime)
    assert re.fullmatch(YES_NO, state["answer"]), state["answer"]
    assert re.fullmatch(DTYPE_REGEX["int"], state["count"]), state["count"]
    int(state["count"])
    assert state["sure"] in ("True", "False")
    assert state.text() == f"Is it? {state['answer']} How many? {state['count']} Sure? {state['sure']}"


def test_a_rejected_pattern_fails_the_program_naming_the_gen(runtime):
    """The runtime compiles the regex when the gen runs, in the program's thread."""

    @function
    def broken(s):
        s += "Is it? "
        s += gen("answer", max_tokens=4, regex="(ab")

    with pytest.raises(ValueError, match=r"gen\('answer'\): .*regex"):
        broken.run(runtime=runtime)


def test_cli_regex_output_matches(tiny_llama_dir):
    done = subprocess.run(
        [sys.executable, "-m", "radixrt.cli", "generate", "Is it?", "--regex", YES_NO, "--max-new-tokens", "16",
         "--json", "--model", str(tiny_llama_dir), "--device", "cpu", "--dtype", "float32"],
        capture_output=True, text=True, timeout=180,
    )
    assert done.returncode == 0, done.stderr
    assert re.fullmatch(YES_NO, json.loads(done.stdout)["text"]), done.stdout
