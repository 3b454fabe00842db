"""The program frontend on the tiny random-weight Llama: token-level state, fork, select,
chat roles, run_batch, streaming and errors."""

from __future__ import annotations

import threading

import pytest
import torch

import radixrt
from radixrt import Runtime, assistant, function, gen, select, system, user
from radixrt.lang import ProgramError

PREFIX = (
    "A radix tree shares the key-value cache of common prompt prefixes between requests. "
    "Paged attention stores each token's keys and values in fixed-size pages of a pool."
)
GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def rt(tiny_llama_dir):
    config = dict(device="cpu", dtype="float32", max_total_tokens=8192, check_invariants=True)
    with Runtime(tiny_llama_dir, **config) as runtime:
        yield runtime


def encode(rt, text: str) -> list[int]:
    return list(rt.tokenizer.encode(text, add_special_tokens=False))


# --- token-level state -------------------------------------------------------------
def test_each_gen_prompt_extends_the_previous_prompt_and_output(rt):
    @function
    def two_steps(s):
        s += PREFIX
        s += gen("first", max_tokens=5, **GREEDY)
        s += " Then"
        s += gen("second", max_tokens=5, **GREEDY)

    state = two_steps.run(runtime=rt)
    first, second = state.get_meta_info("first"), state.get_meta_info("second")
    assert state.text() == PREFIX + state["first"] + " Then" + state["second"]
    first_ids = encode(rt, PREFIX)
    assert first["prompt_tokens"] == len(first_ids)
    # the second prompt is the first prompt + its output ids + " Then": all but the last output token are cached
    assert second["prompt_tokens"] == len(first_ids) + 5 + len(encode(rt, " Then"))
    assert second["cached_tokens"] >= len(first_ids) + 5 - 1
    assert state.token_ids()[: len(first_ids)] == first_ids


