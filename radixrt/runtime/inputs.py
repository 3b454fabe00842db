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

# The chat roles a message may have (the HTTP server's ChatCompletionRequest checks the same).
CHAT_ROLES = ("system", "user", "assistant", "tool")


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

    def encode_messages(self, messages: Sequence[dict], tools: Sequence[dict] | None = None) -> list[int]:
        """A conversation's prompt through the chat template; `tools` (OpenAI's tool list) are
        rendered by the template too. ValueError names the first message that is not one."""
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ValueError("messages must be a list of {'role': ..., 'content': ...} dicts")
            if m["role"] not in CHAT_ROLES:  # a template would drop or mangle it silently
                raise ValueError(f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, got {m['role']!r}")
        options = {} if tools is None else {"tools": list(tools)}
        try:
            text = self.tokenizer.apply_chat_template(
                list(messages), tokenize=False, add_generation_prompt=True, **options
            )
        except Exception as error:
            import jinja2  # transformers' template engine: its errors are the template refusing the messages

            if isinstance(error, jinja2.TemplateError):
                raise ValueError(f"messages: the model's chat template cannot render them: {error}") from None
            raise
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
        params: SamplingParams | Sequence[SamplingParams],
        cache_salt: str | None = None,
        logprob_start_len: int | None | Sequence[int | None] = None,
        rids: Sequence[str] | None = None,
    ) -> list[Request]:
        """`params.n` requests per prompt, prompt by prompt; each is validated against the limits.

        `params` and `logprob_start_len` are one for all prompts or one per prompt (`per_prompt`).
        `rids[i]` names prompt i's request; with `n > 1` its samples are
        `rids[i]-0`, `rids[i]-1`, ... and `rids[i]` aborts them all. Everything is validated
        before the first request is made, so a bad prompt fails the whole call.
        """
        namespace = cache_namespace(cache_salt)
        if rids is not None and len(rids) != len(prompts):
            raise ValueError(f"rid must give one id per prompt ({len(prompts)}), got {len(rids)}")
        all_params = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        starts: list[int | None] = (list(logprob_start_len) if isinstance(logprob_start_len, (list, tuple))
                                    else [logprob_start_len] * len(prompts))  # type: ignore[list-item]  # fmt: skip
        if len(all_params) != len(prompts) or len(starts) != len(prompts):
            raise ValueError(f"sampling_params and logprob_start_len must be one for all prompts or one per prompt "
                             f"({len(prompts)})")  # fmt: skip
        compiled_by_constraint: dict[tuple[str, str], Any] = {}
        for prompt_params in all_params:
            prompt_params.validate(vocab_size=self.limits.vocab_size)
            constraint = prompt_params.constraint
            if constraint is not None and constraint not in compiled_by_constraint:
                compiled_by_constraint[constraint] = self.grammars.compile(*constraint)
        resolved_params = []
        for ids, prompt_params, start in zip(prompts, all_params, starts):
            if start is not None and not 0 <= start <= len(ids):
                raise ValueError(f"logprob_start_len must be -1 (the output only) or in [0, {len(ids)}] "
                                 f"(the prompt's length), got {start}")
            resolved = prompt_params
            if prompt_params.max_new_tokens is None:
                resolved = replace(prompt_params, max_new_tokens=self.limits.room(len(ids)))
            self.limits.check(ids, resolved)
            resolved_params.append(resolved)
        requests = []
        for index, (ids, params, prompt_params, start) in enumerate(zip(prompts, all_params, resolved_params, starts)):
            constraint = params.constraint
            compiled = None if constraint is None else compiled_by_constraint[constraint]
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
                        logprob_start_len=start,
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


def per_prompt(
    sampling_params: Any, logprobs: Sequence[Any], num_prompts: int, is_batch: bool
) -> tuple[list[SamplingParams], list[int | None]]:
    """Each prompt's sampling parameters and input log-prob start, as SGLang's `Engine` and
    `/generate` take them: `sampling_params` a dict (or SamplingParams) for all prompts or, for a
    batch, a list of one per prompt; the log-prob fields (`logprob_options`' order) likewise a value
    for all or a list of one per prompt (`token_ids_logprob`: a list of lists)."""

    def split(name: str, value: Any, nested: bool = False) -> list[Any]:
        per = isinstance(value, (list, tuple)) and (not nested or all(v is None or isinstance(v, (list, tuple))
                                                                     for v in value) and bool(value))
        if not per:
            return [value] * num_prompts
        if not is_batch or len(value) != num_prompts:
            raise ValueError(f"{name}: a list gives one value per prompt of a batch ({num_prompts} prompt(s)), "
                             f"got {len(value)}")
        return list(value)

    if isinstance(sampling_params, (list, tuple)):
        bases = [SamplingParams.from_any(p) for p in split("sampling_params", sampling_params)]
    else:
        bases = [SamplingParams.from_any(sampling_params)] * num_prompts
    names = ("return_logprob", "logprob_start_len", "top_logprobs_num", "token_ids_logprob", "return_text_in_logprobs")
    columns = [split(name, value, nested=name == "token_ids_logprob") for name, value in zip(names, logprobs)]
    params, starts = [], []
    for i, base in enumerate(bases):
        prompt_params, start = logprob_options(base, *(column[i] for column in columns))
        params.append(prompt_params)
        starts.append(start)
    return params, starts


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
