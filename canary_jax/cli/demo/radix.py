"""Paged KV allocator and a radix-style prefix cache (host side, plain Python), shaped like SGLang's.

* :class:`PageAllocator`: pages ``1..num_pages-1`` on a FIFO free list (page 0 holds the dummy slot 0 and is
  never handed out). ``slot = page * page_size + offset``.
* :class:`RadixCache`: a radix tree over token ids at page granularity. Each :class:`TreeNode` holds a
  ``key`` (tokens, a multiple of ``page_size`` long) and ``value`` (the KV slots of those tokens, whole pages).
  ``lock_ref`` counts running requests that read the node (and, as in SGLang, every ancestor is locked too);
  unlocked leaves are evictable, least recently used first, and eviction returns their pages to the
  allocator. Field names follow SGLang (``root_node``, ``children``, ``key``, ``value``, ``parent``,
  ``lock_ref``) so tree walkers written for SGLang's cache walk this one too.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
from collections.abc import Iterator

import numpy as np


class PageAllocator:
    """FIFO free list of pages ``1..num_pages-1`` (page 0 is reserved for the dummy slot 0)."""

    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is reserved), got {num_pages}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.free_pages: collections.deque[int] = collections.deque(range(1, num_pages))
        self.reserved = 0  # pages promised to admitted requests, not yet allocated

    @property
    def num_free(self) -> int:
        return len(self.free_pages)

    def alloc(self) -> int:
        if not self.free_pages:
            raise RuntimeError("demo allocator: out of pages (admission control bug)")
        return self.free_pages.popleft()

    def free(self, pages) -> None:
        self.free_pages.extend(int(p) for p in pages)

    def slots_of_page(self, page: int) -> np.ndarray:
        return np.arange(page * self.page_size, (page + 1) * self.page_size, dtype=np.int64)


_access_clock = itertools.count()


@dataclasses.dataclass(eq=False)
class TreeNode:
    """One radix node: ``key`` tokens and ``value`` slots (equal lengths, whole pages)."""

    key: tuple = ()
    value: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros((0,), np.int64))
    parent: TreeNode | None = None
    children: dict = dataclasses.field(default_factory=dict)
    lock_ref: int = 0
    last_access: int = 0
    pinned: bool = False  # fault injection keeps its victim node cached until the episode ends


class RadixCache:
    """Prefix cache over page-aligned token runs."""

    def __init__(self, allocator: PageAllocator):
        self.allocator = allocator
        self.page_size = allocator.page_size
        self.root_node = TreeNode()
        self.root_node.lock_ref = 1  # the root is never evicted

    # --- helpers ---------------------------------------------------------------------------------------------
    def _child_key(self, tokens) -> tuple:
        return tuple(tokens[: self.page_size])

    def _match_len(self, key: tuple, tokens) -> int:
        """Page-aligned common prefix length of ``key`` and ``tokens``."""
        n = min(len(key), len(tokens))
        i = 0
        while i < n and key[i] == tokens[i]:
            i += 1
        return i - i % self.page_size

    def _split(self, node: TreeNode, at: int) -> TreeNode:
        """Splits ``node`` so its first ``at`` tokens become a new parent; returns that parent."""
        new = TreeNode(
            key=node.key[:at],
            value=node.value[:at],
            parent=node.parent,
            lock_ref=node.lock_ref,
            last_access=node.last_access,
        )
        new.parent.children[self._child_key(new.key)] = new
        node.key, node.value = node.key[at:], node.value[at:]
        node.parent = new
        new.children[self._child_key(node.key)] = node
        return new

    # --- API -----------------------------------------------------------------------------------------------
    def match_prefix(self, tokens) -> tuple[np.ndarray, TreeNode]:
        """Longest cached page-aligned prefix of ``tokens``: ``(slots, last node)``."""
        tokens = tuple(int(t) for t in tokens)
        tokens = tokens[: len(tokens) - len(tokens) % self.page_size]
        node, out, i = self.root_node, [], 0
        stamp = next(_access_clock)
        while i < len(tokens):
            child = node.children.get(self._child_key(tokens[i:]))
            if child is None:
                break
            m = self._match_len(child.key, tokens[i:])
            if m == 0:
                break
            if m < len(child.key):
                child = self._split(child, m)
            child.last_access = stamp
            out.append(child.value)
            node, i = child, i + m
        slots = np.concatenate(out) if out else np.zeros((0,), np.int64)
        return slots, node

    def insert(self, tokens, slots) -> tuple[int, TreeNode]:
        """Inserts a page-aligned run; returns ``(length already cached, last node)``.

        The slots of the already-cached part are NOT taken over (the caller keeps and frees them); the slots
        of the new suffix now belong to the tree.
        """
        tokens = tuple(int(t) for t in tokens)
        slots = np.asarray(slots, np.int64)
        assert len(tokens) == len(slots) and len(tokens) % self.page_size == 0
        node, i = self.root_node, 0
        stamp = next(_access_clock)
        while i < len(tokens):
            child = node.children.get(self._child_key(tokens[i:]))
            if child is None:
                new = TreeNode(key=tokens[i:], value=slots[i:].copy(), parent=node, last_access=stamp)
                node.children[self._child_key(new.key)] = new
                return i, new
            m = self._match_len(child.key, tokens[i:])
            if m < len(child.key):
                child = self._split(child, m)
            child.last_access = stamp
            node, i = child, i + m
        return i, node

    def inc_lock_ref(self, node: TreeNode) -> None:
        while node is not None and node is not self.root_node:
            node.lock_ref += 1
            node = node.parent

    def dec_lock_ref(self, node: TreeNode) -> None:
        while node is not None and node is not self.root_node:
            node.lock_ref -= 1
            assert node.lock_ref >= 0
            node = node.parent

    def nodes(self) -> Iterator[TreeNode]:
        """Every node except the root, depth-first, children in insertion order."""
        stack = list(reversed(list(self.root_node.children.values())))
        while stack:
            n = stack.pop()
            yield n
            stack.extend(reversed(list(n.children.values())))

    def evictable_pages(self) -> int:
        return sum(len(n.value) // self.page_size for n in self.nodes() if n.lock_ref == 0 and not n.pinned)

    def total_pages(self) -> int:
        return sum(len(n.value) // self.page_size for n in self.nodes())

    def evict(self, num_pages: int) -> int:
        """Frees at least ``num_pages`` pages from unlocked leaves (LRU first) if possible; returns freed."""
        freed = 0
        while freed < num_pages:
            leaves = [n for n in self.nodes() if not n.children and n.lock_ref == 0 and not n.pinned]
            if not leaves:
                break
            victim = min(leaves, key=lambda n: n.last_access)
            pages = victim.value[:: self.page_size] // self.page_size
            self.allocator.free(pages)
            freed += len(pages)
            del victim.parent.children[self._child_key(victim.key)]
        return freed

    def sweep_entries(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """SGLang's sweep walk (:func:`canary_jax.runtime.sweep.walk_radix_tree`): ``(slots, positions, prev_slots)``.

        Node slot ``j`` has position ``depth + j`` and predecessor the previous slot of the node, or the
        parent's last slot, or -1 at the top level.
        """
        from canary_jax.runtime.sweep import walk_radix_tree

        e = walk_radix_tree(self.root_node)
        return e.slots, e.positions, e.prev_slots

    def unlocked_nodes(self) -> list[TreeNode]:
        """Cached nodes that no running request reads (what only the sweep protects)."""
        return [n for n in self.nodes() if n.lock_ref == 0 and len(n.value)]
