"""Role blocks rendered with the model's own chat template, one message at a time.

A program appends messages one by one, so each block must be exactly what
the template adds for that message: then the concatenation of the blocks is
the template's rendering of the whole conversation, and the token ids the
model saw for the earlier turns stay a prefix of the next prompt (cache hits
from turn to turn). The block for message k is

    render(messages[:k+1])[len(render(messages[:k])):]

which requires the template to be prefix-stable (rendering a conversation
never changes how its earlier messages were rendered); that is checked.

A message whose content is generated (`assistant(gen("x"))`) is not known
when its block opens. Its opening and closing come from rendering the
message with a placeholder content and splitting at the placeholder; the
generated text is put between them verbatim. (SGLang's frontend splits a
role into a prefix and a suffix the same way, from its own template table.)
"""

from __future__ import annotations

from typing import Any

_PLACEHOLDER = "RADIXRT_MESSAGE_CONTENT_PLACEHOLDER"


class ChatTemplate:
    """Renders role blocks with `tokenizer.apply_chat_template`."""

    def __init__(self, tokenizer: Any):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                "system/user/assistant need the model's chat template, and this tokenizer has none; "
                "append plain text instead"
            )
        self._tokenizer = tokenizer

    def render(self, messages: list[dict[str, str]]) -> str:
        if not messages:  # templates refuse an empty conversation; it renders as nothing
            return ""
        return self._tokenizer.apply_chat_template(messages, tokenize=False)

    def block(self, messages: list[dict[str, str]], role: str, content: str) -> str:
        """The text the template adds after `messages` for one more message."""
        before = self.render(messages)
        after = self.render(messages + [{"role": role, "content": content}])
        if not after.startswith(before):
            raise ValueError(
                "the chat template is not prefix-stable: adding a message changed how earlier messages "
                "render, so a program cannot append messages one at a time"
            )
        return after[len(before):]

    def opening_and_closing(self, messages: list[dict[str, str]], role: str) -> tuple[str, str]:
        """The text before and after a message's content, for content generated in place."""
        parts = self.block(messages, role, _PLACEHOLDER).split(_PLACEHOLDER)
        if len(parts) != 2:
            raise ValueError(f"the chat template does not insert a {role} message's content verbatim exactly once")
        return parts[0], parts[1]
