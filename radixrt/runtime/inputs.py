"""What callers pass to `generate`, turned into validated `Request`s in the caller's thread.

Everything here runs before a request reaches the engine thread, so bad
input raises `ValueError` in the caller's own thread, naming the field and
the accepted range, and the engine never sees it.
"""

from __future__ import annotations

import random
from array import array
from dataclasses import dataclass, replace
from typing import Any, Collection, Hashable, Sequence

from radixrt.engine.request import Request
from radixrt.sampling import SamplingParams
from radixrt.sampling.grammar import Grammars

PromptInput = Any  # str | list[str] | list[int] | list[list[int]] | messages | list of messages


@dataclass(frozen=True)
class RequestLimits:
    """What a request must fit: the model's vocabulary and context, and the KV pool (whole pages)."""

    vocab_size: int
    context_len: int
    pool_tokens: int  # a whole number of pages

    def room(self, num_prompt_tokens: int) -> int:
        """The most tokens a prompt of this length may generate: what the context and the pool leave."""
        return max(min(self.context_len, self.pool_tokens) - num_prompt_tokens, 0)

    def check_tokens(self, prompt: Sequence[int]) -> None:
        """What any prompt must be, generated from or only explained: non-empty, in the vocabulary."""
        if not prompt:
            raise ValueError("prompt is empty: give at least one token")
        if min(prompt) < 0 or max(prompt) >= self.vocab_size:
            bad = next(t for t in prompt if not 0 <= t < self.vocab_size)
            raise ValueError(f"input_ids: token id {bad} is outside the vocabulary [0, {self.vocab_size})")

    def check(self, prompt: Sequence[int], params: SamplingParams) -> None:
        self.check_tokens(prompt)
        total = len(prompt) + params.token_limit
        if total > self.context_len:
            raise ValueError(
                f"prompt ({len(prompt)} tokens) + max_new_tokens ({params.max_new_tokens}) = {total} "
                f"exceeds the model's context length {self.context_len}"
            )
        if total > self.pool_tokens:  # a whole number of pages, so a request that fits in tokens fits in pages
            raise ValueError(
                f"prompt ({len(prompt)} tokens) + max_new_tokens ({params.max_new_tokens}) = {total} "
                f"exceeds the KV pool ({self.pool_tokens} tokens); raise max_total_tokens"
            )


