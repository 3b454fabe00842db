"""Tool calls, prompt log-probabilities (echo) and field classification of the OpenAI routes, in process.

The parsers are fed each model's own format; the app runs over the tiny model with a Qwen-like
chat template (conftest's tiny_tools_dir) through httpx's ASGI transport. The same features
against a real `radixrt serve` with the openai client are in test_tools_e2e.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import typing
from typing import Any

import httpx
import pytest

from radixrt import Runtime, SamplingParams
from radixrt.server import openai_api, openai_fields, tool_parsers, tools
from radixrt.server.app import create_app
from radixrt.server.protocol import ChatCompletionRequest, CompletionRequest

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
                   "additionalProperties": False},
}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"utc": {"type": "boolean"}},
                                       "required": ["utc"], "additionalProperties": False},
}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def call(app: Any, path: str, body: dict[str, Any]) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=120) as client:
            return await client.post(path, json=body)

    return asyncio.run(go())


def events(response: httpx.Response) -> list[Any]:
    lines = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    return [line if line == "[DONE]" else json.loads(line) for line in lines]


@pytest.fixture(scope="module")
def runtime(tiny_tools_dir):
    with Runtime(tiny_tools_dir, device="cpu", dtype="float32", max_total_tokens=8192) as rt:
        yield rt


@pytest.fixture(scope="module")
def app(runtime):
    return create_app(runtime)


# --- the parsers, fed each model's own format ----------------------------------------------------
def test_hermes_parser_splits_content_and_calls():
    text = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_time", "arguments": {"utc": true}}\n</tool_call>')
    content, calls = tool_parsers.parse_calls("hermes", text)
    assert content == "Let me look.\n"
    assert calls == [tool_parsers.ToolCall("get_weather", '{"city": "Paris"}'), tool_parsers.ToolCall("get_time", '{"utc": true}')]
    assert tool_parsers.parse_calls("hermes", "Just prose.") == ("Just prose.", [])
    broken = "<tool_call>\n{not json}\n</tool_call>"
    assert tool_parsers.parse_calls("hermes", broken) == (broken, []), "a malformed call is returned as text"
    cut = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name": "get_w'
    assert tool_parsers.parse_calls("hermes", cut) == (None, [tool_parsers.ToolCall("get_time", "{}")]), "a call cut short is dropped"


def test_llama3_json_parser():
    content, calls = tool_parsers.parse_calls("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": '
                                                      '{"city": "Rome"}}; {"name": "get_time", "parameters": {}}')
    assert content is None and [c.name for c in calls] == ["get_weather", "get_time"]
    assert calls[0].arguments == '{"city": "Rome"}'
    assert tool_parsers.parse_calls("llama3_json", 'The answer is {"name": 1}')[1] == []
    assert tool_parsers.parse_calls("llama3_json", "{not json")[1] == []


def test_streamed_calls_hold_back_a_possible_call_and_send_whole_calls():
    text = 'Sure <b>.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    splitter = tool_parsers.StreamedCalls("hermes")
    content, deltas = "", []
    for i in range(0, len(text), 4):
        piece_content, piece_deltas = splitter.feed(text[i : i + 4], False)
        content += piece_content
        deltas += piece_deltas
    last_content, last_deltas = splitter.feed("", True)
    content, deltas = content + last_content, deltas + last_deltas
    assert content == "Sure <b>.\n"
    assert deltas[0]["index"] == 0 and deltas[0]["type"] == "function" and deltas[0]["id"].startswith("call_")
    assert deltas[0]["function"] == {"name": "get_weather", "arguments": ""}
    assert "".join(d["function"]["arguments"] for d in deltas) == '{"city": "Paris"}'
    prose = tool_parsers.StreamedCalls("hermes")
    assert prose.feed("a <tool", False) == ("a ", [])
    assert prose.feed("box", True) == ("<toolbox", []), "held text that never became a call is content"


def test_template_syntax_detection():
    assert tools.detect_syntax("... <tool_call> ...") == "hermes"
    assert tools.detect_syntax("{{- '<|python_tag|>' }}") == "llama3_json"
    assert tools.detect_syntax("{{ messages }}") is None


# --- the routes over the tiny Qwen-like model ------------------------------------------------------
def tool_calls_of(body: dict[str, Any]) -> list[dict[str, Any]]:
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls", body
    return choice["message"]["tool_calls"]


def test_required_and_named_always_parse(app):
    for choice, expected in (("required", {"get_weather", "get_time"}), (
            {"type": "function", "function": {"name": "get_time"}}, {"get_time"})):
        for seed in range(3):
            response = call(app, "/v1/chat/completions", {
                "messages": ASK, "tools": [WEATHER, TIME], "tool_choice": choice, "max_tokens": 300,
                "temperature": 1.0, "seed": seed, "parallel_tool_calls": False,
            })
            assert response.status_code == 200, response.text
            calls = tool_calls_of(response.json())
            assert len(calls) == 1 and calls[0]["function"]["name"] in expected
            arguments = json.loads(calls[0]["function"]["arguments"])
            assert arguments in ({"city": "Paris"}, {"city": "Rome"}, {"utc": True}, {"utc": False})


def test_auto_leaves_prose_as_content(app):
    response = call(app, "/v1/chat/completions", {"messages": ASK, "tools": [WEATHER], "max_tokens": 8,
                                                  "temperature": 0})
    assert response.status_code == 200, response.text
    message = response.json()["choices"][0]["message"]
    assert isinstance(message["content"], str) and "tool_calls" not in message


def test_streamed_tool_call_deltas(app):
    response = call(app, "/v1/chat/completions", {
        "messages": ASK, "tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "max_tokens": 300, "temperature": 0, "stream": True,
    })
    assert response.status_code == 200, response.text
    chunks = [e for e in events(response) if e != "[DONE]"]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert calls[0]["function"]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
    assert json.loads("".join(c["function"].get("arguments", "") for c in calls))["city"] in ("Paris", "Rome")
    assert not any(d.get("content") for d in deltas), "a forced call sends no content"
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_tool_results_and_calls_flow_back_into_the_template(app, runtime):
    messages = ASK + [
        {"role": "assistant", "content": None, "refusal": None, "audio": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    response = call(app, "/v1/chat/completions", {"messages": messages, "tools": [WEATHER], "max_tokens": 4,
                                                  "temperature": 0})
    assert response.status_code == 200, response.text
    rendered = runtime.tokenizer.decode(runtime.inputs.encode_messages(
        ChatCompletionRequest(messages=messages).chat_messages(), [WEATHER]))
    assert '"arguments": {"city": "Paris"}' in rendered and "<tool_response id=call_1>\nsunny, 21 C" in rendered
    assert '"name": "get_weather"' in rendered.split("<|im_end|>")[0], "the tools are in the system turn"
    assert response.json()["usage"]["prompt_tokens"] == len(runtime.tokenizer.encode(rendered, add_special_tokens=False))


@pytest.mark.parametrize("body, param", [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
     "tools[0].function.parameters.type"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "not a schema"}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "strin"}}}}}], "tool_choice": "required"}, "tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": "{}"}}]},
     "messages[0]"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
])
def test_bad_tool_input_is_a_400_naming_the_field(app, body, param):
    response = call(app, "/v1/chat/completions", {"messages": ASK, "max_tokens": 4, **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.json()


def test_a_template_without_tools_is_a_400_not_prose(tiny_llama_dir):
    with Runtime(tiny_llama_dir, device="cpu", dtype="float32", max_total_tokens=2048) as rt:
        app = create_app(rt)
        response = call(app, "/v1/chat/completions", {"messages": ASK, "tools": [WEATHER], "max_tokens": 4})
        assert response.status_code == 400 and response.json()["error"]["param"] == "tools"
        assert "no tool format" in response.json()["error"]["message"]
        none = call(app, "/v1/chat/completions", {"messages": ASK, "tools": [WEATHER], "tool_choice": "none",
                                                  "max_tokens": 4})
        assert none.status_code == 200, "tool_choice none asks for prose, which any model gives"


def test_generate_refuses_an_unknown_role(runtime):
    with pytest.raises(ValueError, match=r"messages\[1\]\.role"):
        runtime.generate([{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}])


# --- prompt log-probabilities ----------------------------------------------------------------------
@pytest.mark.parametrize("max_tokens", [0, 1])
def test_echo_logprobs_are_the_runtime_prompt_logprobs(app, runtime, max_tokens):
    # A prompt that ends with the model's own greedy tokens: each of those is the argmax at its place.
    start = runtime.tokenizer.encode("The quick brown fox", add_special_tokens=False)
    ids = start + runtime.generate(input_ids=start, sampling_params={"max_new_tokens": 6, "temperature": 0,
                                                                     "ignore_eos": True})["output_ids"]
    prompt = runtime.tokenizer.decode(ids)
    response = call(app, "/v1/completions", {"prompt": ids, "echo": True, "logprobs": 3,
                                             "max_tokens": max_tokens, "temperature": 0})
    assert response.status_code == 200, response.text
    logprobs = response.json()["choices"][0]["logprobs"]
    expected = runtime.generate(input_ids=ids, sampling_params={"max_new_tokens": 0, "return_logprob": True,
                                                                "top_logprobs_num": 3},
                                logprob_start_len=0)["meta_info"]
    values = [openai_api.logprob_value(e) for e in expected["input_token_logprobs"]]
    values = values if len(values) == len(ids) else [None, *values]
    assert logprobs["tokens"][: len(ids)] == [runtime.tokenizer.decode([t]) for t in ids]
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert values[0] is None and logprobs["token_logprobs"][1 : len(ids)] == pytest.approx(values[1:], rel=1e-5)
    assert len(logprobs["token_logprobs"]) == len(ids) + max_tokens
    assert response.json()["choices"][0]["text"].startswith(prompt)
    tops = [openai_api.top_entries(top) for top in expected["input_top_logprobs"]]
    tops = tops if len(tops) == len(ids) else [[], *tops]
    argmax_positions = 0
    for position in range(1, len(ids)):
        assert len(tops[position]) == 3
        shown = logprobs["top_logprobs"][position]
        assert shown == {runtime.tokenizer.decode([t]): lp for t, lp in tops[position]}
        best_id, best = tops[position][0]
        if best_id == ids[position]:  # the argmax: its log-prob and its top-1 come from one computation
            argmax_positions += 1
            assert values[position] == best
            assert logprobs["token_logprobs"][position] == max(shown.values())
        assert logprobs["token_logprobs"][position] <= max(shown.values())
    assert argmax_positions >= 6, "the greedy tail is the argmax at each of its places"


def test_echo_logprobs_of_a_text_prompt(app, runtime):
    prompt = "The quick brown fox jumps over the lazy dog."
    response = call(app, "/v1/completions", {"prompt": [prompt, prompt + " Again"], "echo": True, "logprobs": 1,
                                             "max_tokens": 1})
    assert response.status_code == 200, response.text
    for choice, text in zip(response.json()["choices"], [prompt, prompt + " Again"]):
        ids = runtime.tokenizer.encode(text, add_special_tokens=False)
        logprobs = choice["logprobs"]
        assert "".join(logprobs["tokens"][: len(ids)]) == text and len(logprobs["tokens"]) == len(ids) + 1
        assert logprobs["token_logprobs"][0] is None and all(v <= 0 for v in logprobs["token_logprobs"][1:])
        assert logprobs["text_offset"][len(ids)] == len(text)


def test_echo_streams_the_prompt_first_and_logprobs_with_the_finish(app, runtime):
    body = {"prompt": "Once upon", "echo": True, "max_tokens": 3, "temperature": 0, "logprobs": 2}
    response = call(app, "/v1/completions", {**body, "stream": True})
    assert response.status_code == 200, response.text
    chunks = [e for e in events(response) if e != "[DONE]"]
    assert chunks[0]["choices"][0]["text"] == "Once upon"
    assert "".join(c["choices"][0]["text"] for c in chunks) == call(app, "/v1/completions", body).json()[
        "choices"][0]["text"]
    last = chunks[-1]["choices"][0]
    assert last["finish_reason"] is not None and all(c["choices"][0]["logprobs"] is None for c in chunks[:-1])
    whole = call(app, "/v1/completions", body).json()["choices"][0]["logprobs"]
    assert last["logprobs"]["tokens"] == whole["tokens"] and last["logprobs"]["token_logprobs"][0] is None
    assert last["logprobs"]["token_logprobs"][1:] == pytest.approx(whole["token_logprobs"][1:], rel=1e-5)


def test_chat_stream_sends_logprobs_with_the_finish(app):
    body = {"messages": ASK, "max_tokens": 4, "temperature": 0, "logprobs": True, "top_logprobs": 2,
            "ignore_eos": True}
    chunks = [e for e in events(call(app, "/v1/chat/completions", {**body, "stream": True})) if e != "[DONE]"]
    [last] = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    whole = call(app, "/v1/chat/completions", body).json()["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in last["logprobs"]["content"]] == [e["token"] for e in whole] and len(whole) == 4
    assert all(len(e["top_logprobs"]) == 2 for e in last["logprobs"]["content"])


# --- every OpenAI field is classified ---------------------------------------------------------------
def request_fields_of(module: Any) -> set[str]:
    """Every key of a create-params module's CompletionCreateParams (its streaming and non-streaming forms)."""
    names: set[str] = set()
    for variant in typing.get_args(module.CompletionCreateParams):
        names |= set(variant.__required_keys__) | set(variant.__optional_keys__)
    return names


