"""Output constraints: every output matches its regex or validates against its schema, and
jump-forward decoding gives exactly the tokens of token-by-token constrained decoding.

The drawn regexes and schemas are bounded (bounded repeats, string lengths, integer ranges,
array sizes), so a grammar always completes within `max_new_tokens` unless the output is cut
short on purpose: a test that passed only because outputs were cut short would prove nothing,
so the completion rate is asserted too.
"""

from __future__ import annotations

import concurrent.futures
import json
import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from radixrt import Runtime
from radixrt.sampling import SamplingParams
from radixrt.sampling.grammar import Grammars, new_bitmask
from radixrt.model.row_kernels import cpu_row_kernels
from radixrt.sampling.sampler import Sampler, TokenMasks, apply_masks

# ---------------------------------------------------------------------------------------------------------
# Drawn constraints: (pattern, longest match in characters).

_LITERALS = st.text(alphabet="abcdefxyz", min_size=1, max_size=4)
_CLASSES = st.sampled_from([("[a-c]", 1), ("[0-9]", 1), ("[xyz]", 1), ("[A-F0-9]", 1)])


def _atoms() -> st.SearchStrategy[tuple[str, int]]:
    return st.one_of(_LITERALS.map(lambda s: (s, len(s))), _CLASSES)


def _extend(inner: st.SearchStrategy[tuple[str, int]]) -> st.SearchStrategy[tuple[str, int]]:
    concatenation = st.lists(inner, min_size=2, max_size=3).map(
        lambda parts: ("".join(p for p, _ in parts), sum(n for _, n in parts))
    )
    alternation = st.lists(inner, min_size=2, max_size=3).map(
        lambda parts: ("(" + "|".join(p for p, _ in parts) + ")", max(n for _, n in parts))
    )
    repeat = st.tuples(inner, st.integers(0, 2), st.integers(0, 3)).map(
        lambda t: (f"({t[0][0]}){{{t[1]},{t[1] + t[2]}}}", t[0][1] * (t[1] + t[2]))
    )
    optional = inner.map(lambda t: (f"({t[0]})?", t[1]))
    return st.one_of(concatenation, alternation, repeat, optional)


REGEXES = st.recursive(_atoms(), _extend, max_leaves=6).filter(lambda t: 1 <= t[1] <= 40)


def _leaf_schemas() -> st.SearchStrategy[dict[str, Any]]:
    return st.one_of(
        st.integers(1, 12).map(lambda n: {"type": "string", "maxLength": n}),
        st.tuples(st.integers(-50, 50), st.integers(0, 1000)).map(
            lambda t: {"type": "integer", "minimum": t[0], "maximum": t[0] + t[1]}
        ),
        st.lists(st.text(alphabet="abcxyz", min_size=1, max_size=5), min_size=1, max_size=4, unique=True).map(
            lambda values: {"enum": values}
        ),
        st.just({"type": "boolean"}),
    )


