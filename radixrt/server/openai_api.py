"""OpenAI request bodies to `Runtime.generate` arguments, and `generate` results back to OpenAI shapes.

Pure functions over plain data: the routes in `app.py` call them and do the
I/O. Usage always carries `prompt_tokens_details.cached_tokens` (0 when
nothing was cached), so "nothing cached" and "not reported" differ.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, NamedTuple, Sequence

from radixrt.engine.logprobs import logprob_values, top_pairs
from radixrt.server import constraints, openai_fields, tool_parsers, tools
from radixrt.server.protocol import ChatCompletionRequest, CompletionRequest, _SamplingFields


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def sampling_params(body: _SamplingFields, max_tokens: int | None, top_logprobs: int, logprobs: bool) -> dict[str, Any]:
    """`SamplingParams` fields for a chat or completion body (SamplingParams validates them again).

    Without `max_tokens` a request may generate what the context and the KV pool leave. The
    output constraint (response_format, regex, json_schema or ebnf) becomes its SamplingParams field.
    """
    params: dict[str, Any] = {
        "max_new_tokens": max_tokens,
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "top_p": 1.0 if body.top_p is None else body.top_p,
        "top_k": body.top_k,
        "min_p": body.min_p,
        "frequency_penalty": body.frequency_penalty,
        "presence_penalty": body.presence_penalty,
        "repetition_penalty": body.repetition_penalty,
        "seed": body.seed,
        "stop": body.stop,
        "stop_token_ids": body.stop_token_ids,
        "ignore_eos": body.ignore_eos,
        "skip_special_tokens": body.skip_special_tokens,
        "n": body.n,
        "return_logprob": logprobs,
        "top_logprobs_num": top_logprobs,
    }
    if body.logit_bias:
        params["logit_bias"] = {int(token): bias for token, bias in body.logit_bias.items()}
    constraint = body_constraint(body)
    if constraint is not None:
        if max_tokens == 0:
            raise ValueError(f"max_tokens must be >= 1 with {constraint.source}, which constrains generated tokens; "
                             "got 0")
        params[constraint.field] = constraint.text
    return params


def body_constraint(body: _SamplingFields) -> constraints.Constraint | None:
    """The body's output constraint; ValueError naming the field for a bad or a second one."""
    constraints.refuse_foreign_fields(body.model_extra or {})
    extras = {"regex": body.regex, "json_schema": body.json_schema, "ebnf": body.ebnf}
    return constraints.body_constraint(body.response_format, extras)


def chat_sampling_params(body: ChatCompletionRequest) -> dict[str, Any]:
    openai_fields.check_extra_fields(body.model_extra or {}, openai_fields.NO_OPS_CHAT, "/v1/chat/completions")
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    top = (body.top_logprobs or 0) if body.logprobs else 0
    return sampling_params(body, max_tokens, top, body.logprobs)


def completion_sampling_params(body: CompletionRequest) -> dict[str, Any]:
    openai_fields.check_extra_fields(body.model_extra or {}, openai_fields.NO_OPS_COMPLETION, "/v1/completions")
    if body.best_of is not None and body.best_of != body.n:
        raise ValueError(f"best_of must equal n ({body.n}) when given: radixrt returns every sample, got {body.best_of}")
    wants_logprobs = body.logprobs is not None
    return sampling_params(body, body.max_tokens, body.logprobs or 0, wants_logprobs)


class ToolPlan(NamedTuple):
    """A chat request's tools as the route runs them."""

    functions: list[tools.Function]
    choice: tools.ToolChoice
    parallel: bool

    @property
    def constrained(self) -> bool:
        return self.choice.mode in ("required", "named")


def tool_plan(body: ChatCompletionRequest) -> ToolPlan | None:
    """The tools the template renders and the reply is read for; None when there are none or
    `tool_choice` is "none" (the tools are then not rendered: the model answers in prose, as asked).
    ValueError naming tools[i]... or tool_choice."""
    functions = tools.parse_functions(body.tools) if body.tools is not None else None
    choice = tools.parse_tool_choice(body.tool_choice, functions)
    if choice.mode == "none" or not functions:
        return None
    return ToolPlan(functions, choice, body.parallel_tool_calls is not False)


