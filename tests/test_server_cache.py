"""The cache's explanations and picture over HTTP, `radixrt explain`, and /dashboard in a real browser.

The endpoints run in-process (httpx's ASGI transport, as test_server.py);
the command line and the dashboard run against a real `radixrt serve` on a
loopback port, the dashboard in the operating system's Chromium driven by
Playwright (skipped where either is missing).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import xml.etree.ElementTree as ET

import httpx
import pytest

from radixrt import Runtime
from radixrt.server.app import ServerSettings, create_app
from tests.test_server import call
from tests.test_server_e2e import free_port, start_server

CHROMIUM = "/usr/bin/chromium"
GREEDY = {"max_new_tokens": 2, "temperature": 0}


@pytest.fixture(scope="module")
def runtime(tiny_llama_dir):
    with Runtime(tiny_llama_dir, device="cpu", dtype="float32", max_total_tokens=4096, check_invariants=True) as rt:
        yield rt


@pytest.fixture(scope="module")
def app(runtime):
    return create_app(runtime)


def test_explain_over_http_is_the_runtimes_report(app, runtime):
    runtime.flush_cache()
    cached = list(range(20, 80))
    assert call(app, "POST", "/generate", {"input_ids": cached, "sampling_params": GREEDY}).status_code == 200
    changed = cached[:25] + [9, 9] + cached[27:]
    response = call(app, "POST", "/cache/explain", {"input_ids": changed})
    assert response.status_code == 200
    assert response.json() == runtime.explain_cache(input_ids=changed)
    assert response.json()["diverged_at"] == 25
    chat = call(app, "POST", "/cache/explain", {"messages": [{"role": "user", "content": "hello"}]})
    assert chat.status_code == 200 and chat.json()["prompt_tokens"] > 0


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({}, None, "exactly one"),
        ({"text": ""}, "text", "empty"),
        ({"input_ids": [1] * 1100}, "input_ids", "context length"),
        ({"messages": [{"role": "user"}]}, "messages", "messages"),
        ({"text": "hi", "cache_salt": 7}, "cache_salt", "string"),
        ({"text": "hi", "input_ids": [1, 2]}, None, "exactly one"),
    ],
)
def test_explain_bad_input_is_a_400_naming_the_field(app, body, param, words):
    response = call(app, "POST", "/cache/explain", body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert words in error["message"]
    if param is not None:
        assert error["param"] == param


def test_tree_svg_parses_and_checks_max_nodes(app, runtime):
    runtime.flush_cache()
    call(app, "POST", "/generate", {"text": ["apples and pears", "apples and plums"], "sampling_params": GREEDY})
    response = call(app, "GET", "/cache/tree.svg?max_nodes=50")
    assert response.status_code == 200 and response.headers["content-type"].startswith("image/svg+xml")
    texts = " ".join(t.text or "" for t in ET.fromstring(response.text).iter("{http://www.w3.org/2000/svg}text"))
    assert "apples and" in texts and "ears" in texts and "lums" in texts  # the two sides of the branch point
    for bad in ("0", "-1", "many"):
        rejected = call(app, "GET", f"/cache/tree.svg?max_nodes={bad}")
        assert rejected.status_code == 400 and "max_nodes" in rejected.json()["error"]["message"]


def test_per_key_isolation_hides_other_tenants_prefixes(runtime):
    runtime.flush_cache()
    isolated = create_app(runtime, ServerSettings(api_keys=frozenset({"key-a", "key-b"}), cache_isolation="per-key"))
    body = {"text": "the secret ledger of tenant alpha", "sampling_params": GREEDY}
    assert call(isolated, "POST", "/generate", body, key="key-a").status_code == 200
    own = call(isolated, "GET", "/cache/tree.svg", key="key-a").text
    other = call(isolated, "GET", "/cache/tree.svg", key="key-b").text
    assert "ledger" in own and "ledger" not in other
    probe = {"text": "the secret ledger of tenant alpha"}
    assert call(isolated, "POST", "/cache/explain", probe, key="key-b").json()["cached_tokens"] == 0
    assert call(isolated, "POST", "/cache/explain", probe, key="key-a").json()["cached_tokens"] > 0
    assert call(isolated, "GET", "/cache/tree.svg").status_code == 401
    assert call(isolated, "GET", "/dashboard").status_code == 200  # the page itself asks for the key


def test_dashboard_page_is_served(app):
    response = call(app, "GET", "/dashboard")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/html")
    for element in ('id="tree"', 'id="hit-rate"', 'id="running"', 'id="queued"', 'id="history"'):
        assert element in response.text


# --- a real server: the command line and the browser --------------------------------------------------


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    port = free_port()
    process = start_server(port, tmp_path_factory.mktemp("cache-serve") / "server.log", "--model", str(tiny_llama_dir))
    yield f"http://127.0.0.1:{port}"
    process.send_signal(signal.SIGTERM)
    process.wait(timeout=60)


def explain_command(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "radixrt.cli", "explain", *args],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_radixrt_explain_against_a_running_server(server):
    prompt = "The harbour office keeps a ledger of every ship that arrives."
    assert httpx.post(server + "/generate", json={"text": prompt, "sampling_params": GREEDY}, timeout=60).is_success
    done = explain_command(prompt.replace("every ship", "each boat"), "--url", server)
    assert done.returncode == 0, done.stderr
    assert "leaves the cache at token" in done.stdout and "every ship" in done.stdout
    report = json.loads(explain_command(prompt, "--url", server, "--json").stdout)
    assert report["diverged_at"] is None
    refused = explain_command(prompt, "--url", f"http://127.0.0.1:{free_port()}")
    assert refused.returncode == 1 and "cannot reach the server" in refused.stderr
    bad = explain_command("", "--url", server)
    assert bad.returncode == 1 and "HTTP 400" in bad.stderr


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists(CHROMIUM), reason="needs Chromium at /usr/bin/chromium (apt-get install chromium)")
def test_dashboard_in_a_real_browser_shows_the_tree_and_counters_moving(server):
    playwright = pytest.importorskip("playwright.sync_api")
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            page = browser.new_page()
            page.goto(server + "/dashboard")
            page.wait_for_function("document.querySelector('#tree svg') !== null")
            page.wait_for_function("document.getElementById('prompt-tokens').textContent !== '-'")
            before = int(page.inner_text("#prompt-tokens"))
            text = "zebras graze quietly beside the lighthouse"
            body = {"text": text, "sampling_params": GREEDY}
            assert httpx.post(server + "/generate", json=body, timeout=60).is_success
            page.wait_for_function(f"Number(document.getElementById('prompt-tokens').textContent) > {before}",
                                   timeout=30_000)
            page.wait_for_function("document.getElementById('tree').textContent.includes('zebras')", timeout=30_000)
            assert page.locator("#tree svg g.node").count() >= 2
            assert page.get_attribute("#hit-line", "points")
        finally:
            browser.close()

