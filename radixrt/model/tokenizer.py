"""The model's tokenizer, run through the `tokenizers` library without importing transformers.

Importing transformers and building its tokenizer takes seconds on the
project's 2-core machine (docs/model.md, "Start records"). A transformers fast tokenizer is a
`tokenizers.Tokenizer` (Rust) with a thin layer of Python around it, and the
paths radixrt uses reduce to that layer's state:

    encode(text)            backend encode, no truncation or padding, special tokens in the text matched
    decode(ids)             backend decode (transformers' space clean-up is off for the tokenizers recorded)
    apply_chat_template     the template rendered by transformers' own renderer, with the named special
                            tokens as variables (transformers is imported on the first chat, not at start)

`TokenizerRecord.of` takes that state from a loaded transformers tokenizer
(its backend as transformers left it, the chat template, the special
tokens) and refuses tokenizers whose class changes any of these paths;
`gguf_tokenizer.tokenizer_record` builds the same state from a GGUF file's
metadata without transformers; `Tokenizer` runs a record. Any other attribute (`tokenizer.vocab`,
`tokenizer(...)`, `save_pretrained`, ...) is the transformers tokenizer's,
built on first use, so `Runtime.tokenizer` answers everything a transformers
tokenizer does.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

# The transformers tokenizer methods whose behaviour a record reproduces: a subclass overriding one is not recorded.
_REPRODUCED_METHODS = ("encode", "_encode_plus", "decode", "_decode", "apply_chat_template", "get_chat_template")
_SPECIAL_ID_NAMES = ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")


@dataclass(frozen=True)
class TokenizerRecord:
    """What a transformers fast tokenizer's encode, decode and chat template depend on, as plain data."""

    backend_json: str  # the `tokenizers.Tokenizer` as transformers configured it
    chat_template: str | None
    special_tokens_map: dict[str, str]  # bos_token, eos_token, ...: the chat template's variables
    special_ids: dict[str, int | None]  # bos_token_id, eos_token_id, pad_token_id, unk_token_id
    all_special_ids: list[int] = field(default_factory=list)

    @classmethod
    def of(cls, tokenizer: Any) -> TokenizerRecord | None:
        """The record of a loaded transformers tokenizer, or None where `Tokenizer` would differ from it.

        Recorded: `TokenizersBackend` (transformers 5's fast tokenizer) and
        subclasses that keep its encode, decode and chat-template methods, with
        one chat template (or none), special tokens matched in the text, and
        no space clean-up on decode.
        """
        from transformers.tokenization_utils_tokenizers import TokenizersBackend

        own_class = type(tokenizer)
        if not isinstance(tokenizer, TokenizersBackend) or any(
            getattr(own_class, name) is not getattr(TokenizersBackend, name) for name in _REPRODUCED_METHODS
        ):
            return None
        template = tokenizer.chat_template
        if not (template is None or isinstance(template, str)) or tokenizer.split_special_tokens:
            return None
        if tokenizer.clean_up_tokenization_spaces and (
            type(tokenizer.backend_tokenizer.model).__name__ != "BPE"
            or tokenizer.clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output
        ):
            return None
        return cls(
            backend_json=tokenizer.backend_tokenizer.to_str(),
            chat_template=template,
            special_tokens_map=dict(tokenizer.special_tokens_map),
            special_ids={name: getattr(tokenizer, name) for name in _SPECIAL_ID_NAMES},
            all_special_ids=list(tokenizer.all_special_ids),
        )

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TokenizerRecord:
        return cls(**data)


