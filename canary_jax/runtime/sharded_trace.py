"""The traced pieces of the sharded canary's programs (:mod:`canary_jax.runtime.sharded`): ``shard_map``, a
shard's block of a ``[dp, tp, ...]`` / ``[dp, ...]`` pytree and back, the PartitionSpec trees of the programs,
and the fields digest the head-shard consistency check compares.

Everything here runs inside ``shard_map`` (or abstractly, for shapes); nothing touches the host.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from canary_jax.contract import constants, layout
from canary_jax.runtime import phases
from canary_jax.runtime.state import CanaryBatch, CanaryPlans, CanaryState, CanaryStepConfig, StepSummary

try:  # jax >= 0.6: the public name
    _shard_map_fn = jax.shard_map
    _SHARD_MAP_CHECK = "check_vma"
except AttributeError:  # pragma: no cover - older jax
    from jax.experimental.shard_map import shard_map as _shard_map_fn

    _SHARD_MAP_CHECK = "check_rep"

__all__ = ["fields_digest", "global2", "local1", "local2", "plans_shape", "shard_map", "spec_tree", "summary_specs"]


def shard_map(f: Callable, *, mesh: Mesh, in_specs: Any, out_specs: Any) -> Callable:
    """``jax.shard_map`` (or ``jax.experimental.shard_map.shard_map`` on older jax) with replication checks off
    (the canary's kernels are per-shard programs; nothing is replicated by a collective)."""
    return _shard_map_fn(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, **{_SHARD_MAP_CHECK: False})


def local2(tree: Any) -> Any:
    """A shard's block of a ``[dp, tp, ...]`` pytree inside ``shard_map`` (leaves ``[1, 1, ...]``) without its two
    shard axes."""
    return jax.tree_util.tree_map(lambda x: x[0, 0], tree)


def local1(tree: Any) -> Any:
    """A shard's block of a ``[dp, ...]`` pytree inside ``shard_map`` (leaves ``[1, ...]``) without its dp axis."""
    return jax.tree_util.tree_map(lambda x: x[0], tree)


def global2(tree: Any) -> Any:
    """A shard's result with the two shard axes put back (leaves ``[1, 1, ...]``), as ``shard_map`` returns it."""
    return jax.tree_util.tree_map(lambda x: x[None, None], tree)


def spec_tree(tree: Any, spec: P) -> Any:
    """``spec`` for every leaf of ``tree`` (a ``shard_map`` in_specs / out_specs entry)."""
    return jax.tree_util.tree_map(lambda _: spec, tree)


_DIGEST_SEEDS = (0x9E3779B9, 0x85EBCA6B)


def _mix32(x: jax.Array) -> jax.Array:
    """murmur3's 32-bit finaliser (uint32 in, uint32 out)."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x85EBCA6B)
    x = x ^ (x >> 13)
    x = x * jnp.uint32(0xC2B2AE35)
    return x ^ (x >> 16)


def fields_digest(state: CanaryState) -> jax.Array:
    """``uint32[2]``: a digest of every canary buffer's token, position and prev_hash fields (not real_kv_hash)
    of one shard's (unsharded) state: ``sum_i mix32(word_i ^ mix32(i + seed))`` for two seeds, wrapping.

    Equal on every head shard of one dp row when their bookkeeping agrees (SPEC 2.3: the chain leaves out the
    real-KV hash). Reads the shard's own canary buffers only (traced; no collective).
    """
    out = []
    for seed in _DIGEST_SEEDS:
        acc = jnp.zeros((), jnp.uint32)
        salt = 0
        for g in state.groups:
            for name in phases._BUFFERS:
                buf = getattr(g, name)
                if buf is None:
                    continue
                w = layout.canary_words(buf)[:, : 2 * constants.CANARY_FIELD_REAL_KV_HASH]
                idx = jnp.arange(w.size, dtype=jnp.uint32).reshape(w.shape) + jnp.uint32((seed + salt) & 0xFFFFFFFF)
                acc = acc + jnp.sum(_mix32(w ^ _mix32(idx)), dtype=jnp.uint32)
                salt += 0x1000193
        out.append(acc)
    return jnp.stack(out)


def plans_shape(shell: CanaryState, batch: CanaryBatch, config: CanaryStepConfig) -> CanaryPlans:
    """The local plans' shapes (abstract evaluation only), with the two leading shard axes."""
    return global2(phases.plan_impl(local2(shell), local1(batch), config))


def summary_specs(spec: P) -> StepSummary:
    """``spec`` for every field of a StepSummary (its out_specs)."""
    return StepSummary(verify_enable=spec, verify_num_valid=spec, violations_total=spec, new_violations=spec)
