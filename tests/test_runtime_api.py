"""Runtime behaviour a user relies on: bad input, n, salts, streaming, abort, threads."""

from __future__ import annotations

import asyncio
import math
import random
import re
import threading

import pytest
import torch

from radixrt import Runtime, SamplingParams
from radixrt.config import RuntimeConfig


@pytest.fixture(scope="module")
def rt(tiny_llama_dir):
    with Runtime(tiny_llama_dir, device="cpu", dtype="float32", max_total_tokens=4096, check_invariants=True) as runtime:
        yield runtime


def ids(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 300) for _ in range(n)]


GREEDY = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}


@pytest.mark.parametrize(
    "call, field",
    [
        (lambda rt: rt.generate(""), "empty"),
        (lambda rt: rt.generate([]), "prompt"),
        (lambda rt: rt.generate(ids(1000), {"max_new_tokens": 100}), "context length"),
        (lambda rt: rt.generate("hi", {"max_new_tokens": -1}), "max_new_tokens"),
        (lambda rt: rt.generate("hi", {"temperature": -0.5}), "temperature"),
        (lambda rt: rt.generate("hi", {"temperature": math.nan}), "temperature"),
        (lambda rt: rt.generate("hi", {"top_p": 0.0}), "top_p"),
        (lambda rt: rt.generate("hi", {"top_p": 1.5}), "top_p"),
        (lambda rt: rt.generate([5, 999999]), "vocabulary"),
        (lambda rt: rt.generate([5, -1]), "vocabulary"),
        (lambda rt: rt.generate([5, 2**70]), "input_ids"),
        (lambda rt: rt.generate("hi", {"max_tokens": 5}), "max_tokens"),
        (lambda rt: rt.generate("hi", {"stop": 3}), "stop"),
        (lambda rt: rt.generate("hi", {"stop": ["ok", None]}), "stop"),
        (lambda rt: rt.generate("hi", cache_salt=5), "cache_salt"),
        (lambda rt: rt.generate([{"content": "no role"}]), "role"),
    ],
)
def test_bad_input_is_rejected_and_the_runtime_keeps_serving(rt, call, field):
    with pytest.raises(ValueError, match=field):
        call(rt)
    assert rt.generate(ids(10), GREEDY)["meta_info"]["completion_tokens"] == 6


def test_unknown_runtime_option_names_the_option(tiny_llama_dir):
    with pytest.raises(ValueError, match="page_sise"):
        Runtime(tiny_llama_dir, page_sise=4)
    with pytest.raises(ValueError, match="schedule_policy"):
        Runtime(tiny_llama_dir, schedule_policy="random")


def test_a_runtime_built_in_inference_mode_serves(tiny_llama_dir, rt):
    """Built inside the caller's `torch.inference_mode()`, its tensors are inference tensors that
    the engine thread updates in place: it must serve as any other (it failed every request)."""
    with torch.inference_mode():
        inside = Runtime(tiny_llama_dir, device="cpu", dtype="float32", max_total_tokens=4096, check_invariants=True)
    with inside:
        assert inside.generate(ids(20), GREEDY)["output_ids"] == rt.generate(ids(20), GREEDY)["output_ids"]


def test_result_shape_and_batch_order(rt):
    prompts = [ids(5 + 3 * i, seed=i) for i in range(6)]
    alone = [rt.generate(p, GREEDY) for p in prompts]
    together = rt.generate(prompts, GREEDY)
    assert [r["output_ids"] for r in together] == [r["output_ids"] for r in alone]
    meta = together[0]["meta_info"]
    assert set(meta) >= {"prompt_tokens", "cached_tokens", "completion_tokens", "finish_reason", "ttft", "e2e_latency"}
    assert meta["prompt_tokens"] == 5 and meta["completion_tokens"] == 6
    assert meta["finish_reason"] == {"type": "length", "length": 6}
    assert 0 <= meta["ttft"] <= meta["e2e_latency"]
    assert isinstance(together[0]["text"], str)


