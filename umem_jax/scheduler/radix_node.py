"""The prefix cache's radix tree: Node (one cached page) and Hit (what a lookup found).

A node's key is its page's tokens and, with a lookahead of 1, the token after the page.  Why:
an MTP head (speculative method "mtp": models/mtp.py) writes its K/V entry at position i from
(token i + 1, the target's hidden at i), into the target's page envelopes.  So the entry at a
page's LAST position was made with the token after the page -- the writer's, which a request
sharing the page need not have: a request leaving the writer's path exactly at the page's end
would read a stale entry (its drafts go wrong; outputs stay right: they are verified).  That
holds at every page boundary of a path, not only at a hit's end (a branch at a boundary: one
page serves one next token), so cutting a hit's last page would not be enough.  Keying by
the next token makes every page a request shares one made with its own next token: each
branch at a page boundary gets its own page.  What a hit loses is exactly the stale page:
a request leaving a cached path at a page boundary r resumes at most at r - page_size, or,
with recurrent state, at the deepest checkpoint at or before it (a state checkpoint sits at
the resume point); a request leaving mid-page, or repeating the path, loses nothing.  (vLLM
drops the last matched block on every hit with a draft head instead.)  Every other entry of a
page depends on its own tokens only, as a draft model's entry at i (tokens <= i): lookahead 0.
"""

from __future__ import annotations

import dataclasses


class Node:
    """One cached page.  key: its page_size tokens (and the lookahead token after them); vid:
    the virtual token page id holding their KV; depth: pages from the root (the node holds tokens [(depth - 1) * page_size,
    depth * page_size)); stamp: last use, for LRU; ckpt: state slot id holding the state after
    depth * page_size tokens, or 0; wins: windows in which the tree holds this page's window
    ref; alive: still in the tree; pins: lookups about to restore this node's checkpoint (it
    stays until they unpin it); mark: a prompt ended one token past this node (a model without
    state keeps window pages for a resume here, as a checkpoint does with state); bare: a
    branch point whose window pages were let go under pressure (no longer an anchor, until a
    new branch grows from it)."""

    __slots__ = ("key", "vid", "parent", "children", "depth", "stamp", "ckpt", "wins", "alive", "pins", "mark",
                 "bare")

    def __init__(self, key, vid: int, parent, depth: int):
        self.key, self.vid, self.parent, self.depth = key, int(vid), parent, depth
        self.children: dict[tuple, Node] = {}
        self.stamp = 0
        self.ckpt = 0
        self.wins: set[str] = set()
        self.alive = True
        self.pins = 0
        self.mark = False
        self.bare = False

    def ancestor(self, depth: int) -> Node:
        """This node's ancestor (or itself) at `depth` (>= 0)."""
        node = self
        while node.depth > max(depth, 0):
            node = node.parent
        return node

    def __repr__(self) -> str:
        return f"Node(depth={self.depth}, vid={self.vid}, ckpt={self.ckpt}, wins={sorted(self.wins)}, mark={self.mark})"


@dataclasses.dataclass
class Hit:
    """What a lookup found.  nodes: the shared pages, root side first; resume: tokens a request
    skips (len(nodes) * page_size); matched: tokens found in the tree (>= resume: past resume,
    window rows or a checkpoint were missing); fork: where the request leaves a cached path that
    goes on (a branch point worth a checkpoint), else 0."""

    nodes: list[Node]
    resume: int
    matched: int
    fork: int

    @property
    def checkpoint(self) -> int:
        """The state slot to restore (the deepest node's checkpoint), or 0."""
        return self.nodes[-1].ckpt if self.nodes else 0


def resumes(hit: Hit | None) -> bool:
    """Whether a lookup lets the request skip cached tokens.  With the prefix cache on, a lookup
    that finds nothing to resume is still a Hit (it counts the query and names a fork point), so
    `hit is None` alone does not mean a miss."""
    return hit is not None and hit.resume > 0


__all__ = ["Hit", "Node", "resumes"]
