"""The branch graph as inline SVG: one lane per run, each step once, linked to its entry.

A node is drawn at its lane and depth (`GraphNode`, contents.py, laid them
out), an edge from its parent, and one line of text per row names the steps
there (heads in bold); runs with no step in common are stacked one below the
other, so a line only holds steps of one tree. Forks past `MAX_FORKS` are
counted, not drawn.
"""

from __future__ import annotations

from kvtrace.page.contents import GraphNode, Page
from kvtrace.page.markup import cut, escape
from kvtrace.store.kinds import StepKind

LANE, ROW, MARGIN = 22, 22, 14  # graph geometry in pixels
CHAR_PX = 7.5  # the width of one character of the labels' 12 px monospace font


def graph_section(page: Page, depths: range | None = None) -> str:
    """The branch graph of `page`; with `depths`, of the steps at those depths only (a page of
    a long run's steps: as tall as the page, not as the run)."""
    nodes = page.nodes if depths is None else [n for n in page.nodes if n.depth in depths]
    if not nodes:
        return '<section id="graph"><h2>Branch graph</h2><p>no steps yet</p></section>'
    where = {node.step_id: node for node in nodes}
    row_of = _rows(page.nodes, nodes)
    text_x = MARGIN * 2 + LANE * len(page.lanes)
    height = MARGIN * 2 + ROW * max(row_of.values()) + 8
    rows: dict[int, list[GraphNode]] = {}
    for node in nodes:
        rows.setdefault(row_of[node.step_id], []).append(node)
    lines, longest = _lines(rows)
    # As wide as its longest line (the section scrolls): steps of several runs at one depth
    # share a line, which clipped at a fixed width.
    width = text_x + max(760, int(longest * CHAR_PX) + MARGIN)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" role="img" aria-label="branch graph">']

    def xy(node: GraphNode) -> tuple[int, int]:
        return MARGIN + LANE * node.lane, MARGIN + ROW * row_of[node.step_id]

    for node in nodes:
        parent = where.get(node.parent_id) if node.parent_id else None
        if parent is None:
            continue
        (x1, y1), (x2, y2) = xy(parent), xy(node)
        middle = (y1 + y2) / 2
        out.append(f'<path class="edge" d="M{x1} {y1} C{x1} {middle} {x2} {middle} {x2} {y2}"/>')
    for node in nodes:
        x, y = xy(node)
        circle = (f'<circle class="node kind-{kind_class(node.kind)}" cx="{x}" cy="{y}" r="6">'
                  f"<title>@{node.depth} {escape(node.kind)} {escape(node.summary)}</title>"
                  "</circle>")
        out.append(f'<a href="#{node.anchor}">{circle}</a>' if node.anchor else circle)
    for row, line in lines:
        out.append(f'<text x="{text_x}" y="{MARGIN + ROW * row + 4}">{line}</text>')
    out.append("</svg>")
    lanes = " ".join(f"<span>lane {i + 1}: <code>{escape(name)}</code></span>"
                     for i, name in enumerate(page.lanes))
    kinds = " ".join(f'<span><i class="dot kind-{k}"></i>{k}</span>'
                     for k in (*_DRAWN_KINDS, "other"))
    more = (f"<p class=\"meta\">{page.num_forks_left_out} more forks not drawn</p>"
            if page.num_forks_left_out else "")
    return (f'<section id="graph"><h2>Branch graph</h2><div class="scroll">{"".join(out)}</div>'
            f'<p class="legend">{kinds}</p><p class="legend">{lanes}</p>{more}</section>')


def _rows(every: list[GraphNode], nodes: list[GraphNode]) -> dict[str, int]:
    """Each drawn node's row: its depth within its tree, the trees (runs with no step in
    common, found over `every` node of the page) stacked one below the other, so that
    unrelated runs never share a line of labels."""
    tree_of: dict[str, str] = {}
    for node in every:  # parents come first (layout order), so a parent's tree is known
        parent = node.parent_id if node.parent_id in tree_of else None
        tree_of[node.step_id] = tree_of[parent] if parent is not None else node.step_id
    spans: dict[str, tuple[int, int]] = {}
    for node in nodes:
        low, high = spans.get(tree_of[node.step_id], (node.depth, node.depth))
        spans[tree_of[node.step_id]] = (min(low, node.depth), max(high, node.depth))
    first_row, row = {}, 0
    for tree, (low, high) in spans.items():  # in the order the trees first appear
        first_row[tree] = row - low
        row += high - low + 1
    return {node.step_id: first_row[tree_of[node.step_id]] + node.depth for node in nodes}


def _lines(rows: dict[int, list[GraphNode]]) -> tuple[list[tuple[int, str]], int]:
    """One line of markup per row naming its steps, and the longest line's characters."""
    lines, longest = [], 0
    for row_number, row in sorted(rows.items()):
        labels, shown = [], 0
        width = max(16, 90 // len(row))  # several steps at one depth share the line
        for node in row:
            heads = "".join(f"({h}) " for h in node.heads)
            summary = cut(node.summary, width)
            shown += len(heads) + len(f"@{node.depth} {node.kind} {summary}") + 3
            label = ("".join(f'<tspan class="head">({escape(h)}) </tspan>' for h in node.heads)
                     + f"@{node.depth} {escape(node.kind)} {escape(summary)}")
            labels.append(f'<a href="#{node.anchor}">{label}</a>' if node.anchor else label)
        lines.append((row_number, " | ".join(labels)))
        longest = max(longest, shown)
    return lines, longest


_DRAWN_KINDS = (StepKind.MODEL_CALL, StepKind.TOOL_CALL, StepKind.NOTE)


def kind_class(kind: str) -> str:
    return kind if kind in _DRAWN_KINDS else "other"