def test_n_samples_share_the_prompt_and_seeds_reproduce(rt):
    prompt = ids(80, seed=3)
    params = {"max_new_tokens": 8, "temperature": 1.0, "n": 4, "seed": 11, "ignore_eos": True}
    first = rt.generate(prompt, params)
    assert len(first) == 4
    assert sum(r["meta_info"]["cached_tokens"] for r in first) >= 3 * 79, "the prompt is computed once"
    again = rt.generate(prompt, params)
    assert [r["output_ids"] for r in again] == [r["output_ids"] for r in first]
    assert len({tuple(r["output_ids"]) for r in first}) > 1, "different samples per seed + i"


def test_cache_salt_isolates_namespaces(rt):
    prompt = ids(64, seed=4)
    rt.generate(prompt, GREEDY, cache_salt="tenant-a")
    other = rt.generate(prompt, GREEDY, cache_salt="tenant-b")
    same = rt.generate(prompt, GREEDY, cache_salt="tenant-a")
    assert other["meta_info"]["cached_tokens"] == 0
    assert same["meta_info"]["cached_tokens"] == 63
    assert other["output_ids"] == same["output_ids"]


def test_stream_chunks_add_up_to_the_result(rt):
    prompt = ids(20, seed=5)
    whole = rt.generate(prompt, {**GREEDY, "max_new_tokens": 12})
    chunks = list(rt.generate(prompt, {**GREEDY, "max_new_tokens": 12}, stream=True))
    assert "".join(c["text"] for c in chunks) == whole["text"]
    assert [t for c in chunks for t in c["output_ids"]] == whole["output_ids"]
    assert chunks[-1]["finished"] and chunks[-1]["meta_info"]["completion_tokens"] == 12


def test_stop_string_is_cut_from_the_text(rt, tiny_tokenizer):
    prompt = ids(20, seed=6)
    whole = rt.generate(prompt, {**GREEDY, "max_new_tokens": 16})
    text = whole["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    if not stop.strip():
        pytest.skip("the tiny model's output has no usable stop string here")
    cut = rt.generate(prompt, {**GREEDY, "max_new_tokens": 16, "stop": stop})
    assert cut["text"] == text[: text.index(stop)]
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}


def test_abort_frees_the_request(rt):
    prompt = ids(30, seed=7)
    stream = rt.generate(prompt, {"max_new_tokens": 500, "temperature": 0, "ignore_eos": True}, stream=True)
    first = next(stream)
    stream.close()  # leaving early aborts
    rt.generate(ids(8), GREEDY)  # the engine has processed the abort by now
    stats = rt.cache_stats()
    assert first["finished"] is False
    assert stats["protected_tokens"] == 0
    assert stats["pool_used_tokens"] == stats["tree_tokens"]


def test_abort_by_id_reports_abort(rt):
    outputs = []
    prompt = ids(30, seed=8)
    stream = rt.generate(prompt, {"max_new_tokens": 900, "temperature": 0, "ignore_eos": True}, stream=True)
    for chunk in stream:
        outputs.append(chunk)
        if len(outputs) == 2:
            rt.abort(chunk["id"])
        if chunk["finished"]:
            break
    assert outputs[-1]["meta_info"]["finish_reason"]["type"] == "abort"
    assert outputs[-1]["meta_info"]["completion_tokens"] < 900
    assert rt.cache_stats()["protected_tokens"] == 0


def test_cache_stats_answers_while_a_long_request_runs(rt):
    stream = rt.generate(ids(20, seed=9), {"max_new_tokens": 900, "temperature": 0, "ignore_eos": True}, stream=True)
    first = next(stream)
    stats = rt.cache_stats()  # served between two steps, not after the request
    assert stats["protected_tokens"] > 0
    rt.abort(first["id"])
    assert list(stream)[-1]["meta_info"]["finish_reason"]["type"] == "abort"


