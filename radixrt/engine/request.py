"""A request as the engine sees it: tokens, the KV slots it holds, its progress and its output.

A request's KV slots, in token order:

    slots:  [ 0 .......... cached_len | cached_len ..... num_computed | ... len(slots) ]
              tree-owned, locked via     private: computed here,        private: allocated,
              last_node (borrowed)       not yet in the tree            not yet written

`fill_ids = prompt_ids + output_ids` are the tokens whose KV the request needs.
Both are int64 `array`s: the radix tree reads an array's buffer in place,
where a list would be converted token by token on every match and insert.
A step computes `fill_ids[num_computed : num_computed + k]`; when it reaches
the end of fill_ids the last logits give the next token. A decode is the case
k = 1, a chunk of a long prompt is a k that stops short of the end, and a
retracted request simply starts over from whatever the tree still holds.

Who writes which field (everyone else only reads):

    field                                        written by
    -------------------------------------------  ---------------------------------------------
    prompt_ids, params, rid, group, namespace,   the caller's thread, once, before submission
      seed, logprob_start_len, on_output
    status, num_retractions, admitted_s          Scheduler (which queue the request is in)
    slots, cached_len, last_node, cached_tokens  CacheManager (admit, cache_computed, release)
    num_computed                                 CacheManager on admit/release; Scheduler.postprocess
                                                   as the step's tokens are computed
    prompt_logprobs, prompt_top_logprobs,        LogitPlan (prompt scoring), cleared on admit
      prompt_ids_logprobs
    output_ids, output_logprobs,                 the request's own `append_token` / `finish`,
      output_top_logprobs, output_ids_logprobs,    called by Scheduler.postprocess and abort
      finish_reason,
      first_token_s, finished_s, the text

The output side lives here too: `OutputText` turns sampled tokens into the
text a caller may see so far and judges stop tokens and stop strings;
`FinishReason` says why a request ended; `RequestOutput` is what a step
reports to the caller, and `Request.result()` the final dict.
"""

from __future__ import annotations

import enum
import itertools
import re
import time
from array import array
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Literal

import torch

from radixrt.engine import logprobs as lp
from radixrt.engine.detokenizer import StopStringMatcher, TokenDecoder, make_detokenizer
from radixrt.sampling import SamplingParams
from radixrt.sampling.grammar import Matcher

_request_counter = itertools.count()


@dataclass(frozen=True)
class FinishReason:
    """Why a request ended. `to_dict()` is SGLang's `meta_info["finish_reason"]` shape."""

    type: Literal["stop", "length", "abort"]
    matched: str | int | None = None  # stop: the stop string, or the stop/EOS token id
    length: int | None = None  # length: the limit that was reached
    message: str | None = None  # abort: why

    @classmethod
    def stop(cls, matched: str | int) -> FinishReason:
        return cls("stop", matched=matched)

    @classmethod
    def at_length(cls, length: int) -> FinishReason:
        return cls("length", length=length)

    @classmethod
    def abort(cls, message: str) -> FinishReason:
        return cls("abort", message=message)

    def to_dict(self) -> dict[str, Any]:
        if self.type == "stop":
            return {"type": "stop", "matched": self.matched}
        if self.type == "length":
            return {"type": "length", "length": self.length}
        return {"type": "abort", "message": self.message}


def ends_at_eos(params: SamplingParams) -> bool:
    """Whether EOS ends the request: unless `ignore_eos`, and always under an output constraint,
    whose grammar allows EOS only once it is complete."""
    return not params.ignore_eos or params.constraint is not None


def stop_token_ids(params: SamplingParams, eos_token_ids: Collection[int]) -> tuple[int, ...]:
    """The tokens that end a request as a stop: its stop tokens and EOS (`ends_at_eos`)
    (listed for a decode run's C loop; `token_finish_reason` tests the same rule per token without
    building the list)."""
    return (*params.stop_token_ids, *(eos_token_ids if ends_at_eos(params) else ()))


def token_finish_reason(
    params: SamplingParams, token_id: int, num_output_tokens: int, eos_token_ids: Collection[int]
) -> FinishReason | None:
    """Why a request ends with this new token, judged on the token alone (stop strings need the text).

    `num_output_tokens` counts the new token. A stop token, or EOS where it ends the request
    (`ends_at_eos`), wins over the length limit reached by the same token.
    """
    if token_id in params.stop_token_ids or (token_id in eos_token_ids and ends_at_eos(params)):
        return FinishReason.stop(token_id)
    if num_output_tokens >= params.token_limit:
        return FinishReason.at_length(params.token_limit)
    return None


