"""The HTTP app over a tiny random-weight model, driven in-process with httpx's ASGI transport.

Every endpoint, every error shape, streaming, usage with cached tokens,
API keys and per-key cache isolation. The end-to-end run of `radixrt serve`
with the real `openai` client is in test_server_e2e.py.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from radixrt import Runtime
from radixrt.kernels import cpu
from radixrt.server.app import ServerSettings, create_app

KEYS = ("key-a", "key-b")


@pytest.fixture(scope="module")
def runtime(tiny_llama_dir):
    with Runtime(tiny_llama_dir, device="cpu", dtype="float32", max_total_tokens=4096, check_invariants=True) as rt:
        yield rt


def call(app, method: str, path: str, body: Any = None, key: str | None = None, raw: bytes | None = None):
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as client:
            if raw is not None:
                headers["Content-Type"] = "application/json"
                return await client.request(method, path, content=raw, headers=headers)
            return await client.request(method, path, json=body, headers=headers)

    return asyncio.run(go())


def events(response: httpx.Response) -> list[Any]:
    """The `data:` payloads of an SSE body, [DONE] as the string."""
    payloads = []
    for line in response.text.splitlines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            payloads.append(data if data == "[DONE]" else json.loads(data))
    return payloads


@pytest.fixture(scope="module")
def app(runtime):
    return create_app(runtime)


CHAT = {"messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 6, "temperature": 0}


def test_chat_completion_matches_runtime_generate(app, runtime):
    response = call(app, "POST", "/v1/chat/completions", CHAT)
    assert response.status_code == 200, response.text
    body = response.json()
    expected = runtime.generate(CHAT["messages"], {"max_new_tokens": 6, "temperature": 0})
    assert body["object"] == "chat.completion" and body["model"] == runtime.model_name
    choice = body["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": expected["text"]}
    assert choice["finish_reason"] == expected["meta_info"]["finish_reason"]["type"]
    usage = body["usage"]
    assert usage["prompt_tokens"] == expected["meta_info"]["prompt_tokens"]
    assert usage["completion_tokens"] == len(expected["output_ids"])
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    again = call(app, "POST", "/v1/chat/completions", CHAT).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, "the same prompt again hits the cache"


def test_cached_tokens_is_zero_not_missing_on_a_miss(app):
    body = {"prompt": [301, 302, 303, 304], "max_tokens": 2}  # a first token no other test starts with
    usage = call(app, "POST", "/v1/completions", body).json()["usage"]
    assert usage["prompt_tokens_details"] == {"cached_tokens": 0}


def test_chat_stream_with_usage(app, runtime):
    body = {**CHAT, "stream": True, "stream_options": {"include_usage": True}, "n": 2, "seed": 3, "temperature": 0.8}
    response = call(app, "POST", "/v1/chat/completions", body)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    payloads = events(response)
    assert payloads[-1] == "[DONE]"
    chunks = payloads[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    texts = {0: "", 1: ""}
    finishes = {}
    for chunk in chunks[:-1]:
        assert chunk["usage"] is None
        for choice in chunk["choices"]:
            texts[choice["index"]] += choice["delta"].get("content", "")
            if choice["finish_reason"]:
                finishes[choice["index"]] = choice["finish_reason"]
    assert set(finishes) == {0, 1}
    usage = chunks[-1]["usage"]
    assert chunks[-1]["choices"] == [] and usage["completion_tokens"] > 0
    assert "cached_tokens" in usage["prompt_tokens_details"]
    expected = runtime.generate(CHAT["messages"], {"max_new_tokens": 6, "temperature": 0.8, "seed": 3, "n": 2})
    assert [texts[0], texts[1]] == [r["text"] for r in expected]


def test_completions_single_batch_and_echo(app, runtime):
    one = call(app, "POST", "/v1/completions", {"prompt": "Once upon", "max_tokens": 5, "temperature": 0}).json()
    expected = runtime.generate("Once upon", {"max_new_tokens": 5, "temperature": 0})
    assert one["object"] == "text_completion" and one["choices"][0]["text"] == expected["text"]
    batch = call(app, "POST", "/v1/completions", {"prompt": ["a b", "c d"], "max_tokens": 3, "temperature": 0, "n": 2})
    assert [c["index"] for c in batch.json()["choices"]] == [0, 1, 2, 3]
    echo = call(app, "POST", "/v1/completions", {"prompt": "Once upon", "max_tokens": 5, "temperature": 0, "echo": True})
    assert echo.json()["choices"][0]["text"] == "Once upon" + expected["text"]
    ids = call(app, "POST", "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0}).json()
    assert ids["usage"]["prompt_tokens"] == 3


def test_completion_logprobs_and_chat_top_logprobs(app):
    completion = call(app, "POST", "/v1/completions", {"prompt": "x y", "max_tokens": 3, "logprobs": 2}).json()
    logprobs = completion["choices"][0]["logprobs"]
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == len(logprobs["top_logprobs"]) == 3
    assert all(len(top) <= 2 for top in logprobs["top_logprobs"])
    chat = call(app, "POST", "/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 3}).json()
    content = chat["choices"][0]["logprobs"]["content"]
    assert len(content) == chat["usage"]["completion_tokens"]
    for entry in content:
        assert len(entry["top_logprobs"]) == 3 and entry["logprob"] <= 0
        assert entry["top_logprobs"][0]["logprob"] >= entry["logprob"] - 1e-5, "greedy picks the most likely"


def test_stop_strings_cut_the_text(app, runtime):
    reference = runtime.generate("Once upon", {"max_new_tokens": 8, "temperature": 0})["text"]
    stop = reference[3:5] if len(reference) >= 5 else None
    if not stop or not stop.strip():
        pytest.skip("the tiny model's text has no usable stop string")
    body = {"prompt": "Once upon", "max_tokens": 8, "temperature": 0, "stop": [stop]}
    choice = call(app, "POST", "/v1/completions", body).json()["choices"][0]
    assert choice["finish_reason"] == "stop" and stop not in choice["text"]


def test_native_generate_and_stream(app, runtime):
    body = {"text": "Once upon", "sampling_params": {"max_new_tokens": 5, "temperature": 0}}
    result = call(app, "POST", "/generate", body).json()
    expected = runtime.generate("Once upon", {"max_new_tokens": 5, "temperature": 0})
    assert result["text"] == expected["text"] and result["output_ids"] == expected["output_ids"]
    assert result["meta_info"]["finish_reason"] == expected["meta_info"]["finish_reason"]
    streamed = events(call(app, "POST", "/generate", {**body, "stream": True, "rid": "native-1"}))
    assert streamed[-1] == "[DONE]"
    last = streamed[-2]
    assert last["text"] == expected["text"] and last["meta_info"]["id"] == "native-1"
    batch = call(app, "POST", "/generate", {"input_ids": [[5, 6], [7, 8]], "sampling_params": {"max_new_tokens": 2}})
    assert len(batch.json()) == 2


def test_models_info_health_flush_abort(app, runtime):
    models = call(app, "GET", "/v1/models").json()
    assert models["data"][0]["id"] == runtime.model_name
    assert call(app, "GET", "/health").status_code == 200
    info = call(app, "GET", "/get_model_info").json()
    assert info["model_path"] == runtime.model_name and info["is_generation"] is True
    server = call(app, "GET", "/get_server_info").json()
    assert server["runtime_config"]["max_total_tokens"] == 4096 and "hit_rate" in server["cache_stats"]
    # "auto" resolved: on where radixrt's kernels build (the tiny float32 model runs through them)
    assert server["deterministic"] is (cpu.rowwise_matmul() is not None)
    assert server["kernel_isa"] == cpu.isa()  # the CPU kernels' instruction set (RADIXRT_CPU_ISA caps it)
    # parameters by the format they run in: the tiny float32 model holds every one dense
    assert server["weight_formats"] == {"F32": sum(p.numel() for p in runtime.engine.runner.model.parameters())}
    assert call(app, "POST", "/abort_request", {"rid": "nobody"}).json() == {"rid": "nobody"}
    assert call(app, "POST", "/flush_cache").status_code == 200
    assert runtime.cache_stats()["tree_tokens"] == 0


def test_metrics_agree_with_cache_stats(app, runtime):
    call(app, "POST", "/v1/completions", {"prompt": "metrics please", "max_tokens": 3, "temperature": 0})
    text = call(app, "GET", "/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    stats = runtime.cache_stats()

    def value(name: str, suffix: str = "") -> float:
        return next(s.value for s in families[name].samples if s.name == name + suffix)

    assert value("radixrt:num_running_reqs") == 0
    assert value("radixrt:num_queue_reqs") == 0
    assert value("radixrt:cache_hit_rate") == pytest.approx(stats["hit_rate"])
    assert value("radixrt:token_usage") == pytest.approx(stats["pool_used_tokens"] / stats["pool_total_tokens"])
    assert value("radixrt:requests", "_total") >= 1
    assert value("radixrt:generation_tokens", "_total") >= 3
    assert value("radixrt:time_to_first_token_seconds", "_count") >= 1


@pytest.mark.parametrize(
    "path, body, status, param",
    [
        ("/v1/chat/completions", {"messages": []}, 400, "messages"),
        ("/v1/chat/completions", {}, 400, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}, 400, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
         "messages"),
        ("/v1/chat/completions", {**CHAT, "temperature": -1}, 400, "temperature"),
        ("/v1/chat/completions", {**CHAT, "top_p": 0}, 400, "top_p"),
        ("/v1/chat/completions", {**CHAT, "top_k": 0}, 400, "top_k"),
        ("/v1/chat/completions", {**CHAT, "n": 0}, 400, "n"),
        ("/v1/chat/completions", {**CHAT, "max_tokens": -5}, 400, "max_tokens"),
        ("/v1/chat/completions", {**CHAT, "max_tokens": 10**6}, 400, "messages"),
        ("/v1/chat/completions", {**CHAT, "model": "gpt-9"}, 404, "model"),
        ("/v1/completions", {"prompt": ""}, 400, "prompt"),
        ("/v1/completions", {"max_tokens": 3}, 400, "prompt"),
        ("/v1/completions", {"prompt": [5, 10**7], "max_tokens": 2}, 400, "input_ids"),
        ("/v1/completions", {"prompt": "x", "best_of": 3}, 400, "best_of"),
        ("/generate", {"sampling_params": {"max_new_tokens": 2}}, 400, "text"),
        ("/generate", {"text": "x", "sampling_params": {"temperature": "hot"}}, 400, "temperature"),
        ("/generate", {"text": "x", "sampling_params": {"bogus": 1}}, 400, None),
        ("/abort_request", {}, 400, "rid"),
    ],
)
def test_bad_input_gets_an_openai_error_naming_the_field(app, path, body, status, param):
    response = call(app, "POST", path, body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param or param in error["message"], error


def test_malformed_json_and_unknown_fields(app):
    response = call(app, "POST", "/v1/chat/completions", raw=b"{not json")
    assert response.status_code == 400 and "error" in response.json()
    unknown = call(app, "POST", "/v1/chat/completions", {**CHAT, "some_future_field": 1})
    assert unknown.status_code == 400, "a field in neither OpenAI's API nor SGLang's is refused, never ignored"
    assert unknown.json()["error"]["param"] == "some_future_field"


def test_api_keys_guard_everything_but_health(runtime):
    app = create_app(runtime, ServerSettings(api_keys=frozenset(KEYS)))
    assert call(app, "GET", "/health").status_code == 200
    for method, path in [("GET", "/v1/models"), ("POST", "/v1/chat/completions"), ("GET", "/metrics")]:
        response = call(app, method, path, CHAT if method == "POST" else None)
        assert response.status_code == 401 and response.json()["error"]["type"] == "authentication_error"
        assert call(app, method, path, CHAT if method == "POST" else None, key="wrong").status_code == 401
    assert call(app, "POST", "/v1/chat/completions", CHAT, key="key-a").status_code == 200


@pytest.mark.parametrize("isolation, expect_cross_hit", [("none", True), ("per-key", False)])
def test_per_key_cache_isolation(runtime, isolation, expect_cross_hit):
    app = create_app(runtime, ServerSettings(api_keys=frozenset(KEYS), cache_isolation=isolation))
    runtime.flush_cache()  # earlier tests' prompts and outputs may share a first token with this one
    prompt = {"prompt": f"a tenant's private system prompt, isolation {isolation} " * 3, "max_tokens": 1}
    first = call(app, "POST", "/v1/completions", prompt, key="key-a").json()["usage"]["prompt_tokens_details"]
    assert first["cached_tokens"] == 0
    again = call(app, "POST", "/v1/completions", prompt, key="key-a").json()["usage"]["prompt_tokens_details"]
    assert again["cached_tokens"] > 0, "a tenant hits its own cache"
    other = call(app, "POST", "/v1/completions", prompt, key="key-b").json()["usage"]["prompt_tokens_details"]
    assert (other["cached_tokens"] > 0) is expect_cross_hit


def test_overload_is_a_503_and_nothing_else_is_lost(runtime):
    app = create_app(runtime, ServerSettings(max_queued_requests=0))
    limit = runtime.config.max_running_requests
    n = limit // 3 + 1  # three prompts of n samples each: more requests than the engine runs at once
    response = call(app, "POST", "/v1/completions", {"prompt": ["x", "y", "z"], "max_tokens": 1, "n": n})
    assert response.status_code == 503 and response.json()["error"]["code"] == "overloaded"
    assert call(app, "POST", "/v1/completions", {"prompt": "x", "max_tokens": 1}).status_code == 200


def test_metrics_label_each_replica():
    """With replicas, /metrics adds one labelled series per replica to the added-up gauges."""
    from radixrt.server.metrics import ServerMetrics

    stats = {"running_requests": 3, "waiting_requests": 1, "pool_used_tokens": 50, "pool_total_tokens": 200,
             "hit_rate": 0.5}
    replicas = [{"name": "replica-0", "routed": True, "in_flight": 2, "cache_stats": {**stats, "hit_rate": 0.75}},
                {"name": "replica-1", "routed": False, "in_flight": 0, "cache_stats": None}]
    families = {f.name: f for f in text_string_to_metric_families(ServerMetrics().render(stats, replicas).decode())}
    hit = {s.labels["replica"]: s.value for s in families["radixrt:replica_cache_hit_rate"].samples}
    assert hit == {"replica-0": 0.75}  # replica-1 did not answer: no figure rather than a stale one
    routed = {s.labels["replica"]: s.value for s in families["radixrt:replica_routed"].samples}
    assert routed == {"replica-0": 1.0, "replica-1": 0.0}
    assert families["radixrt:cache_hit_rate"].samples[0].value == 0.5