def test_threads_and_asyncio_share_one_engine(rt):
    prompts = [ids(10 + i, seed=20 + i) for i in range(8)]
    expected = [r["output_ids"] for r in rt.generate(prompts, GREEDY)]
    results: dict[int, list[int]] = {}

    def worker(i: int) -> None:
        results[i] = rt.generate(prompts[i], GREEDY)["output_ids"]

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [results[i] for i in range(8)] == expected

    async def main() -> list[list[int]]:
        outs = await asyncio.gather(*(rt.async_generate(p, GREEDY) for p in prompts))
        return [o["output_ids"] for o in outs]

    assert asyncio.run(main()) == expected


def test_prompt_logprobs_and_output_logprobs(rt, tiny_llama_hf):
    import torch

    prompt = ids(12, seed=9)
    # SGLang's shape: entries [logprob, token_id, text] for prompt[3:], the first logprob None.
    out = rt.generate(prompt, {**GREEDY, "max_new_tokens": 0}, logprob_start_len=3, top_logprobs_num=3,
                      token_ids_logprob=[5, 6])
    with torch.inference_mode():
        logits = tiny_llama_hf(torch.tensor([prompt])).logits[0].float()
    table = torch.log_softmax(logits, -1)
    reference = table[torch.arange(3, 11), torch.tensor(prompt[4:12])]
    entries = out["meta_info"]["input_token_logprobs"]
    assert out["output_ids"] == [] and [e[1] for e in entries] == prompt[3:]
    assert entries[0][0] is None and all(e[2] is None for e in entries)
    assert torch.allclose(torch.tensor([e[0] for e in entries[1:]]), reference, atol=1e-4)
    tops = out["meta_info"]["input_top_logprobs"]
    assert tops[0] is None and len(tops) == len(entries)
    for position, top in enumerate(tops[1:], start=3):
        assert [t[1] for t in top] == table[position].topk(3).indices.tolist()
        assert top[0][0] >= top[1][0] >= top[2][0]
    asked = out["meta_info"]["input_token_ids_logprobs"]
    assert asked[0] is None and [t[1] for t in asked[1]] == [5, 6]
    assert asked[1][0][0] == pytest.approx(table[3, 5].item(), abs=1e-4)
    assert out["meta_info"]["output_token_logprobs"] == []
    sampled = rt.generate(prompt, {**GREEDY, "return_logprob": True}, return_text_in_logprobs=True)
    outputs = sampled["meta_info"]["output_token_logprobs"]
    assert len(outputs) == 6 and [e[1] for e in outputs] == sampled["output_ids"]
    assert all(isinstance(e[2], str) for e in outputs) and sampled["meta_info"]["input_token_logprobs"] == []
    assert "input_token_logprobs" not in rt.generate(prompt, GREEDY)["meta_info"], "asked for nothing"
    with pytest.raises(ValueError, match=r"logprob_start_len must be -1 .* \[0, 12\]"):
        rt.generate(prompt, GREEDY, logprob_start_len=13)
    with pytest.raises(ValueError, match=r"top_logprobs_num must be in \[0, 20\]"):
        rt.generate(prompt, GREEDY, top_logprobs_num=21)


def test_flush_cache_empties_the_tree(rt):
    rt.generate(ids(40, seed=10), GREEDY)
    assert rt.cache_stats()["tree_tokens"] > 0
    rt.flush_cache()
    stats = rt.cache_stats()
    assert stats["tree_tokens"] == 0 and stats["prompt_tokens"] == 0 and stats["pool_used_tokens"] == 0


def test_sampling_params_object_is_accepted(rt):
    out = rt.generate(ids(9), SamplingParams(max_new_tokens=3, temperature=0, ignore_eos=True))
    assert out["meta_info"]["completion_tokens"] == 3


