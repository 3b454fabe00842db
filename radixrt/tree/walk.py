"""Following a packed query down the tree, read-only.

`walk` changes nothing: the tree first checks the rest of the input, then
refreshes access times and makes the one split a match may need. That order
is why a bad call leaves the tree exactly as it was.
"""

from __future__ import annotations

from radixrt.tree.keys import Packed, common_prefix_pages
from radixrt.tree.node import TreeNode

WalkResult = tuple[list[TreeNode], int, tuple[TreeNode, int] | None]
"""(nodes whose whole edge matched, matched bytes, (child, its matched bytes)
where the match ends inside that child's edge, else None)."""


def walk(root: TreeNode | None, query: Packed, page_bytes: int) -> WalkResult:
    """Follow `query` down without changing anything.

    Returns the nodes whose whole edge matched, the matched length in
    bytes, and, where the match ends inside an edge, that child and how
    many of its bytes matched (the split the caller makes once the input
    has passed every check).
    """
    path: list[TreeNode] = []
    if root is None:
        return path, 0, None
    if isinstance(query, memoryview):
        return _walk_view(root, query, page_bytes, path)
    node, offset, end = root, 0, len(query)
    append = path.append
    while offset < end:
        child = node.children.get(query[offset : offset + page_bytes])
        if child is None:
            break
        key = child.key
        if query.startswith(key, offset):  # one memcmp, no copy
            append(child)
            offset += len(key)
            node = child
            continue
        matched = common_prefix_pages(query, offset, key, page_bytes) * page_bytes
        return path, offset + matched, (child, matched)
    return path, offset, None


def _walk_view(
    root: TreeNode, query: memoryview, page_bytes: int, path: list[TreeNode]
) -> WalkResult:
    """`walk` over a byte view of a long query (slightly dearer per node;
    docs/benchmarks.md, "Radix tree internals").

    A view cannot be a dict key (arrays are unhashable) and has no
    `startswith`, so each node costs a small copy and a view slice more.
    """
    node, offset, end = root, 0, len(query)
    append = path.append
    while offset < end:
        child = node.children.get(query[offset : offset + page_bytes].tobytes())
        if child is None:
            break
        key = child.key
        stop = offset + len(key)
        if stop <= end and key.startswith(query[offset:stop]):  # one memcmp
            append(child)
            offset = stop
            node = child
            continue
        matched = common_prefix_pages(query, offset, key, page_bytes) * page_bytes
        return path, offset + matched, (child, matched)
    return path, offset, None
