"""The prefix cache's radix tree: Node (one cached page) and Hit (what a lookup found)."""

from __future__ import annotations

import dataclasses


class Node:
    """One cached page.  key: its page_size tokens; vid: the virtual token page id holding
    their KV; depth: pages from the root (the node holds tokens [(depth - 1) * page_size,
    depth * page_size)); stamp: last use, for LRU; ckpt: state slot id holding the state after
    depth * page_size tokens, or 0; wins: windows in which the tree holds this page's window
    ref; alive: still in the tree; pins: lookups about to restore this node's checkpoint (it
    stays until they unpin it); mark: a prompt ended one token past this node (a model without
    state keeps window pages for a resume here, as a checkpoint does with state)."""

    __slots__ = ("key", "vid", "parent", "children", "depth", "stamp", "ckpt", "wins", "alive", "pins", "mark")

    def __init__(self, key, vid: int, parent, depth: int):
        self.key, self.vid, self.parent, self.depth = key, int(vid), parent, depth
        self.children: dict[tuple, Node] = {}
        self.stamp = 0
        self.ckpt = 0
        self.wins: set[str] = set()
        self.alive = True
        self.pins = 0
        self.mark = False

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


__all__ = ["Hit", "Node"]