def test_every_openai_request_field_is_classified():
    openai = pytest.importorskip("openai")
    from openai.types import completion_create_params
    from openai.types.chat import completion_create_params as chat_create_params

    assert openai.__version__, "the pinned openai package (pyproject's test extra)"
    for module, honoured, no_ops, model in (
        (chat_create_params, openai_fields.HONOURED_CHAT, openai_fields.NO_OPS_CHAT, ChatCompletionRequest),
        (completion_create_params, openai_fields.HONOURED_COMPLETION, openai_fields.NO_OPS_COMPLETION,
         CompletionRequest),
    ):
        names = request_fields_of(module)
        assert names, module
        unclassified = names - honoured - set(no_ops)
        assert not unclassified, f"{module.__name__}: fields neither honoured nor no-op nor refused: {unclassified}"
        unread = honoured - set(model.model_fields)
        assert not unread, f"honoured fields the request model does not read: {unread}"
        assert not honoured & set(no_ops)


@pytest.mark.parametrize("route, name, nothing, something", [
    ("/v1/chat/completions", "user", "u-1", None),
    ("/v1/chat/completions", "metadata", {"a": "b"}, None),
    ("/v1/chat/completions", "store", False, True),
    ("/v1/chat/completions", "service_tier", "auto", "priority"),
    ("/v1/chat/completions", "modalities", ["text"], ["text", "audio"]),
    ("/v1/chat/completions", "reasoning_effort", None, "high"),
    ("/v1/chat/completions", "functions", None, [{"name": "f"}]),
    ("/v1/chat/completions", "prediction", None, {"type": "content", "content": "x"}),
    ("/v1/completions", "suffix", None, " and then"),
    ("/v1/completions", "user", "u-1", None),
])
def test_no_op_fields_accept_nothing_and_refuse_something(app, route, name, nothing, something):
    base = {"messages": ASK} if route == "/v1/chat/completions" else {"prompt": "Hello"}
    ok = call(app, route, {**base, "max_tokens": 1, name: nothing})
    assert ok.status_code == 200, ok.text
    if something is not None:
        refused = call(app, route, {**base, "max_tokens": 1, name: something})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == name, refused.text