def test_exiting_while_a_request_runs_is_clean(tiny_llama_dir, tmp_path):
    import subprocess
    import sys

    script = tmp_path / "exit_mid_request.py"
    script.write_text(
        "import sys, threading, time\n"
        "import radixrt\n"
        "rt = radixrt.Runtime(sys.argv[1], dtype='float32', max_total_tokens=2048)\n"
        "def run():\n"
        "    try:\n"
        "        rt.generate([5] * 20, {'max_new_tokens': 900, 'ignore_eos': True})\n"
        "    except RuntimeError as error:\n"
        "        print('caller saw:', error)\n"
        "threading.Thread(target=run, daemon=True).start()\n"
        "time.sleep(0.5)\n"
    )
    done = subprocess.run([sys.executable, str(script), str(tiny_llama_dir)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_caller_chosen_ids_name_requests_and_their_samples(rt):
    out = rt.generate(ids(8), GREEDY, rid="job-1")
    assert out["meta_info"]["id"] == "job-1"
    samples = rt.generate(ids(8), {**GREEDY, "n": 2}, rid="job-2")
    assert [s["meta_info"]["id"] for s in samples] == ["job-2-0", "job-2-1"]
    batch = rt.generate([ids(8, 1), ids(8, 2)], GREEDY, rid=["a", "b"])
    assert [r["meta_info"]["id"] for r in batch] == ["a", "b"]
    assert out["meta_info"]["queue_time"] >= 0


@pytest.mark.parametrize(
    "rid, message",
    [("", "non-empty string"), (["a"], "non-empty string"), (7, "non-empty string")],
)
def test_bad_request_ids_are_rejected(rt, rid, message):
    with pytest.raises(ValueError, match=f"rid must be .*{message}"):
        rt.generate(ids(8), GREEDY, rid=rid)


def test_a_batch_needs_one_distinct_id_per_prompt(rt):
    with pytest.raises(ValueError, match="rid"):
        rt.generate([ids(8, 1), ids(8, 2)], GREEDY, rid=["same", "same"])
    with pytest.raises(ValueError, match="rid"):
        rt.generate([ids(8, 1), ids(8, 2)], GREEDY, rid=["only-one"])


def test_aborting_a_group_id_stops_every_sample(rt):
    chunks = rt.generate(ids(8), {"max_new_tokens": 200, "ignore_eos": True, "n": 3}, stream=True, rid="fan")
    first = next(chunks)
    rt.abort("fan")
    reasons = [c["meta_info"]["finish_reason"]["type"] for c in [first, *chunks] if c["finished"]]
    assert reasons == ["abort"] * 3
    assert rt.cache_stats()["protected_tokens"] == 0


def test_cancelling_an_async_call_aborts_its_request(rt):
    async def cancel_midway() -> None:
        task = asyncio.create_task(rt.async_generate(ids(8), {"max_new_tokens": 1000, "ignore_eos": True}))
        while rt.cache_stats()["running_requests"] == 0:  # cancel once it runs, not after a guessed delay
            await asyncio.sleep(0.002)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancel_midway())
    stats = rt.cache_stats()  # served between steps, after the abort was applied
    assert stats["running_requests"] == 0 and stats["protected_tokens"] == 0


def test_async_stream_yields_the_same_text_as_generate(rt):
    async def stream() -> list[dict]:
        return [chunk async for chunk in await rt.async_generate(ids(12, 3), GREEDY, stream=True)]

    chunks = asyncio.run(stream())
    expected = rt.generate(ids(12, 3), GREEDY)
    assert "".join(c["text"] for c in chunks) == expected["text"]
    assert [t for c in chunks for t in c["output_ids"]] == expected["output_ids"]


def test_max_new_tokens_none_fills_what_the_context_and_pool_leave(tiny_llama_dir):
    with Runtime(tiny_llama_dir, device="cpu", dtype="float32", max_total_tokens=64) as small:
        out = small.generate(ids(10), {"max_new_tokens": None, "temperature": 0, "ignore_eos": True})
    assert len(out["output_ids"]) == 64 - 10
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 54}


