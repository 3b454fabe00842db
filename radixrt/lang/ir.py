"""What a program appends to its state: text, `gen`, `select` and chat-role blocks.

The constructors validate their arguments when the program builds them, so
a bad name or sampling value raises in the program's own line, before
anything reaches the runtime (and, in a fork branch, before the operation is
queued on the branch's worker thread).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Mapping, Sequence, Union

from radixrt.sampling import SamplingParams

# What gen(dtype=...) constrains the text to (SGLang's frontend turns dtype into a regex the same
# way, with its own patterns). The text stays the variable's value, as in SGLang: int() and
# float() read what the int and float patterns match, bool is True or False by name, str is a
# double-quoted string with backslash escapes. An int cut short by max_tokens is still an int.
DTYPE_REGEX: dict[str, str] = {
    "int": r"[-+]?[0-9]+",
    "float": r"[-+]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][-+]?[0-9]+)?",
    "bool": r"(True|False)",
    "str": r'"([^"\\]|\\.)*"',  # a double-quoted string; a backslash escapes the next character
}
_DTYPE_NAMES = {int: "int", float: "float", bool: "bool", str: "str"}


@dataclass(frozen=True)
class Gen:
    """Generate text into variable `name` with `params`."""

    name: str
    params: SamplingParams


@dataclass(frozen=True)
class Select:
    """Append the choice the model finds most likely; store it in variable `name`."""

    name: str
    choices: tuple[str, ...]


ContentItem = Union[str, Gen, Select]


@dataclass(frozen=True)
class RoleBlock:
    """One chat message: the role's opening, the content items, the role's closing."""

    role: str
    content: tuple[ContentItem, ...]


Expr = Union[str, Gen, Select, RoleBlock]


def _check_name(what: str, name: Any) -> str:
    if not isinstance(name, str):
        raise TypeError(f"{what}: the variable name must be a string, got {type(name).__name__} {name!r}")
    if not name:
        raise ValueError(f"{what}: the variable name must be a non-empty string")
    return name


def gen(
    name: str,
    max_tokens: int | None = None,
    *,
    min_tokens: int | None = None,
    stop: str | Sequence[str] | None = None,
    stop_regex: str | Sequence[str] | None = None,
    stop_token_ids: Sequence[int] | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    frequency_penalty: float | None = None,
    presence_penalty: float | None = None,
    repetition_penalty: float | None = None,
    seed: int | None = None,
    ignore_eos: bool | None = None,
    return_logprob: bool | None = None,
    top_logprobs_num: int | None = None,
    return_text_in_logprobs: bool | None = None,
    regex: str | None = None,
    json_schema: str | Mapping[str, Any] | None = None,
    ebnf: str | None = None,
    dtype: type | str | None = None,
) -> Gen:
    """Generate text from the state so far and store it as `s[name]`.

    Parameters left as None take the runtime's defaults (docs/sampling.md):
    max_tokens 128, temperature 1.0. `min_tokens` is SGLang's gen name for
    `min_new_tokens`; log-probs come in SGLang's `meta_info` shapes
    (`get_meta_info(name)`). Values are checked here, so a bad one
    raises in the program's line. At most one of `regex`, `json_schema` (a
    dict or JSON text), `ebnf` and `dtype` (int, float, bool or str, or
    their names: a regex for that type, DTYPE_REGEX) constrains the text
    (docs/structured.md); a pattern or schema the grammar library rejects
    raises when the gen runs, naming the gen.
    """
    _check_name("gen", name)
    if dtype is not None:
        if regex is not None or json_schema is not None or ebnf is not None:
            other = "regex" if regex is not None else "json_schema" if json_schema is not None else "ebnf"
            raise ValueError(f"gen({name!r}): dtype and {other} both constrain the text; give one of them")
        regex = DTYPE_REGEX[_dtype_name(name, dtype)]
    if isinstance(json_schema, Mapping):  # as text in the caller's key order: properties are generated in it
        try:
            json_schema = json.dumps(json_schema)
        except (TypeError, ValueError) as error:
            raise ValueError(f"gen({name!r}): json_schema must be JSON-serialisable: {error}") from None
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 0):
        raise ValueError(f"gen({name!r}): max_tokens must be an int >= 0, got {max_tokens!r}")
    given: dict[str, Any] = {
        "max_new_tokens": max_tokens, "stop": stop, "stop_token_ids": stop_token_ids, "temperature": temperature,
        "top_p": top_p, "top_k": top_k, "min_p": min_p, "frequency_penalty": frequency_penalty,
        "presence_penalty": presence_penalty, "repetition_penalty": repetition_penalty, "seed": seed,
        "ignore_eos": ignore_eos, "return_logprob": return_logprob, "min_new_tokens": min_tokens,
        "stop_regex": stop_regex, "top_logprobs_num": top_logprobs_num, "return_text_in_logprobs": return_text_in_logprobs,
        "regex": regex, "json_schema": json_schema, "ebnf": ebnf,
    }
    try:
        params = SamplingParams(**{key: value for key, value in given.items() if value is not None})
    except ValueError as error:
        raise ValueError(f"gen({name!r}): {error}") from None
    return Gen(name, params)


def _dtype_name(name: str, dtype: Any) -> str:
    key = _DTYPE_NAMES.get(dtype) if isinstance(dtype, type) else dtype
    if not isinstance(key, str) or key not in DTYPE_REGEX:
        raise ValueError(f"gen({name!r}): dtype must be int, float, bool or str (or their names), got {dtype!r}")
    return key


def select(name: str, choices: Sequence[str]) -> Select:
    """Pick the choice with the highest mean token log-probability given the state; store it as `s[name]`."""
    _check_name("select", name)
    if isinstance(choices, str) or not isinstance(choices, (list, tuple)):
        raise TypeError(f"select({name!r}): choices must be a list of strings, got {type(choices).__name__}")
    if not choices:
        raise ValueError(f"select({name!r}): choices must not be empty")
    for index, choice in enumerate(choices):
        if not isinstance(choice, str):
            raise TypeError(
                f"select({name!r}): choice {index} must be a string, got {type(choice).__name__} {choice!r}"
            )
        if not choice:
            raise ValueError(f"select({name!r}): choice {index} is empty; an empty choice has no tokens to score")
    return Select(name, tuple(choices))


def _role(role: str, content: ContentItem | Sequence[ContentItem]) -> RoleBlock:
    items = content if isinstance(content, (list, tuple)) else (content,)
    for item in items:
        if isinstance(item, RoleBlock):
            raise TypeError(f"{role}(...): a role block cannot contain another role block ({item.role})")
        if not isinstance(item, (str, Gen, Select)):
            raise TypeError(
                f"{role}(...): content must be a string, gen(...), select(...) or a list of them, "
                f"got {type(item).__name__}"
            )
    return RoleBlock(role, tuple(items))


def system(content: ContentItem | Sequence[ContentItem]) -> RoleBlock:
    """A system message, rendered with the model's chat template."""
    return _role("system", content)


def user(content: ContentItem | Sequence[ContentItem]) -> RoleBlock:
    """A user message, rendered with the model's chat template."""
    return _role("user", content)


def assistant(content: ContentItem | Sequence[ContentItem]) -> RoleBlock:
    """An assistant message; `assistant(gen("x"))` opens the turn, generates, and closes it."""
    return _role("assistant", content)


def check_expr(expr: Any) -> Expr:
    """What `s += expr` accepts; raise TypeError naming anything else."""
    if not isinstance(expr, (str, Gen, Select, RoleBlock)):
        raise TypeError(
            "a program state accepts a string, gen(...), select(...), system/user/assistant(...); "
            f"got {type(expr).__name__}"
        )
    return expr
