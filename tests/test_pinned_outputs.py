"""Greedy outputs of the bundled model, pinned: a refactor that changes a token fails here.

The ids were produced by radixrt before the engine was restructured (and
checked equal with the cache on and off); fp32, so that they do not depend on
the CPU's bf16 support. If a deliberate numerical change moves them, check
the new outputs against transformers (tests/test_model.py) before re-pinning.
"""

from __future__ import annotations

import pytest

from radixrt.runtime import Runtime

PROMPTS = [
    "The capital of France is",
    [{"role": "user", "content": "Name three colours of the rainbow."}],
    [{"role": "system", "content": "You are a terse assistant."}, {"role": "user", "content": "What is 2 + 2?"}],
    "def fibonacci(n):",
]
PINNED = [
    [7042, 30, 198, 198, 504, 2988, 314, 42, 216, 34, 32, 33, 40, 29, 32, 33, 29, 34, 34, 216, 33, 34, 42, 33],
    [504, 24594, 314, 253, 3953, 6968, 28, 564, 357, 506, 441, 915, 563, 260, 4683, 282, 260, 24594, 30, 1385, 359,
     2390, 1296, 3003],
    [49, 2232, 2408, 3202, 4119, 1909, 30, 216, 34, 1232, 216, 34, 314, 253, 8170, 1183, 282, 253, 7132, 3905, 338,
     6650, 2629, 1699],
    [472, 585, 304, 1758, 216, 32, 42, 448, 1003, 216, 33, 472, 1003, 304, 1672, 3987, 46477, 24, 94, 731, 216, 33, 25,
     198],
]
GREEDY = {"max_new_tokens": 24, "temperature": 0}


@pytest.mark.slow
@pytest.mark.parametrize("disable_radix_cache", [False, True], ids=["cache-on", "cache-off"])
def test_bundled_model_greedy_outputs_are_pinned(smollm2, disable_radix_cache):
    with Runtime(smollm2, disable_radix_cache=disable_radix_cache, check_invariants=True) as rt:
        one_by_one = [rt.generate(prompt, GREEDY)["output_ids"] for prompt in PROMPTS]
        # The same two prompts again, in one batch: the first now hits the cache.
        batched = [r["output_ids"] for r in rt.generate([PROMPTS[0], PROMPTS[3]], GREEDY)]
    assert one_by_one == PINNED
    assert batched == [PINNED[0], PINNED[3]]
