"""Log-probabilities in SGLang's `meta_info` shapes, and the helpers that read them back.

A request asks with `return_logprob` (and `logprob_start_len`, `top_logprobs_num`,
`token_ids_logprob`, `return_text_in_logprobs`); its result then carries, as SGLang's
own server and `Engine` return them:

    input_token_logprobs       [[logprob, token_id, text], ...]  prompt[start:], the first logprob None
    output_token_logprobs      [[logprob, token_id, text], ...]  one per output token
    input_top_logprobs         [None, [[logprob, token_id, text] x k], ...]   (top_logprobs_num > 0)
    output_top_logprobs        [[[logprob, token_id, text] x k], ...]         most likely first
    input_token_ids_logprobs   [None, [[logprob, token_id, text] per asked id], ...]  (token_ids_logprob)
    output_token_ids_logprobs  [[[logprob, token_id, text] per asked id], ...]

`text` is the token's own text with `return_text_in_logprobs`, else None. `start` is
`logprob_start_len`: -1 (SGLang's default) means the output only, so the input lists
are empty; otherwise the entries cover prompt[start:], and the first one is padded with
None because SGLang pads it (its log-probability is only computed from start + 1 on).

Consumers (the OpenAI layer, `radixrt.lang`) read the triples through `logprob_values`,
`entry_ids` and `top_pairs` below rather than by index, so the shape lives here.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

Entry = list  # [logprob | None, token_id, text | None]
Decode = Callable[[int], "str | None"]


def entries(logprobs: Sequence[float | None], token_ids: Sequence[int], decode: Decode) -> list[Entry]:
    """SGLang's `[logprob, token_id, text]` triples of parallel lists."""
    return [[logprob, token_id, decode(token_id)] for logprob, token_id in zip(logprobs, token_ids)]


def top_entries(pairs: Sequence[tuple[int, float]], decode: Decode) -> list[Entry]:
    """One position's alternatives, (token_id, logprob) most likely first, as triples in that order."""
    return [[logprob, token_id, decode(token_id)] for token_id, logprob in pairs]


def logprob_values(entry_list: Sequence[Sequence[Any]]) -> list[float | None]:
    """The log-probabilities of a list of triples (None where SGLang pads)."""
    return [entry[0] for entry in entry_list]


def entry_ids(entry_list: Sequence[Sequence[Any]]) -> list[int]:
    """The token ids of a list of triples."""
    return [int(entry[1]) for entry in entry_list]


def top_pairs(position: Sequence[Sequence[Any]] | None) -> list[tuple[int, float]]:
    """One position's top-k triples as (token_id, logprob) pairs, most likely first ([] for None)."""
    return [(int(entry[1]), float(entry[0])) for entry in position or ()]


def token_text_decoder(tokenizer: Any, wanted: bool) -> Decode:
    """Each token's own text (as SGLang's `batch_decode([[id]])`), or None when not wanted."""
    if not wanted or tokenizer is None:
        return lambda token_id: None
    cache: dict[int, str] = {}

    def decode(token_id: int) -> str:
        text = cache.get(token_id)
        if text is None:
            text = cache[token_id] = str(tokenizer.decode([token_id]))
        return text

    return decode
