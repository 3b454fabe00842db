"""Tool calls and echoed prompt log-probs through the real `openai` client against a real `radixrt serve`.

The server runs the tiny model with a Qwen-like chat template (conftest's tiny_tools_dir): its
random weights never call a tool on their own, so `auto` is checked for leaving prose as content
(test_openai_tools.py feeds the parser the model format), and `required` and a named function,
which constrain the output, for calls that always parse.
"""

from __future__ import annotations

import json
import signal

import pytest
from test_server_e2e import free_port, start_server

from radixrt import Runtime

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.slow

from test_openai_tools import ASK, TIME, WEATHER  # noqa: E402


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_tools_dir):
    port = free_port()
    log_path = tmp_path_factory.mktemp("serve-tools") / "server.log"
    process = start_server(port, log_path, "--model", str(tiny_tools_dir), "--tool-call-parser", "qwen25")
    yield f"http://127.0.0.1:{port}"
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_auto_answers_in_prose_as_content(client):
    reply = client.chat.completions.create(model=client.models.list().data[0].id, messages=ASK, tools=[WEATHER],
                                           max_tokens=8, temperature=0)
    assert isinstance(reply.choices[0].message.content, str) and not reply.choices[0].message.tool_calls


def test_required_and_named_calls_parse(client):
    model = client.models.list().data[0].id
    reply = client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
                                           max_tokens=300, temperature=0)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in ("get_weather", "get_time")
        assert isinstance(json.loads(call.function.arguments), dict)
    named = client.chat.completions.create(
        model=model, messages=ASK, tools=[WEATHER, TIME], max_tokens=300, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    [call] = named.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] in ("Paris", "Rome")


def test_streamed_tool_call_deltas(client):
    model = client.models.list().data[0].id
    stream = client.chat.completions.create(
        model=model, messages=ASK, tools=[WEATHER], max_tokens=300, temperature=0, stream=True,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    name, arguments, finish, call_id = "", "", None, None
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        for call in delta.tool_calls or []:
            assert call.index == 0
            call_id = call.id or call_id
            name += (call.function.name or "") if call.function else ""
            arguments += (call.function.arguments or "") if call.function else ""
        finish = chunk.choices[0].finish_reason or finish
    assert name == "get_weather" and call_id and json.loads(arguments)["city"] in ("Paris", "Rome")
    assert finish == "tool_calls"


def test_tool_result_round_trip(client):
    model = client.models.list().data[0].id
    first = client.chat.completions.create(
        model=model, messages=ASK, tools=[WEATHER], max_tokens=300, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    [call] = first.choices[0].message.tool_calls
    messages = [*ASK, first.choices[0].message,  # the reply itself, as OpenAI's examples append it
                {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    second = client.chat.completions.create(model=model, messages=messages, tools=[WEATHER], max_tokens=8,
                                            temperature=0)
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # The prompt is the first one, the call as the template writes it, and the result after it.
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + len("sunny, 21 C") // 4
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 1


def test_bad_tool_input_is_a_400_naming_the_field(client):
    model = client.models.list().data[0].id
    cases = [
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
         "tools[0].function.parameters.type"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ]
    for extra, param in cases:
        with pytest.raises(openai.BadRequestError) as error:
            client.chat.completions.create(model=model, messages=ASK, max_tokens=4, **extra)
        assert error.value.body["param"] == param


def test_echo_with_logprobs_streams(client):
    model = client.models.list().data[0].id
    stream = client.completions.create(model=model, prompt="Hi there", echo=True, logprobs=1, max_tokens=2,
                                       stream=True)
    finishes = [c.choices[0] for c in stream if c.choices and c.choices[0].finish_reason]
    assert finishes[0].logprobs.token_logprobs[0] is None, "echo with logprobs streams: the prompt's come last"


def test_echo_logprobs_equal_the_runtime_prompt_logprobs(client, tiny_tools_dir):
    model = client.models.list().data[0].id
    prompt = "The quick brown fox jumps over the lazy dog."
    with Runtime(tiny_tools_dir, device="cpu", dtype="float32", max_total_tokens=2048) as rt:
        ids = rt.tokenizer.encode(prompt, add_special_tokens=False)
        meta = rt.generate(input_ids=ids, sampling_params={"max_new_tokens": 0, "return_logprob": True},
                           logprob_start_len=0)["meta_info"]
    values = [e[0] if isinstance(e, list) else e for e in meta["input_token_logprobs"]]
    values = values[-(len(ids) - 1):]  # from the second token on, in either shape
    for max_tokens in (0, 1):
        reply = client.completions.create(model=model, prompt=prompt, echo=True, logprobs=2, max_tokens=max_tokens,
                                          temperature=0)
        logprobs = reply.choices[0].logprobs
        assert reply.choices[0].text.startswith(prompt)
        assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
        assert len(logprobs.token_logprobs) == len(ids) + max_tokens
        assert logprobs.token_logprobs[1 : len(ids)] == pytest.approx(values, rel=1e-4, abs=1e-5)
        assert all(len(top) <= 2 for top in logprobs.top_logprobs[1:])
