"""SGLang's own frontend (`sglang.lang`, sglang 0.5.23, unchanged) against a real `radixrt serve`.

One server (the bundled SmolLM2, a ChatML model) for the module, driven through
`sgl.RuntimeEndpoint`: chat `gen`, greedy repeatability, `select` (its normalized
log-probs from radixrt's `meta_info` triples), `fork`/`join`, `run_batch`, stop
strings, streaming with `text_iter`, regex and JSON-schema gens, `dtype=int`/`bool`,
`min_tokens` and `flush_cache`. Beside them, a walk over the installed sglang's
`GenerateReqInput` and `SamplingParams` fields (read from its source, not radixrt's
own models) that fails on any field radixrt neither honours, lists as a no-op, nor refuses.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import math
import signal
from pathlib import Path

import httpx
import pytest

from radixrt.sampling.params import REFUSED_SAMPLING_FIELDS, SamplingParams
from radixrt.server.sglang_fields import (
    GENERATE_HONOURED,
    GENERATE_NOOPS,
    GENERATE_REFUSED,
    SAMPLING_HONOURED,
    SAMPLING_NOOPS,
)
from tests.test_server_e2e import free_port, start_server

sgl = pytest.importorskip("sglang", reason="sglang (the pinned frontend, `make setup`) is not installed")


# --- the field walk: sglang's own field lists, read from the installed package's source ---------
def _sglang_fields(relative_path: str, class_name: str) -> dict[str, str | None]:
    """A class's annotated fields and their defaults' source, from the installed sglang (its
    io_struct imports torchvision and the server's stack; its source needs nothing)."""
    spec = importlib.util.find_spec("sglang")
    assert spec is not None and spec.origin is not None
    source = (Path(spec.origin).parent / relative_path).read_text()
    node = next(n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ClassDef) and n.name == class_name)
    return {
        item.target.id: ast.unparse(item.value) if item.value else None
        for item in node.body
        if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)
    }


def test_sglang_version_is_the_pinned_one():
    from importlib.metadata import version

    assert version("sglang") == "0.5.23", "the field lists below are sglang 0.5.23's; re-walk them for another"


def test_every_generate_field_is_honoured_a_noop_or_refused():
    fields = _sglang_fields("srt/managers/io_struct.py", "GenerateReqInput")
    assert len(fields) > 40, "the walk found GenerateReqInput's fields"
    sorted_into = [GENERATE_HONOURED, set(GENERATE_NOOPS), set(GENERATE_REFUSED)]
    missing = [name for name in fields if not any(name in group for group in sorted_into)]
    assert not missing, f"GenerateReqInput fields radixrt does not sort (docs/server.md): {missing}"
    twice = [name for name in fields if sum(name in group for group in sorted_into) > 1]
    assert not twice
    stale = (GENERATE_HONOURED | set(GENERATE_NOOPS) | set(GENERATE_REFUSED)) - set(fields)
    assert not stale, f"listed but not sglang's: {stale}"


def test_every_sampling_field_is_honoured_a_noop_or_refused():
    fields = _sglang_fields("srt/sampling/sampling_params.py", "SamplingParams")
    assert "min_new_tokens" in fields and "logit_bias" in fields
    sorted_into = [SAMPLING_HONOURED, set(SAMPLING_NOOPS), set(REFUSED_SAMPLING_FIELDS)]
    missing = [name for name in fields if not any(name in group for group in sorted_into)]
    assert not missing, f"SamplingParams fields radixrt does not sort (docs/sampling.md): {missing}"
    # Every field at sglang's default (a null for each) is accepted, as its client sends them.
    SamplingParams.from_any({name: None for name in fields})


# --- a real server, sglang's frontend -------------------------------------------------------------
@pytest.fixture(scope="module")
def endpoint(tmp_path_factory):
    port = free_port()
    log_path = tmp_path_factory.mktemp("serve") / "server.log"
    process = start_server(port, log_path)
    url = f"http://127.0.0.1:{port}"
    backend = sgl.RuntimeEndpoint(url, chat_template_name="chatml")  # SmolLM2's template
    sgl.set_default_backend(backend)
    yield url, backend
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)


@sgl.function
def chat(s, question):
    s += sgl.system("You are a helpful assistant.")
    s += sgl.user(question)
    s += sgl.assistant(sgl.gen("answer", max_tokens=16, temperature=0))


@pytest.mark.slow
def test_chat_gen_and_greedy_repeatability(endpoint):
    first = chat.run(question="What is the capital of France?")
    again = chat.run(question="What is the capital of France?")
    assert first["answer"] and first["answer"] == again["answer"]
    meta = first.get_meta_info("answer")
    assert 0 < meta["completion_tokens"] <= 16 and meta["prompt_tokens"] > 10
    assert "<|im_start|>assistant" in first.text()


@sgl.function
def pick(s):
    s += "Q: Is the sky blue on a clear day? Answer yes or no.\nA: "
    s += sgl.select("choice", choices=["yes", "no", "maybe not"])


