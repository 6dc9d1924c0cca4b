"""Fault injection, one per episode, after scheduling and before HEAD: a KV bit flip, a table remap, a token
swap (:data:`FAULTS`), and for the hybrid engine their SWA counterparts and a flipped freed SWA block
(:data:`HYBRID_FAULTS`)."""

from __future__ import annotations

from typing import Any

import numpy as np

from helpers.engines.hybrid import HybridBlockTableEngine
from helpers.engines.toy import KV_BYTES, ToyEngine, WorkItem, _jax


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