def test_small_steps_run_on_fewer_threads_and_the_thread_count_is_restored():
    from radixrt.model.runner import StepThreads

    threads = StepThreads(small=1, small_step_tokens=8, large=2)
    assert [threads.for_tokens(n) for n in (1, 8, 9, 512)] == [1, 1, 2, 2]
    assert StepThreads(small=4, small_step_tokens=8, large=2).for_tokens(1) == 2, "never more than large"
    with pytest.raises(ValueError, match="small_step_threads must be an int >= 1"):
        RuntimeConfig(small_step_threads=0)
    with pytest.raises(ValueError, match="small_step_tokens must be an int >= 0"):
        RuntimeConfig(small_step_tokens=-1)


def test_runner_sets_threads_per_step_and_restores_them(tiny_llama_dir):
    import torch

    from radixrt.model import runner as runner_module

    # Two threads, whatever the environment gives: with one, "small steps get 1" and "large
    # steps get the process's count" would hold without the runner doing anything.
    outside = torch.get_num_threads()
    torch.set_num_threads(2)
    runner_module._process_threads.cache_clear()  # the process's count, as a runtime made now sees it
    try:
        before = torch.get_num_threads()
        seen = []
        with Runtime(tiny_llama_dir, dtype="float32", small_step_threads=1, small_step_tokens=4) as rt:
            runner = rt.engine.runner
            forward = runner.model.forward

            def spy(batch, backend, plan, deterministic):
                seen.append((batch.num_tokens, torch.get_num_threads()))
                return forward(batch, backend, plan, deterministic)

            runner.model.forward = spy
            rt.generate("a prompt of more than four tokens, surely", {"max_new_tokens": 3, "temperature": 0})
        after = torch.get_num_threads()
    finally:
        torch.set_num_threads(outside)
        runner_module._process_threads.cache_clear()
    assert after == before
    assert all(threads == 1 for tokens, threads in seen if tokens <= 4)
    assert all(threads == before for tokens, threads in seen if tokens > 4)
    assert any(tokens > 4 for tokens, _ in seen) and any(tokens <= 4 for tokens, _ in seen)


# --- SGLang's sampling parameters (issue 38) ---------------------------------------------------
@pytest.mark.parametrize("decode_steps", [1, 8])
def test_min_new_tokens_masks_stop_tokens_until_reached(tiny_llama_dir, decode_steps):
    with Runtime(tiny_llama_dir, device="cpu", dtype="float32", max_total_tokens=4096, check_invariants=True,
                 decode_steps=decode_steps) as runtime:
        prompt = ids(10, seed=4)
        free = runtime.generate(prompt, {**GREEDY, "max_new_tokens": 12})["output_ids"]
        first = free[0]  # greedy's first token, made a stop token
        out = runtime.generate(prompt, {**GREEDY, "max_new_tokens": 12, "stop_token_ids": [first],
                                        "min_new_tokens": 5, "return_logprob": True})
        assert len(out["output_ids"]) >= 5 and first not in out["output_ids"][:5]
        assert out["output_ids"][0] != first
        without = runtime.generate(prompt, {**GREEDY, "max_new_tokens": 12, "stop_token_ids": [first]})
        assert without["output_ids"] == [first] and without["meta_info"]["finish_reason"] == {"type": "stop",
                                                                                           "matched": first}


def test_logit_bias_moves_greedy_to_the_biased_token(rt):
    prompt = ids(8, seed=5)
    out = rt.generate(prompt, {**GREEDY, "logit_bias": {"42": 100}})
    assert out["output_ids"] == [42] * 6
    banned = rt.generate(prompt, GREEDY)["output_ids"][0]
    assert rt.generate(prompt, {**GREEDY, "logit_bias": {banned: -100}})["output_ids"][0] != banned