def test_logit_bias_maps_to_the_sampling_parameter():
    body = ChatCompletionRequest(messages=ASK, logit_bias={"42": 100, "7": -100})
    assert openai_api.chat_sampling_params(body)["logit_bias"] == {42: 100, 7: -100}
    completion = CompletionRequest(prompt="x", logit_bias={"3": 5})
    assert openai_api.completion_sampling_params(completion)["logit_bias"] == {3: 5}


@pytest.mark.skipif("logit_bias" not in {f.name for f in dataclasses.fields(SamplingParams)},
                    reason="SamplingParams has no logit_bias yet (the sampler's part of issue 38)")
def test_logit_bias_plus_100_forces_the_token(app, runtime):
    """OpenAI's logit_bias end to end: +100 on one token makes every generated token that token."""
    token = runtime.tokenizer.encode(" fox", add_special_tokens=False)[-1]
    for route, base in (("/v1/chat/completions", {"messages": ASK}), ("/v1/completions", {"prompt": "Hello"})):
        response = call(app, route, {**base, "max_tokens": 4, "temperature": 1.0, "seed": 3, "ignore_eos": True,
                                     "logit_bias": {str(token): 100}})
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        text = choice["message"]["content"] if "message" in choice else choice["text"]
        assert text == runtime.tokenizer.decode([token] * 4)