@pytest.mark.slow
def test_select_reads_the_meta_info_triples(endpoint):
    url, _ = endpoint
    state = pick.run()
    meta = state.get_meta_info("choice")
    scores = meta["normalized_prompt_logprobs"]
    assert state["choice"] in ("yes", "no", "maybe not") and len(scores) == 3
    assert all(math.isfinite(x) and x < 0 for x in scores)
    assert state["choice"] == ["yes", "no", "maybe not"][max(range(3), key=lambda i: scores[i])]
    # The triples sglang read: [logprob, token_id, text], the first input logprob a null pad.
    prompt = "Q: Is the sky blue on a clear day? Answer yes or no.\nA: "
    body = {"text": [prompt + "yes"], "sampling_params": {"max_new_tokens": 0, "temperature": 0},
            "return_logprob": True, "return_text_in_logprobs": True, "logprob_start_len": 3}
    result = httpx.post(url + "/generate", json=body, timeout=60).json()[0]
    entries = result["meta_info"]["input_token_logprobs"]
    assert entries[0][0] is None and all(isinstance(e[0], float) and isinstance(e[2], str) for e in entries[1:])
    assert len(entries) == result["meta_info"]["prompt_tokens"] - 3


@sgl.function
def two_tips(s):
    s += "Here are two tips for staying healthy:\n"
    forks = s.fork(2)
    for i, f in enumerate(forks):
        f += f"{i + 1}." + sgl.gen("tip", max_tokens=12, temperature=0, stop="\n")
    s += "1." + forks[0]["tip"] + "\n2." + forks[1]["tip"] + "\nIn short:" + sgl.gen("summary", max_tokens=8,
                                                                                     temperature=0)


@pytest.mark.slow
def test_fork_and_join(endpoint):
    state = two_tips.run()
    assert "\n" not in state["summary"] or state["summary"]
    assert state.text().startswith("Here are two tips") and "In short:" in state.text()


@pytest.mark.slow
def test_run_batch(endpoint):
    questions = ["Name a color.", "Name a fruit.", "Name an animal."]
    states = chat.run_batch([{"question": q} for q in questions], num_threads=3)
    assert len(states) == 3
    for question, state in zip(questions, states):
        assert state["answer"] == chat.run(question=question)["answer"], "greedy: the same alone or batched"


@sgl.function
def until_newline(s):
    s += "Write three short lines about the sea.\n"
    s += sgl.gen("line", max_tokens=40, temperature=0, stop=["\n", "."])


@pytest.mark.slow
def test_stop_strings(endpoint):
    state = until_newline.run()
    assert "\n" not in state["line"] and "." not in state["line"]
    assert state.get_meta_info("line")["finish_reason"]["type"] in ("stop", "length")


@pytest.mark.slow
def test_streaming_with_text_iter(endpoint):
    state = chat.run(question="Tell me about the moon.", stream=True)
    pieces = list(state.text_iter(var_name="answer"))
    assert len(pieces) > 1 and "".join(pieces) == state["answer"]
    assert state["answer"] == chat.run(question="Tell me about the moon.")["answer"]


@sgl.function
def constrained(s):
    s += "Answer with yes or no. Is water wet? "
    s += sgl.gen("yes_no", max_tokens=4, regex=r"(yes|no)")
    s += "\nA person as JSON: "
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "age": {"type": "integer"}}, "required": ["name", "age"],
              "additionalProperties": False}
    s += sgl.gen("person", max_tokens=48, json_schema=json.dumps(schema))


@pytest.mark.slow
def test_regex_and_json_schema_gens(endpoint):
    state = constrained.run()
    assert state["yes_no"] in ("yes", "no")
    person = json.loads(state["person"])
    assert set(person) == {"name", "age"} and isinstance(person["age"], int)


@sgl.function
def typed(s):
    s += "How many legs does a dog have? "
    s += sgl.gen("legs", dtype=int, max_tokens=8)
    s += "\nIs a dog a mammal? "
    s += sgl.gen("mammal", dtype=bool, max_tokens=4)


@pytest.mark.slow
def test_dtype_int_and_bool(endpoint):
    state = typed.run()
    int(state["legs"])
    assert state["mammal"] in ("True", "False")


@sgl.function
def at_least(s):
    s += sgl.user("Say hi.")
    s += sgl.assistant(sgl.gen("answer", min_tokens=24, max_tokens=32, temperature=0))


@pytest.mark.slow
def test_min_tokens(endpoint):
    state = at_least.run()
    assert state.get_meta_info("answer")["completion_tokens"] >= 24


@pytest.mark.slow
def test_flush_cache_and_server_info(endpoint):
    url, backend = endpoint
    backend.flush_cache()
    info = backend.get_server_info()  # sglang reads /server_info
    assert info["cache_stats"]["cached_prompt_tokens"] == 0
    assert httpx.get(url + "/model_info", timeout=10).json() == httpx.get(url + "/get_model_info", timeout=10).json()
