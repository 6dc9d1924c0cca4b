"""The toy serving engine's shared parts (:class:`ToyEngine`): workload, pages, the toy model's deterministic
layer-0 K write into a paged pool, the canary state and the step loop (plan + HEAD, KV write, TAIL, a periodic
sweep); subclasses lay a step out in one batch convention."""

from __future__ import annotations

import collections
import dataclasses
import functools
import random

import numpy as np

from helpers.engines.pools import Pages

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
        from canary_jax.contract import constants
        from canary_jax.ops.buckets import Buckets
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
        from canary_jax.contract.sources import RealKvSource

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
        from canary_jax.contract import ints

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

    def expected_kwargs(self, arrays: dict, rows: int) -> dict:
        """The adapters' expected-input keywords of a step: the true ids at the fed positions, the running requests'
        tokens (``rows`` table rows, a request at its batch row) and the batch rows' valid lengths."""
        from canary_jax.runtime.endpoints import ExpectedInputs

        return dict(
            expected_inputs=ExpectedInputs(tokens=arrays["expected_true"], positions=arrays["positions"]),
            expected_tokens=self.expected_tokens(rows, lambda r: r.row),
            expected_tokens_valid_lens=arrays["valid_lens"],
        )

    def remap(self, req: Request, page_index: int, page: int) -> None:
        """Points ``req``'s table entry ``page_index`` at ``page`` (its owned pages unchanged: a fault)."""
        req.table_pages[page_index] = page

    def expected_tokens(self, rows: int, row_of) -> np.ndarray:
        table = np.zeros((rows, self.MAX_LEN), np.int32)
        for r in self.running:
            table[row_of(r), : len(r.tokens)] = r.tokens
        return table