def test_a_template_that_cannot_render_the_messages_is_a_400(tiny_llama_dir):
    """ChatML concatenates content: an assistant turn with only tool calls is beyond it, a 400, not a 500."""
    with Runtime(tiny_llama_dir, device="cpu", dtype="float32", max_total_tokens=2048) as rt:
        messages = ASK + [{"role": "assistant", "content": None, "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]}]
        response = call(create_app(rt), "/v1/chat/completions", {"messages": messages, "max_tokens": 2})
        assert response.status_code == 400 and response.json()["error"]["param"] == "messages", response.text


def test_a_special_call_tag_is_kept_in_the_text():
    class Tokenizer:
        all_special_ids = [7]

        def __init__(self, ids):
            self.ids = ids

        def encode(self, text, add_special_tokens=False):
            return self.ids

    assert tools.TemplateTools(Tokenizer([7])).call_tag_is_special("hermes")
    assert not tools.TemplateTools(Tokenizer([8])).call_tag_is_special("hermes")
    assert not tools.TemplateTools(Tokenizer([1, 2])).call_tag_is_special("hermes")
    assert not tools.TemplateTools(Tokenizer([7])).call_tag_is_special("llama3_json")


class ScriptedRuntime:
    """The tiny runtime, but `async_generate` answers with a scripted model reply (streamed in pieces
    when asked): the auto route's parse path, whatever the random weights would write."""

    def __init__(self, runtime: Runtime, reply: str):
        self._runtime, self.reply, self.calls = runtime, reply, []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._runtime, name)

    async def async_generate(self, stream: bool = False, **kwargs: Any) -> Any:
        self.calls.append(kwargs)
        meta = {"id": "scripted", "prompt_tokens": 3, "cached_tokens": 0, "completion_tokens": 5,
                "finish_reason": {"type": "stop"}, "ttft": 0.0, "e2e_latency": 0.0, "queue_time": 0.0}
        if not stream:
            return {"text": self.reply, "output_ids": [1, 2, 3, 4, 5], "meta_info": meta}

        async def chunks() -> Any:
            pieces = [self.reply[i : i + 5] for i in range(0, len(self.reply), 5)]
            for i, piece in enumerate(pieces):
                last = i == len(pieces) - 1
                yield {"index": 0, "id": "scripted", "text": piece, "output_ids": [i], "finished": last,
                       **({"meta_info": meta} if last else {})}

        return chunks()


@pytest.mark.parametrize("parallel", [True, False])
def test_auto_parses_the_models_own_calls(runtime, parallel):
    reply = ('Checking both.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>\n'
             '<tool_call>\n{"name": "get_time", "arguments": {"utc": true}}\n</tool_call>')
    scripted = ScriptedRuntime(runtime, reply)
    app = create_app(scripted)  # type: ignore[arg-type]
    body = {"messages": ASK, "tools": [WEATHER, TIME], "max_tokens": 64, "parallel_tool_calls": parallel}
    choice = call(app, "/v1/chat/completions", body).json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Checking both.\n"
    names = [c["function"]["name"] for c in choice["message"]["tool_calls"]]
    assert names == (["get_weather", "get_time"] if parallel else ["get_weather"])
    assert json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"]) == {"city": "Rome"}
    assert "ebnf" not in scripted.calls[0]["sampling_params"], "auto does not constrain"
    assert "input_ids" in scripted.calls[0] and "messages" not in scripted.calls[0], "the prompt has the tools"

    chunks = [e for e in events(call(app, "/v1/chat/completions", {**body, "stream": True})) if e != "[DONE]"]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert "".join(d.get("content") or "" for d in deltas) == "Checking both.\n"
    streamed = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    headers = [c for c in streamed if "id" in c]
    assert [h["function"]["name"] for h in headers] == names
    assert [h["index"] for h in headers] == list(range(len(names)))
    arguments = "".join(c["function"]["arguments"] for c in streamed if c["index"] == 0)
    assert json.loads(arguments) == {"city": "Rome"}
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_auto_with_prose_only_is_content(runtime):
    app = create_app(ScriptedRuntime(runtime, "It is sunny in <b>Paris</b>."))  # type: ignore[arg-type]
    body = {"messages": ASK, "tools": [WEATHER], "max_tokens": 64}
    choice = call(app, "/v1/chat/completions", body).json()["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "It is sunny in <b>Paris</b>."}
    assert choice["finish_reason"] == "stop"
    chunks = [e for e in events(call(app, "/v1/chat/completions", {**body, "stream": True})) if e != "[DONE]"]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == "It is sunny in <b>Paris</b>." and chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_developer_is_rendered_as_system(runtime):
    request = ChatCompletionRequest(messages=[{"role": "developer", "content": "Be brief."}, *ASK])
    assert request.chat_messages()[0] == {"role": "system", "content": "Be brief."}