def test_stop_token_is_dropped_and_stop_string_text_is_tokenized_later(rt):
    @function
    def once(s, **params):
        s += PREFIX
        s += gen("a", max_tokens=8, temperature=0, **params)

    free = once.run(runtime=rt, ignore_eos=True)
    out_ids = free.get_meta_info("a")["completion_tokens"]
    assert out_ids == 8
    reference = free.token_ids()[len(encode(rt, PREFIX)):]
    stop_token = reference[3]
    stopped = once.run(runtime=rt, stop_token_ids=[stop_token], ignore_eos=True)
    cut = reference.index(stop_token)
    assert stopped.token_ids() == encode(rt, PREFIX) + reference[:cut]

    text = free["a"]
    stop = text[len(text) // 2 :][:2]
    by_string = once.run(runtime=rt, stop=stop, ignore_eos=True)
    assert by_string["a"] == text[: text.index(stop)]
    assert by_string.get_meta_info("a")["finish_reason"]["matched"] == stop
    assert by_string.token_ids() == encode(rt, PREFIX) + encode(rt, by_string["a"])


# --- fork ------------------------------------------------------------------------------
@function
def forked(s, n):
    s += PREFIX
    forks = s.fork(n)
    for i, f in enumerate(forks):
        f += f" Branch {i}:"
        f += gen("x", max_tokens=6, **GREEDY)
    s.join(forks)


@function
def alone(s, i):
    s += PREFIX
    s += f" Branch {i}:"
    s += gen("x", max_tokens=6, **GREEDY)


def test_fork_branches_equal_separate_programs_and_share_the_prefix(rt):
    rt.flush_cache()
    computed_before = rt.cache_stats()["computed_tokens"]
    state = forked.run(n=4, runtime=rt)
    prefix_len = len(encode(rt, PREFIX))
    metas = state.get_meta_info("x")
    assert all(meta["cached_tokens"] >= prefix_len for meta in metas)
    # computed once: the prefix, then per branch its own piece and 6 decoded tokens
    piece_tokens = sum(len(encode(rt, f" Branch {i}:")) for i in range(4))
    assert rt.cache_stats()["computed_tokens"] - computed_before <= prefix_len + piece_tokens + 4 * 6

    for i in range(4):
        separate = alone.run(i=i, runtime=rt)
        assert state["x"][i] == separate["x"]
    branches = _forks_of(rt, 4)
    for i, branch in enumerate(branches):
        assert branch.token_ids() == alone.run(i=i, runtime=rt).token_ids()
        assert branch.text() == PREFIX + f" Branch {i}:" + branch["x"]


def _forks_of(rt, n):
    found = []

    @function
    def keep(s):
        s += PREFIX
        forks = s.fork(n)
        for i, f in enumerate(forks):
            f += f" Branch {i}:"
            f += gen("x", max_tokens=6, **GREEDY)
        found.extend(forks)

    keep.run(runtime=rt)
    return found


class _BarrierRuntime:
    """Lets a generate call through only when `parties` of them wait at once: proves concurrency."""

    def __init__(self, rt, parties):
        self.tokenizer, self.config = rt.tokenizer, rt.config
        self._rt = rt
        self._barrier = threading.Barrier(parties, timeout=20)

    def generate(self, *args, **kwargs):
        if kwargs.get("stream"):
            self._barrier.wait()
        return self._rt.generate(*args, **kwargs)


def test_branch_operations_run_concurrently(rt):
    state = forked.run(n=3, runtime=_BarrierRuntime(rt, 3))
    assert len(state["x"]) == 3


def test_join_gathers_branch_variables_and_checks_its_argument(rt):
    state = forked.run(n=2, runtime=rt)
    assert isinstance(state["x"], list) and len(state["x"]) == 2
    assert [m["completion_tokens"] for m in state.get_meta_info("x")] == [6, 6]

    @function
    def foreign(s):
        s += PREFIX
        other = s.fork(1)[0].fork(2)
        s.join(other)

    with pytest.raises(ValueError, match="forked from this state"):
        foreign.run(runtime=rt)


def test_branch_error_surfaces_to_its_reader_and_to_the_run(rt):
    @function
    def reads(s):
        s += "hi"
        forks = s.fork(2)
        forks[0] += gen("x", max_tokens=100_000)
        forks[1] += gen("x", max_tokens=2, **GREEDY)
        with pytest.raises(ProgramError, match="fork branch 0") as raised:
            forks[0]["x"]
        assert isinstance(raised.value.__cause__, ValueError)
        with pytest.raises(ProgramError):
            forks[0] += "more"
        s += forks[1]["x"]

    assert reads.run(runtime=rt).text().startswith("hi")

    @function
    def ignores(s):
        s += "hi"
        s.fork(2)[1] += gen("x", max_tokens=100_000)

    with pytest.raises(ProgramError, match="fork branch 1"):
        ignores.run(runtime=rt)


# --- select ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "context, choices",
    [
        ("The quick brown fox jumps over the lazy", [" dog", " fox", " radix tree", " pages of a pool"]),
        ("What is the age of John Doe? He is", [" forty-two years old", " in Springfield", " lazy", " a"]),
    ],
)
def test_select_matches_transformers_mean_token_logprob(rt, tiny_llama_hf, context, choices):
    @function
    def pick(s):
        s += context
        s += select("choice", choices=choices)

    state = pick.run(runtime=rt)
    prefix = encode(rt, context)
    reference = []
    for choice in choices:
        ids = prefix + encode(rt, choice)
        with torch.inference_mode():
            logprobs = torch.log_softmax(tiny_llama_hf(torch.tensor([ids])).logits[0].float(), -1)
        token_logprobs = logprobs[torch.arange(len(prefix) - 1, len(ids) - 1), torch.tensor(ids[len(prefix):])]
        reference.append(token_logprobs.mean().item())
    meta = state.get_meta_info("choice")
    assert meta["normalized_logprobs"] == pytest.approx(reference, abs=1e-4)
    best = max(range(len(choices)), key=lambda i: reference[i])
    assert state["choice"] == choices[best]
    assert state.text() == context + choices[best]
    assert state.token_ids() == prefix + encode(rt, choices[best])


