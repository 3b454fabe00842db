"""Structured output from the bundled SmolLM2, as users ask for it: `radixrt serve` on a loopback
port driven by the real `openai` client (response_format json_object and json_schema, SGLang's
extras), programs with `gen(regex=, json_schema=, dtype=)`, and `radixrt generate --json-schema`.

Every reply is parsed with `json.loads` and validated with `jsonschema`, or fully matched
against its regex. All but the bad-input test need the grammar core (radixrt.sampling, the
engine's matchers): without it SmolLM2's text is unconstrained.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys

import jsonschema
import pytest

from radixrt import Runtime, assistant, function, gen, user
from radixrt.lang.ir import DTYPE_REGEX
from test_server_e2e import GLOBAL_OPTIONS, free_port, start_server

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.slow
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
PERSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
ASK_PERSON = [{"role": "user", "content": "Invent a person. Reply in JSON with their name and age."}]
IPV4 = r"((25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])\.){3}(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
PHONE = r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = free_port()
    process = start_server(port, tmp_path_factory.mktemp("serve") / "server.log")
    yield f"http://127.0.0.1:{port}"
    process.send_signal(signal.SIGTERM)
    process.wait(timeout=60)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def model_id(client):
    return client.models.list().data[0].id


# --- the OpenAI API -------------------------------------------------------------------------
def test_json_object_reply_is_a_json_object(client, model_id):
    messages = [{"role": "user", "content": "Describe a cat as a JSON object with its name and colour."}]
    reply = client.chat.completions.create(
        model=model_id, messages=messages, max_tokens=128, temperature=0, response_format={"type": "json_object"}
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "stop", choice
    assert isinstance(json.loads(choice.message.content), dict)


def test_json_schema_reply_validates_plain_streamed_and_sampled(client, model_id):
    plain = client.chat.completions.create(
        model=model_id, messages=ASK_PERSON, max_tokens=96, temperature=0, response_format=PERSON_FORMAT
    )
    jsonschema.validate(json.loads(plain.choices[0].message.content), PERSON)
    stream = client.chat.completions.create(
        model=model_id, messages=ASK_PERSON, max_tokens=96, temperature=0, response_format=PERSON_FORMAT,
        stream=True,
    )
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    jsonschema.validate(json.loads(streamed), PERSON)
    sampled = client.chat.completions.create(
        model=model_id, messages=ASK_PERSON, max_tokens=96, temperature=0.8, seed=7, n=3,
        response_format=PERSON_FORMAT,
    )
    for choice in sampled.choices:
        jsonschema.validate(json.loads(choice.message.content), PERSON)


def test_completions_take_sglang_regex_and_json_schema(client, model_id):
    phone = client.completions.create(
        model=model_id, prompt="The office's phone number is ", max_tokens=24, temperature=0,
        extra_body={"regex": PHONE},
    )
    assert re.fullmatch(PHONE, phone.choices[0].text), phone.choices[0].text
    person = client.completions.create(
        model=model_id, prompt="A person, as JSON: ", max_tokens=96, temperature=0,
        extra_body={"json_schema": json.dumps(PERSON)},
    )
    jsonschema.validate(json.loads(person.choices[0].text), PERSON)


def test_bad_response_format_reaches_the_client_as_a_400_naming_it(client, model_id):
    """Needs only this branch: the edge refuses it before the runtime sees it."""
    bad_name = {"type": "json_schema", "json_schema": {"name": "a person", "schema": PERSON}}
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model=model_id, messages=ASK_PERSON, max_tokens=8, response_format=bad_name)
    assert raised.value.body["param"] == "response_format.json_schema.name", raised.value.body
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model=model_id, messages=ASK_PERSON, max_tokens=8,
                                       response_format={"type": "json_object"}, extra_body={"regex": PHONE})
    assert raised.value.body["param"] == "response_format", raised.value.body


# --- programs -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def rt(smollm2):
    with Runtime(smollm2, max_total_tokens=16384) as runtime:
        yield runtime


def test_program_with_json_schema_and_dtype_gens(rt):
    @function
    def profile(s):
        s += user(ASK_PERSON[0]["content"])
        s += assistant(gen("person", max_tokens=96, temperature=0, json_schema=PERSON))
        s += user("How old will they be in ten years? Reply with the number only.")
        s += assistant(gen("later", max_tokens=8, temperature=0, dtype=int))

    state = profile.run(runtime=rt)
    person = json.loads(state["person"])
    jsonschema.validate(person, PERSON)
    assert re.fullmatch(DTYPE_REGEX["int"], state["later"]), state["later"]
    assert state.messages()[1]["content"] == state["person"]


def test_program_with_a_regex_gen(rt):
    @function
    def dns(s):
        s += "Q: What is the IP address of the Google DNS servers?\nA: "
        s += gen("ip", max_tokens=32, temperature=0, regex=IPV4)

    state = dns.run(runtime=rt)
    assert re.fullmatch(IPV4, state["ip"]), state["ip"]


def test_run_batch_of_typed_gens(rt):
    @function
    def typed(s, question, dtype):
        s += f"Q: {question}\nA: "
        s += gen("value", max_tokens=16, temperature=0, dtype=dtype)

    items = [
        {"question": "How many legs does a spider have?", "dtype": int},
        {"question": "What is pi, roughly?", "dtype": float},
        {"question": "Is the sky blue? Answer True or False.", "dtype": bool},
        {"question": "What is the capital of France, in quotes?", "dtype": str},
    ]
    states = typed.run_batch(items, runtime=rt)
    for item, state in zip(items, states):
        assert re.fullmatch(DTYPE_REGEX[item["dtype"].__name__], state["value"]), (item, state["value"])
    int(states[0]["value"])
    float(states[1]["value"])


# --- the command line -----------------------------------------------------------------------
def test_cli_generate_with_a_json_schema_file(tmp_path):
    schema_file = tmp_path / "person.json"
    schema_file.write_text(json.dumps(PERSON))
    done = subprocess.run(
        [sys.executable, "-m", "radixrt.cli", *GLOBAL_OPTIONS, "generate", ASK_PERSON[0]["content"], "--chat",
         "--json-schema", str(schema_file), "--max-new-tokens", "96", "--json"],
        capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stderr
    jsonschema.validate(json.loads(json.loads(done.stdout)["text"]), PERSON)
