"""Applies one expression (text, gen, select, role block) to a program context.

gen streams from the runtime, so a reader of `text_iter` sees the text as it
is produced. Which token ids a gen leaves in the context (see context.py for
why ids are kept at all):

    finished on a stop token (EOS or stop_token_ids)   its output ids without the stop token,
                                                        which the text does not contain either
    finished on max_tokens                              all its output ids
    finished on a stop string                           none: its text is cut inside the output,
                                                        so the text is tokenized with the next
                                                        piece instead (the cache still hits up to
                                                        where the two tokenizations part)

select scores every choice in one batch of prompt-only requests that share
the state's ids as their prefix, and picks the highest mean token
log-probability (SGLang's default, "token_length_normalized"): with a plain
sum, longer choices lose only for being longer. Ties go to the earlier choice.
"""

from __future__ import annotations

from typing import Any

from radixrt.engine.logprobs import logprob_values
from radixrt.lang.chat import ChatTemplate
from radixrt.lang.context import ProgramContext
from radixrt.lang.ir import Expr, Gen, RoleBlock, Select


def apply(ctx: ProgramContext, expr: Expr) -> None:
    if isinstance(expr, str):
        ctx.append_text(expr)
    elif isinstance(expr, Gen):
        _gen(ctx, expr)
    elif isinstance(expr, Select):
        _select(ctx, expr)
    else:
        assert isinstance(expr, RoleBlock), f"unchecked expression {expr!r}"
        _role(ctx, expr)


def cache_prefix(ctx: ProgramContext) -> None:
    """Compute the context's prompt once (no output) so that every fork branch finds it in the tree.

    Without it the branches' first requests race: those admitted in the same
    step as the first share its work only when the shared part is long
    enough for the scheduler's in-batch sharing, and late ones may compute
    it again. SGLang's frontend commits a prefix before forking the same way.
    With the runtime's cache disabled there is nothing to share, so only the
    text is tokenized.
    """
    prompt = ctx.prompt_ids()
    if prompt and not ctx.runtime.config.disable_radix_cache:
        ctx.runtime.generate(input_ids=prompt, sampling_params={"max_new_tokens": 0})


def _gen(ctx: ProgramContext, expr: Gen) -> None:
    prompt = ctx.prompt_ids()
    if not prompt:
        raise ValueError(f"gen({expr.name!r}) has no prompt: append some text before it")
    output_ids: list[int] = []
    meta_info: dict[str, Any] = {}
    parts: list[str] = []
    try:  # the request is validated here, before anything runs (a constraint is compiled too)
        chunks = ctx.runtime.generate(input_ids=prompt, sampling_params=expr.params, stream=True)
    except ValueError as error:
        raise ValueError(f"gen({expr.name!r}): {error}") from None
    for chunk in chunks:
        output_ids.extend(chunk["output_ids"])
        parts.append(chunk["text"])
        ctx.show(chunk["text"], expr.name)  # visible to text_iter now; the ids follow when the gen ends
        meta_info = chunk.get("meta_info", meta_info)
    text = "".join(parts)
    matched = meta_info.get("finish_reason", {}).get("matched")
    if isinstance(matched, str):  # a stop string: tokenize the cut text with what follows
        ctx.tokenize_later(text)
    else:
        ctx.append_ids(output_ids[:-1] if isinstance(matched, int) else output_ids)
    ctx.set_variable(expr.name, text, meta_info)


def _select(ctx: ProgramContext, expr: Select) -> None:
    prefix = ctx.prompt_ids()
    if not prefix:
        raise ValueError(f"select({expr.name!r}) has nothing to condition on: append some text before it")
    encode = ctx.runtime.tokenizer.encode
    choice_ids = [list(encode(choice, add_special_tokens=False)) for choice in expr.choices]
    for choice, ids in zip(expr.choices, choice_ids):
        if not ids:
            raise ValueError(f"select({expr.name!r}): choice {choice!r} tokenizes to nothing")
    # SGLang's entries cover prompt[start:], the first padded with None: start one token early.
    results = ctx.runtime.generate(
        input_ids=[prefix + ids for ids in choice_ids],
        sampling_params={"max_new_tokens": 0},
        return_logprob=True,
        logprob_start_len=len(prefix) - 1,
    )
    token_logprobs = [[float(v) for v in logprob_values(r["meta_info"]["input_token_logprobs"])[1:] if v is not None]
                      for r in results]  # fmt: skip
    for logprobs, ids in zip(token_logprobs, choice_ids):
        assert len(logprobs) == len(ids), "the runtime scored a different number of choice tokens"
    scores = [sum(logprobs) / len(logprobs) for logprobs in token_logprobs]
    best = max(range(len(scores)), key=lambda i: (scores[i], -i))
    meta_info = {
        "choices": list(expr.choices),
        "normalized_logprobs": scores,
        "token_logprobs": token_logprobs,
        "cached_tokens": [r["meta_info"]["cached_tokens"] for r in results],
    }
    ctx.show(expr.choices[best], expr.name)
    ctx.append_ids(choice_ids[best])
    ctx.set_variable(expr.name, expr.choices[best], meta_info)


def _role(ctx: ProgramContext, expr: RoleBlock) -> None:
    chat = ChatTemplate(ctx.runtime.tokenizer)
    if all(isinstance(item, str) for item in expr.content):
        content = "".join(expr.content)  # type: ignore[arg-type]
        ctx.append_text(chat.block(ctx.messages, expr.role, content))
    else:
        opening, closing = chat.opening_and_closing(ctx.messages, expr.role)
        ctx.append_text(opening)
        start = len(ctx.pieces)
        for item in expr.content:
            apply(ctx, item)
        content = ctx.text_since(start)
        ctx.append_text(closing)
    ctx.messages.append({"role": expr.role, "content": content})
