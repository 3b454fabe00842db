"""The tree as an SVG picture, in the spirit of the RadixAttention paper's figure.

Plain SVG written here: a snapshot has at most a few hundred boxes, and a
drawing library would add a dependency for what is a column layout and a
few rectangles. The tree grows left to right (depth is the column), so a
box's snippet reads on one line, and each leaf gets its own row: a parent
sits level with the middle of its children.

Colours say what eviction may do: amber is locked (a running request holds
it), blue is evictable (darker = used more recently), a dashed outline is
an edge evicted lately, grey is a fold of branches too small to draw. The
bar under each box grows with the edge's tokens (log scale).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Hashable, Sequence
from xml.sax.saxutils import escape

from radixrt.tree.snapshot import NodeView, TreeSnapshot

BOX_WIDTH = 168
BOX_HEIGHT = 40
COLUMN = 200
ROW = 50
MARGIN = 16
HEADER = 44
SNIPPET_CHARS = 22

_LOCKED = "#f59e0b"
_NAMESPACE = "#1f2937"
_FOLDED = "#e5e7eb"
_EVICTED = "#ffffff"
_OLD_BLUE = (219, 234, 254)
_NEW_BLUE = (59, 130, 246)

Decode = Callable[[Sequence[int]], str]

# Characters XML 1.0 cannot hold even escaped (control characters, lone surrogates, U+FFFE/U+FFFF):
# a token can decode to any of them.
_NOT_XML = re.compile("[^\t\n\r\u0020-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")


def _xml_text(text: str) -> str:
    """`text` escaped for XML, with characters XML cannot hold shown as \\xNN."""
    return escape(_NOT_XML.sub(lambda m: f"\\x{ord(m.group()):02x}", text))


def render_svg(snapshot: TreeSnapshot, decode: Decode, namespace_label: Callable[[Hashable], str]) -> str:
    """An SVG document of `snapshot`; `decode` turns an edge's leading tokens into text."""
    positions = _layout(snapshot.nodes)
    recency = _recency(snapshot.nodes)
    width = MARGIN * 2 + (max((x for x, _ in positions.values()), default=0) + 1) * COLUMN
    height = HEADER + MARGIN + (max((y for _, y in positions.values()), default=0) + 1) * ROW
    max_tokens = max((view.num_tokens for view in snapshot.nodes), default=1)
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="ui-monospace, monospace" font-size="11">',
        _header(snapshot),
    ]
    for view in snapshot.nodes:
        if view.parent_id is not None and view.parent_id in positions:
            parts.append(_edge(positions[view.parent_id], positions[view.node_id]))
    for view in snapshot.nodes:
        parts.append(_box(view, positions[view.node_id], recency, max_tokens, decode, namespace_label))
    parts.append("</svg>")
    return "\n".join(parts)


def _layout(nodes: list[NodeView]) -> dict[int, tuple[int, float]]:
    """(column, row) of each node: leaves take consecutive rows in drawing order.

    `nodes` lists each parent before its children (depth-first), so one
    forward pass sets columns and leaf rows, and one backward pass centres
    each parent on its children.
    """
    column: dict[int, int] = {}
    children: dict[int, list[int]] = {}
    for view in nodes:
        parent = view.parent_id
        column[view.node_id] = 0 if parent is None or parent not in column else column[parent] + 1
        if parent is not None:
            children.setdefault(parent, []).append(view.node_id)
    row: dict[int, float] = {}
    next_row = 0
    for view in nodes:
        if view.node_id not in children:
            row[view.node_id] = next_row
            next_row += 1
    for view in reversed(nodes):
        below = children.get(view.node_id)
        if below:
            row[view.node_id] = (row[below[0]] + row[below[-1]]) / 2
    return {node_id: (column[node_id], row[node_id]) for node_id in column}


def _recency(nodes: list[NodeView]) -> dict[int, float]:
    """Each live edge's rank by last use, 0 (oldest) to 1 (newest)."""
    live = sorted((v for v in nodes if v.state in ("locked", "evictable")), key=lambda v: v.last_access)
    if len(live) < 2:
        return {v.node_id: 1.0 for v in live}
    return {v.node_id: i / (len(live) - 1) for i, v in enumerate(live)}


def _header(snapshot: TreeSnapshot) -> str:
    drawn = sum(1 for v in snapshot.nodes if v.state in ("locked", "evictable"))
    text = (
        f"{snapshot.total_nodes} nodes, {snapshot.total_tokens} tokens cached "
        f"({snapshot.protected_tokens} locked); {drawn} nodes drawn"
    )
    legend = [("locked", _LOCKED), ("evictable", _rgb(_NEW_BLUE)), ("evicted lately", _EVICTED), ("folded", _FOLDED)]
    items = []
    for i, (name, colour) in enumerate(legend):
        x = MARGIN + i * 130
        dash = ' stroke-dasharray="4 3"' if name == "evicted lately" else ""
        items.append(
            f'<rect x="{x}" y="28" width="12" height="10" fill="{colour}" stroke="#6b7280"{dash}/>'
            f'<text x="{x + 16}" y="37">{name}</text>'
        )
    return f'<text x="{MARGIN}" y="18" font-size="12" font-weight="bold">{escape(text)}</text>' + "".join(items)


