"""The sharded child's world (:mod:`tests.helpers.sharded_child`): the mesh's sizes and step configuration, each
dp shard's requests (:class:`Workload`), the model's KV write and sources on one head shard, a fresh canary
state, the KV fault and the collectives of compiled HLO text.

Imports JAX: only the child imports it, after it has forced the CPU devices (``XLA_FLAGS``) and, in ``multi``,
started ``jax.distributed``.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import canary_jax as cj
from canary_jax.runtime.groups import CanaryBufferGroup, PoolKind
from canary_jax.runtime.state import CanaryBatch, CanaryState, CanaryStepConfig
from canary_jax.runtime.sweep import build_sweep_plan_from_requests

DP, TP = 2, 2
SLOTS, HEADS, DIM = 48, 4, 8  # bf16: 16 bytes per head, 32 bytes per head shard's slot row
HL = HEADS // TP
ROW_BYTES = HL * DIM * 2
MAX_REQS, MAX_LEN = 4, 16
CONFIG = CanaryStepConfig(
    verify_capacity=64, write_req_capacity=4, real_kv_hash_mode=cj.RealKvHashMode.ALL, backend="reference"
)
SWEEP_CAPACITY = 64
KV_SPECS = P("dp", None, "tp", None)  # pool [dp, slots, heads, dim]: requests over dp, heads over tp
PROMPTS = {0: {1: [101, 7, 42, 9, 13], 2: [5, 6, 7]}, 1: {1: [11, 12, 13, 14], 2: [900, 901, 902, 903, 904, 905]}}
DECODES = 3


def slot_of(row: int, pos: int) -> int:
    """Each dp shard's own slot space: request row r's position p lives in slot 1 + (r - 1) * 16 + p."""
    return 1 + (row - 1) * MAX_LEN + pos


def write_rows(kv3, b, head0):
    """The model's KV write on one head shard: ``kv3`` ``bf16[slots, HL, DIM]``, heads ``head0 ..``."""
    ids = b.input_ids[:, 0].astype(jnp.int32)
    pos = b.positions[:, 0].astype(jnp.int32)
    loc = b.out_cache_loc[:, 0].astype(jnp.int32)
    heads = head0 + jnp.arange(kv3.shape[1], dtype=jnp.int32)
    vals = (ids[:, None, None] * 3 + pos[:, None, None] * 5 + heads[None, :, None] * 7 + jnp.arange(DIM)) % 251
    return kv3.at[loc].set(vals.astype(jnp.bfloat16))


def source_of(kv3):
    src = cj.RealKvSource(
        tensor=kv3.reshape(kv3.shape[0], HL * DIM), page_size=1, num_bytes_per_token=ROW_BYTES, read_bytes=ROW_BYTES
    )
    return (((src,), ()),)


def sharded_sources(kv_local):
    return source_of(kv_local[0])


def sharded_write(kv_local, b):
    head0 = jax.lax.axis_index("tp") * HL
    kv3 = write_rows(kv_local[0], b, head0)
    return kv3[None], source_of(kv3)


def single_write(kv, b):
    pool, head0 = kv
    pool = write_rows(pool, b, head0[0])
    return (pool, head0), source_of(pool)


def single_sweep_sources(pool):
    return source_of(pool)


class Workload:
    """Each dp shard's requests, one step at a time (host-side bookkeeping)."""

    def __init__(self):
        self.tokens = {d: {r: list(p) for r, p in PROMPTS[d].items()} for d in range(DP)}
        self.written = {d: {r: 0 for r in PROMPTS[d]} for d in range(DP)}
        self.r2t = {d: np.zeros((MAX_REQS, MAX_LEN), np.int32) for d in range(DP)}

    def batch(self, d: int) -> CanaryBatch:
        rows, pre, ext, ids, pos, loc = [], [], [], [], [], []
        for r, toks in self.tokens[d].items():
            w = self.written[d][r]
            new = toks[w:]
            slots = [slot_of(r, p) for p in range(w, len(toks))]
            self.r2t[d][r, w : len(toks)] = slots
            rows.append(r), pre.append(w), ext.append(len(new))
            ids += new
            pos += list(range(w, len(toks)))
            loc += slots
        return CanaryBatch(
            req_pool_indices=np.array(rows, np.int64),
            prefix_lens=np.array(pre, np.int64),
            extend_seq_lens=np.array(ext, np.int64),
            input_ids=np.array(ids, np.int64),
            positions=np.array(pos, np.int64),
            out_cache_loc=np.array(loc, np.int64),
            req_to_token=self.r2t[d].copy(),
        )

    def advance(self, d: int) -> None:
        for r, toks in self.tokens[d].items():
            self.written[d][r] = len(toks)
            toks.append((toks[-1] * 31 + 7 + d) % 1000)

    def sweep_plan(self, d: int):
        rows = list(self.tokens[d])
        return build_sweep_plan_from_requests(
            req_to_token=self.r2t[d],
            req_pool_indices=np.array(rows, np.int64),
            seq_lens=np.array([self.written[d][r] for r in rows], np.int64),
            verify_capacity=SWEEP_CAPACITY,
        )


def fresh_state() -> CanaryState:
    group = CanaryBufferGroup.allocate(kind=PoolKind.FULL, num_slots=SLOTS, has_v_half=False)
    return CanaryState.create([group], ring_capacity=16)


COLLECTIVE = re.compile(r"=\s*(\S+)\s+(all-gather|all-reduce|collective-permute|all-to-all|reduce-scatter)[-\w]*\(")


def collectives(hlo: str) -> list[list]:
    """``[op, result_type]`` of every collective in compiled HLO text."""
    return [[m.group(2), m.group(1)] for m in COLLECTIVE.finditer(hlo)]


def flip_kv(pool, d, slot, head, sharding):
    """bf16 bit flip of pool[d, slot, head, 0] (the fault; host-side, between steps)."""
    host = np.asarray(jax.device_get(pool)).copy()
    u = host.view(np.uint16)
    u[d, slot, head, 0] ^= 0x0100
    return jax.device_put(host, sharding)