def constrain_to_calls(plan: ToolPlan, syntax: str, params: dict[str, Any],
                       constraint: constraints.Constraint | None) -> constraints.Constraint:
    """Constrain `params` to a call of the offered functions (required, named) in `syntax`."""
    if constraint is not None:
        raise ValueError(f"tool_choice: {plan.choice.mode} constrains the reply to a tool call, which "
                         f"{constraint.source} would constrain too; send one of them")
    if params.get("max_new_tokens") == 0:
        raise ValueError(f"max_tokens must be >= 1 with tool_choice {plan.choice.mode}; got 0")
    grammar = tools.call_grammar(syntax, plan.functions, plan.choice, plan.parallel)
    params["ebnf"] = grammar
    return constraints.Constraint("ebnf", grammar, "tools")


def logprob_value(entry: Any) -> float | None:
    """A log-prob entry of meta_info: a float (or None), or SGLang's [logprob, token_id, text] triple."""
    if isinstance(entry, (list, tuple)):
        return None if entry[0] is None else float(entry[0])
    return None if entry is None else float(entry)


def top_entries(top: Any) -> list[tuple[int, float]]:
    """A top-k list of meta_info: (token_id, logprob) pairs, or SGLang's [logprob, token_id, text] triples."""
    pairs = []
    for item in top or []:
        if len(item) == 3:
            pairs.append((int(item[1]), float(item[0])))
        else:
            pairs.append((int(item[0]), float(item[1])))
    return pairs


def finish_reason(result: dict[str, Any]) -> str:
    return str(result["meta_info"]["finish_reason"]["type"])


def usage(results: Sequence[dict[str, Any]], samples_per_prompt: int) -> dict[str, Any]:
    """Usage of one call: each prompt counts once (its n samples share it), completions add up.

    `cached_tokens` of a prompt is its least cached sample: the others hit
    the prompt that sample computed.
    """
    prompt_tokens = cached_tokens = 0
    for start in range(0, len(results), samples_per_prompt):
        samples = [r["meta_info"] for r in results[start : start + samples_per_prompt]]
        prompt_tokens += samples[0]["prompt_tokens"]
        cached_tokens += min(m["cached_tokens"] for m in samples)
    completion_tokens = sum(r["meta_info"]["completion_tokens"] for r in results)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def chat_logprobs(result: dict[str, Any], tokenizer: Any) -> dict[str, Any] | None:
    meta = result["meta_info"]
    if "output_token_logprobs" not in meta:
        return None
    values = logprob_values(meta["output_token_logprobs"])
    tops = meta.get("output_top_logprobs") or [[] for _ in values]
    content = []
    for token_id, logprob, top in zip(result["output_ids"], values, tops):
        content.append(
            {
                **_token_entry(tokenizer, token_id, logprob),
                "top_logprobs": [_token_entry(tokenizer, t, lp) for t, lp in top_pairs(top)],
            }
        )
    return {"content": content}


def _token_entry(tokenizer: Any, token_id: int, logprob: float | None) -> dict[str, Any]:
    text = tokenizer.decode([token_id])
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def completion_logprobs(result: dict[str, Any], tokenizer: Any) -> dict[str, Any] | None:
    meta = result["meta_info"]
    if "output_token_logprobs" not in meta:
        return None
    tokens = [tokenizer.decode([t]) for t in result["output_ids"]]
    offsets, position = [], 0
    for token in tokens:
        offsets.append(position)
        position += len(token)
    tops = meta.get("output_top_logprobs") or [[] for _ in tokens]
    return {
        "tokens": tokens,
        "token_logprobs": logprob_values(meta["output_token_logprobs"]),
        "top_logprobs": [{tokenizer.decode([t]): lp for t, lp in top_pairs(top)} for top in tops],
        "text_offset": offsets,
    }


def echo_logprobs(
    result: dict[str, Any], prompt_ids: Sequence[int], tokenizer: Any, generated: dict[str, Any]
) -> dict[str, Any]:
    """`completion_logprobs` with the prompt's tokens in front (`echo`): the first prompt token's
    log-prob and alternatives are null (nothing precedes it), as OpenAI and vLLM send them."""
    meta = result["meta_info"]
    values = [logprob_value(e) for e in meta.get("input_token_logprobs", [])]
    tops: list[Any] = list(meta.get("input_top_logprobs") or [])
    if len(values) == len(prompt_ids) - 1:  # floats from position 1 on; SGLang's triples pad position 0
        values.insert(0, None)
        tops.insert(0, None)
    if len(values) != len(prompt_ids):
        raise RuntimeError(f"{meta['id']}: {len(values)} prompt log-probs for {len(prompt_ids)} prompt tokens")
    tokens = [tokenizer.decode([t]) for t in prompt_ids]
    offsets, position = [], 0
    for token in tokens:
        offsets.append(position)
        position += len(token)
    top_dicts: list[Any] = [
        None if i == 0 else {tokenizer.decode([t]): lp for t, lp in top_entries(tops[i] if i < len(tops) else None)}
        for i in range(len(prompt_ids))
    ]
    return {
        "tokens": tokens + generated["tokens"],
        "token_logprobs": values + [logprob_value(v) for v in generated["token_logprobs"]],
        "top_logprobs": top_dicts + generated["top_logprobs"],
        "text_offset": offsets + [position + offset for offset in generated["text_offset"]],
    }


