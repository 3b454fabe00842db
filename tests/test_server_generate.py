"""SGLang's `/generate` contract as its own client uses it (issue 38): every sampling parameter,
the log-prob request fields and `meta_info` shapes, batches with per-prompt fields, scoring with
`max_new_tokens: 0`, the stream sglang parses, the `/server_info` forms, and a 400 naming the field
for bad input, before anything is queued."""

from __future__ import annotations

import pytest

from tests.test_server import app, call, events, runtime  # noqa: F401 (fixtures)

GREEDY = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
# What sglang 0.5.23's RuntimeEndpoint sends on every gen.
SGLANG_CLIENT_PARAMS = {
    "skip_special_tokens": True, "spaces_between_special_tokens": True, "max_new_tokens": 4, "min_new_tokens": 0,
    "n": 1, "stop": [], "stop_token_ids": [], "stop_regex": [], "temperature": 0, "top_p": 1.0, "top_k": -1,
    "min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0, "ignore_eos": False, "regex": None,
    "json_schema": None,
}


def test_the_sglang_clients_parameters_are_accepted(app, runtime):
    result = call(app, "POST", "/generate", {"text": "Once upon", "sampling_params": SGLANG_CLIENT_PARAMS})
    assert result.status_code == 200, result.text
    assert result.json()["text"] == runtime.generate("Once upon", SGLANG_CLIENT_PARAMS)["text"]
    nulls = {name: None for name in ("temperature", "top_p", "top_k", "seed", "sampling_seed", "logit_bias",
                                     "custom_params", "beam_width", "stream_interval", "watermark")}
    assert call(app, "POST", "/generate", {"text": "x", "sampling_params": {**GREEDY, **nulls}}).status_code == 200


def test_logprob_fields_and_meta_info_shapes(app, runtime):
    body = {"text": "Once upon a time", "sampling_params": GREEDY, "return_logprob": True, "logprob_start_len": 1,
            "top_logprobs_num": 2, "token_ids_logprob": [5, 9], "return_text_in_logprobs": True}
    meta = call(app, "POST", "/generate", body).json()["meta_info"]
    prompt_ids = runtime.tokenizer.encode("Once upon a time", add_special_tokens=False)
    assert [e[1] for e in meta["input_token_logprobs"]] == prompt_ids[1:]
    assert meta["input_token_logprobs"][0][0] is None and meta["input_top_logprobs"][0] is None
    assert meta["input_token_ids_logprobs"][0] is None
    assert len(meta["output_token_logprobs"]) == len(meta["output_top_logprobs"]) == 4
    for entry, top, asked in zip(meta["output_token_logprobs"], meta["output_top_logprobs"],
                                 meta["output_token_ids_logprobs"]):
        assert entry[2] == runtime.tokenizer.decode([entry[1]])
        assert top[0][1] == entry[1] and top[0][0] == pytest.approx(entry[0]), "greedy: its own top-1"
        assert top[0][0] >= top[1][0] and [a[1] for a in asked] == [5, 9]
    default = call(app, "POST", "/generate", {"text": "Once upon", "sampling_params": GREEDY,
                                              "return_logprob": True}).json()["meta_info"]
    assert default["input_token_logprobs"] == [] and all(e[2] is None for e in default["output_token_logprobs"])
    plain = call(app, "POST", "/generate", {"text": "Once upon", "sampling_params": GREEDY}).json()["meta_info"]
    assert not any("logprobs" in key for key in plain)


def test_scoring_batches_and_per_prompt_fields(app):
    body = {"text": ["Once upon a time", "The sky is"], "sampling_params": {"max_new_tokens": 0},
            "return_logprob": True, "logprob_start_len": 0}
    results = call(app, "POST", "/generate", body).json()
    assert [r["output_ids"] for r in results] == [[], []]
    for r in results:
        assert len(r["meta_info"]["input_token_logprobs"]) == r["meta_info"]["prompt_tokens"]
    mixed = call(app, "POST", "/generate", {"input_ids": [[5, 6, 7], [8, 9]],
                                            "sampling_params": [{**GREEDY, "max_new_tokens": 1}, GREEDY],
                                            "return_logprob": [True, False]}).json()
    assert [len(r["output_ids"]) for r in mixed] == [1, 4]
    assert "output_token_logprobs" in mixed[0]["meta_info"] and "output_token_logprobs" not in mixed[1]["meta_info"]


def test_the_stream_sglang_parses(app, runtime):
    streamed = events(call(app, "POST", "/generate", {"text": "Once upon", "sampling_params": GREEDY,
                                                      "stream": True}))
    assert streamed[-1] == "[DONE]"
    texts = [event["text"] for event in streamed[:-1]]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:])), "each event carries the text so far"
    assert texts[-1] == runtime.generate("Once upon", GREEDY)["text"]
    assert all("meta_info" in event and "finish_reason" in event["meta_info"] for event in streamed[:-1])
    batch = events(call(app, "POST", "/generate", {"text": ["a", "b"], "sampling_params": GREEDY, "stream": True}))
    assert {event["index"] for event in batch[:-1]} == {0, 1}


def test_server_info_forms(app):
    assert call(app, "GET", "/server_info").json().keys() == call(app, "GET", "/get_server_info").json().keys()
    assert call(app, "GET", "/model_info").json() == call(app, "GET", "/get_model_info").json()


@pytest.mark.parametrize(
    ("extra", "param", "words"),
    [
        ({"logprob_start_len": 99, "return_logprob": True}, "logprob_start_len", "-1 (the output only) or in [0, "),
        ({"logprob_start_len": -2}, "logprob_start_len", "-1 (the output only) or an int >= 0"),
        ({"top_logprobs_num": 21}, "top_logprobs_num", "[0, 20]"),
        ({"token_ids_logprob": [10**7]}, "token_ids_logprob", "must be in [0, "),
        ({"sampling_params": {**GREEDY, "logit_bias": {"a": 1}}}, "logit_bias", "token ids"),
        ({"sampling_params": {**GREEDY, "logit_bias": {"5": 1000}}}, "logit_bias", "[-100, 100]"),
        ({"sampling_params": {**GREEDY, "stop_regex": "("}}, "stop_regex", "not a valid Python regular expression"),
        ({"sampling_params": {**GREEDY, "custom_params": {"a": 1}}}, "custom_params", "custom"),
        ({"custom_logit_processor": "{}"}, "custom_logit_processor", "custom logit processor"),
        ({"lora_path": "adapter"}, "lora_path", "LoRA"),
        ({"image_data": "x.png"}, "image_data", "text-only"),
        ({"not_a_field": 1}, "not_a_field", "not a field of SGLang's /generate"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(app, runtime, extra, param, words):
    before = runtime.cache_stats()["prompt_tokens"]
    response = call(app, "POST", "/generate", {"text": "x", "sampling_params": GREEDY, **extra})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"], error
    assert runtime.cache_stats()["prompt_tokens"] == before, "nothing was queued"


def test_noops_and_refused_defaults_are_accepted(app):
    body = {"text": "x", "sampling_params": GREEDY, "log_metrics": False, "routing_key": "r", "priority": 3,
            "lora_path": None, "return_hidden_states": False, "session_params": None, "stream_interval": None}
    response = call(app, "POST", "/generate", {k: v for k, v in body.items() if k != "stream_interval"})
    assert response.status_code == 200, response.text
