"""The serving batch and the canary around it: the shapes all scenarios share, one scenario's device inputs and
population data, the canary config / state / batch / real-KV source of a step, and the population that stamps
the pool's prefixes before the timed calls."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

import canary_jax as cj
from benchmarks.serving_step.shapes import HASH, ModelShape, Scenario, bucket
from canary_jax.contract.constants import RealKvHashMode
from canary_jax.ops import buckets as buckets_lib
from canary_jax.runtime.groups import CanaryBufferGroup, PoolKind
from canary_jax.runtime.state import CanaryBatch, CanaryState, CanaryStepConfig
from canary_jax.runtime.step import canary_head, canary_plan, canary_tail


@dataclasses.dataclass(frozen=True)
class Shared:
    """Shapes every scenario shares: the pool's pages (the largest scenario's requests plus page 0), the
    ``req_to_token`` table and the population's padded launch, so that the population programs compile once
    per mode for all scenarios."""

    num_pages: int
    r2t_rows: int
    r2t_cols: int
    pop_tokens: int
    pop_rows: int


def shared_shapes(scn_all: dict[str, Scenario], page_size: int) -> Shared:
    return Shared(
        num_pages=1 + max(s.cached_reqs * (s.row_len // page_size) for s in scn_all.values()),
        r2t_rows=1 + max(s.cached_reqs for s in scn_all.values()),
        r2t_cols=max(s.row_len for s in scn_all.values()),
        pop_tokens=bucket(max(s.verify_entries + (s.cached_reqs - s.batch) * s.cached_len for s in scn_all.values())),
        pop_rows=max(s.cached_reqs for s in scn_all.values()),
    )


def make_batch(scn: Scenario, m: ModelShape, sh: Shared, page_size: int, seed: int) -> tuple[dict, dict]:
    """Device inputs of the step (``b``) and the host data of the population (``pop``)."""
    rng = np.random.default_rng(seed + sum(map(ord, scn.name)))
    ppr = scn.row_len // page_size
    perm = rng.permutation(np.arange(1, sh.num_pages))[: scn.cached_reqs * ppr].reshape(scn.cached_reqs, ppr)
    r2t = np.zeros((sh.r2t_rows, sh.r2t_cols), np.int32)
    for r in range(scn.cached_reqs):
        r2t[r + 1, : scn.row_len] = (perm[r][:, None] * page_size + np.arange(page_size)[None, :]).reshape(-1)
    rows = np.arange(1, scn.batch + 1)
    b = dict(
        rpi=rows.astype(np.int32),
        prefix=np.full(scn.batch, scn.prefix, np.int32),
        extend=np.full(scn.batch, scn.new, np.int32),
        positions=np.tile(np.arange(scn.prefix, scn.context, dtype=np.int32), scn.batch),
        loc=r2t[rows][:, scn.prefix : scn.context].reshape(-1).astype(np.int32),
        r2t=r2t,
        sweep_rpi=np.arange(1, scn.cached_reqs + 1, dtype=np.int32),
        sweep_lens=np.array([scn.context] * scn.batch + [scn.cached_len] * (scn.cached_reqs - scn.batch), np.int32),
    )
    if scn.kind == "decode":
        b["bt"] = perm[: scn.batch, : scn.context // page_size].astype(np.int32)
        b["lengths"] = np.full(scn.batch, scn.context, np.int32)
        b["sample"] = np.arange(scn.batch, dtype=np.int32)
        b["ids"] = np.zeros(scn.tokens, np.int32)  # decode feeds back its sampled tokens
    else:
        b["pslots"] = r2t[1, : scn.prefix].astype(np.int32)
        b["sample"] = np.array([scn.tokens - 1], np.int32)
        b["ids"] = rng.integers(0, m.vocab, scn.tokens).astype(np.int32)
    lens = [scn.prefix] * scn.batch + [scn.cached_len] * (scn.cached_reqs - scn.batch)
    pop = dict(
        rpi=np.arange(1, scn.cached_reqs + 1),
        lens=np.array(lens),
        ids=rng.integers(0, m.vocab, int(sum(lens))),
        positions=np.concatenate([np.arange(n) for n in lens]),
        loc=np.concatenate([r2t[r + 1, :n] for r, n in enumerate(lens)]),
        r2t=r2t,
        toks=rng.integers(0, m.vocab, scn.batch if scn.kind == "decode" else 1).astype(np.int32),
    )
    return {k: jnp.asarray(v) for k, v in b.items()}, pop


def canary_config(scn: Scenario, mode: str, backend: str | None) -> CanaryStepConfig:
    return CanaryStepConfig(
        verify_capacity=bucket(scn.verify_entries),
        write_req_capacity=scn.batch,
        real_kv_hash_mode=HASH[mode],
        backend=backend,
    )


def new_state(num_slots: int) -> CanaryState:
    group = CanaryBufferGroup.allocate(kind=PoolKind.FULL, num_slots=num_slots, has_v_half=False)
    return CanaryState.create([group], ring_capacity=1024)


def sources_of(kv, m: ModelShape, page_size: int, read_bytes: int):
    """Layer 0's K array, as it is (2-D, one page per row): the group's K-half source."""
    src = cj.RealKvSource(tensor=kv[0][0], page_size=page_size, num_bytes_per_token=2 * m.kv_dim, read_bytes=read_bytes)
    return (((src,), ()),)


def canary_batch(b: dict, ids) -> CanaryBatch:
    return CanaryBatch(
        req_pool_indices=b["rpi"],
        prefix_lens=b["prefix"],
        extend_seq_lens=b["extend"],
        input_ids=ids,
        positions=b["positions"],
        out_cache_loc=b["loc"],
        req_to_token=b["r2t"],
    )


def step_ids(scn: Scenario, m: ModelShape, b: dict, toks):
    return toks if scn.kind == "decode" else (b["ids"] + toks[0]) % m.vocab


def populate(state: CanaryState, mode: str, pop: dict, kv, m, page_size, read_bytes, sh: Shared) -> CanaryState:
    """Stamps the pool's prefixes (HEAD and TAIL, with the real KV now in the pool) with the reference backend
    (byte-identical to the kernels; XLA only, so no Triton compiles)."""
    cfg = CanaryStepConfig(
        verify_capacity=16,
        write_req_capacity=sh.pop_rows,
        real_kv_hash_mode=HASH[mode],
        backend="reference",
        buckets=buckets_lib.Buckets(sizes=(sh.pop_tokens,)),
    )
    # Plans and HEAD do not depend on the hash mode: one NONE config for them compiles them once per scenario.
    cfg_head = dataclasses.replace(cfg, real_kv_hash_mode=RealKvHashMode.NONE)
    n = len(pop["lens"])
    batch = CanaryBatch(
        req_pool_indices=pop["rpi"],
        prefix_lens=np.zeros(n, np.int64),
        extend_seq_lens=pop["lens"],
        input_ids=pop["ids"],
        positions=pop["positions"],
        out_cache_loc=pop["loc"],
        req_to_token=pop["r2t"],
    )
    plans = canary_plan(state, batch, config=cfg_head)
    state, plans = canary_head(state, batch, config=cfg_head, plans=plans)
    state, _ = canary_tail(state, plans, batch, config=cfg, real_kv_sources=sources_of(kv, m, page_size, read_bytes))
    return state
