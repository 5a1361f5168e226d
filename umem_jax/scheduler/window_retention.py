"""WindowRetention: which cached pages the prefix cache keeps window (sliding-window) rows of.

Resuming at r needs the window rows of the pages touching [r - w + 1, r), and a window row
cannot be recomputed exactly (it depends on the rows before it, layer by layer, down to
position 0), so the tree keeps a page's window ref only while some ANCHOR at or below it could
resume on it (`refresh`); every other cached page is tombstoned in the window, and a hit whose
window rows are missing is shortened (`rows_kept`).

Anchors (where a hit may resume): with state, the nodes that hold a checkpoint; without, the
leaves (ends of cached sequences), branch points and MARKS: the node one token short of a
cached prompt's end (where its exact repeat resumes; a finished request's leaf is past its
outputs, so without marks a repeat found no window rows).  A branch point appears when a
request diverges from a cached path; that request computed the pages before it itself, so when
it inserts them the tree ADOPTS its copies (same tokens, window pages still bound) in place of
cached ones whose window pages are gone.  The next request with that prefix then resumes
exactly at the branch.

Under pressure an anchor may go alone, its page staying (`droppable`, `let_go`): a checkpoint,
a mark, a branch point's window pages, or those of a leaf that a request still holds (the node
turns `bare`, no anchor until a new branch grows from it: `branched`).  A branch point's may go
because on the path of running requests its window pages would stay as long as those run,
though the requests have passed them and the demand model counts a passed window page as given
back.  A held leaf is, most often, the last cached page of a request still decoding (its pages
are handed over as they fill): as an anchor it keeps the window page that request has just
passed, one per decoder, which the demand model likewise counts as given back.  The request's
next hand-over grows a new leaf past it (an anchor again), and its last one, when it finishes,
leaves the anchor its repeat resumes at.

The tree's window refs go through CacheHoldings; this module never touches the tree's shape
(prefix_cache.py grows and evicts it) and holds only the root, to stop its walks there.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from .cache_holdings import CacheHoldings
from .radix_node import Node


class WindowRetention:
    """holdings: the tree's refs (its owner answers `window_bound`); root: the tree's root node;
    windows: ((name, w), ...) of the plan; state: whether the plan has recurrent state (then the
    anchors are the checkpoints)."""

    def __init__(self, holdings: CacheHoldings, root: Node, page_size: int,
                 windows: tuple[tuple[str, int], ...], state: bool):
        self.holdings, self.owner, self.root = holdings, holdings.owner, root
        self.page_size = int(page_size)
        self.windows = tuple(windows)
        self.state = bool(state)
        widest = max((w for _, w in self.windows), default=0)
        self.reach = -(-widest // self.page_size) + 1  # pages above an anchor its window can touch
        self.adopted_pages = 0  # counter (monotone): tree pages swapped for a request's copy by `refresh`

    # ================================================================== resumes
    def first_window_page(self, depth: int, w: int) -> int:
        """First page a resume after `depth` pages reads in a window of w tokens."""
        return max(0, depth * self.page_size - w + 1) // self.page_size

    def rows_kept(self, path: list[Node]) -> Callable[[int], bool]:
        """path: matched nodes, root side first -> k -> whether a resume after path[:k] finds
        every window's rows (no page of path[first_window_page(k, w):k] tombstoned in w)."""
        if not path or not self.windows:
            return lambda k: True
        # unbound[w][i]: pages among path[:i] tombstoned in w
        unbound = {n: np.concatenate([[0], np.cumsum([not self.owner.window_bound(x.vid, n) for x in path])])
                   for n, _ in self.windows}
        return lambda k: all(unbound[n][k] == unbound[n][self.first_window_page(k, w)] for n, w in self.windows)

    # ================================================================== anchors
    def is_anchor(self, n: Node) -> bool:
        if n is self.root:
            return False
        return bool(n.ckpt) if self.state else (n.mark or (len(n.children) != 1 and not n.bare))

    def nearest_anchor(self, n: Node, limit: int) -> int | None:
        """Depth of the shallowest anchor in n's subtree (n included), looking no deeper than
        `limit` (an anchor deeper than that cannot reach n's page)."""
        best, stack = None, [n]
        while stack:
            x = stack.pop()
            if x.depth > limit or (best is not None and x.depth >= best):
                continue
            if self.is_anchor(x):
                best = x.depth
                continue
            stack.extend(x.children.values())
        return best

    def branched(self, n: Node) -> None:
        """A new child grew under n: a resume at n is wanted again (a bare branch point is an
        anchor once more)."""
        n.bare = False

    def reanchor(self, n: Node) -> None:
        """The request holding leaf n lets it go: a bare leaf is an anchor again, and takes the
        window pages a resume there reads, where they are still bound."""
        if n.alive and n.bare and not n.children:
            n.bare = False
            self.refresh(n, n.depth - self.reach)

    def droppable(self, n: Node) -> bool:
        """A checkpoint, a mark, a branch point's window pages, or those of a leaf a request
        still holds, that may go alone (a future shortcut only: the page stays; the module
        docstring says why the last two may)."""
        shape = len(n.children) > 1 or (not n.children and self.owner.refs[n.vid] > 1)
        windows = not self.state and shape and not n.bare and bool(n.wins)
        return n.alive and not n.pins and bool(n.ckpt or n.mark or windows)

    def let_go(self, x: Node) -> None:
        """x (droppable, its checkpoint already gone) stops being an anchor: its mark goes, a
        branch point or a leaf turns bare, and the window pages no other anchor wants go with
        them."""
        x.mark = False
        x.bare = x.bare or (not self.state and len(x.children) != 1)
        self.refresh(x, x.depth - self.reach)  # its windows may go too

    # ================================================================== window refs
    def refresh(self, deepest: Node, low: int, vids=None) -> None:
        """Re-decide the tree's window refs of the nodes from `deepest` up to depth `low` (the
        anchors near them changed), adopting the inserting request's pages (`vids`) where the
        tree's lack window pages it now wants."""
        if not self.windows or deepest is self.root:
            return
        near = self.nearest_anchor(deepest, deepest.depth + self.reach)
        node, child = deepest, None
        while node is not self.root and node.depth >= max(1, low):
            if child is not None:
                limit = node.depth + self.reach
                candidates = [near] + [self.nearest_anchor(o, limit) for o in node.children.values() if o is not child]
                if self.is_anchor(node):
                    candidates.append(node.depth)
                candidates = [c for c in candidates if c is not None]
                near = min(candidates) if candidates else None
            want = {n for n, w in self.windows
                    if near is not None and self.first_window_page(near, w) <= node.depth - 1}
            if vids is not None and want and node.depth <= len(vids) and int(vids[node.depth - 1]) != node.vid:
                self._maybe_adopt(node, int(vids[node.depth - 1]), want)
            for n in self.owner.windows:
                if n in want and n not in node.wins and self.owner.window_bound(node.vid, n):
                    self.holdings.take_window(node, n)
                elif n not in want and n in node.wins:
                    self.holdings.release_window(node, n)
            node, child = node.parent, node

    def _maybe_adopt(self, node: Node, vid: int, want: set[str]) -> None:
        """Swap node's page for `vid` (the same tokens, computed by the inserting request) when
        that one has more of the wanted window pages."""
        has = lambda v: sum(self.owner.window_bound(v, n) for n in want)
        if has(vid) <= has(node.vid) or self.owner.refs[vid] <= 0:
            return
        self.swap_page(node, vid)
        self.adopted_pages += 1

    def swap_page(self, node: Node, vid: int) -> None:
        """Make `node` hold page `vid` (the same tokens) in place of its own, windows let go."""
        self.holdings.take_page(vid)
        for n in sorted(node.wins):
            self.holdings.release_window(node, n)
        self.holdings.release_page(node.vid)
        node.vid = vid


__all__ = ["WindowRetention"]
