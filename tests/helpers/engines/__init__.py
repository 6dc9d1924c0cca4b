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

The package, by job: ``logical`` (Part 1), ``pools`` (the page and SWA block allocators), ``toy`` (the shared
engine and its step loop), ``sglang_jax``, ``block_table``, ``hybrid`` (the three engines), ``faults`` (the
injections). Every name the single-file module had is importable from ``helpers.engines`` as before.
"""

from __future__ import annotations

from helpers.engines.block_table import BlockTableEngine
from helpers.engines.faults import (
    FAULTS,
    HYBRID_FAULTS,
    flip_freed_swa_block,
    inject_kv_flip,
    inject_swa_kv_flip,
    inject_swa_table_remap,
    inject_table_remap,
    inject_token_swap,
)
from helpers.engines.hybrid import HybridBlockTableEngine
from helpers.engines.logical import (
    LogicalBatch,
    LogicalRequest,
    random_logical_batch,
    to_block_tables,
    to_sglang,
    to_sglang_jax,
)
from helpers.engines.pools import Pages, SwaBlockPool
from helpers.engines.sglang_jax import SglangJaxEngine
from helpers.engines.toy import KV_BYTES, VOCAB, Request, ToyEngine, WorkItem

__all__ = [
    "BlockTableEngine",
    "FAULTS",
    "HYBRID_FAULTS",
    "HybridBlockTableEngine",
    "KV_BYTES",
    "LogicalBatch",
    "LogicalRequest",
    "Pages",
    "Request",
    "SglangJaxEngine",
    "SwaBlockPool",
    "ToyEngine",
    "VOCAB",
    "WorkItem",
    "flip_freed_swa_block",
    "inject_kv_flip",
    "inject_swa_kv_flip",
    "inject_swa_table_remap",
    "inject_table_remap",
    "inject_token_swap",
    "random_logical_batch",
    "to_block_tables",
    "to_sglang",
    "to_sglang_jax",
]