def test_stop_regex_and_no_stop_trim(rt):
    prompt = ids(8, seed=6)
    free = rt.generate(prompt, {**GREEDY, "max_new_tokens": 16})["text"]
    assert len(free) > 4, free
    pattern = re.escape(free[2:4])
    cut = rt.generate(prompt, {**GREEDY, "max_new_tokens": 16, "stop_regex": pattern})
    start = re.search(pattern, free).start()
    assert cut["text"] == free[:start] and cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": pattern}
    kept = rt.generate(prompt, {**GREEDY, "max_new_tokens": 16, "stop_regex": [pattern], "no_stop_trim": True})
    assert kept["text"] == free[: re.search(pattern, free).end()]
    stop = free[2:4]
    assert rt.generate(prompt, {**GREEDY, "max_new_tokens": 16, "stop": stop, "no_stop_trim": True})["text"] == \
        free[: free.index(stop) + len(stop)]
    token = rt.generate(prompt, GREEDY)["output_ids"][1]
    trimmed = rt.generate(prompt, {**GREEDY, "stop_token_ids": [token]})
    untrimmed = rt.generate(prompt, {**GREEDY, "stop_token_ids": [token], "no_stop_trim": True})
    assert untrimmed["text"] == trimmed["text"] + rt.tokenizer.decode([token])


def test_sampling_seed_is_seed(rt):
    sampled = {"max_new_tokens": 6, "temperature": 1.0, "ignore_eos": True}
    prompt = ids(6, seed=7)
    assert rt.generate(prompt, {**sampled, "sampling_seed": 11})["output_ids"] == \
        rt.generate(prompt, {**sampled, "seed": 11})["output_ids"]
    with pytest.raises(ValueError, match="sampling_seed"):
        rt.generate(prompt, {**sampled, "seed": 1, "sampling_seed": 2})


def test_per_prompt_sampling_params_and_logprob_fields(rt):
    prompts = [ids(6, seed=1), ids(7, seed=2)]
    out = rt.generate(input_ids=prompts, sampling_params=[{**GREEDY, "max_new_tokens": 2}, GREEDY],
                      return_logprob=[False, True], logprob_start_len=[-1, 2], top_logprobs_num=[0, 2])
    assert [len(r["output_ids"]) for r in out] == [2, 6]
    assert "output_token_logprobs" not in out[0]["meta_info"]
    assert len(out[1]["meta_info"]["input_token_logprobs"]) == 5 and len(out[1]["meta_info"]["input_top_logprobs"]) == 5
    with pytest.raises(ValueError, match=r"logprob_start_len: a list gives one value per prompt"):
        rt.generate(input_ids=prompts, sampling_params=GREEDY, logprob_start_len=[1])


@pytest.mark.parametrize(
    ("params", "words"),
    [
        ({"logit_bias": {"x": 1}}, r"logit_bias: keys must be token ids"),
        ({"logit_bias": {"3": 101}}, r"logit_bias: values must be in \[-100, 100\]"),
        ({"logit_bias": {"100000": 1}}, r"logit_bias: keys must be in \[0, "),
        ({"stop_regex": "(unclosed"}, r"stop_regex: '\(unclosed' is not a valid Python regular expression"),
        ({"stop_regex": "a*"}, r"stop_regex: 'a\*' matches the empty text"),
        ({"min_new_tokens": 9}, r"min_new_tokens must be <= max_new_tokens \(6\)"),
        ({"custom_params": {"x": 1}}, r"custom_params: radixrt runs no custom logit processor"),
        ({"top_logprobs_num": 21}, r"top_logprobs_num must be in \[0, 20\]"),
    ],
)
def test_bad_sglang_parameters_name_the_field(rt, params, words):
    with pytest.raises(ValueError, match=words):
        rt.generate(ids(4), {**GREEDY, **params})


def test_an_unknown_chat_role_is_a_value_error(rt):
    with pytest.raises(ValueError, match=r"messages\[1\].role must be one of system, user, assistant, tool"):
        rt.generate(messages=[{"role": "user", "content": "hi"}, {"role": "wizard", "content": "x"}])


def test_min_new_tokens_yields_to_a_complete_grammar(rt):
    """A grammar that allows only EOS wins over min_new_tokens: the output is complete."""
    out = rt.generate("Answer:", {"max_new_tokens": 8, "temperature": 0, "regex": "(yes|no)", "min_new_tokens": 6})
    assert out["text"] in ("yes", "no") and out["meta_info"]["finish_reason"]["type"] == "stop"