def _object_of(values: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[dict[str, Any]]:
    return st.dictionaries(st.from_regex(r"[a-z]{1,6}", fullmatch=True), values, min_size=1, max_size=4).flatmap(
        lambda properties: st.lists(st.sampled_from(sorted(properties)), unique=True).map(
            lambda required: {"type": "object", "properties": properties, "required": required,
                              "additionalProperties": False}  # fmt: skip
        )
    )


def _extend_schema(inner: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[dict[str, Any]]:
    arrays = st.tuples(inner, st.integers(0, 3)).map(lambda t: {"type": "array", "items": t[0], "maxItems": t[1]})
    return st.one_of(_object_of(inner), arrays)


SCHEMAS = _object_of(st.recursive(_leaf_schemas(), _extend_schema, max_leaves=5))


# ---------------------------------------------------------------------------------------------------------
# Runtimes, shared by the module: starting one costs seconds.


@pytest.fixture(scope="module")
def tiny_runtime(tiny_llama_dir: Path) -> Iterator[Runtime]:
    with Runtime(tiny_llama_dir, device="cpu", dtype="float32", max_total_tokens=8192, check_invariants=True) as rt:
        yield rt


@pytest.fixture(scope="module")
def smol_runtime() -> Iterator[Runtime]:
    with Runtime(check_invariants=True) as rt:
        yield rt


@pytest.fixture(scope="module")
def smol_token_by_token() -> Iterator[Runtime]:
    with Runtime(check_invariants=True, jump_forward=False) as rt:
        yield rt


PROMPTS = ["Answer in the format asked:", "Here is the value", "Write it down."]


def _generate_together(rt: Runtime, calls: list[tuple[Any, dict[str, Any]]]) -> list[Any]:
    """Several generate calls at once, so that the engine batches their requests together."""
    with concurrent.futures.ThreadPoolExecutor(len(calls)) as pool:
        futures = [pool.submit(rt.generate, prompt, params) for prompt, params in calls]
        return [future.result() for future in futures]


def _outputs(results: list[Any]) -> list[dict[str, Any]]:
    flat: list[dict[str, Any]] = []
    for result in results:
        flat.extend(result if isinstance(result, list) else [result])
    return flat


def _check_completion(outputs: list[dict[str, Any]], completed: list[bool]) -> None:
    for out in outputs:
        completed.append(out["meta_info"]["finish_reason"]["type"] == "stop")


# ---------------------------------------------------------------------------------------------------------
# Every output matches its constraint.

_COMPLETED: dict[str, list[bool]] = {"regex": [], "schema": []}


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(REGEXES, st.integers(0, 2**31))
def test_regex_outputs_match_in_full(tiny_runtime: Runtime, drawn: tuple[str, int], seed: int) -> None:
    pattern, longest = drawn
    limit = longest + 2  # each token writes at least one character, then EOS
    constrained = {"regex": pattern, "max_new_tokens": limit}
    results = _generate_together(tiny_runtime, [
        (PROMPTS, {**constrained, "temperature": 0}),
        (PROMPTS[0], {**constrained, "temperature": 1.0, "seed": seed, "n": 2}),
        (PROMPTS[1], {"max_new_tokens": 12, "temperature": 0}),  # unconstrained, in the same batches
    ])  # fmt: skip
    outputs = _outputs(results[:2])
    for out in outputs:
        assert re.fullmatch(pattern, out["text"]), (pattern, out["text"])
    _check_completion(outputs, _COMPLETED["regex"])


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(SCHEMAS, st.integers(0, 2**31))
def test_json_schema_outputs_validate(tiny_runtime: Runtime, schema: dict[str, Any], seed: int) -> None:
    constrained = {"json_schema": schema, "max_new_tokens": 400}
    results = _generate_together(tiny_runtime, [
        (PROMPTS[:2], {**constrained, "temperature": 0}),
        (PROMPTS[2], {**constrained, "temperature": 0.9, "top_p": 0.95, "seed": seed, "n": 2}),
        (PROMPTS[0], {"max_new_tokens": 12, "temperature": 0}),
    ])  # fmt: skip
    outputs = _outputs(results[:2])
    for out in outputs:
        if out["meta_info"]["finish_reason"]["type"] == "stop":
            jsonschema.validate(json.loads(out["text"]), schema)
    _check_completion(outputs, _COMPLETED["schema"])


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(REGEXES, SCHEMAS)
def test_drawn_constraints_on_the_bundled_model(smol_runtime: Runtime, drawn: tuple[str, int],
                                                schema: dict[str, Any]) -> None:  # fmt: skip
    pattern, longest = drawn
    regex_out, schema_out = _generate_together(smol_runtime, [
        (PROMPTS[0], {"regex": pattern, "max_new_tokens": longest + 2, "temperature": 0}),
        (PROMPTS[1], {"json_schema": schema, "max_new_tokens": 400, "temperature": 0.8, "seed": longest}),
    ])  # fmt: skip
    assert re.fullmatch(pattern, regex_out["text"]), (pattern, regex_out["text"])
    if schema_out["meta_info"]["finish_reason"]["type"] == "stop":
        jsonschema.validate(json.loads(schema_out["text"]), schema)
    _check_completion([regex_out], _COMPLETED["regex"])
    _check_completion([schema_out], _COMPLETED["schema"])


def test_drawn_constraints_mostly_complete() -> None:
    """Runs after the two property tests (file order): most of their outputs ended because the
    grammar completed, not because they were cut short."""
    for name, completed in _COMPLETED.items():
        if not completed:
            pytest.skip(f"the {name} property test did not run in this session")
        print(f"{name}: {sum(completed)} of {len(completed)} outputs completed their grammar")
        assert sum(completed) >= 0.9 * len(completed), (name, sum(completed), len(completed))


EXTRACTION_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "city": {"enum": ["Paris", "London", "Tokyo", "Berlin"]},
        "employed": {"type": "boolean"},
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
    },
    "required": ["name", "age", "city", "employed", "skills"],
    "additionalProperties": False,
}
EXTRACTION_PROMPT = [{"role": "user", "content": "Describe Alice, a 31-year-old engineer from Paris, as JSON."}]