class OutputText:
    """The text side of one request: feed it each sampled token, take the streamable delta.

    `append` returns the finish reason when the token ends the request
    (stop token, EOS, stop string, max_new_tokens), else None. `take_delta`
    returns the text released since the last call, `final_text` the whole
    text once the request is over. Without a tokenizer the text stays empty
    (token ids in, token ids out) while stop tokens and lengths still apply.
    The text never includes a stop token, a matched stop string, or anything
    after it.
    """

    def __init__(
        self,
        tokenizer: TokenDecoder | None,
        params: SamplingParams,
        prompt_ids: Sequence[int] | None = None,
        eos_token_ids: Collection[int] = (),
    ):
        self._params = params
        self._eos_token_ids = eos_token_ids
        self._detokenizer = (
            make_detokenizer(tokenizer, prompt_ids, params.skip_special_tokens) if tokenizer else None
        )
        self._stops = StopStringMatcher(params.stop, keep_stop=params.no_stop_trim)
        self._regexes = [re.compile(pattern) for pattern in params.stop_regex]
        self._regex_from = 0  # where a stop_regex match may start in the text
        self._delta: list[str] = []
        self._closed = False

    def append(self, token_id: int, num_output_tokens: int) -> FinishReason | None:
        """Add the request's newest token (`num_output_tokens` counts it)."""
        if self._closed:
            raise ValueError("append after the request finished")
        reason = token_finish_reason(self._params, token_id, num_output_tokens, self._eos_token_ids)
        stopped_by_token = reason is not None and reason.type == "stop"
        # A stop token reaches the text only with no_stop_trim.
        if self._detokenizer is not None and (not stopped_by_token or self._params.no_stop_trim):
            text = self._detokenizer.append(token_id)
            if num_output_tokens < self._params.min_new_tokens or stopped_by_token:
                self._delta.append(self._stops.feed_unmatched(text))
                if self._regexes:
                    self._regex_from = len(self._stops.seen)
            else:
                self._delta.append(self._stops.feed(text))
                if self._regexes and self._stops.matched is None:
                    self._match_regex()
        if not stopped_by_token and self._stops.matched is not None:
            reason = FinishReason.stop(self._stops.matched)
        if reason is not None:
            matched = self._close()
            if matched is not None:
                reason = FinishReason.stop(matched)
        return reason

    def _match_regex(self) -> None:
        """End the text at the stop_regex match that ends first, if any (its start without
        no_stop_trim)."""
        seen = self._stops.seen
        best: tuple[int, int, str] | None = None
        for pattern in self._regexes:
            match = pattern.search(seen, self._regex_from)
            if match is not None and match.end() > match.start() and (best is None or match.end() < best[1]):
                best = (match.start(), match.end(), pattern.pattern)
        if best is not None:
            start, end, pattern_text = best
            self._delta.append(self._stops.cut(end if self._params.no_stop_trim else start, pattern_text))

    def take_delta(self, final: bool = False) -> str:
        """Text released since the last call; `final=True` first releases everything held back."""
        if final:
            self._close()
        delta = "".join(self._delta)
        self._delta.clear()
        return delta

    def final_text(self) -> str:
        """The whole output text; ends the request's text (held-back text is released)."""
        self._close()
        return self._stops.text

    def _close(self) -> str | None:
        """Release held-back text; return the stop string that this completes, if any."""
        if not self._closed:
            self._closed = True
            if self._detokenizer is not None:
                self._delta.append(self._stops.feed(self._detokenizer.flush()))
            self._delta.append(self._stops.flush())
        return self._stops.matched


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class RequestOutput:
    """What a request reports after a step: the new text and, at the end, the result."""

    rid: str
    text_delta: str
    token_ids_delta: list[int]
    finished: bool
    result: dict[str, Any] | None = None

    def chunk(self, index: int) -> dict[str, Any]:
        """The stream chunk callers see; `index` is the request's place in its call."""
        chunk: dict[str, Any] = {
            "index": index,
            "id": self.rid,
            "text": self.text_delta,
            "output_ids": self.token_ids_delta,
            "finished": self.finished,
        }
        if self.result is not None:
            chunk["meta_info"] = self.result["meta_info"]
        return chunk


