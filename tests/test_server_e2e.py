"""`radixrt serve` as a real process on a loopback port, driven by the real `openai` client.

One server (the bundled SmolLM2) for the module: chat, completions,
streaming with usage, n > 1, stop strings, a shared system prompt reporting
cached tokens, greedy text equal to in-process `Runtime.generate`, clients
that disconnect mid-stream, and a graceful SIGTERM.
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.slow
GLOBAL_OPTIONS = ["--dtype", "float32", "--device", "cpu"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_server(port: int, log_path: Path, *extra: str) -> subprocess.Popen:
    command = [
        sys.executable, "-m", "radixrt.cli", *GLOBAL_OPTIONS, "serve", "--port", str(port),
        "--max-total-tokens", "16384", *extra,
    ]
    log = log_path.open("wb")
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"the server exited with {process.returncode}:\n{log_path.read_text()}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return process
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    process.kill()
    raise AssertionError(f"the server did not become healthy:\n{log_path.read_text()}")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = free_port()
    log_path = tmp_path_factory.mktemp("serve") / "server.log"
    process = start_server(port, log_path)
    yield f"http://127.0.0.1:{port}", process, log_path
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model_id(client):
    return client.models.list().data[0].id


SYSTEM = "You are a helpful assistant who answers in one short sentence. " * 6


def test_chat_equals_in_process_generate(client, model_id, smollm2):
    from radixrt import Runtime

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    reply = client.chat.completions.create(model=model_id, messages=messages, max_tokens=12, temperature=0)
    with Runtime(smollm2, max_total_tokens=16384) as runtime:
        expected = runtime.generate(messages, {"max_new_tokens": 12, "temperature": 0})
    assert reply.choices[0].message.content == expected["text"]
    assert reply.usage.completion_tokens == len(expected["output_ids"])


def test_shared_system_prompt_reports_cached_tokens(client, model_id):
    usages = []
    for question in ("Name a colour.", "Name a fruit."):
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
        reply = client.chat.completions.create(model=model_id, messages=messages, max_tokens=4, temperature=0)
        usages.append(reply.usage)
    assert usages[1].prompt_tokens_details.cached_tokens >= 60, "the second chat reuses the system prompt"


def test_streaming_chat_with_usage_and_n(client, model_id):
    stream = client.chat.completions.create(
        model=model_id, messages=[{"role": "user", "content": "Count to five."}], max_tokens=10,
        temperature=0.7, seed=1, n=2, stream=True, stream_options={"include_usage": True},
    )
    texts = ["", ""]
    usage = None
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
        if chunk.usage is not None:
            usage = chunk.usage
    assert all(texts) and usage is not None and usage.completion_tokens > 0
    assert usage.prompt_tokens_details.cached_tokens is not None


def test_completion_with_stop_string(client, model_id):
    free = client.completions.create(model=model_id, prompt="1, 2, 3, 4,", max_tokens=12, temperature=0)
    text = free.choices[0].text
    assert ", " in text
    stopped = client.completions.create(model=model_id, prompt="1, 2, 3, 4,", max_tokens=12, temperature=0, stop=[","])
    assert stopped.choices[0].text == text.split(",")[0] and stopped.choices[0].finish_reason == "stop"


def test_unknown_model_and_bad_field_are_4xx(client):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=None, messages=[{"role": "user", "content": "x"}], temperature=5)
    assert "temperature" in str(caught.value)


def test_clients_that_disconnect_leave_nothing_behind(server):
    base = server[0]

    async def one(index: int, client: httpx.AsyncClient) -> str:
        body = {"messages": [{"role": "user", "content": f"Tell me a long story about {index}."}],
                "max_tokens": 48, "temperature": 0, "stream": True, "ignore_eos": True}
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            collected = ""
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if index % 2:  # half the clients leave after their first event
                    return "left"
                data = line[len("data: "):]
                if data == "[DONE]":
                    return collected
                for choice in json.loads(data)["choices"]:
                    collected += choice["delta"].get("content", "")
        return collected

    async def run() -> list[str]:
        async with httpx.AsyncClient(base_url=base, timeout=300) as client:
            return await asyncio.gather(*(one(i, client) for i in range(12)))

    results = asyncio.run(run())
    assert all(results[i] for i in range(0, 12, 2)), "the clients that stayed got their whole answer"
    deadline = time.monotonic() + 30
    while True:
        info = httpx.get(base + "/get_server_info", timeout=30).json()["cache_stats"]
        if info["running_requests"] == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert info["running_requests"] == 0 and info["waiting_requests"] == 0
    assert info["protected_tokens"] == 0, "no leaked locks"
    metrics = httpx.get(base + "/metrics", timeout=30).text
    samples = {s.name: s.value for f in text_string_to_metric_families(metrics) for s in f.samples}
    assert samples["radixrt:num_running_reqs"] == 0
    assert samples["radixrt:aborted_requests_total"] >= 6, "each client that left counts as an abort"


def test_sigterm_shuts_down_cleanly(tmp_path):
    port = free_port()
    process = start_server(port, tmp_path / "server.log")
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=60) == 0
    assert "shut down" in (tmp_path / "server.log").read_text()
