"""The order in which waiting requests are admitted: pure functions over plain data.

  lpm        longest cached prefix first (SGLang's default); falls back to
             fcfs when the queue is longer than `lpm_queue_limit`, where
             matching every waiting request each step costs more than it saves.
  dfs-weight walk the tree of waiting requests' cached prefixes depth-first,
             heaviest subtree first, so requests sharing a prefix run together.
  fcfs       arrival order.

Without a prefix cache every policy is fcfs: there is nothing to order by.
"""

from __future__ import annotations

from typing import Hashable, Sequence

from radixrt.config import SCHEDULE_POLICIES
from radixrt.engine.cache_manager import CacheManager
from radixrt.engine.request import Request


def order_waiting(policy: str, waiting: Sequence[Request], cache: CacheManager, lpm_queue_limit: int) -> list[Request]:
    """`waiting` in the order the scheduler should try to admit it."""
    if policy == "fcfs" or not cache.caches_prefixes:
        return first_come_first_served(waiting)
    if policy == "lpm":
        if len(waiting) > lpm_queue_limit:
            return first_come_first_served(waiting)
        return longest_prefix_first(waiting, [cache.match_length(r) for r in waiting])
    if policy == "dfs-weight":
        return depth_first_by_weight(waiting, [cache.prefix_path(r) for r in waiting])
    raise ValueError(f"schedule_policy must be one of {SCHEDULE_POLICIES}, got {policy!r}")


def first_come_first_served(waiting: Sequence[Request]) -> list[Request]:
    return sorted(waiting, key=lambda r: r.arrival_index)


def longest_prefix_first(waiting: Sequence[Request], match_lengths: Sequence[int]) -> list[Request]:
    """Most cached tokens first; ties in arrival order."""
    order = sorted(range(len(waiting)), key=lambda i: (-match_lengths[i], waiting[i].arrival_index))
    return [waiting[i] for i in order]


def depth_first_by_weight(waiting: Sequence[Request], paths: Sequence[tuple[Hashable, ...]]) -> list[Request]:
    """Depth-first over the cached nodes the waiting requests' prefixes end at.

    `paths[i]` lists the nodes from a root down to where request i's match
    ends. A node's weight is the number of waiting requests at or below it;
    heavier children are visited first, so a popular prefix's requests run back to back while it is still cached.
    A request with an empty path (nothing cached at all) comes last.
    """
    at_node: dict[Hashable, list[Request]] = {}
    weight: dict[Hashable, int] = {}
    children: dict[Hashable, list[Hashable]] = {}
    roots: list[Hashable] = []
    unmatched: list[Request] = []
    for i in sorted(range(len(waiting)), key=lambda i: waiting[i].arrival_index):
        path = paths[i]
        if not path:
            unmatched.append(waiting[i])
            continue
        at_node.setdefault(path[-1], []).append(waiting[i])
        for depth, node in enumerate(path):
            if node not in weight:
                weight[node] = 0
                if depth == 0:
                    roots.append(node)
                else:
                    children.setdefault(path[depth - 1], []).append(node)
            weight[node] += 1
    ordered: list[Request] = []
    stack = sorted(roots, key=lambda n: weight[n])
    while stack:
        node = stack.pop()
        ordered.extend(at_node.get(node, ()))
        stack.extend(sorted(children.get(node, ()), key=lambda n: weight[n]))
    return ordered + unmatched
