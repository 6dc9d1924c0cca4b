"""vLLM's hybrid KV cache (:class:`HybridBlockTableEngine`): a full-attention group and a sliding-window group
with its own smaller pool, SWA blocks freed out of the window and reused, prefix hits across both groups, and
each step in SGLang's convention (``sglang_view``)."""

from __future__ import annotations

import numpy as np

from helpers.engines.block_table import BlockTableEngine
from helpers.engines.pools import SwaBlockPool
from helpers.engines.toy import KV_BYTES, Request, WorkItem, _jax, _write_kv_fn


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
        from canary_jax.contract.sources import RealKvSource

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
