"""The first property: caching never changes results.

Greedy outputs with the radix cache on equal those with it off and equal
transformers' own greedy decoding on the same weights, over the workloads
where the cache matters.
"""

from __future__ import annotations

import random

import pytest

from radixrt import Runtime

MAX_NEW = 8


def runtime(model_dir, **config) -> Runtime:
    config.setdefault("max_total_tokens", 8192)
    return Runtime(model_dir, device="cpu", dtype="float32", check_invariants=True, **config)


def greedy(max_new_tokens: int = MAX_NEW, **extra) -> dict:
    return {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True, **extra}


def prefix_workloads(vocab_size: int, seed: int = 0) -> list[list[list[int]]]:
    """Batches to submit one after another; later ones reuse earlier prefixes."""
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, vocab_size) for _ in range(n)]

    system = tokens(90)
    document = tokens(150)
    shared_system = [system + tokens(rng.randrange(4, 20)) for _ in range(5)]
    prefixes = [document[:40], document, document[:100], document + tokens(7)]
    identical = [document[:60] + tokens(5)] * 3
    mixed = [tokens(rng.randrange(1, 120)) for _ in range(64)]
    return [shared_system, prefixes, identical, mixed]


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("min_shared_prefix", [64, 1], ids=["cascade-from-64", "cascade-always"])
def test_greedy_equals_transformers_with_cache_on_and_off(
    tiny_llama_dir, tiny_llama_hf, hf_greedy, page_size, min_shared_prefix
):
    """Also with every shared slot prefix attended once for all its sequences (shared_prefix.py)."""
    vocab = tiny_llama_hf.config.vocab_size
    batches = prefix_workloads(vocab)
    options = {"page_size": page_size, "shared_prefix_min_tokens": min_shared_prefix}
    with runtime(tiny_llama_dir, **options) as cached, runtime(
        tiny_llama_dir, disable_radix_cache=True, **options
    ) as uncached:
        for prompts in batches:
            expected = hf_greedy(tiny_llama_hf, prompts, MAX_NEW)
            with_cache = [r["output_ids"] for r in cached.generate(prompts, greedy())]
            without_cache = [r["output_ids"] for r in uncached.generate(prompts, greedy())]
            assert with_cache == expected
            assert without_cache == expected
        on, off = cached.cache_stats(), uncached.cache_stats()
    assert off["cached_prompt_tokens"] == 0
    assert on["cached_prompt_tokens"] > 500
    assert on["computed_tokens"] < off["computed_tokens"] - 500


def test_multi_turn_chat_reuses_the_conversation(tiny_llama_dir, tiny_llama_hf, hf_greedy):
    rng = random.Random(1)
    vocab = tiny_llama_hf.config.vocab_size
    system = [rng.randrange(3, vocab) for _ in range(60)]
    conversations = [list(system) for _ in range(4)]
    with runtime(tiny_llama_dir) as rt:
        for turn in range(3):
            for conv in conversations:
                conv += [rng.randrange(3, vocab) for _ in range(rng.randrange(3, 12))]
            results = rt.generate([list(c) for c in conversations], greedy())
            expected = hf_greedy(tiny_llama_hf, conversations, MAX_NEW)
            assert [r["output_ids"] for r in results] == expected
            for conv, result in zip(conversations, results):
                if turn > 0:  # the whole previous turn, answer included, is cached
                    assert result["meta_info"]["cached_tokens"] >= len(conv) - 12 - MAX_NEW
                conv += result["output_ids"]


@pytest.mark.slow
def test_bundled_smollm2_greedy_is_unchanged_by_the_cache(smollm2, make_runner, paged_greedy):
    """The reference is our runner's plain paged greedy decoding (no runtime, no cache), which
    tests/test_model.py checks against transformers on this same model; decoding with
    transformers here again would cost several times this whole test for no new assurance."""
    messages = [
        [{"role": "user", "content": question}]
        for question in ("What is 2 + 2?", "Name a color of the sky.", "What is the capital of France?")
    ]
    prompts = [smollm2.tokenizer.encode(smollm2.tokenizer.apply_chat_template(m, tokenize=False,
               add_generation_prompt=True), add_special_tokens=False) for m in messages]
    runner, pool = make_runner(smollm2.model, num_pages=256)
    expected = paged_greedy(runner, pool, prompts, 16)
    with Runtime(smollm2, device="cpu", dtype="float32", max_total_tokens=4096, check_invariants=True) as rt:
        first = rt.generate(prompts, greedy(16))
        again = rt.generate(prompts, greedy(16))
    assert [r["output_ids"] for r in first] == expected
    assert [r["output_ids"] for r in again] == expected
    assert all(r["meta_info"]["cached_tokens"] == len(p) - 1 for r, p in zip(again, prompts))


def test_tiny_pool_evicts_and_retracts_without_changing_outputs(tiny_llama_dir, tiny_llama_hf):
    rng = random.Random(2)
    vocab = tiny_llama_hf.config.vocab_size
    shared = [rng.randrange(3, vocab) for _ in range(24)]
    prompts = [shared + [rng.randrange(3, vocab) for _ in range(rng.randrange(4, 30))] for _ in range(16)]
    params = greedy(24)
    with runtime(tiny_llama_dir) as roomy:
        expected = [r["output_ids"] for r in roomy.generate(prompts, params)]
    with runtime(tiny_llama_dir, max_total_tokens=160, chunked_prefill_size=32) as tight:
        results = tight.generate(prompts, params)
        stats = tight.cache_stats()
    assert [r["output_ids"] for r in results] == expected
    assert stats["evicted_tokens"] > 0 and stats["retracted_requests"] > 0
    assert stats["protected_tokens"] == 0
    assert stats["pool_used_tokens"] == stats["tree_tokens"], "every used slot belongs to the tree"
