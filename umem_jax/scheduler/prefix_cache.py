"""PrefixCache: a radix tree of token pages that requests with a common prefix share.

Each node is one page: its key is the page's `page_size` tokens, its value the VIRTUAL token
page id that holds their KV (full and window sub-pools share the id), so compaction and float
moves never touch the tree.  The tree is one more holder in the PageOwner: it holds one token
ref per node, plus window refs and state checkpoints as below.  Only whole pages are cached,
and a request never writes a page once it is cached (it writes from its resume point on, into
pages of its own), so sharing needs no copy-on-write for KV.

The three kinds of memory:

  full KV      a hit shares the pages of the longest cached prefix, up to the last page
               boundary before the prompt's last token (at least one token is computed: it
               gives the logits).
  window KV    resuming at r needs the window rows of the pages touching [r - w + 1, r).  The
               tree keeps window pages only near its *anchors* (below): a node holds a window
               ref while some anchor at or below it could resume on it; every other cached
               page is tombstoned in the window.  If a hit's window pages are missing it is
               SHORTENED to the deepest point where they exist (recomputing them is not exact:
               a window row depends on the rows before it, layer by layer, down to position 0).
  state        a recurrent state cannot run backwards, so a hit resumes only at a node with a
               CHECKPOINT: a state slot owned by the tree holding the state after that node's
               last token.  A hit copies it into the request's own working slot (a slot copy
               in the allocator's move queue, never aliasing it) and replays from there.
  draft keys   with a draft whose entry at i is made from token i + 1 (an MTP head), a page's
               bytes depend on the token after it: a node's key holds `lookahead` tokens past
               its page (radix_node.py says why and what a hit loses).

Anchors (where a hit may resume, so where window rows are kept): with state, the nodes that
hold a checkpoint; without, the leaves, branch points and MARKS (the node one token short of a
cached prompt's end).  Where a request branches off a cached path the tree ADOPTS its copies of
the pages before the branch (window pages still bound) in place of cached ones whose window
pages are gone.  window_retention.py says more.

Checkpoints: planned by the scheduler (prefill chunk ends, fork points, every N decode tokens),
handed over with the pages; at most `max_checkpoints_per_path` per root path (the shallowest go
first, not branch points nor the newest: a soft bound, as SGLang's); optional memory.

Eviction: LRU over leaves that no request holds (refcount 1: the tree's own).  Evicting one
frees its token page, any window page and its checkpoint; its parent may become an evictable
leaf.  A checkpoint or a mark of any other node goes alone (its windows then go where no anchor
wants them), and so do a branch point's window pages (the node turns `bare`, no anchor until a
new branch grows from it; window_retention.py says why).  The scheduler evicts before it
retracts anything.
"""

from __future__ import annotations

import heapq
import itertools

from ..memory.page_owner import PageOwner
from .cache_holdings import CacheHoldings
from .radix_node import Hit, Node
from .window_retention import WindowRetention


