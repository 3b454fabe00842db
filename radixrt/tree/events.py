"""What a tree tells a mirror of itself: the sequences it inserted and the edges it evicted.

A router that sends each request to the replica holding its prefix needs to
know what every replica holds. Guessing from the requests it routed drifts as
soon as a replica evicts; so a replica's tree records every change that
alters its token set, and the router applies them, in order, to a mirror
(`RadixTree.apply_events`). Splits are not events: they do not change which
tokens are cached.

Tokens travel packed (native uint64 bytes, as the tree stores them): an
event costs 8 bytes a token to send, and nothing to re-pack.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class CacheEvent:
    """One change of a tree's token set.

    "insert": the whole-page sequence `tokens` is now cached (some of it may
    have been already). "evict": the tokens of `tokens` past the first
    `keep` are no longer cached (`tokens` runs from the root to the end of
    the evicted edge, whose first token is at `keep`).
    """

    kind: Literal["insert", "evict"]
    namespace: Hashable
    tokens: bytes
    keep: int = 0