def _edge(parent: tuple[int, float], child: tuple[int, float]) -> str:
    x1, y1 = _corner(parent)
    x2, y2 = _corner(child)
    x1 += BOX_WIDTH
    y1 += BOX_HEIGHT / 2
    y2 += BOX_HEIGHT / 2
    middle = (x1 + x2) / 2
    return (
        f'<path d="M{x1:.0f},{y1:.0f} C{middle:.0f},{y1:.0f} {middle:.0f},{y2:.0f} {x2:.0f},{y2:.0f}" '
        'fill="none" stroke="#9ca3af"/>'
    )


def _box(
    view: NodeView,
    position: tuple[int, float],
    recency: dict[int, float],
    max_tokens: int,
    decode: Decode,
    namespace_label: Callable[[Hashable], str],
) -> str:
    x, y = _corner(position)
    fill, text_colour, dash = _style(view, recency)
    title, snippet, counts = _texts(view, decode, namespace_label)
    bar = BOX_WIDTH * math.log1p(view.num_tokens) / math.log1p(max(max_tokens, 1)) if view.num_tokens else 0
    return (
        f'<g class="node {view.state}" data-node-id="{view.node_id}" data-tokens="{view.num_tokens}">'
        f"<title>{_xml_text(title)}</title>"
        f'<rect x="{x:.0f}" y="{y:.0f}" width="{BOX_WIDTH}" height="{BOX_HEIGHT}" rx="5" fill="{fill}" '
        f'stroke="#6b7280"{dash}/>'
        f'<text x="{x + 6:.0f}" y="{y + 15:.0f}" fill="{text_colour}">{_xml_text(snippet)}</text>'
        f'<text x="{x + 6:.0f}" y="{y + 30:.0f}" fill="{text_colour}" font-size="10">{_xml_text(counts)}</text>'
        f'<rect x="{x:.0f}" y="{y + BOX_HEIGHT - 3:.0f}" width="{bar:.0f}" height="3" fill="#374151"/>'
        "</g>"
    )


def _style(view: NodeView, recency: dict[int, float]) -> tuple[str, str, str]:
    """(fill, text colour, dash attribute) for a box."""
    if view.state == "namespace":
        return _NAMESPACE, "#ffffff", ""
    if view.state == "locked":
        return _LOCKED, "#111827", ""
    if view.state == "evicted":
        return _EVICTED, "#6b7280", ' stroke-dasharray="4 3"'
    if view.state == "folded":
        return _FOLDED, "#374151", ' stroke-dasharray="2 2"'
    share = recency.get(view.node_id, 1.0)
    colour = tuple(round(old + (new - old) * share) for old, new in zip(_OLD_BLUE, _NEW_BLUE))
    return _rgb(colour), "#ffffff" if share > 0.6 else "#111827", ""


def _texts(view: NodeView, decode: Decode, namespace_label: Callable[[Hashable], str]) -> tuple[str, str, str]:
    """(hover title, snippet line, counts line) of a box."""
    if view.state == "namespace":
        label = namespace_label(view.namespace)
        return f"{label}: {view.subtree_tokens} tokens", label, f"{view.subtree_tokens} tok below"
    if view.state == "folded":
        text = f"+{view.num_nodes} more"
        return f"{text} ({view.num_tokens} tokens)", text, f"{view.num_tokens} tok"
    full = decode(view.head)
    snippet = _one_line(full)
    counts = f"{view.num_tokens} tok"
    if view.state == "locked":
        counts += f" · {view.lock_ref} lock" + ("s" if view.lock_ref > 1 else "")
    elif view.state == "evicted":
        counts += " · evicted"
    return f"{view.state}, {view.num_tokens} tokens: {full!r}", snippet, counts


def _one_line(text: str) -> str:
    flat = text.replace("\n", "\u21b5").replace("\t", " ")
    return flat if len(flat) <= SNIPPET_CHARS else flat[: SNIPPET_CHARS - 1] + "\u2026"


def _corner(position: tuple[int, float]) -> tuple[float, float]:
    column, row = position
    return MARGIN + column * COLUMN, HEADER + MARGIN + row * ROW


def _rgb(colour: tuple[int, ...]) -> str:
    return "#" + "".join(f"{c:02x}" for c in colour)
