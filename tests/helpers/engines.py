"""Logical batches in three batch conventions, and toy serving engines that run the canary in two of them.

Part 1 (plan parity): :func:`random_logical_batch` draws one serving step on Python ints (requests with KV pages,
prefix sharing, chunked prefill or decode, padding rows and tokens); :func:`to_sglang`, :func:`to_sglang_jax`
and :func:`to_block_tables` write it in SGLang's, sglang-jax's and vLLM-style conventions. The three describe the
same logical batch, so the canary must plan the same bytes from each. No jax and no canary_jax here.

Part 2 (engines): :class:`SglangJaxEngine` (host ``req_to_token`` rows from 0, padding -1, EXTEND / DECODE batches,
ragged ``cache_loc``) and :class:`BlockTableEngine` (a vLLM-style persistent batch: block tables per batch row,
mixed prefill + decode steps, rows condensed and swapped between steps) serve a small workload through a toy
model that writes deterministic layer-0 K bytes into a paged pool, under the canary step API: plan + HEAD,
the KV write, TAIL with the K pool as real-KV source, and a periodic sweep. Both share a page allocator with a
prefix cache (shared prompt pages, finished requests' pages freed and reused). ``step(inject=...)`` runs a
fault-injection hook after scheduling and before HEAD (:func:`inject_kv_flip`, :func:`inject_table_remap`,
:func:`inject_token_swap`) and ``step(observe=...)`` an observer after HEAD (plan parity checks).

:class:`HybridBlockTableEngine` is vLLM's hybrid KV cache: a full-attention group and a sliding-window group, each
with its block table and its own pool (the SWA pool smaller), SWA blocks that leave the window freed to the null
block and reused by other requests, prefix hits across both groups; the canary runs a FULL and an SWA group
(:func:`inject_swa_kv_flip`, :func:`inject_swa_table_remap`, :func:`flip_freed_swa_block`; ``sglang_view`` writes
each step in SGLang's convention, dense ``req_to_token`` + full-to-SWA LUT).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import random
from typing import Any

import numpy as np

# --- Part 1: logical batches -----------------------------------------------------------------------------


@dataclasses.dataclass
class LogicalRequest:
    """One request row of a step: tokens known, KV pages, prefix P (in the KV before) and extend E (written)."""

    tokens: list[int]
    pages: list[int]
    prefix: int
    extend: int
    pool_row: int  # the stack's req_to_token row (0-based, sglang-jax style)
    swa_pages: list[int] | None = None  # SWA-pool pages (0 = freed out of the window)

    def slot(self, p: int, page_size: int) -> int:
        return self.pages[p // page_size] * page_size + p % page_size

    def swa_slot(self, p: int, page_size: int) -> int:
        return self.swa_pages[p // page_size] * page_size + p % page_size


@dataclasses.dataclass
class LogicalBatch:
    requests: list[LogicalRequest]
    page_size: int
    num_rows: int
    num_tokens: int
    decode: bool
    swa_window: int = 0


def random_logical_batch(
    rng: random.Random,
    *,
    page_size: int,
    num_rows: int,
    num_tokens: int,
    max_blocks: int,
    num_pages: int,
    max_reqs: int,
    decode: bool,
    swa_window: int = 0,
) -> LogicalBatch:
    """A random step: 0..num_rows live requests, some sharing prefix pages (not with an SWA window), prefill
    from scratch, chunked-prefill continuations (P > 0, E > 1) or decode (E = 1)."""
    free = list(range(1, num_pages))  # page 0 is the null / padding page
    rng.shuffle(free)
    max_len = max_blocks * page_size
    n = rng.randint(0, num_rows)
    budget = num_tokens
    shared_len = rng.randint(1, 3) * page_size if swa_window == 0 else 0
    shared_pages = [free.pop() for _ in range(shared_len // page_size)]
    shared_tokens = [rng.randrange(1, 50000) for _ in range(shared_len)]
    rows = rng.sample(range(max_reqs), n)
    reqs = []
    for i in range(n):
        if budget == 0:
            break
        if decode:
            extend = 1
            prefix = rng.randint(0, max_len - 1)
        else:
            extend = rng.randint(1, min(budget, max(1, budget - (n - i - 1))))
            prefix = rng.choice([0, rng.randint(0, max_len - extend)])
            extend = min(extend, max_len - prefix)
        total = prefix + extend
        share = shared_len > 0 and rng.random() < 0.5 and total > shared_len
        tokens = (shared_tokens if share else []) + [rng.randrange(1, 2**31 - 1) for _ in range(total)]
        tokens = tokens[:total]
        pages = (list(shared_pages) if share else []) + [free.pop() for _ in range(-(-total // page_size))]
        pages = pages[: -(-total // page_size)]
        swa = None
        if swa_window:
            swa = [free.pop() for _ in pages]
            for j in range(len(swa)):  # vLLM frees SWA blocks entirely outside the window
                if (j + 1) * page_size <= prefix - swa_window:
                    swa[j] = 0
        reqs.append(LogicalRequest(tokens, pages, prefix, extend, rows[i], swa))
        budget -= extend
    return LogicalBatch(reqs, page_size, num_rows, num_tokens, decode, swa_window)


def _tokens_of(lb: LogicalBatch) -> tuple[list[int], list[int], list[int]]:
    ids, pos, loc = [], [], []
    for r in lb.requests:
        for p in range(r.prefix, r.prefix + r.extend):
            ids.append(r.tokens[p])
            pos.append(p)
            loc.append(r.slot(p, lb.page_size))
    return ids, pos, loc


def to_sglang(lb: LogicalBatch, *, max_reqs: int, max_seq_len: int, num_slots: int = 0) -> dict:
    """SGLang's convention: dense ``req_to_token`` (rows = pool_row + 1; 0 = padding), padding tokens 0, and,
    with an SWA window, the full-to-SWA LUT (0 = evicted)."""
    ps = lb.page_size
    r2t = np.zeros((max_reqs + 1, max_seq_len), np.int32)
    rpi, prefix, extend, valid = [], [], [], []
    pool = np.zeros((max_reqs + 1, max_seq_len), np.int32)
    lut = None
    if lb.swa_window:
        lut = np.zeros(num_slots + 1, np.int64)
    for r in lb.requests:
        row = r.pool_row + 1
        for p in range(r.prefix + r.extend):
            r2t[row, p] = r.slot(p, ps)
            if lut is not None:
                lut[r.slot(p, ps)] = r.swa_slot(p, ps) if r.swa_pages[p // ps] else 0
        pool[row, : len(r.tokens)] = r.tokens
        rpi.append(row)
        prefix.append(r.prefix)
        extend.append(r.extend)
        valid.append(len(r.tokens))
    pad = lb.num_rows - len(rpi)
    ids, pos, loc = _tokens_of(lb)
    tpad = lb.num_tokens - len(ids)
    return dict(
        req_pool_indices=np.array(rpi + [0] * pad, np.int64),
        prefix_lens=np.array(prefix + [0] * pad, np.int64),
        extend_seq_lens=np.array(extend + [0] * pad, np.int64),
        input_ids=np.array(ids + [0] * tpad, np.int64),
        positions=np.array(pos + [0] * tpad, np.int64),
        out_cache_loc=np.array(loc + [0] * tpad, np.int64),
        req_to_token=r2t,
        expected_tokens=pool,
        expected_tokens_valid_lens=np.array(valid + [0] * pad, np.int64),
        lut=lut,
        num_live_tokens=len(ids),
    )


def to_sglang_jax(lb: LogicalBatch, *, cache_loc_len: int, cache_loc_page_size: int, max_reqs: int, rng) -> dict:
    """sglang-jax's convention (``get_model_worker_batch``): rows from 0, padding rows -1 / seq_lens 0, padding
    tokens -1 in out_cache_loc, ragged ``cache_loc`` spans padded to the page size (garbage in the gaps and the
    tail), EXTEND lengths or DECODE."""
    ps, cps = lb.page_size, cache_loc_page_size
    rpi, seq, pre, ext, spans = [], [], [], [], []
    pool = np.zeros((max_reqs, 64), np.int32)
    valid = []
    for r in lb.requests:
        rpi.append(r.pool_row)
        n = r.prefix + r.extend
        seq.append(n)
        pre.append(r.prefix)
        ext.append(r.extend)
        span = [r.slot(p, ps) for p in range(n)]
        span += [rng.randrange(0, 1 << 20) for _ in range(-(-n // cps) * cps - n)]
        spans += span
        pool[r.pool_row, : len(r.tokens)] = r.tokens
        valid.append(len(r.tokens))
    assert len(spans) <= cache_loc_len
    cache_loc = spans + [rng.randrange(0, 1 << 20) for _ in range(cache_loc_len - len(spans))]
    pad = lb.num_rows - len(rpi)
    ids, pos, loc = _tokens_of(lb)
    tpad = lb.num_tokens - len(ids)
    out = dict(
        forward_mode="DECODE" if lb.decode else "EXTEND",
        input_ids=np.array(ids + [0] * tpad, np.int32),
        positions=np.array(pos + [0] * tpad, np.int32),
        out_cache_loc=np.array(loc + [-1] * tpad, np.int32),
        req_pool_indices=np.array(rpi + [-1] * pad, np.int32),
        seq_lens=np.array(seq + [0] * pad, np.int32),
        cache_loc=np.array(cache_loc, np.int32),
        cache_loc_page_size=cps,
        expected_tokens=pool,
        expected_tokens_valid_lens=np.array(valid + [0] * pad, np.int32),
    )
    if not lb.decode:
        out["extend_prefix_lens"] = np.array(pre + [0] * pad, np.int32)
        out["extend_seq_lens"] = np.array(ext + [0] * pad, np.int32)
    return out


def to_block_tables(lb: LogicalBatch, *, max_blocks: int, rng, slot_mapping: bool, dynamic_pad: bool) -> dict:
    """vLLM-style: block tables per batch row (0 = null block; garbage rows past num_reqs), seq_lens,
    query_start_loc padded past num_reqs with 1 (tpu-inference), slot_mapping with -1 padding (or none)."""
    ps = lb.page_size
    n = len(lb.requests)
    bt = np.array([[rng.randrange(0, 1 << 16) for _ in range(max_blocks)] for _ in range(lb.num_rows)], np.int32)
    swa_bt = bt.copy()
    seq = [0] * lb.num_rows
    qsl = [0]
    pool = np.zeros((lb.num_rows, 64), np.int32)
    valid = [0] * lb.num_rows
    for i, r in enumerate(lb.requests):
        bt[i] = 0
        bt[i, : len(r.pages)] = r.pages
        if r.swa_pages is not None:
            swa_bt[i] = 0
            swa_bt[i, : len(r.swa_pages)] = r.swa_pages
        seq[i] = r.prefix + r.extend
        qsl.append(qsl[-1] + r.extend)
        pool[i, : len(r.tokens)] = r.tokens
        valid[i] = len(r.tokens)
    qsl += [1] * (lb.num_rows + 1 - len(qsl))
    ids, pos, loc = _tokens_of(lb)
    tpad = lb.num_tokens - len(ids)
    out = dict(
        input_ids=np.array(ids + [0] * tpad, np.int32),
        positions=np.array(pos + [0] * tpad, np.int32),
        query_start_loc=np.array(qsl, np.int32),
        seq_lens=np.array(seq, np.int32),
        block_table=bt,
        block_size=ps,
        num_reqs=np.array([n], np.int32) if dynamic_pad else n,
        expected_tokens=pool,
        expected_tokens_valid_lens=np.array(valid, np.int32),
    )
    if slot_mapping:
        out["slot_mapping"] = np.array(loc + [-1] * tpad, np.int64)
    if lb.swa_window:
        out["swa_block_table"] = swa_bt
    return out


# --- Part 2: engines ------------------------------------------------------------------------------------
KV_BYTES = 16
VOCAB = 50000


def _jax():
    """Imports jax and the canary lazily (Part 1 stays importable without them)."""
    import jax
    import jax.numpy as jnp

    return jax, jnp


@functools.cache
def _write_kv_fn(page: int):
    jax, jnp = _jax()

    @jax.jit
    def write(pool, slots, tokens, positions):
        """The toy model's KV write: deterministic bytes of (token, position) at each slot (slot < 0: none)."""
        j = jnp.arange(KV_BYTES, dtype=jnp.int32)
        vals = ((tokens[:, None] * 31 + positions[:, None] * 7 + j[None, :] * 3 + 1) % 251 + 1).astype(jnp.uint8)
        ok = slots >= 0
        row = jnp.where(ok, slots // page, pool.shape[0])
        cols = (jnp.where(ok, slots, 0) % page)[:, None] * KV_BYTES + j[None, :]
        return pool.at[row[:, None], cols].set(vals, mode="drop")

    return write


@dataclasses.dataclass
class Request:
    rid: int
    prompt: list[int]
    max_new: int
    tokens: list[int] = dataclasses.field(default_factory=list)
    pages: list[int] = dataclasses.field(default_factory=list)  # the pages the request owns (refcounted)
    table_pages: list[int] = dataclasses.field(default_factory=list)  # what its table row says (faults differ)
    computed: int = 0  # tokens whose KV is written
    row: int = -1
    cached: bool = False
    swa_pages: list[int] = dataclasses.field(default_factory=list)  # sliding-window blocks owned (0 = null)
    swa_table: list[int] = dataclasses.field(default_factory=list)  # what its SWA block-table row says

    @property
    def final_len(self) -> int:
        return len(self.prompt) + self.max_new


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


@dataclasses.dataclass
class WorkItem:
    req: Request
    extend: int
    prefix: int
    swap: int | None = None  # token index (within the item) fed with a wrong id


class ToyEngine:
    """Shared parts: workload, pages, toy model, canary state and the step loop. Subclasses say how a step's work
    is laid out as a batch (:meth:`batch_arrays`) and which adapter reads it (:meth:`canary_batch`)."""

    PAGE_SIZE = 4
    NUM_PAGES = 40
    MAX_ROWS = 4
    NUM_TOKENS = 16
    MAX_LEN = 40
    SWEEP_EVERY = 3
    SWEEP_CAPACITY = 128

    def __init__(self, *, seed: int, num_requests: int = 14):
        from canary_jax import constants
        from canary_jax.buckets import Buckets
        from canary_jax.runtime.groups import CanaryBufferGroup, PoolKind
        from canary_jax.runtime.state import CanaryState, CanaryStepConfig

        _, jnp = _jax()
        self.rng = random.Random(seed)
        self.pages = Pages(self.NUM_PAGES, self.PAGE_SIZE)
        self.num_slots = self.NUM_PAGES * self.PAGE_SIZE
        self.config = CanaryStepConfig(
            verify_capacity=128,
            write_req_capacity=self.MAX_ROWS,
            real_kv_hash_mode=constants.RealKvHashMode.ALL,
            enable_write_input_assert=True,
            enable_verify_token_assert=True,
            backend="reference",
            buckets=Buckets(sizes=(self.NUM_TOKENS,)),
        )
        group = CanaryBufferGroup.allocate(kind=PoolKind.FULL, num_slots=self.num_slots, has_v_half=False)
        self.state = CanaryState.create([group], ring_capacity=64)
        self.pool = jnp.zeros(self.pool_shape(), jnp.uint8)
        prefixes = [[self.rng.randrange(1, VOCAB) for _ in range(2 * self.PAGE_SIZE + 1)] for _ in range(2)]
        self.waiting = collections.deque()
        for rid in range(num_requests):
            head = list(self.rng.choice(prefixes)) if self.rng.random() < 0.7 else []
            prompt = head + [self.rng.randrange(1, VOCAB) for _ in range(self.rng.randint(1, 12))]
            self.waiting.append(Request(rid, prompt, self.rng.randint(2, 7), tokens=list(prompt)))
        self.running: list[Request] = []
        self.step_no = 0
        self.stats = collections.Counter()
        self.last_batch = None

    # -- layout hooks -----------------------------------------------------------------------------------
    def pool_shape(self) -> tuple[int, int]:
        raise NotImplementedError

    def source_page_size(self) -> int:
        raise NotImplementedError

    def add_row(self, req: Request) -> bool:
        raise NotImplementedError

    def remove_row(self, req: Request) -> None:
        raise NotImplementedError

    def schedule(self) -> list[WorkItem]:
        raise NotImplementedError

    def batch_arrays(self, work: list[WorkItem]) -> dict:
        raise NotImplementedError

    def canary_batch(self, arrays: dict):
        raise NotImplementedError

    # -- shared machinery ---------------------------------------------------------------------------------
    def sources(self):
        from canary_jax.sources import RealKvSource

        page = self.source_page_size()
        src = RealKvSource(tensor=self.pool, page_size=page, num_bytes_per_token=KV_BYTES, read_bytes=KV_BYTES)
        return (((src,), ()),)

    def _admit(self) -> None:
        reserved = sum(-(-r.final_len // self.PAGE_SIZE) - len(r.pages) for r in self.running)
        while self.waiting:
            req = self.waiting[0]
            matched = self.match_prefix(req)
            need = -(-req.final_len // self.PAGE_SIZE) - len(matched)
            for page in matched:
                self.pages.ref[page] += 1
            if self.pages.available() - reserved < need or not self.add_row(req):
                for page in matched:
                    self.pages.ref[page] -= 1  # the cache still holds it
                break
            self.waiting.popleft()
            req.pages = list(matched)
            req.table_pages = list(matched)
            req.computed = len(matched) * self.PAGE_SIZE
            self.stats["shared_pages"] += len(matched)
            self.admitted(req)
            self.running.append(req)
            reserved += need

    def _allocate(self, work: list[WorkItem]) -> None:
        ps = self.PAGE_SIZE
        for item in work:
            r = item.req
            while len(r.pages) * ps < item.prefix + item.extend:
                page = self.pages.alloc()
                r.pages.append(page)
                r.table_pages.append(page)

    def _finish(self, work: list[WorkItem]) -> None:
        for item in work:
            r = item.req
            r.computed += item.extend
            if r.computed < len(r.prompt):
                self.stats["chunked_prefills"] += 1
            if r.computed == len(r.tokens):
                if not r.cached:  # prompt fully computed: its full pages join the prefix cache
                    self.pages.insert(r.prompt, r.pages)
                    self.prompt_cached(r)
                    r.cached = True
                if len(r.tokens) - len(r.prompt) < r.max_new:
                    r.tokens.append((r.tokens[-1] * 31 + len(r.tokens) * 7 + r.rid) % VOCAB + 1)
        for r in [r for r in self.running if r.computed == len(r.tokens)]:
            self.running.remove(r)
            self.remove_row(r)
            for page in r.pages:
                self.pages.decref(page)
            self.released(r)
            self.stats["finished"] += 1

    # -- hooks with defaults (the hybrid engine overrides them) ---------------------------------------------
    def match_prefix(self, req: Request) -> list[int]:
        """The cached full pages a new request starts from."""
        return self.pages.match(req.prompt[: len(req.prompt) - 1])

    def admitted(self, req: Request) -> None:
        """After ``req`` is admitted with ``req.pages`` matched."""

    def prompt_cached(self, req: Request) -> None:
        """After ``req``'s prompt pages joined the prefix cache."""

    def released(self, req: Request) -> None:
        """After a finished request's full pages were released."""

    def prepare_step(self, work: list[WorkItem], arrays: dict) -> None:
        """Before HEAD, with the step's batch arrays (e.g. keep a LUT current)."""

    def write_kv(self, arrays: dict) -> None:
        """The toy model's KV write for the step's tokens."""
        _, jnp = _jax()
        write = _write_kv_fn(self.source_page_size())
        self.pool = write(
            self.pool,
            jnp.asarray(arrays["model_slots"]),
            jnp.asarray(arrays["model_tokens"]),
            jnp.asarray(arrays["model_positions"]),
        )

    def sweep_plans(self, batch) -> tuple:
        """One sweep VerifyPlan per canary group, after the step."""
        from canary_jax.adapters.batches import sweep_plan_after_step

        return (sweep_plan_after_step(batch, verify_capacity=self.SWEEP_CAPACITY),)

    def step(self, inject=None, observe=None) -> dict | None:
        """One forward step under the canary. ``inject(engine, work)`` runs after scheduling, before HEAD;
        ``observe(engine, work, arrays, batch, plans)`` after HEAD (before the step's bookkeeping)."""
        from canary_jax.runtime.step import canary_head, canary_sweep, canary_tail

        self._admit()
        work = self.schedule()
        self._allocate(work)
        info = inject(self, work) if inject is not None else None
        arrays = self.batch_arrays(work)
        batch = self.canary_batch(arrays)
        self.prepare_step(work, arrays)
        self.state, plans = canary_head(self.state, batch, config=self.config)
        if observe is not None:
            observe(self, work, arrays, batch, plans)
        self.write_kv(arrays)
        self.state, _ = canary_tail(self.state, plans, batch, config=self.config, real_kv_sources=self.sources())
        self.stats["steps"] += 1
        self._finish(work)
        if self.step_no % self.SWEEP_EVERY == self.SWEEP_EVERY - 1:
            sweeps = self.sweep_plans(batch)
            self.state = canary_sweep(self.state, sweeps, config=self.config, real_kv_sources=self.sources())
            self.stats["sweeps"] += 1
        self.step_no += 1
        self.last_batch = batch
        return info

    def violations(self) -> tuple[int, int]:
        """``(count, OR of the fail-reason bits of the recorded rows)``."""
        n, rows = self.violation_rows()
        bits = 0
        for row in rows:
            bits |= int(row[7])
        return n, bits

    def violation_rows(self) -> tuple[int, np.ndarray]:
        """``(count, the recorded ring rows as int64 [n, 8])`` (row[0] is the launch tag)."""
        from canary_jax import ints

        log = self.state.log
        n = int(np.asarray(log.write_index)[0])
        ring = ints.pairs_to_int64_np(np.asarray(log.ring))
        return n, ring[: min(n, ring.shape[0])]

    def token_arrays(self, work: list[WorkItem]):
        """Per-token ``(ids fed, true ids, positions, slots)`` in work order, padded to NUM_TOKENS."""
        ids, true, pos, slots = [], [], [], []
        ps = self.PAGE_SIZE
        for item in work:
            r = item.req
            for i in range(item.extend):
                p = item.prefix + i
                tok = r.tokens[p]
                true.append(tok)
                ids.append(tok % VOCAB + 1 if item.swap == i else tok)
                pos.append(p)
                slots.append(r.pages[p // ps] * ps + p % ps)
        assert len(ids) <= self.NUM_TOKENS
        return ids, true, pos, slots

    def expected_tokens(self, rows: int, row_of) -> np.ndarray:
        table = np.zeros((rows, self.MAX_LEN), np.int32)
        for r in self.running:
            table[row_of(r), : len(r.tokens)] = r.tokens
        return table


class SglangJaxEngine(ToyEngine):
    """sglang-jax's convention: ``req_to_token`` rows on the host (row 0 is a real request), EXTEND batches of
    (chunked) prefills, DECODE batches of every running request, padding rows -1, padding tokens -1, and the
    ragged ``cache_loc`` (spans aligned to the page size) that ``get_model_worker_batch`` builds."""

    PAGE_SIZE = 2
    NUM_PAGES = 80
    CACHE_LOC = 256

    def __init__(self, **kw):
        super().__init__(**kw)
        self.req_to_token = np.zeros((8, self.MAX_LEN), np.int32)
        self.free_rows = list(range(8))

    def pool_shape(self):
        return (self.num_slots, KV_BYTES)

    def source_page_size(self):
        return 1

    def add_row(self, req):
        if len(self.running) >= self.MAX_ROWS:
            return False
        self.free_rows.sort()
        req.row = self.free_rows.pop(0)
        self.stats["row0_used"] += req.row == 0
        return True

    def remove_row(self, req):
        self.free_rows.append(req.row)

    def schedule(self):
        prefill = [r for r in self.running if r.computed < len(r.prompt)]
        work, budget = [], self.NUM_TOKENS
        if prefill:
            self.forward_mode = "EXTEND"
            for r in prefill:
                if budget == 0:
                    break
                e = min(len(r.prompt) - r.computed, budget)
                work.append(WorkItem(r, e, r.computed))
                budget -= e
        else:
            self.forward_mode = "DECODE"
            work = [WorkItem(r, 1, r.computed) for r in self.running]
        return work

    def batch_arrays(self, work):
        ps = self.PAGE_SIZE
        for item in work:  # the host req_to_token rows (what the table rows say)
            r = item.req
            n = item.prefix + item.extend
            self.req_to_token[r.row, :n] = [r.table_pages[p // ps] * ps + p % ps for p in range(n)]
        ids, true, pos, slots = self.token_arrays(work)
        tpad, pad = self.NUM_TOKENS - len(ids), self.MAX_ROWS - len(work)
        spans = []
        for item in work:  # get_model_worker_batch: each row's slots, the span padded to the page size
            n = item.prefix + item.extend
            spans += list(self.req_to_token[item.req.row, :n]) + [0] * (-(-n // ps) * ps - n)
        rows = [item.req.row for item in work]
        out = dict(
            forward_mode=self.forward_mode,
            input_ids=np.array(ids + [0] * tpad, np.int32),
            positions=np.array(pos + [0] * tpad, np.int32),
            out_cache_loc=np.array(slots + [-1] * tpad, np.int32),
            req_pool_indices=np.array(rows + [-1] * pad, np.int32),
            seq_lens=np.array([i.prefix + i.extend for i in work] + [0] * pad, np.int32),
            cache_loc=np.array(spans + [0] * (self.CACHE_LOC - len(spans)), np.int32),
            expected_true=np.array(true + [0] * tpad, np.int32),
            model_slots=np.array(slots + [-1] * tpad, np.int32),
            model_tokens=np.array(ids + [0] * tpad, np.int32),
            model_positions=np.array(pos + [0] * tpad, np.int32),
            valid_lens=np.array([len(i.req.tokens) for i in work] + [0] * pad, np.int32),
        )
        out["extend_prefix_lens"] = np.array([i.prefix for i in work] + [0] * pad, np.int32)
        out["extend_seq_lens"] = np.array([i.extend for i in work] + [0] * pad, np.int32)
        return out

    def canary_batch(self, a):
        from canary_jax.adapters.batches import from_sglang_jax
        from canary_jax.runtime.endpoints import ExpectedInputs

        extend = a["forward_mode"] == "EXTEND"
        return from_sglang_jax(
            forward_mode=a["forward_mode"],
            input_ids=a["input_ids"],
            positions=a["positions"],
            out_cache_loc=a["out_cache_loc"],
            req_pool_indices=a["req_pool_indices"],
            seq_lens=a["seq_lens"],
            cache_loc=a["cache_loc"],
            extend_prefix_lens=a["extend_prefix_lens"] if extend else None,
            extend_seq_lens=a["extend_seq_lens"] if extend else None,
            cache_loc_page_size=self.PAGE_SIZE,
            expected_inputs=ExpectedInputs(tokens=a["expected_true"], positions=a["positions"]),
            expected_tokens=self.expected_tokens(8, lambda r: r.row),
            expected_tokens_valid_lens=a["valid_lens"],
        )

    def remap(self, req: Request, page_index: int, page: int) -> None:
        req.table_pages[page_index] = page


class BlockTableEngine(ToyEngine):
    """A vLLM-style persistent batch: one block-table row per batch row, every live row scheduled each step
    (decodes first, then prefill chunks), rows condensed when a request finishes (the last row moves into the
    hole) and two rows swapped every few steps; no slot_mapping (tpu-inference writes KV at the positions the
    block table gives)."""

    PAGE_SIZE = 4
    NUM_PAGES = 40
    MAX_BLOCKS = 10
    SWAP_EVERY = 3

    def __init__(self, **kw):
        super().__init__(**kw)
        self.rows: list[Request] = []

    def pool_shape(self):
        return (self.NUM_PAGES, self.PAGE_SIZE * KV_BYTES)

    def source_page_size(self):
        return self.PAGE_SIZE

    def add_row(self, req):
        if len(self.rows) >= self.MAX_ROWS:
            return False
        req.row = len(self.rows)
        self.rows.append(req)
        return True

    def remove_row(self, req):
        hole = self.rows.index(req)
        last = self.rows.pop()
        if last is not req:  # condense: the last row moves into the hole
            self.rows[hole] = last
            last.row = hole
            self.stats["row_moves"] += 1

    def schedule(self):
        if self.step_no % self.SWAP_EVERY == 1 and len(self.rows) >= 2:
            i, j = self.rng.sample(range(len(self.rows)), 2)
            self.rows[i], self.rows[j] = self.rows[j], self.rows[i]
            self.rows[i].row, self.rows[j].row = i, j
            self.stats["row_moves"] += 2
        budget = self.NUM_TOKENS
        decode = {id(r) for r in self.rows if r.computed >= len(r.prompt)}
        budget -= len(decode)
        extends = {}
        prefills = [r for r in self.rows if id(r) not in decode]
        for k, r in enumerate(prefills):
            e = min(len(r.prompt) - r.computed, budget - (len(prefills) - k - 1))
            extends[id(r)] = e
            budget -= e
        return [WorkItem(r, 1 if id(r) in decode else extends[id(r)], r.computed) for r in self.rows]

    def batch_arrays(self, work):
        ids, true, pos, slots = self.token_arrays(work)
        tpad = self.NUM_TOKENS - len(ids)
        bt = np.zeros((self.MAX_ROWS, self.MAX_BLOCKS), np.int32)
        seq = np.zeros(self.MAX_ROWS, np.int32)
        valid = np.zeros(self.MAX_ROWS, np.int32)
        qsl = [0]
        for item in work:
            r = item.req
            bt[r.row, : len(r.table_pages)] = r.table_pages
            seq[r.row] = item.prefix + item.extend
            valid[r.row] = len(r.tokens)
            qsl.append(qsl[-1] + item.extend)
        qsl += [1] * (self.MAX_ROWS + 1 - len(qsl))  # tpu-inference pads query_start_loc with 1
        ps = self.PAGE_SIZE
        model_slots = []
        for item in work:  # where the attention kernel writes: the block table at the token's position
            r = item.req
            for i in range(item.extend):
                p = item.prefix + i
                model_slots.append(r.table_pages[p // ps] * ps + p % ps)
        return dict(
            input_ids=np.array(ids + [0] * tpad, np.int32),
            positions=np.array(pos + [0] * tpad, np.int32),
            query_start_loc=np.array(qsl, np.int32),
            seq_lens=seq,
            block_table=bt,
            num_reqs=np.array([len(work)], np.int32),
            expected_true=np.array(true + [0] * tpad, np.int32),
            valid_lens=valid,
            model_slots=np.array(model_slots + [-1] * tpad, np.int32),
            model_tokens=np.array(ids + [0] * tpad, np.int32),
            model_positions=np.array(pos + [0] * tpad, np.int32),
        )

    def canary_batch(self, a):
        from canary_jax.adapters.batches import from_block_tables
        from canary_jax.runtime.endpoints import ExpectedInputs

        _, jnp = _jax()
        extra = {"swa_block_table": a["swa_block_table"]} if "swa_block_table" in a else {}
        return from_block_tables(
            input_ids=a["input_ids"],
            positions=a["positions"],
            query_start_loc=a["query_start_loc"],
            seq_lens=a["seq_lens"],
            block_table=a["block_table"],
            block_size=self.PAGE_SIZE,
            num_reqs=jnp.asarray(a["num_reqs"]),
            expected_inputs=ExpectedInputs(tokens=a["expected_true"], positions=a["positions"]),
            expected_tokens=self.expected_tokens(self.MAX_ROWS, lambda r: r.row),
            expected_tokens_valid_lens=a["valid_lens"],
            **extra,
        )

    def remap(self, req: Request, page_index: int, page: int) -> None:
        req.table_pages[page_index] = page


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


class HybridBlockTableEngine(BlockTableEngine):
    """vLLM's hybrid KV cache (``vllm/v1/core/kv_cache_coordinator.py`` ``HybridKVCacheCoordinator``): a
    full-attention group (block table, pool and prefix cache of :class:`BlockTableEngine`) and a sliding-window
    group with its own block table and its own, smaller pool (:class:`SwaBlockPool`).

    * Window: vLLM's ``sliding_window`` W counts the token itself (HF convention: a query at q attends to
      [q - W + 1, q]). SGLang's window is exclusive (``get_attention_sliding_window_size(config) =
      config.sliding_window - 1`` in its models), and the canary's SWA group covers ``[max(0, P - w), P)`` with
      w = that exclusive size (SGLang ``plan_ref.py``: ``window_start = max(0, prefix_len - swa_window_size)``).
      So the canary's ``swa_window_size`` is W - 1: exactly the KV the step's new tokens read.
    * Freeing: before each step (``SlidingWindowManager.remove_skipped_blocks`` from ``allocate_slots``) the
      blocks wholly before ``num_computed_tokens - W + 1`` (``get_num_skipped_tokens``) become the null block
      in the request's SWA row and go back to the pool, where the next allocation may hand them to another
      request in the same step. The canary never reads them: the window starts at the first kept position and
      the predecessor of the window's first entry reads the null block (slot 0: chain check skipped).
    * Prefix hits: the longest hit both groups have: the full pages, and the SWA blocks of the last W - 1
      matched tokens (earlier SWA blocks are null), computed with those full pages
      (``SlidingWindowManager.find_longest_cache_hit``).
    * Canary: a FULL group over the full pool and an SWA group (``PoolKind.SWA``, ``swa_window_size`` W - 1)
      over the SWA pool; the batch's SWA group reads the SWA block table (``from_block_tables(...,
      swa_block_table=...)``) and the SWA group's LUT is kept current for the step's tokens with
      ``update_swa_lut`` (SGLang's SWA write translates ``out_cache_loc`` through it: SPEC 8.2). TAIL and SWEEP
      hash each group's layer-0 K (SGLang ``pool_patch/adapters/swa.py``: ``full_kv_pool.k_buffer[0]`` and
      ``swa_kv_pool.k_buffer[0]``).
    """

    SLIDING_WINDOW = 8  # vLLM / HF sliding_window (inclusive of the token itself)
    SWA_WINDOW = SLIDING_WINDOW - 1  # the canary's swa_window_size (SGLang's exclusive window)
    SWA_PAGES = 28  # the SWA pool (block 0 is null): smaller than the full pool's 40 pages

    def __init__(self, **kw):
        from canary_jax.runtime.groups import CanaryBufferGroup, PoolKind
        from canary_jax.runtime.state import CanaryState

        super().__init__(**kw)
        _, jnp = _jax()
        self.swa = SwaBlockPool(self.SWA_PAGES)
        self.num_swa_slots = self.SWA_PAGES * self.PAGE_SIZE
        full = CanaryBufferGroup.allocate(kind=PoolKind.FULL, num_slots=self.num_slots, has_v_half=False)
        swa = CanaryBufferGroup.allocate(
            kind=PoolKind.SWA,
            num_slots=self.num_swa_slots,
            has_v_half=False,
            swa_index_lut=np.zeros(self.num_slots + 1, np.int64),
            swa_window_size=self.SWA_WINDOW,
        )
        self.state = CanaryState.create([full, swa], ring_capacity=64)
        self.swa_pool = jnp.zeros((self.SWA_PAGES, self.PAGE_SIZE * KV_BYTES), jnp.uint8)
        self.watch_block = 0  # an SWA block whose in-window verifications are counted (0: none)
        self.window_freed: dict[int, int] = {}  # SWA blocks freed out of the window, not reused since -> first position

    # -- prefix cache across both groups ------------------------------------------------------------------
    def _swa_needed(self, num_tokens: int) -> int:
        """The first block a request with ``num_tokens`` computed tokens keeps in the SWA group."""
        return max(0, num_tokens - self.SLIDING_WINDOW + 1) // self.PAGE_SIZE

    def match_prefix(self, req: Request) -> list[int]:
        matched = self.pages.match(req.prompt[: len(req.prompt) - 1])
        ps = self.PAGE_SIZE
        for k in range(len(matched), 0, -1):  # the longest k whose SWA window blocks are cached too

            def cached(j: int) -> bool:
                entry = self.swa.cache.get(tuple(req.prompt[: (j + 1) * ps]))
                return entry is not None and entry[0] == matched[j]

            if all(cached(j) for j in range(self._swa_needed(k * ps), k)):
                self.stats["swa_shortened_hits"] += k < len(matched)
                return matched[:k]
        self.stats["swa_shortened_hits"] += bool(matched)
        return []

    def admitted(self, req: Request) -> None:
        ps = self.PAGE_SIZE
        k = len(req.pages)
        first = self._swa_needed(k * ps)
        req.swa_pages = [0] * first
        for j in range(first, k):
            _, block = self.swa.cache[tuple(req.prompt[: (j + 1) * ps])]
            self.swa.touch(block)
            self.window_freed.pop(block, None)
            req.swa_pages.append(block)
            self.stats["swa_shared_blocks"] += 1
        req.swa_table = list(req.swa_pages)

    def prompt_cached(self, req: Request) -> None:
        ps = self.PAGE_SIZE
        for j in range(len(req.prompt) // ps):
            key = tuple(req.prompt[: (j + 1) * ps])
            if req.swa_pages[j] and self.pages.cache.get(key) == req.pages[j]:
                self.swa.insert(key, req.pages[j], req.swa_pages[j])

    def released(self, req: Request) -> None:
        for block in req.swa_pages:
            if block:
                self.swa.decref(block)

    def _allocate(self, work: list[WorkItem]) -> None:
        super()._allocate(work)
        ps = self.PAGE_SIZE
        for item in work:  # vLLM's allocate_slots: remove_skipped_blocks, then new blocks
            r = item.req
            for j in range(min(self._swa_needed(item.prefix), len(r.swa_pages))):
                if r.swa_pages[j]:
                    self.swa.decref(r.swa_pages[j])
                    if not self.swa.ref[r.swa_pages[j]]:
                        self.window_freed[r.swa_pages[j]] = j * ps
                    r.swa_pages[j] = r.swa_table[j] = 0
                    self.stats["swa_freed"] += 1
            while len(r.swa_pages) * ps < item.prefix + item.extend:
                block = self.swa.alloc()
                self.window_freed.pop(block, None)
                r.swa_pages.append(block)
                r.swa_table.append(block)
            if item.extend == 1 and item.prefix > self.SWA_WINDOW:
                self.stats["decode_past_window"] += 1

    # -- batch, KV, canary ----------------------------------------------------------------------------------
    def batch_arrays(self, work):
        out = super().batch_arrays(work)
        ps = self.PAGE_SIZE
        bt = np.zeros((self.MAX_ROWS, self.MAX_BLOCKS), np.int32)
        slots = []
        for item in work:
            r = item.req
            bt[r.row, : len(r.swa_table)] = r.swa_table
            for i in range(item.extend):  # where the SWA layers write: the SWA block table at the position
                p = item.prefix + i
                slots.append(r.swa_table[p // ps] * ps + p % ps)
        out["swa_block_table"] = bt
        out["model_swa_slots"] = np.array(slots + [-1] * (self.NUM_TOKENS - len(slots)), np.int32)
        return out

    def prepare_step(self, work, arrays):
        from canary_jax.adapters.batches import update_swa_lut

        full, swa = self.state.groups
        lut = update_swa_lut(swa.swa_index_lut, arrays["model_slots"], arrays["model_swa_slots"])
        self.state = self.state.replace(groups=(full, swa.replace(swa_index_lut=lut)))
        if self.watch_block:
            ps = self.PAGE_SIZE
            for item in work:
                for p in range(max(0, item.prefix - self.SWA_WINDOW), item.prefix):
                    self.stats["watched_verified"] += item.req.swa_table[p // ps] == self.watch_block

    def write_kv(self, arrays):
        super().write_kv(arrays)
        _, jnp = _jax()
        self.swa_pool = _write_kv_fn(self.PAGE_SIZE)(
            self.swa_pool,
            jnp.asarray(arrays["model_swa_slots"]),
            jnp.asarray(arrays["model_tokens"]),
            jnp.asarray(arrays["model_positions"]),
        )

    def sources(self):
        from canary_jax.sources import RealKvSource

        ps = self.PAGE_SIZE
        mk = lambda pool: RealKvSource(tensor=pool, page_size=ps, num_bytes_per_token=KV_BYTES, read_bytes=KV_BYTES)  # noqa: E731
        return (((mk(self.pool),), ()), ((mk(self.swa_pool),), ()))

    def sweep_plans(self, batch):
        from canary_jax.adapters.batches import sweep_plan_after_step

        cap = self.SWEEP_CAPACITY
        return (
            sweep_plan_after_step(batch, verify_capacity=cap),
            sweep_plan_after_step(batch, verify_capacity=cap, swa_window_size=self.SWA_WINDOW),
        )

    def remap_swa(self, req: Request, block_index: int, block: int) -> None:
        req.swa_table[block_index] = block

    def sglang_view(self, work: list[WorkItem], arrays: dict) -> dict:
        """The step in SGLang's convention: dense ``req_to_token`` (row = batch row + 1) of full-pool slots and
        the full-to-SWA LUT (0 = evicted), as SGLang's SWA pool keeps them (SPEC 7, 8.1), plus
        ``prev_conflicts``: the SWA verify entries (batch row, position) whose predecessor this request's SWA
        row has freed (null: vLLM frees per request) while another request still holds that shared full slot's
        SWA block, so the global LUT names it (one LUT cannot say both; SGLang reads the live slot there).

        Raises:
          AssertionError: two live SWA slots for one full slot, or a null SWA block inside a request's canary
            window or at its write seed (the engine's invariants).
        """
        ps, rows = self.PAGE_SIZE, self.MAX_ROWS
        r2t = np.zeros((rows + 1, self.MAX_LEN), np.int32)
        lut = np.zeros(self.num_slots + 1, np.int64)
        for i, item in enumerate(work):
            r = item.req
            for p in range(item.prefix + item.extend):
                f = r.table_pages[p // ps] * ps + p % ps
                r2t[i + 1, p] = f
                if r.swa_table[p // ps]:
                    s = r.swa_table[p // ps] * ps + p % ps
                    assert lut[f] in (0, s), f"full slot {f} has SWA slots {lut[f]} and {s}"
                    lut[f] = s
        conflicts = []
        for i, item in enumerate(work):
            r = item.req
            for p in range(max(0, item.prefix - self.SWA_WINDOW), item.prefix):
                assert r.swa_table[p // ps], f"null SWA block inside the window (row {i}, position {p})"
                q = p - 1
                if q >= 0 and not r.swa_table[q // ps] and lut[r2t[i + 1, q]]:
                    conflicts.append((i, p))
        pad = rows - len(work)
        return dict(
            req_pool_indices=np.array([i + 1 for i in range(len(work))] + [0] * pad, np.int64),
            prefix_lens=np.array([w.prefix for w in work] + [0] * pad, np.int64),
            extend_seq_lens=np.array([w.extend for w in work] + [0] * pad, np.int64),
            req_to_token=r2t,
            full_to_swa_index_mapping=lut,
            expected_tokens=self.expected_tokens(rows + 1, lambda r: r.row + 1),
            prev_conflicts=conflicts,
        )


# --- fault injection (one per episode; after scheduling, before HEAD) ------------------------------------
def _with_prefix(work: list[WorkItem], minimum: int) -> list[WorkItem]:
    return [w for w in work if w.prefix >= minimum]


def inject_kv_flip(engine: ToyEngine, work: list[WorkItem]) -> dict | None:
    """Flips one bit of the layer-0 K bytes of a slot in a batch request's verified prefix (TAIL real_kv)."""
    cands = _with_prefix(work, 1)
    if not cands:
        return None
    item = engine.rng.choice(cands)
    p = engine.rng.randrange(item.prefix)
    ps = engine.PAGE_SIZE
    slot = item.req.pages[p // ps] * ps + p % ps
    byte, bit = engine.rng.randrange(KV_BYTES), engine.rng.randrange(8)
    page = engine.source_page_size()
    pool = np.array(engine.pool)
    pool[slot // page, (slot % page) * KV_BYTES + byte] ^= np.uint8(1 << bit)
    _, jnp = _jax()
    engine.pool = jnp.asarray(pool)
    return dict(kind="kv_flip", slot=slot)


def inject_table_remap(engine: ToyEngine, work: list[WorkItem]) -> dict | None:
    """Points one full page of a batch request's verified prefix (its req_to_token / block-table entries) at
    another live, fully written page holding other positions (HEAD verify: position, chain)."""
    ps = engine.PAGE_SIZE
    cands = _with_prefix(work, ps)
    if not cands:
        return None
    item = engine.rng.choice(cands)
    j = engine.rng.randrange(item.prefix // ps)
    own = item.req.pages[j]
    targets = [r.pages[k] for r in engine.running for k in range(r.computed // ps) if k != j and r.pages[k] != own]
    if not targets:
        return None
    page = engine.rng.choice(targets)
    engine.remap(item.req, j, page)
    return dict(kind="table_remap", page_index=j, page=page)


def inject_token_swap(engine: ToyEngine, work: list[WorkItem]) -> dict | None:
    """Feeds one token of the step with a wrong id (model and canary see it; the token oracle does not)."""
    if not work:
        return None
    item = engine.rng.choice(work)
    item.swap = engine.rng.randrange(item.extend)
    return dict(kind="token_swap")


FAULTS: dict[str, Any] = {
    "kv_flip": inject_kv_flip,
    "table_remap": inject_table_remap,
    "token_swap": inject_token_swap,
}


def inject_swa_kv_flip(engine: HybridBlockTableEngine, work: list[WorkItem]) -> dict | None:
    """Flips one bit of the SWA pool's layer-0 K bytes at a slot inside a batch request's canary window (SWA
    TAIL real_kv)."""
    cands = _with_prefix(work, 1)
    if not cands:
        return None
    item = engine.rng.choice(cands)
    ps = engine.PAGE_SIZE
    p = engine.rng.randrange(max(0, item.prefix - engine.SWA_WINDOW), item.prefix)
    slot = item.req.swa_pages[p // ps] * ps + p % ps
    byte, bit = engine.rng.randrange(KV_BYTES), engine.rng.randrange(8)
    pool = np.array(engine.swa_pool)
    pool[slot // ps, (slot % ps) * KV_BYTES + byte] ^= np.uint8(1 << bit)
    _, jnp = _jax()
    engine.swa_pool = jnp.asarray(pool)
    return dict(kind="swa_kv_flip", slot=slot, position=p)


def inject_swa_table_remap(engine: HybridBlockTableEngine, work: list[WorkItem]) -> dict | None:
    """Points one SWA block-table entry of a batch request (a fully written block with positions in its canary
    window) at another live, fully written SWA block holding other positions (SWA HEAD verify: position)."""
    ps = engine.PAGE_SIZE
    cands = []
    for item in work:
        r = item.req
        for j in range(item.prefix // ps):
            if r.swa_table[j] and (j + 1) * ps - 1 >= item.prefix - engine.SWA_WINDOW:
                cands.append((item, j))
    if not cands:
        return None
    item, j = engine.rng.choice(cands)
    own = item.req.swa_pages[j]
    targets = [
        r.swa_pages[k]
        for r in engine.running
        for k in range(min(r.computed // ps, len(r.swa_pages)))
        if k != j and r.swa_pages[k] and r.swa_pages[k] != own
    ]
    if not targets:
        return None
    block = engine.rng.choice(targets)
    engine.remap_swa(item.req, j, block)
    return dict(kind="swa_table_remap", block_index=j, block=block)


def flip_freed_swa_block(engine: HybridBlockTableEngine) -> tuple[int, int]:
    """Flips one byte of every slot of an SWA block that left every window (freed, ref 0, fully written) and is
    not in the prefix cache (no request can read it again before it is reallocated); returns ``(block, its first
    position)``, or ``(0, 0)`` if there is none now. The engine then counts the block's in-window reads."""
    cands = [b for b in engine.swa.free if b in engine.window_freed and b not in engine.swa.key_of]
    if not cands:
        return 0, 0
    block = cands[0]  # the next one the pool hands out
    pool = np.array(engine.swa_pool)
    for i in range(engine.PAGE_SIZE):
        pool[block, i * KV_BYTES + engine.rng.randrange(KV_BYTES)] ^= np.uint8(1 << engine.rng.randrange(8))
    _, jnp = _jax()
    engine.swa_pool = jnp.asarray(pool)
    engine.watch_block = block
    return block, engine.window_freed[block]


HYBRID_FAULTS: dict[str, Any] = {
    "swa_kv_flip": inject_swa_kv_flip,
    "swa_table_remap": inject_swa_table_remap,
    "kv_flip": inject_kv_flip,
    "token_swap": inject_token_swap,
}