def test_json_schema_on_the_bundled_model(smol_runtime: Runtime) -> None:
    outs = smol_runtime.generate([EXTRACTION_PROMPT] * 2, {"json_schema": EXTRACTION_SCHEMA, "max_new_tokens": 120,
                                                           "temperature": 0})  # fmt: skip
    sampled = smol_runtime.generate(EXTRACTION_PROMPT, {"json_schema": json.dumps(EXTRACTION_SCHEMA), "n": 3,
                                                        "max_new_tokens": 120, "seed": 5})  # fmt: skip
    for out in [*outs, *sampled]:
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out
        jsonschema.validate(json.loads(out["text"]), EXTRACTION_SCHEMA)


# ---------------------------------------------------------------------------------------------------------
# Jump-forward decoding changes nothing but the number of steps.


@pytest.mark.parametrize("params", [
    {"json_schema": EXTRACTION_SCHEMA, "temperature": 0},
    {"json_schema": EXTRACTION_SCHEMA, "temperature": 0.8, "seed": 11, "n": 2, "top_k": 20},
    {"regex": r"The answer is (yes|no), because [a-z ]{3,20}\.", "temperature": 0.7, "seed": 3,
     "repetition_penalty": 1.2},
], ids=["greedy", "sampled", "regex-with-penalty"])  # fmt: skip
def test_jump_forward_gives_the_tokens_of_token_by_token_decoding(
    smol_runtime: Runtime, smol_token_by_token: Runtime, params: dict[str, Any]
) -> None:
    params = {**params, "max_new_tokens": 100, "return_logprob": True, "top_logprobs_num": 2}
    before = smol_runtime.cache_stats()
    jumped = _outputs([smol_runtime.generate(EXTRACTION_PROMPT, params)])
    stepped = _outputs([smol_token_by_token.generate(EXTRACTION_PROMPT, params)])
    after = smol_runtime.cache_stats()
    assert [o["output_ids"] for o in jumped] == [o["output_ids"] for o in stepped]
    assert [o["text"] for o in jumped] == [o["text"] for o in stepped]
    for a, b in zip(jumped, stepped):  # bitwise: the same floats, not merely close
        assert a["meta_info"]["output_token_logprobs"] == b["meta_info"]["output_token_logprobs"]
        assert a["meta_info"]["output_top_logprobs"] == b["meta_info"]["output_top_logprobs"]
    assert after["confirmed_draft_tokens"] > before["confirmed_draft_tokens"], "no draft was confirmed"
    assert smol_token_by_token.cache_stats()["draft_tokens"] == 0


def test_constrained_requests_stay_in_decode_runs(smol_token_by_token: Runtime) -> None:
    engine = smol_token_by_token.engine
    runs = engine.num_decode_runs
    out = smol_token_by_token.generate(EXTRACTION_PROMPT, {"json_schema": EXTRACTION_SCHEMA, "temperature": 0,
                                                           "max_new_tokens": 100})  # fmt: skip
    jsonschema.validate(json.loads(out["text"]), EXTRACTION_SCHEMA)
    assert engine.num_decode_runs > runs


# ---------------------------------------------------------------------------------------------------------
# Limits, stops, aborts.


def test_length_ends_with_a_prefix_the_grammar_accepts(tiny_runtime: Runtime) -> None:
    schema = {"type": "object", "properties": {"text": {"type": "string", "maxLength": 200}}, "required": ["text"]}
    out = tiny_runtime.generate(PROMPTS[0], {"json_schema": schema, "max_new_tokens": 6, "temperature": 0})
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
    grammars = tiny_runtime.inputs.grammars
    matcher = grammars.matcher(grammars.compile("json_schema", json.dumps(schema)))
    assert all(matcher.accept(token) for token in out["output_ids"])
    assert not matcher.is_terminated