class PrefixCache:
    """owner: the PageOwner (refcounts; its allocator frees checkpoint slots); windows:
    ((name, w), ...) of the plan; state: whether the plan has recurrent state; lookahead: tokens
    past a page that its bytes depend on (0, or 1 with an MTP head: radix_node.py)."""

    def __init__(self, owner: PageOwner, page_size: int, windows: tuple[tuple[str, int], ...], state: bool,
                 *, max_checkpoints_per_path: int | None = 4, lookahead: int = 0):
        if max_checkpoints_per_path is not None and max_checkpoints_per_path < 1:
            raise ValueError("max_checkpoints_per_path must be >= 1 (None: no cap)")
        if lookahead not in (0, 1):
            raise ValueError(f"lookahead must be 0 or 1 (an entry depends on at most the next token), not {lookahead}")
        self.lookahead = int(lookahead)
        self.owner, self.allocator = owner, owner.allocator
        self.page_size = int(page_size)
        self.windows = tuple(windows)
        self.state = bool(state)
        self.max_checkpoints_per_path = max_checkpoints_per_path
        self.root = Node(None, 0, None, 0)
        self._tick = itertools.count(1)
        self.holdings = CacheHoldings(owner)
        self.retention = WindowRetention(self.holdings, self.root, self.page_size, self.windows, self.state)
        # counters (monotone); shortened: matched but not resumable (window rows / checkpoint missing)
        self.queries = self.query_tokens = self.hits = self.hit_tokens = self.shortened_tokens = 0
        self.evicted_pages = self.evicted_checkpoints = self.dropped_checkpoints = 0

    # ================================================================== lookups
    def key(self, get, d: int) -> tuple:
        """The key of page d of a sequence (get(start, end): its tokens): the page's tokens and
        the `lookahead` tokens after it."""
        return tuple(get(d * self.page_size, (d + 1) * self.page_size + self.lookahead))

    def match(self, tokens, max_pages: int) -> Hit:
        """The deepest resumable prefix of `tokens` within `max_pages` pages (touches it for LRU;
        tokens must reach max_pages * page_size + lookahead)."""
        node, path = self.root, []
        page_size = self.page_size
        get = lambda a, b: tokens[a:b]
        while len(path) < max_pages:
            child = node.children.get(self.key(get, len(path)))
            if child is None:
                break
            path.append(child)
            node = child
        m = len(path)
        fork = 0
        if m and node.children and self.key(get, m) not in node.children:
            fork = m * page_size
        k = m
        rows_kept = self.retention.rows_kept(path)
        while k > 0:
            if (not self.state or path[k - 1].ckpt) and rows_kept(k):
                break
            k -= 1
        t = next(self._tick)
        for x in path[:k]:
            x.stamp = t
        return Hit(path[:k], k * page_size, m * page_size, fork)

    def find(self, tokens, pages: int) -> Node | None:
        """The node `pages` deep along `tokens`, or None."""
        node = self.root
        for d in range(pages):
            node = node.children.get(self.key(lambda a, b: tokens[a:b], d))
            if node is None:
                return None
        return node

    def record(self, query_tokens: int, hit: Hit | None) -> None:
        """Count one admitted request's lookup (vLLM's queries / hits, in requests and tokens)."""
        self.queries += 1
        self.query_tokens += int(query_tokens)
        if hit is not None:
            self.shortened_tokens += hit.matched - hit.resume
            if hit.resume:
                self.hits += 1
                self.hit_tokens += hit.resume

    # ================================================================== growth
    def insert(self, tokens, vids, n_pages: int, *, hint: Node | None = None,
               checkpoints: dict[int, int] | None = None, marks=()) -> tuple[Node, list[int]]:
        """Cache the first `n_pages` pages of a sequence: tokens (a list, or tokens(start, end)
        giving a slice; at least n_pages * page_size + lookahead of them) and its page ids `vids`
        (the inserting request's own; where the tree already holds those tokens it keeps its page,
        or adopts the request's when that one still has window pages the tree wants).  hint: a
        node on this path already inserted (continue from it).  checkpoints {depth: slot}: state
        slots to attach at those depths (the tree takes them).  marks: depths of prompt ends to
        keep resumable (models without state).
        -> (the node n_pages deep, the checkpoint slots NOT taken: the caller frees them)."""
        page_size = self.page_size
        get = tokens if callable(tokens) else (lambda a, b: tokens[a:b])
        node = hint if hint is not None and hint.alive and hint.depth <= n_pages else self.root
        low = node.depth
        t = next(self._tick)
        while node.depth < n_pages:
            d = node.depth
            key = self.key(get, d)
            if len(key) != page_size + self.lookahead:
                raise ValueError(f"insert: page {d} has {len(key)} of its {page_size + self.lookahead} key tokens")
            child = node.children.get(key)
            if child is None:
                child = Node(key, vids[d], node, d + 1)
                self.holdings.take_page(child.vid)
                node.children[key] = child
                self.retention.branched(node)
            child.stamp = t
            node = child
        rejected, deepest = [], node
        for depth, slot in sorted((checkpoints or {}).items()):
            target = node.ancestor(depth)
            if depth < 1 or target.depth != depth or target.ckpt:
                rejected.append(slot)
                continue
            target.ckpt = int(slot)
            self.holdings.take_checkpoint()
            low = min(low, depth, self._cap_checkpoints(target))
        for target in (node.ancestor(d) for d in (() if self.state else marks)):
            if target is not self.root and not target.mark:
                target.mark, low = True, min(low, target.depth)
        self.retention.refresh(deepest, low - self.retention.reach, vids)
        return deepest, rejected

    def _cap_checkpoints(self, node: Node) -> int:
        """Keep at most `max_checkpoints_per_path` checkpoints on node's root path -> the
        shallowest depth changed.  Kept beyond the cap: `node` (the newest), branch points and
        pinned nodes."""
        if self.max_checkpoints_per_path is None:
            return node.depth
        on_path, x = [], node
        while x is not self.root:
            if x.ckpt:
                on_path.append(x)
            x = x.parent
        low = node.depth
        excess = len(on_path) - self.max_checkpoints_per_path
        for x in reversed(on_path):  # shallowest first; keep the newest and branch points
            if excess <= 0:
                break
            if x is node or len(x.children) >= 2 or x.pins:
                continue
            self._drop_checkpoint(x)
            self.dropped_checkpoints += 1
            excess -= 1
            low = min(low, x.depth)
        return low

    # ================================================================== page copies
    def release_duplicates(self, paths) -> int:
        """(node, vids): a running request's deepest cached node and its page ids.  A tree-only
        page above it is no leaf, so eviction cannot reach it, and the request pays for those
        tokens twice: swap it for the request's copy (windows follow where bound) -> swaps."""
        out = 0
        for node, vids in paths:
            while node is not None and node.alive and node is not self.root:
                vid = int(vids[node.depth - 1]) if node.depth <= len(vids) else node.vid
                if vid != node.vid and self.owner.refs[node.vid] == 1 and self.owner.refs[vid] > 0:
                    wins = sorted(node.wins)
                    self.retention.swap_page(node, vid)
                    for n in (n for n in wins if self.owner.window_bound(vid, n)):
                        self.holdings.take_window(node, n)
                    out += 1
                node = node.parent
        return out

    # ================================================================== checkpoints
    pin = property(lambda self: self.holdings.pin)  # keep a node's checkpoint until unpin (a hit restores it)
    unpin = property(lambda self: self.holdings.unpin)

    def _drop_checkpoint(self, x: Node) -> None:
        self.holdings.release_checkpoint(x.ckpt)
        x.ckpt = 0

    # ================================================================== eviction
    def _evictable(self, n: Node) -> bool:
        return n.alive and n is not self.root and not n.children and self.owner.refs[n.vid] == 1

    def evict(self, enough=lambda: False) -> int:
        """Evict least recently used entries until enough() -> entries evicted.  An entry is a
        leaf no request holds (its page, window pages and checkpoint), or the checkpoint, mark
        or branch point's window pages alone of any other node (a request's own path included)."""
        heap = []
        for x in self.nodes():
            if self._evictable(x) or self.retention.droppable(x):
                heap.append((x.stamp, -x.depth, id(x), x))
        heapq.heapify(heap)  # oldest first; deepest first among equals (leaves before their parents)
        out = 0
        while heap and not enough():
            _, _, _, x = heapq.heappop(heap)
            if self._evictable(x):
                parent = x.parent
                self._remove(x)
                if self._evictable(parent) or self.retention.droppable(parent):
                    heapq.heappush(heap, (parent.stamp, -parent.depth, id(parent), parent))
            elif self.retention.droppable(x):
                if x.ckpt:
                    self._drop_checkpoint(x)
                    self.evicted_checkpoints += 1
                self.retention.let_go(x)  # its mark, its bare-ness, and its windows where no anchor wants them
            else:
                continue
            out += 1
        return out

    def clear(self) -> bool:
        """Evict everything no request holds -> whether the cache is now empty."""
        self.evict()
        return self.num_pages == 0

    def _remove(self, x: Node) -> None:
        for n in sorted(x.wins):
            self.holdings.release_window(x, n)
        if x.ckpt:
            self._drop_checkpoint(x)
            self.evicted_checkpoints += 1
        self.holdings.release_page(x.vid)
        parent = x.parent
        del parent.children[x.key]
        x.alive = False
        self.evicted_pages += 1
        self.retention.refresh(parent, parent.depth - self.retention.reach)

    # ================================================================== accounting
    def nodes(self):
        stack = list(self.root.children.values())
        while stack:
            x = stack.pop()
            stack.extend(x.children.values())
            yield x

    def held(self) -> tuple[list[int], list[int], dict[str, list[int]]]:
        """(token page ids, checkpoint slot ids, {window: page ids}) the tree holds."""
        vids, slots, wins = [], [], {n: [] for n in self.owner.windows}
        for x in self.nodes():
            vids.append(x.vid)
            if x.ckpt:
                slots.append(x.ckpt)
            for n in x.wins:
                wins[n].append(x.vid)
        return vids, slots, wins

    def held_by_subpool(self) -> dict[str, int]:
        """Pages (slots) the cache holds per sub-pool, as ArenaUsage counts them."""
        return self.holdings.by_subpool()

    def evictable_by_subpool(self) -> dict[str, int]:
        """Pages (slots) only the cache holds, per sub-pool: what eviction could free now."""
        return self.holdings.evictable_by_subpool()

    num_pages = property(lambda self: self.holdings.num_pages)
    num_checkpoints = property(lambda self: self.holdings.num_checkpoints)
    num_window_pages = property(lambda self: self.holdings.num_window_pages)  # {window: pages}
    adopted_pages = property(lambda self: self.retention.adopted_pages)  # counter: WindowRetention's

    def stats(self) -> dict:
        return {"queries": self.queries, "query_tokens": self.query_tokens, "hits": self.hits,
                "hit_tokens": self.hit_tokens, "shortened_tokens": self.shortened_tokens,
                "evicted_pages": self.evicted_pages, "evicted_checkpoints": self.evicted_checkpoints,
                "dropped_checkpoints": self.dropped_checkpoints, "adopted_pages": self.adopted_pages,
                "cached_pages": self.num_pages, "cached_checkpoints": self.num_checkpoints}


__all__ = ["Hit", "Node", "PrefixCache"]