# --- chat roles ----------------------------------------------------------------------
def test_roles_render_like_the_chat_template_and_turns_extend_the_cache(rt):
    @function
    def chat(s):
        s += system("You are terse.")
        s += user("What is a radix tree?")
        s += assistant(gen("a", max_tokens=6, temperature=0))
        s += user("And paged attention?")
        s += assistant(["Paged", gen("b", max_tokens=6, temperature=0)])

    state = chat.run(runtime=rt)
    messages = state.messages()
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant"]
    assert messages[2]["content"] == state["a"] and messages[4]["content"] == "Paged" + state["b"]
    assert state.text() == rt.tokenizer.apply_chat_template(messages, tokenize=False)
    first, second = state.get_meta_info("a"), state.get_meta_info("b")
    assert second["cached_tokens"] >= first["prompt_tokens"] + first["completion_tokens"] - 1


# --- run_batch -----------------------------------------------------------------------
FEW_SHOT = "".join(f"Q: what is {a} plus {b}?\nA: {a + b}\n" for a, b in [(1, 2), (3, 4), (5, 6), (7, 8)])


@function
def few_shot(s, question, fail=False):
    s += FEW_SHOT + "Q: " + question + "\nA:"
    if fail:
        raise RuntimeError("item asked to fail")
    s += gen("answer", max_tokens=4, **GREEDY)


def test_run_batch_keeps_order_isolates_a_failure_and_hits_the_few_shot_prefix(rt):
    rt.flush_cache()
    questions = [f"what is {i} plus {i + 1}?" for i in range(8)]
    items = [{"question": q, "fail": i == 5} for i, q in enumerate(questions)]
    states = few_shot.run_batch(items, runtime=rt, num_threads=4, progress_bar=True)
    assert len(states) == 8
    assert isinstance(states[5].error, RuntimeError)
    with pytest.raises(ProgramError, match="item asked to fail"):
        states[5]["answer"]
    prefix_len = len(encode(rt, FEW_SHOT))
    cached = []
    for i, state in enumerate(states):
        if i == 5:
            continue
        assert state.error is None
        assert state.text() == FEW_SHOT + "Q: " + questions[i] + "\nA:" + state["answer"]
        assert state.token_ids() == encode(rt, FEW_SHOT + "Q: " + questions[i] + "\nA:") + _output(state)
        cached.append(state.get_meta_info("answer")["cached_tokens"])
    assert all(c >= prefix_len for c in sorted(cached)[1:])  # only the first computes the prefix
    assert rt.cache_stats()["hit_rate"] > 0.5


def _output(state):
    return state.token_ids()[-state.get_meta_info("answer")["completion_tokens"]:]


def test_default_runtime_is_used_and_missing_runtime_is_an_error(rt):
    radixrt.set_default_runtime(None)
    with pytest.raises(ValueError, match="set_default_runtime"):
        few_shot.run(question="what is 1 plus 1?")
    radixrt.set_default_runtime(rt)
    try:
        assert few_shot.run(question="what is 1 plus 1?")["answer"]
    finally:
        radixrt.set_default_runtime(None)


# --- streaming -----------------------------------------------------------------------
def test_streamed_run_yields_the_text_as_it_is_generated(rt):
    @function
    def story(s):
        s += PREFIX
        s += gen("a", max_tokens=12, **GREEDY)
        s += " End."

    state = story.run(runtime=rt, stream=True)
    chunks = list(state.text_iter("a"))
    assert len(chunks) > 1 and "".join(chunks) == state["a"]
    assert "".join(state.text_iter()) == state.text() == PREFIX + state["a"] + " End."


class _GatedRuntime:
    """Holds a streamed gen after its first text until `release` is set: proves chunks arrive early."""

    def __init__(self, rt):
        self.tokenizer, self.config = rt.tokenizer, rt.config
        self._rt = rt
        self.release = threading.Event()

    def generate(self, *args, **kwargs):
        chunks = self._rt.generate(*args, **kwargs)
        if not kwargs.get("stream"):
            return chunks

        def gated():
            shown = False
            for chunk in chunks:
                if shown and not self.release.wait(timeout=20):
                    raise TimeoutError("the reader never saw the first chunk")
                shown = shown or bool(chunk["text"])
                yield chunk

        return gated()


def test_text_iter_yields_a_chunk_before_the_gen_finishes(rt):
    @function
    def story(s):
        s += PREFIX
        s += gen("a", max_tokens=8, **GREEDY)

    gated = _GatedRuntime(rt)
    state = story.run(runtime=gated, stream=True)
    chunks = state.text_iter("a")
    first = next(chunks)  # arrives while the gen is held after its first chunk
    gated.release.set()
    assert first + "".join(chunks) == state["a"]


