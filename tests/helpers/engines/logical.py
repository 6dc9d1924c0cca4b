"""Logical batches (plan parity): :func:`random_logical_batch` draws one serving step on Python ints, and
:func:`to_sglang`, :func:`to_sglang_jax` and :func:`to_block_tables` write it in SGLang's, sglang-jax's and
vLLM-style conventions. No jax and no canary_jax here."""

from __future__ import annotations

import dataclasses
import random

import numpy as np


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
