"""The demo engine's scheduler: admission, batching, prefix caching and page lifetime (host-side Python).

* :class:`Request`: one request's host state (tokens, ``req_to_token`` row, pages, prefix-cache lock).
* :class:`Scheduler`: admission with radix prefix matching and page reservation, chunked prefill mixed with
  decode under a per-step token budget, ``req_to_token`` table maintenance, finishing requests (their pages go
  into the prefix cache or back to the free list, their ``req_to_token`` row is reused).
* :class:`Batch` / :class:`BatchRow`: one forward's padded numpy arrays, at the fixed capacities of the
  :class:`~canary_jax.cli.demo.config.EngineConfig`, and the requests behind its rows.

The scheduler never touches the model or the canary, so the campaign's dry run
(:func:`canary_jax.cli.demo.campaign.dry_run`) runs it alone.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from canary_jax.cli.demo import model
from canary_jax.cli.demo.config import EngineConfig
from canary_jax.cli.demo.radix import PageAllocator, RadixCache, TreeNode

__all__ = ["Batch", "BatchRow", "Request", "Scheduler"]


@dataclasses.dataclass(eq=False)
class Request:
    """One request's host state."""

    rid: int
    prompt: list
    max_new_tokens: int
    tokens: list = dataclasses.field(default_factory=list)  # prompt + generated
    row: int = 0  # req_to_token row (0 = not admitted)
    kv_len: int = 0  # positions whose KV (and canary record) is written
    pages: list = dataclasses.field(default_factory=list)
    owned: list = dataclasses.field(default_factory=list)  # per page: the request frees it at finish
    lock_node: TreeNode | None = None
    cached_len: int = 0  # leading positions already inserted into the prefix cache
    matched_len: int = 0  # prefix reused from the cache at admission
    reserved: int = 0  # pages reserved but not yet allocated
    finished: bool = False

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - len(self.prompt)


@dataclasses.dataclass
class BatchRow:
    req: Request
    start: int  # first position computed this step (= prefix_len)
    count: int  # tokens computed this step (= extend_seq_len)
    token_offset: int  # index of the first token in the flat token arrays

    @property
    def samples(self) -> bool:
        return self.start + self.count == len(self.req.tokens)


@dataclasses.dataclass
class Batch:
    """One forward's padded arrays (numpy). ``input_ids`` / ``positions`` are what the model and the canary
    are fed; ``expected_*`` is what the scheduler meant to feed (the token oracle)."""

    rows: list
    req_pool_indices: np.ndarray  # int64[B]
    prefix_lens: np.ndarray  # int64[B]
    extend_seq_lens: np.ndarray  # int64[B]
    valid_lens: np.ndarray  # int64[B] tokens known per request (expected-token pool valid lengths)
    input_ids: np.ndarray  # int32[T]
    positions: np.ndarray  # int32[T]
    out_cache_loc: np.ndarray  # int32[T]
    token_rows: np.ndarray  # int32[T]
    sample_index: np.ndarray  # int32[B]
    expected_input_ids: np.ndarray  # int32[T]
    expected_positions: np.ndarray  # int32[T]
    num_tokens: int