def chat_message(r: dict[str, Any], plan: ToolPlan | None, syntax: str | None) -> tuple[dict[str, Any], str]:
    """The assistant message of one result, its tool calls parsed out when tools are in play; and
    its finish_reason ("tool_calls" when it called a tool and stopped on its own)."""
    reason = finish_reason(r)
    if plan is None or syntax is None:
        return {"role": "assistant", "content": r["text"]}, reason
    content, calls = tool_parsers.parse_calls(syntax, r["text"])
    if not plan.parallel:
        calls = calls[:1]
    if not calls:
        return {"role": "assistant", "content": r["text"]}, reason
    message = {"role": "assistant", "content": content, "tool_calls": tool_parsers.message_tool_calls(calls)}
    return message, "tool_calls" if reason == "stop" else reason


def chat_response(
    body: ChatCompletionRequest, results: Sequence[dict[str, Any]], model: str, tokenizer: Any,
    plan: ToolPlan | None = None, syntax: str | None = None,
) -> dict[str, Any]:
    choices = []
    for i, r in enumerate(results):
        message, reason = chat_message(r, plan, syntax)
        choices.append({"index": i, "message": message, "logprobs": chat_logprobs(r, tokenizer),
                        "finish_reason": reason})
    return {
        "id": new_id("chatcmpl"),
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage(results, body.n),
    }


def completion_response(
    body: CompletionRequest,
    results: Sequence[dict[str, Any]],
    model: str,
    tokenizer: Any,
    prompt_texts: Sequence[str] | None,
    prompt_ids: Sequence[Sequence[int]] | None = None,
) -> dict[str, Any]:
    """`prompt_texts`: with `echo`, each prompt's text; `prompt_ids`: with echo and logprobs, its tokens."""
    choices = []
    for i, r in enumerate(results):
        text = r["text"]
        if body.echo and prompt_texts is not None:
            text = prompt_texts[i // body.n] + text
        logprobs = completion_logprobs(r, tokenizer)
        if body.echo and logprobs is not None and prompt_ids is not None:
            logprobs = echo_logprobs(r, prompt_ids[i // body.n], tokenizer, logprobs)
        choices.append({"index": i, "text": text, "logprobs": logprobs, "finish_reason": finish_reason(r)})
    return {
        "id": new_id("cmpl"),
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage(results, body.n),
    }


class ChunkWriter:
    """The `data:` events of one OpenAI stream: role first, then deltas, a finish, usage, [DONE]."""

    def __init__(self, kind: str, model: str, include_usage: bool):
        self.kind = kind  # "chat" or "completion"
        self.id = new_id("chatcmpl" if kind == "chat" else "cmpl")
        self.created = int(time.time())
        self.model = model
        self.include_usage = include_usage

    def _event(self, choices: list[dict[str, Any]], usage_value: Any = None) -> dict[str, Any]:
        event: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion.chunk" if self.kind == "chat" else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if self.include_usage:
            event["usage"] = usage_value
        return event

    def role(self, index: int) -> dict[str, Any]:
        return self._event([{"index": index, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}])

    def tool_call_delta(self, index: int, call: dict[str, Any]) -> dict[str, Any]:
        """One `delta.tool_calls` entry (tool_parsers.StreamedCalls makes them), in a chunk of its own."""
        return self._event([{"index": index, "delta": {"tool_calls": [call]}, "finish_reason": None}])

    def delta(self, index: int, text: str, finish: str | None = None,
              logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        """A text delta; `logprobs` (chat_logprobs' or completion_logprobs' shape) where given."""
        if self.kind == "chat":
            choice: dict[str, Any] = {"index": index, "delta": {"content": text} if text else {}}
            if logprobs is not None:
                choice["logprobs"] = logprobs
        else:
            choice = {"index": index, "text": text, "logprobs": logprobs}
        choice["finish_reason"] = finish
        return self._event([choice])

    def usage(self, usage_value: dict[str, Any]) -> dict[str, Any]:
        return self._event([], usage_value)
