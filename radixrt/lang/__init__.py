"""The program-style frontend: `@function` programs over a state `s`.

    @radixrt.function
    def answer(s, question):
        s += radixrt.user(question)
        s += radixrt.assistant(radixrt.gen("answer", max_tokens=64))

docs/frontend.md has the whole API and the design choices.
"""

from __future__ import annotations

from radixrt.lang.executor import ProgramError
from radixrt.lang.ir import assistant, gen, select, system, user
from radixrt.lang.program import Program, function, set_default_runtime
from radixrt.lang.state import ProgramState

__all__ = [
    "Program",
    "ProgramError",
    "ProgramState",
    "assistant",
    "function",
    "gen",
    "select",
    "set_default_runtime",
    "system",
    "user",
]