class InputProcessor:
    """Prompt forms to token ids (tokenizer, chat template) and token ids to requests."""

    def __init__(self, tokenizer: Any, limits: RequestLimits, eos_token_ids: Collection[int]):
        self.tokenizer = tokenizer
        self.limits = limits
        self.eos_token_ids = frozenset(eos_token_ids)
        # Output constraints are compiled here, in the caller's thread, never on the engine's.
        self.grammars = Grammars(tokenizer, limits.vocab_size, self.eos_token_ids)

    def token_ids(self, prompt: PromptInput, input_ids: Any, messages: Any) -> tuple[list[list[int]], bool]:
        """The prompts' token ids, and whether the caller gave a batch (a list of prompts)."""
        given = [x is not None for x in (prompt, input_ids, messages)]
        if sum(given) != 1:
            raise ValueError("give exactly one of prompt, input_ids or messages")
        if messages is not None:
            return [self.encode_messages(messages)], False
        if input_ids is not None:
            prompt = input_ids
        if isinstance(prompt, str):
            return [self.encode_text(prompt)], False
        if not isinstance(prompt, (list, tuple)) or not prompt:
            raise ValueError("prompt must be a non-empty string, list of strings, token ids or messages")
        first = prompt[0]
        if isinstance(first, str):
            return [self.encode_text(p) for p in prompt], True
        if isinstance(first, dict):
            return [self.encode_messages(prompt)], False
        if isinstance(first, (list, tuple)) and first and isinstance(first[0], dict):
            return [self.encode_messages(m) for m in prompt], True
        if isinstance(first, (list, tuple)):
            return [_check_ids(ids) for ids in prompt], True
        return [_check_ids(prompt)], False

    def encode_text(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise ValueError(f"prompt must be a string, got {type(text).__name__}")
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def encode_messages(self, messages: Sequence[dict]) -> list[int]:
        for m in messages:
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ValueError("messages must be a list of {'role': ..., 'content': ...} dicts")
        text = self.tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def one_prompt(self, prompt: PromptInput, input_ids: Any, messages: Any) -> list[int]:
        """One prompt's token ids, checked like a request's (for reading the cache, not generating).

        Over the context is the limit generate would hit with no new token at all.
        """
        prompts, is_batch = self.token_ids(prompt, input_ids, messages)
        if is_batch:
            raise ValueError("prompt must be one prompt here, not a list of prompts")
        ids = prompts[0]
        self.limits.check_tokens(ids)
        if len(ids) > self.limits.context_len:
            raise ValueError(
                f"prompt ({len(ids)} tokens) exceeds the model's context length {self.limits.context_len}"
            )
        return ids

    def make_requests(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        cache_salt: str | None = None,
        logprob_start_len: int | None = None,
        rids: Sequence[str] | None = None,
    ) -> list[Request]:
        """`params.n` requests per prompt, prompt by prompt; each is validated against the limits.

        `rids[i]` names prompt i's request; with `n > 1` its samples are
        `rids[i]-0`, `rids[i]-1`, ... and `rids[i]` aborts them all.
        """
        namespace = cache_namespace(cache_salt)
        if rids is not None and len(rids) != len(prompts):
            raise ValueError(f"rid must give one id per prompt ({len(prompts)}), got {len(rids)}")
        params.validate(vocab_size=self.limits.vocab_size)
        constraint = params.constraint
        compiled = None if constraint is None else self.grammars.compile(*constraint)
        requests = []
        for index, ids in enumerate(prompts):
            if logprob_start_len is not None and not 0 <= logprob_start_len <= len(ids):
                raise ValueError(f"logprob_start_len must be -1 (the output only) or in [0, {len(ids)}] "
                                 f"(the prompt's length), got {logprob_start_len}")
            prompt_params = params
            if params.max_new_tokens is None:
                prompt_params = replace(params, max_new_tokens=self.limits.room(len(ids)))
            self.limits.check(ids, prompt_params)
            base_seed = params.seed if params.seed is not None else random.getrandbits(62)
            group = rids[index] if rids is not None else ""
            for i in range(params.n):
                requests.append(
                    Request(
                        array("q", ids),
                        prompt_params,
                        rid=f"{group}-{i}" if group and params.n > 1 else group,
                        group=group,
                        namespace=namespace,
                        logprob_start_len=logprob_start_len,
                        tokenizer=self.tokenizer,
                        eos_token_ids=self.eos_token_ids,
                        seed=base_seed + i,
                        grammar=None if compiled is None else self.grammars.matcher(compiled),
                    )
                )
        return requests


def logprob_options(
    params: SamplingParams,
    return_logprob: bool | None = None,
    logprob_start_len: int | None = None,
    top_logprobs_num: int | None = None,
    token_ids_logprob: Sequence[int] | None = None,
    return_text_in_logprobs: bool | None = None,
) -> tuple[SamplingParams, int | None]:
    """SGLang's request-level log-prob fields folded into the sampling parameters, and the prompt
    position the input lists start at (None: output only, SGLang's -1).

    None leaves a field as `params` has it. Asking for any log-prob (a start >= 0, a top-k, token
    ids) turns `return_logprob` on: SGLang ignores them without it, radixrt never ignores a
    field. Raises ValueError naming the field and its range."""
    if logprob_start_len is not None:
        if isinstance(logprob_start_len, bool) or not isinstance(logprob_start_len, int) or logprob_start_len < -1:
            raise ValueError(f"logprob_start_len must be -1 (the output only) or an int >= 0, got {logprob_start_len!r}")
        if logprob_start_len == -1:
            logprob_start_len = None
    changes: dict[str, Any] = {}
    if return_logprob is not None:
        if not isinstance(return_logprob, bool):
            raise ValueError(f"return_logprob must be True or False, got {return_logprob!r}")
        changes["return_logprob"] = return_logprob
    if top_logprobs_num is not None:
        changes["top_logprobs_num"] = top_logprobs_num
    if token_ids_logprob is not None:
        changes["token_ids_logprob"] = token_ids_logprob
    if return_text_in_logprobs is not None:
        changes["return_text_in_logprobs"] = return_text_in_logprobs
    asks = logprob_start_len is not None or bool(top_logprobs_num) or token_ids_logprob is not None
    if asks:
        changes["return_logprob"] = True
    return (replace(params, **changes) if changes else params), logprob_start_len


def cache_namespace(cache_salt: str | None) -> Hashable:
    """The radix tree namespace of a `cache_salt`: equal salts share a cache, others never do."""
    if cache_salt is not None and not isinstance(cache_salt, str):
        raise ValueError(f"cache_salt must be a string, got {type(cache_salt).__name__}")
    return None if cache_salt is None else ("cache_salt", cache_salt)


def normalise_rids(rid: Any, is_batch: bool, num_prompts: int) -> list[str] | None:
    """The caller's request ids as one per prompt: a string for one prompt, a list for a batch."""
    if rid is None:
        return None
    rids = rid if is_batch and isinstance(rid, (list, tuple)) else [rid]
    if len(rids) != num_prompts or not all(isinstance(r, str) and r for r in rids):
        expected = f"a list of {num_prompts} non-empty strings" if is_batch else "a non-empty string"
        raise ValueError(f"rid must be {expected}, got {rid!r}")
    if len(set(rids)) != len(rids):
        raise ValueError(f"rid must not repeat an id within one call, got {rid!r}")
    return list(rids)


def _check_ids(ids: Any) -> list[int]:
    if not isinstance(ids, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise ValueError("input_ids must be a list of ints (or a list of such lists)")
    return list(ids)
