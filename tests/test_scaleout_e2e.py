"""`radixrt serve --replicas 2` on a real local Ray instance, driven over HTTP.

Two replicas of a tiny random-weight model behind the prefix router: the
turns of one conversation land on one replica, two tenants' system prompts
spread over both, and a replica killed with SIGKILL leaves the service
answering; Ray Serve brings it back, empty, and the router uses it again.
Which replica served a request is read from /get_server_info (each
replica's prompt-token counter), as an operator would.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from radixrt.kernels import cpu
from tests.test_server_e2e import free_port

pytest.importorskip("ray.serve")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def fleet(tiny_llama_dir, tmp_path_factory):
    port = free_port()
    log_path: Path = tmp_path_factory.mktemp("fleet") / "serve.log"
    command = [
        sys.executable, "-m", "radixrt.cli", "--dtype", "float32", "--device", "cpu", "serve",
        "--model", str(tiny_llama_dir), "--port", str(port), "--max-total-tokens", "4096",
        "--replicas", "2", "--router", "prefix",
    ]
    process = subprocess.Popen(command, stdout=log_path.open("wb"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: get(url, "/health").status_code == 200, process, log_path, "healthy")
        yield url
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        assert process.returncode == 0, log_path.read_text()[-4000:]


def get(url: str, path: str) -> httpx.Response:
    try:
        return httpx.get(url + path, timeout=30)
    except httpx.HTTPError:
        return httpx.Response(599)


def wait_until(condition, process, log_path: Path, what: str, limit_s: float = 300) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise AssertionError(f"the server exited with {process.returncode}:\n{log_path.read_text()[-4000:]}")
        if condition():
            return
        time.sleep(0.5)
    raise AssertionError(f"never {what}" + (f":\n{log_path.read_text()[-4000:]}" if log_path else ""))


def replicas(url: str) -> dict[str, dict]:
    return {r["name"]: r for r in get(url, "/get_server_info").json()["replicas"]}


def prompt_tokens(url: str) -> dict[str, int]:
    return {name: (r.get("cache_stats") or {}).get("prompt_tokens", 0) for name, r in replicas(url).items()}


def chat(url: str, messages: list[dict]) -> dict:
    body = {"messages": messages, "max_tokens": 4, "temperature": 0}
    response = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def served_by(url: str, messages: list[dict]) -> tuple[str, dict]:
    """Send one chat request and say which replica counted its prompt."""
    before = prompt_tokens(url)
    reply = chat(url, messages)
    after = prompt_tokens(url)
    grew = [name for name in after if after[name] > before.get(name, 0)]
    assert len(grew) == 1, (before, after)
    return grew[0], reply


def conversation(system: str, turns: int, url: str) -> tuple[set[str], list[int]]:
    messages = [{"role": "system", "content": system}]
    served, cached = set(), []
    for turn in range(turns):
        messages.append({"role": "user", "content": f"question number {turn} about the ledger"})
        name, reply = served_by(url, messages)
        served.add(name)
        cached.append(reply["usage"]["prompt_tokens_details"]["cached_tokens"])
        messages.append({"role": "assistant", "content": reply["choices"][0]["message"]["content"]})
    return served, cached


def test_one_conversation_stays_on_one_replica(fleet):
    # the replicas' "auto", resolved: on where radixrt's kernels build
    assert get(fleet, "/get_server_info").json()["deterministic"] is (cpu.rowwise_matmul() is not None)
    served, cached = conversation("You keep the ledger of the harbour office. " * 4, 4, fleet)
    assert len(served) == 1
    assert all(c > 0 for c in cached[1:])  # every later turn reused the earlier ones
    metrics = get(fleet, "/metrics").text
    assert 'radixrt:replica_cache_hit_rate{replica="replica-0"}' in metrics
    assert 'radixrt:replica_routed{replica="replica-1"} 1.0' in metrics


def test_streams_and_batches_come_back_in_order(fleet):
    body = {"messages": [{"role": "user", "content": "count to three"}], "max_tokens": 4, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", fleet + "/v1/chat/completions", json=body, timeout=120) as response:
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]" and '"usage"' in lines[-2]
    prompts = ["the first prompt", "a second, different prompt", "the first prompt"]
    plain = httpx.post(fleet + "/v1/completions", json={"prompt": prompts, "max_tokens": 3, "temperature": 0},
                       timeout=120).json()
    assert [c["index"] for c in plain["choices"]] == [0, 1, 2]
    assert plain["choices"][0]["text"] == plain["choices"][2]["text"]  # greedy: same prompt, same text


def test_two_tenants_system_prompts_spread_over_both_replicas(fleet):
    assert httpx.post(fleet + "/flush_cache", timeout=60).status_code == 200  # both replicas empty
    served_a, cached_a = conversation("Tenant Alpha: you answer about apples and pears. " * 4, 2, fleet)
    served_b, cached_b = conversation("Tenant Beta: you answer about bicycles and trains. " * 4, 2, fleet)
    assert len(served_a) == len(served_b) == 1
    assert served_a != served_b
    assert cached_a[1] > 0 and cached_b[1] > 0


def test_a_killed_replica_leaves_the_service_answering_and_comes_back_empty(fleet):
    before = replicas(fleet)
    victim = "replica-0"
    os.kill(before[victim]["pid"], signal.SIGKILL)
    for turn in range(4):
        chat(fleet, [{"role": "user", "content": f"are you still there? {turn}"}])
    wait_until(
        lambda: (r := replicas(fleet)[victim]).get("routed") and r.get("pid") not in (None, before[victim]["pid"]),
        None, None, "saw the replica come back",
    )
    back = replicas(fleet)[victim]
    assert back["instance"] != before[victim]["instance"]
    # A new process with fresh counters: at most the chats above, not what it had served before.
    assert back["cache_stats"]["prompt_tokens"] < before[victim]["cache_stats"]["prompt_tokens"]
    served = {served_by(fleet, [{"role": "user", "content": f"fresh question {n}"}])[0] for n in range(6)}
    assert victim in served  # routed to again