def test_a_stop_string_ends_a_constrained_request_first(smol_runtime: Runtime) -> None:
    out = smol_runtime.generate(EXTRACTION_PROMPT, {"json_schema": EXTRACTION_SCHEMA, "temperature": 0,
                                                    "max_new_tokens": 100, "stop": '"age"'})  # fmt: skip
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": '"age"'}
    assert out["text"].startswith("{") and '"age"' not in out["text"]


def test_an_abort_mid_way_frees_the_request(smol_runtime: Runtime) -> None:
    chunks = smol_runtime.generate(EXTRACTION_PROMPT, {"regex": "[a-z]{200}", "max_new_tokens": 200,
                                                       "ignore_eos": True}, stream=True, rid="to-abort")  # fmt: skip
    stream = iter(chunks)
    assert next(stream)["text"]
    smol_runtime.abort("to-abort")
    rest = list(stream)
    assert rest[-1]["meta_info"]["finish_reason"]["type"] == "abort"
    after = smol_runtime.generate("Hello", {"regex": "[0-9]{3}", "max_new_tokens": 5, "temperature": 0})
    assert re.fullmatch("[0-9]{3}", after["text"])


def test_ignore_eos_cannot_outlive_the_grammar(tiny_runtime: Runtime) -> None:
    out = tiny_runtime.generate(PROMPTS[0], {"regex": "ab(c|d)", "ignore_eos": True, "max_new_tokens": 20})
    assert out["text"] in ("abc", "abd") and out["meta_info"]["finish_reason"]["type"] == "stop"


# ---------------------------------------------------------------------------------------------------------
# Bad input: refused in the caller's thread, before anything is queued.


@pytest.mark.parametrize("params, named", [
    ({"regex": "(ab"}, "regex"),
    ({"json_schema": {"type": "strange"}}, "json_schema"),
    ({"json_schema": "{not json"}, "json_schema"),
    ({"json_schema": {}}, "json_schema is empty"),
    ({"json_schema": "[]"}, "json_schema"),
    ({"ebnf": "root ::= missing_rule"}, "ebnf"),
    ({"regex": "a", "json_schema": {"type": "object"}}, "at most one"),
    ({"regex": "a", "max_new_tokens": 0}, "max_new_tokens"),
    ({"regex": ""}, "regex"),
], ids=["regex", "schema-type", "schema-json", "schema-empty", "schema-array", "ebnf", "two", "zero-tokens", "empty"])  # fmt: skip
def test_bad_constraints_are_refused_by_name(tiny_runtime: Runtime, params: dict[str, Any], named: str) -> None:
    before = tiny_runtime.cache_stats()
    with pytest.raises(ValueError, match=named):
        tiny_runtime.generate(PROMPTS[0], params)
    assert tiny_runtime.cache_stats()["prompt_tokens"] == before["prompt_tokens"]  # nothing was queued


def test_a_compile_over_the_time_limit_is_refused(tiny_runtime: Runtime) -> None:
    grammars = Grammars(tiny_runtime.tokenizer, tiny_runtime.inputs.limits.vocab_size, [2], compile_timeout_s=1e-6)
    with pytest.raises(ValueError, match="json_schema: compiling it took longer than"):
        grammars.compile("json_schema", json.dumps(EXTRACTION_SCHEMA))


def test_compiled_grammars_are_cached_per_constraint(tiny_runtime: Runtime) -> None:
    grammars = tiny_runtime.inputs.grammars
    first = grammars.compile("regex", "[a-z]+ [0-9]{2}")
    assert grammars.compile("regex", "[a-z]+ [0-9]{2}") is first
    assert grammars.compile("regex", "[a-z]+ [0-9]{3}") is not first


# ---------------------------------------------------------------------------------------------------------
# The mask in the sampler.