def test_streamed_run_reports_an_error_at_the_end_of_the_stream(rt):
    @function
    def too_long(s):
        s += "hi"
        s += gen("a", max_tokens=100_000)

    state = too_long.run(runtime=rt, stream=True)
    with pytest.raises(ProgramError):
        list(state.text_iter())
    assert isinstance(state.error, ValueError)


# --- bad input -----------------------------------------------------------------------
@pytest.mark.parametrize(
    "make, error, match",
    [
        (lambda: gen(None), TypeError, "name must be a string"),
        (lambda: gen(5), TypeError, "name must be a string"),
        (lambda: gen(""), ValueError, "non-empty"),
        (lambda: gen("x", max_tokens=-1), ValueError, "max_tokens"),
        (lambda: gen("x", temperature=-1), ValueError, r"gen\('x'\): temperature"),
        (lambda: select("c", []), ValueError, "choices must not be empty"),
        (lambda: select("c", "ab"), TypeError, "list of strings"),
        (lambda: select("c", ["a", 3]), TypeError, "choice 1"),
        (lambda: select("c", ["a", ""]), ValueError, "choice 1 is empty"),
        (lambda: select(None, ["a"]), TypeError, "name must be a string"),
        (lambda: user(user("x")), TypeError, "cannot contain another role"),
        (lambda: assistant(3), TypeError, "content must be"),
    ],
)
def test_bad_expressions_name_the_mistake(make, error, match):
    with pytest.raises(error, match=match):
        make()


def test_bad_state_use_names_the_mistake(rt):
    @function
    def misuse(s, what):
        s += "some text"
        s += gen("known", max_tokens=1, **GREEDY)
        if what == "fork0":
            s.fork(0)
        elif what == "fork-1":
            s.fork(-1)
        elif what == "fork-float":
            s.fork(1.5)
        elif what == "unknown":
            s["unknown"]
        elif what == "append-int":
            s += 5

    cases = [
        ("fork0", ValueError, "n must be >= 1"),
        ("fork-1", ValueError, "n must be >= 1"),
        ("fork-float", TypeError, "n must be an int"),
        ("unknown", KeyError, "'unknown'.*known variables: 'known'"),
        ("append-int", TypeError, "accepts a string"),
    ]
    for what, error, match in cases:
        with pytest.raises(error, match=match):
            misuse.run(what=what, runtime=rt)
    with pytest.raises(TypeError, match="misuse.*what"):
        misuse.run(runtime=rt)
    with pytest.raises(TypeError, match="run_batch item 1"):
        misuse.run_batch([{"what": "x"}, {"nope": 1}], runtime=rt)
    with pytest.raises(TypeError, match="run_batch item 0 must be a dict"):
        misuse.run_batch(["x"], runtime=rt)
    with pytest.raises(ValueError, match="num_threads"):
        misuse.run_batch([{"what": "x"}], runtime=rt, num_threads=0)
    with pytest.raises(ValueError, match="has no prompt"):
        function(lambda s: s.__iadd__(gen("a"))).run(runtime=rt)
    with pytest.raises(ValueError, match="select.*nothing to condition on"):
        function(lambda s: s.__iadd__(select("a", ["x"]))).run(runtime=rt)


def test_gen_takes_sglangs_min_tokens_stop_regex_and_logprob_fields(rt):
    import radixrt

    @radixrt.function
    def program(s):
        s += "Once upon a time"
        s += radixrt.gen("story", max_tokens=12, min_tokens=10, temperature=0, ignore_eos=True, return_logprob=True,
                         top_logprobs_num=2, return_text_in_logprobs=True)

    state = program.run(runtime=rt)
    meta = state.get_meta_info("story")
    assert meta["completion_tokens"] >= 10
    assert all(len(entry) == 3 and isinstance(entry[2], str) for entry in meta["output_token_logprobs"])
    assert all(len(top) == 2 for top in meta["output_top_logprobs"])
    with pytest.raises(ValueError, match=r"gen\('x'\): stop_regex"):
        radixrt.gen("x", stop_regex="(")
