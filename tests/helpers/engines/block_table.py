"""The engine as a vLLM-style persistent batch (:class:`BlockTableEngine`): one block-table row per batch row,
mixed prefill + decode steps, rows condensed and swapped between steps, read through ``from_block_tables``."""

from __future__ import annotations

import numpy as np

from helpers.engines.toy import KV_BYTES, Request, ToyEngine, WorkItem, _jax


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
            **self.expected_kwargs(a, self.MAX_ROWS),
            **extra,
        )