def _masks_of(allowed_tokens: list[list[int]], vocab_size: int) -> torch.Tensor:
    bitmask = torch.zeros(len(allowed_tokens), (vocab_size + 31) // 32, dtype=torch.int32)
    for row, tokens in enumerate(allowed_tokens):
        for token in tokens:
            word = int(bitmask[row, token // 32]) & 0xFFFFFFFF
            word |= 1 << (token % 32)
            bitmask[row, token // 32] = word - (1 << 32) if word >= 1 << 31 else word
    return bitmask


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 5), st.integers(33, 300), st.data())
def test_masked_rows_sample_only_allowed_tokens(rows: int, vocab_size: int, data: st.DataObject) -> None:
    logits = torch.randn(rows, vocab_size, generator=torch.Generator().manual_seed(rows * vocab_size))
    allowed = [sorted(data.draw(st.sets(st.integers(0, vocab_size - 1), min_size=1, max_size=8))) for _ in range(rows)]
    masked_rows = data.draw(st.lists(st.integers(0, rows - 1), unique=True, min_size=1))
    masks = TokenMasks(masked_rows, _masks_of([allowed[r] for r in masked_rows], vocab_size))
    params = [SamplingParams(temperature=data.draw(st.sampled_from([0.0, 0.7, 1.3])), seed=1) for _ in range(rows)]
    out = Sampler(cpu_row_kernels()).sample(logits, params, list(range(rows)), [[]] * rows, [[]] * rows, masks)
    for row in masked_rows:
        assert int(out.token_ids[row]) in allowed[row]
        # the log-probability is under the masked distribution: the allowed tokens' sum to 1
        kept = logits[row, allowed[row]]
        expected = float(logits[row, int(out.token_ids[row])] - torch.logsumexp(kept, dim=0))
        assert math.isclose(float(out.logprobs[row]), expected, rel_tol=1e-5, abs_tol=1e-5)


def test_the_c_mask_equals_torch_s() -> None:
    kernels = cpu_row_kernels()
    if kernels is None:
        pytest.skip("no C compiler")
    logits = torch.randn(4, 1000)
    masks = TokenMasks([0, 2, 3], _masks_of([[0, 999], [5, 31, 32, 63], list(range(0, 1000, 7))], 1000))
    with_c = apply_masks(logits, masks, kernels)
    with_torch = apply_masks(logits, masks)
    assert torch.equal(with_c, with_torch)
    assert torch.equal(with_c[1], logits[1])  # an unmasked row is untouched
    assert torch.isinf(with_c[0]).sum() == 998


def test_a_mask_of_every_token_allows_every_token() -> None:
    logits = torch.randn(2, 77)
    assert torch.equal(apply_masks(logits, TokenMasks([0, 1], new_bitmask(2, 77))), logits)



def test_a_structural_tag_holds_the_tagged_part_to_its_schema(tiny_runtime: Runtime) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
              "additionalProperties": False}  # fmt: skip
    tag = {"structures": [{"begin": "<f=weather>", "schema": schema, "end": "</f>"}], "triggers": ["<f="]}
    grammars = tiny_runtime.inputs.grammars
    compiled = grammars.compile("structural_tag", json.dumps(tag))
    encode = tiny_runtime.tokenizer.encode

    def accepts(text: str) -> bool:
        matcher = grammars.matcher(compiled)
        return all(matcher.accept(token) for token in encode(text, add_special_tokens=False))

    assert accepts('free text, then <f=weather>{"city": "Paris"}</f> and more text')
    assert not accepts("free text, then <f=weather>not json")
    with pytest.raises(ValueError, match="structural_tag is not valid"):
        tiny_runtime.generate(PROMPTS[0], {"structural_tag": {"structures": [{"begin": "<g>", "schema": schema,
                                                                               "end": "</g>"}], "triggers": ["<f"]}})


def test_jump_forward_under_memory_pressure_keeps_the_outputs(tiny_llama_dir: Path) -> None:
    """A pool so small that drafts are dropped and requests retracted: the tree, pool and request
    bookkeeping stay consistent after every step, and the outputs are those without jump-forward."""
    schema = {"type": "object", "properties": {"first_key_name": {"enum": ["alpha", "beta"]},
                                               "second_key_name": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["first_key_name", "second_key_name"], "additionalProperties": False}  # fmt: skip
    prompts = [f"{PROMPTS[i % 3]} number {i}" for i in range(12)]
    outputs = {}
    for jump_forward in (True, False):
        with Runtime(tiny_llama_dir, device="cpu", dtype="float32", max_total_tokens=160, check_invariants=True,
                     jump_forward=jump_forward) as rt:  # fmt: skip
            results = rt.generate(prompts, {"json_schema": schema, "max_new_tokens": 40, "temperature": 0})
            outputs[jump_forward] = [r["output_ids"] for r in results]
            stats = rt.cache_stats()
            assert stats["retracted_requests"] > 0, "the pool was not small enough to retract"
            if jump_forward:
                assert stats["confirmed_draft_tokens"] > 0
    assert outputs[True] == outputs[False]
