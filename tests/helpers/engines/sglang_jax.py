"""The engine in sglang-jax's convention (:class:`SglangJaxEngine`): host ``req_to_token`` rows from 0, EXTEND /
DECODE batches, padding -1, ragged ``cache_loc``, read through ``from_sglang_jax``."""

from __future__ import annotations

import numpy as np

from helpers.engines.toy import KV_BYTES, ToyEngine, WorkItem


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
            **self.expected_kwargs(a, 8),
        )