class Scheduler:
    """Admission, chunked prefill + decode batching, prefix caching and page lifetime."""

    def __init__(self, cfg: EngineConfig, requests: Sequence[Request]):
        self.cfg = cfg
        self.allocator = PageAllocator(cfg.num_pages, cfg.page_size)
        self.tree = RadixCache(self.allocator)
        self.waiting = list(requests)
        self.running: list[Request] = []
        self.finished: list[Request] = []
        self.free_rows = list(range(1, cfg.max_running + 1))
        self.req_to_token = np.zeros((cfg.max_running + 1, cfg.max_context), np.int32)
        self.expected_tokens = np.zeros((cfg.max_running + 1, cfg.max_context), np.int32)
        self.stats = dict(
            admitted=0, finished=0, prefix_hit_tokens=0, prompt_tokens=0, pages_allocated=0, pages_evicted=0
        )

    # --- pages ---------------------------------------------------------------------------------------------
    def slot_of(self, req: Request, pos: int) -> int:
        return req.pages[pos // self.cfg.page_size] * self.cfg.page_size + pos % self.cfg.page_size

    def _ensure_pages(self, req: Request, upto: int) -> None:
        ps = self.cfg.page_size
        while len(req.pages) * ps < upto:
            page = self.allocator.alloc()
            self.stats["pages_allocated"] += 1
            if req.reserved > 0:
                req.reserved -= 1
                self.allocator.reserved -= 1
            req.pages.append(page)
            req.owned.append(True)

    def _try_admit(self, req: Request) -> bool:
        ps = self.cfg.page_size
        matched, node = self.tree.match_prefix(req.prompt[: len(req.prompt) - 1])
        m = len(matched)
        total_kv = len(req.prompt) + req.max_new_tokens - 1
        need = math.ceil(total_kv / ps) - m // ps
        self.tree.inc_lock_ref(node)
        short = need + self.allocator.reserved - self.allocator.num_free
        if short > 0:
            self.stats["pages_evicted"] += self.tree.evict(short)
        if need + self.allocator.reserved > self.allocator.num_free:
            self.tree.dec_lock_ref(node)
            return False
        req.row = self.free_rows.pop(0)
        req.tokens = list(req.prompt)
        req.lock_node = node
        req.pages = [int(s) // ps for s in matched[::ps]]
        req.owned = [False] * len(req.pages)
        req.kv_len = req.cached_len = req.matched_len = m
        req.reserved = need
        self.allocator.reserved += need
        self.req_to_token[req.row, :] = 0
        self.req_to_token[req.row, :m] = matched
        self.expected_tokens[req.row, :] = 0
        self.expected_tokens[req.row, : len(req.tokens)] = req.tokens
        self.running.append(req)
        self.stats["admitted"] += 1
        self.stats["prefix_hit_tokens"] += m
        self.stats["prompt_tokens"] += len(req.prompt)
        return True

    def _cache(self, req: Request, upto: int) -> None:
        """Inserts the page-aligned written prefix ``[0, upto)`` into the tree and moves the lock there."""
        ps = self.cfg.page_size
        aligned = upto - upto % ps
        if aligned <= req.cached_len:
            return
        slots = self.req_to_token[req.row, :aligned].astype(np.int64)
        have, node = self.tree.insert(req.tokens[:aligned], slots)
        for i in range(max(have, req.cached_len) // ps, aligned // ps):
            req.owned[i] = False  # now the tree's page
        self.tree.inc_lock_ref(node)
        self.tree.dec_lock_ref(req.lock_node)
        req.lock_node = node
        req.cached_len = aligned

    def _finish(self, req: Request) -> None:
        self._cache(req, req.kv_len)
        self.tree.dec_lock_ref(req.lock_node)
        req.lock_node = None
        self.allocator.free(p for p, own in zip(req.pages, req.owned) if own)
        self.allocator.reserved -= req.reserved
        req.reserved = 0
        req.finished = True
        self.running.remove(req)
        self.finished.append(req)
        self.free_rows.append(req.row)
        self.stats["finished"] += 1

    # --- batching ------------------------------------------------------------------------------------------
    @property
    def done(self) -> bool:
        return not self.waiting and not self.running

    def schedule(self) -> Batch | None:
        cfg = self.cfg
        budget = cfg.max_tokens_per_step
        rows: list[BatchRow] = []
        decodes = [r for r in self.running if len(r.tokens) - r.kv_len == 1]
        prefills = [r for r in self.running if len(r.tokens) - r.kv_len > 1]
        for req in decodes + prefills:
            if budget <= 0:
                break
            c = min(len(req.tokens) - req.kv_len, cfg.chunk_size, budget)
            rows.append(BatchRow(req, req.kv_len, c, 0))
            budget -= c
        while self.waiting and self.free_rows and budget > 0:
            req = self.waiting[0]
            if not self._try_admit(req):
                break
            self.waiting.pop(0)
            c = min(len(req.tokens) - req.kv_len, cfg.chunk_size, budget)
            rows.append(BatchRow(req, req.kv_len, c, 0))
            budget -= c
        if not rows:
            return None
        return self._build(rows)

    def _build(self, rows: list[BatchRow]) -> Batch:
        cfg = self.cfg
        bcap, tcap = cfg.max_running, cfg.max_tokens_per_step
        rpi = np.zeros((bcap,), np.int64)
        prefix = np.zeros((bcap,), np.int64)
        extend = np.zeros((bcap,), np.int64)
        valid = np.zeros((bcap,), np.int64)
        ids = np.full((tcap,), model.PAD_TOKEN, np.int32)
        pos = np.zeros((tcap,), np.int32)
        loc = np.zeros((tcap,), np.int32)
        trow = np.zeros((tcap,), np.int32)
        sample = np.zeros((bcap,), np.int32)
        t = 0
        for b, row in enumerate(rows):
            req = row.req
            self._ensure_pages(req, row.start + row.count)
            row.token_offset = t
            for j in range(row.count):
                p = row.start + j
                slot = self.slot_of(req, p)
                self.req_to_token[req.row, p] = slot
                ids[t + j] = req.tokens[p]
                pos[t + j] = p
                loc[t + j] = slot
                trow[t + j] = req.row
            rpi[b], prefix[b], extend[b], valid[b] = req.row, row.start, row.count, len(req.tokens)
            sample[b] = t + row.count - 1
            t += row.count
        return Batch(
            rows=rows,
            req_pool_indices=rpi,
            prefix_lens=prefix,
            extend_seq_lens=extend,
            valid_lens=valid,
            input_ids=ids,
            positions=pos,
            out_cache_loc=loc,
            token_rows=trow,
            sample_index=sample,
            expected_input_ids=ids.copy(),
            expected_positions=pos.copy(),
            num_tokens=t,
        )

    def complete(self, batch: Batch, next_tokens: np.ndarray) -> None:
        """Advances every request of ``batch`` after its forward: KV written, maybe a new token sampled."""
        for b, row in enumerate(batch.rows):
            req = row.req
            samples = row.samples
            req.kv_len = row.start + row.count
            if samples:
                tok = int(next_tokens[b])
                req.tokens.append(tok)
                if len(req.tokens) <= self.cfg.max_context:
                    self.expected_tokens[req.row, len(req.tokens) - 1] = tok
            if req.num_generated >= req.max_new_tokens:
                self._finish(req)
            elif row.start < len(req.prompt):
                # Prefill chunk: cache the written prompt prefix so later requests can share it (SGLang's
                # cache_unfinished_req). Decode pages stay private until the request finishes.
                self._cache(req, min(req.kv_len, len(req.prompt)))