@dataclass(eq=False)
class Request:
    prompt_ids: array  # int64; a list given here is converted
    params: SamplingParams
    rid: str = ""
    group: str = ""  # the id the caller gave to all `n` samples of a prompt; aborting it aborts them all
    namespace: Hashable = None
    # SGLang's `logprob_start_len`: meta_info's input log-prob lists cover prompt[start:]
    # (the first entry padded with None); None: no input lists (SGLang's -1).
    logprob_start_len: int | None = None
    # Called on the engine thread with each output, or with the error when the
    # engine stops before the request ends.
    on_output: Callable[[RequestOutput | BaseException], None] | None = None
    # False: the caller waits for the whole result, so only the finished output is
    # delivered (a chunk per token would wake the caller's thread per token, and on
    # a 2-core CPU that thread competes with the compute threads for the cores).
    stream: bool = True
    tokenizer: TokenDecoder | None = None  # None: no text, token ids only
    eos_token_ids: Collection[int] = ()
    seed: int = 0
    # The output constraint's matcher (None: unconstrained): it has accepted exactly output_ids.
    grammar: Matcher | None = None
    # Jump-forward: tokens the grammar forces after output_ids, which the next decode step
    # computes with the pending token and the sampler confirms or discards (Scheduler).
    draft_ids: list[int] = field(default_factory=list)

    status: RequestStatus = RequestStatus.WAITING
    output_ids: array = field(default_factory=lambda: array("q"))
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    output_ids_logprobs: list[list[float]] = field(default_factory=list)  # per token, params.token_ids_logprob's
    # Prompt scoring from `scored_from` on: the token's log-prob, its position's top-k and asked ids.
    prompt_logprobs: list[float] = field(default_factory=list)
    prompt_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    prompt_ids_logprobs: list[list[float]] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    arrival_index: int = field(default_factory=lambda: next(_request_counter))

    # KV state (see the module docstring).
    slots: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    cached_len: int = 0
    num_computed: int = 0
    last_node: Any = None  # the cache manager's handle on the borrowed prefix
    cached_tokens: int | None = None  # prefix hit at first admission, reported to the user
    num_retractions: int = 0

    created_s: float = field(default_factory=time.perf_counter)
    admitted_s: float | None = None  # first admission: the end of its wait in the queue
    first_token_s: float | None = None
    finished_s: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.prompt_ids, array) or self.prompt_ids.typecode != "q":
            try:
                self.prompt_ids = array("q", self.prompt_ids)
            except (TypeError, OverflowError):
                raise ValueError("input_ids: token ids must be ints in [0, 2**63)") from None
        if not self.rid:
            self.rid = f"req-{self.arrival_index}"
        if not self.group:
            self.group = self.rid
        if self.params.max_new_tokens is None:
            raise ValueError("max_new_tokens must be resolved for the prompt before a Request is made")
        self._text = OutputText(self.tokenizer, self.params, self.prompt_ids, self.eos_token_ids)
        self._new_token_ids: list[int] = []
        self._reported_finish = False

    # --- tokens -----------------------------------------------------------------
    @property
    def fill_ids(self) -> array:
        return self.prompt_ids + self.output_ids

    def fill_slice(self, start: int, end: int) -> array:
        """fill_ids[start:end] without building fill_ids (the per-step path); positions past
        fill_ids are the draft's."""
        if end > self.fill_len:
            return self.fill_slice(start, self.fill_len) + array("q", self.draft_ids[: end - self.fill_len])
        num_prompt = len(self.prompt_ids)
        if end <= num_prompt:
            return self.prompt_ids[start:end]
        if start >= num_prompt:
            return self.output_ids[start - num_prompt : end - num_prompt]
        return self.prompt_ids[start:] + self.output_ids[: end - num_prompt]

    @property
    def fill_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_pending(self) -> int:
        """Tokens whose KV must be computed before the next token can be sampled."""
        return self.fill_len - self.num_computed

    @property
    def private_slots(self) -> int:
        return self.slots.numel() - self.cached_len

    @property
    def remaining_new_tokens(self) -> int:
        return max(self.params.token_limit - len(self.output_ids), 0)

    def max_prefix_match(self) -> int:
        """How much of fill_ids may come from the cache.

        At least one token is always recomputed, since the next token needs
        the last token's logits; and a prompt being scored must recompute from
        the position whose logits score its first scored token.
        """
        limit = self.fill_len - 1
        if self.scored_from is not None:
            limit = min(limit, self.scored_from - 1)
        return limit

    @property
    def scored_from(self) -> int | None:
        """The first prompt token whose log-probability is computed (the entry for
        prompt[logprob_start_len] is SGLang's None pad), or None when none is."""
        if self.logprob_start_len is None or self.logprob_start_len + 1 >= len(self.prompt_ids):
            return None
        return self.logprob_start_len + 1

    def clear_prompt_logprobs(self) -> None:
        """Scoring restarts at or before its first scored token (on admission or readmission)."""
        self.prompt_logprobs.clear()
        self.prompt_top_logprobs.clear()
        self.prompt_ids_logprobs.clear()

    # --- output -----------------------------------------------------------------
    def append_token(
        self, token_id: int, logprob: float, top_logprobs: list[tuple[int, float]] | None = None,
        ids_logprobs: list[float] | None = None,
    ) -> None:
        """Add a sampled token; sets `finish_reason` when it ends the request."""
        self.output_ids.append(token_id)
        self._new_token_ids.append(token_id)
        if self.params.return_logprob:
            self.output_logprobs.append(logprob)
        if self.params.top_logprobs_num:
            self.output_top_logprobs.append(top_logprobs or [])
        if self.params.token_ids_logprob is not None:
            self.output_ids_logprobs.append(ids_logprobs or [])
        if self.first_token_s is None:
            self.first_token_s = time.perf_counter()
        if self.grammar is not None and not self.grammar.accept(token_id):  # the mask let it through
            raise RuntimeError(f"{self.rid}: token {token_id} is outside its grammar, which allowed it")
        reason = self._text.append(token_id, len(self.output_ids))
        if reason is not None:
            self.finish(reason)

    def finish(self, reason: FinishReason) -> None:
        """End the request (the scheduler takes it out of its queues)."""
        self.finish_reason = reason
        self.finished_s = time.perf_counter()
        if self.first_token_s is None:
            self.first_token_s = self.finished_s

    def take_output(self) -> RequestOutput | None:
        """What the caller has not seen yet: new text and token ids, and the result once finished."""
        new_ids, self._new_token_ids = self._new_token_ids, []
        if self.finish_reason is not None:
            if self._reported_finish:
                return None
            self._reported_finish = True
            delta = self._text.take_delta(final=True)
            return RequestOutput(self.rid, delta, new_ids, True, self.result())
        delta = self._text.take_delta()
        if not delta and not new_ids:
            return None
        return RequestOutput(self.rid, delta, new_ids, False)

    def result(self) -> dict[str, Any]:
        """The `generate` result of a finished request: text, output_ids, meta_info."""
        assert self.finish_reason is not None and self.finished_s is not None, f"{self.rid} has not finished"
        meta: dict[str, Any] = {
            "id": self.rid,
            "prompt_tokens": len(self.prompt_ids),
            "cached_tokens": self.cached_tokens or 0,
            "completion_tokens": len(self.output_ids),
            "finish_reason": self.finish_reason.to_dict(),
            "ttft": (self.first_token_s or self.finished_s) - self.created_s,
            "e2e_latency": self.finished_s - self.created_s,
            "queue_time": (self.admitted_s or self.finished_s) - self.created_s,
        }
        if self.params.return_logprob:
            self._logprob_meta(meta)
        return {"text": self._text.final_text(), "output_ids": list(self.output_ids), "meta_info": meta}

    def _logprob_meta(self, meta: dict[str, Any]) -> None:
        """SGLang's log-prob lists (`radixrt.engine.logprobs` has the shapes)."""
        params = self.params
        decode = lp.token_text_decoder(self.tokenizer, params.return_text_in_logprobs)
        start = len(self.prompt_ids) if self.logprob_start_len is None else self.logprob_start_len
        prompt = self.prompt_ids[start:].tolist()
        pad = [None] if prompt else []
        outputs = self.output_ids.tolist()
        meta["input_token_logprobs"] = lp.entries([*pad, *self.prompt_logprobs], prompt, decode)
        meta["output_token_logprobs"] = lp.entries(self.output_logprobs, outputs, decode)
        if params.top_logprobs_num:
            meta["input_top_logprobs"] = [*pad, *(lp.top_entries(t, decode) for t in self.prompt_top_logprobs)]
            meta["output_top_logprobs"] = [lp.top_entries(t, decode) for t in self.output_top_logprobs]
        if params.token_ids_logprob is not None:
            ids = params.token_ids_logprob
            meta["input_token_ids_logprobs"] = [*pad, *(lp.entries(v, ids, decode) for v in self.prompt_ids_logprobs)]
            meta["output_token_ids_logprobs"] = [lp.entries(v, ids, decode) for v in self.output_ids_logprobs]
