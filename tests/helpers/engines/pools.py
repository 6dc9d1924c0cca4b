"""The engines' block allocators: :class:`Pages` (the full-attention pool with an LRU prefix cache of full
pages) and :class:`SwaBlockPool` (vLLM's sliding-window group pool, null block 0, lazy prefix cache)."""

from __future__ import annotations

import collections


class Pages:
    """A page allocator with a prefix cache of full pages keyed by the tokens up to the page's end (LRU)."""

    def __init__(self, num_pages: int, page_size: int):
        self.page_size = page_size
        self.free = collections.deque(range(1, num_pages))  # page 0: the null / padding page
        self.ref = [0] * num_pages
        self.cache: collections.OrderedDict = collections.OrderedDict()
        self.ever_freed: set[int] = set()
        self.reused = 0

    def available(self) -> int:
        return len(self.free) + sum(1 for p in self.cache.values() if self.ref[p] == 1)

    def alloc(self) -> int:
        if not self.free:
            for key, page in list(self.cache.items()):  # evict the least recently used unshared page
                if self.ref[page] == 1:
                    del self.cache[key]
                    self.decref(page)
                    break
        page = self.free.popleft()
        self.reused += page in self.ever_freed
        self.ref[page] = 1
        return page

    def decref(self, page: int) -> None:
        self.ref[page] -= 1
        if self.ref[page] == 0:
            self.free.appendleft(page)  # reused first
            self.ever_freed.add(page)

    def match(self, tokens: list[int]) -> list[int]:
        out = []
        ps = self.page_size
        while (len(out) + 1) * ps <= len(tokens):
            page = self.cache.get(tuple(tokens[: (len(out) + 1) * ps]))
            if page is None:
                break
            self.cache.move_to_end(tuple(tokens[: (len(out) + 1) * ps]))
            out.append(page)
        return out

    def insert(self, tokens: list[int], pages: list[int]) -> None:
        ps = self.page_size
        for k in range(len(tokens) // ps):
            key = tuple(tokens[: (k + 1) * ps])
            if key not in self.cache:
                self.cache[key] = pages[k]
                self.ref[pages[k]] += 1


class SwaBlockPool:
    """The sliding-window KV-cache group's own block pool, vLLM-style (``vllm/v1/core/block_pool.py``): block 0
    is the null block; freed blocks go to the tail of the free queue and new blocks come from its head; the
    prefix cache is lazy, so a freed block stays hashable until it is reallocated (then it leaves the cache).
    A cache entry remembers the full-attention page its block was computed with, so a hit in both groups names
    one (full slot, SWA slot) pair, as SGLang's full-to-SWA LUT does."""

    def __init__(self, num_blocks: int):
        self.free = collections.deque(range(1, num_blocks))
        self.ref = [0] * num_blocks
        self.cache: dict = {}  # tokens up to the block's end -> (full page, block)
        self.key_of: dict = {}  # block -> its cache key
        self.ever_freed: set[int] = set()
        self.reused = 0  # allocations of a block that had been freed before

    def alloc(self) -> int:
        if not self.free:
            raise RuntimeError("SWA block pool exhausted (engine sizing bug)")
        block = self.free.popleft()
        key = self.key_of.pop(block, None)
        if key is not None:
            del self.cache[key]
        self.reused += block in self.ever_freed
        self.ref[block] = 1
        return block

    def touch(self, block: int) -> None:
        """A prefix-cache hit on ``block``: it leaves the free queue if it was there."""
        if self.ref[block] == 0:
            self.free.remove(block)
        self.ref[block] += 1

    def decref(self, block: int) -> None:
        self.ref[block] -= 1
        if self.ref[block] == 0:
            self.free.append(block)
            self.ever_freed.add(block)

    def insert(self, key: tuple, full_page: int, block: int) -> None:
        if key not in self.cache and block not in self.key_of:
            self.cache[key] = (full_page, block)
            self.key_of[block] = key