class Tokenizer:
    """A transformers fast tokenizer's encode, decode and chat template, from a `TokenizerRecord`.

    Safe from several threads at once (the Rust tokenizer is; the
    transformers tokenizer is built once, under a lock). `transformers_tokenizer`
    builds the full transformers tokenizer with `load_transformers` on first
    use; every attribute this class lacks is read from it.
    """

    def __init__(self, record: TokenizerRecord, load_transformers: Callable[[], Any]):
        from tokenizers import Tokenizer as RustTokenizer

        self.record = record
        self.backend_tokenizer = RustTokenizer.from_str(record.backend_json)
        # What transformers sets on every encode call without truncation, padding or split special tokens.
        self.backend_tokenizer.no_truncation()
        self.backend_tokenizer.no_padding()
        self.backend_tokenizer.encode_special_tokens = False
        self.chat_template = record.chat_template
        self.bos_token_id = record.special_ids["bos_token_id"]
        self.eos_token_id = record.special_ids["eos_token_id"]
        self.pad_token_id = record.special_ids["pad_token_id"]
        self.unk_token_id = record.special_ids["unk_token_id"]
        self.special_tokens_map = dict(record.special_tokens_map)
        self.all_special_ids = list(record.all_special_ids)
        for name, token in record.special_tokens_map.items():
            setattr(self, name, token)
        self._load_transformers = load_transformers
        self._transformers: Any = None
        self._lock = threading.Lock()

    @property
    def transformers_tokenizer(self) -> Any:
        """The transformers tokenizer these files make (built on first use: it imports transformers)."""
        with self._lock:
            if self._transformers is None:
                self._transformers = self._load_transformers()
            return self._transformers

    def encode(self, text: Any, add_special_tokens: bool = True, **kwargs: Any) -> Any:
        """Token ids (a list) of one string, as transformers' `encode`; other inputs and options
        (pairs, truncation, tensors, ...) go to transformers and return what it returns."""
        if kwargs or not isinstance(text, str):
            return self.transformers_tokenizer.encode(text, add_special_tokens=add_special_tokens, **kwargs)
        return self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(
        self, token_ids: Any, skip_special_tokens: bool = False, clean_up_tokenization_spaces: bool | None = None,
        **kwargs: Any,
    ) -> str | list[str]:
        """Text of token ids (or a list of texts for a list of id lists), as transformers' `decode`."""
        if kwargs or clean_up_tokenization_spaces:
            return self.transformers_tokenizer.decode(
                token_ids, skip_special_tokens=skip_special_tokens,
                clean_up_tokenization_spaces=clean_up_tokenization_spaces, **kwargs,
            )  # fmt: skip
        ids = token_ids.tolist() if hasattr(token_ids, "tolist") else token_ids
        if isinstance(ids, int):
            ids = [ids]
        if ids and isinstance(ids[0], (list, tuple)):
            return [self.backend_tokenizer.decode(list(row), skip_special_tokens=skip_special_tokens) for row in ids]
        return self.backend_tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, conversation: Sequence[dict[str, Any]], tokenize: bool = True, add_generation_prompt: bool = False,
        tools: list[dict[str, Any]] | None = None, **kwargs: Any,
    ) -> Any:
        """One conversation's text (`tokenize=False`) rendered with the model's chat template.

        Rendering is transformers' own function, so templates see exactly what
        they see there (and run in its sandbox), tools (JSON Schema dicts) included. Token ids,
        batches, documents and other options go to the transformers tokenizer.
        """
        is_one_conversation = bool(conversation) and all(isinstance(m, dict) for m in conversation)
        plain_tools = tools is None or all(isinstance(tool, dict) for tool in tools)
        if tokenize or kwargs or self.chat_template is None or not is_one_conversation or not plain_tools:
            if tools is not None:
                kwargs["tools"] = tools
            return self.transformers_tokenizer.apply_chat_template(
                conversation, tokenize=tokenize, add_generation_prompt=add_generation_prompt, **kwargs
            )
        from transformers.utils.chat_template_utils import render_jinja_template

        render: Any = render_jinja_template  # annotated as returning str; it returns (texts, generation spans)
        messages = [{key: value for key, value in m.items() if value is not None} for m in conversation]
        rendered, _ = render(
            conversations=[messages], tools=tools, documents=None, chat_template=self.chat_template,
            add_generation_prompt=add_generation_prompt, **self.special_tokens_map,
        )  # fmt: skip
        return rendered[0]

    def __len__(self) -> int:
        return int(self.backend_tokenizer.get_vocab_size(with_added_tokens=True))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.transformers_tokenizer(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name in ("record", "backend_tokenizer"):  # not set yet (copying, unpickling)
            raise AttributeError(name)
        return getattr(self.transformers_tokenizer, name)
